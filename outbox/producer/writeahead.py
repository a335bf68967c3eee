"""Write-ahead mode: every message is committed to the outbox, then sent by the writer thread.

`WriteAhead.write` queues a message for the group-commit writer, born leased to this producer
unless Kafka is known down or its key has older rows waiting (then it is left to the drain).
After each commit the writer thread calls `WriteAhead.send` with the batch's leased rows, and
their deletes wait for the batch (`SentBatch`):

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

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import Message as KafkaMessage

from outbox.drain.settle import Decision, Verdict, settle
from outbox.events import Committed
from outbox.lockorder import new_lock
from outbox.message import DeliveryCallback, Message
from outbox.producer.admission import SEND
from outbox.producer.circuit import CircuitBreaker
from outbox.producer.link import KafkaLink
from outbox.producer.spill import Spill
from outbox.producer.storedcallbacks import StoredCallbacks
from outbox.producer.writer import GroupCommitWriter
from outbox.records import NewMessage
from outbox.retry import RetryPolicy

log = logging.getLogger("outbox")

#: A batch's outcomes as the writer takes them: delivered ids, and (id, decision, when) of the rest.
Outcomes = Callable[[list[int], list[tuple[int, Decision, float]]], None]

_new_tuple = tuple.__new__

#: Durability "batch": the most messages a commit takes, and the most that wait behind it
#: (`GroupCommitWriter.wait_for_lag`): a `kill -9` loses at most twice this many. One group row
#: holds up to this many (`outbox.stores.grouped`), so a commit stays one row and one body.
CRASH_WINDOW_ROWS = 1000

#: Why a committed row admitted as SEND was given to the drain instead (`WriteAhead.send`):
#: settled as a message that was never sent (no attempt counted, due now).
_NOT_SENT = KafkaError(KafkaError._PURGE_QUEUE, "not sent: the circuit opened or its key waits in the outbox")


class WriteAhead:
    """The write-ahead path of a producer: store first, then send from the writer thread.

    Args:
        link: the librdkafka producer.
        spill: the key backlog (a key with rows waiting is not sent ahead of them) and the count
            of messages handed to the drain.
        writer: the group-commit writer; each `committed` batch it tells must reach `send`.
        circuit: one already open when a batch's sends fail leaves their rows due now.
        callbacks: where the `on_delivery` of a row left to the drain waits.
        retry: the policy that settles a failed send.
        durability: "batch" or "sync" (`write` returns once the row is committed).
        report_successes: whether `on_delivery` hears deliveries.
    """

    def __init__(
        self,
        link: KafkaLink,
        spill: Spill,
        writer: GroupCommitWriter,
        circuit: CircuitBreaker,
        callbacks: StoredCallbacks,
        retry: RetryPolicy,
        *,
        durability: str,
        report_successes: bool,
    ) -> None:
        self._link = link
        self._spill = spill
        self._backlog = spill.backlog
        self._route = spill.admission.route
        self._writer = writer
        self._circuit = circuit
        self._waiting = callbacks.waiting
        self._retry = retry
        self._sync = durability == "sync"
        self._report_successes = report_successes

    def write(self, message: Message) -> None:
        """Queue a message for the outbox; raises the commit's StoreError with durability "sync"."""
        msg = message.row()
        cb = message.on_delivery
        # Sent by us after the commit if admitted as SEND; otherwise (Kafka not known up, or the
        # key waits behind its rows) left to the drain workers. Write-ahead never probes.
        send_now = self._route(msg.topic, msg.key) is SEND
        if not self._sync:  # the crash window: one batch under way, at most one behind it
            self._writer.wait_for_lag()
        if send_now:
            batch = self._writer.add_new(msg, cb, leased=True, wait=True)
        else:  # stored for the drain workers; write-ahead rows never need holding back
            self._writer.wait_for_room()
            batch = self._backlog.queue_stored(msg, cb)
        if self._sync:
            batch.done.wait()
            if batch.error is not None:
                raise batch.error

    def send(self, c: Committed) -> None:
        """Writer thread: send a committed batch's write-ahead rows (the rows born leased to us)."""
        if all(c.leased):
            ids, msgs, cbs = c.new_ids, c.new, c.new_meta
        else:
            mine = [i for i, leased in enumerate(c.leased) if leased]
            ids, msgs, cbs = [c.new_ids[i] for i in mine], [c.new[i] for i in mine], [c.new_meta[i] for i in mine]
        batch = SentBatch(
            ids, msgs, cbs, self._on_report, self._writer.add_outcomes,
            successes_heard=self._report_successes and any(cb is not None for cb in cbs),
        )
        produce, handed = self._link.kafka.produce, self._link.handed.add
        shared = None if batch.successes_heard else batch.report  # one callback for every send
        # Admitted as SEND when written, but sent only now, after the commit. Meanwhile the
        # circuit may have opened and librdkafka handed back older rows of the same keys (to
        # the drain, their keys now pending): sent now, a row would overtake them. So the
        # admission is asked again here, and a row that may no longer go is given to the drain.
        route = self._route
        for i, msg in enumerate(msgs):
            report = shared or SentReport(batch, i)
            while True:
                # Asked again before every try: a send that waited for room in a full queue may
                # outlast the circuit's opening and the purge of its key's older rows.
                if route(msg.topic, msg.key) is not SEND:
                    handed()  # counted as taken and failed: _failed counts the failure
                    batch.refused(i, *self._failed(msg, cbs[i], _NOT_SENT))
                    break
                try:
                    produce(
                        msg.topic, msg.value, msg.key, msg.partition, report, None, msg.timestamp,
                        msg.headers,  # type: ignore[arg-type]
                    )
                    handed()
                    break
                except BufferError:
                    time.sleep(0.005)  # the delivery thread is draining the queue
                except KafkaException as exc:
                    handed()  # counted as taken and failed: _failed counts the failure
                    batch.refused(i, *self._failed(msg, cbs[i], exc.args[0]))
                    break
        if not self._circuit.closed or self._spill.hold.active:
            # Committed while Kafka was up, sent as the circuit opened and purged the queue:
            # hand these back to the drain now, not at `message.timeout.ms`.
            self._link.purge_queue_soon()

    def _on_report(self, batch: SentBatch, i: int, err: KafkaError | None, msg: KafkaMessage | None) -> None:
        """Delivery thread: a send finished: the row is deleted with its batch, or handed to the drain."""
        cb = batch.callbacks[i]
        if err is None:
            batch.delivered(i)
            if cb is not None and self._report_successes:
                cb(None, msg)
                self._link.poll_report.delivery_thread_calls += 1
            return
        batch.decided(i, *self._failed(batch.messages[i], cb, err))

    def _failed(self, m: NewMessage, cb: DeliveryCallback | None, err: KafkaError) -> tuple[Decision, float]:
        """A send failed: its decision, and when. Counted as one failed send per row (two alike
        rows of a shared-report batch taken as failed for one report count two)."""
        self._link.send_failures.add()
        now = time.time()
        d = settle(m, err, self._retry, now)
        if d.recreate_producer:
            self._link.recreate_soon()
        if d.verdict is Verdict.RESEND_ALONE:
            # Maybe a batch-mate's fault: due now, a drain worker re-sends it (alone if needed).
            d = replace(d, verdict=Verdict.RESCHEDULE, at=now, attempts=1)
        if d.verdict is not Verdict.DEAD_LETTER:
            self._link.note_transport_failure(err.code())
            if m.key is not None:
                self._backlog.add((m.topic, m.key))
            self._spill.outboxed.add()
        if cb is not None:
            self._waiting[m.msg_id] = cb  # popped when the row is delivered or dead-lettered
        return d, now


