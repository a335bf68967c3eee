"""What happens to a message whose handler raised: the four strategies, validated at construction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from outbox.errors import ConfigError
from outbox.retry import RetryPolicy

#: Longest delay a tier may have: 7 days. Longer waits are better served by a scheduler.
MAX_DELAY_SECONDS = 7 * 24 * 3600.0


@dataclass(frozen=True)
class RetryTopics:
    """Non-blocking retries: a failed message hops to ``<topic>.<group>.retry-N``, then the dead letters.

    The main partition keeps flowing while the message waits in its tier; the consumer pauses a
    tier's partition until its head message is due.

    Args:
        delays: seconds to wait before each retry; ``len(delays)`` tiers, so ``[1, 10, 60]`` gives
            three retries (four attempts in all) before the message is dead-lettered.
    """

    delays: Sequence[float]

    def __post_init__(self) -> None:
        delays = tuple(self.delays) if isinstance(self.delays, (list, tuple)) else None
        if delays is None:
            raise ConfigError(f"RetryTopics(delays=...) must be a list of seconds, got {self.delays!r}")
        if not delays:
            raise ConfigError("RetryTopics(delays=[]) is empty: give at least one delay, e.g. delays=[1, 10, 60]")
        for d in delays:
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= MAX_DELAY_SECONDS:
                raise ConfigError(f"RetryTopics delay {d!r} must be a number of seconds in [0, {MAX_DELAY_SECONDS:g}]")
        object.__setattr__(self, "delays", tuple(float(d) for d in delays))

    @property
    def tiers(self) -> int:
        """How many retry tiers (topics) this strategy uses."""
        return len(self.delays)


@dataclass(frozen=True)
class RetryInPlace:
    """Blocking retries: the failed message's partition is paused until the policy's next attempt.

    Only that partition waits; the consumer keeps polling (so it stays in its group) and other
    partitions flow on. When the policy gives up, the message goes to the dead letters.

    Args:
        policy: attempts and back-off (``RetryPolicy(max_attempts=5, initial_delay=1)``).
        forever: retry with the policy's back-off and never give up (order is kept at any cost).
    """

    policy: RetryPolicy = field(default_factory=RetryPolicy)
    forever: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.policy, RetryPolicy):
            raise ConfigError(f"RetryInPlace(policy=...) must be a RetryPolicy, got {type(self.policy).__name__}")


@dataclass(frozen=True)
class Ignore:
    """Log the failure, count it, and move on: for data whose loss is acceptable (metrics, logs)."""


Strategy = RetryTopics | RetryInPlace | Ignore


def check_strategy(strategy: object) -> Strategy:
    """The strategy, or a ConfigError naming what was given instead."""
    if isinstance(strategy, (RetryTopics, RetryInPlace, Ignore)):
        return strategy
    raise ConfigError(
        f"unknown strategy {strategy!r}: use RetryTopics(delays=[...]), RetryInPlace(policy), "
        "RetryInPlace(forever=True) or Ignore()"
    )
