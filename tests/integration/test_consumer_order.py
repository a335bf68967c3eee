"""ordering="key" against the real cluster: per-key order across retries, and across a rebalance."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient

from outbox import ResilientConsumer, RetryTopics
from outbox.consumer import headers as H
from outbox.testing import KafkaCluster

from ..group_protocols import group_settings
from .test_consumer import committed, group_name, header, running, wait_until


def produce_keyed(bootstrap: str, topic: str, keys: int, per_key: int, first: int = 0) -> list[tuple[str, int]]:
    """`per_key` messages for each of `keys` keys, interleaved; value ``k<i>:<seq>``, key ``k<i>``."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all", "enable.idempotence": True})
    sent = []
    for seq in range(first, first + per_key):
        for k in range(keys):
            p.produce(topic, f"k{k}:{seq}".encode(), key=f"k{k}".encode())
            sent.append((f"k{k}", seq))
    assert p.flush(30) == 0
    return sent


def parse(msg: Message) -> tuple[str, int]:
    key, seq = (msg.value() or b"").decode().split(":")
    return key, int(seq)


def first_occurrence_order(log: list[tuple[str, int]]) -> dict[str, list[int]]:
    """Each key's messages in the order the handler first succeeded with them."""
    out: dict[str, list[int]] = {}
    for key, seq in log:
        got = out.setdefault(key, [])
        if seq not in got:
            got.append(seq)
    return out


def test_key_order_is_kept_across_retries_while_other_keys_flow(
    kafka_bootstrap: str, make_topic: Callable[..., str], consume_all: Callable[..., list[Any]], tmp_path: Path,
    group_protocol: str,
) -> None:
    topic = make_topic(partitions=2)
    group = group_name()
    sent = produce_keyed(kafka_bootstrap, topic, keys=8, per_key=6)
    # How many times each message fails before it succeeds (absent: never fails; 99: always).
    fails = {("k0", 0): 2, ("k1", 0): 1, ("k1", 2): 1, ("k2", 3): 99}
    tries: dict[tuple[str, int], int] = {}
    log: list[tuple[str, int]] = []
    succeeded: dict[tuple[str, int], Message] = {}

    def handle(msg: Message) -> None:
        m = parse(msg)
        tries[m] = tries.get(m, 0) + 1
        if tries[m] <= fails.get(m, 0):
            raise TimeoutError(f"{m} not yet")
        log.append(m)
        succeeded[m] = msg

    consumer = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(group_protocol)},
        topics=[topic],
        handler=handle,
        strategy=RetryTopics(delays=[0.5, 1.0, 0.5]),
        ordering="key",
        outbox=f"sqlite:///{tmp_path / 'o.db'}",
    )
    with running(consumer) as c:
        wait_until(lambda: len(succeeded) == len(sent) - 1 and c.stats()["dead"] == 1, 60, "all but k2:3 handled")
        wait_until(lambda: c.stats()["keys_waiting"] == 0 and c.stats()["waiting_hops"] == 0, 30, "the ladder empty")
        time.sleep(1.0)  # a message handled twice, or late, would show up now
        stats = c.stats()

    order = first_occurrence_order(log)
    assert len(log) == len(sent) - 1, "no message handled twice"
    for k in range(8):
        want = [s for s in range(6) if (f"k{k}", s) != ("k2", 3)]
        assert order[f"k{k}"] == want, f"k{k} handled in the order {order[f'k{k}']}"
    # Non-blocking: every message of the keys with no failure was handled before k0's first
    # message left the ladder (it waits 1.5 s in the tiers).
    first_k0 = log.index(("k0", 0))
    assert all(log.index((f"k{k}", s)) < first_k0 for k in range(3, 8) for s in range(6))
    # Each message counts its own attempts, parked or not: k1:2 was parked behind k1:0, failed on
    # its first attempt, and succeeded on its second; k2:3 got every tier's attempt (1 + 3).
    assert header(succeeded[("k0", 0)], H.ATTEMPT) == "2"
    assert header(succeeded[("k1", 0)], H.ATTEMPT) == "1"
    assert header(succeeded[("k1", 2)], H.ATTEMPT) == "1"
    assert tries[("k2", 3)] == 4
    dlq = consume_all(f"{topic}.{group}.dlq", 1)
    assert [m.value() for m in dlq] == [b"k2:3"] and header(dlq[0], H.ATTEMPT) == "4"
    assert stats["parked"] >= 5 + 2 + 2, "k0's, k1's and k2's later messages were parked"
    assert sum(committed(kafka_bootstrap, group, topic, 2)) == len(sent)


