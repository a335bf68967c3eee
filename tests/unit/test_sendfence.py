"""SendFence: a key's outbox-bound messages wait while librdkafka holds first sends of the key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from outbox.budget import MemoryBudget
from outbox.producer.sendfence import SendFence
from outbox.records import NewMessage

KEY = ("t", b"k")


@dataclass
class Sent:
    """A first send's report, as the fence sees it."""

    msg_id: str
    key: Any = b"k"
    topic: str = "t"
    epoch: int = 0


def row(msg_id: str, key: bytes | None = b"k") -> NewMessage:
    return NewMessage("t", b"v", key, [], -1, msg_id)


def fence(*, tracking: bool = True, limit: int = 1 << 20) -> tuple[SendFence, list[str], list[float]]:
    calls: list[str] = []
    now = [0.0]
    f = SendFence(
        tracking=tracking, budget=MemoryBudget(limit), on_full=lambda: calls.append("purge"),
        on_overtaken=lambda: calls.append("purge queue"), clock=lambda: now[0], longest=31.0,
    )
    return f, calls, now


def send(f: SendFence, report: Sent) -> Sent:
    """What FirstSend does for a keyed first send: in flight, then counted if armed."""
    f.inflight[report.msg_id] = report
    if f.armed:
        f.count(report)
    return report


def report(f: SendFence, sent: Sent) -> list[str]:
    """What a delivery report does: out of flight, then counted down if armed."""
    f.inflight.pop(sent.msg_id)
    return ids(f.reported(sent)) if f.armed else []


def ids(held: list[tuple[NewMessage, object, int]]) -> list[str]:
    return [m.msg_id for m, _, _ in held]


def test_unarmed_sends_cost_an_entry_and_arming_counts_them_by_key() -> None:
    f, _, _ = fence()
    assert not f.armed
    a, b = send(f, Sent("0001")), send(f, Sent("0002", key="k"))  # str keys count as their bytes
    other = send(f, Sent("0003", key=b"other"))
    assert a.epoch == b.epoch == other.epoch == 0  # not counted: nothing may be held yet
    assert f.hold(row("0005"), None, 10)  # a message bound for the outbox arms the fence
    assert f.armed and a.epoch == b.epoch == f.arms == 1
    assert not f.hold(row("0006", key=b"third"), None, 10)  # nothing of that key in flight
    assert report(f, a) == []
    assert report(f, other) == []
    assert report(f, b) == ["0005"]  # the last of its key: held messages go on
    assert not f.active


def test_a_message_waits_until_librdkafka_has_reported_every_first_send_of_its_key() -> None:
    f, _, _ = fence()
    f.arm()
    s1, s2 = send(f, Sent("0001")), send(f, Sent("0002"))
    assert f.hold(row("0004"), None, 10) and f.hold(row("0003"), None, 10)
    assert f.active and len(f) == 2 and f.held_bytes == 20
    assert report(f, s1) == []  # one first send is still in librdkafka
    assert report(f, s2) == ["0003", "0004"]  # in produce order
    assert not f.active and f.held_bytes == 0


def test_reports_in_any_order_a_purge_first_and_the_wire_last() -> None:
    # An older send on the wire, newer ones purged from the queue: the purged ones fail first,
    # and wait (held) until the one on the wire is reported too.
    f, calls, _ = fence()
    f.arm()
    wire, q1, q2 = (send(f, Sent(f"000{i}")) for i in (1, 2, 3))
    f.inflight.pop(q2.msg_id)
    assert f.hold(row("0003"), None, 10)  # purged, stored: held, behind itself until its report
    assert ids(f.reported(q2)) == []
    f.inflight.pop(q1.msg_id)
    assert f.hold(row("0002"), None, 10)
    assert calls == ["purge queue"]  # 0002 is older than 0003, counted as sent: hand the queue back
    assert ids(f.reported(q1)) == []
    assert report(f, wire) == ["0002", "0003"]  # the oldest delivered: the rest go on


def test_nothing_waits_without_a_first_send_in_librdkafka_or_a_key_or_tracking() -> None:
    f, _, _ = fence()
    assert not f.hold(row("0001"), None, 10)
    send(f, Sent("0002", key=b"other"))
    assert not f.hold(row("0003"), None, 10)
    assert not f.hold(row("0004", key=None), None, 10)
    untracked, _, _ = fence(tracking=False)
    assert untracked.armed  # untracked: every message asks admission
    untracked.arm()
    assert not untracked.hold(row("0005"), None, 10)
    assert not untracked.disarm(lambda: True) and untracked.armed


def test_a_send_librdkafka_did_not_take_is_reported_as_such() -> None:
    f, _, _ = fence()
    f.arm()
    refused = send(f, Sent("0001"))
    assert report(f, refused) == []
    assert not f.hold(row("0002"), None, 10)
    s3, s4 = send(f, Sent("0003")), send(f, Sent("0004"))
    assert f.hold(row("0005"), None, 10)
    assert report(f, s3) == []
    assert report(f, s4) == ["0005"]


def test_an_arming_never_counts_a_send_twice_and_a_failure_is_not_its_own_other() -> None:
    f, _, _ = fence()
    s1 = send(f, Sent("0001"))
    f.arm()  # counts s1
    f.count(s1)  # the sending thread's own count, after the arming's: no second count
    assert f.others_sending(s1) is False  # it alone is in flight
    s2 = send(f, Sent("0002"))
    assert f.others_sending(s1) is True
    assert report(f, s1) == [] and report(f, s2) == []
    assert not f.hold(row("0003"), None, 10)  # nothing counted is left


def test_disarming_voids_every_count_and_needs_nothing_held_and_idle() -> None:
    f, _, _ = fence()
    f.arm()
    old = send(f, Sent("0001"))
    assert f.hold(row("0002"), None, 10)
    assert not f.disarm(lambda: True)  # something is held
    assert report(f, old) == ["0002"]
    assert not f.disarm(lambda: False) and f.armed  # the owner says something may be bound
    stale = send(f, Sent("0003"))
    assert stale.epoch == 1
    assert f.disarm(lambda: True) and not f.armed
    assert report(f, stale) == []  # reported while disarmed: nothing to count down
    fresh = send(f, Sent("0004"))
    f.arm()
    assert f.arms == 2 and fresh.epoch > 1  # in flight at the arming: counted anew
    # A report that still carries the voided epoch (it raced the disarm) takes nothing down.
    assert f.reported(stale) == []
    assert f.hold(row("0005"), None, 10)  # fresh is still counted
    assert report(f, fresh) == ["0005"]


def test_a_fence_ends_after_its_longest_wait_and_all_at_once_when_forced() -> None:
    f, _, now = fence()
    f.arm()
    late = send(f, Sent("0001"))
    send(f, Sent("0002", key=b"other"))
    assert f.hold(row("0003"), None, 10) and f.hold(NewMessage("t", b"v", b"other", [], -1, "0004"), None, 10)
    assert f.overdue() == []
    now[0] = 31.0
    assert ids(f.overdue()) == ["0003", "0004"] and not f.active
    s5 = send(f, Sent("0005"))
    assert f.hold(row("0006"), None, 10)
    assert ids(f.overdue(force=True)) == ["0006"]
    assert report(f, late) == [] and report(f, s5) == []  # late reports of ended fences: no error


def test_a_full_budget_asks_for_a_purge() -> None:
    f, calls, _ = fence(limit=15)
    f.arm()
    send(f, Sent("0001"))
    assert f.hold(row("0002"), None, 10)
    assert calls == []
    assert f.hold(row("0003"), None, 10)
    assert calls == ["purge"]
