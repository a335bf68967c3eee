"""Group rows in both durable stores: a batch of GROUP_MIN+ messages of one topic stored as one
row (`outbox.stores.grouped`). Every operation must see the same messages, ids and per-key order
as with one row per message. Real SQLite files and a real PostgreSQL server; no Kafka needed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox.drain.sendloop import resend
from outbox.errors import UnknownMessageError
from outbox.records import DeadLetterFilter, NewMessage, Status
from outbox.stores import grouped
from outbox.stores.base import Settlement
from outbox.stores.claimed import ids_of
from outbox.stores.postgres import PostgresOutbox
from outbox.stores.sqlite import SQLiteOutbox

from .. import resend_cases
from ..group_cases import NOW, STAMP, G, batch, fail, ids, one
from .durable_stores import durable_store

GroupedStore = SQLiteOutbox | PostgresOutbox


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[GroupedStore]:
    yield from durable_store(request, tmp_path, "groups")


def rows_in_table(store: GroupedStore) -> int:
    table = "outbox" if isinstance(store, SQLiteOutbox) else store._t
    return int(store._read(f"SELECT COUNT(*) FROM {table}")[0][0])


def split_group(store: GroupedStore, gid: int) -> None:
    """Explode group `gid` as another claimer would (its rows keep the lease)."""
    if isinstance(store, SQLiteOutbox):
        with store._write() as c:
            store._explode(c, gid)
    else:
        with store._tx() as conn:
            store._explode(conn, gid)


def test_a_batch_is_one_row_and_reads_back_message_by_message(store: GroupedStore) -> None:
    new = batch(40)
    got = store.enqueue(new)
    assert rows_in_table(store) == 1
    assert got == list(range(got[0], got[0] + 40))
    for i, m in zip(got, new, strict=True):
        r = store.get(i)
        assert (r.id, r.msg_id, r.topic, r.key, r.value, r.headers, r.partition, r.status, r.attempts) == (
            i, m.msg_id, "t", m.key, m.value, m.headers, m.partition, Status.PENDING, m.attempts,
        )
        assert (r.first_failed_at, r.last_error, r.error_code, r.error_name, r.timestamp) == (
            m.first_failed_at, m.last_error, m.error_code, m.error_name, m.timestamp,
        )
        assert r.last_failed_at == (m.first_failed_at if m.attempts else None)
    with pytest.raises(UnknownMessageError):
        store.get(got[0] - 1)  # the group's own id is reserved, never a message's
    assert [r.msg_id for r in store.trace("m-7")] == ["m-7"] and store.trace("m-99") == []
    assert [m.msg_id for m in store.messages()] == [m.msg_id for m in new]
    # The next row's id comes after the group's messages.
    assert store.enqueue(one(b"x", "after")) == [got[-1] + 1]
    st = store.stats(now=NOW)
    assert (st.pending, st.pending_by_topic, st.leased) == (41, {"t": 41}, 0)


def test_mixed_topics_and_short_runs_keep_the_batchs_order(store: GroupedStore) -> None:
    new = batch(20, topic="a") + batch(3, topic="b", tag="b") + batch(G, topic="c", tag="c")
    got = store.enqueue(new)
    assert got == sorted(got) and len(set(got)) == len(new)
    assert rows_in_table(store) == 1 + 3 + 1
    assert [(r.topic, r.msg_id) for r in store.messages()] == [(m.topic, m.msg_id) for m in new]
    assert store.stats(now=NOW).pending_by_topic == {"a": 20, "b": 3, "c": G}


def test_a_claim_takes_groups_whole_and_a_full_delivery_deletes_the_row(store: GroupedStore) -> None:
    first = store.enqueue(batch(20))
    second = store.enqueue(batch(20, tag="n", keys=(b"other", None)))
    claimed = store.claim("w", 30, 60, now=NOW)  # 20 + 20 > 30: the second group waits
    assert ids(claimed) == first and [r.msg_id for r in claimed] == [f"m-{i}" for i in range(20)]
    assert store.stats(now=NOW).leased == 20
    assert ids(store.claim("w2", 5, 60, now=NOW)) == second  # a first group larger than the limit: whole
    done = store.apply(Settlement(delivered=first), now=NOW)
    assert done.deleted == 20 and rows_in_table(store) == 1
    assert store.mark_delivered(second) == 20 and rows_in_table(store) == 0
    assert store.stats(now=NOW).pending == 0


def test_a_claim_reads_its_groups_as_decoded_messages_by_iteration_index_and_slice(store: GroupedStore) -> None:
    first = store.enqueue(batch(20))
    single = store.enqueue(one(b"x", "alone"))
    second = store.enqueue(batch(G, tag="n", keys=(b"other", None)))
    claimed = store.claim("w", 100, 60, now=NOW)
    assert isinstance(claimed, grouped.Claimed)
    everything = first + single + second
    # The same messages a full decode gives, read each way a caller reads a list.
    decoded = list(claimed)
    assert [r.id for r in decoded] == everything and len(claimed) == len(everything)
    assert ids_of(claimed) == everything
    assert [claimed[i] for i in range(len(claimed))] == decoded
    assert claimed[-1] == decoded[-1] and claimed[20].msg_id == "alone" and claimed[19].msg_id == "m-19"
    assert claimed[18:23] == decoded[18:23] and claimed[::7] == decoded[::7]
    assert claimed == decoded and decoded == claimed and claimed != decoded[:-1]
    assert [r.timestamp for r in claimed][:4] == [STAMP, STAMP + 1, STAMP + 2, 0]
    with pytest.raises(IndexError):
        claimed[len(everything)]
    # Delivered in full, by the ids alone: every group row goes.
    assert store.apply(Settlement(delivered=ids_of(claimed)), now=NOW).deleted == len(everything)
    assert rows_in_table(store) == 0


def odd_messages() -> list[NewMessage]:
    """`tests.resend_cases.odd_messages` at this module's time and timestamp."""
    return resend_cases.odd_messages(NOW, STAMP)


