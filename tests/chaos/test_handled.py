"""The effect-log checker on logs made by hand: it finds what it is there to find."""

from __future__ import annotations

from outbox.testing.handled import check_handled

PRODUCED = [(b"a", "a0"), (b"b", "b0"), (b"a", "a1"), (b"b", "b1"), (b"a", "a2"), (None, "n0")]


def test_a_log_with_each_effect_once_in_key_order_is_ok() -> None:
    h = check_handled(PRODUCED, ["b0", "a0", "n0", "a1", "b1", "a2"])
    assert h.ok
    assert h.summary() == "6 messages, 6 effects: 0 missing, 0 applied twice, 0 reordered keys, 0 unknown"


def test_missing_twice_reordered_and_unknown_effects_are_counted() -> None:
    h = check_handled(PRODUCED, ["a0", "a2", "b0", "a1", "a2", "b0", "n0", "x9"])
    assert h.missing == ["b1"]
    assert h.twice == {"a2": 2, "b0": 2}
    assert h.reordered == {b"a": ["a0", "a2", "a1"]}
    assert h.unknown == 1
    assert not h.ok
    assert h.first_inversions() == [
        "b'a': a2 (produced #2) took effect before a1 (produced #1); in all: ['a0', 'a2', 'a1']"
    ]


def test_a_later_copy_of_an_earlier_message_is_no_reorder() -> None:
    # Only first effects count for the order: a0 applied again after a1 is a second effect.
    h = check_handled(PRODUCED, ["a0", "a1", "a0", "a2", "b0", "b1", "n0"])
    assert h.reordered == {} and h.twice == {"a0": 2}