def test_key_order_survives_a_second_consumer_joining_mid_ladder(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    topic = make_topic(partitions=4)
    group = group_name()
    keys, per_key = 20, 8
    # Half of each key's messages now; the other half once B has joined, while earlier ones wait
    # in the tiers: a new owner that did not know what waits there would handle them at once.
    sent = produce_keyed(kafka_bootstrap, topic, keys=keys, per_key=per_key // 2)
    # The first message of every even key fails twice, then succeeds; the third of every key divisible by 3 once.
    fails = {(f"k{k}", 0): 2 for k in range(0, keys, 2)} | {(f"k{k}", 2): 1 for k in range(0, keys, 3)}
    tries: dict[tuple[str, int], int] = {}
    log: list[tuple[str, int, str]] = []
    lock = threading.Lock()

    def handler(name: str) -> Callable[[Message], None]:
        def handle(msg: Message) -> None:
            m = parse(msg)
            with lock:
                tries[m] = tries.get(m, 0) + 1
                if tries[m] <= fails.get(m, 0):
                    raise TimeoutError(f"{m} not yet")
                log.append((*m, name))

        return handle

    def make(name: str) -> ResilientConsumer:
        return ResilientConsumer(
            {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(group_protocol),
             "client.id": name},
            topics=[topic],
            handler=handler(name),
            strategy=RetryTopics(delays=[6.0, 6.0]),
            ordering="key",
            outbox=f"sqlite:///{tmp_path / (name + '.db')}",
        )

    def handled() -> set[tuple[str, int]]:
        with lock:
            return {(k, s) for k, s, _ in log}

    a = make("A")
    with running(a):
        wait_until(lambda: a.stats()["parked"] >= 20 and a.stats()["keys_waiting"] >= 10, 60, "keys in the ladder")
        waiting_when_b_joined = a.stats()["keys_waiting"]
        assert len(handled()) < len(sent), "the rebalance must come while messages wait in the tiers"
        b = make("B")
        with running(b):
            wait_until(lambda: b.stats()["assigned"] >= 1 and a.stats()["assigned"] >= 2, 60, "B joined")
            sent += produce_keyed(kafka_bootstrap, topic, keys=keys, per_key=per_key // 2, first=per_key // 2)
            waiting_after_rebalance = a.stats()["keys_waiting"] + b.stats()["keys_waiting"]
            assert waiting_after_rebalance >= 5, "the new owners knew of keys waiting in the tiers"
            wait_until(lambda: handled() == set(sent), 90, "every message handled")
            b_stats = b.stats()
        wait_until(lambda: a.stats()["keys_waiting"] == 0 and a.stats()["waiting_hops"] == 0, 30, "A's ladder empty")
        time.sleep(1.0)
        a_stats = a.stats()

    with lock:
        order = first_occurrence_order([(k, s) for k, s, _ in log])
        by_b = sum(1 for *_, name in log if name == "B")
    for k in range(keys):
        assert order[f"k{k}"] == list(range(per_key)), f"k{k} handled in the order {order[f'k{k}']}"
    assert waiting_when_b_joined >= 10
    assert by_b > 0, "B took over partitions and handled messages"
    # The new owners learnt what was waiting from the tier partitions, not from memory.
    assert a_stats["scanned"] + b_stats["scanned"] > 0
    assert sum(committed(kafka_bootstrap, group, topic, 4)) == len(sent)


def test_key_order_is_kept_when_hops_and_parkings_go_through_the_outbox(
    chaos_cluster: KafkaCluster, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    bootstrap = chaos_cluster.bootstrap_servers
    topic = make_topic(partitions=3)
    group = group_name()
    keys, per_key = 30, 6
    sent = produce_keyed(bootstrap, topic, keys=keys, per_key=per_key)
    brokers_down = threading.Event()
    main_seen = [0]
    tries: dict[tuple[str, int], int] = {}
    log: list[tuple[str, int]] = []

    def handle(msg: Message) -> None:
        m = parse(msg)
        if msg.topic() == topic:
            main_seen[0] += 1
            if main_seen[0] == 20:
                brokers_down.wait(60)  # the rest of the batch hops and parks while no broker is up
        tries[m] = tries.get(m, 0) + 1
        if m[1] == 0 and tries[m] == 1:  # every key's first message fails once
            raise TimeoutError("downstream down")
        log.append(m)

    consumer = ResilientConsumer(
        {"bootstrap.servers": bootstrap, "group.id": group,
         **group_settings(group_protocol, max_poll_interval_ms=120000)},
        topics=[topic],
        handler=handle,
        strategy=RetryTopics(delays=[0.2]),
        ordering="key",
        outbox=f"sqlite:///{tmp_path / 'o.db'}",
        producer_config={"message.timeout.ms": 2000},
    )
    with running(consumer) as c:
        wait_until(lambda: main_seen[0] >= 20, 120, "20 main-topic messages handled")
        chaos_cluster.stop_all()
        brokers_down.set()
        wait_until(lambda: c.stats()["producer"]["pending"] > 0, 60, "hops and parkings in the outbox")
        outboxed = c.stats()["producer"]["outboxed"]
        chaos_cluster.start_all()
        wait_until(lambda: set(log) == set(sent), 120, "every message handled")
        # The outage outlived the member's session: its offsets commit once it has rejoined and
        # read again what it had not committed (a source commits only once Kafka has its hop).
        deadline = time.monotonic() + 90
        while sum(committed(bootstrap, group, topic, 3)) != len(sent) and time.monotonic() < deadline:
            time.sleep(1.0)
        wait_until(lambda: c.stats()["keys_waiting"] == 0 and c.stats()["waiting_hops"] == 0, 60, "the ladder empty")
    assert outboxed > 0
    order = first_occurrence_order(log)
    for k in range(keys):
        assert order[f"k{k}"] == list(range(per_key)), f"k{k} handled in the order {order[f'k{k}']}"
    assert sum(committed(bootstrap, group, topic, 3)) == len(sent)


def assigned_members(bootstrap: str, group: str) -> int:
    """How many members of `group` the coordinator has given partitions to."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    try:
        desc = admin.describe_consumer_groups([group], request_timeout=5)[group].result()
    except KafkaException:
        return 0
    return sum(1 for m in desc.members if m.assignment and m.assignment.topic_partitions)


def outliving_session(group_protocol: str) -> dict[str, Any]:
    """Group settings whose session outlives a short outage, so the member keeps its assignment
    across it. group.protocol=consumer takes its session from the broker (6 s in the test
    cluster) and no consumer setting lengthens it: while every broker is stopped no coordinator
    runs to expire it, and the member heartbeats again as soon as its coordinator is back."""
    if group_protocol == "classic":
        return {"session.timeout.ms": 45000, "heartbeat.interval.ms": 1000}
    return group_settings(group_protocol)


def test_an_assignment_met_by_an_outage_waits_for_its_ladder_and_keeps_key_order(
    chaos_cluster: KafkaCluster, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    bootstrap = chaos_cluster.bootstrap_servers
    topic = make_topic(partitions=2)
    group = group_name()
    sent = produce_keyed(bootstrap, topic, keys=6, per_key=4)
    tries: dict[tuple[str, int], int] = {}
    log: list[tuple[str, int]] = []

    def handle(msg: Message) -> None:
        m = parse(msg)
        tries[m] = tries.get(m, 0) + 1
        if m[1] == 0 and tries[m] == 1:  # every key's first message goes through the ladder once
            raise TimeoutError("downstream down")
        log.append(m)

    consumer = ResilientConsumer(
        {"bootstrap.servers": bootstrap, "group.id": group, **outliving_session(group_protocol)},
        topics=[topic],
        handler=handle,
        strategy=RetryTopics(delays=[0.2]),
        ordering="key",
        outbox=f"sqlite:///{tmp_path / 'o.db'}",
    )
    # The group is joined in librdkafka's background; the assignment is handed to the application
    # (and its ladder scanned) at the first poll, which comes only once every broker is stopped.
    wait_until(lambda: assigned_members(bootstrap, group) == 1, 60, "the group to assign the partitions")
    chaos_cluster.stop_all()
    try:
        with running(consumer) as c:
            wait_until(lambda: c.stats()["unscanned"] == 4, 60, "the assignment paused for want of its ladder")
            assert log == [] and tries == {}, "no message handed out before the ladder is read"
            chaos_cluster.start_all()
            wait_until(lambda: len(log) == len(sent), 120, "every message handled")
            wait_until(lambda: c.stats()["keys_waiting"] == 0, 30, "the ladder empty")
            stats = c.stats()
    finally:
        chaos_cluster.start_all()
    assert sorted(log) == sorted(sent), "each message handled once"
    order = first_occurrence_order(log)
    for k in range(6):
        assert order[f"k{k}"] == [0, 1, 2, 3], f"k{k} handled in the order {order[f'k{k}']}"
    assert stats["unscanned"] == 0 and stats["parked"] >= 6 * 3
