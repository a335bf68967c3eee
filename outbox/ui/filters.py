"""The console's filters: query parameters or JSON fields → the store's `DeadLetterFilter`.

One parser for the pages, the JSON API and the actions, built on `outbox.stores.filters` (the same
rules as `outbox dlq`), so a filter means the same rows everywhere. Anything it cannot read is
a `FilterError` naming the field: the server answers 400 with that text, never a 500.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from outbox.records import DeadLetterFilter
from outbox.stores.filters import describe, describe_json, error_filter, parse_time

__all__ = ["FIELDS", "FilterError", "describe", "describe_json", "parse_filter", "query_of"]

#: The filter fields a request may carry (anything else is refused, so a typo is not ignored).
FIELDS = ("topic", "group", "error", "key", "text", "since", "until")
#: Rows per page: the default and the most a request may ask for.
PAGE = 50
MAX_PAGE = 500
#: Ids one request may name (they become one SQL `IN` list).
MAX_IDS = 1000


class FilterError(ValueError):
    """A filter the console cannot read; its text says which field and why."""


def _text(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise FilterError(f"{name}: expected text, got {type(value).__name__}")
    v = value.strip()
    if not v:
        return None  # an empty form field means "any"
    if len(v) > 1000:
        raise FilterError(f"{name}: longer than 1000 characters")
    return v


def _int(name: str, value: object, low: int, high: int) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise FilterError(f"{name}: expected a whole number")
    try:
        n: int = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise FilterError(f"{name}: {value!r} is not a whole number") from None
    if not low <= n <= high:
        raise FilterError(f"{name}: {n} is not between {low} and {high}")
    return n


def _time(name: str, value: object) -> float | None:
    v = _text(name, value)
    if v is None:
        return None
    try:
        return parse_time(v)
    except ValueError:
        raise FilterError(
            f"{name}: cannot read the time {v!r}: use ISO-8601 (2024-05-01T12:00, UTC when no zone is "
            "given) or an age such as 30m, 2h, 1d"
        ) from None


def parse_filter(
    values: Mapping[str, Any], *, ids: Iterable[object] = (), paging: bool = False, allow: Iterable[str] = ()
) -> DeadLetterFilter:
    """A `DeadLetterFilter` from request fields (query parameters, form fields or a JSON object).

    Args:
        values: the fields; empty strings mean "any".
        ids: row ids named one by one (a selection).
        paging: read `after` (keyset cursor) and `limit` too (lists); actions never page.
        allow: other field names the caller reads itself (not refused as unknown).

    Raises:
        FilterError: an unknown field, or a value that cannot be read.
    """
    known = set(FIELDS) | set(allow) | ({"after", "limit"} if paging else set())
    unknown = sorted(k for k in values if k not in known)
    if unknown:
        raise FilterError(f"unknown filter field(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    id_list = tuple(sorted({n for n in (_int("ids", i, 1, 2**63 - 1) for i in ids) if n is not None}))
    if len(id_list) > MAX_IDS:
        raise FilterError(f"ids: at most {MAX_IDS} at once (act on a filter for more)")
    since, until = _time("since", values.get("since")), _time("until", values.get("until"))
    if since is not None and until is not None and since >= until:
        raise FilterError("since: must be before until")
    key = _text("key", values.get("key"))
    return DeadLetterFilter(
        ids=id_list,
        topic=_text("topic", values.get("topic")),
        group=_text("group", values.get("group")),
        error=error_filter(_text("error", values.get("error"))),
        key=None if key is None else key.encode("utf-8"),
        text=_text("text", values.get("text")),
        since=since,
        until=until,
        after_id=_int("after", values.get("after"), 0, 2**63 - 1) if paging else None,
        limit=(_int("limit", values.get("limit"), 1, MAX_PAGE) or PAGE) if paging else None,
    )


def query_of(flt: DeadLetterFilter) -> dict[str, str]:
    """The filter as the query parameters that name it again (links, hidden form fields)."""
    from datetime import UTC, datetime

    out: dict[str, str] = {}
    for name in ("topic", "group", "error", "text"):
        v = getattr(flt, name)
        if v is not None:
            out[name] = v
    if flt.key is not None:
        out["key"] = flt.key.decode("utf-8", "replace")
    for name in ("since", "until"):
        v = getattr(flt, name)
        if v is not None:
            out[name] = datetime.fromtimestamp(v, UTC).isoformat()
    return out
