"""SQLite groups: what only the SQLite store does with them (its body table, a deleted file,
its schema versions), and the group body's own format. What both stores do with groups is
tests/integration/test_grouped_rows.py. Real SQLite files; no Kafka needed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox.records import NewMessage
from outbox.stores import grouped
from outbox.stores.base import Settlement
from outbox.stores.sqlite import SQLiteOutbox

from ..group_cases import NOW, STAMP, G, batch, ids, one
from ..old_schema import sqlite_v5, v5_body


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteOutbox]:
    s = SQLiteOutbox(str(tmp_path / "o.db"))
    yield s
    s.close()


def test_a_deleted_file_is_recreated_with_its_groups(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    store = SQLiteOutbox(str(path))
    try:
        got = store.enqueue(batch(20))
        path.unlink()
        store.enqueue(one(b"x", "after"))  # the next write re-creates the file, rows copied
        assert ids(store.messages()) == [*got, got[-1] + 1]
    finally:
        store.close()
    again = SQLiteOutbox(str(path), create=False)
    try:
        assert [r.msg_id for r in again.messages()] == [f"m-{i}" for i in range(20)] + ["after"]
    finally:
        again.close()


def test_a_version_4_file_keeps_its_groups_when_migrated(tmp_path: Path) -> None:
    """Version 4 kept a group's body in its outbox row; version 5 moves it to outbox_body."""
    import sqlite3

    from outbox.stores import sqlite_schema as sqlite_store

    path = str(tmp_path / "v4.db")
    raw = sqlite3.connect(path, isolation_level=None)
    for v in range(1, 5):
        if v == 2:
            sqlite_store.migrate_to_2(raw)
        else:
            for stmt in sqlite_store.MIGRATIONS[v]:
                raw.execute(stmt)
    new = batch(G, keys=(b"a", b"b"))
    body, keys = v5_body(new), grouped.encode(new)[1]
    raw.execute(
        "INSERT INTO outbox (id, msg_id, topic, created_at, next_attempt_at, n, body, keys) "
        "VALUES (1, '', 't', ?, 0, ?, ?, ?)",
        (NOW, G, body, keys),
    )
    raw.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'outbox'", (1 + G,))
    raw.execute("PRAGMA user_version = 4")
    raw.close()
    store = SQLiteOutbox(path)
    try:
        assert [m.msg_id for m in store.messages()] == [m.msg_id for m in new]
        assert {m.timestamp for m in store.messages()} == {0}  # stored before timestamps: unknown
        assert store.has_pending("t", b"a") and not store.has_pending("t", b"c")
        claimed = store.claim("me", 100, 30, now=NOW)
        assert ids(claimed) == list(range(2, 2 + G))
        store.apply(Settlement(delivered=ids(claimed)), now=NOW)
        assert store.messages() == []
        assert store._read("SELECT COUNT(*) FROM outbox_body")[0][0] == 0
        assert store.enqueue(one(None, "next")) == [2 + G]
    finally:
        store.close()


def test_a_deleted_group_takes_its_body_with_it(store: SQLiteOutbox) -> None:
    store.enqueue(batch(G))
    store.enqueue(batch(G, tag="n"))
    assert store._read("SELECT COUNT(*) FROM outbox_body")[0][0] == 2
    claimed = store.claim("me", G, 30, now=NOW)
    store.apply(Settlement(delivered=ids(claimed)), now=NOW)
    assert store._read("SELECT COUNT(*) FROM outbox_body")[0][0] == 1
    store.explode_groups()
    assert store._read("SELECT COUNT(*) FROM outbox_body")[0][0] == 0
    assert [m.msg_id for m in store.messages()] == [f"n-{i}" for i in range(G)]


def test_a_group_body_round_trips_each_messages_timestamp() -> None:
    new = batch(G)
    new[0] = new[0]._replace(timestamp=2**63 - 1)  # the largest a record timestamp can be
    body, _ = grouped.encode(new)
    got = grouped.decode(body, 100, "t", NOW)
    assert [m.timestamp for m in got] == [m.timestamp for m in new]
    assert [m.timestamp for m in got][1:4] == [STAMP + 1, STAMP + 2, 0]
    assert [grouped.as_new(m).timestamp for m in got] == [m.timestamp for m in new]
    # A version-5 body upgraded reads back the same messages, each with timestamp 0.
    upgraded = grouped.decode(grouped.upgrade_v5(v5_body(new)), 100, "t", NOW)
    assert upgraded == [m._replace(timestamp=0) for m in got]


def test_a_truncated_version_5_body_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="group body ends inside a message"):
        grouped.upgrade_v5(v5_body(batch(G))[:-3])


def test_a_version_5_file_is_migrated_and_its_rows_and_groups_read_timestamp_0(tmp_path: Path) -> None:
    """Version 6 adds the timestamp: rows and group bodies written before it read as 0 (unknown)."""
    from outbox.stores import sqlite_schema as sqlite_store

    path = str(tmp_path / "v5.db")
    singles = [m._replace(msg_id="single") for m in one(b"k", "single")]
    groups = [batch(G, tag="g"), batch(grouped.GROUP_MAX, tag="h")]
    sqlite_v5(path, singles, groups, now=NOW)
    store = SQLiteOutbox(path)
    try:
        assert store._read("PRAGMA user_version")[0][0] == sqlite_store.SCHEMA_VERSION == 7
        got = store.messages()
        assert [m.msg_id for m in got] == ["single"] + [m.msg_id for new in groups for m in new]
        assert {m.timestamp for m in got} == {0}
        assert [(m.key, m.value, m.headers, m.attempts, m.error_name) for m in got[1:]] == [
            (m.key, m.value, m.headers, m.attempts, m.error_name) for new in groups for m in new
        ]
        claimed = store.claim("w", 5000, 30, now=NOW)
        assert [m.msg_id for m in claimed] == [m.msg_id for m in got] and {m.timestamp for m in claimed} == {0}
        store.release([m.id for m in claimed], now=NOW)
        [later] = store.enqueue([NewMessage("t", b"later", timestamp=STAMP)])
        assert later > got[-1].id and store.get(later).timestamp == STAMP
    finally:
        store.close()
