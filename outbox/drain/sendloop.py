"""The send loop: produce a batch of stored messages, collect their fates, settle each one.

One loop for every re-sender (the drain workers, the Spark job): produce with back-pressure
(BufferError → serve reports, try again), wait for the reports, re-send alone what the broker
refused with its whole record batch, and turn every outcome into a `settle()` decision.

Only failures are reported (`delivery.report.only.error`): a batch is complete when the
producer holds no message any more, so one batch is in flight at a time. `start()` produces a
batch and returns at once and `finish()` waits for it, so a caller can claim the next batch while
this one is in flight (the drain workers do). Why: every delivery report is a call into Python
from librdkafka's poll, which takes the interpreter lock and gives it back. In a process where
the application and the outbox writer also want that lock (a recovery after an outage), each
such hand-over could wait for another thread's switch interval: py-spy of a recovering process
showed its drain worker spending a fifth of its time in poll(0) serving success reports.

Every sender of this package calls `Producer.produce()` with positional arguments, in
confluent-kafka's order (topic, value, key, partition, on_delivery, callback, timestamp,
headers): it parses keyword arguments by name on every call, which was most of the call's
time (docs/benchmarks.md, 'Why the code is shaped as it is').
`tests/unit/test_sendloop.py` checks that order against the installed confluent-kafka.

Delivery reports carry no headers, so each message's callback knows its index in the batch: a
`functools.partial` of the index, made once per index and reused by every batch (making one per
message was costly). Its report lands in the errors of the batch on the producer, which is
always the one batch in flight; a batch given up at a stop with messages still in flight leaves
the callbacks to them behind, and the next batch gets new ones.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar, cast

from confluent_kafka import KafkaError, KafkaException, Producer

from outbox.drain.idempotence import KEY as IDEMPOTENCE
from outbox.drain.idempotence import conflicts, is_set, number
from outbox.drain.settle import DELIVERED, Decision, Verdict, settle
from outbox.errors import ConfigError
from outbox.headers import ID_HEADER, for_resend, resent_once
from outbox.lazyproducer import LazyProducer
from outbox.logs import with_librdkafka_log
from outbox.records import Headers
from outbox.retry import UNREACHABLE_CODES, RetryPolicy, a_broker_answers, refused
from outbox.stores.claimed import LazyClaim, Resend

log = logging.getLogger(__name__)

#: The least `linger.ms` of a re-sending producer: a caller's smaller value (or its alias
#: `queue.buffering.max.ms`) is raised to it. A re-sender produces a claimed batch of thousands at
#: once and then flushes it, and librdkafka's flush() sends what lingers at once (since 1.8), so
#: lingering costs a batch nothing and makes fewer, larger produce requests: at 20 ms instead of
#: 5 the brokers spent over a third less CPU per message and the drain ran faster (see
#: docs/benchmarks.md, 'Why the code is shaped as it is'). The application's own producer keeps
#: the caller's `linger.ms`: there one message's latency matters.
RESEND_MIN_LINGER_MS = 20

#: Settings every re-sending producer gets unless the caller's config says otherwise.
RESEND_DEFAULTS: Mapping[str, Any] = {
    "enable.idempotence": True,  # resends within one batch cannot reorder or duplicate
    "acks": "all",
    "message.timeout.ms": 30000,
}  # and `linger.ms`, which `resend_config` decides

_POLL_EVERY = 1000  # serve error reports now and then while producing (a poll costs several produce() calls)
_PROBE_TIMEOUT = 5.0  # seconds a broker has to answer "is the cluster there?"


class Stored(Protocol):
    """A stored message as the loop re-sends it (`OutboxMessage` is one)."""

    @property
    def id(self) -> int: ...
    @property
    def msg_id(self) -> str: ...
    @property
    def topic(self) -> str: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Headers: ...
    @property
    def partition(self) -> int: ...
    @property
    def attempts(self) -> int: ...
    @property
    def first_failed_at(self) -> float | None: ...
    @property
    def last_error(self) -> str | None: ...
    @property
    def timestamp(self) -> int: ...


R = TypeVar("R", bound=Stored)


def resend(row: Stored) -> Resend:
    """What re-sending `row` produces: its topic, value, key, partition, timestamp and
    `resend_headers`."""
    return row.topic, row.value, row.key, row.partition, row.timestamp, resend_headers(row)


def resend_headers(row: Stored) -> Headers:
    """The stored headers plus this re-send's retry metadata (`outbox-attempt`, ...)."""
    hs = row.headers
    if len(hs) == 1 and hs[0][0] == ID_HEADER and not row.attempts and row.first_failed_at is None:
        return resent_once(hs[0], row.last_error)  # the common row: never failed, the id header alone
    return for_resend(
        row.headers,
        msg_id=row.msg_id,
        attempt=row.attempts + 1,
        first_failed_at=row.first_failed_at,
        last_error=row.last_error,
    )


