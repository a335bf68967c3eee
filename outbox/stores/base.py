"""The `Outbox` store interface: one contract, one test suite, every backend.

Row life: enqueue → PENDING (maybe leased) → deleted when Kafka acknowledged it, or
→ DEAD (dead letter) → purged, or replayed back to PENDING with attempts reset.

Leases: a claimed row gets `lease_owner` and its `next_attempt_at` is pushed to the lease's
expiry, so "due" (`next_attempt_at <= now`) also means "not leased". A worker that dies leaves
its rows to become due again when the lease expires. Transactions are short: claim in one,
send with no transaction open, acknowledge in another.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from outbox.errors import ConfigError
from outbox.records import AuditEntry, DeadLetterFilter, NewMessage, OutboxMessage, Status, StoreStats
from outbox.stores import sealed
from outbox.stores.backlog import Backlog
from outbox.stores.bulk import BulkRead
from outbox.stores.codec import decode_headers, encode_headers
from outbox.stores.encryption import KeyRing
from outbox.stores.owners import Liveness

#: The row columns every backend selects, in the order `row_from_columns` reads them.
COLUMNS = (
    "id, msg_id, topic, key, value, headers, partition, status, attempts, created_at, "
    "first_failed_at, last_failed_at, next_attempt_at, last_error, error_code, error_name, timestamp"
)

#: The columns `insert_values` fills, in its order (both backends insert exactly these).
INSERT_COLUMNS = (
    "msg_id", "topic", "key", "value", "headers", "partition", "status", "attempts", "created_at",
    "first_failed_at", "last_failed_at", "next_attempt_at", "last_error", "error_code", "error_name",
    "lease_owner", "timestamp",
)


def row_from_columns(r: Sequence[Any]) -> OutboxMessage:
    """An OutboxMessage from a row selected with `COLUMNS`."""
    key, value, headers = r[3], r[4], r[5]
    return OutboxMessage(
        r[0], r[1], r[2],
        None if key is None else bytes(key),
        None if value is None else bytes(value),
        decode_headers(None if headers is None else bytes(headers)),
        r[6], _STATUS[r[7]], r[8], r[9], r[10], r[11], r[12], r[13], r[14], r[15], r[16],
    )


_STATUS = {int(s): s for s in Status}  # a dict lookup instead of the Enum call, per row


def insert_values(
    m: NewMessage, status: Status, lease_owner: str | None, lease_until: float | None, now: float
) -> tuple[Any, ...]:
    """One row's values in `INSERT_COLUMNS` order: the single definition of what each column means.

    * created_at: when the row was written (`now`).
    * first_failed_at: the message's first failed send; a dead letter always has one (`now` if
      the message never failed before, e.g. added straight as dead).
    * last_failed_at: the latest failed send: `now` for a dead letter (it failed just now), the
      first failure for a pending row that failed once, None for a row never sent.
    * next_attempt_at: when it is due; a row born leased is due when its lease ends.
    * error_code / error_name: the librdkafka code and name of `last_error`.
    * timestamp: the record timestamp every send of the row carries (ms; 0: unknown).
    """
    dead = status is Status.DEAD
    first = m.first_failed_at if m.first_failed_at is not None or not dead else now
    if dead:
        last: float | None = now
    else:
        last = m.first_failed_at if m.attempts else None
    due = lease_until if lease_owner is not None and lease_until is not None else m.next_attempt_at
    return (
        m.msg_id, m.topic, m.key, m.value, encode_headers(m.headers), m.partition, int(status), m.attempts,
        now, first, last, due, m.last_error, m.error_code, m.error_name,
        lease_owner if lease_owner is not None and lease_until is not None else None, m.timestamp,
    )


def like_pattern(text: str) -> str:
    """`%text%` for LIKE ... ESCAPE '\\', with LIKE's own wildcards in `text` escaped."""
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def group_header(group: str) -> bytes:
    """The bytes `encode_headers` writes for the header `outbox-group: <group>`, found in the
    stored headers by a substring search (a ResilientConsumer's dead letters carry it, whatever
    the strategy and the topic they are addressed to)."""
    encoded = encode_headers([("outbox-group", group.encode("utf-8"))])
    assert encoded is not None
    return encoded


