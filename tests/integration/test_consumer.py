"""ResilientConsumer against the real cluster: the retry ladder, dead letters, crashes, rebalances, outages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Message, Producer, TopicPartition

from outbox import (
    ConfigError,
    DeadLetter,
    Ignore,
    MainTopicCircuit,
    ResilientConsumer,
    RetryInPlace,
    RetryPolicy,
    RetryTopics,
)
from outbox.consumer import headers as H
from outbox.stores import open_outbox
from outbox.testing import KafkaCluster

from .. import waiting
from ..group_protocols import group_settings

WORKER = Path(__file__).with_name("consumer_worker.py")


def group_name() -> str:
    return f"g{uuid.uuid4().hex[:8]}"


def produce(bootstrap: str, topic: str, values: list[bytes], *, partition: int | None = None) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all"})
    for i, v in enumerate(values):
        if partition is None:
            p.produce(topic, v, key=b"k%d" % i)
        else:
            p.produce(topic, v, key=b"k%d" % i, partition=partition)
    assert p.flush(30) == 0


# Errors raised by a consumer loop running in a thread (see `running`): waits fail on them at once.
LOOP_ERRORS: list[BaseException] = []


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    """`waiting.wait_until`, failing at once if the consumer loop raised."""

    def loop_alive() -> None:
        if LOOP_ERRORS:
            raise AssertionError(f"the consumer loop raised {LOOP_ERRORS[0]!r} while waiting until {what}")

    waiting.wait_until(cond, timeout, what, every=0.1, check=loop_alive)


@contextmanager
def running(consumer: ResilientConsumer) -> Iterator[ResilientConsumer]:
    """Run the consumer's loop in a thread; stop and close it afterwards; re-raise a loop error."""
    errors = LOOP_ERRORS
    errors.clear()

    def loop() -> None:
        try:
            consumer.run()
        except BaseException as exc:  # the test must hear of it
            errors.append(exc)

    t = threading.Thread(target=loop, name="consumer-under-test", daemon=True)
    t.start()
    try:
        yield consumer
    finally:
        consumer.stop()
        t.join(30)
        consumer.close()
    assert not t.is_alive(), "the consumer loop did not stop"
    assert not errors, f"the consumer loop raised {errors[0]!r}"


