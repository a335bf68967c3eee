"""SendFence: a key's outbox-bound messages wait while librdkafka holds its older first sends."""

from __future__ import annotations

from outbox.budget import MemoryBudget
from outbox.records import NewMessage
from outbox.sendfence import SendFence

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


def test_a_newer_message_waits_until_its_keys_newest_first_send_is_reported() -> None:
    f, _, _ = fence()
    f.sending(KEY, "0001")
    f.sending(KEY, "0002")
    assert f.hold(row("0003"), None, 10) and f.hold(row("0004"), None, 10)
    assert f.active and len(f) == 2 and f.held_bytes == 20
    assert f.reported(KEY, "0001") == []  # an older send: the newest is still in librdkafka
    assert ids(f.reported(KEY, "0002")) == ["0003", "0004"]
    assert not f.active and f.held_bytes == 0


def test_a_failed_older_send_goes_ahead_of_what_waited_behind_it() -> None:
    f, _, _ = fence()
    f.sending(KEY, "0001")
    assert f.hold(row("0002"), None, 10)
    assert f.hold(row("0001"), None, 10)  # its failure, stored while the key waits: held too
    assert ids(f.reported(KEY, "0001")) == ["0001", "0002"]


def test_nothing_waits_without_a_first_send_in_librdkafka_or_a_key_or_tracking() -> None:
    f, _, _ = fence()
    assert not f.hold(row("0001"), None, 10)
    f.sending(KEY, "0005")
    assert not f.hold(row("0004"), None, 10)  # older than the newest send: a failure, stored now
    assert not f.hold(row("0006", key=None), None, 10)
    untracked, _, _ = fence(tracking=False)
    untracked.sending(KEY, "0001")
    assert not untracked.hold(row("0002"), None, 10)


def test_a_send_librdkafka_did_not_take_is_forgotten() -> None:
    f, _, _ = fence()
    previous = f.sending(KEY, "0001")
    f.not_sent(KEY, "0001", previous)
    assert not f.hold(row("0002"), None, 10)
    f.sending(KEY, "0003")
    previous = f.sending(KEY, "0004")
    f.not_sent(KEY, "0004", previous)
    assert f.hold(row("0005"), None, 10)
    assert ids(f.reported(KEY, "0003")) == ["0005"]


def test_a_fence_ends_after_its_longest_wait_and_all_at_once_when_forced() -> None:
    f, _, now = fence()
    f.sending(KEY, "0001")
    f.sending(("t", b"other"), "0002")
    assert f.hold(row("0003"), None, 10) and f.hold(NewMessage("t", b"v", b"other", [], -1, "0004"), None, 10)
    assert f.overdue() == []
    now[0] = 31.0
    assert ids(f.overdue()) == ["0003", "0004"] and not f.active
    f.sending(KEY, "0005")
    assert f.hold(row("0006"), None, 10)
    assert ids(f.overdue(force=True)) == ["0006"]


def test_a_full_budget_asks_for_a_purge() -> None:
    f, purges, _ = fence(limit=15)
    f.sending(KEY, "0001")
    assert f.hold(row("0002"), None, 10)
    assert purges == []
    assert f.hold(row("0003"), None, 10)
    assert purges == ["purge"]
