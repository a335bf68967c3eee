"""KafkaLink: a ResilientProducer's one librdkafka producer and the thread that serves it.

The delivery thread (`outbox-delivery`) polls librdkafka, so every delivery callback runs on it
(first sends, write-ahead sends, `enable_retry=False` sends). Between polls it does what only it
may do to the producer: purge it when the circuit opens or the hold-back is full, and recreate
it after a fatal error. It also counts what librdkafka took and delivered, which is how a
half-open circuit closes and a run of failures ends when successes are not reported at all
(`delivery.report.only.error`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import KafkaError, Producer

from outbox.message import MESSAGE_OVERHEAD
from outbox.producer.circuit import CircuitBreaker
from outbox.producer.pollreport import PollReport
from outbox.producer.probe import ClusterProbe
from outbox.producer.refusals import Refusal, refusal_of
from outbox.producer.tokens import TokenSource
from outbox.retry import UNREACHABLE_CODES, describe, refused
from outbox.tally import Tally

log = logging.getLogger("outbox")

#: How often a produce() waiting for room in librdkafka's full queue tries again (seconds).
ROOM_CHECK_INTERVAL = 0.001
#: librdkafka's own limit on queued messages (`queue.buffering.max.messages`'s default).
LIBRDKAFKA_MAX_MESSAGES = 100_000


def queue_limits(config: Mapping[str, Any], memory_budget: int) -> tuple[dict[str, Any], int]:
    """librdkafka's queue bound for a producer with this memory budget, and what it lets back.

    Returns the settings to add (only what `config` does not set) and the bytes the messages
    librdkafka may hold would cost once handed back and stored (the delivery thread stores
    them without waiting: the budget keeps that much free for them, at most half).

    librdkafka's default holds up to 1 GB of payload (`queue.buffering.max.kbytes` 1048576):
    400 MB at 4 KiB a message, all of it handed back to the wrapper when the circuit opens.
    It gets a quarter of the budget. `queue.buffering.max.messages` keeps librdkafka's default
    (100,000): a bound low enough for the budget to cover the overhead of 200-byte messages
    (6,000 of them in a 16 MiB budget) cut the messages per produce batch by over a third
    and the happy path's rate at 200 B to under half of what it was with librdkafka's default.
    For messages of 1 KiB and more the payload bound is the one that binds, and what comes back
    fits in the reserve; smaller messages can come back costing more than it (the hand-back is
    the one place the budget can be passed).
    """
    add: dict[str, Any] = {}
    if "queue.buffering.max.kbytes" not in config:
        add["queue.buffering.max.kbytes"] = max(1, memory_budget // 4 // 1024)
    merged = {**config, **add}
    kbytes = int(merged["queue.buffering.max.kbytes"])
    messages = int(merged.get("queue.buffering.max.messages", LIBRDKAFKA_MAX_MESSAGES))
    # What comes back: its payload, and the overhead of a message per KiB of it (messages of
    # 1 KiB or more; smaller ones come back costing more than the reserve, up to `messages`).
    return add, kbytes * 1024 + min(messages, kbytes) * MESSAGE_OVERHEAD


#: The errors of messages a purge handed back.
PURGE_CODES = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})

#: Seconds a refusal of the credentials (`outbox.retry.refused`) names the cause of "all brokers down".
REFUSED_RECENT = 30.0


class _PurgeRequest:
    """The application's `purge()`, carried out by the delivery thread."""

    __slots__ = ("in_queue", "in_flight", "done")

    def __init__(self, in_queue: bool, in_flight: bool) -> None:
        self.in_queue = in_queue
        self.in_flight = in_flight
        self.done = threading.Event()


