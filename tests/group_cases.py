"""Messages and settlements the group-row tests of both stores share (`outbox.stores.grouped`)."""

from __future__ import annotations

from collections.abc import Sequence

from outbox.records import NewMessage, OutboxMessage
from outbox.stores import grouped
from outbox.stores.base import Failure

NOW = 1_000_000.0
G = grouped.GROUP_MIN


STAMP = 1_795_634_888_790  # a record timestamp, ms


def batch(n: int, *, topic: str = "t", keys: tuple[bytes | None, ...] = (b"k0", b"k1", b"k2", None), tag: str = "m",
          due: float = 0.0) -> list[NewMessage]:
    return [
        NewMessage(
            topic, b"%s-%d" % (tag.encode(), i), keys[i % len(keys)], [("outbox-id", b"%s-%d" % (tag.encode(), i))],
            i % 3 - 1, f"{tag}-{i}", i % 2, NOW - 5 if i % 2 else None, "_TRANSPORT (-195): down" if i % 2 else None,
            due, -195 if i % 2 else None, "_TRANSPORT" if i % 2 else None, 0 if i % 4 == 3 else STAMP + i,
        )
        for i in range(n)
    ]


def one(key: bytes | None, tag: str) -> list[NewMessage]:
    return [NewMessage("t", tag.encode(), key, [], -1, tag)]


def fail(id: int, retry_at: float | None) -> Failure:
    return Failure(id, "REQUEST_TIMED_OUT (7): slow", retry_at, NOW, 7, "REQUEST_TIMED_OUT")


def ids(rows: Sequence[OutboxMessage]) -> list[int]:
    return [r.id for r in rows]