def dead_letter_where(
    flt: DeadLetterFilter,
    placeholder: str,
    *,
    key_match: str = "key = {p}",
    headers_contain: str = "instr(headers, {p}) > 0",
) -> tuple[str, list[Any]]:
    """The WHERE clause (with the driver's `placeholder`) and arguments of a dead-letter filter.

    `key_match` is how the backend compares the key (PostgreSQL goes through an md5 index); each
    `{p}` in it takes the key once. `headers_contain` is its test for bytes inside the stored
    headers. The status is a literal so that partial indexes on dead rows (`WHERE status = 2`)
    match the query whatever the driver does with parameters.
    """
    p = placeholder
    where: list[str] = [f"status = {int(Status.DEAD)}"]
    args: list[Any] = []
    if flt.ids:
        where.append(f"id IN ({', '.join([p] * len(flt.ids))})")
        args.extend(flt.ids)
    if flt.topic is not None:
        where.append(f"topic = {p}")
        args.append(flt.topic)
    if flt.error is not None:
        # A librdkafka code ("-192") or name ("_MSG_TIMED_OUT"), matched on its own column.
        if flt.error.lstrip("-").isdigit():
            where.append(f"error_code = {p}")
            args.append(int(flt.error))
        else:
            where.append(f"error_name = {p}")
            args.append(flt.error)
    if flt.since is not None:
        where.append(f"last_failed_at >= {p}")
        args.append(flt.since)
    if flt.until is not None:
        where.append(f"last_failed_at < {p}")
        args.append(flt.until)
    if flt.group is not None:
        # The exact encoded header (name length, name, value length, value): no index, the pages
        # walk the dead rows in id order until they are full.
        where.append(headers_contain.format(p=p))
        args.append(group_header(flt.group))
    if flt.key is not None:
        where.append(key_match.format(p=p))
        args.extend([flt.key] * key_match.count("{p}"))
    if flt.text is not None:
        where.append(f"lower(last_error) LIKE lower({p}) ESCAPE '\\'")
        args.append(like_pattern(flt.text))
    if flt.after_id is not None:
        where.append(f"id > {p}")
        args.append(flt.after_id)
    return " AND ".join(where), args


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed send, as the caller decided it under its retry policy.

    Attributes:
        id: row id.
        error: "NAME (code): reason" (stored as `last_error`, for people).
        retry_at: epoch seconds of the next attempt, or None to dead-letter the row.
        failed_at: epoch seconds of this failure.
        code, name: the librdkafka error code and name (stored as `error_code`, `error_name`).
    """

    id: int
    error: str
    retry_at: float | None
    failed_at: float
    code: int
    name: str


@dataclass(frozen=True, slots=True)
class Rewrite:
    """A pending row's message replaced by the one its sender changed it into and did not deliver
    (the Spark job's `--set`, `--to-topic`, `--transform`): what the outbox keeps, and later sends,
    is then the changed message. The row keeps its id, msg_id, key, timestamp and retry state.

    Attributes:
        id: row id.
        msg_id: the row's msg_id: a row that does not hold it is left alone (an encrypted row's
            payload is sealed bound to it).
        topic, value, headers: the changed message.
        partition: its fixed partition; -1: none (a message sent to another topic).
    """

    id: int
    msg_id: str
    topic: str
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    partition: int = -1


@dataclass
class Settlement:
    """The decisions about one batch of sent rows, applied by `Outbox.apply` in one transaction.

    Built by `outbox.drain.settle.Settler` from `settle()` decisions; rows that must be re-sent alone
    are not here (they are sent again before the batch is settled).
    """

    delivered: list[int] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    rewritten: list[Rewrite] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.delivered or self.failures or self.released or self.rewritten)


def stored_payload(
    msg_id: str, value: bytes | None, headers: list[tuple[str, bytes | None]], ring: KeyRing | None
) -> tuple[bytes | None, bytes | None, str | None]:
    """A one-message row's value, headers and enc_key columns for this payload: sealed with the
    newest key of `ring`, bound to `msg_id` (`outbox.stores.sealed`), or in clear without one."""
    encoded = encode_headers(headers)
    if ring is None:
        return value, encoded, None
    return (*sealed.seal_payload(ring, msg_id, value, encoded), ring.current)


@dataclass(frozen=True, slots=True)
class Applied:
    """What `Outbox.apply` did: ids of new rows, delivered rows deleted, rows dead-lettered now."""

    new_ids: list[int]
    deleted: int
    dead: list[OutboxMessage]


#: One-message rows an erasure deletes per transaction (`StoreAdmin.erase_key`).
ERASE_BATCH = 1000


@dataclass(frozen=True, slots=True)
class Erased:
    """How many messages of one key `StoreAdmin.erase_key` deleted (or, in a dry run, would delete).

    Attributes:
        pending: pending messages, those of group rows included.
        dead: dead letters.
        leased: of the pending ones, those leased to a sender when they were deleted (a drain
            worker's batch, a write-ahead producer's own send): that send may be in flight, and
            may still reach Kafka.
    """

    pending: int = 0
    dead: int = 0
    leased: int = 0

    @property
    def total(self) -> int:
        """Every message counted: pending and dead."""
        return self.pending + self.dead

    def __add__(self, other: Erased) -> Erased:
        return Erased(self.pending + other.pending, self.dead + other.dead, self.leased + other.leased)


@dataclass(frozen=True, slots=True)
class Rotation:
    """What a key rotation (`Outbox.rotate_keys`) did, in messages (a group row counts each)."""

    #: Messages now encrypted with the newest key that were not before.
    reencrypted: int
    #: Messages still under another key or in clear: leased to a sender meanwhile (the next
    #: rotation takes them), or written meanwhile by a process without the newest key.
    left: int


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a store can do beyond the contract every store keeps, declared by its class (read
    `store.capabilities`, never probe for methods).

    Attributes:
        transactional_enqueue: `enqueue_in_transaction(conn, messages)` writes rows with the
            caller's own database connection, inside the caller's transaction
            (`produce(..., transaction=conn)`).
        owner_liveness: the store can tell whether a lease owner is alive (`owner_liveness`,
            `release_gone_owners` do something); otherwise leases run until they expire.
        grouped_rows: one stored row may hold several messages (`outbox.stores.grouped`); a bulk
            reader explodes them (`outbox.stores.bulk`).
        bulk_read: `bulk_read()` describes the table to a JDBC reader (the Spark job).
        durable: what is stored survives the process (False: the memory store).
        shared: several processes can use the store at once.
    """

    transactional_enqueue: bool = False
    owner_liveness: bool = False
    grouped_rows: bool = False
    bulk_read: bool = False
    durable: bool = True
    shared: bool = True


