"""Several messages in one store row (a *group*, in SQLite and PostgreSQL): the row format, in
one module.

Why: one row per message costs a row inserted, leased and deleted, several times a group's store
CPU, most of it B-tree work per row that no schema tuning removes (docs/DESIGN.md). A writer
batch of `GROUP_MIN` or more messages of one topic is stored as one row instead, and a drained
message then costs its encoding, its decoding and its send.

A group row is never rewritten. Its id `G` is reserved and its messages take the ids
`G + 1 … G + n`, so ids still order every message of the store. A claim leases the row whole; a
settlement that delivers every message deletes it; any other outcome (a failure, a release, a
partial delivery) first *explodes* it into one-message rows with those same ids, and is then
applied to them like to any other row. So per-key order, dead letters and the console see the
same messages and ids as before, and only a healthy drain gets the cheaper path.

Columns of a group row: `topic`, `status` 0, `created_at`, `next_attempt_at` (the latest due
time of its messages, or its lease), `lease_owner`, `n` (messages), `body` (the messages, below)
and `keys` (its distinct keys: `k` and the key in hex, each between NUL bytes, so that a
substring search finds exactly one key and never part of another). `key`, `value` and `headers` are NULL.
(SQLite keeps `body` and `keys` in its `outbox_body` table, PostgreSQL in the row.)

Body, per message: a fixed head (`_HEAD`) then key, value, encoded headers, msg_id, last_error
and error_name, each as long as its head says (-1: None). The head ends with the record
timestamp (ms); bodies written at SQLite's schema version 5 have none, and its migration to
version 6 rewrites them (`upgrade_v5`), with timestamp 0 (PostgreSQL groups came later). A
headers length of -2 stands for "the `outbox-id` header alone, its value the msg_id": what the
producer stores for a message sent without headers of its own, so neither encoded nor decoded
per message.
"""

from __future__ import annotations

import bisect
import itertools
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from outbox.headers import FIRST_ATTEMPT, ID_HEADER, for_resend, resent_once
from outbox.records import Headers, NewMessage, OutboxMessage, Status
from outbox.stores.claimed import LazyClaim, Resend
from outbox.stores.codec import TEXTS, decode_headers, encode_headers, text, utf8

#: A batch (of one topic) this long or longer is stored as groups; shorter ones as single rows.
GROUP_MIN = 16
#: The most messages in one group: a claim takes a group whole, so this bounds its overshoot.
GROUP_MAX = 1000

# key, value, headers, last_error lengths (-1: None); msg_id, error_name lengths (error_name -1:
# None); partition; attempts; error_code; whether there is an error code; first_failed_at (NaN:
# None); next_attempt_at; timestamp (ms, 0: unknown).
_HEAD = struct.Struct(">iiiiHhiiiBddq")
#: `_HEAD` less what a re-send does not need (error code, next_attempt_at): fewer objects made.
_RESEND_HEAD = struct.Struct(">iiiiHhii4xxd8xq")
_HEAD_V5 = struct.Struct(">iiiiHhiiiBdd")  # the head without the timestamp (schema version 5)
_NAN = float("nan")
_ID_ALONE = -2  # headers length: [(ID_HEADER, msg_id)]


def encode(messages: Sequence[NewMessage]) -> tuple[bytes, bytes | None]:
    """(body, keys) of a group holding `messages`, in order."""
    parts: list[bytes] = []
    add = parts.append
    keys: set[bytes] = set()
    pack = _HEAD.pack
    for m in messages:
        k, v, hs = m.key, m.value, m.headers
        i = m.msg_id.encode()
        # `headers.id_alone(hs, i)`, inlined: the call was nearly a tenth of encoding a message.
        if hs and len(hs) == 1 and hs[0][0] == ID_HEADER and hs[0][1] == i:
            h, lh = None, _ID_ALONE
        else:
            h = encode_headers(hs)
            lh = -1 if h is None else len(h)
        error, name = m.last_error, m.error_name
        e = None if error is None else utf8(error)
        n = None if name is None else utf8(name)
        code, first = m.error_code, m.first_failed_at
        add(
            pack(
                -1 if k is None else len(k), -1 if v is None else len(v), lh,
                -1 if e is None else len(e), len(i), -1 if n is None else len(n),
                m.partition, m.attempts, code or 0, code is not None,
                _NAN if first is None else first, m.next_attempt_at, m.timestamp,
            )
        )
        if k:
            add(k)
            keys.add(k)
        elif k is not None:
            keys.add(k)
        if v:
            add(v)
        if h:
            add(h)
        add(i)
        if e:
            add(e)
        if n:
            add(n)
    return b"".join(parts), key_blob(keys)


