"""The console's pure logic: filter parsing, header text round trip, value decoding, security helpers."""

from __future__ import annotations

import pytest

from outbox.records import DeadLetterFilter
from outbox.ui import present, security
from outbox.ui.filters import FilterError, describe, parse_filter, query_of


def test_parse_filter_reads_what_the_cli_reads() -> None:
    f = parse_filter({"topic": " orders ", "error": "msg_timed_out", "key": "k", "group": "", "text": "x",
                      "since": "2024-05-01", "after": "7", "limit": "20"}, paging=True)
    assert f == DeadLetterFilter(topic="orders", error="_MSG_TIMED_OUT", key=b"k", text="x",
                                 since=1714521600.0, after_id=7, limit=20)
    assert parse_filter({}, paging=True).limit == 50
    assert parse_filter({"after": "7"}, allow=("after",)).after_id is None  # actions never page
    assert parse_filter({}, ids=["3", 1, "3"]).ids == (1, 3)


@pytest.mark.parametrize(("values", "message"), [
    ({"nope": "1"}, "unknown filter field(s): nope"),
    ({"limit": "501"}, "limit: 501 is not between 1 and 500"),
    ({"limit": "x"}, "limit: 'x' is not a whole number"),
    ({"until": "soon"}, "until: cannot read the time 'soon'"),
    ({"topic": 3}, "topic: expected text, got int"),
    ({"topic": "t" * 1001}, "topic: longer than 1000 characters"),
])
def test_parse_filter_errors_name_the_field(values: dict[str, object], message: str) -> None:
    with pytest.raises(FilterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_filter(values, paging=True)


def test_describe_and_query_round_trip() -> None:
    f = parse_filter({"topic": "t", "key": "k", "since": "2024-05-01T00:00:00+00:00"}, ids=[2])
    assert describe(f) == {"ids": [2], "topic": "t", "key": "k", "since": 1714521600.0}
    assert parse_filter(query_of(f)) == DeadLetterFilter(topic="t", key=b"k", since=1714521600.0)


def test_headers_as_text_round_trip() -> None:
    headers = [("a", b"1"), ("a", b"x: y"), ("none", None), ("empty", b"")]
    text = present.headers_as_text(headers)
    assert text == "a: 1\na: x: y\nnone\nempty:"
    assert present.parse_headers(text + "\n\n") == headers
    with pytest.raises(ValueError, match="line 2"):
        present.parse_headers("a: 1\n: 2")


# Every header the form cannot show as plain `name: text` still comes back as the same bytes.
AWKWARD_HEADERS = [
    ("h", b"\xff\xfe binary"),  # not UTF-8
    ("json", b'{"a": [1, 2]}'),
    ("spaced", b"  padded  "),  # leading and trailing blanks a text line would lose
    ("lines", b"one\r\ntwo"),  # a line break inside a value
    ("colon", b":starts with a colon"),
    ("nul", b"a\x00b"),
    ("name: with colon", b"v"),
    (" spaced name", None),
    ('"quoted"', b"q"),
    ("empty", b""),
    ("none", None),
]


def test_headers_as_text_is_lossless_for_any_bytes() -> None:
    text = present.headers_as_text(AWKWARD_HEADERS)
    assert "h:: fffe2062696e617279" in text.splitlines()  # hex, marked by the double colon
    assert present.parse_headers(text) == AWKWARD_HEADERS
    assert present.parse_headers(text.replace("\n", "\r\n")) == AWKWARD_HEADERS  # as a browser posts it
    with pytest.raises(ValueError, match="headers line 1: 'zz' is not hex"):
        present.parse_headers("h:: zz")
    with pytest.raises(ValueError, match="headers line 1: the quoted name does not end"):
        present.parse_headers('"open: 1')


@pytest.mark.parametrize(("value", "shown"), [
    (b'{"note":"compact","n":[1,2]}', ('{"note":"compact","n":[1,2]}', "utf-8")),  # as stored, not re-indented
    (b"two\nlines", ("two\nlines", "utf-8")),
    (b"\nleading newline", ("\nleading newline", "utf-8")),
    (b"crlf\r\n", ("63726c660d0a", "hex")),  # a browser posts every line break as CRLF
    (b"\xff\xfe binary", ("fffe2062696e617279", "hex")),
    (b"", ("", "utf-8")),
    (None, ("", "null")),
])
def test_edit_value_round_trips_through_the_form(value: bytes | None, shown: tuple[str, str]) -> None:
    assert present.edit_value(value) == shown
    text, encoding = shown
    assert present.form_value(text.replace("\n", "\r\n"), encoding) == value


def test_form_value_errors() -> None:
    with pytest.raises(ValueError, match="value: not valid hex"):
        present.form_value("zz", "hex")
    with pytest.raises(ValueError, match="value: must be empty when the encoding is null"):
        present.form_value("x", "null")
    with pytest.raises(ValueError, match="value_encoding: must be utf-8, hex or null"):
        present.form_value("x", "latin-1")


def test_decode_values() -> None:
    assert present.decode(b'{"a":1}') == ('{"a":1}', "utf-8")  # the stored text, never re-indented
    assert present.pretty(b'{"a":1}') == '{\n  "a": 1\n}'  # shown apart, never submitted
    assert present.pretty(b"12") is None  # JSON scalars stay as written
    assert present.pretty(b"[" * 100_000 + b"]" * 100_000) is None  # too deep to read: shown as text
    assert present.decode(b"<p>") == ("<p>", "utf-8")  # escaping is the template's job
    assert present.decode(b"\xff\x00") == ("ff00", "hex")
    assert present.decode(None) == (None, None)


def test_security_helpers() -> None:
    assert all(security.is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    assert not any(security.is_loopback(h) for h in ("0.0.0.0", "10.0.0.1", "example.com", "localhost.evil", ""))
    assert security.bearer("Bearer abc") == "abc" and security.bearer("bearer  abc ") == "abc"
    assert security.bearer("Basic abc") is None and security.bearer("Bearer ") is None and security.bearer(None) is None
    assert security.who(None) == "local" and security.who("t").startswith("token:") and len(security.who("t")) == 14
    assert security.token_matches("abc", "abc") and not security.token_matches("abc", "abd")
    assert not security.token_matches("abc", None)
    assert security.csrf_ok("x", "x") and not security.csrf_ok("x", "y") and not security.csrf_ok(None, "")
