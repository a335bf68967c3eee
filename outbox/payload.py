"""What a message may be made of, checked before anything is stored or sent.

Kafka's rule for topic names (`produce()`, `outbox dlq replay --to-topic`, the console's
redrive), and what `produce()` accepts as value, key, headers and partition. A message that
fails here raises in the caller's thread and is neither sent nor stored: a bad value must never
reach the writer thread, where its error would have no one to go to.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from outbox.errors import ConfigError
from outbox.records import Headers

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
