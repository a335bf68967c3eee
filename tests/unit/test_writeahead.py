"""Write-ahead deliveries are handed on per committed batch (`outbox.producer.writeahead`): pure logic,
no Kafka, except the two tests at the end, whose broker never answers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

from confluent_kafka import KafkaError, Message

from outbox import ResilientProducer, SQLiteOutbox
from outbox.drain.settle import Decision, Verdict
from outbox.producer.writeahead import SentBatch, SentReport
from outbox.records import NewMessage
from outbox.stores.base import Settlement

from ..waiting import wait_until

RETRY = Decision(Verdict.RESCHEDULE, 1e9 + 30, -192, "_MSG_TIMED_OUT", "_MSG_TIMED_OUT (-192): slow", attempts=1)
Handed = list[tuple[list[int], list[tuple[int, Decision, float]]]]


def make(
    n: int, handed: Handed, reports: list[tuple[int, object]] | None = None, *, successes_heard: bool = True,
    values: list[bytes] | None = None,
) -> SentBatch:
    msgs = [NewMessage("t", values[i] if values else b"v%d" % i, None, [], -1, f"id-{i}") for i in range(n)]

    def on_report(b: SentBatch, i: int, err: KafkaError | None, msg: object) -> None:
        if reports is not None:
            reports.append((i, err))
        if err is None:
            b.delivered(i)
        else:
            b.decided(i, RETRY, 1e9)

    def on_settled(delivered: list[int], decided: list[tuple[int, Decision, float]]) -> None:
        handed.append((list(delivered), list(decided)))

    return SentBatch(
        [100 + i for i in range(n)], msgs, [None] * n, on_report, on_settled, successes_heard=successes_heard
    )


class Report:
    """What a failure report tells of its message (confluent_kafka.Message's accessors): no headers."""

    def __init__(self, value: bytes, topic: str = "t", key: bytes | None = None) -> None:
        self._value, self._topic, self._key = value, topic, key

    def topic(self) -> str:
        return self._topic

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes:
        return self._value


def message(value: bytes, topic: str = "t") -> Message:
    """A fake report's message, typed as the real one for `SentBatch.report`."""
    return cast(Message, Report(value, topic))


TIMED_OUT = KafkaError(KafkaError._MSG_TIMED_OUT)


def in_two_threads(n: int, even: Callable[[int], None], odd: Callable[[int], None]) -> None:
    """Rows 0, 2, 4 … through `even` in one thread while rows 1, 3, 5 … go through `odd` in another."""

    def run(rows: range, outcome: Callable[[int], None]) -> None:
        for i in rows:
            outcome(i)

    threads = [threading.Thread(target=run, args=(range(k, n, 2), even if k == 0 else odd)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_outcomes_are_handed_on_once_when_the_last_row_has_its_outcome() -> None:
    handed: Handed = []
    b = make(4, handed)
    b.delivered(2)
    b.delivered(0)
    b.decided(3, RETRY, 1e9)
    assert handed == []  # held: a group row is settled whole
    b.delivered(1)
    assert handed == [([102, 100, 101], [(103, RETRY, 1e9)])]


def test_a_report_names_its_row() -> None:
    handed: Handed = []
    reports: list[tuple[int, object]] = []
    b = make(3, handed, reports)
    for i, e in ((1, None), (0, TIMED_OUT), (2, None)):
        SentReport(b, i)(e, None)
    assert reports == [(1, None), (0, TIMED_OUT), (2, None)]
    assert handed == [([101, 102], [(100, RETRY, 1e9)])]


def test_shared_reports_count_successes_and_find_a_failed_row_by_its_content() -> None:
    handed: Handed = []
    reports: list[tuple[int, object]] = []
    b = make(3, handed, reports, successes_heard=False)
    b.report(None, message(b"v0"))
    b.report(TIMED_OUT, message(b"v2"))
    assert reports == [(2, TIMED_OUT)]  # the failure only, named by its content
    assert handed == []
    b.report(None, message(b"v1"))
    assert handed == [([100, 101], [(102, RETRY, 1e9)])]


def test_shared_reports_send_again_every_row_alike_to_a_failed_one() -> None:
    """Two rows with one content, one delivered and one failed: a report cannot tell which, so
    both are taken as failed (sent again: at-least-once), never the failed one as delivered."""
    handed: Handed = []
    b = make(3, handed, successes_heard=False, values=[b"same", b"other", b"same"])
    b.report(None, message(b"same"))
    b.report(TIMED_OUT, message(b"same"))
    b.report(None, message(b"other"))
    [(delivered, decided)] = handed
    assert delivered == [101]
    assert sorted(row_id for row_id, _, _ in decided) == [100, 102]


def test_shared_reports_wait_for_rows_refused_by_produce_too() -> None:
    handed: Handed = []
    b = make(3, handed, successes_heard=False)
    b.report(None, message(b"v0"))
    b.refused(1, RETRY, 1e9)  # no report will come for it
    assert handed == []
    b.report(None, message(b"v2"))
    assert handed == [([100, 102], [(101, RETRY, 1e9)])]


def test_a_shared_failure_report_that_matches_no_row_sends_every_undecided_row_again() -> None:
    handed: Handed = []
    b = make(3, handed, successes_heard=False)
    b.report(None, message(b"v0"))
    b.report(TIMED_OUT, message(b"v1", topic="elsewhere"))
    b.report(None, message(b"v2"))
    [(delivered, decided)] = handed
    assert delivered == []  # v0 and v2 were delivered, but the failure could be either: sent again
    assert sorted(row_id for row_id, _, _ in decided) == [100, 101, 102]


def test_outcomes_from_two_threads_are_handed_on_once() -> None:
    handed: Handed = []
    n = 20_000
    b = make(n, handed)
    in_two_threads(n, b.delivered, lambda i: b.decided(i, RETRY, 1e9))
    [(delivered, decided)] = handed
    assert sorted(delivered) == [100 + i for i in range(0, n, 2)]
    assert sorted(row_id for row_id, _, _ in decided) == [100 + i for i in range(1, n, 2)]


def test_shared_reports_and_refusals_from_two_threads_are_handed_on_once() -> None:
    handed: Handed = []
    n = 20_000
    b = make(n, handed, successes_heard=False)
    in_two_threads(n, lambda i: b.report(None, message(b"v%d" % i)), lambda i: b.refused(i, RETRY, 1e9))
    [(delivered, decided)] = handed
    assert delivered == [100 + i for i in range(0, n, 2)]
    assert sorted(row_id for row_id, _, _ in decided) == [100 + i for i in range(1, n, 2)]


def test_a_write_ahead_burst_is_stored_as_groups_and_given_back_whole(tmp_path: Path) -> None:
    """No broker answers: the burst is committed (as groups: few rows), its sends are purged at
    close() and given back whole, so every message is pending in the outbox, still few rows."""
    path = str(tmp_path / "wal.db")
    p = ResilientProducer(
        {"bootstrap.servers": "127.0.0.1:1", "log_level": 0}, outbox=path, mode="write-ahead", drain_workers=0,
    )
    ids = [p.produce("orders", b"v%d" % i, key=b"k%d" % (i % 50)) for i in range(2000)]
    # A guard against a hang, not a deadline: close() returns once every message is committed.
    # (1 s here failed once in CI on a loaded machine, one message counted as unsaved.)
    assert p.close(30.0) is True
    store = SQLiteOutbox(path)
    try:
        assert [m.msg_id for m in store.messages()] == ids
        assert all(m.attempts == 0 for m in store.messages())  # never sent: no attempt counted
        rows = store._read("SELECT COUNT(*) FROM outbox")[0][0]
        assert rows <= 2000 // 16, rows  # one row per message would be 2,000
    finally:
        store.close()


class TripsTheCircuitAtCommit(SQLiteOutbox):
    """Kafka is found down between a write and its commit: write-ahead rows are born leased
    (the circuit was closed at write time) and sent after the circuit has opened and purged."""

    trip: Callable[[str], None] = staticmethod(lambda why: None)
    tripped = False

    def apply(self, settlement: Settlement, *, now: float, new: Sequence[NewMessage] = (), **kw: object) -> object:
        if new:
            self.trip("all brokers down (test)")
            self.tripped = True
            time.sleep(0.5)  # the delivery thread's purge (every 50 ms) runs before these are sent
        return super().apply(settlement, now=now, new=new, **kw)  # type: ignore[arg-type]


def test_rows_sent_after_the_circuit_opened_are_handed_back_at_once(tmp_path: Path) -> None:
    """Not at message.timeout.ms (5 minutes here): the drain has them while Kafka is down."""
    store = TripsTheCircuitAtCommit(str(tmp_path / "wal.db"))
    with socket.socket() as silent:  # accepts and never answers: Kafka is neither up nor known down
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        p = ResilientProducer(
            {"bootstrap.servers": f"127.0.0.1:{silent.getsockname()[1]}", "message.timeout.ms": 300_000,
             "log_level": 0},
            outbox=store, mode="write-ahead", drain_workers=0,
        )
        store.trip = p.circuit.trip
        ids = [p.produce("orders", b"v%d" % i, key=b"k%d" % (i % 5)) for i in range(100)]
        wait_until(lambda: len(p) == 0, 30, "the sends to be handed back from librdkafka's queue", every=0.05)
        assert store.tripped  # rows born leased were committed: the path under test was taken
        assert p.close(30.0) is True
    try:
        assert [m.msg_id for m in store.messages()] == ids
        assert all(m.attempts == 0 for m in store.messages())  # purged unsent: no attempt counted
    finally:
        store.close()
