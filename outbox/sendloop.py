"""The send loop: produce a batch of stored messages, collect their fates, settle each one.

One loop for every re-sender (the drain workers, the Spark job): produce with back-pressure
(BufferError → serve reports, try again), wait for the reports, re-send alone what the broker
refused with its whole record batch, and turn every outcome into a `settle()` decision.

Cheap per message: the producer runs with `delivery.report.only.error=true`, so a delivered
message costs no Python callback at all; a message without an error report once the queue is
empty was delivered. Delivery reports carry no headers, so each message's callback is a
`functools.partial` holding its index in the batch: only failures ever call it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

from confluent_kafka import KafkaError, KafkaException, Producer

from .headers import for_resend
from .records import Headers
from .retry import RetryPolicy
from .settle import Decision, Verdict, settle

log = logging.getLogger(__name__)

#: Settings every re-sending producer gets unless the caller's config says otherwise.
RESEND_DEFAULTS: Mapping[str, Any] = {
    "enable.idempotence": True,  # resends within one batch cannot reorder or duplicate
    "acks": "all",
    "linger.ms": 5,
    "message.timeout.ms": 30000,
}

_POLL_EVERY = 1000  # serve error reports now and then while producing (a poll costs ~20 us)


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


R = TypeVar("R", bound=Stored)


def resend_headers(row: Stored) -> Headers:
    """The stored headers plus this re-send's retry metadata (`outbox-attempt`, ...)."""
    return for_resend(
        row.headers, msg_id=row.msg_id, attempt=row.attempts + 1,
        first_failed_at=row.first_failed_at, last_error=row.last_error,
    )


class SendLoop:
    """Re-sends stored messages with one idempotent producer (recreated after a fatal error).

    Args:
        config: confluent_kafka settings, on top of `RESEND_DEFAULTS`.
        policy: the retry policy that settles each failed send.
        flush_timeout: longest wait for the last reports after a stop (seconds).
    """

    def __init__(self, config: Mapping[str, Any], policy: RetryPolicy, *, flush_timeout: float = 30.0) -> None:
        self.config = {**RESEND_DEFAULTS, **config}
        self.config.pop("on_delivery", None)
        self.config["delivery.report.only.error"] = True
        self.policy = policy
        self.flush_timeout = flush_timeout
        self.producer = Producer(self.config)

    def close(self, timeout: float = 5.0) -> int:
        """Wait up to `timeout` for messages in flight; return how many are left."""
        return int(self.producer.flush(timeout))

    def send(
        self, rows: Sequence[R], now_fn: Any, *, stop: threading.Event | None = None
    ) -> list[tuple[R, Decision]]:
        """Send `rows` in order and return each row's decision once its fate is known.

        Rows whose fate is unknown (a stop left them in flight past `flush_timeout`) are left
        out: the caller leaves them leased, and they come back when the lease ends.

        Args:
            rows: stored messages, oldest first.
            now_fn: the clock (`time.time`), read once when the reports are in.
            stop: when set, what is still queued is purged and released, not sent.
        """
        errors: dict[int, KafkaError] = {}
        report = functools.partial(_record, errors)
        self._produce_all(rows, range(len(rows)), report, errors)
        complete = self._wait(stop)
        now = now_fn()
        out: list[tuple[R, Decision]] = []
        alone: list[int] = []
        recreate = False
        for i, row in enumerate(rows):
            err = errors.get(i)
            if err is None and not complete:
                continue  # unknown: maybe delivered, maybe not; its lease brings it back
            d = settle(row, err, self.policy, now)
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

    def recreate(self) -> None:
        """A new producer after a fatal error (the old one's idempotence state is lost)."""
        log.warning("outbox: fatal producer error; recreating the producer")
        old, self.producer = self.producer, Producer(self.config)
        old.flush(5)

    # -- internals ---------------------------------------------------------------------------

    def _produce_all(self, rows: Sequence[Stored], which: Any, report: Any, errors: dict[int, KafkaError]) -> None:
        producer = self.producer
        produce = producer.produce
        for n, i in enumerate(which):
            if n % _POLL_EVERY == _POLL_EVERY - 1:
                producer.poll(0)
            row = rows[i]
            cb = functools.partial(report, i)
            part = row.partition
            while True:
                try:
                    if part >= 0:
                        produce(row.topic, row.value, row.key, partition=part,
                                headers=resend_headers(row), on_delivery=cb)  # type: ignore[arg-type]
                    else:
                        produce(row.topic, row.value, row.key,
                                headers=resend_headers(row), on_delivery=cb)  # type: ignore[arg-type]
                    break
                except BufferError:
                    producer.poll(0.05)  # local queue full: serve reports to make room
                except KafkaException as exc:  # refused locally, e.g. larger than message.max.bytes
                    errors[i] = exc.args[0]
                    break

    def _wait(self, stop: threading.Event | None) -> bool:
        """Serve reports until every message has one; True when the fate of each is known."""
        producer = self.producer
        while len(producer) > 0:
            producer.poll(0.1)
            if stop is not None and stop.is_set() and len(producer) > 0:
                # Unsent messages come back as _PURGE_QUEUE (released, no attempt counted).
                producer.purge(in_queue=True, in_flight=False)
                producer.flush(self.flush_timeout)
                return len(producer) == 0
        return True

    def _send_alone(self, row: Stored, now_fn: Any) -> Decision:
        """Re-send one message that shared a refused record batch; its own fate decides."""
        errors: dict[int, KafkaError] = {}
        self._produce_all([row], [0], functools.partial(_record, errors), errors)
        if self.producer.flush(self.flush_timeout) > 0:
            errors.setdefault(0, KafkaError(KafkaError._MSG_TIMED_OUT, "no report for a lone re-send"))
        return settle(row, errors.get(0), self.policy, now_fn(), alone=True)


def _record(errors: dict[int, KafkaError], i: int, err: KafkaError | None, msg: Any) -> None:
    if err is not None:
        errors[i] = err
