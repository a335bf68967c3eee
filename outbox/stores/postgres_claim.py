"""A PostgreSQL claim's rows, kept as the binary cursor read them (`COLUMNS` order).

Why: a drained row was made an `OutboxMessage` and then its re-send built from it, although a
healthy batch needs neither: it is sent and settled by id. `ClaimedRows.resends` reads the
common row's re-send straight from the row, nearly ten times cheaper than those two steps, and
a message is built only when one is read (a batch with failures, a listener).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from outbox.headers import FIRST_ATTEMPT, ID_HEADER, resent_once
from outbox.records import OutboxMessage, Status
from outbox.stores.claimed import LazyClaim, Resend
from outbox.stores.codec import decode_headers, encode_headers

#: A claimed row as selected with `COLUMNS` by a binary cursor (bytea as bytes).
Row = tuple[Any, ...]

# The stored headers of most rows: the `outbox-id` header alone (its name, then the value's length).
_ID_HEAD = (encode_headers([(ID_HEADER, b"")]) or b"")[:-4]
_ID_HEAD_LEN = len(_ID_HEAD)
_PENDING = Status.PENDING
_new_tuple = tuple.__new__


def _id_alone(h: bytes | None) -> bytes | None:
    """The id's value when the stored headers `h` are the `outbox-id` header alone, else None."""
    n = _ID_HEAD_LEN
    if h is not None and h.startswith(_ID_HEAD) and len(h) - n - 4 == int.from_bytes(h[n : n + 4], "big"):
        return h[n + 4 :]
    return None


def message_of(r: Row) -> OutboxMessage:
    """The claimed (PENDING) message of row `r`; headers that are the id header alone are split
    without `decode_headers` (nearly halving a row's cost)."""
    h = r[5]
    raw_id = _id_alone(h)
    hs = [(ID_HEADER, raw_id)] if raw_id is not None else [] if h is None else decode_headers(h)
    return _new_tuple(OutboxMessage, (
        r[0], r[1], r[2], r[3], r[4], hs, r[6], _PENDING, r[8], r[9], r[10], r[11], r[12], r[13],
        r[14], r[15], r[16],
    ))


class ClaimedRows(LazyClaim[OutboxMessage]):
    """The claimed rows in id order; each becomes an `OutboxMessage` only when read."""

    __slots__ = ("_rows",)

    def __init__(self, rows: Sequence[Row]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[OutboxMessage]:
        return map(message_of, self._rows)

    def _read(self, i: int) -> OutboxMessage:
        return message_of(self._rows[i])

    def ids(self) -> list[int]:
        return [r[0] for r in self._rows]

    def resends(self, resend: Callable[[OutboxMessage], Resend]) -> Iterator[Resend]:
        """The common row (the id header alone, never failed) gives its re-send here, as
        `outbox.drain.sendloop.resend_headers` would; any other row through `resend`."""
        head, n, name, first_attempt = _ID_HEAD, _ID_HEAD_LEN, ID_HEADER, FIRST_ATTEMPT
        for r in self._rows:
            h = r[5]
            # attempts 0 and first_failed_at NULL: never failed (a spill's "not sent" is no failure)
            if (
                h is not None and not r[8] and r[10] is None and h.startswith(head)
                and len(h) - n - 4 == int.from_bytes(h[n : n + 4], "big")
            ):
                id_header = (name, h[n + 4 :])
                error = r[13]
                headers = resent_once(id_header, error) if error else [id_header, first_attempt]
                yield r[2], r[4], r[3], r[6], r[16], headers
            else:
                yield resend(message_of(r))