def test_a_claims_resends_are_what_resending_each_of_its_messages_gives(store: GroupedStore) -> None:
    # `Claimed.resends` reads a group's messages straight from its body: the same topic, value,
    # key, partition, timestamp and re-send headers as `resend` of each decoded message.
    store.enqueue(batch(20) + odd_messages() * 3)
    store.enqueue(odd_messages()[:2])  # one-message rows
    store.enqueue(batch(G, tag="n", keys=(b"other", None)))
    claimed = store.claim("w", 1000, 60, now=NOW)
    assert isinstance(claimed, grouped.Claimed)
    expected = [resend(m) for m in claimed]
    assert list(claimed.resends(resend)) == expected
    assert len(expected) == 20 + 18 + 2 + G
    assert expected[0][5] == [("outbox-id", b"m-0"), ("outbox-attempt", b"1")]  # the common message
    assert expected[20] == ("t", b"v", b"k", 2, STAMP, [
        ("app", b"1"), ("outbox-id", b"odd-0"), ("outbox-attempt", b"3"),
        ("outbox-first-failed-at", str(int((NOW - 9) * 1000)).encode()),
        ("outbox-last-error", b"_MSG_TIMED_OUT (-192): slow"),
    ])


def test_a_partly_settled_group_becomes_one_row_per_message_with_the_same_ids(store: GroupedStore) -> None:
    got = store.enqueue(batch(20))
    store.claim("w", 100, 60, now=NOW)
    done = store.apply(
        Settlement(delivered=got[:10], failures=[fail(got[10], NOW + 30), fail(got[11], None)], released=[got[12]]),
        now=NOW,
    )
    assert done.deleted == 10
    assert [(d.id, d.msg_id, d.status, d.attempts) for d in done.dead] == [(got[11], "m-11", Status.DEAD, 2)]
    left = {r.id: r for r in store.messages()}
    assert sorted(left) == got[10:]
    assert (left[got[10]].attempts, left[got[10]].next_attempt_at) == (1, NOW + 30)
    assert left[got[12]].next_attempt_at == NOW  # released: due now
    assert all(left[i].next_attempt_at == NOW + 60 for i in got[13:])  # still leased to "w"
    assert [d.id for d in store.list_dead(DeadLetterFilter())] == [got[11]]
    assert rows_in_table(store) == 10
    st = store.stats(now=NOW)
    assert (st.pending, st.dead, st.leased) == (9, 1, 7)


