"""PostgreSQL outbox: one table shared by a fleet of producers and drainers.

Same contract and column meanings as `SQLiteOutbox` (see `outbox.stores.base`): statuses are
small integers, times are epoch seconds in `double precision`, key/value/headers are opaque
`bytea` (headers in `outbox.codec`'s layout), and a lease is `lease_owner` plus
`next_attempt_at` pushed to the lease's expiry.

Connections come from a `psycopg_pool.ConnectionPool` in autocommit mode: single statements
commit on their own, and multi-statement work runs in an explicit short transaction. No
transaction is ever held across a Kafka send.

How N processes claim at once (the choice, and why):
    ``SELECT … FOR UPDATE SKIP LOCKED`` alone keeps each row with one claimer, but not per-key
    order: while claimer A's transaction holds the lock on row 5 of key K, claimer B skips it
    and can take row 7 of K, and both are then sent in parallel. So claim transactions are
    serialized with ``pg_advisory_xact_lock(<hash of schema.table>)``. A claim is a couple of
    short statements (a few milliseconds); the sends happen outside it, so drainers still send
    in parallel. After taking the lock, each statement of the claim runs on a fresh READ
    COMMITTED snapshot, so it sees every lease committed by the previous claimer. SKIP LOCKED
    stays, for rows locked by acknowledging writers (delete / reschedule / release), and the
    per-key check treats any earlier PENDING row of the key that was not among the candidates
    (not due, leased, or skipped because locked) as blocking the key's later rows. That rule
    alone already closes the SKIP LOCKED hole (the lock-free check still sees the row another
    claimer is locking); the advisory lock is kept as a second, simpler guarantee. With neither
    (SQLite's "earlier row not yet due" check and no lock), tests/integration/
    test_postgres_store.py's 4-process test does catch keys claimed out of order.

Claim plan: a probe counts due rows (up to 5,000) on the (status, next_attempt_at) index. Few
due: they are fetched by that index and sorted by id. Many due: the pending rows are walked in
id order. Known slow case: thousands of due rows that all sit behind hundreds of thousands of
rows backing off (the walk passes them, ~1 s per million).

Ordering caveat: ids come from an identity sequence, so a key's order is the order in which its
rows were inserted. Two *concurrent* writers of the same key have no order defined between
them (commit order may differ from id order); one producer writes sequentially, so its
order holds.

Transactional outbox: `PostgresOutbox.enqueue_in_transaction` writes PENDING rows with the
caller's own open psycopg connection and never commits, so the message exists if and only if
the caller's business transaction commits.

Secrets: error messages name ``host:port/database`` (`StoreURL.where()`), never the password;
libpq's own text is scrubbed of it too, and psycopg exceptions are not chained (``from None``)
so a traceback cannot carry connection details further.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..backlog import Backlog, backlog_from_rows, backlog_sql
from ..codec import encode_headers
from ..errors import ConfigError, StoreError, StoreNotFoundError, UnknownMessageError
from ..owners import Liveness, SweepSchedule, describe_owner, local_liveness, parse_owner
from ..records import AuditEntry, DeadLetterFilter, NewMessage, OutboxMessage, Status, StoreStats
from ..urls import StoreURL, parse_url
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

if TYPE_CHECKING:  # psycopg is the optional "postgres" extra: imported lazily at run time.
    import psycopg
    from psycopg_pool import ConnectionPool

log = logging.getLogger(__name__)

SCHEMA_VERSION = 4

_COLUMNS = COLUMNS
_TYPES = {
    "msg_id": "text", "topic": "text", "key": "bytea", "value": "bytea", "headers": "bytea",
    "partition": "int", "status": "smallint", "attempts": "int", "created_at": "float8",
    "first_failed_at": "float8", "last_failed_at": "float8", "next_attempt_at": "float8",
    "last_error": "text", "error_code": "int", "error_name": "text", "lease_owner": "text",
    "timestamp": "bigint",
}
_INSERT = (
    "INSERT INTO {t} (" + ", ".join(INSERT_COLUMNS) + ") SELECT * FROM unnest("
    + ", ".join(f"%s::{_TYPES[c]}[]" for c in INSERT_COLUMNS) + ") RETURNING id"
)

_ALL = DeadLetterFilter()  # the empty filter: every dead letter

# Up to this many due rows, claim sorts them instead of walking the pending rows in id order.
_SORT_DUE_UP_TO = 5_000

_DEFAULT_CONNECT_TIMEOUT = "10"  # libpq's default is to wait forever for an unreachable host


def _migrations(schema: str, table: str) -> dict[int, list[str]]:
    """Versioned DDL. Names are validated by `outbox.urls` (letters, digits, _) and quoted."""
    t = f'"{schema}"."{table}"'
    return {
        1: [
            f"""CREATE TABLE IF NOT EXISTS {t} (
                id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- orders a key's messages
                msg_id TEXT NOT NULL,
                topic TEXT NOT NULL,
                key BYTEA,
                value BYTEA,
                headers BYTEA,
                partition INTEGER NOT NULL DEFAULT -1,
                status SMALLINT NOT NULL DEFAULT 0,
                attempts INTEGER NOT NULL DEFAULT 0,
                created_at DOUBLE PRECISION NOT NULL,
                first_failed_at DOUBLE PRECISION,
                last_failed_at DOUBLE PRECISION,
                next_attempt_at DOUBLE PRECISION NOT NULL DEFAULT 0,
                last_error TEXT,
                lease_owner TEXT
            )""",
            # Oldest pending first: claim walks this small partial index in id order.
            f'CREATE INDEX IF NOT EXISTS "{table}_pending_id" ON {t} (id) WHERE status = 0',
            # "Anything due?" probes, next_due_at, and due-row scans when most rows back off.
            f'CREATE INDEX IF NOT EXISTS "{table}_due" ON {t} (status, next_attempt_at)',
            # Per-key order checks and has_pending. md5(key), not key: a btree entry is limited
            # to ~2.7 kB and Kafka keys are not; queries also compare the key itself.
            f'CREATE INDEX IF NOT EXISTS "{table}_key" ON {t} (topic, md5(key), id) '
            "WHERE status = 0 AND key IS NOT NULL",
            f'CREATE INDEX IF NOT EXISTS "{table}_dead" ON {t} (id) WHERE status = 2',
        ],
        # The error as code and name columns: filters and stats read them, never the text.
        2: [
            f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS error_code INTEGER",
            f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS error_name TEXT",
            # The one place the old text form "NAME (code): reason" (version 1) is parsed.
            f"UPDATE {t} SET error_name = m[1], error_code = m[2]::integer "
            "FROM (SELECT id AS mid, regexp_match(last_error, '^(\\S+) \\((-?\\d+)\\):') AS m "
            f"FROM {t} WHERE last_error IS NOT NULL AND error_code IS NULL) AS x "
            "WHERE id = x.mid AND x.m IS NOT NULL",
        ],
        # The console: dead-letter filters walk small partial indexes in id order (keyset pages;
        # pending rows are not in them, so the producer's writes do not pay for them), a trace
        # finds a message's rows by outbox-id, and operator actions are audited in the store.
        3: [
            # Dead rows only, as in SQLite: a full index taxes every spilled message.
            f'CREATE INDEX IF NOT EXISTS "{table}_dead_msg_id" ON {t} (msg_id) WHERE status = 2',
            f'CREATE INDEX IF NOT EXISTS "{table}_dead_topic" ON {t} (topic, id) WHERE status = 2',
            f'CREATE INDEX IF NOT EXISTS "{table}_dead_error_name" ON {t} (error_name, id) WHERE status = 2',
            f'CREATE INDEX IF NOT EXISTS "{table}_dead_error_code" ON {t} (error_code, id) WHERE status = 2',
            # md5(key), as for the pending key index: a btree entry is limited to ~2.7 kB.
            f'CREATE INDEX IF NOT EXISTS "{table}_dead_key" ON {t} (md5(key), id) WHERE status = 2',
            f'CREATE INDEX IF NOT EXISTS "{table}_dead_failed" ON {t} (last_failed_at) WHERE status = 2',
            f"""CREATE TABLE IF NOT EXISTS "{schema}"."{table}_audit" (
                id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                at DOUBLE PRECISION NOT NULL,
                who TEXT NOT NULL,
                action TEXT NOT NULL,
                filter TEXT NOT NULL,
                count BIGINT NOT NULL
            )""",
        ],
        # The record timestamp every send of a row carries (ms since the epoch); rows stored
        # before it read 0, "unknown", and are sent as they always were (librdkafka's now).
        4: [f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS timestamp BIGINT NOT NULL DEFAULT 0"],
    }

#: How the dead-letter filter compares keys: through the md5 index, then exactly.
_KEY_MATCH = "md5(key) = md5({p}::bytea) AND key = {p}::bytea"
_HEADERS_CONTAIN = "position({p}::bytea in headers) > 0"


def _lock_key(name: str) -> int:
    """A stable signed 64-bit advisory-lock key (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big", signed=True)


def _configure(conn: psycopg.Connection[Any]) -> None:
    """Session settings of every pooled connection."""
    # JIT compiling costs ~1 s on a 2-core host and is triggered by the cost *estimate* of the
    # per-key check on a large table, whose real run takes milliseconds. Outbox statements are
    # short OLTP statements that never gain from JIT.
    conn.execute("SET jit = off")


def _import_psycopg() -> Any:
    try:
        import psycopg
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise ConfigError("a PostgreSQL outbox needs psycopg: pip install 'kafka-outbox[postgres]'") from exc
    return psycopg


class PostgresOutbox(Outbox):
    """The fleet outbox store, in one PostgreSQL table.

    Args:
        url: the parsed URL (`outbox.urls.parse_url`); its `schema` and `table` name the table.
        create: create the schema, the table and its indexes if missing. With False a missing
            table raises `StoreNotFoundError` (the CLI's choice: a typo is not a new outbox).
        pool_size: most connections this store opens (threads of one process share them).

    Raises:
        StoreError: the server is unreachable, the credentials are wrong, the database does not
            exist, or the user may not create the schema. The message names host:port/database.
        StoreNotFoundError: `create` is False and the outbox table does not exist.
    """

    def __init__(self, url: StoreURL | str, *, create: bool = True, pool_size: int = 4) -> None:
        if isinstance(url, str):
            url = parse_url(url)
        if url.kind != "postgresql":
            raise ConfigError(f"not a PostgreSQL outbox URL: {url.redacted()}")
        if pool_size < 1:
            raise ConfigError("pool_size must be at least 1")
        self.url = url
        self.location = url.redacted()
        self._where = url.where()
        self._schema = url.schema
        self._table_name = url.table
        self._t = f'"{url.schema}"."{url.table}"'
        self._version_t = f'"{url.schema}"."{url.table}_schema_version"'
        self._audit_t = f'"{url.schema}"."{url.table}_audit"'
        self._claim_lock = _lock_key(f"kafka-outbox:claim:{url.schema}.{url.table}")
        self._migrate_lock = _lock_key(f"kafka-outbox:migrate:{url.schema}.{url.table}")
        self._create = create
        self._psycopg = _import_psycopg()
        self._kwargs: dict[str, Any] = dict(url.psycopg_kwargs())
        self._kwargs.setdefault("connect_timeout", _DEFAULT_CONNECT_TIMEOUT)
        self._closed = False
        self._close_lock = threading.Lock()
        self._sweeps = SweepSchedule()
        self._owner_lock = threading.Lock()
        self._owner_conns: dict[str, tuple[psycopg.Connection[Any], float]] = {}
        # One direct connection first: a pool hides the reason of a failed connect behind a
        # timeout, and the first connect is where wrong credentials and typos show up.
        with self._direct() as conn:
            self._migrate(conn)
        from psycopg_pool import ConnectionPool

        self._pool: ConnectionPool[Any] = ConnectionPool(
            kwargs={**self._kwargs, "autocommit": True},
            min_size=1,
            max_size=pool_size,
            open=True,
            name=f"outbox-{url.table}",
            timeout=float(self._kwargs["connect_timeout"]) + 5.0,
            configure=_configure,
        )

    # -- connections and errors --------------------------------------------------------------

    def _scrub(self, text: str) -> str:
        if self.url.password:
            text = text.replace(self.url.password, "***")
        return text.strip().replace("\n", " ")

    def _error(self, exc: BaseException, doing: str = "") -> StoreError:
        """A StoreError naming host:port/database, with the server's reason, never the password."""
        psycopg = self._psycopg
        reason = self._scrub(str(exc))
        sqlstate = getattr(exc, "sqlstate", None)
        if sqlstate == "42501" or "permission denied" in reason:
            text = f"permission denied ({reason})"
        elif sqlstate == "3D000" or ("database" in reason and "does not exist" in reason):
            text = f"database {self.url.database!r} does not exist"
        elif sqlstate == "28P01" or "password authentication failed" in reason:
            text = f"authentication failed for user {self.url.user!r} (wrong user or password)"
        elif isinstance(exc, psycopg.OperationalError) and "connection" in reason.lower():
            text = f"cannot connect to the PostgreSQL server ({reason})"
        else:
            text = reason or type(exc).__name__
        prefix = f"PostgreSQL outbox {self._where}"
        if doing:
            prefix += f" ({doing})"
        return StoreError(f"{prefix}: {text}")

    @contextmanager
    def _direct(self) -> Iterator[psycopg.Connection[Any]]:
        psycopg = self._psycopg
        try:
            conn = psycopg.connect(**self._kwargs, autocommit=True)
        except psycopg.Error as exc:
            raise self._error(exc) from None
        try:
            yield conn
        except psycopg.Error as exc:
            raise self._error(exc) from None
        finally:
            conn.close()

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled autocommit connection; psycopg and pool errors become StoreErrors."""
        from psycopg_pool import PoolTimeout

        if self._closed:
            raise StoreError(f"PostgreSQL outbox {self._where} is closed")
        try:
            with self._pool.connection() as conn:
                yield conn
        except PoolTimeout:
            raise StoreError(
                f"PostgreSQL outbox {self._where}: no connection to the server within "
                f"{self._pool.timeout:.0f} s (server down or unreachable?)"
            ) from None
        except self._psycopg.Error as exc:
            raise self._error(exc) from None

    @contextmanager
    def _tx(self) -> Iterator[psycopg.Connection[Any]]:
        """One short transaction on a pooled connection."""
        with self._conn() as conn, conn.transaction():
            yield conn

    # -- schema ------------------------------------------------------------------------------

    def migrate(self) -> None:
        with self._conn() as conn:
            self._migrate(conn)

    def _version(self, conn: psycopg.Connection[Any]) -> int | None:
        """The stored schema version; None when there is no version table yet."""
        exists = conn.execute(
            "SELECT to_regclass(%s)", [f'"{self._schema}"."{self._table_name}_schema_version"']
        ).fetchone()
        if exists is None or exists[0] is None:
            return None
        row = conn.execute(f"SELECT max(version) FROM {self._version_t}").fetchone()
        return int(row[0]) if row is not None and row[0] is not None else 0

    def _migrate(self, conn: psycopg.Connection[Any]) -> None:
        version = self._version(conn)
        if version == SCHEMA_VERSION:
            return  # the common case: no lock, no DDL
        if version is not None and version > SCHEMA_VERSION:
            raise StoreError(
                f"PostgreSQL outbox {self._where}: schema version {version} of {self._t} is newer "
                f"than this kafka-outbox ({SCHEMA_VERSION}); upgrade the library"
            )
        if not self._create:
            table = conn.execute("SELECT to_regclass(%s)", [self._t]).fetchone()
            if table is None or table[0] is None:
                raise StoreNotFoundError(
                    f"PostgreSQL outbox {self._where}: table {self._schema}.{self._table_name} does not exist"
                )
        try:
            with conn.transaction():
                # Two processes starting at once must not both run the DDL.
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [self._migrate_lock])
                has_schema = conn.execute(
                    "SELECT 1 FROM pg_namespace WHERE nspname = %s", [self._schema]
                ).fetchone()
                if not has_schema:
                    # Only when missing: CREATE SCHEMA IF NOT EXISTS checks the CREATE privilege
                    # first, and a user with rights on an existing schema need not have it.
                    conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self._schema}"')
                conn.execute(
                    f"CREATE TABLE IF NOT EXISTS {self._version_t} "
                    "(version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
                )
                version = self._version(conn) or 0
                steps = _migrations(self._schema, self._table_name)
                for v in range(version + 1, SCHEMA_VERSION + 1):
                    for stmt in steps[v]:
                        conn.execute(stmt)
                    conn.execute(
                        f"INSERT INTO {self._version_t} (version, applied_at) VALUES (%s, %s)",
                        [v, time.time()],
                    )
                    log.info("outbox %s: schema migrated to version %d", self.location, v)
        except self._psycopg.Error as exc:
            raise self._error(exc, f"creating {self._schema}.{self._table_name}") from None

    # -- writes ------------------------------------------------------------------------------

    def _insert(
        self,
        conn: psycopg.Connection[Any],
        messages: Sequence[NewMessage],
        status: Status,
        lease_owner: str | None,
        lease_until: float | None,
        now: float,
    ) -> list[int]:
        if not messages:
            return []
        if lease_owner is not None and lease_until is not None:
            self._hold_owner(str(lease_owner))
        rows = [insert_values(m, status, lease_owner, lease_until, now) for m in messages]
        # One statement for the whole batch: arrays unnested server-side, ~one round trip.
        cur = conn.execute(_INSERT.format(t=self._t), [list(col) for col in zip(*rows, strict=True)])
        # Identity values are drawn as the unnested rows are inserted, in order, so sorted
        # ids line up with the input even when other writers insert at the same time.
        return sorted(r[0] for r in cur.fetchall())

    def enqueue(
        self,
        messages: Sequence[NewMessage],
        *,
        lease_owner: str | None = None,
        lease_until: float | None = None,
    ) -> list[int]:
        if not messages:
            return []
        with self._conn() as conn:
            return self._insert(conn, messages, Status.PENDING, lease_owner, lease_until, time.time())

    def enqueue_in_transaction(self, conn: Any, messages: Sequence[NewMessage]) -> list[int]:
        """Write PENDING rows with the caller's own open psycopg connection; never commit.

        The classic transactional outbox: call this inside the transaction that does the
        business write. The messages exist if and only if that transaction commits; the
        drainers then deliver them. Nothing is committed, rolled back or closed here.

        Args:
            conn: a `psycopg.Connection` to this store's database, either in a transaction
                (non-autocommit mode starts one implicitly) or inside `conn.transaction()`.
            messages: the messages, stored as PENDING and due as given in `next_attempt_at`.

        Returns:
            The new row ids, in order.

        Raises:
            ConfigError: `conn` is not a psycopg connection, is connected to another database,
                or is in autocommit mode outside a transaction block (each write would commit
                on its own, so there would be no transaction to join).
            StoreError: the insert failed; the caller's transaction is then aborted and must be
                rolled back by the caller.
        """
        psycopg = self._psycopg
        if not isinstance(conn, psycopg.Connection):
            raise ConfigError(
                f"transaction must be a psycopg.Connection (got {type(conn).__name__}); "
                "async connections are not supported"
            )
        if conn.closed:
            raise ConfigError("transaction connection is closed")
        if conn.info.dbname != self.url.database:
            raise ConfigError(
                f"transaction connection is to database {conn.info.dbname!r}, but the outbox is "
                f"in {self._where}"
            )
        status = conn.info.transaction_status
        if status == psycopg.pq.TransactionStatus.INERROR:
            raise StoreError(
                f"PostgreSQL outbox {self._where}: the caller's transaction is aborted; roll it back"
            )
        if conn.autocommit and status == psycopg.pq.TransactionStatus.IDLE:
            raise ConfigError(
                "transaction connection is in autocommit mode outside a transaction block: use "
                "`with conn.transaction():` or a non-autocommit connection"
            )
        if not messages:
            return []
        try:
            return self._insert(conn, messages, Status.PENDING, None, None, time.time())
        except psycopg.Error as exc:
            raise self._error(exc, "enqueue in the caller's transaction") from None

    def add_dead(self, messages: Sequence[NewMessage], *, failed_at: float) -> list[int]:
        if not messages:
            return []
        with self._conn() as conn:
            return self._insert(conn, messages, Status.DEAD, None, None, failed_at)

    def _delete(self, conn: psycopg.Connection[Any], ids: Sequence[int]) -> int:
        if not ids:
            return 0
        cur = conn.execute(f"DELETE FROM {self._t} WHERE id = ANY(%s::bigint[]) AND status = 0", [list(ids)])
        return cur.rowcount

    def _fail(self, conn: psycopg.Connection[Any], failures: Sequence[Failure]) -> list[OutboxMessage]:
        if not failures:
            return []
        retry = [f for f in failures if f.retry_at is not None]
        dead = [f for f in failures if f.retry_at is None]
        if retry:
            conn.execute(
                f"UPDATE {self._t} AS o SET attempts = o.attempts + 1, last_error = f.e, "
                "error_code = f.c, error_name = f.n, "
                "first_failed_at = COALESCE(o.first_failed_at, f.at), last_failed_at = f.at, "
                "next_attempt_at = f.retry, lease_owner = NULL "
                "FROM unnest(%s::bigint[], %s::text[], %s::int[], %s::text[], %s::float8[], %s::float8[]) "
                "AS f(id, e, c, n, at, retry) WHERE o.id = f.id AND o.status = 0",
                [
                    [f.id for f in retry],
                    [f.error for f in retry],
                    [f.code for f in retry],
                    [f.name for f in retry],
                    [f.failed_at for f in retry],
                    [f.retry_at for f in retry],
                ],
            )
        if not dead:
            return []
        cols = ", ".join(f"o.{c.strip()}" for c in _COLUMNS.split(","))
        cur = conn.execute(
            f"UPDATE {self._t} AS o SET attempts = o.attempts + 1, last_error = f.e, status = 2, "
            "error_code = f.c, error_name = f.n, "
            "first_failed_at = COALESCE(o.first_failed_at, f.at), last_failed_at = f.at, "
            "lease_owner = NULL "
            "FROM unnest(%s::bigint[], %s::text[], %s::int[], %s::text[], %s::float8[]) AS f(id, e, c, n, at) "
            f"WHERE o.id = f.id AND o.status = 0 RETURNING {cols}",
            [
                [f.id for f in dead], [f.error for f in dead], [f.code for f in dead], [f.name for f in dead],
                [f.failed_at for f in dead],
            ],
        )
        return sorted((row_from_columns(r) for r in cur.fetchall()), key=lambda m: m.id)

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
        with self._tx() as conn:
            ids = self._insert(conn, new, Status.PENDING, lease_owner, lease_until, now)
            deleted = self._delete(conn, settlement.delivered)
            dead = self._fail(conn, settlement.failures)
            if settlement.released:
                conn.execute(
                    f"UPDATE {self._t} SET lease_owner = NULL, next_attempt_at = %s "
                    "WHERE id = ANY(%s::bigint[]) AND status = 0",
                    [now, settlement.released],
                )
        return Applied(ids, deleted, dead)

    def claim(
        self, owner: str, limit: int, lease_seconds: float, *, now: float, topic: str | None = None,
        in_flight: Collection[int] = (),
    ) -> list[OutboxMessage]:
        if limit <= 0:
            return []
        self._hold_owner(owner)
        if self._sweeps.due():
            self.release_gone_owners(now=now)
        where = "status = 0 AND next_attempt_at <= %s"
        args: list[Any] = [now]
        if topic is not None:
            where += " AND topic = %s"
            args.append(topic)
        with self._conn() as conn:
            # Probe without the claim lock, on the (status, next_attempt_at) index, counting due
            # rows up to a cap. Nothing due (an outage): idle pollers neither queue on the lock
            # nor scan. Few due: walking the pending rows in id order could pass millions that
            # back off first (the planner assumes due rows are spread evenly over ids; after an
            # outage they are not), so fetch the due rows by the due index and sort them (`id + 0`
            # keeps the planner off the id index). Many due: they are dense among the pending
            # rows, and the id-order walk stops after `limit` of them.
            n_due = conn.execute(
                f"SELECT count(*) FROM (SELECT 1 FROM {self._t} WHERE {where} LIMIT %s) AS d",
                [*args, _SORT_DUE_UP_TO],
            ).fetchone()
            if n_due is None or n_due[0] == 0:
                return []
            order = "id + 0" if n_due[0] < _SORT_DUE_UP_TO else "id"
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [self._claim_lock])
                rows = conn.execute(
                    f"SELECT {_COLUMNS} FROM {self._t} WHERE {where} ORDER BY {order} LIMIT %s "
                    "FOR UPDATE SKIP LOCKED",
                    [*args, limit],
                ).fetchall()
                if not rows:
                    return []
                rows = self._keep_key_order(conn, rows, in_flight)
                conn.execute(
                    f"UPDATE {self._t} SET lease_owner = %s, next_attempt_at = %s "
                    "WHERE id = ANY(%s::bigint[])",
                    [owner, now + lease_seconds, [r[0] for r in rows]],
                )
        return [row_from_columns(r) for r in rows]

    def _keep_key_order(
        self, conn: psycopg.Connection[Any], rows: list[tuple[Any, ...]], in_flight: Collection[int]
    ) -> list[tuple[Any, ...]]:
        """Drop candidates that an earlier PENDING row of the same key, not claimed now, precedes.

        Candidates are the first due, unlocked rows in id order; an earlier pending row of the
        key that is not among them is leased, backing off, or locked by an acknowledging writer,
        and the key's later rows wait for it. The claimer's own rows in flight do not block (see
        `Outbox.claim`).
        """
        last_of_key: dict[tuple[str, bytes], int] = {}
        for r in rows:
            if r[3] is not None:
                last_of_key[(r[2], r[3])] = r[0]
        if not last_of_key:
            return rows
        ids = [r[0] for r in rows] + list(in_flight)
        topics = [k[0] for k in last_of_key]
        keys = [k[1] for k in last_of_key]
        lasts = list(last_of_key.values())
        found = conn.execute(
            "SELECT c.t, c.k, (SELECT min(o.id) FROM "
            f"{self._t} AS o WHERE o.status = 0 AND o.key IS NOT NULL AND o.topic = c.t "
            "AND md5(o.key) = md5(c.k) AND o.key = c.k AND o.id < c.last "
            "AND o.id NOT IN (SELECT unnest(%s::bigint[]))) "
            "FROM unnest(%s::text[], %s::bytea[], %s::bigint[]) AS c(t, k, last)",
            [ids, topics, keys, lasts],
        ).fetchall()
        blocked_from = {(t, bytes(k)): b for t, k, b in found if b is not None}
        if not blocked_from:
            return rows
        return [r for r in rows if r[3] is None or r[0] < blocked_from.get((r[2], r[3]), r[0] + 1)]

    # -- dead letters and reads --------------------------------------------------------------

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._conn() as conn:
            return conn.execute(sql, args).fetchall()

    def get(self, id: int) -> OutboxMessage:
        rows = self._read(f"SELECT {_COLUMNS} FROM {self._t} WHERE id = %s", [id])
        if not rows:
            raise UnknownMessageError(f"no message with id {id} in outbox {self.location}")
        return row_from_columns(rows[0])

    def list_dead(self, flt: DeadLetterFilter = _ALL) -> list[OutboxMessage]:
        where, args = dead_letter_where(flt, "%s", key_match=_KEY_MATCH, headers_contain=_HEADERS_CONTAIN)
        # A time filter: read its window on the failure-time index and sort it (`id + 0` keeps the
        # planner from walking the id index instead: failure times grow with ids, so a recent
        # window sits at the end of that walk, behind every older dead letter).
        by_time = flt.since is not None and not (flt.ids or flt.topic is not None or flt.error is not None
                                                 or flt.key is not None)
        sql = f"SELECT {_COLUMNS} FROM {self._t} WHERE {where} ORDER BY {'id + 0' if by_time else 'id'}"
        if flt.limit is not None:
            sql += " LIMIT %s"
            args.append(flt.limit)
        walk = flt.limit is not None and not (
            flt.ids or flt.topic is not None or flt.error is not None or flt.key is not None or flt.since is not None
        )
        if not walk:
            return [row_from_columns(r) for r in self._read(sql, args)]
        # No selective column: a page is found fastest by walking the dead rows in id order (the
        # partial index) until it is full. The planner cannot know that: it estimates a LIKE
        # '%text%' or a group's topic suffix to match almost nothing, and would read and sort
        # every dead letter instead (seconds at a million). SQLite gets the same walk by
        # INDEXED BY (sqlite._dead_index).
        with self._conn() as conn, conn.transaction():
            conn.execute("SET LOCAL enable_sort = off")
            return [row_from_columns(r) for r in conn.execute(sql, args).fetchall()]

    def purge_dead(self, flt: DeadLetterFilter = _ALL) -> int:
        where, args = dead_letter_where(flt, "%s", key_match=_KEY_MATCH, headers_contain=_HEADERS_CONTAIN)
        with self._conn() as conn:
            return conn.execute(f"DELETE FROM {self._t} WHERE {where}", args).rowcount

    def replay_dead(self, flt: DeadLetterFilter = _ALL, *, now: float, to_topic: str | None = None) -> int:
        where, args = dead_letter_where(flt, "%s", key_match=_KEY_MATCH, headers_contain=_HEADERS_CONTAIN)
        with self._conn() as conn:
            return conn.execute(
                f"UPDATE {self._t} SET status = 0, attempts = 0, next_attempt_at = %s, "
                f"lease_owner = NULL, topic = COALESCE(%s, topic) WHERE {where}",
                [now, to_topic, *args],
            ).rowcount

    def count_dead(self, flt: DeadLetterFilter = _ALL) -> int:
        where, args = dead_letter_where(flt, "%s", key_match=_KEY_MATCH, headers_contain=_HEADERS_CONTAIN)
        return int(self._read(f"SELECT count(*) FROM {self._t} WHERE {where}", args)[0][0])

    def redrive_edited(
        self, id: int, *, value: bytes | None, headers: list[tuple[str, bytes | None]], now: float
    ) -> bool:
        with self._conn() as conn:
            return conn.execute(
                f"UPDATE {self._t} SET value = %s, headers = %s, status = 0, attempts = 0, "
                "next_attempt_at = %s, lease_owner = NULL WHERE id = %s AND status = 2",
                [value, encode_headers(headers), now, id],
            ).rowcount == 1

    def trace(self, msg_id: str) -> list[OutboxMessage]:
        rows = self._read(
            f"SELECT {_COLUMNS} FROM {self._t} WHERE msg_id = %s AND status = 2 UNION ALL "
            f"SELECT {_COLUMNS} FROM {self._t} WHERE msg_id = %s AND status = 0 ORDER BY 1",
            [msg_id, msg_id],
        )
        return [row_from_columns(r) for r in rows]

    def add_audit(self, *, who: str, action: str, filter: str, count: int, at: float) -> int:
        with self._conn() as conn:
            row = conn.execute(
                f"INSERT INTO {self._audit_t} (at, who, action, filter, count) VALUES (%s, %s, %s, %s, %s) "
                "RETURNING id",
                [at, who, action, filter, count],
            ).fetchone()
        return int(row[0]) if row is not None else 0

    def audit_log(self, *, limit: int = 100, before_id: int | None = None) -> list[AuditEntry]:
        rows = self._read(
            f"SELECT id, at, who, action, filter, count FROM {self._audit_t} WHERE id < %s "
            "ORDER BY id DESC LIMIT %s",
            [before_id if before_id is not None else 2**63 - 1, limit],
        )
        return [AuditEntry(int(r[0]), r[1], r[2], r[3], r[4], int(r[5])) for r in rows]

    def has_pending(self, topic: str, key: bytes) -> bool:
        return bool(
            self._read(
                f"SELECT 1 FROM {self._t} WHERE status = 0 AND key IS NOT NULL AND topic = %s "
                "AND md5(key) = md5(%s::bytea) AND key = %s::bytea LIMIT 1",
                [topic, key, key],
            )
        )

    def pending_keys(self) -> set[tuple[str, bytes]]:
        rows = self._read(f"SELECT DISTINCT topic, key FROM {self._t} WHERE status = 0 AND key IS NOT NULL")
        return {(t, bytes(k)) for t, k in rows}

    def keys_with_pending(self, keys: Sequence[tuple[str, bytes]]) -> set[tuple[str, bytes]]:
        if not keys:
            return set()
        rows = self._read(
            f"SELECT DISTINCT c.t, c.k FROM unnest(%s::text[], %s::bytea[]) AS c(t, k) WHERE EXISTS ("
            f"SELECT 1 FROM {self._t} AS o WHERE o.status = 0 AND o.key IS NOT NULL AND o.topic = c.t "
            "AND md5(o.key) = md5(c.k) AND o.key = c.k)",
            [[t for t, _ in keys], [k for _, k in keys]],
        )
        return {(t, bytes(k)) for t, k in rows}

    def next_due_at(self) -> float | None:
        rows = self._read(f"SELECT min(next_attempt_at) FROM {self._t} WHERE status = 0")
        return None if rows[0][0] is None else float(rows[0][0])

    def stats(self, *, now: float) -> StoreStats:
        with self._conn() as conn:
            by_state = conn.execute(
                "SELECT status, topic, count(*), min(created_at), "
                "count(*) FILTER (WHERE lease_owner IS NOT NULL AND next_attempt_at > %s) "
                f"FROM {self._t} GROUP BY status, topic",
                [now],
            ).fetchall()
            errors = conn.execute(
                "SELECT COALESCE(error_name || ' (' || error_code || ')', error_name, '?'), "
                f"count(*) FROM {self._t} WHERE status = 2 GROUP BY 1"
            ).fetchall()
            due = conn.execute(f"SELECT min(next_attempt_at) FROM {self._t} WHERE status = 0").fetchone()
        pending_by_topic: dict[str, int] = {}
        dead_by_topic: dict[str, int] = {}
        oldest: float | None = None
        leased = 0
        for status, topic, count, created, leased_n in by_state:
            if status == Status.PENDING:
                pending_by_topic[topic] = count
                oldest = created if oldest is None else min(oldest, created)
                leased += leased_n or 0
            else:
                dead_by_topic[topic] = count
        return StoreStats(
            pending=sum(pending_by_topic.values()),
            dead=sum(dead_by_topic.values()),
            leased=leased,
            oldest_pending_at=oldest,
            next_due_at=due[0] if due is not None else None,
            pending_by_topic=pending_by_topic,
            dead_by_topic=dead_by_topic,
            dead_by_error={e: n for e, n in errors},
        )

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._pool.close()
        with self._owner_lock:
            conns, self._owner_conns = self._owner_conns, {}
        for conn, _ in conns.values():
            conn.close()  # the owners' locks go with them: their leases are free to take

    # -- lease owners ------------------------------------------------------------------------

    def _owner_key(self, owner: str) -> tuple[int, int]:
        """The two-int advisory-lock key of an owner of this table (31 bits each: no sign)."""
        digest = hashlib.blake2b(f"{self._schema}.{self._table_name}\0{owner}".encode(), digest_size=8).digest()
        return (
            int.from_bytes(digest[:4], "big") & 0x7FFFFFFF,
            int.from_bytes(digest[4:], "big") & 0x7FFFFFFF,
        )

    def _hold_owner(self, owner: str) -> None:
        """Make sure `owner` holds its liveness lock before it leases anything.

        One dedicated connection per owner, outside the pool (a pooled connection is shared and
        recycled; a session lock must live exactly as long as its owner). Checked at most once
        a second; after a server restart the lock is taken again on a new connection.
        """
        now = time.monotonic()
        held = self._owner_conns.get(owner)
        if held is not None and now - held[1] < 1.0:
            return
        with self._owner_lock:
            held = self._owner_conns.get(owner)
            if held is not None:
                conn = held[0]
                try:
                    conn.execute("SELECT 1")
                    self._owner_conns[owner] = (conn, now)
                    return
                except self._psycopg.Error:
                    conn.close()
                    log.warning("PostgreSQL outbox %s: lease owner %s lost its session; taking its lock again",
                                self._where, describe_owner(owner))
            if self._closed:
                raise StoreError(f"PostgreSQL outbox {self._where} is closed")
            try:
                conn = self._psycopg.connect(**self._kwargs, autocommit=True)
                k1, k2 = self._owner_key(owner)
                got = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", [k1, k2]).fetchone()
            except self._psycopg.Error as exc:
                raise self._error(exc, "taking the lease owner's lock") from None
            if not got or not got[0]:
                log.warning("PostgreSQL outbox %s: another session holds the lock of lease owner %s",
                            self._where, describe_owner(owner))
            self._owner_conns[owner] = (conn, now)

    def owner_liveness(self, owners: Sequence[str]) -> dict[str, Liveness]:
        """Alive, gone or unknown, for each lease owner.

        An owner of this host is judged by its process (`outbox.owners.local_liveness`);
        otherwise an owner named by `outbox.owners.new_owner` is alive while its advisory lock
        is held, and gone when it is free. Other names are unknown (their leases expire).
        """
        out: dict[str, Liveness] = {}
        remote: dict[tuple[int, int], str] = {}
        for o in owners:
            live = local_liveness(o)
            if live is Liveness.UNKNOWN and parse_owner(o) is not None:
                remote[self._owner_key(o)] = o
            out[o] = live
        if remote:
            held = {
                (int(a), int(b))
                for a, b in self._read(
                    "SELECT classid::int8, objid::int8 FROM pg_locks WHERE locktype = 'advisory' "
                    "AND objsubid = 2 AND granted "
                    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                )
            }
            for key, o in remote.items():
                out[o] = Liveness.ALIVE if key in held else Liveness.GONE
        return out

    def backlog(self, *, now: float, topic: str | None = None) -> Backlog:
        sql, args = backlog_sql(self._t, "%s", now, topic)
        return backlog_from_rows(self._read(sql, args), self.owner_liveness)

    def release_gone_owners(self, *, now: float) -> int:
        """Give back, due now, every lease whose owner is gone (see `owner_liveness`).

        Claimers call it at their first claim and then now and then (`SweepSchedule`), so a drain
        started after an owner died takes over at once. Returns how many rows were released.
        """
        started = time.monotonic()
        try:
            owners = [
                r[0]
                for r in self._read(
                    f"SELECT DISTINCT lease_owner FROM {self._t} "
                    "WHERE status = 0 AND next_attempt_at > %s AND lease_owner IS NOT NULL",
                    [now],
                )
            ]
            gone = [o for o, live in self.owner_liveness(owners).items() if live is Liveness.GONE]
            if not gone:
                return 0
            with self._conn() as conn:
                released = conn.execute(
                    f"UPDATE {self._t} SET lease_owner = NULL, next_attempt_at = %s "
                    "WHERE status = 0 AND next_attempt_at > %s AND lease_owner = ANY(%s::text[])",
                    [now, now, gone],
                ).rowcount
        finally:
            self._sweeps.done(started)
        log.info(
            "PostgreSQL outbox %s: released %d leased row(s) of %s (owner gone)",
            self._where, released, ", ".join(describe_owner(o) for o in gone),
        )
        return released