def committed(bootstrap: str, group: str, topic: str, partitions: int) -> list[int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        got = c.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
        return [tp.offset for tp in got]
    finally:
        c.close()


def header(msg: Message | DeadLetter, name: str) -> str | None:
    hs = msg.headers() if isinstance(msg, Message) else msg.headers
    found = [v for h, v in (hs or []) if h == name]
    assert len(found) <= 1, f"header {name} repeated: {found}"
    return None if not found or found[0] is None else found[0].decode("utf-8")


# -- RetryTopics ------------------------------------------------------------------------------


def test_poison_message_reaches_the_dlq_with_every_header_while_the_partition_flows(
    kafka_bootstrap: str, make_topic: Callable[..., str], consume_all: Callable[..., list[Any]], tmp_path: Path,
    group_protocol: str,
) -> None:
    topic = make_topic(partitions=1)
    group = group_name()
    good = [b"good-%05d" % i for i in range(10_000)]
    values = good[:100] + [b"poison"] + good[100:]
    produce(kafka_bootstrap, topic, values, partition=0)
    handled: list[bytes] = []
    attempts: list[tuple[str, float]] = []
    dead: list[DeadLetter] = []
    next_good_at: list[float] = []

    def handle(msg: Message) -> None:
        if msg.value() == b"poison":
            attempts.append((msg.topic() or "", time.time()))
            raise TimeoutError("downstream said no " + "x" * 2000)
        if msg.value() == good[100]:
            next_good_at.append(time.time())
        handled.append(msg.value() or b"")

    consumer = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(group_protocol)},
        topics=[topic],
        handler=handle,
        strategy=RetryTopics(delays=[0.5, 1.0]),
        dead_letters="both",
        outbox=f"sqlite:///{tmp_path / 'c.db'}",
        on_dead_letter=dead.append,
    )
    with running(consumer) as c:
        wait_until(lambda: len(dead) == 1 and len(handled) == 10_000, 90, "all good handled, poison dead")
        wait_until(lambda: c.stats()["waiting_hops"] == 0, 30, "the DLQ publish is durable")
        stats = c.stats()
    # Every good message once, in order: the poison did not block its partition.
    assert handled == good
    assert [t for t, _ in attempts] == [topic, f"{topic}.{group}.retry-1", f"{topic}.{group}.retry-2"]
    assert stats["handled"] == 10_000 and stats["retried"] == 2 and stats["dead"] == 1
    # The good message right after the poison was not held back until the poison's retries.
    assert next_good_at[0] < attempts[1][1]
    dlq = consume_all(f"{topic}.{group}.dlq", 1)
    assert len(dlq) == 1
    m = dlq[0]
    assert m.value() == b"poison" and m.key() == b"k100" and m.partition() == 0
    assert header(m, H.ORIGINAL_TOPIC) == topic
    assert header(m, H.ORIGINAL_PARTITION) == "0"
    assert header(m, H.ORIGINAL_OFFSET) == "100"
    assert header(m, H.ORIGINAL_TIMESTAMP) is not None and int(header(m, H.ORIGINAL_TIMESTAMP) or 0) > 0
    assert header(m, H.GROUP) == group
    assert header(m, H.ATTEMPT) == "3"
    assert header(m, H.DUE_AT) is None  # a dead letter is not due anywhere
    assert header(m, H.ERROR_CLASS) == "builtins.TimeoutError"
    msg_text = header(m, H.ERROR_MESSAGE) or ""
    assert msg_text.startswith("downstream said no xxx") and len(msg_text.encode()) == H.ERROR_MESSAGE_MAX
    assert header(m, H.SPRING_ORIGINAL_TOPIC) == topic
    assert header(m, "outbox-id")
    # The same dead letter in the outbox store, aimed at the group's first tier for a replay.
    store = open_outbox(f"sqlite:///{tmp_path / 'c.db'}")
    try:
        rows = store.list_dead()
    finally:
        store.close()
    assert len(rows) == 1
    row = rows[0]
    assert row.topic == f"{topic}.{group}.retry-1" and row.value == b"poison" and row.attempts == 3
    assert row.last_error is not None and row.last_error.startswith("builtins.TimeoutError (consumer): downstream")
    assert dead[0].id == row.id and dead[0].topic == topic and dead[0].msg_id == header(m, "outbox-id")
    # Offsets: past everything, on the main topic and both tiers.
    assert committed(kafka_bootstrap, group, topic, 1) == [10_001]
    assert committed(kafka_bootstrap, group, f"{topic}.{group}.retry-1", 1) == [1]
    assert committed(kafka_bootstrap, group, f"{topic}.{group}.retry-2", 1) == [1]


