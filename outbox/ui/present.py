"""How the console shows a stored message: as JSON for the API, as fields for the pages.

Message bytes come from applications and may be anything. Values are pretty-printed JSON when
they parse, UTF-8 text when they decode, hex otherwise; headers are text when they decode (hex
otherwise). The pages escape all of it (Jinja2 autoescape): nothing here produces HTML.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from ..consumer.headers import consumer_failure
from ..records import AuditEntry, Headers, OutboxMessage

#: Values larger than this are cut in lists (the page of one message shows them whole).
PREVIEW = 120


def iso(ts: float | None) -> str | None:
    """Epoch seconds as ISO-8601 UTC with milliseconds; None stays None."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def decode(data: bytes | None) -> tuple[str | None, str | None]:
    """(text, encoding): "json" (pretty-printed), "utf-8", "hex", or (None, None) for None."""
    if data is None:
        return None, None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return data.hex(), "hex"
    try:
        doc = json.loads(text)
    except ValueError:
        return text, "utf-8"
    if isinstance(doc, (dict, list)):
        return json.dumps(doc, indent=2, ensure_ascii=False), "json"
    return text, "utf-8"


def header_text(value: bytes | None) -> tuple[str | None, str | None]:
    """A header value as text ("utf-8"), hex when it does not decode, (None, None) for None."""
    if value is None:
        return None, None
    try:
        return value.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return value.hex(), "hex"


def one_line(text: str | None, width: int = PREVIEW) -> str:
    if text is None:
        return "-"
    flat = re.sub(r"\s+", " ", text)
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _preview(data: bytes | None) -> tuple[str | None, str | None]:
    """The start of a value as text (or hex): only what a one-line preview can show is decoded."""
    if data is None or len(data) <= PREVIEW * 4:
        return header_text(data)
    cut = data[: PREVIEW * 4]
    for end in range(len(cut), len(cut) - 4, -1):  # a UTF-8 character is at most 4 bytes
        try:
            return cut[:end].decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            continue
    return cut.hex(), "hex"


def summary(row: OutboxMessage) -> dict[str, Any]:
    """One dead letter in a list: no value bytes beyond a short preview (as text, or hex; a
    list does not pretty-print JSON: it would be flattened again into one line)."""
    key, key_enc = header_text(row.key)
    value, value_enc = _preview(row.value)
    failure = consumer_failure(row.headers)
    return {
        "id": row.id,
        "msg_id": row.msg_id,
        "topic": row.topic,
        "group": failure.group if failure else None,
        "key": key,
        "key_encoding": key_enc,
        "value_preview": one_line(value),
        "value_encoding": value_enc,
        "size": len(row.value) if row.value is not None else 0,
        "attempts": row.attempts,
        "first_failed_at": iso(row.first_failed_at),
        "last_failed_at": iso(row.last_failed_at),
        "error_code": row.error_code,
        "error_name": row.error_name,
        "last_error": row.last_error,
    }


def detail(row: OutboxMessage) -> dict[str, Any]:
    """Everything about one stored message, every byte shown safely."""
    doc = summary(row)
    del doc["value_preview"]
    doc["value"], doc["value_encoding"] = decode(row.value)
    doc["status"] = row.status.name.lower()
    doc["partition"] = row.partition
    doc["created_at"] = iso(row.created_at)
    doc["next_attempt_at"] = iso(row.next_attempt_at)
    doc["headers"] = [
        {"name": name, "value": text, "encoding": enc}
        for name, (text, enc) in ((n, header_text(v)) for n, v in row.headers)
    ]
    failure = consumer_failure(row.headers)
    doc["consumer"] = failure.as_dict() if failure else None
    doc["timeline"] = timeline(row)
    return doc


def timeline(row: OutboxMessage) -> list[dict[str, Any]]:
    """The attempts timeline the store and the headers can tell, oldest first."""
    events: list[tuple[float, str]] = []
    failure = consumer_failure(row.headers)
    if failure is not None and failure.origin.timestamp_ms > 0:
        events.append((failure.origin.timestamp_ms / 1000.0,
                       f"entered {failure.origin.topic} [{failure.origin.partition}] @{failure.origin.offset}"))
    if row.first_failed_at is not None:
        events.append((row.first_failed_at, "first failure"))
    events.append((row.created_at, "stored in the outbox" + (" as a dead letter" if row.status.name == "DEAD" else "")))
    if row.last_failed_at is not None:
        what = f"last failure after {row.attempts} attempt(s): {one_line(row.last_error, 300)}"
        if failure is not None and failure.attempt is not None:
            what += f" (handler attempt {failure.attempt} in group {failure.group})"
        events.append((row.last_failed_at, what))
    if row.status.name == "PENDING":
        events.append((row.next_attempt_at, "next attempt due"))
    return [{"at": iso(t), "what": w} for t, w in sorted(events, key=lambda e: e[0])]


def audit(e: AuditEntry) -> dict[str, Any]:
    return {"id": e.id, "at": iso(e.at), "who": e.who, "action": e.action, "filter": e.filter, "count": e.count}


def parse_headers(text: str) -> Headers:
    """Headers edited as text: one `name: value` per line (UTF-8); a line `name` without a
    colon is a header with no value (None). Blank lines are skipped.

    Raises:
        ValueError: a line with an empty name.
    """
    out: Headers = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        name, sep, value = line.partition(":")
        name = name.strip()
        if not name:
            raise ValueError(f"headers line {n}: a header needs a name before the colon")
        out.append((name, value.strip().encode("utf-8") if sep else None))
    return out


def headers_as_text(headers: Headers) -> str:
    """The inverse of `parse_headers`, for the edit form (values that are not UTF-8 become hex)."""
    lines = []
    for name, value in headers:
        text, _enc = header_text(value)
        lines.append(name if text is None else f"{name}: {text}")
    return "\n".join(lines)
