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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from outbox.retry import RetryPolicy
from outbox.sendloop import SendLoop
from outbox.settle import Verdict, add_to
from outbox.stores import open_outbox
from outbox.stores.base import Outbox, Settlement
from outbox.stores.bulk import BulkMessage
from spark_drain.batches import messages

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


class PartitionSender:
    """Sends one partition's rows; `run()` returns per-topic counts."""

    def __init__(self, cfg: SendConfig) -> None:
        self.cfg = cfg
        self.policy = cfg.policy()
        self.counts: dict[str, list[int]] = {}
        self.failed_keys: set[tuple[str, bytes]] = set()
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

    def _send(self, loop: SendLoop, chunk: list[BulkMessage]) -> None:
        """Send one chunk with the SDK's send loop; apply its decisions in one transaction."""
        if not chunk:
            return
        decided = loop.send(chunk, time.time)
        now = time.time()
        settlement = Settlement()
        for row, d in decided:
            add_to(settlement, row.id, d, now)
            if d.verdict is Verdict.RESCHEDULE and row.key is not None:
                # This row will be sent again later: its key's later rows must wait for it.
                self.failed_keys.add((row.topic, row.key))
        dead = {r.id for r in self.store.apply(settlement, now=now).dead}
        for row, d in decided:
            if d.verdict is Verdict.DELIVERED:
                self._count(row.topic, 1)
            elif d.verdict is not Verdict.RELEASE:
                self._count(row.topic, 3 if row.id in dead else 2)
        unknown = len(chunk) - len(decided)
        if unknown:
            log.warning("spark_drain: %d messages unacknowledged at the end; they stay pending", unknown)

    def run(self, rows: Iterable[BulkMessage]) -> list[tuple[str, int, int, int, int, int]]:
        """Send the messages (in id order per key); return per-topic counts."""
        loop = SendLoop(dict(self.cfg.producer_config), self.policy)
        try:
            chunk: list[BulkMessage] = []
            for m in rows:
                self._count(m.topic, 0)
                if m.key is not None and (m.topic, m.key) in self.failed_keys:
                    continue  # stays pending, untouched: its key must wait for the failed row
                chunk.append(m)
                if len(chunk) >= self.cfg.mark_batch:
                    self._send(loop, chunk)
                    chunk = []
            self._send(loop, chunk)
        finally:
            loop.close(10)
            if self._store is not None:
                self._store.close()
        out = []
        for topic, c in self.counts.items():
            c[4] = c[0] - c[1] - c[2] - c[3]  # left pending, untouched (key waiting, or unacknowledged)
            out.append((topic, c[0], c[1], c[2], c[3], c[4]))
        return out


def send_batches(
    cfg: SendConfig,
    blockers: Mapping[tuple[str, bytes], int] | None,
    batches: Iterator[pa.RecordBatch],
) -> Iterator[pa.RecordBatch]:
    """`mapInArrow` body over one send task's message batches (`spark_drain.batches.MESSAGES`),
    in id order, every message of a key in this task: send them, yield one batch of per-topic
    counts (`spark_drain.batches.COUNTS`)."""
    import pyarrow as pa

    counts = PartitionSender(cfg).run(messages(batches, blockers))
    names = ("topic", "read", "delivered", "failed", "dead", "left")
    types = (pa.string(), pa.int64(), pa.int64(), pa.int64(), pa.int64(), pa.int64())
    cols = list(zip(*counts, strict=True)) if counts else [()] * len(names)
    yield pa.RecordBatch.from_arrays(
        [pa.array(list(c), type=t) for c, t in zip(cols, types, strict=True)], names=list(names)
    )