def test_fails_twice_then_succeeds_never_before_its_delays(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    topic = make_topic(partitions=3)
    group = group_name()
    values = [b"m%03d" % i for i in range(60)]
    produce(kafka_bootstrap, topic, values)
    delays = [0.5, 1.5]
    failed_at: dict[tuple[bytes, int], float] = {}
    successes: dict[bytes, list[tuple[str, float, Message]]] = {}
    tier = {topic: 0, f"{topic}.{group}.retry-1": 1, f"{topic}.{group}.retry-2": 2}

    def handle(msg: Message) -> None:
        now = time.time()
        n = tier[msg.topic() or ""]
        if n < 2:
            failed_at[(msg.value() or b"", n)] = now
            raise ConnectionError("try later")
        successes.setdefault(msg.value() or b"", []).append((msg.topic() or "", now, msg))

    consumer = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(group_protocol)},
        topics=[topic],
        handler=handle,
        strategy=RetryTopics(delays=delays),
        retry_on=(ConnectionError,),
        outbox=f"sqlite:///{tmp_path / 'c.db'}",
    )
    with running(consumer):
        wait_until(lambda: len(successes) == 60, 60, "every message succeeded on its second retry")
        time.sleep(0.5)  # any duplicate would show up now
    assert sorted(successes) == values
    for v, got in successes.items():
        assert len(got) == 1, f"{v!r} handled {len(got)} times"
        _, at, msg = got[0]
        assert at - failed_at[(v, 1)] >= delays[1], f"{v!r} handled {at - failed_at[(v, 1)]:.3f}s after retry-1"
        assert failed_at[(v, 1)] - failed_at[(v, 0)] >= delays[0]
        # The due time carried by the header is the failure time plus the tier's delay (in ms).
        due = int(header(msg, H.DUE_AT) or 0) / 1000
        assert due >= failed_at[(v, 1)] + delays[1] - 0.001
        assert at >= due
        assert header(msg, H.ATTEMPT) == "2"
        assert header(msg, H.ORIGINAL_TOPIC) == topic


def test_missing_tiers_with_creation_off_is_a_config_error(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = make_topic(partitions=2)
    group = group_name()
    try:
        ResilientConsumer(
            {"bootstrap.servers": kafka_bootstrap, "group.id": group},
            topics=[topic],
            handler=print,
            strategy=RetryTopics(delays=[1, 2]),
            create_topics=False,
            outbox=f"sqlite:///{tmp_path / 'c.db'}",
        )
    except ConfigError as exc:
        assert str(exc) == (
            f"tier topics missing: {topic}.{group}.retry-1, {topic}.{group}.retry-2, {topic}.{group}.dlq; "
            "create them with the partition count of their main topic, or pass create_topics=True"
        )
    else:
        raise AssertionError("no ConfigError")
    try:
        ResilientConsumer(
            {"bootstrap.servers": kafka_bootstrap, "group.id": group},
            topics=["no-such-topic-" + uuid.uuid4().hex[:6]],
            handler=print,
            outbox=f"sqlite:///{tmp_path / 'c.db'}",
        )
    except ConfigError as exc:
        assert "does not exist: create it before starting the consumer" in str(exc)
    else:
        raise AssertionError("no ConfigError")
    # Created with the source's partition count when allowed.
    c = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group},
        topics=[topic],
        handler=print,
        strategy=RetryTopics(delays=[1]),
        outbox=f"sqlite:///{tmp_path / 'c.db'}",
    )
    c.close()
    from confluent_kafka.admin import AdminClient

    md = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=10)
    assert len(md.topics[f"{topic}.{group}.retry-1"].partitions) == 2
    assert len(md.topics[f"{topic}.{group}.dlq"].partitions) == 2


