"""Hops: copies of a consumed message published into the group's retry tiers or its DLQ topic.

A hop goes through the consumer's ResilientProducer, so it is never lost: Kafka acknowledges it,
or the producer commits it to the outbox and sends it from there. The offset of the message it
copies waits in the OffsetTracker until the hop is durable. With ordering="key" each hop also moves
its message's entry in the KeyOrder: into the ladder (a hop from the main topic, or a parking),
from tier to tier, and out again (handled, dead-lettered, or a hop the producer dead-lettered).
"""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections.abc import Sequence

from confluent_kafka import KafkaError, Message

from outbox.consumer.headers import failure_headers, ladder_position, record_timestamp
from outbox.consumer.inbox import Inbox
from outbox.consumer.offsets import TP, OffsetTracker
from outbox.consumer.ordering import KeyOrder
from outbox.consumer.tiers import Ladder, Place
from outbox.headers import IdGenerator
from outbox.producer.resilient import ResilientProducer
from outbox.records import Headers

log = logging.getLogger(__name__)


def attempts_before(m: Message, place: Place) -> int:
    """Handling attempts this message had before the current one."""
    if not place.tier:
        return 0
    parked = ladder_position(m).parked_attempts  # a parked message does not count by its tier
    return place.tier if parked is None else parked


def _ladder_at(m: Message, tp: TP, place: Place) -> tuple[TP, int]:
    """The main-topic partition and offset a message entered by (its ladder entry's address)."""
    if not place.tier:
        return tp, m.offset()  # type: ignore[return-value]
    pos = ladder_position(m)
    return (place.main, pos.origin_partition if pos.origin_partition >= 0 else tp[1]), pos.origin_offset


