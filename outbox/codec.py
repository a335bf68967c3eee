"""Byte encoding of message headers for the store: no pickle, order and duplicates kept.

Layout, repeated per header: u16 name length, UTF-8 name, i32 value length (-1 for None), value.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

_NAME = struct.Struct(">H")
_VALUE = struct.Struct(">i")


def encode_headers(headers: Sequence[tuple[str, bytes | None]] | None) -> bytes | None:
    """Encode headers to bytes; None or empty gives None (stored as NULL)."""
    if not headers:
        return None
    out = bytearray()
    for name, value in headers:
        raw = name.encode("utf-8")
        out += _NAME.pack(len(raw))
        out += raw
        if value is None:
            out += _VALUE.pack(-1)
        else:
            out += _VALUE.pack(len(value))
            out += value
    return bytes(out)


def decode_headers(blob: bytes | None) -> list[tuple[str, bytes | None]]:
    """Inverse of `encode_headers`."""
    if not blob:
        return []
    headers: list[tuple[str, bytes | None]] = []
    end = len(blob)
    pos = 0
    # Plain slicing and int.from_bytes: cheaper than struct on a memoryview for the short
    # headers every stored row has (one per drained row; the drain's profile counts it).
    while pos < end:
        n = (blob[pos] << 8) | blob[pos + 1]
        pos += 2
        name = blob[pos : pos + n].decode("utf-8")
        pos += n
        vlen = int.from_bytes(blob[pos : pos + 4], "big", signed=True)
        pos += 4
        if vlen < 0:
            headers.append((name, None))
        else:
            headers.append((name, blob[pos : pos + vlen]))
            pos += vlen
    return headers
