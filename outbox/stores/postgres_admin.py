"""Dead letters and reads for people in a PostgreSQL outbox: list, count, purge, replay, edit
and redrive, trace, the audit log, stats and the backlog (`outbox.stores.base.StoreAdmin`)."""

from __future__ import annotations

import abc
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from outbox.errors import UnknownMessageError
from outbox.records import AuditEntry, DeadLetterFilter, OutboxMessage, Status, StoreStats
from outbox.stores import grouped, sealed
from outbox.stores.backlog import Backlog, backlog_from_rows, backlog_sql
from outbox.stores.base import (
    COLUMNS,
    Erased,
    StoreAdmin,
    dead_letter_where,
    row_from_columns,
    stored_payload,
)
from outbox.stores.encryption import KeyRing

if TYPE_CHECKING:  # psycopg is the optional "postgres" extra: imported lazily at run time.
    import psycopg
from outbox.stores.postgres_conn import PostgresConnection
from outbox.stores.postgres_schema import NEXT_DUE_SQL
from outbox.stores.rotation import Resealed, RotatingStore, StoredPayload
from outbox.stores.sqlcore import store_stats

_ALL = DeadLetterFilter()  # the empty filter: every dead letter
#: A row's columns as `row_from_columns` reads them, then the id of its encryption key.
ROW = f"{COLUMNS}, enc_key"

_KEY_MATCH = "md5(key) = md5({p}::bytea) AND key = {p}::bytea"
_HEADERS_CONTAIN = "position({p}::bytea in headers) > 0"
# "Leased to a sender at %s": a pending row whose lease has not ended.
_LEASED = "(lease_owner IS NOT NULL AND next_attempt_at > %s)"


def _of_key(key: bytes, topic: str | None) -> tuple[str, list[Any], str, list[Any]]:
    """WHERE clauses and arguments of `key`'s one-message rows (of `topic`): the pending ones on
    the pending key index (with a topic), the dead ones on the dead key index. Group rows have
    no key."""
    match = _KEY_MATCH.format(p="%s")
    pending, dead = f"status = 0 AND key IS NOT NULL AND {match}", f"status = 2 AND {match}"
    args: list[Any] = [key, key]
    if topic is not None:
        pending, dead = f"topic = %s AND {pending}", f"topic = %s AND {dead}"
        args = [topic, *args]
    return pending, args, dead, list(args)


def _erased(rows: list[tuple[Any, ...]]) -> Erased:
    """What rows of (status, leased, count) add up to."""
    out = Erased()
    for status, leased, n in rows:
        dead = status == Status.DEAD
        out += Erased(0 if dead else int(n), int(n) if dead else 0, int(n) if leased else 0)
    return out


