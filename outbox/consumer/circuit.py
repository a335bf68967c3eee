"""The main topic's circuit breaker: stop feeding a dead downstream from the main topic.

When the handler keeps failing on main-topic messages (N in a row, or a failure rate over a
window), every message from the main topic would go through the whole retry ladder. The circuit
opens instead: main-topic partitions are held (paused at their next message) for `reset_timeout`
seconds, then let through again (half-open); the first main-topic result closes it or opens it
again. Tier topics keep flowing while it is open: their messages are already late.
Only retriable failures count; a message that goes straight to the dead letters says nothing
about the downstream's health.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from outbox.errors import ConfigError
from outbox.producer.circuit import CircuitState

__all__ = ["CircuitState", "MainTopicBreaker", "MainTopicCircuit"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MainTopicCircuit:
    """When to open the circuit, and for how long.

    Args:
        consecutive_failures: open after this many main-topic failures in a row (None: off).
        failure_rate: open when the failed fraction of the last `window` main-topic messages
            reaches this (0 < rate <= 1; None: off).
        window: how many recent main-topic results the rate is computed over.
        reset_timeout: seconds the main topic stays paused before a probe.
    """

    consecutive_failures: int | None = 20
    failure_rate: float | None = None
    window: int = 100
    reset_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.consecutive_failures is None and self.failure_rate is None:
            raise ConfigError("MainTopicCircuit needs consecutive_failures or failure_rate")
        if self.consecutive_failures is not None and self.consecutive_failures < 1:
            raise ConfigError(f"consecutive_failures must be >= 1, got {self.consecutive_failures}")
        if self.failure_rate is not None and not 0 < self.failure_rate <= 1:
            raise ConfigError(f"failure_rate is a fraction in (0, 1], got {self.failure_rate}")
        if self.window < 1 or self.reset_timeout <= 0:
            raise ConfigError("window must be >= 1 and reset_timeout > 0")


class MainTopicBreaker:
    """The main topic's circuit, as a state machine (pure: the caller passes the time). The
    producer's `outbox.producer.circuit.CircuitBreaker` guards the cluster; this one the handler's
    downstream. They share `CircuitState`."""

    def __init__(self, policy: MainTopicCircuit) -> None:
        self.policy = policy
        self.state = CircuitState.CLOSED
        self.open_until = 0.0
        self.opened = 0
        self._consecutive = 0
        self._recent: deque[bool] = deque(maxlen=policy.window)
        self._recent_failures = 0

    def blocks(self, now: float) -> bool:
        """Whether main-topic messages must wait now (turns OPEN into HALF_OPEN once it is time)."""
        if self.state is not CircuitState.OPEN:
            return False
        if now < self.open_until:
            return True
        self.state = CircuitState.HALF_OPEN
        log.info("main-topic circuit half-open: probing")
        return False

    def success(self) -> None:
        if self.state is CircuitState.HALF_OPEN:
            self._close()
        self._consecutive = 0
        self._remember(False)

    def failure(self, now: float) -> None:
        self._consecutive += 1
        self._remember(True)
        p = self.policy
        if self.state is CircuitState.HALF_OPEN:
            self._open(now, "the probe failed")
        elif self.state is CircuitState.CLOSED:
            if p.consecutive_failures is not None and self._consecutive >= p.consecutive_failures:
                self._open(now, f"{self._consecutive} failures in a row")
            elif (
                p.failure_rate is not None
                and len(self._recent) == p.window
                and self._recent_failures / p.window >= p.failure_rate
            ):
                self._open(now, f"{self._recent_failures} of the last {p.window} failed")

    def _remember(self, failed: bool) -> None:
        if len(self._recent) == self._recent.maxlen and self._recent[0]:
            self._recent_failures -= 1
        self._recent.append(failed)
        self._recent_failures += failed

    def _open(self, now: float, why: str) -> None:
        self.state = CircuitState.OPEN
        self.open_until = now + self.policy.reset_timeout
        self.opened += 1
        log.warning("main-topic circuit open for %.1fs: %s", self.policy.reset_timeout, why)

    def _close(self) -> None:
        self.state = CircuitState.CLOSED
        self._recent.clear()
        self._recent_failures = 0
        log.info("main-topic circuit closed")
