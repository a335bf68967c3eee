"""Write-ahead deliveries are handed on per committed batch (`outbox.writeahead`): pure logic,
no Kafka."""

from __future__ import annotations

import threading
from pathlib import Path

from confluent_kafka import KafkaError

from outbox import ResilientProducer, SQLiteOutbox
from outbox.records import NewMessage
from outbox.settle import Decision, Verdict
from outbox.writeahead import SentBatch, SentReport

RETRY = Decision(Verdict.RESCHEDULE, 1e9 + 30, -192, "_MSG_TIMED_OUT", "_MSG_TIMED_OUT (-192): slow", attempts=1)
Handed = list[tuple[list[int], list[tuple[int, Decision, float]]]]


def make(
    n: int, handed: Handed, reports: list[tuple[int, object]] | None = None, *, successes_heard: bool = True
) -> SentBatch:
    msgs = [NewMessage("t", b"v", None, [], -1, f"id-{i}") for i in range(n)]

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
    err = KafkaError(KafkaError._MSG_TIMED_OUT)
    for i, e in ((1, None), (0, err), (2, None)):
        SentReport(b, i)(e, None)
    assert reports == [(1, None), (0, err), (2, None)]
    assert handed == [([101, 102], [(100, RETRY, 1e9)])]


def test_a_success_nobody_hears_of_skips_the_report_handler() -> None:
    handed: Handed = []
    reports: list[tuple[int, object]] = []
    b = make(2, handed, reports, successes_heard=False)
    err = KafkaError(KafkaError._MSG_TIMED_OUT)
    SentReport(b, 0)(None, None)
    SentReport(b, 1)(err, None)
    assert reports == [(1, err)]  # the failure only
    assert handed == [([100], [(101, RETRY, 1e9)])]


def test_outcomes_from_two_threads_are_handed_on_once() -> None:
    handed: Handed = []
    n = 20_000
    b = make(n, handed)

    def settle(rows: range, fail: bool) -> None:
        for i in rows:
            if fail:
                b.decided(i, RETRY, 1e9)
            else:
                b.delivered(i)

    threads = [threading.Thread(target=settle, args=(range(k, n, 2), k == 1)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    [(delivered, decided)] = handed
    assert sorted(delivered) == [100 + i for i in range(0, n, 2)]
    assert sorted(row_id for row_id, _, _ in decided) == [100 + i for i in range(1, n, 2)]


def test_a_write_ahead_burst_is_stored_as_groups_and_given_back_whole(tmp_path: Path) -> None:
    """No broker answers: the burst is committed (as groups: few rows), its sends are purged at
    close() and given back whole, so every message is pending in the outbox, still few rows."""
    path = str(tmp_path / "wal.db")
    p = ResilientProducer(
        {"bootstrap.servers": "127.0.0.1:1", "log_level": 0}, outbox=path, mode="write-ahead", drain_workers=0,
    )
    ids = [p.produce("orders", b"v%d" % i, key=b"k%d" % (i % 50)) for i in range(2000)]
    assert p.close(1.0) == 0
    store = SQLiteOutbox(path)
    try:
        assert [m.msg_id for m in store.messages()] == ids
        assert all(m.attempts == 0 for m in store.messages())  # never sent: no attempt counted
        rows = store._read("SELECT COUNT(*) FROM outbox")[0][0]
        assert rows <= 2000 // 16, rows  # one row per message would be 2,000
    finally:
        store.close()
