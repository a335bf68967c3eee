"""The test bed itself, against a real local Kafka cluster, PostgreSQL and Spark (no mocks)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import KafkaError, Producer
from confluent_kafka.admin import AdminClient

from outbox.testing import KafkaCluster


def _produce(bootstrap: str, topic: str, n: int, flush_timeout: float = 30.0, **conf: Any) -> list[Any]:
    """Produce ``n`` messages and return one delivery-report error (or None) per message."""
    reports: list[Any] = []
    producer = Producer({"bootstrap.servers": bootstrap, **conf})
    for i in range(n):
        producer.produce(
            topic,
            key=f"k{i}".encode(),
            value=f"v{i}".encode(),
            headers=[("idx", str(i).encode())],
            on_delivery=lambda err, _msg: reports.append(err),
        )
        producer.poll(0)
    remaining = producer.flush(flush_timeout)
    assert remaining == 0, f"{remaining} messages still undelivered after {flush_timeout}s"
    assert len(reports) == n
    return reports


def _wait_isr_is(bootstrap: str, topic: str, isr: list[int], timeout: float = 30.0) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + timeout
    while True:
        parts = admin.list_topics(topic, timeout=5).topics[topic].partitions.values()
        if all(p.leader == isr[0] and sorted(p.isrs) == isr for p in parts):
            return
        assert time.monotonic() < deadline, f"ISR of {topic} never became {isr}: {list(parts)}"
        time.sleep(0.1)


def _codes(reports: list[Any]) -> set[int | None]:
    return {None if err is None else err.code() for err in reports}


def test_produce_and_consume_roundtrip(
    kafka_bootstrap: str, topic: str, consume_all: Callable[..., list[Any]]
) -> None:
    n = 500
    assert _codes(_produce(kafka_bootstrap, topic, n, acks="all")) == {None}
    messages = consume_all(topic, n, timeout=30)
    assert len(messages) == n
    assert sorted(int(dict(m.headers())["idx"]) for m in messages) == list(range(n))
    assert {m.partition() for m in messages} == {0, 1, 2}


def test_all_brokers_down_then_up(chaos_cluster: KafkaCluster, make_topic: Callable[..., str]) -> None:
    topic = make_topic()
    bootstrap = chaos_cluster.bootstrap_servers
    chaos_cluster.stop_all()
    assert chaos_cluster.running_brokers() == []

    started = time.monotonic()
    reports = _produce(bootstrap, topic, 20, flush_timeout=20, **{"message.timeout.ms": 3000})
    assert _codes(reports) == {KafkaError._MSG_TIMED_OUT}
    assert time.monotonic() - started < 15

    chaos_cluster.start_all()
    assert chaos_cluster.running_brokers() == [0, 1, 2]
    assert _codes(_produce(bootstrap, topic, 20, acks="all")) == {None}


def test_not_enough_replicas_is_reported(chaos_cluster: KafkaCluster, make_topic: Callable[..., str]) -> None:
    topic = make_topic(replication_factor=3, config={"min.insync.replicas": "2"})
    bootstrap = chaos_cluster.bootstrap_servers
    chaos_cluster.stop_broker(1)
    chaos_cluster.stop_broker(2)
    _wait_isr_is(bootstrap, topic, [0])  # broker 0 now leads every partition, alone in the ISR

    # Without retries (and so without idempotence) librdkafka hands the broker's error to the app.
    strict = _produce(
        bootstrap,
        topic,
        10,
        acks="all",
        retries=0,
        **{"enable.idempotence": False, "message.timeout.ms": 10000},
    )
    assert _codes(strict) == {KafkaError.NOT_ENOUGH_REPLICAS}

    # With default retries librdkafka retries NOT_ENOUGH_REPLICAS until message.timeout.ms expires.
    retried = _produce(bootstrap, topic, 10, acks="all", **{"message.timeout.ms": 3000})
    assert _codes(retried) == {KafkaError._MSG_TIMED_OUT}


def test_kill_one_broker_keeps_acks_all_working(
    chaos_cluster: KafkaCluster, make_topic: Callable[..., str], consume_all: Callable[..., list[Any]]
) -> None:
    topic = make_topic(replication_factor=3, config={"min.insync.replicas": "2"})
    bootstrap = chaos_cluster.bootstrap_servers
    chaos_cluster.kill_broker(1)
    assert chaos_cluster.running_brokers() == [0, 2]

    n = 200
    assert _codes(_produce(bootstrap, topic, n, flush_timeout=60, acks="all")) == {None}
    assert len(consume_all(topic, n, timeout=60)) == n

    chaos_cluster.start_broker(1)
    chaos_cluster.wait_for_isr(topic, 3, timeout=60)
    assert _codes(_produce(bootstrap, topic, 10, acks="all")) == {None}
    assert len(consume_all(topic, n + 10, timeout=60)) == n + 10


def test_postgres_fresh_database(fresh_postgres_url: str) -> None:
    import psycopg

    with psycopg.connect(fresh_postgres_url) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        name = conn.execute("SELECT current_database()").fetchone()
    assert name is not None and name[0].startswith("outbox_test_")


def test_spark_local_session(spark: Any) -> None:
    assert spark.range(100).count() == 100
    jars = spark.sparkContext.getConf().get("spark.jars")
    assert "postgresql" in jars and "sqlite" in jars


def test_close_leaves_no_process(tmp_path: Any) -> None:
    with KafkaCluster(brokers=1, base_dir=tmp_path) as cluster:
        pids = cluster.pids()
        cluster_dir = cluster.dir
        assert len(pids) == 2  # controller + 1 broker
        assert cluster.create_topic("single", replication_factor=1) == "single"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not cluster_dir.exists()


def test_consume_to_end_reads_duplicates_and_everything_after_them(kafka_bootstrap: str, topic: str) -> None:
    """Counting by message count stops early when a message was written twice; reading to the end does not."""
    from outbox.testing.consume import consume, consume_to_end

    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(10):
        p.produce(topic, b"v%d" % i, key=b"k", partition=0)
    p.produce(topic, b"v3", key=b"k", partition=0)  # a duplicate, as at-least-once may write
    p.produce(topic, b"last", key=b"k", partition=1)
    assert p.flush(30) == 0
    everything = consume_to_end(kafka_bootstrap, topic, timeout=30)
    assert sorted(m.value() for m in everything) == sorted([b"v%d" % i for i in range(10)] + [b"v3", b"last"])
    assert len(consume(kafka_bootstrap, topic, 11, timeout=30)) == 11  # a count of 11 stops before the 12th
