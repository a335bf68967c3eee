"""What is left in an outbox, and why: the answer `outbox status` and `outbox drain` print.

Every PENDING row is in exactly one of these states at a given moment:

* **due now**: free to claim;
* **backing off** until its next attempt (it failed; the retry policy set the time);
* **leased** by an owner (a drainer or a write-ahead producer sending it) until the lease ends;
* **waiting** behind an earlier row of its key (per-key order) that is backing off or leased.

Dead letters are counted apart. An owner's liveness (`outbox.stores.owners`) says whether a lease is
really held: a gone owner's rows go to the next claimer at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from outbox.stores.owners import Liveness


@dataclass(frozen=True, slots=True)
class OwnerLeases:
    """The rows one lease owner holds, and the rows of their keys queued behind them.

    Attributes:
        owner: the owner's name as stored (see `outbox.stores.owners`).
        liveness: alive, gone (its leases go to the next claimer) or unknown (they expire).
        leased: rows it holds.
        waiting: due rows of the same keys that wait for its rows first.
        until: when its last lease expires (epoch seconds).
    """

    owner: str
    liveness: Liveness
    leased: int
    waiting: int
    until: float


@dataclass(frozen=True, slots=True)
class Backlog:
    """What is left in an outbox at one moment (see the module docstring).

    Attributes:
        due_now: rows free to claim now.
        backing_off: rows waiting for their next attempt.
        backing_off_first / backing_off_last: earliest and latest next attempt among them.
        waiting_behind_backoff: due rows whose key has an earlier row backing off.
        waiting_behind_backoff_until: the latest next attempt among those blocking rows.
        leases: per owner, oldest expiry first.
        dead: dead letters.
    """

    due_now: int = 0
    backing_off: int = 0
    backing_off_first: float | None = None
    backing_off_last: float | None = None
    waiting_behind_backoff: int = 0
    waiting_behind_backoff_until: float | None = None
    leases: tuple[OwnerLeases, ...] = ()
    dead: int = 0

    @property
    def pending(self) -> int:
        """Every PENDING row, whatever its state."""
        return (
            self.due_now
            + self.backing_off
            + self.waiting_behind_backoff
            + sum(o.leased + o.waiting for o in self.leases)
        )


# Row states of `backlog_sql`'s first column.
DUE, BACKING_OFF, LEASED, WAITING_BACKOFF, WAITING_LEASE, DEAD = range(6)


def backlog_sql(
    table: str, p: str, now: float, topic: str | None, *, count: str = "COUNT(*)", key: str = "key"
) -> tuple[str, list[Any]]:
    """The one query every SQL store runs, with its placeholder `p`, and its arguments.

    `count`: how a group of rows counts its messages (SQLite: `SUM(r.n)`, a row may hold several).
    `key`: the key column as the dialect names it (a reserved word in MySQL, quoted there).

    Columns: state, owner, count, min time, max time. The blocker of a key is its first PENDING
    row that is not due (leased or backing off); due rows after it wait behind it.
    """
    sql = (
        f"WITH head AS (SELECT topic, {key}, MIN(id) AS bid FROM {table} "
        f"WHERE status = 0 AND next_attempt_at > {p} AND {key} IS NOT NULL GROUP BY topic, {key}) "
        "SELECT CASE "
        f"WHEN r.status = 2 THEN {DEAD} "
        f"WHEN r.next_attempt_at > {p} THEN "
        f"CASE WHEN r.lease_owner IS NULL THEN {BACKING_OFF} ELSE {LEASED} END "
        "WHEN h.bid IS NOT NULL AND h.bid < r.id THEN "
        f"CASE WHEN b.lease_owner IS NULL THEN {WAITING_BACKOFF} ELSE {WAITING_LEASE} END "
        f"ELSE {DUE} END AS state, "
        f"CASE WHEN r.status = 2 THEN NULL WHEN r.next_attempt_at > {p} THEN r.lease_owner "
        "WHEN h.bid IS NOT NULL AND h.bid < r.id THEN b.lease_owner END AS owner, "
        f"{count}, "
        f"MIN(CASE WHEN r.next_attempt_at > {p} THEN r.next_attempt_at ELSE b.next_attempt_at END), "
        f"MAX(CASE WHEN r.next_attempt_at > {p} THEN r.next_attempt_at ELSE b.next_attempt_at END) "
        f"FROM {table} AS r LEFT JOIN head AS h ON h.topic = r.topic AND h.{key} = r.{key} "
        f"AND r.status = 0 LEFT JOIN {table} AS b ON b.id = h.bid "
        "WHERE r.status IN (0, 2)"
    )
    args: list[Any] = [now] * sql.count(p)
    if topic is not None:
        sql += f" AND r.topic = {p}"
        args.append(topic)
    return sql + " GROUP BY 1, 2", args


def backlog_from_rows(
    rows: Iterable[Sequence[Any]], liveness: Callable[[Sequence[str]], dict[str, Liveness]]
) -> Backlog:
    """A Backlog from `backlog_sql`'s rows; `liveness` judges the owners found."""
    fields: dict[str, Any] = {}
    per_owner: dict[str, list[Any]] = {}  # owner -> [leased, waiting, until]
    for state, owner, count, first, last in rows:
        if state == DUE:
            fields["due_now"] = count
        elif state == DEAD:
            fields["dead"] = count
        elif state == BACKING_OFF:
            fields.update(backing_off=count, backing_off_first=first, backing_off_last=last)
        elif state == WAITING_BACKOFF:
            fields.update(waiting_behind_backoff=count, waiting_behind_backoff_until=last)
        else:
            entry = per_owner.setdefault(owner, [0, 0, 0.0])
            entry[0 if state == LEASED else 1] += count
            entry[2] = max(entry[2], last)
    live = liveness(sorted(per_owner))
    leases = sorted(
        (OwnerLeases(o, live.get(o, Liveness.UNKNOWN), n, w, until) for o, (n, w, until) in per_owner.items()),
        key=lambda ol: (ol.until, ol.owner),
    )
    return Backlog(**fields, leases=tuple(leases))
