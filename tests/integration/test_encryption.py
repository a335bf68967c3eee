"""Encryption at rest with a real Kafka cluster: what an outage stores is unreadable on disk,
and it reaches Kafka intact once the cluster (and the right key) is there."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from outbox import Drainer, ResilientProducer, SQLiteOutbox
from outbox.encryption import Key, KeyRing
from outbox.errors import DecryptionError

from ..waiting import wait_until

MARKER = b"IBAN-DE89370400440532013000"
HEADER_MARKER = b"card-holder-ALICE-EXAMPLE"
OLD = Key(bytes(range(32)))
NEW = Key(bytes(range(50, 82)))


def raw_bytes(path: Path) -> bytes:
    wal = Path(f"{path}-wal")
    return path.read_bytes() + (wal.read_bytes() if wal.exists() else b"")


def spill(path: Path, topic: str, n: int, ring: KeyRing) -> None:
    """`n` messages produced while no broker answers: every one is stored, encrypted."""
    with ResilientProducer(
        {"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 1000},
        outbox=f"sqlite:///{path}", drain_workers=0, encryption=ring, circuit_failure_threshold=1,
        circuit_reset_timeout=3600,
    ) as p:
        for i in range(n):
            p.produce(topic, MARKER + b"-%d" % i, key=b"k%d" % (i % 7), headers=[("card", HEADER_MARKER)])
        wait_until(lambda: p.stats()["in_memory"] == 0 and p.stats()["unsaved"] == 0, 60, "all stored")
    store = SQLiteOutbox(str(path), create=False)
    store.set_encryption(ring)
    try:
        assert store.stats(now=time.time()).pending == n
    finally:
        store.close()


def check_delivered(got: list[Any], n: int) -> None:
    assert sorted(m.value() for m in got) == sorted(MARKER + b"-%d" % i for i in range(n))
    for m in got:
        assert ("card", HEADER_MARKER) in (m.headers() or [])
    by_key: dict[bytes, list[int]] = {}
    for m in got:
        by_key.setdefault(m.key(), []).append(int(m.value().rsplit(b"-", 1)[1]))
    assert all(seq == sorted(seq) for seq in by_key.values())  # each key in order


def test_an_outage_is_stored_encrypted_and_delivered_intact(
    kafka_bootstrap: str, topic: str, tmp_path: Path, consume_all: Callable[..., list[Any]]
) -> None:
    path = tmp_path / "o.db"
    n = 300
    spill(path, topic, n, KeyRing([OLD]))
    data = raw_bytes(path)
    assert MARKER not in data and HEADER_MARKER not in data
    assert topic.encode() in data  # topics stay in clear (docs/encryption.md)
    store = SQLiteOutbox(str(path), create=False)
    try:
        result = Drainer(store, {"bootstrap.servers": kafka_bootstrap}, encryption=OLD).run(until_empty=True)
        assert result.delivered == n and result.dead == 0
    finally:
        store.close()
    check_delivered(consume_all(topic, n), n)


def test_a_missing_or_wrong_key_keeps_every_row_pending_until_the_right_key_sends_them(
    kafka_bootstrap: str, topic: str, tmp_path: Path, consume_all: Callable[..., list[Any]]
) -> None:
    path = tmp_path / "o.db"
    n = 50
    spill(path, topic, n, KeyRing([OLD]))
    for given in (None, NEW):
        store = SQLiteOutbox(str(path), create=False)
        try:
            with pytest.raises(DecryptionError, match=f"key {OLD.id}") as info:
                Drainer(store, {"bootstrap.servers": kafka_bootstrap}, encryption=given).run(until_empty=True)
            assert info.value.key_id == OLD.id
            stats = store.stats(now=time.time())
            assert (stats.pending, stats.dead, stats.leased) == (n, 0, 0)
        finally:
            store.close()
    # The right key, in a producer whose drain runs in a process of its own.
    with ResilientProducer(
        {"bootstrap.servers": kafka_bootstrap}, outbox=f"sqlite:///{path}", drain_in="process",
        encryption=[NEW, OLD], drain_poll_interval=0.2,
    ) as p:
        wait_until(lambda: p.stats()["pending"] == 0, 60, "the outbox is drained")
        assert p.stats()["dead"] == 0
    check_delivered(consume_all(topic, n), n)


def test_rotated_rows_deliver_with_the_new_key_alone(
    kafka_bootstrap: str, topic: str, tmp_path: Path, consume_all: Callable[..., list[Any]]
) -> None:
    path = tmp_path / "o.db"
    n = 120
    spill(path, topic, n, KeyRing([OLD]))
    store = SQLiteOutbox(str(path), create=False)
    store.set_encryption(KeyRing([NEW, OLD]))
    try:
        rotation = store.rotate_keys(now=time.time(), batch=1)
        assert rotation.reencrypted == n and rotation.left == 0
    finally:
        store.close()
    assert MARKER not in raw_bytes(path)
    store = SQLiteOutbox(str(path), create=False)
    try:
        result = Drainer(store, {"bootstrap.servers": kafka_bootstrap}, encryption=NEW).run(until_empty=True)
        assert result.delivered == n and result.dead == 0
    finally:
        store.close()
    check_delivered(consume_all(topic, n), n)
