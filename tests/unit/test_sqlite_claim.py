"""SQLite claims choose their rows in a read snapshot and lease them in a short write transaction
(`SQLiteOutbox.claim`). A row another writer takes between the two must not be leased twice, and
the rows after it must not be sent ahead of it. Real SQLite files; no Kafka needed."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outbox.records import NewMessage
from outbox.stores import grouped
from outbox.stores.sqlite import SQLiteOutbox, _ranges

NOW = 1_000_000.0


def one(key: bytes, tag: str) -> NewMessage:
    return NewMessage("t", tag.encode(), key, [], -1, tag, 0, None, None, 0.0)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteOutbox]:
    s = SQLiteOutbox(str(tmp_path / "o.db"))
    yield s
    s.close()


def lease_behind_the_snapshot(monkeypatch: pytest.MonkeyPatch, path: str, sql: str, args: tuple[Any, ...]) -> None:
    """Run `sql` from another connection right after the claim chose its rows, as a claimer in
    another process would."""
    choose = SQLiteOutbox._keep_key_order

    def racing(*a: Any, **kw: Any) -> Any:
        out = choose(*a, **kw)
        other = sqlite3.connect(path, isolation_level=None)
        other.execute(sql, args)
        other.close()
        return out

    monkeypatch.setattr(SQLiteOutbox, "_keep_key_order", staticmethod(racing))


def test_a_row_taken_meanwhile_ends_the_claim_and_the_rows_after_it_stay_due(
    store: SQLiteOutbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One message per call: single rows 1, 2, 3 (a group needs GROUP_MIN messages).
    for tag, key in (("a", b"k1"), ("b", b"k2"), ("c", b"k2")):
        store.enqueue([one(key, tag)])
    lease_behind_the_snapshot(
        monkeypatch, store.path, "UPDATE outbox SET lease_owner = 'other', next_attempt_at = ? WHERE id = 2",
        (NOW + 60,),
    )
    got = store.claim("me", 10, 30, now=NOW)
    assert [m.msg_id for m in got] == ["a"]
    rows = {r[0]: r[1:] for r in store._read("SELECT id, lease_owner, next_attempt_at FROM outbox")}
    assert rows == {1: ("me", NOW + 30), 2: ("other", NOW + 60), 3: (None, 0.0)}


def test_a_group_delivered_meanwhile_is_not_returned(store: SQLiteOutbox, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = store.enqueue([one(b"k%d" % (i % 3), f"m{i}") for i in range(grouped.GROUP_MIN)])
    lease_behind_the_snapshot(monkeypatch, store.path, "DELETE FROM outbox WHERE id = ?", (ids[0] - 1,))
    assert store.claim("me", 100, 30, now=NOW) == []
    assert store.messages() == []


def test_without_a_race_every_chosen_row_is_leased(store: SQLiteOutbox) -> None:
    ids = store.enqueue([one(b"k%d" % (i % 3), f"m{i}") for i in range(grouped.GROUP_MIN)])
    store.enqueue([one(b"k9", "single")])
    got = store.claim("me", 100, 30, now=NOW)
    assert [m.id for m in got] == [*ids, ids[-1] + 1]
    assert {r[0] for r in store._read("SELECT lease_owner FROM outbox")} == {"me"}


def test_ids_to_delete_become_one_range_per_contiguous_run_in_any_order_with_repeats() -> None:
    assert _ranges([]) == [] and _ranges([7]) == [(7, 7)]
    assert _ranges([9, 1, 2, 2, 3, 5, 6, 5]) == [(1, 3), (5, 6), (9, 9)]
    assert _ranges([*range(2, 1002), *range(1003, 2003)]) == [(2, 1001), (1003, 2002)]


@pytest.mark.parametrize("flying", [20, 150])  # runs named in the SQL, or more than it names: a JSON list
def test_only_the_rows_named_in_flight_let_their_keys_later_rows_through(store: SQLiteOutbox, flying: int) -> None:
    # One message per call: single rows a0 f0 a1 f1 …, so the claimer's a rows are 150 runs of one id.
    for i in range(150):
        store.enqueue([one(b"k%d" % i, f"a{i}")])
        store.enqueue([one(b"f%d" % i, f"f{i}")])
    mine = store.claim("me", 1000, 30, now=NOW)
    f_ids = [m.id for m in mine if m.msg_id.startswith("f")]
    store.release(f_ids, now=NOW)
    a_ids = [m.id for m in mine if m.msg_id.startswith("a")]
    later = [store.enqueue([one(b"k%d" % i, f"b{i}")])[0] for i in range(150)]
    # The claimer's producer has the first `flying` a rows in flight: only their keys' b rows may
    # follow them; the others wait for their a rows, leased and not said to be in flight.
    got = store.claim("me", 1000, 30, now=NOW, in_flight=a_ids[:flying])
    assert [m.id for m in got] == f_ids + later[:flying]
