"""Bulk reads of an outbox by a reader that is not the store (the Spark job's JDBC reads).

The store describes its own table (`Outbox.bulk_read()` -> `BulkRead`): the selection of pending
or dead rows, the rows that hold their keys back, the SQL of a read by id range and how to count
messages. Readers run that SQL as it is and turn each row read into messages with `explode`,
where the rows land (a row may hold a group of messages, `outbox.stores.grouped`): the
reader's driver reads id bounds and counts only, never a message's bytes. The per-key order rule
is `outbox.stores.keyrule`'s.

JDBC readers cannot bind parameters, so values are written into the SQL as literals; every
literal goes through `_str` / `_num`, which quote or validate it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from outbox.errors import ConfigError
from outbox.records import Headers, Status
from outbox.stores import grouped
from outbox.stores.codec import decode_headers

#: What a reader needs of a row, in `BulkMessage` order (`key` and `partition` are keywords of some
#: databases: quoted, as every store's reader session takes double-quoted names).
MESSAGE_COLUMNS = (
    "id", "msg_id", "topic", '"key"', "value", "headers", '"partition" AS part', "attempts", "first_failed_at",
    "last_error", "timestamp",
)


class BulkMessage(NamedTuple):
    """One message of a bulk read, as a re-sender sends it (`outbox.drain.sendloop.Stored`)."""

    id: int
    msg_id: str
    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers
    partition: int
    attempts: int
    first_failed_at: float | None
    last_error: str | None
    timestamp: int  # the record timestamp, ms (0: unknown)


@dataclass(frozen=True, slots=True)
class BulkSelection:
    """Which rows a bulk read takes: pending rows (due ones unless `include_not_due`), or dead
    letters; of some topics; of an error (dead letters: a librdkafka code or name); created (dead
    letters: last failed) in [since, until)."""

    dead_letters: bool = False
    topics: tuple[str, ...] = ()
    error: str | None = None
    since: float | None = None
    until: float | None = None
    include_not_due: bool = False


@dataclass(frozen=True, slots=True)
class Selected:
    """The SQL conditions of a selection.

    Attributes:
        where: the selected rows.
        blocked_where: PENDING rows that are *not* selected but hold back the later messages of
            their keys (per-key order), or None when nothing can block.
    """

    where: str
    blocked_where: str | None


def _str(text: str) -> str:
    if "\x00" in text:
        raise ConfigError("filter values cannot contain NUL characters")
    return "'" + text.replace("'", "''") + "'"


def _num(x: float) -> str:
    if not math.isfinite(x):
        raise ConfigError(f"not a finite time: {x}")
    return repr(float(x))


@dataclass(frozen=True, slots=True)
class BulkRead:
    """One outbox table as a bulk reader reads it (built by the store's `bulk_read()`).

    Attributes:
        table: the quoted table name (schema-qualified for PostgreSQL).
        grouped: a row may hold a group of messages (its `n` and `body` columns).
        schema: column types the reader must be told ("name TYPE, ...": sqlite-jdbc reports a
            BIGINT as DECIMAL, and no type for an expression column).
        body_table: where a group's `body` and `keys` are, by the group's id (SQLite's
            `outbox_body`); None: in the row itself (PostgreSQL).
    """

    table: str
    grouped: bool
    schema: str
    body_table: str | None = None

    @property
    def count(self) -> str:
        """How a selection counts messages: a grouped row holds `n`."""
        return "SUM(n)" if self.grouped else "COUNT(*)"

    def selection(self, sel: BulkSelection, now: float) -> Selected:
        """The SQL conditions for `sel`'s rows at time `now`."""
        conds: list[str] = []
        outside: list[str] = []  # why a pending row of a selected key may be left out
        if sel.topics:
            conds.append(f"topic IN ({', '.join(_str(t) for t in sel.topics)})")
        if sel.dead_letters:
            conds.insert(0, f"status = {int(Status.DEAD)}")
            column = "last_failed_at"
            if sel.error is not None:
                # The store's own rule (`base.dead_letter_where`): a code or a name, on its own column.
                if sel.error.lstrip("-").isdigit():
                    conds.append(f"error_code = {int(sel.error)}")
                else:
                    conds.append(f"error_name = {_str(sel.error.upper())}")
        else:
            conds.insert(0, f"status = {int(Status.PENDING)}")
            column = "created_at"
            if not sel.include_not_due:
                # Due also means "not leased": a running drainer's rows are left to it.
                conds.append(f"next_attempt_at <= {_num(now)}")
                outside.append(f"next_attempt_at > {_num(now)}")
        if sel.since is not None:
            conds.append(f"{column} >= {_num(sel.since)}")
            outside.append(f"{column} < {_num(sel.since)}")
        if sel.until is not None:
            conds.append(f"{column} < {_num(sel.until)}")
            outside.append(f"{column} >= {_num(sel.until)}")
        blocked = None
        if outside and not sel.dead_letters:
            blocked = f"status = {int(Status.PENDING)} AND ({' OR '.join(outside)})"
        return Selected(where=" AND ".join(conds), blocked_where=blocked)

    def rows(self, where: str, lo: int, hi: int, extra: Sequence[str] = ()) -> str:
        """The selected rows with ids in [lo, hi], each row's columns as `explode` reads them, and
        `enc_key` (`explode` reads rows in clear only), then the `extra` columns of the table."""
        columns = ", ".join(MESSAGE_COLUMNS)
        if self.grouped and self.body_table is None:
            columns += ", n, body"  # NULL in a one-message row
        elif self.grouped:
            # A group's body, read where the row is exploded; one-message rows have none.
            columns += (
                f", n, CASE WHEN n > 1 THEN (SELECT b.body FROM {self.body_table} AS b WHERE b.id = {self.table}.id) "
                "END AS body"
            )
        columns += ", enc_key"  # the key a row's payload is sealed with (`outbox.stores.sealed`); NULL: in clear
        columns += "".join(f", {c}" for c in extra)
        return f"SELECT {columns} FROM {self.table} WHERE {where} AND id BETWEEN {lo} AND {hi}"

    def bounds(self, where: str) -> str:
        """Columns lo, hi (ids) and n (messages) of the selection."""
        return f"SELECT MIN(id) AS lo, MAX(id) AS hi, {self.count} AS n FROM {self.table} WHERE {where}"

    def blockers(self, blocked_where: str) -> str:
        """Columns b_topic, b_key, block_id: the first blocking one-message row of each key."""
        return (
            f'SELECT topic AS b_topic, "key" AS b_key, MIN(id) AS block_id FROM {self.table} '
            f'WHERE {blocked_where} AND "key" IS NOT NULL GROUP BY topic, "key"'
        )

    def blocking_groups(self, blocked_where: str) -> str | None:
        """Columns id, topic, keys of the blocking groups (`explode_keys` reads them); None: no groups."""
        if not self.grouped:
            return None
        if self.body_table is None:
            return (
                f"SELECT id, topic, keys FROM {self.table} WHERE n > 1 AND keys IS NOT NULL AND {blocked_where}"
            )
        return (
            f"SELECT o.id AS id, o.topic AS topic, b.keys AS keys FROM {self.table} AS o "
            f"JOIN {self.body_table} AS b ON b.id = o.id WHERE o.n > 1 AND b.keys IS NOT NULL AND o.id IN "
            f"(SELECT id FROM {self.table} WHERE {blocked_where})"
        )

    def ids(self, where: str) -> str:
        """Column id of the selection (dead letters: never groups)."""
        return f"SELECT id FROM {self.table} WHERE {where}"

    def counts_by_topic(self, where: str) -> str:
        """Columns topic, n: messages per topic of the selection."""
        return f"SELECT topic, {self.count} AS n FROM {self.table} WHERE {where} GROUP BY topic"


def explode(row: Sequence[Any]) -> list[BulkMessage]:
    """The messages of one row read by `BulkRead.rows`: the row's own, or its group's."""
    body = row[12] if len(row) > 12 else None
    if body is not None:
        topic = row[2]
        return [
            BulkMessage(m.id, m.msg_id, topic, m.key, m.value, m.headers, m.partition, m.attempts,
                        m.first_failed_at, m.last_error, m.timestamp)
            for m in grouped.decode(bytes(body), row[0], topic, 0.0)
        ]
    id_, msg_id, topic, key, value, headers, part, attempts, first_failed_at, last_error, stamp = row[:11]
    return [
        BulkMessage(
            int(id_), msg_id, topic, None if key is None else bytes(key), None if value is None else bytes(value),
            decode_headers(None if headers is None else bytes(headers)), -1 if part is None else int(part),
            int(attempts), first_failed_at, last_error, int(stamp or 0),
        )
    ]


def explode_keys(row: Sequence[Any]) -> Iterator[tuple[str, bytes, int]]:
    """(topic, key, group id) for each key of a blocking group read by `BulkRead.blocking_groups`."""
    gid, topic, keys = row[0], row[1], row[2]
    for key in grouped.keys_of(None if keys is None else bytes(keys)):
        yield topic, key, int(gid)