def decode(body: bytes, group_id: int, topic: str, created_at: float) -> list[OutboxMessage]:
    """The messages of a group, with their ids (`group_id + 1 …`), as a claim returns them."""
    return list(messages_of(body, group_id, topic, created_at))


def messages_of(body: bytes, group_id: int, topic: str, created_at: float) -> Iterator[OutboxMessage]:
    """`decode`, one message at a time: a reader that drops each message before taking the next
    allocates no lasting objects, so the garbage collector does not run for it (`Claimed`)."""
    pos, end, size, unpack = 0, len(body), _HEAD.size, _HEAD.unpack_from
    mid = group_id
    pending = Status.PENDING
    cached = TEXTS.get
    # An OutboxMessage built as the tuple it is: NamedTuple's generated __new__ is a Python
    # call per message (a drain decodes every message it sends).
    new, cls = tuple.__new__, OutboxMessage
    while pos < end:
        lk, lv, lh, le, li, ln, part, attempts, code, has_code, first, due, ts = unpack(body, pos)
        pos += size
        key = value = None
        if lk >= 0:
            key = body[pos : pos + lk]
            pos += lk
        if lv >= 0:
            value = body[pos : pos + lv]
            pos += lv
        if lh >= 0:
            headers = decode_headers(body[pos : pos + lh])
            pos += lh
            raw_id = body[pos : pos + li]
        else:
            raw_id = body[pos : pos + li]
            headers = [(ID_HEADER, raw_id)] if lh == _ID_ALONE else []
        msg_id = raw_id.decode()
        pos += li
        error = name = None
        if le >= 0:
            raw = body[pos : pos + le]
            error = cached(raw) or text(raw)  # the lookup inline: error texts repeat
            pos += le
        if ln >= 0:
            raw = body[pos : pos + ln]
            name = cached(raw) or text(raw)
            pos += ln
        first_failed = None if first != first else first  # NaN: None
        mid += 1
        yield new(cls, (
            mid, msg_id, topic, key, value, headers, part, pending, attempts, created_at, first_failed,
            first_failed if attempts else None, due, error, code if has_code else None, name, ts,
        ))


#: `columns_of`'s headers of a message stored with the `outbox-id` header alone, its value the
#: msg_id (an encoded header list is never empty: no headers at all is None).
ID_ALONE_HEADERS = b""


def columns_of(body: bytes, group_id: int) -> tuple[list[Any], ...]:
    """A group's messages as columns, for a bulk reader that hands them on as arrays (the Spark
    job, `spark_drain.batches`): ids, msg_ids, keys, values, encoded headers (`outbox.stores.codec`;
    `ID_ALONE_HEADERS` for the common message), partitions, attempts, first_failed_at,
    last_error and record timestamps.

    Why: building each message (`messages_of`) only to take it apart into columns, and encoding
    its headers again, cost about half of a Spark executor's CPU per message here.
    """
    cols: tuple[list[Any], ...] = tuple([] for _ in range(10))
    ids, msg_ids, keys, values, headers, parts, attempts, firsts, errors, stamps = cols
    pos, end, size, unpack = 0, len(body), _HEAD.size, _HEAD.unpack_from
    mid = group_id
    cached = TEXTS.get
    while pos < end:
        lk, lv, lh, le, li, ln, part, tries, _, _, first, _, ts = unpack(body, pos)
        pos += size
        mid += 1
        ids.append(mid)
        if lk >= 0:
            keys.append(body[pos : pos + lk])
            pos += lk
        else:
            keys.append(None)
        if lv >= 0:
            values.append(body[pos : pos + lv])
            pos += lv
        else:
            values.append(None)
        if lh >= 0:
            headers.append(body[pos : pos + lh])
            pos += lh
        else:
            headers.append(ID_ALONE_HEADERS if lh == _ID_ALONE else None)
        msg_ids.append(body[pos : pos + li].decode())
        pos += li
        if le >= 0:
            raw = body[pos : pos + le]
            errors.append(cached(raw) or text(raw))
            pos += le
        else:
            errors.append(None)
        if ln >= 0:
            pos += ln  # the error's name: not re-sent
        parts.append(part)
        attempts.append(tries)
        firsts.append(None if first != first else first)  # NaN: None
        stamps.append(ts)
    return cols


