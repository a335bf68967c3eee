"""PostgreSQL outbox: one table shared by a fleet of producers and drainers.

Same contract and column meanings as `SQLiteOutbox` (see `outbox.stores.base`): statuses are
small integers, times are epoch seconds in `double precision`, key/value/headers are opaque
`bytea` (headers in `outbox.codec`'s layout), and a lease is `lease_owner` plus
`next_attempt_at` pushed to the lease's expiry.

The due index covers `ready_at`, not `next_attempt_at` (schema version 5): "due when, leases
aside", set with `next_attempt_at` by every write except a lease, and never later than it. A
lease then changes no indexed column, so it is a heap-only (HOT) update in the room the table's
fillfactor leaves on each page, with no new index entries. Due rows are found on the `ready_at`
index and judged on `next_attempt_at`; the leased rows the index also returns are the few in
flight.

Connections come from a `psycopg_pool.ConnectionPool` in autocommit mode: single statements
commit on their own, and multi-statement work runs in an explicit short transaction. No
transaction is ever held across a Kafka send.

How N processes claim at once (the choice, and why):
    ``SELECT … FOR UPDATE SKIP LOCKED`` alone keeps each row with one claimer, but not per-key
    order: while claimer A's transaction holds the lock on row 5 of key K, claimer B skips it
    and can take row 7 of K, and both are then sent in parallel. So claim transactions are
    serialized with ``pg_advisory_xact_lock(<hash of schema.table>)``. A claim is a couple of
    short statements (a few milliseconds); the sends happen outside it, so drainers still send
    in parallel. No Python runs under the lock but the row fetch and the per-key check: the
    transaction runs in pipeline mode, so the lease and its COMMIT go to the server together,
    and the rows stay as read (`ClaimedRows`) until they are sent. After taking the lock, each
    statement of the claim runs on a fresh READ COMMITTED snapshot, so it sees every lease
    committed by the previous claimer. SKIP LOCKED stays, for rows locked by acknowledging
    writers (delete / reschedule / release), and the per-key check treats any earlier PENDING
    row of the key that was not among the candidates (not due, leased, or skipped because
    locked) as blocking the key's later rows. That rule alone already closes the SKIP LOCKED
    hole (the lock-free check still sees the row another claimer is locking); the advisory lock
    is kept as a second, simpler guarantee. With neither (SQLite's "earlier row not yet due"
    check and no lock), tests/integration/test_postgres_store.py's 4-process test does catch
    keys claimed out of order.

Claim plan: a probe counts due rows (up to 5,000) on the ready_at index. Few
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
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, StoreError
from ..owners import Liveness, describe_owner, local_liveness, parse_owner
from ..records import DeadLetterFilter, NewMessage, OutboxMessage, Status
from .base import (
    COLUMNS,
    INSERT_COLUMNS,
    Applied,
    Capabilities,
    Failure,
    Outbox,
    Settlement,
    insert_values,
    row_from_columns,
)
from .postgres_claim import ClaimedRows, Row
from .postgres_schema import NEXT_DUE_SQL, SCHEMA_VERSION

if TYPE_CHECKING:  # psycopg is the optional "postgres" extra: imported lazily at run time.
    import psycopg
from .bulk import BulkRead
from .postgres_admin import PostgresAdmin

__all__ = ["SCHEMA_VERSION", "PostgresOutbox"]

log = logging.getLogger(__name__)

_TYPES = {
    "msg_id": "text", "topic": "text", "key": "bytea", "value": "bytea", "headers": "bytea",
    "partition": "int", "status": "smallint", "attempts": "int", "created_at": "float8",
    "first_failed_at": "float8", "last_failed_at": "float8", "next_attempt_at": "float8",
    "last_error": "text", "error_code": "int", "error_name": "text", "lease_owner": "text",
    "timestamp": "bigint",
}
# COPY's binary column types, in `INSERT_COLUMNS` order after the id.
_COPY_TYPES = ["int8", *(
    {"text": "text", "bytea": "bytea", "int": "int4", "smallint": "int2", "float8": "float8",
     "bigint": "int8"}[_TYPES[c]]
    for c in INSERT_COLUMNS
)]
_COPY_TYPES.append("float8")  # ready_at
_COPY = "COPY {t} (id, " + ", ".join(INSERT_COLUMNS) + ", ready_at) FROM STDIN (FORMAT BINARY)"
_NEXT_ATTEMPT = INSERT_COLUMNS.index("next_attempt_at")

# Rows due at %s (both placeholders: the same time): found on the ready_at index, judged exactly.
_DUE = "status = 0 AND ready_at <= %s AND next_attempt_at <= %s"
# The ids are drawn from the identity sequence first, as for COPY (which may set them).
_INSERT = (
    "INSERT INTO {t} (id, " + ", ".join(INSERT_COLUMNS) + ", ready_at) OVERRIDING SYSTEM VALUE VALUES ("
    + ", ".join(["%s"] * (len(INSERT_COLUMNS) + 2)) + ")"
)

_ALL = DeadLetterFilter()  # the empty filter: every dead letter


def _pending_ids(ids: Sequence[int]) -> tuple[str, list[Any]]:
    """WHERE clause and arguments for "the PENDING rows among `ids`", as read by the primary key.

    A batch's ids are nearly contiguous: then the clause is a range on the primary key, with the
    ids themselves checked as a filter (`id + 0`: not one index search per id), or not at all
    when they are the whole range; the status check is written so that no partial index matches
    it (`status + 0`). Otherwise, on a table not yet analyzed, the planner takes `status = 0` for
    0.5% of the rows and reads every pending row through a partial index, once per claim and
    once per settle.
    """
    lo, hi = min(ids), max(ids)
    if hi - lo + 1 == len(ids) == len(set(ids)):
        return "status + 0 = 0 AND id BETWEEN %s::bigint AND %s::bigint", [lo, hi]
    if hi - lo < 2 * len(ids):
        return (
            "status + 0 = 0 AND id BETWEEN %s::bigint AND %s::bigint AND id + 0 = ANY(%s::bigint[])",
            [lo, hi, _id_array(ids)],
        )
    return "status = 0 AND id = ANY(%s::bigint[])", [_id_array(ids)]


def _id_array(ids: Sequence[int]) -> str:
    """`ids` as an array literal: psycopg's list dumper costs ~2.5 µs an element, this ~0.1."""
    return "{" + ",".join(map(str, ids)) + "}"


