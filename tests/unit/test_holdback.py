"""The hold-back that keeps per-key order when the circuit opens (outbox/holdback.py): pure logic."""

from __future__ import annotations

import threading

from outbox.holdback import Holdback


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(limit: int = 10, on_full=None) -> tuple[Holdback[str], Clock]:  # type: ignore[no-untyped-def]
    clock = Clock()
    return Holdback(lambda s: s, limit=limit, on_full=on_full, clock=clock), clock


def test_nothing_is_held_without_a_hold() -> None:
    h, _ = make()
    assert h.offer("a") is False
    assert len(h) == 0
    assert h.release(source_empty=True) == []


def test_held_items_come_back_in_sequence_order_once_the_source_is_empty() -> None:
    h, _ = make()
    h.start(30)
    # A spill produced later (…0003) is offered before the purged older messages come back.
    for seq in ["p-0003", "p-0001", "p-0004", "p-0002"]:
        assert h.offer(seq)
    assert h.release(source_empty=False) == []  # librdkafka still holds older messages
    assert h.active and len(h) == 4
    assert h.release(source_empty=True) == ["p-0001", "p-0002", "p-0003", "p-0004"]
    assert not h.active and len(h) == 0
    assert h.offer("p-0005") is False  # the hold is over: straight to the writer


def test_a_hold_ends_when_its_time_runs_out_even_if_the_source_is_not_empty() -> None:
    h, clock = make()
    h.start(31)
    h.offer("b")
    h.offer("a")
    clock.now += 30.9
    assert h.release(source_empty=False) == []
    clock.now += 0.2
    assert h.release(source_empty=False) == ["a", "b"]


def test_starting_again_extends_the_hold_and_counts_one_hold() -> None:
    h, clock = make()
    h.start(10)
    clock.now += 8
    h.start(10)
    clock.now += 5
    assert h.release(source_empty=False) == []
    assert h.holds == 1
    clock.now += 6
    h.release(source_empty=False)
    h.start(1)
    assert h.holds == 2


def test_a_full_hold_asks_once_for_a_purge_and_blocks_waiters_until_released() -> None:
    asked: list[int] = []
    h, _ = make(limit=3, on_full=lambda: asked.append(1))
    h.start(30)
    for s in "cba":
        h.offer(s)
    h.offer("d")  # the delivery thread may go past the limit; it never waits
    assert asked == [1]
    waited = threading.Event()

    def app() -> None:
        h.wait_for_room()
        waited.set()

    t = threading.Thread(target=app)
    t.start()
    assert not waited.wait(0.2), "produce() must wait while the hold is full"
    assert h.release(source_empty=True) == ["a", "b", "c", "d"]
    t.join(5)
    assert waited.is_set()


def test_wait_for_room_returns_at_once_below_the_limit() -> None:
    h, _ = make(limit=3)
    h.start(30)
    h.offer("a")
    t = threading.Thread(target=h.wait_for_room)
    t.start()
    t.join(10)
    assert not t.is_alive(), "wait_for_room() blocked below the limit"
