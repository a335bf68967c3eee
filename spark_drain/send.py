"""Executor side: send one Spark partition's rows to Kafka and mark exactly what Kafka acknowledged.

Runs inside Spark's Python workers, so it imports nothing from pyspark and takes its settings as
a small picklable `SendConfig`. One confluent_kafka producer per partition (idempotent,
acks=all): rows arrive sorted by id and all rows of a (topic, key) are in one partition, so a
key's messages leave in their original order.

Safety rules:
    * a row is deleted only after Kafka acknowledged it (`mark_delivered`, idempotent, in batches);
    * a failed send counts one attempt and follows the retry policy (`record_failures`), so a row
      Kafka rejects for good is dead-lettered instead of being retried forever;
    * after a retriable failure of a key, that key's later rows in this partition are not sent
      (they stay pending, untouched), so a later drain still sends the key in order;
    * anything not acknowledged by the end stays pending. A retried Spark task may re-send rows
      that were delivered but not yet marked: duplicates are possible, losses are not.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from outbox.codec import decode_headers
from outbox.headers import for_resend
from outbox.retry import Disposition, RetryPolicy, describe
from outbox.stores import open_outbox
from outbox.stores.base import Failure, Outbox

log = logging.getLogger(__name__)

#: Per-topic counter names, in report order.
COUNTERS = ("read", "delivered", "failed", "dead", "left")

#: Broker errors about a whole produce batch: Kafka fails *every* message of a record batch
#: that exceeds the topic's max.message.bytes, so small neighbours of one oversized row get
#: the same error. A row is dead-lettered for these only after it failed when sent alone.
BATCH_SIZE_CODES = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})


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


class _Row:
    """The fields of a row the delivery report needs (a slotted object: cheap per message)."""

    __slots__ = ("id", "topic", "key", "attempts", "first_failed_at", "send", "alone")

    def __init__(
        self, id: int, topic: str, key: bytes | None, attempts: int, first_failed_at: float | None,
        send: tuple[Any, ...],
    ):
        self.id = id
        self.topic = topic
        self.key = key
        self.attempts = attempts
        self.first_failed_at = first_failed_at
        self.send = send  # (value, partition, headers): to send it again alone
        self.alone = False


class PartitionSender:
    """Sends one partition's rows; `run()` returns per-topic counts."""

    def __init__(self, cfg: SendConfig) -> None:
        self.cfg = cfg
        self.policy = cfg.policy()
        self.counts: dict[str, list[int]] = {}
        self.acked: list[_Row] = []
        self.failed: list[tuple[_Row, int, str]] = []  # (row, error code, described error)
        self.failed_keys: set[tuple[str, bytes]] = set()
        self.suspects: list[_Row] = []  # failed with a batch-size error next to other rows
        self.fatal = False
        self._store: Outbox | None = None

    # -- bookkeeping -------------------------------------------------------------------------

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

    def _on_report(self, row: _Row, err: KafkaError | None, msg: Message) -> None:
        if err is None:
            self.acked.append(row)
        elif err.code() in BATCH_SIZE_CODES and not row.alone:
            self.suspects.append(row)  # maybe an innocent neighbour: send it again on its own
            if row.key is not None:
                self.failed_keys.add((row.topic, row.key))
        else:
            self._failed(row, err.code(), describe(err))

    def _failed(self, row: _Row, code: int, text: str) -> None:
        self.failed.append((row, code, text))
        disposition = self.policy.classify(code)
        if disposition is Disposition.FATAL:
            self.fatal = True
        if disposition is not Disposition.DEAD and row.key is not None:
            # This row will be sent again later: its key's later rows must wait for it.
            self.failed_keys.add((row.topic, row.key))

    def _mark(self) -> None:
        """Delete what Kafka acknowledged; record failures (retry or dead-letter)."""
        if self.acked:
            acked, self.acked = self.acked, []
            self.store.mark_delivered([r.id for r in acked])
            for r in acked:
                self._count(r.topic, 1)
        if self.failed:
            failed, self.failed = self.failed, []
            now = time.time()
            failures: list[Failure] = []
            for row, code, text in failed:
                retry_at: float | None = None
                if self.policy.classify(code) is not Disposition.DEAD:
                    decision = self.policy.decide(row.attempts + 1, row.first_failed_at or now, now)
                    retry_at = None if decision.give_up else now + decision.delay
                failures.append(Failure(id=row.id, error=text, retry_at=retry_at, failed_at=now))
            dead = {r.id for r in self.store.record_failures(failures)}
            for row, _, _ in failed:
                self._count(row.topic, 3 if row.id in dead else 2)

    # -- sending -----------------------------------------------------------------------------

    def _new_producer(self) -> Producer:
        return Producer(dict(self.cfg.producer_config))

    def run(self, rows: Iterable[Any]) -> list[tuple[str, int, int, int, int, int]]:
        """Send the rows (Spark Rows or tuples in `read.COLUMNS` order); return per-topic counts."""
        producer = self._new_producer()
        report = self._on_report
        produce = producer.produce
        try:
            for r in rows:
                (id_, msg_id, topic, key, value, headers, part, attempts, first_failed_at, last_error) = r
                self._count(topic, 0)
                if key is not None and (topic, key) in self.failed_keys:
                    continue  # stays pending, untouched: its key must wait for the failed row
                hdrs: Any = for_resend(
                    decode_headers(headers),
                    msg_id=msg_id,
                    attempt=attempts + 1,
                    first_failed_at=first_failed_at,
                    last_error=last_error,
                )
                row = _Row(id_, topic, key, attempts, first_failed_at, (value, part, hdrs))
                cb = functools.partial(report, row)
                while True:
                    try:
                        if part is not None and part >= 0:
                            produce(topic, value, key, partition=part, headers=hdrs, on_delivery=cb)
                        else:
                            produce(topic, value, key, headers=hdrs, on_delivery=cb)
                        break
                    except BufferError:
                        producer.poll(0.05)  # local queue full: let delivery reports drain it
                    except KafkaException as exc:  # rejected locally (too large, bad partition)
                        err: KafkaError = exc.args[0]
                        self._failed(row, err.code(), describe(err))
                        break
                producer.poll(0)
                if self.fatal:
                    # The idempotent producer is unusable: settle what it has, start a new one.
                    producer.flush(60)
                    self._mark()
                    producer = self._new_producer()
                    produce = producer.produce
                    self.fatal = False
                if len(self.acked) >= self.cfg.mark_batch or len(self.failed) >= self.cfg.mark_batch:
                    self._mark()
            # Every queued message gets a report within message.timeout.ms; wait a little longer.
            timeout = float(self.cfg.producer_config.get("message.timeout.ms", "300000")) / 1000 + 30
            unacked = producer.flush(timeout)
            suspects, self.suspects = self.suspects, []
            for row in sorted(suspects, key=lambda r: r.id):  # id order keeps each key's order
                # One at a time, each in its own request: a row that fails alone is too large
                # itself (dead letter); one that goes through was only a neighbour.
                row.alone = True
                value, part, hdrs = row.send
                kw: dict[str, Any] = {"partition": part} if part is not None and part >= 0 else {}
                try:
                    producer.produce(
                        row.topic, value, row.key, headers=hdrs, on_delivery=functools.partial(report, row), **kw
                    )
                except KafkaException as exc:
                    self._failed(row, exc.args[0].code(), describe(exc.args[0]))
                unacked = producer.flush(timeout)
            self._mark()
            if unacked:
                # Neither acknowledged nor failed: these rows stay pending, untouched.
                log.warning("spark_drain: %d messages unacknowledged at the end; they stay pending", unacked)
        except BaseException:
            # Mark what Kafka did acknowledge before the task dies, so a retry re-sends less.
            try:
                producer.flush(10)
                self._mark()
            except Exception:
                log.exception("spark_drain: could not mark acknowledged rows; a re-run re-sends them")
            raise
        finally:
            if self._store is not None:
                self._store.close()
        out = []
        for topic, c in self.counts.items():
            c[4] = c[0] - c[1] - c[2] - c[3]  # left pending, untouched (key waiting, or unacknowledged)
            out.append((topic, c[0], c[1], c[2], c[3], c[4]))
        return out


def send_partition(cfg: SendConfig, rows: Iterator[Any]) -> Iterator[tuple[str, int, int, int, int, int]]:
    """`mapPartitions` body: send the rows, yield (topic, read, delivered, failed, dead, left)."""
    yield from PartitionSender(cfg).run(rows)
