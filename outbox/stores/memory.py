"""An outbox in this process's memory, for users' unit tests (`memory://`).

Keeps the whole `Outbox` contract (the suite in tests/integration/test_store_contract.py runs on
it as on SQLite and PostgreSQL): ids in insertion order, leases, the per-key order rule
(`outbox.stores.keyrule`), retries and dead letters, dead-letter filters, audit log, stats and
backlog. Column meanings come from `outbox.stores.base.insert_values`, as for the SQL stores.

What it does not do: it is not durable (the messages die with the process, or with the last
reference to the store), and it is not shared (another process, e.g. `drain_in="process"` or
the `outbox` command, sees an empty store of its own).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Sequence

from outbox.errors import UnknownMessageError
from outbox.records import AuditEntry, DeadLetterFilter, Headers, NewMessage, OutboxMessage, Status, StoreStats
from outbox.stores import keyrule
from outbox.stores.backlog import (
    BACKING_OFF,
    DEAD,
    DUE,
    LEASED,
    WAITING_BACKOFF,
    WAITING_LEASE,
    Backlog,
    backlog_from_rows,
)
from outbox.stores.base import (
    Applied,
    Capabilities,
    Erased,
    Failure,
    Outbox,
    Settlement,
    group_header,
    insert_values,
    row_from_columns,
)
from outbox.stores.codec import decode_headers, encode_headers

__all__ = ["MemoryOutbox", "open_memory"]

_PENDING, _DEAD = Status.PENDING, Status.DEAD
_NAMED: dict[str, MemoryOutbox] = {}
_NAMED_LOCK = threading.Lock()


def open_memory(name: str = "") -> MemoryOutbox:
    """The memory outbox of `memory://NAME`: one store per name in this process, so that a test can
    open the store its producer uses (`open_outbox("memory://orders")`). No name: a new store."""
    if not name:
        return MemoryOutbox()
    with _NAMED_LOCK:
        store = _NAMED.get(name)
        if store is None:
            store = _NAMED[name] = MemoryOutbox(name=name)
        return store


def forget_memory(name: str) -> None:
    """Drop the named memory outbox (its messages go with it); the next open gets an empty one."""
    with _NAMED_LOCK:
        _NAMED.pop(name, None)


def _same_headers(headers: Headers | None) -> Headers:
    """Headers as a stored row returns them (the SQL stores' encoding, round-tripped)."""
    return decode_headers(encode_headers(headers))


def _matches(flt: DeadLetterFilter, m: OutboxMessage) -> bool:
    """Whether a dead letter matches the filter (`base.dead_letter_where`, in Python)."""
    if m.status is not _DEAD:
        return False
    if flt.ids and m.id not in flt.ids:
        return False
    if flt.topic is not None and m.topic != flt.topic:
        return False
    if flt.error is not None:
        if flt.error.lstrip("-").isdigit():
            if m.error_code != int(flt.error):
                return False
        elif m.error_name != flt.error:
            return False
    failed = m.last_failed_at
    if flt.since is not None and (failed is None or failed < flt.since):
        return False
    if flt.until is not None and (failed is None or failed >= flt.until):
        return False
    if flt.group is not None and group_header(flt.group) not in (encode_headers(m.headers) or b""):
        return False
    if flt.key is not None and m.key != flt.key:
        return False
    if flt.text is not None and (m.last_error is None or flt.text.lower() not in m.last_error.lower()):
        return False
    return flt.after_id is None or m.id > flt.after_id


class MemoryOutbox(Outbox):
    """An outbox held in this process's memory: for unit tests, never for production.

    NOT DURABLE: a process exit (or a crash) loses every message in it, pending and dead. Not
    shared: other processes cannot see it. Thread-safe: one lock guards every call, so threads of
    the process (the producer's writer, its drain workers, the test) may share it. `close()` keeps
    the messages, so a test can read them after the producer that used it has closed.

    Open one with `MemoryOutbox()`, or by URL: `memory://` (a new store) or `memory://NAME` (the
    store of that name in this process, see `open_memory`).

    Args:
        name: what `location` shows (`memory://NAME`).
    """

    capabilities = Capabilities(durable=False, shared=False)

    def __init__(self, *, name: str = "") -> None:
        self.location = f"memory://{name}"
        self._lock = threading.RLock()
        self._rows: dict[int, OutboxMessage] = {}  # in id order: ids only grow, rows keep theirs
        self._owners: dict[int, str] = {}  # id -> lease owner of a leased row
        self._ids = itertools.count(1)
        self._audit: list[AuditEntry] = []

    # -- inspection, for tests -------------------------------------------------------------------

    def messages(self) -> list[OutboxMessage]:
        """Every message in the store, pending and dead, in id order."""
        with self._lock:
            return list(self._rows.values())

    def pending(self, topic: str | None = None) -> list[OutboxMessage]:
        """The PENDING messages (of one topic, or all), in id order."""
        with self._lock:
            return [m for m in self._rows.values() if m.status is _PENDING and topic in (None, m.topic)]

    # -- the hot path ----------------------------------------------------------------------------

    def migrate(self) -> None:
        """Nothing to create: the store has no schema."""

    def _insert(
        self, messages: Sequence[NewMessage], status: Status, owner: str | None, until: float | None, now: float
    ) -> list[int]:
        ids: list[int] = []
        for m in messages:
            v = insert_values(m, status, owner, until, now)  # the SQL stores' column meanings
            id_ = next(self._ids)
            self._rows[id_] = row_from_columns((id_, *v[:15], v[16]))
            if v[15] is not None:
                self._owners[id_] = v[15]
            ids.append(id_)
        return ids

    def enqueue(
        self, messages: Sequence[NewMessage], *, lease_owner: str | None = None, lease_until: float | None = None
    ) -> list[int]:
        with self._lock:
            return self._insert(messages, _PENDING, lease_owner, lease_until, time.time())

    def add_dead(self, messages: Sequence[NewMessage], *, failed_at: float) -> list[int]:
        with self._lock:
            return self._insert(messages, _DEAD, None, None, failed_at)

    def claim(
        self, owner: str, limit: int, lease_seconds: float, *, now: float, topic: str | None = None,
        in_flight: Collection[int] = (),
    ) -> list[OutboxMessage]:
        with self._lock:
            chosen: list[OutboxMessage] = []
            for m in self._rows.values():
                if len(chosen) >= limit:
                    break
                if m.status is _PENDING and m.next_attempt_at <= now and topic in (None, m.topic):
                    chosen.append(m)
            if not chosen:
                return []
            last = chosen[-1].id
            flying = set(in_flight)
            blockers = keyrule.first_blockers(
                (m.topic, m.key, m.id) for m in self._held(now) if m.id < last and m.id not in flying
            )
            chosen = [m for m in chosen if not keyrule.waits(m.topic, m.key, m.id, blockers)]
            for m in chosen:
                self._rows[m.id] = m._replace(next_attempt_at=now + lease_seconds)
                self._owners[m.id] = owner
            return chosen

    def _held(self, now: float) -> Iterator[OutboxMessage]:
        """PENDING rows not due now (leased or backing off): what holds their keys back."""
        return (m for m in self._rows.values() if m.status is _PENDING and m.next_attempt_at > now)

    def apply(
        self,
        settlement: Settlement,
        *,
        now: float,
        new: Sequence[NewMessage] = (),
        lease_owner: str | None = None,
        lease_until: float | None = None,
    ) -> Applied:
        with self._lock:
            ids = self._insert(new, _PENDING, lease_owner, lease_until, now)
            deleted = 0
            for i in settlement.delivered:
                m = self._rows.get(i)
                if m is not None and m.status is _PENDING:
                    del self._rows[i]
                    self._owners.pop(i, None)
                    deleted += 1
            for r in settlement.rewritten:
                m = self._rows.get(r.id)
                if m is not None and m.status is _PENDING and m.msg_id == r.msg_id:
                    self._rows[r.id] = m._replace(
                        topic=r.topic, value=r.value, headers=_same_headers(r.headers), partition=r.partition
                    )
            dead = [d for d in (self._fail(f) for f in settlement.failures) if d is not None]
            for i in settlement.released:
                m = self._rows.get(i)
                if m is not None and m.status is _PENDING:
                    self._rows[i] = m._replace(next_attempt_at=now)
                    self._owners.pop(i, None)
            return Applied(ids, deleted, sorted(dead, key=lambda m: m.id))

    def _fail(self, f: Failure) -> OutboxMessage | None:
        """Count one failed attempt; the row if it was dead-lettered now."""
        m = self._rows.get(f.id)
        if m is None or m.status is not _PENDING:
            return None
        m = m._replace(
            attempts=m.attempts + 1, last_error=f.error, error_code=f.code, error_name=f.name,
            first_failed_at=f.failed_at if m.first_failed_at is None else m.first_failed_at,
            last_failed_at=f.failed_at,
        )
        m = m._replace(next_attempt_at=f.retry_at) if f.retry_at is not None else m._replace(status=_DEAD)
        self._rows[f.id] = m
        self._owners.pop(f.id, None)
        return m if f.retry_at is None else None

    def has_pending(self, topic: str, key: bytes) -> bool:
        with self._lock:
            return any(m.status is _PENDING and m.topic == topic and m.key == key for m in self._rows.values())

    def keys_with_pending(self, keys: Sequence[tuple[str, bytes]]) -> set[tuple[str, bytes]]:
        return self.pending_keys() & set(keys)

    def pending_keys(self) -> set[tuple[str, bytes]]:
        with self._lock:
            return {(m.topic, m.key) for m in self._rows.values() if m.status is _PENDING and m.key is not None}

    def next_due_at(self) -> float | None:
        with self._lock:
            return min((m.next_attempt_at for m in self._rows.values() if m.status is _PENDING), default=None)

    def close(self) -> None:
        """Nothing to release; the messages stay readable (see the class docstring)."""

    # -- administration --------------------------------------------------------------------------

    def get(self, id: int) -> OutboxMessage:
        with self._lock:
            m = self._rows.get(id)
        if m is None:
            raise UnknownMessageError(f"no message with id {id} in outbox {self.location}")
        return m

    def _dead(self, flt: DeadLetterFilter) -> list[OutboxMessage]:
        return [m for m in self._rows.values() if _matches(flt, m)]

    def list_dead(self, flt: DeadLetterFilter = DeadLetterFilter()) -> list[OutboxMessage]:
        with self._lock:
            found = self._dead(flt)
        return found if flt.limit is None else found[: flt.limit]

    def count_dead(self, flt: DeadLetterFilter = DeadLetterFilter()) -> int:
        with self._lock:
            return len(self._dead(flt))

    def purge_dead(self, flt: DeadLetterFilter = DeadLetterFilter(), *, at_most: int | None = None) -> int:
        with self._lock:
            found = self._dead(flt)[:at_most]
            for m in found:
                del self._rows[m.id]
            return len(found)

    def _of_key(self, key: bytes, topic: str | None) -> list[OutboxMessage]:
        return [m for m in self._rows.values() if m.key == key and topic in (None, m.topic)]

    def _counted(self, rows: list[OutboxMessage], now: float) -> Erased:
        pending = [m for m in rows if m.status is _PENDING]
        leased = sum(m.id in self._owners and m.next_attempt_at > now for m in pending)
        return Erased(len(pending), len(rows) - len(pending), leased)

    def _key_counts(self, key: bytes, topic: str | None, now: float) -> Erased:
        with self._lock:
            return self._counted(self._of_key(key, topic), now)

    def _erase_in_group(self, key: bytes, topic: str | None, after: int, now: float) -> tuple[int, Erased] | None:
        return None  # one message per row: no group

    def _erase_rows(self, key: bytes, topic: str | None, now: float, limit: int) -> Erased:
        with self._lock:
            rows = self._of_key(key, topic)[:limit]
            erased = self._counted(rows, now)
            for m in rows:
                del self._rows[m.id]
                self._owners.pop(m.id, None)
            return erased

    def replay_dead(
        self, flt: DeadLetterFilter = DeadLetterFilter(), *, now: float, to_topic: str | None = None
    ) -> int:
        with self._lock:
            found = self._dead(flt)
            for m in found:
                self._rows[m.id] = m._replace(
                    status=_PENDING, attempts=0, next_attempt_at=now, topic=to_topic or m.topic
                )
            return len(found)

    def redrive_edited(
        self, id: int, *, value: bytes | None, headers: list[tuple[str, bytes | None]], now: float
    ) -> bool:
        with self._lock:
            m = self._rows.get(id)
            if m is None or m.status is not _DEAD:
                return False
            self._rows[id] = m._replace(
                value=value, headers=_same_headers(headers), status=_PENDING, attempts=0, next_attempt_at=now
            )
            return True

    def trace(self, msg_id: str) -> list[OutboxMessage]:
        with self._lock:
            return [m for m in self._rows.values() if m.msg_id == msg_id]

    def add_audit(self, *, who: str, action: str, filter: str, count: int, at: float) -> int:
        with self._lock:
            entry = AuditEntry(len(self._audit) + 1, at, who, action, filter, count)
            self._audit.append(entry)
            return entry.id

    def audit_log(self, *, limit: int = 100, before_id: int | None = None) -> list[AuditEntry]:
        with self._lock:
            older = [e for e in self._audit if before_id is None or e.id < before_id]
        return older[::-1][:limit]

    def stats(self, *, now: float) -> StoreStats:
        pending: dict[str, int] = {}
        dead: dict[str, int] = {}
        errors: dict[str, int] = {}
        leased = 0
        oldest: float | None = None
        with self._lock:
            for m in self._rows.values():
                if m.status is _PENDING:
                    pending[m.topic] = pending.get(m.topic, 0) + 1
                    oldest = m.created_at if oldest is None else min(oldest, m.created_at)
                    leased += m.next_attempt_at > now and m.id in self._owners
                else:
                    dead[m.topic] = dead.get(m.topic, 0) + 1
                    name = m.error_name
                    error = "?" if name is None else name if m.error_code is None else f"{name} ({m.error_code})"
                    errors[error] = errors.get(error, 0) + 1
        return StoreStats(
            pending=sum(pending.values()), dead=sum(dead.values()), leased=leased, oldest_pending_at=oldest,
            next_due_at=self.next_due_at(), pending_by_topic=pending, dead_by_topic=dead, dead_by_error=errors,
        )

    def backlog(self, *, now: float, topic: str | None = None) -> Backlog:
        """`outbox.stores.backlog.backlog_sql`'s states, computed in Python."""
        with self._lock:
            rows = list(self._rows.values())
            owners = dict(self._owners)
        heads = keyrule.first_blockers((m.topic, m.key, m.id) for m in rows if m.status is _PENDING
                                       and m.next_attempt_at > now)
        by_id = {m.id: m for m in rows}
        groups: dict[tuple[int, str | None], list[float]] = {}
        counts: dict[tuple[int, str | None], int] = {}
        for m in rows:
            if topic is not None and m.topic != topic:
                continue
            when: float | None = None
            if m.status is _DEAD:
                state, owner = DEAD, None
            elif m.next_attempt_at > now:
                owner = owners.get(m.id)
                state, when = (BACKING_OFF if owner is None else LEASED), m.next_attempt_at
            elif keyrule.waits(m.topic, m.key, m.id, heads):
                assert m.key is not None
                blocker = by_id[heads[(m.topic, m.key)]]
                owner = owners.get(blocker.id)
                state, when = (WAITING_BACKOFF if owner is None else WAITING_LEASE), blocker.next_attempt_at
            else:
                state, owner = DUE, None
            counts[(state, owner)] = counts.get((state, owner), 0) + 1
            times = groups.setdefault((state, owner), [])
            if when is not None:
                times.append(when)
        found: Iterable[tuple[int, str | None, int, float | None, float | None]] = (
            (s, o, n, min(groups[(s, o)], default=None), max(groups[(s, o)], default=None))
            for (s, o), n in counts.items()
        )
        return backlog_from_rows(found, self.owner_liveness)
