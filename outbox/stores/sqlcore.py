"""One SQL store over a small dialect object: the whole `Outbox` contract, one message per row.

A SQL backend gives what differs (`Dialect`: how a column name is quoted, how a key is found on
its index, how a claim skips the rows other claimers hold) and its connections (`_tx`, `_read`,
`_insert`); everything else is here, written once: enqueue, claims with their lease and the
per-key order rule (`outbox.stores.keyrule`, applied to the rows that hold a candidate's key
back), settlements, dead letters, the erasure of a key, the audit log, stats, the backlog
(`outbox.stores.backlog.backlog_sql`), encryption at rest (`outbox.stores.sealed`) and its
rotation (`outbox.stores.rotation`).

Rows: the columns of `outbox.stores.base.INSERT_COLUMNS`, a `key_hash` the dialect's key
index reads, `enc_key` (the id of the key a row is sealed with; NULL: in clear), in a table
`<table>` next to an audit log `<table>_audit`. Claims: the first due rows in id order that no
other claimer's transaction holds (`FOR UPDATE SKIP LOCKED`), less those an earlier pending row
of their key holds back, leased in the same short transaction.
"""

from __future__ import annotations

import abc
import logging
import re
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from outbox.errors import UnknownMessageError
from outbox.records import AuditEntry, DeadLetterFilter, NewMessage, OutboxMessage, Status, StoreStats
from outbox.stores import keyrule, sealed
from outbox.stores.backlog import Backlog, backlog_from_rows, backlog_sql
from outbox.stores.base import (
    COLUMNS,
    INSERT_COLUMNS,
    Applied,
    Erased,
    Outbox,
    Settlement,
    dead_letter_where,
    insert_values,
    row_from_columns,
    stored_payload,
)
from outbox.stores.encryption import KeyRing
from outbox.stores.owners import Liveness, SweepSchedule, describe_owner
from outbox.stores.rotation import Resealed, RotatingStore, StoredPayload

log = logging.getLogger(__name__)
_ALL = DeadLetterFilter()
_PENDING, _DEAD = int(Status.PENDING), int(Status.DEAD)

#: A cursor of the backend's driver (DB-API: execute, executemany, fetchall, rowcount, lastrowid).
Cursor = Any


@dataclass(frozen=True)
class Dialect:
    """What one SQL dialect writes its own way.

    Attributes:
        quote: an identifier quoted (`key` and `partition` are reserved words in some dialects).
        key_match: the test that a row's key is the parameter ``{p}``, on the key's index (each
            ``{p}`` takes the key once).
        keys_in: the test that a row's key is one of ``{ps}`` (the placeholders of `key_index`'s values).
        key_index: the value `keys_in` compares for one key.
        headers_contain: the test that the stored headers contain the bytes ``{p}``.
        skip_locked: what a claim's read ends with, so that it neither waits for nor takes the
            rows another claimer's (or settler's) transaction holds.
        null_safe_equal: the operator that compares two values, NULL equal to NULL.
    """

    quote: Any  # Callable[[str], str]
    key_match: str
    keys_in: str
    key_index: Any  # Callable[[bytes], Any]
    headers_contain: str
    skip_locked: str = " FOR UPDATE SKIP LOCKED"
    null_safe_equal: str = "IS NOT DISTINCT FROM"

    def columns(self, names: str) -> str:
        """A column list with the reserved names quoted."""
        return re.sub(r"\b(key|partition)\b", lambda m: str(self.quote(m.group(1))), names)


