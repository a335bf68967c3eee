"""How a write is split into group rows and one-message rows: the one rule both stores follow.

A pending batch of `grouped.GROUP_MIN` or more messages becomes group rows
(`outbox.stores.grouped`): each run of one topic, up to `grouped.GROUP_MAX` messages a row; a run
shorter than `GROUP_MIN`, and any other batch (dead letters), one row per message. Rows born
leased (write-ahead) are grouped too: the writer hands their deliveries back per batch
(`outbox.producer.writeahead`), so a group is deleted whole.

The encoding is done here, before a store takes its write lock or opens its transaction: it is
per-message work, and under the lock it held up every other writer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from outbox.records import NewMessage, Status
from outbox.stores import grouped, sealed
from outbox.stores.base import insert_values
from outbox.stores.encryption import KeyRing


@dataclass(frozen=True, slots=True)
class NewGroup:
    """A group row ready to insert, and the messages it holds (a store that cannot give the
    group consecutive ids stores them one row each instead)."""

    topic: str
    n: int
    due: float  # when its lease ends, or when its latest message is due: none is sent before its time
    ready_at: float  # when its latest message is due, leases aside
    body: bytes
    keys: bytes | None
    owner: str | None  # born leased (write-ahead)
    key_id: str | None  # the key its body is encrypted with (`outbox.stores.sealed`); None: in clear
    messages: Sequence[NewMessage]


#: Part of a write: one-message rows (`insert_values` tuples), or one group.
Part = list[tuple[Any, ...]] | NewGroup


def prepare(
    messages: Sequence[NewMessage],
    status: Status,
    lease_owner: str | None,
    lease_until: float | None,
    now: float,
    ring: KeyRing | None = None,
) -> list[Part]:
    """What storing `messages` writes, in order (see the module's rule); with `ring`, each row's
    payload encrypted (`outbox.stores.sealed`: a one-message row's values, a group's body once)."""
    if status is not Status.PENDING or len(messages) < grouped.GROUP_MIN:
        return [rows_of(messages, status, lease_owner, lease_until, now, ring)] if messages else []
    owner = lease_owner if lease_until is not None else None  # as insert_values: both or neither
    if owner is None:
        lease_until = None
    parts: list[Part] = []
    start = 0
    while start < len(messages):
        topic = messages[start].topic
        end = start + 1
        while end < len(messages) and end - start < grouped.GROUP_MAX and messages[end].topic == topic:
            end += 1
        run = messages[start:end]
        if len(run) < grouped.GROUP_MIN:
            parts.append(rows_of(run, status, owner, lease_until, now, ring))
        else:
            body, keys = grouped.encode(run)
            if ring is not None:
                body = sealed.seal_body(body, topic, ring)
            latest = max(m.next_attempt_at for m in run)
            due = latest if lease_until is None else lease_until
            kid = None if ring is None else ring.current
            parts.append(NewGroup(topic, len(run), due, latest, body, keys, owner, kid, run))
        start = end
    return parts


def rows_of(
    messages: Sequence[NewMessage], status: Status, owner: str | None, until: float | None, now: float,
    ring: KeyRing | None,
) -> list[tuple[Any, ...]]:
    """One-message rows' values (`insert_values`), encrypted with `ring` (then the key id last)."""
    if ring is None:
        return [insert_values(m, status, owner, until, now) for m in messages]
    return [sealed.seal_values(insert_values(m, status, owner, until, now), ring) for m in messages]
