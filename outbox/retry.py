"""Retry policy (on tenacity's stop/wait strategies) and the error classification table."""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import tenacity
from confluent_kafka import KafkaError, KafkaException, Producer
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from outbox.errors import ConfigError

E = KafkaError


class Disposition(enum.Enum):
    """What to do with a message whose send failed."""

    RETRY = "retry"  # keep it in the outbox and send again later
    DEAD = "dead"  # retrying cannot help: dead-letter it now
    FATAL = "fatal"  # the producer instance is unusable: recreate it; the message is retried


# The cluster refuses our credentials or our TLS: a rotated or expired password, an OAuth token
# not refreshed, a certificate the broker does not trust. An outage that an operator ends (or
# `set_sasl_credentials`), never a fault of the message: retried without counting attempts while
# no broker takes us, like a cluster that is down.
REFUSED_CODES: frozenset[int] = frozenset(
    {
        E._AUTHENTICATION,  # librdkafka: SASL or TLS authentication failed
        E.SASL_AUTHENTICATION_FAILED,  # the broker: wrong credentials
        E._SSL,  # TLS handshake failed (a certificate rejected, either way)
        E.UNSUPPORTED_SASL_MECHANISM,  # the listener does not offer the client's mechanism
        E.ILLEGAL_SASL_STATE,
    }
)



def refused(err: KafkaError) -> bool:
    """Did the cluster refuse our credentials or TLS? A `REFUSED_CODES` code, or a connection the
    broker ended with a TLS alert: under TLS 1.3 the broker judges the client's certificate after
    the client's side of the handshake is done, so librdkafka reports a certificate it rejects
    as a failed receive (``_TRANSPORT``, "ssl/tls alert bad certificate")."""
    return err.code() in REFUSED_CODES or (err.code() == E._TRANSPORT and "ssl/tls alert" in err.str().lower())


# Failures that go away by themselves: the cluster or a partition leader comes back, an ISR
# grows again. librdkafka already retries most of these internally, so by the time a delivery
# report carries one the message usually shows as _MSG_TIMED_OUT.
RETRIABLE_CODES: frozenset[int] = frozenset(
    {
        E._MSG_TIMED_OUT,  # delivery not confirmed within message.timeout.ms (cluster down, no ISR)
        E._TIMED_OUT,
        E._TIMED_OUT_QUEUE,
        E._TRANSPORT,  # connection to the broker broke
        E._ALL_BROKERS_DOWN,
        E._QUEUE_FULL,  # local queue full (queue.buffering.max.messages)
        E._PURGE_QUEUE,  # purged before it was sent (fatal error, circuit opening): never sent
        E._PURGE_INFLIGHT,  # purged while in flight: may have been delivered; a resend can duplicate
        E._RESOLVE,
        E._NODE_UPDATE,
        E._WAIT_COORD,
        E._UNKNOWN_PARTITION,  # partition metadata not known yet (topic just created)
        E._UNKNOWN_TOPIC,  # topic metadata not known yet, or auto-create pending
        E._ISR_INSUFF,
        E._RETRY,
        E._DESTROY,  # producer closed with the message still queued: never sent
        E.NOT_ENOUGH_REPLICAS,  # min.insync.replicas not met: brokers of the ISR are down
        E.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        E.LEADER_NOT_AVAILABLE,  # leader election in progress
        E.NOT_LEADER_FOR_PARTITION,  # leadership moved
        E.FENCED_LEADER_EPOCH,
        E.UNKNOWN_LEADER_EPOCH,
        E.REQUEST_TIMED_OUT,
        E.NETWORK_EXCEPTION,
        E.BROKER_NOT_AVAILABLE,
        E.REPLICA_NOT_AVAILABLE,
        E.KAFKA_STORAGE_ERROR,  # a broker's disk failed; another replica takes over
        E.UNKNOWN_TOPIC_OR_PART,  # topic missing (auto-create off): an operator can create it
        E.THROTTLING_QUOTA_EXCEEDED,
        E.COORDINATOR_LOAD_IN_PROGRESS,
        E.COORDINATOR_NOT_AVAILABLE,
        E.NOT_COORDINATOR,
        E.CONCURRENT_TRANSACTIONS,
        E.REBOOTSTRAP_REQUIRED,
    }
) | REFUSED_CODES