def test_kill_9_in_the_middle_of_the_ladder_then_restart_loses_nothing(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    topic = make_topic(partitions=3)
    group = group_name()
    values = [f"fail-{i:03d}" if i % 5 == 0 else f"ok-{i:03d}" for i in range(300)]
    produce(kafka_bootstrap, topic, [v.encode() for v in values])
    log_path = tmp_path / "handled.log"
    # Delays long enough (2 s + 3 s) that the kill lands before any message finishes the ladder.
    args = [sys.executable, str(WORKER), kafka_bootstrap, topic, group, str(tmp_path / "c.db"), str(log_path), "2,3",
            json.dumps(group_settings(group_protocol))]

    def succeeded() -> set[str]:
        if not log_path.exists():
            return set()
        return {line.split()[0] for line in log_path.read_text().splitlines() if line}

    first = subprocess.Popen(args, stdout=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        # Kill once the good messages are through and the failing ones are on their way up the ladder.
        wait_until(lambda: sum(1 for v in succeeded() if v.startswith("ok")) == 240, 60, "the good messages handled")
        lines = log_path.read_text()
        assert ".retry-2" not in lines  # nobody finished the ladder yet: the kill lands in the middle
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        second = subprocess.Popen(args, stdout=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_until(lambda: succeeded() == set(values), 90, "every message handled after the restart")
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0
    finally:
        if first.poll() is None:
            first.kill()
    done = [line.split() for line in log_path.read_text().splitlines()]
    for value, t, _ in done:
        assert t.endswith(".retry-2") == value.startswith("fail"), (value, t)


# Classic eager (both assignors), classic incremental, and KIP-848 with each of the broker's assignors.
@pytest.mark.parametrize(
    "variant",
    ["classic:range", "classic:roundrobin", "classic:cooperative-sticky", "consumer:uniform", "consumer:range"],
)
def test_second_consumer_joins_then_is_killed_during_a_pause_nothing_stuck(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, variant: str
) -> None:
    topic = make_topic(partitions=4)
    group = group_name()
    values = [f"fail-{i:03d}" if i % 2 else f"ok-{i:03d}" for i in range(80)]
    produce(kafka_bootstrap, topic, [v.encode() for v in values])
    delay = 6.0
    successes: dict[str, list[tuple[float, float]]] = {}  # value → (handled at, due at)

    def handle(msg: Message) -> None:
        value = (msg.value() or b"").decode()
        if value.startswith("fail") and msg.topic() == topic:
            raise TimeoutError("later")
        due = int(header(msg, H.DUE_AT) or 0) / 1000
        successes.setdefault(value, []).append((time.time(), due))

    consumer = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(variant)},
        topics=[topic],
        handler=handle,
        strategy=RetryTopics(delays=[delay]),
        outbox=f"sqlite:///{tmp_path / 'a.db'}",
    )
    log_path = tmp_path / "b.log"
    with running(consumer) as c:
        wait_until(lambda: c.stats()["retried"] == 40 and c.stats()["held"] > 0, 30, "40 hops, tier partitions held")
        b = subprocess.Popen(
            [sys.executable, str(WORKER), kafka_bootstrap, topic, group, str(tmp_path / "b.db"), str(log_path),
             str(delay), json.dumps(group_settings(variant))],
            stdout=subprocess.PIPE,
        )
        try:
            assert b.stdout is not None and b.stdout.readline() == b"ready\n"
            wait_until(lambda: c.stats()["assigned"] >= 2, 30, "the second consumer joined (rebalance)")
            time.sleep(1.0)  # B holds its share of the tier partitions, paused
            b.send_signal(signal.SIGKILL)
            b.wait(10)
        finally:
            if b.poll() is None:
                b.kill()
        wait_until(lambda: c.stats()["assigned"] >= 3, 30, "B's partitions came back to A")
        handled_by_b = {line.split()[0] for line in log_path.read_text().splitlines()} if log_path.exists() else set()
        wait_until(
            lambda: set(successes) | handled_by_b == set(values), 60, "every message handled, none stuck paused"
        )
        wait_until(lambda: c.stats()["held"] == 0, 10, "no partition left paused")
    for value, got in successes.items():
        for at, due in got:
            assert at >= due, f"{value} handled {due - at:.3f}s before it was due"


def test_all_brokers_stopped_while_hops_are_published_they_land_in_the_outbox_then_their_tiers(
    chaos_cluster: KafkaCluster, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    bootstrap = chaos_cluster.bootstrap_servers
    topic = make_topic(partitions=3)
    group = group_name()
    values = [b"m%03d" % i for i in range(300)]
    produce(bootstrap, topic, values)
    brokers_down = threading.Event()
    main_seen: list[bytes] = []
    # retry-1: (value, consumer attempt header, the producer's outbox-attempt header); retry-2: the message.
    in_retry_1: list[tuple[bytes, str | None, str | None]] = []
    succeeded: dict[bytes, Message] = {}

    def handle(msg: Message) -> None:
        value = msg.value() or b""
        if msg.topic() == topic:
            main_seen.append(value)
            if len(main_seen) == 50:
                brokers_down.wait(60)  # the remaining prefetched messages hop while no broker is up
            raise TimeoutError("downstream down")
        if msg.topic() == f"{topic}.{group}.retry-1":
            in_retry_1.append((value, header(msg, H.ATTEMPT), header(msg, "outbox-attempt")))
            raise TimeoutError("still down")
        succeeded[value] = msg

    consumer = ResilientConsumer(
        {"bootstrap.servers": bootstrap, "group.id": group,
         **group_settings(group_protocol, max_poll_interval_ms=120000)},
        topics=[topic],
        handler=handle,
        strategy=RetryTopics(delays=[0.2, 0.2]),
        outbox=f"sqlite:///{tmp_path / 'c.db'}",
        producer_config={"message.timeout.ms": 2000},
    )
    with running(consumer) as c:
        wait_until(lambda: len(main_seen) >= 50, 120, "50 messages handled")
        chaos_cluster.stop_all()
        brokers_down.set()
        wait_until(lambda: c.stats()["producer"]["pending"] > 0, 60, "hops in the outbox")
        wait_until(lambda: c.stats()["retried"] >= 250, 60, "the prefetched messages hopped while brokers were down")
        outboxed = c.stats()["producer"]["outboxed"]
        chaos_cluster.start_all()
        wait_until(lambda: set(succeeded) == set(values), 120, "every message handled from its last tier")
        wait_until(lambda: c.stats()["producer"]["pending"] == 0, 60, "the outbox drained")
    assert outboxed > 0
    assert sum(committed(bootstrap, group, topic, 3)) == 300
    # The outbox's re-send stamps its own send counter (outbox-attempt) on a hop; the consumer's
    # handling counter is another header, which the re-send leaves alone.
    resent = [v for v, _, sends in in_retry_1 if sends is not None]
    assert resent, "some hops to retry-1 were re-sent from the outbox"
    assert {attempt for _, attempt, _ in in_retry_1} == {"1"}
    for value, msg in succeeded.items():
        assert header(msg, H.ATTEMPT) == "2", f"{value!r} reached retry-2 with attempt {header(msg, H.ATTEMPT)}"
        assert header(msg, H.ORIGINAL_TOPIC) == topic


# -- RetryInPlace and Ignore ------------------------------------------------------------------


def test_retry_in_place_forever_holds_one_partition_past_max_poll_interval_and_stays_in_the_group(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    topic = make_topic(partitions=2)
    group = group_name()
    produce(kafka_bootstrap, topic, [b"a-%d" % i for i in range(20)], partition=0)
    produce(kafka_bootstrap, topic, [b"b-%d" % i for i in range(20)], partition=1)
    handled: list[tuple[bytes, float]] = []
    fail_until = time.time() + 1e9
    tries: list[float] = []

    def handle(msg: Message) -> None:
        if msg.value() == b"a-5" and time.time() < fail_until:
            tries.append(time.time())
            raise TimeoutError("still down")
        handled.append((msg.value() or b"", time.time()))

    # max.poll.interval.ms must be >= session.timeout.ms; 6 s is the broker's minimum session.
    consumer = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group,
         **group_settings(group_protocol, max_poll_interval_ms=6000)},
        topics=[topic],
        handler=handle,
        strategy=RetryInPlace(RetryPolicy(initial_delay=0.3), forever=True),
        outbox=f"sqlite:///{tmp_path / 'c.db'}",
    )
    with running(consumer) as c:
        wait_until(lambda: sum(1 for v, _ in handled if v.startswith(b"b-")) == 20, 30, "partition 1 flowed")
        wait_until(lambda: bool(tries), 30, "a-5 failed once")
        started = tries[0]
        wait_until(lambda: time.time() - started > 9.0, 15, "9 s of retrying in place (max.poll.interval.ms 6 s)")
        assert [v for v, _ in handled if v.startswith(b"a-")] == [b"a-%d" % i for i in range(5)]
        fail_until = time.time()
        wait_until(lambda: sum(1 for v, _ in handled if v.startswith(b"a-")) == 20, 30, "partition 0 resumed")
        stats = c.stats()
    assert stats["assigned"] == 1 and stats["revoked"] == 0, stats  # never left the group
    assert [v for v, _ in handled if v.startswith(b"a-")] == [b"a-%d" % i for i in range(20)]  # order kept
    # Retried again and again while the loop kept polling, never sooner than the policy's 0.3 s.
    assert len(tries) >= 3 and all(b - a >= 0.3 for a, b in zip(tries, tries[1:], strict=False))
    assert stats["dead"] == 0 and stats["handled"] == 40
    assert committed(kafka_bootstrap, group, topic, 2) == [20, 20]


def test_retry_in_place_gives_up_to_the_dead_letters_when_the_policy_runs_out(
    kafka_bootstrap: str, make_topic: Callable[..., str], consume_all: Callable[..., list[Any]], tmp_path: Path,
    group_protocol: str,
) -> None:
    topic = make_topic(partitions=1)
    group = group_name()
    produce(kafka_bootstrap, topic, [b"x0", b"bad", b"x2"], partition=0)
    seen: list[bytes] = []

    def handle(msg: Message) -> None:
        seen.append(msg.value() or b"")
        if msg.value() == b"bad":
            raise TimeoutError("no")

    consumer = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(group_protocol)},
        topics=[topic],
        handler=handle,
        strategy=RetryInPlace(RetryPolicy(max_attempts=3, initial_delay=0.2)),
        outbox=f"sqlite:///{tmp_path / 'c.db'}",
    )
    with running(consumer) as c:
        wait_until(lambda: b"x2" in seen and c.stats()["waiting_hops"] == 0, 30, "x2 handled after the dead letter")
    assert seen == [b"x0", b"bad", b"bad", b"bad", b"x2"]
    dlq = consume_all(f"{topic}.{group}.dlq", 1)
    assert [m.value() for m in dlq] == [b"bad"] and header(dlq[0], H.ATTEMPT) == "3"
    assert committed(kafka_bootstrap, group, topic, 1) == [3]


