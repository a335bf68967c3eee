"""Executor side: send one Spark partition's rows to Kafka and mark exactly what Kafka acknowledged.

Runs inside Spark's Python workers, so it imports nothing from pyspark and takes its settings as
a small picklable `SendConfig`. One confluent_kafka producer per partition (idempotent,
acks=all): messages arrive as Arrow batches (`spark_drain.batches`) sorted by id, and all
messages of a (topic, key) are in one partition, so a key's messages leave in their original
order.

Safety rules:
    * a row is deleted only after Kafka acknowledged it (`mark_delivered`, idempotent, in batches);
    * a failed send counts one attempt and follows the retry policy (`record_failures`), so a row
      Kafka rejects for good is dead-lettered instead of being retried forever;
    * once a row of a key stays pending (a retriable failure, given back while no broker
      answered, or unacknowledged), that key's later rows in this partition are not sent (they
      stay pending), so a later drain still sends the key in order;
    * a message the job changed (`spark_drain.transform`) and does not deliver, for any of these
      reasons or because its key was held back, is stored as changed (`Settlement.rewritten`), in
      the transaction that settles it, with the `CHANGED_HEADER` of the changes: a later drain
      sends the changed message, and a re-run of the same changes sends it as it is;
    * anything not acknowledged by the end stays pending. A retried Spark task may re-send rows
      that were delivered but not yet marked: duplicates are possible, losses are not.

The send-and-settle logic is the SDK's own (`outbox.drain.sendloop.SendLoop`, `outbox.drain.settle`): rows
are sent in chunks of `mark_batch` (at most one Arrow batch, `spark.sql.execution.arrow.maxRecordsPerBatch`),
and each chunk's decisions are applied in one transaction; a healthy chunk is settled by id alone.

A group row (`outbox.stores.grouped`) is deleted as one row only when a settlement delivers
all of its messages; settled in part, it is first rewritten as one row per message. The shuffle
by key gives every send task a part of nearly every group, so a task settles a group's delivered
messages itself only when it has all of them, and hands the others on (`PartitionSender.split`)
to the job's settle stage (`settle_split`), which sees each group's deliveries from every task at
once. Such a group stays pending until that stage: a job that fails before it re-sends the
group's delivered messages when it is run again (duplicates, never a loss).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from outbox.drain.sendloop import SendLoop
from outbox.drain.settle import Verdict, add_to
from outbox.retry import RetryPolicy
from outbox.stores import open_outbox
from outbox.stores.base import Outbox, Rewrite, Settlement
from outbox.stores.bulk import BulkMessage
from spark_drain.batches import COUNT_NAMES, MessageChunk, chunks
from spark_drain.transform import CHANGED_HEADER

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

    from outbox.stores.encryption import KeyRing

log = logging.getLogger(__name__)

#: Per-topic counter names, in report order.
COUNTERS = ("read", "delivered", "failed", "dead", "left", "skipped")


@dataclass(frozen=True)
class SendConfig:
    """What an executor needs to send and acknowledge (pickled into every task).

    The outbox URL may carry a password; it is only used to connect and never logged. `keys`,
    the key ring of an encrypted outbox, open the rows read (`spark_drain.batches`) and seal again
    the rows a settlement rewrites (a group settled in part, as the stores do); neither is in the repr.
    No outbox URL (None): the messages come from an archive (`spark_drain.archive`), nothing is
    settled, and every message not delivered is counted as failed (none is dead-lettered).
    """

    outbox_url: str | None = field(repr=False)
    producer_config: dict[str, str]
    mark_batch: int = 5000
    max_attempts: int = 3
    retry_delay: float = 3.0
    backoff: str = "fixed"
    keys: KeyRing | None = field(default=None, repr=False)
    #: The `spark_drain.transform.change_mark` of the job's changes (None: nothing changed): every
    #: message it changed and does not deliver is stored changed, carrying it (`PartitionSender`).
    changed: str | None = None

    def policy(self) -> RetryPolicy:
        """The SDK's retry policy with this job's settings."""
        return RetryPolicy(
            max_attempts=self.max_attempts, initial_delay=self.retry_delay, backoff=self.backoff
        )


class PartitionSender:
    """Sends one partition's messages; `run()` returns per-topic counts."""

    def __init__(self, cfg: SendConfig) -> None:
        self.cfg = cfg
        self.policy = cfg.policy()
        self.counts: dict[str, list[int]] = {}
        self.failed_keys: set[tuple[str, bytes]] = set()
        #: Delivered messages of groups this task has not seen whole yet: group id -> (size, ids).
        self.split: dict[int, tuple[int, list[np.ndarray]]] = {}
        #: Changed messages not delivered, to store as changed with the next settlement.
        self.unsent: list[Rewrite] = []
        self._store: Outbox | None = None

    def _count(self, topics: Iterable[str], what: int) -> None:
        for topic, n in Counter(topics).items():
            c = self.counts.get(topic)
            if c is None:
                c = self.counts[topic] = [0] * len(COUNTERS)
            c[what] += n

    @property
    def store(self) -> Outbox:
        assert self.cfg.outbox_url is not None, "no outbox to settle in"
        if self._store is None:
            self._store = open_outbox(self.cfg.outbox_url, create=False, encryption=self.cfg.keys)
        return self._store

    def keep_changed(self, messages: Iterable[BulkMessage]) -> None:
        """Store these messages, changed and not delivered (failed, dead-lettered, given back,
        unacknowledged, or held back behind their key), as changed, with the next settlement:
        else a later drain would send them as they were before the change. Each carries the
        `CHANGED_HEADER` of these changes, so that a re-run sends it as it is; one that already
        does is stored so already."""
        mark = self.cfg.changed
        if mark is None or self.cfg.outbox_url is None:
            return
        header = (CHANGED_HEADER, mark.encode())
        for m in messages:
            if header not in m.headers:
                hs = [h for h in m.headers if h[0] != CHANGED_HEADER]
                self.unsent.append(Rewrite(m.id, m.msg_id, m.topic, m.value, [*hs, header], m.partition))

    def _settle(self, settlement: Settlement, now: float) -> list[int]:
        """Apply `settlement`, with the changed messages not delivered so far, in one transaction;
        the ids of the rows dead-lettered now."""
        if self.cfg.outbox_url is None:
            return []
        settlement.rewritten += self.unsent
        self.unsent = []
        return [r.id for r in self.store.apply(settlement, now=now).dead] if settlement else []

    def _hold(self, settlement: Settlement, group: int, size: int, ids: np.ndarray) -> None:
        """Delivered messages of a group: settled now once this task has all of the group (it is
        deleted as one row), else held for the settle stage."""
        held = self.split.get(group)
        if held is None:
            if len(ids) == size:
                settlement.delivered += ids.tolist()
                return
            held = self.split[group] = (size, [])
        held[1].append(ids)
        if sum(len(a) for a in held[1]) == size:
            settlement.delivered += [int(i) for a in held[1] for i in a]
            del self.split[group]

    def _all_delivered(self, settlement: Settlement, chunk: MessageChunk) -> None:
        """A healthy chunk's settlement, a group's messages at a time: they are neighbours, since
        a chunk is in id order and a group's ids are consecutive."""
        import numpy as np

        ones = chunk.sizes == 1
        if ones.all():
            settlement.delivered += chunk.ids()
            return
        settlement.delivered += chunk.id_array[ones].tolist()
        many = ~ones
        ids, groups, sizes = chunk.id_array[many], chunk.groups[many], chunk.sizes[many]
        starts = [0, *(np.flatnonzero(np.diff(groups)) + 1).tolist()]
        for start, stop in zip(starts, [*starts[1:], len(ids)], strict=True):
            self._hold(settlement, int(groups[start]), int(sizes[start]), ids[start:stop])

    def _send(self, loop: SendLoop, chunk: MessageChunk) -> None:
        """Send one chunk with the SDK's send loop; apply its decisions in one transaction."""
        if not len(chunk):
            return
        import numpy as np

        batch = loop.start(chunk)
        settlement = Settlement()
        if loop.wait(batch):
            self._all_delivered(settlement, chunk)
            self._settle(settlement, time.time())
            self._count(chunk.cols[2], 1)
            return
        decided = loop.decide(batch, time.time)
        now = time.time()
        group_of = dict(zip(chunk.ids(), zip(chunk.groups.tolist(), chunk.sizes.tolist(), strict=True), strict=True))
        origin = dict(zip(chunk.ids(), chunk.origin, strict=True))
        for row, d in decided:
            if d.verdict is Verdict.DELIVERED:
                group, size = group_of[row.id]
                if size > 1:
                    self._hold(settlement, group, size, np.array([row.id], np.int64))
                else:
                    settlement.delivered.append(row.id)
                continue
            add_to(settlement, row.id, d, now)
        delivered = {row.id for row, d in decided if d.verdict is Verdict.DELIVERED}
        dead_now = {row.id for row, d in decided if d.verdict is Verdict.DEAD_LETTER}
        for m in chunk:
            if m.key is not None and m.id not in delivered and m.id not in dead_now:
                # It stays pending, to be sent again later (rescheduled, given back while no broker
                # answered, or unacknowledged): its key's later rows must wait for it, else they
                # overtake it once the cluster answers again (its key in the outbox: a message
                # sent to another topic is ordered by its own).
                self.failed_keys.add((origin[m.id], m.key))
        self.keep_changed(m for m in chunk if m.id not in delivered)
        dead = set(self._settle(settlement, now))
        failed = [(row, d) for row, d in decided if d.verdict not in (Verdict.DELIVERED, Verdict.RELEASE)]
        self._count((row.topic for row, d in decided if d.verdict is Verdict.DELIVERED), 1)
        self._count((row.topic for row, _ in failed if row.id in dead), 3)
        self._count((row.topic for row, _ in failed if row.id not in dead), 2)
        unknown = len(chunk) - len(decided)
        if unknown:
            log.warning("spark_drain: %d messages unacknowledged at the end; they stay pending", unknown)

    def count_skipped(self, topics: list[str]) -> None:
        """Count messages not to send (`keep` false), by their topic in the outbox."""
        self._count(topics, 5)

    def run(self, chunks: Iterable[MessageChunk]) -> list[tuple[str, int, int, int, int, int, int]]:
        """Send the messages (in id order per key); return per-topic counts. Delivered messages of
        groups met only in part are left in `split` for the settle stage."""
        loop = SendLoop(dict(self.cfg.producer_config), self.policy)
        try:
            for chunk in chunks:
                self._count(chunk.cols[2], 0)
                if self.failed_keys:  # its key must wait for the failed row: stays pending (changed)
                    failed = self.failed_keys
                    waiting = [k is not None and (t, k) in failed
                               for t, k in zip(chunk.origin, chunk.cols[3], strict=True)]
                    if any(waiting):
                        self.keep_changed(chunk.only(waiting))
                        chunk = chunk.only([not w for w in waiting])
                self._send(loop, chunk)
            if self.unsent:
                self._settle(Settlement(), time.time())
        finally:
            loop.close(10)
            if self._store is not None:
                self._store.close()
        out = []
        for topic, c in self.counts.items():
            c[4] = c[0] - c[1] - c[2] - c[3]  # left pending, untouched (key waiting, or unacknowledged)
            out.append((topic, c[0], c[1], c[2], c[3], c[4], c[5]))
        return out


