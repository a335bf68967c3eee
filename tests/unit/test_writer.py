"""GroupCommitWriter against a real SQLite outbox in tmp_path.

Stores are real `SQLiteOutbox` subclasses that count, gate or fail some of their calls, so the
rows checked at the end are the rows SQLite actually committed.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from outbox.budget import MemoryBudget
from outbox.drain.settle import Decision, Verdict
from outbox.errors import StoreError, UnknownMessageError
from outbox.events import Committed, Listener
from outbox.message import message_cost
from outbox.producer.writer import GroupCommitWriter
from outbox.records import NewMessage, Status
from outbox.stores import SQLiteOutbox
from outbox.stores.base import Applied, Settlement

from ..waiting import wait_until

OWNER = "test-producer"
ERR = "_MSG_TIMED_OUT (-192): Local: Message timed out"
DEAD_ERR = "MSG_SIZE_TOO_LARGE (10): Broker: Message size too large"


class CountingOutbox(SQLiteOutbox):
    """Counts the write transactions the writer opens, and the rows in each."""

    def __init__(self, path: str) -> None:
        self.calls: list[tuple[str, int]] = []
        super().__init__(path, synchronous="NORMAL")

    def apply(
        self,
        settlement: Settlement,
        *,
        now: float,
        new: Sequence[NewMessage] = (),
        lease_owner: str | None = None,
        lease_until: float | None = None,
    ) -> Applied:
        out = super().apply(settlement, now=now, new=new, lease_owner=lease_owner, lease_until=lease_until)
        s = settlement
        self.calls.append(("apply", len(new) + len(s.delivered) + len(s.failures) + len(s.released)))
        return out

    def enqueue(
        self,
        messages: Sequence[NewMessage],
        *,
        lease_owner: str | None = None,
        lease_until: float | None = None,
    ) -> list[int]:
        out = super().enqueue(messages, lease_owner=lease_owner, lease_until=lease_until)
        self.calls.append(("enqueue", len(messages)))
        return out

    def add_dead(self, messages: Sequence[NewMessage], *, failed_at: float) -> list[int]:
        out = super().add_dead(messages, failed_at=failed_at)
        self.calls.append(("add_dead", len(messages)))
        return out


class GatedOutbox(CountingOutbox):
    """enqueue() waits at a gate, so a test can look at the writer while a commit is in progress."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def enqueue(
        self,
        messages: Sequence[NewMessage],
        *,
        lease_owner: str | None = None,
        lease_until: float | None = None,
    ) -> list[int]:
        self.entered.set()
        assert self.gate.wait(30), "test never opened the gate"
        return super().enqueue(messages, lease_owner=lease_owner, lease_until=lease_until)


class FlakyOutbox(CountingOutbox):
    """The first `fail` writes of the named kinds raise StoreError, as a locked or full disk would."""

    def __init__(self, path: str, fail: int, kinds: tuple[str, ...] = ("apply", "enqueue")) -> None:
        super().__init__(path)
        self.left = fail
        self.kinds = kinds
        self.failed = 0

    def _maybe_fail(self, kind: str) -> None:
        if kind in self.kinds and self.left > 0:
            self.left -= 1
            self.failed += 1
            raise StoreError(f"outbox {self.path}: database is locked (simulated)")

    def apply(
        self,
        settlement: Settlement,
        *,
        now: float,
        new: Sequence[NewMessage] = (),
        lease_owner: str | None = None,
        lease_until: float | None = None,
    ) -> Applied:
        self._maybe_fail("apply")
        return super().apply(settlement, now=now, new=new, lease_owner=lease_owner, lease_until=lease_until)

    def enqueue(
        self,
        messages: Sequence[NewMessage],
        *,
        lease_owner: str | None = None,
        lease_until: float | None = None,
    ) -> list[int]:
        self._maybe_fail("enqueue")
        return super().enqueue(messages, lease_owner=lease_owner, lease_until=lease_until)


def msg(i: int, topic: str = "t", key: bytes | None = None) -> NewMessage:
    return NewMessage(topic=topic, value=f"v{i}".encode(), key=key, msg_id=f"id-{i}")


