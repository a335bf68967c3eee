"""Kafka's topic-name rule and produce()'s payload checks (outbox.message): pure logic."""

from __future__ import annotations

import pytest

from outbox.errors import ConfigError
from outbox.message import (
    as_bytes,
    check_partition,
    check_timestamp,
    check_topic,
    normalize_headers,
    topic_chars_ok,
    topic_problem,
)


@pytest.mark.parametrize("name", ["orders", "a", "a.b_c-D9", "x" * 249, "...", ".a"])
def test_names_kafka_accepts(name: str) -> None:
    assert topic_problem(name) is None
    check_topic(name)


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("", "topic name is empty"),
        (".", "topic name '.' is not allowed by Kafka"),
        ("..", "topic name '..' is not allowed by Kafka"),
        ("x" * 250, "topic name is 250 characters long; Kafka allows 249"),
        ("a b", "topic name 'a b' has characters Kafka does not allow (only a-z A-Z 0-9 . _ -)"),
        # A regex `^...$` with match() accepts a trailing newline; fullmatch does not.
        ("orders\n", "topic name 'orders\\n' has characters Kafka does not allow (only a-z A-Z 0-9 . _ -)"),
        ("ordérs", "topic name 'ordérs' has characters Kafka does not allow (only a-z A-Z 0-9 . _ -)"),
    ],
)
def test_names_kafka_refuses(name: str, problem: str) -> None:
    assert topic_problem(name) == problem
    with pytest.raises(ConfigError) as exc:
        check_topic(name)
    assert str(exc.value) == problem


def test_a_topic_that_is_not_a_str_is_a_type_error() -> None:
    assert topic_problem(b"orders") == "topic must be str, not bytes"
    with pytest.raises(TypeError, match="^topic must be str, not NoneType$"):
        check_topic(None)


def test_characters_of_a_name_part() -> None:
    assert topic_chars_ok("my-group.v2") and not topic_chars_ok("my group") and not topic_chars_ok("")


def test_timestamp() -> None:
    assert check_timestamp(0) == 0 and check_timestamp(1_795_634_888_790) == 1_795_634_888_790
    assert check_timestamp(2**63 - 1) == 2**63 - 1
    for bad, error in ((-1, ConfigError), (2**63, OverflowError), (1.5e12, TypeError), (True, TypeError),
                       ("1", TypeError), (None, TypeError)):
        with pytest.raises(error, match="^timestamp must"):
            check_timestamp(bad)


def test_partition() -> None:
    assert check_partition(None) == -1 and check_partition(-1) == -1 and check_partition(2**31 - 1) == 2**31 - 1
    for bad in (-2, 2**31, 1.0, True, "1"):
        with pytest.raises(ConfigError, match="^partition must be an int from -1 to 2147483647, got "):
            check_partition(bad)


def test_payloads_and_headers() -> None:
    assert as_bytes("é") == "é".encode() and as_bytes(bytearray(b"x")) == b"x" and as_bytes(None) is None
    assert normalize_headers({"a": "1", "b": None}) == [("a", b"1"), ("b", None)]
    assert normalize_headers([("a", b"1"), ["a", b"2"]]) == [("a", b"1"), ("a", b"2")]
    with pytest.raises(TypeError, match="each header must be a"):
        normalize_headers(["ab"])
    with pytest.raises(TypeError, match="header 'a' value must be bytes, str or None, not int"):
        normalize_headers([("a", 1)])
    with pytest.raises(ValueError, match="header 'a': value is not valid UTF-8 text"):
        normalize_headers([("a", "\ud800")])
