"""SQLite outbox: one file per host, shared by the application and `outbox drain`.

WAL journal (readers never block the writer), a busy timeout so concurrent processes wait
instead of failing, BEGIN IMMEDIATE for every write so lock upgrades cannot deadlock, and
batched statements: the caller group-commits, so one transaction carries many rows.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

from ..backlog import Backlog, backlog_from_rows, backlog_sql
from ..codec import encode_headers
from ..errors import StoreError, StoreNotFoundError, UnknownMessageError
from ..owners import Liveness, SweepSchedule, describe_owner, local_liveness
from ..records import AuditEntry, DeadLetterFilter, NewMessage, OutboxMessage, Status, StoreStats
from . import grouped
from .base import (
    COLUMNS,
    INSERT_COLUMNS,
    Applied,
    Failure,
    Outbox,
    Settlement,
    dead_letter_where,
    insert_values,
    row_from_columns,
)

log = logging.getLogger(__name__)

SCHEMA_VERSION = 6
_T = TypeVar("_T")
_CHUNK = 500  # ids per IN (...) list: well under SQLite's variable limit
#: The write connection's page cache (negative: KiB). SQLite's default, 2 MiB, holds a small part
#: of the indexes a backlog's inserts and deletes walk at random (by key): spill + drain cost 109
#: us of store CPU per message with it, 84 with 16 MiB, 86 with 64 MiB (profile_store_rows.py,
#: one run each on a busy machine). Reads keep the default.
_CACHE_KIB = -16384

_COLUMNS = COLUMNS
#: The statement that writes one row (`insert_values` order); benchmarks time it as their baseline.
INSERT_SQL = f"INSERT INTO outbox ({', '.join(INSERT_COLUMNS)}) VALUES ({','.join('?' * len(INSERT_COLUMNS))})"

_MIGRATIONS: dict[int, list[str]] = {
    1: [
        """CREATE TABLE IF NOT EXISTS outbox (
            id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: ids order a key's messages
            msg_id TEXT NOT NULL,
            topic TEXT NOT NULL,
            key BLOB,
            value BLOB,
            headers BLOB,
            partition INTEGER NOT NULL DEFAULT -1,
            status INTEGER NOT NULL DEFAULT 0,
            attempts INTEGER NOT NULL DEFAULT 0,
            created_at REAL NOT NULL,
            first_failed_at REAL,
            last_failed_at REAL,
            next_attempt_at REAL NOT NULL DEFAULT 0,
            last_error TEXT,
            lease_owner TEXT
        )""",
        "CREATE INDEX IF NOT EXISTS outbox_due ON outbox (status, next_attempt_at)",
        "CREATE INDEX IF NOT EXISTS outbox_key ON outbox (topic, key, id)",
    ]
}

# Version 3 (the console): dead-letter filters walk small partial indexes in id order (keyset
# pages), a trace finds a message's rows by its outbox-id, and operator actions are audited here,
# in the store itself (same file permissions and backups as the dead letters they describe).
# Partial indexes (WHERE status = 2) cost the producer nothing: pending rows are not in them.
_MIGRATIONS[3] = [
    # Dead rows only: a full msg_id index cost every spilled message ~9 us of CPU (enqueue 25 ->
    # 34 us, bench_msg_id_index), on the path recovery speed depends on. Pending rows are the
    # backlog, gone once drained; trace() scans those.
    "CREATE INDEX IF NOT EXISTS outbox_dead_msg_id ON outbox (msg_id) WHERE status = 2",
    "CREATE INDEX IF NOT EXISTS outbox_dead ON outbox (id) WHERE status = 2",
    "CREATE INDEX IF NOT EXISTS outbox_dead_topic ON outbox (topic, id) WHERE status = 2",
    "CREATE INDEX IF NOT EXISTS outbox_dead_error_name ON outbox (error_name, id) WHERE status = 2",
    "CREATE INDEX IF NOT EXISTS outbox_dead_error_code ON outbox (error_code, id) WHERE status = 2",
    "CREATE INDEX IF NOT EXISTS outbox_dead_key ON outbox (key, id) WHERE status = 2",
    "CREATE INDEX IF NOT EXISTS outbox_dead_failed ON outbox (last_failed_at) WHERE status = 2",
    """CREATE TABLE IF NOT EXISTS outbox_audit (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        who TEXT NOT NULL,
        action TEXT NOT NULL,
        filter TEXT NOT NULL,
        count INTEGER NOT NULL
    )""",
]

# Version 4: several messages to a row (`outbox.stores.grouped`). A one-message row has n = 1 and
# no body; the partial index lists the groups (few: one per writer batch), with what stats() and
# the id lookups need, so neither reads a body.
_MIGRATIONS[4] = [
    "ALTER TABLE outbox ADD COLUMN n INTEGER NOT NULL DEFAULT 1",
    "ALTER TABLE outbox ADD COLUMN body BLOB",
    "ALTER TABLE outbox ADD COLUMN keys BLOB",
    "CREATE INDEX IF NOT EXISTS outbox_group ON outbox (id, topic, n) WHERE body IS NOT NULL",
]

# Version 5: a group's body and keys live in a table of their own, one row per group. A lease
# changes the size of the `outbox` row (lease_owner NULL -> text), and SQLite then rewrites the
# whole record, overflow pages included: every claim and release of a 1,000-message group wrote
# its ~270 KB again (3.7 ms of a 5,000-message claim per group; a same-size update writes one
# page). Groups are the `outbox` rows with n > 1; a trigger deletes a group's body with its row.
_MIGRATIONS[5] = [
    """CREATE TABLE IF NOT EXISTS outbox_body (
        id INTEGER PRIMARY KEY,  -- the group's id in outbox
        body BLOB NOT NULL,  -- its messages (outbox.stores.grouped)
        keys BLOB  -- its distinct keys, NULL without any
    )""",
    "INSERT INTO outbox_body (id, body, keys) SELECT id, body, keys FROM outbox WHERE body IS NOT NULL",
    "DROP INDEX IF EXISTS outbox_group",
    "ALTER TABLE outbox DROP COLUMN body",
    "ALTER TABLE outbox DROP COLUMN keys",
    "CREATE INDEX IF NOT EXISTS outbox_group ON outbox (id, topic, n) WHERE n > 1",
    """CREATE TRIGGER IF NOT EXISTS outbox_body_gone AFTER DELETE ON outbox WHEN OLD.n > 1
    BEGIN DELETE FROM outbox_body WHERE id = OLD.id; END""",
]


def _migrate_to_6(conn: sqlite3.Connection) -> None:
    """Version 6: the record timestamp (ms; 0: unknown, what every row stored before has) as a
    column, and in each message of a group body (`grouped.upgrade_v5` rewrites the bodies)."""
    # BIGINT, INTEGER affinity: a 64-bit integer (the Spark job reads it through JDBC as a long).
    conn.execute("ALTER TABLE outbox ADD COLUMN timestamp BIGINT NOT NULL DEFAULT 0")
    last = 0
    while True:  # a few bodies at a time: a backlog's bodies need not fit in memory at once
        bodies = conn.execute(
            "SELECT id, body FROM outbox_body WHERE id > ? ORDER BY id LIMIT 64", (last,)
        ).fetchall()
        if not bodies:
            return
        conn.executemany(
            "UPDATE outbox_body SET body = ? WHERE id = ?", [(grouped.upgrade_v5(body), gid) for gid, body in bodies]
        )
        last = bodies[-1][0]


#: A group's columns as `_group_messages` reads them (`outbox` as o, `outbox_body` as b).
_GROUP = "o.id, o.topic, o.created_at, o.next_attempt_at, o.n, b.body"
#: A claim's candidate: the row's columns, then n, body and keys (NULL for a one-message row).
_CANDIDATE = ", ".join(f"o.{c.strip()}" for c in _COLUMNS.split(",")) + ", o.n, b.body, b.keys"
#: Where a candidate holds n, body and keys.
_N = len(_COLUMNS.split(","))
_BODY, _KEYS = _N + 1, _N + 2
#: A group row with its body and keys.
_GROUPS = "outbox AS o INDEXED BY outbox_group JOIN outbox_body AS b ON b.id = o.id"
#: Every column a row has, in the order `_recreate` copies them.
_ALL_COLUMNS = f"{_COLUMNS}, lease_owner, n"
_ALL_PLACES = ",".join("?" * len(_ALL_COLUMNS.split(",")))

#: Version 2: the error as code and name columns (filters and stats read them, never the text).
_ERROR_COLUMNS = ("error_code", "error_name")


def _migrate_to_2(conn: sqlite3.Connection) -> None:
    """Add error_code/error_name beside last_error and fill them from the stored text.

    Runs inside the caller's BEGIN IMMEDIATE. sqlite-utils does the schema work: `add_column`
    (an ALTER TABLE) and `transform()` for the copy-and-swap that puts the new columns beside
    `last_error`, which ALTER TABLE cannot do; transform keeps AUTOINCREMENT and the indexes,
    and its savepoint nests in our transaction. The last-issued id is kept so ids are never reused.
    """
    import sqlite_utils  # only needed once per outbox file, when it is upgraded

    db = sqlite_utils.Database(conn, execute_plugins=False)
    table = db.table("outbox")
    columns = table.columns_dict
    for name, kind in (("error_code", int), ("error_name", str)):
        if name not in columns:
            table.add_column(name, kind)
    # The one place the old text form is parsed: "NAME (code): reason", written by version 1.
    conn.execute(
        "UPDATE outbox SET "
        "error_name = substr(last_error, 1, instr(last_error, ' (') - 1), "
        "error_code = CAST(substr(last_error, instr(last_error, ' (') + 2, "
        "instr(last_error, '):') - instr(last_error, ' (') - 2) AS INTEGER) "
        "WHERE last_error IS NOT NULL AND error_code IS NULL "
        "AND instr(last_error, ' (') > 0 AND instr(last_error, '):') > instr(last_error, ' (')"
    )
    order = [c for c in table.columns_dict if c not in _ERROR_COLUMNS]
    at = order.index("last_error") + 1
    order[at:at] = list(_ERROR_COLUMNS)
    if list(table.columns_dict) != order:
        seq = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'").fetchone()
        table.transform(column_order=order)
        if seq is not None:
            conn.execute("UPDATE sqlite_sequence SET seq = MAX(seq, ?) WHERE name = 'outbox'", (seq[0],))


def _chunks(ids: Sequence[_T]) -> Iterator[Sequence[_T]]:
    for i in range(0, len(ids), _CHUNK):
        yield ids[i : i + _CHUNK]


def _identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`, None if there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _ranges(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous runs of ids, so a batch of consecutive rows is one range statement."""
    out: list[tuple[int, int]] = []
    for i in sorted(ids):
        if out and i == out[-1][1] + 1:
            out[-1] = (out[-1][0], i)
        elif not out or i > out[-1][1]:
            out.append((i, i))
    return out