class SQLOutbox(RotatingStore, Outbox):
    """The contract over a `Dialect` and the backend's connections (see the module doc)."""

    dialect: Dialect
    _t: str  # the table, quoted
    _audit_t: str

    # -- what the backend gives --------------------------------------------------------------------

    @abc.abstractmethod
    def _tx(self) -> AbstractContextManager[Cursor]:
        """A cursor in a transaction of its own: committed when the block ends, rolled back if it raises."""

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._tx() as cur:
            cur.execute(sql, args)
            return list(cur.fetchall())

    @abc.abstractmethod
    def _insert(self, cur: Cursor, rows: Sequence[tuple[Any, ...]]) -> list[int]:
        """Insert rows of `_insert_columns` values in order; their ids, in order."""

    def _hold_owner(self, owner: str) -> None:
        """Make sure `owner` is known to be alive before it leases anything (a store whose
        `capabilities.owner_liveness` is set: `owner_liveness` judges it); nothing otherwise."""

    # -- SQL built once -----------------------------------------------------------------------------

    def _setup(self) -> None:
        """The statements this store runs, for its dialect (call once the table names are set)."""
        d = self.dialect
        self._sweeps = SweepSchedule()
        self._row = f"{d.columns(COLUMNS)}, enc_key"
        self._insert_columns = f"{d.columns(', '.join(INSERT_COLUMNS))}, enc_key"
        self._key = d.quote("key")

    def _message(self, r: Sequence[Any]) -> OutboxMessage:
        return row_from_columns(sealed.open_row(r, self.encryption))

    def _values(self, m: NewMessage, status: Status, owner: str | None, until: float | None, now: float) -> Any:
        v = insert_values(m, status, owner, until, now)
        return (*v, None) if self.encryption is None else sealed.seal_values(v, self.encryption)

    def set_encryption(self, ring: KeyRing | None) -> None:
        self.encryption = ring

    # -- the hot path -----------------------------------------------------------------------------

    def enqueue(
        self, messages: Sequence[NewMessage], *, lease_owner: str | None = None, lease_until: float | None = None
    ) -> list[int]:
        return self.apply(
            Settlement(), now=time.time(), new=messages, lease_owner=lease_owner, lease_until=lease_until
        ).new_ids

    def add_dead(self, messages: Sequence[NewMessage], *, failed_at: float) -> list[int]:
        if not messages:
            return []
        with self._tx() as cur:
            return self._insert(cur, [self._values(m, Status.DEAD, None, None, failed_at) for m in messages])

    def claim(
        self,
        owner: str,
        limit: int,
        lease_seconds: float,
        *,
        now: float,
        topic: str | None = None,
        in_flight: Collection[int] = (),
    ) -> Sequence[OutboxMessage]:
        if limit <= 0:
            return []
        self._hold_owner(owner)
        if self.capabilities.owner_liveness and self._sweeps.due():
            self.release_gone_owners(now=now)
        where = f"status = {_PENDING} AND next_attempt_at <= %s"
        args: list[Any] = [now]
        if topic is not None:
            where += " AND topic = %s"
            args.append(topic)
        with self._tx() as cur:
            cur.execute(
                f"SELECT {self._row} FROM {self._t} WHERE {where} ORDER BY id LIMIT %s{self.dialect.skip_locked}",
                [*args, limit],
            )
            rows = list(cur.fetchall())
            rows = self._keep_key_order(cur, rows, in_flight)
            if rows:
                cur.execute(
                    f"UPDATE {self._t} SET lease_owner = %s, next_attempt_at = %s WHERE id IN ({_marks(rows)})",
                    [owner, now + lease_seconds, *(r[0] for r in rows)],
                )
        return [self._message(r) for r in rows]

    def _keep_key_order(
        self, cur: Cursor, rows: list[tuple[Any, ...]], in_flight: Collection[int]
    ) -> list[tuple[Any, ...]]:
        """The candidates no earlier pending row of their key holds back (`keyrule`): a row
        leased to another claimer, backing off, or locked by another transaction. The claimer's
        own rows in flight hold nothing back."""
        keys = {(r[2], bytes(r[3])) for r in rows if r[3] is not None}
        if not keys:
            return rows
        taken = {r[0] for r in rows} | set(in_flight)
        held = self._pending_of_keys(cur, keys, f" AND id < {int(rows[-1][0])}")
        blockers = keyrule.first_blockers((t, k, i) for t, k, i in held if i not in taken)
        return [r for r in rows if not keyrule.waits(r[2], None if r[3] is None else bytes(r[3]), r[0], blockers)]

    def _pending_of_keys(
        self, cur: Cursor, keys: Collection[tuple[str, bytes]], also: str = ""
    ) -> list[tuple[str, bytes, int]]:
        """(topic, key, id) of the pending rows of these keys, found on the key index."""
        d = self.dialect
        digests = list({d.key_index(k) for _, k in keys})
        cur.execute(
            f"SELECT topic, {self._key}, id FROM {self._t} WHERE status = {_PENDING} AND "
            f"{d.keys_in.format(ps=', '.join(['%s'] * len(digests)))}{also}",
            digests,
        )
        return [(t, bytes(k), int(i)) for t, k, i in cur.fetchall() if (t, bytes(k)) in keys]

    def apply(
        self,
        settlement: Settlement,
        *,
        now: float,
        new: Sequence[NewMessage] = (),
        lease_owner: str | None = None,
        lease_until: float | None = None,
    ) -> Applied:
        ids: list[int] = []
        deleted = 0
        dead: list[OutboxMessage] = []
        if not (new or settlement):
            return Applied(ids, deleted, dead)
        if new and lease_owner is not None:
            self._hold_owner(lease_owner)
        with self._tx() as cur:
            if new:
                ids = self._insert(cur, [self._values(m, Status.PENDING, lease_owner, lease_until, now) for m in new])
            if settlement.delivered:
                cur.execute(
                    f"DELETE FROM {self._t} WHERE id IN ({_marks(settlement.delivered)}) AND status = {_PENDING}",
                    settlement.delivered,
                )
                deleted = cur.rowcount
            for r in settlement.rewritten:
                value, headers, kid = stored_payload(r.msg_id, r.value, r.headers, self.encryption)
                cur.execute(
                    f"UPDATE {self._t} SET topic = %s, value = %s, headers = %s, enc_key = %s, "
                    f"{self.dialect.quote('partition')} = %s WHERE id = %s AND msg_id = %s AND status = {_PENDING}",
                    [r.topic, value, headers, kid, r.partition, r.id, r.msg_id],
                )
            now_dead = []
            for f in settlement.failures:  # rescheduled, or dead (its due time kept)
                cur.execute(
                    f"UPDATE {self._t} SET attempts = attempts + 1, last_error = %s, error_code = %s, "
                    "error_name = %s, first_failed_at = COALESCE(first_failed_at, %s), last_failed_at = %s, "
                    "lease_owner = NULL, next_attempt_at = COALESCE(%s, next_attempt_at), status = %s "
                    f"WHERE id = %s AND status = {_PENDING}",
                    [
                        f.error,
                        f.code,
                        f.name,
                        f.failed_at,
                        f.failed_at,
                        f.retry_at,
                        _PENDING if f.retry_at is not None else _DEAD,
                        f.id,
                    ],
                )
                if f.retry_at is None and cur.rowcount == 1:
                    now_dead.append(f.id)
            if now_dead:
                cur.execute(f"SELECT {self._row} FROM {self._t} WHERE id IN ({_marks(now_dead)}) ORDER BY id", now_dead)
                dead = [self._message(r) for r in cur.fetchall()]
            if settlement.released:
                cur.execute(
                    f"UPDATE {self._t} SET lease_owner = NULL, next_attempt_at = %s "
                    f"WHERE id IN ({_marks(settlement.released)}) AND status = {_PENDING}",
                    [now, *settlement.released],
                )
        return Applied(ids, deleted, dead)

    def has_pending(self, topic: str, key: bytes) -> bool:
        return bool(self.keys_with_pending([(topic, key)]))

    def keys_with_pending(self, keys: Sequence[tuple[str, bytes]]) -> set[tuple[str, bytes]]:
        if not keys:
            return set()
        with self._tx() as cur:
            return {(t, k) for t, k, _ in self._pending_of_keys(cur, set(keys))}

    def pending_keys(self) -> set[tuple[str, bytes]]:
        rows = self._read(
            f"SELECT topic, {self._key} FROM {self._t} WHERE status = {_PENDING} AND {self._key} IS NOT NULL"
        )
        return {(t, bytes(k)) for t, k in rows}

    def release_gone_owners(self, *, now: float) -> int:
        """Give back, due now, every lease whose owner is gone (`owner_liveness`): claimers call it
        at their first claim and then now and then (`SweepSchedule`). How many rows."""
        if not self.capabilities.owner_liveness:
            return 0
        started = time.monotonic()
        try:
            leased = f"status = {_PENDING} AND next_attempt_at > %s AND lease_owner IS NOT NULL"
            owners = [r[0] for r in self._read(f"SELECT DISTINCT lease_owner FROM {self._t} WHERE {leased}", [now])]
            gone = [o for o, live in self.owner_liveness(owners).items() if live is Liveness.GONE]
            if not gone:
                return 0
            with self._tx() as cur:
                cur.execute(
                    f"UPDATE {self._t} SET lease_owner = NULL, next_attempt_at = %s "
                    f"WHERE {leased} AND lease_owner IN ({_marks(gone)})",
                    [now, now, *gone],
                )
                released = int(cur.rowcount)
        finally:
            self._sweeps.done(started)
        log.info(
            "outbox %s: released %d leased row(s) of %s (owner gone)",
            self.location,
            released,
            ", ".join(describe_owner(o) for o in gone),
        )
        return released

    def next_due_at(self) -> float | None:
        rows = self._read(f"SELECT MIN(next_attempt_at) FROM {self._t} WHERE status = {_PENDING}")
        return None if rows[0][0] is None else float(rows[0][0])

    # -- dead letters and reads for people -------------------------------------------------------

    def get(self, id: int) -> OutboxMessage:
        rows = self._read(f"SELECT {self._row} FROM {self._t} WHERE id = %s", [id])
        if not rows:
            raise UnknownMessageError(f"no message with id {id} in outbox {self.location}")
        return self._message(rows[0])

    def messages(self) -> list[OutboxMessage]:
        """Every message in the store, pending and dead, in id order: for inspection and tests."""
        return [self._message(r) for r in self._read(f"SELECT {self._row} FROM {self._t} ORDER BY id")]

    def _dead_where(self, flt: DeadLetterFilter) -> tuple[str, list[Any]]:
        d = self.dialect
        return dead_letter_where(flt, "%s", key_match=d.key_match, headers_contain=d.headers_contain)

    def list_dead(self, flt: DeadLetterFilter = _ALL) -> list[OutboxMessage]:
        where, args = self._dead_where(flt)
        sql = f"SELECT {self._row} FROM {self._t} WHERE {where} ORDER BY id"
        if flt.limit is not None:
            sql += " LIMIT %s"
            args.append(flt.limit)
        return [self._message(r) for r in self._read(sql, args)]

    def count_dead(self, flt: DeadLetterFilter = _ALL) -> int:
        where, args = self._dead_where(flt)
        return int(self._read(f"SELECT COUNT(*) FROM {self._t} WHERE {where}", args)[0][0])

    def purge_dead(self, flt: DeadLetterFilter = _ALL, *, at_most: int | None = None) -> int:
        where, args = self._dead_where(flt)
        with self._tx() as cur:
            if at_most is None:
                cur.execute(f"DELETE FROM {self._t} WHERE {where}", args)
                return int(cur.rowcount)
            cur.execute(f"SELECT id FROM {self._t} WHERE {where} ORDER BY id LIMIT %s FOR UPDATE", [*args, at_most])
            found = [r[0] for r in cur.fetchall()]
            if found:
                cur.execute(f"DELETE FROM {self._t} WHERE id IN ({_marks(found)})", found)
            return len(found)

    def replay_dead(self, flt: DeadLetterFilter = _ALL, *, now: float, to_topic: str | None = None) -> int:
        where, args = self._dead_where(flt)
        with self._tx() as cur:
            cur.execute(
                f"UPDATE {self._t} SET status = {_PENDING}, attempts = 0, next_attempt_at = %s, lease_owner = NULL, "
                f"topic = COALESCE(%s, topic) WHERE {where}",
                [now, to_topic, *args],
            )
            return int(cur.rowcount)

    def redrive_edited(
        self, id: int, *, value: bytes | None, headers: list[tuple[str, bytes | None]], now: float
    ) -> bool:
        with self._tx() as cur:
            cur.execute(f"SELECT msg_id FROM {self._t} WHERE id = %s AND status = {_DEAD} FOR UPDATE", [id])
            row = cur.fetchone()
            if row is None:
                return False
            cur.execute(
                f"UPDATE {self._t} SET value = %s, headers = %s, enc_key = %s, status = {_PENDING}, attempts = 0, "
                "next_attempt_at = %s, lease_owner = NULL WHERE id = %s",
                [*stored_payload(row[0], value, headers, self.encryption), now, id],
            )
            return True

    def trace(self, msg_id: str) -> list[OutboxMessage]:
        rows = self._read(f"SELECT {self._row} FROM {self._t} WHERE msg_id = %s ORDER BY id", [msg_id])
        return [self._message(r) for r in rows]

    def _of_key(self, key: bytes, topic: str | None, now: float, tail: str = "") -> tuple[str, list[Any]]:
        """The (status, leased, id) of `key`'s rows (of `topic`)."""
        where = self.dialect.key_match.format(p="%s")
        args: list[Any] = [now, *[key] * where.count("%s")]
        if topic is not None:
            where += " AND topic = %s"
            args.append(topic)
        leased = "CASE WHEN lease_owner IS NOT NULL AND next_attempt_at > %s THEN 1 ELSE 0 END"
        return f"SELECT status, {leased}, id FROM {self._t} WHERE {where}{tail}", args

    def _key_counts(self, key: bytes, topic: str | None, now: float) -> Erased:
        sql, args = self._of_key(key, topic, now)
        return _erased(self._read(sql, args))

    def _erase_in_group(self, key: bytes, topic: str | None, after: int, now: float) -> tuple[int, Erased] | None:
        return None  # one message per row: no group

    def _erase_rows(self, key: bytes, topic: str | None, now: float, limit: int) -> Erased:
        sql, args = self._of_key(key, topic, now, " ORDER BY id LIMIT %s FOR UPDATE")
        with self._tx() as cur:
            cur.execute(sql, [*args, limit])
            rows = list(cur.fetchall())
            if rows:
                cur.execute(f"DELETE FROM {self._t} WHERE id IN ({_marks(rows)})", [r[2] for r in rows])
        return _erased(rows)

    def add_audit(self, *, who: str, action: str, filter: str, count: int, at: float) -> int:
        q = self.dialect.quote
        with self._tx() as cur:
            cur.execute(
                f"INSERT INTO {self._audit_t} ({q('at')}, who, {q('action')}, {q('filter')}, {q('count')}) "
                "VALUES (%s, %s, %s, %s, %s)",
                [at, who, action, filter, count],
            )
            return int(cur.lastrowid)

    def audit_log(self, *, limit: int = 100, before_id: int | None = None) -> list[AuditEntry]:
        q = self.dialect.quote
        rows = self._read(
            f"SELECT id, {q('at')}, who, {q('action')}, {q('filter')}, {q('count')} FROM {self._audit_t} "
            "WHERE id < %s ORDER BY id DESC LIMIT %s",
            [before_id if before_id is not None else 2**63 - 1, limit],
        )
        return [AuditEntry(int(r[0]), float(r[1]), r[2], r[3], r[4], int(r[5])) for r in rows]

    def stats(self, *, now: float) -> StoreStats:
        with self._tx() as cur:
            cur.execute(
                "SELECT status, topic, COUNT(*), MIN(created_at), "
                "SUM(CASE WHEN lease_owner IS NOT NULL AND next_attempt_at > %s THEN 1 ELSE 0 END) "
                f"FROM {self._t} GROUP BY status, topic",
                [now],
            )
            by_state = list(cur.fetchall())
            cur.execute(f"SELECT error_name, error_code, COUNT(*) FROM {self._t} WHERE status = {_DEAD} GROUP BY 1, 2")
            errors: dict[str, int] = {}
            for name, code, n in cur.fetchall():
                label = "?" if name is None else name if code is None else f"{name} ({code})"
                errors[label] = errors.get(label, 0) + int(n)
        return store_stats(by_state, errors, self.next_due_at())

    def backlog(self, *, now: float, topic: str | None = None) -> Backlog:
        sql, args = backlog_sql(self._t, "%s", now, topic, key=self._key)
        rows = [(int(s), o, int(n), lo, hi) for s, o, n, lo, hi in self._read(sql, args)]
        return backlog_from_rows(rows, self.owner_liveness)

    # -- encryption at rest: the rotation's primitives (`outbox.stores.rotation`) ------------------

    def encrypted_key_ids(self) -> list[str]:
        return [r[0] for r in self._read(f"SELECT DISTINCT enc_key FROM {self._t} WHERE enc_key IS NOT NULL")]

    def _rotation_page(self, after: int, current: str, limit: int, now: float) -> list[StoredPayload]:
        rows = self._read(
            f"SELECT id, msg_id, topic, 1, enc_key, value, headers, NULL FROM {self._t} WHERE id > %s "
            "AND (enc_key IS NULL OR enc_key <> %s) AND NOT (lease_owner IS NOT NULL AND next_attempt_at > %s) "
            "ORDER BY id LIMIT %s",
            [after, current, now, limit],
        )
        return [StoredPayload(*r) for r in rows]

    def _bodies(self, ids: Sequence[int]) -> dict[int, bytes]:
        return {}  # one message per row: no group bodies

    def _write_resealed(self, rows: Sequence[Resealed], current: str) -> int:
        done = 0
        same = self.dialect.null_safe_equal
        with self._tx() as cur:  # each row only where it still holds the bytes read
            for r in rows:
                cur.execute(
                    f"UPDATE {self._t} SET value = %s, headers = %s, enc_key = %s WHERE id = %s "
                    f"AND enc_key {same} %s AND value {same} %s AND headers {same} %s",
                    [r.value, r.headers, current, r.old.id, r.old.kid, r.old.value, r.old.headers],
                )
                done += cur.rowcount
        return done

    def _left_to_rotate(self, current: str) -> int:
        return int(
            self._read(f"SELECT COUNT(*) FROM {self._t} WHERE enc_key IS NULL OR enc_key <> %s", [current])[0][0]
        )


