"""KeyBacklog: which keys queue behind the outbox, and when they are released (a real SQLite store).

The backlog's collaborators are real (hold-back, send fence, memory budget) except the writer,
which records what it is given."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from outbox import NewMessage, SQLiteOutbox
from outbox.budget import MemoryBudget
from outbox.errors import StoreError
from outbox.producer.keyorder import Held, Holdback, KeyBacklog
from outbox.producer.sendfence import SendFence

from ..waiting import wait_until

_ids = itertools.count()


def keyed(key: bytes, topic: str = "t", value: bytes = b"v") -> NewMessage:
    # Ids sort in produce order, as the producer's do.
    return NewMessage(topic=topic, value=value, key=key, msg_id=f"{next(_ids):012d}")


class Writer:
    """The writer's part the backlog uses: it records what it is given; `on_flush` runs at each flush."""

    def __init__(self) -> None:
        self.added: list[NewMessage] = []
        self.on_flush: Callable[[], object] = lambda: None

    def add_new(self, msg: NewMessage, meta: object = None, *, cost: int = 0) -> None:
        self.added.append(msg)

    def flush(self) -> int:
        self.on_flush()
        return 0

    def values(self) -> list[bytes | None]:
        return [m.value for m in self.added]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteOutbox]:
    s = SQLiteOutbox(str(tmp_path / "o.db"))
    yield s
    s.close()


@contextmanager
def backlog(
    store: SQLiteOutbox,
    writer: Writer | None = None,
    *,
    holding: bool = False,
    may_check: bool = False,
    send: Callable[[tuple[str, bytes], Held], None] | None = None,
    budget: MemoryBudget | None = None,
) -> Iterator[KeyBacklog]:
    parts_budget = budget or MemoryBudget(1 << 30)
    hold: Holdback[NewMessage] = Holdback(lambda m: m.msg_id, budget=parts_budget, clock=time.monotonic)
    fence = SendFence(tracking=False, budget=parts_budget, on_full=lambda: None, clock=time.monotonic, longest=30.0)
    if holding:  # the circuit has just opened: what is bound for the outbox is held in memory
        hold.start(3600.0)
    b = KeyBacklog(
        store, writer or Writer(), hold, fence, waiting={}, may_check=lambda: may_check, budget=budget
    )
    b.start(send)
    try:
        yield b
    finally:
        b.close()


def mark_then_check(b: KeyBacklog, key: tuple[str, bytes]) -> None:
    """A message of `key` bound for the outbox, then a check while the store has no row of it."""
    b.queue(keyed(key[1], key[0]), None)
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
    writer = Writer()
    # produce() on another thread queues a message of the key; its row is not committed yet
    writer.on_flush = lambda: b.queue(keyed(b"a"), None)

    with backlog(store, writer) as b:
        mark_then_check(b, ("t", b"a"))
        assert b.pending == {("t", b"a")}


def test_releases_nothing_while_messages_are_held(store: SQLiteOutbox) -> None:
    with backlog(store, holding=True) as b:
        mark_then_check(b, ("t", b"a"))
        assert b.pending == {("t", b"a")}


def test_its_thread_releases_delivered_keys_when_woken(store: SQLiteOutbox) -> None:
    [a] = store.enqueue([keyed(b"a")])
    with backlog(store, may_check=True) as b:
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