def test_retry_in_place_attempt_count_survives_a_kill_9_and_a_new_owner(
    kafka_bootstrap: str, make_topic: Callable[..., str], consume_all: Callable[..., list[Any]], tmp_path: Path,
    group_protocol: str,
) -> None:
    """The count is committed with the offset after each failed attempt: a new owner goes on from it.

    What holds exactly: the new owner makes max_attempts minus the attempts whose commit completed,
    so at most one attempt more than the bound when the kill lands between an attempt and its commit.
    """
    topic = make_topic(partitions=1)
    group = group_name()
    produce(kafka_bootstrap, topic, [b"ok-0", b"fail-1", b"ok-2"], partition=0)
    log_path = tmp_path / "a.log"
    worker = subprocess.Popen(
        [sys.executable, str(WORKER), kafka_bootstrap, topic, group, str(tmp_path / "a.db"), str(log_path), "1",
         json.dumps(group_settings(group_protocol)), "in-place:6:0.3"],
        stdout=subprocess.PIPE,
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline() == b"ready\n"

        def tries_by_a() -> int:
            return sum(1 for line in log_path.read_text().splitlines() if line.startswith("fail-1 try"))

        wait_until(lambda: log_path.exists() and tries_by_a() >= 4, 60, "4 attempts by the first process")
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
    finally:
        if worker.poll() is None:
            worker.kill()
    a_tries = tries_by_a()
    seen: list[bytes] = []

    def handle(msg: Message) -> None:
        seen.append(msg.value() or b"")
        if msg.value() == b"fail-1":
            raise TimeoutError("still down")

    consumer = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(group_protocol)},
        topics=[topic],
        handler=handle,
        strategy=RetryInPlace(RetryPolicy(max_attempts=6, initial_delay=0.3)),
        outbox=f"sqlite:///{tmp_path / 'b.db'}",
    )
    with running(consumer) as c:  # joins once the killed member's session (6 s) has expired
        wait_until(lambda: b"ok-2" in seen and c.stats()["waiting_hops"] == 0, 60, "ok-2 handled after the dead letter")
    b_tries = seen.count(b"fail-1")
    assert 6 - a_tries <= b_tries <= 6 - a_tries + 1, f"{a_tries} attempts, then {b_tries} by the new owner"
    dlq = consume_all(f"{topic}.{group}.dlq", 1)
    assert [m.value() for m in dlq] == [b"fail-1"]
    assert header(dlq[0], H.ATTEMPT) == "6"
    assert committed(kafka_bootstrap, group, topic, 1) == [3]


