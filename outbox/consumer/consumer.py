"""ResilientConsumer: one confluent_kafka consumer for a main topic and its group's retry tiers.

The poll loop never sleeps: a partition that must wait (a tier whose head is not yet due, or a
message retried in place) is paused at that message and resumed when it is due, while the loop
keeps polling, so the consumer stays in its group however long the wait. Offsets are stored for
commit only past messages whose fate is durable: handled, hop acknowledged by Kafka or committed
to the outbox (the hop producer is a ResilientProducer), or dead letter stored.
"""

from __future__ import annotations

import inspect
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import FrameType
from typing import Any

import tenacity
from confluent_kafka import Consumer, KafkaError, KafkaException, Message

from outbox.consumer.assignment import Assignments, is_consumer_protocol, is_cooperative
from outbox.consumer.circuit import CircuitState, MainTopicBreaker, MainTopicCircuit
from outbox.consumer.commits import OffsetCommits
from outbox.consumer.deadletters import DeadLetters, check_mode
from outbox.consumer.headers import due_at
from outbox.consumer.hops import Hops, attempts_before
from outbox.consumer.inbox import DEFAULT_WINDOW, Inbox, InboxCommitFailed, takes_transaction
from outbox.consumer.inplace import InPlaceRetries
from outbox.consumer.offsets import TP, OffsetTracker
from outbox.consumer.ordering import KeyOrder, KeyOrderRebuild
from outbox.consumer.rebalance import Rebalance
from outbox.consumer.scheduler import Holds
from outbox.consumer.strategies import Ignore, RetryInPlace, RetryTopics, Strategy, check_strategy
from outbox.consumer.tiers import Ladder, Place, client_config, ensure_tiers
from outbox.errors import ConfigError, KafkaDeliveryError
from outbox.headers import IdGenerator
from outbox.logs import with_librdkafka_log
from outbox.producer.refusals import RefusalNotices
from outbox.producer.resilient import ResilientProducer
from outbox.records import DeadLetter
from outbox.retry import RetryPolicy, refused
from outbox.stores import Outbox, open_outbox
from outbox.stores.encryption import Encryption, as_key_ring

