"""ordering="key": which keys have messages in the retry ladder, per main-topic partition.

The rule: a message of key K that entered from main partition p is handled only when no earlier
message of K from p (a smaller main-topic offset) is in the ladder. Otherwise it is *parked*:
published into the tier where that earliest message waits, on the same partition, so it is read
right behind it, and decided again then. A message leaves the ladder when it is handled or dead-lettered.

The state is kept in memory by the member that owns partition p of the main topic and of every tier
(the range assignor gives both to the same member), and rebuilt when partitions are assigned from
the only place that is always right about it: the tier partitions themselves, read from the group's
committed offsets to their ends (`scan_ladder`). Every message there is either still waiting or was
handled but not yet committed; the second kind is read, and settled, again by the new owner, so
counting it errs only towards waiting, never towards reordering.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from outbox.consumer.headers import ladder_position
from outbox.consumer.tiers import Place
from outbox.logs import with_librdkafka_log

log = logging.getLogger(__name__)

TP = tuple[str, int]


@dataclass(slots=True)
class Entry:
    """One message of a key in the ladder: its copies in tier topics, and the tier of the latest one."""

    copies: int
    tier: int


class KeyOrder:
    """Keys with messages in the ladder, by main-topic partition and main-topic offset.

    Pure bookkeeping for the poll-loop thread; keys are bytes (messages without a key have no order).
    """

    def __init__(self) -> None:
        self._parts: dict[TP, dict[bytes, dict[int, Entry]]] = {}

    def __len__(self) -> int:
        """How many keys are waiting for a message in the ladder."""
        return sum(len(keys) for keys in self._parts.values())

    def blocker(self, origin: TP, key: bytes, offset: int) -> tuple[int, int] | None:
        """The earliest message of `key` before `offset` still in the ladder: (its offset, its tier), or None."""
        keys = self._parts.get(origin)
        entries = keys.get(key) if keys else None
        if not entries:
            return None
        first = min(entries)
        return (first, entries[first].tier) if first < offset else None

    def contains(self, origin: TP, key: bytes, offset: int) -> bool:
        """True if the message at `offset` is in the ladder already (a main-topic message read again)."""
        keys = self._parts.get(origin)
        entries = keys.get(key) if keys else None
        return bool(entries) and offset in entries  # type: ignore[operator]

    def entered(self, origin: TP, key: bytes, offset: int, tier: int, *, scanned: bool = False) -> None:
        """A copy of the message was published into `tier` (a hop from the main topic, a parking, or a scan).

        `scanned`: found by a scan, whose copies come in no particular order: the highest tier is
        taken as the latest (the lower copies are mostly settled ones whose commit had not happened).
        """
        entries = self._parts.setdefault(origin, {}).setdefault(key, {})
        e = entries.get(offset)
        if e is None:
            entries[offset] = Entry(1, tier)
        else:
            e.copies += 1
            e.tier = max(e.tier, tier) if scanned else tier

    def moved(self, origin: TP, key: bytes, offset: int, tier: int) -> None:
        """A copy read from a tier was published into `tier` (its next hop, or parked again)."""
        keys = self._parts.get(origin)
        e = keys.get(key, {}).get(offset) if keys else None
        if e is None:  # a copy this member never counted (a redriven dead letter, a late one): count it now
            self.entered(origin, key, offset, tier)
        else:
            e.tier = tier

    def left(self, origin: TP, key: bytes, offset: int) -> None:
        """A copy read from a tier is settled: handled or dead-lettered (unknown copies are ignored)."""
        keys = self._parts.get(origin)
        entries = keys.get(key) if keys else None
        if not entries or offset not in entries:
            return
        e = entries[offset]
        e.copies -= 1
        if e.copies <= 0:
            del entries[offset]
            if not entries:
                del keys[key]  # type: ignore[union-attr]

    def forget(self, origins: Iterable[TP]) -> None:
        """Drop main-topic partitions this member no longer owns."""
        for tp in origins:
            self._parts.pop(tp, None)


def scan_ladder(
    config: Mapping[str, Any],
    starts: list[TopicPartition],
    places: Mapping[str, Place],
    order: KeyOrder,
    *,
    timeout: float = 30.0,
) -> int:
    """Count every message of the tier partitions `starts` (from their offsets to their current ends) into `order`.

    Args:
        config: client settings (bootstrap servers, security) for a group-less reader.
        starts: tier partitions with the offset to read from (the group's committed offset, or
            the partition's beginning when the group never committed it).
        places: each topic's place in the ladder.
        order: where the entries go.
        timeout: longest time the scan may take.

    Returns:
        How many messages were counted.

    Raises:
        KafkaException: the ends could not be read or the scan did not finish in time; the
            caller must not hand out messages on the order such a partial state would give.
    """
    reader = Consumer(
        {
            **with_librdkafka_log(config),
            "group.id": "outbox-ladder-scan",  # never joins or commits: partitions are assigned
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
        }
    )
    deadline = time.monotonic() + timeout
    counted = 0
    try:
        todo: dict[TP, int] = {}
        assign: list[TopicPartition] = []
        for s in starts:
            low, high = reader.get_watermark_offsets(TopicPartition(s.topic, s.partition), timeout=timeout)
            start = s.offset if s.offset >= 0 else low
            if start < high:
                todo[(s.topic, s.partition)] = high
                assign.append(TopicPartition(s.topic, s.partition, max(start, low)))
        if not assign:
            return 0
        reader.assign(assign)
        while todo:
            if time.monotonic() > deadline:
                raise KafkaException(KafkaError(KafkaError._TIMED_OUT, f"ladder scan unfinished: {sorted(todo)}"))
            for m in reader.consume(500, 0.5):
                err = m.error()
                tp = (m.topic() or "", m.partition() or 0)
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        todo.pop(tp, None)
                        continue
                    raise KafkaException(err)
                end = todo.get(tp)
                offset = m.offset() or 0
                if end is None:
                    continue
                if offset >= end:
                    todo.pop(tp, None)
                    continue
                key = m.key()
                if key is not None:
                    pos = ladder_position(m)
                    place = places[tp[0]]
                    if pos.origin_offset >= 0:
                        origin = (place.main, pos.origin_partition if pos.origin_partition >= 0 else tp[1])
                        order.entered(origin, key, pos.origin_offset, place.tier, scanned=True)
                        counted += 1
                if offset + 1 >= end:
                    todo.pop(tp, None)
        return counted
    finally:
        reader.close()
