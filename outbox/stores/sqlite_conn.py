"""The SQLite outbox's connections: one reader per thread, one writer per process, the
write transaction every change goes through, and what happens when the file is deleted or
replaced under it (`outbox.stores.sqlite_file`)."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

from outbox.errors import StoreError, StoreNotFoundError
from outbox.stores import sqlite_file
from outbox.stores.owners import SweepSchedule
from outbox.stores.sqlite_schema import SCHEMA_VERSION, migrate_in

log = logging.getLogger("outbox.stores.sqlite")

#: The write connection's page cache (negative: KiB). SQLite's default, 2 MiB, held a small part
#: of the indexes a backlog of one-message rows walks at random (by key); a spill now stores a
#: writer batch as one row, whose body pages would fill a larger cache instead. 4 MiB: the
#: outage spill's CPU per message as with 16 MiB, and 13 to 26 MB less resident (docs/benchmarks.md).
#: Reads keep the default.
_CACHE_KIB = -4096

#: How long a fork waits for a write transaction of this process to end (`_hold_writes`).
_FORK_WAIT = 5.0
#: Every open outbox of this process, so that a fork happens between two writes.
_open: weakref.WeakSet[SQLiteConnection] = weakref.WeakSet()
#: The SQLite modules of this package: a thread whose innermost frame is there is in SQLite.
_STORES = os.path.join(os.path.dirname(__file__), "sqlite")
_held_for_fork: list[threading.Lock] = []


def _hold_writes() -> None:
    """Before `os.fork()`: let this process's threads leave SQLite, and keep them out of writes.

    A thread inside SQLite at the fork leaves SQLite's own mutexes locked in the child (its
    allocator's and its open's), whose first `sqlite3.connect` then waits forever: a child that
    makes its own producer, as it must, would hang. So the fork waits for the write
    transactions under way and holds off new ones (the write locks), then waits, a bounded time,
    until no other thread's innermost frame is one of this package's SQLite calls (a read, a
    connect); a thread waiting for a write lock held here is not inside SQLite.
    """
    if not _open:
        return
    for conn in list(_open):
        if conn._write_lock.acquire(timeout=_FORK_WAIT):
            _held_for_fork.append(conn._write_lock)
    deadline = time.monotonic() + _FORK_WAIT
    while _inside_sqlite() and time.monotonic() < deadline:
        time.sleep(0.001)


def _inside_sqlite() -> bool:
    me = threading.get_ident()
    waiting = SQLiteConnection._write.__wrapped__.__code__  # type: ignore[attr-defined]
    for ident, frame in sys._current_frames().items():
        code = frame.f_code
        if ident != me and code.co_filename.startswith(_STORES) and code is not waiting:
            return True
    return False


def _release_writes() -> None:
    """After the fork, in the parent and in the child: writes go on."""
    while _held_for_fork:
        _held_for_fork.pop().release()


os.register_at_fork(before=_hold_writes, after_in_parent=_release_writes, after_in_child=_release_writes)


class SQLiteConnection:
    """The file, its connections and its schema: what the hot path (`SQLiteOutbox`) and the
    administration (`outbox.stores.sqlite_admin`) of one SQLite outbox share.

    Args: see `SQLiteOutbox`.
    """

    def __init__(
        self,
        path: str,
        *,
        create: bool = True,
        synchronous: str = "FULL",
        busy_timeout: float = 30.0,
    ) -> None:
        self.path = os.path.abspath(path)
        self.location = self.path
        self._synchronous = synchronous.upper()
        if self._synchronous not in ("FULL", "NORMAL", "EXTRA", "OFF"):
            raise StoreError(f"outbox {self.path}: synchronous must be FULL or NORMAL")
        self._busy_ms = int(busy_timeout * 1000)
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._closed = False
        self._create = create
        _open.add(self)
        self._sweeps = SweepSchedule()
        self._gen = 0  # bumped when the file is re-created: every thread then opens a new connection
        self._writer_conn: sqlite3.Connection | None = None
        self._writer_gen = -1
        self._writer_sync = self._synchronous
        self._ident: tuple[int, int] | None = None  # (device, inode) of the file our connections use
        if not os.path.exists(self.path):
            if not create:
                raise StoreNotFoundError(f"outbox file {self.path} does not exist")
            sqlite_file.create_file(self.path)
        elif not os.access(self.path, os.R_OK):
            raise StoreError(f"outbox file {self.path} is not readable")
        self.migrate()

    # -- connections -------------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        """This thread's connection, for reads."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None and self._local.gen == self._gen:
            return conn
        conn = self._local.conn = self._open()
        self._local.gen = self._gen
        return conn

    def _writer(self) -> sqlite3.Connection:
        """The connection every write of this process goes through (called under the write lock).

        One connection, not one per thread: in WAL mode a connection drops its whole page cache
        when another one committed since its last transaction, so writers taking turns on their
        own connections (the spill writer, two drain workers) each began with a cold cache and
        re-read the index pages they were about to change.
        """
        if self._writer_conn is None or self._writer_gen != self._gen:
            self._writer_conn = self._open(cache_kib=_CACHE_KIB)
            self._writer_gen = self._gen
            self._writer_sync = self._synchronous
        return self._writer_conn

    def _open(self, *, cache_kib: int | None = None) -> sqlite3.Connection:
        """A new connection to the file; `cache_kib`: its page cache, else SQLite's default."""
        if self._closed:
            raise StoreError(f"outbox {self.path} is closed")
        try:
            # isolation_level=None: we issue BEGIN ourselves, so transactions are explicit.
            # mode=rw: never create the file here (a deleted outbox must not come back empty).
            conn = sqlite3.connect(
                f"file:{quote(self.path)}?mode=rw", uri=True, isolation_level=None, check_same_thread=False
            )
            conn.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
            # Deleted bytes are overwritten with zeros (a purged dead letter leaves nothing in
            # the file), whatever the build's default; delivered messages: see below.
            conn.execute("PRAGMA secure_delete = ON")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal" and os.access(self.path, os.W_OK):
                log.warning("outbox %s: journal_mode is %s, not WAL", self.path, mode)
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            if cache_kib is not None:
                conn.execute(f"PRAGMA cache_size = {cache_kib}")
        except sqlite3.Error as exc:
            raise self._error(exc) from exc
        if self._ident is None:
            self._ident = sqlite_file.identity(self.path)
        with self._lock:
            self._all.append(conn)
        return conn

    def _error(self, exc: BaseException) -> StoreError:
        text = str(exc)
        name = getattr(exc, "sqlite_errorname", None)
        if name and name.startswith("SQLITE_IOERR"):  # "disk I/O error" alone does not say which I/O failed
            text = f"{text} ({name})"
        if "not a database" in text or "malformed" in text:
            text = f"file is not a valid SQLite outbox (corrupt?): {text}"
        elif "readonly" in text:
            text = f"outbox is read-only: {text}"
        elif "full" in text:
            text = f"disk is full: {text}"
        elif "locked" in text:
            text = f"locked by another process for longer than the busy timeout: {text}"
        return StoreError(f"outbox {self.path}: {text}")

    @contextmanager
    def _write(self, *, stores_messages: bool = True) -> Iterator[sqlite3.Connection]:
        """One short write transaction; any SQLite error becomes a StoreError naming the file.

        `stores_messages=False` (claims, deletes of delivered rows, releases): the commit need
        not reach the disk before we go on. Losing it to a power cut can only bring rows back
        (a lease, an acknowledgement undone: the row is sent again, at-least-once), never lose
        one; and the next commit that does store messages syncs the WAL, these frames included.
        So such commits skip the fsync of synchronous=FULL (the drain's profile: two fsyncs per
        batch were a third of its wall time).
        """
        # Threads of this process queue here, on a lock that hands over at once, instead of in
        # SQLite's busy handler, which sleeps 1..100 ms between tries: the writer and two drain
        # workers spent most of a recovery asleep there (py-spy). Other processes still meet
        # the busy handler.
        with self._write_lock:
            self._check_file()
            conn = self._writer()
            self._sync(conn, full=stores_messages)
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise self._error(exc) from exc
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException as exc:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise self._error(exc) from exc
                raise

    def _check_file(self) -> None:
        """Before each write: is the path still the file our connections write to?

        SQLite goes on writing to a file deleted underneath it, and what it writes there dies with
        the process. So a deleted outbox is re-created at once, with every row of the deleted
        file copied in (`_recreate`); a file put in its place by someone else is refused.
        One stat() per write transaction, not per message.
        """
        if self._ident is None:
            return
        now = sqlite_file.identity(self.path)
        if now == self._ident:
            return
        if now is not None:
            raise StoreError(
                f"outbox {self.path}: the file was replaced by another one while in use; not writing to "
                "either (its write-ahead log belongs to the new file): restart to use the new file"
            )
        self._recreate()

    def _recreate(self) -> None:
        """The file was deleted: copy its rows (still readable through our open connection) into
        a new file at the same path, keeping ids, leases and attempts, then switch every thread to it.

        Called under the write lock. The old connections are closed before the new file exists:
        closing the last one checkpoints and deletes "<path>-wal" by name, which must not be the
        new file's log; a stale log or shm file left at the path would be taken for the new
        file's, so they go too. Not handled: another process with the deleted file open finds a
        replaced file at its next write and refuses to write until restarted (it must not close its
        connections either: that would delete the new file's log); what it wrote to the deleted
        file after this copy dies with it.
        """
        # Any connection opened before the deletion still reads the old file; a new one could not.
        writer = self._writer_conn if self._writer_gen == self._gen else None
        try:
            contents = sqlite_file.read_contents(writer or self._all[0])
        except sqlite3.Error as exc:
            raise self._error(exc) from exc
        with self._lock:
            conns, self._all = self._all, []
            self._gen += 1
            self._ident = None
        for conn in conns:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
        sqlite_file.remove_logs(self.path)
        sqlite_file.create_file(self.path)
        try:
            sqlite_file.write_contents(self._writer(), contents)
        except sqlite3.Error as exc:
            raise self._error(exc) from exc
        log.error(
            "outbox %s: the file was deleted while in use; re-created it with its %d row(s)",
            self.path, len(contents.rows),
        )

    def _sync(self, conn: sqlite3.Connection, *, full: bool) -> None:
        if self._synchronous != "FULL" and self._synchronous != "EXTRA":
            return
        want = self._synchronous if full else "NORMAL"
        if self._writer_sync != want:
            try:
                conn.execute(f"PRAGMA synchronous = {want}")
            except sqlite3.Error as exc:
                raise self._error(exc) from exc
            self._writer_sync = want

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        try:
            return self._conn().execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise self._error(exc) from exc

    @contextlib.contextmanager
    def _snapshot(self) -> Iterator[sqlite3.Connection]:
        """One read transaction on this thread's connection: the `_read`s (and the statements
        on the connection it yields) inside see one state of the store. SQLite errors raised
        inside become a StoreError naming the file."""
        conn = self._conn()
        try:
            conn.execute("BEGIN")
        except sqlite3.Error as exc:
            raise self._error(exc) from exc
        try:
            yield conn
        except sqlite3.Error as exc:
            raise self._error(exc) from exc
        finally:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("COMMIT")

    # -- schema ------------------------------------------------------------------------------

    def migrate(self) -> None:
        conn = self._conn()
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.Error as exc:
            raise self._error(exc) from exc
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"outbox {self.path}: schema version {version} is newer than this kafka-outbox "
                f"({SCHEMA_VERSION}); upgrade the library"
            )
        if version == SCHEMA_VERSION:
            return
        if version == 0 and not self._create:
            others = conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            ).fetchall()
            if others:
                # An existing database that is not an outbox: never add our tables to it.
                raise StoreError(
                    f"{self.path} is a SQLite database but not a kafka-outbox outbox "
                    f"(tables: {', '.join(r[0] for r in others[:5])})"
                )
        with self._write() as c:
            # Another process may have migrated while we waited for the write lock.
            migrate_in(c, c.execute("PRAGMA user_version").fetchone()[0])

    def close(self) -> None:
        if not self._closed:
            with self._write_lock, contextlib.suppress(StoreError):
                self._check_file()  # rows in a deleted file would die with this process
        with self._lock:
            self._closed = True
            conns, self._all = self._all, []
            self._writer_conn = None
        for conn in conns:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
        self._local = threading.local()
