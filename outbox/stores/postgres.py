"""PostgreSQL outbox: one table shared by a fleet of producers and drainers.

Same contract and column meanings as `SQLiteOutbox` (see `outbox.stores.base`): statuses are
small integers, times are epoch seconds in `double precision`, key/value/headers are opaque
`bytea` (headers in `outbox.stores.codec`'s layout), and a lease is `lease_owner` plus
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
rows backing off (the walk passes every one of them).

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
from typing import TYPE_CHECKING, Any, NamedTuple

from outbox.errors import ConfigError, DecryptionError, StoreError
from outbox.records import DeadLetterFilter, NewMessage, OutboxMessage, Status
from outbox.stores import grouped, sealed
from outbox.stores.base import (
    INSERT_COLUMNS,
    Applied,
    Capabilities,
    Failure,
    Outbox,
    Rewrite,
    Settlement,
    insert_values,
    stored_payload,
)
from outbox.stores.encryption import KeyRing
from outbox.stores.grouping import NewGroup, prepare, rows_of
from outbox.stores.owners import Liveness, describe_owner, local_liveness, parse_owner
from outbox.stores.postgres_claim import ClaimedRows, Row, message_of
from outbox.stores.postgres_schema import NEXT_DUE_SQL, SCHEMA_VERSION

if TYPE_CHECKING:  # psycopg is the optional "postgres" extra: imported lazily at run time.
    import psycopg
from outbox.stores.bulk import BulkRead
from outbox.stores.postgres_admin import ROW, PostgresAdmin

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
_COPY_TYPES += ["float8", "int4", "bytea", "bytea"]  # ready_at, n, body, keys
_COPY = "COPY {t} (id, " + ", ".join(INSERT_COLUMNS) + ", ready_at, n, body, keys) FROM STDIN (FORMAT BINARY)"
# The same with the encryption key's id last (`outbox.stores.sealed`): encrypted rows.
_SEALED_COPY = _COPY.replace(", keys)", ", keys, enc_key)")
_SEALED_COPY_TYPES = [*_COPY_TYPES, "text"]
_NEXT_ATTEMPT = INSERT_COLUMNS.index("next_attempt_at")
# A row's group columns: n, body, keys (a one-message row's).
_SINGLE = (1, None, None)
# What a claim selects: `COLUMNS` and the key id (`ROW`), then the group columns at these positions.
_CLAIMED = f"{ROW}, n, body, keys"
N, BODY, KEYS = 18, 19, 20

# Rows due at %s (both placeholders: the same time): found on the ready_at index, judged exactly.
_DUE = "status = 0 AND ready_at <= %s AND next_attempt_at <= %s"
# The ids are drawn from the identity sequence first, as for COPY (which may set them).
_INSERT = (
    "INSERT INTO {t} (id, " + ", ".join(INSERT_COLUMNS) + ", ready_at) OVERRIDING SYSTEM VALUE VALUES ("
    + ", ".join(["%s"] * (len(INSERT_COLUMNS) + 2)) + ")"
)

_SEALED_INSERT = _INSERT.replace(", ready_at)", ", ready_at, enc_key)").replace("VALUES (", "VALUES (%s, ")

_ALL = DeadLetterFilter()  # the empty filter: every dead letter


def _pending_ids(ids: Sequence[int]) -> tuple[str, list[Any]]:
    """WHERE clause and arguments for "the PENDING rows among `ids`", as read by the primary key.

    A batch's ids are nearly contiguous: then the clause is a range on the primary key, with the
    ids themselves checked as a filter (`id + 0`: not one index search per id), or not at all
    when they are the whole range; the status check is written so that no partial index matches
    it (`status + 0`). Otherwise, on a table not yet analyzed, the planner guesses that few rows
    have `status = 0` and reads every pending row through a partial index, once per claim and
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
    """`ids` as an array literal: psycopg's list dumper is over ten times slower."""
    return "{" + ",".join(map(str, ids)) + "}"


def _row_id(r: Row) -> int:
    return int(r[0])


# Up to this many due rows, claim sorts them instead of walking the pending rows in id order.
_SORT_DUE_UP_TO = 5_000


class _Lease(NamedTuple):
    """The lease a claim sets: rows due at `now` go to `owner` until `until`."""

    owner: str
    now: float
    until: float