def test_ignore_skips_and_counts(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    topic = make_topic(partitions=2)
    group = group_name()
    produce(kafka_bootstrap, topic, [b"%d" % i for i in range(50)])
    ok: list[bytes] = []

    def handle(msg: Message) -> None:
        if int(msg.value() or b"0") % 10 == 3:
            raise RuntimeError("bad data")
        ok.append(msg.value() or b"")

    consumer = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(group_protocol)},
        topics=[topic],
        handler=handle,
        strategy=Ignore(),
        outbox=f"sqlite:///{tmp_path / 'c.db'}",
    )
    with running(consumer) as c:
        wait_until(lambda: c.stats()["handled"] + c.stats()["ignored"] == 50, 30, "all 50 seen")
        stats = c.stats()
    assert stats["ignored"] == 5 and stats["handled"] == 45 and stats["dead"] == 0 and stats["retried"] == 0
    assert sorted(ok) == sorted(b"%d" % i for i in range(50) if i % 10 != 3)
    assert sum(committed(kafka_bootstrap, group, topic, 2)) == 50


def test_main_topic_circuit_opens_then_probes_and_closes(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    topic = make_topic(partitions=1)
    group = group_name()
    values = [b"%03d" % i for i in range(100)]
    produce(kafka_bootstrap, topic, values, partition=0)
    main_failures: list[bytes] = []
    succeeded: list[tuple[str, bytes]] = []

    def handle(msg: Message) -> None:
        # The downstream is down for the main topic's first 6 attempts: 5 open the circuit, the
        # 6th is the failed probe that opens it again; the next probe succeeds.
        if msg.topic() == topic and len(main_failures) < 6:
            main_failures.append(msg.value() or b"")
            raise ConnectionError("downstream down")
        succeeded.append((msg.topic() or "", msg.value() or b""))

    consumer = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(group_protocol)},
        topics=[topic],
        handler=handle,
        strategy=RetryTopics(delays=[0.2]),
        circuit=MainTopicCircuit(consecutive_failures=5, reset_timeout=1.0),
        outbox=f"sqlite:///{tmp_path / 'c.db'}",
    )
    with running(consumer) as c:
        wait_until(lambda: len(succeeded) == 100, 60, "every message handled")
        stats = c.stats()
    # Without the circuit all 100 would have failed on the main topic and gone up the ladder.
    assert main_failures == values[:6]
    assert stats["circuit_opened"] == 2 and stats["circuit"] == "closed"
    assert stats["retried"] == 6
    assert sorted(v for _, v in succeeded) == values
    assert [v for t, v in succeeded if t == topic] == values[6:]  # in order once it closed