class Sent:
    """What gates sent: each released key with the values of its held messages, in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[tuple[str, bytes], list[bytes | None]]] = []

    def __call__(self, key: tuple[str, bytes], held: Held) -> None:
        self.sent.append((key, [msg.value for msg, _ in held]))


def produce_behind(b: KeyBacklog, key: tuple[str, bytes], value: bytes, cost: int = 1) -> bool:
    """produce() of a message admitted as waiting behind its key; True: it was (held or queued)."""
    return b.queue_behind_key(keyed(key[1], key[0], value), None, cost)


def test_a_gate_releases_a_key_once_its_rows_are_delivered_and_sends_what_it_held_in_order(
    store: SQLiteOutbox,
) -> None:
    [a] = store.enqueue([keyed(b"a")])
    out, writer = Sent(), Writer()
    with backlog(store, writer, send=out) as b:
        key = ("t", b"a")
        assert produce_behind(b, key, b"before the gate")  # not gated: queued for the outbox
        assert writer.values() == [b"before the gate"] and b.held == 0
        writer.added.clear()
        released: list[int] = []
        gate = threading.Thread(target=lambda: released.append(b.hand_back({key})))
        gate.start()
        wait_until(lambda: key in b.gated, 10, "the gate to begin", every=0.01)
        assert produce_behind(b, key, b"m1", 100) and produce_behind(b, key, b"m2", 100)
        assert b.held == 2 and b.held_bytes == 200
        store.mark_delivered([a])
        b.drained([key])
        gate.join(10)
        assert released == [1]
        assert out.sent == [(key, [b"m1", b"m2"])] and writer.added == []
        assert b.pending == set() and b.gated == {} and b.held == 0 and b.held_bytes == 0
        assert not produce_behind(b, key, b"after")  # released: the producer asks its route again


def test_a_gate_that_runs_out_of_time_stores_what_it_held_behind_the_rows(store: SQLiteOutbox) -> None:
    store.enqueue([keyed(b"a")])
    out, writer = Sent(), Writer()
    b: KeyBacklog
    key = ("t", b"a")
    ticks = iter([0.0, 0.0, 100.0])  # the deadline, one look at the store, then past the deadline

    def held_during_the_gate() -> None:
        assert produce_behind(b, key, b"m1") and b.held == 1

    writer.on_flush = held_during_the_gate
    with backlog(store, writer, send=out) as b:
        assert b.hand_back({key}, clock=lambda: next(ticks)) == 0
        assert writer.values() == [b"m1"] and out.sent == []
        assert b.pending == {key} and b.gated == {} and b.held == 0


def test_a_key_stored_again_during_its_gate_is_not_released(store: SQLiteOutbox) -> None:
    """A failed first send of the key is stored while the gate waits: its row is behind the
    gate's look at the store, so the key stays pending and the held messages go behind it."""
    out, writer = Sent(), Writer()
    b: KeyBacklog
    key = ("t", b"a")

    def stored_during_the_gate() -> None:
        b.queue(keyed(b"a", value=b"failed first send"), None)  # the delivery thread stored it
        assert produce_behind(b, key, b"m1") and b.held == 1

    with backlog(store, writer, send=out) as b:
        b.queue(keyed(b"a", value=b"stored"), None)
        writer.on_flush = stored_during_the_gate
        assert b.hand_back({key}) == 0
        assert writer.values() == [b"stored", b"failed first send", b"m1"] and out.sent == []
        assert b.pending == {key}


def test_with_the_memory_budget_full_a_produce_ends_its_keys_gate(store: SQLiteOutbox) -> None:
    budget = MemoryBudget(1000)
    out, writer = Sent(), Writer()
    key = ("t", b"a")
    with backlog(store, writer, budget=budget, send=out) as b:
        b.add(key)
        b.gated[key] = []  # its gate has begun
        assert produce_behind(b, key, b"m1", 400) and produce_behind(b, key, b"m2", 400)
        assert b.held_bytes == 800 and budget.held() == 800 and writer.added == []
        assert produce_behind(b, key, b"m3", 400)  # no room: the gate ends, m3 queued behind m1 and m2
        assert writer.values() == [b"m1", b"m2", b"m3"] and out.sent == []
        assert b.gated == {} and b.held == 0 and b.held_bytes == 0 and b.pending == {key}
        assert budget.peak == 800


def test_store_gated_hands_every_gates_messages_to_the_outbox(store: SQLiteOutbox) -> None:
    """The producer's way out when the budget is full: gates never make produce() wait."""
    out, writer = Sent(), Writer()
    a, c = ("t", b"a"), ("t", b"c")
    with backlog(store, writer, budget=MemoryBudget(10_000), send=out) as b:
        for k in (a, c):
            b.add(k)
            b.gated[k] = []  # its gate has begun
        assert produce_behind(b, a, b"a1", 100) and produce_behind(b, c, b"c1", 100)
        assert produce_behind(b, a, b"a2", 100) and writer.added == []
        b.store_gated()
        assert sorted((m.key, m.value) for m in writer.added) == [(b"a", b"a1"), (b"a", b"a2"), (b"c", b"c1")]
        assert [m.value for m in writer.added if m.key == b"a"] == [b"a1", b"a2"]
        assert out.sent == [] and b.gated == {} and b.held_bytes == 0 and b.pending == {a, c}


def test_a_key_whose_held_message_the_send_stored_stays_pending(store: SQLiteOutbox) -> None:
    """librdkafka refused a held message (queue full): the send stored it, marking the key."""
    b: KeyBacklog
    key = ("t", b"a")
    writer = Writer()

    def send_stores(k: tuple[str, bytes], held: Held) -> None:
        b.queue_held(held)  # what the producer's first sends do with a message librdkafka refused

    with backlog(store, writer, send=send_stores) as b:
        b.queue(keyed(b"a", value=b"stored"), None)
        writer.on_flush = lambda: produce_behind(b, key, b"m1")
        assert b.hand_back({key}) == 0
        assert writer.values() == [b"stored", b"m1"]
        assert b.pending == {key}


def test_without_a_send_nothing_is_gated(store: SQLiteOutbox) -> None:
    """Write-ahead mode: every message is stored, keys are released only when found without rows."""
    key = ("t", b"a")
    writer = Writer()
    with backlog(store, writer) as b:
        b.queue(keyed(b"a", value=b"stored"), None)
        assert b.hand_back({key}) == 0
        assert b.gated == {} and produce_behind(b, key, b"m1") and b.held == 0
        assert writer.values() == [b"stored", b"m1"]
