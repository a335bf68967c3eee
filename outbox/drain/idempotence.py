"""When a librdkafka producer can be idempotent, and the default that follows from it.

Per-key order needs an idempotent producer: without it librdkafka retries a failed request
(a leader moved, a broker stopped) while later requests of the same partition are in flight, so
a later message can land first. Idempotence needs `acks=all`, at most 5 requests in flight per
connection and at least one retry; librdkafka refuses it otherwise. Every producer the library
runs is idempotent unless the caller's config says it cannot be, as the Java producer has done
since Kafka 3.0: an explicit `enable.idempotence` wins, and settings that rule it out turn the
default off instead of failing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["KEY", "conflicts", "is_set", "number", "with_default"]

KEY = "enable.idempotence"


def conflicts(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The settings of `config` that rule out idempotence: (`name=value`, what idempotence needs)."""
    bad: list[tuple[str, str]] = []
    for name in ("acks", "request.required.acks"):
        if name in config and str(config[name]) not in ("all", "-1"):
            bad.append((f"{name}={config[name]}", "acks=all"))
    for name in ("max.in.flight.requests.per.connection", "max.in.flight"):
        n = number(config.get(name))
        if n is not None and n > 5:
            bad.append((f"{name}={config[name]}", "at most 5"))
    for name in ("retries", "message.send.max.retries"):
        n = number(config.get(name))
        if n is not None and n < 1:
            bad.append((f"{name}={config[name]}", "at least 1"))
    return bad


def with_default(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` with `enable.idempotence` on, unless it names the setting or rules it out."""
    out = dict(config)
    if KEY not in out and not conflicts(out):
        out[KEY] = True
    return out


def is_set(value: object) -> bool:
    """librdkafka's reading of a boolean setting given as a bool or a string."""
    return value is True or str(value).lower() == "true"


def number(value: object) -> float | None:
    """A numeric setting as a float, or None when it is unset or not a number (librdkafka's own
    error then names it)."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
