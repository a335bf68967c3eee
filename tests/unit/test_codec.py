"""Header encoding for the store: exact round trips (order, duplicates, None, empty) and a stable layout."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from outbox.stores.codec import decode_headers, encode_headers

names = st.text()  # any Unicode except lone surrogates (not encodable, and not valid Kafka header names)
values = st.none() | st.binary()
header_lists = st.lists(st.tuples(names, values), max_size=20)


@settings(max_examples=150, deadline=None)
@given(header_lists)
def test_round_trip_keeps_everything(headers: list[tuple[str, bytes | None]]) -> None:
    blob = encode_headers(headers)
    if not headers:
        assert blob is None
        assert decode_headers(blob) == []
    else:
        assert isinstance(blob, bytes)
        assert decode_headers(blob) == headers


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(["a", "", "é", "a"]), min_size=1, max_size=10), st.data())
def test_round_trip_with_many_duplicate_names(hnames: list[str], data: st.DataObject) -> None:
    headers = [(n, data.draw(values)) for n in hnames]
    assert decode_headers(encode_headers(headers)) == headers


@settings(max_examples=50, deadline=None)
@given(header_lists)
def test_encoding_is_a_concatenation_per_header(headers: list[tuple[str, bytes | None]]) -> None:
    # Each header encodes independently, so a blob splits into per-header pieces: no framing state.
    pieces = [encode_headers([h]) or b"" for h in headers]
    assert (encode_headers(headers) or b"") == b"".join(pieces)


def test_none_and_empty_encode_to_none() -> None:
    assert encode_headers(None) is None
    assert encode_headers([]) is None
    assert encode_headers(()) is None
    assert decode_headers(None) == []
    assert decode_headers(b"") == []


def test_empty_name_empty_value_and_none_value_are_distinct() -> None:
    headers: list[tuple[str, bytes | None]] = [("", b""), ("", None), ("x", b""), ("x", None)]
    blob = encode_headers(headers)
    assert blob is not None
    assert decode_headers(blob) == headers


def test_layout_is_stable() -> None:
    # The blob lives in outbox files across library versions: pin the byte layout
    # (u16 name length, UTF-8 name, i32 value length or -1 for None, value; big-endian).
    blob = encode_headers([("ké", b"\x00\x01"), ("n", None)])
    assert blob == (b"\x00\x03k\xc3\xa9" + b"\x00\x00\x00\x02\x00\x01" + b"\x00\x01n" + b"\xff\xff\xff\xff")


def test_binary_values_are_kept_byte_for_byte() -> None:
    value = bytes(range(256)) * 40  # 10 KiB, every byte value
    assert decode_headers(encode_headers([("bin", value)])) == [("bin", value)]


def test_long_unicode_name() -> None:
    name = "名前" * 5000  # 30,000 UTF-8 bytes: within the u16 length
    assert decode_headers(encode_headers([(name, b"v")])) == [(name, b"v")]
