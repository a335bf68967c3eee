"""Settings the re-senders' producers cannot use are refused by name (they would end each drain
worker at its start); librdkafka's own checks, run here, say the same."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaException, Producer

from outbox import ConfigError
from outbox.drain.sendloop import check_resend_config, resend_config

REFUSED = [
    ({"acks": 1, "enable.idempotence": True}, "acks=1"),
    ({"max.in.flight.requests.per.connection": 6}, "max.in.flight.requests.per.connection=6"),
    ({"max.in.flight": 10}, "max.in.flight=10"),
    ({"retries": 0}, "retries=0"),
    ({"message.send.max.retries": 0}, "message.send.max.retries=0"),
]
ACCEPTED: list[dict[str, Any]] = [
    {},
    {"message.timeout.ms": 21},
    # A time-out no longer than the re-senders' linger shortens the linger (librdkafka refuses
    # a linger as long as the time-out).
    {"message.timeout.ms": 20},
    {"message.timeout.ms": 10},
    {"message.timeout.ms": 50, "linger.ms": 60},
    {"linger.ms": 5, "delivery.timeout.ms": "15"},
    {"message.timeout.ms": 0},  # no time-out
    {"acks": -1},
    {"acks": "all", "max.in.flight": 5, "retries": 1},
    {"acks": 1, "enable.idempotence": False, "max.in.flight": 10},
    # Weaker acks without a word on idempotence: the re-senders keep the caller's acks, without
    # idempotence and with one request in flight (each key's order).
    {"acks": 1},
    {"acks": "0"},
]


@pytest.mark.parametrize("acks", [1, "0", "1"])
def test_weaker_acks_turn_the_re_senders_idempotence_off_and_keep_order(acks: object) -> None:
    out = resend_config({"acks": acks})
    assert out["acks"] == acks and out["enable.idempotence"] is False
    assert out["max.in.flight.requests.per.connection"] == 1


def test_a_transactional_id_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"cannot use: transactional.id=tx "):
        check_resend_config({"transactional.id": "tx"})


@pytest.mark.parametrize(("config", "named"), REFUSED)
def test_refused_by_name_and_by_librdkafka(config: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=rf"cannot use: {named} "):
        check_resend_config(config)
    with pytest.raises(KafkaException):
        Producer({"bootstrap.servers": "127.0.0.1:1", **resend_config(config)})


@pytest.mark.parametrize("config", ACCEPTED)
def test_accepted_here_and_by_librdkafka(config: dict[str, Any]) -> None:
    check_resend_config(config)
    Producer({"bootstrap.servers": "127.0.0.1:1", **resend_config(config)}).flush(0)
