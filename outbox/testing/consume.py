"""Reading a topic back in tests."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, TopicPartition

__all__ = ["consume"]


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
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "group.id": f"outbox-testing-{uuid.uuid4().hex}",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": False,
    }
    conf.update(config or {})
    deadline = time.monotonic() + timeout
    consumer = Consumer(conf)
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
