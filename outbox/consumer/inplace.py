"""RetryInPlace's attempt count, kept in the metadata of the partition's committed offset.

A message retried in place is the partition's next uncommitted message, so the group's committed
offset for that partition is where its retry state belongs: it survives a crash, a restart and a
rebalance, and a new owner reads it with the offset it resumes from. It is committed synchronously
after each failed attempt; a crash between an attempt and that commit leaves that one attempt
uncounted (the only way the bound can be exceeded: by one attempt per such crash).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import tenacity
from confluent_kafka import Consumer, KafkaException, TopicPartition

from outbox.consumer.offsets import TP, OffsetTracker
from outbox.consumer.strategies import RetryInPlace

log = logging.getLogger(__name__)

PREFIX = "outbox-in-place"


@dataclass(frozen=True, slots=True)
class InPlace:
    """A message retried in place: its offset, failed attempts so far, and when it first failed."""

    offset: int
    attempts: int
    first_failed_at: float  # epoch seconds

    def encode(self) -> str:
        """The commit metadata: ``outbox-in-place <offset> <attempts> <first failure, epoch ms>``."""
        return f"{PREFIX} {self.offset} {self.attempts} {int(self.first_failed_at * 1000)}"


def decode(metadata: str | None) -> InPlace | None:
    """The state in a committed offset's metadata, or None (none there, or not ours)."""
    if not metadata or not metadata.startswith(PREFIX + " "):
        return None
    try:
        offset, attempts, first_ms = (int(x) for x in metadata[len(PREFIX) + 1 :].split())
    except ValueError:
        return None
    return InPlace(offset, attempts, first_ms / 1000.0)


class InPlaceRetries:
    """RetryInPlace: the message each partition retries in place, its attempts, and their commit.

    Used by the poll-loop thread only.

    Args:
        strategy: when to try again and when to give up (never, with ``forever=True``).
        consumer: the group's consumer, whose committed offsets carry the attempt counts.
        tracker: each partition's committable offset (a count is committed at most at its message).
    """

    def __init__(self, strategy: RetryInPlace, consumer: Consumer, tracker: OffsetTracker) -> None:
        p = strategy.policy
        self._policy = dataclasses.replace(p, stop=tenacity.stop_never) if strategy.forever else p
        self._consumer = consumer
        self._tracker = tracker
        self._state: dict[TP, InPlace] = {}  # the message each partition retries in place

    def failed(self, tp: TP, offset: int, exc: Exception) -> tuple[int, float | None]:
        """Count a failed attempt of the message at `offset` of `tp`.

        Returns:
            The attempts made, and when to try again (epoch seconds), or None: the policy gives up.
        """
        now = time.time()
        state = self._state.get(tp)
        n, first = (state.attempts, state.first_failed_at) if state is not None and state.offset == offset else (0, now)
        n += 1
        decision = self._policy.decide(n, first, now)
        if decision.give_up:
            self._state.pop(tp, None)
            return n, None
        state = self._state[tp] = InPlace(offset, n, first)
        self._commit(tp, state)
        log.info("retrying %s [%d] @%d in place in %.3fs (attempt %d): %r", tp[0], tp[1], offset,
                 decision.delay, n, exc)
        return n, now + decision.delay

    def _commit(self, tp: TP, state: InPlace) -> None:
        """Commit the partition's offset (at most the retried message's) with the attempt count in its metadata."""
        at = self._tracker.committable_of(tp)
        part = TopicPartition(tp[0], tp[1], state.offset if at is None else min(at, state.offset), state.encode())
        try:
            # Stored too, so that an automatic commit of this offset carries the same metadata.
            self._consumer.store_offsets(offsets=[part])
            self._consumer.commit(offsets=[part], asynchronous=False)
        except KafkaException as exc:
            log.warning("could not commit the in-place attempt count of %s [%d]: %s", tp[0], tp[1], exc.args[0])

    def metadata(self, tp: TP, offset: int) -> str | None:
        """The commit metadata of `tp` at `offset`: the in-place count of a message not yet past, else none."""
        if not self._state:
            return None
        state = self._state.get(tp)
        if state is None:
            return None
        if offset <= state.offset:
            return state.encode()  # still to be retried: keep its count
        del self._state[tp]  # past it: handled or dead-lettered
        return None

    def restore(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """The attempt counts a previous owner committed with the offsets it resumes from."""
        try:
            got = consumer.committed([TopicPartition(p.topic, p.partition) for p in partitions], timeout=10)
        except KafkaException as exc:
            log.warning("could not read the in-place attempt counts (they restart from zero): %s", exc.args[0])
            return
        for c in got:
            state = decode(c.metadata)
            if state is not None:
                self._state[(c.topic, c.partition)] = state
                log.info("%s [%d] @%d: %d in-place attempts made before the assignment", c.topic, c.partition,
                         state.offset, state.attempts)

    def forget(self, tps: Iterable[TP]) -> None:
        """Drop the counts of revoked partitions."""
        for tp in tps:
            self._state.pop(tp, None)
