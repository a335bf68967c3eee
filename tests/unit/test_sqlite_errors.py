"""A broken SQLite outbox file gives a clear StoreError naming the file; nothing stored is lost."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outbox import NewMessage, SQLiteOutbox, StoreError, StoreNotFoundError, open_outbox


def test_new_file_is_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "o.db"
    SQLiteOutbox(str(path)).close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_missing_file_without_create(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFoundError, match=f"outbox file {tmp_path}/nope.db does not exist"):
        open_outbox(f"sqlite:///{tmp_path}/nope.db", create=False)
    assert not (tmp_path / "nope.db").exists()


def test_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match=rf"outbox {path}: file is not a valid SQLite outbox"):
        SQLiteOutbox(str(path))


def test_foreign_database_is_not_adopted_without_create(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE orders (id INTEGER)")
    with pytest.raises(StoreError, match="is a SQLite database but not a kafka-outbox outbox"):
        SQLiteOutbox(str(path), create=False)
    with sqlite3.connect(path) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert tables == {"orders"}


def test_locked_file_names_the_file_and_keeps_rows(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    store = SQLiteOutbox(str(path), busy_timeout=0.2)
    store.enqueue([NewMessage("t", b"kept", None, None, -1, "m1")])
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreError, match=rf"outbox {path}: locked by another process"):
            store.enqueue([NewMessage("t", b"new", None, None, -1, "m2")])
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert store.stats(now=time.time()).pending == 1
    [row] = store.claim("w", 10, 30, now=time.time())
    assert row.value == b"kept"
    store.close()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    SQLiteOutbox(str(path)).close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version = 99")
    with pytest.raises(StoreError, match="schema version 99 is newer than this kafka-outbox"):
        SQLiteOutbox(str(path))


def test_version_1_outbox_is_migrated_with_error_columns(tmp_path: Path) -> None:
    """A file written by schema version 1 gets error_code/error_name (filled from last_error),
    keeps its rows, indexes and AUTOINCREMENT, and never reuses an id it issued."""
    from outbox.records import DeadLetterFilter
    from outbox.stores.sqlite_schema import MIGRATIONS as _MIGRATIONS

    path = tmp_path / "v1.db"
    conn = sqlite3.connect(path)
    for stmt in _MIGRATIONS[1]:
        conn.execute(stmt)
    conn.executemany(
        "INSERT INTO outbox (msg_id, topic, status, attempts, created_at, last_error) VALUES (?, 't', ?, 1, 1, ?)",
        [
            ("a", 2, "_MSG_TIMED_OUT (-192): Local: Message timed out"),
            ("b", 0, None),
            ("c", 2, "odd text without a code"),
            ("d", 0, None),
        ],
    )
    conn.execute("DELETE FROM outbox WHERE msg_id = 'd'")  # id 4 was issued, then deleted
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()

    store = SQLiteOutbox(str(path))
    try:
        a, b, c = (store.get(i) for i in (1, 2, 3))
        assert (a.error_code, a.error_name, a.last_error) == (
            -192, "_MSG_TIMED_OUT", "_MSG_TIMED_OUT (-192): Local: Message timed out"
        )
        assert (b.error_code, c.error_code, c.error_name) == (None, None, None)
        assert [r.id for r in store.list_dead(DeadLetterFilter(error="_MSG_TIMED_OUT"))] == [1]
        assert store.enqueue([NewMessage("t", b"new")]) == [5]
        raw = sqlite3.connect(path)
        sql = raw.execute("SELECT sql FROM sqlite_master WHERE name = 'outbox'").fetchone()[0]
        indexes = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        version = raw.execute("PRAGMA user_version").fetchone()[0]
        raw.close()
        assert "AUTOINCREMENT" in sql and sql.index("error_code") < sql.index("lease_owner")
        assert {"outbox_due", "outbox_key", "outbox_dead_msg_id", "outbox_dead_topic", "outbox_group"} <= indexes
        assert "body" not in sql  # version 5: group bodies live in outbox_body
        assert version == 7 and "timestamp" in sql and "enc_key" in sql  # 6: the timestamp; 7: the key id
    finally:
        store.close()


def test_file_deleted_before_this_process_wrote_is_recreated_with_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    with SQLiteOutbox(str(path)) as first:
        first.enqueue([NewMessage("t", b"old", None, None, -1, "m1")])
    store = SQLiteOutbox(str(path))  # opened for reading only: nothing written through it yet
    assert store.stats(now=time.time()).pending == 1
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{path}{suffix}"):
            os.unlink(f"{path}{suffix}")
    store.enqueue([NewMessage("t", b"new", None, None, -1, "m2")])
    store.close()
    with SQLiteOutbox(str(path), create=False) as again:
        assert [r.value for r in again.claim("w", 10, 30, now=time.time())] == [b"old", b"new"]


def test_a_new_outbox_has_the_upgraded_files_columns_without_importing_sqlite_utils(tmp_path: Path) -> None:
    """A new file is made at its last version directly: the same columns, types and order as a
    version-1 file upgraded, and sqlite-utils (which imports pandas, when installed, into the
    application's process) is never imported for it."""
    new, old = tmp_path / "new.db", tmp_path / "v1.db"
    script = (
        "import sys; from outbox.stores.sqlite import SQLiteOutbox; "
        f"SQLiteOutbox({str(new)!r}).close(); "
        "print(sorted(m for m in ('sqlite_utils', 'pandas', 'numpy') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
    from outbox.stores.sqlite_schema import MIGRATIONS as _MIGRATIONS

    conn = sqlite3.connect(old)
    for stmt in _MIGRATIONS[1]:
        conn.execute(stmt)
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    SQLiteOutbox(str(old)).close()

    def table(path: Path) -> list[tuple[object, ...]]:
        """Each column's position, name, type, NOT NULL and primary key (sqlite-utils' copy quotes
        an integer default, `'-1'`, which the column's INTEGER affinity stores as -1 all the same)."""
        raw = sqlite3.connect(path)
        try:
            return [(cid, name, kind, notnull, pk) for cid, name, kind, notnull, _, pk in raw.execute(
                "PRAGMA table_info(outbox)"
            )]
        finally:
            raw.close()

    assert table(new) == table(old)
    assert [c[1] for c in table(new)].index("error_code") == [c[1] for c in table(new)].index("last_error") + 1
