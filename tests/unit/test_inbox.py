"""The inbox's logic on a real SQLite store, with stand-in messages (no broker needed here):
handler detection, batched marks, the transactional path's rollback, pruning by the window."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from outbox import ConfigError
from outbox.consumer.inbox import Inbox, message_id, takes_transaction
from outbox.stores import open_outbox
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


def test_batched_marks_skip_copies_across_batches_and_restarts(tmp_path: Path) -> None:
    store = open_outbox(f"sqlite:///{tmp_path / 'c.db'}")
    seen: list[str | None] = []
    inbox = Inbox(store, "g", transactional=False)
    batch = [Msg("a"), Msg("b"), Msg("a"), Msg(None), Msg(None)]
    inbox.begin(batch)  # type: ignore[arg-type]
    got = [inbox.handle(m, lambda m: seen.append(message_id(m))) for m in batch]  # type: ignore[arg-type]
    inbox.commit()
    inbox.close()
    assert got == [True, True, False, True, True] and seen == ["a", "b", None, None]
    again = Inbox(store, "g", transactional=False)  # as after a restart
    later = [Msg("b"), Msg("c")]
    again.begin(later)  # type: ignore[arg-type]
    assert [again.handle(m, lambda m: None) for m in later] == [False, True]  # type: ignore[arg-type]
    assert again.duplicates == 1
    other_group = Inbox(store, "h", transactional=False)
    other_group.begin(later)  # type: ignore[arg-type]
    assert [other_group.handle(m, lambda m: None) for m in later] == [True, True]  # type: ignore[arg-type]
    store.close()


def test_transactional_handler_writes_commit_with_the_mark_or_not_at_all(tmp_path: Path) -> None:
    store = open_outbox(f"sqlite:///{tmp_path / 'c.db'}")
    inbox = Inbox(store, "g", transactional=True)
    inbox.connection.execute("CREATE TABLE effects (v TEXT)")

    def handler(m: Any, tx: sqlite3.Connection) -> None:
        tx.execute("INSERT INTO effects VALUES (?)", (message_id(m),))
        if message_id(m) == "bad":
            raise LookupError("after its write")

    assert inbox.handle(Msg("a"), handler)  # type: ignore[arg-type]
    assert not inbox.handle(Msg("a"), handler)  # type: ignore[arg-type]
    with pytest.raises(LookupError):
        inbox.handle(Msg("bad"), handler)  # type: ignore[arg-type]
    assert inbox.handle(Msg(None), handler)  # type: ignore[arg-type]
    db = sqlite3.connect(tmp_path / "c.db")
    assert db.execute("SELECT v FROM effects ORDER BY rowid").fetchall() == [("a",), (None,)]
    assert db.execute("SELECT msg_id FROM outbox_inbox").fetchall() == [("a",)]  # "bad" can run again
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
