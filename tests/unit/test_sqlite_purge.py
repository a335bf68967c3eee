"""What deleting leaves in a SQLite outbox file: a purged dead letter's bytes are zeroed, every
copy of them (the outbox sets secure_delete, whatever the SQLite build's default; only delivered
messages are deleted without it, for the drain's cost). Real SQLite files; no Kafka needed."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from outbox.records import DeadLetterFilter, NewMessage
from outbox.stores.base import Failure, Settlement
from outbox.stores.sqlite import SQLiteOutbox

NOW = 1_000_000.0
MARK = b"card-4111-1111-1111-1111"
SECRET = MARK * 500  # 12 KB: overflow pages, which FAST would not zero


def file_bytes(path: str) -> bytes:
    raw = sqlite3.connect(path)
    raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every page in the main file, the log empty
    raw.close()
    return Path(path).read_bytes()


def test_a_purged_dead_letter_leaves_no_bytes_in_the_file(tmp_path: Path) -> None:
    path = str(tmp_path / "o.db")
    store = SQLiteOutbox(path)
    try:
        (dead,) = store.enqueue([NewMessage("t", SECRET, b"k", [], -1, "m1", 0, None, None, 0.0)])
        store.enqueue([NewMessage("t", b"other", b"k2", [], -1, "m2", 0, None, None, 0.0)])
        store.claim("me", 1, 30, now=NOW)
        store.apply(Settlement(failures=[Failure(dead, "TOPIC_AUTHORIZATION_FAILED (29): no", None, NOW, 29,
                                                 "TOPIC_AUTHORIZATION_FAILED")]), now=NOW)
        assert MARK in file_bytes(path)
        assert store.purge_dead(DeadLetterFilter()) == 1
        assert MARK not in file_bytes(path)
        assert [m.msg_id for m in store.messages()] == ["m2"]
    finally:
        store.close()


def test_an_erased_key_leaves_no_bytes_in_the_file_and_the_other_keys_keep_theirs(tmp_path: Path) -> None:
    path = str(tmp_path / "o.db")
    store = SQLiteOutbox(path)
    key = b"customer-4111-erase-me"
    try:
        # A group row (its body and its key list hold the key), a one-message row and a dead letter.
        batch = [NewMessage("t", SECRET if i % 2 else b"kept-%d" % i, key if i % 2 else b"other", [], -1, f"m{i}",
                            0, None, None, 0.0) for i in range(20)]
        store.enqueue(batch)
        store.enqueue([NewMessage("t", SECRET, key, [], -1, "single", 0, None, None, 0.0)])
        store.add_dead([NewMessage("u", SECRET, key, [], -1, "dead", 0, None, None, 0.0)], failed_at=NOW)
        raw = file_bytes(path)
        assert MARK in raw and key in raw and key.hex().encode() in raw
        erased = store.erase_key(key, now=NOW)
        assert (erased.pending, erased.dead) == (11, 1)
        raw = file_bytes(path)
        assert MARK not in raw and key not in raw and key.hex().encode() not in raw
        assert [m.value for m in store.messages()] == [b"kept-%d" % i for i in range(0, 20, 2)]
    finally:
        store.close()
