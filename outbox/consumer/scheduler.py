"""Which partitions are held (paused at a message) and until when.

`PauseScheduler` is the bookkeeping (no Kafka calls); `Holds` pauses and resumes the consumer's
partitions by it. The consumer pauses a partition at a message that is not yet due (a tier's
head, or a message retried in place), and resumes it when the time comes. The state is rebuilt from the messages
themselves after a rebalance: a revoked partition is forgotten, and a newly assigned one is
read from its committed offset, whose head tells again whether to wait. Nothing here has to
survive a rebalance, which is how partitions that stay paused forever (spring-kafka #2525,
#2565) cannot happen.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaException, TopicPartition

log = logging.getLogger(__name__)

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


class Holds:
    """Pauses the consumer's partitions at a message until a time, and resumes them when it comes.

    Used by the poll-loop thread only.

    Args:
        consumer: the group's consumer.
        counts: the consumer's counters (its stats()), counted in place: paused.
    """

    def __init__(self, consumer: Consumer, counts: dict[str, int]) -> None:
        self._consumer = consumer
        self._counts = counts
        self._scheduler = PauseScheduler()

    def __len__(self) -> int:
        """How many partitions are held now."""
        return len(self._scheduler)

    def hold(self, tp: TP, offset: int, due: float) -> None:
        """Pause `tp` at `offset` until `due` (epoch seconds)."""
        part = TopicPartition(tp[0], tp[1], offset)
        # Pause first, then seek: librdkafka drops the prefetched messages on pause, and a seek made
        # before the pause can be lost (librdkafka #3471). The seek is repeated on resume (#2557).
        self._consumer.pause([part])
        self._consumer.seek(part)
        self._scheduler.hold(tp, offset, due)
        self._counts["paused"] += 1

    def resume_due(self, now: float) -> None:
        """Resume the partitions whose hold is due at `now`, each at its held message."""
        for tp, hold in self._scheduler.pop_due(now):
            part = TopicPartition(tp[0], tp[1], hold.offset)
            try:
                self._consumer.seek(part)
                self._consumer.resume([part])
            except KafkaException as exc:
                log.warning("could not resume %s [%d]: %s", tp[0], tp[1], exc.args[0])

    def next_due(self) -> float | None:
        """When the earliest hold is due (epoch seconds), or None."""
        return self._scheduler.next_due()

    def forget(self, tps: Iterable[TP]) -> None:
        """Drop the holds of partitions assigned anew, revoked or lost."""
        self._scheduler.forget(tps)