def test_deserialization_failure_goes_straight_to_the_dead_letters(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    import json

    topic = make_topic(partitions=1)
    group = group_name()
    produce(kafka_bootstrap, topic, [b'{"n": 1}', b"not json", b'{"n": 3}'], partition=0)
    handled: list[Any] = []
    dead: list[DeadLetter] = []
    consumer = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(group_protocol)},
        topics=[topic],
        handler=lambda msg: handled.append(msg.value()),
        deserializer=json.loads,
        strategy=RetryTopics(delays=[0.1]),
        dead_letters="store",
        on_dead_letter=dead.append,
        outbox=f"sqlite:///{tmp_path / 'c.db'}",
    )
    with running(consumer) as c:
        wait_until(lambda: len(handled) == 2 and len(dead) == 1, 30, "two handled, one dead")
        stats = c.stats()
    assert handled == [{"n": 1}, {"n": 3}]  # the handler gets the deserialized value
    assert stats["retried"] == 0 and stats["dead"] == 1  # no retry: the bytes will never parse
    assert dead[0].value == b"not json" and dead[0].attempts == 1
    assert (dead[0].last_error or "").startswith("json.decoder.JSONDecodeError (consumer): Expecting value")
    assert committed(kafka_bootstrap, group, topic, 1) == [3]


