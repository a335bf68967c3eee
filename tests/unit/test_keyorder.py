"""KeyBacklog: which keys queue behind the outbox, and when they are released (a real SQLite store)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from outbox import NewMessage, SQLiteOutbox
from outbox.budget import MemoryBudget
from outbox.errors import StoreError
from outbox.producer.keyorder import KeyBacklog

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
    b.start()
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


# -- the gate: handing a busy key back to the fast path ------------------------------------


class Outcomes:
    """What a gate did with held messages: sent (key released) or stored (key kept)."""

    def __init__(self) -> None:
        self.sent: list[tuple[tuple[str, bytes], list[object]]] = []
        self.stored: list[tuple[tuple[str, bytes], list[object]]] = []

    def opts(self) -> dict[str, object]:
        return {"send": lambda k, held: self.sent.append((k, list(held))),
                "store_held": lambda k, held: self.stored.append((k, list(held)))}


def hold(b: KeyBacklog, key: tuple[str, bytes], message: object, cost: int = 1) -> bool:
    with b.lock:
        return b.hold(key, message, cost)


def test_a_gate_releases_a_key_once_its_rows_are_delivered_and_sends_what_it_held_in_order(
    store: SQLiteOutbox,
) -> None:
    [a] = store.enqueue([keyed(b"a")])
    out = Outcomes()
    with backlog(store, **out.opts()) as b:
        key = ("t", b"a")
        assert not hold(b, key, "before the gate")  # not gated: the producer stores it
        released: list[int] = []
        gate = threading.Thread(target=lambda: released.append(b.hand_back({key})))
        gate.start()
        wait_until(lambda: key in b.gated, 10, "the gate to begin", every=0.01)
        assert hold(b, key, "m1", 100) and hold(b, key, "m2", 100)
        assert b.held == 2 and b.held_bytes == 200
        store.mark_delivered([a])
        b.drained([key])
        gate.join(10)
        assert released == [1]
        assert out.sent == [(key, ["m1", "m2"])] and out.stored == []
        assert b.pending == set() and b.gated == {} and b.held == 0 and b.held_bytes == 0


def test_a_gate_that_runs_out_of_time_stores_what_it_held_behind_the_rows(store: SQLiteOutbox) -> None:
    store.enqueue([keyed(b"a")])
    out = Outcomes()
    b: KeyBacklog
    key = ("t", b"a")
    ticks = iter([0.0, 0.0, 100.0])  # the deadline, one look at the store, then past the deadline

    def held_during_the_gate() -> int:
        assert hold(b, key, "m1")
        return 0

    with backlog(store, flush=held_during_the_gate, **out.opts()) as b:
        assert b.hand_back({key}, clock=lambda: next(ticks)) == 0
        assert out.stored == [(key, ["m1"])] and out.sent == []
        assert b.pending == {key} and b.gated == {} and b.held == 0


def test_a_key_stored_again_during_its_gate_is_not_released(store: SQLiteOutbox) -> None:
    """A failed first send of the key is stored while the gate waits: its row is behind the
    gate's look at the store, so the key stays pending and the held messages go behind it."""
    out = Outcomes()
    b: KeyBacklog
    key = ("t", b"a")

    def stored_during_the_gate() -> int:
        with b.lock:
            b.mark(key)  # the delivery thread stored a failed first send of the key
        assert hold(b, key, "m1")
        return 0

    with backlog(store, flush=stored_during_the_gate, **out.opts()) as b:
        with b.lock:
            b.mark(key)
        assert b.hand_back({key}) == 0
        assert out.stored == [(key, ["m1"])] and out.sent == []
        assert b.pending == {key}


def test_with_the_memory_budget_full_a_produce_ends_its_keys_gate(store: SQLiteOutbox) -> None:
    budget = MemoryBudget(1000)
    out = Outcomes()
    key = ("t", b"a")
    with backlog(store, budget=budget, **out.opts()) as b:
        with b.lock:
            b.mark(key)
            b.gated[key] = []
        assert hold(b, key, "m1", 400) and hold(b, key, "m2", 400)
        assert b.held_bytes == 800 and budget.held() == 800
        assert not hold(b, key, "m3", 400)  # the producer queues it for the outbox, behind m1 and m2
        assert out.stored == [(key, ["m1", "m2"])]
        assert b.gated == {} and b.held == 0 and b.held_bytes == 0 and b.pending == {key}
        assert budget.peak == 800


def test_store_gated_hands_every_gates_messages_to_the_outbox(store: SQLiteOutbox) -> None:
    """The producer's way out when the budget is full: gates never make produce() wait."""
    out = Outcomes()
    a, c = ("t", b"a"), ("t", b"c")
    with backlog(store, budget=MemoryBudget(10_000), **out.opts()) as b:
        with b.lock:
            for k in (a, c):
                b.mark(k)
                b.gated[k] = []
        assert hold(b, a, "a1", 100) and hold(b, c, "c1", 100) and hold(b, a, "a2", 100)
        b.store_gated()
        assert sorted(out.stored) == [(a, ["a1", "a2"]), (c, ["c1"])]
        assert b.gated == {} and b.held_bytes == 0 and b.pending == {a, c}


def test_a_key_whose_held_message_the_send_stored_stays_pending(store: SQLiteOutbox) -> None:
    """librdkafka refused a held message (queue full): the send stored it, marking the key."""
    b: KeyBacklog
    key = ("t", b"a")

    def send_stores(k: tuple[str, bytes], held: list[object]) -> None:
        b.mark(k)

    with backlog(store, send=send_stores, store_held=lambda k, held: None) as b:
        with b.lock:
            b.mark(key)
        b._flush = lambda: hold(b, key, "m1")  # type: ignore[method-assign]
        assert b.hand_back({key}) == 0
        assert b.pending == {key}


def test_without_a_send_nothing_is_gated(store: SQLiteOutbox) -> None:
    """Write-ahead mode: every message is stored, keys are released only when found without rows."""
    key = ("t", b"a")
    with backlog(store) as b:
        with b.lock:
            b.mark(key)
        assert b.hand_back({key}) == 0
        assert b.gated == {} and not hold(b, key, "m1")
