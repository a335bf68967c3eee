"""The Spark drain's verdict (`JobReport.ok`), which its exit code follows."""

from __future__ import annotations

from spark_drain.report import JobReport, TopicCounts


def _report(**kw: int) -> JobReport:
    report = JobReport(mode="drain", dry_run=False, outbox="sqlite:///o.db", partitions=2,
                       held_back=kw.pop("held_back", 0))
    report.topics["t"] = TopicCounts(read=5100, delivered=5100, **kw)
    return report


def test_a_drain_that_sent_every_selected_row_is_ok() -> None:
    assert _report().ok


def test_rows_held_back_behind_their_key_make_the_drain_pending() -> None:
    # docs/exit-codes.md: 3 when rows "failed or were held back".
    assert not _report(held_back=400).ok


def test_failed_or_left_rows_make_the_drain_pending() -> None:
    assert not _report(failed=1).ok and not _report(left=1).ok
