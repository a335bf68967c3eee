"""What is left in an outbox and why, as text lines and as JSON (`outbox status`, `outbox drain`)."""

from __future__ import annotations

from typing import Any

from outbox.stores.backlog import Backlog, OwnerLeases
from outbox.stores.owners import Liveness, describe_owner

from . import format as fmt

_LIVENESS_TEXT = {
    Liveness.ALIVE: "alive",
    Liveness.GONE: "gone: the next drain takes its rows at once",
    Liveness.UNKNOWN: "not on this host: its leases expire",
}


def _owner(o: OwnerLeases) -> str:
    return f"{describe_owner(o.owner)} ({_LIVENESS_TEXT[o.liveness]})"


def lines(b: Backlog) -> list[str]:
    """One line per state that holds rows, in the order an operator acts on them."""
    out: list[str] = []
    if b.due_now:
        out.append(f"{b.due_now} due now")
    if b.backing_off:
        span = fmt.when(b.backing_off_first)
        if b.backing_off_last != b.backing_off_first:
            span += f" (the last until {fmt.when(b.backing_off_last)})"
        out.append(f"{b.backing_off} backing off until {span}")
    for o in b.leases:
        out.append(f"{o.leased} leased by {_owner(o)} until {fmt.when(o.until)}")
        if o.waiting:
            out.append(
                f"{o.waiting} waiting behind {o.leased} row(s) of their key leased by "
                f"{describe_owner(o.owner)} until {fmt.when(o.until)}"
            )
    if b.waiting_behind_backoff:
        out.append(
            f"{b.waiting_behind_backoff} waiting behind rows of their key backing off until "
            f"{fmt.when(b.waiting_behind_backoff_until)}"
        )
    if b.dead:
        out.append(f"{b.dead} dead-lettered (see: outbox dlq list)")
    return out


def owner_json(o: OwnerLeases) -> dict[str, Any]:
    return {
        "owner": o.owner,
        "name": describe_owner(o.owner),
        "state": o.liveness.value,
        "leased": o.leased,
        "waiting": o.waiting,
        "until": fmt.iso(o.until),
    }


def as_json(b: Backlog) -> dict[str, Any]:
    """The same facts as `lines`, as one JSON object."""
    return {
        "due_now": b.due_now,
        "backing_off": b.backing_off,
        "backing_off_until": {"first": fmt.iso(b.backing_off_first), "last": fmt.iso(b.backing_off_last)},
        "waiting_behind_backoff": b.waiting_behind_backoff,
        "waiting_behind_backoff_until": fmt.iso(b.waiting_behind_backoff_until),
        "leases": [owner_json(o) for o in b.leases],
        "dead": b.dead,
    }


def lease_table(b: Backlog) -> str:
    """`outbox status`'s leases by owner."""
    rows = [
        [describe_owner(o.owner), o.liveness.value, str(o.leased), str(o.waiting), fmt.when(o.until)]
        for o in b.leases
    ]
    return fmt.table(["OWNER", "STATE", "LEASED", "WAITING", "UNTIL"], rows, indent="  ")


def next_move(b: Backlog, now: float) -> float | None:
    """When a drain could next send something: now if rows are due or held by a gone owner,
    else the earliest back-off end or lease expiry; None if nothing is pending."""
    if b.due_now or any(o.liveness is Liveness.GONE for o in b.leases):
        return now
    times = [t for t in [b.backing_off_first, *(o.until for o in b.leases)] if t is not None]
    return max(now, min(times)) if times else None
