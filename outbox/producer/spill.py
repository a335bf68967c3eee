"""Spill: messages on their way from a producer into its outbox, in per-key order.

Every message a `ResilientProducer` stores (not sent: circuit open, queue full, key waiting; or
sent and failed) goes through here to the group-commit writer. Two things keep one key's
messages in produce order on that way (README, "Order per key"):

- the key backlog (`outbox.producer.keyorder`): once a key has a message bound for the outbox, its later
  messages are stored behind it, until the drain has delivered them all;
- the hold-back (`outbox.producer.keyorder.Holdback`): from the moment the circuit opens, messages bound for the
  outbox wait in memory until librdkafka has handed back the older ones it still held; and the
  same while a keyed message probes the half-open circuit (if it fails it is stored, ahead of
  its key's later messages).

Both, and the send fence, are owned by the key backlog, which alone takes the lock that makes
"mark the key and queue its message" one step; this module builds the rows and decides when.

All three hold messages in memory against one budget in bytes (`outbox.budget`): an application
thread waits for room before it queues a message (`wait_for_room`), the delivery thread never does.
"""

from __future__ import annotations

import time

from outbox.message import DeliveryCallback, Message, message_cost
from outbox.producer.admission import Admission
from outbox.producer.circuit import CircuitBreaker, CircuitState
from outbox.producer.keyorder import Held, Holdback, KeyBacklog
from outbox.producer.link import KafkaLink
from outbox.producer.sendfence import SendFence, SentReport, key_of
from outbox.producer.storedcallbacks import StoredCallbacks
from outbox.producer.writer import GroupCommitWriter
from outbox.records import NewMessage

#: The last error of a message stored without a send attempt, by why it was not sent.
NOT_SENT_CIRCUIT_OPEN = "not sent: circuit open"
NOT_SENT_QUEUE_FULL = "not sent: local queue full"
NOT_SENT_KEY_WAITS = "not sent: key has messages in the outbox"



