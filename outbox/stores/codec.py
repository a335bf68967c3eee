"""Byte encoding of message headers for the store: no pickle, order and duplicates kept.

Layout, repeated per header: u16 name length, UTF-8 name, i32 value length (-1 for None), value.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

_VALUE = struct.Struct(">i")
_NONE = _VALUE.pack(-1)

# Header names and error texts repeat (`outbox-id` on every message, "not sent: ..." on every
# spilled one): they are encoded and decoded once, then looked up (a drain decodes every message
# it sends, and the spill encodes every message it stores). Bounded: past the limit, texts are
# converted on each use.
_CACHED = 1000
TEXTS: dict[bytes, str] = {}  # read directly by hot loops (`outbox.stores.grouped`)
_UTF8: dict[str, bytes] = {}
_PREFIXES: dict[str, bytes] = {}  # a header name as encode_headers writes it: length, then UTF-8


def text(raw: bytes) -> str:
    """`raw` decoded as UTF-8 (from a bounded cache: for texts that repeat)."""
    out = TEXTS.get(raw)
    if out is None:
        out = raw.decode("utf-8")
        if len(TEXTS) < _CACHED:
            TEXTS[raw] = out
    return out


def utf8(s: str) -> bytes:
    """`s` encoded as UTF-8 (from a bounded cache: for texts that repeat)."""
    out = _UTF8.get(s)
    if out is None:
        out = s.encode("utf-8")
        if len(_UTF8) < _CACHED:
            _UTF8[s] = out
    return out


def _prefix(name: str) -> bytes:
    raw = name.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ValueError(f"header name is {len(raw)} bytes long; at most 65535 can be stored")
    out = len(raw).to_bytes(2, "big") + raw
    if len(_PREFIXES) < _CACHED:
        _PREFIXES[name] = out
    return out


def encode_headers(headers: Sequence[tuple[str, bytes | None]] | None) -> bytes | None:
    """Encode headers to bytes; None or empty gives None (stored as NULL)."""
    if not headers:
        return None
    parts: list[bytes] = []
    pack = _VALUE.pack
    for name, value in headers:
        parts.append(_PREFIXES.get(name) or _prefix(name))
        if value is None:
            parts.append(_NONE)
        else:
            parts.append(pack(len(value)))
            parts.append(value)
    return b"".join(parts)


def decode_headers(blob: bytes | None) -> list[tuple[str, bytes | None]]:
    """Inverse of `encode_headers`."""
    if not blob:
        return []
    headers: list[tuple[str, bytes | None]] = []
    end = len(blob)
    pos = 0
    length = _VALUE.unpack_from
    # Plain slicing and unpack_from on the bytes: cheaper than a memoryview, and unpack_from
    # costs a quarter of int.from_bytes on a slice (one header per drained row at least).
    while pos < end:
        n = (blob[pos] << 8) | blob[pos + 1]
        pos += 2
        name = text(blob[pos : pos + n])
        pos += n
        vlen = length(blob, pos)[0]
        pos += 4
        if vlen < 0:
            headers.append((name, None))
        else:
            headers.append((name, blob[pos : pos + vlen]))
            pos += vlen
    return headers
