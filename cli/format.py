"""How the `outbox` command prints things: bytes, times, sizes, tables and JSON.

Message bytes come from applications and may be anything, so nothing is written to a terminal
unless it is printable text: binary keys and values are shown as hex (short) or base64 (long),
always labelled, so a dead letter full of escape sequences cannot garble the operator's screen.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from outbox.records import OutboxMessage

#: Binary payloads up to this many bytes are shown as hex, longer ones as base64 (shorter).
HEX_LIMIT = 64

_ALLOWED_CONTROLS = {"\n", "\t", "\r"}


def as_text(data: bytes) -> str | None:
    """`data` decoded as UTF-8 if it is printable text (newlines and tabs allowed), else None."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if all(ch.isprintable() or ch in _ALLOWED_CONTROLS for ch in text):
        return text
    return None


def render_bytes(data: bytes | None, encoding: str = "auto") -> tuple[str | None, str | None]:
    """Bytes as a printable string and the name of the encoding used.

    Args:
        data: the bytes (None stays None).
        encoding: "auto" (text if printable UTF-8, else hex up to `HEX_LIMIT` bytes, else base64),
            or force one of "text", "hex", "base64". "text" falls back to auto for binary data:
            it never prints raw control bytes.

    Returns:
        (string, encoding) with encoding one of "utf-8", "hex", "base64"; (None, None) for None.
    """
    if data is None:
        return None, None
    if encoding in ("auto", "text"):
        text = as_text(data)
        if text is not None:
            return text, "utf-8"
        encoding = "hex" if len(data) <= HEX_LIMIT else "base64"
    if encoding == "hex":
        return data.hex(), "hex"
    return base64.b64encode(data).decode("ascii"), "base64"


def short_bytes(data: bytes | None, width: int = 24) -> str:
    """One table cell for a key: text (one line, cut to `width`), `0x…` hex, or `-` for None."""
    if data is None:
        return "-"
    text = as_text(data)
    shown = re.sub(r"\s", " ", text) if text is not None else "0x" + data.hex()
    return shown if len(shown) <= width else shown[: width - 1] + "…"


def iso(ts: float | None) -> str | None:
    """Epoch seconds as ISO-8601 UTC with milliseconds (JSON output); None stays None."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def when(ts: float | None) -> str:
    """Epoch seconds as `2024-05-01 12:00:03Z` (text output, UTC); `-` for None."""
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def duration(seconds: float) -> str:
    """A duration rounded to its two largest units: `45s`, `3m 20s`, `2h 5m`, `3d 4h`."""
    s = int(round(abs(seconds)))
    if s < 60:
        return f"{s}s"
    units = [(s // 86400, "d"), (s % 86400 // 3600, "h"), (s % 3600 // 60, "m"), (s % 60, "s")]
    first = next(i for i, (v, _) in enumerate(units) if v)
    return " ".join(f"{v}{u}" for v, u in units[first : first + 2])


def size(n: int) -> str:
    """A byte count for people: `512 B`, `1.5 KiB`, `3.2 MiB`."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover - the loop always returns


def table(headers: Sequence[str] | None, rows: Sequence[Sequence[str]], indent: str = "") -> str:
    """Left-aligned columns separated by two spaces; the last column is not padded.

    Args:
        headers: column titles, or None for no title line.
        rows: the cells, as strings.
        indent: put before every line.
    """
    body = [list(r) for r in rows]
    all_rows = ([list(headers)] if headers is not None else []) + body
    if not all_rows:
        return ""
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(all_rows[0]))]
    lines = []
    for row in all_rows:
        cells = [c.ljust(widths[i]) if i < len(row) - 1 else c for i, c in enumerate(row)]
        lines.append(indent + "  ".join(cells).rstrip())
    return "\n".join(lines)


def dumps(doc: Any) -> str:
    """One JSON document on one line, keys in a stable order, non-ASCII kept readable.

    One line: a script that reads stdout line by line (`read`, `tail -1`, a log shipper) gets
    the whole document as one record; `jq .` pretty-prints it. A lone surrogate (a command-line
    argument that was not valid UTF-8) cannot be written as UTF-8, so a document holding one is
    written with escapes instead."""
    text = json.dumps(doc, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(doc)
    return text


def message_json(row: OutboxMessage, encoding: str = "auto") -> dict[str, Any]:
    """Everything about one stored message, for `--json`: bytes labelled with their encoding.

    Times are ISO-8601 UTC strings. Keys and values use the same rules as the text output, so a
    UTF-8 value can be read directly and a binary one decoded from its `*_encoding`.
    """
    key, key_enc = render_bytes(row.key, encoding)
    value, value_enc = render_bytes(row.value, encoding)
    headers = []
    for name, raw in row.headers:
        text, enc = render_bytes(raw, encoding)
        headers.append({"name": name, "value": text, "encoding": enc})
    return {
        "id": row.id,
        "msg_id": row.msg_id,
        "status": row.status.name.lower(),
        "topic": row.topic,
        "partition": row.partition,
        "key": key,
        "key_encoding": key_enc,
        "value": value,
        "value_encoding": value_enc,
        "size": len(row.value) if row.value is not None else 0,
        "headers": headers,
        "attempts": row.attempts,
        "created_at": iso(row.created_at),
        "first_failed_at": iso(row.first_failed_at),
        "last_failed_at": iso(row.last_failed_at),
        "next_attempt_at": iso(row.next_attempt_at),
        "last_error": row.last_error,
    }