class Spill:
    """The way into the outbox: key backlog, hold-back, writer.

    Args:
        writer: commits what is queued here into its store (which the key backlog reads for
            keys with rows); its memory budget is shared by the hold-back and the gate.
        link: the librdkafka producer (the hold-back ends once it has handed back its messages).
        circuit: keys are checked only while it is not open (nothing drains then).
        callbacks: where a stored message's `on_delivery` waits.
        gate: fallback mode: a key is handed back to the fast path through a gate
            (`outbox.producer.keyorder`), and new messages may probe the half-open circuit; not
            in write-ahead mode, which stores every message anyway.
        keyed_probes: fallback mode: a keyed message may probe the circuit (`outbox.producer.admission`).
        track_sends: success reports are heard, so a key's outbox-bound messages can wait behind
            its first sends still in librdkafka (`outbox.producer.keyorder.SendFence`).
        hold_longest: the most a hold-back or such a wait lasts (`message.timeout.ms` + 1 s).

    `admission` decides each message's route from the circuit, the key backlog and the
    hold-back built here (`outbox.producer.admission`).
    """

    def __init__(
        self,
        writer: GroupCommitWriter,
        link: KafkaLink,
        circuit: CircuitBreaker,
        callbacks: StoredCallbacks,
        *,
        gate: bool,
        keyed_probes: bool = False,
        track_sends: bool = False,
        hold_longest: float = 31.0,
    ) -> None:
        self._writer = writer
        self._gate = gate
        self.hold_longest = hold_longest
        self._link = link
        self._circuit = circuit
        self.budget = writer.budget
        self.hold: Holdback[NewMessage] = Holdback(
            _sequence, budget=self.budget, on_full=link.purge_all_soon, clock=time.monotonic
        )
        self.fence = SendFence(
            tracking=track_sends, budget=self.budget, on_full=link.purge_all_soon,
            on_overtaken=link.purge_queue_soon, clock=time.monotonic, longest=hold_longest,
        )
        link.on_purge = self.fence.purged
        # A hold after the circuit opened purges librdkafka's queue at every tick (stragglers
        # queued just after the open); one behind a probe does not (the probe is in that queue
        # while a broker reconnects).
        self._purge_stragglers = True
        # Not checked while the circuit is open: nothing drains then. Half-open counts as not
        # open: when every key has a backlog, no message is left to probe the circuit, and only
        # a released key lets one through.
        self.backlog = KeyBacklog(
            writer.store,
            writer,
            self.hold,
            self.fence,
            waiting=callbacks.waiting,
            may_check=lambda: circuit.state is not CircuitState.OPEN,
            budget=self.budget,
        )
        self.outboxed = self.backlog.outboxed  # the key backlog counts what it queues
        self.admission = Admission(
            circuit, self.backlog, self.hold, self.fence, probes=gate, keyed_probes=keyed_probes
        )

    def held(self) -> int:
        """Messages bound for the outbox but in memory here (hold-back and gate), not queued."""
        return len(self.hold) + self.backlog.held + len(self.fence)

    # -- paths in ----------------------------------------------------------------------------

    def key_waits(self, message: Message) -> bool:
        """A message admitted as HOLD: store it behind its key's messages and return True; False
        if the key was freed since (then the caller asks `admission.route` again).

        After an outage this is the path of nearly every message until the backlog is drained,
        and the drain shares this process's interpreter lock: so the check that the key still
        waits and the queueing are one step of the backlog's.
        """
        msg = message.row(error=NOT_SENT_KEY_WAITS)
        assert msg.key is not None  # admitted as HOLD: keyed
        cost = message_cost(msg)
        self.wait_for_room(cost)  # outside the backlog's lock: the writer's hooks may need it
        return self.backlog.queue_behind_key(msg, message.on_delivery, cost)

    def store_unsent(self, message: Message, why: str, *, wait: bool = False) -> None:
        """Store a message that was not sent (`why`: a `NOT_SENT_*`): due at once."""
        self.store(message.row(error=why), message.on_delivery, wait=wait)

    def store(self, msg: NewMessage, cb: DeliveryCallback | None, *, wait: bool = False) -> None:
        """Queue a message for the outbox (held back while the circuit has just opened).

        `wait=True` only from the application's produce() call: it may block for backpressure.
        The delivery thread never waits here (the writer's sends need it to poll).
        """
        cost = message_cost(msg)
        if wait:
            self.wait_for_room(cost)  # outside the backlog's lock, which the delivery thread needs
        self.backlog.queue(msg, cb, cost)

    def store_held(self, held: Held) -> None:
        """Messages a gate held, queued for the outbox in order (the key stays pending)."""
        self.backlog.queue_held(held)

    def sent_reported(self, report: SentReport) -> None:
        """librdkafka reported a first send, or did not take it after all; if it held no other of
        its key, the key's messages that waited go on to the writer, in produce order."""
        self.backlog.forward_fenced(self.fence.reported(report))

    def straggled(self, report: SentReport) -> None:
        """A fast-path send entered librdkafka while the fence armed. If its key had sends in
        librdkafka when it was last asked to hand them back, older ones may be on their way to the
        outbox: librdkafka's queue is handed back again, this one with it, to be held behind them."""
        if key_of(report) in self.fence.handed_back:
            self._link.purge_queue_soon()

    def wait_for_room(self, cost: int) -> None:
        """Application threads: block while the memory budget has no room for `cost` more bytes.

        The gate's messages go to the writer first: a gate keeps them up to a second, the
        writer's commits free the room sooner (a gate never makes produce() wait). A hold-back
        asks librdkafka for what is in flight, which ends it at the next poll.
        """
        if not self.budget.full(cost):
            return
        self.hold.budget_full()
        if self.backlog.held_bytes:
            self.backlog.store_gated()
        self._writer.wait_for_room(cost)

    # -- the hold-back -----------------------------------------------------------------------

    def hold_after_open(self, longest: float) -> None:
        """The circuit has just opened: hold what is bound for the outbox for up to `longest` s,
        until librdkafka has handed back what it held (module doc). A tracking send fence
        holds each key's behind its own first sends instead: it is armed, nothing more."""
        if self.fence.tracking:
            self.fence.arm()
            return
        self._purge_stragglers = True
        self.hold.start(longest, grace=STRAGGLER_GRACE)

    def hold_behind_probe(self, longest: float) -> None:
        """A keyed message went to Kafka as the half-open circuit's probe. Should it fail it is
        stored, so what is bound for the outbox meanwhile (its key's later messages among it)
        is held until librdkafka has reported it, for up to `longest` s. (A tracking send fence
        counts the probe, and holds its key's messages behind it.)"""
        if self.fence.tracking:
            return
        if not self.hold.active:
            self._purge_stragglers = False
        self.hold.start(longest)

    def tick(self) -> None:
        """Delivery thread, after each poll: end a hold-back whose time has come."""
        if self.hold.active:
            self.release_held()
        fence = self.fence
        if fence.active:
            self.backlog.forward_fenced(fence.overdue())
            if fence.overtaking or (self._circuit.state is CircuitState.OPEN and len(self._link)):
                # A send that entered librdkafka's queue after the last purge (a produce() that
                # saw the circuit closed, or the key not pending, an instant before) would
                # overtake an older held message of its key, or keep its key's held messages
                # here until message.timeout.ms: hand it back now.
                self._link.purge_again()
        elif fence.armed:
            # Nothing may be bound for the outbox any more: first sends stop being counted.
            self.backlog.disarm_fence(lambda: self._circuit.closed and not self.hold.active)

    def release_held(self, *, force: bool = False) -> None:
        """Delivery thread: store held messages in produce order once librdkafka returned the rest
        (`force`: at once, with every fenced key's, at close())."""
        if force:
            self.backlog.forward_fenced(self.fence.overdue(force=True))
        closed = self._circuit.closed
        in_grace = self.hold.in_grace()
        if not force and self._purge_stragglers and (not closed or in_grace):
            # Purge again: a produce() that saw the circuit closed just before it opened may have
            # queued a message after the first purge; without this it would hold everything
            # back until message.timeout.ms.
            self._link.purge_again()
        # Closed again (a drain delivery proved the cluster back): in fallback mode new sends
        # fill librdkafka, so "empty" may never come; what is still on the wire from before is
        # the README's window. Write-ahead mode sends nothing new while the hold lasts
        # (`outbox.producer.admission`), so it waits for "empty" (or the hold's time).
        empty = force or (closed and self._gate and not in_grace) or len(self._link) == 0
        self.backlog.release_hold(source_empty=empty)


#: Seconds after the circuit opens during which the hold-back lasts and what librdkafka's queue
#: holds is purged at each tick (every 50 ms), even if the circuit has closed again meanwhile, and
#: during which every message is stored (`outbox.producer.admission`). A produce() that saw the circuit
#: closed just before it opened puts its message in the queue after the opening's purge; when one
#: partition's failure opened the circuit, a drain delivery to the other partitions closes it
#: again within milliseconds, and without the grace the message stayed queued for the leaderless
#: partition, ahead of older messages of its key that the purge had sent to the outbox (10 keys
#: reordered in 1 of 20 runs of the window's schedule). Stored meanwhile, not sent, the messages
#: produced then cannot be caught in a purge while their keys' earlier ones are stored.
STRAGGLER_GRACE = 0.2


def _sequence(msg: NewMessage) -> str:
    # Ids are one generator's fixed-width prefix + hex counter: string order is produce order.
    return msg.msg_id
