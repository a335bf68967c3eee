"""What the `delivered` and `retried` events carry (`outbox.events.Drained`), whether the drain
runs in threads or in a process: the fields callbacks read, with the common headers left out and
rebuilt on reading."""

from __future__ import annotations

import pickle

from outbox.events import Drained, drained, drained_fields
from outbox.headers import ID_HEADER
from outbox.records import OutboxMessage, Status


def row(msg_id: str, headers: list[tuple[str, bytes | None]]) -> OutboxMessage:
    return OutboxMessage(7, msg_id, "orders", b"k", b"value", headers, -1, Status.PENDING, 2, 100.0, None, None,
                         0.0, None)


def read_back(rows: list[OutboxMessage]) -> list[Drained]:
    new = tuple.__new__
    return [new(Drained, t) for t in pickle.loads(pickle.dumps(drained_fields(rows)))]


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
    rows = read_back([row("abc", h) for h in kept])
    assert [d.headers for d in rows] == kept
    assert [d.stored_headers for d in rows] == kept


def test_a_thread_drain_tells_the_same_rows_as_a_drain_process() -> None:
    rows = [row("abc", [(ID_HEADER, b"abc")]), row("def", [("app", b"1"), (ID_HEADER, b"def")])]
    told = drained(rows)
    assert told == read_back(rows)
    assert all(type(d) is Drained for d in told)
