"""FirstSend: fallback mode's first attempt of each message, and what its failure becomes.

A message goes to librdkafka with the id header and one small object its failure report needs
(`_Report`). With `delivery.report.only.error` a success costs nothing more; without it, one
call on the delivery thread. A failure is settled (`outbox.drain.settle`) and the message is stored
for the drain, stored to be re-sent alone, or dead-lettered. `enable_retry=False` messages are
sent here too, and their failures only reported.

Record timestamps: a message goes to librdkafka with the one given to produce(), or 0, which
librdkafka stamps with the time of the call. A failure report does not say what it stamped
(`confluent_kafka.Message.timestamp()` is "not available" for a failed message), but it does say how long ago
the message was produced (`Message.latency()`), so a failed message is stored with report time
less latency: the time of its produce() call, with no clock read per message on the way out.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import Message as KafkaMessage

from outbox.drain.settle import Verdict, settle
from outbox.message import DeliveryCallback, Failure, Message
from outbox.producer.admission import SEND
from outbox.producer.circuit import CircuitBreaker
from outbox.producer.compiling import mypyc_attr
from outbox.producer.keyorder import HeldMessage
from outbox.producer.link import PURGE_CODES, KafkaLink
from outbox.producer.spill import NOT_SENT_QUEUE_FULL, Spill
from outbox.producer.writer import GroupCommitWriter
from outbox.records import Headers, Key, NewMessage
from outbox.retry import RetryPolicy
from outbox.tally import Tally

# `# type: ignore[arg-type]` on produce(): confluent-kafka's stubs type headers as
# list[tuple[str, str | bytes | None]], and list is invariant, so our list[tuple[str, bytes | None]]
# is rejected although every value is valid. Every produce() here is positional: parsing
# keyword arguments was most of a call (outbox.drain.sendloop).


class FirstSend:
    """First sends of a fallback-mode producer.

    Args:
        link: the librdkafka producer.
        spill: where failed and unsent messages go.
        writer: takes dead letters.
        circuit: a failed report while it is not closed may be the half-open circuit's probe.
        retry: the policy that settles a failure.
        wake_drain: a message to re-send alone is due now.
        id_header: the id header's name, or None (a failure report rebuilds the header from it).
        report_successes: whether `on_delivery` hears deliveries.
    """

    def __init__(
        self,
        link: KafkaLink,
        spill: Spill,
        writer: GroupCommitWriter,
        circuit: CircuitBreaker,
        retry: RetryPolicy,
        *,
        wake_drain: Callable[[], None],
        id_header: str | None,
        report_successes: bool,
    ) -> None:
        self._link = link
        self._hold_longest = spill.hold_longest  # how long a hold-back may last (as when the circuit opens)
        self._spill = spill
        self._fence = self.fence = spill.fence
        # The reports of keyed first sends in flight (None: not tracked, outbox.producer.sendfence).
        self.inflight: dict[str, Any] | None = spill.fence.inflight if spill.fence.tracking else None
        self._writer = writer
        self._circuit = circuit
        self._retry = retry
        self._wake_drain = wake_drain
        self._id_header = id_header
        self._id_headers = 0 if id_header is None else 1  # headers a message has with none of its own
        self._report_successes = report_successes
        self.failed = Tally()  # enable_retry=False messages that failed (delivery thread, or the caller's)
        self.poll_report = link.poll_report  # counts the delivery thread's calls of `on_delivery`

    def send(
        self, topic: str, value: Any, key: Any, hdrs: Headers, partition: int, msg_id: str,
        cb: DeliveryCallback | None, timestamp: int, *, routed: bool = True,
    ) -> bool:
        """Send a message for the first time; stored instead if librdkafka's queue stays full.

        routed: admission chose SEND (`outbox.producer.admission`). False: produce()'s fast path,
        taken without asking admission while the send fence is not armed; it gives up, and
        returns False with nothing sent, if the fence armed meanwhile (the caller asks admission
        then). Returns True once the message is librdkafka's or stored.

        The one path that takes a message's parts rather than its `Message`: it is every
        message's path while Kafka is up, and building the object per message cost more CPU per
        message than the design allows this path (docs/benchmarks.md). A message that leaves
        it (refused, or failed) becomes a `Message` there.
        """
        report: _Report
        app_headers = len(hdrs) > self._id_headers  # the application's headers besides the id
        if cb is None and partition == -1 and not timestamp and not app_headers:
            report = _Report(self, msg_id, topic, key)  # the common message: its id is all a failure needs
        else:
            report = _FullReport(self, msg_id, topic, key, hdrs if app_headers else None, cb, partition, timestamp)
        fence = self._fence
        inflight = self.inflight
        purges = -1  # the fence's purges when a counted send was counted (-1: not counted)
        if key is not None and inflight is not None:
            inflight[msg_id] = report  # before `armed` is read (outbox.producer.sendfence)
            if routed:
                if fence.armed:
                    purges = fence.purges
                    fence.count(report)
            elif fence.armed:
                self._not_taken(report)  # an arming meanwhile may have counted it
                return False
        elif not routed and fence.armed:
            return False
        link = self._link
        try:
            try:
                link.kafka.produce(topic, value, key, partition, report, None, timestamp, hdrs)  # type: ignore[arg-type]
            except BufferError:
                # The produce() call's time, before a wait for room that may be long.
                timestamp = timestamp or int(time.time() * 1000)
                # The same call again, as a closure made only when the queue is full: the common
                # path makes no closure per message.
                if not link.when_queue_has_room(
                    lambda: link.kafka.produce(
                        topic, value, key, partition, report, None, timestamp, hdrs  # type: ignore[arg-type]
                    ),
                    open_if_stalled=True,
                ):
                    raise
                if not self._circuit.closed:
                    # The wait straddled the circuit's opening: this message entered librdkafka
                    # after the open's hold-back may have ended, and its key's later messages
                    # would be stored ahead of it. Hold them again until librdkafka hands it back.
                    self._spill.hold_after_open(self._hold_longest)
            link.handed.add()
            if report.epoch and (fence.purges != purges if routed else True):
                # Armed during this call, after it chose the fast path, or librdkafka was asked to
                # hand messages back while it was counted: that purge may have come before this
                # message entered librdkafka's queue, behind older ones of its key it handed back.
                self._spill.straggled(report)
        except BufferError:
            self._not_taken(report)
            message = Message(topic, value, key, hdrs, partition, msg_id, timestamp, cb)
            self._spill.store_unsent(message, NOT_SENT_QUEUE_FULL, wait=True)
        except KafkaException as exc:
            self._not_taken(report)
            self.failed_send(exc.args[0], Message(topic, value, key, hdrs, partition, msg_id, timestamp, cb), None)
        return True

    def _not_taken(self, report: _Report) -> None:
        """librdkafka did not take a first send after all: it is no longer in flight."""
        if report.key is not None and self.inflight is not None:
            self.inflight.pop(report.msg_id, None)
            if self._fence.armed:
                self._spill.sent_reported(report)

    def send_unprotected(self, message: Message) -> None:
        """enable_retry=False: Kafka or nothing; failures go to its `on_delivery` only."""
        topic, value, key, hdrs, partition, _, timestamp, cb = message
        report = functools.partial(self._on_unprotected_report, cb)
        link = self._link

        def send() -> None:
            link.kafka.produce(topic, value, key, partition, report, None, timestamp, hdrs)  # type: ignore[arg-type]

        try:
            try:
                send()
            except BufferError:
                if not link.when_queue_has_room(send):
                    raise
            link.handed.add()
        except BufferError:
            self.failed.add()
            if cb is not None:
                cb(KafkaError(KafkaError._QUEUE_FULL, "local queue full; enable_retry=False: dropped"), None)
        except KafkaException as exc:
            self.failed.add()
            if cb is not None:
                cb(exc.args[0], None)

    def send_held(self, key: Key, held: list[HeldMessage]) -> None:
        """Under the backlog's lock: a key handed back to the fast path; its messages held by the
        gate go to Kafka in produce order. One that librdkafka does not take is stored, and so
        is every one after it (the key stays pending)."""
        if self._spill.admission.released() is not SEND:
            self._spill.store_held(held)
            return
        produce = self._link.kafka.produce
        fence = self._fence
        for i, (msg, cb) in enumerate(held):
            report = _FullReport(self, msg.msg_id, msg.topic, msg.key, msg.headers, cb, msg.partition, msg.timestamp)
            if self.inflight is not None:
                self.inflight[msg.msg_id] = report
            if fence.armed:  # armed: the key was pending
                fence.count(report)
            try:
                produce(
                    msg.topic, msg.value, msg.key, msg.partition, report, None, msg.timestamp,
                    msg.headers,  # type: ignore[arg-type]
                )
                self._link.handed.add()
            except BufferError:  # no waiting under the lock: the delivery thread may need it
                self._not_taken(report)
                self._spill.store_held(held[i:])
                return
            except KafkaException as exc:
                self._not_taken(report)
                self.failed_send(exc.args[0], _message_of(msg, cb), None)
                self._spill.store_held(held[i + 1 :])
                return

    def reported(self, r: _Report) -> None:
        """Delivery thread: a first send was reported while the fence was armed (`outbox.producer.sendfence`)."""
        self._spill.sent_reported(r)

    def on_failure(self, r: _Report, err: KafkaError, msg: KafkaMessage) -> None:
        """Delivery thread: the failure report of a first send (`_Report.__call__` serves successes)."""
        self._link.send_failures.add()
        if err.code() in PURGE_CODES:
            if self._link.app_purging:  # the application dropped it
                if r.cb is not None:
                    r.cb(err, msg)
                    self._link.poll_report.delivery_thread_calls += 1
                return
            if not self._circuit.closed:
                # Purged while the circuit is not closed: if it was the half-open circuit's probe,
                # the probe failed (open again; the next one after reset_timeout).
                self._circuit.record_failure()
        if r.headers is not None:
            hdrs = r.headers
        else:
            hdrs = [(self._id_header, r.msg_id.encode())] if self._id_header is not None else []
        # The message again, from what the report carries and what travelled with it.
        message = Message(msg.topic() or "", msg.value(), msg.key(), hdrs, r.partition, r.msg_id, r.timestamp, r.cb)
        to_resend = self.failed_send(err, message, msg)
        if (
            to_resend and r.key is not None and self._circuit.closed and err.code() not in PURGE_CODES
            and self._fence.others_sending(r)
        ):
            # It failed on its own (its partition leaderless past message.timeout.ms, say) while
            # later messages of its key wait in librdkafka: delivered once the leader is back,
            # they would overtake it. librdkafka hands back only a whole queue, and a produce()
            # that sees the circuit closed sends on: opening the circuit does both, in order
            # (the hold-back stores what librdkafka hands back, and what is produced meanwhile,
            # in produce order). What is already on the wire may still overtake it.
            self._circuit.trip("a message failed while later ones of its key waited in librdkafka")

    def failed_send(self, err: KafkaError, message: Message, report: KafkaMessage | None) -> bool:
        """A first send failed: outbox it (retriable) or dead-letter it (permanent). `report`:
        librdkafka's failure report, None if produce() itself refused it. Returns whether it is
        stored to be sent again (False: dead-lettered)."""
        now = time.time()
        if not message.timestamp:  # stamped with the time of its produce() call (module doc)
            latency = report.latency() if report is not None else None  # seconds since produce(); -1: unknown
            message = message._replace(
                timestamp=int((now - latency if latency is not None and latency >= 0 else now) * 1000)
            )
        # No report: refused by produce() itself, so the message alone is at fault.
        d = settle(_FIRST_SEND, err, self._retry, now, alone=report is None)
        if d.recreate_producer:
            self._link.recreate_soon()
        cb = message.on_delivery
        if d.verdict is Verdict.RELEASE:  # never sent: stored due now, no attempt counted
            self._spill.store(message.row(error=d.error, failure=Failure(0, d.code, d.name)), cb)
            return True
        if d.verdict is Verdict.RESEND_ALONE:
            # The broker refused the record batch it was in: maybe another message's fault, so
            # no attempt is counted (as the drain counts none for it, `settle`). Stored due now;
            # a drain worker re-sends it alone and dead-letters it only if it fails on its own.
            self._spill.store(message.row(error=d.error, failure=Failure(d.attempts, d.code, d.name)), cb)
            self._wake_drain()
            return True
        failed = message.row(error=d.error, due=d.at or now, failure=Failure(d.attempts, d.code, d.name))
        if d.verdict is Verdict.DEAD_LETTER:
            self._writer.add_dead(failed, cb)
            return False
        self._link.note_transport_failure(err.code())
        self._spill.store(failed, cb)
        return True

    def _on_unprotected_report(self, cb: DeliveryCallback | None, err: KafkaError | None, msg: KafkaMessage) -> None:
        if err is not None:
            self._link.send_failures.add()
            self.failed.add()
        if cb is not None and (err is not None or self._report_successes):
            cb(err, msg)
            self._link.poll_report.delivery_thread_calls += 1


# Compiled, a report is left out of the garbage collector's walks (acyclic): it refers to its
# FirstSend and to the application's callback, and nothing refers to it but librdkafka until
# its report is served, so no cycle can pass through it.
@mypyc_attr(acyclic=True)
class _Report:
    """The delivery callback of a first send: what storing the message after a failure needs.

    Delivery reports carry no headers, partition or timestamp as given to produce() (confluent-kafka
    drops the headers; a failed message's timestamp reads "not available"; its partition is the
    partitioner's, or None), so what the outbox needs travels here. One lives per message in flight,
    often 100,000 at once, each an object the garbage collector walks (except in the compiled
    build: acyclic); this one, for the common message (no `on_delivery`, partition -1, no
    timestamp, no application headers), holds the id alone: a third cheaper to make and keep
    than `_FullReport` (a functools.partial holding the header list and its tuple cost ten times
    that in collection). Its success report returns at once.
    """

    __slots__ = ("first", "msg_id", "topic", "key", "epoch")

    # What `_FullReport` holds per message; these are the common message's.
    headers: Headers | None = None  # None: the id header alone (rebuilt on failure)
    cb: DeliveryCallback | None = None
    partition = -1
    timestamp = 0  # given to produce(); 0: librdkafka's (a failure: its latency)

    def __init__(self, first: FirstSend, msg_id: str, topic: str, key: Any) -> None:
        self.first = first
        self.msg_id = msg_id
        self.topic = topic
        self.key = key  # as given to produce(); the send fence counts keyed sends by it
        self.epoch = 0  # the send fence's epoch it was counted in (outbox.producer.sendfence)

    def __call__(self, err: KafkaError | None, msg: KafkaMessage) -> None:
        first = self.first
        inflight = first.inflight
        keyed = self.key is not None and inflight is not None
        if keyed:  # out of flight before a failure is stored: an arming then does not count it
            inflight.pop(self.msg_id, None)  # type: ignore[union-attr]
        if err is not None:
            first.on_failure(self, err, msg)
        if keyed and first.fence.armed:  # after a failure is stored: ahead of what waited behind it
            first.reported(self)


@mypyc_attr(acyclic=True)
class _FullReport(_Report):
    """`_Report` of a message with an `on_delivery`, a partition, a timestamp or headers given.
    Its success report calls `on_delivery` (unless successes go unreported) in the same frame."""

    __slots__ = ("headers", "cb", "partition", "timestamp")

    def __init__(
        self, first: FirstSend, msg_id: str, topic: str, key: Any, headers: Headers | None,
        cb: DeliveryCallback | None, partition: int, timestamp: int,
    ) -> None:
        self.first = first
        self.msg_id = msg_id
        self.topic = topic
        self.key = key
        self.epoch = 0
        self.headers = headers
        self.cb = cb
        self.partition = partition
        self.timestamp = timestamp

    def __call__(self, err: KafkaError | None, msg: KafkaMessage) -> None:
        _Report.__call__(self, err, msg)
        cb = self.cb
        if err is None and cb is not None:  # successes heard (delivery.report.only.error unset)
            cb(None, msg)
            self.first.poll_report.delivery_thread_calls += 1


def _message_of(row: NewMessage, cb: DeliveryCallback | None) -> Message:
    """A gated message again, from its row and callback (what a failed send of it needs)."""
    return Message(row.topic, row.value, row.key, row.headers or [], row.partition, row.msg_id, row.timestamp, cb)


class _FirstSend:
    """The retry state of a message on its first send: no failure yet."""

    attempts = 0
    first_failed_at: float | None = None


_FIRST_SEND = _FirstSend()
