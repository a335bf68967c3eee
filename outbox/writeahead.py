"""Write-ahead sends: a committed batch's rows go to Kafka, and their deletes wait for the batch.

A write-ahead message is stored before it is sent, so every delivery deletes a stored row.
The store keeps a committed batch as group rows where it can (`outbox.stores.grouped`): one
row and one body for up to 1,000 messages. A group is deleted cheaply only when all its
messages are delivered in one settlement (and kept whole, due now, only when all are given
back); anything partial splits it into a row per message first, which costs more than storing
one row per message in the first place. So the outcomes of a batch are held here until every
message of the batch has one, and then handed to the writer together.

Holding outcomes back only delays what the store records. If the process dies meanwhile, the
batch's rows are still leased to it in the store: they are sent again from the outbox with the
same id (at-least-once, as the README says), and a failure not yet recorded is not counted as an
attempt.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import KafkaError, Message

from .records import NewMessage
from .settle import Decision

#: A batch's outcomes as the writer takes them: delivered ids, and (id, decision, when) of the rest.
Outcomes = Callable[[list[int], list[tuple[int, Decision, float]]], None]


class SentBatch:
    """The write-ahead rows of one committed batch, while their sends are in flight.

    Args:
        ids: the rows' ids, in send order.
        messages: the rows, same order.
        callbacks: the caller's `on_delivery` per row (or None), same order.
        on_report: runs a row's delivery report: (this batch, the row's place, error, message);
            for a success only if `successes_heard`.
        on_settled: called once, when the last row has its outcome, with all of them.
        successes_heard: some row's caller wants to hear of its delivery.
    """

    __slots__ = ("ids", "messages", "callbacks", "on_report", "successes_heard", "_on_settled", "_delivered",
                 "_decided", "_left", "_lock")

    def __init__(
        self, ids: Sequence[int], messages: Sequence[NewMessage], callbacks: Sequence[Any],
        on_report: Callable[[SentBatch, int, KafkaError | None, Message | None], None],
        on_settled: Outcomes, *, successes_heard: bool = True,
    ) -> None:
        self.ids = ids
        self.messages = messages
        self.callbacks = callbacks
        self.on_report = on_report
        self.successes_heard = successes_heard
        self._on_settled = on_settled
        self._delivered: list[int] = []
        self._decided: list[tuple[int, Decision, float]] = []
        self._left = len(ids)
        # Reports come on the delivery thread, a refused produce() on the writer thread.
        self._lock = threading.Lock()

    def delivered(self, i: int) -> None:
        """Row `i` was delivered."""
        with self._lock:
            self._delivered.append(self.ids[i])
            self._left -= 1
            if self._left:
                return
        self._on_settled(self._delivered, self._decided)

    def decided(self, i: int, decision: Decision, now: float) -> None:
        """Row `i` failed; `decision` is its `settle()` verdict at `now`."""
        with self._lock:
            self._decided.append((self.ids[i], decision, now))
            self._left -= 1
            if self._left:
                return
        self._on_settled(self._delivered, self._decided)


class SentReport:
    """The delivery callback of one write-ahead send: its batch and its place there.

    A slotted object of two fields, not a `functools.partial` holding the message: up to
    100,000 are alive at once and the garbage collector walks each (see `_Report` in
    `outbox.producer`).
    """

    __slots__ = ("batch", "i")

    def __init__(self, batch: SentBatch, i: int) -> None:
        self.batch = batch
        self.i = i

    def __call__(self, err: KafkaError | None, msg: Message | None) -> None:
        b = self.batch
        if err is None and not b.successes_heard:
            b.delivered(self.i)  # the common case, one call deep: this runs once per message
        else:
            b.on_report(b, self.i, err, msg)
