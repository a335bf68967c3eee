"""A counter that any thread may bump without a lock."""

from __future__ import annotations

import itertools


class Tally:
    """Counts events from many threads: `add()` is `next()` on an itertools.count, one C call and
    so atomic under the interpreter lock (``self.n += 1`` is a read and a write that two threads
    can interleave, losing a count).
    """

    __slots__ = ("_count", "add")

    def __init__(self) -> None:
        self._count = itertools.count()
        #: Count one event; returns the count before it.
        self.add = self._count.__next__

    @property
    def value(self) -> int:
        """How many events were counted (reading does not count one)."""
        # repr is "count(N)" with N the next value to hand out.
        return int(repr(self._count)[6:-1])
