"""One history checker: what was accepted, against what a topic holds, read per partition.

A test records every message whose `produce()` returned (`History.accepted`), then reads the
topic back partition by partition in offset order (`History.check`) and gets a `Verdict`:

- **lost**: accepted messages with no copy in the topic;
- **reordered keys**: keys whose first copies did not arrive in produce order (a copy after the
  first, with the same `outbox-id`, is a duplicate: consumers that deduplicate drop it);
- **duplicates**: copies beyond the first of a message;
- **without id**: records that carry no `outbox-id` header.

The accepted order of a key is the order its `produce()` calls returned in on the thread that
made them; a key produced from several threads at once has no single produce order, so a
history records each key from one thread.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from outbox.headers import ID_HEADER
from outbox.testing.consume import readable_partitions

__all__ = ["History", "Verdict"]


@dataclass
class Verdict:
    """What `History.check` found; `ok` when nothing was lost or reordered and every record has its id."""

    accepted: int
    records: int
    lost: list[str] = field(default_factory=list)
    reordered: dict[bytes, list[str]] = field(default_factory=dict)
    duplicates: int = 0
    without_id: int = 0
    #: Of reordered keys' messages: (partition, offset, `outbox-attempt` of the first copy or None).
    where: dict[str, tuple[int, int, str | None]] = field(default_factory=dict)
    #: Of reordered keys' messages: the position in its key's produce order.
    produced: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.lost and not self.reordered and not self.without_id

    def summary(self) -> str:
        """One line: messages, records, lost, reordered keys, duplicates, records without id."""
        return (
            f"{self.accepted} messages, {self.records} records: {len(self.lost)} lost, "
            f"{len(self.reordered)} reordered keys, {self.duplicates} duplicates, {self.without_id} without id"
        )

    def first_inversions(self, most: int = 3) -> list[str]:
        """A few reordered keys with the ids around their first inversion, for a failure message."""
        out = []
        for key, ids in list(self.reordered.items())[:most]:
            first = next(n for n in range(len(ids) - 1) if self.produced[ids[n]] > self.produced[ids[n + 1]])
            late, early = ids[first], ids[first + 1]
            out.append(
                f"{key!r}: {late} {self._at(late)} arrived before {early} {self._at(early)}; "
                f"in all: {ids[:12]}{' ...' if len(ids) > 12 else ''}"
            )
        return out

    def _at(self, msg_id: str) -> str:
        part, offset, attempt = self.where.get(msg_id, (-1, -1, None))
        return f"(partition {part} offset {offset}, {'first send' if attempt is None else 'attempt ' + attempt})"


class History:
    """Accepted messages by topic and key, in produce order; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._order: dict[tuple[str, bytes | None], list[str]] = defaultdict(list)
        self._topics: dict[str, set[str]] = defaultdict(set)

    def accepted(self, topic: str, key: bytes | None, msg_id: str) -> None:
        """`produce()` returned for the message `msg_id` (its `outbox-id`)."""
        with self._lock:
            self._order[(topic, key)].append(msg_id)
            self._topics[topic].add(msg_id)

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._topics.values())

    def check(self, bootstrap: str, topic: str, *, timeout: float = 120.0) -> Verdict:
        """Read `topic` to its end, partition by partition in offset order, and judge it.

        Raises:
            TimeoutError: a partition was not read to its high watermark within `timeout`.
        """
        first_seen: dict[str, tuple[int, int]] = {}  # id -> (partition, offset) of its first copy
        attempts: dict[str, str] = {}
        records = duplicates = without_id = 0
        for part, msg_ids in _read(bootstrap, topic, timeout):
            for offset, msg_id, attempt in msg_ids:
                records += 1
                if msg_id is None:
                    without_id += 1
                elif msg_id in first_seen:
                    duplicates += 1
                else:
                    first_seen[msg_id] = (part, offset)
                    if attempt is not None:
                        attempts[msg_id] = attempt
        accepted = self._topics.get(topic, set())
        verdict = Verdict(len(accepted), records, duplicates=duplicates, without_id=without_id)
        verdict.lost = sorted(accepted - first_seen.keys())
        for (t, key), ids in self._order.items():
            if t != topic or key is None:
                continue
            arrived = sorted((first_seen[i], n) for n, i in enumerate(ids) if i in first_seen)
            positions = [n for _, n in arrived]
            if positions != sorted(positions):
                verdict.reordered[key] = [ids[n] for n in positions]
                verdict.where.update((i, (*first_seen[i], attempts.get(i))) for i in ids if i in first_seen)
                verdict.produced.update((i, n) for n, i in enumerate(ids))
        return verdict


Read = tuple[int, str | None, str | None]  # offset, outbox-id, outbox-attempt


def _read(bootstrap: str, topic: str, timeout: float) -> list[tuple[int, list[Read]]]:
    """Every record of `topic` as (partition, [(offset, outbox-id, outbox-attempt)]), up to the
    high watermarks, asked again until none moved.

    A partition's new leader answers its own high watermark, which can lag behind the previous
    leader's for a moment after an election (it learns the committed offset from its followers'
    next fetches): read to that, a partition would stop short of records Kafka has already
    acknowledged. So once every partition is read to its high watermark, they are all asked
    again a second later, and read on, until a round finds nothing new.
    """
    deadline = time.monotonic() + timeout
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"outbox-history-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": False,
        }
    )
    try:
        parts = readable_partitions(consumer, topic, timeout)
        got: dict[int, list[Read]] = {part: [] for part in parts}
        position: dict[int, int] = {}
        while True:
            grew = False
            for part in parts:
                low, high = _watermarks(consumer, topic, part, deadline)
                position.setdefault(part, low)  # the first round reads from the start
                if high > position[part]:
                    grew = True
                    position[part] = _read_to(consumer, topic, part, position[part], high, got[part], deadline)
            if not grew:
                return [(part, got[part]) for part in parts]
            time.sleep(1.0)
    finally:
        consumer.close()


def _read_to(
    consumer: Consumer, topic: str, part: int, start: int, high: int, got: list[Read], deadline: float
) -> int:
    """Read partition `part` from offset `start` up to `high` into `got`; return the next offset."""
    consumer.assign([TopicPartition(topic, part, start)])
    position = start
    while position < high:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{topic!r} [{part}]: read to offset {position} of {high} in time")
        msg = consumer.poll(1.0)
        if msg is None or msg.error() is not None:
            continue
        offset = msg.offset() or 0
        position = offset + 1
        headers = msg.headers() or []
        pairs = list(headers.items()) if isinstance(headers, dict) else headers
        got.append((offset, _header(pairs, ID_HEADER), _header(pairs, "outbox-attempt")))
    return position


#: Answers of a partition whose leadership is moving.
_MOVING = frozenset({KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError._TIMED_OUT})


def _watermarks(consumer: Consumer, topic: str, part: int, deadline: float) -> tuple[int, int]:
    """A partition's watermarks, asked again while its leadership moves (a broker just restarted
    answers NOT_LEADER_FOR_PARTITION until the metadata catches up)."""
    while True:
        try:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, part), timeout=30)
            return low, high
        except KafkaException as exc:
            err = exc.args[0]
            if time.monotonic() > deadline or not (err.retriable() or err.code() in _MOVING):
                raise
            time.sleep(0.2)


def _header(headers: list[tuple[str, str | bytes | None]], wanted: str) -> str | None:
    """The last header named `wanted` (the producer appends its `outbox-id` after the application's
    headers, as Kafka's own clients read the last of a name)."""
    for name, value in reversed(headers):
        if name == wanted and value is not None:
            return value.decode() if isinstance(value, bytes) else value
    return None