class InFlight(Generic[R]):
    """One produced batch: its rows and the errors reported so far."""

    __slots__ = ("rows", "errors", "unknown")

    def __init__(self, rows: Sequence[R]) -> None:
        self.rows = rows
        self.errors: dict[int, KafkaError] = {}
        #: A stop gave up waiting: rows without an error may or may not have been delivered.
        self.unknown = False

    @property
    def all_delivered(self) -> bool:
        """Once waited for: every row was delivered (no failure report, nothing left unknown)."""
        return not self.errors and not self.unknown


class _Reports:
    """The delivery-report callbacks of one producer's batches, one per index (module doc)."""

    __slots__ = ("errors", "callbacks")

    def __init__(self) -> None:
        self.errors: dict[int, KafkaError] = {}  # the batch on the producer's
        self.callbacks: list[functools.partial[None]] = []

    def upto(self, n: int) -> list[functools.partial[None]]:
        """Callbacks for indexes 0 … n-1."""
        cbs = self.callbacks
        if len(cbs) < n:
            cbs += [functools.partial(self.report, i) for i in range(len(cbs), n)]
        return cbs

    def report(self, i: int, err: KafkaError | None, msg: Any) -> None:
        """Delivery-report callback (the producer's polling thread): failures only."""
        if err is not None:
            self.errors[i] = err


