"""Hold-back: outbox-bound messages wait in memory while librdkafka may still return older ones.

When the circuit opens, librdkafka still holds messages produced while it was closed. They come
back as failures (purged at once, or at `message.timeout.ms` if on the wire) and are stored
then. A message of the same key spilled in between would get an earlier row, and the drain
would send it first: per-key order lost. So from the moment the circuit opens, every message
bound for the outbox is held here, in memory, until librdkafka has handed back everything it
held (or until `message.timeout.ms` has passed, by which time it has reported every one of
them); then the held messages are stored sorted by their producer sequence (the `outbox-id`
counter), which is the order the application produced them in.

The time is a bound, not a proof: librdkafka reports a timed-out message up to a second after
its timeout (it scans for them once a second) and one on the wire after its request's own
timeout. So a hold whose time ran out while librdkafka still holds messages is not released
then: the owner is asked to purge what is in flight (a purge reports at once), and the hold
waits once more as long, then ends whatever is left.

Memory stays bounded: the held messages count against the producer's memory budget
(`outbox.budget`, bytes). Once it is full the owner is asked to purge what is in flight, which
ends the hold at librdkafka's next poll, and the application's produce() waits for room (it is
spilling anyway) until the released messages are committed.
Pure logic (no Kafka, no store): unit-tested with a fake clock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from outbox.budget import MemoryBudget

T = TypeVar("T")


class Holdback(Generic[T]):
    """Items held while `active`, released in `seq` order.

    Args:
        seq: the sort key of an item (its producer sequence).
        budget: the memory budget the held items count against (this is one of its parts).
        on_full: called (once per hold) when the budget is full, e.g. to purge in-flight sends.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        seq: Callable[[T], str],
        *,
        budget: MemoryBudget,
        on_full: Callable[[], None] | None = None,
        clock: Callable[[], float],
    ) -> None:
        self._seq = seq
        self._budget = budget
        self._on_full = on_full
        self._clock = clock
        self._lock = threading.Lock()
        self._items: list[T] = []
        self.held_bytes = 0  # what the held items cost (under the lock; outbox.budget)
        self._until = 0.0
        self._longest = 0.0
        self._asked_purge = False
        self._overdue = False  # the hold's time ran out once with the source not empty
        self.active = False  # a plain attribute: produce()'s check is one attribute read
        self._grace_until = 0.0
        self.holds = 0  # how many holds began (stats, tests)
        budget.add_part(self)

    def start(self, longest: float, *, grace: float = 0.0) -> None:
        """Begin holding (or extend a hold) for at most `longest` seconds, the first `grace`
        of them whatever the source says (`in_grace`)."""
        with self._lock:
            if not self.active:
                self.holds += 1
                self._asked_purge = False
                self._overdue = False
            self._longest = longest
            now = self._clock()
            self._until = max(self._until, now + longest)
            self._grace_until = max(self._grace_until, now + grace)
            self.active = True

    def in_grace(self) -> bool:
        """Within the first `grace` seconds of the hold: it lasts, and nothing bypasses it."""
        return self.active and self._clock() < self._grace_until

    def offer(self, item: T, cost: int) -> bool:
        """Hold `item` (costing `cost` bytes) and return True, or return False when no hold is active.

        Never waits (the delivery thread offers what librdkafka hands back).
        """
        with self._lock:
            if not self.active:
                return False
            if self._budget.full(cost):
                self._budget_full()
            self._items.append(item)
            self.held_bytes += cost
            return True

    def budget_full(self) -> None:
        """The memory budget has no room: end the hold sooner (an application thread about to wait)."""
        if self.active:
            with self._lock:
                self._budget_full()

    def _budget_full(self) -> None:
        """Under the lock: ask the owner, once per hold, to purge what is in flight."""
        if self.active and not self._asked_purge and self._on_full is not None:
            self._asked_purge = True
            self._on_full()

    def release(self, *, source_empty: bool) -> list[T]:
        """End the hold if the source holds nothing older or the hold ran out; items in seq order.

        The first time the hold runs out with the source not empty, it asks for a purge and
        runs once more as long (module doc). Returns [] while the hold goes on (or when none
        is active).
        """
        if not self.active:
            return []
        with self._lock:
            if not source_empty:
                now = self._clock()
                if now < self._until:
                    return []
                if not self._overdue:
                    self._overdue = True
                    self._until = now + self._longest
                    if self._on_full is not None:
                        self._on_full()
                    return []
            self._budget.sample()  # the most held is reached just before a decrease
            items, self._items = self._items, []
            self.held_bytes = 0  # the caller hands them to the writer, which counts them again
            self.active = False
        items.sort(key=self._seq)
        return items

    def __len__(self) -> int:
        return len(self._items)
