"""The MySQL / MariaDB outbox (`mysql://user:password@host:port/database?table=outbox`): the SQL
core (`outbox.stores.sqlcore`) over MySQL's dialect, through PyMySQL (the ``mysql`` extra).

MariaDB >= 10.6 and MySQL >= 8.0 (both have `FOR UPDATE SKIP LOCKED`). One message per row;
an InnoDB table whose key is found on `key_hash`, a stored column the server computes
(`UNHEX(MD5(key))`), so that a key's bytes of any length are compared on an index. Connections:
a small pool, each in READ COMMITTED (a claim's rule reads the newest committed rows, and no gap
locks are taken), with ANSI quotes and no backslash escapes (the shared SQL's quoting). A broken
connection is dropped from the pool, so a restarted server is used again at the next call.

Lease owners (`outbox.stores.owners`): an owner holds a named lock (`GET_LOCK`) on a connection
of its own before it leases anything; the server frees it when that session ends (the process
killed), and claimers then take the owner's rows at once. An owner of this host is judged by its
process.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from outbox.errors import ConfigError, MissingDependencyError, StoreError
from outbox.records import NewMessage, Status
from outbox.stores.base import Capabilities
from outbox.stores.bulk import BulkRead
from outbox.stores.location import StoreURL
from outbox.stores.owners import Liveness, describe_owner, local_liveness, parse_owner
from outbox.stores.sqlcore import Cursor, Dialect, SQLOutbox

log = logging.getLogger(__name__)

#: The schema version this code writes (`<table>_meta`).
VERSION = 1

DIALECT = Dialect(
    quote=lambda name: f'"{name}"',
    key_match='key_hash = UNHEX(MD5({p})) AND "key" = {p}',
    keys_in="key_hash IN ({ps})",
    key_index=lambda key: hashlib.md5(key).digest(),
    headers_contain="INSTR(headers, {p}) > 0",
    null_safe_equal="<=>",
)

#: What every connection of the store's own pool runs in (the SQL core's quoting and escapes).
_SQL_MODE = "ANSI_QUOTES,NO_BACKSLASH_ESCAPES,STRICT_TRANS_TABLES,NO_ENGINE_SUBSTITUTION"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS {t} (
  id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
  msg_id VARCHAR(255) NOT NULL,
  topic VARCHAR(255) NOT NULL,
  "key" LONGBLOB NULL,
  key_hash BINARY(16) GENERATED ALWAYS AS (UNHEX(MD5("key"))) STORED,
  value LONGBLOB NULL,
  headers LONGBLOB NULL,
  "partition" INT NOT NULL,
  status TINYINT NOT NULL,
  attempts INT NOT NULL,
  created_at DOUBLE NOT NULL,
  first_failed_at DOUBLE NULL,
  last_failed_at DOUBLE NULL,
  next_attempt_at DOUBLE NOT NULL,
  last_error TEXT NULL,
  error_code INT NULL,
  error_name VARCHAR(255) NULL,
  lease_owner VARCHAR(255) NULL,
  "timestamp" BIGINT NOT NULL DEFAULT 0,
  enc_key VARCHAR(255) NULL,
  INDEX {i}_due (status, next_attempt_at, id),
  INDEX {i}_key (key_hash, id),
  INDEX {i}_msg (msg_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
CREATE TABLE IF NOT EXISTS {a} (
  id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
  "at" DOUBLE NOT NULL, who VARCHAR(255) NOT NULL, "action" VARCHAR(64) NOT NULL,
  "filter" TEXT NOT NULL, "count" BIGINT NOT NULL
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
CREATE TABLE IF NOT EXISTS {m} (version INT NOT NULL) ENGINE=InnoDB;
"""


def _pymysql() -> Any:
    try:
        import pymysql
    except ImportError:
        raise MissingDependencyError("a MySQL outbox needs PyMySQL: pip install 'kafka-outbox[mysql]'") from None
    return pymysql