def test_dead_letters_the_consumer_stores_are_encrypted_at_rest(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    from outbox.stores.encryption import Key, KeyRing

    marker = b"IBAN-DE89370400440532013000"
    key = Key(bytes(range(32)))
    topic = make_topic(partitions=1)
    produce(kafka_bootstrap, topic, [b"ok-1", marker + b"-poison", b"ok-2"], partition=0)
    handled: list[bytes | None] = []
    dead: list[DeadLetter] = []

    def handler(msg: Message) -> None:
        if marker in (msg.value() or b""):
            raise ValueError("poison")
        handled.append(msg.value())

    path = tmp_path / "c.db"
    consumer = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group_name(), **group_settings(group_protocol)},
        topics=[topic], handler=handler, strategy=RetryTopics(delays=[0.1]), dead_letters="store",
        on_dead_letter=dead.append, outbox=f"sqlite:///{path}", encryption=key,
    )
    with running(consumer):
        wait_until(lambda: len(handled) == 2 and len(dead) == 1, 60, "two handled, one dead")
    raw = path.read_bytes() + (Path(f"{path}-wal").read_bytes() if Path(f"{path}-wal").exists() else b"")
    assert marker not in raw
    with open_outbox(f"sqlite:///{path}", create=False, encryption=KeyRing([key])) as store:
        (row,) = [m for m in store.messages() if m.status.name == "DEAD"]
        assert row.value == marker + b"-poison"


def test_close_from_another_thread_waits_for_the_loop_and_a_handler_still_running_keeps_it_open(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    """close() while run() polls in another thread: it waits for the loop's turn, so librdkafka
    is never closed under a running consume(). A handler that outlasts close()'s timeout gets a
    RuntimeError that says so, and nothing is closed; once it returns, close() finishes, run()
    returns without error and every handled message is committed."""
    topic = make_topic(partitions=1)
    group = group_name()
    produce(kafka_bootstrap, topic, [b"%d" % i for i in range(10)])
    release = threading.Event()
    seen: list[bytes] = []

    def handle(msg: Message) -> None:
        seen.append(msg.value() or b"")
        if msg.value() == b"5":
            release.wait(60)

    consumer = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(group_protocol)},
        topics=[topic],
        handler=handle,
        strategy=Ignore(),
        outbox=f"sqlite:///{tmp_path / 'c.db'}",
        batch_size=1,
    )
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            consumer.run()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        wait_until(lambda: b"5" in seen, 30, "the handler holds message 5")
        with pytest.raises(RuntimeError, match=r"did not finish its turn within 0\.5 s .*nothing was closed"):
            consumer.close(timeout=0.5)
        assert t.is_alive()
    finally:
        release.set()
    consumer.close()
    t.join(30)
    assert not t.is_alive() and errors == []
    assert seen == [b"%d" % i for i in range(6)], "the loop stopped after the turn close() waited for"
    assert committed(kafka_bootstrap, group, topic, 1) == [6]
    with pytest.raises(RuntimeError, match="this ResilientConsumer is closed"):
        consumer.poll_once()