# Up to this many due rows, claim sorts them instead of walking the pending rows in id order.
_SORT_DUE_UP_TO = 5_000

class PostgresOutbox(PostgresAdmin, Outbox):
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

    capabilities = Capabilities(transactional_enqueue=True, owner_liveness=True, bulk_read=True)

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
        # Ids are drawn from the table's identity sequence first, then the rows are streamed
        # with binary COPY (one round trip each; ~5x the rows/s of a multi-row INSERT of the
        # same rows). Sorted ids follow the input order, which is what orders a key's rows,
        # even when other writers draw ids at the same time.
        ids = sorted(
            r[0] for r in conn.execute(
                "SELECT nextval(%s::regclass) FROM generate_series(1, %s)", [self._id_seq, len(messages)]
            ).fetchall()
        )
        with conn.cursor().copy(_COPY.format(t=self._t)) as copy:
            copy.set_types(_COPY_TYPES)
            write = copy.write_row
            # ready_at: next_attempt_at, or for a row born leased its due time without the lease.
            for i, m in zip(ids, messages, strict=True):
                v = insert_values(m, status, lease_owner, lease_until, now)
                write((i, *v, min(m.next_attempt_at, v[_NEXT_ATTEMPT])))
        return ids

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

    def bulk_read(self) -> BulkRead:
        return BulkRead(table=self._t, grouped=False, schema="timestamp LONG")

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
        # SQLAlchemy's adapter of a psycopg AsyncConnection (an AsyncSession's run_sync()) runs
        # each DB-API call on the event loop; its driver's state answers the checks.
        driver = getattr(conn, "driver_connection", conn)
        if not (isinstance(conn, psycopg.Connection) or isinstance(driver, psycopg.AsyncConnection)):
            raise ConfigError(
                f"transaction must be a psycopg.Connection (got {type(conn).__name__}), or an "
                "AsyncSession on psycopg given to AsyncResilientProducer"
            )
        if driver.closed:
            raise ConfigError("transaction connection is closed")
        if driver.info.dbname != self.url.database:
            raise ConfigError(
                f"transaction connection is to database {driver.info.dbname!r}, but the outbox is "
                f"in {self._where}"
            )
        status = driver.info.transaction_status
        if status == psycopg.pq.TransactionStatus.INERROR:
            raise StoreError(
                f"PostgreSQL outbox {self._where}: the caller's transaction is aborted; roll it back"
            )
        if driver.autocommit and status == psycopg.pq.TransactionStatus.IDLE:
            raise ConfigError(
                "transaction connection is in autocommit mode outside a transaction block: use "
                "`with conn.transaction():` or a non-autocommit connection"
            )
        if not messages:
            return []
        try:
            if driver is conn:
                return self._insert(conn, messages, Status.PENDING, None, None, time.time())
            return self._insert_adapted(conn, messages, time.time())
        except psycopg.Error as exc:
            raise self._error(exc, "enqueue in the caller's transaction") from None

    def _insert_adapted(self, conn: Any, messages: Sequence[NewMessage], now: float) -> list[int]:
        """PENDING rows through a DB-API adapter that has no COPY (SQLAlchemy's, of an asyncio
        connection): ids first, as `_insert` draws them, then one multi-row statement."""
        cur = conn.cursor()
        cur.execute("SELECT nextval(%s::regclass) FROM generate_series(1, %s)", [self._id_seq, len(messages)])
        ids = sorted(r[0] for r in cur.fetchall())
        rows = []
        for i, m in zip(ids, messages, strict=True):
            v = insert_values(m, Status.PENDING, None, None, now)
            rows.append((i, *v, v[_NEXT_ATTEMPT]))  # ready_at: not leased, so its due time
        cur.executemany(_INSERT.format(t=self._t), rows)
        return ids

    def add_dead(self, messages: Sequence[NewMessage], *, failed_at: float) -> list[int]:
        if not messages:
            return []
        with self._conn() as conn:
            return self._insert(conn, messages, Status.DEAD, None, None, failed_at)

    def _delete(self, conn: psycopg.Connection[Any], ids: Sequence[int]) -> int:
        if not ids:
            return 0
        where, args = _pending_ids(ids)
        return conn.execute(f"DELETE FROM {self._t} WHERE {where}", args).rowcount

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
                "next_attempt_at = f.retry, ready_at = f.retry, lease_owner = NULL "
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
        cols = ", ".join(f"o.{c.strip()}" for c in COLUMNS.split(","))
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
        if not (new or settlement.failures or settlement.released):
            # The common settlement, a delivered batch: one set-based DELETE that commits on its
            # own (autocommit), without the BEGIN and COMMIT round trips of a transaction.
            with self._conn() as conn:
                return Applied([], self._delete(conn, settlement.delivered), [])
        with self._tx() as conn:
            ids = self._insert(conn, new, Status.PENDING, lease_owner, lease_until, now)
            deleted = self._delete(conn, settlement.delivered)
            dead = self._fail(conn, settlement.failures)
            if settlement.released:
                conn.execute(
                    f"UPDATE {self._t} SET lease_owner = NULL, next_attempt_at = %s, ready_at = %s "
                    "WHERE id = ANY(%s::bigint[]) AND status = 0",
                    [now, now, settlement.released],
                )
        return Applied(ids, deleted, dead)

    def claim(
        self, owner: str, limit: int, lease_seconds: float, *, now: float, topic: str | None = None,
        in_flight: Collection[int] = (),
    ) -> Sequence[OutboxMessage]:
        if limit <= 0:
            return []
        self._hold_owner(owner)
        if self._sweeps.due():
            self.release_gone_owners(now=now)
        return self._claim_due(owner, limit, lease_seconds, now, topic, in_flight)

    def _claim_due(
        self, owner: str, limit: int, lease_seconds: float, now: float, topic: str | None,
        in_flight: Collection[int],
    ) -> Sequence[OutboxMessage]:
        """`claim` after the sweep for gone owners' leases."""
        where = _DUE
        args: list[Any] = [now, now]
        if topic is not None:
            where += " AND topic = %s"
            args.append(topic)
        with self._conn() as conn:
            # Probe without the claim lock, on the ready_at index, counting due
            # rows up to a cap. Nothing due (an outage): idle pollers neither queue on the lock
            # nor scan. Few due: walking the pending rows in id order could pass millions that
            # back off first (the planner assumes due rows are spread evenly over ids; after an
            # outage they are not), so fetch the due rows by the due index and sort them (`id + 0`
            # keeps the planner off the id index). Many due: they are dense among the pending
            # rows, and the id-order walk stops after `limit` of them. While claims keep coming
            # back full from a dense backlog, the probe (a scan of up to 5,000 index entries, as
            # much as the claim itself) is skipped: the walk is the right plan until one is short.
            if self._dense_backlog:
                order = "id"
            else:
                n_due = conn.execute(
                    f"SELECT count(*) FROM (SELECT 1 FROM {self._t} WHERE {where} LIMIT %s) AS d",
                    [*args, _SORT_DUE_UP_TO],
                ).fetchone()
                if n_due is None or n_due[0] == 0:
                    return []
                order = "id + 0" if n_due[0] < _SORT_DUE_UP_TO else "id"
            sql = f"SELECT {COLUMNS} FROM {self._t} WHERE {where} ORDER BY {order} LIMIT %s"
            full, rows, leased = self._claim_tx(
                conn, sql, [*args, limit], order, limit, in_flight, owner, now, lease_seconds
            )
            self._dense_backlog = order == "id" and full
            if len(leased) != len(rows):
                rows = self._give_back_lost(conn, rows, leased, now)
            return ClaimedRows(rows)

    def _claim_tx(
        self, conn: psycopg.Connection[Any], sql: str, args: list[Any], order: str, limit: int,
        in_flight: Collection[int], owner: str, now: float, lease_seconds: float,
    ) -> tuple[bool, list[Row], set[int]]:
        """One claim's transaction: read the candidates, keep each key's order, lease them,
        commit. Returns whether the read was full (`limit` candidates), the rows kept, and the
        ids leased.

        In pipeline mode: the lease and the COMMIT go to the server together, so the claim lock
        ends with that COMMIT, on the server, however long this thread then waits for the
        interpreter lock (four drain processes on two cores queued on a lock held through such
        waits). No Python work is left between the read and the lease: the rows stay as read
        (`ClaimedRows`) until the send loop reads their re-sends.
        """
        with conn.pipeline(), conn.transaction():
            # The walk in id order is also forbidden to sort (for this transaction only): on a
            # table not yet analyzed (a spill fills one in seconds; autovacuum analyzes it a
            # minute later) the planner guesses few due rows and would read every due row and
            # sort them all, ten times the walk's time.
            conn.execute(
                "SELECT pg_advisory_xact_lock(%s), set_config('enable_sort', %s, true)",
                [self._claim_lock, "off" if order == "id" else "on"],
            )
            # No FOR UPDATE: the advisory lock already keeps other claimers out, and locking
            # each candidate row wrote it (and its WAL) once more before the lease did. A
            # row an acknowledging writer changes meanwhile fails the lease's own recheck
            # below (READ COMMITTED re-evaluates the WHERE on the newest row version).
            # Binary results: bytea arrives as is, not as hex text to decode (the values
            # are most of a row's bytes).
            rows = conn.cursor(binary=True).execute(sql, args).fetchall()
            full = len(rows) == limit
            rows = self._keep_key_order(conn, rows, in_flight)
            if not rows:  # nothing due, or every candidate waits for an earlier row of its key
                return full, rows, set()
            ids = [r[0] for r in rows]
            where, where_args = _pending_ids(ids)
            until = now + lease_seconds
            lease = conn.execute(
                f"UPDATE {self._t} SET lease_owner = %s, next_attempt_at = %s "
                f"WHERE {where} AND next_attempt_at <= %s",
                [owner, until, *where_args, now],
            )
        if lease.rowcount == len(ids):  # the rule: no `RETURNING id` (~0.7 µs a row) to learn it
            return full, rows, set(ids)
        got = conn.execute(
            f"SELECT id FROM {self._t} WHERE id = ANY(%s::bigint[]) AND lease_owner = %s AND next_attempt_at = %s",
            [_id_array(ids), owner, until],
        )
        return full, rows, {r[0] for r in got.fetchall()}

    def _give_back_lost(
        self, conn: psycopg.Connection[Any], rows: list[Row], leased: set[int], now: float
    ) -> list[Row]:
        """The claimed rows (`COLUMNS`: id, msg_id, topic, key, ...), once some candidates were
        not leased.

        Rare: a candidate changed between the read and the lease. Its key's later candidates
        must wait for it, so their fresh leases are given back at once (after the claim's
        commit: until then they are leased to this claimer, and nobody else can take them).
        """
        lost_keys = {(r[2], r[3]) for r in rows if r[0] not in leased}
        keep: list[Row] = []
        back: list[int] = []
        blocked: set[tuple[str, bytes | None]] = set()
        for r in rows:
            k = (r[2], r[3])
            if r[0] not in leased:
                if r[3] is not None:
                    blocked.add(k)
            elif r[3] is not None and k in lost_keys and k in blocked:
                back.append(r[0])
            else:
                keep.append(r)
        if back:
            conn.execute(
                f"UPDATE {self._t} SET lease_owner = NULL, next_attempt_at = %s, ready_at = %s "
                "WHERE id = ANY(%s::bigint[])",
                [now, now, back],
            )
        return keep

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
        rows = self._read(NEXT_DUE_SQL.format(t=self._t))
        return None if rows[0][0] is None else float(rows[0][0])

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
                    f"UPDATE {self._t} SET lease_owner = NULL, next_attempt_at = %s, ready_at = %s "
                    "WHERE status = 0 AND next_attempt_at > %s AND lease_owner = ANY(%s::text[])",
                    [now, now, now, gone],
                ).rowcount
        finally:
            self._sweeps.done(started)
        log.info(
            "PostgreSQL outbox %s: released %d leased row(s) of %s (owner gone)",
            self._where, released, ", ".join(describe_owner(o) for o in gone),
        )
        return released