class MessageStore(abc.ABC):
    """The hot path of a store: messages in, claims, settlements, and the key queries of the
    producer's per-key order.

    Several processes may use one store at once when its `capabilities.shared` says so (leases
    keep each row with one sender at a time).
    """

    #: Where the store lives, for messages (never with credentials).
    location: str
    #: What this store can do beyond the contract (`Capabilities`); each backend declares its own.
    capabilities: Capabilities = Capabilities()

    @abc.abstractmethod
    def migrate(self) -> None:
        """Create or upgrade the schema (idempotent, versioned)."""

    @abc.abstractmethod
    def enqueue(
        self,
        messages: Sequence[NewMessage],
        *,
        lease_owner: str | None = None,
        lease_until: float | None = None,
    ) -> list[int]:
        """Store new PENDING messages in one transaction; return their row ids in order.

        With `lease_owner`, the rows are born leased until `lease_until` (write-ahead mode:
        the producer sends them itself and only a crash hands them to drainers).
        """

    def enqueue_in_transaction(self, conn: Any, messages: Sequence[NewMessage]) -> list[int]:
        """Write PENDING rows with the caller's own open database connection, inside the caller's
        transaction, and never commit (`produce(..., transaction=conn)`). Only stores whose
        `capabilities.transactional_enqueue` is set can (SQLite, PostgreSQL)."""
        raise ConfigError(f"outbox {self.location} cannot enqueue in the caller's transaction")

    def bulk_read(self) -> BulkRead:
        """How a bulk reader that is not this store (the Spark job's JDBC reads) reads its table
        (`outbox.stores.bulk`). Only stores whose `capabilities.bulk_read` is set can."""
        raise ConfigError(f"outbox {self.location} has no table a bulk reader can read")

    @abc.abstractmethod
    def add_dead(self, messages: Sequence[NewMessage], *, failed_at: float) -> list[int]:
        """Store messages straight into the dead-letter state (never pending)."""

    @abc.abstractmethod
    def claim(
        self, owner: str, limit: int, lease_seconds: float, *, now: float, topic: str | None = None,
        in_flight: Collection[int] = (),
    ) -> Sequence[OutboxMessage]:
        """Lease up to `limit` due PENDING messages to `owner`, oldest first.

        A SQLite store keeps a batch of messages as one row (`outbox.stores.grouped`), leased
        whole: a claim's first group may exceed `limit`, and a claim ends before a group that
        must wait.

        Per-key order: a row is not claimed while an earlier PENDING row of the same topic and key
        is leased or not yet due, so one key's messages leave in id order.

        `in_flight`: ids the caller has claimed and produced on the one producer that will also
        send this claim's rows. They do not hold back later rows of their keys: that producer
        (idempotent, one partition's messages in the order produced) keeps them in order, as it
        keeps the rows of one claim. Without it, a keyed backlog over fewer keys than a batch
        holds left one batch in flight per store, claimed, sent and settled in turn.
        """

    @abc.abstractmethod
    def apply(
        self,
        settlement: Settlement,
        *,
        now: float,
        new: Sequence[NewMessage] = (),
        lease_owner: str | None = None,
        lease_until: float | None = None,
    ) -> Applied:
        """Apply a batch of decisions (and store new rows) in ONE short transaction.

        * `settlement.delivered`: rows Kafka acknowledged are deleted (idempotent; DEAD rows are
          never deleted this way).
        * `settlement.failures`: one failed attempt counted per row; rescheduled at `retry_at`,
          or dead-lettered (`retry_at` None). Rows already deleted or dead are ignored.
        * `settlement.released`: leased rows given back, due at `now`, no attempt counted.
        * `settlement.rewritten`: pending rows' topic, value, headers and partition replaced
          (`Rewrite`; sealed with the newest key when the store encrypts), before the failures
          are counted. A group holding one is first exploded into one-message rows. Rows no
          longer pending, or not holding the `Rewrite`'s msg_id, are left alone.
        * `new`: PENDING rows, born leased to `lease_owner` until `lease_until` if given
          (write-ahead mode: the producer sends them itself).

        Returns the new row ids in order, how many delivered rows were deleted, and the rows
        dead-lettered now, in their final state, in id order.
        """

    def mark_delivered(self, ids: Sequence[int]) -> int:
        """Delete rows Kafka acknowledged. Idempotent; returns how many were deleted."""
        if not ids:
            return 0
        return self.apply(Settlement(delivered=list(ids)), now=time.time()).deleted

    def record_failures(self, failures: Sequence[Failure]) -> list[OutboxMessage]:
        """Count one failed attempt per row: reschedule it, or dead-letter it (retry_at None).

        Rows already deleted (delivered by someone else) are ignored. Returns the rows that were
        dead-lettered now, in their final state.
        """
        if not failures:
            return []
        return self.apply(Settlement(failures=list(failures)), now=time.time()).dead

    def release(self, ids: Sequence[int], *, now: float) -> None:
        """Give leased rows back, due now, without counting an attempt (clean stop)."""
        if ids:
            self.apply(Settlement(released=list(ids)), now=now)

    def commit_batch(
        self,
        new: Sequence[NewMessage],
        delivered: Sequence[int],
        failures: Sequence[Failure],
        *,
        lease_owner: str | None,
        lease_until: float | None,
    ) -> tuple[list[int], list[OutboxMessage]]:
        """enqueue + mark_delivered + record_failures in ONE transaction (group commit).

        Returns (ids of the new rows, rows dead-lettered now).
        """
        if not (new or delivered or failures):
            return [], []
        done = self.apply(
            Settlement(delivered=list(delivered), failures=list(failures)),
            now=time.time(), new=new, lease_owner=lease_owner, lease_until=lease_until,
        )
        return done.new_ids, done.dead

    @abc.abstractmethod
    def has_pending(self, topic: str, key: bytes) -> bool:
        """Whether any PENDING row of this topic and key exists."""

    def keys_with_pending(self, keys: Sequence[tuple[str, bytes]]) -> set[tuple[str, bytes]]:
        """Which of these (topic, key) pairs still have a PENDING row. Backends answer in one query."""
        return {k for k in keys if self.has_pending(*k)}

    @abc.abstractmethod
    def pending_keys(self) -> set[tuple[str, bytes]]:
        """Every (topic, key) with a PENDING row: one pass over the pending rows (a producer's
        start-up, so that it queues a key's new messages behind what an earlier process left)."""

    @abc.abstractmethod
    def next_due_at(self) -> float | None:
        """Earliest `next_attempt_at` of a PENDING row (None: nothing pending): one indexed
        query, so that idle drain workers sleep exactly until work is due."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections. Idempotent."""

    # -- lease owners (see outbox.stores.owners for the rule) -----------------------------------------

    def release_gone_owners(self, *, now: float) -> int:
        """Give back, due now, the leases of owners known to be gone; return how many rows.

        A backend that cannot tell releases nothing: leases then run until they expire.
        """
        return 0


