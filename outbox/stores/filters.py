"""How people name dead letters: error codes or names, TIME (ISO-8601 or an age), a DURATION,
and how a filter is written in the audit log.

One place for all, shared by the `outbox` command line, the console (`outbox.ui`) and the
producer's dead-letter retention, so a filter means the same rows in each.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import KafkaError

from outbox.records import DeadLetterFilter

_AMOUNT = r"(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d|w)"
_AGE = re.compile(rf"^\s*{_AMOUNT}\s*(?:ago)?\s*$", re.IGNORECASE)
_DURATION = re.compile(rf"^\s*{_AMOUNT}\s*$", re.IGNORECASE)
_UNIT = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_time(text: str, *, now: float | None = None) -> float:
    """A TIME argument as epoch seconds.

    Accepts ISO-8601 (a naive time is UTC) or an age `<number><s|m|h|d|w>` meaning that long
    before `now`.

    Raises:
        ValueError: the text is neither.
    """
    m = _AGE.match(text)
    try:
        if m:
            ts = (time.time() if now is None else now) - float(m.group(1)) * _UNIT[m.group(2).lower()]
            datetime.fromtimestamp(ts, UTC)  # an age beyond year 1 cannot be shown or compared
            return ts
        dt = datetime.fromisoformat(text.strip())
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)  # documented: a time without a zone is UTC
        return dt.timestamp()
    except (ValueError, OverflowError, OSError):
        raise ValueError(text) from None


def parse_duration(text: str) -> float:
    """A DURATION argument as seconds: `<number><s|m|h|d|w>` (90s, 30m, 12h, 7d, 2w; `sec` and
    `min` too), above zero.

    Raises:
        ValueError: the text is not a duration, is zero, or reaches back before year 1 (no time
            that old can be shown or compared).
    """
    m = _DURATION.match(text)
    if not m:
        raise ValueError(text)
    seconds = float(m.group(1)) * _UNIT[m.group(2).lower()]
    try:
        datetime.fromtimestamp(-seconds, UTC)  # now less the duration is after this: representable
    except (ValueError, OverflowError, OSError):
        raise ValueError(text) from None
    if not seconds > 0:
        raise ValueError(text)
    return seconds


def error_filter(value: str | None) -> str | None:
    """An error as the store matches it: a librdkafka code (`-192`) or name (`_MSG_TIMED_OUT`),
    or a consumer dead letter's exception class (`builtins.ValueError`).

    librdkafka names are case-insensitive and the leading underscore of its local errors may be
    left out (`msg_timed_out`); exception classes are matched as given.
    """
    if value is None:
        return None
    v = value.strip()
    if re.fullmatch(r"[+-]?\d+", v):
        return str(int(v))
    name = v.upper()
    if hasattr(KafkaError, name):
        return name
    if not name.startswith("_") and hasattr(KafkaError, "_" + name):
        return "_" + name
    # Not a librdkafka name: a consumer dead letter's exception class ("builtins.ValueError"), as given.
    return v


def describe(flt: DeadLetterFilter) -> dict[str, Any]:
    """The filter as a JSON-able object without its empty fields and paging (for the audit log)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(flt):
        v = getattr(flt, f.name)
        if f.name in ("limit", "after_id") or v is None or v == ():
            continue
        out[f.name] = v.decode("utf-8", "replace") if isinstance(v, bytes) else list(v) if isinstance(v, tuple) else v
    return out


def describe_json(flt: DeadLetterFilter) -> str:
    """`describe` as the audit log's `filter` text."""
    return json.dumps(describe(flt), sort_keys=True)
