"""The inbox's logic on a real SQLite store, with stand-in messages (no broker needed here):
handler detection, batched marks, the transactional path's rollback, pruning by the window."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from outbox import ConfigError
from outbox.consumer.inbox import Inbox, message_id, takes_transaction
from outbox.stores import Outbox, open_outbox
from outbox.stores.urls import parse_url
from outbox.transactions import dbapi_connection


class Msg:
    """What the inbox reads of a confluent_kafka.Message: its headers."""

    def __init__(self, mid: str | None) -> None:
        self._headers = [("other", b"x")] + ([("outbox-id", mid.encode())] if mid else [])

    def headers(self) -> list[tuple[str, bytes]]:
        return self._headers


def test_which_handlers_take_a_transaction() -> None:
    def one(m: Any) -> None: ...
    def two(m: Any, tx: Any) -> None: ...
    def star(m: Any, *rest: Any) -> None: ...
    def keyword_only(m: Any, *, tx: Any = None) -> None: ...

    # print(*args): no positional parameter named, so one argument, as without dedup.
    assert [takes_transaction(f) for f in (one, two, star, keyword_only, print)] == [False, True, True, False, False]


def test_message_id_is_the_outbox_id_header() -> None:
    assert message_id(Msg("a-1")) == "a-1"  # type: ignore[arg-type]
    assert message_id(Msg(None)) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_batched_marks_skip_copies_across_batches_and_restarts(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url, query = _store(kind, tmp_path, request)
    store = open_outbox(url)
    seen: list[str | None] = []
    inbox = Inbox(store, "g", transactional=False)
    batch = [Msg("a"), Msg("b"), Msg("a"), Msg(None), Msg(None)]
    inbox.begin(batch)  # type: ignore[arg-type]
    got = [inbox.handle(m, lambda m: seen.append(message_id(m))) for m in batch]  # type: ignore[arg-type]
    inbox.commit()
    inbox.close()
    assert got == [True, True, False, True, True] and seen == ["a", "b", None, None]
    assert sorted(query("SELECT msg_id FROM outbox_inbox")) == [("a",), ("b",)]
    again = Inbox(store, "g", transactional=False)  # as after a restart
    later = [Msg("b"), Msg("c")]
    again.begin(later)  # type: ignore[arg-type]
    assert [again.handle(m, lambda m: None) for m in later] == [False, True]  # type: ignore[arg-type]
    again.commit()
    assert again.duplicates == 1
    # A handler that raises: no mark, so its retry (or a copy) runs; the batch's others are marked.
    failing = [Msg("d"), Msg("e"), Msg("d"), Msg("f")]

    def handler(m: Any) -> None:
        seen.append(message_id(m))
        if message_id(m) == "d" and seen.count("d") == 1:
            raise LookupError("fails once")

    assert run_batch(again, failing, handler) == [None, True, True, True]
    assert sorted(query("SELECT msg_id FROM outbox_inbox")) == [("a",), ("b",), ("c",), ("d",), ("e",), ("f",)]
    again.close()
    other_group = Inbox(store, "h", transactional=False)
    other_group.begin(later)  # type: ignore[arg-type]
    assert [other_group.handle(m, lambda m: None) for m in later] == [True, True]  # type: ignore[arg-type]
    other_group.commit()
    other_group.close()
    store.close()


def run_batch(inbox: Inbox, batch: list[Msg], handler: Callable[..., Any]) -> list[bool | None]:
    """As the consumer runs a poll batch: handle's results, None where the handler raised LookupError."""
    inbox.begin(batch)  # type: ignore[arg-type]
    got: list[bool | None] = []
    for m in batch:
        try:
            got.append(inbox.handle(m, handler))  # type: ignore[arg-type]
        except LookupError:
            got.append(None)
    inbox.commit()
    return got


