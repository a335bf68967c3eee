"""Plain data shared by the producer, the stores, the CLI and the Spark job."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

Headers = list[tuple[str, bytes | None]]
#: A message's (topic, key): the unit of per-key order.
Key = tuple[str, bytes]


class Status(enum.IntEnum):
    """Where a stored row stands. Stored as a small integer, never as text.

    Delivered rows are deleted, so there is no DELIVERED status in the store.
    """

    PENDING = 0
    DEAD = 2


class NewMessage(NamedTuple):
    """A message about to be written to the outbox (a tuple: cheap to build on hot paths)."""

    topic: str
    value: bytes | None
    key: bytes | None = None
    headers: Headers | None = None
    partition: int = -1
    msg_id: str = ""
    attempts: int = 0
    first_failed_at: float | None = None
    last_error: str | None = None
    next_attempt_at: float = 0.0
    error_code: int | None = None  # librdkafka code of last_error (None: no failure yet)
    error_name: str | None = None  # librdkafka name of that code, e.g. "_MSG_TIMED_OUT"
    #: The record timestamp, ms since the epoch: the one given to produce(), else the time of the
    #: first produce() call; every re-send sends it. 0: unknown (sent as librdkafka's now).
    timestamp: int = 0


class OutboxMessage(NamedTuple):
    """A message stored in the outbox (pending or dead), as the store returns it.

    A NamedTuple, not a frozen dataclass: a drain builds one per row, and a tuple is built
    several times faster (the dataclass's __init__ stood out in a claim's profile).
    """

    id: int
    msg_id: str
    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers
    partition: int
    status: Status
    attempts: int
    created_at: float
    first_failed_at: float | None
    last_failed_at: float | None
    next_attempt_at: float
    last_error: str | None
    error_code: int | None = None
    error_name: str | None = None
    timestamp: int = 0  # the record timestamp, ms since the epoch (0: unknown), as `NewMessage`'s


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message that will not be retried any more: handed to the recovery callback.

    Attributes:
        id: row id in the outbox store (what the CLI's `dlq show ID` takes).
        msg_id: the stable message id carried in the `outbox-id` header.
        topic, key, value, headers, partition: the message exactly as produced.
        attempts: how many sends failed.
        first_failed_at, last_failed_at: epoch seconds.
        last_error: the error that ended it, as "NAME (code): reason" (for people).
        error_code, error_name: that error's librdkafka code and name (for programs).
        timestamp: the record timestamp, ms since the epoch (0: unknown).
    """

    id: int
    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers
    partition: int
    attempts: int
    first_failed_at: float | None
    last_failed_at: float | None
    last_error: str | None
    msg_id: str = ""
    error_code: int | None = None
    error_name: str | None = None
    timestamp: int = 0

    @classmethod
    def from_row(cls, row: OutboxMessage) -> DeadLetter:
        return cls(
            id=row.id,
            topic=row.topic,
            key=row.key,
            value=row.value,
            headers=row.headers,
            partition=row.partition,
            attempts=row.attempts,
            first_failed_at=row.first_failed_at,
            last_failed_at=row.last_failed_at,
            last_error=row.last_error,
            msg_id=row.msg_id,
            error_code=row.error_code,
            error_name=row.error_name,
            timestamp=row.timestamp,
        )


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counts the store can tell without scanning message bytes."""

    pending: int
    dead: int
    leased: int
    oldest_pending_at: float | None
    next_due_at: float | None
    pending_by_topic: dict[str, int]
    dead_by_topic: dict[str, int]
    dead_by_error: dict[str, int]


@dataclass(frozen=True, slots=True)
class DeadLetterFilter:
    """Which dead letters a list / purge / replay names. Empty filter: all of them."""

    ids: tuple[int, ...] = ()
    topic: str | None = None
    error: str | None = None
    since: float | None = None
    until: float | None = None
    limit: int | None = None
    #: A ResilientConsumer group: its dead letters carry the header ``outbox-group: <group>``.
    group: str | None = None
    #: The exact message key.
    key: bytes | None = None
    #: Text the error contains (case-insensitive for ASCII).
    text: str | None = None
    #: Keyset pagination: only ids greater than this (results are in id order).
    after_id: int | None = None


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One operator action on stored messages, as the audit log keeps it.

    Attributes:
        id: entry id (increasing).
        at: epoch seconds.
        who: the console's "local", "token:<first 8 hex of its SHA-256>" (never the token
            itself) or "proxy:<role>" (a reverse proxy's role header), the command line's
            "cli:<user>", the Spark job's "spark_drain:<user>", or a producer's "retention".
        action: "redrive", "purge" (one entry per batch of a bounded purge), "edit-redrive",
            "erase", "reveal" (a message shown unmasked), ...
        filter: what was named (a JSON object as text: filter fields or ids; an erasure's key as
            "key_sha256", never its bytes).
        count: how many messages the action changed (an erasure: pending and dead).
    """

    id: int
    at: float
    who: str
    action: str
    filter: str
    count: int
