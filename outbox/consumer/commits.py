"""The group's committed offsets: storing and committing the tracker's committable ones, and reading them back.

Offsets are stored for commit only past messages whose fate is durable (`OffsetTracker`); librdkafka
commits the stored offsets itself (auto commit), or `OffsetCommits.store` commits them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from confluent_kafka import OFFSET_BEGINNING, OFFSET_INVALID, Consumer, KafkaError, KafkaException, TopicPartition

from outbox.consumer.inplace import InPlaceRetries
from outbox.consumer.offsets import TP, OffsetTracker

log = logging.getLogger(__name__)


class OffsetCommits:
    """Stores and commits the offsets the tracker says may be committed.

    Used by the poll-loop thread only.

    Args:
        consumer: the group's consumer.
        tracker: which offset of each partition may be committed.
        in_place: RetryInPlace: the attempt counts committed with the offsets (None for the other strategies).
        auto_commit: librdkafka commits the stored offsets itself; else `store` commits them.
    """

    def __init__(
        self, consumer: Consumer, tracker: OffsetTracker, in_place: InPlaceRetries | None, *, auto_commit: bool
    ) -> None:
        self._consumer = consumer
        self._tracker = tracker
        self._in_place = in_place
        self._auto_commit = auto_commit

    def store(self) -> None:
        """Store the committable offsets that moved (and commit them, without auto commit)."""
        moved = self._tracker.committable()
        if not moved:
            return
        in_place = self._in_place
        parts = [
            _partition(t, p, o, None if in_place is None else in_place.metadata((t, p), o)) for (t, p), o in moved
        ]
        try:
            self._consumer.store_offsets(offsets=parts)
        except KafkaException as exc:
            log.debug("store_offsets: %s", exc.args[0])  # a partition was revoked meanwhile
        if not self._auto_commit:
            self.commit(sync=False)

    def commit(self, *, sync: bool) -> None:
        """Commit the stored offsets (a commit with nothing to commit is no failure)."""
        try:
            if sync:
                self._consumer.commit(asynchronous=False)
            else:
                self._consumer.commit(asynchronous=True)
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            if err.code() != KafkaError._NO_OFFSET:
                log.warning("offset commit failed: %s", err)

    def forget(self, tps: Iterable[TP]) -> None:
        """Drop the progress of partitions assigned anew, revoked or lost."""
        self._tracker.forget(tps)


def tier_offsets(consumer: Consumer, tier_parts: list[TopicPartition]) -> dict[TP, int] | None:
    """The group's committed offsets of `tier_parts`, or None when the cluster does not answer."""
    try:
        return {(c.topic, c.partition): c.offset for c in consumer.committed(tier_parts, timeout=10)}
    except KafkaException as exc:
        log.warning("could not read committed offsets of tier partitions: %s", exc.args[0])
        return None


def start_new_tiers_at_beginning(tier_parts: list[TopicPartition], committed: Mapping[TP, int]) -> None:
    """A tier partition this group never committed starts at its beginning whatever
    auto.offset.reset says: its messages were produced by this group for this group."""
    for p in tier_parts:
        if committed.get((p.topic, p.partition), OFFSET_INVALID) == OFFSET_INVALID:
            p.offset = OFFSET_BEGINNING


def _partition(topic: str, partition: int, offset: int, metadata: str | None) -> TopicPartition:
    # confluent_kafka takes metadata only as a str argument (None is refused, the attribute is read-only).
    if metadata is None:
        return TopicPartition(topic, partition, offset)
    return TopicPartition(topic, partition, offset, metadata)
