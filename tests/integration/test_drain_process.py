"""`ResilientProducer(drain_in="process")` against the real cluster: the drain in a child process.

The outage case (nothing lost, key order, every `on_delivery` run in the application's process)
is a case of `test_producer.test_outage_of_all_brokers_loses_nothing_and_keeps_key_order`.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import pytest

from outbox import DeadLetter, Listener, NewMessage, SQLiteOutbox
from outbox.events import Drained

from ..waiting import wait_until
from .delivery import keyed_value, read_topic
from .test_producer import drained, make_producer


def _fill(db: Path, topic: str, n: int, *, extra: list[NewMessage] | None = None) -> None:
    with SQLiteOutbox(str(db)) as store:
        keyed = [keyed_value(i % 50, i // 50) for i in range(n)]
        rows = [NewMessage(topic, value, key, [], -1, f"row-{i}") for i, (key, value) in enumerate(keyed)]
        store.enqueue(rows + (extra or []))


def test_a_killed_drain_process_is_restarted_and_loses_nothing(
    kafka_bootstrap: str, topic: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "o.db"
    total = 30_000
    _fill(db, topic, total)
    caplog.set_level(logging.ERROR, logger="outbox")
    with make_producer(kafka_bootstrap, db, drain_in="process") as p:
        first = p.drainer.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)  # mid-drain, or before it claimed: either way a restart
        wait_until(lambda: p.drainer.pid not in (None, first), 60, "a new drain process runs")
        wait_until(lambda: drained(p), 120, "the outbox is drained")
        st = p.stats()
    assert st["drain_restarts"] == 1
    assert st["pending"] == 0 and st["dead"] == 0
    assert "the drain process exited with code -9; starting a new one" in caplog.text
    got = read_topic(kafka_bootstrap, topic, total)
    assert got.unique == total, f"lost {total - got.unique} messages"
    assert got.order_violations() == []


def test_dead_letters_of_the_drain_process_reach_the_application(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    """A stored message Kafka refuses for good is dead-lettered by the child; the recovery
    callback runs in the application's process with the whole DeadLetter, and the counts add up."""
    db = tmp_path / "o.db"
    huge = NewMessage(topic, b"x" * 2_000_000, b"big", [("h", b"1")], -1, "too-big")
    _fill(db, topic, 10, extra=[huge])
    dead: list[DeadLetter] = []
    with make_producer(kafka_bootstrap, db, drain_in="process", on_dead_letter=dead.append) as p:
        wait_until(lambda: drained(p) and len(dead) == 1, 60, "the outbox is drained")
        st = p.stats()
    assert [(d.msg_id, d.key, len(d.value or b""), d.error_name) for d in dead] == [
        ("too-big", b"big", 2_000_000, "MSG_SIZE_TOO_LARGE")
    ]
    assert dead[0].headers[0] == ("h", b"1")
    assert (st["delivered_from_outbox"], st["dead_this_process"], st["dead"]) == (10, 1, 1)
    assert read_topic(kafka_bootstrap, topic, 10).unique == 10


@pytest.mark.parametrize("drain_in", ["threads", "process"])
def test_observers_hear_one_delivered_shape_whatever_drain_in(
    kafka_bootstrap: str, topic: str, tmp_path: Path, drain_in: str
) -> None:
    """The `delivered` event carries `Drained` rows, drained in threads or in a drain process."""
    db = tmp_path / "o.db"
    heard: list[Drained] = []

    class Observer(Listener):
        def delivered(self, rows: Sequence[Drained]) -> None:
            heard.extend(rows)

    with make_producer(kafka_bootstrap, db, drain_in=drain_in) as p:
        p.subscribe(Observer())
        # Stored after the observer subscribed (as an earlier process would have left them).
        plain = NewMessage(topic, b"v", b"k", [("outbox-id", b"plain")], -1, "plain")
        traced = NewMessage(topic, b"v", b"k", [("app", b"1"), ("outbox-id", b"traced")], -1, "traced")
        with SQLiteOutbox(str(db)) as store:
            store.enqueue([plain, traced])
        wait_until(lambda: len(heard) == 2, 60, "both rows delivered")
    assert [type(r) for r in heard] == [Drained, Drained]
    assert [(r.msg_id, r.topic, r.key, r.attempts, r.headers) for r in heard] == [
        ("plain", topic, b"k", 0, [("outbox-id", b"plain")]),
        ("traced", topic, b"k", 0, [("app", b"1"), ("outbox-id", b"traced")]),
    ]
    assert read_topic(kafka_bootstrap, topic, 2).unique == 2
