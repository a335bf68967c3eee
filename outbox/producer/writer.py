"""Group commit: one writer thread turns many small store writes into few transactions.

Callers append to an in-memory list and return (durability "batch") or wait for the commit
("sync"). The writer swaps the list out, writes everything in one transaction, then hands the
committed batch to its owner (`CommitHandoff`: the producer sends write-ahead rows, wakes the
drain, reports dead letters) and tells observers (the `committed` event, `outbox.events`). One
fsync then covers hundreds of messages (batched, about thirty times the rows/s of one per
transaction: docs/DESIGN.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from outbox.budget import DEFAULT_MEMORY_BUDGET, MemoryBudget
from outbox.drain.settle import Decision, add_to
from outbox.errors import StoreError
from outbox.events import Committed, Listener
from outbox.latency import LatencyHistogram
from outbox.lockorder import new_condition, new_lock
from outbox.message import message_cost
from outbox.records import NewMessage, OutboxMessage
from outbox.stores.base import Outbox, Settlement

log = logging.getLogger(__name__)


class CommitHandoff(Protocol):
    """Who takes each committed batch on, on the writer thread, before the batch counts as done."""

    def committed(self, batch: Committed) -> None: ...


@dataclass
class Batch:
    """What one transaction writes, and who waits for it."""

    new: list[NewMessage] = field(default_factory=list)
    new_meta: list[Any] = field(default_factory=list)  # caller's tag per new row (same order)
    leased: list[bool] = field(default_factory=list)  # per new row: born leased to us?
    dead: list[NewMessage] = field(default_factory=list)
    dead_meta: list[Any] = field(default_factory=list)
    settled: Settlement = field(default_factory=Settlement)  # decisions about sent rows
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    bytes: int = 0  # what its new rows and dead letters cost in memory (outbox.budget)

    def size(self) -> int:
        st = self.settled
        return len(self.new) + len(self.dead) + len(st.delivered) + len(st.failures) + len(st.released)


class GroupCommitWriter:
    """A thread that commits queued store writes in batches.

    Args:
        store: the outbox.
        owner: lease owner for rows born leased (write-ahead mode sends them itself).
        lease_seconds: lease length for rows born leased.
        max_delay: how long the writer waits for more work after the first item before it
            commits (the "batch" durability window's floor; the commit itself adds its fsync).
        max_batch: commit at once when this many items are queued.
        budget: the producer's memory budget (`outbox.budget`), shared with its other parts:
            callers that pass `wait=True` block while it is full, so a long outage keeps memory
            flat instead of queueing in RAM; and a quarter of it queued starts a commit at once.
            None: a budget of its own, `DEFAULT_MEMORY_BUDGET`.
        events: observers told each committed batch (`committed`), on the writer thread, after
            its owner took it on: the producer's `outbox.events.Events`, or any object with a
            `committed(batch)` method.

    Nothing is committed before `start`, which is given the batches' owner.
    """

    def __init__(
        self,
        store: Outbox,
        *,
        owner: str,
        lease_seconds: float,
        max_delay: float = 0.002,
        max_batch: int = 5000,
        budget: MemoryBudget | None = None,
        events: Listener | None = None,
    ) -> None:
        self.store = store
        self.owner = owner
        self.lease_seconds = lease_seconds
        self.max_delay = max_delay
        self.max_batch = max_batch
        self.budget = MemoryBudget(DEFAULT_MEMORY_BUDGET) if budget is None else budget
        # Commit without waiting for `max_delay` once this much is queued: while the previous
        # commit runs, the next batch fills the rest of the budget.
        self.max_batch_bytes = max(1, self.budget.admit // 4)
        #: Bytes of the rows queued or being committed (under `_lock`; `outbox.budget`).
        self.held_bytes = 0
        self._events = events
        # `with self._lock` is one C call; `with self._cond` is two Python-level calls
        # (Condition.__enter__/__exit__), paid by every produce() in write-ahead mode.
        self._lock = new_lock("writer")
        self._cond = new_condition("writer", self._lock)
        self._batch = Batch()
        self._committing: Batch | None = None
        self._closed = False
        self._failing_since: float | None = None
        self.committed_rows = 0
        self.commit_seconds = LatencyHistogram()  # per commit, not per message: no hot-path cost
        self.budget.add_part(self)
        self._hand_off: CommitHandoff | None = None
        self._thread = threading.Thread(target=self._run, name="outbox-writer", daemon=True)

    def start(self, hand_off: CommitHandoff | None = None) -> None:
        """Start the writer thread, which hands each committed batch to `hand_off` (None: nobody
        takes them on; observers still hear them)."""
        self._hand_off = hand_off
        self._thread.start()

    # -- producers of work (any thread) ------------------------------------------------------

    def add_new(
        self, msg: NewMessage, meta: Any = None, *, leased: bool = False, wait: bool = False, cost: int = 0
    ) -> Batch:
        """Queue a new row. `wait=True` (application threads only) applies backpressure.

        `cost`: the message's `message_cost` if the caller has it already (0: computed here).
        """
        if not cost:
            cost = message_cost(msg)
        if wait:
            self.wait_for_room(cost)
        with self._lock:
            b = self._batch
            b.new.append(msg)
            b.new_meta.append(meta)
            b.leased.append(leased)
            b.bytes += cost
            self.held_bytes += cost
            if len(b.new) == 1 or len(b.new) >= self.max_batch or b.bytes >= self.max_batch_bytes:
                self._cond.notify()
            return b

    def wait_for_room(self, cost: int = 0) -> None:
        """Block while the memory budget has no room for `cost` more bytes (backpressure).

        Only for application threads, never while holding a lock the writer's hooks need. The
        commits make the room; messages held elsewhere (hold-back, gate) move here first.
        """
        budget = self.budget
        if budget.full(cost):  # no lock: the common case is free
            self._wait_while(lambda: budget.full(cost))

    def wait_for_lag(self) -> None:
        """Block while a whole batch (`max_batch` rows, or a commit's bytes) waits to be committed.

        Write-ahead "batch" (application threads only): a crash loses the commit under way and
        the batch behind it, so this bounds the window to two batches (and about two commits'
        time) instead of the whole memory budget a burst could queue.
        """
        if self._full(self._batch):  # no lock: the common case is free
            self._wait_while(lambda: self._full(self._batch))

    def _full(self, batch: Batch) -> bool:
        """Whether `batch` is as large as one commit takes."""
        return len(batch.new) >= self.max_batch or batch.bytes >= self.max_batch_bytes

    def _wait_while(self, blocked: Callable[[], bool]) -> None:
        """Wait, nudging the writer, until `blocked()` is false or the writer closes."""
        with self._cond:
            while blocked() and not self._closed:
                self._cond.notify()
                self._cond.wait(0.05)

    def add_dead(self, msg: NewMessage, meta: Any = None) -> Batch:
        cost = message_cost(msg)
        with self._cond:
            self._batch.dead.append(msg)
            self._batch.dead_meta.append(meta)
            self._batch.bytes += cost
            self.held_bytes += cost
            self._cond.notify()
            return self._batch

    def add_outcomes(self, delivered: Sequence[int], decided: Sequence[tuple[int, Decision, float]]) -> None:
        """Sent rows' outcomes, applied with the next commit in one settlement: the delivered
        ids, and `settle()` decisions (row id, decision, when) about the others."""
        with self._cond:
            settled = self._batch.settled
            was_empty = not settled
            settled.delivered += delivered
            for row_id, decision, now in decided:
                add_to(settled, row_id, decision, now)
            if was_empty:
                self._cond.notify()

    def pending(self) -> int:
        """Messages accepted but not yet committed (they would be lost if the process died now)."""
        with self._cond:
            n = len(self._batch.new) + len(self._batch.dead)
            if self._committing is not None:
                n += len(self._committing.new) + len(self._committing.dead)
            return n

    def flush(self, timeout: float | None = None) -> int:
        """Wait until everything queued so far is committed; return how many messages are not."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target: Batch | None = self._batch
            if self._batch.size() == 0:
                target = self._committing  # None: nothing queued, nothing being written
            self._cond.notify()
        if target is None:
            return self.pending()
        while not target.done.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            target.done.wait(0.05 if left is None else min(0.05, left))
            with self._cond:
                self._cond.notify()
        return self.pending()

    def close(self, timeout: float | None = None) -> int:
        """Commit what is queued and stop the thread; return how many messages were not committed."""
        if self._thread.ident is None:  # never started: nothing was committed, nothing runs
            return self.pending()
        left = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)
        return left

    # -- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._batch.size() == 0 and not self._closed:
                    self._cond.wait()
                if self._closed and self._batch.size() == 0:
                    return
            if self.max_delay:
                # Let a burst accumulate: one commit for the whole burst.
                deadline = time.monotonic() + self.max_delay
                with self._cond:
                    while (
                        self._batch.size() < self.max_batch
                        and self._batch.bytes < self.max_batch_bytes
                        and not self._closed
                    ):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
            with self._cond:
                batch, self._batch = self._batch, Batch()
                self._committing = batch
            self._commit(batch)

    def _commit(self, batch: Batch) -> None:
        delay = 0.05
        started = time.perf_counter()
        leased = [m for m, is_leased in zip(batch.new, batch.leased, strict=True) if is_leased]
        free = [m for m, is_leased in zip(batch.new, batch.leased, strict=True) if not is_leased]
        # Each step below is its own transaction. A step that committed is not repeated when a
        # later one fails: that would store its rows twice or count its failures twice.
        first: tuple[list[int], list[OutboxMessage]] | None = None
        ids_free: list[int] | None = None
        dead_ids: list[int] | None = None
        while True:
            try:
                now = time.time()
                # Usually one transaction: rows born leased (write-ahead, circuit closed) or free rows
                # (fallback spill); a batch mixing both, or holding dead letters, takes one more each.
                if first is None and not (leased or batch.settled):
                    first = ([], [])
                if first is None:
                    done = self.store.apply(
                        batch.settled, now=now, new=leased, lease_owner=self.owner, lease_until=now + self.lease_seconds
                    )
                    first = (done.new_ids, done.dead)
                if ids_free is None:
                    ids_free = self.store.enqueue(free) if free else []
                if dead_ids is None:
                    dead_ids = self.store.add_dead(batch.dead, failed_at=now) if batch.dead else []
                break
            except StoreError as exc:
                # Keep the batch in memory and retry: the messages are not lost while we live,
                # and stats()/flush() report them as not yet safe.
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                log.error("outbox write failed, retrying in %.2fs: %s", delay, exc)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
                if self._closed and time.monotonic() - self._failing_since > 5:
                    batch.error = exc
                    self._forget(batch)
                    batch.done.set()
                    return
        self._failing_since = None
        self.commit_seconds.observe(time.perf_counter() - started)
        ids_leased, dead_failed = first
        it_l, it_f = iter(ids_leased), iter(ids_free)
        new_ids = [next(it_l) if is_leased else next(it_f) for is_leased in batch.leased]
        self.committed_rows += len(new_ids) + len(dead_ids)
        # Handed on before the batch counts as done, so flush()/close() also wait until the
        # committed rows were taken on (sent, or reported as dead letters).
        if self._hand_off is not None or self._events is not None:
            committed = Committed(
                new_ids, batch.new, batch.new_meta, batch.leased, dead_ids, batch.dead, batch.dead_meta, dead_failed
            )
            for taker in (self._hand_off, self._events):
                if taker is None:
                    continue
                try:
                    taker.committed(committed)
                except Exception:
                    log.exception("outbox writer: handing on a committed batch failed; the writer goes on")
        self._forget(batch)
        batch.done.set()

    def _forget(self, batch: Batch) -> None:
        """The batch is committed (or given up at close): its memory is free again."""
        self.budget.sample()  # the most held is reached just before a decrease
        with self._cond:
            self._committing = None
            self.held_bytes -= batch.bytes
            self._cond.notify_all()  # room again for producers held back by the budget
