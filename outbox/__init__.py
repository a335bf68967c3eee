"""kafka-outbox: a Kafka producer that loses nothing when Kafka fails.

    from outbox import ResilientProducer, RetryPolicy, DeadLetter

Failed sends go to a durable outbox (SQLite by default, PostgreSQL for fleets); background
drain workers re-send them under a retry policy; what cannot be delivered becomes a dead letter
and the application's recovery callback is called.
"""

import logging

from outbox.consumer import (
    AsyncResilientConsumer,
    Ignore,
    MainTopicCircuit,
    ResilientConsumer,
    RetryInPlace,
    RetryTopics,
)
from outbox.drain.workers import Drainer, DrainResult
from outbox.errors import (
    ConfigError,
    DecryptionError,
    KafkaDeliveryError,
    KafkaUnavailableError,
    OutboxError,
    ProducerClosedError,
    ProducerForkedError,
    StoreError,
    StoreNotFoundError,
    UnknownMessageError,
)
from outbox.events import Listener
from outbox.headers import ATTEMPT_HEADER, FIRST_FAILED_HEADER, ID_HEADER, LAST_ERROR_HEADER
from outbox.producer.aio import AsyncResilientProducer
from outbox.producer.circuit import CircuitBreaker, CircuitState
from outbox.producer.resilient import PRODUCER_DEFAULTS, ResilientProducer
from outbox.producer.sigterm import on_sigterm
from outbox.records import DeadLetter, DeadLetterFilter, NewMessage, OutboxMessage, Status, StoreStats
from outbox.retry import Disposition, RetryPolicy
from outbox.stores import MemoryOutbox, Outbox, SQLiteOutbox, open_outbox
from outbox.stores.urls import StoreURL, parse_url

__version__ = "0.1.0"

# A library configures no logging: without this, Python's last-resort handler would print our
# warnings on the application's stderr (see outbox.logs).
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "ATTEMPT_HEADER",
    "FIRST_FAILED_HEADER",
    "ID_HEADER",
    "LAST_ERROR_HEADER",
    "Listener",
    "PRODUCER_DEFAULTS",
    "AsyncResilientConsumer",
    "AsyncResilientProducer",
    "CircuitBreaker",
    "CircuitState",
    "ConfigError",
    "DeadLetter",
    "DeadLetterFilter",
    "Disposition",
    "DrainResult",
    "Drainer",
    "Ignore",
    "KafkaDeliveryError",
    "DecryptionError",
    "KafkaUnavailableError",
    "MainTopicCircuit",
    "MemoryOutbox",
    "NewMessage",
    "Outbox",
    "OutboxError",
    "OutboxMessage",
    "ProducerClosedError",
    "ProducerForkedError",
    "ResilientConsumer",
    "ResilientProducer",
    "RetryInPlace",
    "RetryPolicy",
    "RetryTopics",
    "SQLiteOutbox",
    "Status",
    "StoreError",
    "StoreNotFoundError",
    "StoreStats",
    "StoreURL",
    "UnknownMessageError",
    "on_sigterm",
    "open_outbox",
    "parse_url",
]