class SentBatch:
    """The write-ahead rows of one committed batch, while their sends are in flight.

    Its reports come one of two ways:
    - *per row*, when some row's caller hears of its delivery (`successes_heard`): each send
      carries a `SentReport` naming its row, and `on_report` runs for every report.
    - *shared*, otherwise: every send carries the batch's one `report` method, so a send makes
      no object of its own (a `SentReport` per message taxed every `produce()` of the writer
      thread: its creation and the garbage collector's walks over up to 100,000 alive). A
      success is only counted. A failure report carries no headers, so its row is found by
      content (topic, key, value); every undecided row with that content is taken as failed, so
      when two rows are alike and one was delivered, both are sent again (at-least-once, with
      their own ids), and no failed row is ever taken as delivered.

    Args:
        ids: the rows' ids, in send order.
        messages: the rows, same order.
        callbacks: the caller's `on_delivery` per row (or None), same order.
        on_report: runs a row's delivery report: (this batch, the row's place, error, message);
            shared: for failures only.
        on_settled: called once, when the last row has its outcome, with all of them.
        successes_heard: some row's caller wants to hear of its delivery (per-row reports).
    """

    __slots__ = ("ids", "messages", "callbacks", "on_report", "successes_heard", "_on_settled", "_delivered",
                 "_decided", "_decided_rows", "_next_outcome", "_lock", "_by_content")

    def __init__(
        self, ids: Sequence[int], messages: Sequence[NewMessage], callbacks: Sequence[Any],
        on_report: Callable[[SentBatch, int, KafkaError | None, KafkaMessage | None], None],
        on_settled: Outcomes, *, successes_heard: bool = True,
    ) -> None:
        self.ids = ids
        self.messages = messages
        self.callbacks = callbacks
        self.on_report = on_report
        self.successes_heard = successes_heard
        self._on_settled = on_settled
        self._delivered: list[int] = []  # per row
        self._decided: list[tuple[int, Decision, float]] = []
        self._decided_rows: set[int] = set()
        # Numbers the outcomes (per row: each row's; shared: each report, and each row refused by
        # produce(), which gets no report); the one numbered len(ids) settles the batch. Each
        # outcome is recorded before it takes its number, so that one sees them all. A count's
        # next() is one call that the interpreter lock makes atomic: a lock taken per success
        # cost the delivery thread much more per message.
        self._next_outcome = itertools.count(1).__next__
        self._by_content: dict[tuple[str, bytes | None, bytes | None], list[int]] | None = None
        # Failure reports come on the delivery thread, a refused produce() on the writer thread.
        self._lock = new_lock("write-ahead")

    def delivered(self, i: int) -> None:
        """Per row: row `i` was delivered."""
        self._delivered.append(self.ids[i])  # list.append is atomic
        self._count_down()

    def decided(self, i: int, decision: Decision, now: float) -> None:
        """Row `i` failed; `decision` is its `settle()` verdict at `now` (once per row)."""
        with self._lock:
            if i in self._decided_rows:
                return
            self._decided_rows.add(i)
            self._decided.append((self.ids[i], decision, now))
        if self.successes_heard:  # shared: the report that found this row counts down
            self._count_down()

    def refused(self, i: int, decision: Decision, now: float) -> None:
        """produce() refused row `i` (no report will come); `decision` as in `decided`."""
        self.decided(i, decision, now)
        if not self.successes_heard:
            self._count_down()

    def report(self, err: KafkaError | None, msg: KafkaMessage) -> None:
        """Shared: the delivery callback of every send of this batch (see the class doc)."""
        if err is not None:
            for i in self._rows_like(msg):
                self.on_report(self, i, err, msg)
        self._count_down()

    def _count_down(self) -> None:
        if self._next_outcome() == len(self.ids):
            self._settle()

    def _rows_like(self, msg: KafkaMessage) -> list[int]:
        """The undecided rows with the content of a failure report (all undecided rows, should none
        match: a failed row must never be taken as delivered)."""
        with self._lock:
            if self._by_content is None:
                self._by_content = {}
                for i, m in enumerate(self.messages):
                    self._by_content.setdefault((m.topic, m.key, m.value), []).append(i)
            rows = self._by_content.get((msg.topic() or "", msg.key(), msg.value()))
            undecided = [i for i in rows or range(len(self.ids)) if i not in self._decided_rows]
        if not rows:
            log.warning("outbox: a write-ahead failure report matched no row of its batch; the batch's undecided "
                        "rows are all sent again")
        return undecided

    def _settle(self) -> None:
        if not self.successes_heard:
            decided = self._decided_rows
            self._delivered = [row_id for i, row_id in enumerate(self.ids) if i not in decided]
        self._on_settled(self._delivered, self._decided)


class SentReport:
    """The delivery callback of one write-ahead send in a per-row batch: its batch and its place.

    A slotted object of two fields, not a `functools.partial` holding the message: up to
    100,000 are alive at once and the garbage collector walks each (see `_Report` in
    `outbox.producer.firstsend`).
    """

    __slots__ = ("batch", "i")

    def __init__(self, batch: SentBatch, i: int) -> None:
        self.batch = batch
        self.i = i

    def __call__(self, err: KafkaError | None, msg: KafkaMessage | None) -> None:
        b = self.batch
        b.on_report(b, self.i, err, msg)