class Hops:
    """Publishes hops, settles them once durable, and keeps the key order's ladder entries.

    Used by the poll-loop thread, but for the producer's reports (`_settled`).

    Args:
        producer: the hop producer.
        tracker: the offsets that wait for hops.
        order: ordering="key": the keys with messages in the ladder (None: no order is kept).
        inbox: dedup=True: its batch is settled before each hop.
        ladder: the names of the tier topics.
        ids: where a hop's `outbox-id` comes from when the message has none.
        delays: RetryTopics' delays, tier 1 first (empty for the other strategies).
        counts: the consumer's counters (its stats()), counted in place: retried, parked, skipped.
    """

    def __init__(
        self,
        producer: ResilientProducer,
        tracker: OffsetTracker,
        order: KeyOrder | None,
        inbox: Inbox | None,
        ladder: Ladder,
        ids: IdGenerator,
        delays: Sequence[float],
        counts: dict[str, int],
    ) -> None:
        self._producer = producer
        self._tracker = tracker
        self._order = order
        self._inbox = inbox
        self._ladder = ladder
        self._ids = ids
        self._delays = tuple(delays)
        self._counts = counts
        #: Hops made into each retry tier (index 0: tier 1); a list the loop thread alone increments.
        self.retried_by_tier = [0] * len(self._delays)
        self._durable: queue.SimpleQueue[tuple[int, bool]] = queue.SimpleQueue()
        self._tokens = 0
        self._hop_keys: dict[int, tuple[TP, bytes, int]] = {}  # ordering: hop token → its ladder entry

    def retry(self, m: Message, tp: TP, offset: int, place: Place, attempts: int, exc: Exception) -> None:
        """Send `m`, which failed its attempt number `attempts`, to the tier of its next attempt."""
        # Tier n holds the messages waiting for their attempt n + 1; a parked message
        # counts its own attempts, so it may go back to a lower tier than the one it was in.
        due = time.time() + self._delays[attempts - 1]
        headers, _, _ = failure_headers(
            m, group=self._ladder.group, attempt=attempts, exc=exc, due_at_s=due, ids=self._ids
        )
        token = self.publish(self._ladder.retry_topic(place.main, attempts), m, headers, tp[1])
        self._tracker.wait(tp, offset, token)
        self._counts["retried"] += 1
        self.retried_by_tier[attempts - 1] += 1
        if self._order is not None:
            self._into_ladder(m, tp, place, token, attempts)

    # -- ordering="key" -------------------------------------------------------------------------

    def park(self, m: Message, tp: TP, place: Place) -> bool:
        """ordering="key": park `m` behind an earlier message of its key in the ladder. True if parked (or skipped)."""
        order = self._order
        assert order is not None
        key: bytes = m.key()  # type: ignore[assignment]
        origin, at = _ladder_at(m, tp, place)
        if at < 0:
            return False  # not from this consumer's ladder: no order to keep
        if not place.tier and order.contains(origin, key, at):
            # Read again from the main topic (its offset was not committed before a crash or a
            # rebalance) while its copy is in the ladder: that copy is its fate; this one is done.
            self._tracker.done(tp, at)
            self._counts["skipped"] += 1
            return True
        blocker = order.blocker(origin, key, at)
        if blocker is None:
            return False
        behind, tier = blocker
        headers, _, _ = failure_headers(
            m, group=self._ladder.group, attempt=attempts_before(m, place), exc=None, due_at_s=None, ids=self._ids,
            parked_behind=behind,
        )
        token = self.publish(self._ladder.retry_topic(place.main, tier), m, headers, tp[1])
        self._tracker.wait(tp, m.offset(), token)  # type: ignore[arg-type]
        self._into_ladder(m, tp, place, token, tier)
        self._counts["parked"] += 1
        return True

    def _into_ladder(self, m: Message, tp: TP, place: Place, token: int, tier: int) -> None:
        """Count a copy of `m` published into `tier` (hop or parking) in its key's ladder entry."""
        order = self._order
        key = m.key()
        if order is None or key is None:
            return
        origin, at = _ladder_at(m, tp, place)
        if at < 0:
            return
        if place.tier:
            order.moved(origin, key, at, tier)
        else:
            order.entered(origin, key, at, tier)
        self._hop_keys[token] = (origin, key, at)

    def left(self, m: Message, tp: TP, place: Place) -> None:
        """A tier message was handled or dead-lettered: its key's later messages may follow."""
        key = m.key()
        if self._order is not None and key is not None:
            origin, at = _ladder_at(m, tp, place)
            self._order.left(origin, key, at)

    def forget(self, origins: set[TP]) -> None:
        """ordering="key": drop the ladder entries of main-topic partitions this member no longer owns."""
        if self._order is None:
            return
        self._order.forget(origins)
        self._hop_keys = {k: v for k, v in self._hop_keys.items() if v[0] not in origins}

    # -- publishing and settling ----------------------------------------------------------------

    def publish(self, topic: str, m: Message, headers: Headers, partition: int) -> int:
        """Send a hop through the ResilientProducer; its token is settled once the hop is durable."""
        if self._inbox is not None:
            self._inbox.settle()  # the producer may write the hop to the store: not under the inbox's lock
        self._tokens += 1
        token = self._tokens
        self._producer.produce(
            topic, m.value(), m.key(), partition, functools.partial(self._settled, token),
            record_timestamp(m), headers,
        )
        return token

    def _settled(self, token: int, err: KafkaError | None, _msg: Message | None) -> None:
        # Runs on the producer's delivery or drain thread: hand the token to the loop thread.
        if err is not None:
            log.error("hop %d was dead-lettered by the producer (kept in the outbox's dead letters): %s", token, err)
        self._durable.put((token, err is None))

    def settle(self) -> None:
        """Resolve, in the tracker, the hops that became durable since the last call."""
        tracker = self._tracker
        while True:
            try:
                token, ok = self._durable.get_nowait()
            except queue.Empty:
                break
            tracker.resolve(token)
            if self._hop_keys:
                entry = self._hop_keys.pop(token, None)
                if entry is not None and not ok and self._order is not None:
                    self._order.left(*entry)  # the producer dead-lettered the hop: it left the ladder
        # Every hop produced so far is delivered or committed to the outbox (the producer's flush
        # contract): those in the outbox have no report yet, yet their fate is durable.
        # ordering="key" waits for Kafka's acknowledgement instead: a partition's next owner learns
        # what is in the ladder from the tier topics (scan_ladder), and a hop still in this
        # process's outbox is not there, so its source must be read again rather than committed.
        if tracker.waiting_hops and self._order is None and len(self._producer) == 0:
            tracker.resolve_all()

    def hand_over(self) -> None:
        """Partitions are revoked: settle what can be, before their offsets are committed."""
        if self._order is not None:
            # Hops acknowledged now are seen by the next owner's scan; their sources can be committed.
            self._producer.flush(10.0)
        self.settle()

    def flush(self, deadline: float) -> None:
        """Closing: wait for the hops in flight until `deadline` (monotonic), then settle."""
        if (
            self._tracker.waiting_hops
            and self._producer.flush(max(0.0, deadline - time.monotonic())) == 0
            and self._order is None
        ):
            self._tracker.resolve_all()
        self.settle()
