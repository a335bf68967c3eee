"""The row codec's encryption: where a stored row's payload is sealed and opened (`outbox.stores.encryption`).

One place for both: a one-message row's value and headers columns, each sealed on its own, and
a group row's body (`outbox.stores.grouped`), sealed once whole, so that a group of 1,000
messages costs one AES-GCM call. The row names its key's id in its `enc_key` column (NULL: in
clear, what every row written without encryption has). Keys, topics, ids, times, attempts and
error texts stay in clear: the claim's per-key order and the store's indexes read them.

Associated data binds the sealed bytes to where they belong: a value or headers column to its
column name and the message's msg_id, a group body to the word "body" and its topic (its id is
chosen under the write lock, after sealing, which is done before the lock is taken).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outbox.stores.encryption import KeyRing, missing_key

#: Where `insert_values` puts the msg_id, the value and the headers.
_MSG_ID, _VALUE, _HEADERS = 0, 3, 4
#: Where a row selected with its columns and `enc_key` last has them (`outbox.stores.base.COLUMNS`).
ROW_MSG_ID, ROW_VALUE, ROW_HEADERS, ROW_KEY = 1, 4, 5, 17


def seal_values(v: tuple[Any, ...], ring: KeyRing) -> tuple[Any, ...]:
    """An `insert_values` tuple with its value and headers sealed, and the key's id appended."""
    bound = v[_MSG_ID].encode()
    value, headers = v[_VALUE], v[_HEADERS]
    return (
        *v[:_VALUE],
        None if value is None else ring.seal(value, b"value\0" + bound),
        None if headers is None else ring.seal(headers, b"headers\0" + bound),
        *v[_HEADERS + 1 :],
        ring.current,
    )


def open_row(r: Sequence[Any], ring: KeyRing | None) -> Sequence[Any]:
    """A row selected with `enc_key` last, its value and headers opened (the row itself when it
    is in clear).

    Raises:
        DecryptionError: sealed with a key `ring` does not hold, or without any ring.
    """
    kid = r[ROW_KEY]
    if kid is None:
        return r
    value, headers = open_payload(kid, r[0], r[ROW_MSG_ID], r[ROW_VALUE], r[ROW_HEADERS], ring)
    return (*r[:ROW_VALUE], value, headers, *r[ROW_HEADERS + 1 : ROW_KEY], None, *r[ROW_KEY + 1 :])


def open_payload(
    kid: str, id_: int, msg_id: str, value: bytes | None, headers: bytes | None, ring: KeyRing | None
) -> tuple[bytes | None, bytes | None]:
    """A one-message row's (value, headers), sealed with the key `kid`, opened (for a reader
    that holds the columns apart: the Spark job, `spark_drain.batches`).

    Raises:
        DecryptionError: sealed with a key `ring` does not hold, or without any ring.
    """
    what = f"message {id_}"
    if ring is None:
        raise missing_key(kid, what)
    bound = msg_id.encode()
    return (
        None if value is None else ring.open(kid, bytes(value), b"value\0" + bound, what=what),
        None if headers is None else ring.open(kid, bytes(headers), b"headers\0" + bound, what=what),
    )


def seal_payload(
    ring: KeyRing, msg_id: str, value: bytes | None, headers: bytes | None
) -> tuple[bytes | None, bytes | None]:
    """A one-message row's (value, headers) sealed with the newest key of `ring`, as `seal_values`
    seals them (`open_payload` opens them): for a writer that holds the columns apart (the Spark
    job's archive, `spark_drain.archive`)."""
    bound = msg_id.encode()
    return (
        None if value is None else ring.seal(value, b"value\0" + bound),
        None if headers is None else ring.seal(headers, b"headers\0" + bound),
    )


def group_messages(gid: int, n: int | None, topic: str) -> str:
    """How an error names a group's messages: by the ids `outbox dlq list` and `Outbox.messages`
    show (a group row's own id is none of them; its messages follow it), and their topic."""
    first = gid + 1
    if n is None:
        return f"the messages stored with message {first} (topic {topic})"
    return f"message {first} (topic {topic})" if n == 1 else f"messages {first} to {gid + n} (topic {topic})"


def seal_body(body: bytes, topic: str, ring: KeyRing) -> bytes:
    """A group's body sealed whole with the newest key."""
    return ring.seal(body, b"body\0" + topic.encode())


def open_body(
    body: bytes, kid: str | None, topic: str, ring: KeyRing | None, gid: int, n: int | None = None
) -> bytes:
    """A group's body as `outbox.stores.grouped` reads it (itself when `kid` is None: in clear).
    `n`, the group's messages, when the caller knows it: the error names their ids."""
    if kid is None:
        return body
    what = group_messages(gid, n, topic)
    if ring is None:
        raise missing_key(kid, what)
    return ring.open(kid, bytes(body), b"body\0" + topic.encode(), what=what)
