"""Dead-letter retention: the DURATION the command line reads, the producer's
`dead_letter_retention` setting and its checks, and the thread that deletes old dead letters
(on the memory store; no Kafka needed: the producer's librdkafka client has no broker to reach)."""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from pathlib import Path

import pytest

from outbox import ConfigError, ResilientProducer
from outbox.errors import StoreError
from outbox.producer.retention import DeadLetterRetention
from outbox.producer.settings import retention_seconds
from outbox.records import DeadLetterFilter, NewMessage
from outbox.stores.audited import PURGE_BATCH
from outbox.stores.filters import parse_duration
from outbox.stores.memory import MemoryOutbox

from ..waiting import wait_until

DAY = 86400.0


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("12h", 43200), ("7d", 7 * DAY), ("2w", 14 * DAY), ("1.5h", 5400),
     (" 10 sec ", 10), ("5min", 300), ("3D", 3 * DAY)],
)
def test_a_duration_is_a_number_and_a_unit(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7", "d", "7x", "0s", "0.0h", "-1d", "1d ago", "2024-05-01", "1e3s",
                                  "99999999999999w", "nan s"])
def test_anything_else_is_not_a_duration(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize(("given", "seconds"), [(None, None), (60, 60.0), (0.5, 0.5),
                                                (timedelta(days=7), 7 * DAY)])
def test_the_retention_is_seconds_or_a_timedelta(given: object, seconds: float | None) -> None:
    assert retention_seconds(given) == seconds


@pytest.mark.parametrize("given", [0, -5, timedelta(0), timedelta(seconds=-1), float("nan"), float("inf"),
                                   "7d", True, [7]])
def test_a_bad_retention_is_a_config_error_naming_it_and_opens_nothing(given: object, tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    with pytest.raises(ConfigError, match=r"^dead_letter_retention must be "):
        ResilientProducer({"bootstrap.servers": "127.0.0.1:1"}, outbox=f"sqlite:///{db}",
                          dead_letter_retention=given)  # type: ignore[arg-type]
    assert not db.exists()


def fill(store: MemoryOutbox, *, old: int, young: int, now: float) -> list[int]:
    """`old` dead letters that failed 8 days ago, `young` that failed an hour ago; the young ids."""
    store.add_dead([NewMessage("t", b"old-%d" % i, b"k") for i in range(old)], failed_at=now - 8 * DAY)
    store.enqueue([NewMessage("t", b"pending", b"k")])  # never a dead letter: never deleted
    return store.add_dead([NewMessage("t", b"young-%d" % i, b"k") for i in range(young)], failed_at=now - 3600)


def test_a_pass_deletes_the_dead_letters_older_than_the_retention_batch_by_batch() -> None:
    store = MemoryOutbox()
    now = time.time()
    young = fill(store, old=PURGE_BATCH + 3, young=2, now=now)
    retention = DeadLetterRetention(store, 7 * DAY, clock=lambda: now)
    assert retention.purge_expired() == PURGE_BATCH + 3
    assert [m.id for m in store.list_dead()] == young and len(store.pending()) == 1
    entries = store.audit_log()[::-1]
    assert [(e.who, e.action, e.count) for e in entries] == [
        ("retention", "purge", PURGE_BATCH), ("retention", "purge", 3)]
    assert json.loads(entries[0].filter) == {"until": now - 7 * DAY}
    assert retention.purge_expired() == 0 and len(store.audit_log()) == 2


class FailingOnce(MemoryOutbox):
    """A store whose first purge fails, as a store that is briefly unreachable does."""

    def __init__(self) -> None:
        super().__init__()
        self.purges = 0

    def purge_dead(self, flt: DeadLetterFilter = DeadLetterFilter(), *, at_most: int | None = None) -> int:
        self.purges += 1
        if self.purges == 1:
            raise StoreError("outbox memory://: unreachable")
        return super().purge_dead(flt, at_most=at_most)


def test_the_thread_logs_a_failed_pass_and_tries_again(caplog: pytest.LogCaptureFixture) -> None:
    store = FailingOnce()
    young = fill(store, old=5, young=1, now=time.time())
    retention = DeadLetterRetention(store, 7 * DAY, every=3600, retry=0.05)
    with caplog.at_level(logging.WARNING, logger="outbox"):
        retention.start()
        try:
            wait_until(lambda: retention.purged == 5, 30, "the retry deleted the old dead letters")
        finally:
            retention.stop(5)
    assert [m.id for m in store.list_dead()] == young
    assert retention.failures == 1
    [record] = [r for r in caplog.records if "retention" in r.getMessage()]
    assert "cannot delete dead letters older than the retention (retrying): outbox memory://: unreachable" in (
        record.getMessage())
    assert not retention._thread.is_alive()


def test_a_producer_with_a_retention_deletes_old_dead_letters_until_it_is_closed() -> None:
    store = MemoryOutbox()
    young = fill(store, old=40, young=3, now=time.time())
    producer = ResilientProducer({"message.timeout.ms": 600000}, outbox=store, drain_workers=0,
                                 dead_letter_retention=timedelta(days=7))
    try:
        wait_until(lambda: store.count_dead() == 3, 30, "the producer's retention deleted the old dead letters")
        assert [m.id for m in store.list_dead()] == young
        assert [(e.who, e.action, e.count) for e in store.audit_log()] == [("retention", "purge", 40)]
        thread = producer._retention._thread if producer._retention is not None else None
        assert thread is not None and thread.is_alive()
    finally:
        producer.close(5)
    assert not thread.is_alive()


def test_a_producer_without_a_retention_keeps_its_dead_letters() -> None:
    store = MemoryOutbox()
    fill(store, old=4, young=1, now=time.time())
    producer = ResilientProducer({"message.timeout.ms": 600000}, outbox=store, drain_workers=0)
    producer.close(5)
    assert producer._retention is None and store.count_dead() == 5 and store.audit_log() == []