def test_transactional_handler_writes_commit_with_the_mark_or_not_at_all(tmp_path: Path) -> None:
    store = open_outbox(f"sqlite:///{tmp_path / 'c.db'}")
    inbox = Inbox(store, "g", transactional=True)
    inbox.connection.execute("CREATE TABLE effects (v TEXT)")

    def handler(m: Any, tx: sqlite3.Connection) -> None:
        tx.execute("INSERT INTO effects VALUES (?)", (message_id(m),))
        if message_id(m) == "bad":
            raise LookupError("after its write")

    assert run_batch(inbox, [Msg("a")], handler) == [True]
    assert run_batch(inbox, [Msg("a")], handler) == [False]
    assert run_batch(inbox, [Msg("bad")], handler) == [None]
    assert run_batch(inbox, [Msg(None)], handler) == [True]
    db = sqlite3.connect(tmp_path / "c.db")
    assert db.execute("SELECT v FROM effects ORDER BY rowid").fetchall() == [("a",), (None,)]
    assert db.execute("SELECT msg_id FROM outbox_inbox").fetchall() == [("a",)]  # "bad" can run again
    inbox.close()
    store.close()


def _store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, Callable[[str], list[Any]]]:
    """A store URL and a query function on a second connection to it (what another process sees)."""
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'c.db'}"

        def query(sql: str) -> list[Any]:
            with sqlite3.connect(tmp_path / "c.db") as c:
                return c.execute(sql).fetchall()

        return url, query
    import psycopg

    url = str(request.getfixturevalue("fresh_postgres_url"))

    def query_pg(sql: str) -> list[Any]:
        with psycopg.connect(**parse_url(url).psycopg_kwargs()) as c:  # type: ignore[arg-type]
            return [tuple(r) for r in c.execute(sql.replace("outbox_inbox", f'"{parse_url(url).table}_inbox"'))]

    return url, query_pg


