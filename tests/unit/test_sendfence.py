"""SendFence: a key's outbox-bound messages wait while librdkafka holds first sends of the key."""

from __future__ import annotations

from outbox.budget import MemoryBudget
from outbox.producer.keyorder import SendFence
from outbox.records import NewMessage

KEY = ("t", b"k")


def row(msg_id: str, key: bytes | None = b"k") -> NewMessage:
    return NewMessage("t", b"v", key, [], -1, msg_id)


def fence(*, tracking: bool = True, limit: int = 1 << 20) -> tuple[SendFence, list[str], list[float]]:
    purges: list[str] = []
    now = [0.0]
    f = SendFence(
        tracking=tracking, budget=MemoryBudget(limit), on_full=lambda: purges.append("purge"),
        clock=lambda: now[0], longest=31.0,
    )
    return f, purges, now


def ids(held: list[tuple[NewMessage, object, int]]) -> list[str]:
    return [m.msg_id for m, _, _ in held]


def test_a_message_waits_until_librdkafka_has_reported_every_first_send_of_its_key() -> None:
    f, _, _ = fence()
    f.sending(KEY)
    f.sending(KEY)
    assert f.hold(row("0004"), None, 10) and f.hold(row("0003"), None, 10)
    assert f.active and len(f) == 2 and f.held_bytes == 20
    assert f.reported(KEY) == []  # one first send is still in librdkafka
    assert ids(f.reported(KEY)) == ["0003", "0004"]  # in produce order
    assert not f.active and f.held_bytes == 0


def test_reports_in_any_order_a_purge_first_and_the_wire_last() -> None:
    # An older send on the wire, newer ones purged from the queue: the purged ones fail first,
    # and wait (held) until the one on the wire is reported too.
    f, _, _ = fence()
    for _ in range(3):
        f.sending(KEY)
    assert f.reported(KEY) == [] and f.hold(row("0003"), None, 10)  # purged, stored: held
    assert f.reported(KEY) == [] and f.hold(row("0002"), None, 10)
    assert ids(f.reported(KEY)) == ["0002", "0003"]  # the oldest delivered: the rest go on


def test_nothing_waits_without_a_first_send_in_librdkafka_or_a_key_or_tracking() -> None:
    f, _, _ = fence()
    assert not f.hold(row("0001"), None, 10)
    f.sending(("t", b"other"))
    assert not f.hold(row("0002"), None, 10)
    assert not f.hold(row("0003", key=None), None, 10)
    untracked, _, _ = fence(tracking=False)
    untracked.sending(KEY)
    assert not untracked.hold(row("0004"), None, 10)


def test_a_send_librdkafka_did_not_take_is_reported_as_such() -> None:
    f, _, _ = fence()
    f.sending(KEY)
    assert f.reported(KEY) == []
    assert not f.hold(row("0002"), None, 10)
    f.sending(KEY)
    f.sending(KEY)
    assert f.hold(row("0003"), None, 10)
    assert f.reported(KEY) == []
    assert ids(f.reported(KEY)) == ["0003"]


def test_a_fence_ends_after_its_longest_wait_and_all_at_once_when_forced() -> None:
    f, _, now = fence()
    f.sending(KEY)
    f.sending(("t", b"other"))
    assert f.hold(row("0003"), None, 10) and f.hold(NewMessage("t", b"v", b"other", [], -1, "0004"), None, 10)
    assert f.overdue() == []
    now[0] = 31.0
    assert ids(f.overdue()) == ["0003", "0004"] and not f.active
    f.sending(KEY)
    assert f.hold(row("0006"), None, 10)
    assert ids(f.overdue(force=True)) == ["0006"]
    assert f.reported(KEY) == []  # a late report of a fence that ended: nothing held, no error


def test_a_full_budget_asks_for_a_purge() -> None:
    f, purges, _ = fence(limit=15)
    f.sending(KEY)
    assert f.hold(row("0002"), None, 10)
    assert purges == []
    assert f.hold(row("0003"), None, 10)
    assert purges == ["purge"]