def test_a_group_holding_a_key_that_backs_off_is_split_and_only_that_key_waits(store: GroupedStore) -> None:
    [early] = store.enqueue(one(b"k1", "early"))
    store.claim("other", 1, 60, now=NOW)
    store.record_failures([fail(early, NOW + 30)])  # k1 backs off for 30 s
    group = store.enqueue(batch(20, keys=(b"k1", b"k2")))
    [k2_later] = store.enqueue(one(b"k2", "k2-later"))
    [k9] = store.enqueue(one(b"k9", "k9"))
    # The group becomes one row per message, so only k1's wait (behind `early`); k2's messages
    # and k9 go, in id order.
    claimed = store.claim("w", 100, 60, now=NOW)
    k1 = [i for i, m in zip(group, batch(20, keys=(b"k1", b"k2")), strict=True) if m.key == b"k1"]
    assert ids(claimed) == [i for i in group if i not in k1] + [k2_later, k9]
    assert rows_in_table(store) == 1 + 20 + 2
    store.mark_delivered(ids(claimed))
    assert store.claim("w", 100, 60, now=NOW + 29) == []
    assert ids(store.claim("w", 100, 60, now=NOW + 30)) == [early, *k1]


def test_a_claim_ends_before_a_group_behind_a_back_off_and_the_next_claim_goes_on_without_its_key(
    store: GroupedStore,
) -> None:
    [early] = store.enqueue(one(b"k1", "early"))
    store.claim("other", 1, 60, now=NOW)
    store.record_failures([fail(early, NOW + 30)])  # k1 backs off for 30 s
    [first] = store.enqueue(one(b"k9", "first"))
    group = store.enqueue(batch(20, keys=(b"k1", b"k2")))
    # The rows before the group are claimed; the group is split meanwhile.
    assert ids(store.claim("w", 100, 60, now=NOW)) == [first]
    assert rows_in_table(store) == 2 + 20
    k1 = [i for i, m in zip(group, batch(20, keys=(b"k1", b"k2")), strict=True) if m.key == b"k1"]
    assert ids(store.claim("w", 100, 60, now=NOW)) == [i for i in group if i not in k1]


def test_a_settlement_deletes_groups_whole_and_rows_of_a_group_split_while_in_flight(store: GroupedStore) -> None:
    whole = store.enqueue(batch(20))
    split = store.enqueue(batch(20, tag="s"))
    [single] = store.enqueue(one(b"x", "single"))
    assert ids(store.claim("w", 100, 60, now=NOW)) == [*whole, *split, single]
    # Another claimer split the second group while it was in flight (its rows keep the lease).
    split_group(store, split[0] - 1)
    assert rows_in_table(store) == 1 + 20 + 1
    assert store.apply(Settlement(delivered=whole), now=NOW).deleted == 20  # a group's ids alone
    assert rows_in_table(store) == 20 + 1
    assert store.apply(Settlement(delivered=[*split, single]), now=NOW).deleted == 21
    assert rows_in_table(store) == 0


def test_a_group_behind_another_claimers_lease_waits_whole_and_the_claim_skips_its_keys(store: GroupedStore) -> None:
    [early] = store.enqueue(one(b"k1", "early"))
    assert ids(store.claim("other", 1, 60, now=NOW)) == [early]  # leased: settled in moments
    group = store.enqueue(batch(20, keys=(b"k1", b"k2")))
    [k2_later] = store.enqueue(one(b"k2", "k2-later"))
    other = store.enqueue(batch(20, keys=(b"k8", b"k9"), tag="o"))
    # The group waits whole; k2's later message waits behind it; the group of other keys goes.
    assert ids(store.claim("w", 100, 60, now=NOW)) == other
    assert rows_in_table(store) == 4
    store.mark_delivered([early])
    assert ids(store.claim("w", 100, 60, now=NOW)) == [*group, k2_later]


def test_a_leased_group_blocks_its_keys_except_for_its_own_claimer(store: GroupedStore) -> None:
    group = store.enqueue(batch(20, keys=(b"a", b"b")))
    [a_later] = store.enqueue(one(b"a", "a-later"))
    [c] = store.enqueue(one(b"c", "c"))
    assert ids(store.claim("w1", 20, 60, now=NOW)) == group
    assert ids(store.claim("w2", 100, 60, now=NOW)) == [c]
    store.release([c], now=NOW)
    # w1's producer has the group in flight: its next claim may continue the group's keys.
    assert ids(store.claim("w1", 100, 60, now=NOW, in_flight=set(group))) == [a_later, c]


def test_a_group_is_due_when_its_latest_message_is(store: GroupedStore) -> None:
    new = batch(20)
    new[5] = new[5]._replace(next_attempt_at=NOW + 50)
    store.enqueue(new)
    assert store.claim("w", 100, 60, now=NOW) == []
    assert store.next_due_at() == NOW + 50
    assert len(store.claim("w", 100, 60, now=NOW + 50)) == 20


