"""`ResilientProducer`'s settings, checked once: what its constructor was given, defaulted and refused here.

`ProducerSettings.check` does every check of the constructor's arguments, in the order they are
made, before any part is built, opened or started: a producer whose settings are refused leaves
nothing behind (no outbox file, no thread). The parts are then built from one `ProducerSettings`.
librdkafka checks its own settings when the producer's Kafka client is built (`outbox.producer.link`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from outbox.drain import idempotence
from outbox.drain.process import DrainSettings
from outbox.drain.sendloop import check_resend_config
from outbox.errors import ConfigError, StoreError
from outbox.logs import LIBRDKAFKA_LOG
from outbox.message import DeliveryCallback
from outbox.producer.link import queue_limits
from outbox.producer.serialization import Serializer, Serializers
from outbox.producer.storedcallbacks import DeadLetterCallback
from outbox.producer.tokens import TokenSource
from outbox.retry import RetryPolicy
from outbox.stores import Outbox
from outbox.stores.encryption import Encryption, KeyRing, as_key_ring

__all__ = ["PRODUCER_DEFAULTS", "ProducerArguments", "ProducerSettings"]

#: Defaults for the wrapped producer; any key the caller sets wins.
PRODUCER_DEFAULTS: Mapping[str, Any] = {
    # librdkafka's default is 300 s: five minutes of messages held in memory, lost if the
    # process dies, before the application hears of a failure. The outbox takes over sooner.
    "message.timeout.ms": 30000,
}

_MODES = ("fallback", "write-ahead")
_DURABILITY = ("batch", "sync")
_DRAIN_IN = ("threads", "process")

#: Settings that name the default delivery callback, as confluent_kafka reads them.
_DEFAULT_CALLBACK_KEYS = ("on_delivery", "dr_msg_cb", "dr_cb")

_NO_TRANSACTIONS = (
    "transactional.id is not supported: an outbox cannot hold part of a Kafka transaction (a "
    "message stored for a later re-send would be delivered outside the transaction, after it "
    "committed or aborted). To write messages atomically with database changes, use "
    "produce(..., transaction=conn) with a PostgreSQL outbox; for Kafka transactions use "
    "confluent_kafka.Producer"
)


@dataclass(frozen=True, kw_only=True)
class ProducerArguments:
    """`ResilientProducer`'s keyword arguments as the caller gave them, unchecked.

    No defaults here: the constructor's signature is the one place that has them. Each is
    described in `ResilientProducer`'s docstring.
    """

    logger: logging.Logger | logging.LoggerAdapter[Any] | None
    outbox: str | Outbox
    retry: RetryPolicy | None
    on_dead_letter: DeadLetterCallback | None
    mode: str
    durability: str
    drain_workers: int
    drain_in: str
    id_header: str | None
    circuit_failure_threshold: int
    circuit_reset_timeout: float
    queue_full_timeout: float
    commit_interval: float
    lease_seconds: float
    drain_batch_size: int
    drain_poll_interval: float
    on_store_error: Callable[[StoreError], None] | None
    key_serializer: Serializer | None
    value_serializer: Serializer | None
    memory_budget: int
    exit_timeout: float
    handle_sigterm: bool
    dead_letter_retention: float | timedelta | None
    encryption: Encryption | None


@dataclass(frozen=True)
class ProducerSettings:
    """A `ResilientProducer`'s settings once checked and defaulted (`check`); its parts are built from them."""

    outbox: str | Outbox
    retry: RetryPolicy
    on_dead_letter: DeadLetterCallback | None
    mode: str
    durability: str
    #: As given: 0 runs no drain worker (`drain.workers` is then 1, for a drainer never started).
    drain_workers: int
    drain_in: str
    id_header: str | None
    circuit_failure_threshold: int
    circuit_reset_timeout: float
    queue_full_timeout: float
    commit_interval: float
    #: At least one send attempt (`message_timeout`) plus a margin.
    lease_seconds: float
    on_store_error: Callable[[StoreError], None] | None
    #: None without serializers, so that produce() pays one `is None` test.
    serializers: Serializers | None
    memory_budget: int
    exit_timeout: float
    handle_sigterm: bool
    #: Seconds a dead letter is kept after its last failure (None: kept until purged).
    dead_letter_retention: float | None
    #: The key ring that encrypts stored payloads (None: stored in clear).
    encryption: KeyRing | None
    #: The librdkafka producer's settings: the caller's (less `error_cb` and the default delivery
    #: callback) over `PRODUCER_DEFAULTS`, with idempotence, the logger and the queue's bound defaulted.
    kafka_config: Mapping[str, Any]
    #: The drain workers' producers' settings: the caller's, with its `error_cb`.
    drain_config: Mapping[str, Any]
    #: The caller's `error_cb`, which the producer's Kafka client runs after its own.
    user_error_cb: Callable[..., None] | None
    #: The delivery callback of a message produced without one (`on_delivery`, `dr_msg_cb`, `dr_cb`).
    default_on_delivery: DeliveryCallback | None
    #: What the messages librdkafka may hand back would cost once stored (`queue_limits`).
    rdkafka_reserve: int
    #: False when `delivery.report.only.error` is set: `on_delivery` hears failures only.
    report_successes: bool
    #: `message.timeout.ms` in seconds: the longest a send attempt lasts.
    message_timeout: float
    drain: DrainSettings

    @classmethod
    def check(
        cls, config: Mapping[str, Any] | None, settings: Mapping[str, Any], given: ProducerArguments
    ) -> ProducerSettings:
        """The settings of `ResilientProducer(config, **settings, ...given)`.

        Raises:
            TypeError: `config` is not a mapping, or neither it nor `settings` is given (as
                confluent_kafka's), or the default delivery callback is not callable.
            ConfigError: a setting is refused (the message names it).
        """
        if config is None and not settings:
            raise TypeError("expected configuration dict")  # confluent_kafka's words
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"expected configuration dict, got {type(config).__name__}")
        caller_config = {**(config or {}), **settings}
        if callable(caller_config.get("oauth_cb")):  # what it raises names the circuit's cause
            caller_config["oauth_cb"] = TokenSource(caller_config["oauth_cb"])
        if given.logger is not None:
            caller_config["logger"] = given.logger
        _check_arguments(caller_config, given)
        if given.drain_workers > 0:  # before anything starts: a worker whose producer is refused never runs
            check_resend_config(caller_config)
        user_error_cb = caller_config.pop("error_cb", None)
        # Every message carries its own callback; these name the one of messages given none.
        default_callbacks = [caller_config.pop(k) for k in _DEFAULT_CALLBACK_KEYS if k in caller_config]
        default_on_delivery: DeliveryCallback | None = next((cb for cb in default_callbacks if cb is not None), None)
        if default_on_delivery is not None and not callable(default_on_delivery):
            raise TypeError(f"on_delivery must be callable, got {type(default_on_delivery).__name__}")
        # Idempotent unless the caller's settings rule it out: per-key order on the fast path
        # needs it (`outbox.drain.idempotence`).
        kafka_config = idempotence.with_default({**PRODUCER_DEFAULTS, **caller_config})
        kafka_config.setdefault("logger", LIBRDKAFKA_LOG)  # librdkafka's lines to logging, summarised
        rdkafka_queue, rdkafka_reserve = queue_limits(kafka_config, given.memory_budget)
        kafka_config.update(rdkafka_queue)
        # Successes are reported to on_delivery unless the application opts out, as in librdkafka.
        # Write-ahead rows are deleted on their success report, so that mode always asks for them.
        report_successes = not _is_true(kafka_config.pop("delivery.report.only.error", False))
        kafka_config["delivery.report.only.error"] = given.mode == "fallback" and not report_successes
        message_timeout = int(kafka_config["message.timeout.ms"]) / 1000
        lease_seconds = max(given.lease_seconds, message_timeout + 5)  # a lease must outlive one send attempt
        drain_config = dict(caller_config)
        if user_error_cb is not None:
            drain_config["error_cb"] = user_error_cb
        retry = given.retry or RetryPolicy()
        return cls(
            outbox=given.outbox,
            retry=retry,
            on_dead_letter=given.on_dead_letter,
            mode=given.mode,
            durability=given.durability,
            drain_workers=given.drain_workers,
            drain_in=given.drain_in,
            id_header=given.id_header,
            circuit_failure_threshold=given.circuit_failure_threshold,
            circuit_reset_timeout=given.circuit_reset_timeout,
            queue_full_timeout=given.queue_full_timeout,
            commit_interval=given.commit_interval,
            lease_seconds=lease_seconds,
            on_store_error=given.on_store_error,
            serializers=Serializers.of(given.key_serializer, given.value_serializer),
            memory_budget=given.memory_budget,
            exit_timeout=float(given.exit_timeout),
            handle_sigterm=given.handle_sigterm,
            dead_letter_retention=retention_seconds(given.dead_letter_retention),
            kafka_config=kafka_config,
            encryption=as_key_ring(given.encryption),
            drain_config=drain_config,
            user_error_cb=user_error_cb,
            default_on_delivery=default_on_delivery,
            rdkafka_reserve=rdkafka_reserve,
            report_successes=report_successes,
            message_timeout=message_timeout,
            drain=DrainSettings(
                retry=retry,
                workers=max(given.drain_workers, 1),
                batch_size=given.drain_batch_size,
                lease_seconds=lease_seconds,
                poll_interval=given.drain_poll_interval,
            ),
        )


