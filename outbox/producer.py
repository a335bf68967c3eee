"""ResilientProducer: a confluent_kafka producer that stores what Kafka could not take.

This module is the router: it checks a message once and sends it down one path.

- `outbox.firstsend`: fallback mode's first send, and what a failed one becomes;
- `outbox.spill`: the way into the outbox (per-key order, hold-back, group-commit writer);
- `outbox.writeahead`: write-ahead mode (stored first, sent from the writer thread);
- `outbox.link`: the librdkafka producer and its delivery thread;
- `outbox.fates`: the callbacks of stored messages, once delivered or dead-lettered;
- `outbox.drain` / `outbox.drainproc`: the drain workers that re-send stored messages.

Threads: the caller's threads call `produce()`; one delivery thread polls librdkafka and runs
every callback (`on_delivery`, `on_dead_letter` for first-send failures); the group-commit
writer thread writes the outbox and, in write-ahead mode, sends committed rows; the key thread
releases keys whose stored messages are delivered; the drain worker threads re-send stored rows
and run callbacks for the messages they deliver or dead-letter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import exithook
from .budget import DEFAULT_MEMORY_BUDGET, MemoryBudget
from .circuit import CircuitBreaker
from .drain import DEFAULT_BATCH_SIZE, Drainer
from .drainproc import DrainProcess
from .errors import ConfigError, ProducerClosedError, StoreError
from .fates import DeadLetterCallback, DeliveryCallback, Fates
from .firstsend import FirstSend
from .headers import ID_HEADER, IdGenerator
from .link import KafkaLink, queue_limits
from .logs import LIBRDKAFKA_LOG
from .owners import new_owner
from .payload import (
    BYTES_LIKE,
    KNOWN_TOPICS,
    as_bytes,
    check_partition,
    check_payload,
    check_timestamp,
    check_topic,
    normalize_headers,
)
from .records import Headers, NewMessage, StoreStats
from .retry import RetryPolicy
from .sendloop import check_resend_config
from .serialization import Serializer, Serializers
from .spill import NOT_SENT_CIRCUIT_OPEN, Spill
from .stores import Outbox, open_outbox
from .writeahead import WriteAhead
from .writer import Committed, GroupCommitWriter

__all__ = ["PRODUCER_DEFAULTS", "DeadLetterCallback", "DeliveryCallback", "ResilientProducer"]

log = logging.getLogger("outbox")

#: Defaults for the wrapped producer; any key the caller sets wins.
PRODUCER_DEFAULTS: Mapping[str, Any] = {
    # librdkafka's default is 300 s: five minutes of messages held in memory, lost if the
    # process dies, before the application hears of a failure. The outbox takes over sooner.
    "message.timeout.ms": 30000,
}

_MODES = ("fallback", "write-ahead")
_DURABILITY = ("batch", "sync")
_DRAIN_IN = ("threads", "process")

#: The default `exit_timeout` (seconds). Half of it (`_DELIVERY_SHARE`) lets a healthy cluster
#: acknowledge what is on the wire; the other half commits the largest backlog the writer holds
#: (`memory_budget`, 16 MiB by default: at most ~20,000 small messages, well under a second of
#: SQLite inserts on a 2-core machine). Short
#: enough to leave most of an orchestrator's stop grace period (Kubernetes' 30 s by default) to
#: the rest of the application's shutdown.
DEFAULT_EXIT_TIMEOUT = 10.0
#: The share of a bounded close() spent waiting for deliveries; the rest is kept for moving what
#: is still undelivered to the outbox (committing it is what must not be cut short).
_DELIVERY_SHARE = 0.5


class ResilientProducer:
    """A Kafka producer that writes what it cannot deliver to a durable outbox.

    Args:
        config: confluent_kafka.Producer settings, passed through unchanged except that
            `message.timeout.ms` defaults to 30000 (librdkafka: 300000). Its `error_cb`,
            `throttle_cb`, `stats_cb` and `oauth_cb` serve every librdkafka client the producer
            runs: its own and each drain worker's (in the drain process with
            `drain_in="process"`); `stats_cb` tells them apart by the statistics' `name`. On a
            drain worker a callback that raises is logged and counted in
            `stats()["callback_errors"]` and never ends the worker. Settings the drain workers'
            producers cannot use (see `outbox.sendloop.check_resend_config`) raise ConfigError.
            `delivery.report.only.error: True` means what it means in librdkafka:
            `on_delivery` hears failures only (and in fallback mode librdkafka reports no
            success, which makes each send cheaper).
        outbox: an outbox URL (``sqlite:///path.db``, ``jdbc:sqlite:/path.db``,
            ``postgresql://...``, ``jdbc:postgresql://...``) or an `Outbox` instance.
        retry: the retry policy for re-sends and the classification of errors.
        on_dead_letter: recovery callback, called once per dead-lettered message with a
            DeadLetter, after the dead letter is stored.
        mode: "fallback" (Kafka first, only failures stored) or "write-ahead" (every message
            committed to the outbox before it is sent).
        durability: write-ahead only: "batch" (produce() returns at once; the message is
            committed within `commit_interval` plus one commit) or "sync" (produce() returns once
            the message is committed).
        drain_workers: background threads re-sending stored messages (0: none; run
            `outbox drain` elsewhere).
        drain_in: "threads" (in this process) or "process": the drain workers run in a child
            process of their own (`outbox.drainproc`), so re-sending does not share this
            process's interpreter lock with the application; callbacks still run here. Needs
            `outbox` as a URL and settings that pickle (a retry policy's callables must be
            module-level functions of an importable module).
        id_header: name of the message id header (default "outbox-id"); None sends no id header
            on the first attempt (faster, but consumers cannot dedup a first-send duplicate).
        circuit_failure_threshold: consecutive failed deliveries that open the circuit.
        circuit_reset_timeout: seconds before an open circuit lets a probe message through.
        queue_full_timeout: how long produce() waits for room when librdkafka's local queue is
            full while the circuit is closed (Kafka's back-pressure, like the Java producer's
            `max.block.ms`), before it stores the message in the outbox instead. Once a wait
            found no room, later calls store at once until the cluster delivers again, so a
            cluster that hangs stalls one call, not each. 0: store at once, never wait.
        commit_interval: how long the writer gathers messages before a commit (seconds).
        lease_seconds: how long a drain worker or write-ahead send owns a row.
        drain_batch_size: rows claimed per drain transaction.
        drain_poll_interval: longest pause of an idle drain worker.
        on_store_error: called (on a drain thread) with each StoreError the drain workers met
            and survived: they back off and retry, and `stats()` counts them in `store_errors`.
        key_serializer, value_serializer: ``serializer(obj, ctx) -> bytes | None``, e.g.
            confluent_kafka.serialization's or the Schema Registry serializers; called once in
            produce(), before anything is sent or stored (see outbox.serialization).
        memory_budget: bytes of messages the producer may hold in memory on their way to the
            outbox (hold-back, key gate, group-commit writer; each message counts its value,
            key and headers plus a fixed overhead, `outbox.budget`). Past it, produce() waits
            for the outbox to commit, as when the store is slow. Default 16 MiB. librdkafka's
            queue gets a quarter of it in payload (`queue.buffering.max.kbytes`, unless the
            config sets it), and what it may hand back when the circuit opens is kept free; the
            drain threads claim at most a quarter of it per batch.
        exit_timeout: seconds allowed at interpreter exit, for a producer that was never
            closed, to deliver and then commit to the outbox every accepted message still in
            memory (`outbox.exithook`; the count is logged). Default 10. A `kill -9` runs no
            exit hook: write-ahead mode is the answer to that.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        outbox: str | Outbox = "sqlite:///outbox.db",
        retry: RetryPolicy | None = None,
        on_dead_letter: DeadLetterCallback | None = None,
        mode: str = "fallback",
        durability: str = "batch",
        drain_workers: int = 2,
        drain_in: str = "threads",
        id_header: str | None = ID_HEADER,
        circuit_failure_threshold: int = 5,
        circuit_reset_timeout: float = 5.0,
        queue_full_timeout: float = 0.5,
        commit_interval: float = 0.002,
        lease_seconds: float = 120.0,
        drain_batch_size: int = DEFAULT_BATCH_SIZE,
        drain_poll_interval: float = 0.5,
        on_store_error: Callable[[StoreError], None] | None = None,
        key_serializer: Serializer | None = None,
        value_serializer: Serializer | None = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        exit_timeout: float = DEFAULT_EXIT_TIMEOUT,
    ) -> None:
        if not isinstance(config, Mapping):
            raise ConfigError("config must be a dict of confluent_kafka settings")
        if mode not in _MODES:
            raise ConfigError(f"mode must be one of {_MODES}, got {mode!r}")
        if durability not in _DURABILITY:
            raise ConfigError(f"durability must be one of {_DURABILITY}, got {durability!r}")
        if drain_workers < 0:
            raise ConfigError(f"drain_workers must be >= 0, got {drain_workers}")
        if not queue_full_timeout >= 0:  # also refuses NaN
            raise ConfigError(f"queue_full_timeout must be >= 0 seconds, got {queue_full_timeout!r}")
        if not (isinstance(exit_timeout, int | float) and exit_timeout >= 0):  # also refuses NaN
            raise ConfigError(f"exit_timeout must be a number of seconds >= 0, got {exit_timeout!r}")
        if drain_in not in _DRAIN_IN:
            raise ConfigError(f"drain_in must be one of {_DRAIN_IN}, got {drain_in!r}")
        if memory_budget.__class__ is not int or memory_budget < 1:
            raise ConfigError(f"memory_budget must be a positive number of bytes (int), got {memory_budget!r}")
        if drain_in == "process" and isinstance(outbox, Outbox):
            raise ConfigError("drain_in='process' needs the outbox as a URL: the drain process opens it itself")
        self._serializers = Serializers.of(key_serializer, value_serializer)
        self.mode = mode
        self.durability = durability
        self.retry = retry or RetryPolicy()
        self._id_header = id_header
        self._ids = IdGenerator()
        self._next_id = self._ids.next
        config = dict(config)
        if drain_workers > 0:  # before anything starts: a worker whose producer is refused never runs
            check_resend_config(config)
        user_error_cb = config.pop("error_cb", None)
        self._config = {**PRODUCER_DEFAULTS, **config}
        self._config.setdefault("logger", LIBRDKAFKA_LOG)  # librdkafka's lines to logging, summarised
        self._config.pop("on_delivery", None)  # every message carries its own callback
        rdkafka_queue, rdkafka_reserve = queue_limits(self._config, memory_budget)
        self._config.update(rdkafka_queue)
        self.memory = MemoryBudget(memory_budget, reserve=rdkafka_reserve)
        # Successes are reported to on_delivery unless the application opts out, as in librdkafka.
        # Write-ahead rows are deleted on their success report, so that mode always asks for them.
        report_successes = not _is_true(self._config.pop("delivery.report.only.error", False))
        self._config["delivery.report.only.error"] = mode == "fallback" and not report_successes
        self._message_timeout = int(self._config["message.timeout.ms"]) / 1000
        lease_seconds = max(lease_seconds, self._message_timeout + 5)  # a lease must outlive one send attempt
        self._owns_store = not isinstance(outbox, Outbox)
        self.store = open_outbox(outbox)
        self._closed = False
        self._exit_timeout = float(exit_timeout)
        self._in_transaction = 0
        # Keyed messages may probe a half-open circuit only when no drain worker of this process
        # does (a drain delivery closes the circuit too): a keyed probe that fails is stored after
        # later messages of its key (README, per-key order).
        self._keyed_probes = drain_workers == 0
        self.circuit = CircuitBreaker(
            failure_threshold=circuit_failure_threshold,
            reset_timeout=circuit_reset_timeout,
            on_open=self._circuit_opened,
        )
        # The parts, wired once. Two calls go to a part built later, through a lambda: the fates
        # tell the key backlog (in the spill) of drained keys, and the backlog hands keys back
        # through the first sends. No thread calls either before every part is built: the
        # delivery and key threads start below, the writer commits only what produce() queues.
        self._fates = Fates(
            on_dead_letter,
            report_successes=report_successes,
            keys_drained=lambda keys: self._spill.backlog.drained(keys),
        )
        drain_config = {k: v for k, v in config.items() if k != "on_delivery"}
        if user_error_cb is not None:
            drain_config["error_cb"] = user_error_cb
        drain_settings: dict[str, Any] = dict(
            retry=self.retry,
            workers=max(drain_workers, 1),
            batch_size=drain_batch_size,
            lease_seconds=lease_seconds,
            poll_interval=drain_poll_interval,
            on_delivered=self._fates.drained,
            on_dead_letter=self._fates.drain_dead,
            on_success=self.circuit.record_success,
            on_store_error=on_store_error,
        )
        self.drainer: Drainer | DrainProcess
        if drain_in == "process" and drain_workers > 0:
            assert isinstance(outbox, str)
            try:
                self.drainer = DrainProcess(outbox, drain_config, **drain_settings)
            except ConfigError:
                self.store.close()
                raise
        else:
            # Claims bounded in bytes too: a drain thread's batches share this process's memory
            # (a drain process has its own).
            self.drainer = Drainer(self.store, drain_config, batch_bytes=memory_budget // 4, **drain_settings)
        self._link = KafkaLink(
            self._config, self.circuit, queue_full_timeout=queue_full_timeout, user_error_cb=user_error_cb
        )
        self.writer = GroupCommitWriter(
            self.store,
            owner=new_owner("producer"),
            lease_seconds=lease_seconds,
            max_delay=commit_interval,
            budget=self.memory,
            after_commit=self._after_commit,
        )
        fallback = mode == "fallback"
        self._spill = Spill(
            self.store, self.writer, self._link, self.circuit, self._fates,
            # Fallback mode hands keys back to the fast path through a gate (keyorder.py);
            # write-ahead stores every message anyway.
            send_held=(lambda key, held: self._first.send_held(key, held)) if fallback else None,
        )
        self._backlog = self._spill.backlog  # produce()'s first check, one attribute away
        self._first = FirstSend(
            self._link, self._spill, self.writer, self.circuit, self.retry,
            wake_drain=self.drainer.wake, id_header=id_header, report_successes=report_successes,
        )
        self._write_ahead = WriteAhead(
            self._link, self._spill, self.writer, self.circuit, self._fates, self.retry,
            durability=durability, report_successes=report_successes,
        )
        self._link.start(tick=self._spill.tick)
        self._backlog.start()
        if drain_workers > 0:
            try:
                self.drainer.start()
            except BaseException:  # the drain process could not start: nothing may keep running
                self.close(5)
                raise
        exithook.remember(self)  # last: only a producer whose every part runs is closed at exit

    @property
    def on_dead_letter(self) -> DeadLetterCallback | None:
        """The recovery callback: called once per dead-lettered message, after it is stored."""
        return self._fates.on_dead_letter

    @on_dead_letter.setter
    def on_dead_letter(self, callback: DeadLetterCallback | None) -> None:
        self._fates.on_dead_letter = callback

    # -- the public API ----------------------------------------------------------------------

    def produce(
        self,
        topic: str,
        value: Any = None,
        key: Any = None,
        headers: Sequence[tuple[str, bytes | str | None]] | Mapping[str, bytes | str | None] | None = None,
        partition: int | None = None,
        on_delivery: DeliveryCallback | None = None,
        enable_retry: bool = True,
        *,
        transaction: Any = None,
        timestamp: int = 0,
    ) -> str:
        """Send a message to Kafka, or store it in the outbox if Kafka cannot take it now.

        Args:
            topic: topic name (Kafka's rules: [a-zA-Z0-9._-], 1..249 characters).
            value, key: bytes, str (sent as UTF-8) or None; with a value_serializer /
                key_serializer, any object it accepts. Typed ``Any`` because what is accepted
                depends on the serializers given to the constructor, which a static type of
                this method cannot see (a generic producer class would be the alternative, at
                the cost of a type parameter on every annotation); the check is at run time:
                without a serializer anything else raises TypeError, with one its error raises
                Key/ValueSerializationError, and nothing is stored or sent.
            headers: list of (name, value) pairs (order and duplicates kept) or a dict.
            partition: explicit partition, or None/-1 for the partitioner.
            on_delivery: ``callback(err, msg)``, called at most once with the message's final
                fate: delivered (err None), dead-lettered, or failed with enable_retry=False.
                Runs on the producer's delivery thread or a drain thread: keep it short and
                do not call flush()/close() from it. For a message delivered from the outbox,
                ``msg`` is None.
            enable_retry: False: a failed send is reported to on_delivery and never stored.
            transaction: a psycopg connection with an open transaction (PostgreSQL outbox
                only): the message is written to the outbox inside it, so it exists if and only
                if the caller's transaction commits; drain workers deliver it.
            timestamp: the record timestamp, ms since the epoch; 0 (default): the time of this
                call. Every send of the message, from the outbox too, carries it.

        Returns:
            The message id (the `outbox-id` header value).

        Raises:
            TypeError / ConfigError(ValueError): bad arguments; nothing was stored or sent.
            ProducerClosedError: the producer is closed.
        """
        if self._closed:
            raise ProducerClosedError("produce() called after close()")
        if topic.__class__ is not str or topic not in KNOWN_TOPICS:
            check_topic(topic)
        if self._serializers is not None:  # once, before the outbox: re-sends reuse the bytes
            value, key, headers = self._serializers(topic, value, key, headers)
        if value is not None and not isinstance(value, BYTES_LIKE):
            check_payload("value", value)
        if key is not None and not isinstance(key, BYTES_LIKE):
            check_payload("key", key)
        partition = -1 if partition is None else check_partition(partition)
        timestamp = check_timestamp(timestamp) if timestamp else 0  # None (or any false value): none given
        hdrs: Headers = normalize_headers(headers) if headers is not None else []
        msg_id = self._next_id()
        if self._id_header is not None:
            hdrs.append((self._id_header, msg_id.encode()))

        if transaction is not None:
            self._enqueue_in_transaction(transaction, topic, value, key, hdrs, partition, msg_id, timestamp)
            return msg_id
        if self.mode == "write-ahead" and enable_retry:
            self._write_ahead.write(topic, value, key, hdrs, partition, msg_id, on_delivery, timestamp)
            return msg_id
        if not enable_retry:
            self._first.send_unprotected(topic, value, key, hdrs, partition, on_delivery, timestamp)
            return msg_id
        # Key first: a message that must queue behind its key is no use as the circuit's probe.
        if self._backlog.pending and key is not None and self._spill.key_waits(
            topic, key, value, hdrs, partition, msg_id, on_delivery, timestamp
        ):
            return msg_id
        if not self.circuit.closed and not self._may_probe(key):
            self._spill.store_unsent(
                topic, value, key, hdrs, partition, msg_id, on_delivery, NOT_SENT_CIRCUIT_OPEN, timestamp, wait=True
            )
            return msg_id
        self._first.send(topic, value, key, hdrs, partition, msg_id, on_delivery, headers is not None, timestamp)
        return msg_id

    def poll(self, timeout: float = 0) -> int:
        """Compatibility with confluent_kafka: callbacks already run on the delivery thread."""
        if timeout:
            time.sleep(timeout)
        return 0

    def flush(self, timeout: float | None = None) -> int:
        """Wait until every message is delivered or safely in the outbox.

        Returns:
            How many messages are neither delivered nor committed to the outbox (0 on success).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            in_memory = len(self._link)
            held = self._spill.held()
            queued = self.writer.pending() + held
            if in_memory == 0 and queued == 0:
                return 0
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                # Write-ahead: what librdkafka holds is already committed, hence safe.
                return queued if self.mode == "write-ahead" else in_memory + queued
            if in_memory == 0 and held == 0:
                # Committing may hand write-ahead rows to librdkafka: look again afterwards.
                self.writer.flush(left)
                continue
            time.sleep(0.01 if left is None else min(0.01, left))

    def __len__(self) -> int:
        return len(self._link) + self.writer.pending() + self._spill.held()

    def stats(self) -> dict[str, Any]:
        """Counters and outbox state: see the README for each field."""
        now = time.time()
        try:
            store: StoreStats | None = self.store.stats(now=now)
        except StoreError:  # the store is down: the counters still answer; its fields read None
            store = None
        first_try = self._link.first_sends_delivered()  # once: two reads could disagree
        drain_delivered = self._fates.drain_delivered
        return {
            "produced": self._ids.issued,
            "delivered": first_try + drain_delivered,
            "delivered_first_try": first_try,
            "delivered_from_outbox": drain_delivered,
            "outboxed": self._spill.outboxed.value,
            "pending": None if store is None else store.pending,
            "retried": self.drainer.result.retried,
            "dead": None if store is None else store.dead,
            "dead_this_process": self._fates.dead + self.drainer.result.dead,
            "failed_no_retry": self._first.failed.value,
            "queue_full_waits": self._link.queue_full_waits.value,
            "store_errors": self.drainer.health.store_errors,
            "drain_restarts": self.drainer.restarts,
            "callback_errors": self.drainer.callback_errors.count,
            "store_failing_since": self.drainer.health.failing_since,
            "enqueued_in_transaction": self._in_transaction,
            "in_memory": len(self._link),
            "keys_waiting": len(self._backlog.pending),
            "unsaved": self.writer.pending() + self._spill.held(),
            "memory_held_bytes": self.memory.held(),
            "memory_held_peak": self.memory.peak_now(),
            "memory_budget": self.memory.limit,
            "circuit": self.circuit.state.value,
            "oldest_pending_age": (
                None if store is None or store.oldest_pending_at is None else now - store.oldest_pending_at
            ),
            "mode": self.mode,
            "outbox": self.store.location,
        }

    def close(self, timeout: float | None = None) -> int:
        """Flush, stop the drain workers and the delivery thread, close the outbox.

        With a `timeout`, deliveries get the first half of it. Then what librdkafka still holds,
        queued or on the wire, is purged and committed to the outbox with the rest of it (a
        message purged from the wire may have been delivered: it can arrive twice, with the same
        `outbox-id`, which beats losing it); messages not committed by then are counted in the
        return value.

        Returns:
            How many messages are neither delivered nor in the outbox (0 on a clean close).
        """
        if self._closed:
            return 0
        self._closed = True
        exithook.forget(self)
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        raised: Exception | None = None
        try:
            self.flush(None if timeout is None else timeout * _DELIVERY_SHARE)
        except Exception as exc:  # an application callback's error: raised once all is stored
            raised = exc
        kafka = self._link.kafka
        # Undelivered: librdkafka hands them back (_PURGE_QUEUE, _PURGE_INFLIGHT) for the outbox.
        # What flush() returns is counted now: once the delivery thread stops, len() grows with
        # the events librdkafka keeps queueing (a log line per failed connection), not messages.
        kafka.purge(in_queue=True, in_flight=True)
        budget = left()  # (a spent budget still serves the purge's reports that are ready)
        in_librdkafka = kafka.flush(5.0 if budget is None else min(budget, 5.0))
        self._backlog.close()
        self._link.stop()
        self._spill.release_held(force=True)
        # Commit before stopping the drain: a drain worker may wait for its batch on the wire,
        # and what is only in memory matters more than what is already stored.
        self.writer.flush(left())
        self.drainer.stop(left())
        unsaved = self.writer.close(left()) + in_librdkafka
        if self._owns_store:
            self.store.close()
        if unsaved:
            log.error("outbox: %d messages were neither delivered nor stored at close()", unsaved)
        if raised is not None:
            raise raised
        return unsaved

    def close_at_exit(self) -> None:
        """`outbox.exithook`: close within `exit_timeout` at interpreter exit, and log the counts."""
        committed = self.writer.committed_rows
        unsaved = self.close(self._exit_timeout)
        stored = self.writer.committed_rows - committed
        if unsaved:
            log.error(
                "outbox: at exit, %d accepted messages were lost: not committed to the outbox within "
                "exit_timeout=%gs (%d were)", unsaved, self._exit_timeout, stored,
            )
        elif stored:
            log.warning(
                "outbox: at exit, %d undelivered messages were committed to the outbox (%s); the next "
                "producer on it, or `outbox drain`, delivers them", stored, self.store.location,
            )

    def __enter__(self) -> ResilientProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- routing helpers ---------------------------------------------------------------------

    def _may_probe(self, key: Any) -> bool:
        """While the circuit is not closed: may this message go to Kafka as the probe?"""
        if self._spill.hold.active or (key is not None and not self._keyed_probes):
            return False
        return self.circuit.allow_probe()

    def _enqueue_in_transaction(
        self, conn: Any, topic: str, value: Any, key: Any, hdrs: Headers, partition: int, msg_id: str,
        timestamp: int,
    ) -> None:
        enqueue = self.store.enqueue_in_transaction if self.store.capabilities.transactional_enqueue else None
        if enqueue is None:
            raise ConfigError("transaction= needs a PostgreSQL outbox (postgresql:// or jdbc:postgresql:// URL)")
        now = time.time()
        msg = NewMessage(
            topic, as_bytes(value), as_bytes(key), hdrs, partition, msg_id, 0, None, None, now, None, None,
            timestamp or int(now * 1000),
        )
        enqueue(conn, [msg])
        # Not counted as "outboxed": the row exists only if the caller commits, which we cannot see.
        self._in_transaction += 1
        self.drainer.wake()

    def _after_commit(self, c: Committed) -> None:
        """Writer thread: committed rows. Send write-ahead rows; wake the drain; report dead letters."""
        if any(c.leased):
            self._write_ahead.send(c)
        if any(not leased for leased in c.leased):
            self.drainer.wake()
        self._fates.committed_dead(c)

    def _circuit_opened(self) -> None:
        # Move what waits in librdkafka's queue to disk now instead of at message.timeout.ms,
        # and hold later spills back until it has (holdback.py: per-key order). Write-ahead rows
        # are stored before they are sent, so their order never depends on this.
        if self.mode == "fallback":
            self._spill.hold.start(self._message_timeout + 1.0)
        self._link.purge_queue_soon()


def _is_true(setting: object) -> bool:
    """`delivery.report.only.error` as confluent_kafka takes it: a bool, nothing else."""
    if not isinstance(setting, bool):
        raise ConfigError(f"delivery.report.only.error must be True or False, got {setting!r}")
    return setting
