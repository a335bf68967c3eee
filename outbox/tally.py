"""A counter that any thread may bump without a lock."""

from __future__ import annotations

import itertools
from collections.abc import Iterator


class Tally:
    """Counts events from many threads: `add()` is `next()` on an itertools.count, one C call and
    so atomic under the interpreter lock (``self.n += 1`` is a read and a write that two threads
    can interleave, losing a count).
    """

    __slots__ = ("_start", "_count", "add")

    def __init__(self, start: int = 0) -> None:
        self._start = start
        self._count = itertools.count(start)
        #: Count one event; returns the count before it (`start` plus the events before it).
        self.add = self._count.__next__

    def __iter__(self) -> Iterator[int]:
        """The counts as an iterator whose `next()` is `add()`: for a C pipeline (`map`) that counts."""
        return self._count

    @property
    def value(self) -> int:
        """How many events were counted (reading does not count one)."""
        # repr is "count(N)" with N the next value to hand out.
        return int(repr(self._count)[6:-1]) - self._start
