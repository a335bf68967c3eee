"""Reading a topic back in tests."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, TopicPartition

__all__ = ["consume", "consume_to_end"]


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
        partitions: list[int] = []
        while not partitions:
            md = consumer.list_topics(topic, timeout=max(0.5, min(5.0, deadline - time.monotonic())))
            tmd = md.topics.get(topic)
            if tmd is not None and tmd.error is None:
                partitions = sorted(tmd.partitions)
            elif time.monotonic() > deadline:
                return out
            else:
                time.sleep(0.2)
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
        md = consumer.list_topics(topic, timeout=max(1.0, min(10.0, timeout)))
        tmd = md.topics.get(topic)
        if tmd is None or tmd.error is not None:
            raise RuntimeError(f"topic {topic!r} is not readable: {tmd.error if tmd else 'unknown topic'}")
        ends: dict[int, int] = {}
        for p in sorted(tmd.partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high > low:
                ends[p] = high
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
