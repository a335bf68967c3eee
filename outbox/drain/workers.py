"""Drain workers: claim due rows, send them, acknowledge what Kafka acknowledged.

Each worker owns a `SendLoop` (one producer) and loops: claim a batch with a lease (one short
transaction), send it with no transaction open (`outbox.drain.sendloop`), then apply every row's
`settle()` decision in one short transaction (`Outbox.apply`). The next batch is claimed, on the
workers' one claim thread, while one is produced and in flight, and sent once that one is settled.
Retry state lives in the row, so workers never sleep per message and a crashed worker's rows
come back when their lease expires.

A worker thread never dies of a store failure (PostgreSQL restarted, SQLite locked past its busy
timeout): the error is logged once, counted in `Drainer.health`, passed to `on_store_error`, and
the worker backs off and tries again; a settlement that could not be written is kept and retried,
so what Kafka acknowledged is not sent twice because of it. A worker that fails for any other
reason (a bug, a producer librdkafka refused, an `oauth_cb` that raised) is logged at ERROR,
counted in `restarts`, and started again after a back-off; the rows it held come back when
their lease ends. The application's client callbacks cannot end a worker (`outbox.drain.callbacks`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from confluent_kafka import KafkaException, Producer

from outbox.budget import return_freed_memory
from outbox.drain.callbacks import CallbackErrors, guarded
from outbox.drain.sendloop import RESEND_DEFAULTS, InFlight, SendLoop, check_resend_config
from outbox.drain.settle import Verdict, add_to
from outbox.errors import KafkaUnavailableError, StoreError
from outbox.events import Drained, Events, drained, logged_and_counted
from outbox.latency import LatencyHistogram
from outbox.lockorder import new_condition, new_lock
from outbox.logs import LIBRDKAFKA_LOG
from outbox.message import MESSAGE_OVERHEAD
from outbox.records import DeadLetter, OutboxMessage
from outbox.retry import RetryPolicy
from outbox.stores.base import Outbox, Settlement
from outbox.stores.claimed import ids_of
from outbox.stores.encryption import Encryption, as_key_ring
from outbox.stores.owners import new_owner

log = logging.getLogger(__name__)


class DrainHandback(Protocol):
    """Who takes back what a drain worker settled: the producer whose outbox it drains (its
    circuit, its messages' `on_delivery`, its key backlog). Told on the worker's thread, after
    the batch is settled in the store and before observers hear the events."""

    def delivered(self, rows: Sequence[OutboxMessage] | Sequence[Drained]) -> None:
        """These stored rows were delivered (whole rows in threads, `Drained` from a drain process)."""

    def dead(self, letter: DeadLetter) -> None:
        """This message was dead-lettered; `letter` is stored."""

    def cluster_known_down(self) -> bool:
        """Did the producer's own sends just find no broker (its circuit is open)?"""


#: Settings the drain producers use unless the caller's config says otherwise.
DRAIN_DEFAULTS: Mapping[str, Any] = RESEND_DEFAULTS

#: Rows claimed per transaction. Deleting a batch touches one `outbox_key` index page per key in
#: it, so the commit's cost is per key, not per row: with several rows per key a row commits
#: several times more cheaply and a worker drains nearly twice as fast. 10,000 rather than
#: 5,000: the producer is idle while a batch is settled and the next one produced, once per
#: batch, so fewer batches idle it less (docs/benchmarks.md, 'Why the code is shaped as it is').
DEFAULT_BATCH_SIZE = 10_000
_BACKOFF_MAX = 5.0  # longest pause between tries while the store fails (seconds)
_CLUSTER_RETRY = 2.0  # pause between "is a broker up?" probes while the cluster is down (seconds)
#: While the cluster is thought down, a broker that takes longer than this to answer is not back
#: (seconds). Short, so that `stop()` does not wait on a probe for long.
_DOWN_PROBE = 1.0
_RESTART_FIRST = 0.5  # pause before a failed worker's first restart (seconds), doubling to:
_RESTART_MAX = 30.0
#: A probe batch (claimed before the cluster took one of the worker's) is this fraction of a batch: enough rows
#: to measure, few to hold if the cluster is down. A group is still claimed whole.
_PROBE_SHARE = 10
#: Rows a worker settles between two idle moments that make a backlog worth giving back what it
#: took once it is gone (its producer closed, `SendLoop.release`, then a heap trim,
#: `outbox.budget.return_freed_memory`): a recovery, not the odd retried message.
_TRIM_AFTER = 10_000


@dataclass
class DrainResult:
    """Counts of one `Drainer.run()` (or of a running drainer so far).

    `remaining`: the messages still pending when the run ended (of the drainer's topic, if it
    has one). `due_remaining`: 1 if any pending message was due then (any topic), else 0.
    """

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
class DrainHealth:
    """Store failures the workers met and survived (they back off and retry).

    Attributes:
        store_errors: store operations that failed so far.
        failing_since: epoch seconds of the first failure of the current run of failures, or
            None when the last store operation succeeded.
        last_error: the text of the latest store error (no credentials: StoreError texts are
            scrubbed by the stores).
    """

    store_errors: int = 0
    failing_since: float | None = None
    last_error: str | None = None


#: What a claimed row is assumed to cost before one was claimed (`Drainer.batch_bytes`).
_FIRST_ROW_BYTES = 4096 + MESSAGE_OVERHEAD
#: Rows of a claim whose size stands for the next claim's rows (sampling keeps it O(1)).
_ROW_SAMPLE = 64


def _row_bytes(rows: Sequence[OutboxMessage]) -> int:
    """A claimed row's cost in memory: value and key of the first rows, plus the overhead."""
    sample = list(itertools.islice(rows, _ROW_SAMPLE))  # read, not indexed: nothing kept decoded (`Claimed`)
    payload = sum(len(r.value or b"") + len(r.key or b"") for r in sample)
    return max(1, payload // len(sample) + MESSAGE_OVERHEAD)


class Drainer:
    """Sends the outbox's due messages to Kafka under a retry policy.

    Args:
        store: the outbox.
        producer_config: confluent_kafka settings (bootstrap.servers, security, ...); passed
            through, on top of `DRAIN_DEFAULTS`. Its `error_cb`, `throttle_cb`, `stats_cb` and
            `oauth_cb` serve each worker's producer; one that raises is logged and counted in
            `callback_errors` (`outbox.drain.callbacks`).
        retry: decides the next attempt or the dead letter after each failed send.
        workers: threads, each with its own producer.
        batch_size: rows claimed per transaction.
        batch_bytes: fewer rows per claim when `batch_size` of them would cost more memory than
            this (their value and key plus `outbox.message.MESSAGE_OVERHEAD`, sized from the rows
            claimed before; 4 KiB each until then), but never less than one stored group of rows
            (`Outbox.claim` takes a group whole). A producer's drain threads get a quarter of
            its `memory_budget`: a worker holds a batch on the wire and the next one claimed,
            each in Python and the first once more in librdkafka. None: `batch_size` alone.
        lease_seconds: how long a claimed row stays with this worker; must exceed the time to
            send a batch (message.timeout.ms). A crashed worker's rows are due again after it.
        poll_interval: longest sleep when nothing is due.
        topic: drain only this topic.
        events: observers the workers tell each batch's fates (`outbox.events`: `delivered`,
            `retried`, `dead`), on a worker thread; a producer passes its own (and takes the
            fates back first, `start(hand_back)`). Default: a fan-out of this drainer's, for
            `subscribe`; a listener that raises is logged and counted in `callback_errors`, and
            never ends the worker.
        owner: lease owner name; default `outbox.stores.owners.new_owner("drain")`, whose liveness
            claimers can check (see outbox.stores.owners). Other names keep leases until expiry.
        on_store_error: called with each StoreError a background worker survived (it backs off
            and retries); `health` keeps the counts. A row whose encryption key is missing or
            wrong is such an error (`DecryptionError`, naming the key's id): it stays pending,
            no attempt counted, and is sent once the right key is given.
        encryption: the keys of an encrypted outbox (`ResilientProducer`'s `encryption`), set on
            `store` (`Outbox.set_encryption`).
    """

    def __init__(
        self,
        store: Outbox,
        producer_config: Mapping[str, Any],
        *,
        retry: RetryPolicy | None = None,
        workers: int = 1,
        batch_size: int = DEFAULT_BATCH_SIZE,
        batch_bytes: int | None = None,
        lease_seconds: float = 120.0,
        poll_interval: float = 0.5,
        topic: str | None = None,
        events: Events | None = None,
        owner: str | None = None,
        on_store_error: Callable[[StoreError], None] | None = None,
        encryption: Encryption | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if encryption is not None:
            store.set_encryption(as_key_ring(encryption))
        self.store = store
        self.retry = retry or RetryPolicy()
        self.workers = workers
        self.batch_size = batch_size
        self.batch_bytes = batch_bytes
        self._row_bytes = _FIRST_ROW_BYTES  # a claimed row's cost in memory, as last sampled
        self.lease_seconds = lease_seconds
        self.poll_interval = poll_interval
        self.topic = topic
        self.owner = owner or new_owner("drain")
        self.on_store_error = on_store_error
        self.health = DrainHealth()
        self.restarts = 0  # background workers that failed and were started again
        self.callback_errors = CallbackErrors()
        self.events = events if events is not None else Events(logged_and_counted(self.callback_errors.add))
        self._config = guarded(
            {"logger": LIBRDKAFKA_LOG, **producer_config},  # SendLoop adds DRAIN_DEFAULTS (resend_config)
            self.callback_errors,
            client="a drain worker's producer",
        )
        self._config.pop("on_delivery", None)
        self._stop = threading.Event()
        self._loops: set[SendLoop] = set()  # the workers' producers, for set_sasl_credentials()
        self._threads: list[threading.Thread] = []
        self._lock = new_lock("drain")
        self.result = DrainResult()
        # How long each claim took in the store, rows found or not (once per batch, never per
        # message), under `_lock`: claims run on the claim thread, or at exit on a worker's own.
        self._claim_seconds = LatencyHistogram()
        self._wakeup = threading.Event()
        # Bumped after every settled batch (and by wake/stop): a worker whose due rows are all
        # blocked behind rows of their keys in flight waits for it instead of claiming again
        # every 10 ms (each futile claim scanned the in-flight rows under the store's write lock).
        self._progress = new_condition("drain progress")
        self._changes = 0
        # Workers of this drainer holding claimed rows. A run until empty ends a worker only when
        # its claim found nothing and no other worker holds rows: a claim also comes back empty
        # when another worker leased the same rows first (two claims read one snapshot), and the
        # rows that worker settles may unblock more of their keys.
        self._holding = 0
        self._hand_back: DrainHandback | None = None
        # The workers' one claim thread, and how many running workers use it (under `_lock`).
        # One is enough: claims are serialized anyway, by the SQLite file's write lock and by
        # PostgreSQL's per-table advisory lock; each worker's claim still runs while its own
        # batch is in flight.
        self._claims: ThreadPoolExecutor | None = None
        self._claimers = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, hand_back: DrainHandback | None = None) -> None:
        """Run the workers in background threads until `stop()`, handing what they settle back
        to `hand_back` (a producer draining its own outbox; None: nobody).

        Raises:
            ConfigError: settings the workers' producers cannot use (`check_resend_config`).
        """
        check_resend_config(self._config)
        self._hand_back = hand_back
        self._stop.clear()
        for i in range(self.workers):
            t = threading.Thread(target=self._supervise, name=f"outbox-drain-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _supervise(self) -> None:
        """A background worker's thread: run the worker, and start it again if it fails."""
        pause = _RESTART_FIRST
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._worker(False, None)
                return  # stopped
            except Exception:
                # Logged here, where the error ends: nobody else hears of it.
                log.exception(
                    "outbox drain worker %s failed; the rows it holds come back when their lease ends", self.owner
                )
            if self._stop.is_set():
                return
            with self._lock:
                self.restarts += 1
            if time.monotonic() - started > _RESTART_MAX:  # it had run well: a new spell of failures
                pause = _RESTART_FIRST
            log.error("outbox drain worker restarts in %.1f s (restart %d)", pause, self.restarts)
            self._stop.wait(pause)
            pause = min(pause * 2, _RESTART_MAX)

    def stop(self, timeout: float | None = None) -> None:
        """Stop the workers: the batch in flight is settled, unsent leases are released."""
        self._stop.set()
        self._interrupt()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]

    def set_sasl_credentials(self, username: str, password: str) -> None:
        """New SASL credentials for every worker's producer, and for those made later."""
        self._config["sasl.username"] = username
        self._config["sasl.password"] = password
        for loop in list(self._loops):
            loop.set_sasl_credentials(username, password)

    def subscribe(self, listener: object) -> None:
        """Tell `listener` (an `outbox.events.Listener`) the fates of the rows this drainer
        re-sends. Subscribe before `start()`/`run()`."""
        self.events.subscribe(listener)

    def wake(self) -> None:
        """Look for due rows now instead of at the next poll (new rows were just stored)."""
        self._interrupt()

    def _interrupt(self) -> None:
        """End every worker's wait: for due rows, and for a settled batch."""
        self._wakeup.set()
        self._interrupt_waiters()

    def _interrupt_waiters(self) -> None:
        with self._progress:
            self._changes += 1
            self._progress.notify_all()

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
            until_empty: return once no pending row is due (a store failure is raised); False
                keeps draining (follow mode) until `stop` is set, and survives store failures
                as background workers do (logged once, backed off, retried; `health` counts them).
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
            threading.Thread(
                target=self._helper, args=(until_empty, limit, progress), name=f"outbox-drain-{i}", daemon=True
            )
            for i in range(1, self.workers)
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
        self.result.remaining = st.pending if self.topic is None else st.pending_by_topic.get(self.topic, 0)
        self.result.due_remaining = 0 if st.next_due_at is None or st.next_due_at > time.time() else 1
        return self.result

    def _helper(
        self, until_empty: bool, limit: list[int | None], progress: Callable[[DrainResult], None] | None
    ) -> None:
        """A worker of `run` in a thread of its own: its error is logged here, where it ends (the
        caller hears the first worker's)."""
        try:
            self._worker(until_empty, limit, progress)
        except Exception:
            log.exception(
                "outbox drain worker %s failed; the rows it holds come back when their lease ends", self.owner
            )

    def _relay_stop(self, stop: threading.Event) -> None:
        while not self._stop.is_set():
            if stop.wait(0.2):
                self._stop.set()
                self._interrupt()
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
        # An error ends the worker and is raised to whoever runs it, who reports it once: `run`'s
        # caller for the worker in its thread, `_supervise` or `_helper` for the others.
        loop = SendLoop(self._config, self.retry)
        self._loops.add(loop)
        # Background workers (start()) and follow mode (`outbox drain --follow`, a long-running
        # sidecar) survive store failures, which a database restart causes; a run until empty
        # reports them to its caller.
        background = limit is None or not until_empty
        # The next batch is claimed while one is produced and in flight, on the workers' claim
        # thread (stop-and-wait left the worker idle for most of each batch, and a claim that
        # waits on a database server would leave it idle still), and produced once that one is
        # settled: the producer holds one batch at a time (`outbox.drain.sendloop`). Its rows may
        # continue keys of the batch in flight (a claim does not count this worker's own leases
        # as blocking), which is safe because they are sent only after it, and only if all of it
        # was delivered.
        #
        # Until a batch of this worker's was settled with the cluster there (at start, and
        # after the worker found no broker), the cluster is unproven: the worker claims a probe
        # batch and nothing ahead of it. Into a cluster that is down, each claimed batch waits in
        # the producer for message.timeout.ms, held twice (here and in librdkafka): full batches
        # claimed ahead held three times a quarter of the producer's memory budget per worker.
        current: InFlight[OutboxMessage] | None = None  # on the producer
        queued: Sequence[OutboxMessage] = []  # claimed, sent once `current` is settled
        claiming: Future[Sequence[OutboxMessage]] | None = None  # the claim of the next batch
        claims = self._claim_thread()
        holding = False
        proven = False  # a batch was settled since the worker last found no broker
        since_idle = 0  # rows this worker settled since it last found nothing to send
        try:
            while not self._stop.is_set():
                holding = self._mark_holding(current is not None or bool(queued) or claiming is not None, holding)
                if current is None and not proven and not loop.cluster_down and self._known_down(loop):
                    loop.cluster_down = True
                if loop.cluster_down and current is None:
                    self._wait_for_cluster(loop, until_empty)
                    proven = False
                    continue
                if not queued and claiming is None and not loop.cluster_down and (current is None or proven):
                    holding = self._mark_holding(True, holding)  # before its lease: see _holding
                    in_flight = ids_of(current.rows) if current else []
                    claiming = _submit(claims, self._claim, limit, background, in_flight, proven)
                if current is not None:
                    delivered_all = self._settle(loop, current, background)
                    since_idle += len(current.rows)
                    proven, current = not loop.cluster_down, None
                    if progress is not None:
                        progress(self.result)
                    if claiming is not None:
                        # Forgotten before its result is taken: a claim that failed is raised
                        # once, here, not again at stop (it leased nothing to give back).
                        claim, claiming = claiming, None
                        queued = claim.result()
                    if queued and not delivered_all:
                        # A row of the batch before failed (or the cluster went away): rows of its
                        # key must not overtake it. Claim again; the per-key rule sees it now.
                        self._give_back(queued, limit, background)
                        queued = []
                    continue
                if claiming is not None:
                    claim, claiming = claiming, None  # (as above)
                    queued = claim.result()
                if queued:
                    if proven and not loop.cluster_down:  # the next claim runs while this batch is produced
                        holding = self._mark_holding(True, holding)
                        claiming = _submit(claims, self._claim, limit, background, ids_of(queued), proven)
                    current, queued = loop.start(queued), []
                    continue
                if limit is not None and limit[0] is not None and limit[0] <= 0:
                    return
                if until_empty and self.health.failing_since is None:
                    holding = self._mark_holding(False, holding)
                    if not self._others_hold_rows():
                        return
                    self._wait_for_progress()
                    continue
                if since_idle >= _TRIM_AFTER:  # a backlog is gone: give back what it took
                    loop.release()  # first: its client's memory is then trimmed too
                    return_freed_memory()
                since_idle = 0
                self._sleep_until_due(time.time())
        finally:
            try:  # stopping: settle what is in flight (the rest is purged, released)
                if current is not None:
                    self._settle(loop, current, background)
                if claiming is not None:
                    queued = [*queued, *claiming.result()]
                if queued:
                    self._give_back(queued, limit, background)
            except Exception:
                log.exception("outbox drain: could not settle a batch at stop; its leases expire")
            self._claim_thread_done()
            loop.close(5)
            self._loops.discard(loop)
            self._mark_holding(False, holding)
            self._interrupt_waiters()  # a worker waiting for this one's rows looks again

    def _claim_thread(self) -> ThreadPoolExecutor:
        """A starting worker's claim thread, shared with the other running workers."""
        with self._lock:
            if self._claims is None:
                self._claims = ThreadPoolExecutor(1, thread_name_prefix="outbox-claim")
            self._claimers += 1
            return self._claims

    def _claim_thread_done(self) -> None:
        """A worker ended (its own claims were taken): the last one stops the claim thread."""
        with self._lock:
            self._claimers -= 1
            pool = self._claims if self._claimers == 0 else None
            if pool is not None:
                self._claims = None
        if pool is not None:
            pool.shutdown(wait=True)

    def claim_seconds(self) -> tuple[list[tuple[str, int]], float]:
        """The claims' durations so far, as `LatencyHistogram.cumulative()` gives them: exported
        as `outbox_drain_claim_seconds` (`outbox.metrics`). A claim that slows as the table
        grows, or while a long transaction keeps vacuum from removing dead rows, shows there."""
        with self._lock:
            return self._claim_seconds.cumulative()

    def _mark_holding(self, now_holding: bool, was_holding: bool) -> bool:
        if now_holding != was_holding:
            with self._lock:
                self._holding += 1 if now_holding else -1
        return now_holding

    def _others_hold_rows(self) -> bool:
        """Does another worker hold claimed rows? (The caller holds none.)"""
        with self._lock:
            return self._holding > 0

    def _wait_for_progress(self) -> None:
        """Wait until a worker settles a batch or ends (or `poll_interval` passes)."""
        with self._progress:
            seen = self._changes
            self._progress.wait_for(lambda: self._changes != seen, self.poll_interval)

    def _known_down(self, loop: SendLoop) -> bool:
        """Before a probe batch: the producer's circuit is open, and no broker answers this
        worker either. A batch sent then would wait in librdkafka for message.timeout.ms, held
        in memory twice, to fail."""
        hand_back = self._hand_back
        return hand_back is not None and hand_back.cluster_known_down() and not loop.cluster_up(_DOWN_PROBE)

    def _wait_for_cluster(self, loop: SendLoop, until_empty: bool) -> None:
        """No broker answers: the batch went back unattempted; claim again once one does.

        Claiming on would only cycle every pending row through time-outs (their attempts are not
        counted, but each costs `message.timeout.ms` of a lease). A run until empty returns
        instead: the CLI reports what stays pending.
        """
        if until_empty:
            self._stop.set()
            return
        # A producer's drain: its circuit's opening already told the application, with the cause.
        level = logging.INFO if self._hand_back is not None else logging.WARNING
        log.log(level, "outbox drain: no Kafka broker answers; waiting for the cluster (rows stay pending)")
        while not self._stop.is_set() and not loop.cluster_up(_DOWN_PROBE):
            self._stop.wait(_CLUSTER_RETRY)
        loop.cluster_down = False

    def _claim(
        self, limit: list[int | None] | None, background: bool, in_flight: list[int], proven: bool
    ) -> Sequence[OutboxMessage]:
        """Claim the next batch (within `max_messages`); [] when nothing is due or the store failed.

        `in_flight`: this worker's rows in flight on its producer; their keys' later rows may
        follow them in this batch (`Outbox.claim`). `proven`: the cluster took the worker's last
        batch; else this is a probe batch (`_PROBE_SHARE` of a batch).
        """
        want = self._batch_rows() if proven else max(1, self._batch_rows() // _PROBE_SHARE)
        if limit is not None and limit[0] is not None:
            with self._lock:
                if limit[0] <= 0:
                    return []
                take = min(want, limit[0])
                limit[0] -= take
        else:
            take = want
        try:
            started = time.perf_counter()
            rows = self.store.claim(
                self.owner, take, self.lease_seconds, now=time.time(), topic=self.topic, in_flight=in_flight
            )
            took = time.perf_counter() - started
            with self._lock:
                self._claim_seconds.observe(took)
            if self._hand_back is not None or self.events.listens("delivered"):
                # Decoded once, here, for the producer and then the listener. Nobody listening, a
                # claim's groups are decoded as they are produced, each message then dropped
                # (`outbox.stores.grouped.Claimed`): no claimed batch of tracked objects for the
                # garbage collector to walk.
                rows = list(rows)
            self._store_ok()
            if rows and self.batch_bytes is not None:
                self._row_bytes = _row_bytes(rows)
        except StoreError as exc:
            if not background:
                raise
            self._store_failed(exc)
            rows = []
        if limit is not None and limit[0] is not None and len(rows) < take:
            with self._lock:
                limit[0] += take - len(rows)
        return rows

    def _batch_rows(self) -> int:
        """Rows to claim: `batch_size`, or fewer to stay within `batch_bytes`."""
        if self.batch_bytes is None:
            return self.batch_size
        return max(1, min(self.batch_size, self.batch_bytes // self._row_bytes))

    def _give_back(self, rows: Sequence[OutboxMessage], limit: list[int | None] | None, background: bool) -> None:
        """Release claimed rows that were not sent: due now, no attempt counted."""
        if limit is not None and limit[0] is not None:
            with self._lock:
                limit[0] += len(rows)
        try:
            self.store.apply(Settlement(released=ids_of(rows)), now=time.time())
            self._store_ok()
        except StoreError as exc:  # their leases expire
            if not background:
                raise
            self._store_failed(exc)

    def _store_ok(self) -> None:
        if self.health.failing_since is not None:
            log.warning(
                "outbox drain: the store works again after %.1f s of errors", time.time() - self.health.failing_since
            )
            self.health.failing_since = None

    def _store_failed(self, exc: StoreError) -> None:
        """Count, report once per run of failures, tell the application; the caller backs off."""
        h = self.health
        with self._lock:
            h.store_errors += 1
            h.last_error = str(exc)
            first = h.failing_since is None
            if first:
                h.failing_since = time.time()
        if first:
            log.error("outbox drain: store failed, retrying with back-off: %s", exc)
        else:
            log.debug("outbox drain: store still failing: %s", exc)
        if self.on_store_error is not None:
            try:
                self.on_store_error(exc)
            except Exception:
                log.exception("on_store_error callback raised")

    def _backoff(self) -> float:
        since = self.health.failing_since
        elapsed = 0.0 if since is None else time.time() - since
        return min(_BACKOFF_MAX, 0.1 + elapsed / 4)

    def _sleep_until_due(self, now: float) -> None:
        if self.health.failing_since is not None:
            self._wakeup.wait(self._backoff())
            self._wakeup.clear()
            return
        try:
            due = self.store.next_due_at()
        except Exception as exc:  # a store hiccup must not kill a background worker
            log.warning("outbox drain: cannot read the store: %s", exc)
            due = None
        if due is not None and due <= now:  # due rows, none claimable: their keys are in flight
            self._wait_for_progress()
            return
        wait = self.poll_interval if due is None else min(self.poll_interval, due - now)
        self._wakeup.wait(max(wait, 0.01))
        self._wakeup.clear()

    def _settle(self, loop: SendLoop, batch: InFlight[OutboxMessage], background: bool) -> bool:
        """Wait for one batch's reports and apply every row's decision in one transaction.

        Returns whether every row of the batch was delivered (and that settled)."""
        failed = 0
        failed_ids: set[int] = set()
        last_error: str | None = None
        all_delivered = loop.wait(batch, stop=self._stop)
        now = time.time()
        delivered: Sequence[OutboxMessage]
        if all_delivered:  # the healthy batch, without a decision per row
            delivered = batch.rows
            settlement = Settlement(delivered=ids_of(batch.rows))
        else:
            delivered = got = []
            settlement = Settlement()
            for row, d in loop.decide(batch, time.time):
                add_to(settlement, row.id, d, now)
                if d.verdict is Verdict.DELIVERED:
                    got.append(row)
                elif d.verdict is not Verdict.RELEASE:
                    failed += 1
                    failed_ids.add(row.id)
                    last_error = d.error
        while True:
            try:
                dead = self.store.apply(settlement, now=now).dead
                self._store_ok()
                break
            except StoreError as exc:
                if not background:
                    raise
                self._store_failed(exc)
                if self._stop.is_set():
                    log.error("outbox drain: stopping with %d rows unsettled; their leases expire", len(batch.rows))
                    return False
                self._stop.wait(self._backoff())
        self._interrupt_waiters()
        with self._lock:
            self.result.delivered += len(delivered)
            self.result.retried += failed - len(dead)
            self.result.dead += len(dead)
            self.result.released += len(settlement.released)
        # Handed back and told after the batch is settled: a producer that fails (it reads the
        # store to free keys, and the store can fail at that moment) cannot undo it.
        hand_back, events = self._hand_back, self.events
        if delivered:
            if hand_back is not None:
                hand_back_logged(hand_back.delivered, delivered)
            if events.listens("delivered"):
                events.delivered(drained(delivered))
        if failed > len(dead) and events.listens("retried"):
            gone = {row.id for row in dead}
            events.retried(drained([row for row in batch.rows if row.id in failed_ids and row.id not in gone]))
        for row in dead:
            letter = DeadLetter.from_row(row)
            if hand_back is not None:
                hand_back_logged(hand_back.dead, letter)
            events.dead(letter)
        if failed:
            log.info(
                "outbox drain: %d delivered, %d to retry, %d dead-lettered in this batch (last error: %s)",
                len(delivered), failed - len(dead), len(dead), last_error,
            )
        return len(delivered) == len(batch.rows)


def hand_back_logged(take: Callable[[Any], None], what: Any) -> None:
    """Hand settled rows back; a failure there is the library's, logged, and the worker goes on
    (the rows are settled; the producer's key thread finds its keys free at its next look)."""
    try:
        take(what)
    except Exception:
        log.exception("outbox drain: handing settled rows back to the producer failed; the worker goes on")


def _submit(
    pool: ThreadPoolExecutor, fn: Callable[..., Sequence[OutboxMessage]], *args: Any
) -> Future[Sequence[OutboxMessage]]:
    """`pool.submit(fn, *args)`, or `fn(*args)` run here once the interpreter is shutting down.

    At exit, concurrent.futures refuses new work before the producer's exit hook has stopped the
    drain; the worker then claimed nothing and was restarted, logging each time at ERROR, while
    the hook committed what was left. Claiming on the worker's own thread keeps it draining.
    """
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        done: Future[Sequence[OutboxMessage]] = Future()
        try:
            done.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001 - raised where the worker reads the result
            done.set_exception(exc)
        return done