class KafkaLink:
    """The librdkafka producer, its delivery thread, and the counts both keep.

    Args:
        config: the producer's settings (its `error_cb` is replaced by this link's, which calls
            `user_error_cb`).
        circuit: opened by "all brokers down"; told of deliveries and transport failures.
        queue_full_timeout: see `ResilientProducer` (how long a produce() waits for room).
        user_error_cb: the application's `error_cb`, still called for every error.
        poll_report: counts what the delivery thread served and keeps what the callbacks raised.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        circuit: CircuitBreaker,
        *,
        queue_full_timeout: float,
        user_error_cb: Callable[[KafkaError], None] | None = None,
        poll_report: PollReport | None = None,
    ) -> None:
        self.poll_report = poll_report or PollReport()
        self._config = {**config, "error_cb": self._on_error}
        for name in ("stats_cb", "throttle_cb"):  # counted as served events, as poll() reports them
            if callable(self._config.get(name)):
                self._config[name] = self._counted(self._config[name])
        self._circuit = circuit
        self._user_error_cb = user_error_cb
        #: librdkafka's last refusal of our credentials or TLS (`outbox.retry.refused`), and when.
        self._refused: tuple[float, KafkaError] | None = None
        #: Called after each purge whose messages go to the outbox (the send fence notes it).
        self.on_purge: Callable[[], None] = lambda: None
        self.kafka = Producer(self._config)
        self._probe = ClusterProbe(self._config)  # "is the cluster there?" when the queue stays full
        # Tallies: several threads count into each (see Tally).
        self.handed = Tally()  # messages librdkafka took (first sends, write-ahead sends): any producing thread
        # Failures of those: their reports (delivery thread), and write-ahead sends produce() refused
        # (writer thread).
        self.send_failures = Tally()
        self._done_seen = 0
        self._queue_full_timeout = queue_full_timeout
        self.queue_full_waits = Tally()  # produce() calls that waited for room in librdkafka's queue
        # Set when a wait for room ended without any; cleared at the next delivery (`note_progress`).
        self._queue_stalled = False
        self._purge_queue = False
        self._purge_in_flight = False
        self._recreate = False
        self._app_purges: list[_PurgeRequest] = []
        #: Set by the application's purge(): a report of a purged message belongs to it (reported
        #: to on_delivery, not stored: the application dropped it) until librdkafka holds nothing
        #: more, or the next purge of the outbox's own. Not just while the purge runs: librdkafka
        #: may report a purged message after purge() returned.
        self.app_purging = False
        # The delivery thread's polls, begun and ended, and whether the latest began while
        # librdkafka held something (`poll_serving`). Written by that thread alone.
        self._polls_begun = 0
        self._polls_ended = 0
        self._poll_began_holding = False
        self._stop = False
        # What librdkafka held when the delivery thread stopped (None: running). After that,
        # nothing polls it, and its queue fills with the log lines and errors it goes on
        # producing (one per failed connection): len() no longer counts messages.
        self._held_at_stop: int | None = None
        self._tick: Callable[[], None] = lambda: None
        self._thread = threading.Thread(target=self._poll_loop, name="outbox-delivery", daemon=True)

    def start(self, tick: Callable[[], None]) -> None:
        """Start the delivery thread; it calls `tick` after every poll (the hold-back's release)."""
        self._tick = tick
        self._thread.start()

    def __len__(self) -> int:
        return len(self.kafka) if self._held_at_stop is None else self._held_at_stop

    # -- asked of the delivery thread ----------------------------------------------------------

    def purge_queue_soon(self) -> None:
        """Hand back what waits in librdkafka's queue now, not at `message.timeout.ms`."""
        self._purge_queue = True

    def purge_all_soon(self) -> None:
        """Hand back everything librdkafka holds, queued or on the wire (a hold-back that cannot
        wait longer: the memory budget is full, or its time ran out). What was on the wire may
        have been delivered: stored again, it can arrive twice, with the same `outbox-id`."""
        self._purge_queue = True
        self._purge_in_flight = True

    def recreate_soon(self) -> None:
        """A fatal error: replace the producer; its queued messages come back as failures."""
        self._recreate = True

    def purge_for_app(self, in_queue: bool, in_flight: bool, blocking: bool) -> None:
        """The application's purge(): done by the delivery thread, which serves the purged
        messages' reports at once, marked as the application's (`app_purging`). `blocking`:
        wait until it is done."""
        request = _PurgeRequest(in_queue, in_flight)
        self._app_purges.append(request)
        if blocking:
            while not request.done.wait(0.05):
                if not self._thread.is_alive():  # stopped meanwhile: nothing left to purge
                    return

    def set_sasl_credentials(self, username: str, password: str) -> None:
        """New SASL credentials for this producer, and for the one that replaces it."""
        self.kafka.set_sasl_credentials(username, password)
        self._probe.set_sasl_credentials(username, password)
        self._config["sasl.username"] = username
        self._config["sasl.password"] = password

    def purge_again(self) -> None:
        """Delivery thread: purge the queue (and the wire, if asked) once more."""
        self.app_purging = False  # what this purge hands back goes to the outbox
        self.kafka.purge(in_queue=True, in_flight=self._purge_in_flight)
        self.on_purge()
        self._purge_in_flight = False

    # -- counts ------------------------------------------------------------------------------

    def first_sends_delivered(self) -> int:
        """Messages librdkafka took from us and delivered: taken, minus still held, minus failed.

        Counted, not reported: with `delivery.report.only.error` no success is reported. Read in
        this order, a produce() or a failure report in between can only make it lower, never
        show a delivery that did not happen (librdkafka's count includes unserved reports).
        """
        handed = self.handed.value
        return handed - len(self) - self.send_failures.value

    def note_progress(self) -> None:
        """Deliveries since the last look close a half-open circuit and end a run of failures."""
        done = self.first_sends_delivered()
        if done > self._done_seen:
            self._done_seen = done
            self._queue_stalled = False
            self._circuit.record_success()

    def note_transport_failure(self, code: int) -> None:
        """A send failed with `code`. Only errors that say "the cluster is not reachable or not
        healthy" count toward the circuit; a bad topic or a too-large message says nothing
        about the cluster."""
        if code in UNREACHABLE_CODES:
            self.note_progress()  # deliveries since the last failure: it is not consecutive
            self._circuit.record_failure()

    # -- back-pressure -----------------------------------------------------------------------

    def when_queue_has_room(self, send: Callable[[], None], *, open_if_stalled: bool = False) -> bool:
        """produce() met a full local queue: try `send` again as room appears, while the circuit
        is closed, for up to `queue_full_timeout`. False: no room in time (the caller stores the
        message), or at once while an earlier wait found none and nothing was delivered since.

        Why wait: a full queue on a cluster that delivers is back-pressure, not an outage. Stored
        instead, a burst on a healthy cluster went to SQLite (a sixth to a third of 200,000
        messages on one local broker), each at several times a send's cost, and every later
        message of a stored key followed it into the outbox until the drain caught up.

        `open_if_stalled`: a wait that ends with nothing delivered during it opens the circuit,
        unless a broker still answers a metadata request within `queue_full_timeout`, asked on a
        client of its own (`outbox.producer.probe`: the busy producer's own request waits behind its traffic). Nothing
        delivered and no answer: the cluster is not taking messages, whether or not librdkafka
        has said so yet (it reports all brokers down only once every connection has failed, and
        never for a hung broker). Opening moves what librdkafka still holds to the outbox through
        the hold-back, in produce order, ahead of this message and its key's later ones; left in
        librdkafka, those earlier messages would be stored behind them when they failed. An
        answer: one broker is gone and its partitions' messages fill the queue, which the others
        cannot drain; the message is stored with the circuit closed (`outbox.producer.keyorder.SendFence` keeps it
        behind its key's messages in librdkafka), and the other brokers go on taking the rest.
        """
        if self._queue_stalled or self._queue_full_timeout <= 0:
            return False
        self.queue_full_waits.add()
        delivered_before = self.first_sends_delivered()
        deadline = time.monotonic() + self._queue_full_timeout
        while self._circuit.closed:
            time.sleep(ROOM_CHECK_INTERVAL)  # the delivery thread serves reports, which frees room
            try:
                send()
                return True
            except BufferError:
                if time.monotonic() >= deadline:
                    self._queue_stalled = True
                    if (
                        open_if_stalled
                        and self.first_sends_delivered() <= delivered_before
                        and not self._probe.answers(self._queue_full_timeout)
                    ):
                        self._circuit.trip(
                            f"librdkafka's queue stayed full for {self._queue_full_timeout:g} s with nothing "
                            "delivered, and no broker answered"
                        )
                    return False
        return False

    # -- the delivery thread -----------------------------------------------------------------

    def stop(self) -> None:
        """Stop the delivery thread and serve the reports still due."""
        self._stop = True
        if self._thread.is_alive():
            self._thread.join(5)
        self._serve(0)
        self._held_at_stop = len(self.kafka)
        self._probe.close()

    def _serve(self, timeout: float) -> int:
        """Poll librdkafka: serve reports and callbacks, keep what they raised, publish how
        many of the application's callbacks ran. A callback that raises ends librdkafka's poll;
        the rest are served by the next one. Returns how many events librdkafka served."""
        self._poll_began_holding = len(self.kafka) > 0  # before the count: see poll_serving
        self._polls_begun += 1
        try:
            served: int = self.kafka.poll(timeout)
        except Exception as exc:  # a callback raised: the application hears it in poll()/flush()
            self.poll_report.failed(exc)
            served = 1
        finally:
            self._polls_ended = self._polls_begun
        self.poll_report.publish()
        return served

    def poll_serving(self) -> int:
        """The delivery thread's poll that may still be running callbacks for events librdkafka
        no longer counts (0: none). librdkafka takes a batch of events off its queue (log lines,
        errors, stats) before it calls the first one, so `len()` is 0 while they are still to
        run. They belong to a poll that began while librdkafka held something, and such a poll
        returns as soon as they have run; a poll that began with nothing held only waits."""
        begun = self._polls_begun
        return begun if self._polls_ended != begun and self._poll_began_holding else 0

    def poll_ended(self, poll: int) -> bool:
        """Has the delivery thread's poll number `poll` (`poll_serving`) returned?"""
        return self._polls_ended >= poll

    def flush_reports(self, timeout: float) -> int:
        """close(): serve librdkafka's remaining reports in this thread for up to `timeout` s.
        A callback that raises ends librdkafka's flush, so it is kept (poll()/flush() would
        raise it) and the flush goes on. Returns what librdkafka still holds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return int(self.kafka.flush(max(0.0, deadline - time.monotonic())))
            except Exception as exc:  # a callback's: counted and logged, never the end of close()
                self.poll_report.failed(exc)
                if time.monotonic() >= deadline:
                    return len(self.kafka)

    def _counted(self, callback: Callable[..., None]) -> Callable[..., None]:
        served = self.poll_report

        def counted(*args: Any) -> None:
            callback(*args)
            served.delivery_thread_calls += 1

        return counted

    def _purge_for_app(self) -> None:
        """Delivery thread: the application's purges; the reports that are ready are served."""
        while not self.app_purging and self._serve(0):  # reports due before the purge are not its
            pass
        while self._app_purges:
            request = self._app_purges.pop(0)
            self.app_purging = True
            try:
                self.kafka.purge(in_queue=request.in_queue, in_flight=request.in_flight)
                while self._serve(0):
                    pass
            finally:
                request.done.set()

    def _poll_loop(self) -> None:
        while not self._stop:
            try:
                self._serve(0.05)
                if self._app_purges:
                    self._purge_for_app()
                elif self.app_purging and len(self.kafka) == 0:
                    self.app_purging = False  # every report of the application's purge was served
                self.note_progress()
                if self._purge_queue:
                    self._purge_queue = False
                    self.app_purging = False  # what this purge hands back goes to the outbox
                    self.kafka.purge(in_queue=True, in_flight=False)
                    self.on_purge()
                if self._purge_in_flight:
                    self._purge_in_flight = False
                    self.app_purging = False
                    self.kafka.purge(in_queue=False, in_flight=True)
                    self.on_purge()
                self._tick()
                if self._recreate:
                    self._recreate_producer()
            except Exception as exc:  # the thread serves the next report regardless; the app hears
                self.poll_report.failed(exc)

    def _recreate_producer(self) -> None:
        self._recreate = False
        self.app_purging = False  # the old producer's messages go to the outbox
        old = self.kafka
        self.kafka = Producer(self._config)
        log.warning("outbox: producer recreated after a fatal error; queued messages move to the outbox")
        old.purge(in_queue=True, in_flight=True)
        self.on_purge()
        old.flush(10)

    def _why_down(self) -> tuple[str, Refusal | None]:
        """The circuit's reason for "all brokers down", and the refusal it is in if any: the
        cluster's refusal of our credentials or TLS if librdkafka reported one lately (what the
        operator must fix), else the outage."""
        tokens = self._config.get("oauth_cb")
        failed = tokens.failed_within(REFUSED_RECENT) if isinstance(tokens, TokenSource) else None
        if failed is not None:
            why = f"no OAuth token, the application's oauth_cb raised {failed} (its text is not logged)"
            return f"every broker refused the connection: {why}", refusal_of(self._config)
        last = self._refused
        if last is not None and time.monotonic() - last[0] < REFUSED_RECENT:
            return f"every broker refused the connection: {describe(last[1])}", refusal_of(self._config)
        return "all brokers down", None

    def _on_error(self, err: KafkaError) -> None:
        """librdkafka's error_cb: cluster-level events."""
        code = err.code()
        if refused(err):
            self._refused = (time.monotonic(), err)
        if code == KafkaError._ALL_BROKERS_DOWN:
            self._circuit.trip(*self._why_down())
        elif err.fatal():
            log.error("outbox: fatal producer error %s; the producer will be recreated", describe(err))
            self._recreate = True
        else:
            log.debug("outbox: producer error %s", describe(err))
        if self._user_error_cb is not None:
            self._user_error_cb(err)
            self.poll_report.delivery_thread_calls += 1