log = logging.getLogger(__name__)

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
#: The counters of stats(), in its order; the loop thread alone increments them.
COUNTERS = (
    "handled",
    "failed",
    "retried",
    "ignored",
    "dead",
    "paused",
    "assigned",
    "revoked",
    "parked",
    "skipped",
    "scanned",
)
_NOWHERE = Place("", 0)  # before the first message of a batch
_REWIND_PAUSE = 1.0  # seconds before a batch whose inbox commit failed is read again


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
            after it leaves them (see the README's ordering rule). Needs a range assignor: the
            classic protocol's, or the broker's with group.protocol=consumer (set unless given).
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
        encryption: encrypt the value and headers of every message the consumer's outbox stores
            (hops it could not publish yet, dead letters with dead_letters="store" or "both"), as
            `ResilientProducer`'s `encryption`: a `KeyRing`, a `Key`, or keys newest first.
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
        encryption: Encryption | None = None,
    ) -> None:
        group = _check_arguments(config, topics, handler, deserializer, on_dead_letter)
        self.strategy = check_strategy(RetryTopics(delays=[1, 10, 60]) if strategy is None else strategy)
        self._retry_on = _exception_classes("retry_on", retry_on) if retry_on is not None else None
        self._dead_on = _exception_classes("dead_on", dead_on)
        mode = check_mode(dead_letters)
        _check_options(config, ordering, circuit, batch_size, poll_timeout)

        self.group = group
        #: Called per message; read at each batch (`wrap_handler` replaces it).
        self.handler: Handler = handler
        self._deserializer = deserializer
        self._batch_size = batch_size
        self._poll_timeout = poll_timeout
        delays = tuple(self.strategy.delays) if isinstance(self.strategy, RetryTopics) else ()
        self.ladder = Ladder(group, tuple(dict.fromkeys(topics)), len(delays), with_dlq=mode in ("topic", "both"))
        self._places: dict[str, Place] = self.ladder.places()

        admin_conf = with_librdkafka_log(client_config(config))  # tiers, hop producer, ladder scans
        #: The settings of the clients made later (ladder scans): `set_sasl_credentials` updates them.
        self._client_conf = admin_conf
        self._notices = RefusalNotices(admin_conf)  # its refused errors, told once in the process
        # Only retry tiers can reorder; RetryInPlace and Ignore keep a partition's order already.
        self._order = KeyOrder() if ordering == "key" and delays else None
        ensure_tiers(admin_conf, self.ladder, create=create_topics, same_partitions=self._order is not None)

        self.circuit = MainTopicBreaker(circuit) if circuit is not None else None
        self._tracker = OffsetTracker()
        self._stop = threading.Event()
        # Held by each turn of the loop: close() waits for a turn in another thread to end, since
        # librdkafka may crash (not raise) when a consumer is closed under a running consume().
        self._turn = threading.RLock()
        self._closed = False
        self.counts = dict.fromkeys(COUNTERS, 0)

        self._owns_store = not isinstance(outbox, Outbox)
        self.store: Outbox = open_outbox(outbox, encryption=as_key_ring(encryption))
        try:
            self._producer = _hop_producer(admin_conf, producer_config, self.store, on_dead_letter)
        except BaseException:
            self._close_store()
            raise
        try:
            transactional = takes_transaction(handler)
            self._inbox = Inbox(self.store, group, window=dedup_window, transactional=transactional) if dedup else None
        except BaseException:
            self._producer.close(5)
            self._close_store()
            raise
        ids = IdGenerator()
        self._hops = Hops(
            self._producer, self._tracker, self._order, self._inbox, self.ladder, ids, delays, self.counts
        )
        #: Hops made into each retry tier (index 0: tier 1).
        self.retried_by_tier = self._hops.retried_by_tier
        self._dead = DeadLetters(
            mode, self.store, self._hops, on_dead_letter, self.ladder, ids, self._tracker, self._inbox
        )
        # None of our settings is one that group.protocol=consumer refuses (session.timeout.ms,
        # heartbeat.interval.ms, partition.assignment.strategy): a user's gets librdkafka's error.
        conf = {**CONSUMER_DEFAULTS, **config, **CONSUMER_FORCED}
        if self._order is not None:  # main p and tier p on the same member (_check_ordering_config)
            conf["group.remote.assignor" if is_consumer_protocol(conf) else "partition.assignment.strategy"] = "range"
        try:
            self._consumer = Consumer(with_librdkafka_log(conf))
        except KafkaException as exc:
            raise self._rejected(exc) from None
        self._holds = Holds(self._consumer, self.counts)
        in_place = self.strategy if isinstance(self.strategy, RetryInPlace) else None
        self._in_place = None if in_place is None else InPlaceRetries(in_place, self._consumer, self._tracker)
        auto_commit = str(config.get("enable.auto.commit", True)).lower() not in ("false", "0")
        assignments = Assignments(self._consumer, cooperative=is_cooperative(conf))
        self._offsets = OffsetCommits(self._consumer, self._tracker, self._in_place, auto_commit=auto_commit)
        self._rebuild = (
            None
            if self._order is None
            else KeyOrderRebuild(self._order, self._consumer, assignments, self._places, admin_conf, self.counts)
        )
        rebalance = Rebalance(
            self._places,
            self._holds,
            self._offsets,
            self._hops,
            self._rebuild,
            self._in_place,
            self.counts,
            assignments,
        )
        try:
            self._consumer.subscribe(
                list(self._places),
                on_assign=rebalance.on_assign,
                on_revoke=rebalance.on_revoke,
                on_lost=rebalance.on_lost,
            )
        except KafkaException as exc:
            raise self._rejected(exc) from None

    def _rejected(self, exc: KafkaException) -> ConfigError:
        """The consumer's settings were refused: close what __init__ opened, and say why in
        librdkafka's own sentence (a setting group.protocol=consumer does not allow is named there)."""
        self._producer.close(5)
        self._close_store()
        err = exc.args[0]
        why = err.str() if isinstance(err, KafkaError) else str(err)
        return ConfigError(f"consumer config rejected: {why.removeprefix('Failed to create consumer: ')}")

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
        restore = _install_signals(self.stop)
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
            rebuild = self._rebuild
            if rebuild is not None and rebuild.unscanned and time.monotonic() >= rebuild.next_scan:
                rebuild.retry()
            if self._holds:
                self._holds.resume_due(now)
            if self._tracker.waiting_hops:
                self._hops.settle()
            timeout = self._poll_timeout
            nxt = self._holds.next_due()
            if nxt is not None:
                timeout = min(timeout, max(0.0, nxt - time.time()))
            msgs = self._consumer.consume(self._batch_size, timeout)
            if msgs:
                self._handle_batch(msgs)
            self._offsets.store()
            return len(msgs)

    def set_sasl_credentials(self, username: str, password: str) -> None:
        """New SASL username and password for every Kafka client of this consumer, used from
        their next authentication on: its consumer, the producer of its hops (and that producer's
        drain), and the clients it makes later (the ladder scans of ``ordering="key"``)."""
        if self._closed:
            raise RuntimeError("this ResilientConsumer is closed")
        self._consumer.set_sasl_credentials(username, password)
        self._producer.set_sasl_credentials(username, password)
        self._client_conf.update({"sasl.username": username, "sasl.password": password})

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
            "held": len(self._holds),
            "waiting_hops": self._tracker.waiting_hops,
            "keys_waiting": 0 if self._order is None else len(self._order),
            "unscanned": 0 if self._rebuild is None else len(self._rebuild.unscanned),
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
            self._hops.flush(deadline)
            self._offsets.store()
            self._offsets.commit(sync=True)
            self._consumer.close()
        finally:
            self._notices.answered()
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
                self._holds.hold(tp, offset, due)
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
        hops = self._hops
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
        if self._notices.refusing and any(m.error() is None for m in msgs):
            self._notices.answered()
        for m in msgs:
            err = m.error()
            if err is not None:
                _consumer_error(err, self._notices)
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
                self._holds.hold(tp, m.offset(), circuit.open_until)  # type: ignore[arg-type]
                held = held or set()
                held.add(tp)
                skip = True
                continue
            if order is not None and m.key() is not None and hops.park(m, tp, place):
                continue
            try:
                if deserializer is not None and not self._deserialize(m, tp, place):
                    continue
                if inbox is None:
                    handler(m)
                elif not inbox.handle(m, handler):
                    last = m  # handled before: its offset may be committed
                    if order is not None and place.tier:
                        hops.left(m, tp, place)  # as a handled copy would
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
                hops.left(m, tp, place)
        if inbox is not None:
            inbox.commit()  # the marks before the offsets (stored after this batch)
        if last is not None:
            done(tp, last.offset())  # type: ignore[arg-type]
        self.counts["handled"] += handled

    def _is_due(self, m: Message, tp: TP) -> bool:
        due = due_at(m)
        if due is None or due <= time.time():
            return True
        self._holds.hold(tp, m.offset(), due)  # type: ignore[arg-type]
        return False

    def _deserialize(self, m: Message, tp: TP, place: Place) -> bool:
        assert self._deserializer is not None
        try:
            m.set_value(self._deserializer(m.value()))
        except Exception as exc:
            self.counts["failed"] += 1
            self._dead.dead_letter(m, tp, m.offset(), place, attempts=place.tier + 1, exc=exc)  # type: ignore[arg-type]
            return False
        return True

    def _failed(self, m: Message, tp: TP, offset: int, place: Place, exc: Exception) -> bool:
        """Decide a failed message's fate. False: its partition is now held at it."""
        self.counts["failed"] += 1
        attempts = attempts_before(m, place) + 1
        retriable = not isinstance(exc, self._dead_on) and (self._retry_on is None or isinstance(exc, self._retry_on))
        if retriable and not place.tier and self.circuit is not None:
            self.circuit.failure(time.time())
        strategy = self.strategy
        if not retriable:
            self._dead.dead_letter(m, tp, offset, place, attempts=attempts, exc=exc)
        elif isinstance(strategy, RetryTopics):
            if attempts <= self.ladder.tiers:
                self._hops.retry(m, tp, offset, place, attempts, exc)
            else:
                self._dead.dead_letter(m, tp, offset, place, attempts=attempts, exc=exc)
        elif isinstance(strategy, RetryInPlace):
            assert self._in_place is not None
            attempts, due = self._in_place.failed(tp, offset, exc)
            if due is not None:
                self._holds.hold(tp, offset, due)
                return False
            self._dead.dead_letter(m, tp, offset, place, attempts=attempts, exc=exc)
        else:
            assert isinstance(strategy, Ignore)
            self.counts["ignored"] += 1
            log.warning("ignored a failed message %s [%d] @%d: %r", tp[0], tp[1], offset, exc)
            self._tracker.done(tp, offset)
        return True

    def _close_store(self) -> None:
        if self._owns_store:
            self.store.close()


