"""Hold-back: outbox-bound messages wait in memory while librdkafka may still return older ones.

When the circuit opens, librdkafka still holds messages produced while it was closed. They come
back as failures (purged at once, or at `message.timeout.ms` if on the wire) and are stored
then. A message of the same key spilled in between would get an earlier row, and the drain
would send it first: per-key order lost. So from the moment the circuit opens, every message
bound for the outbox is held here, in memory, until librdkafka has handed back everything it
held (or until `message.timeout.ms` has passed, by which time it has reported every one of
them); then the held messages are stored sorted by their producer sequence (the `outbox-id`
counter), which is the order the application produced them in.

Memory stays bounded: past `limit` held messages the application's produce() waits (it is
spilling anyway) and the owner is asked to purge what is in flight, which ends the hold.
Pure logic (no Kafka, no store): unit-tested with a fake clock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Holdback(Generic[T]):
    """Items held while `active`, released in `seq` order.

    Args:
        seq: the sort key of an item (its producer sequence).
        limit: held items above which `wait_for_room()` blocks.
        on_full: called (once per hold) when `limit` is reached, e.g. to purge in-flight sends.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        seq: Callable[[T], str],
        *,
        limit: int,
        on_full: Callable[[], None] | None = None,
        clock: Callable[[], float],
    ) -> None:
        self._seq = seq
        self.limit = limit
        self._on_full = on_full
        self._clock = clock
        self._cond = threading.Condition()
        self._items: list[T] = []
        self._until = 0.0
        self._asked_purge = False
        self.active = False  # a plain attribute: produce()'s check is one attribute read
        self.holds = 0  # how many holds began (stats, tests)

    def start(self, longest: float) -> None:
        """Begin holding (or extend a hold) for at most `longest` seconds."""
        with self._cond:
            if not self.active:
                self.holds += 1
                self._asked_purge = False
            self._until = max(self._until, self._clock() + longest)
            self.active = True

    def offer(self, item: T) -> bool:
        """Hold `item` and return True, or return False when no hold is active."""
        with self._cond:
            if not self.active:
                return False
            self._items.append(item)
            if len(self._items) >= self.limit and not self._asked_purge and self._on_full is not None:
                self._asked_purge = True
                self._on_full()
            return True

    def wait_for_room(self) -> None:
        """Block while a hold has `limit` items (application threads only, never under a lock)."""
        if not self.active or len(self._items) < self.limit:
            return
        with self._cond:
            while self.active and len(self._items) >= self.limit:
                self._cond.wait(0.05)

    def release(self, *, source_empty: bool) -> list[T]:
        """End the hold if the source holds nothing older or the hold ran out; items in seq order.

        Returns [] while the hold goes on (or when none is active).
        """
        if not self.active:
            return []
        with self._cond:
            if not (source_empty or self._clock() >= self._until):
                return []
            items, self._items = self._items, []
            self.active = False
            self._cond.notify_all()
        items.sort(key=self._seq)
        return items

    def __len__(self) -> int:
        return len(self._items)
