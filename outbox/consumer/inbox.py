"""The inbox: which `outbox-id`s a consumer group has handled, so that a copy is skipped.

`ResilientConsumer(..., dedup=True)` keeps one mark per handled message, (group, outbox-id, time),
in a table of its own next to the consumer's outbox: ``outbox_inbox`` in the SQLite file, or
``<table>_inbox`` beside the PostgreSQL outbox table. Marks older than `window` seconds are
pruned once a minute, so a copy that arrives later than the window after the first is handled
again.

Two ways to handle a message:

* ``handler(msg)``: at least once, deduplicated. SQLite: the batch's ids are looked up in one
  query before the batch; the marks of the messages handled are written in one transaction
  after it (synchronous=NORMAL), so no write lock is held while the handlers run. PostgreSQL: as
  ``handler(msg, tx)`` below without the savepoints: the batch's transaction (synchronous_commit
  =off) opens with one statement that inserts its marks, and commits after it. Either way the
  marks commit before the batch's offsets are stored, and survive a crash of this process (a
  power cut or a server crash may lose the last ones: a later copy then runs again). A crash
  before that commit makes the batch's messages run again; every copy after it is skipped.
* ``handler(msg, tx)``: one transaction per poll batch on the inbox's connection `tx`. It opens
  at the batch's first message to handle with one statement that inserts the batch's marks
  (an id whose mark was there, or another member's, is a duplicate and skipped); each message
  then runs in a savepoint, released when the handler returns. A handler that raises rolls back
  to its savepoint and its mark is deleted: its writes and its mark both vanish; the batch so far
  then commits at once (the consumer writes the failed message's hop or dead letter next, on
  SQLite with the write lock free), and the rest of the batch runs in a new transaction. At the
  end the marks of messages not reached (a held partition) are deleted, the transaction
  commits, and only then are the batch's offsets stored. Effectively once: a crash anywhere
  leaves, for each message, both its writes and its mark or neither, and no offset is stored
  past an uncommitted mark. A commit that fails raises `InboxCommitFailed`, and the consumer
  reads the batch again from its first messages (a message whose mark did commit is skipped).

A message without an `outbox-id` header is handled as without dedup.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import Message

from outbox.errors import ConfigError, StoreError
from outbox.headers import ID_HEADER
from outbox.stores import Outbox

DEFAULT_WINDOW = 7 * 24 * 3600.0  #: seconds a mark is kept: a copy later than this is handled again
_PRUNE_EVERY = 60.0
_ID = ID_HEADER


class InboxCommitFailed(StoreError):
    """The batch's marks (and a transactional handler's writes) did not commit: the batch must be read again."""


def takes_transaction(handler: Callable[..., Any]) -> bool:
    """Does `handler` take two positional parameters, ``handler(msg, tx)``?"""
    try:
        params = inspect.signature(handler).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or (len(positional) == 1 and any(p.kind is p.VAR_POSITIONAL for p in params))


def message_id(m: Message) -> str | None:
    """The `outbox-id` header of `m` (the first one), or None."""
    headers = m.headers()
    if headers:
        for h in headers:
            if h[0] == _ID and h[1] is not None:
                value = h[1]
                return value.decode() if isinstance(value, bytes) else str(value)
    return None


class Inbox:
    """One consumer group's marks in its store (see the module doc). Used by the loop thread only."""

    def __init__(self, store: Outbox, group: str, *, window: float = DEFAULT_WINDOW, transactional: bool) -> None:
        if not window > 0:
            raise ConfigError(f"dedup_window must be a positive number of seconds, got {window!r}")
        self.group = group
        self.window = float(window)
        self.transactional = transactional
        self.duplicates = 0
        self._ids: dict[int, str | None] = {}  # the batch's messages (by object id) → outbox-id
        self._seen: set[str] = set()  # not _claims: the batch's ids marked already (or to be)
        self._pending: list[str] = []  # not _claims: the ids handled, to mark
        self._open = False  # _claims: the batch's transaction is open
        self._claimed: set[str] = set()  # _claims: marked in the open transaction, not yet run
        self._to_claim: set[str] = set()  # _claims: the batch's ids to mark when it opens
        self._next_prune = 0.0
        url = getattr(store, "url", None)
        if url is not None and getattr(url, "kind", "") == "postgresql":
            self._db: _Db = _Postgres(url, durable=transactional)
        elif isinstance(getattr(store, "path", None), str):
            # handler(msg): a mark lost to a power cut (WAL, synchronous=NORMAL keeps it through a
            # process crash) only lets a later copy run again, which that handler allows anyway.
            # handler(msg, tx): the handler's writes are in the commit: the store's own setting.
            sync = getattr(store, "_synchronous", "FULL") if transactional else "NORMAL"
            self._db = _SQLite(store.path, sync)  # type: ignore[attr-defined]
        else:
            raise ConfigError(f"dedup=True needs a SQLite or PostgreSQL outbox (got {type(store).__name__})")
        # The batch's marks inserted when its transaction opens, committed when it ends (see the
        # module doc): handler(msg, tx) always; handler(msg) on PostgreSQL, where that one
        # statement replaces a lookup and an insert and locks only the batch's marks.
        self._claims = transactional or isinstance(self._db, _Postgres)

    @property
    def connection(self) -> Any:
        """The inbox's DB-API connection: the `tx` a transactional handler gets."""
        return self._db.conn

    def begin(self, msgs: Sequence[Message]) -> None:
        """Before a batch: read its ids; handler(msg): learn which were handled already (one query)."""
        ids = list(map(message_id, msgs))
        self._ids = dict(zip(map(id, msgs), ids, strict=True))  # each header read once per batch
        wanted = {i for i in ids if i is not None}
        if self._claims:
            self._to_claim = wanted
        else:
            self._seen = self._db.marked(self.group, list(wanted)) if wanted else set()

    def handle(self, m: Message, handler: Callable[..., Any]) -> bool:
        """Run `handler` on `m` unless it was handled already. False: a duplicate, skipped."""
        mid = self._ids.get(id(m))
        if self._claims:
            return self._handle_claimed(m, mid, handler)
        if mid is None:
            handler(m)
            return True
        if mid in self._seen:
            self.duplicates += 1
            return False
        handler(m)
        self._seen.add(mid)
        self._pending.append(mid)
        return True

    def _handle_claimed(self, m: Message, mid: str | None, handler: Callable[..., Any]) -> bool:
        """In the batch's transaction, whose first statement marked the batch's ids."""
        if not self._open:
            to_claim, self._to_claim = self._to_claim, set()
            self._claimed = self._db.open(self.group, sorted(to_claim), time.time())
            self._open = True
        if mid is not None:
            if mid not in self._claimed:
                self.duplicates += 1
                return False
            self._claimed.remove(mid)
        try:
            if self.transactional:
                self._db.attempt(handler, m)
            else:
                handler(m)
        except InboxCommitFailed:
            self._open = False
            raise
        except BaseException:
            # Its writes (handler(msg, tx)) are rolled back to its savepoint; its mark goes too,
            # and a copy later in the batch may run. The batch so far commits before the
            # consumer writes the hop.
            if mid is not None:
                self._unmark(mid)
                self._claimed.add(mid)
            self.settle()
            raise
        return True

    def _unmark(self, mid: str) -> None:
        try:
            self._db.unmark(self.group, mid)
        except Exception as exc:
            self._open = False
            self._db.rollback()
            raise InboxCommitFailed(f"inbox: a failed message's mark was not deleted ({type(exc).__name__})") from exc

    def settle(self) -> None:
        """Commit the batch's transaction so far, if one is open: the marks of
        messages not run yet are deleted, to be inserted again if the batch goes on."""
        if self._open:
            self._open = False
            unclaimed, self._claimed = self._claimed, set()
            self._to_claim |= unclaimed
            self._db.commit(self.group, sorted(unclaimed))

    def commit(self) -> None:
        """After a batch, before its offsets are stored: commit its marks; prune now and then.

        Raises:
            InboxCommitFailed: nothing of the batch since its last commit holds; read it again.
        """
        self.settle()
        self._to_claim = set()
        self._ids = {}
        now = time.time()
        if self._pending:
            pending, self._pending = self._pending, []
            try:
                self._db.mark(self.group, pending, now)
            except Exception as exc:
                raise InboxCommitFailed(f"inbox: the batch's marks did not commit ({type(exc).__name__})") from exc
        if now >= self._next_prune:
            self._next_prune = now + _PRUNE_EVERY
            self._db.prune(self.group, now - self.window)

    def rewound(self) -> None:
        """The consumer reads the batch again: forget what it left behind."""
        self._pending = []
        self._ids = {}
        self._claimed = set()
        self._to_claim = set()
        if self._open:
            self._open = False
            self._db.rollback()

    def close(self) -> None:
        self._db.close()


