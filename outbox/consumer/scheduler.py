"""Which partitions are held (paused at a message) and until when: pure bookkeeping, no Kafka calls.

The consumer pauses a partition at a message that is not yet due (a tier's head, or a message
retried in place), and resumes it when the time comes. The state is rebuilt from the messages
themselves after a rebalance: a revoked partition is forgotten, and a newly assigned one is
read from its committed offset, whose head tells again whether to wait. Nothing here has to
survive a rebalance, which is how partitions that stay paused forever (spring-kafka #2525,
#2565) cannot happen.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

TP = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Hold:
    """A paused partition: where to read again, and when (epoch seconds)."""

    offset: int
    due: float


class PauseScheduler:
    """Held partitions ordered by due time."""

    def __init__(self) -> None:
        self._holds: dict[TP, Hold] = {}
        self._heap: list[tuple[float, TP]] = []

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, tp: object) -> bool:
        return tp in self._holds

    def hold(self, tp: TP, offset: int, due: float) -> None:
        """Hold `tp` at `offset` until `due` (replaces an earlier hold of it)."""
        self._holds[tp] = Hold(offset, due)
        heapq.heappush(self._heap, (due, tp))

    def pop_due(self, now: float) -> list[tuple[TP, Hold]]:
        """Remove and return the holds due at `now`."""
        out: list[tuple[TP, Hold]] = []
        while self._heap and self._heap[0][0] <= now:
            due, tp = heapq.heappop(self._heap)
            h = self._holds.get(tp)
            if h is not None and h.due == due:  # else a stale heap entry of a replaced/forgotten hold
                del self._holds[tp]
                out.append((tp, h))
        return out

    def next_due(self) -> float | None:
        """Earliest due time of a hold, or None."""
        while self._heap:
            due, tp = self._heap[0]
            h = self._holds.get(tp)
            if h is not None and h.due == due:
                return due
            heapq.heappop(self._heap)
        return None

    def forget(self, tps: Iterable[TP]) -> list[TP]:
        """Drop the holds of `tps` (revoked); return those that were held."""
        dropped = [tp for tp in tps if self._holds.pop(tp, None) is not None]
        return dropped

    def held(self) -> dict[TP, Hold]:
        """A copy of every hold."""
        return dict(self._holds)
