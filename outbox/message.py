"""A message as `produce()` accepts it: what it may be made of, and the one object that carries it.

Kafka's rule for topic names (`produce()`, `outbox dlq replay --to-topic`, the console's
redrive), and what `produce()` accepts as value, key, headers and partition. A message that
fails here raises in the caller's thread and is neither sent nor stored: a bad value must never
reach the writer thread, where its error would have no one to go to.

`produce()` checks a message once. A message Kafka takes at once goes to librdkafka as it is;
any other is one `Message`, which every later step of the producer takes (the way into the
outbox, write-ahead, a transaction's row, a failed first send), and the row the outbox stores is
made from it by one factory, `Message.row`. What a row costs in memory while the producer holds
it, `message_cost`, is what the memory budget (`outbox.budget`) counts.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from confluent_kafka import KafkaError
from confluent_kafka import Message as KafkaMessage

from outbox.errors import ConfigError
from outbox.records import Headers, NewMessage

#: `on_delivery(err, msg)`: a message's final fate (`msg` is None for one delivered from the outbox).
DeliveryCallback = Callable[[KafkaError | None, KafkaMessage | None], None]

_new_tuple = tuple.__new__


class Message(NamedTuple):
    """One message, as `produce()` accepted it: checked, with its id header, passed on by reference.

    A tuple, built with `tuple.__new__` on the hot path: NamedTuple's generated `__new__` is a
    Python call, and every message pays for what is built here.

    Attributes:
        topic: the topic name.
        value, key: as given (bytes, str or bytes-like); a stored row holds their bytes.
        headers: the application's headers with the `outbox-id` header appended.
        partition: the partition, or -1 for the partitioner.
        id: the message id (the `outbox-id` header's value).
        timestamp: the record timestamp given to `produce()`, ms since the epoch; 0: none given
            (librdkafka stamps the time of the call, and a stored row the time it is made).
        on_delivery: the callback of its final fate, or None.
    """

    topic: str
    value: Any
    key: Any
    headers: Headers
    partition: int
    id: str
    timestamp: int
    on_delivery: DeliveryCallback | None

    def row(self, *, error: str | None = None, due: float = 0.0, failure: Failure | None = None) -> NewMessage:
        """The outbox row of this message, with `error` (why it was not sent, or the send's error)
        as its last error, due at `due` (0: now), and after a failed send what `failure` counts.
        Stamped with its timestamp, or the time the row is made if it has none."""
        now = time.time()
        value, key = self.value, self.key
        # Built as the tuple it is (the class doc); bytes skip as_bytes().
        value = value if value.__class__ is bytes else as_bytes(value)
        key = key if key.__class__ is bytes else as_bytes(key)
        timestamp = self.timestamp or int(now * 1000)
        if failure is None:
            return _new_tuple(NewMessage, (
                self.topic, value, key, self.headers, self.partition, self.id, 0, None, error, due or now, None, None,
                timestamp,
            ))
        attempts = failure.attempts
        return _new_tuple(NewMessage, (
            self.topic, value, key, self.headers, self.partition, self.id, attempts, now if attempts else None,
            error, due or now, failure.code, failure.name, timestamp,
        ))


class Failure(NamedTuple):
    """What a failed send leaves on a message's row: the attempts counted (0: it never left, and
    has no first failure), and the error's librdkafka code and name."""

    attempts: int
    code: int | None
    name: str | None

#: Kafka's longest topic name.
MAX_TOPIC_LENGTH = 249
_TOPIC_CHARS = re.compile(r"[a-zA-Z0-9._-]+")
#: Topic names already accepted: produce() pays one set lookup instead of a regex match (py-spy:
#: the match was a sixth of produce()'s own time on the happy path). Bounded: endless
#: generated names stay correct, just slower.
KNOWN_TOPICS: set[str] = set()
_KNOWN_MAX = 10_000

BYTES_LIKE = (bytes, str, bytearray, memoryview)


def topic_problem(topic: object) -> str | None:
    """Why `topic` is not a topic name Kafka accepts, or None if it is one."""
    if not isinstance(topic, str):
        return f"topic must be str, not {type(topic).__name__}"
    if not topic:
        return "topic name is empty"
    if topic in (".", ".."):
        return f"topic name {topic!r} is not allowed by Kafka"
    if len(topic) > MAX_TOPIC_LENGTH:
        return f"topic name is {len(topic)} characters long; Kafka allows {MAX_TOPIC_LENGTH}"
    if not topic_chars_ok(topic):
        return f"topic name {topic!r} has characters Kafka does not allow (only a-z A-Z 0-9 . _ -)"
    return None


def topic_chars_ok(text: str) -> bool:
    """Whether `text` holds only characters a topic name may have (a part of a name, too)."""
    return _TOPIC_CHARS.fullmatch(text) is not None


def check_topic(topic: Any) -> None:
    """Raise TypeError (not a str) or ConfigError (not a name Kafka accepts); remember good names."""
    problem = topic_problem(topic)
    if problem is not None:
        raise TypeError(problem) if not isinstance(topic, str) else ConfigError(problem)
    if len(KNOWN_TOPICS) < _KNOWN_MAX:
        KNOWN_TOPICS.add(topic)


def check_partition(partition: Any) -> int:
    """An explicit partition (None means "the partitioner's choice", -1)."""
    if partition is None:
        return -1
    if partition.__class__ is not int or not -1 <= partition <= 0x7FFFFFFF:  # Kafka: int32
        raise ConfigError(f"partition must be an int from -1 to 2147483647, got {partition!r}")
    return int(partition)


def check_timestamp(timestamp: Any) -> int:
    """A record timestamp given to produce(): ms since the epoch, 0 for none (librdkafka's now).

    The error types are confluent_kafka's: TypeError for a value that is not an int,
    OverflowError past Kafka's int64; a negative time is a ConfigError (a ValueError)."""
    if timestamp.__class__ is not int:
        raise TypeError(f"timestamp must be an int of milliseconds since the epoch (0: none), got {timestamp!r}")
    if timestamp > 0x7FFFFFFFFFFFFFFF:  # Kafka: int64
        raise OverflowError(f"timestamp must fit in a signed 64-bit integer of milliseconds, got {timestamp!r}")
    if timestamp < 0:
        raise ConfigError(f"timestamp must be an int of milliseconds since the epoch (0: none), got {timestamp!r}")
    return timestamp


def as_bytes(v: Any) -> bytes | None:
    """A checked payload as the bytes sent and stored (str as UTF-8)."""
    if v is None or isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode("utf-8")
    return bytes(v)


def check_payload(name: str, v: Any) -> None:
    """TypeError unless `v` is bytes-like, str or None."""
    if v is not None and not isinstance(v, BYTES_LIKE):
        raise TypeError(f"{name} must be bytes, str or None, not {type(v).__name__}")


def normalize_headers(headers: Any) -> Headers:
    """Headers as a list of (str, bytes | None), validated; dicts keep their iteration order."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    if not isinstance(items, (list, tuple)) and not isinstance(headers, Mapping):
        raise TypeError(f"headers must be a list of (name, value) pairs or a dict, not {type(headers).__name__}")
    out: Headers = []
    for item in items:
        # A str of two characters unpacks as a pair too: only tuples and lists are pairs.
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"each header must be a (name, value) pair, got {item!r}")
        name, value = item
        if not isinstance(name, str):
            raise TypeError(f"header names must be str, got {type(name).__name__}")
        check_payload(f"header {name!r} value", value)
        try:
            # Encoded here, not on the writer thread, where the error would kill the thread.
            name.encode("utf-8")
            out.append((name, as_bytes(value)))
        except UnicodeEncodeError as exc:
            what = "name" if exc.object is name else "value"
            raise ValueError(f"header {name!r}: {what} is not valid UTF-8 text ({exc.reason})") from None
    return out


#: Bytes a held message costs beyond its value, key and headers: the `NewMessage` tuple, its id
#: string, header list and tuple, the writer's slots, and while its commit runs the row the store
#: binds. With the id header's share below it covers what tracemalloc measured a message to cost.
MESSAGE_OVERHEAD = 700
#: Bytes each header costs beyond its name and value (its tuple, the value's bytes object).
HEADER_OVERHEAD = 96


def message_cost(msg: NewMessage) -> int:
    """Bytes `msg` costs while the producer holds it (once per message on the way to the outbox)."""
    _, value, key, headers = msg[:4]  # one slice: faster than three attribute reads
    n = MESSAGE_OVERHEAD
    if value is not None:
        n += len(value)
    if key is not None:
        n += len(key)
    if headers:
        for name, hv in headers:
            n += HEADER_OVERHEAD + len(name) + (0 if hv is None else len(hv))
    return n
