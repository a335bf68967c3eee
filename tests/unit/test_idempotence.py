"""The producers are idempotent unless the caller's settings rule it out (per-key order needs it),
read back from librdkafka's own statistics: their `eos` section exists only on an idempotent
producer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from outbox import ResilientProducer
from outbox.drain.idempotence import conflicts, with_default

NO_BROKER = {"bootstrap.servers": "127.0.0.1:1", "statistics.interval.ms": 50}

RULED_OUT: list[tuple[dict[str, Any], str]] = [
    ({"acks": 1}, "acks=1"),
    ({"acks": "0"}, "acks=0"),
    ({"request.required.acks": 1}, "request.required.acks=1"),
    ({"max.in.flight.requests.per.connection": 6}, "max.in.flight.requests.per.connection=6"),
    ({"max.in.flight": 1000}, "max.in.flight=1000"),
    ({"retries": 0}, "retries=0"),
    ({"message.send.max.retries": "0"}, "message.send.max.retries=0"),
]


def resilient(config: dict[str, Any], tmp_path: Path) -> ResilientProducer:
    return ResilientProducer(config, outbox=f"sqlite:///{tmp_path}/o.db", drain_workers=0)


def is_idempotent(make: Any) -> bool:
    """Whether the librdkafka producer built by `make(config)` reports an `eos` section."""
    seen: list[dict[str, Any]] = []
    producer = make({**NO_BROKER, "stats_cb": lambda s: seen.append(json.loads(s))})
    try:
        while not seen:
            producer.poll(0.05)
    finally:
        if isinstance(producer, ResilientProducer):
            producer.close(0)
    return "eos" in seen[0]


@pytest.mark.parametrize("config", [{}, {"acks": "all"}, {"acks": -1, "max.in.flight": 5, "retries": 3}])
def test_idempotent_by_default(config: dict[str, Any], tmp_path: Path) -> None:
    assert with_default(config)["enable.idempotence"] is True
    assert is_idempotent(lambda c: resilient({**c, **config}, tmp_path))


def test_an_explicit_setting_wins(tmp_path: Path) -> None:
    assert not is_idempotent(lambda c: resilient({**c, "enable.idempotence": False}, tmp_path))


@pytest.mark.parametrize(("config", "named"), RULED_OUT)
def test_settings_that_rule_it_out_turn_the_default_off(config: dict[str, Any], named: str, tmp_path: Path) -> None:
    assert [setting for setting, _ in conflicts(config)] == [named]
    assert "enable.idempotence" not in with_default(config)
    # librdkafka takes the result (it would refuse idempotence with these), and so does the producer.
    assert not is_idempotent(lambda c: Producer({**c, **with_default(config)}))
    assert not is_idempotent(lambda c: resilient({**c, **config}, tmp_path))