@contextmanager
def _zeroing_only_written_pages(c: sqlite3.Connection) -> Iterator[None]:
    """Delete delivered messages without overwriting their freed pages with zeros.

    Connections zero every deleted byte (secure_delete, set in `_open`), so deleting a delivered
    group wrote its ~270 KB of zeros to the WAL (19 ms of a 5,000-message settlement; 0.9 us/msg
    instead of 3.8 with FAST). FAST zeroes only within pages written anyway. So a delivered
    message's bytes can stay in the file's free pages until reused (they are in Kafka, and the
    file is owner-only); everything else (dead letters purged, rows rewritten) is zeroed.
    """
    c.execute("PRAGMA secure_delete = FAST")
    try:
        yield
    finally:
        c.execute("PRAGMA secure_delete = ON")


def _dead_index(flt: DeadLetterFilter) -> str:
    """Which index a dead-letter list walks when no selective column (ids, topic, error, key) is named.

    Without statistics SQLite takes the (status, next_attempt_at) index for `status = 2` and sorts
    every dead letter to find the first page (seconds at a million rows). Walking the dead rows
    in id order stops after one page when matches are common (group, text, no filter); a time
    filter reads only its window of failure times and sorts that (recent windows are small).
    The selective columns have their own (column, id) partial indexes, which SQLite picks by itself.
    """
    if flt.ids or flt.topic is not None or flt.error is not None or flt.key is not None:
        return ""
    if flt.since is not None:
        return "INDEXED BY outbox_dead_failed"
    return "INDEXED BY outbox_dead"