def resend_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A re-sending producer's settings: `RESEND_DEFAULTS`, then `config`, then what the loop
    needs (only-error reports, no `on_delivery`, a linger of at least `RESEND_MIN_LINGER_MS`) and,
    unless `config` names one, `LIBRDKAFKA_LOG` as its logger."""
    out = {**RESEND_DEFAULTS, **with_librdkafka_log(config)}
    out.pop("on_delivery", None)
    acks = config.get("acks", config.get("request.required.acks"))
    if acks is not None and str(acks) not in ("all", "-1") and IDEMPOTENCE not in config:
        # The caller chose weaker acknowledgements (acks=1 was Kafka's default before 3.0):
        # idempotence needs acks=all, so the re-senders keep the caller's acks and keep each
        # key's order with one request in flight instead.
        out[IDEMPOTENCE] = False
        out.setdefault("max.in.flight.requests.per.connection", 1)
    out["delivery.report.only.error"] = True  # see the module doc
    lingers = [out.pop(k) for k in ("queue.buffering.max.ms", "linger.ms") if k in out]
    try:
        out["linger.ms"] = max([RESEND_MIN_LINGER_MS, *(float(v) for v in lingers)])
    except (TypeError, ValueError):  # not a number: librdkafka's own error names the setting
        out["linger.ms"] = lingers[-1]
    # librdkafka refuses a linger as long as the time-out (the last alias set wins): a caller's
    # short time-out (confluent's own tests use 10 ms) shortens the re-senders' linger instead.
    timeouts = [number(v) for k, v in out.items() if k in ("message.timeout.ms", "delivery.timeout.ms")]
    linger = number(out["linger.ms"])
    if timeouts and timeouts[-1] and linger is not None and linger >= timeouts[-1]:
        out["linger.ms"] = max(0.0, timeouts[-1] - 1)
    return out


def check_resend_config(config: Mapping[str, Any]) -> None:
    """Raise ConfigError naming each of the caller's settings a re-sender cannot use.

    A re-sender's producer gets what `resend_config` forces on top of the caller's config: a
    linger (at least `RESEND_MIN_LINGER_MS`, shorter than the time-out), and idempotence
    (`RESEND_DEFAULTS`) unless the caller turned it off. Settings valid for the application's producer can be refused by
    librdkafka on a re-sender's, where they would end each drain worker at its start.
    """
    out = resend_config(config)
    bad: list[str] = []
    if is_set(out.get(IDEMPOTENCE)):
        why = "the re-senders are idempotent (enable.idempotence) so that a batch keeps each key's order"
        for setting, need in conflicts(out):
            bad.append(f"{setting} ({why}, which needs {need}; or set enable.idempotence=False)")
    if out.get("transactional.id") is not None:
        bad.append(
            f"transactional.id={out['transactional.id']} (an outbox cannot hold part of a Kafka transaction, "
            "and re-senders sharing one id would fence each other)"
        )
    if bad:
        raise ConfigError("settings the drain workers' producers cannot use: " + "; ".join(bad))


class SendLoop:
    """Re-sends stored messages with one idempotent producer (recreated after a fatal error).

    Args:
        config: confluent_kafka settings (`resend_config` adds what the loop needs).
        policy: the retry policy that settles each failed send.
        flush_timeout: longest wait for the last reports after a stop (seconds).
    """

    def __init__(self, config: Mapping[str, Any], policy: RetryPolicy, *, flush_timeout: float = 30.0) -> None:
        self._client = LazyProducer(resend_config(config))  # made at its first send
        self.config = self._client.config
        self.policy = policy
        self.flush_timeout = flush_timeout
        self._reports = _Reports()
        #: No broker answered after the last finished batch failed for want of a cluster: its
        #: rows were released without counting an attempt. Senders wait for `cluster_up()`.
        self.cluster_down = False

    @property
    def producer(self) -> Producer:
        """The re-sending producer, made at its first use: a drain that has had nothing to send
        holds no client, no connection to the brokers and no librdkafka threads (a producer
        whose outbox stays empty keeps one client, its own, instead of one more per worker)."""
        return self._client.get()

    def _made(self) -> Producer | KafkaError:
        """The producer, or the refusal that kept it from being made: confluent-kafka makes a
        client with an `oauth_cb` only once the callback gave a token, and raises
        SASL_AUTHENTICATION_FAILED ("OAuth token not set") after 10 s without one. A token that
        cannot be had is the cluster refusing us (`outbox.retry.refused`), not the worker's end."""
        try:
            return self._client.get()
        except KafkaException as exc:
            if not refused(exc.args[0]):
                raise
            return cast(KafkaError, exc.args[0])

    def set_sasl_credentials(self, username: str, password: str) -> None:
        """New SASL credentials: for the producer if it is made, else for the one made later."""
        self._client.set_sasl_credentials(username, password)

    def close(self, timeout: float = 5.0) -> int:
        """Wait up to `timeout` for messages in flight; return how many are left."""
        producer = self._client.made()
        return int(producer.flush(timeout)) if producer is not None else 0

    def release(self) -> None:
        """Close the producer, if made, while nothing is in flight on it: a drain that has sent
        a backlog and found nothing more holds no client again (its connections, librdkafka
        threads and buffers are given back). The next send makes a new one."""
        producer = self._client.made()
        if producer is None or producer.flush(self.flush_timeout):
            return  # none made, or reports still due on it (the idle caller has none in flight)
        self._client.take()
        producer.close()

    def send(self, rows: Sequence[R], now_fn: Any, *, stop: threading.Event | None = None) -> list[tuple[R, Decision]]:
        """`start()` then `finish()`: send `rows` and return each row's decision."""
        return self.finish(self.start(rows), now_fn, stop=stop)

    def start(self, rows: Sequence[R]) -> InFlight[R]:
        """Produce `rows` in order (back-pressure on a full queue) and return without waiting.

        The previous batch must be finished: a batch is complete when the producer is empty.
        """
        batch: InFlight[R] = InFlight(rows)
        self._produce_all(batch, rows.resends(resend) if isinstance(rows, LazyClaim) else map(resend, rows))
        return batch

    def finish(
        self, batch: InFlight[R], now_fn: Any, *, stop: threading.Event | None = None
    ) -> list[tuple[R, Decision]]:
        """Wait for the batch's reports and return each row's decision once its fate is known.

        Rows whose fate is unknown (a stop left them in flight past `flush_timeout`) are left
        out: the caller leaves them leased, and they come back when the lease ends.

        Args:
            batch: what `start()` returned.
            now_fn: the clock (`time.time`), read once when the reports are in.
            stop: when set, what is still queued is purged and released, not sent.
        """
        if self.wait(batch, stop):
            # The healthy batch: settle()'s answer for a report without an error is DELIVERED,
            # the same for every row, so it is not asked once per row.
            return [(row, DELIVERED) for row in batch.rows]
        return self.decide(batch, now_fn)

    def wait(self, batch: InFlight[R], stop: threading.Event | None = None) -> bool:
        """Wait for the batch's reports (see `finish`); return whether every row was delivered.

        If not, `decide()` tells each row's decision.
        """
        self._wait(batch, stop)
        if batch.all_delivered:
            self.cluster_down = False
            return True
        return False

    def decide(self, batch: InFlight[R], now_fn: Any) -> list[tuple[R, Decision]]:
        """Each row's decision, once `wait()` said that not all were delivered (see `finish`)."""
        rows, errors, unknown = batch.rows, batch.errors, batch.unknown
        # Asked only when something failed for want of a cluster: one metadata request.
        # (No producer could be made: the cluster refuses us, not asked again.)
        down = self.cluster_down = any(e.code() in UNREACHABLE_CODES for e in errors.values()) and (
            self._client.made() is None or not self.cluster_up()
        )
        now = now_fn()
        out: list[tuple[R, Decision]] = []
        alone: list[int] = []
        recreate = False
        for i, row in enumerate(rows):
            err = errors.get(i)
            if err is None and unknown:
                continue  # maybe delivered, maybe not: its lease brings it back
            d = settle(row, err, self.policy, now, cluster_down=down)
            if d.verdict is Verdict.RESEND_ALONE:
                alone.append(i)
                continue
            recreate = recreate or d.recreate_producer
            out.append((row, d))
        for i in alone:  # id order keeps each key's order
            out.append((rows[i], self._send_alone(rows[i], now_fn)))
        if recreate:
            self.recreate()
        return out

    def cluster_up(self, timeout: float = _PROBE_TIMEOUT) -> bool:
        """Does any broker answer a metadata request within `timeout` seconds? (No while the
        producer cannot be made for a refusal.)"""
        producer = self._made()
        return not isinstance(producer, KafkaError) and a_broker_answers(producer, timeout)

    def recreate(self) -> None:
        """A new producer after a fatal error (the old one's idempotence state is lost)."""
        log.warning("outbox: fatal producer error; recreating the producer")
        old = self._client.replace()
        if old is not None:
            old.flush(self.flush_timeout)  # batches still in flight on it get their reports

    # -- internals ---------------------------------------------------------------------------

    def _produce_all(self, batch: InFlight[Any], sends: Iterable[Resend]) -> None:
        """Produce `sends`, the batch's messages in order (`Resend` tuples: a claim's groups give
        them without decoding a message, `outbox.stores.claimed.LazyClaim.resends`)."""
        producer = self._made()
        if isinstance(producer, KafkaError):  # never sent: each row fails with the refusal
            batch.errors.update(dict.fromkeys(range(len(batch.rows)), producer))
            return
        produce, poll = producer.produce, producer.poll
        self._reports.errors = batch.errors
        callbacks = self._reports.upto(len(batch.rows))
        for i, cb, (topic, value, key, partition, timestamp, headers) in zip(itertools.count(), callbacks, sends):
            if i % _POLL_EVERY == _POLL_EVERY - 1:
                poll(0)
            while True:
                try:
                    # Positional (see the module doc): (topic, value, key, partition, on_delivery,
                    # callback, timestamp, headers); partition -1 is the default. The row's record
                    # timestamp is its first produce()'s (0 for rows stored without one: now).
                    produce(topic, value, key, partition, cb, None, timestamp, headers)  # type: ignore[arg-type]
                    break
                except BufferError:
                    poll(0.05)  # local queue full: serve reports to make room
                except KafkaException as exc:  # refused locally, e.g. larger than message.max.bytes
                    batch.errors[i] = exc.args[0]
                    break

    def _wait(self, batch: InFlight[Any], stop: threading.Event | None) -> None:
        """Serve failure reports until the producer holds none of this batch's messages (or a
        stop gave up on the rest). flush() returns as soon as the last one is acknowledged, and
        sends at once what lingers."""
        producer = self._client.made()
        if producer is None:  # none could be made: nothing was sent
            return
        while producer.flush(0.1) > 0:
            if stop is not None and stop.is_set():
                # Unsent messages come back as _PURGE_QUEUE (released, no attempt counted).
                producer.purge(in_queue=True, in_flight=False)
                batch.unknown = producer.flush(self.flush_timeout) > 0
                if batch.unknown:  # reports may still come for it: later batches get new callbacks
                    self._reports = _Reports()
                return

    def _send_alone(self, row: Stored, now_fn: Any) -> Decision:
        """Re-send one message that shared a refused record batch; its own fate decides."""
        alone: InFlight[Stored] = InFlight([row])
        self._produce_all(alone, [resend(row)])
        self._wait(alone, None)
        return settle(row, alone.errors.get(0), self.policy, now_fn(), alone=True)
