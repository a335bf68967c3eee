"""Key rotation of an encrypted store: every row sealed with the newest key, online.

One loop for both backends (`RotatingStore.rotate_keys`); each backend reads a page of rows and
writes their new payloads. The loop decrypts and encrypts between transactions, never inside
one: a transaction only writes bytes already sealed, so a producer's writer in another process
waits for at most one short write. Without that, a rotation of a million one-message rows held
SQLite's write lock almost without a break, and a producer spilling to the same file stalled
for seconds in SQLite's busy handler.

A row is rewritten only if it still holds the sealed bytes the rotation read (optimistic, per
row): one changed meanwhile (edited, redriven, split by a drain) is left as it is now, and the
next rotation takes it. Sealed bytes carry a random nonce, so "the same bytes" means "not
rewritten since".
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from typing import NamedTuple

from outbox.errors import ConfigError
from outbox.stores import sealed
from outbox.stores.base import Rotation
from outbox.stores.encryption import KeyRing


class StoredPayload(NamedTuple):
    """A row's sealed payload as stored: value and headers (a one-message row) or body (a group
    row of `n` messages), the id of the key that sealed them (None: in clear)."""

    id: int
    msg_id: str | None
    topic: str
    n: int
    kid: str | None
    value: bytes | None
    headers: bytes | None
    body: bytes | None


class Resealed(NamedTuple):
    """A row's payload under the newest key, and the stored one it replaces."""

    old: StoredPayload
    value: bytes | None
    headers: bytes | None
    body: bytes | None


def reseal(row: StoredPayload, ring: KeyRing) -> Resealed:
    """`row`'s payload opened with the key that sealed it and sealed with `ring`'s newest key."""
    if row.body is not None:
        plain = sealed.open_body(row.body, row.kid, row.topic, ring, row.id, row.n)
        return Resealed(row, None, None, sealed.seal_body(plain, row.topic, ring))
    msg_id = row.msg_id or ""
    value, headers = row.value, row.headers
    if row.kid is not None:
        value, headers = sealed.open_payload(row.kid, row.id, msg_id, value, headers, ring)
    bound = msg_id.encode()
    return Resealed(
        row,
        None if value is None else ring.seal(bytes(value), b"value\0" + bound),
        None if headers is None else ring.seal(bytes(headers), b"headers\0" + bound),
        None,
    )


class RotatingStore(abc.ABC):
    """The rotation of a store that encrypts (`outbox.stores.base.Outbox.rotate_keys`)."""

    encryption: KeyRing | None

    def rotate_keys(self, *, now: float, batch: int = 1000) -> Rotation:
        """As `outbox.stores.base.Outbox.rotate_keys`: every row not sealed with the newest key
        of `encryption`, about `batch` messages a transaction, while producers and drains run."""
        ring = self.encryption
        if ring is None:
            raise ConfigError("no encryption keys given: a rotation needs the new key first, then the old ones")
        done = 0
        after = 0
        while page := self._rotation_page(after, ring.current, batch, now):
            taken: list[StoredPayload] = []
            messages = 0
            for row in page:  # about `batch` messages: a group row whole, and at least one row
                if messages >= batch:
                    break
                taken.append(row)
                messages += row.n
            after = taken[-1].id
            bodies = self._bodies([row.id for row in taken if row.n > 1])
            resealed = [  # a group deleted since the page was read has no body, and nothing to seal
                reseal(row._replace(body=bodies.get(row.id)), ring) for row in taken if row.n == 1 or row.id in bodies
            ]
            started = time.monotonic()
            done += self._write_resealed(resealed, ring.current)
            # Leave the write lock free at least as long as this transaction held it: a writer
            # of another process polls for it (SQLite's busy handler), and would otherwise meet
            # the next transaction almost every time.
            time.sleep(time.monotonic() - started)
        return Rotation(done, self._left_to_rotate(ring.current))

    @abc.abstractmethod
    def _rotation_page(self, after: int, current: str, limit: int, now: float) -> list[StoredPayload]:
        """Up to `limit` rows after id `after`, in id order, not sealed with the key `current`
        and not leased to a sender at `now` (its send may settle it; the next rotation takes the
        rest), group rows without their body. One read, no write lock."""

    @abc.abstractmethod
    def _bodies(self, ids: Sequence[int]) -> dict[int, bytes]:
        """The bodies of these group rows (those that still exist)."""

    @abc.abstractmethod
    def _write_resealed(self, rows: Sequence[Resealed], current: str) -> int:
        """Store the new payloads, sealed with the key `current`, in one transaction, each only
        where its row still holds the old one; return how many messages were rewritten."""

    @abc.abstractmethod
    def _left_to_rotate(self, current: str) -> int:
        """Messages not sealed with the key `current`."""
