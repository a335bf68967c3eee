"""The settle step: what happens to a message after one send. The one place this is decided.

`settle(row, outcome, policy, now)` is a pure function (no I/O, no clock of its own), used by
the producer's first sends, the write-ahead sends, the drain workers and the Spark job alike:

* delivered                      → the row is deleted;
* never sent (purged, destroyed) → released: due now, no attempt counted;
* failed for want of a cluster (time-out, transport) while no broker answered at all
                                 → released too: an outage is not the message's failure, so a
                                   long one does not use up its attempts and dead-letter it;
* whole record batch refused for its size, the message not yet sent alone
                                 → re-send alone (maybe a batch-mate's fault);
* permanent error, or the policy gives up → dead letter (code, name);
* otherwise                      → reschedule at `now + policy delay`.

A fatal error (the producer instance is unusable) reschedules the message and also says
`recreate_producer`: the message is fine, the producer is not.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from confluent_kafka import KafkaError

from outbox.retry import BATCH_SIZE_CODES, UNREACHABLE_CODES, Disposition, RetryPolicy, describe, error_name
from outbox.stores.base import Failure, Settlement

#: Errors of messages that never left the process: not an attempt, not the message's fault.
NEVER_SENT_CODES = frozenset({KafkaError._PURGE_QUEUE, KafkaError._DESTROY})


class Verdict(enum.Enum):
    """The five fates of one send."""

    DELIVERED = "delivered"
    RESCHEDULE = "reschedule"
    DEAD_LETTER = "dead-letter"
    RESEND_ALONE = "re-send alone"
    RELEASE = "release"


@dataclass(frozen=True, slots=True)
class Decision:
    """A verdict and what it needs: the retry time, the error (code, name, text)."""

    verdict: Verdict
    at: float | None = None  # RESCHEDULE: epoch seconds of the next attempt
    code: int | None = None
    name: str | None = None
    error: str | None = None  # "NAME (code): reason", for people (last_error, headers)
    recreate_producer: bool = False
    attempts: int = field(default=0)  # failed sends counted after this one (RESCHEDULE, DEAD_LETTER)


DELIVERED = Decision(Verdict.DELIVERED)


class SentRow(Protocol):
    """What settle needs to know about the message that was sent."""

    @property
    def attempts(self) -> int: ...  # failed sends before this one

    @property
    def first_failed_at(self) -> float | None: ...


def settle(
    row: SentRow, err: KafkaError | None, policy: RetryPolicy, now: float, *, alone: bool = False,
    cluster_down: bool = False,
) -> Decision:
    """Decide the fate of `row` after one send whose delivery report carried `err`.

    Args:
        row: the message's retry state before this send (attempts, first_failed_at).
        err: None for a delivered message, else the report's (or produce()'s) error.
        policy: classification of error codes and the retry schedule.
        now: epoch seconds of the report.
        alone: the message was sent on its own (a batch-size error is then its own fault).
        cluster_down: no broker answered when the sender looked after this send's failure.
    """
    if err is None:
        return DELIVERED
    code = err.code()
    name = error_name(code)
    if code in NEVER_SENT_CODES or (cluster_down and code in UNREACHABLE_CODES):
        return Decision(Verdict.RELEASE, now, code, name, describe(err), attempts=row.attempts)
    if code in BATCH_SIZE_CODES and not alone:
        return Decision(Verdict.RESEND_ALONE, now, code, name, describe(err), attempts=row.attempts)
    attempts = row.attempts + 1
    disposition = policy.classify(code)
    if disposition is Disposition.DEAD:
        return Decision(Verdict.DEAD_LETTER, None, code, name, describe(err), attempts=attempts)
    decision = policy.decide(attempts, row.first_failed_at if row.first_failed_at is not None else now, now)
    fatal = disposition is Disposition.FATAL
    if decision.give_up:
        return Decision(Verdict.DEAD_LETTER, None, code, name, describe(err), fatal, attempts)
    return Decision(Verdict.RESCHEDULE, now + decision.delay, code, name, describe(err), fatal, attempts)


def add_to(settlement: Settlement, row_id: int, d: Decision, now: float) -> None:
    """Put one stored row's decision into the batch the store applies in one transaction.

    RESEND_ALONE rows are not stored decisions: the caller sends them again first.
    """
    v = d.verdict
    if v is Verdict.DELIVERED:
        settlement.delivered.append(row_id)
    elif v is Verdict.RELEASE:
        settlement.released.append(row_id)
    elif v is Verdict.RESCHEDULE or v is Verdict.DEAD_LETTER:
        assert d.code is not None and d.name is not None and d.error is not None
        settlement.failures.append(Failure(row_id, d.error, d.at, now, d.code, d.name))
    else:
        raise ValueError(f"{v.value} is not a stored decision; re-send row {row_id} first")