# Errors that say "the cluster is not reachable or not healthy" rather than anything about the
# message: they count toward the producer's circuit breaker, and a re-send that fails with one
# while no broker answers at all is not counted as an attempt (settle(cluster_down=True)).
UNREACHABLE_CODES: frozenset[int] = frozenset(
    {
        E._MSG_TIMED_OUT,
        E._TRANSPORT,
        E._ALL_BROKERS_DOWN,
        E._TIMED_OUT,
        E.NOT_ENOUGH_REPLICAS,
        E.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        E.REQUEST_TIMED_OUT,
        E.NETWORK_EXCEPTION,
        E.LEADER_NOT_AVAILABLE,
        E.NOT_LEADER_FOR_PARTITION,
    }
) | REFUSED_CODES


def a_broker_answers(producer: Producer, timeout: float) -> bool:
    """Does any broker answer `producer`'s metadata request within `timeout` seconds? What tells a
    cluster that is there from one that is gone or hung, whatever librdkafka has reported."""
    try:
        return bool(producer.list_topics(timeout=timeout).brokers)
    except KafkaException:
        return False

# Failures a resend of the same bytes can never fix: they go to the dead-letter store at once.
PERMANENT_CODES: frozenset[int] = frozenset(
    {
        E.MSG_SIZE_TOO_LARGE,  # broker's message.max.bytes exceeded
        E.INVALID_MSG_SIZE,
        E.RECORD_LIST_TOO_LARGE,
        E.INVALID_MSG,  # CRC / corrupt record
        E.INVALID_RECORD,  # rejected by broker validation (e.g. compacted topic without a key)
        E.INVALID_TIMESTAMP,
        E.UNSUPPORTED_FOR_MESSAGE_FORMAT,
        E.UNSUPPORTED_COMPRESSION_TYPE,
        E.INVALID_REQUIRED_ACKS,
        E.TOPIC_EXCEPTION,  # invalid topic name
        E.POLICY_VIOLATION,
        E.TOPIC_AUTHORIZATION_FAILED,  # not allowed to write this topic
        E.CLUSTER_AUTHORIZATION_FAILED,
        E.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
        E._BAD_MSG,
        E._INVALID_ARG,
        E._KEY_SERIALIZATION,
        E._VALUE_SERIALIZATION,
    }
)

# The broker rejects a whole record *batch* that exceeds the topic's max.message.bytes, so every
# message batched with an oversized one gets this error too. Senders re-send such a message on its
# own before deciding: only a message that fails alone is dead-lettered.
BATCH_SIZE_CODES: frozenset[int] = frozenset({E.MSG_SIZE_TOO_LARGE, E.RECORD_LIST_TOO_LARGE})

# The producer instance itself is broken (idempotence state lost): librdkafka will not send
# anything more on it. The fix is a new producer; the message itself is fine and is retried.
FATAL_CODES: frozenset[int] = frozenset(
    {
        E._FATAL,
        E.OUT_OF_ORDER_SEQUENCE_NUMBER,
        E.UNKNOWN_PRODUCER_ID,
        E.INVALID_PRODUCER_EPOCH,
        E.INVALID_PRODUCER_ID_MAPPING,
        E.PRODUCER_FENCED,
        E._FENCED,
        E._INCONSISTENT,
        E._GAPLESS_GUARANTEE,
    }
)


def error_name(code: int) -> str:
    """librdkafka's name for an error code, e.g. -192 → "_MSG_TIMED_OUT"."""
    return _NAMES.get(code, f"ERR_{code}")


_NAMES: dict[int, str] = {
    getattr(E, n): n for n in dir(E) if n.isupper() or (n.startswith("_") and n[1:2].isupper())
}


def describe(err: KafkaError) -> str:
    """The form stored as `last_error`: "NAME (code): reason"."""
    return f"{error_name(err.code())} ({err.code()}): {err.str()}"


@dataclass(frozen=True)
class RetryDecision:
    """What the policy decided about one failed attempt."""

    give_up: bool
    delay: float = 0.0