class StoreAdmin(abc.ABC):
    """Dead-letter administration and reads for people (the CLI, the console): not on the hot
    path, and each call may read much of the store."""

    def owner_liveness(self, owners: Sequence[str]) -> dict[str, Liveness]:
        """Alive, gone or unknown, for each lease owner. A backend that cannot tell: unknown."""
        return {o: Liveness.UNKNOWN for o in owners}

    @abc.abstractmethod
    def get(self, id: int) -> OutboxMessage:
        """One row by id. Raises UnknownMessageError."""

    @abc.abstractmethod
    def list_dead(self, flt: DeadLetterFilter = DeadLetterFilter()) -> list[OutboxMessage]:
        """Dead letters matching the filter, oldest first."""

    @abc.abstractmethod
    def purge_dead(self, flt: DeadLetterFilter = DeadLetterFilter(), *, at_most: int | None = None) -> int:
        """Delete dead letters matching the filter; return how many.

        `at_most`: delete no more than that many (which ones is the store's choice) in one short
        transaction, for a caller that purges in bounded batches: it calls again until fewer
        come back (`outbox.stores.audited.purge_in_batches`). None: every match, in one statement.
        """

    @abc.abstractmethod
    def replay_dead(
        self, flt: DeadLetterFilter = DeadLetterFilter(), *, now: float, to_topic: str | None = None
    ) -> int:
        """Put dead letters back to PENDING, due now, attempts reset; return how many.

        The message bytes are unchanged; `to_topic` sends them to another topic instead.
        """

    @abc.abstractmethod
    def count_dead(self, flt: DeadLetterFilter = DeadLetterFilter()) -> int:
        """How many dead letters match the filter (its `limit` is ignored)."""

    @abc.abstractmethod
    def redrive_edited(
        self, id: int, *, value: bytes | None, headers: list[tuple[str, bytes | None]], now: float
    ) -> bool:
        """Replace one dead letter's value and headers and put it back to PENDING, due now,
        attempts reset, in one statement. False when `id` is not a dead letter (any more)."""

    def erase_key(
        self,
        key: bytes,
        *,
        topic: str | None = None,
        dry_run: bool = False,
        now: float,
        on_batch: Callable[[Erased], None] | None = None,
    ) -> Erased:
        """Delete every pending message and dead letter whose key is `key` (of `topic` only, when
        given); return how many, by state. `dry_run`: count them, delete nothing.

        In short transactions, never one long one: first each group row holding the key (several
        messages in one row, `outbox.stores.grouped`) is exploded into one-message rows without
        the key's messages, one group per transaction, so the other keys' messages keep their
        ids, their leases and their order; then the key's one-message rows go `ERASE_BATCH` at a
        time. `on_batch` hears what each committed transaction deleted, so a caller that
        records the erasure knows what was done if a later transaction fails.

        Rows leased to a sender (`now` is before their lease's end) are deleted too, and counted
        in `leased`: their send may be in flight and reach Kafka, and its outcome then finds no
        row to settle. A message of the key stored while the erasure runs (its producer still
        spilling it) may be left: stop producing the key first, or erase it again. Messages
        already in Kafka, or still in a producer's memory, are out of the store's reach.
        """
        if dry_run:
            return self._key_counts(key, topic, now)
        done = Erased()
        after = 0
        while (found := self._erase_in_group(key, topic, after, now)) is not None:
            after, erased = found
            done += erased
            if on_batch is not None and erased.total:
                on_batch(erased)
        while True:
            erased = self._erase_rows(key, topic, now, ERASE_BATCH)
            done += erased
            if on_batch is not None and erased.total:
                on_batch(erased)
            if erased.total < ERASE_BATCH:
                return done

    @abc.abstractmethod
    def _key_counts(self, key: bytes, topic: str | None, now: float) -> Erased:
        """What `erase_key` would delete now: one read, nothing changed."""

    @abc.abstractmethod
    def _erase_in_group(self, key: bytes, topic: str | None, after: int, now: float) -> tuple[int, Erased] | None:
        """In one transaction, explode the first group row with an id above `after` (of `topic`)
        that holds `key`, leaving out the key's messages: the group's id and what left with it.
        None: no such group. A store without group rows has none."""

    @abc.abstractmethod
    def _erase_rows(self, key: bytes, topic: str | None, now: float, limit: int) -> Erased:
        """In one transaction, delete up to `limit` one-message rows (pending or dead) of `key`
        (of `topic`); what was deleted."""

    @abc.abstractmethod
    def trace(self, msg_id: str) -> list[OutboxMessage]:
        """Every row (pending or dead) carrying this `outbox-id`, in id order: one indexed query."""

    @abc.abstractmethod
    def add_audit(self, *, who: str, action: str, filter: str, count: int, at: float) -> int:
        """Append one entry to the audit log of operator actions; return its id."""

    @abc.abstractmethod
    def audit_log(self, *, limit: int = 100, before_id: int | None = None) -> list[AuditEntry]:
        """The latest audit entries, newest first (ids below `before_id` when given)."""

    @abc.abstractmethod
    def stats(self, *, now: float) -> StoreStats:
        """Counts by state, topic and error; oldest pending; next due time."""

    @abc.abstractmethod
    def backlog(self, *, now: float, topic: str | None = None) -> Backlog:
        """What is left (of one topic, or all) and why: due now, backing off, leased by whom (alive or gone), waiting
        behind which owner's rows, dead-lettered (`outbox.stores.backlog`). One full read of the table:
        for operators and the CLI, not for hot paths."""


