"""A first send's report object: what a failure stores, and what a success calls.

Pure logic with fakes for the link, the spill and the message (the broker side is covered by
tests/integration: test_timestamps, test_producer)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from confluent_kafka import KafkaError

from outbox.headers import ID_HEADER
from outbox.producer.firstsend import FirstSend, _FullReport, _Report
from outbox.producer.pollreport import PollReport
from outbox.retry import RetryPolicy
from outbox.tally import Tally


class FakeMessage:
    """What a failure report tells: topic, payload, key, and seconds since produce()."""

    def __init__(self, topic: str, value: bytes | None, key: bytes | None, latency: float) -> None:
        self._topic, self._value, self._key, self._latency = topic, value, key, latency

    def topic(self) -> str:
        return self._topic

    def value(self) -> bytes | None:
        return self._value

    def key(self) -> bytes | None:
        return self._key

    def latency(self) -> float:
        return self._latency


def first_send() -> tuple[FirstSend, list[tuple[Any, Any]], PollReport]:
    stored: list[tuple[Any, Any]] = []
    served = PollReport()
    link = SimpleNamespace(
        send_failures=Tally(), app_purging=False, poll_report=served,
        note_transport_failure=lambda code: None, recreate_soon=lambda: None,
    )
    spill = SimpleNamespace(
        store=lambda msg, cb: stored.append((msg, cb)), hold_longest=4.0,
        fence=SimpleNamespace(tracking=False, armed=True, inflight={}),
    )
    first = FirstSend(
        link, spill, SimpleNamespace(), SimpleNamespace(closed=True), RetryPolicy(),  # type: ignore[arg-type]
        wake_drain=lambda: None, id_header=ID_HEADER, report_successes=True,
    )
    return first, stored, served


def test_the_common_messages_report_ignores_a_success_and_stores_a_failure_with_its_id_and_produce_time() -> None:
    first, stored, served = first_send()
    report = _Report(first, "id-1", "t", None)
    report(None, FakeMessage("t", b"v", None, 0.01))  # type: ignore[arg-type]
    assert stored == [] and served.delivery_thread_calls == 0

    before = time.time()
    report(KafkaError(KafkaError._MSG_TIMED_OUT), FakeMessage("t", b"v", b"k", 2.0))  # type: ignore[arg-type]
    [(msg, cb)] = stored
    assert (msg.topic, msg.value, msg.key, msg.headers, msg.partition, msg.msg_id) == (
        "t", b"v", b"k", [(ID_HEADER, b"id-1")], -1, "id-1",
    )
    assert cb is None
    # Stamped with its produce() time: the report's time less its latency.
    assert int((before - 2.0) * 1000) - 1 <= msg.timestamp <= int((time.time() - 2.0) * 1000) + 1
    assert first._link.send_failures.value == 1


def test_a_full_report_calls_on_delivery_on_success_and_stores_what_produce_was_given_on_failure() -> None:
    first, stored, served = first_send()
    heard: list[tuple[KafkaError | None, object]] = []
    headers = [("app", b"1"), (ID_HEADER, b"id-2")]
    report = _FullReport(
        first, "id-2", "t", None, headers, lambda err, msg: heard.append((err, msg)), 2, 1_700_000_000_000
    )
    ok = FakeMessage("t", b"v", None, 0.01)
    report(None, ok)  # type: ignore[arg-type]
    assert heard == [(None, ok)] and served.delivery_thread_calls == 1 and stored == []

    report(KafkaError(KafkaError._MSG_TIMED_OUT), FakeMessage("t", b"v", None, 2.0))  # type: ignore[arg-type]
    [(msg, cb)] = stored
    assert (msg.headers, msg.partition, msg.timestamp, msg.msg_id) == (headers, 2, 1_700_000_000_000, "id-2")
    assert cb is report.cb and len(heard) == 1  # a retriable failure is stored, not reported