def is_async_callable(f: object) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one (an async handler)."""
    return inspect.iscoroutinefunction(f) or inspect.iscoroutinefunction(type(f).__call__)


def _check_arguments(
    config: Mapping[str, Any],
    topics: Sequence[str],
    handler: Handler,
    deserializer: Callable[[bytes | None], Any] | None,
    on_dead_letter: Callable[[DeadLetter], None] | None,
) -> str:
    """The checks of config, topics and the callables, in the constructor's order; returns the group."""
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
    return group


def _check_options(
    config: Mapping[str, Any],
    ordering: str | None,
    circuit: MainTopicCircuit | None,
    batch_size: int,
    poll_timeout: float,
) -> None:
    """The checks of ordering, circuit, batch_size and poll_timeout, in the constructor's order."""
    if ordering not in ORDERINGS:
        raise ConfigError(f"ordering must be None or 'key', got {ordering!r}")
    if ordering == "key":
        _check_ordering_config(config)
    if circuit is not None and not isinstance(circuit, MainTopicCircuit):
        raise ConfigError(f"circuit must be a MainTopicCircuit, got {type(circuit).__name__}")
    if batch_size < 1 or poll_timeout <= 0:
        raise ConfigError("batch_size must be >= 1 and poll_timeout > 0")


def _consumer_error(err: KafkaError, notices: RefusalNotices) -> None:
    if err.code() == KafkaError._PARTITION_EOF:
        return
    if err.fatal():
        raise KafkaDeliveryError(err.code(), err.name(), err.str())
    # A refusal of the credentials is told once in the process (`outbox.producer.refusals`).
    log.log(notices.level() if refused(err) else logging.WARNING, "consumer error: %s", err)


