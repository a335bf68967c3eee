"""The consumer's pure parts: strategies and bad input, tier names, header codec, offsets, holds."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import Message

from outbox import ConfigError, Ignore, ResilientConsumer, RetryInPlace, RetryPolicy, RetryTopics
from outbox.consumer import headers as H
from outbox.consumer.assignment import is_cooperative
from outbox.consumer.headers import ERROR_MESSAGE_MAX, cap_utf8, error_class, failure_headers, ladder_position
from outbox.consumer.offsets import OffsetTracker
from outbox.consumer.ordering import KeyOrder
from outbox.consumer.scheduler import PauseScheduler
from outbox.consumer.tiers import Ladder, client_config
from outbox.headers import IdGenerator, for_resend

CONF = {"bootstrap.servers": "127.0.0.1:1", "group.id": "billing"}


def ok(_msg: Any) -> None:
    pass


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "retry"}, "unknown strategy 'retry'"),
        ({"strategy": object}, "unknown strategy"),
        ({"handler": 42}, "handler must be callable, got int"),
        ({"config": {"bootstrap.servers": "x"}}, "config needs a 'group.id'"),
        ({"config": {"bootstrap.servers": "x", "group.id": ""}}, "config needs a 'group.id'"),
        ({"topics": []}, "topics must be a non-empty list"),
        ({"topics": "orders"}, "topics must be a non-empty list"),
        ({"dead_letters": "s3"}, "dead_letters must be one of ('topic', 'store', 'both'), got 's3'"),
        ({"ordering": "value"}, "ordering must be None or 'key'"),
        ({"dead_on": (ValueError, 3)}, "dead_on must be exception classes, got 3"),
        ({"config": {"group.id": "a/b"}}, "group.id 'a/b' cannot be part of a topic name"),
        (
            {"ordering": "key", "config": {**CONF, "partition.assignment.strategy": "cooperative-sticky"}},
            "ordering='key' needs partition.assignment.strategy 'range' (got 'cooperative-sticky')",
        ),
        (
            {"ordering": "key", "config": {**CONF, "group.protocol": "consumer", "group.remote.assignor": "uniform"}},
            "ordering='key' needs group.remote.assignor 'range' (got 'uniform')",
        ),
    ],
)
def test_bad_input_is_a_config_error_at_construction(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"topics": ["orders"], "handler": ok, "strategy": RetryTopics(delays=[1])}
    config = kwargs.pop("config", CONF)
    args.update(kwargs)
    with pytest.raises(ConfigError) as info:
        ResilientConsumer(config, **args)
    assert message in str(info.value)


def test_retry_topics_delays_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"delays=\[\]\) is empty"):
        RetryTopics(delays=[])
    with pytest.raises(ConfigError, match="must be a list of seconds"):
        RetryTopics(delays=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="delay -1 must be a number of seconds"):
        RetryTopics(delays=[1, -1])
    with pytest.raises(ConfigError, match="delay True"):
        RetryTopics(delays=[True])
    assert RetryTopics(delays=[1, 10, 60]).delays == (1.0, 10.0, 60.0)
    assert RetryTopics(delays=[1, 10, 60]).tiers == 3


def test_retry_in_place_needs_a_policy() -> None:
    with pytest.raises(ConfigError, match="must be a RetryPolicy, got int"):
        RetryInPlace(3)  # type: ignore[arg-type]
    assert RetryInPlace(forever=True).forever
    assert isinstance(RetryInPlace(RetryPolicy(max_attempts=2)).policy, RetryPolicy)
    assert Ignore() == Ignore()


def test_tier_names_depend_on_group_and_tier_only() -> None:
    ladder = Ladder("billing", ("orders",), 3, with_dlq=True)
    assert ladder.tier_topics("orders") == [
        "orders.billing.retry-1",
        "orders.billing.retry-2",
        "orders.billing.retry-3",
        "orders.billing.dlq",
    ]
    places = ladder.places()
    assert places["orders"].tier == 0
    assert places["orders.billing.retry-2"].tier == 2 and places["orders.billing.retry-2"].main == "orders"
    assert "orders.billing.dlq" not in places  # the DLQ is written, never read by the group
    assert Ladder("billing", ("orders",), 0, with_dlq=False).tier_topics("orders") == []
    with pytest.raises(ConfigError, match="longer than Kafka's 249"):
        Ladder("g", ("x" * 240,), 1, with_dlq=True)


def test_client_config_drops_consumer_only_settings() -> None:
    conf = {"bootstrap.servers": "b", "group.id": "g", "auto.offset.reset": "earliest", "security.protocol": "SSL",
            "enable.auto.commit": False, "max.poll.interval.ms": 6000, "session.timeout.ms": 6000}
    assert client_config(conf) == {"bootstrap.servers": "b", "security.protocol": "SSL"}
    # The group-less readers (redrive_topic, the ordering scan) assign partitions themselves: a
    # KIP-848 group's settings are not theirs.
    kip848 = {"bootstrap.servers": "b", "group.id": "g", "group.protocol": "consumer", "group.remote.assignor": "range",
              "group.instance.id": "i"}
    assert client_config(kip848) == {"bootstrap.servers": "b"}


@pytest.mark.parametrize(
    ("settings", "cooperative"),
    [
        ({}, False),  # librdkafka's default assignors: range,roundrobin
        ({"partition.assignment.strategy": "range"}, False),
        ({"partition.assignment.strategy": "roundrobin"}, False),
        ({"partition.assignment.strategy": "cooperative-sticky"}, True),
        ({"partition.assignment.strategy": " Cooperative-Sticky "}, True),
        ({"group.protocol": "classic", "partition.assignment.strategy": "range, roundrobin"}, False),
        ({"group.protocol": "consumer"}, True),
        ({"group.protocol": "CONSUMER", "group.remote.assignor": "range"}, True),
        ({"group.protocol": "consumer", "group.remote.assignor": "uniform"}, True),
    ],
)
def test_the_rebalance_protocol_follows_group_protocol_then_the_assignors(
    settings: dict[str, Any], cooperative: bool
) -> None:
    assert is_cooperative({**CONF, **settings}) is cooperative


def test_error_message_is_capped_on_a_character_boundary() -> None:
    text = "é" * 1000  # 2 bytes each
    capped = cap_utf8(text)
    assert len(capped) <= ERROR_MESSAGE_MAX
    assert capped.decode("utf-8") == "é" * (ERROR_MESSAGE_MAX // 2)
    assert cap_utf8("short") == b"short"
    assert error_class(TimeoutError("x")) == "builtins.TimeoutError"
    assert error_class(ConfigError("x")) == "outbox.errors.ConfigError"


def test_offsets_wait_for_hops_and_move_past_done_messages() -> None:
    t = OffsetTracker()
    tp = ("orders", 0)
    t.done(tp, 0)
    t.done(tp, 1)
    assert t.committable() == [(tp, 2)]
    t.wait(tp, 2, token=7)
    t.done(tp, 3)
    t.done(tp, 4)
    assert t.committable() == []  # still 2: held at the waiting hop
    t.wait(tp, 5, token=8)
    t.resolve(8)
    assert t.committable() == []  # still 2: nothing moved
    t.resolve(7)
    assert t.committable() == [(tp, 6)]
    assert t.waiting_hops == 0
    t.resolve(99)  # unknown token: ignored


def test_offsets_never_move_backwards_and_revoked_partitions_are_forgotten() -> None:
    t = OffsetTracker()
    a, b = ("orders", 0), ("orders", 1)
    t.wait(a, 10, token=1)
    t.done(a, 8)  # an earlier message reported late: the position stays after 10
    t.done(b, 3)
    assert sorted(t.committable()) == [(a, 10), (b, 4)]
    t.forget([a])
    assert t.waiting_hops == 0
    t.resolve(1)
    assert t.committable() == []
    t.wait(b, 4, token=2)
    t.wait(b, 5, token=3)
    t.resolve_all()
    assert t.committable() == [(b, 6)]


def test_scheduler_pops_due_holds_in_time_order_and_forgets_revoked() -> None:
    s = PauseScheduler()
    s.hold(("t", 0), 5, due=100.0)
    s.hold(("t", 1), 7, due=50.0)
    s.hold(("t", 2), 9, due=75.0)
    assert s.next_due() == 50.0
    assert [tp for tp, _ in s.pop_due(80.0)] == [("t", 1), ("t", 2)]
    s.hold(("t", 0), 6, due=200.0)  # replaced: the old due time must not fire
    assert s.pop_due(150.0) == []
    assert s.next_due() == 200.0
    assert s.forget([("t", 0), ("t", 9)]) == [("t", 0)]
    assert s.next_due() is None and len(s) == 0


def test_circuit_opens_after_consecutive_failures_probes_and_closes() -> None:
    from outbox.consumer.circuit import CircuitState, MainTopicBreaker, MainTopicCircuit

    c = MainTopicBreaker(MainTopicCircuit(consecutive_failures=3, reset_timeout=10))
    for now in (1.0, 2.0):
        c.failure(now)
    c.success()  # resets the run
    c.failure(3.0)
    c.failure(4.0)
    assert c.state is CircuitState.CLOSED and not c.blocks(4.0)
    c.failure(5.0)
    assert c.state is CircuitState.OPEN and c.blocks(14.9) and c.opened == 1
    assert not c.blocks(15.0) and c.state is CircuitState.HALF_OPEN
    c.failure(15.1)  # the probe failed
    assert c.state is CircuitState.OPEN and c.open_until == 25.1 and c.opened == 2
    assert not c.blocks(25.1)
    c.success()
    assert c.state is CircuitState.CLOSED


def test_circuit_opens_on_a_failure_rate_over_its_window() -> None:
    from outbox.consumer.circuit import CircuitState, MainTopicBreaker, MainTopicCircuit

    c = MainTopicBreaker(MainTopicCircuit(consecutive_failures=None, failure_rate=0.5, window=10, reset_timeout=1))
    for i in range(9):
        c.failure(float(i)) if i % 2 else c.success()
    assert c.state is CircuitState.CLOSED  # 4 of 9: the window is not full yet
    c.failure(9.0)  # 5 of 10
    assert c.state is CircuitState.OPEN
    with pytest.raises(ConfigError, match="needs consecutive_failures or failure_rate"):
        MainTopicCircuit(consecutive_failures=None)
    with pytest.raises(ConfigError, match=r"failure_rate is a fraction in \(0, 1\], got 2"):
        MainTopicCircuit(failure_rate=2)


def test_key_order_parks_behind_the_earliest_entry_and_releases_when_every_copy_left() -> None:
    order = KeyOrder()
    main = ("orders", 0)
    assert order.blocker(main, b"k", 5) is None
    order.entered(main, b"k", 5, 1)  # offset 5 failed: retry-1
    assert order.blocker(main, b"k", 9) == (5, 1)
    assert order.blocker(main, b"k", 5) is None, "a message never waits for itself"
    assert order.blocker(main, b"other", 9) is None and order.blocker(("orders", 1), b"k", 9) is None
    order.entered(main, b"k", 9, 1)  # 9 parked behind it
    order.moved(main, b"k", 5, 2)  # 5 failed again: retry-2
    assert order.blocker(main, b"k", 9) == (5, 2), "the parked one follows it into retry-2"
    assert order.contains(main, b"k", 9) and len(order) == 1
    order.left(main, b"k", 5)
    assert order.blocker(main, b"k", 9) is None and order.blocker(main, b"k", 12) == (9, 1)
    order.left(main, b"k", 9)
    order.left(main, b"k", 9)  # an unknown copy (a redriven dead letter) changes nothing
    assert len(order) == 0 and order.blocker(main, b"k", 12) is None


def test_key_order_counts_copies_found_by_a_scan_and_forgets_revoked_partitions() -> None:
    order = KeyOrder()
    main = ("orders", 3)
    # A hop from retry-1 to retry-2 whose retry-1 offset was not committed: two copies of offset 7.
    order.entered(main, b"k", 7, 2, scanned=True)
    order.entered(main, b"k", 7, 1, scanned=True)
    assert order.blocker(main, b"k", 8) == (7, 2), "a scan takes the highest tier as the latest copy"
    order.left(main, b"k", 7)
    assert order.blocker(main, b"k", 8) == (7, 2), "one copy is still to be read"
    order.left(main, b"k", 7)
    assert order.blocker(main, b"k", 8) is None
    order.entered(main, b"k", 1, 1)
    order.forget([main])
    assert len(order) == 0


def test_an_outbox_re_send_of_a_hop_leaves_the_consumer_counters_alone() -> None:
    main = Message(topic="orders", partition=2, offset=40, key=b"k", value=b"v", headers=[("app", b"1")])
    hop, msg_id, _ = failure_headers(main, group="billing", attempt=1, exc=TimeoutError("x"), due_at_s=5.0,
                                     ids=IdGenerator())
    # Kafka was down for the hop: the producer stored it and its drain re-sent it (third send).
    resent = for_resend(hop, msg_id=msg_id, attempt=3, first_failed_at=1.0, last_error="_MSG_TIMED_OUT")
    in_tier = Message(topic="orders.billing.retry-1", partition=2, offset=7, key=b"k", value=b"v", headers=resent)
    assert H.find_text(resent, H.ATTEMPT) == "1" and H.find_text(resent, "outbox-attempt") == "3"
    assert H.find_text(resent, H.DUE_AT) == "5000" and H.find_text(resent, H.ORIGINAL_OFFSET) == "40"
    pos = ladder_position(in_tier)
    assert (pos.origin_partition, pos.origin_offset, pos.parked_attempts) == (2, 40, None)
    # Its next hop counts on from the consumer's header and drops the previous publish's metadata.
    nxt, same_id, origin = failure_headers(in_tier, group="billing", attempt=2, exc=TimeoutError("y"), due_at_s=None,
                                           ids=IdGenerator())
    names = [h for h, _ in nxt]
    assert same_id == msg_id and (origin.topic, origin.partition, origin.offset) == ("orders", 2, 40)
    assert H.find_text(nxt, H.ATTEMPT) == "2" and names.count(H.ATTEMPT) == 1
    assert not {"outbox-attempt", "outbox-first-failed-at", "outbox-last-error"} & set(names)
    assert names[0] == "app"


def test_a_parked_message_counts_its_own_attempts_and_keeps_its_last_failure() -> None:
    failed = failure_headers(Message(topic="orders", partition=0, offset=9, key=b"k", value=b"v"), group="g",
                             attempt=1, exc=ValueError("boom"), due_at_s=1.0, ids=IdGenerator())[0]
    in_tier = Message(topic="orders.g.retry-1", partition=0, offset=3, key=b"k", value=b"v", headers=failed)
    parked, _, _ = failure_headers(in_tier, group="g", attempt=1, exc=None, due_at_s=None, ids=IdGenerator(),
                                   parked_behind=4)
    assert H.find_text(parked, H.PARKED_BEHIND) == "4" and H.find_text(parked, H.DUE_AT) is None
    assert H.find_text(parked, H.ERROR_CLASS) == "builtins.ValueError" and H.find_text(parked, H.ATTEMPT) == "1"
    pos = ladder_position(Message(topic="orders.g.retry-3", partition=0, offset=1, key=b"k", headers=parked))
    assert (pos.origin_offset, pos.parked_attempts) == (9, 1)
