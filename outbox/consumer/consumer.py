"""ResilientConsumer: one confluent_kafka consumer for a main topic and its group's retry tiers.

The poll loop never sleeps: a partition that must wait (a tier whose head is not yet due, or a
message retried in place) is paused at that message and resumed when it is due, while the loop
keeps polling, so the consumer stays in its group however long the wait. Offsets are stored for
commit only past messages whose fate is durable: handled, hop acknowledged by Kafka or committed
to the outbox (the hop producer is a ResilientProducer), or dead letter stored.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import FrameType
from typing import Any

import tenacity
from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from outbox.consumer.circuit import CircuitState, MainTopicBreaker, MainTopicCircuit
from outbox.consumer.deadletters import DeadLetters, check_mode
from outbox.consumer.headers import due_at, failure_headers, ladder_position, record_timestamp
from outbox.consumer.inbox import DEFAULT_WINDOW, Inbox, InboxCommitFailed, takes_transaction
from outbox.consumer.inplace import InPlace, decode
from outbox.consumer.offsets import OffsetTracker
from outbox.consumer.ordering import KeyOrder, scan_ladder
from outbox.consumer.scheduler import PauseScheduler
from outbox.consumer.strategies import Ignore, RetryInPlace, RetryTopics, Strategy, check_strategy
from outbox.consumer.tiers import Ladder, Place, client_config, ensure_tiers
from outbox.errors import ConfigError, KafkaDeliveryError
from outbox.headers import IdGenerator
from outbox.logs import with_librdkafka_log
from outbox.producer.resilient import ResilientProducer
from outbox.records import DeadLetter, Headers
from outbox.retry import RetryPolicy
from outbox.stores import Outbox, open_outbox

log = logging.getLogger(__name__)

TP = tuple[str, int]
Handler = Callable[..., Any]  # handler(msg), or handler(msg, tx) with dedup=True

#: Consumer settings we choose unless the caller sets them.
CONSUMER_DEFAULTS: Mapping[str, Any] = {
    "enable.auto.commit": True,
    "auto.commit.interval.ms": 1000,
    "auto.offset.reset": "earliest",
    # A partition resumed when its head is due joins the *next* fetch request; librdkafka's 500 ms
    # default long-poll made every tier's delay ~0.5 s late while the other partitions were idle.
    "fetch.wait.max.ms": 100,
}
#: Settings the consumer needs and overrides: offsets are stored only once a message's fate is durable.
CONSUMER_FORCED: Mapping[str, Any] = {"enable.auto.offset.store": False}
#: Hop producer defaults (the caller's producer_config wins): hops must not be lost or reordered.
HOP_PRODUCER_DEFAULTS: Mapping[str, Any] = {
    "acks": "all",
    "enable.idempotence": True,
    # Hops are few and never urgent (they wait for a delay anyway): batch them into fewer requests.
    "linger.ms": 20,
    "message.timeout.ms": 15000,
}
#: A hop's offset is committed on its success report, so the hop producer must get every one.
HOP_PRODUCER_FORCED: Mapping[str, Any] = {"delivery.report.only.error": False}
#: The hop producer's retry policy: a hop the cluster cannot take now (a retriable error) is sent
#: again from the outbox until it lands, however long the outage; the producer's default (3
#: attempts) dead-lettered hops after ~30 s of outage, taking them out of the ladder. Errors that
#: no retry can cure (a deleted tier, a message too large) are still dead-lettered at once.
HOP_RETRY = RetryPolicy(stop=tenacity.stop_never, backoff="exponential", initial_delay=1.0, max_delay=30.0)
ORDERINGS = (None, "key")
_NOWHERE = Place("", 0)  # before the first message of a batch
_REWIND_PAUSE = 1.0  # seconds before a batch whose inbox commit failed is read again
SCAN_RETRY_INTERVAL = 5.0  # seconds between tries to read the ladder of partitions paused for want of it
SCAN_TIMEOUT = 30.0  # seconds a ladder scan may take at first


class ResilientConsumer:
    """Consume a topic with non-blocking retry tiers, dead letters and no loss on a crash.

    Args:
        config: confluent_kafka.Consumer settings; `group.id` is required. `enable.auto.offset.store`
            is always False (offsets are stored once a message's fate is durable); auto commit of
            those stored offsets stays on unless you turn it off (then run() commits them).
        topics: the main topics.
        handler: ``handler(msg)`` with a confluent_kafka.Message; raising means the message failed.
        strategy: RetryTopics(delays=[...]) (default [1, 10, 60]), RetryInPlace(policy),
            RetryInPlace(forever=True) or Ignore().
        retry_on: exception classes worth a retry (default: every exception not in `dead_on`).
        dead_on: exception classes that go straight to the dead letters.
        dead_letters: "topic" (``<topic>.<group>.dlq``), "store" (the outbox's dead-letter store)
            or "both".
        outbox: URL or Outbox instance for the hop producer's outbox and the dead-letter store.
        ordering: None, or "key": with RetryTopics, a message whose key has an earlier message
            (from the same main-topic partition) in the retry tiers is parked behind it and handled
            after it leaves them (see the README's ordering rule). Needs the range assignor.
        on_dead_letter: recovery callback, once per dead letter, after it is stored or published;
            also for a hop the hop producer dead-letters (an error no retry cures), then on that
            producer's thread.
        create_topics: create missing tier topics at start-up (else a ConfigError names them).
        deserializer: ``f(value_bytes) -> object`` applied before the handler (the result replaces
            ``msg.value()``); a failure sends the message straight to the dead letters.
        circuit: a MainTopicCircuit: pause the main topic while the handler keeps failing on it
            (None: no circuit breaker).
        producer_config: settings for the hop producer, over those derived from `config`.
        batch_size: messages taken from librdkafka per poll.
        poll_timeout: longest wait of one poll, seconds (bounds how late a due partition resumes).
        dedup: skip a message whose `outbox-id` this group handled already (`outbox.consumer.inbox`;
            marks kept in the outbox's store). A handler ``handler(msg, tx)`` then runs in the
            transaction that marks the message, on the store's connection `tx`.
        dedup_window: seconds a mark is kept (default 7 days): a copy later than that is handled again.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        topics: Sequence[str],
        handler: Handler,
        strategy: Strategy | None = None,
        retry_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
        dead_on: type[BaseException] | tuple[type[BaseException], ...] = (),
        dead_letters: str = "topic",
        outbox: str | Outbox = "sqlite:///consumer-outbox.db",
        ordering: str | None = None,
        on_dead_letter: Callable[[DeadLetter], None] | None = None,
        create_topics: bool = True,
        deserializer: Callable[[bytes | None], Any] | None = None,
        circuit: MainTopicCircuit | None = None,
        producer_config: Mapping[str, Any] | None = None,
        batch_size: int = 500,
        poll_timeout: float = 0.1,
        dedup: bool = False,
        dedup_window: float = DEFAULT_WINDOW,
    ) -> None:
        if not isinstance(config, Mapping):
            raise ConfigError("config must be a dict of confluent_kafka consumer settings")
        group = config.get("group.id")
        if not isinstance(group, str) or not group:
            raise ConfigError("config needs a 'group.id': retry tiers, offsets and dead letters belong to a group")
        if isinstance(topics, str) or not topics or not all(isinstance(t, str) and t for t in topics):
            raise ConfigError(f"topics must be a non-empty list of topic names, got {topics!r}")
        if not callable(handler):
            raise ConfigError(f"handler must be callable, got {type(handler).__name__}")
        if is_async_callable(handler):
            # Called here it would return a coroutine never awaited: every message "handled", none run.
            raise ConfigError("handler is a coroutine function: use outbox.AsyncResilientConsumer for async handlers")
        if deserializer is not None and not callable(deserializer):
            raise ConfigError(f"deserializer must be callable, got {type(deserializer).__name__}")
        if on_dead_letter is not None and not callable(on_dead_letter):
            raise ConfigError(f"on_dead_letter must be callable, got {type(on_dead_letter).__name__}")
        self.strategy = check_strategy(RetryTopics(delays=[1, 10, 60]) if strategy is None else strategy)
        self._retry_on = _exception_classes("retry_on", retry_on) if retry_on is not None else None
        self._dead_on = _exception_classes("dead_on", dead_on)
        mode = check_mode(dead_letters)
        if ordering not in ORDERINGS:
            raise ConfigError(f"ordering must be None or 'key', got {ordering!r}")
        if ordering == "key":
            _check_ordering_config(config)
        if circuit is not None and not isinstance(circuit, MainTopicCircuit):
            raise ConfigError(f"circuit must be a MainTopicCircuit, got {type(circuit).__name__}")
        if batch_size < 1 or poll_timeout <= 0:
            raise ConfigError("batch_size must be >= 1 and poll_timeout > 0")

        self.group = group
        #: Called per message; read at each batch (`wrap_handler` replaces it).
        self.handler: Handler = handler
        self._deserializer = deserializer
        self._batch_size = batch_size
        self._poll_timeout = poll_timeout
        tiers = self.strategy.tiers if isinstance(self.strategy, RetryTopics) else 0
        self.ladder = Ladder(group, tuple(dict.fromkeys(topics)), tiers, with_dlq=mode in ("topic", "both"))
        self._places: dict[str, Place] = self.ladder.places()
        self._delays = tuple(self.strategy.delays) if isinstance(self.strategy, RetryTopics) else ()
        self._in_place: RetryPolicy | None = None
        if isinstance(self.strategy, RetryInPlace):
            p = self.strategy.policy
            self._in_place = dataclasses.replace(p, stop=tenacity.stop_never) if self.strategy.forever else p

        admin_conf = with_librdkafka_log(client_config(config))  # tiers, hop producer, ladder scans
        self._admin_conf = admin_conf
        # Only retry tiers can reorder; RetryInPlace and Ignore keep a partition's order already.
        self._order = KeyOrder() if ordering == "key" and self._delays else None
        self._hop_keys: dict[int, tuple[TP, bytes, int]] = {}  # ordering: hop token → its ladder entry
        ensure_tiers(admin_conf, self.ladder, create=create_topics, same_partitions=self._order is not None)

        self.circuit = MainTopicBreaker(circuit) if circuit is not None else None
        self._ids = IdGenerator()
        #: Hops made into each retry tier (index 0: tier 1); a list the loop thread alone increments.
        self.retried_by_tier = [0] * tiers
        self._tracker = OffsetTracker()
        self._scheduler = PauseScheduler()
        self._durable: queue.SimpleQueue[tuple[int, bool]] = queue.SimpleQueue()
        self._tokens = 0
        self._in_place_state: dict[TP, InPlace] = {}  # the message each partition retries in place
        self._unscanned: list[TopicPartition] = []  # ordering="key": paused until their ladder is read
        self._next_scan = 0.0
        self._scan_timeout = SCAN_TIMEOUT  # doubled after each failed scan: a big ladder gets the time it needs
        self._stop = threading.Event()
        # Held by each turn of the loop: close() waits for a turn in another thread to end, since
        # librdkafka may crash (not raise) when a consumer is closed under a running consume().
        self._turn = threading.RLock()
        self._closed = False
        self._auto_commit = str(config.get("enable.auto.commit", True)).lower() not in ("false", "0")
        self._cooperative = "cooperative" in str(config.get("partition.assignment.strategy", ""))
        self.counts = {
            "handled": 0, "failed": 0, "retried": 0, "ignored": 0, "dead": 0, "paused": 0, "assigned": 0, "revoked": 0,
            "parked": 0, "skipped": 0, "scanned": 0,
        }

        self._owns_store = not isinstance(outbox, Outbox)
        self.store: Outbox = open_outbox(outbox)
        try:
            self._producer = ResilientProducer(
                {**HOP_PRODUCER_DEFAULTS, **admin_conf, **(producer_config or {}), **HOP_PRODUCER_FORCED},
                outbox=self.store,
                id_header=None,  # hops carry the message's own outbox-id (kept, or set once)
                retry=HOP_RETRY,
                # A hop the producer dead-letters (an error no retry cures) is a dead letter too.
                on_dead_letter=on_dead_letter,
            )
        except BaseException:
            self._close_store()
            raise
        self._dead = DeadLetters(mode, self.store, self._publish, on_dead_letter)
        try:
            transactional = takes_transaction(handler)
            self._inbox = Inbox(self.store, group, window=dedup_window, transactional=transactional) if dedup else None
        except BaseException:
            self._producer.close(5)
            self._close_store()
            raise
        conf = {**CONSUMER_DEFAULTS, **config, **CONSUMER_FORCED}
        if self._order is not None:
            conf["partition.assignment.strategy"] = "range"  # main p and tier p on the same member
        try:
            self._consumer = Consumer(with_librdkafka_log(conf))
            self._consumer.subscribe(
                list(self._places), on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
            )
        except KafkaException as exc:
            self._producer.close(5)
            self._close_store()
            raise ConfigError(f"consumer config rejected: {exc.args[0]}") from None

    # -- public API ---------------------------------------------------------------------------

    def wrap_handler(self, wrap: Callable[[Handler], Handler]) -> None:
        """Handle every message from the next batch on with ``wrap(handler)``: a span or a log
        line around each call (`outbox.otel` opens its ``process`` spans this way). A wrapper of
        a transactional handler takes and passes on ``(msg, tx)``."""
        self.handler = wrap(self.handler)

    def run(self, timeout: float | None = None) -> None:
        """Consume until stop(), SIGTERM or SIGINT (or `timeout` seconds), then return.

        SIGTERM/SIGINT handlers are installed only when called from the main thread, and the
        previous ones are restored on return. Call close() (or use ``with``) afterwards.
        """
        restore = self._install_signals()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._stop.is_set():
                if deadline is not None and time.monotonic() >= deadline:
                    break
                if self._poll_turn() is None:  # closed from another thread meanwhile
                    break
        finally:
            for sig, old in restore:
                signal.signal(sig, old)

    def poll_once(self) -> int:
        """One turn of the loop: resume due partitions, settle hops, poll a batch, handle it.

        Returns:
            How many messages were taken from Kafka (held ones included).
        """
        taken = self._poll_turn()
        if taken is None:
            raise RuntimeError("this ResilientConsumer is closed")
        return taken

    def _poll_turn(self) -> int | None:
        """poll_once() under the turn lock; None once closed."""
        with self._turn:
            if self._closed:
                return None
            now = time.time()
            if self._unscanned and time.monotonic() >= self._next_scan:
                self._scan_unscanned()
            if self._scheduler:
                self._resume_due(now)
            if self._tracker.waiting_hops:
                self._settle_hops()
            timeout = self._poll_timeout
            nxt = self._scheduler.next_due()
            if nxt is not None:
                timeout = min(timeout, max(0.0, nxt - time.time()))
            msgs = self._consumer.consume(self._batch_size, timeout)
            if msgs:
                self._handle_batch(msgs)
            self._store_offsets()
            return len(msgs)

    def stop(self) -> None:
        """Ask run() to return after the current message (thread- and signal-safe)."""
        self._stop.set()

    def stats(self) -> dict[str, Any]:
        """Counters and state.

        handled, failed (handler raised), retried (hops to a tier; retried_by_tier: per tier,
        tier 1 first), ignored, dead, paused (holds
        made), assigned / revoked (rebalance callbacks), held (partitions paused now), waiting_hops
        (hops not yet durable), circuit / circuit_opened, producer (the hop producer's stats()).
        ordering="key": parked (messages parked behind an earlier one of their key), skipped
        (main-topic messages read again that were in the ladder already), scanned (tier messages
        counted by the scans at assignment), keys_waiting (keys with a message in the ladder now),
        unscanned (assigned partitions paused because their ladder could not be read yet: the
        cluster did not answer at the assignment; the scan is tried again every few seconds).
        Safe to call from any thread: it makes no librdkafka consumer call.
        """
        return {
            **self.counts,
            "dead": self._dead.count,
            "retried_by_tier": list(self.retried_by_tier),
            "held": len(self._scheduler),
            "waiting_hops": self._tracker.waiting_hops,
            "keys_waiting": 0 if self._order is None else len(self._order),
            "unscanned": len(self._unscanned),
            "circuit": None if self.circuit is None else self.circuit.state.value,
            "circuit_opened": 0 if self.circuit is None else self.circuit.opened,
            "producer": self._producer.stats(),
            "duplicates_skipped": 0 if self._inbox is None else self._inbox.duplicates,
        }

    def close(self, timeout: float = 30.0) -> None:
        """Make pending hops durable, commit, leave the group, close the producer and the store.

        Safe to call while run() polls in another thread: it stops the loop and waits for its
        current turn to end (up to `timeout`). If the turn does not end in time (a handler still
        running), it raises RuntimeError and closes nothing; call it again once the handler returns.
        """
        if self._closed:
            return
        self._stop.set()
        deadline = time.monotonic() + timeout
        if not self._turn.acquire(timeout=max(0.0, timeout)):
            raise RuntimeError(
                f"close(): the consumer loop in another thread did not finish its turn within {timeout:g} s "
                "(a handler is still running); nothing was closed"
            )
        try:
            if self._closed:  # closed by another thread while this one waited
                return
            self._closed = True
            self._close_all(deadline)
        finally:
            self._turn.release()

    def _close_all(self, deadline: float) -> None:
        try:
            if (
                self._tracker.waiting_hops
                and self._producer.flush(max(0.0, deadline - time.monotonic())) == 0
                and self._order is None
            ):
                self._tracker.resolve_all()
            self._settle_hops()
            self._store_offsets()
            self._commit(sync=True)
            self._consumer.close()
        finally:
            self._producer.close(max(1.0, deadline - time.monotonic()))
            if self._inbox is not None:
                self._inbox.close()
            self._close_store()

    def __enter__(self) -> ResilientConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop -----------------------------------------------------------------------------

    def _handle_batch(self, msgs: list[Message]) -> None:
        if self._inbox is None:
            self._handle_messages(msgs)
            return
        try:
            self._handle_messages(msgs)
        except InboxCommitFailed:
            self._rewind(msgs)
            raise
        except BaseException:
            # Stopped half way (an exception out of the loop): what it handled commits, as its
            # offsets may be stored by a later poll or by close().
            try:
                self._inbox.settle()
            except InboxCommitFailed:
                self._rewind(msgs)
            raise

    def _rewind(self, msgs: list[Message]) -> None:
        """The inbox lost the batch's transaction: read the batch again, from each partition's first
        message in it, after a pause (a message whose mark did commit is skipped then)."""
        assert self._inbox is not None
        self._inbox.rewound()
        first: dict[TP, int] = {}
        for m in msgs:
            if m.error() is None:
                first.setdefault((m.topic(), m.partition()), m.offset())  # type: ignore[arg-type]
        due = time.time() + _REWIND_PAUSE
        for tp, offset in first.items():
            self._tracker.rewind(tp, offset)
            try:
                self._hold(tp, offset, due)
            except KafkaException as exc:
                log.warning("could not rewind %s [%d] to %d: %s", tp[0], tp[1], offset, exc.args[0])

    def _handle_messages(self, msgs: list[Message]) -> None:
        # librdkafka returns a batch as runs of one partition's messages: per-partition work (the
        # place lookup, the held check, the offset bookkeeping) is done once per run, not per message.
        held: set[TP] | None = None
        places = self._places
        handler = self.handler
        circuit = self.circuit
        deserializer = self._deserializer
        order = self._order
        inbox = self._inbox
        if inbox is not None:
            inbox.begin(msgs)
        done = self._tracker.done
        handled = 0
        cur_topic: str | None = None
        cur_part = -1
        tp: TP = ("", -1)
        place = _NOWHERE
        skip = False  # the current run's partition is held
        last: Message | None = None  # the current run's last handled message
        for m in msgs:
            err = m.error()
            if err is not None:
                self._consumer_error(err)
                continue
            part = m.partition()
            topic = m.topic()
            if part != cur_part or topic != cur_topic:
                if last is not None:
                    done(tp, last.offset())  # type: ignore[arg-type]
                    last = None
                # Never None on a consumed message; confluent_kafka's stubs say Optional.
                cur_topic, cur_part = topic, part  # type: ignore[assignment]
                tp = (topic, part)  # type: ignore[assignment]
                place = places[topic]  # type: ignore[index]
                skip = held is not None and tp in held
            if skip:
                continue  # behind a held message: it is read again after the seek
            if place.tier:
                if not self._is_due(m, tp):
                    held = held or set()
                    held.add(tp)
                    skip = True
                    continue
            elif circuit is not None and circuit.state is not CircuitState.CLOSED and circuit.blocks(time.time()):
                self._hold(tp, m.offset(), circuit.open_until)  # type: ignore[arg-type]
                held = held or set()
                held.add(tp)
                skip = True
                continue
            if order is not None and m.key() is not None and self._parked(m, tp, place):
                continue
            try:
                if deserializer is not None and not self._deserialize(m, tp, place):
                    continue
                if inbox is None:
                    handler(m)
                elif not inbox.handle(m, handler):
                    last = m  # handled before: its offset may be committed
                    if order is not None and place.tier:
                        self._left_ladder(m, tp, place)  # as a handled copy would
                    continue
            except InboxCommitFailed:
                raise  # not this message's failure: the batch is read again (_handle_batch)
            except Exception as exc:
                if not self._failed(m, tp, m.offset(), place, exc):  # type: ignore[arg-type]
                    held = held or set()
                    held.add(tp)
                    skip = True
                continue
            last = m
            handled += 1
            if circuit is not None and not place.tier:
                circuit.success()
            if order is not None and place.tier:
                self._left_ladder(m, tp, place)
        if inbox is not None:
            inbox.commit()  # the marks before the offsets (stored after this batch)
        if last is not None:
            done(tp, last.offset())  # type: ignore[arg-type]
        self.counts["handled"] += handled

    def _is_due(self, m: Message, tp: TP) -> bool:
        due = due_at(m)
        if due is None or due <= time.time():
            return True
        self._hold(tp, m.offset(), due)  # type: ignore[arg-type]
        return False

    def _deserialize(self, m: Message, tp: TP, place: Place) -> bool:
        assert self._deserializer is not None
        try:
            m.set_value(self._deserializer(m.value()))
        except Exception as exc:
            self.counts["failed"] += 1
            self._dead_letter(m, tp, m.offset(), place, attempts=place.tier + 1, exc=exc)  # type: ignore[arg-type]
            return False
        return True

    def _failed(self, m: Message, tp: TP, offset: int, place: Place, exc: Exception) -> bool:
        """Decide a failed message's fate. False: its partition is now held at it."""
        self.counts["failed"] += 1
        attempts = self._attempts_before(m, place) + 1
        retriable = not isinstance(exc, self._dead_on) and (self._retry_on is None or isinstance(exc, self._retry_on))
        if retriable and not place.tier and self.circuit is not None:
            self.circuit.failure(time.time())
        strategy = self.strategy
        if not retriable:
            self._dead_letter(m, tp, offset, place, attempts=attempts, exc=exc)
        elif isinstance(strategy, RetryTopics):
            if attempts <= len(self._delays):
                # Tier n holds the messages waiting for their attempt n + 1; a parked message
                # counts its own attempts, so it may go back to a lower tier than the one it was in.
                due = time.time() + self._delays[attempts - 1]
                headers, _, _ = failure_headers(
                    m, group=self.group, attempt=attempts, exc=exc, due_at_s=due, ids=self._ids
                )
                token = self._publish(self.ladder.retry_topic(place.main, attempts), m, headers, tp[1])
                self._tracker.wait(tp, offset, token)
                self.counts["retried"] += 1
                self.retried_by_tier[attempts - 1] += 1
                if self._order is not None:
                    self._into_ladder(m, tp, place, token, attempts)
            else:
                self._dead_letter(m, tp, offset, place, attempts=attempts, exc=exc)
        elif isinstance(strategy, RetryInPlace):
            return self._retry_in_place(m, tp, offset, place, exc)
        else:
            assert isinstance(strategy, Ignore)
            self.counts["ignored"] += 1
            log.warning("ignored a failed message %s [%d] @%d: %r", tp[0], tp[1], offset, exc)
            self._tracker.done(tp, offset)
        return True

    def _retry_in_place(self, m: Message, tp: TP, offset: int, place: Place, exc: Exception) -> bool:
        assert self._in_place is not None
        now = time.time()
        state = self._in_place_state.get(tp)
        n, first = (state.attempts, state.first_failed_at) if state is not None and state.offset == offset else (0, now)
        n += 1
        decision = self._in_place.decide(n, first, now)
        if decision.give_up:
            self._in_place_state.pop(tp, None)
            self._dead_letter(m, tp, offset, place, attempts=n, exc=exc)
            return True
        state = self._in_place_state[tp] = InPlace(offset, n, first)
        self._commit_in_place(tp, state)
        log.info("retrying %s [%d] @%d in place in %.3fs (attempt %d): %r", tp[0], tp[1], offset,
                 decision.delay, n, exc)
        self._hold(tp, offset, now + decision.delay)
        return False

    def _commit_in_place(self, tp: TP, state: InPlace) -> None:
        """Commit the partition's offset (at most the retried message's) with the attempt count in its metadata."""
        at = self._tracker.committable_of(tp)
        part = TopicPartition(tp[0], tp[1], state.offset if at is None else min(at, state.offset), state.encode())
        try:
            # Stored too, so that an automatic commit of this offset carries the same metadata.
            self._consumer.store_offsets(offsets=[part])
            self._consumer.commit(offsets=[part], asynchronous=False)
        except KafkaException as exc:
            log.warning("could not commit the in-place attempt count of %s [%d]: %s", tp[0], tp[1], exc.args[0])

    def _dead_letter(
        self, m: Message, tp: TP, offset: int, place: Place, *, attempts: int, exc: BaseException
    ) -> None:
        if self._inbox is not None:
            self._inbox.settle()  # the dead letter may go to the store: not under the inbox's lock
        headers, msg_id, origin = failure_headers(
            m, group=self.group, attempt=attempts, exc=exc, due_at_s=None, ids=self._ids
        )
        if self._order is not None and place.tier:
            self._left_ladder(m, tp, place)
        replay = self.ladder.retry_topic(place.main, 1) if self._delays else place.main
        token = self._dead.record(
            m,
            headers=headers,
            msg_id=msg_id,
            origin=origin,
            attempts=attempts,
            exc=exc,
            dlq_topic=self.ladder.dlq_topic(place.main),
            replay_topic=replay,
            partition=tp[1],
        )
        if token is None:
            self._tracker.done(tp, offset)
        else:
            self._tracker.wait(tp, offset, token)

    # -- ordering="key" -------------------------------------------------------------------------

    def _attempts_before(self, m: Message, place: Place) -> int:
        """Handling attempts this message had before the current one."""
        if not place.tier:
            return 0
        parked = ladder_position(m).parked_attempts  # a parked message does not count by its tier
        return place.tier if parked is None else parked

    def _ladder_at(self, m: Message, tp: TP, place: Place) -> tuple[TP, int]:
        """The main-topic partition and offset a message entered by (its ladder entry's address)."""
        if not place.tier:
            return tp, m.offset()  # type: ignore[return-value]
        pos = ladder_position(m)
        return (place.main, pos.origin_partition if pos.origin_partition >= 0 else tp[1]), pos.origin_offset

    def _parked(self, m: Message, tp: TP, place: Place) -> bool:
        """ordering="key": park `m` behind an earlier message of its key in the ladder. True if parked (or skipped)."""
        order = self._order
        assert order is not None
        key: bytes = m.key()  # type: ignore[assignment]
        origin, at = self._ladder_at(m, tp, place)
        if at < 0:
            return False  # not from this consumer's ladder: no order to keep
        if not place.tier and order.contains(origin, key, at):
            # Read again from the main topic (its offset was not committed before a crash or a
            # rebalance) while its copy is in the ladder: that copy is its fate; this one is done.
            self._tracker.done(tp, at)
            self.counts["skipped"] += 1
            return True
        blocker = order.blocker(origin, key, at)
        if blocker is None:
            return False
        behind, tier = blocker
        headers, _, _ = failure_headers(
            m, group=self.group, attempt=self._attempts_before(m, place), exc=None, due_at_s=None, ids=self._ids,
            parked_behind=behind,
        )
        token = self._publish(self.ladder.retry_topic(place.main, tier), m, headers, tp[1])
        self._tracker.wait(tp, m.offset(), token)  # type: ignore[arg-type]
        self._into_ladder(m, tp, place, token, tier)
        self.counts["parked"] += 1
        return True

    def _into_ladder(self, m: Message, tp: TP, place: Place, token: int, tier: int) -> None:
        """Count a copy of `m` published into `tier` (hop or parking) in its key's ladder entry."""
        order = self._order
        key = m.key()
        if order is None or key is None:
            return
        origin, at = self._ladder_at(m, tp, place)
        if at < 0:
            return
        if place.tier:
            order.moved(origin, key, at, tier)
        else:
            order.entered(origin, key, at, tier)
        self._hop_keys[token] = (origin, key, at)

    def _left_ladder(self, m: Message, tp: TP, place: Place) -> None:
        """A tier message was handled or dead-lettered: its key's later messages may follow."""
        key = m.key()
        if self._order is not None and key is not None:
            origin, at = self._ladder_at(m, tp, place)
            self._order.left(origin, key, at)

    # -- hops ---------------------------------------------------------------------------------

    def _publish(self, topic: str, m: Message, headers: Headers, partition: int) -> int:
        """Send a hop through the ResilientProducer; its token is settled once the hop is durable."""
        if self._inbox is not None:
            self._inbox.settle()  # the producer may write the hop to the store: not under the inbox's lock
        self._tokens += 1
        token = self._tokens
        self._producer.produce(
            topic, m.value(), m.key(), partition, functools.partial(self._hop_settled, token),
            record_timestamp(m), headers,
        )
        return token

    def _hop_settled(self, token: int, err: KafkaError | None, _msg: Message | None) -> None:
        # Runs on the producer's delivery or drain thread: hand the token to the loop thread.
        if err is not None:
            log.error("hop %d was dead-lettered by the producer (kept in the outbox's dead letters): %s", token, err)
        self._durable.put((token, err is None))

    def _settle_hops(self) -> None:
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

    # -- pause / resume ----------------------------------------------------------------------

    def _hold(self, tp: TP, offset: int, due: float) -> None:
        part = TopicPartition(tp[0], tp[1], offset)
        # Pause first, then seek: librdkafka drops the prefetched messages on pause, and a seek made
        # before the pause can be lost (librdkafka #3471). The seek is repeated on resume (#2557).
        self._consumer.pause([part])
        self._consumer.seek(part)
        self._scheduler.hold(tp, offset, due)
        self.counts["paused"] += 1

    def _resume_due(self, now: float) -> None:
        for tp, hold in self._scheduler.pop_due(now):
            part = TopicPartition(tp[0], tp[1], hold.offset)
            try:
                self._consumer.seek(part)
                self._consumer.resume([part])
            except KafkaException as exc:
                log.warning("could not resume %s [%d]: %s", tp[0], tp[1], exc.args[0])

    # -- offsets and rebalances ---------------------------------------------------------------

    def _store_offsets(self) -> None:
        moved = self._tracker.committable()
        if not moved:
            return
        parts = [_partition(t, p, o, self._in_place_metadata((t, p), o)) for (t, p), o in moved]
        try:
            self._consumer.store_offsets(offsets=parts)
        except KafkaException as exc:
            log.debug("store_offsets: %s", exc.args[0])  # a partition was revoked meanwhile
        if not self._auto_commit:
            self._commit(sync=False)

    def _in_place_metadata(self, tp: TP, offset: int) -> str | None:
        """The commit metadata of `tp` at `offset`: the in-place count of a message not yet past, else none."""
        if not self._in_place_state:
            return None
        state = self._in_place_state.get(tp)
        if state is None:
            return None
        if offset <= state.offset:
            return state.encode()  # still to be retried: keep its count
        del self._in_place_state[tp]  # past it: handled or dead-lettered
        return None

    def _commit(self, *, sync: bool) -> None:
        try:
            if sync:
                self._consumer.commit(asynchronous=False)
            else:
                self._consumer.commit(asynchronous=True)
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            if err.code() != KafkaError._NO_OFFSET:
                log.warning("offset commit failed: %s", err)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = [(p.topic, p.partition) for p in partitions]
        self._scheduler.forget(tps)
        self._tracker.forget(tps)
        tier_parts = [p for p in partitions if self._places[p.topic].tier]
        unscanned = False
        if tier_parts:
            committed = self._tier_offsets(consumer, tier_parts)
            if committed is None and self._order is not None:
                unscanned = True  # the offsets are read with the ladder, once the cluster answers
            else:
                committed = committed or {}  # unreadable: every tier partition from its beginning
                _start_new_tiers_at_beginning(tier_parts, committed)
                if self._order is not None:
                    unscanned = not self._rebuild_order(partitions, tier_parts, committed)
        if self._in_place is not None:
            self._restore_in_place(consumer, partitions)
        if self._cooperative:
            consumer.incremental_assign(partitions)
        else:
            consumer.assign(partitions)
        # A pause does not survive in our state; make sure none survives in librdkafka's either.
        consumer.resume(partitions)
        if unscanned:
            # ordering="key" with the ladder unreadable (the cluster is down): handing out these
            # partitions' messages could reorder a key, so they stay paused until a scan succeeds.
            consumer.pause(partitions)
            self._unscanned.extend(TopicPartition(p.topic, p.partition) for p in partitions)
            self._next_scan = time.monotonic() + SCAN_RETRY_INTERVAL
        # Counted once done (the ordering scan included), so that stats() never shows an assignment half made.
        self.counts["assigned"] += 1
        log.info("assigned %d partitions", len(partitions))

    def _tier_offsets(self, consumer: Consumer, tier_parts: list[TopicPartition]) -> dict[TP, int] | None:
        """The group's committed offsets of `tier_parts`, or None when the cluster does not answer."""
        try:
            return {(c.topic, c.partition): c.offset for c in consumer.committed(tier_parts, timeout=10)}
        except KafkaException as exc:
            log.warning("could not read committed offsets of tier partitions: %s", exc.args[0])
            return None

    def _scan_unscanned(self) -> None:
        """ordering="key": try again to read the ladder of the partitions paused for want of it."""
        self._next_scan = time.monotonic() + SCAN_RETRY_INTERVAL
        partitions = self._unscanned
        tier_parts = [TopicPartition(p.topic, p.partition) for p in partitions if self._places[p.topic].tier]
        committed = self._tier_offsets(self._consumer, tier_parts) if tier_parts else {}
        if committed is None or not self._rebuild_order(partitions, tier_parts, committed):
            return
        # Assigned again, the same partitions, now with the tier offsets known. (A seek cannot
        # start a tier partition at its beginning: librdkafka refuses to seek a partition whose
        # fetch never started.) ordering="key" uses the eager range assignor, so these
        # partitions are the whole assignment.
        _start_new_tiers_at_beginning(tier_parts, committed)
        starts = [p for p in partitions if not self._places[p.topic].tier] + tier_parts
        try:
            self._consumer.assign(starts)
            self._consumer.resume(starts)
        except KafkaException as exc:
            assert self._order is not None
            self._order.forget(self._origins(partitions))
            log.warning("could not resume the scanned partitions, trying again: %s", exc.args[0])
            return
        self._unscanned = []
        log.info("ordering='key': %d partitions resumed after their ladder scan", len(partitions))

    def _origins(self, partitions: list[TopicPartition]) -> set[TP]:
        """The main-topic partitions whose messages `partitions` (main or tier) hold."""
        return {(self._places[p.topic].main, p.partition) for p in partitions}

    def _restore_in_place(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """RetryInPlace: the attempt counts a previous owner committed with the offsets it resumes from."""
        try:
            got = consumer.committed([TopicPartition(p.topic, p.partition) for p in partitions], timeout=10)
        except KafkaException as exc:
            log.warning("could not read the in-place attempt counts (they restart from zero): %s", exc.args[0])
            return
        for c in got:
            state = decode(c.metadata)
            if state is not None:
                self._in_place_state[(c.topic, c.partition)] = state
                log.info("%s [%d] @%d: %d in-place attempts made before the assignment", c.topic, c.partition,
                         state.offset, state.attempts)

    def _rebuild_order(
        self, partitions: list[TopicPartition], tier_parts: list[TopicPartition], committed: dict[TP, int]
    ) -> bool:
        """ordering="key": learn what is in the ladder of the assigned partitions from their tier partitions.

        Returns:
            False when the ladder could not be read (the cluster does not answer); nothing of
            these partitions is counted then.
        """
        assert self._order is not None
        mine = {(p.topic, p.partition) for p in partitions}
        for t, part in mine:
            place = self._places[t]
            missing = [x for x, pl in self._places.items() if pl.main == place.main and (x, part) not in mine]
            if missing:
                log.error(
                    "ordering='key' cannot be kept for %s [%d]: %s [%d] belongs to another member "
                    "(every member must use the range assignor and the same topics)", place.main, part, missing[0],
                    part,
                )
        starts = [
            TopicPartition(p.topic, p.partition, committed.get((p.topic, p.partition), OFFSET_INVALID))
            for p in tier_parts
        ]
        try:
            counted = scan_ladder(self._admin_conf, starts, self._places, self._order, timeout=self._scan_timeout)
        except KafkaException as exc:
            self._scan_timeout = min(self._scan_timeout * 2, 600.0)
            self._order.forget(self._origins(partitions))  # a partial count would make keys wait for copies never read
            log.warning("ordering='key': the ladder of %d partitions could not be read, they stay paused "
                        "until it can: %s", len(partitions), exc.args[0])
            return False
        self._scan_timeout = SCAN_TIMEOUT
        self.counts["scanned"] += counted
        log.info("ordering='key': %d tier messages counted, %d keys waiting", counted, len(self._order))
        return True

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.counts["revoked"] += 1
        tps = [(p.topic, p.partition) for p in partitions]
        if self._order is not None:
            # Hops acknowledged now are seen by the next owner's scan; their sources can be committed.
            self._producer.flush(10.0)
        self._settle_hops()
        self._store_offsets()
        self._commit(sync=True)
        self._forget(tps)
        if self._cooperative:
            consumer.incremental_unassign(partitions)
        else:
            consumer.unassign()

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost, not revoked: another member may own them already, so commit nothing.
        self._forget([(p.topic, p.partition) for p in partitions])
        if self._cooperative:
            consumer.incremental_unassign(partitions)
        else:
            consumer.unassign()

    def _forget(self, tps: list[TP]) -> None:
        self._scheduler.forget(tps)
        self._tracker.forget(tps)
        gone = set(tps)
        self._unscanned = [p for p in self._unscanned if (p.topic, p.partition) not in gone]
        if self._order is not None:
            origins = {(self._places[t].main, p) for t, p in gone}
            self._order.forget(origins)
            self._hop_keys = {k: v for k, v in self._hop_keys.items() if v[0] not in origins}
        for tp in gone:
            self._in_place_state.pop(tp, None)

    # -- misc ---------------------------------------------------------------------------------

    def _consumer_error(self, err: KafkaError) -> None:
        if err.code() == KafkaError._PARTITION_EOF:
            return
        if err.fatal():
            raise KafkaDeliveryError(err.code(), err.name(), err.str())
        log.warning("consumer error: %s", err)

    def _install_signals(self) -> list[tuple[int, Any]]:
        if threading.current_thread() is not threading.main_thread():
            return []

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            log.info("signal %d: stopping the consumer", signum)
            self.stop()

        restore: list[tuple[int, Any]] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            restore.append((sig, signal.signal(sig, on_signal)))
        return restore

    def _close_store(self) -> None:
        if self._owns_store:
            self.store.close()


def is_async_callable(f: object) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one (an async handler)."""
    return inspect.iscoroutinefunction(f) or inspect.iscoroutinefunction(type(f).__call__)


def _start_new_tiers_at_beginning(tier_parts: list[TopicPartition], committed: Mapping[TP, int]) -> None:
    """A tier partition this group never committed starts at its beginning whatever
    auto.offset.reset says: its messages were produced by this group for this group."""
    for p in tier_parts:
        if committed.get((p.topic, p.partition), OFFSET_INVALID) == OFFSET_INVALID:
            p.offset = OFFSET_BEGINNING


def _partition(topic: str, partition: int, offset: int, metadata: str | None) -> TopicPartition:
    # confluent_kafka takes metadata only as a str argument (None is refused, the attribute is read-only).
    if metadata is None:
        return TopicPartition(topic, partition, offset)
    return TopicPartition(topic, partition, offset, metadata)


def _check_ordering_config(config: Mapping[str, Any]) -> None:
    """ordering="key" keeps its state on the member that owns partition p of the main topic and of
    every tier: only the classic protocol's range assignor puts them together."""
    assignor = str(config.get("partition.assignment.strategy", "range")).replace(" ", "")
    if assignor != "range":
        raise ConfigError(
            f"ordering='key' needs partition.assignment.strategy 'range' (got {assignor!r}): partition p of the "
            "main topic and of each retry tier must belong to the same member"
        )
    if str(config.get("group.protocol", "classic")).lower() != "classic":
        raise ConfigError("ordering='key' needs group.protocol 'classic' (its range assignor co-locates the tiers)")


def _exception_classes(
    name: str, value: type[BaseException] | Iterable[type[BaseException]]
) -> tuple[type[BaseException], ...]:
    classes = (value,) if isinstance(value, type) else tuple(value)
    for c in classes:
        if not (isinstance(c, type) and issubclass(c, BaseException)):
            raise ConfigError(f"{name} must be exception classes, got {c!r}")
    return classes