def _check_arguments(config: Mapping[str, Any], given: ProducerArguments) -> None:
    """The checks of the constructor's own arguments (librdkafka's settings aside)."""
    if "transactional.id" in config:
        raise ConfigError(_NO_TRANSACTIONS)
    if given.mode not in _MODES:
        raise ConfigError(f"mode must be one of {_MODES}, got {given.mode!r}")
    if given.durability not in _DURABILITY:
        raise ConfigError(f"durability must be one of {_DURABILITY}, got {given.durability!r}")
    if given.drain_workers < 0:
        raise ConfigError(f"drain_workers must be >= 0, got {given.drain_workers}")
    queue_full_timeout = given.queue_full_timeout
    if not queue_full_timeout >= 0:  # also refuses NaN
        raise ConfigError(f"queue_full_timeout must be >= 0 seconds, got {queue_full_timeout!r}")
    exit_timeout = given.exit_timeout
    if not (isinstance(exit_timeout, int | float) and exit_timeout >= 0):  # also refuses NaN
        raise ConfigError(f"exit_timeout must be a number of seconds >= 0, got {exit_timeout!r}")
    if given.handle_sigterm.__class__ is not bool:
        raise ConfigError(f"handle_sigterm must be True or False, got {given.handle_sigterm!r}")
    if given.drain_in not in _DRAIN_IN:
        raise ConfigError(f"drain_in must be one of {_DRAIN_IN}, got {given.drain_in!r}")
    memory_budget = given.memory_budget
    if memory_budget.__class__ is not int or memory_budget < 1:
        raise ConfigError(f"memory_budget must be a positive number of bytes (int), got {memory_budget!r}")
    if given.drain_in == "process" and isinstance(given.outbox, Outbox):
        raise ConfigError("drain_in='process' needs the outbox as a URL: the drain process opens it itself")


def retention_seconds(retention: object) -> float | None:
    """`dead_letter_retention` in seconds: a number of seconds or a `datetime.timedelta`, above 0;
    None keeps dead letters until they are purged.

    Raises:
        ConfigError: anything else, named.
    """
    if retention is None:
        return None
    if isinstance(retention, timedelta):
        seconds = retention.total_seconds()
    elif isinstance(retention, int | float) and not isinstance(retention, bool):
        seconds = float(retention)
    else:
        raise ConfigError(
            "dead_letter_retention must be a number of seconds or a datetime.timedelta (None: keep dead "
            f"letters until purged), got {retention!r}"
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"dead_letter_retention must be above 0 seconds, got {retention!r}")
    return seconds


def _is_true(setting: object) -> bool:
    """`delivery.report.only.error` as confluent_kafka takes it: a bool, nothing else."""
    if not isinstance(setting, bool):
        raise ConfigError(f"delivery.report.only.error must be True or False, got {setting!r}")
    return setting
