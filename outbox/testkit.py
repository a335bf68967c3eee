"""Doubles for unit tests of code that produces with a `ResilientProducer` or handles a
`ResilientConsumer`'s messages: no broker, no outbox file, no threads.

* `TestProducer` stands in for a `ResilientProducer`: `produce()` records the message (`sent`)
  and its delivery callback runs at the next `poll()` / `flush()`, delivered or failed as the
  test decides (`fail=`).
* `TestMessage` stands in for a `confluent_kafka.Message`: what delivery callbacks receive and
  what a test hands to a consumer handler.
* `outbox.stores.MemoryOutbox` (`outbox="memory://"`) is an outbox in memory, for tests of code
  that reads or writes a store (dead letters, the console's actions).

For tests against a real cluster, `outbox.testing` is the test bed (the `testing` extra).
docs/testing.md shows each of them in use.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_NOT_AVAILABLE, KafkaError

from outbox.headers import ID_HEADER, IdGenerator
from outbox.message import as_bytes, check_partition, check_payload, check_timestamp, check_topic, normalize_headers
from outbox.records import Headers

__all__ = ["Sent", "TestMessage", "TestProducer"]

DeliveryCallback = Callable[[KafkaError | None, Any], None]


class Sent(NamedTuple):
    """One message a `TestProducer` took, as it would have reached Kafka."""

    topic: str
    value: bytes | None
    key: bytes | None
    partition: int
    timestamp: int  # ms since the epoch: the one given, else the time of produce()
    headers: Headers  # as given, then the `outbox-id` header (unless id_header=None)


class TestMessage:
    """A stand-in for `confluent_kafka.Message`, with the same accessors.

    Args: the message's fields; `timestamp` in ms (0: not available), `error` a KafkaError or None.
    """

    __test__ = False  # not a pytest test class
    __slots__ = ("_error", "_headers", "_key", "_offset", "_partition", "_timestamp", "_topic", "_value")

    def __init__(
        self,
        topic: str,
        value: Any = None,
        key: Any = None,
        *,
        headers: Headers | None = None,
        partition: int = 0,
        offset: int = 0,
        timestamp: int = 0,
        error: KafkaError | None = None,
    ) -> None:
        self._topic, self._value, self._key = topic, value, key
        self._headers, self._partition, self._offset = headers, partition, offset
        self._timestamp, self._error = timestamp, error

    def topic(self) -> str:
        return self._topic

    def value(self) -> Any:
        return self._value

    def set_value(self, value: Any) -> None:
        self._value = value

    def key(self) -> Any:
        return self._key

    def set_key(self, key: Any) -> None:
        self._key = key

    def headers(self) -> Headers | None:
        return self._headers

    def set_headers(self, headers: Headers | None) -> None:
        self._headers = headers

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def timestamp(self) -> tuple[int, int]:
        """(type, ms) as confluent_kafka returns it."""
        if not self._timestamp:
            return TIMESTAMP_NOT_AVAILABLE, 0
        return TIMESTAMP_CREATE_TIME, self._timestamp

    def error(self) -> KafkaError | None:
        return self._error

    def __len__(self) -> int:
        return len(self._value) if isinstance(self._value, (bytes, str)) else 0

    def __repr__(self) -> str:
        return f"TestMessage(topic={self._topic!r}, partition={self._partition}, offset={self._offset})"


class TestProducer:
    """Stands in for `ResilientProducer` in unit tests: records every message and reports deliveries.

    `produce()` checks its arguments as the real producer does (topic, bytes or str payloads or
    the serializers' input, headers, timestamp) and records a `Sent`. The delivery callbacks run
    in the test's own thread at the next `poll()` or `flush()` (the real producer runs them on
    its threads), in produce order, each with a `TestMessage` carrying its offset in its topic.

    Args:
        fail: decides a message's fate: return a KafkaError to report it failed to its
            callback (as a dead-lettered message is reported), None to deliver it.
        key_serializer, value_serializer: as `ResilientProducer`'s.
        id_header: name of the message id header (None: no header), as `ResilientProducer`'s.
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        *,
        fail: Callable[[Sent], KafkaError | None] | None = None,
        key_serializer: Callable[[Any], bytes | None] | None = None,
        value_serializer: Callable[[Any], bytes | None] | None = None,
        id_header: str | None = ID_HEADER,
    ) -> None:
        self.sent: list[Sent] = []
        self._fail = fail
        self._key_serializer = key_serializer
        self._value_serializer = value_serializer
        self._id_header = id_header
        self._ids = IdGenerator()
        self._lock = threading.Lock()
        self._waiting: list[tuple[Sent, DeliveryCallback | None]] = []
        self._offsets: dict[str, int] = {}

    def produce(
        self,
        topic: str,
        value: Any = None,
        key: Any = None,
        partition: int = -1,
        on_delivery: DeliveryCallback | None = None,
        timestamp: int = 0,
        headers: Sequence[tuple[str, bytes | str | None]] | Mapping[str, bytes | str | None] | None = None,
        *,
        callback: DeliveryCallback | None = None,
        enable_retry: bool = True,
        transaction: Any = None,
    ) -> str:
        """Record one message; returns its id (the `outbox-id` header value)."""
        check_topic(topic)
        value = value if self._value_serializer is None else self._value_serializer(value)
        key = key if self._key_serializer is None else self._key_serializer(key)
        check_payload("value", value)
        check_payload("key", key)
        stamp = check_timestamp(timestamp) or int(time.time() * 1000)
        msg_id = self._ids.next()
        hdrs = normalize_headers(headers) if headers is not None else []
        if self._id_header is not None:
            hdrs.append((self._id_header, msg_id.encode()))
        sent = Sent(topic, as_bytes(value), as_bytes(key), check_partition(partition), stamp, hdrs)
        with self._lock:
            self.sent.append(sent)
            self._waiting.append((sent, on_delivery or callback))
        return msg_id

    def messages(self, topic: str | None = None) -> list[Sent]:
        """The messages produced so far (to one topic, or all), in produce order."""
        with self._lock:
            return [m for m in self.sent if topic in (None, m.topic)]

    def poll(self, timeout: float = 0) -> int:
        """Run the delivery callbacks of the messages produced since; return how many ran."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
        for sent, cb in waiting:
            error = self._fail(sent) if self._fail is not None else None
            offset = -1
            if error is None:
                offset = self._offsets.get(sent.topic, 0)
                self._offsets[sent.topic] = offset + 1
            if cb is not None:
                cb(error, TestMessage(
                    sent.topic, sent.value, sent.key, headers=sent.headers, partition=max(sent.partition, 0),
                    offset=offset, timestamp=sent.timestamp, error=error,
                ))
        return len(waiting)

    def flush(self, timeout: float | None = None) -> int:
        """Run every waiting callback; return 0 (nothing is left undelivered)."""
        self.poll()
        return 0

    def close(self, timeout: float | None = None) -> bool:
        """Flush; return True (nothing is left unsaved), as ResilientProducer.close() on a clean close."""
        self.flush()
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)

    def __enter__(self) -> TestProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
