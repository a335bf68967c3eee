"""ResilientProducer: a confluent_kafka producer that stores what Kafka could not take.

Fast path (fallback mode, circuit closed): one `Producer.produce()` with the id header and one
small object that a failure report needs (`_Report`). With `delivery.report.only.error` a
success costs nothing more; without it, one call on the delivery thread. Only failures touch
the outbox.

Threads: the caller's threads call `produce()`; one delivery thread polls librdkafka and runs
every callback (`on_delivery`, `on_dead_letter` for first-send failures); the group-commit
writer thread writes the outbox and, in write-ahead mode, sends committed rows; the drain
worker threads re-send stored rows and run callbacks for the messages they deliver or
dead-letter.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from .circuit import CircuitBreaker, CircuitState
from .drain import DEFAULT_BATCH_SIZE, Drainer
from .drainproc import Drained, DrainProcess
from .errors import ConfigError, ProducerClosedError, StoreError
from .headers import ID_HEADER, IdGenerator, find
from .holdback import Holdback
from .keyorder import KeyBacklog
from .logs import LIBRDKAFKA_LOG
from .owners import new_owner
from .payload import BYTES_LIKE, KNOWN_TOPICS, as_bytes, check_partition, check_payload, check_topic, normalize_headers
from .records import DeadLetter, Headers, NewMessage, OutboxMessage, StoreStats
from .retry import UNREACHABLE_CODES, RetryPolicy, describe
from .serialization import Serializer, Serializers
from .settle import Decision, Verdict, settle
from .stores import Outbox, open_outbox
from .tally import Tally
from .writeahead import SentBatch, SentReport
from .writer import Committed, GroupCommitWriter

log = logging.getLogger("outbox")
# librdkafka's own log lines go to logging (not raw stderr), connection failures summarised.
_LIBRDKAFKA_LOG = LIBRDKAFKA_LOG

DeliveryCallback = Callable[[KafkaError | None, Message | None], None]
DeadLetterCallback = Callable[[DeadLetter], None]

#: Defaults for the wrapped producer; any key the caller sets wins.
PRODUCER_DEFAULTS: Mapping[str, Any] = {
    # librdkafka's default is 300 s: five minutes of messages held in memory, lost if the
    # process dies, before the application hears of a failure. The outbox takes over sooner.
    "message.timeout.ms": 30000,
}

_MODES = ("fallback", "write-ahead")
_new_tuple = tuple.__new__
_DURABILITY = ("batch", "sync")
_DRAIN_IN = ("threads", "process")
#: The last error of a message stored without a send attempt, by why it was not sent.
_NOT_SENT_CIRCUIT_OPEN = "not sent: circuit open"
_NOT_SENT_QUEUE_FULL = "not sent: local queue full"
_NOT_SENT_KEY_WAITS = "not sent: key has messages in the outbox"
#: How often a produce() waiting for room in librdkafka's full queue tries again (seconds).
_ROOM_CHECK_INTERVAL = 0.001


# `# type: ignore[arg-type]` on produce(headers=...): confluent-kafka's stubs type headers as
# list[tuple[str, str | bytes | None]], and list is invariant, so our list[tuple[str, bytes | None]]
# is rejected although every value is valid.


class ResilientProducer:
    """A Kafka producer that writes what it cannot deliver to a durable outbox.

    Args:
        config: confluent_kafka.Producer settings, passed through unchanged except that
            `message.timeout.ms` defaults to 30000 (librdkafka: 300000). An `error_cb` in it is
            still called. `delivery.report.only.error: True` means what it means in librdkafka:
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
        if drain_in not in _DRAIN_IN:
            raise ConfigError(f"drain_in must be one of {_DRAIN_IN}, got {drain_in!r}")
        if drain_in == "process" and isinstance(outbox, Outbox):
            raise ConfigError("drain_in='process' needs the outbox as a URL: the drain process opens it itself")
        self._serializers = Serializers.of(key_serializer, value_serializer)
        self.mode = mode
        self.durability = durability
        self.retry = retry or RetryPolicy()
        self.on_dead_letter = on_dead_letter
        self._id_header = id_header
        self._ids = IdGenerator()
        self._next_id = self._ids.next
        self._user_error_cb = config.get("error_cb")
        self._config = {**PRODUCER_DEFAULTS, **config}
        self._config["error_cb"] = self._on_error
        self._config.setdefault("logger", _LIBRDKAFKA_LOG)
        self._config.pop("on_delivery", None)  # every message carries its own callback
        # Successes are reported to on_delivery unless the application opts out, as in librdkafka.
        # Write-ahead rows are deleted on their success report, so that mode always asks for them.
        self._report_successes = not _is_true(self._config.pop("delivery.report.only.error", False))
        self._config["delivery.report.only.error"] = mode == "fallback" and not self._report_successes
        lease_floor = int(self._config["message.timeout.ms"]) / 1000 + 5
        lease_seconds = max(lease_seconds, lease_floor)  # a lease must outlive one send attempt
        self._owns_store = not isinstance(outbox, Outbox)
        self.store = open_outbox(outbox)
        self._closed = False
        # Counters: each is written by one thread only, so plain ints are enough; `_handed` is
        # bumped by every thread that calls produce().
        self._handed = Tally()  # messages librdkafka took from us (first sends, write-ahead sends)
        self._send_failures = 0  # failure reports of those
        self._done_seen = 0
        self._queue_full_timeout = queue_full_timeout
        self._queue_full_waits = Tally()  # produce() calls that waited for room in librdkafka's queue
        # Set when a wait for room ended without any; cleared by the delivery thread at the next
        # delivery (`_note_progress`).
        self._queue_stalled = False
        self._outboxed = 0
        self._dead = 0
        self._failed = 0
        self._in_transaction = 0
        self._drain_delivered = 0
        self._recreate = False
        self._purge_on_open = False
        self._purge_in_flight = False
        # Keyed messages may probe a half-open circuit only when no drain worker of this process
        # does (a drain delivery closes the circuit too): a keyed probe that fails is stored after
        # later messages of its key (README, per-key order).
        self._keyed_probes = drain_workers == 0
        self._message_timeout = int(self._config["message.timeout.ms"]) / 1000
        # Callbacks of outboxed messages that this process may still deliver (msg_id → cb).
        self._waiting: dict[str, DeliveryCallback] = {}
        self.circuit = CircuitBreaker(
            failure_threshold=circuit_failure_threshold,
            reset_timeout=circuit_reset_timeout,
            on_open=self._circuit_opened,
        )
        drain_config = {k: v for k, v in config.items() if k not in ("error_cb", "on_delivery")}
        drain_settings: dict[str, Any] = dict(
            retry=self.retry,
            workers=max(drain_workers, 1),
            batch_size=drain_batch_size,
            lease_seconds=lease_seconds,
            poll_interval=drain_poll_interval,
            on_delivered=self._drained,
            on_dead_letter=self._drain_dead,
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
            self.drainer = Drainer(self.store, drain_config, **drain_settings)
        self._kafka = Producer(self._config)
        self.writer = GroupCommitWriter(
            self.store,
            owner=new_owner("producer"),
            lease_seconds=lease_seconds,
            max_delay=commit_interval,
            after_commit=self._after_commit,
        )
        self._hold: Holdback[NewMessage] = Holdback(
            _sequence, limit=self.writer.max_pending, on_full=self._ask_purge_in_flight, clock=time.monotonic
        )
        # Keys with a message in the outbox (this process's or an earlier one's): their later
        # messages queue behind it. Not checked while the circuit is open: nothing drains then.
        # Half-open counts as not open: when every key has a backlog, no message is left to
        # probe the circuit, and only a released key lets one through.
        # Fallback mode hands keys back to the fast path through a gate (keyorder.py); write-ahead
        # stores every message anyway.
        fallback = mode == "fallback"
        self._backlog = KeyBacklog(
            self.store,
            flush=lambda: self.writer.flush(),
            holding=lambda: self._hold.active,
            may_check=lambda: self.circuit.state is not CircuitState.OPEN,
            send=self._send_held if fallback else None,
            store_held=self._store_held if fallback else None,
        )
        self._poller = threading.Thread(target=self._poll_loop, name="outbox-delivery", daemon=True)
        self._poller.start()
        if drain_workers > 0:
            try:
                self.drainer.start()
            except BaseException:  # the drain process could not start: nothing may keep running
                self.close(5)
                raise

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
        hdrs: Headers = normalize_headers(headers) if headers is not None else []
        msg_id = self._next_id()
        if self._id_header is not None:
            hdrs.append((self._id_header, msg_id.encode()))

        if transaction is not None:
            self._enqueue_in_transaction(transaction, topic, value, key, hdrs, partition, msg_id)
            return msg_id
        if self.mode == "write-ahead" and enable_retry:
            self._write_ahead(topic, value, key, hdrs, partition, msg_id, on_delivery)
            return msg_id
        if not enable_retry:
            self._send_unprotected(topic, value, key, hdrs, partition, on_delivery)
            return msg_id
        # Key first: a message that must queue behind its key is no use as the circuit's probe.
        if self._backlog.pending and key is not None and self._key_waits(
            topic, key, value, hdrs, partition, msg_id, on_delivery
        ):
            return msg_id
        if not self.circuit.closed and not self._may_probe(key):
            self._spill(topic, value, key, hdrs, partition, msg_id, on_delivery, _NOT_SENT_CIRCUIT_OPEN, wait=True)
            return msg_id
        report = _Report(self, msg_id, hdrs if headers is not None else None, on_delivery, partition)
        try:
            try:
                # Positional, as every send here: keyword arguments cost ~1.2 µs (outbox.sendloop).
                self._kafka.produce(topic, value, key, partition, report, None, 0, hdrs)  # type: ignore[arg-type]
            except BufferError:
                # The same call again, as a closure made only when the queue is full: the common
                # path makes no closure per message.
                if not self._when_queue_has_room(
                    lambda: self._kafka.produce(
                        topic, value, key, partition, report, None, 0, hdrs  # type: ignore[arg-type]
                    )
                ):
                    raise
            self._handed.add()
        except BufferError:
            self._spill(topic, value, key, hdrs, partition, msg_id, on_delivery, _NOT_SENT_QUEUE_FULL, wait=True)
        except KafkaException as exc:
            self._handle_failure(exc.args[0], topic, value, key, hdrs, partition, msg_id, on_delivery, None)
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
            in_memory = len(self._kafka)
            held = len(self._hold) + self._backlog.held
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
        return len(self._kafka) + self.writer.pending() + len(self._hold) + self._backlog.held

    def stats(self) -> dict[str, Any]:
        """Counters and outbox state: see the README for each field."""
        now = time.time()
        try:
            store: StoreStats | None = self.store.stats(now=now)
        except StoreError:  # the store is down: the counters still answer; its fields read None
            store = None
        first_try = self._first_sends_delivered()  # once: two reads could disagree
        return {
            "produced": self._ids.issued,
            "delivered": first_try + self._drain_delivered,
            "delivered_first_try": first_try,
            "delivered_from_outbox": self._drain_delivered,
            "outboxed": self._outboxed,
            "pending": None if store is None else store.pending,
            "retried": self.drainer.result.retried,
            "dead": None if store is None else store.dead,
            "dead_this_process": self._dead + self.drainer.result.dead,
            "failed_no_retry": self._failed,
            "queue_full_waits": self._queue_full_waits.value,
            "store_errors": self.drainer.health.store_errors,
            "drain_restarts": self.drainer.restarts,
            "store_failing_since": self.drainer.health.failing_since,
            "enqueued_in_transaction": self._in_transaction,
            "in_memory": len(self._kafka),
            "keys_waiting": len(self._backlog.pending),
            "unsaved": self.writer.pending() + len(self._hold) + self._backlog.held,
            "circuit": self.circuit.state.value,
            "oldest_pending_age": (
                None if store is None or store.oldest_pending_at is None else now - store.oldest_pending_at
            ),
            "mode": self.mode,
            "outbox": self.store.location,
        }

    def close(self, timeout: float | None = None) -> int:
        """Flush, stop the drain workers and the delivery thread, close the outbox.

        Messages still in librdkafka's queue when `timeout` runs out are moved to the outbox
        (purged, then stored); messages not yet committed are counted in the return value.

        Returns:
            How many messages are neither delivered nor in the outbox (0 on a clean close).
        """
        if self._closed:
            return 0
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        self.flush(left())
        if len(self._kafka):
            # Still unsent: purge so librdkafka hands them back (_PURGE_QUEUE) for the outbox.
            self._kafka.purge(in_queue=True, in_flight=False)
            self._kafka.flush(min(left() or 5.0, 5.0))
        self.drainer.stop(left())
        self._backlog.close()
        self._stop_poller = True
        self._poller.join(5)
        self._kafka.poll(0)
        self._release_held(force=True)
        unsaved = self.writer.close(left()) + len(self._kafka)
        if self._owns_store:
            self.store.close()
        if unsaved:
            log.error("outbox: %d messages were neither delivered nor stored at close()", unsaved)
        return unsaved

    def __enter__(self) -> ResilientProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- paths into the outbox ---------------------------------------------------------------

    def _key_waits(
        self, topic: str, key: Any, value: Any, hdrs: Headers, partition: int, msg_id: str,
        cb: DeliveryCallback | None,
    ) -> bool:
        """If this key has a message in the outbox, store this one behind it and return True.

        After an outage this is the path of nearly every message until the backlog is drained,
        and the drain shares this process's interpreter lock: so it marks and queues the row
        under the one lock it already holds (`_queue`), not through `_store_pending`.
        """
        k = key if key.__class__ is bytes else as_bytes(key)
        assert k is not None  # the caller checked key
        backlog = self._backlog
        if (topic, k) not in backlog.pending:
            return False
        self._wait_for_room()  # outside the lock: the writer's hooks may need it
        with backlog.lock:
            if (topic, k) not in backlog.pending:
                return False
            msg = self._unsent(topic, value, k, hdrs, partition, msg_id, _NOT_SENT_KEY_WAITS)
            if not backlog.hold((topic, k), (msg, cb)):  # held while the key is handed back
                self._queue(msg, cb)
            return True

    def _send_held(self, key: tuple[str, bytes], held: list[tuple[NewMessage, DeliveryCallback | None]]) -> None:
        """Under the backlog's lock: a key handed back to the fast path; its messages held by the
        gate go to Kafka in produce order. One that librdkafka does not take is stored, and so
        is every one after it (the key stays pending)."""
        if not self.circuit.closed:
            self._store_held(key, held)
            return
        produce = self._kafka.produce
        for i, (msg, cb) in enumerate(held):
            report = _Report(self, msg.msg_id, msg.headers, cb, msg.partition)
            try:
                produce(
                    msg.topic, msg.value, msg.key, msg.partition, report, None, 0, msg.headers  # type: ignore[arg-type]
                )
                self._handed.add()
            except BufferError:  # no waiting under the lock: the delivery thread may need it
                self._store_held(key, held[i:])
                return
            except KafkaException as exc:
                self._handle_failure(
                    exc.args[0], msg.topic, msg.value, msg.key, msg.headers or [], msg.partition, msg.msg_id, cb, None
                )
                self._store_held(key, held[i + 1 :])
                return

    def _store_held(self, key: tuple[str, bytes], held: list[tuple[NewMessage, DeliveryCallback | None]]) -> None:
        """Under the backlog's lock: messages the gate held, queued for the outbox in order."""
        for msg, cb in held:
            self._queue(msg, cb)

    def _spill(
        self, topic: str, value: Any, key: Any, hdrs: Headers, partition: int, msg_id: str,
        cb: DeliveryCallback | None, why: str, *, wait: bool = False,
    ) -> None:
        """Store a message that was not sent (circuit open, queue full): due at once."""
        self._store_pending(self._unsent(topic, value, key, hdrs, partition, msg_id, why), cb, wait=wait)

    @staticmethod
    def _unsent(topic: str, value: Any, key: Any, hdrs: Headers, partition: int, msg_id: str, why: str) -> NewMessage:
        """The row of a message that was not sent: due at once, `why` (a `_NOT_SENT_*`) as its last error."""
        now = time.time()
        # Built as the tuple it is: NamedTuple's generated __new__ is a Python call (0.5 µs of a
        # key-waits path that every message of a recovering key takes); bytes skip as_bytes().
        return _new_tuple(NewMessage, (
            topic, value if value.__class__ is bytes else as_bytes(value),
            key if key.__class__ is bytes else as_bytes(key), hdrs, partition, msg_id, 0, None, why, now, None, None,
        ))

    def _store_pending(self, msg: NewMessage, cb: DeliveryCallback | None, *, wait: bool = False) -> None:
        """Queue a message for the outbox (held back while the circuit has just opened).

        `wait=True` only from the application's produce() call: it may block for backpressure.
        The delivery thread never waits here (the writer's sends need it to poll).
        """
        if wait:
            self._wait_for_room()  # outside the lock, which the delivery thread needs
        if msg.key is None:
            self._queue(msg, cb)
            return
        # Marking the key and queueing the message are one step (KeyBacklog.lock).
        with self._backlog.lock:
            self._queue(msg, cb)

    def _note_pending(self, msg: NewMessage, cb: DeliveryCallback | None) -> None:
        """Count a message bound for the outbox; its key's later messages queue behind it."""
        if msg.key is not None:  # under the backlog's lock
            self._backlog.mark((msg.topic, msg.key))
        if cb is not None:
            self._waiting[msg.msg_id] = cb
        self._outboxed += 1

    def _queue(self, msg: NewMessage, cb: DeliveryCallback | None) -> None:
        """Count `msg` as bound for the outbox and queue it for the writer (or the hold-back).
        A keyed message: under the backlog's lock (marking its key and queueing it are one step)."""
        self._note_pending(msg, cb)
        if not (self._hold.active and self._hold.offer(msg)):
            self.writer.add_new(msg)

    def _wait_for_room(self) -> None:
        self._hold.wait_for_room()
        self.writer.wait_for_room()

    def _when_queue_has_room(self, send: Callable[[], None]) -> bool:
        """produce() met a full local queue: try `send` again as room appears, while the circuit
        is closed, for up to `queue_full_timeout`. False: no room in time (the caller stores the
        message), or at once while an earlier wait found none and nothing was delivered since.

        Why wait: a full queue on a cluster that delivers is back-pressure, not an outage. Stored
        instead, a burst on a healthy cluster went to SQLite (a sixth to a third of 200,000 messages
        on one local broker), each at several times a send's cost, and every later message of a stored
        key followed it into the outbox until the drain caught up.
        """
        if self._queue_stalled or self._queue_full_timeout <= 0:
            return False
        self._queue_full_waits.add()
        deadline = time.monotonic() + self._queue_full_timeout
        while self.circuit.closed:
            time.sleep(_ROOM_CHECK_INTERVAL)  # the delivery thread serves reports, which frees room
            try:
                send()
                return True
            except BufferError:
                if time.monotonic() >= deadline:
                    self._queue_stalled = True
                    return False
        return False

    def _may_probe(self, key: Any) -> bool:
        """While the circuit is not closed: may this message go to Kafka as the probe?"""
        if self._hold.active or (key is not None and not self._keyed_probes):
            return False
        return self.circuit.allow_probe()

    def _enqueue_in_transaction(
        self, conn: Any, topic: str, value: Any, key: Any, hdrs: Headers, partition: int, msg_id: str
    ) -> None:
        enqueue = getattr(self.store, "enqueue_in_transaction", None)
        if enqueue is None:
            raise ConfigError("transaction= needs a PostgreSQL outbox (postgresql:// or jdbc:postgresql:// URL)")
        msg = NewMessage(topic, as_bytes(value), as_bytes(key), hdrs, partition, msg_id, 0, None, None, time.time())
        enqueue(conn, [msg])
        # Not counted as "outboxed": the row exists only if the caller commits, which we cannot see.
        self._in_transaction += 1
        self.drainer.wake()

    def _send_unprotected(
        self, topic: str, value: Any, key: Any, hdrs: Headers, partition: int, cb: DeliveryCallback | None
    ) -> None:
        """enable_retry=False: Kafka or nothing; failures go to `cb` only."""
        report = functools.partial(self._on_unprotected_report, cb)

        def send() -> None:
            self._kafka.produce(topic, value, key, partition, report, None, 0, hdrs)  # type: ignore[arg-type]

        try:
            try:
                send()
            except BufferError:
                if not self._when_queue_has_room(send):
                    raise
            self._handed.add()
        except BufferError:
            self._failed += 1
            if cb is not None:
                cb(KafkaError(KafkaError._QUEUE_FULL, "local queue full; enable_retry=False: dropped"), None)
        except KafkaException as exc:
            self._failed += 1
            if cb is not None:
                cb(exc.args[0], None)

    def _write_ahead(
        self, topic: str, value: Any, key: Any, hdrs: Headers, partition: int, msg_id: str,
        cb: DeliveryCallback | None,
    ) -> None:
        now = time.time()
        kb = as_bytes(key)
        # Sent by us after the commit unless Kafka is known down or the key must wait.
        send_now = self.circuit.closed and not (kb is not None and (topic, kb) in self._backlog.pending)
        # Built as the tuple it is: NamedTuple's generated __new__ is a Python call (0.2 µs).
        msg = _new_tuple(
            NewMessage, (topic, as_bytes(value), kb, hdrs, partition, msg_id, 0, None, None, now, None, None)
        )
        if send_now:
            batch = self.writer.add_new(msg, cb, leased=True, wait=True)
        else:  # stored for the drain workers; write-ahead rows never need holding back
            self.writer.wait_for_room()
            with self._backlog.lock:
                self._note_pending(msg, cb)
                batch = self.writer.add_new(msg)
        if self.durability == "sync":
            batch.done.wait()
            if batch.error is not None:
                raise batch.error

    # -- callbacks ---------------------------------------------------------------------------

    def _after_commit(self, c: Committed) -> None:
        """Writer thread: committed rows. Send write-ahead rows; report dead letters."""
        if any(c.leased):
            self._send_written(c)
        if any(not leased for leased in c.leased):
            self.drainer.wake()
        for row_id, msg, cb in zip(c.dead_ids, c.dead, c.dead_meta, strict=True):
            self._dead += 1
            self._notify_dead(
                DeadLetter(
                    row_id, msg.topic, msg.key, msg.value, msg.headers or [], msg.partition, msg.attempts,
                    msg.first_failed_at, msg.first_failed_at, msg.last_error, msg.msg_id,
                    msg.error_code, msg.error_name,
                ),
                cb,
            )
        for row in c.dead_failed:
            self._dead += 1
            self._notify_dead(DeadLetter.from_row(row), self._waiting.pop(row.msg_id, None))

    def _send_written(self, c: Committed) -> None:
        """Send a committed batch's write-ahead rows (the rows born leased to us)."""
        if all(c.leased):
            ids, msgs, cbs = c.new_ids, c.new, c.new_meta
        else:
            mine = [i for i, leased in enumerate(c.leased) if leased]
            ids, msgs, cbs = [c.new_ids[i] for i in mine], [c.new[i] for i in mine], [c.new_meta[i] for i in mine]
        batch = SentBatch(
            ids, msgs, cbs, self._on_wal_report, self.writer.add_outcomes,
            successes_heard=self._report_successes and any(cb is not None for cb in cbs),
        )
        produce, handed = self._kafka.produce, self._handed.add
        shared = None if batch.successes_heard else batch.report  # one callback for every send
        for i, msg in enumerate(msgs):
            report = shared or SentReport(batch, i)
            while True:
                try:
                    produce(
                        msg.topic, msg.value, msg.key, msg.partition, report, None, 0, msg.headers  # type: ignore[arg-type]
                    )
                    handed()
                    break
                except BufferError:
                    time.sleep(0.005)  # the delivery thread is draining the queue
                except KafkaException as exc:
                    handed()  # counted as taken and failed: _wal_failed counts the failure
                    batch.refused(i, *self._wal_failed(msg, cbs[i], exc.args[0]))
                    break

    def _notify_dead(self, dl: DeadLetter, cb: DeliveryCallback | None) -> None:
        if cb is not None:
            try:
                code = dl.error_code if dl.error_code is not None else KafkaError._FAIL
                cb(KafkaError(code, f"dead-lettered: {dl.last_error}"), None)
            except Exception:
                log.exception("on_delivery callback raised")
        if self.on_dead_letter is not None:
            try:
                self.on_dead_letter(dl)
            except Exception:
                log.exception("on_dead_letter callback raised; the dead letter is stored anyway")

    def _on_report(self, r: _Report, err: KafkaError | None, msg: Message) -> None:
        """Delivery thread: the report of a first send (of a success only if they are reported)."""
        if err is None:
            if r.cb is not None:
                r.cb(None, msg)
            return
        self._send_failures += 1
        if r.headers is not None:
            hdrs = r.headers
        else:
            hdrs = [(self._id_header, r.msg_id.encode())] if self._id_header is not None else []
        self._handle_failure(err, msg.topic() or "", msg.value(), msg.key(), hdrs, r.partition, r.msg_id, r.cb, msg)

    def _on_unprotected_report(self, cb: DeliveryCallback | None, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self._send_failures += 1
            self._failed += 1
        if cb is not None and (err is not None or self._report_successes):
            cb(err, msg)

    def _on_wal_report(self, batch: SentBatch, i: int, err: KafkaError | None, msg: Message | None) -> None:
        """Write-ahead send finished: the row is deleted with its batch, or handed to the drain."""
        cb = batch.callbacks[i]
        if err is None:
            batch.delivered(i)
            if cb is not None and self._report_successes:
                cb(None, msg)
            return
        batch.decided(i, *self._wal_failed(batch.messages[i], cb, err))

    def _wal_failed(self, m: NewMessage, cb: DeliveryCallback | None, err: KafkaError) -> tuple[Decision, float]:
        """A write-ahead send failed: its decision, and when. Counted as one failed send per row
        (two alike rows of a shared-report batch taken as failed for one report count two)."""
        self._send_failures += 1
        now = time.time()
        d = settle(m, err, self.retry, now)
        if d.recreate_producer:
            self._recreate = True
        if d.verdict is Verdict.RESEND_ALONE:
            # Maybe a batch-mate's fault: due now, a drain worker re-sends it (alone if needed).
            d = replace(d, verdict=Verdict.RESCHEDULE, at=now, attempts=1)
        if d.verdict is not Verdict.DEAD_LETTER:
            self._note_transport_failure(err.code())
            if m.key is not None:
                self._backlog.add((m.topic, m.key))
            self._outboxed += 1
        if cb is not None:
            self._waiting[m.msg_id] = cb  # popped when the row is delivered or dead-lettered
        return d, now

    def _handle_failure(
        self, err: KafkaError, topic: str, value: Any, key: Any, hdrs: Headers, partition: int,
        msg_id: str | None, cb: DeliveryCallback | None, msg: Message | None,
    ) -> None:
        """A first send failed: outbox it (retriable) or dead-letter it (permanent)."""
        if msg_id is None:
            found = find(hdrs, self._id_header) if self._id_header else None
            msg_id = found.decode() if found else self._ids()
        now = time.time()
        # msg None: refused by produce() itself, so the message alone is at fault.
        d = settle(_FIRST_SEND, err, self.retry, now, alone=msg is None)
        if d.recreate_producer:
            self._recreate = True
        k, v = as_bytes(key), as_bytes(value)
        if d.verdict is Verdict.RELEASE:  # never sent: stored due now, no attempt counted
            self._store_pending(
                NewMessage(topic, v, k, hdrs, partition, msg_id, 0, None, d.error, now, d.code, d.name), cb
            )
            return
        if d.verdict is Verdict.RESEND_ALONE:
            # The broker refused the record batch it was in: maybe another message's fault.
            # Stored due now; a drain worker re-sends it alone and dead-letters it only if it
            # fails on its own.
            alone = NewMessage(topic, v, k, hdrs, partition, msg_id, 1, now, d.error, now, d.code, d.name)
            self._store_pending(alone, cb)
            self.drainer.wake()
            return
        failed = NewMessage(topic, v, k, hdrs, partition, msg_id, d.attempts, now, d.error, d.at or now, d.code, d.name)
        if d.verdict is Verdict.DEAD_LETTER:
            self.writer.add_dead(failed, cb)
            return
        self._note_transport_failure(err.code())
        self._store_pending(failed, cb)

    def _note_transport_failure(self, code: int) -> None:
        # Only errors that say "the cluster is not reachable or not healthy" count toward the
        # circuit; a bad topic or a too-large message says nothing about the cluster.
        if code in UNREACHABLE_CODES:
            self._note_progress()  # deliveries since the last failure: it is not consecutive
            self.circuit.record_failure()

    def _first_sends_delivered(self) -> int:
        """Messages librdkafka took from us and delivered: taken, minus still held, minus failed.

        Counted, not reported: with `delivery.report.only.error` no success is reported. Read in
        this order, a produce() or a failure report in between can only make it lower, never
        show a delivery that did not happen (librdkafka's count includes unserved reports).
        """
        handed = self._handed.value
        return handed - len(self._kafka) - self._send_failures

    def _note_progress(self) -> None:
        """Deliveries since the last look close a half-open circuit and end a run of failures."""
        done = self._first_sends_delivered()
        if done > self._done_seen:
            self._done_seen = done
            self._queue_stalled = False
            self.circuit.record_success()

    def _drained(self, rows: Sequence[OutboxMessage] | Sequence[Drained]) -> None:
        """Drain thread: rows delivered from the outbox."""
        self._drain_delivered += len(rows)
        for row in rows:
            cb = self._waiting.pop(row.msg_id, None) if self._waiting else None
            if cb is not None and self._report_successes:
                try:
                    cb(None, None)
                except Exception:
                    log.exception("on_delivery callback raised")
        # Its thread looks; the drain worker claims on.
        self._backlog.drained((row.topic, row.key) for row in rows if row.key is not None)

    def _drain_dead(self, dl: DeadLetter) -> None:
        self._notify_dead(dl, self._waiting.pop(dl.msg_id, None) if self._waiting else None)
        if dl.key is not None:
            self._backlog.drained([(dl.topic, dl.key)])

    def _on_error(self, err: KafkaError) -> None:
        """librdkafka's error_cb: cluster-level events."""
        code = err.code()
        if code == KafkaError._ALL_BROKERS_DOWN:
            self.circuit.trip("all brokers down")
        elif err.fatal():
            log.error("outbox: fatal producer error %s; the producer will be recreated", describe(err))
            self._recreate = True
        else:
            log.debug("outbox: producer error %s", describe(err))
        if self._user_error_cb is not None:
            self._user_error_cb(err)

    def _circuit_opened(self) -> None:
        # Move what waits in librdkafka's queue to disk now instead of at message.timeout.ms,
        # and hold later spills back until it has (holdback.py: per-key order). Write-ahead rows
        # are stored before they are sent, so their order never depends on this.
        if self.mode == "fallback":
            self._hold.start(self._message_timeout + 1.0)
        self._purge_on_open = True

    def _ask_purge_in_flight(self) -> None:
        # The hold is full: make librdkafka hand back what is on the wire now (possibly delivered:
        # a duplicate with the same outbox-id) instead of at message.timeout.ms.
        self._purge_in_flight = True

    def _release_held(self, *, force: bool = False) -> None:
        """Delivery thread: store held messages in produce order once librdkafka returned the rest."""
        closed = self.circuit.closed
        if not force and not closed:
            # Purge again: a produce() that saw the circuit closed just before it opened may have
            # queued a message after the first purge; without this it would hold everything
            # back until message.timeout.ms.
            self._kafka.purge(in_queue=True, in_flight=self._purge_in_flight)
            self._purge_in_flight = False
        # Closed again (a drain delivery proved the cluster back): new sends fill librdkafka, so
        # "empty" may never come; what is still on the wire from before is the README's window.
        with self._backlog.lock:  # a backlog check must see these either held or in the writer
            for msg in self._hold.release(source_empty=force or closed or len(self._kafka) == 0):
                self.writer.add_new(msg)

    # -- the delivery thread -----------------------------------------------------------------

    _stop_poller = False

    def _poll_loop(self) -> None:
        while not self._stop_poller:
            try:
                self._kafka.poll(0.05)
                self._note_progress()
                if self._purge_on_open:
                    self._purge_on_open = False
                    self._kafka.purge(in_queue=True, in_flight=False)
                if self._purge_in_flight:
                    self._purge_in_flight = False
                    self._kafka.purge(in_queue=False, in_flight=True)
                if self._hold.active:
                    self._release_held()
                if self._recreate:
                    self._recreate_producer()
            except Exception:
                log.exception("outbox delivery thread: callback failed")

    def _recreate_producer(self) -> None:
        self._recreate = False
        old = self._kafka
        self._kafka = Producer(self._config)
        log.warning("outbox: producer recreated after a fatal error; queued messages move to the outbox")
        old.purge(in_queue=True, in_flight=True)
        old.flush(10)


class _Report:
    """The delivery callback of a first send: what storing the message after a failure needs.

    Delivery reports carry no headers (confluent-kafka drops them), so the id and the
    application's headers travel here. One lives per message in flight, often 100,000 at once,
    and each is an object the garbage collector walks: one slotted object that keeps the header
    list only if the application gave headers costs produce() 0.5 µs of collection per message,
    where a functools.partial holding the list and its tuple cost 2.9 µs.
    """

    __slots__ = ("producer", "msg_id", "headers", "cb", "partition")

    def __init__(
        self, producer: ResilientProducer, msg_id: str, headers: Headers | None, cb: DeliveryCallback | None,
        partition: int,
    ) -> None:
        self.producer = producer
        self.msg_id = msg_id
        self.headers = headers  # None: the id header alone (rebuilt on failure)
        self.cb = cb
        self.partition = partition

    def __call__(self, err: KafkaError | None, msg: Message) -> None:
        self.producer._on_report(self, err, msg)


def _is_true(setting: object) -> bool:
    """`delivery.report.only.error` as confluent_kafka takes it: a bool, nothing else."""
    if not isinstance(setting, bool):
        raise ConfigError(f"delivery.report.only.error must be True or False, got {setting!r}")
    return setting


class _FirstSend:
    """The retry state of a message on its first send: no failure yet."""

    attempts = 0
    first_failed_at: float | None = None


_FIRST_SEND = _FirstSend()


def _sequence(msg: NewMessage) -> str:
    # Ids are one generator's fixed-width prefix + hex counter: string order is produce order.
    return msg.msg_id

