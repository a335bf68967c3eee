"""SQLite outbox: one file per host, shared by the application and `outbox drain`.

WAL journal (readers never block the writer), a busy timeout so concurrent processes wait
instead of failing, BEGIN IMMEDIATE for every write so lock upgrades cannot deadlock, and
batched statements: the caller group-commits, so one transaction carries many rows.

This module is the hot path (writes, claims, settlements, key queries); the connections, the
schema, the file and the administration are in `sqlite_conn`, `sqlite_schema`, `sqlite_file` and
`sqlite_admin`.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import operator
import os
import sqlite3
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from outbox.errors import ConfigError
from outbox.records import NewMessage, OutboxMessage, Status
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
    row_from_columns,
    stored_payload,
)
from outbox.stores.bulk import BulkRead
from outbox.stores.encryption import KeyRing
from outbox.stores.grouping import NewGroup, Part, prepare
from outbox.stores.owners import Liveness, describe_owner, local_liveness
from outbox.stores.sqlite_admin import SQLiteAdmin
from outbox.stores.sqlite_schema import (
    BODY,
    CANDIDATE,
    GROUP,
    GROUPS,
    INSERT_SQL,
    INSERT_WITH_ID_SQL,
    KEYS,
    ROW,
    SCHEMA_VERSION,
    SEALED_INSERT_SQL,
    SEALED_INSERT_WITH_ID_SQL,
    N,
)

__all__ = ["INSERT_SQL", "SCHEMA_VERSION", "SQLiteOutbox"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_CHUNK = 500  # ids per IN (...) list: well under SQLite's variable limit
_RUNS_IN_SQL = 100  # runs of ids in flight a claim's SQL names one by one (more: a JSON list of ids)


def _chunks(ids: Sequence[_T]) -> Iterator[Sequence[_T]]:
    for i in range(0, len(ids), _CHUNK):
        yield ids[i : i + _CHUNK]


def _ranges(ids: Iterable[int]) -> list[tuple[int, int]]:
    """Contiguous runs of ids, so a batch of consecutive rows is one range statement."""
    out: list[tuple[int, int]] = []
    ordered = sorted(ids)
    if not ordered:
        return out
    # One tuple per run, not per id: a drain's settlement deletes 10,000 ids at a time.
    lo = prev = ordered[0]
    for i in ordered:
        if i > prev + 1:
            out.append((lo, prev))
            lo = i
        prev = i
    out.append((lo, prev))
    return out


_START = operator.itemgetter(0)


def _in_runs(runs: Sequence[tuple[int, int]], i: int) -> bool:
    """Is `i` in one of these runs (`_ranges`)?"""
    at = bisect.bisect_right(runs, i, key=_START) - 1  # the last run that starts at or before i
    return at >= 0 and runs[at][1] >= i


@contextmanager
def _zeroing_only_written_pages(c: sqlite3.Connection) -> Iterator[None]:
    """Delete delivered messages without overwriting their freed pages with zeros.

    Connections zero every deleted byte (secure_delete, set in `_open`), so deleting a delivered
    group wrote its whole body again as zeros to the WAL, a cost per message that FAST cut about
    fourfold. FAST zeroes only within pages written anyway. So a delivered message's bytes can
    stay in the file's free pages until reused (they are in Kafka, and the file is owner-only);
    everything else (dead letters purged, rows rewritten) is zeroed.
    """
    c.execute("PRAGMA secure_delete = FAST")
    try:
        yield
    finally:
        c.execute("PRAGMA secure_delete = ON")


class SQLiteOutbox(SQLiteAdmin, Outbox):
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

    capabilities = Capabilities(transactional_enqueue=True, owner_liveness=True, grouped_rows=True, bulk_read=True)

    def set_encryption(self, ring: KeyRing | None) -> None:
        self.encryption = ring

    # -- writes ------------------------------------------------------------------------------

    @staticmethod
    def _insert(c: sqlite3.Connection, parts: Sequence[Part], now: float) -> list[int]:
        """Write prepared rows and groups in this transaction; the stored messages' ids, in order."""
        ids: list[int] = []
        for part in parts:
            if isinstance(part, NewGroup):
                seq = c.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'").fetchone()
                gid = (seq[0] if seq else 0) + 1
                c.execute(
                    "INSERT INTO outbox (id, msg_id, topic, created_at, next_attempt_at, n, lease_owner, enc_key) "
                    "VALUES (?, '', ?, ?, ?, ?, ?, ?)",
                    (gid, part.topic, now, part.due, part.n, part.owner, part.key_id),
                )
                c.execute("INSERT INTO outbox_body (id, body, keys) VALUES (?, ?, ?)", (gid, part.body, part.keys))
                # AUTOINCREMENT: the next row's id comes after this group's message ids (the
                # group's own id is reserved, never a message's).
                c.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'outbox'", (gid + part.n,))
                ids += range(gid + 1, gid + part.n + 1)
            elif part:
                # An encrypted row's values end with its key id (`sealed.seal_values`).
                c.executemany(INSERT_SQL if len(part[0]) == len(INSERT_COLUMNS) else SEALED_INSERT_SQL, part)
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
        parts = prepare(messages, Status.PENDING, lease_owner, lease_until, now, self.encryption)
        with self._write() as c:
            return self._insert(c, parts, now)

    def enqueue_in_transaction(self, conn: sqlite3.Connection, messages: Sequence[NewMessage]) -> list[int]:
        """Write PENDING rows with the application's own connection to this file; never commit.

        The messages exist if and only if the caller's transaction commits (`outbox.transactions`).

        Raises:
            ConfigError: `conn` is not a sqlite3 connection to this outbox's file, or is in
                autocommit mode outside a transaction (each write would commit on its own).
        """
        if not isinstance(conn, sqlite3.Connection):
            raise ConfigError(
                f"transaction must be a sqlite3.Connection for a SQLite outbox (got {type(conn).__name__})"
            )
        try:
            main = next((r[2] for r in conn.execute("PRAGMA database_list") if r[1] == "main"), "")
        except sqlite3.ProgrammingError as exc:
            raise ConfigError(f"transaction connection is unusable: {exc}") from None
        if not main or not os.path.exists(main) or not os.path.samefile(main, self.path):
            where = main or "a database in memory"
            raise ConfigError(f"transaction connection is to {where!r}, but the outbox is {self.path}")
        if not conn.in_transaction and (conn.isolation_level is None or getattr(conn, "autocommit", None) is True):
            raise ConfigError(
                "transaction connection is in autocommit mode outside a transaction: BEGIN first, "
                "or use a connection with the default isolation_level"
            )
        now = time.time()
        try:
            return self._insert(conn, prepare(messages, Status.PENDING, None, None, now, self.encryption), now)
        except sqlite3.Error as exc:
            raise self._error(exc) from exc


    def add_dead(self, messages: Sequence[NewMessage], *, failed_at: float) -> list[int]:
        parts = prepare(messages, Status.DEAD, None, None, failed_at, self.encryption)
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
                self._message(r)
                for r in c.execute(
                    f"SELECT {ROW} FROM outbox WHERE status = 2 AND id IN ({','.join('?' * len(chunk))})",
                    list(chunk),
                )
            ]
        return out

    def _settle_groups(self, c: sqlite3.Connection, settlement: Settlement, now: float) -> tuple[int, bool]:
        """The groups among a settlement's messages: deleted when every message of one was
        delivered, released as one row when every message was given back, else exploded into
        one-message rows (less the delivered ones) that the rest of `apply` settles like any row.

        Returns how many delivered messages left with their group, and whether every delivered
        message was one of these groups' (then no one-message row is left to delete: a healthy
        drain's settlement, whose ids are not looked at one by one)."""
        delivered = set(settlement.delivered)
        released = set(settlement.released)
        rewritten = {r.id for r in settlement.rewritten}
        other = {f.id for f in settlement.failures} | released | rewritten
        touched = delivered | other if other else delivered
        lo, hi = min(touched), max(touched)
        found = c.execute(
            "SELECT id, n FROM outbox INDEXED BY outbox_group WHERE n > 1 AND id BETWEEN ? AND ?",
            (lo - grouped.GROUP_MAX - 1, hi),
        ).fetchall()
        gone = 0
        of_groups = 0  # delivered messages that are these groups' (each group's ids are its own)
        for gid, n in found:
            members = range(gid + 1, gid + n + 1)
            if delivered.issuperset(members):
                of_groups += n
                if c.execute("DELETE FROM outbox WHERE id = ? AND status = 0", (gid,)).rowcount:
                    gone += n
            elif released.issuperset(members) and rewritten.isdisjoint(members):
                # Given back whole (a stop, the cluster gone, a drain's next batch not sent): the
                # group stays one row, due now.
                c.execute("UPDATE outbox SET lease_owner = NULL, next_attempt_at = ? WHERE id = ? AND status = 0",
                          (now, gid))
            else:
                done = [i for i in members if i in delivered]
                if done or not other.isdisjoint(members):
                    self._explode(c, gid, skip=set(done))
                    gone += len(done)
                    of_groups += len(done)
        return gone, of_groups == len(delivered)

    def _rewrite(self, c: sqlite3.Connection, rewrites: Sequence[Rewrite]) -> None:
        """Replace pending one-message rows' messages (`Outbox.apply`; their groups are exploded
        already). The old bytes are zeroed (secure_delete)."""
        if rewrites:
            c.executemany(
                'UPDATE outbox SET topic = ?, value = ?, headers = ?, enc_key = ?, "partition" = ? '
                "WHERE id = ? AND msg_id = ? AND status = 0",
                [(r.topic, *stored_payload(r.msg_id, r.value, r.headers, self.encryption), r.partition, r.id, r.msg_id)
                 for r in rewrites],
            )

    def _message(self, r: Sequence[Any]) -> OutboxMessage:
        """A row selected with `ROW` as a message, its payload decrypted (`sealed.open_row`)."""
        return row_from_columns(sealed.open_row(r, self.encryption))

    def _explode(self, c: sqlite3.Connection, gid: int, *, skip: Collection[int] = ()) -> int:
        """Replace a group row with one row per message (their own ids; lease and created_at kept),
        leaving out the ids in `skip`. Returns how many rows it wrote."""
        row = c.execute(
            f"SELECT {GROUP}, o.lease_owner FROM {GROUPS} WHERE o.n > 1 AND o.id = ?", (gid,)
        ).fetchone()
        if row is None:
            return 0
        _, topic, created_at, due, n, body, kid, owner = row
        ring = self.encryption
        body = sealed.open_body(body, kid, topic, ring, gid, n)
        rows = [
            (m.id, *insert_values(grouped.as_new(m), Status.PENDING, owner, due, created_at))
            for m in grouped.decode(body, gid, topic, created_at)
            if m.id not in skip
        ]
        c.execute("DELETE FROM outbox WHERE id = ?", (gid,))  # its body too (outbox_body_gone)
        if ring is None:
            c.executemany(INSERT_WITH_ID_SQL, rows)
        else:  # its messages encrypted again, each on its own, with the newest key
            c.executemany(SEALED_INSERT_WITH_ID_SQL, [(r[0], *sealed.seal_values(r[1:], ring)) for r in rows])
        return len(rows)

    def bulk_read(self) -> BulkRead:
        # sqlite-jdbc reports a BIGINT as DECIMAL and no type for the body's expression column.
        return BulkRead(table='"outbox"', grouped=True, schema="timestamp LONG, n LONG, body BINARY",
                        body_table="outbox_body")

    def explode_groups(self) -> int:
        """Store every pending group as one-message rows; return how many rows that wrote.

        For a reader that takes rows one message at a time from the table itself and cannot
        decode a group (`outbox.stores.bulk.explode` does). Groups stored after this call are left
        as they are.
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
        parts = prepare(new, Status.PENDING, lease_owner, lease_until, now, self.encryption)
        # Failures must last (attempt counts decide dead letters); new and rewritten rows must last.
        with self._write(stores_messages=bool(new or settlement.failures or settlement.rewritten)) as c:
            ids = self._insert(c, parts, now)
            with _zeroing_only_written_pages(c):
                deleted, only_groups = self._settle_groups(c, settlement, now) if settlement else (0, True)
                if not only_groups:
                    deleted += self._delete(c, settlement.delivered)
            self._rewrite(c, settlement.rewritten)
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
    ) -> Sequence[OutboxMessage]:
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
            # A group holding a key that waits behind a back-off becomes one-message rows, so
            # that the per-key rule holds back only that key's messages, and the claim goes on
            # with the others (read again if nothing came before the group).
            with self._write(stores_messages=False) as c:
                self._explode(c, blocked_group)  # leased meanwhile: it keeps its lease
            if rows:
                break
        if not rows:
            return []
        if any(r[sealed.ROW_KEY] is not None for r in rows):
            # Decrypted before the lease: a row whose key is missing or wrong is not leased, so it
            # stays pending as it was, no attempt counted, and the claim fails naming the key.
            rows = [self._opened(r) for r in rows]
        rows = self._lease(rows, owner, now, now + lease_seconds)
        if all(r[BODY] is None for r in rows):
            return [row_from_columns(r) for r in rows]
        # Groups stay encoded until read (`grouped.Claimed`).
        return grouped.Claimed([
            row_from_columns(r) if r[BODY] is None else grouped.Group(r[0], r[N], r[2], r[9], r[BODY])
            for r in rows
        ])

    def _opened(self, r: tuple[Any, ...]) -> tuple[Any, ...]:
        """A claim's candidate with its payload decrypted (a group's body, or a row's values)."""
        if r[BODY] is None:
            return tuple(sealed.open_row(r, self.encryption))
        body = sealed.open_body(r[BODY], r[sealed.ROW_KEY], r[2], self.encryption, r[0], r[N])
        return (*r[: sealed.ROW_KEY], None, *r[sealed.ROW_KEY + 1 : BODY], body, *r[BODY + 1 :])

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
        """Alive, gone or unknown, for each lease owner (`outbox.stores.owners.local_liveness`)."""
        return {o: local_liveness(o) for o in owners}

    def release_gone_owners(self, *, now: float) -> int:
        """Give back, due now, every lease whose owner's process is gone; return how many rows.

        Claimers call it at their first claim and then now and then (`SweepSchedule`), so a drain
        started after a crash on this host takes over at once. Owners on other hosts, or whose
        names are not `outbox.stores.owners.new_owner`'s, keep their leases until they expire.
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
            f"SELECT {CANDIDATE} FROM outbox AS o NOT INDEXED LEFT JOIN outbox_body AS b ON o.n > 1 AND b.id = o.id "
            f"WHERE {where} ORDER BY o.id LIMIT ?",
            [*args, limit],
        )
        rows: list[tuple[Any, ...]] = []
        count = 0
        for r in cur:
            if rows and count + r[N] > limit:
                break
            rows.append(r)
            count += r[N]
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

        A candidate group that holds a key blocked by a lease is left out, and its keys then
        block the later candidates too (they follow its messages), so a claim skips past a group
        another worker holds and takes the groups of other keys. The claim ends before a group
        one of whose keys waits behind a back-off. Returns the rows to claim, and that group's id
        (None otherwise): the caller splits it.
        """
        last = rows[-1][0]
        sql = (
            "SELECT topic, key, MIN(id), MAX(lease_owner IS NULL) FROM outbox WHERE status = 0 "
            "AND next_attempt_at > ? AND id < ? AND key IS NOT NULL"
        )
        args: list[Any] = [now, last]
        # The rows in flight as runs of ids: a drain's batch is a few groups, each a run. Passed
        # as 10,000 ids in JSON, SQLite built a table of them anew for every claim.
        flying = _ranges(in_flight)
        if len(flying) > _RUNS_IN_SQL:
            sql += " AND id NOT IN (SELECT value FROM json_each(?))"
            args.append(json.dumps(list(in_flight)))
        elif flying:
            sql += " AND NOT (" + " OR ".join(["id BETWEEN ? AND ?"] * len(flying)) + ")"
            args += itertools.chain.from_iterable(flying)
        blocked: dict[str, dict[bytes, int]] = {}  # topic -> key entry -> first blocking id
        backing_off: set[tuple[str, bytes]] = set()  # keys with a blocking row that is not leased
        # Newest first: an older group's id overwrites a newer one's, leaving each key's first.
        for gid, topic, keys, free in c.execute(
            "SELECT o.id, o.topic, b.keys, o.lease_owner IS NULL FROM outbox AS o JOIN outbox_body AS b "
            "ON b.id = o.id WHERE o.status = 0 AND o.next_attempt_at > ? AND o.id < ? AND o.n > 1 "
            "AND b.keys IS NOT NULL ORDER BY o.id DESC",
            (now, last),
        ):
            if not _in_runs(flying, gid + 1):
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
            elif r[BODY] is None:
                if r[3] is None or rid < of_topic.get(grouped.key_entry(r[3]), rid + 1):
                    kept.append(r)
            else:
                entries = grouped.key_entries(r[KEYS]) if r[KEYS] is not None else []
                waits = [e for e in entries if of_topic.get(e, rid + 1) < rid]
                if not waits:
                    kept.append(r)
                elif any((r[2], e) in backing_off for e in waits):
                    # Behind a back-off (maybe long): the claim ends here, and the caller splits it.
                    return kept, rid
                else:
                    # Behind a lease only (another worker's batch, settled in moments): it stays
                    # whole, and its keys hold back the later candidates (they follow it).
                    for e in entries:
                        if of_topic.get(e, rid + 1) > rid:
                            of_topic[e] = rid
        return kept, None

    def has_pending(self, topic: str, key: bytes) -> bool:
        return bool(
            self._read("SELECT 1 FROM outbox WHERE topic = ? AND key = ? AND status = 0 LIMIT 1", (topic, key))
            or self._read(
                f"SELECT 1 FROM {GROUPS} WHERE o.n > 1 AND o.topic = ? AND instr(b.keys, ?) > 0 LIMIT 1",
                (topic, grouped.key_token(key)),
            )
        )

    def pending_keys(self) -> set[tuple[str, bytes]]:
        rows = self._read("SELECT DISTINCT topic, key FROM outbox WHERE status = 0 AND key IS NOT NULL")
        keys = {(t, bytes(k)) for t, k in rows}
        for topic, blob in self._read(
            f"SELECT o.topic, b.keys FROM {GROUPS} WHERE o.n > 1 AND b.keys IS NOT NULL"
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
                # every row of every key: a large share of a recovering process's time (py-spy).
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
                f"SELECT o.topic, b.keys FROM {GROUPS} WHERE o.n > 1 AND b.keys IS NOT NULL ORDER BY o.id DESC"
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

