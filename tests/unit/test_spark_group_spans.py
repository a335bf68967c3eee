"""Which SQLite group a message id belongs to, as a Spark send task tells it (pure logic)."""

from __future__ import annotations

from spark_drain.send import GroupSpans


def test_a_groups_messages_are_the_ids_after_it_and_nothing_else() -> None:
    spans = GroupSpans()
    spans.add(10, 3)  # ids 11, 12, 13
    spans.add(20, 2)  # ids 21, 22
    assert [spans.of(i) for i in (10, 11, 13, 14, 20, 21, 22, 23)] == [
        None, (10, 3), (10, 3), None, None, (20, 2), (20, 2), None,
    ]
    assert spans.of(5) is None


def test_groups_met_again_or_out_of_order_are_noted_once() -> None:
    spans = GroupSpans()
    spans.add(20, 2)
    spans.add(10, 3)
    spans.add(20, 2)
    spans.add(10, 3)
    assert [spans.of(i) for i in (22, 12, 21, 11, 23, 14)] == [(20, 2), (10, 3), (20, 2), (10, 3), None, None]
