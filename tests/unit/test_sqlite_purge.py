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
