"""The hold-back that keeps per-key order when the circuit opens (outbox/producer/keyorder.py): pure logic."""

from __future__ import annotations

from outbox.budget import MemoryBudget
from outbox.producer.keyorder import Holdback


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(limit: int = 10, on_full=None) -> tuple[Holdback[str], Clock]:  # type: ignore[no-untyped-def]
    """A hold-back alone in a budget of `limit` bytes; items cost 1 byte unless offered otherwise."""
    clock = Clock()
    return Holdback(lambda s: s, budget=MemoryBudget(limit), on_full=on_full, clock=clock), clock


def test_nothing_is_held_without_a_hold() -> None:
    h, _ = make()
    assert h.offer("a", 1) is False
    assert len(h) == 0
    assert h.release(source_empty=True) == []


def test_held_items_come_back_in_sequence_order_once_the_source_is_empty() -> None:
    h, _ = make()
    h.start(30)
    # A spill produced later (…0003) is offered before the purged older messages come back.
    for seq in ["p-0003", "p-0001", "p-0004", "p-0002"]:
        assert h.offer(seq, 1)
    assert h.release(source_empty=False) == []  # librdkafka still holds older messages
    assert h.active and len(h) == 4
    assert h.release(source_empty=True) == ["p-0001", "p-0002", "p-0003", "p-0004"]
    assert not h.active and len(h) == 0
    assert h.offer("p-0005", 1) is False  # the hold is over: straight to the writer


def test_a_hold_whose_time_runs_out_purges_then_waits_once_more_as_long_for_the_source() -> None:
    purges: list[int] = []
    h, clock = make(on_full=lambda: purges.append(1))
    h.start(31)
    h.offer("b", 1)
    h.offer("a", 1)
    clock.now += 30.9
    assert h.release(source_empty=False) == []
    assert purges == []
    clock.now += 0.2  # out of time, librdkafka still holds a message: purge it, do not store ahead of it
    assert h.release(source_empty=False) == []
    assert purges == [1] and h.active
    clock.now += 30.9
    assert h.release(source_empty=False) == []
    assert h.release(source_empty=True) == ["a", "b"]  # the purge's report came back


def test_a_hold_ends_when_its_time_runs_out_twice_even_if_the_source_is_not_empty() -> None:
    h, clock = make()
    h.start(31)
    h.offer("b", 1)
    h.offer("a", 1)
    clock.now += 31.1
    assert h.release(source_empty=False) == []
    clock.now += 31.1
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
    h.release(source_empty=True)
    h.start(1)
    assert h.holds == 2


def test_held_bytes_count_what_is_held_until_the_release() -> None:
    h, _ = make(limit=1000)
    h.start(30)
    h.offer("b", 300)
    h.offer("a", 200)
    assert h.held_bytes == 500
    assert h.release(source_empty=True) == ["a", "b"]
    assert h.held_bytes == 0


def test_a_full_budget_asks_once_for_a_purge_and_the_delivery_thread_never_waits() -> None:
    asked: list[int] = []
    h, _ = make(limit=100, on_full=lambda: asked.append(1))
    h.start(30)
    h.offer("c", 40)
    h.offer("b", 40)
    assert asked == []  # 80 of 100 bytes
    h.offer("a", 40)  # no room for it: purge what is in flight, which ends the hold soon
    h.offer("d", 40)  # the delivery thread may go past the budget; it never waits (offer returns)
    h.budget_full()  # an application thread found no room either
    assert asked == [1]
    assert h.held_bytes == 160
    assert h.release(source_empty=True) == ["a", "b", "c", "d"]
    h.start(30)
    h.budget_full()  # an application thread about to wait for room
    assert asked == [1, 1]  # once per hold


def test_a_release_records_the_most_held_as_the_budgets_peak() -> None:
    budget = MemoryBudget(10_000)
    h = Holdback(lambda s: s, budget=budget, clock=Clock())
    h.start(30)
    for s in "abc":
        h.offer(s, 700)
    assert h.release(source_empty=True) == ["a", "b", "c"]
    assert budget.held() == 0 and budget.peak == 2100
