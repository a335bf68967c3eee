"""ordering="key": which keys have messages in the retry ladder, per main-topic partition.

The rule: a message of key K that entered from main partition p is handled only when no earlier
message of K from p (a smaller main-topic offset) is in the ladder. Otherwise it is *parked*:
published into the tier where that earliest message waits, on the same partition, so it is read
right behind it, and decided again then. A message leaves the ladder when it is handled or dead-lettered.

The state is kept in memory by the member that owns partition p of the main topic and of every tier
(a range assignor gives both to the same member: the classic protocol's in the client, or the
broker's under group.protocol=consumer), and rebuilt when partitions are assigned from
the only place that is always right about it: the tier partitions themselves, read from the group's
committed offsets to their ends (`scan_ladder`). Every message there is either still waiting or was
handled but not yet committed; the second kind is read, and settled, again by the new owner, so
counting it errs only towards waiting, never towards reordering. `KeyOrderRebuild` runs that scan
at each assignment, and keeps the partitions whose ladder the cluster could not give paused
until a later scan reads it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, TopicPartition

from outbox.consumer.assignment import Assignments
from outbox.consumer.commits import start_new_tiers_at_beginning, tier_offsets
from outbox.consumer.headers import ladder_position
from outbox.consumer.tiers import Place
from outbox.logs import with_librdkafka_log

log = logging.getLogger(__name__)

TP = tuple[str, int]
SCAN_RETRY_INTERVAL = 5.0  # seconds between tries to read the ladder of partitions paused for want of it
SCAN_TIMEOUT = 30.0  # seconds a ladder scan may take at first


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


class KeyOrderRebuild:
    """ordering="key": rebuilds the KeyOrder of assigned partitions from their tier partitions, and
    tries again, every few seconds, for the partitions whose ladder could not be read.

    Used by the poll-loop thread only (the rebalance callbacks run on it).

    Args:
        order: the keys with messages in the ladder.
        consumer: the group's consumer (resumes the partitions once their ladder is read).
        assignments: its assignment's changes, in the calls of the group's rebalance protocol.
        places: each subscribed topic's place in the ladder.
        client_config: settings of the group-less reader that scans the tiers.
        counts: the consumer's counters (its stats()), counted in place: scanned.
    """

    def __init__(
        self,
        order: KeyOrder,
        consumer: Consumer,
        assignments: Assignments,
        places: Mapping[str, Place],
        client_config: Mapping[str, Any],
        counts: dict[str, int],
    ) -> None:
        self._order = order
        self._consumer = consumer
        self._assignments = assignments
        self._places = places
        self._client_config = client_config
        self._counts = counts
        self.unscanned: list[TopicPartition] = []  # paused until their ladder is read
        self.next_scan = 0.0  # monotonic
        self._scan_timeout = SCAN_TIMEOUT  # doubled after each failed scan: a big ladder gets the time it needs

    def rebuild(
        self, partitions: list[TopicPartition], tier_parts: list[TopicPartition], committed: dict[TP, int]
    ) -> bool:
        """Learn what is in the ladder of the assigned partitions from their tier partitions.

        Returns:
            False when the ladder could not be read (the cluster does not answer), or when this
            member does not own the whole ladder of one of their main partitions yet; nothing of
            these partitions is counted then.
        """
        mine = {(p.topic, p.partition) for p in partitions}
        if not self._whole_ladders(mine):
            self._order.forget(self._origins(partitions))
            return False
        if not tier_parts:
            return True
        starts = [
            TopicPartition(p.topic, p.partition, committed.get((p.topic, p.partition), OFFSET_INVALID))
            for p in tier_parts
        ]
        try:
            counted = scan_ladder(self._client_config, starts, self._places, self._order, timeout=self._scan_timeout)
        except KafkaException as exc:
            self._scan_timeout = min(self._scan_timeout * 2, 600.0)
            self._order.forget(self._origins(partitions))  # a partial count would make keys wait for copies never read
            log.warning("ordering='key': the ladder of %d partitions could not be read, they stay paused "
                        "until it can: %s", len(partitions), exc.args[0])
            return False
        self._scan_timeout = SCAN_TIMEOUT
        self._counts["scanned"] += counted
        log.info("ordering='key': %d tier messages counted, %d keys waiting", counted, len(self._order))
        return True

    def _whole_ladders(self, mine: set[TP]) -> bool:
        """Whether, for each main partition p of `mine`, this member owns partition p of the main
        topic and of every tier, none of them waiting apart from `mine`. An incremental rebalance
        (KIP-848) may hand them over in more than one step; until the last one comes, a key's
        earlier messages could be in a tier partition nobody here has read."""
        owned = {(p.topic, p.partition) for p in self._consumer.assignment()} | mine
        waiting = {(p.topic, p.partition) for p in self.unscanned} - mine
        whole = True
        for main, part in {(self._places[t].main, part) for t, part in mine}:
            ladder = [(t, part) for t, place in self._places.items() if place.main == main]
            missing = [tp for tp in ladder if tp not in owned]
            if missing:
                log.warning(
                    "ordering='key': %s [%d] waits, paused, until %s [%d] is this member's too (partition p of "
                    "the main topic and of its tiers need one owner: every member must use the range assignor "
                    "and the same topics)", main, part, missing[0][0], part,
                )
            whole = whole and not missing and not any(tp in waiting for tp in ladder)
        return whole

    def split(self, gone: set[TP]) -> list[TP]:
        """Partitions revoked or lost: what this member keeps of their main partitions' ladders
        waits, paused, until the whole ladder is its again (or leaves too); returns those kept."""
        origins = {(self._places[t].main, part) for t, part in gone}
        waiting = {(p.topic, p.partition) for p in self.unscanned}
        kept = [
            TopicPartition(p.topic, p.partition) for p in self._consumer.assignment()
            if (self._places[p.topic].main, p.partition) in origins and (p.topic, p.partition) not in waiting
        ]
        if kept:
            self._consumer.pause(kept)
            self.wait(kept)
        return [(p.topic, p.partition) for p in kept]

    def wait(self, partitions: list[TopicPartition]) -> None:
        """`partitions` (paused by the caller) wait for their ladder to be read."""
        self.unscanned.extend(TopicPartition(p.topic, p.partition) for p in partitions)
        owned = {(p.topic, p.partition) for p in self._consumer.assignment()}
        # The last step of a hand-off made every waiting ladder whole: read it at the next turn.
        whole = all((t, p.partition) in owned for p in self.unscanned
                    for t, place in self._places.items() if place.main == self._places[p.topic].main)
        self.next_scan = time.monotonic() + (0.0 if whole else SCAN_RETRY_INTERVAL)

    def retry(self) -> None:
        """Try again to read the ladder of the partitions paused for want of it."""
        self.next_scan = time.monotonic() + SCAN_RETRY_INTERVAL
        partitions = self.unscanned
        tier_parts = [TopicPartition(p.topic, p.partition) for p in partitions if self._places[p.topic].tier]
        committed = tier_offsets(self._consumer, tier_parts) if tier_parts else {}
        if committed is None or not self.rebuild(partitions, tier_parts, committed):
            return
        # Assigned again, the same partitions, now with the tier offsets known. (A seek cannot
        # start a tier partition at its beginning: librdkafka refuses to seek a partition whose
        # fetch never started.) Eager (classic range), these partitions are the whole assignment;
        # incremental (KIP-848), the member's other partitions keep theirs.
        start_new_tiers_at_beginning(tier_parts, committed)
        starts = [p for p in partitions if not self._places[p.topic].tier] + tier_parts
        try:
            self._assignments.remove(partitions)
            self._assignments.add(starts)
            self._consumer.resume(starts)
        except KafkaException as exc:
            self._order.forget(self._origins(partitions))
            log.warning("could not resume the scanned partitions, trying again: %s", exc.args[0])
            return
        self.unscanned = []
        log.info("ordering='key': %d partitions resumed after their ladder scan", len(partitions))

    def forget(self, gone: set[TP]) -> None:
        """Partitions revoked or lost wait no more."""
        self.unscanned = [p for p in self.unscanned if (p.topic, p.partition) not in gone]

    def _origins(self, partitions: list[TopicPartition]) -> set[TP]:
        """The main-topic partitions whose messages `partitions` (main or tier) hold."""
        return {(self._places[p.topic].main, p.partition) for p in partitions}