def resends_of(body: bytes, topic: str) -> Iterator[Resend]:
    """What re-sending a group's messages produces, in order, read straight from the body.

    Why: the drain sends every message it reads once and settles a healthy batch by id alone, so
    it needs no `OutboxMessage` for it. Building one (`messages_of`, with its msg_id decoded) and
    then its re-send headers from it cost about a quarter of a drained message's CPU. The
    common message (stored with the `outbox-id` header alone, never failed) gets its headers here;
    any other gets `for_resend`'s, as `outbox.drain.sendloop.resend_headers` would give them.
    """
    pos, end, size, unpack = 0, len(body), _RESEND_HEAD.size, _RESEND_HEAD.unpack_from
    id_name, first_attempt = ID_HEADER, FIRST_ATTEMPT
    cached = TEXTS.get
    while pos < end:
        lk, lv, lh, le, li, ln, part, attempts, first, ts = unpack(body, pos)
        pos += size
        key = value = None
        if lk >= 0:
            key = body[pos : pos + lk]
            pos += lk
        if lv >= 0:
            value = body[pos : pos + lv]
            pos += lv
        headers: Headers
        if lh == _ID_ALONE and not attempts and first != first:  # never failed: first_failed_at NaN
            raw_id = body[pos : pos + li]
            pos += li
            if le < 0:
                headers = [(id_name, raw_id), first_attempt]  # `resent_once` inlined: most messages
            else:
                raw = body[pos : pos + le]
                pos += le
                headers = resent_once((id_name, raw_id), cached(raw) or text(raw))
        else:
            if lh >= 0:
                stored = decode_headers(body[pos : pos + lh])
                pos += lh
                raw_id = body[pos : pos + li]
            else:
                raw_id = body[pos : pos + li]
                stored = [(id_name, raw_id)] if lh == _ID_ALONE else []
            pos += li
            error = None
            if le >= 0:
                raw = body[pos : pos + le]
                pos += le
                error = cached(raw) or text(raw)
            headers = for_resend(
                stored, msg_id=raw_id.decode(), attempt=attempts + 1,
                first_failed_at=None if first != first else first, last_error=error,
            )
        if ln >= 0:
            pos += ln  # the error's name: not sent
        yield topic, value, key, part, ts, headers


class Group(NamedTuple):
    """A claimed group row, its messages still encoded."""

    id: int
    n: int
    topic: str
    created_at: float
    body: bytes


