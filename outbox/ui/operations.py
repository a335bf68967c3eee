"""What the pages and the JSON API both do with the store: a keyset page of dead letters, the
overview's counts, the check that named ids are dead letters, and what the audit log records
(a purge, an edited message redriven, a key erased, a message revealed).

Each works through the store's own methods; the routes only read the request and shape the
answer, so a page and its API twin cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from outbox.consumer.headers import consumer_failure
from outbox.errors import KafkaUnavailableError
from outbox.records import DeadLetterFilter, Headers, OutboxMessage, Status
from outbox.stores.audited import erase_key
from outbox.stores.base import Erased
from outbox.ui import present
from outbox.ui.console import Console
from outbox.ui.errors import ConsoleError
from outbox.ui.filters import describe, describe_json
from outbox.ui.lag import tier_lags
from outbox.ui.masking import MaskedEdit
from outbox.ui.roles import Identity, Role, forbidden


def dead_page(console: Console, flt: DeadLetterFilter) -> dict[str, Any]:
    """One page of the dead letters `flt` names, and the `after` of the next one (None: the last)."""
    assert flt.limit is not None
    # One row more than the page: whether there is a next page, without counting.
    rows = console.store.list_dead(DeadLetterFilter(**{**_fields(flt), "limit": flt.limit + 1}))
    more = len(rows) > flt.limit
    rows = rows[: flt.limit]
    return {
        "items": [present.summary(r, console.masker) for r in rows],
        "next_after": rows[-1].id if more and rows else None,
        "filter": describe(flt),
    }


def overview(console: Console) -> dict[str, Any]:
    """The counts of the overview page and of GET /api/stats."""
    store = console.store
    now = time.time()
    s = store.stats(now=now)
    by_group: dict[str, int] = {}
    for topic, n in s.dead_by_topic.items():
        if topic.endswith(".retry-1"):  # a consumer group's dead letters (addressed to its first tier)
            sample = store.list_dead(DeadLetterFilter(topic=topic, limit=1))
            failure = consumer_failure(sample[0].headers) if sample else None
            if failure is not None:
                by_group[failure.group] = by_group.get(failure.group, 0) + n
    return {
        "outbox": console.location,
        "pending": s.pending,
        "dead": s.dead,
        "leased": s.leased,
        "oldest_pending_age": None if s.oldest_pending_at is None else max(0.0, now - s.oldest_pending_at),
        "pending_by_topic": dict(sorted(s.pending_by_topic.items())),
        "dead_by_topic": dict(sorted(s.dead_by_topic.items())),
        "dead_by_group": dict(sorted(by_group.items())),
        "dead_by_error": dict(sorted(s.dead_by_error.items(), key=lambda kv: -kv[1])),
        # The circuit lives in each producer process (ResilientProducer.stats()["circuit"]);
        # the store cannot tell it.
        "circuit": None,
        **_tiers(console),
    }


def _tiers(console: Console) -> dict[str, Any]:
    """The retry tiers' lag (with -b); a cluster that does not answer is said, not fatal."""
    if console.kafka is None:
        return {"tier_lag": None, "tier_lag_error": None}
    try:
        lags = tier_lags(console.kafka, timeout=5.0)
    except KafkaUnavailableError as exc:
        return {"tier_lag": None, "tier_lag_error": str(exc)}
    return {"tier_lag": [dataclasses.asdict(t) for t in lags], "tier_lag_error": None}


def check_ids(console: Console, flt: DeadLetterFilter) -> DeadLetterFilter:
    """Every id named must be a dead letter: a typo or a row someone else redrove is said, not
    silently skipped (as `outbox dlq --id`)."""
    for i in flt.ids:
        row = console.store.get(i)  # UnknownMessageError: 404
        if row.status is not Status.DEAD:
            raise ConsoleError(409, f"message {i} is {row.status.name.lower()}, not a dead letter")
    return flt


def purge(console: Console, flt: DeadLetterFilter, who: str) -> int:
    """Delete the dead letters `flt` names, and record it as `who`'s; how many were deleted."""
    removed = console.store.purge_dead(flt)
    console.store.add_audit(who=who, action="purge", filter=describe_json(flt), count=removed,
                            at=time.time())
    return removed


def erase(console: Console, key: bytes, topic: str | None, *, who: str, dry_run: bool) -> Erased:
    """Delete every pending message and dead letter of `key` (of `topic`), and record it as
    `outbox erase` does (`outbox.stores.audited.erase_key`); `dry_run` counts only."""
    return erase_key(console.store, key, topic=topic, who=who, dry_run=dry_run)


def redrive_edited(console: Console, row_id: int, value: bytes | None, headers: Headers, me: Identity) -> int:
    """Store a dead letter's new value and headers and make it pending again, and record it.

    The edit was made on the masked message (`outbox.ui.masking`): masks that came back unchanged
    are the stored bytes again, masked text changed but still holding the mask is refused (400),
    and changing or dropping a masked part needs the admin's role, who may see it revealed.
    """
    store = console.store
    row = store.get(row_id)
    if row.status is not Status.DEAD:
        raise ConsoleError(409, f"message {row_id} is {row.status.name.lower()}, not a dead letter")
    try:
        edit = console.masker.restore(row, value, headers)
    except MaskedEdit as exc:
        raise ConsoleError(400, str(exc)) from None
    if edit.changes_masked and not me.may(Role.ADMIN):
        raise forbidden(me, Role.ADMIN, f"changing the masked parts of message {row_id}")
    if not store.redrive_edited(row_id, value=edit.value, headers=edit.headers, now=time.time()):
        raise ConsoleError(409, f"message {row_id} is no longer a dead letter")
    store.add_audit(who=me.who, action="edit-redrive", filter=describe_json(DeadLetterFilter(ids=(row_id,))),
                    count=1, at=time.time())
    return row_id


def reveal(console: Console, row_id: int, me: Identity) -> OutboxMessage:
    """One stored message, to be shown unmasked (`outbox.ui.masking.NO_MASKS`) to an admin; the
    audit log records who saw which first, so that no reveal goes unrecorded."""
    if not me.may(Role.ADMIN):
        raise forbidden(me, Role.ADMIN, "revealing a message unmasked")
    row = console.store.get(row_id)
    console.store.add_audit(who=me.who, action="reveal", filter=describe_json(DeadLetterFilter(ids=(row_id,))),
                            count=1, at=time.time())
    return row


def _fields(flt: DeadLetterFilter) -> dict[str, Any]:
    return {f: getattr(flt, f) for f in DeadLetterFilter.__dataclass_fields__}