@dataclass(frozen=True, slots=True)
class _Group:
    """A group row ready to insert (`outbox.stores.grouped`)."""

    topic: str
    n: int
    due: float
    body: bytes
    keys: bytes | None
    owner: str | None  # born leased (write-ahead): due when the lease ends


#: Part of a write: one-message rows (`insert_values` tuples), or one group.
_Part = list[tuple[Any, ...]] | _Group


class SQLiteOutbox(Outbox):
    """The default outbox store, in one SQLite file.

    Args:
        path: the database file.
        create: create the file (owner-only permissions, 0600) if it does not exist. The CLI
            passes False so a mistyped path is an error, not a new empty outbox.
        synchronous: SQLite's `synchronous` pragma: "FULL" (default: a committed batch survives
            power loss) or "NORMAL" (survives a process crash; the last commits may be lost on
            power loss, at a much higher commit rate).
        busy_timeout: seconds to wait for another process's write lock.
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
        self._sweeps = SweepSchedule()
        self._gen = 0  # bumped when the file is re-created: every thread then opens a new connection
        self._writer_conn: sqlite3.Connection | None = None
        self._writer_gen = -1
        self._writer_sync = self._synchronous
        self._ident: tuple[int, int] | None = None  # (device, inode) of the file our connections use
        if not os.path.exists(self.path):
            if not create:
                raise StoreNotFoundError(f"outbox file {self.path} does not exist")
            self._create_file()
        elif not os.access(self.path, os.R_OK):
            raise StoreError(f"outbox file {self.path} is not readable")
        self.migrate()

    # -- connections -------------------------------------------------------------------------

    def _create_file(self) -> None:
        parent = os.path.dirname(self.path)
        try:
            os.makedirs(parent, exist_ok=True)
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            os.close(fd)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StoreError(f"cannot create outbox file {self.path}: {exc.strerror}") from exc

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
            self._ident = _identity(self.path)
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
        now = _identity(self.path)
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
        old = writer or self._all[0]
        try:
            rows = old.execute(f"SELECT {_ALL_COLUMNS} FROM outbox ORDER BY id").fetchall()
            bodies = old.execute("SELECT id, body, keys FROM outbox_body").fetchall()
            seq = old.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'").fetchone()
        except sqlite3.Error as exc:
            raise self._error(exc) from exc
        with self._lock:
            conns, self._all = self._all, []
            self._gen += 1
            self._ident = None
        for conn in conns:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
        for suffix in ("-wal", "-shm", "-journal"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path + suffix)
        self._create_file()
        conn = self._writer()
        try:
            conn.execute("BEGIN IMMEDIATE")
            self._migrate_in(conn, 0)
            conn.executemany(
                f"INSERT OR IGNORE INTO outbox ({_ALL_COLUMNS}) VALUES ({_ALL_PLACES})", rows
            )
            conn.executemany("INSERT OR IGNORE INTO outbox_body (id, body, keys) VALUES (?, ?, ?)", bodies)
            if seq is not None:
                conn.execute("DELETE FROM sqlite_sequence WHERE name = 'outbox'")
                conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('outbox', ?)", (seq[0],))
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise self._error(exc) from exc
        log.error(
            "outbox %s: the file was deleted while in use; re-created it with its %d row(s)", self.path, len(rows)
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
            self._migrate_in(c, c.execute("PRAGMA user_version").fetchone()[0])

    @staticmethod
    def _migrate_in(c: sqlite3.Connection, version: int) -> None:
        """From `version` to SCHEMA_VERSION, inside the caller's write transaction."""
        for v in range(version + 1, SCHEMA_VERSION + 1):
            if v == 2:
                _migrate_to_2(c)
                continue
            if v == 6:
                _migrate_to_6(c)
                continue
            for stmt in _MIGRATIONS[v]:
                c.execute(stmt)
        c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    # -- writes ------------------------------------------------------------------------------

    @staticmethod
    def _prepare(
        messages: Sequence[NewMessage],
        status: Status,
        lease_owner: str | None,
        lease_until: float | None,
        now: float,
    ) -> list[_Part]:
        """What storing `messages` writes, computed before the write lock is taken (encoding is
        per-message work; under the lock it held up every other writer of the process).

        A pending batch of GROUP_MIN or more becomes group rows (`outbox.stores.grouped`): each
        run of one topic, up to GROUP_MAX messages a row; a run shorter than GROUP_MIN, and any
        other batch, one row per message. Rows born leased (write-ahead) are grouped too: the
        writer hands their deliveries back per batch (`outbox.writeahead`), so a group is
        deleted whole.
        """
        if status is not Status.PENDING or len(messages) < grouped.GROUP_MIN:
            return [[insert_values(m, status, lease_owner, lease_until, now) for m in messages]] if messages else []
        owner = lease_owner if lease_until is not None else None  # as insert_values: both or neither
        if owner is None:
            lease_until = None
        parts: list[_Part] = []
        start = 0
        while start < len(messages):
            topic = messages[start].topic
            end = start + 1
            while end < len(messages) and end - start < grouped.GROUP_MAX and messages[end].topic == topic:
                end += 1
            run = messages[start:end]
            if len(run) < grouped.GROUP_MIN:
                parts.append([insert_values(m, status, owner, lease_until, now) for m in run])
            else:
                body, keys = grouped.encode(run)
                # Due when its lease ends, or when its latest message is: none of them is sent
                # before its time.
                due = max(m.next_attempt_at for m in run) if lease_until is None else lease_until
                parts.append(_Group(topic, len(run), due, body, keys, owner))
            start = end
        return parts

    @staticmethod
    def _insert(c: sqlite3.Connection, parts: Sequence[_Part], now: float) -> list[int]:
        """Write prepared rows and groups in this transaction; the stored messages' ids, in order."""
        ids: list[int] = []
        for part in parts:
            if isinstance(part, _Group):
                seq = c.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'").fetchone()
                gid = (seq[0] if seq else 0) + 1
                c.execute(
                    "INSERT INTO outbox (id, msg_id, topic, created_at, next_attempt_at, n, lease_owner) "
                    "VALUES (?, '', ?, ?, ?, ?, ?)",
                    (gid, part.topic, now, part.due, part.n, part.owner),
                )
                c.execute("INSERT INTO outbox_body (id, body, keys) VALUES (?, ?, ?)", (gid, part.body, part.keys))
                # AUTOINCREMENT: the next row's id comes after this group's message ids (the
                # group's own id is reserved, never a message's).
                c.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'outbox'", (gid + part.n,))
                ids += range(gid + 1, gid + part.n + 1)
            elif part:
                c.executemany(INSERT_SQL, part)
                # The write lock is ours for the whole transaction, so the ids are consecutive.
                last = c.execute("SELECT last_insert_rowid()").fetchone()[0]
                ids += range(last - len(part) + 1, last + 1)
        return ids

    def enqueue(
        self,
        messages: Sequence[NewMessage],
        *,
        lease_owner: str | None = None,
        lease_until: float | None = None,
    ) -> list[int]:
        now = time.time()
        parts = self._prepare(messages, Status.PENDING, lease_owner, lease_until, now)
        with self._write() as c:
            return self._insert(c, parts, now)

    def add_dead(self, messages: Sequence[NewMessage], *, failed_at: float) -> list[int]:
        parts = self._prepare(messages, Status.DEAD, None, None, failed_at)
        with self._write() as c:
            return self._insert(c, parts, failed_at)

    def _delete(self, c: sqlite3.Connection, ids: Sequence[int]) -> int:
        if not ids:
            return 0
        before = c.total_changes
        c.executemany(
            # "+status": keeps the planner on the primary key; with `status = 0` it picks the
            # outbox_due index and scans every pending row for each range.
            "DELETE FROM outbox WHERE id BETWEEN ? AND ? AND +status = 0", _ranges(ids)
        )
        return c.total_changes - before

    def _fail(self, c: sqlite3.Connection, failures: Sequence[Failure]) -> list[OutboxMessage]:
        if not failures:
            return []
        retry = [
            (f.error, f.code, f.name, f.failed_at, f.failed_at, f.retry_at, f.id)
            for f in failures if f.retry_at is not None
        ]
        dead = [(f.error, f.code, f.name, f.failed_at, f.failed_at, f.id) for f in failures if f.retry_at is None]
        if retry:
            c.executemany(
                "UPDATE outbox SET attempts = attempts + 1, last_error = ?, error_code = ?, error_name = ?, "
                "first_failed_at = COALESCE(first_failed_at, ?), last_failed_at = ?, "
                "next_attempt_at = ?, lease_owner = NULL WHERE id = ? AND status = 0",
                retry,
            )
        if not dead:
            return []
        # Only rows still PENDING are dead-lettered now: a row that is already dead must not be
        # returned again (the caller would hand it to on_dead_letter a second time).
        pending: list[int] = []
        for chunk in _chunks([d[-1] for d in dead]):
            pending += [
                r[0]
                for r in c.execute(
                    f"SELECT id FROM outbox WHERE status = 0 AND id IN ({','.join('?' * len(chunk))})",
                    list(chunk),
                )
            ]
        c.executemany(
            "UPDATE outbox SET attempts = attempts + 1, last_error = ?, error_code = ?, error_name = ?, status = 2, "
            "first_failed_at = COALESCE(first_failed_at, ?), last_failed_at = ?, lease_owner = NULL "
            "WHERE id = ? AND status = 0",
            dead,
        )
        ids = pending
        out: list[OutboxMessage] = []
        for chunk in _chunks(ids):
            out += [
                row_from_columns(r)
                for r in c.execute(
                    f"SELECT {_COLUMNS} FROM outbox WHERE status = 2 AND id IN ({','.join('?' * len(chunk))})",
                    list(chunk),
                )
            ]
        return out

    def _settle_groups(self, c: sqlite3.Connection, settlement: Settlement, now: float) -> int:
        """The groups among a settlement's messages: deleted when every message of one was
        delivered, released as one row when every message was given back, else exploded into
        one-message rows (less the delivered ones) that the rest of `apply` settles like any row.
        Returns how many delivered messages left with their group."""
        delivered = set(settlement.delivered)
        released = set(settlement.released)
        other = {f.id for f in settlement.failures} | released
        touched = delivered | other
        lo, hi = min(touched), max(touched)
        found = c.execute(
            "SELECT id, n FROM outbox INDEXED BY outbox_group WHERE n > 1 AND id BETWEEN ? AND ?",
            (lo - grouped.GROUP_MAX - 1, hi),
        ).fetchall()
        gone = 0
        for gid, n in found:
            members = range(gid + 1, gid + n + 1)
            done = [i for i in members if i in delivered]
            if len(done) == n:
                if c.execute("DELETE FROM outbox WHERE id = ? AND status = 0", (gid,)).rowcount:
                    gone += n
            elif all(i in released for i in members):
                # Given back whole (a stop, the cluster gone, a drain's next batch not sent): the
                # group stays one row, due now.
                c.execute("UPDATE outbox SET lease_owner = NULL, next_attempt_at = ? WHERE id = ? AND status = 0",
                          (now, gid))
            elif done or any(i in other for i in members):
                self._explode(c, gid, skip=set(done))
                gone += len(done)
        return gone

    @staticmethod
    def _explode(c: sqlite3.Connection, gid: int, *, skip: Collection[int] = ()) -> int:
        """Replace a group row with one row per message (their own ids; lease and created_at kept),
        leaving out the ids in `skip`. Returns how many rows it wrote."""
        row = c.execute(
            f"SELECT {_GROUP}, o.lease_owner FROM {_GROUPS} WHERE o.n > 1 AND o.id = ?", (gid,)
        ).fetchone()
        if row is None:
            return 0
        _, topic, created_at, due, _, body, owner = row
        rows = [
            (m.id, *insert_values(grouped.as_new(m), Status.PENDING, owner, due, created_at))
            for m in grouped.decode(body, gid, topic, created_at)
            if m.id not in skip
        ]
        c.execute("DELETE FROM outbox WHERE id = ?", (gid,))  # its body too (outbox_body_gone)
        c.executemany(
            f"INSERT INTO outbox (id, {', '.join(INSERT_COLUMNS)}) VALUES (?, {','.join('?' * len(INSERT_COLUMNS))})",
            rows,
        )
        return len(rows)

    def explode_groups(self) -> int:
        """Store every pending group as one-message rows; return how many rows that wrote.

        For readers that take rows one message at a time from the table itself (the Spark job's
        JDBC read). Groups stored after this call are left as they are.
        """
        with self._write() as c:
            groups = c.execute("SELECT id FROM outbox INDEXED BY outbox_group WHERE n > 1").fetchall()
            return sum(self._explode(c, gid) for (gid,) in groups)

    def apply(
        self,
        settlement: Settlement,
        *,
        now: float,
        new: Sequence[NewMessage] = (),
        lease_owner: str | None = None,
        lease_until: float | None = None,
    ) -> Applied:
        if not settlement and not new:
            return Applied([], 0, [])
        parts = self._prepare(new, Status.PENDING, lease_owner, lease_until, now)
        # Failures must last (attempt counts decide dead letters); new rows must last.
        with self._write(stores_messages=bool(new or settlement.failures)) as c:
            ids = self._insert(c, parts, now)
            with _zeroing_only_written_pages(c):
                deleted = self._settle_groups(c, settlement, now) if settlement else 0
                deleted += self._delete(c, settlement.delivered)
            dead = self._fail(c, settlement.failures)
            if settlement.released:
                c.executemany(
                    "UPDATE outbox SET lease_owner = NULL, next_attempt_at = ? WHERE id = ? AND status = 0",
                    [(now, i) for i in settlement.released],
                )
        return Applied(ids, deleted, dead)

    def claim(
        self, owner: str, limit: int, lease_seconds: float, *, now: float, topic: str | None = None,
        in_flight: Collection[int] = (),
    ) -> list[OutboxMessage]:
        if self._sweeps.due():
            self.release_gone_owners(now=now)
        # Cheap probe on the (status, next_attempt_at) index first: during an outage nothing is
        # due, and this keeps idle polls from scanning the table.
        due = self.next_due_at()
        if due is None or due > now:
            return []
        where = "status = 0 AND next_attempt_at <= ?"
        args: list[Any] = [now]
        if topic is not None:
            where += " AND topic = ?"
            args.append(topic)
        rows: list[tuple[Any, ...]] = []
        for _ in range(2):
            # Which rows to claim is read in a snapshot, outside the write lock: the spill writer
            # and other claimers write meanwhile (py-spy, recovering process: the writer waited for
            # that lock half its time while claims read their candidates' bodies under it).
            with self._snapshot() as c:
                candidates = self._candidates(c, where, args, limit)
                if not candidates:
                    return []
                rows, blocked_group = self._keep_key_order(c, candidates, now, in_flight)
            if blocked_group is None:
                break
            # A group holding a blocked key becomes one-message rows, so that the per-key rule
            # holds back only that key's messages and the claim goes on with the others.
            with self._write(stores_messages=False) as c:
                self._explode(c, blocked_group)  # leased meanwhile: it keeps its lease
            if rows:
                break
        if not rows:
            return []
        rows = self._lease(rows, owner, now, now + lease_seconds)
        out: list[OutboxMessage] = []
        for r in rows:
            if r[_BODY] is None:
                out.append(row_from_columns(r))
            else:
                out += grouped.decode(r[_BODY], r[0], r[2], r[9])
        return out

    def _lease(
        self, rows: list[tuple[Any, ...]], owner: str, now: float, until: float
    ) -> list[tuple[Any, ...]]:
        """Lease the rows a snapshot chose, up to the first one another writer took meanwhile.

        A row claimed, exploded or settled since the snapshot is not leased again (the UPDATE's
        WHERE sees the current state); the rows after it are given back, since they may continue
        its key. Everything else the snapshot decided still holds: rows that appear later have
        larger ids, and a row that stops being due meanwhile is one of these lost rows.
        """
        with self._write(stores_messages=False) as c:
            # Claimed ids are mostly contiguous: one range statement per run instead of one per row.
            leased: set[int] = set()
            for lo, hi in _ranges([r[0] for r in rows]):
                leased.update(
                    i for (i,) in c.execute(
                        "UPDATE outbox SET lease_owner = ?, next_attempt_at = ? "
                        "WHERE id BETWEEN ? AND ? AND +status = 0 AND next_attempt_at <= ? RETURNING id",
                        (owner, until, lo, hi, now),
                    )
                )
            if len(leased) == len(rows):
                return rows
            kept = list(itertools.takewhile(lambda r: r[0] in leased, rows))
            back = [(r[12], r[0]) for r in rows[len(kept):] if r[0] in leased]  # due as before
            c.executemany("UPDATE outbox SET lease_owner = NULL, next_attempt_at = ? WHERE id = ?", back)
        return kept

    def owner_liveness(self, owners: Sequence[str]) -> dict[str, Liveness]:
        """Alive, gone or unknown, for each lease owner (`outbox.owners.local_liveness`)."""
        return {o: local_liveness(o) for o in owners}

    def release_gone_owners(self, *, now: float) -> int:
        """Give back, due now, every lease whose owner's process is gone; return how many rows.

        Claimers call it at their first claim and then now and then (`SweepSchedule`), so a drain
        started after a crash on this host takes over at once. Owners on other hosts, or whose
        names are not `outbox.owners.new_owner`'s, keep their leases until they expire.
        """
        started = time.monotonic()
        try:
            owners = [
                r[0]
                for r in self._read(
                    "SELECT DISTINCT lease_owner FROM outbox "
                    "WHERE status = 0 AND next_attempt_at > ? AND lease_owner IS NOT NULL",
                    (now,),
                )
            ]
            gone = [o for o, live in self.owner_liveness(owners).items() if live is Liveness.GONE]
            if not gone:
                return 0
            with self._write() as c:
                before = c.total_changes
                c.executemany(
                    "UPDATE outbox SET lease_owner = NULL, next_attempt_at = ? "
                    "WHERE status = 0 AND lease_owner = ? AND next_attempt_at > ?",
                    [(now, o, now) for o in gone],
                )
                released = c.total_changes - before
        finally:
            self._sweeps.done(started)
        log.info(
            "outbox %s: released %d leased row(s) of %s (process gone)",
            self.path, released, ", ".join(describe_owner(o) for o in gone),
        )
        return released

    @staticmethod
    def _candidates(c: sqlite3.Connection, where: str, args: Sequence[Any], limit: int) -> list[tuple[Any, ...]]:
        """The first due rows, oldest first by id (primary-key order: no sort), up to `limit`
        messages: a group counts its n, and one larger than what is left of the limit is taken
        whole only as the first row."""
        cur = c.execute(
            f"SELECT {_CANDIDATE} FROM outbox AS o NOT INDEXED LEFT JOIN outbox_body AS b ON o.n > 1 AND b.id = o.id "
            f"WHERE {where} ORDER BY o.id LIMIT ?",
            [*args, limit],
        )
        rows: list[tuple[Any, ...]] = []
        count = 0
        for r in cur:
            if rows and count + r[_N] > limit:
                break
            rows.append(r)
            count += r[_N]
            if count >= limit:
                break
        cur.close()
        return rows

    @staticmethod
    def _keep_key_order(
        c: sqlite3.Connection, rows: list[tuple[Any, ...]], now: float, in_flight: Collection[int]
    ) -> tuple[list[tuple[Any, ...]], int | None]:
        """Drop rows that an earlier, not-yet-claimable row of the same key must precede.

        The candidates are the first due rows in id order, so any earlier pending row of the same
        key that is not among them is leased elsewhere or backing off: it blocks the later ones.
        Two queries over the not-due rows (the due index's range: other workers' leases and
        back-offs, few in a healthy drain) find each blocked key's first blocking id, among
        one-message rows and among groups (whose keys are in their `keys` blob). The claimer's own
        rows in flight do not block (see `Outbox.claim`); a group is in flight when its first
        message is. Keys are compared as the groups store them (`grouped.key_token` without its
        NULs), so a group's key list is split, never decoded.

        The claim ends before the first candidate group that holds a blocked key (what follows
        may continue its keys). Returns the rows to claim, and that group's id if one of its keys
        waits behind a back-off rather than a lease (None otherwise): the caller splits it.
        """
        last = rows[-1][0]
        sql = (
            "SELECT topic, key, MIN(id), MAX(lease_owner IS NULL) FROM outbox WHERE status = 0 "
            "AND next_attempt_at > ? AND id < ? AND key IS NOT NULL"
        )
        args: list[Any] = [now, last]
        if in_flight:
            sql += " AND id NOT IN (SELECT value FROM json_each(?))"
            args.append(json.dumps(list(in_flight)))
        blocked: dict[str, dict[bytes, int]] = {}  # topic -> key entry -> first blocking id
        backing_off: set[tuple[str, bytes]] = set()  # keys with a blocking row that is not leased
        flying = in_flight if isinstance(in_flight, (set, frozenset)) else set(in_flight)
        # Newest first: an older group's id overwrites a newer one's, leaving each key's first.
        for gid, topic, keys, free in c.execute(
            "SELECT o.id, o.topic, b.keys, o.lease_owner IS NULL FROM outbox AS o JOIN outbox_body AS b "
            "ON b.id = o.id WHERE o.status = 0 AND o.next_attempt_at > ? AND o.id < ? AND o.n > 1 "
            "AND b.keys IS NOT NULL ORDER BY o.id DESC",
            (now, last),
        ):
            if gid + 1 not in flying:
                entries = grouped.key_entries(keys)
                blocked.setdefault(topic, {}).update(dict.fromkeys(entries, gid))
                if free:
                    backing_off.update((topic, e) for e in entries)
        for topic, key, first, free in c.execute(sql + " GROUP BY topic, key", args):
            of_topic = blocked.setdefault(topic, {})
            entry = grouped.key_entry(key)
            if of_topic.get(entry, first + 1) > first:
                of_topic[entry] = first
            if free:
                backing_off.add((topic, entry))
        if not blocked:
            return rows, None
        kept: list[tuple[Any, ...]] = []
        for r in rows:
            rid, of_topic = r[0], blocked.get(r[2], {})
            if not of_topic:
                kept.append(r)
            elif r[_BODY] is None:
                if r[3] is None or rid < of_topic.get(grouped.key_entry(r[3]), rid + 1):
                    kept.append(r)
            else:
                entries = grouped.key_entries(r[_KEYS]) if r[_KEYS] is not None else []
                if not of_topic.keys().isdisjoint(entries):
                    waits = [e for e in entries if of_topic.get(e, rid + 1) < rid]
                    if waits:
                        # Behind a back-off (maybe long): split it. Behind a lease only (another
                        # worker's batch, settled in moments): leave it whole for the next claim.
                        split = any((r[2], e) in backing_off for e in waits)
                        return kept, rid if split else None
                kept.append(r)
        return kept, None

    # -- dead letters and reads --------------------------------------------------------------

    def get(self, id: int) -> OutboxMessage:
        rows = self._read(f"SELECT {_COLUMNS} FROM outbox WHERE id = ? AND n = 1", (id,))
        if rows:
            return row_from_columns(rows[0])
        # A message of a group: the group with the largest id below it, if its ids reach it.
        for m in self._group_messages(
            "o.id < ? AND o.id >= ? ORDER BY o.id DESC LIMIT 1", (id, id - grouped.GROUP_MAX)
        ):
            if m.id == id:
                return m
        raise UnknownMessageError(f"no message with id {id} in outbox {self.path}")

    def messages(self) -> list[OutboxMessage]:
        """Every message in the store, pending and dead, in id order (groups read message by
        message): for inspection and tests, not for hot paths."""
        with self._snapshot():
            out = [row_from_columns(r) for r in self._read(f"SELECT {_COLUMNS} FROM outbox WHERE n = 1")]
            out += self._group_messages("1", ())
        return sorted(out, key=lambda m: m.id)

    def _group_messages(self, where: str, args: Sequence[Any]) -> list[OutboxMessage]:
        """The messages of the groups matching `where`, each due when its group is (its lease)."""
        out: list[OutboxMessage] = []
        for gid, topic, created_at, due, _, body in self._read(
            f"SELECT {_GROUP} FROM {_GROUPS} WHERE o.n > 1 AND {where}", args
        ):
            out += [m._replace(next_attempt_at=due) for m in grouped.decode(body, gid, topic, created_at)]
        return out

    def list_dead(self, flt: DeadLetterFilter = DeadLetterFilter()) -> list[OutboxMessage]:
        where, args = dead_letter_where(flt, "?")
        sql = f"SELECT {_COLUMNS} FROM outbox {_dead_index(flt)} WHERE {where} ORDER BY id"
        if flt.limit is not None:
            sql += " LIMIT ?"
            args.append(flt.limit)
        return [row_from_columns(r) for r in self._read(sql, args)]

    def purge_dead(self, flt: DeadLetterFilter = DeadLetterFilter()) -> int:
        where, args = dead_letter_where(flt, "?")
        with self._write() as c:
            return c.execute(f"DELETE FROM outbox WHERE {where}", args).rowcount

    def replay_dead(
        self, flt: DeadLetterFilter = DeadLetterFilter(), *, now: float, to_topic: str | None = None
    ) -> int:
        where, args = dead_letter_where(flt, "?")
        with self._write() as c:
            return c.execute(
                "UPDATE outbox SET status = 0, attempts = 0, next_attempt_at = ?, lease_owner = NULL, "
                f"topic = COALESCE(?, topic) WHERE {where}",
                [now, to_topic, *args],
            ).rowcount

    def count_dead(self, flt: DeadLetterFilter = DeadLetterFilter()) -> int:
        where, args = dead_letter_where(flt, "?")
        count: int = self._read(f"SELECT COUNT(*) FROM outbox WHERE {where}", args)[0][0]
        return count

    def redrive_edited(
        self, id: int, *, value: bytes | None, headers: list[tuple[str, bytes | None]], now: float
    ) -> bool:
        with self._write() as c:
            return c.execute(
                "UPDATE outbox SET value = ?, headers = ?, status = 0, attempts = 0, next_attempt_at = ?, "
                "lease_owner = NULL WHERE id = ? AND status = 2",
                (value, encode_headers(headers), now, id),
            ).rowcount == 1

    def trace(self, msg_id: str) -> list[OutboxMessage]:
        # Dead letters on the partial index, pending rows by a scan of the backlog (see _MIGRATIONS[3]).
        rows = self._read(
            f"SELECT {_COLUMNS} FROM outbox WHERE msg_id = ? AND status = 2 UNION ALL "
            f"SELECT {_COLUMNS} FROM outbox WHERE msg_id = ? AND status = 0 ORDER BY 1",
            (msg_id, msg_id),
        )
        found = [row_from_columns(r) for r in rows]
        # In a group: only the bodies holding the id's bytes are decoded.
        found += [m for m in self._group_messages("instr(b.body, ?) > 0", (msg_id.encode(),)) if m.msg_id == msg_id]
        return sorted(found, key=lambda m: m.id)

    def add_audit(self, *, who: str, action: str, filter: str, count: int, at: float) -> int:
        with self._write() as c:
            cur = c.execute(
                "INSERT INTO outbox_audit (at, who, action, filter, count) VALUES (?, ?, ?, ?, ?)",
                (at, who, action, filter, count),
            )
            return int(cur.lastrowid or 0)

    def audit_log(self, *, limit: int = 100, before_id: int | None = None) -> list[AuditEntry]:
        rows = self._read(
            "SELECT id, at, who, action, filter, count FROM outbox_audit WHERE id < ? ORDER BY id DESC LIMIT ?",
            (before_id if before_id is not None else 2**63 - 1, limit),
        )
        return [AuditEntry(*r) for r in rows]

    def has_pending(self, topic: str, key: bytes) -> bool:
        return bool(
            self._read("SELECT 1 FROM outbox WHERE topic = ? AND key = ? AND status = 0 LIMIT 1", (topic, key))
            or self._read(
                f"SELECT 1 FROM {_GROUPS} WHERE o.n > 1 AND o.topic = ? AND instr(b.keys, ?) > 0 LIMIT 1",
                (topic, grouped.key_token(key)),
            )
        )

    def pending_keys(self) -> set[tuple[str, bytes]]:
        rows = self._read("SELECT DISTINCT topic, key FROM outbox WHERE status = 0 AND key IS NOT NULL")
        keys = {(t, bytes(k)) for t, k in rows}
        for topic, blob in self._read(
            f"SELECT o.topic, b.keys FROM {_GROUPS} WHERE o.n > 1 AND b.keys IS NOT NULL"
        ):
            keys.update((topic, k) for k in grouped.keys_of(blob))
        return keys

    def keys_with_pending(self, keys: Sequence[tuple[str, bytes]]) -> set[tuple[str, bytes]]:
        by_topic: dict[str, list[bytes]] = {}
        for topic, key in keys:
            by_topic.setdefault(topic, []).append(key)
        found: set[tuple[str, bytes]] = set()
        for topic, ks in by_topic.items():
            for chunk in _chunks(ks):
                # EXISTS per key stops at the key's first pending row on the outbox_key index
                # (`+status` keeps the planner off outbox_due, where it scanned pending rows
                # until it met the key). The DISTINCT over `key IN (...)` it replaces visited
                # every row of every key: ~40% of a recovering process's time (py-spy).
                found.update(
                    (topic, bytes(r[0]))
                    for r in self._read(
                        f"WITH k(key) AS (VALUES {','.join(['(?)'] * len(chunk))}) SELECT key FROM k "
                        "WHERE EXISTS (SELECT 1 FROM outbox AS o "
                        "WHERE o.topic = ? AND o.key = k.key AND +o.status = 0)",
                        [*chunk, topic],
                    )
                )
        rest = {k for k in keys if k not in found}
        return found | self._keys_in_groups(rest) if rest else found

    def _keys_in_groups(self, keys: set[tuple[str, bytes]]) -> set[tuple[str, bytes]]:
        """Which of these keys some group holds. Newest groups first, stopping once all are
        found: a key still in use is in the latest groups, so only a key that has left the
        store (or a rare one) costs a look at every group's key list."""
        wanted: dict[str, dict[bytes, bytes]] = {}
        for topic, key in keys:
            wanted.setdefault(topic, {})[grouped.key_entry(key)] = key
        found: set[tuple[str, bytes]] = set()
        left = len(keys)
        try:
            cur = self._conn().execute(
                f"SELECT o.topic, b.keys FROM {_GROUPS} WHERE o.n > 1 AND b.keys IS NOT NULL ORDER BY o.id DESC"
            )
            for topic, blob in cur:
                want = wanted.get(topic)
                if not want:
                    continue
                for entry in want.keys() & set(grouped.key_entries(blob)):
                    found.add((topic, want.pop(entry)))
                    left -= 1
                if not left:
                    break
            cur.close()
        except sqlite3.Error as exc:
            raise self._error(exc) from exc
        return found

    def next_due_at(self) -> float | None:
        due: float | None = self._read("SELECT MIN(next_attempt_at) FROM outbox WHERE status = 0")[0][0]
        return due

    def stats(self, *, now: float) -> StoreStats:
        # Counted from indexes alone, never from the rows (which carry the message bytes): a
        # backlog of 300k rows took 365 ms to count by reading them, 90 ms from the indexes; the
        # recovery benchmark's sampler and a metrics scrape pay this while the backlog drains.
        # Every row is PENDING or DEAD (`Status`), so the pending rows of a topic are all of its
        # rows (the `outbox_key` index) less its dead letters (their partial index).
        with self._snapshot():
            all_rows = self._read("SELECT topic, COUNT(*) FROM outbox INDEXED BY outbox_key GROUP BY topic")
            # A group is one row of the key index and n messages (its partial index says how many).
            more = dict(
                self._read(
                    "SELECT topic, SUM(n) - COUNT(*) FROM outbox INDEXED BY outbox_group WHERE n > 1 GROUP BY topic"
                )
            )
            dead_rows = self._read(
                "SELECT topic, COUNT(*) FROM outbox INDEXED BY outbox_dead_topic WHERE status = 2 GROUP BY topic"
            )
            # Rows are leased by moving next_attempt_at past now: only the due index's not-due range.
            leased = self._read(
                "SELECT COALESCE(SUM(n), 0) FROM outbox WHERE status = 0 AND next_attempt_at > ? "
                "AND lease_owner IS NOT NULL",
                (now,),
            )[0][0]
            # The oldest pending message is the first in id order: ids follow insertion, and
            # created_at is set just before it (a dead letter replayed keeps both).
            oldest = self._read(
                "SELECT created_at FROM outbox WHERE id = "
                "(SELECT MIN(id) FROM outbox INDEXED BY outbox_due WHERE status = 0)"
            )
            next_due = self._read("SELECT MIN(next_attempt_at) FROM outbox WHERE status = 0")[0][0]
        dead_by_topic = {topic: count for topic, count in dead_rows}
        pending_by_topic = {
            t: n + more.get(t, 0) - dead_by_topic.get(t, 0) for t, n in all_rows if n > dead_by_topic.get(t, 0)
        }
        return StoreStats(
            pending=sum(pending_by_topic.values()),
            dead=sum(dead_by_topic.values()),
            leased=leased,
            oldest_pending_at=oldest[0][0] if oldest else None,
            next_due_at=next_due,
            pending_by_topic=pending_by_topic,
            dead_by_topic=dead_by_topic,
            dead_by_error=self._dead_by_error(),
        )

    def _dead_by_error(self) -> dict[str, int]:
        """Dead letters by "NAME (code)" (the name alone when there is no code; "?" without either).

        Counted by name on the name's partial index; the code is read from the name's first row:
        a librdkafka name has exactly one code, a consumer's exception class has none.
        """
        out: dict[str, int] = {}
        by_name = self._read(
            "SELECT error_name, COUNT(*) FROM outbox INDEXED BY outbox_dead_error_name WHERE status = 2 "
            "GROUP BY error_name"
        )
        for name, count in by_name:
            if name is None:
                out["?"] = count
                continue
            code = self._read(
                "SELECT error_code FROM outbox INDEXED BY outbox_dead_error_name "
                "WHERE status = 2 AND error_name = ? ORDER BY id LIMIT 1",
                (name,),
            )[0][0]
            out[name if code is None else f"{name} ({code})"] = count
        return out

    def backlog(self, *, now: float, topic: str | None = None) -> Backlog:
        sql, args = backlog_sql("outbox", "?", now, topic, count="SUM(r.n)")
        return backlog_from_rows(self._read(sql, args), self.owner_liveness)

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