def _install_signals(stop: Callable[[], None]) -> list[tuple[int, Any]]:
    """SIGTERM and SIGINT call `stop` (from the main thread only); returns what restores the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping the consumer", signum)
        stop()

    restore: list[tuple[int, Any]] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        restore.append((sig, signal.signal(sig, on_signal)))
    return restore


def _hop_producer(
    client_conf: Mapping[str, Any],
    producer_config: Mapping[str, Any] | None,
    store: Outbox,
    on_dead_letter: Callable[[DeadLetter], None] | None,
) -> ResilientProducer:
    """The producer of the hops: the consumer's client settings, then the caller's `producer_config`."""
    return ResilientProducer(
        {**HOP_PRODUCER_DEFAULTS, **client_conf, **(producer_config or {}), **HOP_PRODUCER_FORCED},
        outbox=store,
        id_header=None,  # hops carry the message's own outbox-id (kept, or set once)
        retry=HOP_RETRY,
        # A hop the producer dead-letters (an error no retry cures) is a dead letter too.
        on_dead_letter=on_dead_letter,
    )


def _check_ordering_config(config: Mapping[str, Any]) -> None:
    """ordering="key" keeps its state on the member that owns partition p of the main topic and of
    every tier: a range assignor puts them together, as the tiers have the main topic's partition
    count. Classic: librdkafka's range assignor. group.protocol=consumer: the broker's, which
    co-partitions topics of one partition count, stickiness included; the broker uses the assignor
    most members ask for, and every ResilientConsumer with ordering="key" asks for range. A
    hand-off in steps (main p before tier p) waits for its last step (KeyOrderRebuild)."""
    if is_consumer_protocol(config):
        assignor = str(config.get("group.remote.assignor", "range")).strip()
        if assignor != "range":
            raise ConfigError(
                f"ordering='key' needs group.remote.assignor 'range' (got {assignor!r}): partition p of the "
                "main topic and of each retry tier must belong to the same member"
            )
        return
    assignor = str(config.get("partition.assignment.strategy", "range")).replace(" ", "")
    if assignor != "range":
        raise ConfigError(
            f"ordering='key' needs partition.assignment.strategy 'range' (got {assignor!r}): partition p of the "
            "main topic and of each retry tier must belong to the same member"
        )


def _exception_classes(
    name: str, value: type[BaseException] | Iterable[type[BaseException]]
) -> tuple[type[BaseException], ...]:
    classes = (value,) if isinstance(value, type) else tuple(value)
    for c in classes:
        if not (isinstance(c, type) and issubclass(c, BaseException)):
            raise ConfigError(f"{name} must be exception classes, got {c!r}")
    return classes
