"""hypothesis over produce()'s arguments: a clear error or a stored/sent message, never both.

The producer is real (librdkafka, a real SQLite outbox) and points at a closed port: no broker
is needed to judge validation. Write-ahead mode stores every accepted message; after each call
the group-commit writer is flushed (with a time limit: a dead writer thread must fail the test,
not hang it), so the outbox's row count says exactly what was kept.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox import OutboxError, ResilientProducer
from outbox.stores import SQLiteOutbox

MAX_BYTES = 4096
# Every code point, lone surrogates included (hypothesis leaves them out by default): a str that
# cannot be encoded as UTF-8 is exactly what once killed the writer thread from a header name.
_ODD = ["a", "é", "\u200d", "\u202e", "\x00", "\ud800", "\udfff", "🙂", "\n", ":", "@"]


def _text(max_size: int) -> st.SearchStrategy[str]:
    # hypothesis' own text() leaves out surrogates, and mixing alphabets inside one text()
    # loses them too: three separate strategies.
    return st.one_of(
        st.text(max_size=max_size),
        st.text(st.characters(categories=["Cs"]), min_size=1, max_size=max_size),
        st.text(st.sampled_from(_ODD), max_size=max_size),
    )  # message.max.bytes, small so that sizes past it are cheap to generate

_ANY_SCALAR = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), _text(20), st.binary(max_size=20)
)
_PAYLOAD = st.one_of(
    st.none(),
    st.binary(max_size=MAX_BYTES + 200),
    _text(MAX_BYTES // 2 + 100),  # includes lone surrogates: not encodable as UTF-8
    st.builds(bytearray, st.binary(max_size=100)),
    st.builds(memoryview, st.binary(max_size=100)),
    st.integers(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(_text(3), st.integers(), max_size=2),
)
_TOPIC = st.one_of(
    st.sampled_from(["fuzz", "fuzz.topic-1_A", "a" * 249]),
    _text(260),
    st.from_regex(r"[a-zA-Z0-9._-]{0,260}", fullmatch=True),
    _ANY_SCALAR,
)
_HEADER_NAME = st.one_of(_text(30), _ANY_SCALAR)
_HEADER_VALUE = st.one_of(st.none(), st.binary(max_size=50), _text(50), _ANY_SCALAR)
_HEADERS = st.one_of(
    st.none(),
    st.lists(st.tuples(_HEADER_NAME, _HEADER_VALUE), max_size=4),
    st.lists(
        st.one_of(_text(3), st.tuples(_HEADER_NAME), st.tuples(_HEADER_NAME, _HEADER_VALUE, _HEADER_VALUE)),
        max_size=3,
    ),
    st.dictionaries(_text(10), _HEADER_VALUE, max_size=3),
    st.dictionaries(
        _ANY_SCALAR.filter(lambda x: x is not None and not isinstance(x, float)), _HEADER_VALUE, max_size=2
    ),
    _ANY_SCALAR,
)
_PARTITION = st.one_of(st.none(), st.integers(min_value=-3, max_value=2**40), _ANY_SCALAR)
_ENABLE_RETRY = st.one_of(st.booleans(), st.none(), st.integers(0, 2), _text(2))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def producer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ResilientProducer, SQLiteOutbox]]:
    path: Path = tmp_path_factory.mktemp("fuzz") / "o.db"
    p = ResilientProducer(
        {
            "bootstrap.servers": f"127.0.0.1:{_closed_port()}",
            "message.max.bytes": MAX_BYTES,
            "message.timeout.ms": 600000,
        },
        outbox=SQLiteOutbox(str(path), synchronous="NORMAL"), mode="write-ahead", durability="batch",
        drain_workers=0,
    )
    reader = SQLiteOutbox(str(path), synchronous="NORMAL")
    yield p, reader
    p.close(timeout=1)
    reader.close()


def rows(store: SQLiteOutbox) -> int:
    st_ = store.stats(now=time.time())
    return st_.pending + st_.dead


FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def check(producer: tuple[ResilientProducer, SQLiteOutbox], **kwargs: Any) -> None:
    """produce(**kwargs) either raises a named error and keeps nothing, or keeps the message."""
    p, store = producer
    args = {"topic": "fuzz", "value": b"v", "key": b"k", "headers": None, "partition": None, "enable_retry": True}
    args.update(kwargs)
    before = rows(store)
    try:
        msg_id = p.produce(**args)
    except (TypeError, ValueError, OutboxError) as exc:
        text = str(exc)
        assert text and "Traceback" not in text, repr(exc)
        assert rows(store) == before, f"rejected ({exc}) but stored"
        return
    assert isinstance(msg_id, str) and msg_id
    # A background thread must never die from bad input (the writer did, from a surrogate in a
    # header name that only it encoded).
    assert p.writer.flush(timeout=10) == 0 and p.writer._thread.is_alive()
    # Accepted with retry: committed (pending, or dead-lettered at once if librdkafka refuses
    # it, e.g. too large). Without retry: handed to librdkafka only, never stored.
    assert rows(store) == before + (1 if args["enable_retry"] else 0)


@FUZZ
@given(topic=_TOPIC, value=_PAYLOAD, key=_PAYLOAD, headers=_HEADERS, partition=_PARTITION, enable_retry=_ENABLE_RETRY)
def test_produce_everything_at_once(
    producer: tuple[ResilientProducer, SQLiteOutbox],
    topic: Any, value: Any, key: Any, headers: Any, partition: Any, enable_retry: Any,
) -> None:
    check(producer, topic=topic, value=value, key=key, headers=headers, partition=partition, enable_retry=enable_retry)


# One argument at a time, the others valid: junk in one place must not hide behind another.
@FUZZ
@given(topic=_TOPIC)
def test_produce_topic(producer: tuple[ResilientProducer, SQLiteOutbox], topic: Any) -> None:
    check(producer, topic=topic)


@FUZZ
@given(value=_PAYLOAD, key=_PAYLOAD)
def test_produce_value_and_key(producer: tuple[ResilientProducer, SQLiteOutbox], value: Any, key: Any) -> None:
    check(producer, value=value, key=key)


@FUZZ
@given(headers=_HEADERS)
def test_produce_headers(producer: tuple[ResilientProducer, SQLiteOutbox], headers: Any) -> None:
    check(producer, headers=headers)


@FUZZ
@given(partition=_PARTITION, enable_retry=_ENABLE_RETRY)
def test_produce_partition_and_retry_flag(
    producer: tuple[ResilientProducer, SQLiteOutbox], partition: Any, enable_retry: Any
) -> None:
    check(producer, partition=partition, enable_retry=enable_retry)


NOT_UTF8 = "not valid UTF-8 text (surrogates not allowed)"
NOT_PAIR = "each header must be a (name, value) pair, got"


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"headers": [("\ud800", b"x")]}, ValueError, "header '\\ud800': name is " + NOT_UTF8),
        ({"headers": [("h", "\udfff")]}, ValueError, f"header 'h': value is {NOT_UTF8}"),
        ({"headers": ["ab"]}, TypeError, "each header must be a (name, value) pair, got 'ab'"),
        ({"headers": [("a", b"1", b"2")]}, TypeError, f"{NOT_PAIR} ('a', b'1', b'2')"),
        ({"partition": 2**31}, ValueError, "partition must be an int from -1 to 2147483647, got 2147483648"),
        ({"timestamp": -1}, ValueError, "timestamp must be an int of milliseconds since the epoch (0: none), got -1"),
        ({"timestamp": 1.5}, TypeError, "timestamp must be an int of milliseconds since the epoch (0: none), got 1.5"),
    ],
)
def test_what_the_fuzzer_found_is_a_clear_error_and_nothing_stored(
    producer: tuple[ResilientProducer, SQLiteOutbox], kwargs: dict[str, Any], error: type[Exception], text: str
) -> None:
    p, store = producer
    before = rows(store)
    with pytest.raises(error) as info:
        p.produce("fuzz", b"v", **kwargs)
    assert str(info.value) == text
    assert p.writer.flush(timeout=10) == 0 and rows(store) == before
