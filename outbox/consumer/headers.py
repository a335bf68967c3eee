"""The consumer's metadata headers: UTF-8 text that any tool can read, replaced (never repeated) per hop.

A hop keeps the application's headers in order, drops the previous hop's metadata and appends the
new one, so headers do not grow over the ladder; the error message is capped for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, cast

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Message

from outbox.headers import (
    ATTEMPT_HEADER,
    FIRST_FAILED_HEADER,
    ID_HEADER,
    LAST_ERROR_HEADER,
    CheckedHeaders,
    IdGenerator,
)
from outbox.records import Headers

ORIGINAL_TOPIC = "outbox-original-topic"
ORIGINAL_PARTITION = "outbox-original-partition"
ORIGINAL_OFFSET = "outbox-original-offset"
ORIGINAL_TIMESTAMP = "outbox-original-timestamp"  # epoch ms of the message in the main topic
GROUP = "outbox-group"
# Not "outbox-attempt": that is the producer's send counter, which its outbox re-sends rewrite
# (outbox.headers.for_resend). A hop that went through the outbox carries both, each meaning one thing.
ATTEMPT = "outbox-consumer-attempt"  # handling attempts made so far (1 after the main topic failed)
DUE_AT = "outbox-due-at"  # epoch ms: the message is not handled before this
ERROR_CLASS = "outbox-error-class"  # e.g. "builtins.TimeoutError"
ERROR_MESSAGE = "outbox-error-message"  # str(exception), capped at ERROR_MESSAGE_MAX bytes
SPRING_ORIGINAL_TOPIC = "kafka_dlt-original-topic"  # Spring Kafka's name, so its consoles can redrive
# ordering="key": the message was not handled (or not again) but parked behind the earlier message of
# its key at this main-topic offset; `outbox-consumer-attempt` then counts its own attempts, not the tier's.
PARKED_BEHIND = "outbox-parked-behind"
#: The producer's delivery metadata describes one publish (an outbox re-send of it); a hop is a new
#: publish, so the previous one's is dropped rather than passed on as if it described the hop.
PRODUCER_RESEND = frozenset({ATTEMPT_HEADER, FIRST_FAILED_HEADER, LAST_ERROR_HEADER})

#: Headers this module writes; a hop replaces them. `outbox-id` is kept, not replaced.
MANAGED = frozenset(
    {
        ORIGINAL_TOPIC,
        ORIGINAL_PARTITION,
        ORIGINAL_OFFSET,
        ORIGINAL_TIMESTAMP,
        GROUP,
        ATTEMPT,
        DUE_AT,
        ERROR_CLASS,
        ERROR_MESSAGE,
        SPRING_ORIGINAL_TOPIC,
        PARKED_BEHIND,
    }
) | PRODUCER_RESEND
ERROR_MESSAGE_MAX = 512


def error_class(exc: BaseException) -> str:
    """``module.QualName`` of an exception's class (``builtins.`` kept, so the name is never ambiguous)."""
    t = type(exc)
    return f"{t.__module__}.{t.__qualname__}"


def cap_utf8(text: str, limit: int = ERROR_MESSAGE_MAX) -> bytes:
    """`text` as UTF-8, cut to `limit` bytes on a character boundary."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return raw
    return raw[:limit].decode("utf-8", "ignore").encode("utf-8")


class Origin(NamedTuple):
    """Where a message first entered the consumer: the main topic's coordinates.

    A named tuple, not a frozen dataclass: each failure builds one, and a tuple is built in C."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int


def headers_of(msg: Message) -> Headers:
    """A consumed message's headers as (name, bytes | None) pairs (confluent_kafka's stubs are looser)."""
    return cast(Headers, msg.headers() or [])


def record_timestamp(msg: Message) -> int:
    """The record timestamp a copy of `msg` keeps (a hop, a DLQ record, a dead letter, a redrive):
    its own, in ms since the epoch; 0 (librdkafka's now) when it has none. Windowed readers of
    the copy then see the event time of the original, whatever the tier it went through."""
    kind, ms = msg.timestamp()
    return ms if kind != TIMESTAMP_NOT_AVAILABLE and ms > 0 else 0


def find_text(headers: Headers | None, name: str) -> str | None:
    """The last `name` header's value as text, or None."""
    if headers:
        for h, v in reversed(headers):
            if h == name:
                return None if v is None else v.decode("utf-8", "replace")
    return None


def due_at(msg: Message) -> float | None:
    """Epoch seconds when the message becomes due (None: no due time, due now)."""
    v = find_text(headers_of(msg), DUE_AT)
    if v is None:
        return None
    try:
        return int(v) / 1000.0
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class LadderPosition:
    """What a tier message's headers say about its place in the ladder (ordering="key")."""

    origin_partition: int  # -1 when the headers do not say (not written by this consumer)
    origin_offset: int  # -1 likewise
    parked_attempts: int | None  # attempts made so far, for a parked message; None: the tier counts


def ladder_position(msg: Message) -> LadderPosition:
    """One pass over a tier message's headers: its origin in the main topic, and whether it is parked."""
    part = off = attempt = parked = None
    for h, v in headers_of(msg):
        if h == ORIGINAL_OFFSET:
            off = v
        elif h == ORIGINAL_PARTITION:
            part = v
        elif h == ATTEMPT:
            attempt = v
        elif h == PARKED_BEHIND:
            parked = v
    return LadderPosition(_int(part), _int(off), None if parked is None else max(0, _int(attempt)))


