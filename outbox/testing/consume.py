"""Reading a topic back in tests."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, TopicPartition

__all__ = ["consume", "consume_to_end", "readable_partitions", "topic_size"]


def readable_partitions(consumer: Consumer, topic: str, timeout: float) -> list[int]:
    """The partitions of ``topic``, once the broker that answers knows it.

    A topic just created (or written) can still be unknown to the broker a metadata request
    reaches: each broker applies the cluster's metadata on its own, a lagging one answers
    ``UNKNOWN_TOPIC_OR_PART`` with no partitions. Reading that answer as "no partitions" would
    assign nothing and read nothing, so ask again until the topic is known.

    Raises:
        TimeoutError: the topic was still unknown after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        md = consumer.list_topics(topic, timeout=max(0.5, min(5.0, deadline - time.monotonic())))
        tmd = md.topics.get(topic)
        if tmd is not None and tmd.error is None and tmd.partitions:
            return sorted(tmd.partitions)
        if time.monotonic() > deadline:
            raise TimeoutError(f"topic {topic!r} is not readable after {timeout} s: {tmd.error if tmd else 'unknown'}")
        time.sleep(0.2)


def topic_size(bootstrap: str, topic: str, timeout: float = 30.0) -> int:
    """How many records ``topic`` holds now (high minus low watermarks): duplicates included."""
    consumer = _reader(bootstrap, None, eof=False)
    try:
        total = 0
        for part in readable_partitions(consumer, topic, timeout):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, part), timeout=10)
            total += high - low
        return total
    finally:
        consumer.close()


def _reader(bootstrap: str, config: Mapping[str, Any] | None, *, eof: bool) -> Consumer:
    """A consumer of its own (new random group, no commits) that reads from the earliest offset."""
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "group.id": f"outbox-testing-{uuid.uuid4().hex}",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": eof,
    }
    conf.update(config or {})
    return Consumer(conf)


def consume(
    bootstrap: str,
    topic: str,
    expected: int,
    timeout: float = 30.0,
    *,
    config: Mapping[str, Any] | None = None,
) -> list[Message]:
    """Read ``topic`` from the beginning until ``expected`` messages arrived or ``timeout`` passed.

    A fresh consumer (new random ``group.id``, no offset commits) is assigned
    every partition of the topic at the earliest offset, so no group
    coordinator or rebalance is involved and the result does not depend on
    earlier consumers. Messages keep their headers, keys and partitions.

    Args:
        bootstrap: ``bootstrap.servers`` of the cluster.
        topic: Topic to read.
        expected: Stop as soon as this many messages were read.
        timeout: Give up after this many seconds and return what was read.
        config: Extra consumer configuration (e.g. ``{"isolation.level": "read_committed"}``).

    Returns:
        The messages read (possibly fewer than ``expected``; compare the length).

    Raises:
        confluent_kafka.KafkaException: A non-retriable consumer error.
    """
    deadline = time.monotonic() + timeout
    consumer = _reader(bootstrap, config, eof=False)
    out: list[Message] = []
    try:
        try:
            partitions = readable_partitions(consumer, topic, deadline - time.monotonic())
        except TimeoutError:
            return out
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        while len(out) < expected:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            msg = consumer.poll(min(1.0, remaining))
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF or err.retriable() or not err.fatal():
                    continue
                raise RuntimeError(f"consumer error on {topic!r}: {err}")
            out.append(msg)
        return out
    finally:
        consumer.close()


def consume_to_end(
    bootstrap: str, topic: str, timeout: float = 60.0, *, config: Mapping[str, Any] | None = None
) -> list[Message]:
    """Read every message ``topic`` holds now: from the beginning up to each partition's high watermark.

    Unlike :func:`consume` with a count, duplicates cannot make it stop early, so it is the way
    to count what reached Kafka (at-least-once delivery may write a message twice).

    Raises:
        TimeoutError: The end was not reached within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    consumer = _reader(bootstrap, config, eof=True)
    out: list[Message] = []
    try:
        ends: dict[int, int] = {}
        for part in readable_partitions(consumer, topic, timeout):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, part), timeout=10)
            if high > low:
                ends[part] = high
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        while ends:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic!r}: partitions {sorted(ends)} not read to their end in {timeout} s")
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    ends.pop(msg.partition() or 0, None)  # at the end (also past trailing control records)
                elif err.fatal():
                    raise RuntimeError(f"consumer error on {topic!r}: {err}")
                continue
            out.append(msg)
            p, offset = msg.partition(), msg.offset()
            if p in ends and offset is not None and offset + 1 >= ends[p]:
                del ends[p]
        return out
    finally:
        consumer.close()
