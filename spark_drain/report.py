"""The job's summary: counts per topic, elapsed time and rate, as a table or JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TopicCounts:
    """What happened to one topic's rows.

    Attributes:
        read: rows selected and handed to the senders (in a dry run: rows that would be sent).
        delivered: acknowledged by Kafka and deleted from the outbox.
        failed: failed with a retriable error; left pending with an attempt counted.
        dead: dead-lettered (permanent error, or attempts exhausted).
        left: left pending untouched: behind a failed row of the same key, or never acknowledged.
    """

    read: int = 0
    delivered: int = 0
    failed: int = 0
    dead: int = 0
    left: int = 0

    def add(self, other: TopicCounts) -> None:
        """Add another count into this one."""
        self.read += other.read
        self.delivered += other.delivered
        self.failed += other.failed
        self.dead += other.dead
        self.left += other.left


@dataclass
class JobReport:
    """The result of one run.

    Attributes:
        mode: "pending" or "dead-letters"; "export" (`--export`: `topics` counts the messages
            written, in `read`); "archive" (`--from-parquet`: `outbox` is the archive's path, and
            `failed` counts every message not delivered).
        dry_run: nothing was sent or changed.
        outbox: where the outbox is (never with credentials).
        partitions: the `--partitions` used.
        replayed: dead letters put back to pending before sending (dead-letter mode).
        held_back: pending rows selected but held back behind an earlier, not-due row of their key
            (or one `--where` or the transform left out).
        skipped: messages left out by `--where` or the transform, untouched.
        topics: counts per topic.
        elapsed_seconds: wall time of the job (without starting Spark).
        send_seconds: wall time of the send stages.
        waves: the send stages run: a drain of pending rows sends in waves (`spark_drain.read.id_waves`),
            anything else in one.
        not_sent: pending rows of later waves not sent, because an earlier wave left a row pending
            (they are in `left`).
        exported_from: an export's selection: "pending" or "dead-letters".
        archive: where an export wrote its files.
        purged: dead letters an export deleted after writing them (`--purge-after-export`).
    """

    mode: str
    dry_run: bool
    outbox: str
    partitions: int
    replayed: int = 0
    held_back: int = 0
    skipped: int = 0
    topics: dict[str, TopicCounts] = field(default_factory=dict)
    elapsed_seconds: float = 0.0
    send_seconds: float = 0.0
    waves: int = 0
    not_sent: int = 0
    exported_from: str | None = None
    archive: str | None = None
    purged: int = 0

    @property
    def total(self) -> TopicCounts:
        """The counts summed over topics."""
        t = TopicCounts()
        for c in self.topics.values():
            t.add(c)
        return t

    @property
    def rows_per_second(self) -> float:
        """Delivered rows per second of the whole job (rows counted per second in a dry run)."""
        n = self.total.read if self.dry_run or self.mode == "export" else self.total.delivered
        return n / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0

    @property
    def ok(self) -> bool:
        """True when no selected row is left pending: none failed, left or held back (dead letters are a
        final outcome, not a failure)."""
        t = self.total
        return self.dry_run or self.mode == "export" or (t.failed == 0 and t.left == 0 and self.held_back == 0)

    def add_rows(self, rows: Iterable[tuple[str, int, int, int, int, int]]) -> None:
        """Merge the executors' per-partition (topic, read, delivered, failed, dead, left) tuples."""
        for topic, *n in rows:
            self.topics.setdefault(topic, TopicCounts()).add(TopicCounts(*n))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (totals and rate included)."""
        d = asdict(self)
        d["total"] = asdict(self.total)
        d["rows_per_second"] = round(self.rows_per_second, 1)
        return d

    def write_json(self, path: str) -> None:
        """Write the report as JSON (atomically: a reader never sees half a file)."""
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)

    def format_table(self) -> str:
        """The summary as a plain-text table."""
        heads: tuple[str, ...] = ("topic", "read", "delivered", "failed", "dead", "left")
        counts_only = self.dry_run or self.mode == "export"
        if counts_only:
            heads = ("topic", "exported" if self.mode == "export" else "would send")
        rows: list[tuple[str, ...]] = []
        for topic in sorted(self.topics):
            c = self.topics[topic]
            rows.append((topic, str(c.read)) if counts_only else
                        (topic, str(c.read), str(c.delivered), str(c.failed), str(c.dead), str(c.left)))
        t = self.total
        rows.append(("TOTAL", str(t.read)) if counts_only else
                    ("TOTAL", str(t.read), str(t.delivered), str(t.failed), str(t.dead), str(t.left)))
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]

        def line(cells: tuple[str, ...]) -> str:
            pairs = enumerate(zip(cells, widths, strict=True))
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

        out = [line(heads), "  ".join("-" * w for w in widths)]
        out += [line(r) for r in rows[:-1]]
        out += ["  ".join("-" * w for w in widths), line(rows[-1])]
        what = "dry run (nothing sent)" if self.dry_run else f"{self.rows_per_second:,.0f} rows/s"
        if self.mode == "export":
            out.append(
                f"export of {self.exported_from} from {self.outbox} to {self.archive}: {self.elapsed_seconds:.1f} s, "
                f"nothing sent, {self.purged} dead letters purged after the export"
            )
            return "\n".join(out)
        extra = ""
        if self.mode == "dead-letters" and not self.dry_run:
            extra = f", {self.replayed} dead letters replayed"
        if self.skipped:
            extra += f", {self.skipped} not selected (--where or the transform), left as they were"
        if self.held_back:
            extra += f", {self.held_back} held back behind a not-due or not-selected row of their key"
        out.append(
            f"{'replay of the archive' if self.mode == 'archive' else self.mode + ' from'} {self.outbox}: "
            f"{self.elapsed_seconds:.1f} s, {what}, "
            f"partitions={self.partitions}{extra}"
        )
        return "\n".join(out)
