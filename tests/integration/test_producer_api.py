"""The confluent_kafka.Producer API of ResilientProducer against the real cluster: what is
delivered is read back from Kafka (positional produce, produce_batch's headers and timestamps),
what poll() serves and raises, what purge() drops, what list_topics() sees."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, KafkaError, Message

from outbox import ID_HEADER, ResilientProducer
from outbox.testing.consume import topic_size

from ..waiting import wait_until
from .test_producer import make_producer

TS = 1_700_000_000_123  # ms since the epoch: a create time no send would pick by itself


def _headers(m: Message) -> list[tuple[str, bytes]]:
    return [(k, v) for k, v in cast(list[tuple[str, bytes]], m.headers() or []) if k != ID_HEADER]


def test_positional_produce_in_confluents_order_round_trips(
    kafka_bootstrap: str, topic: str, tmp_path: Path, consume_all: Callable[..., list[Any]]
) -> None:
    reports: list[tuple[KafkaError | None, int, int]] = []

    def on_delivery(err: KafkaError | None, msg: Message | None) -> None:
        assert msg is not None
        reports.append((err, msg.partition() or 0, msg.timestamp()[1]))

    with make_producer(kafka_bootstrap, tmp_path / "o.db") as p:
        ids = [
            p.produce(topic, b"v%d" % i, b"k%d" % i, i % 3, on_delivery, TS + i, [("h", b"%d" % i)]) for i in range(30)
        ]
        assert p.flush(30) == 0
    assert sorted(reports) == sorted((None, i % 3, TS + i) for i in range(30))
    got = sorted(consume_all(topic, 30), key=lambda m: m.value())
    assert len(got) == 30
    by_value = {m.value(): m for m in got}
    for i, msg_id in enumerate(ids):
        m = by_value[b"v%d" % i]
        assert (m.key(), m.partition(), m.timestamp()) == (b"k%d" % i, i % 3, (TIMESTAMP_CREATE_TIME, TS + i))
        assert _headers(m) == [("h", b"%d" % i)]
        assert dict(m.headers() or [])[ID_HEADER] == msg_id.encode()


def test_produce_batch_keeps_each_messages_headers_and_timestamp(
    kafka_bootstrap: str, topic: str, tmp_path: Path, consume_all: Callable[..., list[Any]]
) -> None:
    batch: list[dict[str, Any]] = [
        {"value": b"b%d" % i, "key": b"k", "partition": 1, "timestamp": TS + i, "headers": {"n": b"%d" % i}}
        for i in range(20)
    ]
    batch.append({"value": b"refused", "partition": -7})
    with make_producer(kafka_bootstrap, tmp_path / "o.db") as p:
        assert p.produce_batch(topic, batch) == 20
        assert p.flush(30) == 0
    assert batch[-1]["_error"].code() == KafkaError._INVALID_ARG
    assert all("_error" not in m for m in batch[:-1])
    got = consume_all(topic, 20)
    assert [(m.value(), m.partition(), m.timestamp()[1], _headers(m)) for m in got] == [
        (b"b%d" % i, 1, TS + i, [("n", b"%d" % i)]) for i in range(20)
    ]  # one key, one partition: in produce order


def test_poll_serves_the_reports_and_raises_what_a_callback_raised(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    delivered: list[bytes] = []
    threads: set[str] = set()

    def on_delivery(err: KafkaError | None, msg: Message | None) -> None:
        assert err is None and msg is not None
        threads.add(threading.current_thread().name)
        delivered.append(msg.value() or b"")

    with make_producer(kafka_bootstrap, tmp_path / "o.db", config={"on_delivery": on_delivery}) as p:
        for i in range(50):
            p.produce(topic, b"%d" % i)
        served = 0
        while served < 50:
            served += p.poll()  # blocks until reports were served
        assert served == 50
        assert sorted(delivered) == sorted(b"%d" % i for i in range(50))
        assert threads == {"outbox-delivery"}  # the producer's thread, not the caller's

        def boom(err: KafkaError | None, msg: Message | None) -> None:
            raise LookupError(f"delivered to partition {msg.partition() if msg else None}")

        p.produce(topic, b"boom", partition=2, callback=boom)
        with pytest.raises(LookupError, match="delivered to partition 2"):
            while True:
                p.poll(1)
        assert p.stats()["callback_errors"] == 1
        assert p.flush(30) == 0  # raised once: the next call goes on


def test_purge_drops_what_librdkafka_holds_and_stores_none(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    purged: list[int] = []

    def on_delivery(err: KafkaError | None, msg: Message | None) -> None:
        purged.append(err.code() if err is not None else 0)

    # A long linger keeps the messages in librdkafka's queue until purge().
    with make_producer(
        kafka_bootstrap, tmp_path / "o.db", message_timeout_ms=120000, config={"linger.ms": 60000}
    ) as p:
        p.produce(topic, b"sent", partition=0)
        p.purge()  # nothing delivered yet: the first message too is dropped
        for i in range(10):
            p.produce(topic, b"%d" % i, on_delivery=on_delivery)
        p.purge()
        # librdkafka reports a message purged from a broker's queue from that broker's thread,
        # possibly after purge() returned: the delivery thread serves it then, as purged.
        assert p.flush(10) == 0
        wait_until(lambda: len(purged) == 10, 10, "every purged message is reported")
        assert purged == [KafkaError._PURGE_QUEUE] * 10, (purged, len(p), p.stats())
        stats = p.stats()
        assert (stats["outboxed"], stats["pending"], stats["delivered"]) == (0, 0, 0)
        assert len(p) == 0
    assert topic_size(kafka_bootstrap, topic) == 0  # none was sent, none was stored


def test_list_topics_sees_the_topic_and_its_partitions(kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    with make_producer(kafka_bootstrap, tmp_path / "o.db") as p:
        md = p.list_topics(topic, timeout=30)
        assert set(md.topics) == {topic}
        assert sorted(md.topics[topic].partitions) == [0, 1, 2]
        assert len(p.list_topics(timeout=30).brokers) >= 1


def test_drop_in_for_confluent_producer(kafka_bootstrap: str, topic: str, tmp_path: Path,
                                        consume_all: Callable[..., list[Any]]) -> None:
    """Code written for confluent_kafka.Producer: **conf with dotted keys, callback=, poll/flush."""
    conf = {"bootstrap.servers": kafka_bootstrap, "linger.ms": 5}
    reports: list[KafkaError | None] = []
    p = ResilientProducer(**conf, outbox=f"sqlite:///{tmp_path / 'o.db'}")  # type: ignore[arg-type]
    try:
        assert p  # an idle producer is true
        for i in range(5):
            p.produce(topic, value=b"%d" % i, key=b"k", callback=lambda err, msg: reports.append(err))
            p.poll(0)
        assert p.flush() == 0
        assert reports == [None] * 5
    finally:
        assert p.close(30) is True
    assert sorted(m.value() for m in consume_all(topic, 5)) == [b"%d" % i for i in range(5)]
