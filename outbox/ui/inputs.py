"""What a request sends, read and checked: JSON bodies, posted forms, whole-number parameters,
the redrive rate, and an edited message's value and headers.

Whatever cannot be read is a `FilterError` naming the field (400), as for the filters
(`outbox.ui.filters`); a form whose CSRF token does not match is a 403.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import Request
from starlette.datastructures import FormData

from outbox.records import Headers
from outbox.ui import present, security
from outbox.ui.errors import ConsoleError
from outbox.ui.filters import FilterError

#: Redrive rate (messages/s) when a request names none, and the most one may ask for.
DEFAULT_RATE = 500.0
MAX_RATE = 100_000.0


async def json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise FilterError("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise FilterError("the body must be a JSON object")
    return body


async def posted_form(request: Request) -> FormData:
    """The posted form, after its CSRF token was checked against the cookie."""
    form = await request.form()
    if not security.csrf_ok(request.cookies.get(security.CSRF_COOKIE), form.get(security.CSRF_FIELD)):
        raise ConsoleError(403, "the form's CSRF token does not match this browser's: reload the page and try again")
    return form


def body_ids(body: Mapping[str, Any]) -> list[object]:
    ids = body.get("ids", [])
    if not isinstance(ids, list):
        raise FilterError("ids: must be a list of row ids")
    return ids


def key_of(body: Mapping[str, Any]) -> bytes:
    """The key an erasure names: `key` (text) or `key_hex`, exactly one. The value is never
    repeated in an error: it is the data to forget."""
    text, hex_text = body.get("key"), body.get("key_hex")
    if (text is None) == (hex_text is None):
        raise FilterError("give the key once: key (text) or key_hex")
    if text is not None:
        if not isinstance(text, str):
            raise FilterError("key: must be text (key_hex for bytes)")
        return text.encode("utf-8")
    if not isinstance(hex_text, str):
        raise FilterError("key_hex: must be text")
    try:
        return bytes.fromhex(hex_text)
    except ValueError:
        raise FilterError("key_hex: not hex (two hex digits per byte; the value is not repeated)") from None


def int_param(value: str | None, name: str, default: int | None, low: int, high: int) -> Any:
    if value is None or value == "":
        return default
    try:
        n = int(value)
    except ValueError:
        raise FilterError(f"{name}: {value!r} is not a whole number") from None
    if not low <= n <= high:
        raise FilterError(f"{name}: {n} is not between {low} and {high}")
    return n


def rate_of(value: object, default: float) -> float:
    """The redrive rate a request asks for (`default` when it names none)."""
    if value is None or value == "":
        return default
    try:
        rate = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise FilterError(f"rate: {value!r} is not a number of messages per second") from None
    if not 0 < rate <= MAX_RATE:
        raise FilterError(f"rate: must be above 0 and at most {MAX_RATE:.0f} messages per second")
    return rate


def value_of(value: object, encoding: object) -> bytes | None:
    """An edited value as the API sends it: text, hex text, or null."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise FilterError("value: must be text or null")
    if encoding == "utf-8":
        return value.encode("utf-8")
    if encoding == "hex":
        try:
            return present.from_hex(value, "value")
        except ValueError as exc:
            raise FilterError(str(exc)) from None
    raise FilterError("value_encoding: must be utf-8 or hex")


def headers_of(value: object) -> Headers:
    """Edited headers as the API sends them: [name, text-or-null] pairs, or the
    {name, value, encoding} objects that GET /api/dead-letters/{id} shows."""
    if not isinstance(value, list):
        raise FilterError("headers: must be a list of [name, value] pairs")
    out: Headers = []
    for n, h in enumerate(value):
        if isinstance(h, dict) and set(h) <= {"name", "value", "encoding"}:
            name, text, encoding = h.get("name"), h.get("value"), h.get("encoding", "utf-8")
        elif isinstance(h, list) and len(h) == 2:
            (name, text), encoding = h, "utf-8"
        else:
            name = None
        if not (isinstance(name, str) and name and (text is None or isinstance(text, str))):
            raise FilterError(f"headers[{n}]: must be [name, text or null] or {{name, value, encoding}}"
                              " with a non-empty name")
        if text is None:
            out.append((name, None))
        elif encoding in ("utf-8", None):
            out.append((name, text.encode("utf-8")))
        elif encoding == "hex":
            try:
                out.append((name, present.from_hex(text, f"headers[{n}]")))
            except ValueError as exc:
                raise FilterError(str(exc)) from None
        else:
            raise FilterError(f"headers[{n}]: encoding must be utf-8, hex or null")
    return out