class Outbox(MessageStore, StoreAdmin):
    """A store of messages waiting for Kafka, and of dead letters: the contract every backend
    keeps (`SQLiteOutbox`, `PostgresOutbox`, `MemoryOutbox`), tested by one suite.

    Implementations are safe to share between threads of one process; what else a backend can
    do is in its `capabilities`.
    """

    #: The key ring that encrypts stored payloads (`outbox.stores.encryption`); None: stored in clear.
    encryption: KeyRing | None = None

    def set_encryption(self, ring: KeyRing | None) -> None:
        """Encrypt the payloads this store writes with `ring`'s newest key, and read those its
        keys encrypted (`outbox.stores.sealed`); None: write in clear.

        Raises:
            ConfigError: this backend does not encrypt (the SQLite and PostgreSQL stores do).
        """
        if ring is not None:
            raise ConfigError(
                f"{type(self).__name__} does not encrypt stored messages; encryption is available "
                "with a SQLite or PostgreSQL outbox"
            )

    def encrypted_key_ids(self) -> list[str]:
        """The ids of the keys some stored row is encrypted with (none for a store that does not
        encrypt): for a bulk reader (the Spark job) to check, before it reads, that it was given
        each of them."""
        return []

    def rotate_keys(self, *, now: float, batch: int = 1000) -> Rotation:
        """Encrypt every row not under the newest key of `encryption` with it (rows under older
        keys, and rows in clear), about `batch` messages a transaction (a group row whole, and at
        least one row), while producers and drains run. A row leased to a sender is skipped.

        Raises:
            ConfigError: this backend does not encrypt, or no key ring is set.
        """
        raise ConfigError(f"{type(self).__name__} does not encrypt stored messages; there are no keys to rotate")

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
