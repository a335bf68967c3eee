"""The memory budget: one limit, in bytes, on the messages a producer holds in memory.

Three parts of a `ResilientProducer` hold messages bound for the outbox: the hold-back (the
circuit has just opened), the key gate (a busy key being handed back) and the group-commit
writer's queue (accepted, not yet committed). A bound on each part's *count* of messages grows
with the message size (50,000 x 4 KiB is 200 MB in one part alone), so they share one bound in
bytes instead. Each part keeps its own `held_bytes` under its own lock (an integer add where it
appends a message); the budget sums them where a decision needs the total.

A message's cost is its value, key and headers plus what Python spends around them
(`outbox.message.message_cost`), counted from the moment a part takes it until its
commit has ended (or the gate handed it to librdkafka).

librdkafka's own queue is bounded separately (`queue.buffering.*`, set from the budget in
`outbox.producer.link.queue_limits`). What it hands back when sends fail is stored by the delivery
thread, which never waits; application threads therefore wait at `admit`, below `limit`, and
leave the difference (`reserve`) for those messages.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Protocol

#: The default budget: 16 MiB. A spill with the brokers down peaked about a sixth higher in memory
#: with 32 MiB and over a quarter higher with 64 MiB, and ran no slower with less (the commits,
#: not the queue, set its rate).
DEFAULT_MEMORY_BUDGET = 16 * 1024 * 1024
class HoldsBytes(Protocol):
    """A part that holds messages: `held_bytes` is the cost of what it holds now."""

    @property
    def held_bytes(self) -> int: ...


class MemoryBudget:
    """The bytes a producer's parts may hold, and the most they held.

    Args:
        limit: the budget in bytes (>= 1).
        reserve: bytes kept for messages librdkafka hands back (stored without waiting);
            application threads wait once `limit - reserve` is reached. At most half the
            budget: a librdkafka queue set larger than that can hand back more than fits.
    """

    def __init__(self, limit: int, *, reserve: int = 0) -> None:
        self.limit = limit
        self.admit = max(1, limit - min(reserve, limit // 2))
        self.peak = 0  # the most held, sampled before every decrease (see `sample`)
        self._parts: tuple[HoldsBytes, ...] = ()
        self._lock = threading.Lock()

    def add_part(self, part: HoldsBytes) -> None:
        self._parts += (part,)

    def held(self) -> int:
        """Bytes held by every part now (each part's count is exact; the sum is a snapshot)."""
        total = 0
        for part in self._parts:
            total += part.held_bytes
        return total

    def full(self, cost: int = 0) -> bool:
        """Whether an application thread must wait before adding `cost` more bytes.

        A message larger than the whole budget still passes once nothing else is held.
        """
        held = self.held()
        return held > 0 and held + cost > self.admit

    def sample(self) -> None:
        """Record the total as a candidate peak: a part calls it just before it holds less.

        The total only grows between two decreases, so its highest value is the one just
        before a decrease (or now): sampling there costs nothing per message.
        """
        held = self.held()
        if held > self.peak:
            with self._lock:
                self.peak = max(self.peak, held)

    def peak_now(self) -> int:
        """The most held so far, including now."""
        self.sample()
        return self.peak


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


_TRIM = _malloc_trim()


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the operating system: glibc's `malloc_trim(0)`, which
    walks every arena (librdkafka's threads allocate in their own), outside the interpreter lock.

    After an outage's recovery, what its traffic freed otherwise stays with the process: a soak
    (a producer and a consumer in one process through two outages) ended 55 MB over its size
    before the first outage, and 38.5 MB over it with the drain's trim after each recovery.
    Elsewhere than glibc, nothing.
    """
    if _TRIM is not None:
        _TRIM(0)
