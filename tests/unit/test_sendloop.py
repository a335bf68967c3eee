"""SendLoop.finish: turning a produced batch's reports into one decision per row. The producer
is real; no broker listens at its address. Failure reports are put in the batch's errors as its
callbacks would, except in the last test, where librdkafka reports them itself."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from outbox.drain.sendloop import RESEND_MIN_LINGER_MS, InFlight, SendLoop, resend_config
from outbox.drain.settle import Verdict
from outbox.records import OutboxMessage
from outbox.retry import RetryPolicy

NOW = 1_000_000.0


def row(i: int) -> OutboxMessage:
    return OutboxMessage(i, f"m-{i}", "t", b"k", b"v", [], -1, 0, 0, NOW, None, None, NOW, None, None, None)


@pytest.fixture
def loop() -> Iterator[SendLoop]:
    # Port 1: nothing listens; nothing is produced, so nothing is sent.
    yield SendLoop({"bootstrap.servers": "127.0.0.1:1", "log_level": 0}, RetryPolicy(max_attempts=5))


def test_a_batch_without_failure_reports_is_delivered_row_by_row(loop: SendLoop) -> None:
    rows = [row(i) for i in range(3)]
    out = loop.finish(InFlight(rows), lambda: NOW)
    assert [(r.id, d.verdict) for r, d in out] == [(i, Verdict.DELIVERED) for i in range(3)]


def test_a_failure_report_reschedules_its_row_only(loop: SendLoop) -> None:
    rows = [row(i) for i in range(3)]
    batch = InFlight(rows)
    # Retriable, and not a sign of the cluster gone (so no broker is asked whether it is up).
    batch.errors[1] = KafkaError(KafkaError.KAFKA_STORAGE_ERROR)
    out = {r.id: d for r, d in loop.finish(batch, lambda: NOW)}
    assert [out[i].verdict for i in range(3)] == [Verdict.DELIVERED, Verdict.RESCHEDULE, Verdict.DELIVERED]
    assert (out[1].attempts, out[1].name) == (1, "KAFKA_STORAGE_ERROR")


def test_rows_whose_fate_is_unknown_are_left_out(loop: SendLoop) -> None:
    batch = InFlight([row(0), row(1)])
    batch.unknown = True  # a stop gave up waiting: maybe delivered, maybe not
    batch.errors[0] = KafkaError(KafkaError._PURGE_QUEUE)
    out = loop.finish(batch, lambda: NOW)
    assert [(r.id, d.verdict) for r, d in out] == [(0, Verdict.RELEASE)]


def test_each_report_lands_in_the_batch_on_the_producer_at_its_index() -> None:
    # The callbacks are made once per index and reused: the second batch's reports must land in
    # the second batch, at the second batch's indexes.
    loop = SendLoop({"bootstrap.servers": "127.0.0.1:1", "log_level": 0, "message.timeout.ms": 200},
                    RetryPolicy(max_attempts=5))
    first = loop.start([row(i) for i in range(3)])
    assert not loop.wait(first)
    assert {i: e.code() for i, e in first.errors.items()} == {i: KafkaError._MSG_TIMED_OUT for i in range(3)}
    second = loop.start([row(10), row(11)])
    assert not loop.wait(second)
    assert sorted(second.errors) == [0, 1]
    assert sorted(first.errors) == [0, 1, 2]


@pytest.mark.parametrize(
    ("given", "linger"),
    [
        ({}, RESEND_MIN_LINGER_MS),  # the default
        ({"linger.ms": 5}, RESEND_MIN_LINGER_MS),  # an application's latency setting is raised
        ({"linger.ms": "0"}, RESEND_MIN_LINGER_MS),  # as -X / Spark options give it: a string
        ({"queue.buffering.max.ms": 1}, RESEND_MIN_LINGER_MS),  # librdkafka's alias
        ({"linger.ms": 100}, 100.0),  # a longer linger is the caller's to choose
        ({"queue.buffering.max.ms": 250, "linger.ms": 5}, 250.0),  # both: the longer one
    ],
)
def test_a_resending_producer_lingers_at_least_the_floor(given: dict[str, object], linger: float) -> None:
    config = resend_config({"bootstrap.servers": "127.0.0.1:1", **given})
    assert config["linger.ms"] == linger
    assert "queue.buffering.max.ms" not in config  # one setting, not two that librdkafka applies in turn
    assert config["delivery.report.only.error"] is True


def test_a_linger_that_is_not_a_number_is_left_for_librdkafka_to_name() -> None:
    config = resend_config({"bootstrap.servers": "127.0.0.1:1", "linger.ms": "soon"})
    assert config["linger.ms"] == "soon"
    # librdkafka names the property behind the alias.
    loop = SendLoop(config, RetryPolicy())  # its producer is made at its first use
    with pytest.raises(KafkaException, match="Invalid value for configuration property .queue.buffering.max.ms"):
        _ = loop.producer


def test_produce_takes_positional_arguments_in_the_order_every_sender_passes_them() -> None:
    """The senders call `Producer.produce(topic, value, key, partition, on_delivery, callback,
    timestamp, headers)` positionally (keyword parsing costs more than the rest of the call): the
    installed confluent-kafka must read them in that order. No broker: the message is purged."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": "127.0.0.1:1", "log_level": 0})
    reports: list[tuple[int | None, str | None, int, bytes | None, bytes | None]] = []

    def report(err: KafkaError | None, msg: Any) -> None:
        reports.append((None if err is None else err.code(), msg.topic(), msg.partition(), msg.key(), msg.value()))

    producer.produce("t", b"value", b"key", 2, report, None, 0, [("outbox-id", b"1")])
    producer.purge()
    producer.poll(0)
    assert reports == [(KafkaError._PURGE_QUEUE, "t", 2, b"key", b"value")]
    with pytest.raises(TypeError, match="integer"):  # the 7th is the timestamp
        producer.produce("t", b"v", None, -1, report, None, "not a timestamp", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="headers"):  # the 8th is the headers
        producer.produce("t", b"v", None, -1, report, None, 0, "not headers")  # type: ignore[arg-type]
