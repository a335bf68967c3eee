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
    * after a retriable failure of a key, that key's later rows in this partition are not sent
      (they stay pending, untouched), so a later drain still sends the key in order;
    * anything not acknowledged by the end stays pending. A retried Spark task may re-send rows
      that were delivered but not yet marked: duplicates are possible, losses are not.

The send-and-settle logic is the SDK's own (`outbox.sendloop.SendLoop`, `outbox.settle`): rows
are sent in chunks of `mark_batch`, and each chunk's decisions are applied in one transaction.

A SQLite group (`outbox.stores.grouped`) is deleted as one row only when a settlement delivers
all of its messages; settled in part, it is first rewritten as one row per message. The shuffle
by key gives every send task a part of nearly every group, so a task settles a group's delivered
messages itself only when it has all of them, and hands the others on (`split_groups`) to the
job's settle stage (`settle_split`), which sees each group's deliveries from every task at once.
"""

from __future__ import annotations

import bisect
import logging
import time
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from outbox.retry import RetryPolicy
from outbox.sendloop import SendLoop
from outbox.settle import Verdict, add_to
from outbox.stores import open_outbox
from outbox.stores.base import Outbox, Settlement
from outbox.stores.bulk import BulkMessage
from spark_drain.batches import COUNT_NAMES, messages

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

#: Per-topic counter names, in report order.
COUNTERS = ("read", "delivered", "failed", "dead", "left")


@dataclass(frozen=True)
class SendConfig:
    """What an executor needs to send and acknowledge (pickled into every task).

    The outbox URL may carry a password; it is only used to connect and never logged.
    """

    outbox_url: str = field(repr=False)
    producer_config: dict[str, str]
    mark_batch: int = 5000
    max_attempts: int = 3
    retry_delay: float = 3.0
    backoff: str = "fixed"

    def policy(self) -> RetryPolicy:
        """The SDK's retry policy with this job's settings."""
        return RetryPolicy(
            max_attempts=self.max_attempts, initial_delay=self.retry_delay, backoff=self.backoff
        )


class GroupSpans:
    """The groups a send task has met (id -> size), and which one a message id belongs to: a
    group `G` of `n` messages holds the ids `G + 1 … G + n`. Groups are met in id order."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._sizes: list[int] = []
        self._last: tuple[int, int] | None = None

    def add(self, group_id: int, size: int) -> None:
        """Note a group (again: a group may span several batches)."""
        starts = self._starts
        if starts and group_id <= starts[-1]:
            i = bisect.bisect_left(starts, group_id)
            if starts[i] == group_id:
                return
            starts.insert(i, group_id)
            self._sizes.insert(i, size)
            return
        starts.append(group_id)
        self._sizes.append(size)

    def of(self, message_id: int) -> tuple[int, int] | None:
        """(group id, size) of the group holding `message_id`, or None for a one-message row."""
        last = self._last
        if last is not None and last[0] < message_id <= last[0] + last[1]:
            return last  # ids come in order: mostly the group of the id before
        i = bisect.bisect_left(self._starts, message_id) - 1
        if i >= 0 and message_id <= self._starts[i] + self._sizes[i]:
            self._last = self._starts[i], self._sizes[i]
            return self._last
        return None


