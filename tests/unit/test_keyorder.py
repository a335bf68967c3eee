"""KeyBacklog: which keys queue behind the outbox, and when they are released (a real SQLite store)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from outbox import NewMessage, SQLiteOutbox
from outbox.errors import StoreError
from outbox.keyorder import KeyBacklog

from ..waiting import wait_until


def keyed(key: bytes, topic: str = "t") -> NewMessage:
    return NewMessage(topic=topic, value=b"v", key=key)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteOutbox]:
    s = SQLiteOutbox(str(tmp_path / "o.db"))
    yield s
    s.close()


@contextmanager
def backlog(store: SQLiteOutbox, **kw: object) -> Iterator[KeyBacklog]:
    opts: dict[str, object] = {"flush": lambda: 0, "holding": lambda: False, "may_check": lambda: False}
    opts.update(kw)
    b = KeyBacklog(store, **opts)  # type: ignore[arg-type]
    try:
        yield b
    finally:
        b.close()


def mark_then_check(b: KeyBacklog, key: tuple[str, bytes]) -> None:
    """A message of `key` bound for the outbox, then a check while the store has no row of it."""
    with b.lock:
        b.mark(key)
    b.release_delivered({key})


def test_starts_with_every_key_an_earlier_process_left(store: SQLiteOutbox) -> None:
    store.enqueue([keyed(b"a"), keyed(b"a"), keyed(b"b", topic="u"), NewMessage(topic="t", value=b"v")])
    with backlog(store) as b:
        assert b.pending == {("t", b"a"), ("u", b"b")}


def test_releases_a_key_once_its_rows_are_gone(store: SQLiteOutbox) -> None:
    [a, _] = store.enqueue([keyed(b"a"), keyed(b"b")])
    with backlog(store) as b:
        b.release_delivered({("t", b"a"), ("t", b"b")})
        assert b.pending == {("t", b"a"), ("t", b"b")}
        store.mark_delivered([a])
        b.release_delivered({("t", b"a"), ("t", b"b")})
        assert b.pending == {("t", b"b")}


def test_keeps_a_key_marked_while_the_check_looked(store: SQLiteOutbox) -> None:
    """A message of the key was bound for the outbox after the check read the mark but before
    its row reached the store: the store says "no rows", the key must stay."""
    b: KeyBacklog

    def flush_while_a_message_is_marked() -> int:
        with b.lock:
            b.mark(("t", b"a"))  # produce() on another thread; its row is not committed yet
        return 0

    with backlog(store, flush=flush_while_a_message_is_marked) as b:
        mark_then_check(b, ("t", b"a"))
        assert b.pending == {("t", b"a")}


def test_releases_nothing_while_messages_are_held(store: SQLiteOutbox) -> None:
    with backlog(store, holding=lambda: True) as b:
        mark_then_check(b, ("t", b"a"))
        assert b.pending == {("t", b"a")}


def test_its_thread_releases_delivered_keys_when_woken(store: SQLiteOutbox) -> None:
    [a] = store.enqueue([keyed(b"a")])
    with backlog(store, may_check=lambda: True) as b:
        assert b.pending == {("t", b"a")}
        store.mark_delivered([a])
        b.drained([("t", b"a")])
        wait_until(lambda: not b.pending, 10, "the key to be released", every=0.05)
        assert b.pending == set()


class FailingOnce(SQLiteOutbox):
    fail = True

    def pending_keys(self) -> set[tuple[str, bytes]]:
        if self.fail:
            self.fail = False
            raise StoreError("store unreachable (test)")
        return super().pending_keys()


def test_a_store_that_cannot_answer_at_start_is_asked_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = FailingOnce(str(tmp_path / "o.db"))
    store.enqueue([keyed(b"a")])
    try:
        with caplog.at_level(logging.WARNING, logger="outbox"), backlog(store) as b:
            assert b.pending == set()
            assert "cannot read which keys have messages in the outbox" in caplog.text
            wait_until(lambda: bool(b.pending), 10, "the key thread to ask the store again", every=0.05)
            assert b.pending == {("t", b"a")}
    finally:
        store.close()