class _Db:
    conn: Any

    # handler(msg) without the batch's transaction (SQLite): a lookup before, the marks after.
    def marked(self, group: str, ids: list[str]) -> set[str]:
        raise NotImplementedError

    def mark(self, group: str, ids: list[str], now: float) -> None:
        raise NotImplementedError

    # The batch's transaction (Inbox._claims). Each raises InboxCommitFailed (rolled back) when
    # the transaction is lost, except attempt, which raises the handler's own exception too.
    def open(self, group: str, ids: list[str], now: float) -> set[str]:
        """Begin the transaction and insert the marks of `ids`: those inserted (the others were there)."""
        raise NotImplementedError

    def attempt(self, handler: Callable[..., Any], m: Message) -> None:
        """``handler(m, conn)`` in a savepoint; if it raises, rolled back to it and raised again."""
        raise NotImplementedError

    def unmark(self, group: str, mid: str) -> None:
        raise NotImplementedError

    def commit(self, group: str, unclaimed: list[str]) -> None:
        """Delete the marks `unclaimed`, commit."""
        raise NotImplementedError

    def rollback(self) -> None:
        """Abandon the transaction (the batch is read again); never raises."""
        raise NotImplementedError

    def prune(self, group: str, before: float) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.conn.close()


class _SQLite(_Db):
    _TABLE = "outbox_inbox"

    def __init__(self, path: str, synchronous: str) -> None:
        try:
            # isolation_level=None: BEGIN / COMMIT are ours; the handler's writes join them.
            self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self.conn.execute("PRAGMA busy_timeout = 30000")
            self.conn.execute(f"PRAGMA synchronous = {synchronous}")
            self.conn.execute(
                f"CREATE TABLE IF NOT EXISTS {self._TABLE} (grp TEXT NOT NULL, msg_id TEXT NOT NULL, "
                "handled_at REAL NOT NULL, PRIMARY KEY (grp, msg_id)) WITHOUT ROWID"
            )
            self.conn.execute(f"CREATE INDEX IF NOT EXISTS {self._TABLE}_age ON {self._TABLE} (grp, handled_at)")
        except sqlite3.Error as exc:
            raise StoreError(f"inbox {path}: {exc}") from exc
        self._path = path
        self._savepoints = self.conn.cursor()

    # The ids travel as one JSON array (json_each unpacks it in C): a third of the CPU of
    # executemany or of an IN list of parameters, per id.
    def marked(self, group: str, ids: list[str]) -> set[str]:
        rows = self.conn.execute(
            f"SELECT msg_id FROM {self._TABLE} WHERE grp = ? AND msg_id IN (SELECT value FROM json_each(?))",
            (group, json.dumps(ids)),
        )
        return {r[0] for r in rows}

    def mark(self, group: str, ids: list[str], now: float) -> None:
        with self._tx():
            self.conn.execute(
                f"INSERT OR IGNORE INTO {self._TABLE} SELECT ?, value, ? FROM json_each(?)",
                (group, now, json.dumps(ids)),
            )

    def open(self, group: str, ids: list[str], now: float) -> set[str]:
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            if not ids:
                return set()
            rows = self.conn.execute(
                f"INSERT OR IGNORE INTO {self._TABLE} SELECT ?, value, ? FROM json_each(?) RETURNING msg_id",
                (group, now, json.dumps(ids)),
            ).fetchall()
        except sqlite3.Error as exc:
            self.rollback()
            raise InboxCommitFailed(f"inbox {self._path}: the batch's transaction did not begin: {exc}") from exc
        return {r[0] for r in rows}

    def attempt(self, handler: Callable[..., Any], m: Message) -> None:
        execute = self._savepoints.execute  # one cursor for them: a third less CPU than conn.execute's new one
        execute("SAVEPOINT msg")
        try:
            handler(m, self.conn)
        except BaseException:
            try:
                execute("ROLLBACK TO msg")
                execute("RELEASE msg")
            except sqlite3.Error as exc:
                self.rollback()
                raise InboxCommitFailed(f"inbox {self._path}: rollback to the message's savepoint: {exc}") from exc
            raise
        execute("RELEASE msg")

    def unmark(self, group: str, mid: str) -> None:
        self.conn.execute(f"DELETE FROM {self._TABLE} WHERE grp = ? AND msg_id = ?", (group, mid))

    def commit(self, group: str, unclaimed: list[str]) -> None:
        try:
            if unclaimed:
                self.conn.execute(
                    f"DELETE FROM {self._TABLE} WHERE grp = ? AND msg_id IN (SELECT value FROM json_each(?))",
                    (group, json.dumps(unclaimed)),
                )
            self.conn.execute("COMMIT")
        except sqlite3.Error as exc:
            self.rollback()
            raise InboxCommitFailed(f"inbox {self._path}: the batch did not commit: {exc}") from exc

    def rollback(self) -> None:
        if self.conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):  # no transaction left to end
                self.conn.execute("ROLLBACK")

    def prune(self, group: str, before: float) -> None:
        with self._tx():
            self.conn.execute(f"DELETE FROM {self._TABLE} WHERE grp = ? AND handled_at < ?", (group, before))

    def _tx(self) -> _SQLiteTx:
        return _SQLiteTx(self.conn)


