"""Reading a topic back and judging what arrived: counts by outbox-id, duplicates, key order."""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, TopicPartition

from outbox import ID_HEADER
from outbox.testing.consume import readable_partitions


def header(msg: Message, name: str) -> bytes | None:
    for h, v in reversed(msg.headers() or []):
        if h == name:
            return v
    return None


@dataclass
class Arrivals:
    """What a topic holds, keyed by outbox-id."""

    messages: list[Message] = field(default_factory=list)
    by_id: dict[str, list[Message]] = field(default_factory=lambda: defaultdict(list))

    @property
    def unique(self) -> int:
        return len(self.by_id)

    @property
    def duplicates(self) -> int:
        return len(self.messages) - len(self.by_id)

    def values(self) -> set[bytes]:
        return {m.value() for m in self.messages}

    def order_violations(self) -> list[tuple[bytes, list[int]]]:
        """Keys whose first arrivals are not in produce order.

        Values are b"<key>:<seq>"; a duplicate (same outbox-id) is judged at its first arrival,
        since consumers that dedup by outbox-id drop the later copies.
        """
        seen: set[str] = set()
        per_key: dict[bytes, list[int]] = defaultdict(list)
        for m in self.messages:
            mid = (header(m, ID_HEADER) or b"").decode()
            if mid in seen:
                continue
            seen.add(mid)
            seq = int(m.value().rsplit(b":", 1)[1])
            per_key[m.key()].append(seq)
        return [(k, s) for k, s in per_key.items() if s != sorted(s)]


def read_topic(
    bootstrap: str, topic: str, expect_unique: int, timeout: float = 90.0, *, config: Mapping[str, str] | None = None
) -> Arrivals:
    """Read `topic` from the start until `expect_unique` distinct outbox-ids arrived (or timeout),
    then on to the end each partition had at that moment, so that duplicates written with them
    are counted too. `config`: more client settings (a secured cluster's)."""
    consumer = Consumer(
        {
            **(config or {}),
            "bootstrap.servers": bootstrap,
            "group.id": f"check-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": True,
        }
    )
    out = Arrivals()
    try:
        parts = readable_partitions(consumer, topic, 30)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        deadline = time.monotonic() + timeout
        read_to: dict[int, int] = {}  # partition -> the offset after the last one read
        ends: dict[int, int] | None = None  # the high watermarks once every id has arrived
        while time.monotonic() < deadline:
            if ends is None and out.unique >= expect_unique:
                ends = {}
                for p in parts:
                    low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                    ends[p] = high
                    read_to.setdefault(p, low)
            if ends is not None and all(read_to[p] >= end for p, end in ends.items()):
                break
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            part, offset = msg.partition(), msg.offset()
            err = msg.error()
            if err is not None:
                # At a partition's end: past its last record, transaction markers included.
                if err.code() == KafkaError._PARTITION_EOF and part is not None and offset is not None:
                    read_to[part] = max(read_to.get(part, 0), offset)
                continue
            if part is not None and offset is not None:
                read_to[part] = max(read_to.get(part, 0), offset + 1)
            out.messages.append(msg)
            out.by_id[(header(msg, ID_HEADER) or b"").decode()].append(msg)
        return out
    finally:
        consumer.close()


def keyed_value(key: int, seq: int) -> tuple[bytes, bytes]:
    """(key, value) with the per-key sequence number inside the value."""
    k = b"key-%d" % key
    return k, k + b":%d" % seq
