"""Byte encoding of message headers for the store: no pickle, order and duplicates kept.

Layout, repeated per header: u16 name length, UTF-8 name, i32 value length (-1 for None), value.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

_VALUE = struct.Struct(">i")
_NONE = _VALUE.pack(-1)

# Header names repeat (`outbox-id` on every message): each name's encoded prefix and each
# encoded name's text are looked up, not rebuilt, per header (a drain decodes every message it
# sends, and the spill encodes every message it stores). Bounded: past the limit, names are
# encoded on each use.
_NAME_LIMIT = 1000
_PREFIXES: dict[str, bytes] = {}
_NAMES: dict[bytes, str] = {}


def _prefix(name: str) -> bytes:
    raw = name.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ValueError(f"header name is {len(raw)} bytes long; at most 65535 can be stored")
    out = len(raw).to_bytes(2, "big") + raw
    if len(_PREFIXES) < _NAME_LIMIT:
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
    names, length = _NAMES, _VALUE.unpack_from
    # Plain slicing and unpack_from on the bytes: cheaper than a memoryview, and unpack_from
    # costs a quarter of int.from_bytes on a slice (one header per drained row at least).
    while pos < end:
        n = (blob[pos] << 8) | blob[pos + 1]
        pos += 2
        raw = blob[pos : pos + n]
        name = names.get(raw)
        if name is None:
            name = raw.decode("utf-8")
            if len(names) < _NAME_LIMIT:
                names[raw] = name
        pos += n
        vlen = length(blob, pos)[0]
        pos += 4
        if vlen < 0:
            headers.append((name, None))
        else:
            headers.append((name, blob[pos : pos + vlen]))
            pos += vlen
    return headers
