"""Stored messages off a drain's common path (the `outbox-id` header alone, never failed), shared by
the tests that check a store's or a reader's re-sends against `outbox.drain.sendloop.resend`."""

from __future__ import annotations

from outbox.records import NewMessage


def odd_messages(now: float, stamp: int) -> list[NewMessage]:
    """Headers of their own (earlier retry headers among them), none at all, an id header that is
    not the msg_id, an error text without an attempt, a first failure without one, no value, an
    empty key; `now` and `stamp` (a record timestamp, ms) place their failures and timestamps."""
    return [
        NewMessage("t", b"v", b"k", [("app", b"1"), ("outbox-attempt", b"3"), ("outbox-id", b"odd-0")], 2,
                   "odd-0", 2, now - 9, "_MSG_TIMED_OUT (-192): slow", now, -192, "_MSG_TIMED_OUT", stamp),
        NewMessage("t", None, b"", [], -1, "odd-1"),
        NewMessage("t", b"v", None, [("outbox-id", b"other")], -1, "odd-2"),
        NewMessage("t", b"v", None, [("outbox-id", b"odd-3")], -1, "odd-3", 0, None, "_TRANSPORT (-195): down"),
        NewMessage("t", b"v", None, [("outbox-id", b"odd-4")], -1, "odd-4", 0, now - 1),
        NewMessage("t", b"v", None, [("outbox-id", b"odd-5"), ("app", None)], 0, "odd-5", 1, now - 2, None, now,
                   None, "_TRANSPORT"),
    ]