def all_rows(store: SQLiteOutbox) -> list[tuple[str, int]]:
    """(msg_id, status) of every stored message, in id order, via the store's own read path."""
    return [(m.msg_id, int(m.status)) for m in store.messages()]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CountingOutbox]:
    s = CountingOutbox(str(tmp_path / "outbox.db"))
    yield s
    s.close()


class Hook(Listener):
    """`committed` collector."""

    def __init__(self) -> None:
        self.batches: list[Committed] = []

    def committed(self, batch: Committed) -> None:
        self.batches.append(batch)


# -- group commit --------------------------------------------------------------------------------


@pytest.mark.parametrize("leased", [False, True], ids=["free", "leased"])
def test_many_threads_commit_in_few_transactions(store: CountingOutbox, leased: bool) -> None:
    hook = Hook()
    w = GroupCommitWriter(store, owner=OWNER, lease_seconds=60, max_delay=0.02, events=hook)
    w.start()
    per_thread, nthreads = 1000, 4
    start = threading.Barrier(nthreads)

    def add(t: int) -> None:
        start.wait()
        for i in range(per_thread):
            w.add_new(msg(t * per_thread + i), meta=(t, i), leased=leased)

    threads = [threading.Thread(target=add, args=(t,)) for t in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert w.flush() == 0
    assert w.close() == 0
    total = per_thread * nthreads

    rows = all_rows(store)
    assert len(rows) == total
    assert {r[0] for r in rows} == {f"id-{i}" for i in range(total)}
    kind = "apply" if leased else "enqueue"
    assert {k for k, _ in store.calls} == {kind}
    assert sum(n for _, n in store.calls) == total
    # Each transaction waits up to max_delay for more work: thousands of adds become a few
    # transactions (one per 20 ms window at most, however slow the machine).
    assert 1 <= len(store.calls) <= total // 20
    assert w.committed_rows == total

    # Born leased rows belong to the writer's owner; free rows are due for any drainer now.
    claimed = store.claim("drainer", total, 60, now=time.time())
    assert len(claimed) == (0 if leased else total)

    # `committed` saw every row once, each batch's ids ascending, each thread's rows in order.
    new_ids = [i for c in hook.batches for i in c.new_ids]
    metas = [m for c in hook.batches for m in c.new_meta]
    assert len(new_ids) == len(set(new_ids)) == total
    assert new_ids == sorted(new_ids)
    for t in range(nthreads):
        assert [i for th, i in metas if th == t] == list(range(per_thread))
    for c in hook.batches:
        assert c.leased == [leased] * len(c.new)
        assert [m.msg_id for m in c.new] == [f"id-{th * per_thread + i}" for th, i in c.new_meta]


def test_committed_batch_ids_match_the_stored_rows_in_order(store: CountingOutbox) -> None:
    hook = Hook()
    w = GroupCommitWriter(store, owner=OWNER, lease_seconds=60)
    w.start(hook)  # the batches' owner
    for i in range(300):
        w.add_new(msg(i), meta=i, leased=i % 3 == 0)  # a mix: two transactions per batch
    assert w.close() == 0
    ids = [i for c in hook.batches for i in c.new_ids]
    metas = [m for c in hook.batches for m in c.new_meta]
    assert metas == list(range(300))
    assert len(set(ids)) == 300
    for row_id, i in zip(ids, metas, strict=True):
        row = store.get(row_id)
        assert (row.msg_id, row.value) == (f"id-{i}", f"v{i}".encode())


def test_rows_born_leased_carry_the_lease(store: CountingOutbox) -> None:
    w = GroupCommitWriter(store, owner=OWNER, lease_seconds=3600)
    w.start()
    before = time.time()
    w.add_new(msg(1), leased=True)
    w.add_new(msg(2), leased=False)
    assert w.close() == 0
    # The leased row is not due until its lease ends; the free one is due at once.
    assert [m.msg_id for m in store.claim("drainer", 10, 86400, now=before + 1)] == ["id-2"]
    assert [m.msg_id for m in store.claim("drainer", 10, 86400, now=before + 3601 + 60)] == ["id-1"]


# -- deliveries, failures, dead letters ----------------------------------------------------------


def test_delivered_outcomes_delete_rows(store: CountingOutbox) -> None:
    ids = store.enqueue([msg(i) for i in range(4)])
    w = GroupCommitWriter(store, owner=OWNER, lease_seconds=60)
    w.start()
    w.add_outcomes([ids[0]], [])
    w.add_outcomes([ids[2], 999_999], [])  # unknown (delivered by another worker): ignored
    assert w.flush() == 0
    assert w.close() == 0
    for gone in (ids[0], ids[2]):
        with pytest.raises(UnknownMessageError):
            store.get(gone)
    assert [m.msg_id for m in (store.get(ids[1]), store.get(ids[3]))] == ["id-1", "id-3"]
    assert [k for k, _ in store.calls] == ["enqueue", "apply"]


def test_failed_outcomes_reschedule_or_dead_letter(store: CountingOutbox) -> None:
    retry_id, dead_id = store.enqueue([msg(1), msg(2)])
    hook = Hook()
    w = GroupCommitWriter(store, owner=OWNER, lease_seconds=60, events=hook)
    w.start()
    now = 1_700_000_000.0
    w.add_outcomes([], [
        (retry_id, Decision(Verdict.RESCHEDULE, now + 30, -192, "_MSG_TIMED_OUT", ERR, attempts=1), now),
        (dead_id, Decision(Verdict.DEAD_LETTER, None, 10, "MSG_SIZE_TOO_LARGE", DEAD_ERR, attempts=1), now),
    ])
    assert w.close() == 0

    r = store.get(retry_id)
    assert (r.status, r.attempts, r.last_error) == (Status.PENDING, 1, ERR)
    assert (r.first_failed_at, r.last_failed_at, r.next_attempt_at) == (now, now, now + 30)
    d = store.get(dead_id)
    assert (d.status, d.attempts, d.last_error) == (Status.DEAD, 1, DEAD_ERR)
    # The dead-lettered row reaches `committed` (the producer tells it as a `dead` event).
    dead_failed = [row for c in hook.batches for row in c.dead_failed]
    assert [(row.id, row.status) for row in dead_failed] == [(dead_id, Status.DEAD)]


def test_add_dead_stores_dead_letters(store: CountingOutbox) -> None:
    hook = Hook()
    w = GroupCommitWriter(store, owner=OWNER, lease_seconds=60, events=hook)
    w.start()
    w.add_dead(msg(1)._replace(last_error=DEAD_ERR, attempts=1), meta="m1")
    assert w.close() == 0
    (c,) = hook.batches
    assert c.dead_meta == ["m1"] and c.new_ids == []
    (row,) = store.list_dead()
    assert (row.id, row.msg_id, row.status, row.last_error) == (c.dead_ids[0], "id-1", Status.DEAD, DEAD_ERR)


# -- flush, close, pending -----------------------------------------------------------------------


def test_flush_on_idle_writer_returns_zero(store: CountingOutbox) -> None:
    w = GroupCommitWriter(store, owner=OWNER, lease_seconds=60)
    w.start()
    assert w.flush() == 0
    assert w.flush(timeout=0) == 0
    assert w.pending() == 0
    assert store.calls == []  # nothing to write: no empty transaction either
    w.add_new(msg(1))
    assert w.flush() == 0
    assert w.flush() == 0  # idle again after the commit
    assert w.close() == 0
    assert len(store.calls) == 1


def test_close_commits_what_is_queued(store: CountingOutbox) -> None:
    w = GroupCommitWriter(store, owner=OWNER, lease_seconds=60)
    w.start()
    for i in range(500):
        w.add_new(msg(i), leased=bool(i % 2))
    w.add_dead(msg(500))
    assert w.close() == 0
    assert not w._thread.is_alive()
    assert len(all_rows(store)) == 501
    assert w.committed_rows == 501
    assert w.close() == 0  # idempotent


def test_pending_counts_uncommitted_messages(tmp_path: Path) -> None:
    store = GatedOutbox(str(tmp_path / "outbox.db"))
    try:
        w = GroupCommitWriter(store, owner=OWNER, lease_seconds=60, max_delay=0)
        w.start()
        for i in range(5):
            w.add_new(msg(i))
        assert store.entered.wait(30)  # the writer took the batch and is inside its transaction
        # Messages queued behind the running commit count too; deliveries and failures do not
        # (they are not messages that a crash would lose).
        w.add_new(msg(5))
        w.add_new(msg(6))
        w.add_dead(msg(7))
        w.add_outcomes([12345], [])
        assert w.pending() == 5 + 3
        assert w.flush(timeout=0.01) == 8  # timed out: nothing committed yet
        store.gate.set()
        assert w.flush() == 0
        assert w.pending() == 0
        assert w.close() == 0
        assert len(all_rows(store)) == 8
    finally:
        store.gate.set()
        store.close()


# -- store failures ------------------------------------------------------------------------------


@pytest.mark.parametrize("leased", [False, True], ids=["free", "leased"])
def test_failed_commits_are_retried_and_nothing_is_lost(tmp_path: Path, leased: bool) -> None:
    store = FlakyOutbox(str(tmp_path / "outbox.db"), fail=2)
    hook = Hook()
    try:
        w = GroupCommitWriter(store, owner=OWNER, lease_seconds=60, events=hook)
        w.start()
        batch = [w.add_new(msg(i), meta=i, leased=leased) for i in range(200)]
        assert w.flush() == 0
        assert w.close() == 0
        assert store.failed == 2
        assert all(b.done.is_set() and b.error is None for b in batch)
        rows = all_rows(store)
        assert [r[0] for r in rows] == [f"id-{i}" for i in range(200)]  # each once, in order
        assert [m for c in hook.batches for m in c.new_meta] == list(range(200))
    finally:
        store.close()


def test_the_owner_takes_each_batch_before_observers_hear_it_and_before_flush_returns(
    store: CountingOutbox,
) -> None:
    told: list[str] = []

    class Owner:
        def committed(self, batch: Committed) -> None:
            told.append(f"owner {batch.new_ids}")

    class Observer(Listener):
        def committed(self, batch: Committed) -> None:
            told.append(f"observer {batch.new_ids}")

    w = GroupCommitWriter(store, owner=OWNER, lease_seconds=60, events=Observer())
    w.start(Owner())
    w.add_new(msg(1))
    assert w.flush() == 0
    assert told == ["owner [1]", "observer [1]"]
    with pytest.raises(dataclasses.FrozenInstanceError):  # one observer cannot change the next one's
        Committed([], [], [], [], [], [], [], []).new_ids = [2]  # type: ignore[misc]
    assert w.close() == 0


def test_a_writer_never_started_closes_with_what_it_holds(store: CountingOutbox) -> None:
    w = GroupCommitWriter(store, owner=OWNER, lease_seconds=60)
    w.add_new(msg(1))
    assert w.close() == 1
    assert all_rows(store) == []


def test_a_committed_listener_that_fails_does_not_stop_the_writer(store: CountingOutbox) -> None:
    seen: list[int] = []

    class Failing(Listener):
        def committed(self, batch: Committed) -> None:
            seen.extend(batch.new_ids)
            if len(seen) == 1:
                raise RuntimeError("hook bug")

    w = GroupCommitWriter(store, owner=OWNER, lease_seconds=60, events=Failing())
    w.start()
    w.add_new(msg(1))
    assert w.flush() == 0
    w.add_new(msg(2))
    assert w.close() == 0
    assert len(seen) == 2
    assert len(all_rows(store)) == 2



def test_retry_after_a_partial_commit_does_not_write_twice(tmp_path: Path) -> None:
    # One batch holding a born-leased row and a free row takes two transactions: commit_batch,
    # then enqueue. enqueue fails once; the retry must not commit the leased row again.
    store = FlakyOutbox(str(tmp_path / "outbox.db"), fail=1, kinds=("enqueue",))
    try:
        # max_batch=2: the writer commits as soon as both are queued, so they share one batch.
        w = GroupCommitWriter(store, owner=OWNER, lease_seconds=60, max_delay=30, max_batch=2)
        w.start()
        w.add_new(msg(1), leased=True)
        w.add_new(msg(2), leased=False)
        assert w.close() == 0
        assert store.failed == 1
        assert sorted(r[0] for r in all_rows(store)) == ["id-1", "id-2"]
    finally:
        store.close()


def test_retry_after_a_partial_commit_counts_a_failure_once(tmp_path: Path) -> None:
    # During an outage a batch typically holds failures (commit_batch) and spilled new rows
    # (enqueue). If enqueue fails, the retry must not count the failed attempt a second time.
    store = FlakyOutbox(str(tmp_path / "outbox.db"), fail=0, kinds=("enqueue",))
    try:
        (row_id,) = store.enqueue([msg(0)])
        store.left = 1  # fail the writer's enqueue, not the setup's above
        w = GroupCommitWriter(store, owner=OWNER, lease_seconds=60, max_delay=30, max_batch=2)
        w.start()
        retry = Decision(Verdict.RESCHEDULE, 2e9, -192, "_MSG_TIMED_OUT", ERR, attempts=1)
        w.add_outcomes([], [(row_id, retry, 1.7e9)])
        w.add_new(msg(1), leased=False)
        assert w.close() == 0
        assert store.failed == 1
        assert store.get(row_id).attempts == 1
    finally:
        store.close()


# -- the memory budget ---------------------------------------------------------------------------


def test_held_bytes_count_queued_and_committing_rows_until_their_commit(tmp_path: Path) -> None:
    store = GatedOutbox(str(tmp_path / "outbox.db"))
    budget = MemoryBudget(1 << 30)
    try:
        w = GroupCommitWriter(store, owner=OWNER, lease_seconds=60, max_delay=0, budget=budget)
        w.start()
        first = [msg(i) for i in range(3)]
        for m in first:
            w.add_new(m)
        assert store.entered.wait(30)  # the three are being committed
        w.add_new(msg(3))  # queued behind that commit
        w.add_dead(msg(4))
        costs = [message_cost(msg(i)) for i in range(5)]
        assert w.held_bytes == budget.held() == sum(costs)
        store.gate.set()
        assert w.flush() == 0
        assert w.held_bytes == 0 and budget.held() == 0
        assert budget.peak == sum(costs)  # sampled before each commit handed its bytes back
        assert w.close() == 0
    finally:
        store.gate.set()
        store.close()


def test_a_full_budget_makes_application_threads_wait_for_a_commit(tmp_path: Path) -> None:
    store = GatedOutbox(str(tmp_path / "outbox.db"))
    cost = message_cost(msg(0))
    budget = MemoryBudget(3 * cost)  # room for three messages
    try:
        w = GroupCommitWriter(store, owner=OWNER, lease_seconds=60, max_delay=0, budget=budget)
        w.start()
        for i in range(3):
            w.add_new(msg(i), wait=True)
        assert store.entered.wait(30)
        added = threading.Event()

        def app() -> None:
            w.add_new(msg(3), wait=True)
            added.set()

        t = threading.Thread(target=app)
        t.start()
        assert not added.wait(0.3), "add_new(wait=True) must wait while the budget is full"
        w.add_new(msg(4))  # wait=False (the delivery thread) never waits, even past the budget
        assert w.held_bytes == 4 * cost
        store.gate.set()  # the commit frees the room
        assert added.wait(30)
        t.join(30)
        assert w.close() == 0
        assert sorted(r[0] for r in all_rows(store)) == [f"id-{i}" for i in range(5)]
        assert budget.peak <= 5 * cost
    finally:
        store.gate.set()
        store.close()


def test_a_quarter_of_the_budget_queued_is_committed_without_waiting_for_max_delay(store: CountingOutbox) -> None:
    cost = message_cost(msg(0))
    w = GroupCommitWriter(
        store, owner=OWNER, lease_seconds=60, max_delay=600, max_batch=10_000, budget=MemoryBudget(40 * cost)
    )
    w.start()
    assert w.max_batch_bytes == 10 * cost
    for i in range(10):
        w.add_new(msg(i))
    # max_delay is ten minutes and max_batch 10,000: only the bytes can start this commit.
    wait_until(lambda: w.committed_rows == 10, 30, "a commit of the ten queued rows")
    assert w.close() == 0
