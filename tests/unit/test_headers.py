"""Message ids and the retry headers added to re-sends from the outbox."""

from __future__ import annotations

import re
import threading

import pytest

from outbox.headers import (
    ATTEMPT_HEADER,
    FIRST_FAILED_HEADER,
    ID_HEADER,
    LAST_ERROR_HEADER,
    IdGenerator,
    find,
    for_resend,
    resent_once,
)
from outbox.records import Headers

HEX32 = re.compile(r"[0-9a-f]{32}")
ERR = "_MSG_TIMED_OUT (-192): Local: Message timed out"


# -- ids ---------------------------------------------------------------------------------------


def test_ids_are_unique_32_hex_chars() -> None:
    gen = IdGenerator()
    ids = [gen() for _ in range(100_000)]
    assert len(set(ids)) == len(ids)
    assert all(HEX32.fullmatch(i) for i in ids)
    assert gen.issued == 100_000


def test_two_generators_differ() -> None:
    a, b = IdGenerator(), IdGenerator()
    ids_a = {a() for _ in range(1000)}
    ids_b = {b() for _ in range(1000)}
    assert not ids_a & ids_b
    # The random prefix differs, not just the counters' overlap being avoided by luck.
    assert next(iter(ids_a))[:16] != next(iter(ids_b))[:16]


def test_ids_sort_in_issue_order_within_a_generator() -> None:
    gen = IdGenerator()
    ids = [gen() for _ in range(5000)]
    assert ids == sorted(ids)


def test_ids_unique_across_threads() -> None:
    gen = IdGenerator()
    start = threading.Barrier(4)
    results: list[list[str]] = [[] for _ in range(4)]

    def work(out: list[str]) -> None:
        start.wait()
        for _ in range(10_000):
            out.append(gen())

    threads = [threading.Thread(target=work, args=(r,)) for r in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for r in results for i in r]
    assert len(every) == 40_000
    assert len(set(every)) == 40_000
    assert gen.issued == 40_000


# -- find ----------------------------------------------------------------------------------------


def test_find_returns_the_last_value_or_none() -> None:
    h: Headers = [("a", b"1"), ("b", b"2"), ("a", b"3")]
    assert find(h, "a") == b"3"
    assert find(h, "b") == b"2"
    assert find(h, "c") is None
    assert find(None, "a") is None
    assert find([], "a") is None


# -- for_resend ----------------------------------------------------------------------------------


def test_for_resend_keeps_app_headers_in_order_and_appends_retry_metadata() -> None:
    app: Headers = [("trace", b"t1"), ("dup", b"1"), ("", None), ("dup", b"2"), (ID_HEADER, b"abc")]
    out = for_resend(app, msg_id="abc", attempt=2, first_failed_at=1_700_000_000.25, last_error=ERR)
    assert out == [
        *app,
        (ATTEMPT_HEADER, b"2"),
        (FIRST_FAILED_HEADER, b"1700000000250"),
        (LAST_ERROR_HEADER, ERR.encode()),
    ]
    # The stored list is not modified in place.
    assert app == [("trace", b"t1"), ("dup", b"1"), ("", None), ("dup", b"2"), (ID_HEADER, b"abc")]


def test_for_resend_replaces_old_retry_headers_instead_of_repeating() -> None:
    h: Headers = [("app", b"x"), (ID_HEADER, b"id1")]
    for attempt in range(2, 6):
        h = for_resend(h, msg_id="id1", attempt=attempt, first_failed_at=100.0, last_error=f"E{attempt}")
    names = [n for n, _ in h]
    assert names == ["app", ID_HEADER, ATTEMPT_HEADER, FIRST_FAILED_HEADER, LAST_ERROR_HEADER]
    assert find(h, ATTEMPT_HEADER) == b"5"
    assert find(h, LAST_ERROR_HEADER) == b"E5"


def test_for_resend_drops_retry_headers_wherever_they_were() -> None:
    h: Headers = [
        (ATTEMPT_HEADER, b"1"),
        ("app", b"x"),
        (LAST_ERROR_HEADER, b"old"),
        (FIRST_FAILED_HEADER, b"5"),
        ("app2", b"y"),
    ]
    out = for_resend(h, msg_id="m", attempt=3, first_failed_at=None, last_error=None)
    assert out == [("app", b"x"), ("app2", b"y"), (ID_HEADER, b"m"), (ATTEMPT_HEADER, b"3")]


def test_for_resend_adds_id_when_missing() -> None:
    out = for_resend([("app", b"x")], msg_id="deadbeef", attempt=1, first_failed_at=None, last_error=None)
    assert out == [("app", b"x"), (ID_HEADER, b"deadbeef"), (ATTEMPT_HEADER, b"1")]
    out = for_resend(None, msg_id="deadbeef", attempt=1, first_failed_at=None, last_error=None)
    assert out == [(ID_HEADER, b"deadbeef"), (ATTEMPT_HEADER, b"1")]


def test_for_resend_keeps_the_stored_id_and_adds_none_for_empty_msg_id() -> None:
    out = for_resend([(ID_HEADER, b"stored")], msg_id="other", attempt=1, first_failed_at=None, last_error=None)
    assert [v for n, v in out if n == ID_HEADER] == [b"stored"]
    out = for_resend([("a", b"1")], msg_id="", attempt=1, first_failed_at=None, last_error=None)
    assert find(out, ID_HEADER) is None


@pytest.mark.parametrize("last_error", [None, "", "not sent: key has messages in the outbox", "é" * 400])
def test_resent_once_is_for_resend_of_a_never_failed_row_with_the_id_header_alone(last_error: str | None) -> None:
    stored: Headers = [(ID_HEADER, b"abc")]
    first = resent_once(stored[0], last_error)  # the error text's header made here, then cached
    expected = for_resend(stored, msg_id="abc", attempt=1, first_failed_at=None, last_error=last_error)
    assert first == expected
    assert resent_once(stored[0], last_error) == expected


@pytest.mark.parametrize(
    ("first_failed_at", "expected"),
    [(0.0, b"0"), (1.0, b"1000"), (1_700_000_000.123, b"1700000000123"), (1_700_000_000.9999, b"1700000000999")],
)
def test_first_failed_at_is_integer_epoch_millis(first_failed_at: float, expected: bytes) -> None:
    out = for_resend([], msg_id="m", attempt=1, first_failed_at=first_failed_at, last_error=None)
    assert find(out, FIRST_FAILED_HEADER) == expected


def test_last_error_is_utf8_and_capped_at_512_bytes() -> None:
    out = for_resend([], msg_id="m", attempt=1, first_failed_at=None, last_error="x" * 2000)
    assert find(out, LAST_ERROR_HEADER) == b"x" * 512
    out = for_resend([], msg_id="m", attempt=1, first_failed_at=None, last_error="Broker: réplica ✗")
    assert find(out, LAST_ERROR_HEADER) == "Broker: réplica ✗".encode()


def test_empty_last_error_adds_no_header() -> None:
    out = for_resend([], msg_id="m", attempt=1, first_failed_at=None, last_error="")
    assert find(out, LAST_ERROR_HEADER) is None


def test_truncated_last_error_header_is_valid_utf8() -> None:
    out = for_resend([], msg_id="m", attempt=1, first_failed_at=None, last_error="€" * 200)
    value = find(out, LAST_ERROR_HEADER)
    assert value is not None and len(value) <= 512
    assert value.decode("utf-8") == "€" * (len(value) // 3)
