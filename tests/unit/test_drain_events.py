"""What the drain process tells the application about delivered rows (`outbox.drain.process`):
the fields its callbacks read, with the common headers left out and rebuilt on reading."""

from __future__ import annotations

import pickle

from outbox.drain.process import _drained
from outbox.events import Drained
from outbox.headers import ID_HEADER
from outbox.records import OutboxMessage, Status


def row(msg_id: str, headers: list[tuple[str, bytes | None]]) -> OutboxMessage:
    return OutboxMessage(7, msg_id, "orders", b"k", b"value", headers, -1, Status.PENDING, 2, 100.0, None, None,
                         0.0, None)


def read_back(rows: list[OutboxMessage]) -> list[Drained]:
    new = tuple.__new__
    return [new(Drained, t) for t in pickle.loads(pickle.dumps(_drained(rows)))]


def test_the_id_header_alone_is_not_sent_and_is_rebuilt_when_read() -> None:
    [d] = read_back([row("abc", [(ID_HEADER, b"abc")])])
    assert d.stored_headers is None
    assert d.headers == [(ID_HEADER, b"abc")]
    assert (d.msg_id, d.topic, d.key, d.attempts, d.created_at) == ("abc", "orders", b"k", 2, 100.0)


def test_any_other_headers_travel_as_they_are() -> None:
    kept = [
        [(ID_HEADER, b"other")],  # an id header that is not the row's msg_id
        [("traceparent", b"00-abc-def-01"), (ID_HEADER, b"abc")],
        [("app", None)],
        [],
    ]
    drained = read_back([row("abc", h) for h in kept])
    assert [d.headers for d in drained] == kept
    assert [d.stored_headers for d in drained] == kept
