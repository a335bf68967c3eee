"""ResilientProducer: a confluent_kafka producer that stores what Kafka could not take.

This module is the router: it checks a message once and sends it down the one path that
`outbox.producer.admission` decides (SEND, PROBE, HOLD behind its key, STORE).

- `outbox.producer.settings`: the constructor's arguments, checked once (`ProducerSettings`), which
  the parts are built from;
- `outbox.producer.firstsend`: fallback mode's first send, and what a failed one becomes;
- `outbox.producer.spill`: the way into the outbox (per-key order, hold-back, group-commit writer);
- `outbox.producer.writeahead`: write-ahead mode (stored first, sent from the writer thread);
- `outbox.producer.link`: the librdkafka producer and its delivery thread;
- `outbox.producer.storedcallbacks`: the callbacks of stored messages, once delivered or dead-lettered;
- `outbox.drain.workers` / `outbox.drain.process`: the drain workers that re-send stored messages.
- `_Handoffs` (here): what the producer does with each batch its writer committed (send
  write-ahead rows, wake the drain, report dead letters) and each row its drain settled (close
  the circuit, run callbacks, free keys); handed over directly, on the thread that learned it;
- `outbox.events`: what happened to messages (committed, delivered, retried, dead), told after
  those hand-offs to observers only: tracing, metrics and the application's listeners
  (`subscribe`).

Threads: the caller's threads call `produce()`; one delivery thread polls librdkafka and runs
every callback (`on_delivery`, `on_dead_letter` for first-send failures); `poll()` waits for
them and raises what they raised (`outbox.producer.pollreport`); the group-commit
writer thread writes the outbox and, in write-ahead mode, sends committed rows; the key thread
releases keys whose stored messages are delivered; the drain worker threads re-send stored rows
and run callbacks for the messages they deliver or dead-letter; with `dead_letter_retention`, the
retention thread deletes old dead letters (`outbox.producer.retention`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, cast

from confluent_kafka import KafkaError, TopicPartition
from confluent_kafka.admin._metadata import ClusterMetadata

from outbox.budget import DEFAULT_MEMORY_BUDGET, MemoryBudget
from outbox.drain.process import DrainProcess
from outbox.drain.workers import DEFAULT_BATCH_SIZE, Drainer
from outbox.errors import ConfigError, ProducerClosedError, ProducerForkedError, StoreError
from outbox.events import Committed, Drained, Events
from outbox.headers import ID_HEADER, CheckedHeaders, HookedHeaders, IdGenerator
from outbox.message import (
    BYTES_LIKE,
    KNOWN_TOPICS,
    DeliveryCallback,
    Message,
    check_partition,
    check_payload,
    check_timestamp,
    check_topic,
    normalize_headers,
)
from outbox.producer import exithook, sigterm
from outbox.producer.admission import HOLD, PROBE, SEND, STORE
from outbox.producer.circuit import CircuitBreaker, CircuitState
from outbox.producer.compiling import PythonObject
from outbox.producer.firstsend import FirstSend
from outbox.producer.keyorder import KeyBacklog
from outbox.producer.link import KafkaLink
from outbox.producer.pollreport import PollReport
from outbox.producer.retention import DeadLetterRetention
from outbox.producer.serialization import Serializer
from outbox.producer.settings import PRODUCER_DEFAULTS, ProducerArguments, ProducerSettings
from outbox.producer.spill import NOT_SENT_CIRCUIT_OPEN, Spill
from outbox.producer.storedcallbacks import DeadLetterCallback, StoredCallbacks
from outbox.producer.writeahead import CRASH_WINDOW_ROWS, WriteAhead
from outbox.producer.writer import GroupCommitWriter
from outbox.records import DeadLetter, Headers, OutboxMessage, StoreStats
from outbox.retry import RetryPolicy
from outbox.stores import Outbox, open_outbox
from outbox.stores.encryption import Encryption
from outbox.stores.owners import new_owner
from outbox.transactions import enqueue_in_transaction

_new_tuple = tuple.__new__


#: `ResilientProducer.hook_produce`'s hook: (produce, topic, value, key, partition, on_delivery,
#: timestamp, headers, callback, enable_retry, transaction) -> the message id.
ProduceHook = Callable[..., str]

__all__ = [
    "PRODUCER_DEFAULTS",
    "DeadLetterCallback",
    "DeliveryCallback",
    "HookedHeaders",
    "ProduceHook",
    "ResilientProducer",
]

log = logging.getLogger("outbox")

#: confluent_kafka's message for any call on a closed producer.
CLOSED = "Producer has been closed"

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
#: flush()'s step (seconds) while only the delivery thread's last callbacks are left to run.
CALLBACKS_STEP = 0.0002
#: flush()'s first step (seconds) between two looks at what is left, doubled up to the last: a
#: produce-then-flush waits about a broker's round trip, and a long flush wakes 100 times a second.
FLUSH_STEP_FIRST = 0.0005
FLUSH_STEP_MAX = 0.01


class ResilientProducer(PythonObject):
    """A Kafka producer that writes what it cannot deliver to a durable outbox.

    Made to be used where a `confluent_kafka.Producer` is: the same constructor forms, the
    same methods and arguments; `docs/confluent-compatibility.md` lists where it differs and why.

    Args:
        config: confluent_kafka.Producer settings, passed through unchanged except for two
            defaults: `message.timeout.ms` is 30000 (librdkafka: 300000), and
            `enable.idempotence` is True (librdkafka: False) unless `acks`, `max.in.flight` or
            `retries` rule it out, as in the Java producer since Kafka 3.0: per-key order needs
            it (`outbox.drain.idempotence`). As with confluent_kafka,
            they may also be given as keyword arguments (``ResilientProducer(**conf)``), and
            `logger=` sets the `logger` setting. Its `error_cb`,
            `throttle_cb`, `stats_cb` and `oauth_cb` serve every librdkafka client the producer
            runs: its own and each drain worker's (in the drain process with
            `drain_in="process"`); `stats_cb` tells them apart by the statistics' `name`. On a
            drain worker a callback that raises is logged and counted in
            `stats()["callback_errors"]` and never ends the worker. Settings the drain workers'
            producers cannot use (see `outbox.drain.sendloop.check_resend_config`) raise ConfigError.
            `on_delivery` (or `dr_msg_cb` / `dr_cb`) is the delivery callback of every message
            produced without one. `transactional.id` is refused (`ConfigError`): see
            `produce(..., transaction=)`. `delivery.report.only.error: True` means what it means
            in librdkafka: `on_delivery` hears failures only (and in fallback mode librdkafka
            reports no success, which makes each send cheaper).
        outbox: an outbox URL (``sqlite:///path.db``, ``jdbc:sqlite:/path.db``,
            ``postgresql://...``, ``jdbc:postgresql://...``) or an `Outbox` instance.
        retry: the retry policy for re-sends and the classification of errors.
        on_dead_letter: recovery callback, called once per dead-lettered message with a
            DeadLetter, after the dead letter is stored.
        mode: "fallback" (Kafka first, only failures stored) or "write-ahead" (every message
            committed to the outbox before it is sent).
        durability: write-ahead only: "batch" (produce() returns at once, unless a whole batch
            of 1,000 already waits behind the commit under way: a crash loses at most those two
            batches, about `commit_interval` plus two commits) or "sync" (produce() returns once
            the message is committed).
        drain_workers: background threads re-sending stored messages (0: none; run
            `outbox drain` elsewhere).
        drain_in: "threads" (in this process) or "process": the drain workers run in a child
            process of their own (`outbox.drain.process`), so re-sending does not share this
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
            produce(), before anything is sent or stored (see outbox.producer.serialization).
        memory_budget: bytes of messages the producer may hold in memory on their way to the
            outbox (hold-back, key gate, group-commit writer; each message counts its value,
            key and headers plus a fixed overhead, `outbox.budget`). Past it, produce() waits
            for the outbox to commit, as when the store is slow. Default 16 MiB. librdkafka's
            queue gets a quarter of it in payload (`queue.buffering.max.kbytes`, unless the
            config sets it), and what it may hand back when the circuit opens is kept free; the
            drain threads claim at most a quarter of it per batch.
        exit_timeout: seconds allowed at interpreter exit or at SIGTERM, for a producer that
            was never closed, to deliver and then commit to the outbox every accepted message
            still in memory (`outbox.producer.exithook`; the count is logged). Default 10. A
            `kill -9` runs no exit hook: write-ahead mode is the answer to that.
        handle_sigterm: True (the default): a producer started in the main thread while SIGTERM
            has its default action installs `outbox.on_sigterm` for it: at SIGTERM every open
            producer commits what it holds within its `exit_timeout`, then the process ends as
            the default action would (`outbox.producer.sigterm`). An application's own handler
            is never replaced. False: the producer leaves SIGTERM alone.
        dead_letter_retention: how long the outbox keeps a dead letter, in seconds or as a
            `datetime.timedelta`, counted from its last failure (when it became a dead letter).
            A thread of the producer deletes older ones when it starts and every 5 minutes, in
            batches of 1,000, each its own transaction and audit entry (who: "retention"); every
            dead letter of the outbox counts, whoever stored it (`outbox.producer.retention`).
            None (the default): dead letters are kept until purged.
        encryption: encrypt the value and headers of every message the outbox stores (pending
            or dead) with AES-256-GCM: a `outbox.stores.encryption.KeyRing`, a `Key`, or keys newest
            first (the newest encrypts, every one decrypts). Message keys, topics and times stay
            in clear. SQLite and PostgreSQL outboxes; needs the `encryption` extra. docs/encryption.md.
    """

    #: Until __init__ has run (a subclass that does not call it), every call says "closed", as
    #: confluent_kafka's does.
    _closed = True
    #: What close() counted as neither delivered nor stored (`stats()["unsaved_at_close"]`): None
    #: until close() has counted it; 0 for a producer whose __init__ never ran, which holds nothing.
    _unsaved_at_close: int | None = 0
    #: produce()'s one check before its fast path: closed, or a produce hook is set.
    _produce_guard = True
    _produce_hook: ProduceHook | None = None
    #: The pid of the process this producer was made in, once a fork disowned it (`disown`).
    _forked_from: int | None = None

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        /,
        *,
        logger: logging.Logger | logging.LoggerAdapter[Any] | None = None,
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
        handle_sigterm: bool = True,
        dead_letter_retention: float | timedelta | None = None,
        encryption: Encryption | None = None,
        **settings: Any,
    ) -> None:
        checked = ProducerSettings.check(
            config,
            settings,
            ProducerArguments(
                logger=logger,
                outbox=outbox,
                retry=retry,
                on_dead_letter=on_dead_letter,
                mode=mode,
                durability=durability,
                drain_workers=drain_workers,
                drain_in=drain_in,
                id_header=id_header,
                circuit_failure_threshold=circuit_failure_threshold,
                circuit_reset_timeout=circuit_reset_timeout,
                queue_full_timeout=queue_full_timeout,
                commit_interval=commit_interval,
                lease_seconds=lease_seconds,
                drain_batch_size=drain_batch_size,
                drain_poll_interval=drain_poll_interval,
                on_store_error=on_store_error,
                key_serializer=key_serializer,
                value_serializer=value_serializer,
                memory_budget=memory_budget,
                exit_timeout=exit_timeout,
                handle_sigterm=handle_sigterm,
                dead_letter_retention=dead_letter_retention,
                encryption=encryption,
            ),
        )
        # What produce() reads stays a plain attribute of the producer: one lookup per message.
        self._serializers = checked.serializers
        self.mode, self.durability, self.retry = checked.mode, checked.durability, checked.retry
        self._writes_ahead = checked.mode == "write-ahead"  # produce() reads a flag, not a string compare
        self._id_header = checked.id_header
        self._ids = IdGenerator()
        self._next_id = self._ids.next
        self._default_on_delivery = checked.default_on_delivery
        self._message_timeout = checked.message_timeout
        self._exit_timeout = checked.exit_timeout
        self._in_transaction = 0
        self.memory = MemoryBudget(checked.memory_budget, reserve=checked.rdkafka_reserve)
        self.circuit = CircuitBreaker(
            failure_threshold=checked.circuit_failure_threshold,
            reset_timeout=checked.circuit_reset_timeout,
            on_open=self._circuit_opened,
        )
        self._poll_report = PollReport()
        # The librdkafka producer first: it checks the settings (a KafkaException, as from
        # confluent_kafka) before anything is opened or started.
        self._link = KafkaLink(
            checked.kafka_config,
            self.circuit,
            queue_full_timeout=checked.queue_full_timeout,
            user_error_cb=checked.user_error_cb,
            poll_report=self._poll_report,
        )
        self._owns_store = not isinstance(checked.outbox, Outbox)
        self.store = open_outbox(checked.outbox, encryption=checked.encryption)
        # Observers hear what happens to messages through one fan-out (`outbox.events`); the
        # producer's own reactions are handed over directly (`_Handoffs`), given to each thread
        # as it starts (`_start`), once every part is built.
        self._events = Events(self._poll_report.failed)
        self._callbacks = StoredCallbacks(
            checked.on_dead_letter, report_successes=checked.report_successes, poll_report=self._poll_report
        )
        self.drainer = self._new_drainer(checked)
        self.writer = GroupCommitWriter(
            self.store,
            owner=new_owner("producer"),
            lease_seconds=checked.lease_seconds,
            max_delay=checked.commit_interval,
            budget=self.memory,
            events=self._events,
            **({"max_batch": CRASH_WINDOW_ROWS} if self._writes_ahead and checked.durability == "batch" else {}),
        )
        self._assemble_routes(checked)
        retention = checked.dead_letter_retention
        self._retention = None if retention is None else DeadLetterRetention(self.store, retention)
        self._start(checked.drain_workers > 0)
        if checked.handle_sigterm:
            sigterm.install()

    def _new_drainer(self, settings: ProducerSettings) -> Drainer | DrainProcess:
        """The drain workers, not started: in a process of their own, or threads of this one."""
        if settings.drain_in == "process" and settings.drain_workers > 0:
            assert isinstance(settings.outbox, str)
            try:
                return DrainProcess(
                    settings.outbox,
                    settings.drain_config,
                    settings.drain,
                    events=self._events,
                    on_store_error=settings.on_store_error,
                    encryption=settings.encryption,
                )
            except ConfigError:
                self.store.close()
                raise
        # Claims bounded in bytes too: a drain thread's batches share this process's memory
        # (a drain process has its own).
        drain = settings.drain
        return Drainer(
            self.store,
            settings.drain_config,
            retry=drain.retry,
            workers=drain.workers,
            batch_size=drain.batch_size,
            batch_bytes=settings.memory_budget // 4,
            lease_seconds=drain.lease_seconds,
            poll_interval=drain.poll_interval,
            events=self._events,
            on_store_error=settings.on_store_error,
        )

    def _assemble_routes(self, settings: ProducerSettings) -> None:
        """The paths a message takes (spill, first send, write-ahead), and the producer's hand-offs."""
        fallback = settings.mode == "fallback"
        self._spill = Spill(
            self.writer,
            self._link,
            self.circuit,
            self._callbacks,
            gate=fallback,
            keyed_probes=settings.drain_workers == 0,
            track_sends=fallback and not settings.kafka_config["delivery.report.only.error"],
            hold_longest=self._message_timeout + 1.0,
        )
        self._route = self._spill.admission.route  # produce()'s one decision (outbox.producer.admission)
        self._fence = self._spill.fence  # not armed: produce() needs no decision (outbox.producer.sendfence)
        self._backlog = self._spill.backlog
        self._first = FirstSend(
            self._link,
            self._spill,
            self.writer,
            self.circuit,
            self.retry,
            wake_drain=self.drainer.wake,
            id_header=settings.id_header,
            report_successes=settings.report_successes,
        )
        self._write_ahead = WriteAhead(
            self._link,
            self._spill,
            self.writer,
            self.circuit,
            self._callbacks,
            self.retry,
            durability=settings.durability,
            report_successes=settings.report_successes,
        )
        self._handoffs = _Handoffs(
            self._events, self.circuit, self._callbacks, self._backlog, self._write_ahead, self.drainer
        )

    def _start(self, drain: bool) -> None:
        """Open the producer to produce(), then start its threads (and the drain workers, if `drain`)."""
        self._unsaved_at_close = None
        self._close_finished = threading.Event()
        self._closed = False
        self._produce_guard = False
        self.writer.start(self._handoffs)
        self._link.start(tick=self._spill.tick)
        # A key the backlog hands back: the messages its gate held go to Kafka, in order.
        self._backlog.start(self._first.send_held if self.mode == "fallback" else None)
        if drain:
            try:
                self.drainer.start(self._handoffs)
            except BaseException:  # the drain process could not start: nothing may keep running
                self.close(5)
                raise
        if self._retention is not None:
            self._retention.start()
        exithook.remember(self)  # last: only a producer whose every part runs is closed at exit

    @property
    def on_dead_letter(self) -> DeadLetterCallback | None:
        """The recovery callback: called once per dead-lettered message, after it is stored."""
        return self._callbacks.on_dead_letter

    @on_dead_letter.setter
    def on_dead_letter(self, callback: DeadLetterCallback | None) -> None:
        self._callbacks.on_dead_letter = callback

    # -- the public API ----------------------------------------------------------------------

    def subscribe(self, listener: object) -> None:
        """Tell `listener` what happens to this producer's messages from now on.

        `listener` is an `outbox.Listener` (or any object with some of its methods):
        `committed(batch)`, `delivered(rows)`, `retried(rows)`, `dead(letter)`. Each is called on
        the producer thread that learned the event (the writer, a drain thread, the drain
        process's events thread), once per batch: keep it short. What it raises is logged,
        counted in `stats()["callback_errors"]` and raised by the next `poll()` / `flush()`; the
        producer goes on, and so do the other listeners.
        A message delivered on its first try makes no event: its `on_delivery` hears it.

        Raises:
            TypeError: `listener` has none of the event methods.
            ProducerClosedError: the producer is closed (a RuntimeError).
        """
        if self._closed:
            raise self._closed_error()
        self._events.subscribe(listener)

    def hook_produce(self, hook: ProduceHook) -> None:
        """Run every later produce() call through `hook` (the OpenTelemetry `send` spans).

        `hook(produce, topic, value, key, partition, on_delivery, timestamp, headers, callback,
        enable_retry, transaction)` must return `produce(topic, value, key, partition,
        on_delivery, timestamp, HookedHeaders(...), callback=callback, enable_retry=enable_retry,
        transaction=transaction)`: headers passed as `HookedHeaders` (even empty) run the message
        itself instead of the hook again. One hook per producer: a second replaces the first.
        Costs produce() nothing while none is set (it shares the check of a closed producer).

        Raises:
            ProducerClosedError: the producer is closed (a RuntimeError).
        """
        if self._closed:
            raise self._closed_error()
        if not callable(hook):
            raise TypeError(f"a produce hook must be callable, got {type(hook).__name__}")
        self._produce_hook = hook
        self._produce_guard = True

    def produce(
        self,
        topic: str,
        value: Any = None,
        key: Any = None,
        partition: int | None = -1,
        on_delivery: DeliveryCallback | None = None,
        timestamp: int | None = 0,
        headers: Sequence[tuple[str, bytes | str | None]] | Mapping[str, bytes | str | None] | None = None,
        *,
        callback: DeliveryCallback | None = None,
        enable_retry: bool = True,
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
            partition: explicit partition, or None/-1 for the partitioner.
            on_delivery: ``callback(err, msg)``, called at most once with the message's final
                fate: delivered (err None), dead-lettered, purged by `purge()`, or failed with
                enable_retry=False. Runs on the producer's delivery thread or a drain thread:
                keep it short and do not call flush()/close() from it; what it raises is raised
                by the next poll()/flush(). For a message delivered from the outbox, ``msg`` is
                None. Default: the config's `on_delivery`.
            timestamp: the record timestamp, ms since the epoch; 0 (default) or None: the time of this
                call. Every send of the message, from the outbox too, carries it.
            headers: list of (name, value) pairs (order and duplicates kept) or a dict.
            callback: confluent_kafka's other name for `on_delivery`; it wins if both are given.
            enable_retry: False: a failed send is reported to on_delivery and never stored.
            transaction: the application's open database transaction, on the outbox's own
                database: a psycopg or sqlite3 connection, a SQLAlchemy Connection or Session,
                or Django's connection inside ``transaction.atomic()`` (`outbox.transactions`):
                the message is written to the outbox inside it, so it exists if and only
                if the caller's transaction commits; drain workers deliver it.

        Returns:
            The message id (the `outbox-id` header value).

        Raises:
            TypeError / OverflowError / ConfigError(ValueError): bad arguments; nothing was
                stored or sent.
            ProducerClosedError (a RuntimeError): the producer is closed.
        """
        if self._produce_guard:  # one read on the fast path: closed, hooked (tracing), or the process stops
            if self._closed or exithook.stopping:
                raise self._closed_error()
            hook = self._produce_hook
            if hook is not None and headers.__class__ is not HookedHeaders:
                return hook(
                    self.produce,
                    topic,
                    value,
                    key,
                    partition,
                    on_delivery,
                    timestamp,
                    headers,
                    callback,
                    enable_retry,
                    transaction,
                )
        if topic.__class__ is not str or topic not in KNOWN_TOPICS:
            check_topic(topic)
        if self._serializers is not None:  # once, before the outbox: re-sends reuse the bytes
            value, key, headers = self._serializers(topic, value, key, headers)
        if value is not None and not isinstance(value, BYTES_LIKE):
            check_payload("value", value)
        if key is not None and not isinstance(key, BYTES_LIKE):
            check_payload("key", key)
        if partition != -1 or partition.__class__ is not int:  # the default costs no call
            partition = -1 if partition is None else check_partition(partition)
        timestamp = check_timestamp(timestamp) if timestamp else 0  # None (or any false value): none given
        if callback is not None:  # confluent_kafka: `callback` wins over `on_delivery`
            on_delivery = callback
        elif on_delivery is None:
            on_delivery = self._default_on_delivery
        id_header = self._id_header
        if headers is None:  # the common message: one list, made with the id in it
            msg_id = self._next_id()
            hdrs: Headers = [(id_header, msg_id.encode())] if id_header is not None else []
        else:
            # Before the id: bad headers take no id ("produced").
            hdrs = cast(Headers, headers) if headers.__class__ is CheckedHeaders else normalize_headers(headers)
            msg_id = self._next_id()
            if id_header is not None:
                hdrs.append((id_header, msg_id.encode()))

        route = None
        if enable_retry and not self._writes_ahead and transaction is None:
            # Nothing may be bound for the outbox (the send fence is not armed): Kafka takes it
            # now, without asking admission; the fast path makes no message object (docs/DESIGN.md).
            if not self._fence.armed and self._first.send(
                topic, value, key, hdrs, partition, msg_id, on_delivery, timestamp, routed=False
            ):
                return msg_id
            route = self._route(topic, key)  # outbox.producer.admission: SEND, PROBE, HOLD or STORE
            if route is SEND:
                self._first.send(topic, value, key, hdrs, partition, msg_id, on_delivery, timestamp)
                return msg_id
        # The message object (outbox.message), built as the tuple it is: every other path takes it.
        message: Message = _new_tuple(Message, (topic, value, key, hdrs, partition, msg_id, timestamp, on_delivery))
        if transaction is not None:
            self._enqueue_in_transaction(transaction, message)
            return msg_id
        if route is None:
            if enable_retry:
                self._write_ahead.write(message)
            else:
                self._first.send_unprotected(message)
            return msg_id
        while route is HOLD:
            if self._spill.key_waits(message):
                return msg_id
            route = self._route(topic, key)  # the key was freed meanwhile
        if route is STORE:
            self._spill.store_unsent(message, NOT_SENT_CIRCUIT_OPEN, wait=True)
            return msg_id
        self._first.send(topic, value, key, hdrs, partition, msg_id, on_delivery, timestamp)
        if route is PROBE and key is not None:  # should it fail, stored ahead of its key's later messages
            self._spill.hold_behind_probe(self._message_timeout + 1.0)
        return msg_id

    def produce_batch(
        self,
        topic: str,
        messages: list[dict[str, Any]],
        partition: int = -1,
        on_delivery: DeliveryCallback | None = None,
        *,
        callback: DeliveryCallback | None = None,
    ) -> int:
        """Produce a list of messages, each a dict with any of `value`, `key`, `partition`,
        `timestamp`, `headers` and `callback` (other keys are ignored).

        Unlike confluent_kafka's, each message's headers and timestamp are sent. As there, a
        message that could not be taken gets an `_error` key (a KafkaError) in its dict, and
        the messages are checked before any is produced (a TypeError names the first bad one).

        Returns:
            How many messages were taken (delivered later, or stored in the outbox).
        """
        if self._closed:
            raise self._closed_error()
        if topic.__class__ is not str:
            raise TypeError(f"topic must be str, got {type(topic).__name__}")
        if partition.__class__ is not int:
            raise TypeError(f"partition must be int, got {type(partition).__name__}")
        if not isinstance(messages, list):
            raise TypeError("messages must be a list")
        if callback is not None:
            on_delivery = callback
        _check_batch(messages, payloads=self._serializers is None)
        taken = 0
        for m in messages:
            msg_partition = m.get("partition")
            try:
                self.produce(
                    topic,
                    m.get("value"),
                    m.get("key"),
                    partition if msg_partition is None else msg_partition,
                    m.get("callback") or on_delivery,
                    m.get("timestamp") or 0,
                    m.get("headers"),
                )
            except (TypeError, ValueError, OverflowError) as exc:
                m["_error"] = KafkaError(KafkaError._INVALID_ARG, f"Message failed: {exc}")
                continue
            taken += 1
        return taken

    def poll(self, timeout: float | None = None) -> int:
        """Wait up to `timeout` seconds (None or a negative value: until one comes) for events:
        the callbacks run on the producer's own threads, not in this call.

        Returns:
            How many events (delivery reports, other callbacks) were served since the last call.

        Raises:
            Exception: whatever a callback raised on a producer thread since the last
                poll()/flush().
            ProducerClosedError: the producer is closed (a RuntimeError).
        """
        if self._closed:
            raise self._closed_error()
        return self._poll_report.wait(None if timeout is None or timeout < 0 else timeout)

    def flush(self, timeout: float | None = None) -> int:
        """Wait until every message is delivered or safely in the outbox.

        Args:
            timeout: seconds; None or a negative value: without end.

        Returns:
            How many messages are neither delivered nor committed to the outbox (0 on success).

        Raises:
            Exception: whatever a callback raised on a producer thread (as from poll()).
            ProducerClosedError: the producer is closed (a RuntimeError).
        """
        if self._closed:
            raise self._closed_error()
        left = self._flush(None if timeout is None or timeout < 0 else timeout)
        self._poll_report.raise_pending()
        return left

    def _flush(self, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        step = FLUSH_STEP_FIRST
        while True:
            self._poll_report.raise_pending()
            in_memory = len(self._link)
            held = self._spill.held()
            queued = self.writer.pending() + held
            if in_memory == 0 and queued == 0:
                # As confluent_kafka's flush(): every callback librdkafka had queued has run.
                # Only the delivery thread's current poll is waited for: events queued later
                # are the next flush()'s. Its callbacks are running: the wait is short, its step too.
                serving = self._link.poll_serving()
                while serving and not self._link.poll_ended(serving):
                    if deadline is not None and time.monotonic() >= deadline:
                        break
                    time.sleep(CALLBACKS_STEP)
                return 0
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                # Write-ahead: what librdkafka holds is already committed, hence safe.
                return queued if self.mode == "write-ahead" else in_memory + queued
            if in_memory == 0 and held == 0:
                # Committing may hand write-ahead rows to librdkafka: look again afterwards.
                self.writer.flush(left)
                continue
            time.sleep(step if left is None else min(step, left))
            step = min(step * 2, FLUSH_STEP_MAX)

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        """Drop the messages librdkafka holds, as confluent_kafka's purge() does.

        The application asked for them to be dropped, so they are not stored in the outbox:
        each is reported to its `on_delivery` with KafkaError._PURGE_QUEUE (not yet sent) or
        _PURGE_INFLIGHT (sent, not acknowledged: it may still arrive). Messages already in the
        outbox, or on their way into it, are not purged; in write-ahead mode every message is
        committed before it is sent, so a purged one is re-sent by the drain workers. A purged
        message that librdkafka reports only after this call returned is reported as purged too.

        Args:
            in_queue: purge the messages not yet sent.
            in_flight: purge the messages sent and not yet acknowledged.
            blocking: wait until librdkafka has purged them and the reports it had ready were
                served. A message purged from a broker's queue may be reported a moment later,
                from that broker's thread: flush() waits for it.
        """
        if self._closed:
            raise self._closed_error()
        if in_queue or in_flight:
            self._link.purge_for_app(in_queue, in_flight, blocking)

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> ClusterMetadata:
        """The cluster's metadata, as confluent_kafka's list_topics() gives it."""
        if self._closed:
            raise self._closed_error()
        metadata: ClusterMetadata = self._link.kafka.list_topics(topic, timeout)
        return metadata

    def set_sasl_credentials(self, username: str, password: str) -> None:
        """New SASL username and password for every Kafka client of this producer (its own,
        and its drain workers', in a drain process too), used from their next authentication on."""
        if self._closed:
            raise self._closed_error()
        self._link.set_sasl_credentials(username, password)
        self.drainer.set_sasl_credentials(username, password)

    # Kafka transactions: this producer has no transactional.id (the constructor refuses one),
    # so librdkafka answers these calls exactly as it does for any such confluent_kafka producer.

    def init_transactions(self, timeout: float = -1) -> None:
        """Refused: see `ResilientProducer` (no Kafka transactions; `produce(..., transaction=)`)."""
        self._transactional().init_transactions(timeout)

    def begin_transaction(self) -> None:
        """Refused: see `init_transactions`."""
        self._transactional().begin_transaction()

    def send_offsets_to_transaction(
        self, positions: list[TopicPartition], group_metadata: object, timeout: float = -1
    ) -> None:
        """Refused: see `init_transactions`."""
        self._transactional().send_offsets_to_transaction(positions, group_metadata, timeout)

    def commit_transaction(self, timeout: float = -1) -> None:
        """Refused: see `init_transactions`."""
        self._transactional().commit_transaction(timeout)

    def abort_transaction(self, timeout: float = -1) -> None:
        """Refused: see `init_transactions`."""
        self._transactional().abort_transaction(timeout)

    def _transactional(self) -> Any:
        if self._closed:
            raise self._closed_error()
        return self._link.kafka

    def __len__(self) -> int:
        if self._closed:
            return 0
        return len(self._link) + self.writer.pending() + self._spill.held()

    def __bool__(self) -> bool:
        return True  # not "empty": __len__ alone would make an idle producer false

    def stats(self) -> dict[str, Any]:
        """Counters and outbox state: see the README for each field."""
        if self._forked_from is not None:  # its outbox connection is the parent's
            raise self._closed_error()
        now = time.time()
        try:
            store: StoreStats | None = self.store.stats(now=now)
        except StoreError:  # the store is down: the counters still answer; its fields read None
            store = None
        first_try = self._link.first_sends_delivered()  # once: two reads could disagree
        drain_delivered = self._callbacks.drain_delivered
        return {
            "produced": self._ids.issued,
            "delivered": first_try + drain_delivered,
            "delivered_first_try": first_try,
            "delivered_from_outbox": drain_delivered,
            "outboxed": self._spill.outboxed.value,
            "pending": None if store is None else store.pending,
            "retried": self.drainer.result.retried,
            "dead": None if store is None else store.dead,
            "dead_this_process": self._callbacks.dead + self.drainer.result.dead,
            "failed_no_retry": self._first.failed.value,
            "queue_full_waits": self._link.queue_full_waits.value,
            "store_errors": self.drainer.health.store_errors,
            "drain_restarts": self.drainer.restarts,
            "callback_errors": self._poll_report.callback_errors + self.drainer.callback_errors.count,
            "store_failing_since": self.drainer.health.failing_since,
            "enqueued_in_transaction": self._in_transaction,
            "in_memory": len(self._link),
            "keys_waiting": len(self._backlog.pending),
            "unsaved": self.writer.pending() + self._spill.held(),
            "unsaved_at_close": self._unsaved_at_close,
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

    def close(self, timeout: float | None = None) -> bool:
        """Flush, stop the drain workers and the delivery thread, close the outbox.

        With a `timeout`, deliveries get the first half of it. Then what librdkafka still holds,
        queued or on the wire, is purged and committed to the outbox with the rest of it (a
        message purged from the wire may have been delivered: it can arrive twice, with the same
        `outbox-id`, which beats losing it). Messages not committed by then (the timeout ran out,
        or the outbox could not be written) may be lost: close() returns False, logs their
        number at ERROR and keeps it in `stats()["unsaved_at_close"]`. A callback's exception
        does not stop close(): it is logged and counted (`stats()["callback_errors"]`), never
        raised here, so that closing always finishes.

        Returns:
            True when every message is delivered or in the outbox, as confluent_kafka's close()
            returns True; False when some are neither. A later call returns the first one's
            answer (False while the first is still closing: its count is not known yet).
        """
        if self._closed:
            return self._unsaved_at_close == 0
        self._closed = True
        self._produce_guard = True
        try:
            unsaved = self._close(timeout)
        finally:
            # Forgotten only now: a process that ends meanwhile waits for this close to finish.
            exithook.forget(self)
            self._close_finished.set()
        self._unsaved_at_close = unsaved
        if unsaved:
            log.error(
                "outbox: %d messages were neither delivered nor stored at close() (stats()['unsaved_at_close'])",
                unsaved,
            )
        return unsaved == 0

    def _close(self, timeout: float | None) -> int:
        """close()'s work; returns how many messages are neither delivered nor in the outbox."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        try:
            self._flush(None if timeout is None else timeout * _DELIVERY_SHARE)
        except Exception as exc:  # a callback's, already counted and logged: closing goes on
            log.warning("outbox: close() goes on after a callback raised %r", exc)
        kafka = self._link.kafka
        # Undelivered: librdkafka hands them back (_PURGE_QUEUE, _PURGE_INFLIGHT) for the outbox.
        # What flush() returns is counted now: once the delivery thread stops, len() grows with
        # the events librdkafka keeps queueing (a log line per failed connection), not messages.
        self._link.app_purging = False  # what this purge hands back goes to the outbox
        kafka.purge(in_queue=True, in_flight=True)
        budget = left()  # (a spent budget still serves the purge's reports that are ready)
        in_librdkafka = self._link.flush_reports(5.0 if budget is None else min(budget, 5.0))
        self._backlog.close()
        self._link.stop()
        self.circuit.retire()  # a refusal it was in is told again by the next producer it refuses
        self._poll_report.close()
        self._spill.release_held(force=True)
        # Commit before stopping the drain: a drain worker may wait for its batch on the wire,
        # and what is only in memory matters more than what is already stored.
        self.writer.flush(left())
        self.drainer.stop(left())
        if self._retention is not None:
            self._retention.stop(left())
        unsaved = self.writer.close(left()) + in_librdkafka
        if self._owns_store:
            self.store.close()
        return unsaved

    def close_at_exit(self) -> None:
        """`outbox.producer.exithook`: close within `exit_timeout` as the process ends, and log the counts.

        A close that another thread had begun is waited for (within `exit_timeout`) instead.
        """
        if self._closed:
            if not self._close_finished.wait(self._exit_timeout):
                log.error("outbox: the process ends before a close() begun on another thread finished")
            return
        committed = self.writer.committed_rows
        self.close(self._exit_timeout)
        unsaved = self._unsaved_at_close
        stored = self.writer.committed_rows - committed
        if unsaved:
            log.error(
                "outbox: at exit, %d accepted messages were lost: not committed to the outbox within "
                "exit_timeout=%gs (%d were)",
                unsaved,
                self._exit_timeout,
                stored,
            )
        elif stored:
            log.warning(
                "outbox: at exit, %d undelivered messages were committed to the outbox (%s); the next "
                "producer on it, or `outbox drain`, delivers them",
                stored,
                self.store.location,
            )

    def stop_producing(self) -> None:
        """`outbox.producer.exithook`: the process ends; produce() looks at `exithook.stopping` from now on."""
        self._produce_guard = True

    def disown(self, parent_pid: int) -> None:
        """`outbox.producer.exithook`, in the child of a fork: this copy is the parent's producer.

        It is closed here without closing anything: its threads are not in this process, and its
        outbox connection, Kafka client and drain process are the parent's still. Every later
        call raises ProducerForkedError.
        """
        self._forked_from = parent_pid
        self._closed = True
        self._produce_guard = True
        self._unsaved_at_close = 0  # this process accepted nothing with it
        self._close_finished.set()

    def _closed_error(self) -> ProducerClosedError:
        """What a call on a closed producer raises. While the process stops at exit or SIGTERM,
        a produce() on another thread does not return: it waits for the end (`exithook.park`)."""
        if exithook.stopping:
            exithook.park()
        if self._forked_from is not None:
            return ProducerForkedError(
                f"this ResilientProducer was made in process {self._forked_from}, before a fork: librdkafka's "
                f"threads and the producer's do not survive os.fork(), so process {os.getpid()} cannot use it. "
                "Make the producer in the child, after the fork (gunicorn: in the post_fork hook or the app "
                "without --preload; Celery prefork: on worker_process_init; multiprocessing: in the child's target)"
            )
        return ProducerClosedError(CLOSED)

    def __enter__(self) -> ResilientProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- routing helpers ---------------------------------------------------------------------

    def _enqueue_in_transaction(self, conn: Any, message: Message) -> None:
        # psycopg, sqlite3, SQLAlchemy or Django
        enqueue_in_transaction(self.store, conn, [message.row()])
        # Not counted as "outboxed": the row exists only if the caller commits, which we cannot see.
        self._in_transaction += 1
        self.drainer.wake()

    def _circuit_opened(self) -> None:
        # Move what waits in librdkafka's queue to disk now instead of at message.timeout.ms,
        # and hold later spills back until it has (`outbox.producer.keyorder.Holdback`: per-key
        # order). In write-ahead mode nothing is held, but no new row is sent until then either
        # (admission.py): a row sent now could overtake older rows of its key that librdkafka
        # has yet to hand back.
        self._spill.hold_after_open(self._message_timeout + 1.0)
        self._link.purge_queue_soon()


exithook.accepting(ResilientProducer.produce)


class _Handoffs:
    """The producer's own reactions to what its writer committed and its drain settled: the
    writer's `CommitHandoff` and the drain's `DrainHandback`. Each runs on the thread that
    learned it, before observers hear the event."""

    def __init__(
        self,
        events: Events,
        circuit: CircuitBreaker,
        callbacks: StoredCallbacks,
        backlog: KeyBacklog,
        write_ahead: WriteAhead,
        drainer: Drainer | DrainProcess,
    ) -> None:
        self._events = events
        self._circuit = circuit
        self._callbacks = callbacks
        self._backlog = backlog
        self._write_ahead = write_ahead
        self._drainer = drainer

    def committed(self, batch: Committed) -> None:
        """Writer thread: send write-ahead rows; wake the drain for the rest; report dead letters."""
        if any(batch.leased):
            self._write_ahead.send(batch)
        if any(not leased for leased in batch.leased):
            self._drainer.wake()
        if batch.dead or batch.dead_failed:
            for letter in self._callbacks.committed_dead(batch):
                self.dead(letter)
                self._events.dead(letter)

    def delivered(self, rows: Sequence[OutboxMessage] | Sequence[Drained]) -> None:
        """Drain: a delivery proves the cluster back (the circuit); callbacks; keys may be free."""
        self._circuit.record_success()
        self._callbacks.drained(rows)
        # The key thread looks; the drain worker claims on.
        self._backlog.drained([(row.topic, row.key) for row in rows if row.key is not None])

    def dead(self, letter: DeadLetter) -> None:
        self._callbacks.dead_letter(letter)
        if letter.key is not None:
            self._backlog.drained([(letter.topic, letter.key)])

    def cluster_known_down(self) -> bool:
        return self._circuit.state is CircuitState.OPEN


def _check_batch(messages: list[Any], *, payloads: bool) -> None:
    """produce_batch()'s checks, with confluent_kafka's messages, before anything is sent
    (`payloads`: check values and keys too; not when serializers turn objects into bytes)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"Message at index {i} must be a dict")
        for field in ("value", "key") if payloads else ():
            v = m.get(field)
            if v is not None and not isinstance(v, (bytes, str)):
                raise TypeError(f"Message {field} at index {i} must be bytes or str")
        p = m.get("partition")
        if p is not None and not isinstance(p, int):
            raise TypeError(f"Message partition at index {i} must be int")
