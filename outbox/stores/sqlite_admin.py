"""Dead letters and reads for people in a SQLite outbox: list, count, purge, replay, edit and
redrive, trace, the audit log, stats and the backlog (`outbox.stores.base.StoreAdmin`)."""

from __future__ import annotations

import abc
import sqlite3
from collections.abc import Collection, Sequence
from typing import Any

from outbox.errors import UnknownMessageError
from outbox.records import AuditEntry, DeadLetterFilter, OutboxMessage, Status, StoreStats
from outbox.stores import grouped, sealed
from outbox.stores.backlog import Backlog, backlog_from_rows, backlog_sql
from outbox.stores.base import (
    Erased,
    StoreAdmin,
    dead_letter_where,
    stored_payload,
)
from outbox.stores.encryption import KeyRing
from outbox.stores.rotation import Resealed, RotatingStore, StoredPayload
from outbox.stores.sqlite_conn import SQLiteConnection
from outbox.stores.sqlite_schema import (
    GROUP,
    GROUPS,
    ROW,
)


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


def _batch_index(flt: DeadLetterFilter) -> str:
    """Which index a bounded purge reads its batch from: a time window (the retention's "failed
    before T") on the failure-time index, where it starts, so that the last, short batch does
    not walk every dead letter that is not in the window; otherwise as a list would."""
    selective = flt.ids or flt.topic is not None or flt.error is not None or flt.key is not None
    if not selective and (flt.since is not None or flt.until is not None):
        return "INDEXED BY outbox_dead_failed"
    return _dead_index(flt)


def _key_where(key: bytes, topic: str | None) -> tuple[str, list[Any]]:
    """The one-message rows of `key` (of `topic`: then on the key index). Group rows have no key."""
    if topic is None:
        return "key = ?", [key]
    return "topic = ? AND key = ?", [topic, key]


def _leased(prefix: str = "") -> str:
    """The SQL truth of "leased to a sender at ?" (a pending row whose lease has not ended)."""
    return f"({prefix}lease_owner IS NOT NULL AND {prefix}next_attempt_at > ?)"


