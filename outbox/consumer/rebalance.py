"""The consumer's rebalance callbacks: what its parts keep of each partition comes and goes with it.

None of the loop's per-partition state has to survive a rebalance: a partition that leaves is
forgotten (after its offsets are committed, when it is revoked rather than lost), and one that
comes is read from its committed offset, whose messages tell again what to do.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from confluent_kafka import Consumer, TopicPartition

from outbox.consumer.assignment import Assignments
from outbox.consumer.commits import OffsetCommits, start_new_tiers_at_beginning, tier_offsets
from outbox.consumer.hops import Hops
from outbox.consumer.inplace import InPlaceRetries
from outbox.consumer.offsets import TP
from outbox.consumer.ordering import KeyOrderRebuild
from outbox.consumer.scheduler import Holds
from outbox.consumer.tiers import Place

log = logging.getLogger(__name__)


class Rebalance:
    """on_assign, on_revoke and on_lost of the group's consumer (they run on the poll-loop thread).

    Args:
        places: each subscribed topic's place in the ladder.
        holds: the paused partitions.
        offsets: the committable offsets and their commits.
        hops: the hops in flight, and the key order's entries of hops.
        rebuild: ordering="key": the key order's rebuild from the tiers (None: no order is kept).
        in_place: RetryInPlace: the attempt counts (None for the other strategies).
        counts: the consumer's counters (its stats()), counted in place: assigned, revoked.
        assignments: the assignment's changes, in the calls of the group's rebalance protocol:
            incremental, partitions come and go a few at a time and the others keep flowing (and
            stay paused if they were); eager, every rebalance revokes the whole assignment first.
    """

    def __init__(
        self,
        places: Mapping[str, Place],
        holds: Holds,
        offsets: OffsetCommits,
        hops: Hops,
        rebuild: KeyOrderRebuild | None,
        in_place: InPlaceRetries | None,
        counts: dict[str, int],
        assignments: Assignments,
    ) -> None:
        self._places = places
        self._holds = holds
        self._offsets = offsets
        self._hops = hops
        self._rebuild = rebuild
        self._in_place = in_place
        self._counts = counts
        self._assignments = assignments

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = [(p.topic, p.partition) for p in partitions]
        self._holds.forget(tps)
        self._offsets.forget(tps)
        tier_parts = [p for p in partitions if self._places[p.topic].tier]
        committed = tier_offsets(consumer, tier_parts) if tier_parts else {}
        unscanned = False
        if committed is None and self._rebuild is not None:
            unscanned = True  # the offsets are read with the ladder, once the cluster answers
        else:
            committed = committed or {}  # unreadable: every tier partition from its beginning
            start_new_tiers_at_beginning(tier_parts, committed)
            if self._rebuild is not None and partitions:
                # Also for main partitions alone: their tier partitions may come in a later step.
                unscanned = not self._rebuild.rebuild(partitions, tier_parts, committed)
        if self._in_place is not None:
            self._in_place.restore(consumer, partitions)
        self._assignments.add(partitions)
        # A pause does not survive in our state; make sure none survives in librdkafka's either.
        consumer.resume(partitions)
        if unscanned:
            assert self._rebuild is not None
            # ordering="key" with the ladder unreadable (the cluster is down) or not wholly this
            # member's yet (an incremental hand-off in steps): handing out these partitions'
            # messages could reorder a key, so they stay paused until a scan succeeds.
            consumer.pause(partitions)
            self._rebuild.wait(partitions)
        # Counted once done (the ordering scan included), so that stats() never shows an assignment half made.
        self._counts["assigned"] += 1
        log.info("assigned %d partitions", len(partitions))

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._counts["revoked"] += 1
        tps = [(p.topic, p.partition) for p in partitions]
        self._hops.hand_over()
        self._offsets.store()
        self._offsets.commit(sync=True)
        self._forget(tps)
        self._assignments.remove(partitions)
        self._split(tps)

    def on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost, not revoked: another member may own them already, so commit nothing.
        tps = [(p.topic, p.partition) for p in partitions]
        self._forget(tps)
        self._assignments.remove(partitions)
        self._split(tps)

    def _split(self, tps: list[TP]) -> None:
        """ordering="key", incremental: a main partition's ladder partly gone (main p kept, tier p
        gone, or the other way round) waits, paused from where it was committed, until it is whole."""
        if self._rebuild is None:
            return
        kept = self._rebuild.split(set(tps))
        self._holds.forget(kept)  # their pause is the wait's now; a hold's resume would end it
        self._offsets.forget(kept)  # read again from the committed offset once whole

    def _forget(self, tps: list[TP]) -> None:
        self._holds.forget(tps)
        self._offsets.forget(tps)
        gone = set(tps)
        if self._rebuild is not None:
            self._rebuild.forget(gone)
            self._hops.forget({(self._places[t].main, p) for t, p in gone})
        if self._in_place is not None:
            self._in_place.forget(gone)
