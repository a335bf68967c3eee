"""A claim's messages as a store hands them to the drain: read lazily, re-sent without decoding.

Why: the drain sends every message it claims once and settles a healthy batch by id alone, so
for most batches it never needs an `OutboxMessage`. A store whose rows can give the re-send
(`Resend`) and the ids straight from what it read returns a `LazyClaim`: the send loop asks it
for `resends()` and the settlement for `ids()`, and only a batch with failures reads messages.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar, overload

from outbox.records import Headers, OutboxMessage

#: A stored message as a re-send produces it: topic, value, key, partition, record timestamp (ms,
#: 0: now) and the re-send's headers (`outbox.headers.for_resend`). `outbox.drain.sendloop` makes one
#: for each message it sends.
Resend = tuple[str, bytes | None, bytes | None, int, int, Headers]


#: The messages a claim holds: a store's `OutboxMessage`, or a bulk reader's row.
M = TypeVar("M")


class LazyClaim(Sequence[M], abc.ABC, Generic[M]):
    """Claimed messages in id order that a store decodes only when they are read."""

    __slots__ = ()

    @abc.abstractmethod
    def resends(self, resend: Callable[[M], Resend]) -> Iterable[Resend]:
        """What re-sending the messages produces, in order; `resend` for any message the store
        cannot read a re-send from directly."""

    @abc.abstractmethod
    def _read(self, i: int) -> M:
        """The message at index `i`, 0 <= i < len(self)."""

    @overload
    def __getitem__(self, i: int) -> M: ...
    @overload
    def __getitem__(self, i: slice) -> list[M]: ...
    def __getitem__(self, i: int | slice) -> M | list[M]:
        n = len(self)
        if isinstance(i, slice):
            return [self._read(j) for j in range(*i.indices(n))]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("claimed message index out of range")
        return self._read(i)

    @abc.abstractmethod
    def ids(self) -> list[int]:
        """The messages' ids, in order, without decoding them."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a sequence compared by its items, like a list

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"


def ids_of(rows: Sequence[OutboxMessage]) -> list[int]:
    """The ids of claimed messages (a `LazyClaim`'s without decoding them)."""
    if isinstance(rows, LazyClaim):
        claim: LazyClaim[Any] = rows
        return claim.ids()
    return [r.id for r in rows]
