"""Drain workers: claim due rows, send them, acknowledge what Kafka acknowledged.

Each worker owns a producer and loops: claim a batch with a lease (one short transaction),
produce it with no transaction open, wait for every delivery report, then delete the delivered
rows and reschedule or dead-letter the failed ones (one short transaction). Retry state lives in
the row, so workers never sleep per message and a crashed worker's rows come back when their
lease expires.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from .errors import KafkaUnavailableError
from .headers import for_resend
from .logs import LIBRDKAFKA_LOG
from .owners import new_owner
from .records import DeadLetter, OutboxMessage
from .retry import BATCH_SIZE_CODES, Disposition, RetryPolicy, describe
from .stores.base import Failure, Outbox

log = logging.getLogger(__name__)

#: Settings the drain producers use unless the caller's config says otherwise.
DRAIN_DEFAULTS: Mapping[str, Any] = {
    "enable.idempotence": True,  # resends within one batch cannot reorder or duplicate
    "acks": "all",
    "linger.ms": 5,
    "message.timeout.ms": 30000,
}


@dataclass
class DrainResult:
    """Counts of one `Drainer.run()` (or of a running drainer so far)."""

    delivered: int = 0
    retried: int = 0
    dead: int = 0
    released: int = 0
    remaining: int = 0
    due_remaining: int = 0
    started_at: float = field(default_factory=time.time)

    @property
    def rate(self) -> float:
        """Delivered messages per second since the start."""
        elapsed = time.time() - self.started_at
        return self.delivered / elapsed if elapsed > 0 else 0.0


@dataclass
class _Batch:
    """Delivery reports of one claimed batch, filled by the producer's callbacks."""

    acked: list[OutboxMessage] = field(default_factory=list)
    failed: list[tuple[OutboxMessage, KafkaError]] = field(default_factory=list)
    purged: list[int] = field(default_factory=list)
    rejected: list[tuple[OutboxMessage, KafkaError]] = field(default_factory=list)  # refused by produce()


