"""Circuit breaker: stop feeding librdkafka's memory queue while the cluster is unreachable."""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

from outbox.lockorder import new_lock
from outbox.producer.refusals import REFUSALS, Refusal

log = logging.getLogger(__name__)


class CircuitState(enum.Enum):
    CLOSED = "closed"  # Kafka first
    OPEN = "open"  # straight to the outbox
    HALF_OPEN = "half-open"  # one probe message goes to Kafka; the rest to the outbox


class CircuitBreaker:
    """Opens after `failure_threshold` consecutive delivery failures or an all-brokers-down event.

    While open, `produce()` writes to the outbox instead of librdkafka's queue, so a dead cluster
    never holds messages in process memory. After `reset_timeout` seconds one probe message is let
    through (half-open; the producer decides which messages may probe); its delivery, or any
    successful delivery by a drain worker, closes it.

    Its opening is logged at WARNING, but for a refusal of the credentials that another circuit
    of the process told already (`outbox.producer.refusals`): then at INFO.

    `closed` is a plain attribute so the produce hot path pays one attribute read.
    """

    def __init__(
        self,
        *,
        failure_threshold: int = 5,
        reset_timeout: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        on_open: Callable[[], None] | None = None,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.reset_timeout = reset_timeout
        self._clock = clock
        self._on_open = on_open
        self._lock = new_lock("circuit")
        self._state = CircuitState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_out = False
        self.closed = True
        self.opened_count = 0

    @property
    def state(self) -> CircuitState:
        with self._lock:
            if self._state is CircuitState.OPEN and self._clock() - self._opened_at >= self.reset_timeout:
                return CircuitState.HALF_OPEN
            return self._state

    def allow_probe(self) -> bool:
        """While not closed: True once per reset period, for the one message that probes Kafka."""
        with self._lock:
            if self._state is CircuitState.CLOSED:
                return True
            if self._probe_out or self._clock() - self._opened_at < self.reset_timeout:
                return False
            self._state = CircuitState.HALF_OPEN
            self._probe_out = True
            return True

    def record_success(self) -> None:
        if self.closed and self._failures == 0:
            return
        with self._lock:
            self._failures = 0
            if self._state is not CircuitState.CLOSED:
                log.info("circuit closed: Kafka accepts messages again")
                REFUSALS.leave(self)
            self._state = CircuitState.CLOSED
            self._probe_out = False
            self.closed = True

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._state is CircuitState.HALF_OPEN:
                self._open_locked("probe message failed")
            elif self._state is CircuitState.CLOSED and self._failures >= self.failure_threshold:
                self._open_locked(f"{self._failures} consecutive delivery failures")

    def trip(self, reason: str, refusal: Refusal | None = None) -> None:
        """Open now (e.g. librdkafka reported all brokers down); `refusal`: the cluster refused
        these credentials (`outbox.producer.refusals.refusal_of`)."""
        with self._lock:
            if self._state is CircuitState.OPEN:
                self._opened_at = self._clock()
                return
            self._open_locked(reason, refusal)

    def retire(self) -> None:
        """Its producer is closed: the circuit is in no refusal of the process any more."""
        REFUSALS.leave(self)

    def _open_locked(self, reason: str, refusal: Refusal | None = None) -> None:
        was_closed = self._state is CircuitState.CLOSED
        if was_closed and self._on_open is not None:
            # Before `closed` flips: a produce() that sees the circuit open must see what
            # on_open set up (the producer's hold-back) too.
            self._on_open()
        self._state = CircuitState.OPEN
        self._opened_at = self._clock()
        self._probe_out = False
        self.closed = False
        if was_closed:
            self.opened_count += 1
            told = refusal is not None and not REFUSALS.join(refusal, self)
            log.log(
                logging.INFO if told else logging.WARNING, "circuit open (%s): new messages go to the outbox", reason
            )
