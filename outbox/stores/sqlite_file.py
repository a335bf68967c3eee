"""The SQLite outbox's file: created owner-only, recognised by (device, inode), and copied into
a new file at the same path when it is deleted while in use (`SQLiteConnection._check_file`)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from dataclasses import dataclass
from typing import Any

from outbox.errors import StoreError
from outbox.stores.sqlite_schema import ALL_COLUMNS, ALL_PLACES, migrate_in


def create_file(path: str) -> None:
    """An empty file at `path` with owner-only permissions (0600); its directory too."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StoreError(f"cannot create outbox file {path}: {exc.strerror}") from exc


def identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`, None if there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


@dataclass(frozen=True, slots=True)
class Contents:
    """Everything a deleted outbox file held: its rows, group bodies and last issued id."""

    rows: list[tuple[Any, ...]]
    bodies: list[tuple[Any, ...]]
    seq: int | None


def read_contents(old: sqlite3.Connection) -> Contents:
    """Every row of the file `old` is connected to (readable after the file was deleted)."""
    rows = old.execute(f"SELECT {ALL_COLUMNS} FROM outbox ORDER BY id").fetchall()
    bodies = old.execute("SELECT id, body, keys FROM outbox_body").fetchall()
    seq = old.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'").fetchone()
    return Contents(rows, bodies, None if seq is None else int(seq[0]))


def remove_logs(path: str) -> None:
    """Delete a stale log or shm file left at `path`: a new file would take it for its own."""
    for suffix in ("-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + suffix)


def write_contents(conn: sqlite3.Connection, contents: Contents) -> None:
    """Create the schema in the new, empty file and copy `contents` in, keeping ids, leases and
    attempts, in one transaction (rolled back on error)."""
    try:
        conn.execute("BEGIN IMMEDIATE")
        migrate_in(conn, 0)
        conn.executemany(f"INSERT OR IGNORE INTO outbox ({ALL_COLUMNS}) VALUES ({ALL_PLACES})", contents.rows)
        conn.executemany("INSERT OR IGNORE INTO outbox_body (id, body, keys) VALUES (?, ?, ?)", contents.bodies)
        if contents.seq is not None:
            conn.execute("DELETE FROM sqlite_sequence WHERE name = 'outbox'")
            conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('outbox', ?)", (contents.seq,))
        conn.execute("COMMIT")
    except sqlite3.Error:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