class PostgresOutbox(PostgresAdmin, Outbox):
    """The fleet outbox store, in one PostgreSQL table.

    Args:
        url: the parsed URL (`outbox.stores.urls.parse_url`); its `schema` and `table` name the table.
        create: create the schema, the table and its indexes if missing. With False a missing
            table raises `StoreNotFoundError` (the CLI's choice: a typo is not a new outbox).
        pool_size: most connections this store opens (threads of one process share them).

    Raises:
        StoreError: the server is unreachable, the credentials are wrong, the database does not
            exist, or the user may not create the schema. The message names host:port/database.
        StoreNotFoundError: `create` is False and the outbox table does not exist.
    """

    capabilities = Capabilities(transactional_enqueue=True, owner_liveness=True, grouped_rows=True, bulk_read=True)

    # -- writes ------------------------------------------------------------------------------

    def _insert(
        self,
        conn: psycopg.Connection[Any],
        messages: Sequence[NewMessage],
        status: Status,
        lease_owner: str | None,
        lease_until: float | None,
        now: float,
        *,
        lock_ids: bool = False,
    ) -> list[int]:
        """Store `messages` (as groups where `outbox.stores.grouping` says so); their ids, in order.

        Ids are drawn from the table's identity sequence first, then the rows are streamed with
        binary COPY (one round trip each; about five times the rows/s of a multi-row INSERT of
        the same rows). Sorted ids follow the input order, which is what orders a key's rows,
        even when other writers draw ids at the same time.

        A group takes n + 1 consecutive ids: its own, then its messages'. Another writer drawing
        at the same moment can break the run; then the group's messages are stored one row each
        with the ids drawn, which are as good. `lock_ids` (an autocommit write: the lock ends
        with the statement) draws under a lock per table, so that concurrent spills keep their
        groups; inside a transaction it would be held until the commit, so it is not taken.
        """
        if not messages:
            return []
        if lease_owner is not None and lease_until is not None:
            self._hold_owner(str(lease_owner))
        ring = self.encryption
        parts = prepare(messages, status, lease_owner, lease_until, now, ring)
        count = sum(p.n + 1 if isinstance(p, NewGroup) else len(p) for p in parts)
        source = "generate_series(1, %s)"
        args: list[Any] = [self._id_seq, count]
        if lock_ids and any(isinstance(p, NewGroup) for p in parts):
            source = "(SELECT pg_advisory_xact_lock(%s)) AS l, " + source
            args.insert(1, self._id_lock)
        # The ids come back as their bounds when they are one run (the rule under the lock), not
        # one row each; the list itself only when another writer's ids are among them.
        row = conn.execute(
            "SELECT min(i), max(i), CASE WHEN max(i) - min(i) + 1 = count(*) THEN NULL "
            f"ELSE array_agg(i ORDER BY i) END FROM (SELECT nextval(%s::regclass) AS i FROM {source}) AS d",
            args,
        ).fetchone()
        assert row is not None  # an aggregate's one row
        ids: Sequence[int] = range(row[0], row[1] + 1) if row[2] is None else row[2]
        stored: list[int] = []
        # Encrypted rows end with their key's id (`sealed.seal_values`), after the group columns.
        kid = () if ring is None else (ring.current,)
        with conn.cursor().copy((_COPY if ring is None else _SEALED_COPY).format(t=self._t)) as copy:
            copy.set_types(_COPY_TYPES if ring is None else _SEALED_COPY_TYPES)
            write = copy.write_row
            at = 0  # the next id to use
            pos = 0  # the next message
            for part in parts:
                if isinstance(part, NewGroup):
                    gid, n = ids[at], part.n
                    if ids[at + n] == gid + n:
                        # The group row (`INSERT_COLUMNS`, then ready_at and the group columns):
                        # its messages' own columns are in its body.
                        write((gid, "", part.topic, None, None, None, -1, int(status), 0, now, None, None,
                               part.due, None, None, None, part.owner, 0, part.ready_at, n, part.body, part.keys,
                               *kid))
                        stored += range(gid + 1, gid + n + 1)
                        at += n + 1
                        pos += n
                        continue
                    until = part.due if part.owner is not None else None
                    rows = rows_of(part.messages, status, part.owner, until, now, ring)
                    at += 1  # the group's own id, not needed
                else:
                    rows = part
                for v in rows:
                    # ready_at: next_attempt_at, or for a row born leased its due time without the lease.
                    i = ids[at]
                    ready = min(messages[pos].next_attempt_at, v[_NEXT_ATTEMPT])
                    write((i, *v, ready, *_SINGLE) if ring is None else (i, *v[:-1], ready, *_SINGLE, v[-1]))
                    stored.append(i)
                    at += 1
                    pos += 1
        return stored

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
            return self._insert(
                conn, messages, Status.PENDING, lease_owner, lease_until, time.time(), lock_ids=True
            )

    def bulk_read(self) -> BulkRead:
        return BulkRead(table=self._t, grouped=True, schema="timestamp LONG, n LONG, body BINARY")

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
        ring = self.encryption
        for i, m, v in zip(ids, messages, rows_of(messages, Status.PENDING, None, None, now, ring), strict=True):
            ready = m.next_attempt_at  # ready_at: not leased, so its due time
            rows.append((i, *v, ready) if ring is None else (i, *v[:-1], ready, v[-1]))
        cur.executemany((_INSERT if ring is None else _SEALED_INSERT).format(t=self._t), rows)
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
        cols = ", ".join(f"o.{c.strip()}" for c in ROW.split(","))
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
        return sorted((self._message(r) for r in cur.fetchall()), key=lambda m: m.id)

    def _groups_touched(self, conn: psycopg.Connection[Any], settlement: Settlement) -> list[tuple[int, int]]:
        """(id, n) of the group rows whose messages the settlement names (on the group index)."""
        touched = [
            *settlement.delivered, *settlement.released, *(f.id for f in settlement.failures),
            *(r.id for r in settlement.rewritten),
        ]
        if not touched:
            return []
        return conn.execute(
            f"SELECT id, n FROM {self._t} WHERE n > 1 AND id BETWEEN %s AND %s AND status = 0",
            [min(touched) - grouped.GROUP_MAX - 1, max(touched)],
        ).fetchall()

    def _settle_groups(
        self, conn: psycopg.Connection[Any], settlement: Settlement, now: float, found: Sequence[tuple[int, int]],
        delivered: set[int],
    ) -> tuple[int, list[int]]:
        """The groups among a settlement's messages: deleted when every message of one was
        delivered, released as one row when every message was given back, else exploded into
        one-message rows (less the delivered ones) that the rest of `apply` settles like any row.

        Returns how many delivered messages left with their groups, and the delivered ids that
        are not these groups' (one-message rows, for `_delete`): none, without a look at each
        id, when every delivered message was a whole group's (a healthy drain's settlement)."""
        released = set(settlement.released)
        rewritten = {r.id for r in settlement.rewritten}
        other = {f.id for f in settlement.failures} | released | rewritten
        whole: list[range] = []  # the messages' ids of the groups deleted whole
        split: set[int] = set()  # delivered messages of the groups split
        gone = 0
        for gid, n in found:
            ids = range(gid + 1, gid + n + 1)
            if delivered.issuperset(ids):
                whole.append(ids)
            elif released.issuperset(ids) and rewritten.isdisjoint(ids):
                # Given back whole (a stop, the cluster gone, a drain's next batch not sent): the
                # group stays one row, due now.
                conn.execute(
                    f"UPDATE {self._t} SET lease_owner = NULL, next_attempt_at = %s, ready_at = %s "
                    "WHERE id = %s AND status = 0",
                    [now, now, gid],
                )
            else:
                done = delivered.intersection(ids)
                if done or not other.isdisjoint(ids):
                    self._explode(conn, gid, skip=done)
                    gone += len(done)
                    split.update(done)
        if whole:
            gone += sum(r[0] for r in conn.execute(
                f"DELETE FROM {self._t} WHERE id = ANY(%s::bigint[]) AND n > 1 AND status = 0 RETURNING n",
                [_id_array([ids.start - 1 for ids in whole])],
            ).fetchall())
        if sum(map(len, whole)) == len(delivered):
            return gone, []
        of_groups = split.union(*whole)
        return gone, [i for i in settlement.delivered if i not in of_groups]

    def _rewrite(self, conn: psycopg.Connection[Any], rewrites: Sequence[Rewrite]) -> None:
        """Replace pending one-message rows' messages (`Outbox.apply`; their groups are exploded
        already), in one statement."""
        if not rewrites:
            return
        stored = [stored_payload(r.msg_id, r.value, r.headers, self.encryption) for r in rewrites]
        conn.execute(
            f'UPDATE {self._t} AS o SET topic = r.topic, value = r.value, headers = r.headers, enc_key = r.kid, '
            '"partition" = r.part '
            "FROM unnest(%s::bigint[], %s::text[], %s::text[], %s::bytea[], %s::bytea[], %s::text[], %s::int[]) "
            "AS r(id, msg_id, topic, value, headers, kid, part) "
            "WHERE o.id = r.id AND o.msg_id = r.msg_id AND o.status = 0",
            [
                [r.id for r in rewrites], [r.msg_id for r in rewrites], [r.topic for r in rewrites],
                [v for v, _, _ in stored], [h for _, h, _ in stored], [k for _, _, k in stored],
                [r.partition for r in rewrites],
            ],
        )

    def _explode(self, conn: psycopg.Connection[Any], gid: int, *, skip: Collection[int] = ()) -> int:
        """Replace a group row with one row per message (their own ids; lease and created_at
        kept), leaving out the ids in `skip`. Returns how many rows it wrote.

        Run in a transaction: the group row is locked until it commits."""
        row = conn.cursor(binary=True).execute(
            f"SELECT topic, created_at, next_attempt_at, lease_owner, body, enc_key FROM {self._t} "
            "WHERE id = %s AND n > 1 AND status = 0 FOR UPDATE",
            [gid],
        ).fetchone()
        if row is None:
            return 0
        topic, created_at, due, owner, body, kid = row
        plain = self._body(gid, topic, body, kid)
        conn.execute(f"DELETE FROM {self._t} WHERE id = %s", [gid])
        until = due if owner is not None else None
        written = 0
        ring = self.encryption  # the messages encrypted again, each on its own, with the newest key
        with conn.cursor().copy((_COPY if ring is None else _SEALED_COPY).format(t=self._t)) as copy:
            copy.set_types(_COPY_TYPES if ring is None else _SEALED_COPY_TYPES)
            for m in grouped.decode(plain, gid, topic, created_at):
                if m.id not in skip:
                    v = insert_values(grouped.as_new(m), Status.PENDING, owner, until, created_at)
                    # ready_at: the message's own due time (the group's is its latest message's).
                    ready = min(m.next_attempt_at, v[_NEXT_ATTEMPT])
                    if ring is None:
                        copy.write_row((m.id, *v, ready, *_SINGLE))
                    else:
                        copy.write_row((m.id, *sealed.seal_values(v, ring)[:-1], ready, *_SINGLE, ring.current))
                    written += 1
        return written

    def explode_groups(self) -> int:
        """Store every pending group as one-message rows; return how many rows that wrote (for a
        reader of the table that cannot decode a group, as `SQLiteOutbox.explode_groups`)."""
        with self._tx() as conn:
            gids = [r[0] for r in conn.execute(f"SELECT id FROM {self._t} WHERE n > 1").fetchall()]
            return sum(self._explode(conn, gid) for gid in gids)

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
        if not (new or settlement.failures or settlement.released or settlement.rewritten):
            # The common settlement, a delivered batch: set-based DELETEs that commit on their
            # own (autocommit), without the BEGIN and COMMIT round trips of a transaction; each
            # deletes only what was delivered, so a crash between them loses nothing.
            with self._conn() as conn:
                found = self._groups_touched(conn, settlement)
                if not found:
                    return Applied([], self._delete(conn, settlement.delivered), [])
                delivered = set(settlement.delivered)
                if all(delivered.issuperset(range(g + 1, g + n + 1)) for g, n in found):
                    deleted, rest = self._settle_groups(conn, settlement, now, found, delivered)
                    return Applied([], deleted + self._delete(conn, rest), [])
        with self._tx() as conn:
            ids = self._insert(conn, new, Status.PENDING, lease_owner, lease_until, now)
            found = self._groups_touched(conn, settlement)
            deleted, rest = self._settle_groups(conn, settlement, now, found, set(settlement.delivered))
            deleted += self._delete(conn, rest)
            self._rewrite(conn, settlement.rewritten)
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
            # The first due rows up to `limit` messages: a group counts its n, and one larger than
            # what is left of the limit is taken whole only as the first row. Bodies are not read
            # (TOAST) for the rows the outer filter drops.
            sql = (
                f"SELECT {_CLAIMED} FROM (SELECT {_CLAIMED}, sum(n) OVER (ORDER BY {order} ROWS UNBOUNDED "
                f"PRECEDING) - n AS before FROM {self._t} WHERE {where} ORDER BY {order} LIMIT %s) AS c "
                "WHERE c.before = 0 OR c.before + c.n <= %s"
            )
            lease = _Lease(owner, now, now + lease_seconds)
            rows: list[Row] = []
            try:
                for _ in range(2):
                    full, rows, leased, split = self._claim_tx(
                        conn, sql, [*args, limit, limit], order, limit, in_flight, lease
                    )
                    self._dense_backlog = order == "id" and full
                    if len(leased) != len(rows):
                        rows = self._give_back_lost(conn, rows, leased, now)
                    if split is None:
                        break
                    # A group holding a key that waits behind a back-off becomes one-message rows, so
                    # that the per-key rule holds back only that key's messages, and the claim goes
                    # on with the others (read again if nothing came before the group).
                    with conn.transaction():
                        self._explode(conn, split)  # leased meanwhile: it keeps its lease
                    if rows:
                        break
                if any(r[sealed.ROW_KEY] is not None for r in rows):
                    rows = [self._opened(r) for r in rows]
            except DecryptionError:
                # Decrypted after the claim's commit (no Python work between its read and its
                # lease): the claim's rows are given back at once, due now, no attempt counted,
                # and the claim fails naming the key of the row that did not decrypt.
                if rows:
                    conn.execute(
                        f"UPDATE {self._t} SET lease_owner = NULL, next_attempt_at = %s, ready_at = %s "
                        "WHERE id = ANY(%s::bigint[]) AND status = 0",
                        [now, now, _id_array([r[0] for r in rows])],
                    )
                raise
        if all(r[N] == 1 for r in rows):
            return ClaimedRows(rows)
        # Groups stay encoded until read (`grouped.Claimed`).
        return grouped.Claimed([
            message_of(r) if r[N] == 1 else grouped.Group(r[0], r[N], r[2], r[9], r[BODY]) for r in rows
        ])

    def _opened(self, r: Row) -> Row:
        """A claimed row with its payload decrypted (a group's body, or a row's values)."""
        if r[N] == 1:
            return tuple(sealed.open_row(r, self.encryption))
        body = self._body(r[0], r[2], r[BODY], r[sealed.ROW_KEY], r[N])
        return (*r[: sealed.ROW_KEY], None, *r[sealed.ROW_KEY + 1 : BODY], body, *r[BODY + 1 :])

    def set_encryption(self, ring: KeyRing | None) -> None:
        self.encryption = ring

    def _claim_tx(
        self, conn: psycopg.Connection[Any], sql: str, args: list[Any], order: str, limit: int,
        in_flight: Collection[int], lease: _Lease,
    ) -> tuple[bool, list[Row], set[int], int | None]:
        """One claim's transaction: read the candidates, keep each key's order, lease them,
        commit. Returns whether the read was full (`limit` candidate rows), the rows kept, the
        ids leased, and a group to split (`_keep_key_order`).

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
            rows.sort(key=_row_id)  # read in order (a filter keeps it), but SQL does not promise it
            full = sum(r[N] for r in rows) >= limit
            rows, split = self._keep_key_order(conn, rows, in_flight)
            if not rows:  # nothing due, or every candidate waits for an earlier row of its key
                return full, rows, set(), split
            ids = [r[0] for r in rows]
            where, where_args = _pending_ids(ids)
            updated = conn.execute(
                f"UPDATE {self._t} SET lease_owner = %s, next_attempt_at = %s "
                f"WHERE {where} AND next_attempt_at <= %s",
                [lease.owner, lease.until, *where_args, lease.now],
            )
        if updated.rowcount == len(ids):  # the rule: no `RETURNING id` (~0.7 µs a row) to learn it
            return full, rows, set(ids), split
        got = conn.execute(
            f"SELECT id FROM {self._t} WHERE id = ANY(%s::bigint[]) AND lease_owner = %s AND next_attempt_at = %s",
            [_id_array(ids), lease.owner, lease.until],
        )
        return full, rows, {r[0] for r in got.fetchall()}, split

    def _give_back_lost(
        self, conn: psycopg.Connection[Any], rows: list[Row], leased: set[int], now: float
    ) -> list[Row]:
        """The claimed rows (`_CLAIMED`: id, msg_id, topic, key, ...), once some candidates were
        not leased.

        Rare: a candidate changed between the read and the lease. Its key's later candidates
        must wait for it, so their fresh leases are given back at once (after the claim's
        commit: until then they are leased to this claimer, and nobody else can take them). A
        lost group's keys are not read: every row after it is given back.
        """
        lost_keys = {(r[2], r[3]) for r in rows if r[0] not in leased}
        keep: list[Row] = []
        back: list[int] = []
        blocked: set[tuple[str, bytes | None]] = set()
        after_lost_group = False
        for r in rows:
            k = (r[2], r[3])
            if r[0] not in leased:
                if r[3] is not None:
                    blocked.add(k)
                after_lost_group = after_lost_group or r[N] > 1
            elif after_lost_group or (r[3] is not None and k in lost_keys and k in blocked) or (
                r[N] > 1 and blocked
            ):
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
        self, conn: psycopg.Connection[Any], rows: list[Row], in_flight: Collection[int]
    ) -> tuple[list[Row], int | None]:
        """Drop candidates that an earlier PENDING row of the same key, not claimed now, precedes.

        Candidates are the first due, unlocked rows in id order; an earlier pending row of the
        key that is not among them is leased, backing off, or locked by an acknowledging writer,
        and the key's later rows wait for it. The claimer's own rows in flight do not block (see
        `Outbox.claim`); a group is in flight when its first message is. A group's keys are
        those of its `keys` blob, on both sides.

        A candidate group that holds a key blocked by a lease is left out, and its keys then
        block the later candidates too, so other drainers' claims skip past a group another one
        holds and take the groups of other keys. The claim ends before a group one of whose keys
        waits behind a back-off. Returns the rows to claim, and that group's id (None
        otherwise): the caller splits it.
        """
        last_of_key: dict[tuple[str, bytes], int] = {}
        group_keys = {r[0]: grouped.keys_of(r[KEYS]) for r in rows if r[N] > 1}  # read once
        for r in rows:
            if r[N] > 1:
                for k in group_keys[r[0]]:
                    last_of_key[(r[2], k)] = r[0]
            elif r[3] is not None:
                last_of_key[(r[2], r[3])] = r[0]
        if not last_of_key:
            return rows, None
        ids = [r[0] for r in rows] + list(in_flight)
        found = conn.execute(
            "SELECT c.t, c.k, b.id, b.lease_owner IS NULL FROM unnest(%s::text[], %s::bytea[], %s::bigint[]) "
            "AS c(t, k, last) JOIN LATERAL (SELECT o.id, o.lease_owner FROM "
            f"{self._t} AS o WHERE o.status = 0 AND o.key IS NOT NULL AND o.topic = c.t "
            "AND md5(o.key) = md5(c.k) AND o.key = c.k AND o.id < c.last "
            "AND o.id NOT IN (SELECT unnest(%s::bigint[])) ORDER BY o.id LIMIT 1) AS b ON true",
            [[k[0] for k in last_of_key], [k[1] for k in last_of_key], list(last_of_key.values()), ids],
        ).fetchall()
        blocked: dict[tuple[str, bytes], int] = {}
        backing_off: set[tuple[str, bytes]] = set()
        for t, k, b, free in found:
            blocked[(t, bytes(k))] = b
            if free:
                backing_off.add((t, bytes(k)))
        # Earlier groups not claimed now (their keys read here, in Python): newest first, so
        # that an older group's id overwrites a newer one's and each key keeps its first.
        flying = set(in_flight)
        for gid, t, blob, free in conn.execute(
            f"SELECT id, topic, keys, lease_owner IS NULL FROM {self._t} WHERE n > 1 AND id < %s "
            "AND keys IS NOT NULL AND status = 0 AND id <> ALL(%s::bigint[]) ORDER BY id DESC",
            [rows[-1][0], _id_array([r[0] for r in rows])],
        ).fetchall():
            if gid + 1 in flying:
                continue
            for k in grouped.keys_of(blob):
                if (t, k) in last_of_key and blocked.get((t, k), gid + 1) > gid:
                    blocked[(t, k)] = gid
                    if free:
                        backing_off.add((t, k))
                    else:
                        backing_off.discard((t, k))
        if not blocked:
            return rows, None
        kept: list[Row] = []
        for r in rows:
            rid, t = r[0], r[2]
            if r[N] == 1:
                if r[3] is None or rid < blocked.get((t, r[3]), rid + 1):
                    kept.append(r)
                continue
            keys = group_keys[rid]
            waits = [(t, k) for k in keys if blocked.get((t, k), rid + 1) < rid]
            if not waits:
                kept.append(r)
                continue
            if any(w in backing_off for w in waits):
                # Behind a back-off (maybe long): the claim ends here, and the caller splits it.
                return kept, rid
            # Behind a lease only (another claimer's batch, settled in moments): it stays whole
            # and is left out, and so are the later candidates of any of its keys (they come
            # after its messages).
            for k in keys:
                if blocked.get((t, k), rid + 1) > rid:
                    blocked[(t, k)] = rid
        return kept, None

    def has_pending(self, topic: str, key: bytes) -> bool:
        return bool(
            self._read(
                f"SELECT 1 FROM {self._t} WHERE status = 0 AND key IS NOT NULL AND topic = %s "
                "AND md5(key) = md5(%s::bytea) AND key = %s::bytea LIMIT 1",
                [topic, key, key],
            )
            or self._read(
                f"SELECT 1 FROM {self._t} WHERE n > 1 AND status = 0 AND topic = %s "
                "AND position(%s::bytea in keys) > 0 LIMIT 1",
                [topic, grouped.key_token(key)],
            )
        )

    def pending_keys(self) -> set[tuple[str, bytes]]:
        rows = self._read(f"SELECT DISTINCT topic, key FROM {self._t} WHERE status = 0 AND key IS NOT NULL")
        keys = {(t, bytes(k)) for t, k in rows}
        for topic, blob in self._read(f"SELECT topic, keys FROM {self._t} WHERE n > 1 AND keys IS NOT NULL"):
            keys.update((topic, k) for k in grouped.keys_of(bytes(blob)))
        return keys

    def keys_with_pending(self, keys: Sequence[tuple[str, bytes]]) -> set[tuple[str, bytes]]:
        if not keys:
            return set()
        rows = self._read(
            f"SELECT DISTINCT c.t, c.k FROM unnest(%s::text[], %s::bytea[]) AS c(t, k) WHERE EXISTS ("
            f"SELECT 1 FROM {self._t} AS o WHERE o.status = 0 AND o.key IS NOT NULL AND o.topic = c.t "
            "AND md5(o.key) = md5(c.k) AND o.key = c.k)",
            [[t for t, _ in keys], [k for _, k in keys]],
        )
        found = {(t, bytes(k)) for t, k in rows}
        rest = {k for k in keys if k not in found}
        return found | self._keys_in_groups(rest) if rest else found

    def _keys_in_groups(self, keys: set[tuple[str, bytes]]) -> set[tuple[str, bytes]]:
        """Which of these keys some group holds. Newest groups first, a page at a time, stopping
        once all are found: a key still in use is in the latest groups, so only a key that has
        left the store (or a rare one) costs a look at every group's key list."""
        wanted: dict[str, set[bytes]] = {}
        for topic, key in keys:
            wanted.setdefault(topic, set()).add(key)
        found: set[tuple[str, bytes]] = set()
        before = 2**63 - 1
        while len(found) < len(keys):
            page = self._read(
                f"SELECT id, topic, keys FROM {self._t} WHERE n > 1 AND id < %s AND keys IS NOT NULL "
                "AND topic = ANY(%s::text[]) ORDER BY id DESC LIMIT 100",
                [before, list(wanted)],
            )
            for gid, topic, blob in page:
                before = gid
                found.update((topic, k) for k in wanted[topic] & grouped.keys_of(bytes(blob)))
            if len(page) < 100:
                break
        return found

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

        An owner of this host is judged by its process (`outbox.stores.owners.local_liveness`);
        otherwise an owner named by `outbox.stores.owners.new_owner` is alive while its advisory lock
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