def test_keys_of_groups_are_pending_keys_until_delivered(store: GroupedStore) -> None:
    got = store.enqueue(batch(20, keys=(b"a", b"\x00b", None)))
    assert store.has_pending("t", b"a") and store.has_pending("t", b"\x00b")
    assert not store.has_pending("t", b"b") and not store.has_pending("u", b"a") and not store.has_pending("t", b"")
    assert store.keys_with_pending([("t", b"a"), ("t", b"b"), ("t", b"\x00b")]) == {("t", b"a"), ("t", b"\x00b")}
    assert store.pending_keys() == {("t", b"a"), ("t", b"\x00b")}
    store.claim("w", 100, 60, now=NOW)
    store.mark_delivered(got)
    assert store.keys_with_pending([("t", b"a")]) == set() and store.pending_keys() == set()


def test_explode_groups_keeps_every_message_and_id(store: GroupedStore) -> None:
    new = batch(30)
    got = store.enqueue(new)
    before = store.messages()
    assert store.explode_groups() == 30
    assert rows_in_table(store) == 30
    after = store.messages()
    assert [(r.id, r.msg_id, r.key, r.value, r.attempts, r.first_failed_at, r.timestamp) for r in after] == [
        (r.id, r.msg_id, r.key, r.value, r.attempts, r.first_failed_at, r.timestamp) for r in before
    ]
    assert [r.timestamp for r in after] == [m.timestamp for m in new]
    assert ids(after) == got and store.explode_groups() == 0


def test_backlog_counts_messages_not_rows(store: GroupedStore) -> None:
    store.enqueue(batch(25))
    assert store.backlog(now=NOW).due_now == 25
    store.claim("w", 100, 60, now=NOW)
    assert store.backlog(now=NOW).due_now == 0 and store.stats(now=NOW).leased == 25


def test_a_group_given_back_whole_stays_one_row_due_now(store: GroupedStore) -> None:
    store.enqueue(batch(G))
    claimed = store.claim("me", G, 30, now=NOW)
    assert store.claim("other", G, 30, now=NOW + 1) == []  # leased
    store.apply(Settlement(released=ids(claimed)), now=NOW + 2)
    assert rows_in_table(store) == 1
    again = store.claim("other", G, 30, now=NOW + 2)
    assert ids(again) == ids(claimed)
    assert [m.attempts for m in again] == [m.attempts for m in claimed]  # no attempt counted


def test_a_batch_born_leased_is_one_group_row_that_a_whole_delivery_deletes(store: GroupedStore) -> None:
    """Write-ahead: the writer stores a batch leased to itself, then sends it."""
    done = store.apply(Settlement(), now=NOW, new=batch(40), lease_owner="me", lease_until=NOW + 30)
    got = done.new_ids
    assert rows_in_table(store) == 1 and got == list(range(got[0], got[0] + 40))
    st = store.stats(now=NOW)
    assert (st.pending, st.leased) == (40, 40)
    assert store.claim("other", 100, 60, now=NOW + 29) == []  # leased until NOW + 30
    assert all(m.next_attempt_at == NOW + 30 for m in store.messages())
    assert store.has_pending("t", b"k1")  # its keys are pending keys while in flight
    assert store.apply(Settlement(delivered=got), now=NOW + 1).deleted == 40
    assert rows_in_table(store) == 0 and store.stats(now=NOW + 1).pending == 0


def test_a_batch_born_leased_whose_lease_ends_is_claimed_whole(store: GroupedStore) -> None:
    """The writing process died before its sends were settled: a drain takes the group over."""
    got = store.apply(Settlement(), now=NOW, new=batch(20), lease_owner="me", lease_until=NOW + 30).new_ids
    assert ids(store.claim("drain", 100, 60, now=NOW + 30)) == got
    assert rows_in_table(store) == 1


def test_a_failure_in_a_batch_born_leased_splits_it_and_keeps_the_rest_leased(store: GroupedStore) -> None:
    got = store.apply(Settlement(), now=NOW, new=batch(20), lease_owner="me", lease_until=NOW + 30).new_ids
    done = store.apply(Settlement(delivered=got[:5], failures=[fail(got[5], NOW + 10)]), now=NOW + 1)
    assert done.deleted == 5 and rows_in_table(store) == 15
    left = {r.id: r for r in store.messages()}
    assert left[got[5]].next_attempt_at == NOW + 10
    assert all(left[i].next_attempt_at == NOW + 30 for i in got[6:])  # still in flight: still ours
    assert store.apply(Settlement(delivered=got[6:]), now=NOW + 2).deleted == 14
    assert ids(store.claim("drain", 100, 60, now=NOW + 10)) == [got[5]]
