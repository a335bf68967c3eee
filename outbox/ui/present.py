"""How the console shows a stored message: as JSON for the API, as fields for the pages.

Message bytes come from applications and may be anything. Values and headers are shown as UTF-8
text when they decode, hex otherwise; a JSON value is also pretty-printed, for reading only. What
is shown for editing encodes every byte, so a form submitted unchanged stores the same bytes.
The pages escape all of it (Jinja2 autoescape): nothing here produces HTML.

Every message is shown through a `Masker` (`outbox.ui.masking`): what it masks is never shown, and
`masked` says that something was. Sizes are the stored bytes'.
"""

from __future__ import annotations

import binascii
import json
import re
from datetime import UTC, datetime
from typing import Any

from outbox.consumer.headers import consumer_failure
from outbox.records import AuditEntry, Headers, OutboxMessage
from outbox.ui.masking import MaskedRow, Masker

#: Values larger than this are cut in lists (the page of one message shows them whole).
PREVIEW = 120


def iso(ts: float | None) -> str | None:
    """Epoch seconds as ISO-8601 UTC with milliseconds; None stays None."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def decode(data: bytes | None) -> tuple[str | None, str | None]:
    """(text, encoding): the bytes as "utf-8" text when they decode, else "hex"; (None, None) for None."""
    if data is None:
        return None, None
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return data.hex(), "hex"


def pretty(data: bytes | None) -> str | None:
    """A JSON object or array re-indented for reading; None for anything else. Never the value
    itself: an edit sends back the stored text, not this."""
    text, encoding = decode(data)
    if encoding != "utf-8" or text is None:
        return None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested too deep to read
        return None
    return json.dumps(doc, indent=2, ensure_ascii=False) if isinstance(doc, (dict, list)) else None


# Characters a browser's textarea does not give back as they were: it posts every line break as
# CRLF (so a CR of the value's own is lost) and replaces NUL; other controls are invisible.
_FORM_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def edit_value(data: bytes | None) -> tuple[str, str]:
    """(text, encoding) for the edit form: "utf-8" text when a textarea gives it back unchanged,
    else "hex"; ("", "null") for no value. `form_value` is its inverse."""
    if data is None:
        return "", "null"
    text, encoding = decode(data)
    if encoding == "utf-8" and text is not None and not _FORM_UNSAFE.search(text):
        return text, "utf-8"
    return data.hex(), "hex"


def form_value(text: str, encoding: str) -> bytes | None:
    """The bytes of an edit form's value: the inverse of `edit_value`.

    Raises:
        ValueError: hex that does not parse, text with the "null" encoding, an unknown encoding.
    """
    if encoding == "utf-8":
        return text.replace("\r\n", "\n").encode("utf-8")  # a browser sends LF as CRLF
    if encoding == "hex":
        return from_hex(text, "value")
    if encoding == "null":
        if text.strip():
            raise ValueError("value: must be empty when the encoding is null (no value)")
        return None
    raise ValueError("value_encoding: must be utf-8, hex or null")


def from_hex(text: str, what: str) -> bytes:
    """Hex digits, blanks and line breaks allowed between them.

    Raises:
        ValueError: not hex.
    """
    try:
        return binascii.unhexlify("".join(text.split()))
    except (binascii.Error, ValueError):
        raise ValueError(f"{what}: not valid hex") from None


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


def summary(stored: OutboxMessage, masker: Masker) -> dict[str, Any]:
    """One dead letter in a list: no value bytes beyond a short preview (as text, or hex; a
    list does not pretty-print JSON: it would be flattened again into one line), masked."""
    return _summary(stored, masker.row(stored))


def _summary(stored: OutboxMessage, shown: MaskedRow) -> dict[str, Any]:
    row = shown.row
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
        "size": len(stored.value) if stored.value is not None else 0,
        "masked": shown.masked,
        "attempts": row.attempts,
        "first_failed_at": iso(row.first_failed_at),
        "last_failed_at": iso(row.last_failed_at),
        "error_code": row.error_code,
        "error_name": row.error_name,
        "last_error": row.last_error,
    }


def detail(stored: OutboxMessage, masker: Masker) -> dict[str, Any]:
    """Everything about one stored message, every byte shown safely, masked."""
    shown = masker.row(stored)
    row = shown.row
    doc = _summary(stored, shown)
    del doc["value_preview"]
    doc["value"], doc["value_encoding"] = decode(row.value)
    doc["value_pretty"] = pretty(row.value)
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
    """Headers edited as text, one per line: `name: text` (UTF-8, blanks around it dropped),
    `name:: hex` (any bytes), `name` alone (no value, None). A name that would not read back
    plainly is written as a JSON string, e.g. `"a: b": 1`. Blank lines are skipped.

    Raises:
        ValueError: a line with an empty name, a quoted name that does not end, hex that does not parse.
    """
    out: Headers = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"headers line {n}"
        rest = line.lstrip()
        if rest.startswith('"'):
            try:
                name, end = json.JSONDecoder().raw_decode(rest)
            except ValueError:
                raise ValueError(f"{where}: the quoted name does not end as a JSON string") from None
            rest = rest[end:].lstrip()
            sep = rest[:1]
            value = rest[1:]
            if sep not in ("", ":"):
                raise ValueError(f"{where}: a colon must follow the quoted name")
        else:
            name, sep, value = rest.partition(":")
            name = name.strip()
        if not name:
            raise ValueError(f"{where}: a header needs a name before the colon")
        if not sep:
            out.append((name, None))
        elif value.startswith(":"):
            try:
                out.append((name, from_hex(value[1:], where)))
            except ValueError:
                raise ValueError(f"{where}: {value[1:].strip()!r} is not hex") from None
        else:
            out.append((name, value.strip().encode("utf-8")))
    return out


def _plain(text: str) -> bool:
    """Can `text` stand in a header line as it is: no controls, no blanks at its ends?"""
    return not _FORM_UNSAFE.search(text) and "\r" not in text and "\n" not in text and text == text.strip()


def headers_as_text(headers: Headers) -> str:
    """The inverse of `parse_headers`, for the edit form: values that are not plain UTF-8 text
    (not UTF-8, line breaks, blanks at either end) are written in hex after a double colon."""
    lines = []
    for name, value in headers:
        plain_name = name and _plain(name) and ":" not in name and not name.startswith('"')
        label = name if plain_name else json.dumps(name, ensure_ascii=False)
        if value is None:
            lines.append(label)
            continue
        text, encoding = decode(value)
        if encoding == "utf-8" and text is not None and _plain(text):
            lines.append(f"{label}: {text}" if text else f"{label}:")
        else:
            lines.append(f"{label}:: {value.hex()}")
    return "\n".join(lines)