class _SQLiteTx:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any exception."""

    __slots__ = ("conn",)

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.conn.execute("COMMIT")
        elif self.conn.in_transaction:
            self.conn.execute("ROLLBACK")


class _Postgres(_Db):
    def __init__(self, url: Any, *, durable: bool) -> None:
        import psycopg

        self._psycopg = psycopg
        self._t = f'"{url.schema}"."{url.table}_inbox"'
        self._where = url.where()
        self._kwargs = url.psycopg_kwargs()
        self._durable = durable
        self._in_savepoint = False
        self._in_error = psycopg.pq.TransactionStatus.INERROR
        self._command_ok = psycopg.pq.ExecStatus.COMMAND_OK
        try:
            self.conn = self._connect()
            self.conn.execute(
                f"CREATE TABLE IF NOT EXISTS {self._t} (grp TEXT NOT NULL, msg_id TEXT NOT NULL, "
                "handled_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (grp, msg_id))"
            )
            self.conn.execute(
                f'CREATE INDEX IF NOT EXISTS "{url.table}_inbox_age" ON {self._t} (grp, handled_at)'
            )
        except psycopg.Error as exc:
            raise StoreError(f"inbox in PostgreSQL {self._where}: {type(exc).__name__}") from None

    def _connect(self) -> Any:
        conn = self._psycopg.connect(**self._kwargs, autocommit=True)
        if not self._durable:
            # handler(msg)'s marks, as SQLite's synchronous=NORMAL (see the module doc): a commit
            # does not wait for the server's WAL flush, which was most of a batch's time.
            conn.execute("SET synchronous_commit = off")
        return conn

    def _live(self) -> Any:
        """The connection; a new one if the last was lost (a server restart): the loop goes on."""
        if self.conn.closed:
            try:
                self.conn = self._connect()
            except self._psycopg.Error as exc:
                reason = type(exc).__name__
                raise StoreError(f"inbox in PostgreSQL {self._where}: cannot reconnect ({reason})") from None
        return self.conn

    # Both handler forms run in the batch's transaction (Inbox._claims). The ids travel as a binary
    # text[] (%b): half the client's CPU of the text form, which quotes each element. The
    # savepoints (handler(msg, tx)) go through libpq directly (one round trip each, about half the
    # CPU of a psycopg execute); psycopg reads the transaction's state from libpq, so the
    # handler's own statements and transaction blocks see it as it is.
    def open(self, group: str, ids: list[str], now: float) -> set[str]:
        try:
            conn = self._live()
            self._exec(b"BEGIN")
            self._in_savepoint = False
            if not ids:
                return set()
            # In the ids' order: two members marking overlapping batches wait, never deadlock.
            rows = conn.execute(
                f"INSERT INTO {self._t} SELECT %s, u, %s FROM unnest(%b::text[]) AS u ORDER BY u "
                "ON CONFLICT DO NOTHING RETURNING msg_id",
                (group, now, ids),
            )
            return {r[0] for r in rows}
        except (self._psycopg.Error, StoreError) as exc:
            self.rollback()
            raise InboxCommitFailed(f"inbox in PostgreSQL {self._where}: the batch's transaction did not begin: "
                                    f"{type(exc).__name__}") from None

    def attempt(self, handler: Callable[..., Any], m: Message) -> None:
        conn = self.conn
        self._exec(b"RELEASE SAVEPOINT msg; SAVEPOINT msg" if self._in_savepoint else b"SAVEPOINT msg")
        self._in_savepoint = True
        try:
            handler(m, conn)
            if conn.pgconn.transaction_status == self._in_error:
                raise StoreError("handler(msg, tx) returned with its transaction failed (a statement failed)")
        except BaseException:
            self._in_savepoint = False
            self._exec(b"ROLLBACK TO SAVEPOINT msg; RELEASE SAVEPOINT msg")
            raise

    def unmark(self, group: str, mid: str) -> None:
        self.conn.execute(f"DELETE FROM {self._t} WHERE grp = %s AND msg_id = %s", (group, mid))

    def commit(self, group: str, unclaimed: list[str]) -> None:
        try:
            if unclaimed:
                self.conn.execute(
                    f"DELETE FROM {self._t} WHERE grp = %s AND msg_id = ANY(%b::text[])", (group, unclaimed)
                )
        except self._psycopg.Error as exc:
            self.rollback()
            raise InboxCommitFailed(f"inbox in PostgreSQL {self._where}: {type(exc).__name__}") from None
        self._exec(b"COMMIT")

    def rollback(self) -> None:
        if not self.conn.closed:
            with contextlib.suppress(self._psycopg.Error):  # a lost connection: the server rolled it back
                self.conn.execute("ROLLBACK")

    def _exec(self, command: bytes) -> None:
        """Run `command` (statements without parameters); InboxCommitFailed (rolled back) if it failed."""
        try:
            result = self.conn.pgconn.exec_(command)
        except self._psycopg.Error as exc:  # no result at all: the connection is gone
            self.rollback()
            reason = type(exc).__name__
            raise InboxCommitFailed(f"inbox in PostgreSQL {self._where}: {command.decode()}: {reason}") from None
        if result.status != self._command_ok:
            reason = (result.error_field(self._psycopg.pq.DiagnosticField.SQLSTATE) or b"").decode() or "no result"
            self.rollback()
            raise InboxCommitFailed(f"inbox in PostgreSQL {self._where}: {command.decode()}: failed ({reason})")

    def prune(self, group: str, before: float) -> None:
        self._live().execute(f"DELETE FROM {self._t} WHERE grp = %s AND handled_at < %s", (group, before))
