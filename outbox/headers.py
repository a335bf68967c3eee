"""Names and values of the headers kafka-outbox adds to a message (one prefix, UTF-8 names)."""

from __future__ import annotations

import operator
import os
from collections.abc import Callable
from typing import Any

from outbox.records import Headers
from outbox.tally import Tally

ID_HEADER = "outbox-id"  # stable unique id, set at produce(): consumers dedup on it
ATTEMPT_HEADER = "outbox-attempt"  # 1-based number of this send, on re-sends from the outbox
FIRST_FAILED_HEADER = "outbox-first-failed-at"  # epoch milliseconds, on re-sends
LAST_ERROR_HEADER = "outbox-last-error"  # "NAME (code): reason" of the previous failure
_RETRY_HEADERS = frozenset((ATTEMPT_HEADER, FIRST_FAILED_HEADER, LAST_ERROR_HEADER))


class HookedHeaders(list[tuple[str, Any]]):
    """Headers a produce hook passes on (`ResilientProducer.hook_produce`): produce() sends the
    message itself instead of calling the hook again."""

    __slots__ = ()


class CheckedHeaders(list[tuple[str, bytes | None]]):
    """Headers the library built itself, already as produce() keeps them: (str, bytes | None)
    pairs. produce() takes such a list as it is, without checking each pair again (a consumer's
    hop copies a consumed message's headers, which librdkafka gave as such pairs), and may append
    to it."""

    __slots__ = ()


class IdGenerator:
    """Unique message ids: a random 64-bit prefix per generator plus a counter, 32 hex digits.

    uuid4() costs a getrandom() system call per message (a heavy cost on the happy path:
    docs/DESIGN.md); 64 random bits make a clash between two generators
    negligible. The prefix and the counter are one integer, ``1 << 128 | prefix << 64 | counter``,
    counted by a `Tally` (an itertools.count): `hex()` of it is "0x1" and then the 32 digits, so
    an id is a slice of one hex(), and `next` runs in C from end to end. That makes it atomic
    under the interpreter lock (unique across threads without a lock) and cheap: about a third of
    what ``f"{prefix}{n:016x}"`` cost (a zero-padded format is slow).
    """

    __slots__ = ("_count", "next")

    def __init__(self) -> None:
        self._count = Tally(1 << 128 | int.from_bytes(os.urandom(8), "big") << 64)
        #: The next id (hot paths call this C function directly, without a Python frame).
        self.next: Callable[[], str] = map(_AFTER_0X1, map(hex, self._count)).__next__

    def __call__(self) -> str:
        return self.next()

    @property
    def issued(self) -> int:
        """How many ids were handed out."""
        return self._count.value


_AFTER_0X1: Callable[[str], str] = operator.itemgetter(slice(3, None))


def find(headers: Headers | None, name: str) -> bytes | None:
    """The value of the last header called `name`, or None."""
    if headers:
        for h, v in reversed(headers):
            if h == name:
                return v
    return None


def for_resend(
    headers: Headers | None, *, msg_id: str, attempt: int, first_failed_at: float | None, last_error: str | None
) -> Headers:
    """Stored headers plus the retry metadata for a re-send from the outbox.

    The application's headers keep their order; earlier retry metadata is replaced, not repeated;
    an `outbox-id` is added if the stored headers lack one (rows enqueued without the id header).
    """
    if headers and len(headers) == 1 and headers[0][0] == ID_HEADER:
        out: Headers = [headers[0]]  # what the producer stores: the id header alone
    else:
        out = []
        has_id = False
        for h, v in headers or ():
            if h in _RETRY_HEADERS:
                continue
            if h == ID_HEADER:
                has_id = True
            out.append((h, v))
        if msg_id and not has_id:
            out.append((ID_HEADER, msg_id.encode()))
    out.append(_ATTEMPTS[attempt] if attempt < len(_ATTEMPTS) else (ATTEMPT_HEADER, str(attempt).encode()))
    if first_failed_at is not None:
        out.append((FIRST_FAILED_HEADER, str(int(first_failed_at * 1000)).encode()))
    if last_error:
        out.append(_ERRORS.get(last_error) or _error_header(last_error))
    return out


def id_alone(headers: Headers | None, raw_id: bytes) -> bool:
    """Are `headers` the `outbox-id` header alone, its value `raw_id`? What the producer stores
    for a message sent without headers of its own: the stores and the drain process carry such
    headers as a flag, not as bytes."""
    return headers is not None and len(headers) == 1 and headers[0][0] == ID_HEADER and headers[0][1] == raw_id


def resent_once(id_header: tuple[str, bytes | None], last_error: str | None) -> Headers:
    """`for_resend` of a message stored with the id header alone that never failed (its
    `last_error` says why it was not sent, if it says anything): the drain's common row."""
    if last_error:
        return [id_header, FIRST_ATTEMPT, _ERRORS.get(last_error) or _error_header(last_error)]
    return [id_header, FIRST_ATTEMPT]


def _error_header(last_error: str) -> tuple[str, bytes]:
    # Cut at 512 bytes on a character boundary, so consumers can decode the value as UTF-8.
    raw = last_error.encode("utf-8", "replace")[:512].decode("utf-8", "ignore").encode("utf-8")
    pair = (LAST_ERROR_HEADER, raw)
    if len(_ERRORS) < 1000:  # a drain re-sends many rows with the same few error texts
        _ERRORS[last_error] = pair
    return pair


_ATTEMPTS = [(ATTEMPT_HEADER, str(i).encode()) for i in range(100)]
#: The `outbox-attempt` header of a first re-send, one tuple shared by every message that carries it.
FIRST_ATTEMPT = _ATTEMPTS[1]
_ERRORS: dict[str, tuple[str, bytes]] = {}