@dataclass
class RetryPolicy:
    """How many times and how often a failed message is sent again before it is dead-lettered.

    Retry state lives in the outbox row (attempts, first failure, next due time), so a restart
    loses nothing and no worker sleeps per message.

    Args:
        max_attempts: total failed sends after which the message is dead-lettered (default 3).
            A re-send that failed for want of a cluster while no broker answered at all is
            not counted (`outbox.drain.settle`): an outage does not dead-letter messages.
        backoff: "fixed" (every retry `initial_delay` later) or "exponential".
        initial_delay: seconds before the first retry (default 3.0).
        multiplier: growth factor of each exponential step.
        max_delay: cap of one delay, seconds.
        jitter: fraction (0..1) of each delay added at random, so that many producers that failed
            together do not retry together.
        stop: a tenacity stop strategy (e.g. `stop_after_delay(3600) | stop_after_attempt(10)`);
            replaces `max_attempts` when given.
        wait: a tenacity wait strategy; replaces backoff/initial_delay/multiplier/max_delay.
        retry_codes: extra librdkafka error codes to treat as retriable.
        dead_letter_codes: extra codes to dead-letter at once.
        is_retriable: a predicate on the error code that overrides the table when it returns a
            bool (return None to fall through to the table).
    """

    max_attempts: int = 3
    backoff: str = "fixed"
    initial_delay: float = 3.0
    multiplier: float = 2.0
    max_delay: float = 300.0
    jitter: float = 0.0
    stop: stop_base | None = None
    wait: wait_base | None = None
    retry_codes: Iterable[int] = ()
    dead_letter_codes: Iterable[int] = ()
    is_retriable: Callable[[int], bool | None] | None = None
    _stop: stop_base = field(init=False, repr=False)
    _wait: wait_base = field(init=False, repr=False)
    _retry: frozenset[int] = field(init=False, repr=False)
    _dead: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None and self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.backoff not in ("fixed", "exponential"):
            raise ConfigError(f"backoff must be 'fixed' or 'exponential', got {self.backoff!r}")
        if self.initial_delay < 0 or self.max_delay < 0 or self.multiplier < 1:
            raise ConfigError("delays must be >= 0 and multiplier >= 1")
        if not 0 <= self.jitter <= 1:
            raise ConfigError(f"jitter is a fraction between 0 and 1, got {self.jitter}")
        self._stop = self.stop if self.stop is not None else tenacity.stop_after_attempt(self.max_attempts)
        if self.wait is not None:
            self._wait = self.wait
        elif self.backoff == "fixed":
            self._wait = tenacity.wait_fixed(self.initial_delay)
        else:
            self._wait = tenacity.wait_exponential(
                multiplier=self.initial_delay, exp_base=self.multiplier, max=self.max_delay
            )
        self._retry = frozenset(self.retry_codes)
        self._dead = frozenset(self.dead_letter_codes)

    def classify(self, code: int) -> Disposition:
        """Retry, dead-letter, or recreate the producer, for a librdkafka error code."""
        if self.is_retriable is not None:
            verdict = self.is_retriable(code)
            if verdict is not None:
                return Disposition.RETRY if verdict else Disposition.DEAD
        if code in self._dead:
            return Disposition.DEAD
        if code in self._retry or code in RETRIABLE_CODES:
            return Disposition.RETRY
        if code in FATAL_CODES:
            return Disposition.FATAL
        if code in PERMANENT_CODES:
            return Disposition.DEAD
        # Unknown errors: retried, but only as often as the policy allows, then dead-lettered.
        return Disposition.RETRY

    def decide(self, attempts: int, first_failed_at: float, now: float) -> RetryDecision:
        """Decide after the `attempts`-th failed send (1 = the first send failed).

        Args:
            attempts: failed sends so far, this one included.
            first_failed_at: epoch seconds of the first failure.
            now: epoch seconds of this failure.
        """
        state = tenacity.RetryCallState(None, None, (), {})  # type: ignore[arg-type]
        state.attempt_number = attempts
        state.start_time = first_failed_at
        state.outcome_timestamp = now
        if self._stop(state):
            return RetryDecision(give_up=True)
        delay = float(self._wait(state))
        if self.jitter:
            delay += delay * self.jitter * random.random()
        return RetryDecision(give_up=False, delay=delay)