class PostgresAdmin(PostgresConnection, RotatingStore, StoreAdmin):
    """The administration half of `PostgresOutbox` (one class of the store, kept in its own module)."""

    encryption: KeyRing | None = None

    def _message(self, r: Any) -> OutboxMessage:
        """A row selected with `ROW` as a message, its payload decrypted (`sealed.open_row`)."""
        return row_from_columns(sealed.open_row(r, self.encryption))

    def _body(self, gid: int, topic: str, body: bytes, kid: str | None, n: int | None = None) -> bytes:
        """A group's body as `grouped` reads it: decrypted when it is encrypted (`n`: its messages)."""
        return sealed.open_body(bytes(body), kid, topic, self.encryption, gid, n)

    def _group_of(
        self, gid: int, topic: str, created_at: float, due: float, body: bytes, kid: str | None
    ) -> list[OutboxMessage]:
        """A group row's messages, each due when its group is (its lease)."""
        plain = self._body(gid, topic, body, kid)
        return [m._replace(next_attempt_at=due) for m in grouped.decode(plain, gid, topic, created_at)]

    @abc.abstractmethod
    def _explode(self, conn: psycopg.Connection[Any], gid: int, *, skip: Collection[int] = ()) -> int:
        """Replace a group row with one row per message, leaving out the ids in `skip`, in the
        caller's transaction: the hot path's (`PostgresOutbox._explode`), which an erasure uses too."""

    def get(self, id: int) -> OutboxMessage:
        rows = self._read(f"SELECT {ROW} FROM {self._t} WHERE id = %s AND n = 1", [id])
        if rows:
            return self._message(rows[0])
        # A message of a group: the group with the largest id below it, if its ids reach it.
        for m in self._group_messages(
            "id < %s AND id >= %s ORDER BY id DESC LIMIT 1", [id, id - grouped.GROUP_MAX]
        ):
            if m.id == id:
                return m
        raise UnknownMessageError(f"no message with id {id} in outbox {self.location}")

    def messages(self) -> list[OutboxMessage]:
        """Every message in the store, pending and dead, in id order (groups read message by
        message): for inspection and tests, not for hot paths."""
        with self._conn() as conn:  # one statement: one snapshot
            rows = conn.cursor(binary=True).execute(
                f"SELECT {ROW}, n, body FROM {self._t} ORDER BY id"
            ).fetchall()
        out: list[OutboxMessage] = []
        for r in rows:
            if r[18] == 1:  # n
                out.append(self._message(r))
            else:  # id, topic, created_at, next_attempt_at, body, enc_key
                out += self._group_of(r[0], r[2], r[9], r[12], r[19], r[17])
        return out

    def _group_messages(self, where: str, args: list[Any]) -> list[OutboxMessage]:
        """The messages of the groups matching `where` (`_group_of`)."""
        out: list[OutboxMessage] = []
        for r in self._read(
            f"SELECT id, topic, created_at, next_attempt_at, body, enc_key FROM {self._t} WHERE n > 1 AND {where}",
            args,
        ):
            out += self._group_of(*r)
        return out

    def list_dead(self, flt: DeadLetterFilter = _ALL) -> list[OutboxMessage]:
        where, args = dead_letter_where(flt, "%s", key_match=_KEY_MATCH, headers_contain=_HEADERS_CONTAIN)
        # A time filter: read its window on the failure-time index and sort it (`id + 0` keeps the
        # planner from walking the id index instead: failure times grow with ids, so a recent
        # window sits at the end of that walk, behind every older dead letter).
        by_time = flt.since is not None and not (flt.ids or flt.topic is not None or flt.error is not None
                                                 or flt.key is not None)
        sql = f"SELECT {ROW} FROM {self._t} WHERE {where} ORDER BY {'id + 0' if by_time else 'id'}"
        if flt.limit is not None:
            sql += " LIMIT %s"
            args.append(flt.limit)
        walk = flt.limit is not None and not (
            flt.ids or flt.topic is not None or flt.error is not None or flt.key is not None or flt.since is not None
        )
        if not walk:
            return [self._message(r) for r in self._read(sql, args)]
        # No selective column: a page is found fastest by walking the dead rows in id order (the
        # partial index) until it is full. The planner cannot know that: it estimates a LIKE
        # '%text%' or a group's topic suffix to match almost nothing, and would read and sort
        # every dead letter instead (seconds at a million). SQLite gets the same walk by
        # INDEXED BY (sqlite._dead_index).
        with self._conn() as conn, conn.transaction():
            conn.execute("SET LOCAL enable_sort = off")
            return [self._message(r) for r in conn.execute(sql, args).fetchall()]

    def purge_dead(self, flt: DeadLetterFilter = _ALL, *, at_most: int | None = None) -> int:
        where, args = dead_letter_where(flt, "%s", key_match=_KEY_MATCH, headers_contain=_HEADERS_CONTAIN)
        if at_most is not None:
            where = f"id IN (SELECT id FROM {self._t} WHERE {where} LIMIT %s)"
            args.append(at_most)
        with self._conn() as conn:
            return conn.execute(f"DELETE FROM {self._t} WHERE {where}", args).rowcount

    # -- erasure of one key (`StoreAdmin.erase_key`) ------------------------------------------

    def _groups_of_key(self, key: bytes, topic: str | None) -> tuple[str, list[Any]]:
        """WHERE clause and arguments of the group rows holding `key` (of `topic`)."""
        where = "n > 1 AND status = 0 AND position(%s::bytea in keys) > 0"
        args: list[Any] = [grouped.key_token(key)]
        if topic is not None:
            where += " AND topic = %s"
            args.append(topic)
        return where, args

    def _key_counts(self, key: bytes, topic: str | None, now: float) -> Erased:
        pending, pending_args, dead, dead_args = _of_key(key, topic)
        groups, group_args = self._groups_of_key(key, topic)
        with self._conn() as conn:
            rows = conn.execute(
                f"SELECT status, {_LEASED}, count(*) FROM {self._t} WHERE {pending} GROUP BY 1, 2 UNION ALL "
                f"SELECT status, false, count(*) FROM {self._t} WHERE {dead} GROUP BY 1",
                [now, *pending_args, *dead_args],
            ).fetchall()
            in_groups = conn.cursor(binary=True).execute(
                f"SELECT id, topic, created_at, body, enc_key, {_LEASED} FROM {self._t} WHERE {groups}",
                [now, *group_args],
            ).fetchall()
        counts = _erased(rows)
        for gid, gtopic, created_at, body, kid, leased in in_groups:
            plain = self._body(gid, gtopic, body, kid)
            n = sum(m.key == key for m in grouped.decode(plain, gid, gtopic, created_at))
            counts += Erased(n, 0, n if leased else 0)
        return counts

    def _erase_in_group(self, key: bytes, topic: str | None, after: int, now: float) -> tuple[int, Erased] | None:
        groups, args = self._groups_of_key(key, topic)
        found = self._read(f"SELECT id FROM {self._t} WHERE id > %s AND {groups} ORDER BY id LIMIT 1", [after, *args])
        if not found:
            return None
        gid = int(found[0][0])
        with self._tx() as conn:
            # Locked until the commit; gone if it was delivered or exploded since.
            row = conn.cursor(binary=True).execute(
                f"SELECT topic, created_at, body, enc_key, {_LEASED} FROM {self._t} "
                "WHERE id = %s AND n > 1 AND status = 0 FOR UPDATE",
                [now, gid],
            ).fetchone()
            if row is None:
                return gid, Erased()
            gtopic, created_at, body, kid, leased = row
            plain = self._body(gid, gtopic, body, kid)
            gone = [m.id for m in grouped.decode(plain, gid, gtopic, created_at) if m.key == key]
            self._explode(conn, gid, skip=gone)
        return gid, Erased(len(gone), 0, len(gone) if leased else 0)

    def _erase_rows(self, key: bytes, topic: str | None, now: float, limit: int) -> Erased:
        pending, pending_args, dead, dead_args = _of_key(key, topic)
        with self._conn() as conn:  # one statement: its own transaction
            rows = conn.execute(
                f"DELETE FROM {self._t} WHERE id IN (SELECT id FROM ("
                f"(SELECT id FROM {self._t} WHERE {pending} LIMIT %s) UNION ALL "
                f"(SELECT id FROM {self._t} WHERE {dead} LIMIT %s)) AS k LIMIT %s) "
                f"RETURNING status, {_LEASED}, 1",
                [*pending_args, limit, *dead_args, limit, limit, now],
            ).fetchall()
        return _erased(rows)

    def replay_dead(self, flt: DeadLetterFilter = _ALL, *, now: float, to_topic: str | None = None) -> int:
        where, args = dead_letter_where(flt, "%s", key_match=_KEY_MATCH, headers_contain=_HEADERS_CONTAIN)
        with self._conn() as conn:
            return conn.execute(
                f"UPDATE {self._t} SET status = 0, attempts = 0, next_attempt_at = %s, ready_at = %s, "
                f"lease_owner = NULL, topic = COALESCE(%s, topic) WHERE {where}",
                [now, now, to_topic, *args],
            ).rowcount

    def count_dead(self, flt: DeadLetterFilter = _ALL) -> int:
        where, args = dead_letter_where(flt, "%s", key_match=_KEY_MATCH, headers_contain=_HEADERS_CONTAIN)
        return int(self._read(f"SELECT count(*) FROM {self._t} WHERE {where}", args)[0][0])

    def redrive_edited(
        self, id: int, *, value: bytes | None, headers: list[tuple[str, bytes | None]], now: float
    ) -> bool:
        with self._tx() as conn:
            row = conn.execute(f"SELECT msg_id FROM {self._t} WHERE id = %s AND status = 2", [id]).fetchone()
            if row is None:
                return False
            # Encrypted again with the newest key, bound to its msg_id, when the store encrypts.
            return conn.execute(
                f"UPDATE {self._t} SET value = %s, headers = %s, enc_key = %s, status = 0, attempts = 0, "
                "next_attempt_at = %s, ready_at = %s, lease_owner = NULL WHERE id = %s AND status = 2",
                [*stored_payload(row[0], value, headers, self.encryption), now, now, id],
            ).rowcount == 1

    def trace(self, msg_id: str) -> list[OutboxMessage]:
        rows = self._read(
            f"SELECT {ROW} FROM {self._t} WHERE msg_id = %s AND status = 2 UNION ALL "
            f"SELECT {ROW} FROM {self._t} WHERE msg_id = %s AND status = 0 ORDER BY 1",
            [msg_id, msg_id],
        )
        found = [self._message(r) for r in rows]
        # An encrypted body cannot be searched: each is decrypted.
        found += [
            m for m in self._group_messages(
                "(position(%s::bytea in body) > 0 OR enc_key IS NOT NULL)", [msg_id.encode()]
            )
            if m.msg_id == msg_id
        ]
        return sorted(found, key=lambda m: m.id)

    def encrypted_key_ids(self) -> list[str]:
        return [r[0] for r in self._read(f"SELECT DISTINCT enc_key FROM {self._t} WHERE enc_key IS NOT NULL", [])]

    def _rotation_page(self, after: int, current: str, limit: int, now: float) -> list[StoredPayload]:
        rows = self._read(
            f"SELECT id, msg_id, topic, n, enc_key, value, headers, NULL FROM {self._t} "
            f"WHERE id > %s AND (enc_key IS NULL OR enc_key <> %s) AND NOT {_LEASED} ORDER BY id LIMIT %s",
            [after, current, now, limit],
        )
        return [StoredPayload(*r) for r in rows]

    def _bodies(self, ids: Sequence[int]) -> dict[int, bytes]:
        if not ids:
            return {}
        return dict(self._read(f"SELECT id, body FROM {self._t} WHERE id = ANY(%s)", [list(ids)]))

    def _write_resealed(self, rows: Sequence[Resealed], current: str) -> int:
        # One statement: the rows still holding the bytes read (a group row's are its body).
        with self._tx() as conn:
            changed = conn.execute(
                f"UPDATE {self._t} t SET value = u.nv, headers = u.nh, body = u.nb, enc_key = %s "
                "FROM unnest(%s::bigint[], %s::text[], %s::bytea[], %s::bytea[], %s::bytea[], "
                "%s::bytea[], %s::bytea[], %s::bytea[]) AS u(id, kid, ov, oh, ob, nv, nh, nb) "
                "WHERE t.id = u.id AND t.enc_key IS NOT DISTINCT FROM u.kid "
                "AND t.value IS NOT DISTINCT FROM u.ov AND t.headers IS NOT DISTINCT FROM u.oh "
                "AND t.body IS NOT DISTINCT FROM u.ob RETURNING t.n",
                [
                    current,
                    [r.old.id for r in rows], [r.old.kid for r in rows],
                    [r.old.value for r in rows], [r.old.headers for r in rows], [r.old.body for r in rows],
                    [r.value for r in rows], [r.headers for r in rows], [r.body for r in rows],
                ],
            ).fetchall()
        return sum(n for (n,) in changed)

    def _left_to_rotate(self, current: str) -> int:
        return int(self._read(
            f"SELECT COALESCE(sum(n), 0) FROM {self._t} WHERE enc_key IS NULL OR enc_key <> %s", [current]
        )[0][0])

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

    def stats(self, *, now: float) -> StoreStats:
        with self._conn() as conn:
            by_state = conn.execute(
                "SELECT status, topic, sum(n), min(created_at), "
                "sum(n) FILTER (WHERE lease_owner IS NOT NULL AND next_attempt_at > %s) "
                f"FROM {self._t} GROUP BY status, topic",
                [now],
            ).fetchall()
            errors = conn.execute(
                "SELECT COALESCE(error_name || ' (' || error_code || ')', error_name, '?'), "
                f"count(*) FROM {self._t} WHERE status = 2 GROUP BY 1"
            ).fetchall()
            due = conn.execute(NEXT_DUE_SQL.format(t=self._t)).fetchone()
        return store_stats(by_state, {e: int(n) for e, n in errors}, due[0] if due is not None else None)

    def backlog(self, *, now: float, topic: str | None = None) -> Backlog:
        sql, args = backlog_sql(self._t, "%s", now, topic, count="SUM(r.n)")
        return backlog_from_rows(self._read(sql, args), self.owner_liveness)

