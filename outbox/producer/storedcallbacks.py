"""StoredCallbacks: what the application hears of its messages that went through the outbox.

A message stored in the outbox is delivered later by a drain worker (of this process, its drain
process, or another process), or dead-lettered. Its `on_delivery` callback waits here, by
message id, until that happens in this process; `on_dead_letter` hears every dead letter this
process makes. Callbacks run on the thread that learned the fate (a drain thread, the writer,
the delivery thread); an exception in one is kept for the application's next `poll()` or
`flush()` (`outbox.producer.pollreport`), never lost in a dead thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from confluent_kafka import KafkaError

from outbox.events import Committed, Drained
from outbox.message import DeliveryCallback
from outbox.producer.pollreport import PollReport
from outbox.records import DeadLetter, OutboxMessage

DeadLetterCallback = Callable[[DeadLetter], None]


class StoredCallbacks:
    """The callbacks of outboxed messages, and the counts of their fates in this process.

    Args:
        on_dead_letter: the application's recovery callback (or None).
        report_successes: whether `on_delivery` hears deliveries (not with
            `delivery.report.only.error`).
        poll_report: counts the callbacks run and keeps the exceptions they raised.
    """

    def __init__(
        self,
        on_dead_letter: DeadLetterCallback | None,
        *,
        report_successes: bool,
        poll_report: PollReport,
    ) -> None:
        self.on_dead_letter = on_dead_letter
        self._poll_report = poll_report
        self._report_successes = report_successes
        #: msg_id → on_delivery of outboxed messages that this process may still deliver. Written
        #: directly on the paths into the outbox: a method call would add a frame per message.
        self.waiting: dict[str, DeliveryCallback] = {}
        self.dead = 0  # dead letters made by this process's first sends and write-ahead sends
        self.drain_delivered = 0

    def dead_letter(self, dl: DeadLetter) -> None:
        """A message was dead-lettered (and the dead letter stored): tell its `on_delivery`, if
        it waits here, and `on_dead_letter`."""
        cb = self.waiting.pop(dl.msg_id, None) if self.waiting else None
        if cb is not None:
            try:
                code = dl.error_code if dl.error_code is not None else KafkaError._FAIL
                cb(KafkaError(code, f"dead-lettered: {dl.last_error}"), None)
                self._poll_report.add(1)
            except Exception as exc:
                self._poll_report.failed(exc)
        if self.on_dead_letter is not None:
            try:
                self.on_dead_letter(dl)  # the dead letter is stored whatever it does
                self._poll_report.add(1)
            except Exception as exc:
                self._poll_report.failed(exc)

    def committed_dead(self, c: Committed) -> list[DeadLetter]:
        """Writer thread: the dead letters of a commit (first sends and write-ahead rows), each
        message's `on_delivery` waiting under its id for `dead_letter`."""
        out: list[DeadLetter] = []
        for row_id, msg, cb in zip(c.dead_ids, c.dead, c.dead_meta, strict=True):
            if cb is not None:
                self.waiting[msg.msg_id] = cb
            out.append(
                DeadLetter(
                    row_id, msg.topic, msg.key, msg.value, msg.headers or [], msg.partition, msg.attempts,
                    msg.first_failed_at, msg.first_failed_at, msg.last_error, msg.msg_id,
                    msg.error_code, msg.error_name,
                )
            )
        out.extend(DeadLetter.from_row(row) for row in c.dead_failed)
        self.dead += len(out)
        return out

    def drained(self, rows: Sequence[OutboxMessage] | Sequence[Drained]) -> None:
        """Drain thread: rows delivered from the outbox."""
        self.drain_delivered += len(rows)
        if self.waiting:
            called = 0
            for row in rows:
                cb = self.waiting.pop(row.msg_id, None)
                if cb is not None and self._report_successes:
                    try:
                        cb(None, None)
                        called += 1
                    except Exception as exc:
                        self._poll_report.failed(exc)
            if called:
                self._poll_report.add(called)