def store_stats(
    by_state: Sequence[Sequence[Any]], errors: dict[str, int], next_due_at: float | None
) -> StoreStats:
    """`StoreStats` from rows of (status, topic, messages, oldest created_at, leased messages) per
    status and topic, dead letters by error label ("NAME (code)"), and the next due time: what
    every SQL store's `stats` reads (this core's, PostgreSQL's)."""
    pending: dict[str, int] = {}
    dead: dict[str, int] = {}
    oldest: float | None = None
    leased = 0
    for status, topic, count, created, leased_n in by_state:
        if int(status) == _PENDING:
            pending[topic] = int(count)
            oldest = float(created) if oldest is None else min(oldest, float(created))
            leased += int(leased_n or 0)
        else:
            dead[topic] = int(count)
    return StoreStats(
        pending=sum(pending.values()),
        dead=sum(dead.values()),
        leased=leased,
        oldest_pending_at=oldest,
        next_due_at=next_due_at,
        pending_by_topic=pending,
        dead_by_topic=dead,
        dead_by_error=errors,
    )


def _marks(items: Sequence[Any]) -> str:
    """One placeholder per item."""
    return ", ".join(["%s"] * len(items))


def _erased(rows: Iterator[Sequence[Any]] | list[tuple[Any, ...]]) -> Erased:
    """What rows of (status, leased, id) add up to."""
    out = Erased()
    for status, leased, _ in rows:
        dead = int(status) == _DEAD
        out += Erased(0 if dead else 1, 1 if dead else 0, 1 if leased and not dead else 0)
    return out