class Claimed(LazyClaim[OutboxMessage]):
    """A claim's messages in id order, each group's decoded only as they are read.

    Why: a claim of 10,000 messages held decoded is ~20,000 objects the garbage collector tracks
    (each message and its headers list) for as long as the batch is claimed and in flight; the
    collections they set off took a fifth of a drain's CPU. A drain worker reads each message
    once, to produce it, and drops it: held encoded, a batch is a few bytes objects the
    collector never looks at. Reading by index decodes the group of that index (the last one
    read is kept, so reading in order decodes each group once).
    """

    __slots__ = ("_parts", "_starts", "_len", "_at", "_rows")

    def __init__(self, parts: Sequence[OutboxMessage | Group]) -> None:
        self._parts = parts
        starts: list[int] = []
        count = 0
        for p in parts:
            starts.append(count)
            count += p.n if type(p) is Group else 1
        self._starts = starts
        self._len = count
        self._at = -1  # the part whose messages `_rows` holds
        self._rows: list[OutboxMessage] = []

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[OutboxMessage]:
        for p in self._parts:
            if type(p) is Group:
                yield from messages_of(p.body, p.id, p.topic, p.created_at)
            else:
                yield p  # type: ignore[misc]  # an OutboxMessage

    def resends(self, resend: Callable[[OutboxMessage], Resend]) -> Iterator[Resend]:
        """What re-sending the messages produces, in order: a group's read from its body
        (`resends_of`, no message decoded), a one-message row's given by `resend`. Chained in C:
        a generator delegating to each group's cost a frame resumption per message."""
        return itertools.chain.from_iterable(
            resends_of(p.body, p.topic) if type(p) is Group else (resend(p),)  # type: ignore[arg-type]
            for p in self._parts
        )

    def _read(self, i: int) -> OutboxMessage:
        at = bisect.bisect_right(self._starts, i) - 1
        p = self._parts[at]
        if type(p) is not Group:
            return p  # type: ignore[return-value]  # an OutboxMessage
        if at != self._at:
            self._rows, self._at = decode(p.body, p.id, p.topic, p.created_at), at
        return self._rows[i - self._starts[at]]

    def ids(self) -> list[int]:
        """The messages' ids, without decoding: a group's are `id + 1 … id + n`."""
        out: list[int] = []
        for p in self._parts:
            if type(p) is Group:
                out += range(p.id + 1, p.id + p.n + 1)
            else:
                out.append(p.id)
        return out


def as_new(m: OutboxMessage) -> NewMessage:
    """A decoded message as the one-message row it becomes when its group is exploded."""
    return NewMessage(
        m.topic, m.value, m.key, m.headers, m.partition, m.msg_id, m.attempts, m.first_failed_at,
        m.last_error, m.next_attempt_at, m.error_code, m.error_name, m.timestamp,
    )


def upgrade_v5(body: bytes) -> bytes:
    """A body written at schema version 5 in today's format: each head gains timestamp 0 (unknown),
    the bytes after it are copied as they are."""
    parts: list[bytes] = []
    add = parts.append
    pos, end, size, unpack, pack = 0, len(body), _HEAD_V5.size, _HEAD_V5.unpack_from, _HEAD.pack
    while pos < end:
        head = unpack(body, pos)
        pos += size
        lk, lv, lh, le, li, ln = head[:6]
        tail = max(lk, 0) + max(lv, 0) + max(lh, 0) + max(le, 0) + li + max(ln, 0)
        if pos + tail > end:
            raise ValueError(f"group body ends inside a message ({end - pos} of {tail} bytes left)")
        add(pack(*head, 0))
        add(body[pos : pos + tail])
        pos += tail
    return b"".join(parts)


def key_entry(key: bytes) -> bytes:
    """One key as a `keys` blob lists it (between its NULs)."""
    return b"k" + key.hex().encode()


def key_token(key: bytes) -> bytes:
    """How one key appears in a `keys` blob: a substring search for it finds exactly this key."""
    return b"\0" + key_entry(key) + b"\0"


def key_blob(keys: Iterable[bytes]) -> bytes | None:
    """The `keys` column of a group holding these keys (None: no keyed message)."""
    entries = [key_entry(k) for k in sorted(keys)]
    return b"\0" + b"\0".join(entries) + b"\0" if entries else None


def key_entries(blob: bytes) -> list[bytes]:
    """The entries of a `keys` blob (`key_entry` of each key), split in C, not decoded."""
    return blob[1:-1].split(b"\0")


def keys_of(blob: bytes | None) -> set[bytes]:
    """The keys of a `keys` blob."""
    return {bytes.fromhex(e[1:].decode()) for e in key_entries(blob)} if blob else set()