def send_batches(
    cfg: SendConfig,
    blockers: Mapping[tuple[str, bytes], int] | None,
    batches: Iterator[pa.RecordBatch],
) -> Iterator[pa.RecordBatch]:
    """`mapInArrow` body over one send task's message batches (`spark_drain.batches.MESSAGES`),
    in id order, every message of a key in this task: send them, yield one batch of per-topic
    counts and the delivered messages of groups it did not see whole (`spark_drain.batches.SENT`)."""
    import numpy as np
    import pyarrow as pa

    sender = PartitionSender(cfg)
    counts = sender.run(chunks(batches, cfg.mark_batch, blockers, cfg.keys, sender.keep_changed, sender.count_skipped))
    cols: list[pa.Array] = [
        pa.array(list(c), type=pa.string() if i == 0 else pa.int64())
        for i, c in enumerate(zip(*counts, strict=True) if counts else [()] * len(COUNT_NAMES))
    ]
    nulls = [None] * len(counts)
    split = sender.split
    ids = [np.concatenate(held) for _, held in split.values()]
    offsets = np.cumsum([0, *(len(i) for i in ids)], dtype=np.int32)
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    yield pa.RecordBatch.from_arrays(
        [
            *(pa.concat_arrays([c, pa.nulls(len(split), c.type)]) for c in cols),
            pa.array(nulls + list(split), type=pa.int64()),
            pa.array(nulls + [size for size, _ in split.values()], type=pa.int64()),
            pa.ListArray.from_arrays(
                pa.array(np.concatenate([np.zeros(len(counts), np.int32), offsets]), type=pa.int32()),
                pa.array(flat, type=pa.int64()),
                mask=pa.array([True] * len(counts) + [False] * len(split), type=pa.bool_()),
            ),
        ],
        names=[*COUNT_NAMES, "grp", "grp_n", "done"],
    )


def settle_split(cfg: SendConfig, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """`mapInArrow` body of the settle stage over the send tasks' output, partitioned by group:
    each group's delivered messages from every task in one settlement (a group delivered whole is
    deleted as one row). Per-topic counts pass through (`spark_drain.batches.COUNTS`)."""
    import pyarrow.compute as pc

    held: dict[int, list[int]] = {}
    for b in batches:
        counts = b.filter(pc.is_null(b.column("grp"))).select(list(COUNT_NAMES))
        if counts.num_rows:
            yield counts
        groups = b.filter(pc.is_valid(b.column("grp")))
        for gid, done in zip(groups.column("grp").to_pylist(), groups.column("done").to_pylist(), strict=True):
            held.setdefault(gid, []).extend(done)
    if not held:
        return
    assert cfg.outbox_url is not None, "groups come from an outbox"
    with open_outbox(cfg.outbox_url, create=False, encryption=cfg.keys) as store:
        settlement = Settlement()
        for done in held.values():
            settlement.delivered.extend(done)  # a group's messages stay in one settlement
            if len(settlement.delivered) >= cfg.mark_batch:
                store.apply(settlement, now=time.time())
                settlement = Settlement()
        if settlement:
            store.apply(settlement, now=time.time())