class Drainer:
    """Sends the outbox's due messages to Kafka under a retry policy.

    Args:
        store: the outbox.
        producer_config: confluent_kafka settings (bootstrap.servers, security, ...); passed
            through, on top of `DRAIN_DEFAULTS`.
        retry: decides the next attempt or the dead letter after each failed send.
        workers: threads, each with its own producer.
        batch_size: rows claimed per transaction.
        lease_seconds: how long a claimed row stays with this worker; must exceed the time to
            send a batch (message.timeout.ms). A crashed worker's rows are due again after it.
        poll_interval: longest sleep when nothing is due.
        topic: drain only this topic.
        on_delivered: called with the rows of each batch Kafka acknowledged, on a worker thread.
        on_dead_letter: called with a DeadLetter for each row dead-lettered, on a worker thread.
        on_success / on_failure: called once per delivered / failed send (the producer's circuit
            breaker listens to these: a drain success proves the cluster is back).
        owner: lease owner name; default `outbox.owners.new_owner("drain")`, whose liveness
            claimers can check (see outbox.owners). Other names keep leases until expiry.
    """

    def __init__(
        self,
        store: Outbox,
        producer_config: Mapping[str, Any],
        *,
        retry: RetryPolicy | None = None,
        workers: int = 1,
        batch_size: int = 1000,
        lease_seconds: float = 120.0,
        poll_interval: float = 0.5,
        topic: str | None = None,
        on_delivered: Callable[[list[OutboxMessage]], None] | None = None,
        on_dead_letter: Callable[[DeadLetter], None] | None = None,
        on_success: Callable[[], None] | None = None,
        on_failure: Callable[[], None] | None = None,
        owner: str | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.store = store
        self.retry = retry or RetryPolicy()
        self.workers = workers
        self.batch_size = batch_size
        self.lease_seconds = lease_seconds
        self.poll_interval = poll_interval
        self.topic = topic
        self.on_delivered = on_delivered
        self.on_dead_letter = on_dead_letter
        self.on_success = on_success
        self.on_failure = on_failure
        self.owner = owner or new_owner("drain")
        self._config = {**DRAIN_DEFAULTS, "logger": LIBRDKAFKA_LOG, **producer_config}
        self._config.pop("on_delivery", None)
        self._config.pop("delivery.report.only.error", None)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.result = DrainResult()
        self._wakeup = threading.Event()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Run the workers in background threads until `stop()`."""
        self._stop.clear()
        for i in range(self.workers):
            t = threading.Thread(
                target=self._worker, args=(False, None), name=f"outbox-drain-{i}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float | None = None) -> None:
        """Stop the workers: the batch in flight is settled, unsent leases are released."""
        self._stop.set()
        self._wakeup.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]

    def wake(self) -> None:
        """Look for due rows now instead of at the next poll (new rows were just stored)."""
        self._wakeup.set()

    def run(
        self,
        *,
        until_empty: bool = True,
        max_messages: int | None = None,
        stop: threading.Event | None = None,
        progress: Callable[[DrainResult], None] | None = None,
    ) -> DrainResult:
        """Drain in the calling thread (and `workers - 1` more threads) and return the counts.

        Args:
            until_empty: return once no pending row is due; False keeps draining (follow mode)
                until `stop` is set.
            max_messages: stop after about this many messages were handled (delivered, retried
                or dead-lettered); whole batches are settled, so it may go over by a batch.
            stop: set it (e.g. from a signal handler) to stop cleanly: leases are released.
            progress: called after each settled batch with the running counts.
        """
        if stop is not None:
            threading.Thread(target=self._relay_stop, args=(stop,), daemon=True).start()
        self._stop.clear()
        self.result = DrainResult()
        limit = [max_messages]
        helpers = [
            threading.Thread(target=self._worker, args=(until_empty, limit, progress), daemon=True)
            for _ in range(self.workers - 1)
        ]
        for t in helpers:
            t.start()
        try:
            self._worker(until_empty, limit, progress)
        except BaseException:
            self._stop.set()
            raise
        finally:
            # until_empty: the other workers stop by themselves once nothing is due; setting
            # _stop before they finish would purge and release the batch they have in flight.
            if not until_empty:
                self._stop.set()
            for t in helpers:
                t.join()
            self._stop.set()
        st = self.store.stats(now=time.time())
        self.result.remaining = st.pending
        self.result.due_remaining = 0 if st.next_due_at is None or st.next_due_at > time.time() else 1
        return self.result

    def _relay_stop(self, stop: threading.Event) -> None:
        while not self._stop.is_set():
            if stop.wait(0.2):
                self._stop.set()
                self._wakeup.set()
                return

    def check_cluster(self, timeout: float = 10.0) -> None:
        """Raise KafkaUnavailableError unless a broker answers within `timeout` seconds."""
        servers = self._config.get("bootstrap.servers", "")
        probe = Producer(self._config)
        try:
            md = probe.list_topics(timeout=timeout)
        except KafkaException as exc:
            raise KafkaUnavailableError(
                f"no Kafka broker answered at {servers} within {timeout:g}s ({exc.args[0].name()})"
            ) from exc
        finally:
            probe.flush(0)
        if not md.brokers:
            raise KafkaUnavailableError(f"no Kafka broker is up at {servers}")

    # -- the worker loop ---------------------------------------------------------------------

    def _worker(
        self,
        until_empty: bool,
        limit: list[int | None] | None,
        progress: Callable[[DrainResult], None] | None = None,
    ) -> None:
        producer = Producer(self._config)
        try:
            while not self._stop.is_set():
                if limit is not None and limit[0] is not None:
                    with self._lock:
                        if limit[0] <= 0:
                            return
                        take = min(self.batch_size, limit[0])
                        limit[0] -= take
                else:
                    take = self.batch_size
                now = time.time()
                rows = self.store.claim(self.owner, take, self.lease_seconds, now=now, topic=self.topic)
                if not rows:
                    if limit is not None and limit[0] is not None:
                        with self._lock:
                            limit[0] += take
                    if until_empty:
                        return
                    self._sleep_until_due(now)
                    continue
                producer = self._send(producer, rows)
                if progress is not None:
                    progress(self.result)
        except Exception:
            log.exception("outbox drain worker %s failed; its leases expire and others take over", self.owner)
            raise
        finally:
            producer.flush(5)

    def _sleep_until_due(self, now: float) -> None:
        try:
            due = self.store.next_due_at()
        except Exception as exc:  # a store hiccup must not kill a background worker
            log.warning("outbox drain: cannot read the store: %s", exc)
            due = None
        wait = self.poll_interval if due is None else min(self.poll_interval, max(0.0, due - now))
        self._wakeup.wait(max(wait, 0.01))
        self._wakeup.clear()

    def _send(self, producer: Producer, rows: list[OutboxMessage]) -> Producer:
        batch = _Batch()
        report = functools.partial(self._report, batch)
        for n, row in enumerate(rows):
            if n % 500 == 0:
                producer.poll(0)  # serve reports now and then; one poll per message costs ~20 us
            headers = for_resend(
                row.headers,
                msg_id=row.msg_id,
                attempt=row.attempts + 1,
                first_failed_at=row.first_failed_at,
                last_error=row.last_error,
            )
            kwargs: dict[str, Any] = {"headers": headers, "on_delivery": functools.partial(report, row)}
            if row.partition >= 0:
                kwargs["partition"] = row.partition
            while True:
                try:
                    producer.produce(row.topic, row.value, row.key, **kwargs)
                    break
                except BufferError:
                    producer.poll(0.05)  # local queue full: let deliveries drain it
                except KafkaException as exc:  # rejected locally, e.g. larger than message.max.bytes
                    batch.rejected.append((row, exc.args[0]))
                    break
        # Every row gets a report within message.timeout.ms; stopping early purges the queue so
        # the unsent rows come back as _PURGE_QUEUE and are released, not counted as failures.
        while len(producer) > 0:
            producer.poll(0.1)
            if self._stop.is_set() and len(producer) > 0:
                producer.purge(in_queue=True, in_flight=False)
                producer.poll(0.1)
                producer.flush(30)
                break
        return self._settle(producer, batch)

    @staticmethod
    def _report(batch: _Batch, row: OutboxMessage, err: KafkaError | None, msg: Message) -> None:
        if err is None:
            batch.acked.append(row)
        elif err.code() == KafkaError._PURGE_QUEUE:
            batch.purged.append(row.id)
        else:
            batch.failed.append((row, err))

    def _resend_alone(self, producer: Producer, batch: _Batch) -> None:
        """Re-send, one at a time, rows whose record batch was too large for the broker.

        Only a row that fails on its own keeps the error; its innocent batch-mates get delivered.
        """
        suspects = [(row, err) for row, err in batch.failed if err.code() in BATCH_SIZE_CODES]
        if not suspects:
            return
        batch.failed = [(row, err) for row, err in batch.failed if err.code() not in BATCH_SIZE_CODES]
        for row, _ in suspects:
            alone = _Batch()
            kwargs: dict[str, Any] = {
                "headers": for_resend(row.headers, msg_id=row.msg_id, attempt=row.attempts + 1,
                                      first_failed_at=row.first_failed_at, last_error=row.last_error),
                "on_delivery": functools.partial(self._report, alone, row),
            }
            if row.partition >= 0:
                kwargs["partition"] = row.partition
            try:
                producer.produce(row.topic, row.value, row.key, **kwargs)
            except KafkaException as exc:
                alone.failed.append((row, exc.args[0]))
            producer.flush()  # a lone message: its report arrives within message.timeout.ms
            batch.acked += alone.acked
            batch.failed += alone.failed
            batch.purged += alone.purged

    def _settle(self, producer: Producer, batch: _Batch) -> Producer:
        self._resend_alone(producer, batch)
        batch.failed += batch.rejected
        now = time.time()
        failures: list[Failure] = []
        fatal = False
        for row, err in batch.failed:
            disposition = self.retry.classify(err.code())
            fatal = fatal or disposition is Disposition.FATAL
            retry_at: float | None = None
            if disposition is not Disposition.DEAD:
                decision = self.retry.decide(row.attempts + 1, row.first_failed_at or now, now)
                retry_at = None if decision.give_up else now + decision.delay
            failures.append(Failure(id=row.id, error=describe(err), retry_at=retry_at, failed_at=now))
        acked_ids = [r.id for r in batch.acked]
        _, dead = self.store.commit_batch([], acked_ids, failures, lease_owner=None, lease_until=None)
        if batch.purged:
            self.store.release(batch.purged, now=now)
        with self._lock:
            self.result.delivered += len(batch.acked)
            self.result.retried += len(failures) - len(dead)
            self.result.dead += len(dead)
            self.result.released += len(batch.purged)
        if batch.acked and self.on_success is not None:
            self.on_success()
        if failures and self.on_failure is not None and not batch.acked:
            self.on_failure()
        if self.on_delivered is not None and batch.acked:
            self.on_delivered(batch.acked)
        if self.on_dead_letter is not None:
            for row in dead:
                try:
                    self.on_dead_letter(DeadLetter.from_row(row))
                except Exception:
                    log.exception("on_dead_letter callback raised; the dead letter is stored anyway")
        if failures:
            log.info(
                "outbox drain: %d delivered, %d to retry, %d dead-lettered in this batch (last error: %s)",
                len(batch.acked), len(failures) - len(dead), len(dead), failures[-1].error,
            )
        if fatal:
            log.warning("outbox drain: fatal producer error; recreating the producer")
            producer.flush(5)
            return Producer(self._config)
        return producer
