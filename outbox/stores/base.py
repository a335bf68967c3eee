"""The `Outbox` store interface: one contract, one test suite, every backend.

Row life: enqueue → PENDING (maybe leased) → deleted when Kafka acknowledged it, or
→ DEAD (dead letter) → purged, or replayed back to PENDING with attempts reset.

Leases: a claimed row gets `lease_owner` and its `next_attempt_at` is pushed to the lease's
expiry, so "due" (`next_attempt_at <= now`) also means "not leased". A worker that dies leaves
its rows to become due again when the lease expires. Transactions are short: claim in one,
send with no transaction open, acknowledge in another.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..backlog import Backlog
from ..codec import decode_headers
from ..owners import Liveness
from ..records import DeadLetterFilter, NewMessage, OutboxMessage, Status, StoreStats

#: The row columns every backend selects, in the order `row_from_columns` reads them.
COLUMNS = (
    "id, msg_id, topic, key, value, headers, partition, status, attempts, created_at, "
    "first_failed_at, last_failed_at, next_attempt_at, last_error"
)


def row_from_columns(r: Sequence[Any]) -> OutboxMessage:
    """An OutboxMessage from a row selected with `COLUMNS`."""
    return OutboxMessage(
        id=r[0],
        msg_id=r[1],
        topic=r[2],
        key=None if r[3] is None else bytes(r[3]),
        value=None if r[4] is None else bytes(r[4]),
        headers=decode_headers(None if r[5] is None else bytes(r[5])),
        partition=r[6],
        status=Status(r[7]),
        attempts=r[8],
        created_at=r[9],
        first_failed_at=r[10],
        last_failed_at=r[11],
        next_attempt_at=r[12],
        last_error=r[13],
    )


def dead_letter_where(flt: DeadLetterFilter, placeholder: str) -> tuple[str, list[Any]]:
    """The WHERE clause (with the driver's `placeholder`) and arguments of a dead-letter filter."""
    p = placeholder
    where: list[str] = [f"status = {p}"]
    args: list[Any] = [int(Status.DEAD)]
    if flt.ids:
        where.append(f"id IN ({', '.join([p] * len(flt.ids))})")
        args.extend(flt.ids)
    if flt.topic is not None:
        where.append(f"topic = {p}")
        args.append(flt.topic)
    if flt.error is not None:
        # Matches the error name or code at the start of "NAME (code): reason".
        where.append(f"(last_error LIKE {p} OR last_error LIKE {p})")
        args.extend([f"{flt.error} (%", f"% ({flt.error}):%"])
    if flt.since is not None:
        where.append(f"last_failed_at >= {p}")
        args.append(flt.since)
    if flt.until is not None:
        where.append(f"last_failed_at < {p}")
        args.append(flt.until)
    return " AND ".join(where), args


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed send, as the caller decided it under its retry policy.

    Attributes:
        id: row id.
        error: "NAME (code): reason".
        retry_at: epoch seconds of the next attempt, or None to dead-letter the row.
        failed_at: epoch seconds of this failure.
    """

    id: int
    error: str
    retry_at: float | None
    failed_at: float


class Outbox(abc.ABC):
    """A durable store of messages waiting for Kafka, and of dead letters.

    Implementations are safe to share between threads of one process, and several processes
    may use one store at once (leases keep each row with one sender at a time).
    """

    #: Where the store lives, for messages (never with credentials).
    location: str

    @abc.abstractmethod
    def migrate(self) -> None:
        """Create or upgrade the schema (idempotent, versioned)."""

    @abc.abstractmethod
    def enqueue(
        self,
        messages: Sequence[NewMessage],
        *,
        lease_owner: str | None = None,
        lease_until: float | None = None,
    ) -> list[int]:
        """Store new PENDING messages in one transaction; return their row ids in order.

        With `lease_owner`, the rows are born leased until `lease_until` (write-ahead mode:
        the producer sends them itself and only a crash hands them to drainers).
        """

    @abc.abstractmethod
    def add_dead(self, messages: Sequence[NewMessage], *, failed_at: float) -> list[int]:
        """Store messages straight into the dead-letter state (never pending)."""

    @abc.abstractmethod
    def claim(
        self, owner: str, limit: int, lease_seconds: float, *, now: float, topic: str | None = None
    ) -> list[OutboxMessage]:
        """Lease up to `limit` due PENDING rows to `owner`, oldest first.

        Per-key order: a row is not claimed while an earlier PENDING row of the same topic and key
        is leased or not yet due, so one key's messages leave in id order.
        """

    @abc.abstractmethod
    def mark_delivered(self, ids: Sequence[int]) -> int:
        """Delete rows Kafka acknowledged. Idempotent; returns how many were deleted."""

    @abc.abstractmethod
    def record_failures(self, failures: Sequence[Failure]) -> list[OutboxMessage]:
        """Count one failed attempt per row: reschedule it, or dead-letter it (retry_at None).

        Rows already deleted (delivered by someone else) are ignored. Returns the rows that were
        dead-lettered now, in their final state.
        """

    @abc.abstractmethod
    def release(self, ids: Sequence[int], *, now: float) -> None:
        """Give leased rows back, due now, without counting an attempt (clean stop)."""

    @abc.abstractmethod
    def commit_batch(
        self,
        new: Sequence[NewMessage],
        delivered: Sequence[int],
        failures: Sequence[Failure],
        *,
        lease_owner: str | None,
        lease_until: float | None,
    ) -> tuple[list[int], list[OutboxMessage]]:
        """enqueue + mark_delivered + record_failures in ONE transaction (group commit).

        Returns (ids of the new rows, rows dead-lettered now).
        """

    @abc.abstractmethod
    def get(self, id: int) -> OutboxMessage:
        """One row by id. Raises UnknownMessageError."""

    @abc.abstractmethod
    def list_dead(self, flt: DeadLetterFilter = DeadLetterFilter()) -> list[OutboxMessage]:
        """Dead letters matching the filter, oldest first."""

    @abc.abstractmethod
    def purge_dead(self, flt: DeadLetterFilter = DeadLetterFilter()) -> int:
        """Delete dead letters matching the filter; return how many."""

    @abc.abstractmethod
    def replay_dead(
        self, flt: DeadLetterFilter = DeadLetterFilter(), *, now: float, to_topic: str | None = None
    ) -> int:
        """Put dead letters back to PENDING, due now, attempts reset; return how many.

        The message bytes are unchanged; `to_topic` sends them to another topic instead.
        """

    @abc.abstractmethod
    def has_pending(self, topic: str, key: bytes) -> bool:
        """Whether any PENDING row of this topic and key exists."""

    def next_due_at(self) -> float | None:
        """Earliest `next_attempt_at` of a PENDING row (None: nothing pending).

        Idle drain workers call this to sleep exactly until work is due; backends override it
        with one indexed query instead of the full `stats()`.
        """
        return self.stats(now=time.time()).next_due_at

    @abc.abstractmethod
    def stats(self, *, now: float) -> StoreStats:
        """Counts by state, topic and error; oldest pending; next due time."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections. Idempotent."""

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- lease owners (see outbox.owners for the rule) -----------------------------------------

    def owner_liveness(self, owners: Sequence[str]) -> dict[str, Liveness]:
        """Alive, gone or unknown, for each lease owner. A backend that cannot tell: unknown."""
        return {o: Liveness.UNKNOWN for o in owners}

    def release_gone_owners(self, *, now: float) -> int:
        """Give back, due now, the leases of owners known to be gone; return how many rows.

        A backend that cannot tell releases nothing: leases then run until they expire.
        """
        return 0

    @abc.abstractmethod
    def backlog(self, *, now: float, topic: str | None = None) -> Backlog:
        """What is left (of one topic, or all) and why: due now, backing off, leased by whom (alive or gone), waiting
        behind which owner's rows, dead-lettered (`outbox.backlog`). One full read of the table:
        for operators and the CLI, not for hot paths."""