def _effects_inbox(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> tuple[Outbox, Inbox, str, Callable[[str], list[Any]]]:
    """A store of `kind`, a transactional inbox of group "g" on it with an `effects (v)` table for
    handlers to write, the driver's parameter mark, and a query on another connection."""
    url, query = _store(kind, tmp_path, request)
    store = open_outbox(url)
    inbox = Inbox(store, "g", transactional=True)
    inbox.connection.execute("CREATE TABLE effects (v TEXT NOT NULL)")
    return store, inbox, "?" if kind == "sqlite" else "%s", query


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_batch_is_one_transaction_and_a_failed_message_rolls_back_alone(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    store, inbox, mark, query = _effects_inbox(kind, tmp_path, request)
    ran: list[str] = []

    def handler(m: Any, tx: Any) -> None:
        v = message_id(m) or "anonymous"
        ran.append(v)
        tx.execute(f"INSERT INTO effects VALUES ({mark})", (v,))
        if v == "bad":
            if ran.count("bad") == 1:
                assert query("SELECT msg_id FROM outbox_inbox") == []  # the batch is not committed yet
            raise LookupError("after its write")

    batch = [Msg("a"), Msg("b"), Msg("a"), Msg("bad"), Msg(None), Msg("c"), Msg("c")]
    inbox.begin(batch)  # type: ignore[arg-type]
    got: list[bool | None] = []
    for m in batch:
        try:
            got.append(inbox.handle(m, handler))  # type: ignore[arg-type]
        except LookupError:
            got.append(None)
            # What came before the failed message is committed when its failure is handled.
            assert sorted(query("SELECT msg_id FROM outbox_inbox")) == [("a",), ("b",)]
            assert sorted(query("SELECT v FROM effects")) == [("a",), ("b",)]
    inbox.commit()
    assert got == [True, True, False, None, True, True, False]
    assert ran == ["a", "b", "bad", "anonymous", "c"]
    counts = sorted(query("SELECT v, count(*) FROM effects GROUP BY v"))
    assert counts == [("a", 1), ("anonymous", 1), ("b", 1), ("c", 1)]
    assert sorted(query("SELECT msg_id FROM outbox_inbox")) == [("a",), ("b",), ("c",)]  # "bad" can run again
    assert inbox.duplicates == 2
    # The next batch: the failed message runs again (its retry), the others are skipped.
    again = [Msg("bad"), Msg("b")]
    inbox.begin(again)  # type: ignore[arg-type]
    with pytest.raises(LookupError):
        inbox.handle(again[0], handler)  # type: ignore[arg-type]
    assert not inbox.handle(again[1], handler)  # type: ignore[arg-type]
    inbox.commit()
    assert query("SELECT count(*) FROM effects WHERE v = 'bad'") == [(0,)]
    inbox.close()
    store.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_rewound_batch_leaves_nothing_and_a_message_not_reached_is_not_marked(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    store, inbox, mark, query = _effects_inbox(kind, tmp_path, request)

    def handler(m: Any, tx: Any) -> None:
        tx.execute(f"INSERT INTO effects VALUES ({mark})", (message_id(m),))

    batch = [Msg("a"), Msg("b")]
    inbox.begin(batch)  # type: ignore[arg-type]
    assert [inbox.handle(m, handler) for m in batch] == [True, True]  # type: ignore[arg-type]
    inbox.rewound()  # as after a failed commit: the consumer reads the batch again
    assert query("SELECT count(*) FROM effects") == [(0,)]
    inbox.begin(batch)  # type: ignore[arg-type]
    assert [inbox.handle(m, handler) for m in batch] == [True, True]  # type: ignore[arg-type]
    inbox.commit()
    assert sorted(query("SELECT v FROM effects")) == [("a",), ("b",)]
    # Messages of a batch the consumer did not reach (a held partition) are not marked: read again, they run.
    held = [Msg("c"), Msg("d"), Msg("e")]
    inbox.begin(held)  # type: ignore[arg-type]
    assert inbox.handle(held[0], handler)  # type: ignore[arg-type]
    inbox.commit()
    assert sorted(query("SELECT msg_id FROM outbox_inbox")) == [("a",), ("b",), ("c",)]
    assert run_batch(inbox, held, handler) == [False, True, True]
    assert sorted(query("SELECT v FROM effects")) == [("a",), ("b",), ("c",), ("d",), ("e",)]
    inbox.close()
    store.close()


def test_marks_older_than_the_window_are_pruned(tmp_path: Path) -> None:
    store = open_outbox(f"sqlite:///{tmp_path / 'c.db'}")
    inbox = Inbox(store, "g", window=60, transactional=False)
    db = sqlite3.connect(tmp_path / "c.db")
    with db:
        db.execute("INSERT INTO outbox_inbox VALUES ('g', 'old', ?), ('g', 'new', ?)", (time.time() - 61, time.time()))
    inbox.commit()  # the first commit prunes
    assert db.execute("SELECT msg_id FROM outbox_inbox").fetchall() == [("new",)]
    inbox.close()
    store.close()


def test_bad_window_and_unknown_transaction_kinds_are_refused(tmp_path: Path) -> None:
    store = open_outbox(f"sqlite:///{tmp_path / 'c.db'}")
    with pytest.raises(ConfigError, match="dedup_window must be a positive number of seconds"):
        Inbox(store, "g", window=0, transactional=False)
    store.close()
    with pytest.raises(ConfigError, match="got dict"):
        dbapi_connection({})


def test_a_rewound_partition_stores_no_offset_past_the_batch() -> None:
    from outbox.consumer.offsets import OffsetTracker

    t = OffsetTracker()
    tp = ("orders", 0)
    t.done(tp, 4)
    assert t.committable() == [(tp, 5)]  # stored after the previous batch
    t.done(tp, 9)  # this batch, handled; its inbox commit then fails
    t.rewind(tp, 5)
    assert t.committable() == [] and t.committable_of(tp) == 5
    t.rewind(tp, 7)  # never forward
    assert t.committable_of(tp) == 5
    t.done(tp, 9)  # read again and handled
    assert t.committable() == [(tp, 10)]