class SQLiteAdmin(SQLiteConnection, RotatingStore, StoreAdmin):
    """The administration half of `SQLiteOutbox` (one class of the store, kept in its own module)."""

    encryption: KeyRing | None = None

    @abc.abstractmethod
    def _explode(self, c: sqlite3.Connection, gid: int, *, skip: Collection[int] = ()) -> int:
        """Replace a group row with one row per message, leaving out the ids in `skip`: the hot
        path's (`SQLiteOutbox._explode`), which an erasure uses too."""

    @abc.abstractmethod
    def _message(self, r: Sequence[Any]) -> OutboxMessage:
        """A row selected with `ROW` as a message, its payload decrypted."""

    def _body(self, gid: int, topic: str, body: bytes, kid: str | None, n: int | None = None) -> bytes:
        """A group's body as `grouped` reads it: decrypted when it is encrypted (`n`: its messages)."""
        return sealed.open_body(body, kid, topic, self.encryption, gid, n)

    def get(self, id: int) -> OutboxMessage:
        rows = self._read(f"SELECT {ROW} FROM outbox WHERE id = ? AND n = 1", (id,))
        if rows:
            return self._message(rows[0])
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
            out = [self._message(r) for r in self._read(f"SELECT {ROW} FROM outbox WHERE n = 1")]
            out += self._group_messages("1", ())
        return sorted(out, key=lambda m: m.id)

    def _group_messages(self, where: str, args: Sequence[Any]) -> list[OutboxMessage]:
        """The messages of the groups matching `where`, each due when its group is (its lease)."""
        out: list[OutboxMessage] = []
        for gid, topic, created_at, due, n, body, kid in self._read(
            f"SELECT {GROUP} FROM {GROUPS} WHERE o.n > 1 AND {where}", args
        ):
            body = self._body(gid, topic, body, kid, n)
            out += [m._replace(next_attempt_at=due) for m in grouped.decode(body, gid, topic, created_at)]
        return out

    def list_dead(self, flt: DeadLetterFilter = DeadLetterFilter()) -> list[OutboxMessage]:
        where, args = dead_letter_where(flt, "?")
        sql = f"SELECT {ROW} FROM outbox {_dead_index(flt)} WHERE {where} ORDER BY id"
        if flt.limit is not None:
            sql += " LIMIT ?"
            args.append(flt.limit)
        return [self._message(r) for r in self._read(sql, args)]

    def purge_dead(self, flt: DeadLetterFilter = DeadLetterFilter(), *, at_most: int | None = None) -> int:
        where, args = dead_letter_where(flt, "?")
        if at_most is not None:
            where = f"id IN (SELECT id FROM outbox {_batch_index(flt)} WHERE {where} LIMIT ?)"
            args.append(at_most)
        with self._write() as c:
            return c.execute(f"DELETE FROM outbox WHERE {where}", args).rowcount

    # -- erasure of one key (`StoreAdmin.erase_key`) ------------------------------------------

    def _key_counts(self, key: bytes, topic: str | None, now: float) -> Erased:
        where, args = _key_where(key, topic)
        in_groups = f"SELECT {GROUP}, {_leased('o.')} FROM {GROUPS} WHERE o.n > 1 AND instr(b.keys, ?) > 0"
        group_args: list[Any] = [now, grouped.key_token(key)]
        if topic is not None:
            in_groups += " AND o.topic = ?"
            group_args.append(topic)
        counts = Erased()
        with self._snapshot() as c:
            for status, leased, n in c.execute(
                f"SELECT status, {_leased()}, COUNT(*) FROM outbox WHERE {where} GROUP BY 1, 2", [now, *args]
            ):
                dead = status == Status.DEAD
                counts += Erased(0 if dead else n, n if dead else 0, n if leased else 0)
            for gid, gtopic, created_at, _, _, body, kid, leased in c.execute(in_groups, group_args):
                body = self._body(gid, gtopic, body, kid)
                n = sum(m.key == key for m in grouped.decode(body, gid, gtopic, created_at))
                counts += Erased(n, 0, n if leased else 0)
        return counts

    def _erase_in_group(self, key: bytes, topic: str | None, after: int, now: float) -> tuple[int, Erased] | None:
        sql = f"SELECT o.id FROM {GROUPS} WHERE o.n > 1 AND o.id > ? AND instr(b.keys, ?) > 0"
        args: list[Any] = [after, grouped.key_token(key)]
        if topic is not None:
            sql += " AND o.topic = ?"
            args.append(topic)
        found = self._read(sql + " ORDER BY o.id LIMIT 1", args)
        if not found:
            return None
        gid: int = found[0][0]
        # Read again under the write lock: the group may have been delivered or exploded since.
        with self._write() as c:
            row = c.execute(f"SELECT {GROUP}, {_leased('o.')} FROM {GROUPS} WHERE o.n > 1 AND o.id = ?",
                            (now, gid)).fetchone()
            if row is None:
                return gid, Erased()
            _, gtopic, created_at, _, _, body, kid, leased = row
            body = self._body(gid, gtopic, body, kid)
            gone = [m.id for m in grouped.decode(body, gid, gtopic, created_at) if m.key == key]
            self._explode(c, gid, skip=gone)
        return gid, Erased(len(gone), 0, len(gone) if leased else 0)

    def _erase_rows(self, key: bytes, topic: str | None, now: float, limit: int) -> Erased:
        where, args = _key_where(key, topic)
        with self._write() as c:
            rows = c.execute(
                f"DELETE FROM outbox WHERE id IN (SELECT id FROM outbox WHERE {where} LIMIT ?) "
                f"RETURNING status, {_leased()}",
                [*args, limit, now],
            ).fetchall()
        dead = sum(status == Status.DEAD for status, _ in rows)
        return Erased(len(rows) - dead, dead, sum(bool(leased) for _, leased in rows))

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
            row = c.execute("SELECT msg_id FROM outbox WHERE id = ? AND status = 2", (id,)).fetchone()
            if row is None:
                return False
            # Encrypted again with the newest key, bound to its msg_id, when the store encrypts.
            return c.execute(
                "UPDATE outbox SET value = ?, headers = ?, enc_key = ?, status = 0, attempts = 0, "
                "next_attempt_at = ?, lease_owner = NULL WHERE id = ? AND status = 2",
                (*stored_payload(row[0], value, headers, self.encryption), now, id),
            ).rowcount == 1

    def trace(self, msg_id: str) -> list[OutboxMessage]:
        # Dead letters on the partial index, pending rows by a scan of the backlog (see MIGRATIONS[3]).
        rows = self._read(
            f"SELECT {ROW} FROM outbox WHERE msg_id = ? AND status = 2 UNION ALL "
            f"SELECT {ROW} FROM outbox WHERE msg_id = ? AND status = 0 ORDER BY 1",
            (msg_id, msg_id),
        )
        found = [self._message(r) for r in rows]
        # In a group: only the bodies holding the id's bytes are decoded (an encrypted body
        # cannot be searched: each is decrypted).
        found += [
            m for m in self._group_messages("(instr(b.body, ?) > 0 OR o.enc_key IS NOT NULL)", (msg_id.encode(),))
            if m.msg_id == msg_id
        ]
        return sorted(found, key=lambda m: m.id)

    def encrypted_key_ids(self) -> list[str]:
        return [k for (k,) in self._read("SELECT DISTINCT enc_key FROM outbox WHERE enc_key IS NOT NULL")]

    def _rotation_page(self, after: int, current: str, limit: int, now: float) -> list[StoredPayload]:
        rows = self._read(
            "SELECT id, msg_id, topic, n, enc_key, value, headers, NULL FROM outbox "
            f"WHERE id > ? AND (enc_key IS NULL OR enc_key != ?) AND NOT {_leased()} ORDER BY id LIMIT ?",
            (after, current, now, limit),
        )
        return [StoredPayload(*r) for r in rows]

    def _bodies(self, ids: Sequence[int]) -> dict[int, bytes]:
        if not ids:
            return {}
        return dict(self._read(f"SELECT id, body FROM outbox_body WHERE id IN ({', '.join('?' * len(ids))})", ids))

    def _write_resealed(self, rows: Sequence[Resealed], current: str) -> int:
        done = 0
        with self._write() as c:
            for r in rows:
                old = r.old
                if old.body is None:
                    cur = c.execute(
                        "UPDATE outbox SET value = ?, headers = ?, enc_key = ? "
                        "WHERE id = ? AND enc_key IS ? AND value IS ? AND headers IS ?",
                        (r.value, r.headers, current, old.id, old.kid, old.value, old.headers),
                    )
                else:
                    cur = c.execute("UPDATE outbox_body SET body = ? WHERE id = ? AND body IS ?",
                                    (r.body, old.id, old.body))
                    if cur.rowcount:
                        c.execute("UPDATE outbox SET enc_key = ? WHERE id = ?", (current, old.id))
                done += old.n if cur.rowcount else 0
        return done

    def _left_to_rotate(self, current: str) -> int:
        return int(self._read(
            "SELECT COALESCE(SUM(n), 0) FROM outbox WHERE enc_key IS NULL OR enc_key != ?", (current,)
        )[0][0])

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

    def stats(self, *, now: float) -> StoreStats:
        # Counted from indexes alone, never from the rows (which carry the message bytes): a
        # large backlog took four times as long to count by reading them as from the indexes; the
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