def _int(v: bytes | None) -> int:
    try:
        return -1 if v is None else int(v)
    except ValueError:
        return -1


def failure_headers(
    msg: Message,
    *,
    group: str,
    attempt: int,
    exc: BaseException | None,
    due_at_s: float | None,
    ids: IdGenerator,
    parked_behind: int | None = None,
) -> tuple[CheckedHeaders, str, Origin]:
    """Headers for a hop to a retry tier or to the dead letters, the message id they carry, its origin.

    One pass over the message's headers: the application's are kept in order, the previous hop's
    metadata is dropped (and its origin read), then the new metadata is appended.

    Args:
        msg: the message that failed (from the main topic or a tier).
        group: the consumer group.
        attempt: handling attempts made so far, this failed one included.
        exc: the exception the handler raised; None when the message is parked (ordering="key")
            without a new failure, which keeps its last failure's class and message, if any.
        due_at_s: epoch seconds when the next attempt is due (None for a dead letter).
        ids: where a new `outbox-id` comes from when the message has none.
        parked_behind: main-topic offset of the earlier message of its key it is parked behind.
    """
    # librdkafka gives a consumed message's headers as (str, bytes | None) pairs, and the ones
    # added here are such pairs too: produce() takes the list without checking it again.
    kept = CheckedHeaders()
    found: dict[str, bytes | None] = {}
    msg_id: str | None = None
    for h, v in headers_of(msg):
        if h in MANAGED:
            found[h] = v
            continue
        if h == ID_HEADER and v is not None:
            msg_id = v.decode("utf-8", "replace")
        kept.append((h, v))
    origin = _origin_from(found, msg)
    if msg_id is None:
        msg_id = ids()
        kept.append((ID_HEADER, msg_id.encode()))
    topic = origin.topic.encode()
    kept += [
        (ORIGINAL_TOPIC, topic),
        (ORIGINAL_PARTITION, str(origin.partition).encode()),
        (ORIGINAL_OFFSET, str(origin.offset).encode()),
        (ORIGINAL_TIMESTAMP, str(origin.timestamp_ms).encode()),
        (GROUP, group.encode()),
        (ATTEMPT, str(attempt).encode()),
    ]
    if due_at_s is not None:
        kept.append((DUE_AT, str(int(due_at_s * 1000)).encode()))
    if exc is not None:
        kept += [(ERROR_CLASS, error_class(exc).encode()), (ERROR_MESSAGE, cap_utf8(str(exc)))]
    else:
        kept += [(h, found[h]) for h in (ERROR_CLASS, ERROR_MESSAGE) if found.get(h) is not None]
    kept.append((SPRING_ORIGINAL_TOPIC, topic))
    if parked_behind is not None:
        kept.append((PARKED_BEHIND, str(parked_behind).encode()))
    return kept, msg_id, origin


def _origin_from(found: dict[str, bytes | None], msg: Message) -> Origin:
    """The origin from a tier message's metadata headers, else the message's own place."""
    topic = found.get(ORIGINAL_TOPIC)
    if topic is not None:
        try:
            return Origin(
                topic.decode("utf-8", "replace"),
                int(found.get(ORIGINAL_PARTITION) or -1),
                int(found.get(ORIGINAL_OFFSET) or -1),
                int(found.get(ORIGINAL_TIMESTAMP) or -1),
            )
        except ValueError:
            pass  # damaged by hand: fall back to the message's own place
    return Origin(msg.topic() or "", msg.partition() or 0, msg.offset() or 0, msg.timestamp()[1])


@dataclass(frozen=True, slots=True)
class ConsumerFailure:
    """What the consumer's headers say about a dead letter or a tier message (for the CLI and tools)."""

    group: str
    origin: Origin
    attempt: int | None
    error_class: str | None
    error_message: str | None

    def as_dict(self) -> dict[str, object]:
        return {
            "group": self.group,
            "original_topic": self.origin.topic,
            "original_partition": self.origin.partition,
            "original_offset": self.origin.offset,
            "original_timestamp_ms": self.origin.timestamp_ms,
            "attempt": self.attempt,
            "error_class": self.error_class,
            "error_message": self.error_message,
        }


def consumer_failure(headers: Headers | None) -> ConsumerFailure | None:
    """The consumer metadata carried by `headers`, or None when they are not a consumer's."""
    group = find_text(headers, GROUP)
    topic = find_text(headers, ORIGINAL_TOPIC)
    if group is None or topic is None:
        return None

    def number(name: str) -> int:
        try:
            return int(find_text(headers, name) or -1)
        except ValueError:
            return -1

    attempt = number(ATTEMPT)
    return ConsumerFailure(
        group=group,
        origin=Origin(topic, number(ORIGINAL_PARTITION), number(ORIGINAL_OFFSET), number(ORIGINAL_TIMESTAMP)),
        attempt=None if attempt < 0 else attempt,
        error_class=find_text(headers, ERROR_CLASS),
        error_message=find_text(headers, ERROR_MESSAGE),
    )