class PartitionSender:
    """Sends one partition's rows; `run()` returns per-topic counts."""

    def __init__(self, cfg: SendConfig) -> None:
        self.cfg = cfg
        self.policy = cfg.policy()
        self.counts: dict[str, list[int]] = {}
        self.failed_keys: set[tuple[str, bytes]] = set()
        self.groups = GroupSpans()
        #: Delivered messages of groups this task has not seen whole yet: group id -> (size, ids).
        self.split: dict[int, tuple[int, array[int]]] = {}
        self._store: Outbox | None = None

    def _count(self, topic: str, what: int, n: int = 1) -> None:
        c = self.counts.get(topic)
        if c is None:
            c = self.counts[topic] = [0] * len(COUNTERS)
        c[what] += n

    @property
    def store(self) -> Outbox:
        if self._store is None:
            self._store = open_outbox(self.cfg.outbox_url, create=False)
        return self._store

    def _delivered(self, settlement: Settlement, message_id: int) -> None:
        """Settle a delivered message now, or hold it while its group is not whole here."""
        group = self.groups.of(message_id)
        if group is None:
            settlement.delivered.append(message_id)
            return
        gid, size = group
        held = self.split.get(gid)
        if held is None:
            held = self.split[gid] = (size, array("q"))
        held[1].append(message_id)
        if len(held[1]) == size:  # all of it delivered by this task: deleted as one row
            settlement.delivered.extend(held[1])
            del self.split[gid]

    def _send(self, loop: SendLoop, chunk: list[BulkMessage]) -> None:
        """Send one chunk with the SDK's send loop; apply its decisions in one transaction."""
        if not chunk:
            return
        decided = loop.send(chunk, time.time)
        now = time.time()
        settlement = Settlement()
        for row, d in decided:
            if d.verdict is Verdict.DELIVERED:
                self._delivered(settlement, row.id)
                continue
            add_to(settlement, row.id, d, now)
            if d.verdict is Verdict.RESCHEDULE and row.key is not None:
                # This row will be sent again later: its key's later rows must wait for it.
                self.failed_keys.add((row.topic, row.key))
        dead = {r.id for r in self.store.apply(settlement, now=now).dead} if settlement else set()
        for topic, n in Counter(row.topic for row, d in decided if d.verdict is Verdict.DELIVERED).items():
            self._count(topic, 1, n)
        for row, d in decided:
            if d.verdict is not Verdict.DELIVERED and d.verdict is not Verdict.RELEASE:
                self._count(row.topic, 3 if row.id in dead else 2)
        unknown = len(chunk) - len(decided)
        if unknown:
            log.warning("spark_drain: %d messages unacknowledged at the end; they stay pending", unknown)

    def run(self, rows: Iterable[BulkMessage]) -> list[tuple[str, int, int, int, int, int]]:
        """Send the messages (in id order per key); return per-topic counts. Delivered messages of
        groups met only in part are left in `split` for the settle stage."""
        loop = SendLoop(dict(self.cfg.producer_config), self.policy)
        try:
            chunk: list[BulkMessage] = []
            read: Counter[str] = Counter()
            for m in rows:
                if self.failed_keys and m.key is not None and (m.topic, m.key) in self.failed_keys:
                    read[m.topic] += 1
                    continue  # stays pending, untouched: its key must wait for the failed row
                chunk.append(m)
                if len(chunk) >= self.cfg.mark_batch:
                    read.update(m.topic for m in chunk)
                    self._send(loop, chunk)
                    chunk = []
            read.update(m.topic for m in chunk)
            self._send(loop, chunk)
            for topic, n in read.items():
                self._count(topic, 0, n)
        finally:
            loop.close(10)
            if self._store is not None:
                self._store.close()
        out = []
        for topic, c in self.counts.items():
            c[4] = c[0] - c[1] - c[2] - c[3]  # left pending, untouched (key waiting, or unacknowledged)
            out.append((topic, c[0], c[1], c[2], c[3], c[4]))
        return out


def _noting_groups(batches: Iterator[pa.RecordBatch], groups: GroupSpans) -> Iterator[pa.RecordBatch]:
    """The batches as they are, noting the groups (`grp`, `grp_n` > 1) their messages belong to."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for b in batches:
        if "grp_n" in b.schema.names:
            of_groups = b.filter(pc.greater(b.column("grp_n"), 1)).select(["grp", "grp_n"])
            if of_groups.num_rows:
                found = pa.Table.from_batches([of_groups]).group_by("grp").aggregate([("grp_n", "max")])
                for gid, size in zip(found.column("grp").to_pylist(), found.column("grp_n_max").to_pylist(),
                                     strict=True):
                    groups.add(gid, size)
        yield b


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
    counts = sender.run(messages(_noting_groups(batches, sender.groups), blockers))
    cols: list[pa.Array] = [
        pa.array(list(c), type=pa.string() if i == 0 else pa.int64())
        for i, c in enumerate(zip(*counts, strict=True) if counts else [()] * len(COUNT_NAMES))
    ]
    nulls = [None] * len(counts)
    split = sender.split
    ids = [held for _, held in split.values()]
    offsets = np.cumsum([0, *(len(i) for i in ids)], dtype=np.int32)
    flat = np.concatenate([np.frombuffer(i, dtype=np.int64) for i in ids]) if ids else np.zeros(0, np.int64)
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
    with open_outbox(cfg.outbox_url, create=False) as store:
        settlement = Settlement()
        for done in held.values():
            settlement.delivered.extend(done)  # a group's messages stay in one settlement
            if len(settlement.delivered) >= cfg.mark_batch:
                store.apply(settlement, now=time.time())
                settlement = Settlement()
        if settlement:
            store.apply(settlement, now=time.time())
