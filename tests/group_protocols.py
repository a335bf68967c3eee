"""The settings of a test consumer group on each group protocol, for the tests that run on both."""

from __future__ import annotations

from typing import Any

#: The `group_protocol` fixture's values (tests/conftest.py).
PROTOCOLS = ("classic", "consumer")


def group_settings(variant: str, *, max_poll_interval_ms: int = 10000) -> dict[str, Any]:
    """A group's settings besides bootstrap.servers and group.id: small timeouts so that rebalances
    and a dead member are noticed within seconds.

    `variant` is a protocol, optionally with an assignor: ``classic``, ``classic:cooperative-sticky``,
    ``consumer``, ``consumer:range``. A group of group.protocol=consumer takes its session and
    heartbeat from the broker (6 s and 0.5 s in the test cluster, outbox/testing/cluster.py):
    librdkafka refuses them in a consumer's settings, as it refuses partition.assignment.strategy
    (the broker's assignor is asked for with group.remote.assignor).
    """
    protocol, _, assignor = variant.partition(":")
    if protocol == "classic":
        settings: dict[str, Any] = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}
        if assignor:
            settings["partition.assignment.strategy"] = assignor
    elif protocol == "consumer":
        settings = {"group.protocol": "consumer"}
        if assignor:
            settings["group.remote.assignor"] = assignor
    else:
        raise ValueError(f"unknown group protocol {variant!r}")
    settings["max.poll.interval.ms"] = max_poll_interval_ms
    return settings
