"""Deletions written to the audit log (`outbox.stores.audited`): purges in bounded batches, one
entry per batch, and the erasure of a key, one entry naming the key by a digest, never its bytes.
On the memory store: the stores' own deletions are the contract suite's."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest

from outbox.errors import StoreError
from outbox.records import DeadLetterFilter, NewMessage
from outbox.stores.audited import PURGE_BATCH, erase_key, key_digest, purge_in_batches
from outbox.stores.base import Erased
from outbox.stores.memory import MemoryOutbox

NOW = 1_000_000.0


def dead(store: MemoryOutbox, n: int, *, at: float, key: bytes | None = None) -> list[int]:
    return store.add_dead([NewMessage("t", b"%d" % i, key) for i in range(n)], failed_at=at)


def test_a_purge_goes_in_batches_each_its_own_audit_entry() -> None:
    store = MemoryOutbox()
    dead(store, 2 * PURGE_BATCH + 7, at=100.0)
    young = dead(store, 3, at=NOW)
    flt = DeadLetterFilter(until=200.0)
    assert purge_in_batches(store, flt, who="cli:ops") == 2 * PURGE_BATCH + 7
    assert [m.id for m in store.list_dead()] == young
    entries = store.audit_log()[::-1]  # oldest first
    assert [(e.who, e.action, e.count) for e in entries] == [
        ("cli:ops", "purge", PURGE_BATCH), ("cli:ops", "purge", PURGE_BATCH), ("cli:ops", "purge", 7)]
    assert {json.loads(e.filter)["until"] for e in entries} == {200.0}


def test_a_purge_that_finds_nothing_writes_no_entry_and_a_stop_ends_it_between_batches() -> None:
    store = MemoryOutbox()
    assert purge_in_batches(store, DeadLetterFilter(), who="retention") == 0
    assert store.audit_log() == []
    dead(store, 10, at=100.0)
    stop = threading.Event()
    stop.set()
    assert purge_in_batches(store, DeadLetterFilter(), who="retention", stop=stop) == 0
    assert store.count_dead() == 10
    assert purge_in_batches(store, DeadLetterFilter(), who="retention", batch=4) == 10
    assert [e.count for e in store.audit_log()] == [2, 4, 4]


def test_the_key_digest_is_a_sha256_prefix() -> None:
    assert key_digest(b"customer-42") == hashlib.sha256(b"customer-42").hexdigest()[:16]
    assert len({key_digest(b"a"), key_digest(b"b"), key_digest(b"")}) == 3


def test_an_erasure_is_one_entry_naming_the_key_by_its_digest_only() -> None:
    store = MemoryOutbox()
    key = b"customer-42"
    store.enqueue([NewMessage("orders", b"v", key), NewMessage("orders", b"v", b"customer-7")])
    dead(store, 2, at=NOW, key=key)
    assert erase_key(store, key, topic=None, who="cli:ops", dry_run=True) == Erased(pending=1, dead=2)
    assert store.audit_log() == []  # a dry run records nothing
    assert erase_key(store, key, topic=None, who="cli:ops") == Erased(pending=1, dead=2)
    [entry] = store.audit_log()
    assert (entry.who, entry.action, entry.count) == ("cli:ops", "erase", 3)
    assert json.loads(entry.filter) == {"key_sha256": key_digest(key)}
    assert b"customer-42" not in entry.filter.encode() and key.hex() not in entry.filter
    assert [m.key for m in store.messages()] == [b"customer-7"]
    assert erase_key(store, key, topic="orders", who="local") == Erased()  # recorded even when nothing is left
    assert json.loads(store.audit_log()[0].filter) == {"key_sha256": key_digest(key), "topic": "orders"}


class FailingAfterOneBatch(MemoryOutbox):
    """A store whose second erasure transaction fails (the first one committed)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def _erase_rows(self, key: bytes, topic: str | None, now: float, limit: int) -> Erased:
        self.calls += 1
        if self.calls > 1:
            raise StoreError("outbox memory://: the disk is gone")
        return super()._erase_rows(key, topic, now, limit)


def test_an_erasure_that_fails_part_way_records_what_it_did_and_raises() -> None:
    store = FailingAfterOneBatch()
    dead(store, 1500, at=NOW, key=b"k")
    with pytest.raises(StoreError, match="the disk is gone"):
        erase_key(store, b"k", topic=None, who="cli:ops")
    [entry] = store.audit_log()
    assert (entry.action, entry.count) == ("erase (failed)", 1000)
    assert store.count_dead() == 500
