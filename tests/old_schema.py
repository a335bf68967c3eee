"""Outboxes as kafka-outbox wrote them before the record timestamp (SQLite schema version 5):
for the tests of the migration. Built with the old DDL and the old group body layout."""

from __future__ import annotations

import sqlite3
import struct
from collections.abc import Sequence

from outbox.records import NewMessage
from outbox.stores import grouped
from outbox.stores import sqlite_schema as sqlite_store
from outbox.stores.codec import encode_headers

#: The head of a message in a group body at version 5, and today's (timestamp last).
_V5_HEAD = struct.Struct(">iiiiHhiiiBdd")
_HEAD = struct.Struct(">iiiiHhiiiBddq")


def v5_body(messages: Sequence[NewMessage]) -> bytes:
    """A group body as schema version 5 wrote it: each message head without the timestamp."""
    body, _ = grouped.encode(messages)
    out: list[bytes] = []
    pos = 0
    while pos < len(body):
        head = _HEAD.unpack_from(body, pos)
        pos += _HEAD.size
        tail = sum(max(n, 0) for n in head[:6])
        out += [_V5_HEAD.pack(*head[:-1]), body[pos : pos + tail]]
        pos += tail
    return b"".join(out)


def sqlite_v5(path: str, singles: Sequence[NewMessage], groups: Sequence[Sequence[NewMessage]], *, now: float) -> None:
    """A version-5 SQLite outbox at `path` holding `singles` (one row each), then `groups`."""
    raw = sqlite3.connect(path, isolation_level=None)
    for v in range(1, 6):
        if v == 2:
            sqlite_store.migrate_to_2(raw)
        else:
            for stmt in sqlite_store.MIGRATIONS[v]:
                raw.execute(stmt)
    for m in singles:
        raw.execute(
            "INSERT INTO outbox (msg_id, topic, key, value, headers, partition, created_at, next_attempt_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (m.msg_id, m.topic, m.key, m.value, encode_headers(m.headers), m.partition, now, 0),
        )
    for new in groups:
        seq = raw.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'").fetchone()
        gid = (seq[0] if seq else 0) + 1
        raw.execute(
            "INSERT INTO outbox (id, msg_id, topic, created_at, next_attempt_at, n) VALUES (?, '', ?, ?, 0, ?)",
            (gid, new[0].topic, now, len(new)),
        )
        raw.execute(
            "INSERT INTO outbox_body (id, body, keys) VALUES (?, ?, ?)",
            (gid, v5_body(new), grouped.key_blob({m.key for m in new if m.key is not None})),
        )
        raw.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'outbox'", (gid + len(new),))
    raw.execute("PRAGMA user_version = 5")
    raw.close()