class MySQLOutbox(SQLOutbox):
    """An outbox in a MySQL or MariaDB database (see the module doc).

    Args:
        url: a parsed ``mysql://`` URL; its `table` names the table (``outbox``).
        create: create the tables when missing (False: a missing table is an error).
        pool_size: connections kept open (at least 1).
    """

    capabilities = Capabilities(transactional_enqueue=True, owner_liveness=True, bulk_read=True)
    dialect = DIALECT

    def __init__(self, url: StoreURL, *, create: bool = True, pool_size: int = 4) -> None:
        if pool_size < 1:
            raise ConfigError("pool_size must be at least 1")
        self._pymysql = _pymysql()
        self.url = url
        self.location = url.redacted()
        self._where = f"MySQL outbox {url.where()}"
        self._t = f'"{url.table}"'
        self._audit_t = f'"{url.table}_audit"'
        self._meta_t = f'"{url.table}_meta"'
        self._setup()
        self._pool: queue.LifoQueue[Any] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(pool_size)
        self._closed = False
        self._owners: dict[str, tuple[Any, float]] = {}  # owner -> (its lock's connection, last checked)
        self._owner_lock = threading.Lock()
        with self._tx() as cur:
            cur.execute("SELECT @@innodb_autoinc_lock_mode")
            # Modes 0 and 1 give a multi-row INSERT consecutive ids; 2 ("interleaved") may not.
            self._consecutive_ids = int(cur.fetchone()[0]) != 2
        if create:
            self.migrate()
        elif self._version() is None:
            raise StoreError(f"{self._where}: no outbox table {url.table!r} (create it first, or drop create=False)")

    # -- connections --------------------------------------------------------------------------------

    def _connect(self) -> Any:
        u = self.url
        try:
            return self._pymysql.connect(
                host=u.host,
                port=u.port,
                user=u.user or "",
                password=u.password or "",
                database=u.database,
                autocommit=False,
                charset="utf8mb4",
                sql_mode=_SQL_MODE,
                connect_timeout=10,
                init_command="SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
            )
        except self._pymysql.Error as exc:
            raise self._error(exc) from None

    @contextmanager
    def _tx(self) -> Iterator[Cursor]:
        if self._closed:
            raise StoreError(f"{self._where}: the store is closed")
        self._slots.acquire()
        try:
            try:
                conn = self._pool.get_nowait()
            except queue.Empty:
                conn = self._connect()
            try:
                with conn.cursor() as cur:
                    yield cur
                conn.commit()
            except self._pymysql.Error as exc:
                _close_quietly(conn)  # a broken connection is never handed out again
                raise self._error(exc) from None
            except BaseException:
                try:
                    conn.rollback()
                except self._pymysql.Error:
                    _close_quietly(conn)
                    raise
                self._pool.put(conn)
                raise
            self._pool.put(conn)
        finally:
            self._slots.release()

    def _error(self, exc: BaseException, doing: str = "") -> StoreError:
        """A one-line StoreError naming host:port/database and the server's reason, never the password."""
        args = list(getattr(exc, "args", ()))
        code = args[0] if args and isinstance(args[0], int) else None
        reason = str(args[1]) if len(args) > 1 else str(exc)
        if self.url.password:
            reason = reason.replace(self.url.password, "***")
        if code == 1045:
            reason = f"authentication failed for user {self.url.user!r} (wrong user or password)"
        elif code == 1049:
            reason = f"database {self.url.database!r} does not exist"
        elif code in (2003, 2006, 2013):
            reason = f"cannot reach the MySQL server ({reason})"
        elif not reason.strip():  # PyMySQL's InterfaceError(0, ''): a connection already closed
            reason = f"the connection to the MySQL server is closed ({type(exc).__name__})"
        prefix = self._where + (f" ({doing})" if doing else "")
        return StoreError(f"{prefix}: {' '.join(reason.split())}")

    def bulk_read(self) -> BulkRead:
        """The table as the Spark job's JDBC reader reads it (its session in ANSI quotes: the
        backend's JDBC URL sets them)."""
        return BulkRead(table=self._t, grouped=False, schema="timestamp LONG")

    # -- lease owners --------------------------------------------------------------------------------

    def _lock_name(self, owner: str) -> str:
        """The named lock of an owner of this table (at most 64 characters)."""
        digest = hashlib.blake2b(f"{self.url.database}.{self.url.table}\0{owner}".encode(), digest_size=16)
        return f"outbox:{digest.hexdigest()}"

    def _hold_owner(self, owner: str) -> None:
        """Make sure `owner` holds its lock, on a connection of its own (outside the pool: the
        lock must live exactly as long as its owner); checked at most once a second, and taken
        again on a new connection after a server restart."""
        now = time.monotonic()
        held = self._owners.get(owner)
        if held is not None and now - held[1] < 1.0:
            return
        with self._owner_lock:
            if self._closed:
                raise StoreError(f"{self._where}: the store is closed")
            held = self._owners.pop(owner, None)
            if held is not None:
                try:
                    held[0].ping(reconnect=False)
                    self._owners[owner] = (held[0], now)
                    return
                except self._pymysql.Error:
                    _close_quietly(held[0])
            conn = self._connect()
            try:
                with conn.cursor() as cur:
                    cur.execute("SELECT GET_LOCK(%s, 0)", [self._lock_name(owner)])
                    got = cur.fetchone()[0]
            except self._pymysql.Error as exc:
                _close_quietly(conn)
                raise self._error(exc, "taking the lease owner's lock") from None
            if got != 1:
                log.warning("%s: another session holds the lock of lease owner %s", self._where, describe_owner(owner))
            self._owners[owner] = (conn, now)

    def owner_liveness(self, owners: Sequence[str]) -> dict[str, Liveness]:
        """Alive, gone or unknown, for each lease owner: one of this host by its process, one
        named by `outbox.stores.owners.new_owner` by its lock (held: alive), others unknown."""
        out = {o: local_liveness(o) for o in owners}
        remote = [o for o, live in out.items() if live is Liveness.UNKNOWN and parse_owner(o) is not None]
        if remote:
            names = [self._lock_name(o) for o in remote]
            free = self._read(f"SELECT {', '.join(['IS_FREE_LOCK(%s)'] * len(names))}", names)[0]
            out.update({o: Liveness.GONE if f == 1 else Liveness.ALIVE for o, f in zip(remote, free, strict=True)})
        return out

    def close(self) -> None:
        self._closed = True
        with self._owner_lock:
            for conn, _ in self._owners.values():
                _close_quietly(conn)
            self._owners.clear()
        while True:
            try:
                _close_quietly(self._pool.get_nowait())
            except queue.Empty:
                return

    # -- schema ---------------------------------------------------------------------------------------

    def _version(self) -> int | None:
        with self._tx() as cur:
            cur.execute(
                "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = %s",
                [self.url.table + "_meta"],
            )
            if not cur.fetchone()[0]:
                return None
            cur.execute(f"SELECT MAX(version) FROM {self._meta_t}")
            found = cur.fetchone()[0]
        return None if found is None else int(found)

    def migrate(self) -> None:
        version = self._version()
        if version is not None and version > VERSION:
            raise StoreError(f"{self._where}: schema version {version} is newer than this code's ({VERSION})")
        if version == VERSION:
            return
        t = self.url.table
        ddl = _SCHEMA.format(t=self._t, i=t, a=self._audit_t, m=self._meta_t)
        with self._tx() as cur:  # CREATE TABLE commits on its own: each one is idempotent
            for statement in filter(str.strip, ddl.split(";")):
                cur.execute(statement)
            cur.execute(f"SELECT COUNT(*) FROM {self._meta_t}")
            if not cur.fetchone()[0]:
                cur.execute(f"INSERT INTO {self._meta_t} (version) VALUES (%s)", [VERSION])

    # -- writes -----------------------------------------------------------------------------------------

    def _insert(self, cur: Cursor, rows: Sequence[tuple[Any, ...]]) -> list[int]:
        sql = f"INSERT INTO {self._t} ({self._insert_columns}) VALUES ({', '.join(['%s'] * len(rows[0]))})"
        if self._consecutive_ids:
            cur.executemany(sql, rows)  # PyMySQL sends one multi-row INSERT
            first = int(cur.lastrowid)
            return list(range(first, first + len(rows)))
        ids = []
        for r in rows:
            cur.execute(sql, r)
            ids.append(int(cur.lastrowid))
        return ids

    def enqueue_in_transaction(self, conn: Any, messages: Sequence[NewMessage]) -> list[int]:
        """Write PENDING rows with the caller's own open PyMySQL connection, in its transaction;
        never commit (`produce(..., transaction=conn)`). The messages exist if and only if that
        transaction commits.

        Raises:
            ConfigError: `conn` is not a PyMySQL connection, is in autocommit mode, or is to
                another database.
            StoreError: the insert failed; the caller rolls its transaction back.
        """
        if not isinstance(conn, self._pymysql.connections.Connection):
            raise ConfigError(f"transaction must be a PyMySQL connection (got {type(conn).__name__})")
        if not conn.open:
            raise ConfigError("transaction connection is closed")
        try:
            if conn.get_autocommit():
                raise ConfigError(
                    "transaction connection is in autocommit mode: each write would commit on its own; "
                    "use a connection with autocommit=False"
                )
            with conn.cursor() as cur:
                cur.execute("SELECT DATABASE()")
                database = cur.fetchone()[0]
                if database != self.url.database:
                    raise ConfigError(
                        f"transaction connection is to database {database!r}, but the outbox is in {self._where}"
                    )
                if not messages:
                    return []
                now = time.time()
                values = [self._values(m, Status.PENDING, None, None, now) for m in messages]
                return self._insert_app(cur, values)
        except self._pymysql.Error as exc:
            raise self._error(exc, "enqueue in the caller's transaction") from None

    def _insert_app(self, cur: Cursor, rows: Sequence[tuple[Any, ...]]) -> list[int]:
        """`_insert` in a session of the application's, whatever its sql_mode: backquoted names."""
        names = ", ".join(f"`{c}`" for c in self._insert_columns.replace('"', "").split(", "))
        sql = f"INSERT INTO `{self.url.table}` ({names}) VALUES ({', '.join(['%s'] * len(rows[0]))})"
        ids = []
        for r in rows:
            cur.execute(sql, r)
            ids.append(int(cur.lastrowid))
        return ids


def _close_quietly(conn: Any) -> None:
    with contextlib.suppress(Exception):  # already broken: nothing to report
        conn.close()
