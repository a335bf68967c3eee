"""The `Outbox` contract, for any backend: one suite of tests that every store keeps.

A backend (the ones of this package, or one a package adds through the store registry,
`outbox.stores.registry`) runs it against itself by subclassing `StoreContract` in a test module
and giving it a fixture ``make_store``: a factory of fresh, empty stores (each call a new
store, a new file or table), which it closes afterwards::

    import pytest
    from outbox.testing.contract import DurableStoreContract

    class TestMyStore(DurableStoreContract):
        @pytest.fixture
        def make_store(self, tmp_path):
            opened = []
            def factory():
                opened.append(MyOutbox(tmp_path / f"outbox-{len(opened)}"))
                return opened[-1]
            yield factory
            for store in opened:
                store.close()

        def reopen(self, store):
            return MyOutbox(store.path, create=False)

`StoreContract` is what every store keeps (the memory store too); `DurableStoreContract` adds
what a store whose rows outlive the store object keeps: its rows after a reopen (`reopen`),
and, where its `capabilities` say so, bulk reads and encryption at rest, read back with the
store's own SQL (`run_sql`). What a store can do beyond the contract is read from its
`capabilities`: a test of a capability checks the capability's refusal where it is not declared.
Needs pytest and hypothesis (the ``testing`` extra). Nothing is skipped.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from outbox.errors import ConfigError, UnknownMessageError
from outbox.records import DeadLetterFilter, NewMessage, OutboxMessage, Status
from outbox.stores.base import ERASE_BATCH, Erased, Failure, Outbox, Rewrite, Settlement
from outbox.stores.bulk import BulkSelection, explode, explode_keys
from outbox.stores.encryption import Key, KeyRing
from outbox.stores.keyrule import first_blockers, waits

__all__ = ["NOW", "DurableStoreContract", "Factory", "StoreContract", "fail", "msg"]

#: The time every contract test runs at (epoch seconds).
NOW = 1_000_000.0

#: A factory of fresh, empty stores of one backend.
Factory = Callable[[], Outbox]


def msg(topic: str = "t", value: bytes | None = b"v", key: bytes | None = None, **kw: Any) -> NewMessage:
    return NewMessage(topic=topic, value=value, key=key, **kw)


def fail(id: int, retry_at: float | None, error: str = "REQUEST_TIMED_OUT (7): slow", at: float = NOW) -> Failure:
    name, rest = error.split(" (", 1)
    return Failure(id=id, error=error, retry_at=retry_at, failed_at=at, code=int(rest.split(")")[0]), name=name)


def ids(rows: Sequence[OutboxMessage]) -> list[int]:
    return [r.id for r in rows]


_bytes = st.one_of(st.none(), st.binary(max_size=300))
_headers = st.lists(st.tuples(st.text(max_size=8), _bytes), max_size=6)


def _dead_fixture(store: Outbox) -> list[int]:
    got = store.enqueue([msg("a", value=b"1"), msg("b", value=b"2"), msg("a", value=b"3"), msg("a", value=b"4")])
    store.record_failures(
        [
            fail(got[0], None, "MSG_SIZE_TOO_LARGE (10): big", at=100.0),
            fail(got[1], None, "TOPIC_AUTHORIZATION_FAILED (29): no", at=200.0),
            fail(got[2], None, "MSG_SIZE_TOO_LARGE (10): big", at=300.0),
        ]
    )
    return got


STAMP = 1_795_634_888_790  # a record timestamp, ms since the epoch


@dataclasses.dataclass
class Row:
    topic: str
    key: bytes | None
    value: bytes
    status: Status = Status.PENDING
    due: float = 0.0
    owner: str | None = None
    attempts: int = 0


class OutboxMachine(RuleBasedStateMachine):
    """Random operation sequences against a simple model of the outbox's states.

    Checks: no row lost or duplicated, every row in exactly one state, claims return exactly the
    rows the per-key rule allows, and the store's bytes and counters match the model.
    """

    factory: Factory

    def __init__(self) -> None:
        super().__init__()
        self.store = type(self).factory()
        self.model: dict[int, Row] = {}
        self.gone: set[int] = set()
        self.now = NOW
        self.serial = 0

    rows = Bundle("rows")

    @initialize()
    def start(self) -> None:
        assert self.store.stats(now=self.now).pending == 0

    @rule(
        target=rows,
        batch=st.lists(
            st.tuples(st.sampled_from(["t", "u"]), st.sampled_from([None, b"A", b"B"])),
            min_size=1,
            max_size=4,
        ),
        leased=st.booleans(),
    )
    def enqueue(self, batch: list[tuple[str, bytes | None]], leased: bool) -> Any:
        new = []
        for topic, key in batch:
            self.serial += 1
            new.append(msg(topic, key=key, value=f"v{self.serial}".encode(), msg_id=str(self.serial)))
        if leased:
            got = self.store.enqueue(new, lease_owner="writer", lease_until=self.now + 20)
        else:
            got = self.store.enqueue(new)
        assert len(got) == len(new) and got == sorted(got)
        for i, m in zip(got, new, strict=True):
            assert i not in self.model and i not in self.gone
            assert m.value is not None
            row = Row(m.topic, m.key, m.value)
            if leased:
                row.due, row.owner = self.now + 20, "writer"
            self.model[i] = row
        return multiple(*got)

    @rule(dt=st.sampled_from([0.0, 1.0, 5.0, 15.0, 40.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    def _expected_claim(self, limit: int) -> list[int]:
        due = sorted(i for i, r in self.model.items() if r.status == Status.PENDING and r.due <= self.now)
        cand = due[:limit]
        chosen = set(cand)
        out = []
        for i in cand:
            r = self.model[i]
            if r.key is not None and any(
                j < i and j not in chosen and o.status == Status.PENDING and (o.topic, o.key) == (r.topic, r.key)
                for j, o in self.model.items()
            ):
                continue
            out.append(i)
        return out

    @rule(owner=st.sampled_from(["w1", "w2"]), limit=st.integers(1, 6), lease=st.sampled_from([10.0, 30.0]))
    def claim(self, owner: str, limit: int, lease: float) -> None:
        expected = self._expected_claim(limit)
        got = self.store.claim(owner, limit, lease, now=self.now)
        assert ids(got) == expected
        for r in got:
            m = self.model[r.id]
            assert (r.topic, r.key, r.value, r.status) == (m.topic, m.key, m.value, Status.PENDING)
            m.due, m.owner = self.now + lease, owner

    @rule(picked=st.lists(rows, max_size=3, unique=True))
    def deliver(self, picked: list[int]) -> None:
        expected = sum(1 for i in picked if i in self.model and self.model[i].status == Status.PENDING)
        assert self.store.mark_delivered(picked) == expected
        for i in picked:
            if i in self.model and self.model[i].status == Status.PENDING:
                del self.model[i]
                self.gone.add(i)

    @rule(picked=st.lists(st.tuples(rows, st.sampled_from([None, 5.0, 50.0])), max_size=3, unique_by=lambda p: p[0]))
    def fail_some(self, picked: list[tuple[int, float | None]]) -> None:
        failures = [fail(i, None if d is None else self.now + d, at=self.now) for i, d in picked]
        dead = self.store.record_failures(failures)
        expected_dead = []
        for i, d in picked:
            m = self.model.get(i)
            if m is None or m.status != Status.PENDING:
                continue
            m.attempts += 1
            m.owner = None
            if d is None:
                m.status = Status.DEAD
                expected_dead.append(i)
            else:
                m.due = self.now + d
        assert sorted(ids(dead)) == sorted(expected_dead)
        for r in dead:
            assert r.status == Status.DEAD and r.attempts == self.model[r.id].attempts

    @rule(picked=st.lists(rows, max_size=3, unique=True))
    def release(self, picked: list[int]) -> None:
        self.store.release(picked, now=self.now)
        for i in picked:
            m = self.model.get(i)
            if m is not None and m.status == Status.PENDING:
                m.due, m.owner = self.now, None

    @precondition(lambda self: any(r.status == Status.DEAD for r in self.model.values()))
    @rule(all_of_them=st.booleans(), data=st.data())
    def replay(self, all_of_them: bool, data: st.DataObject) -> None:
        dead = sorted(i for i, r in self.model.items() if r.status == Status.DEAD)
        chosen = dead if all_of_them else [data.draw(st.sampled_from(dead))]
        flt = DeadLetterFilter() if all_of_them else DeadLetterFilter(ids=tuple(chosen))
        assert self.store.replay_dead(flt, now=self.now) == len(chosen)
        for i in chosen:
            m = self.model[i]
            m.status, m.attempts, m.due, m.owner = Status.PENDING, 0, self.now, None

    @precondition(lambda self: any(r.status == Status.DEAD for r in self.model.values()))
    @rule(row=consumes(rows))
    def purge(self, row: int) -> None:
        is_dead = row in self.model and self.model[row].status == Status.DEAD
        assert self.store.purge_dead(DeadLetterFilter(ids=(row,))) == int(is_dead)
        if is_dead:
            del self.model[row]
            self.gone.add(row)

    @rule()
    def check_every_row(self) -> None:
        for i, m in self.model.items():
            r = self.store.get(i)
            assert (r.topic, r.key, r.value, r.status, r.attempts) == (
                m.topic,
                m.key,
                m.value,
                m.status,
                m.attempts,
            )
            if m.status == Status.PENDING:
                assert r.next_attempt_at == m.due
        for i in self.gone:
            with pytest.raises(UnknownMessageError):
                self.store.get(i)

    @invariant()
    def counts_match(self) -> None:
        s = self.store.stats(now=self.now)
        pending = [r for r in self.model.values() if r.status == Status.PENDING]
        dead = sorted(i for i, r in self.model.items() if r.status == Status.DEAD)
        # Every row is in exactly one state, and none is lost or duplicated.
        assert s.pending == len(pending) and s.dead == len(dead)
        assert s.pending + s.dead == len(self.model)
        assert s.leased == sum(1 for r in pending if r.owner is not None and r.due > self.now)
        assert ids(self.store.list_dead()) == dead
        assert s.next_due_at == (min(r.due for r in pending) if pending else None)

    def teardown(self) -> None:
        self.check_every_row()
        self.store.close()


def _keyed(n: int, topic: str = "t", keys: int = 3, prefix: str = "m") -> list[NewMessage]:
    return [
        msg(topic, value=b"%s-%d" % (prefix.encode(), i), key=b"k%d" % (i % keys), msg_id=f"{prefix}-{i}")
        for i in range(n)
    ]


class StoreContract:
    """The contract every store keeps: subclass it in a test module (its name beginning with
    ``Test``) and give it a ``make_store`` fixture (see the module doc)."""

    #: Examples of the state machine's random operation sequences (`test_state_machine`).
    state_machine_examples: ClassVar[int] = 30

    @pytest.fixture
    def make_store(self) -> Iterator[Factory]:
        """A factory of fresh, empty stores of the backend under test: a subclass gives its own."""
        raise NotImplementedError(f"{type(self).__name__} must define the fixture make_store")
        yield  # a generator, as a subclass's fixture is

    @pytest.fixture
    def store(self, make_store: Factory) -> Outbox:
        return make_store()

    def messages(self, store: Outbox) -> list[OutboxMessage]:
        """Every message the store holds, pending and dead (the stores of this package have
        `messages()`; a backend without it says how)."""
        every = getattr(store, "messages", None)
        if every is None:
            raise NotImplementedError(
                f"{type(self).__name__} must define messages(store): {type(store).__name__} has none"
            )
        found: list[OutboxMessage] = every()
        return found

    def group_rows(self, store: Outbox) -> int:
        """How many stored rows hold several messages (`capabilities.grouped_rows`; 0 without)."""
        if not store.capabilities.grouped_rows:
            return 0
        raise NotImplementedError(f"{type(self).__name__} must define group_rows(store): the store groups rows")

    def state_machine_factory(self, make_store: Factory) -> Factory:
        """The stores the state machine runs on (each example opens one, and closes it)."""
        return make_store

    # -- enqueue, get, round trip -----------------------------------------------------------------------

    def test_enqueue_returns_increasing_ids_and_get_reads_them_back(self, store: Outbox) -> None:
        new = [msg(value=b"a", key=b"k", msg_id="m1", partition=2), msg(value=None, msg_id="m2")]
        got = store.enqueue(new)
        assert len(got) == 2 and got[0] < got[1]
        a = store.get(got[0])
        assert (a.msg_id, a.topic, a.key, a.value, a.partition) == ("m1", "t", b"k", b"a", 2)
        assert (a.status, a.attempts, a.last_error, a.first_failed_at) == (Status.PENDING, 0, None, None)
        assert store.get(got[1]).value is None and store.get(got[1]).key is None
        assert store.enqueue([]) == []
        more = store.enqueue([msg()])
        assert more[0] > got[1]

    def test_enqueue_keeps_retry_state_given_by_the_producer(self, store: Outbox) -> None:
        [i] = store.enqueue([msg(attempts=2, first_failed_at=5.0, last_error="X (1): y", next_attempt_at=NOW + 9)])
        r = store.get(i)
        assert (r.attempts, r.first_failed_at, r.last_failed_at, r.last_error) == (2, 5.0, 5.0, "X (1): y")
        assert r.next_attempt_at == NOW + 9
        assert store.claim("w", 10, 30, now=NOW) == []
        assert ids(store.claim("w", 10, 30, now=NOW + 9)) == [i]

    def test_get_unknown_id_raises_unknown_message_error(self, store: Outbox) -> None:
        with pytest.raises(UnknownMessageError):
            store.get(424242)
        with pytest.raises(KeyError):  # also a KeyError, for callers that catch that
            store.get(424242)

    def test_headers_round_trip_exactly_with_duplicates_order_and_none(self, store: Outbox) -> None:
        headers = [("b", b"2"), ("a", b"\x00\xff"), ("b", None), ("b", b""), ("ü", b"1")]
        [i] = store.enqueue([msg(key=b"\x00", value=b"", headers=headers)])
        r = store.get(i)
        assert r.headers == headers
        assert r.key == b"\x00" and r.value == b""
        [j] = store.enqueue([msg(headers=[])])
        assert store.get(j).headers == []

    # Each backend's subclass runs it (its own executor); what is drawn does not depend on it.
    @settings(
        max_examples=40,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.differing_executors],
    )
    @given(batch=st.lists(st.tuples(_bytes, _bytes, _headers), min_size=1, max_size=5))
    def test_bytes_round_trip_property(self, store: Outbox, batch: list[tuple[Any, Any, Any]]) -> None:
        new = [msg(key=k, value=v, headers=h) for k, v, h in batch]
        got = store.enqueue(new)
        for i, m in zip(got, new, strict=True):
            r = store.get(i)
            assert (r.key, r.value, r.headers) == (m.key, m.value, m.headers)
            assert type(r.value) is type(m.value) and type(r.key) is type(m.key)

    def test_large_key_and_value(self, store: Outbox) -> None:
        key = os.urandom(10_000)  # bigger than a btree index entry may be
        value = os.urandom(1_000_000)
        [i] = store.enqueue([msg(key=key, value=value)])
        assert store.get(i).key == key and store.get(i).value == value
        assert store.has_pending("t", key)
        assert ids(store.claim("w", 10, 30, now=NOW)) == [i]

    # -- claim, leases ---------------------------------------------------------------------------------

    def test_claim_oldest_first_with_limit_and_lease(self, store: Outbox) -> None:
        got = store.enqueue([msg(value=bytes([n])) for n in range(5)])
        first = store.claim("w1", 2, 30, now=NOW)
        assert ids(first) == got[:2]
        assert ids(store.claim("w2", 10, 30, now=NOW)) == got[2:]
        assert store.claim("w3", 10, 30, now=NOW) == []
        r = store.get(got[0])
        assert r.next_attempt_at == NOW + 30 and r.status == Status.PENDING and r.attempts == 0
        assert store.claim("w1", 0, 30, now=NOW) == []

    def test_lease_expiry_hands_rows_to_another_worker(self, store: Outbox) -> None:
        got = store.enqueue([msg(), msg()])
        assert ids(store.claim("dead-worker", 10, 10, now=NOW)) == got
        assert store.claim("w2", 10, 10, now=NOW + 9.9) == []
        assert store.stats(now=NOW + 5).leased == 2
        assert store.stats(now=NOW + 11).leased == 0
        again = store.claim("w2", 10, 10, now=NOW + 11)
        assert ids(again) == got
        assert store.get(got[0]).attempts == 0  # an expired lease is not a failed attempt

    def test_claim_by_topic(self, store: Outbox) -> None:
        a = store.enqueue([msg("a"), msg("b"), msg("a")])
        assert ids(store.claim("w", 10, 30, now=NOW, topic="a")) == [a[0], a[2]]
        assert ids(store.claim("w", 10, 30, now=NOW, topic="a")) == []
        assert ids(store.claim("w", 10, 30, now=NOW)) == [a[1]]

    def test_born_leased_rows_write_ahead(self, store: Outbox) -> None:
        got = store.enqueue([msg(), msg()], lease_owner="producer-1", lease_until=NOW + 60)
        assert store.claim("drainer", 10, 30, now=NOW) == []
        assert store.stats(now=NOW).leased == 2
        assert ids(store.claim("drainer", 10, 30, now=NOW + 61)) == got

    def test_mark_delivered_is_idempotent_and_ignores_dead_rows(self, store: Outbox) -> None:
        got = store.enqueue([msg(), msg(), msg()])
        [dead] = store.add_dead([msg()], failed_at=NOW)
        assert store.mark_delivered(got[:2]) == 2
        assert store.mark_delivered(got[:2]) == 0
        assert store.mark_delivered([got[2], 999_999, dead]) == 1
        assert store.mark_delivered([]) == 0
        with pytest.raises(UnknownMessageError):
            store.get(got[0])
        assert store.get(dead).status == Status.DEAD

    def test_record_failures_retry_then_dead(self, store: Outbox) -> None:
        [a, b] = store.enqueue([msg(), msg()])
        store.claim("w", 10, 30, now=NOW)
        dead = store.record_failures([fail(a, NOW + 5, at=NOW), fail(b, None, error="MSG_SIZE_TOO_LARGE (10): big")])
        assert ids(dead) == [b]
        assert dead[0].status == Status.DEAD and dead[0].attempts == 1
        assert dead[0].last_error == "MSG_SIZE_TOO_LARGE (10): big" and dead[0].last_failed_at == NOW
        ra = store.get(a)
        assert (ra.attempts, ra.next_attempt_at, ra.first_failed_at, ra.last_failed_at) == (1, NOW + 5, NOW, NOW)
        assert store.claim("w", 10, 30, now=NOW + 4) == []
        assert ids(store.claim("w", 10, 30, now=NOW + 5)) == [a]
        store.record_failures([fail(a, NOW + 20, at=NOW + 6, error="X (1): again")])
        ra = store.get(a)
        assert (ra.attempts, ra.first_failed_at, ra.last_failed_at, ra.last_error) == (
            2,
            NOW,
            NOW + 6,
            "X (1): again",
        )
        dead = store.record_failures([fail(a, None, at=NOW + 30)])
        assert ids(dead) == [a] and dead[0].attempts == 3 and dead[0].first_failed_at == NOW

    def test_record_failures_ignores_rows_delivered_or_dead_already(self, store: Outbox) -> None:
        [a, b] = store.enqueue([msg(), msg()])
        store.mark_delivered([a])
        assert store.record_failures([fail(a, None), fail(a, NOW + 1)]) == []
        assert ids(store.record_failures([fail(b, None)])) == [b]
        # "Returns the rows that were dead-lettered now": a second report does not return it again.
        assert store.record_failures([fail(b, None)]) == []
        assert store.get(b).attempts == 1
        assert store.record_failures([]) == []

    def test_release_gives_rows_back_due_now_without_an_attempt(self, store: Outbox) -> None:
        got = store.enqueue([msg(), msg()])
        store.claim("w", 10, 300, now=NOW)
        store.release(got, now=NOW + 1)
        r = store.get(got[0])
        assert r.next_attempt_at == NOW + 1 and r.attempts == 0
        assert store.stats(now=NOW + 1).leased == 0
        assert ids(store.claim("w2", 10, 30, now=NOW + 1)) == got
        store.release([], now=NOW)

    def test_commit_batch_is_enqueue_deliver_and_fail_together(self, store: Outbox) -> None:
        [a, b, c] = store.enqueue([msg(), msg(), msg()])
        new_ids, dead = store.commit_batch(
            [msg(value=b"n1"), msg(value=b"n2")],
            [a],
            [fail(b, NOW + 10), fail(c, None)],
            lease_owner="p",
            lease_until=NOW + 60,
        )
        assert len(new_ids) == 2 and new_ids[0] > c
        assert ids(dead) == [c]
        with pytest.raises(UnknownMessageError):
            store.get(a)
        assert store.get(b).attempts == 1
        assert store.get(new_ids[1]).value == b"n2" and store.get(new_ids[1]).next_attempt_at == NOW + 60
        assert store.commit_batch([], [], [], lease_owner=None, lease_until=None) == ([], [])

    # -- per-key order ------------------------------------------------------------------------------------

    def test_key_blocked_while_earlier_row_is_leased(self, store: Outbox) -> None:
        [a1, a2, b1] = store.enqueue([msg(key=b"A"), msg(key=b"A"), msg(key=b"B")])
        assert ids(store.claim("w1", 1, 30, now=NOW)) == [a1]
        assert ids(store.claim("w2", 10, 30, now=NOW)) == [b1]  # a2 waits for a1
        assert store.mark_delivered([a1]) == 1
        assert ids(store.claim("w2", 10, 30, now=NOW)) == [a2]

    def test_key_blocked_while_earlier_row_backs_off_and_freed_by_dead_letter(self, store: Outbox) -> None:
        [a1, a2, a3] = store.enqueue([msg(key=b"A"), msg(key=b"A"), msg(key=b"A")])
        assert ids(store.claim("w", 1, 30, now=NOW)) == [a1]
        store.record_failures([fail(a1, NOW + 100)])
        assert store.claim("w", 10, 30, now=NOW + 1) == []
        assert ids(store.claim("w", 1, 30, now=NOW + 100)) == [a1]
        store.record_failures([fail(a1, None)])
        assert ids(store.claim("w", 10, 30, now=NOW + 100)) == [a2, a3]

    def test_key_order_applies_within_one_claim(self, store: Outbox) -> None:
        got = store.enqueue([msg(key=b"K") for _ in range(4)])
        claimed = store.claim("w", 10, 30, now=NOW)
        assert ids(claimed) == got  # one claimer gets the whole run, in id order

    def test_a_claimers_own_rows_in_flight_do_not_hold_back_their_keys(self, store: Outbox) -> None:
        [a1, b1, a2, b2] = store.enqueue([msg(key=b"A"), msg(key=b"B"), msg(key=b"A"), msg(key=b"B")])
        assert ids(store.claim("w1", 1, 30, now=NOW)) == [a1]
        assert ids(store.claim("w2", 1, 30, now=NOW)) == [b1]
        assert store.claim("w1", 10, 30, now=NOW) == []  # a2 waits for a1, b2 for b1
        # w1's producer has a1 in flight and sends a2 after it; b1 is another claimer's.
        assert ids(store.claim("w1", 10, 30, now=NOW, in_flight=[a1])) == [a2]
        assert store.claim("w1", 10, 30, now=NOW, in_flight=[a1, a2]) == []

    def test_none_keys_never_block_and_topics_are_separate(self, store: Outbox) -> None:
        [n1, n2, t1, u1, t2] = store.enqueue(
            [msg(key=None), msg(key=None), msg("t", key=b"K"), msg("u", key=b"K"), msg("t", key=b"K")]
        )
        assert ids(store.claim("w", 1, 30, now=NOW)) == [n1]
        assert ids(store.claim("w", 1, 30, now=NOW)) == [n2]
        assert ids(store.claim("w", 1, 30, now=NOW)) == [t1]
        assert ids(store.claim("w", 10, 30, now=NOW)) == [u1]  # t2 waits for t1; u's K is another key

    def test_has_pending(self, store: Outbox) -> None:
        assert not store.has_pending("t", b"K")
        [a] = store.enqueue([msg(key=b"K")])
        assert store.has_pending("t", b"K")
        assert not store.has_pending("other", b"K") and not store.has_pending("t", b"K2")
        store.claim("w", 10, 30, now=NOW)
        assert store.has_pending("t", b"K")  # leased is still pending
        store.record_failures([fail(a, None)])
        assert not store.has_pending("t", b"K")  # dead is not pending

    # -- dead letters --------------------------------------------------------------------------------

    def test_dead_letter_filters(self, store: Outbox) -> None:
        a1, b2, a3, _pending = _dead_fixture(store)
        assert ids(store.list_dead()) == [a1, b2, a3]
        assert ids(store.list_dead(DeadLetterFilter(topic="a"))) == [a1, a3]
        assert ids(store.list_dead(DeadLetterFilter(error="MSG_SIZE_TOO_LARGE"))) == [a1, a3]
        assert ids(store.list_dead(DeadLetterFilter(error="29"))) == [b2]
        assert ids(store.list_dead(DeadLetterFilter(since=200.0))) == [b2, a3]
        assert ids(store.list_dead(DeadLetterFilter(until=200.0))) == [a1]
        assert ids(store.list_dead(DeadLetterFilter(ids=(a3, b2, 999)))) == [b2, a3]
        assert ids(store.list_dead(DeadLetterFilter(limit=2))) == [a1, b2]
        assert ids(store.list_dead(DeadLetterFilter(topic="a", error="10", since=150.0))) == [a3]
        assert store.list_dead(DeadLetterFilter(topic="none")) == []
        assert ids(store.list_dead(DeadLetterFilter(ids=(_pending,)))) == []  # pending is not dead

    def test_add_dead(self, store: Outbox) -> None:
        [d] = store.add_dead([msg(attempts=3, first_failed_at=5.0, last_error="X (1): y")], failed_at=NOW)
        r = store.get(d)
        assert r.status == Status.DEAD and r.attempts == 3 and r.last_error == "X (1): y"
        assert store.claim("w", 10, 30, now=NOW + 1e6) == []
        assert ids(store.list_dead()) == [d]

    def test_replay_resets_attempts_keeps_bytes_and_can_retarget(self, store: Outbox) -> None:
        headers = [("h", b"\x01"), ("h", None)]
        [a, b] = store.enqueue([msg("a", key=b"k", value=b"\x00v", headers=headers), msg("b")])
        store.record_failures([fail(a, None), fail(b, None)])
        assert store.replay_dead(DeadLetterFilter(ids=(a,)), now=NOW + 5, to_topic="a.retry") == 1
        r = store.get(a)
        assert (r.status, r.attempts, r.topic, r.next_attempt_at) == (Status.PENDING, 0, "a.retry", NOW + 5)
        assert (r.key, r.value, r.headers) == (b"k", b"\x00v", headers)
        assert store.claim("w", 10, 30, now=NOW + 4) == []
        assert ids(store.claim("w", 10, 30, now=NOW + 5)) == [a]
        assert store.replay_dead(now=NOW) == 1
        assert store.get(b).topic == "b"
        assert store.replay_dead(now=NOW) == 0

    def test_the_timestamp_column_keeps_each_messages_record_timestamp_through_every_change(
        self, store: Outbox
    ) -> None:
        """`timestamp`: what every send of the row carries; 0 (unknown) unless given; nothing but the
        insert writes it: a claim, a failure, a dead letter, a replay, an edit or a release keep it."""
        batch = [msg(msg_id=f"g-{i}", key=b"k%d" % (i % 3), timestamp=STAMP + i) for i in range(40)]  # SQLite: a group
        [plain, stamped] = store.enqueue([msg(msg_id="plain"), msg(msg_id="stamped", timestamp=STAMP)])
        group = store.enqueue(batch)
        assert (store.get(plain).timestamp, store.get(stamped).timestamp) == (0, STAMP)
        assert [store.get(i).timestamp for i in group] == [STAMP + i for i in range(40)]
        claimed = store.claim("w", 100, 30, now=NOW)
        assert {r.msg_id: r.timestamp for r in claimed} == {
            "plain": 0,
            "stamped": STAMP,
            **{f"g-{i}": STAMP + i for i in range(40)},
        }
        # Part of the group fails, part is delivered, part dead-lettered: each row keeps its own.
        store.record_failures([fail(group[0], NOW + 1), fail(group[1], None)])
        store.mark_delivered(group[2:20])
        store.release([stamped, *group[20:]], now=NOW)
        assert store.get(group[0]).timestamp == STAMP and store.get(group[1]).status == Status.DEAD
        assert [d.timestamp for d in store.list_dead()] == [STAMP + 1]
        assert store.replay_dead(DeadLetterFilter(ids=(group[1],)), now=NOW, to_topic="elsewhere") == 1
        assert store.get(group[1]).timestamp == STAMP + 1
        [dead] = store.add_dead([msg(msg_id="dead", timestamp=STAMP - 5)], failed_at=NOW)
        assert store.redrive_edited(dead, value=b"edited", headers=[], now=NOW)
        assert store.get(dead).timestamp == STAMP - 5
        [again] = store.apply(Settlement(), now=NOW, new=[msg(msg_id="new", timestamp=STAMP + 99)]).new_ids
        assert store.get(again).timestamp == STAMP + 99
        assert {r.msg_id: r.timestamp for r in store.trace("stamped")} == {"stamped": STAMP}
        assert [r.timestamp for r in store.claim("w", 100, 30, now=NOW + 2) if r.msg_id == "g-0"] == [STAMP]

    def test_purge_dead_with_filter(self, store: Outbox) -> None:
        a1, b2, a3, pending = _dead_fixture(store)
        assert store.purge_dead(DeadLetterFilter(topic="a")) == 2
        assert ids(store.list_dead()) == [b2]
        assert store.purge_dead(DeadLetterFilter(ids=(pending,))) == 0  # never deletes pending rows
        assert store.purge_dead() == 1
        assert store.list_dead() == []
        assert store.get(pending).status == Status.PENDING

    def test_console_filters_and_keyset_pages(self, store: Outbox) -> None:
        """The filters the console adds: consumer group, key, text in the error, keyset pages; count_dead."""

        def grp(g: str) -> list[tuple[str, bytes | None]]:
            return [("outbox-original-topic", b"orders"), ("outbox-group", g.encode()), ("outbox-attempt", b"3")]

        rows = [
            msg(
                "orders.billing.retry-1",
                key=b"k1",
                error_name="builtins.ValueError",
                headers=grp("billing"),
                last_error="builtins.ValueError (consumer): Bad 100% _price_",
            ),
            msg(
                "orders.x_billing.retry-1",
                key=b"k2",
                error_name="builtins.ValueError",
                headers=grp("x_billing"),
                last_error="builtins.ValueError (consumer): bad",
            ),
            msg(
                "orders",
                key=b"k1",
                error_code=10,
                error_name="MSG_SIZE_TOO_LARGE",
                last_error="MSG_SIZE_TOO_LARGE (10): big",
            ),
            msg(
                "orders",
                key=b"\x00" * 3000,
                error_code=10,
                error_name="MSG_SIZE_TOO_LARGE",
                last_error="MSG_SIZE_TOO_LARGE (10): big",
            ),
        ]
        a, b, c, d = store.add_dead(rows, failed_at=NOW)
        # RetryInPlace: a consumer dead letter addressed to the main topic; a group name's prefix is another group.
        [e, f] = store.add_dead(
            [msg("orders", headers=grp("billing")), msg("orders", headers=grp("billin"))], failed_at=NOW
        )
        [pending] = store.enqueue([msg("orders", key=b"k1", headers=grp("billing"))])
        assert ids(store.list_dead(DeadLetterFilter(group="billing"))) == [a, e]
        assert ids(store.list_dead(DeadLetterFilter(group="billin"))) == [f]
        assert ids(store.list_dead(DeadLetterFilter(group="billing", limit=1, after_id=a))) == [e]
        store.purge_dead(DeadLetterFilter(ids=(e, f)))
        assert ids(store.list_dead(DeadLetterFilter(group="x_billing"))) == [b]
        assert ids(store.list_dead(DeadLetterFilter(group="Billing"))) == []  # exact, case-sensitive
        assert ids(store.list_dead(DeadLetterFilter(key=b"k1"))) == [a, c]
        assert ids(store.list_dead(DeadLetterFilter(key=b"\x00" * 3000))) == [d]  # longer than a btree entry
        assert ids(store.list_dead(DeadLetterFilter(text="100% _PRICE_"))) == [a]
        assert ids(store.list_dead(DeadLetterFilter(text="%"))) == [a]  # a LIKE wildcard is matched as itself
        assert ids(store.list_dead(DeadLetterFilter(text="BIG"))) == [c, d]
        assert ids(store.list_dead(DeadLetterFilter(after_id=a, limit=2))) == [b, c]
        assert ids(store.list_dead(DeadLetterFilter(after_id=c, limit=2))) == [d]
        assert ids(store.list_dead(DeadLetterFilter(error="builtins.ValueError", key=b"k2"))) == [b]
        assert store.count_dead() == 4
        assert store.count_dead(DeadLetterFilter(topic="orders", limit=1)) == 2  # the limit does not count
        assert store.count_dead(DeadLetterFilter(ids=(pending,))) == 0

    def test_redrive_edited_replaces_value_and_headers(self, store: Outbox) -> None:
        [d] = store.add_dead([msg("t", value=b"old", key=b"k", headers=[("a", b"1")], attempts=4)], failed_at=NOW)
        [p] = store.enqueue([msg("t")])
        assert store.redrive_edited(d, value=b'{"fixed": 1}', headers=[("a", b"2"), ("b", None)], now=NOW + 1)
        r = store.get(d)
        assert (r.status, r.attempts, r.next_attempt_at, r.key) == (Status.PENDING, 0, NOW + 1, b"k")
        assert (r.value, r.headers) == (b'{"fixed": 1}', [("a", b"2"), ("b", None)])
        assert not store.redrive_edited(d, value=b"x", headers=[], now=NOW)  # no longer dead
        assert not store.redrive_edited(p, value=b"x", headers=[], now=NOW)  # pending rows are never edited
        assert not store.redrive_edited(99_999, value=b"x", headers=[], now=NOW)
        assert store.get(d).value == b'{"fixed": 1}' and store.get(p).value == b"v"

    def test_trace_finds_every_row_of_a_message(self, store: Outbox) -> None:
        [d] = store.add_dead([msg("t", msg_id="m-1")], failed_at=NOW)
        [p, _other] = store.enqueue([msg("t.g.retry-1", msg_id="m-1"), msg("t", msg_id="m-2")])
        assert ids(store.trace("m-1")) == [d, p]
        assert [r.status for r in store.trace("m-1")] == [Status.DEAD, Status.PENDING]
        assert store.trace("nope") == []

    def test_audit_log_newest_first(self, store: Outbox) -> None:
        first = store.add_audit(who="local", action="purge", filter='{"topic": "a"}', count=2, at=NOW)
        second = store.add_audit(who="token:ab12cd34", action="redrive", filter='{"ids": [1]}', count=1, at=NOW + 1)
        got = store.audit_log()
        assert [(e.id, e.who, e.action, e.filter, e.count, e.at) for e in got] == [
            (second, "token:ab12cd34", "redrive", '{"ids": [1]}', 1, NOW + 1),
            (first, "local", "purge", '{"topic": "a"}', 2, NOW),
        ]
        assert [e.id for e in store.audit_log(limit=1)] == [second]
        assert [e.id for e in store.audit_log(before_id=second)] == [first]

    def test_stats(self, store: Outbox) -> None:
        empty = store.stats(now=NOW)
        assert (empty.pending, empty.dead, empty.leased, empty.oldest_pending_at, empty.next_due_at) == (
            0,
            0,
            0,
            None,
            None,
        )
        *_, first_pending = _dead_fixture(store)  # three dead letters with lower ids than it
        got = store.enqueue([msg("b", next_attempt_at=NOW + 50), msg("c")])
        store.claim("w", 1, 30, now=NOW)  # claims the pending "a" row (oldest due)
        s = store.stats(now=NOW)
        assert (s.pending, s.dead, s.leased) == (3, 3, 1)
        assert s.pending_by_topic == {"a": 1, "b": 1, "c": 1}
        assert s.dead_by_topic == {"a": 2, "b": 1}
        assert s.dead_by_error == {"MSG_SIZE_TOO_LARGE (10)": 2, "TOPIC_AUTHORIZATION_FAILED (29)": 1}
        assert s.next_due_at == 0.0  # row "c" was due from the start
        assert s.oldest_pending_at == store.get(first_pending).created_at
        store.mark_delivered([got[1]])
        assert store.stats(now=NOW).next_due_at == NOW + 30  # the leased row, when its lease ends
        store.mark_delivered([got[0]])  # topic "b" keeps only its dead letter
        s = store.stats(now=NOW)
        assert (s.pending, s.dead, s.pending_by_topic, s.dead_by_topic) == (1, 3, {"a": 1}, {"a": 2, "b": 1})

    def test_close_is_idempotent(self, make_store: Factory) -> None:
        s = make_store()
        s.enqueue([msg()])
        s.close()
        s.close()

    # -- every column's meaning, the same on every backend -------------------------------------------

    def test_columns_of_a_rescheduled_row(self, store: Outbox) -> None:
        [a] = store.enqueue([msg(key=b"k", next_attempt_at=NOW - 1)])
        fresh = store.get(a)
        assert (fresh.attempts, fresh.first_failed_at, fresh.last_failed_at) == (0, None, None)
        assert (fresh.last_error, fresh.error_code, fresh.error_name, fresh.next_attempt_at) == (
            None,
            None,
            None,
            NOW - 1,
        )
        assert fresh.created_at > 0
        store.claim("w", 10, 30, now=NOW)
        assert store.get(a).next_attempt_at == NOW + 30  # leased: due when the lease ends
        store.record_failures([fail(a, NOW + 5, "_MSG_TIMED_OUT (-192): late", at=NOW + 1)])
        r = store.get(a)
        assert (r.status, r.attempts, r.first_failed_at, r.last_failed_at, r.next_attempt_at) == (
            Status.PENDING,
            1,
            NOW + 1,
            NOW + 1,
            NOW + 5,
        )
        assert (r.last_error, r.error_code, r.error_name) == ("_MSG_TIMED_OUT (-192): late", -192, "_MSG_TIMED_OUT")
        assert r.created_at == fresh.created_at
        assert store.stats(now=NOW + 2).leased == 0  # a rescheduled row is not leased any more

    def test_columns_of_a_dead_letter_from_failures(self, store: Outbox) -> None:
        [a] = store.enqueue([msg()])
        store.record_failures([fail(a, NOW + 5, at=NOW)])
        [d] = store.record_failures([fail(a, None, "MSG_SIZE_TOO_LARGE (10): big", at=NOW + 7)])
        assert (d.status, d.attempts, d.first_failed_at, d.last_failed_at) == (Status.DEAD, 2, NOW, NOW + 7)
        assert (d.last_error, d.error_code, d.error_name) == ("MSG_SIZE_TOO_LARGE (10): big", 10, "MSG_SIZE_TOO_LARGE")
        assert store.get(a) == d

    @pytest.mark.parametrize("first", [None, NOW - 50])
    def test_columns_of_a_dead_letter_added_directly(self, store: Outbox, first: float | None) -> None:
        [d] = store.add_dead(
            [
                msg(
                    attempts=1,
                    first_failed_at=first,
                    last_error="INVALID_RECORD (87): no key",
                    error_code=87,
                    error_name="INVALID_RECORD",
                )
            ],
            failed_at=NOW,
        )
        r = store.get(d)
        # A dead letter failed just now (last_failed_at) and always has a first failure.
        assert (r.status, r.attempts, r.first_failed_at, r.last_failed_at, r.created_at) == (
            Status.DEAD,
            1,
            first if first is not None else NOW,
            NOW,
            NOW,
        )
        assert (r.error_code, r.error_name, r.last_error) == (87, "INVALID_RECORD", "INVALID_RECORD (87): no key")

    def test_columns_of_a_spilled_row_that_failed_once(self, store: Outbox) -> None:
        [a] = store.enqueue(
            [
                msg(
                    attempts=1,
                    first_failed_at=NOW,
                    last_error="_TRANSPORT (-195): down",
                    next_attempt_at=NOW + 3,
                    error_code=-195,
                    error_name="_TRANSPORT",
                )
            ]
        )
        r = store.get(a)
        assert (r.attempts, r.first_failed_at, r.last_failed_at, r.next_attempt_at) == (1, NOW, NOW, NOW + 3)
        assert (r.error_code, r.error_name) == (-195, "_TRANSPORT")

    def test_apply_settles_a_whole_batch_in_one_call(self, store: Outbox) -> None:
        from outbox.stores.base import Settlement

        [a, b, c, d] = store.enqueue([msg(), msg(), msg(), msg()])
        store.claim("w", 10, 300, now=NOW)
        done = store.apply(
            Settlement(delivered=[a, 999], failures=[fail(b, NOW + 9), fail(c, None)], released=[d]),
            now=NOW + 1,
            new=[msg(value=b"n")],
            lease_owner="p",
            lease_until=NOW + 60,
        )
        assert done.deleted == 1 and ids(done.dead) == [c] and len(done.new_ids) == 1
        with pytest.raises(UnknownMessageError):
            store.get(a)
        assert (store.get(b).attempts, store.get(b).next_attempt_at) == (1, NOW + 9)
        rd = store.get(d)
        assert (rd.attempts, rd.next_attempt_at, rd.last_error) == (0, NOW + 1, None)  # released: no attempt
        assert store.get(done.new_ids[0]).next_attempt_at == NOW + 60
        assert ids(store.claim("w2", 10, 30, now=NOW + 1)) == [d]

    def test_apply_rewrites_pending_rows_with_their_settlement(self, store: Outbox) -> None:
        """A rewrite replaces a pending row's topic, value, headers and partition in the settlement's
        transaction; id, msg_id, key, timestamp and the failure it comes with are kept. A row of
        another msg_id, a dead letter and rows not named are left as they were."""
        [a, b, c, x] = store.enqueue(
            [
                msg("t", value=b"a", key=b"k", msg_id="a", partition=2, timestamp=7, headers=[("h", b"1")]),
                msg("t", value=b"b", key=b"k", msg_id="b"),
                msg("t", value=b"c", msg_id="c"),
                msg("t", msg_id="x"),
            ]
        )
        [d] = store.add_dead([msg("t", value=b"d", msg_id="d")], failed_at=NOW)
        before = {i: store.get(i) for i in (c, x, d)}
        done = store.apply(
            Settlement(
                failures=[fail(a, NOW + 9), fail(b, None)],
                rewritten=[
                    Rewrite(a, "a", "u", b"a!", [("h", b"2"), ("outbox-original-topic", b"t")]),
                    Rewrite(b, "b", "t", None, [("h", None)], partition=1),
                    Rewrite(c, "not-c", "u", b"c!", []),
                    Rewrite(d, "d", "u", b"d!", []),
                ],
            ),
            now=NOW,
        )
        ra = store.get(a)
        redirected = [("h", b"2"), ("outbox-original-topic", b"t")]
        assert (ra.topic, ra.value, ra.headers, ra.partition) == ("u", b"a!", redirected, -1)
        assert (ra.msg_id, ra.key, ra.timestamp, ra.status, ra.attempts, ra.next_attempt_at) == (
            "a",
            b"k",
            7,
            Status.PENDING,
            1,
            NOW + 9,
        )
        [rb] = done.dead
        assert (rb.id, rb.value, rb.headers, rb.partition, rb.status) == (b, None, [("h", None)], 1, Status.DEAD)
        assert store.get(b) == rb
        assert {i: store.get(i) for i in (c, x, d)} == before
        assert store.has_pending("u", b"k") and not store.has_pending("t", b"k")
        # A rewrite alone is a settlement too: a row held back, not sent, holds the changed message.
        store.apply(Settlement(rewritten=[Rewrite(x, "x", "t", b"x!", [])]), now=NOW)
        assert (store.get(x).value, store.get(x).attempts) == (b"x!", 0)

    def test_apply_explodes_a_group_holding_a_rewritten_message(self, store: Outbox) -> None:
        """A group (SQLite, PostgreSQL) that one rewrite touches becomes one-message rows with their
        own ids; only the rewritten one changes, even when the group is also given back whole."""
        batch = _keyed(30)
        ids_ = store.enqueue(batch)
        assert self.group_rows(store) == (1 if store.capabilities.grouped_rows else 0)
        store.apply(
            Settlement(released=ids_, rewritten=[Rewrite(ids_[4], "m-4", "t", b"m-4!", [("outbox-id", b"m-4")])]),
            now=NOW,
        )
        assert self.group_rows(store) == 0
        left = sorted(self.messages(store), key=lambda m: m.id)
        assert [m.id for m in left] == ids_
        assert [m.value for m in left] == [b"m-4!" if i == 4 else m.value for i, m in enumerate(batch)]
        assert [m.key for m in left] == [m.key for m in batch]

    def test_dead_letter_error_filter_reads_the_code_and_name_columns(self, store: Outbox) -> None:
        # The text says one thing, the columns another: the filter must follow the columns.
        [a] = store.add_dead(
            [msg(last_error="free text (1): whatever", error_code=10, error_name="MSG_SIZE_TOO_LARGE")], failed_at=NOW
        )
        assert ids(store.list_dead(DeadLetterFilter(error="10"))) == [a]
        assert ids(store.list_dead(DeadLetterFilter(error="MSG_SIZE_TOO_LARGE"))) == [a]
        assert store.list_dead(DeadLetterFilter(error="1")) == []
        assert store.stats(now=NOW).dead_by_error == {"MSG_SIZE_TOO_LARGE (10)": 1}

    def test_keys_with_pending(self, store: Outbox) -> None:
        [a1, _a2, _b1] = store.enqueue([msg("t", key=b"A"), msg("t", key=b"A\x00"), msg("u", key=b"B")])
        [d] = store.add_dead([msg("t", key=b"D")], failed_at=NOW)
        asked = [("t", b"A"), ("t", b"A\x00"), ("t", b"B"), ("u", b"B"), ("t", b"D"), ("t", b"none")]
        assert store.keys_with_pending(asked) == {("t", b"A"), ("t", b"A\x00"), ("u", b"B")}
        store.mark_delivered([a1])
        assert store.keys_with_pending([("t", b"A"), ("t", b"A\x00")]) == {("t", b"A\x00")}
        assert store.keys_with_pending([]) == set()
        assert store.get(d).status == Status.DEAD

    def test_pending_keys(self, store: Outbox) -> None:
        assert store.pending_keys() == set()
        [a1, a2, _b1, _n] = store.enqueue(
            [msg("t", key=b"A"), msg("t", key=b"A"), msg("u", key=b"\x00B"), msg("t", key=None)]
        )
        store.add_dead([msg("t", key=b"D")], failed_at=NOW)
        store.claim("w", 1, 30, now=NOW)  # leased rows are pending too
        assert store.pending_keys() == {("t", b"A"), ("u", b"\x00B")}
        store.mark_delivered([a1, a2])
        assert store.pending_keys() == {("u", b"\x00B")}

    # -- bounded purges and the erasure of one key --------------------------------------------------------

    def test_purge_dead_at_most_deletes_a_bounded_batch_and_never_a_pending_row(self, store: Outbox) -> None:
        old = store.add_dead([msg(value=b"%d" % i) for i in range(5)], failed_at=100.0)
        young = store.add_dead([msg(value=b"young")], failed_at=NOW)
        [pending] = store.enqueue([msg(value=b"pending")])
        older = DeadLetterFilter(until=200.0)
        assert [store.purge_dead(older, at_most=2) for _ in range(4)] == [2, 2, 1, 0]
        assert ids(store.list_dead()) == young
        assert store.get(pending).status == Status.PENDING
        assert store.purge_dead(at_most=10) == 1
        assert store.count_dead() == 0 and len(old) == 5

    def test_erase_key_deletes_the_keys_pending_and_dead_messages_and_nothing_else(self, store: Outbox) -> None:
        batch = _keyed(40)  # SQLite, PostgreSQL: one group row holding k0, k1 and k2
        before = store.enqueue(batch)
        [single] = store.enqueue([msg("t", key=b"k1", msg_id="single")])
        [other_topic] = store.enqueue([msg("u", key=b"k1", msg_id="other-topic")])
        [unkeyed] = store.enqueue([msg("t", key=None, msg_id="unkeyed")])
        dead = store.add_dead(
            [
                msg("t", key=b"k1", msg_id="dead-1"),
                msg("u", key=b"k1", msg_id="dead-2"),
                msg("t", key=b"k2", msg_id="dead-k2"),
            ],
            failed_at=NOW,
        )
        groups = self.group_rows(store)
        assert groups == (1 if store.capabilities.grouped_rows else 0)
        of_k1 = sum(m.key == b"k1" for m in batch)  # 13
        expected = Erased(pending=of_k1 + 2, dead=2, leased=0)
        assert store.erase_key(b"k1", dry_run=True, now=NOW) == expected
        assert len(self.messages(store)) == 40 + 3 + 3  # a dry run changes nothing
        batches: list[Erased] = []
        assert store.erase_key(b"k1", now=NOW, on_batch=batches.append) == expected
        assert sum(batches, Erased()) == expected
        left = self.messages(store)
        assert all(m.key != b"k1" for m in left)
        # The other keys' messages keep their ids, bytes and order; the rest of the store is untouched.
        kept = [(i, m.msg_id, m.value) for i, m in zip(before, batch, strict=True) if m.key != b"k1"]
        assert [(m.id, m.msg_id, m.value) for m in left if m.msg_id.startswith("m-")] == kept
        assert {m.id for m in left} == {i for i, _, _ in kept} | {unkeyed, dead[2]}
        assert single not in {m.id for m in left} and other_topic not in {m.id for m in left}
        assert self.group_rows(store) == 0  # the group holding k1 became one-message rows
        assert not store.has_pending("t", b"k1") and store.keys_with_pending([("t", b"k1"), ("u", b"k1")]) == set()
        assert store.pending_keys() == {("t", b"k0"), ("t", b"k2")}
        assert [m.msg_id for m in store.claim("w", 100, 30, now=NOW)] == [m.msg_id for m in batch if m.key != b"k1"] + [
            "unkeyed"
        ]
        assert store.erase_key(b"k1", now=NOW) == Erased()
        assert ids(store.list_dead()) == [dead[2]]

    def test_erase_key_of_one_topic_leaves_the_key_in_other_topics(self, store: Outbox) -> None:
        store.enqueue(_keyed(20, "t") + _keyed(20, "u", prefix="n"))  # a group per topic
        store.add_dead([msg("t", key=b"k0"), msg("u", key=b"k0")], failed_at=NOW)
        assert store.erase_key(b"k0", topic="t", now=NOW) == Erased(pending=7, dead=1)
        assert not store.has_pending("t", b"k0") and store.has_pending("u", b"k0")
        assert sorted(m.topic for m in self.messages(store) if m.key == b"k0") == ["u"] * 8
        assert store.erase_key(b"k0", topic="none", dry_run=True, now=NOW) == Erased()

    def test_erase_key_deletes_leased_rows_and_counts_them(self, store: Outbox) -> None:
        batch = _keyed(30)
        rows = store.enqueue(batch)
        [free] = store.enqueue([msg("t", key=b"k1", msg_id="free")])
        claimed = store.claim("w", 30, 60, now=NOW)  # the group (SQLite, PostgreSQL), leased whole
        assert {m.msg_id for m in claimed} == {m.msg_id for m in batch}
        leased_k1 = sum(m.key == b"k1" for m in batch)  # 10
        assert store.erase_key(b"k1", dry_run=True, now=NOW) == Erased(pending=leased_k1 + 1, leased=leased_k1)
        assert store.erase_key(b"k1", now=NOW) == Erased(pending=leased_k1 + 1, leased=leased_k1)
        assert free not in {m.id for m in self.messages(store)}
        # The other keys' messages stay leased to their sender, whose settlement still applies: the
        # erased ones are simply not there to settle.
        assert store.claim("w2", 100, 60, now=NOW + 1) == []
        k1_ids = [i for i, m in zip(rows, batch, strict=True) if m.key == b"k1"]
        assert store.record_failures([fail(k1_ids[0], None)]) == []
        assert store.mark_delivered(rows) == len(rows) - leased_k1
        assert self.messages(store) == []

    def test_erase_key_goes_in_bounded_transactions(self, store: Outbox) -> None:
        n = ERASE_BATCH * 2 + 5
        store.add_dead([msg("t", key=b"many", value=b"%d" % i) for i in range(n)], failed_at=NOW)  # one row each
        [other] = store.add_dead([msg("t", key=b"other")], failed_at=NOW)
        batches: list[Erased] = []
        assert store.erase_key(b"many", now=NOW, on_batch=batches.append) == Erased(dead=n)
        assert [b.dead for b in batches] == [ERASE_BATCH, ERASE_BATCH, 5]
        assert ids(store.list_dead()) == [other]

    def test_erase_key_matches_the_exact_key_bytes(self, store: Outbox) -> None:
        keys = [b"", b"k", b"k\x00", b"K", None]
        store.enqueue([msg(key=k, msg_id=f"m{i}") for i, k in enumerate(keys)] * 4)  # 20: a group with every key
        assert store.erase_key(b"", now=NOW) == Erased(pending=4)
        assert store.erase_key(b"k", now=NOW) == Erased(pending=4)
        assert sorted({m.msg_id for m in self.messages(store)}) == ["m2", "m3", "m4"]
        assert len(self.messages(store)) == 12

    # -- the state machine ----------------------------------------------------------------------------

    def test_state_machine(self, make_store: Factory) -> None:
        factory = self.state_machine_factory(make_store)
        machine = type(f"OutboxMachine_{type(self).__name__}", (OutboxMachine,), {"factory": staticmethod(factory)})
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=self.state_machine_examples,
                stateful_step_count=25,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )

    # -- capabilities -----------------------------------------------------------------------------------

    def test_a_missing_capability_is_refused_by_name(self, store: Outbox) -> None:
        caps = store.capabilities
        assert caps.shared is False or caps.durable, "a store shared between processes keeps its rows"
        if not caps.transactional_enqueue:
            with pytest.raises(ConfigError, match="cannot enqueue in the caller's transaction"):
                store.enqueue_in_transaction(object(), [msg()])
        if not caps.bulk_read:
            with pytest.raises(ConfigError, match="no table a bulk reader can read"):
                store.bulk_read()


class DurableStoreContract(StoreContract):
    """`StoreContract` for a store whose rows outlive the store object: it also gives `reopen`,
    and `run_sql` when its store reads in bulk or encrypts."""

    def reopen(self, store: Outbox) -> Outbox:
        """A new store object on the same rows as `store` (closed already), opened without creating."""
        raise NotImplementedError(f"{type(self).__name__} must define reopen(store)")

    def run_sql(self, store: Outbox, sql: str) -> list[tuple[Any, ...]]:
        """`sql` run on the store's database as a bulk reader runs it: as it is, on a connection
        of its own."""
        raise NotImplementedError(f"{type(self).__name__} must define run_sql(store, sql)")

    def table(self, store: Outbox) -> str:
        """The store's table, as `sql` given to `run_sql` names it."""
        return "outbox"

    def group_rows(self, store: Outbox) -> int:
        if not store.capabilities.grouped_rows:
            return 0
        return int(self.run_sql(store, f"SELECT count(*) FROM {self.table(store)} WHERE n > 1")[0][0])

    def test_data_survives_reopen(self, make_store: Factory) -> None:
        s = make_store()
        [i] = s.enqueue([msg(value=b"keep")])
        s.close()
        with self.reopen(s) as again:
            assert again.get(i).value == b"keep"
            again.migrate()  # idempotent
            assert again.get(i).value == b"keep"

    def test_a_bulk_read_yields_every_due_message_and_the_blockers_of_the_rest(self, store: Outbox) -> None:
        if not store.capabilities.bulk_read:
            with pytest.raises(ConfigError, match="no table a bulk reader can read"):
                store.bulk_read()
            return
        [early] = store.enqueue([msg(key=b"k1", value=b"early", next_attempt_at=NOW - 9)])
        batch = store.enqueue(
            [msg(key=f"k{i % 4}".encode(), value=b"%d" % i, next_attempt_at=NOW - 5) for i in range(40)]
        )
        [alone] = store.enqueue([msg(value=b"alone", next_attempt_at=NOW - 1, headers=[("h", b"x")], timestamp=7)])
        store.claim("other", 1, 60, now=NOW)  # `early` leased elsewhere: key k1 waits behind it
        bulk = store.bulk_read()
        sel = bulk.selection(BulkSelection(), now=NOW)
        lo, hi, n = self.run_sql(store, bulk.bounds(sel.where))[0]
        assert n == 41 and hi >= lo
        read = [m for row in self.run_sql(store, bulk.rows(sel.where, lo, hi)) for m in explode(row)]
        assert [m.id for m in read] == [*batch, alone]  # ids in order, groups exploded
        assert [m.value for m in read] == [b"%d" % i for i in range(40)] + [b"alone"]
        assert (read[-1].headers, read[-1].timestamp) == ([("h", b"x")], 7)
        assert sel.blocked_where is not None
        found = [(t, bytes(k), int(i)) for t, k, i in self.run_sql(store, bulk.blockers(sel.blocked_where))]
        groups_sql = bulk.blocking_groups(sel.blocked_where)
        if groups_sql is not None:
            found += [k for row in self.run_sql(store, groups_sql) for k in explode_keys(row)]
        blockers = first_blockers(found)
        assert blockers == {("t", b"k1"): early}
        kept = [m.id for m in read if not waits(m.topic, m.key, m.id, blockers)]
        assert kept == [m.id for m in read if m.key != b"k1"]
        counts = dict(self.run_sql(store, bulk.counts_by_topic(sel.where)))
        assert {t: int(c) for t, c in counts.items()} == {"t": 41}

    def test_a_rewritten_row_of_an_encrypted_store_is_sealed_with_the_newest_key(self, store: Outbox) -> None:
        old, new = KeyRing([Key(b"o" * 32)]), KeyRing([Key(b"n" * 32), Key(b"o" * 32)])
        try:
            store.set_encryption(old)
        except ConfigError as exc:  # a store that does not encrypt says so, and stores in clear
            assert "does not encrypt" in str(exc)
            [i] = store.enqueue([msg(value=b"clear")])
            assert store.encrypted_key_ids() == [] and store.get(i).value == b"clear"
            return
        [a, b] = store.enqueue([msg("t", value=b"a", msg_id="a"), msg("t", value=b"b", msg_id="b")])
        store.set_encryption(new)
        store.apply(Settlement(rewritten=[Rewrite(a, "a", "t", b"a!", [("h", b"1")])]), now=NOW)
        assert (store.get(a).value, store.get(a).headers, store.get(b).value) == (b"a!", [("h", b"1")], b"b")
        table = self.table(store)
        stored = dict(self.run_sql(store, f"SELECT id, enc_key FROM {table} ORDER BY id"))
        assert stored == {a: new.current, b: old.current}
        raw = self.run_sql(store, f"SELECT value FROM {table} WHERE id = {a}")[0][0]
        assert b"a!" not in bytes(raw)
