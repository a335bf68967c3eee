"""The inbox: which `outbox-id`s a consumer group has handled, so that a copy is skipped.

`ResilientConsumer(..., dedup=True)` keeps one mark per handled message, (group, outbox-id, time),
in a table of its own next to the consumer's outbox: ``outbox_inbox`` in the SQLite file, or
``<table>_inbox`` beside the PostgreSQL outbox table. Marks older than `window` seconds are
pruned once a minute, so a copy that arrives later than the window after the first is handled
again.

Two ways to handle a message:

* ``handler(msg)``: the batch's ids are looked up in one query before the batch; the marks of
  the messages handled are written in one transaction after it, before the offsets are stored
  (SQLite: synchronous=NORMAL; PostgreSQL: synchronous_commit=off: durable through a crash of
  this process; a power cut or a server crash may lose the last marks, and then a later copy
  runs again, as at least once allows).
  A crash between the handler and that commit makes the batch's messages run again: at least
  once, and every copy that arrives after the commit is skipped.
* ``handler(msg, tx)``: each message in its own transaction on the inbox's connection `tx`:
  the mark is inserted first (a copy finds it and is skipped), then the handler runs, and its
  writes commit with the mark. A handler that raises rolls both back. Effectively once: a crash
  anywhere leaves either both or neither, and the offset is stored only after the commit.
  One transaction per message, not per batch: a failed message's hop and dead letter are
  written by the consumer while no inbox transaction holds the store's write lock.

A message without an `outbox-id` header is handled as without dedup.
"""

from __future__ import annotations

import inspect
import json
import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import Message

from ..errors import ConfigError, StoreError
from ..headers import ID_HEADER
from ..stores import Outbox

DEFAULT_WINDOW = 7 * 24 * 3600.0  #: seconds a mark is kept: a copy later than this is handled again
_PRUNE_EVERY = 60.0
_ID = ID_HEADER


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
        self._seen: set[str] = set()  # the batch's ids already marked (or to be)
        self._ids: dict[int, str | None] = {}  # the batch's messages (by object id) → outbox-id
        self._pending: list[str] = []
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

    @property
    def connection(self) -> Any:
        """The inbox's DB-API connection: the `tx` a transactional handler gets."""
        return self._db.conn

    def begin(self, msgs: Sequence[Message]) -> None:
        """Before a batch: learn which of its ids were handled already (one query)."""
        if self.transactional:
            return
        ids = list(map(message_id, msgs))
        self._ids = dict(zip(map(id, msgs), ids, strict=True))  # each header read once per batch
        wanted = [i for i in ids if i is not None]
        self._seen = self._db.marked(self.group, wanted) if wanted else set()

    def handle(self, m: Message, handler: Callable[..., Any]) -> bool:
        """Run `handler` on `m` unless it was handled already. False: a duplicate, skipped."""
        mid = message_id(m) if self.transactional else self._ids.get(id(m))
        if mid is None:
            if self.transactional:
                self._db.run(handler, m, None, self.group, 0.0)
            else:
                handler(m)
            return True
        if self.transactional:
            if self._db.run(handler, m, mid, self.group, time.time()):
                return True
            self.duplicates += 1
            return False
        if mid in self._seen:
            self.duplicates += 1
            return False
        handler(m)
        self._seen.add(mid)
        self._pending.append(mid)
        return True

    def commit(self) -> None:
        """After a batch, before its offsets are stored: write the marks; prune now and then."""
        now = time.time()
        if self._pending:
            self._db.mark(self.group, self._pending, now)  # kept on failure: the next batch's commit retries
            self._pending = []
        self._ids = {}
        if now >= self._next_prune:
            self._next_prune = now + _PRUNE_EVERY
            self._db.prune(self.group, now - self.window)

    def close(self) -> None:
        self._db.close()


class _Db:
    conn: Any

    def marked(self, group: str, ids: list[str]) -> set[str]:
        raise NotImplementedError

    def mark(self, group: str, ids: list[str], now: float) -> None:
        raise NotImplementedError

    def run(self, handler: Callable[..., Any], m: Message, mid: str | None, group: str, now: float) -> bool:
        """One transaction: the mark (unless `mid` is None), then ``handler(m, conn)``. False: marked already."""
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

    def run(self, handler: Callable[..., Any], m: Message, mid: str | None, group: str, now: float) -> bool:
        with self._tx():
            if mid is not None:
                cur = self.conn.execute(f"INSERT OR IGNORE INTO {self._TABLE} VALUES (?, ?, ?)", (group, mid, now))
                if cur.rowcount == 0:
                    return False  # commits nothing: the transaction wrote nothing
            handler(m, self.conn)
        return True

    def prune(self, group: str, before: float) -> None:
        with self._tx():
            self.conn.execute(f"DELETE FROM {self._TABLE} WHERE grp = ? AND handled_at < ?", (group, before))

    def _tx(self) -> _SQLiteTx:
        return _SQLiteTx(self.conn)


class _SQLiteTx:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any exception (the handler's too)."""

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

    def marked(self, group: str, ids: list[str]) -> set[str]:
        # A join with the unnested ids: one primary-key probe per id, whatever the table's size.
        rows = self._live().execute(
            f"SELECT t.msg_id FROM unnest(%s::text[]) AS u(id) JOIN {self._t} t ON t.grp = %s AND t.msg_id = u.id",
            (ids, group),
        )
        return {r[0] for r in rows}

    def mark(self, group: str, ids: list[str], now: float) -> None:
        self._live().execute(
            f"INSERT INTO {self._t} SELECT %s, unnest(%s::text[]), %s ON CONFLICT DO NOTHING", (group, ids, now)
        )

    def run(self, handler: Callable[..., Any], m: Message, mid: str | None, group: str, now: float) -> bool:
        conn = self._live()
        with conn.transaction():
            if mid is not None:
                cur = conn.execute(
                    f"INSERT INTO {self._t} VALUES (%s, %s, %s) ON CONFLICT DO NOTHING", (group, mid, now)
                )
                if cur.rowcount == 0:
                    return False
            handler(m, conn)
        return True

    def prune(self, group: str, before: float) -> None:
        self._live().execute(f"DELETE FROM {self._t} WHERE grp = %s AND handled_at < %s", (group, before))
