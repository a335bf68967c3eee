"""Keys with messages in the outbox: a producer sends their later messages behind them.

Once a key has a message bound for the outbox, the producer stores that key's later messages
too, so one key's messages leave in the order `produce()` took them (README, "Order per key").
`KeyBacklog` is that set of keys: the producer asks `in`, marks a key for every message it sends
to the outbox, and a thread of its own (`outbox-keys`) releases the keys whose rows are all
delivered, by this process or by anyone else. It is the one place keys are released.

A key whose application keeps producing is never found without rows: its next message is stored
before the drain has delivered the last one (in the recovery benchmark a key's next message
comes sooner than a drain round ends), so after an outage every message of every key went
through the outbox until the traffic stopped (the recovery benchmark: every key waiting, no
first-try delivery, for minutes after the restart). So the thread also *hands keys back*:
for at most `GATE_SECONDS` it holds their new messages in memory (the gate) while it waits for
their stored rows to be delivered; a key whose rows are all gone is released and its held
messages are sent, in order, ahead of anything produced later; a key whose rows outlast the gate
gets its held messages queued for the outbox behind them, as they would have been anyway.
The gate's messages count against the producer's memory budget (`outbox.budget`): once it is
full, a key's next message ends that key's gate, and the producer ends every gate
(`store_gated`) rather than wait for them, so a gate never makes `produce()` wait.

`KeyBacklog` is also the one owner of the lock that keeps per-key order, and every step taken
under it is a method here: marking a key and queueing its message (to the send fence, the
hold-back or the writer), holding a gated key's message, and moving held messages on to the
writer. A check of the store must never see a key marked while its message is in none of them.

Two more holds keep a message bound for the outbox in memory, both filled only under the
backlog's lock (each keeps its own small lock for the delivery thread's reads).

*The hold-back* (`Holdback`), where the send fence counts nothing (`delivery.report.only.error`
hides successes; write-ahead mode's sends are the writer's): elsewhere the send fence keeps this
order per key, exactly (below). When the circuit opens, librdkafka still holds messages produced
while it was closed. They come back as failures (purged at once, or at `message.timeout.ms` if
on the wire) and are stored then. A message of the same key spilled in between would get an
earlier row, and the drain would send it first: per-key order lost. So from the moment the
circuit opens, every message bound for the outbox is held here, in memory, until librdkafka has
handed back everything it held (or until `message.timeout.ms` has passed, by which time it has
reported every one of them); then the held messages are stored sorted by their producer sequence
(the `outbox-id` counter), which is the order the application produced them in.

The time is a bound, not a proof: librdkafka reports a timed-out message up to a second after
its timeout (it scans for them once a second) and one on the wire after its request's own
timeout. So a hold whose time ran out while librdkafka still holds messages is not released
then: the owner is asked to purge what is in flight (a purge reports at once), and the hold
waits once more as long, then ends whatever is left.

Memory stays bounded: the held messages count against the producer's memory budget
(`outbox.budget`, bytes). Once it is full the owner is asked to purge what is in flight, which
ends the hold at librdkafka's next poll, and the application's produce() waits for room (it is
spilling anyway) until the released messages are committed.

*The send fence* (`outbox.producer.sendfence.SendFence`) holds a key's outbox-bound messages
while librdkafka still holds first sends of that key, the circuit's opening included.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

from outbox.budget import MemoryBudget
from outbox.errors import StoreError
from outbox.lockorder import new_lock, new_rlock
from outbox.message import DeliveryCallback, message_cost
from outbox.producer.sendfence import Fenced, SendFence
from outbox.records import Key, NewMessage
from outbox.stores import Outbox
from outbox.tally import Tally

log = logging.getLogger("outbox")

RELEASE_EVERY = 0.25  # least seconds between two checks for keys whose outbox backlog is gone
WATCH_EVERY = 1.0  # most seconds between two checks (rows drained by another process)
GATE_SECONDS = 1.0  # longest a gate holds a key's new messages in memory
# After a gate that released no key (the drain is far from the keys' last rows), the next one
# waits this long, doubled each time up to GATE_PAUSE_MAX, so a deep backlog is not gated in vain.
GATE_PAUSE = 1.0
GATE_PAUSE_MAX = 8.0

#: A message bound for the outbox with its `on_delivery`, as a gate holds it.
HeldMessage = tuple[NewMessage, DeliveryCallback | None]
Held = list[HeldMessage]  # a gated key's held messages, in produce order
T = TypeVar("T")


class Holdback(Generic[T]):
    """Items held while `active`, released in `seq` order.

    Args:
        seq: the sort key of an item (its producer sequence).
        budget: the memory budget the held items count against (this is one of its parts).
        on_full: called (once per hold) when the budget is full, e.g. to purge in-flight sends.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        seq: Callable[[T], str],
        *,
        budget: MemoryBudget,
        on_full: Callable[[], None] | None = None,
        clock: Callable[[], float],
    ) -> None:
        self._seq = seq
        self._budget = budget
        self._on_full = on_full
        self._clock = clock
        self._lock = new_lock("hold-back")
        self._items: list[T] = []
        self.held_bytes = 0  # what the held items cost (under the lock; outbox.budget)
        self._until = 0.0
        self._longest = 0.0
        self._asked_purge = False
        self._overdue = False  # the hold's time ran out once with the source not empty
        self.active = False  # a plain attribute: produce()'s check is one attribute read
        self._grace_until = 0.0
        self.holds = 0  # how many holds began (stats, tests)
        budget.add_part(self)

    def start(self, longest: float, *, grace: float = 0.0) -> None:
        """Begin holding (or extend a hold) for at most `longest` seconds, the first `grace`
        of them whatever the source says (`in_grace`)."""
        with self._lock:
            if not self.active:
                self.holds += 1
                self._asked_purge = False
                self._overdue = False
            self._longest = longest
            now = self._clock()
            self._until = max(self._until, now + longest)
            self._grace_until = max(self._grace_until, now + grace)
            self.active = True

    def in_grace(self) -> bool:
        """Within the first `grace` seconds of the hold: it lasts, and nothing bypasses it."""
        return self.active and self._clock() < self._grace_until

    def offer(self, item: T, cost: int) -> bool:
        """Hold `item` (costing `cost` bytes) and return True, or return False when no hold is active.

        Never waits (the delivery thread offers what librdkafka hands back).
        """
        with self._lock:
            if not self.active:
                return False
            if self._budget.full(cost):
                self._budget_full()
            self._items.append(item)
            self.held_bytes += cost
            return True

    def budget_full(self) -> None:
        """The memory budget has no room: end the hold sooner (an application thread about to wait)."""
        if self.active:
            with self._lock:
                self._budget_full()

    def _budget_full(self) -> None:
        """Under the lock: ask the owner, once per hold, to purge what is in flight."""
        if self.active and not self._asked_purge and self._on_full is not None:
            self._asked_purge = True
            self._on_full()

    def release(self, *, source_empty: bool) -> list[T]:
        """End the hold if the source holds nothing older or the hold ran out; items in seq order.

        The first time the hold runs out with the source not empty, it asks for a purge and
        runs once more as long (module doc). Returns [] while the hold goes on (or when none
        is active).
        """
        if not self.active:
            return []
        with self._lock:
            if not source_empty:
                now = self._clock()
                if now < self._until:
                    return []
                if not self._overdue:
                    self._overdue = True
                    self._until = now + self._longest
                    if self._on_full is not None:
                        self._on_full()
                    return []
            self._budget.sample()  # the most held is reached just before a decrease
            items, self._items = self._items, []
            self.held_bytes = 0  # the caller hands them to the writer, which counts them again
            self.active = False
        items.sort(key=self._seq)
        return items

    def __len__(self) -> int:
        return len(self._items)


class Writer(Protocol):
    """What the backlog needs of the group-commit writer (`outbox.producer.writer`)."""

    def add_new(self, msg: NewMessage, meta: Any = None, *, cost: int = 0) -> Any: ...

    def flush(self) -> object: ...


class KeyBacklog:
    """The (topic, key) pairs whose new messages must queue behind the outbox.

    Args:
        store: the outbox; read for every key with a pending row at start-up (rows an earlier
            process left) and for which keys still have rows.
        writer: where marked messages are queued; flushed so that a check sees them.
        hold: the hold-back: from the circuit's opening, what is bound for the outbox waits
            here until librdkafka has handed back what it held (no key is released meanwhile).
        fence: keys with first sends in librdkafka, behind which their outbox-bound messages
            wait (no key is released while it holds any).
        waiting: where a stored message's `on_delivery` waits for its fate (`outbox.producer.storedcallbacks`).
        may_check: whether a check is worth its query now (the producer: circuit not open).
        budget: the memory budget the held messages count against (the gate is one of its
            parts); None: the gate holds without a bound (tests of its logic).
    """

    def __init__(
        self,
        store: Outbox,
        writer: Writer,
        hold: Holdback[NewMessage],
        fence: SendFence,
        *,
        waiting: dict[str, DeliveryCallback],
        may_check: Callable[[], bool],
        budget: MemoryBudget | None = None,
    ) -> None:
        self._lock = new_rlock("key backlog")
        self._budget = budget
        self._store = store
        self._writer = writer
        self._hold = hold
        self._fence = fence
        self._waiting = waiting
        # Messages this process queued for the outbox or handed to the drain: counted by the
        # application's threads, the delivery thread (failed first sends) and the writer thread.
        self.outboxed = Tally()
        self._may_check = may_check
        self._send: Callable[[Key, Held], None] | None = None
        #: The keys; read without the lock on the hot path (a set lookup is atomic under the GIL).
        self.pending: set[Key] = set()
        #: Keys being handed back to the fast path, with the messages held meanwhile.
        self.gated: dict[Key, Held] = {}
        self.held = 0  # messages in `gated`
        self.held_bytes = 0  # what they cost (under the lock; outbox.budget)
        self._gated_bytes: dict[Key, int] = {}  # the same, per gated key
        self._gate_pause = 0.0
        self._next_gate = 0.0
        # Mark number of each key's latest message bound for the outbox: a check looks at the
        # store without the lock and keeps a key that was marked since it looked.
        self._mark = 0
        self._marks: dict[Key, int] = {}
        self._loaded = self._load(report=True)
        self._stop = threading.Event()
        self._drained = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="outbox-keys", daemon=True)
        if budget is not None:
            budget.add_part(self)

    def start(self, send: Callable[[Key, Held], None] | None) -> None:
        """Start the `outbox-keys` thread, which calls `send` under the lock with a released
        key's held messages: send them now, ahead of the key's later messages. None: no gate
        (write-ahead mode: every message is stored)."""
        self._send = send
        self._thread.start()

    def add(self, key: Key) -> None:
        """`key` has a row in the store already (a write-ahead row that failed)."""
        with self._lock:
            self._fence.arm()  # before the key is pending: produce() asks admission from here on
            self.pending.add(key)

    def disarm_fence(self, idle: Callable[[], bool]) -> None:
        """Stop counting first sends if no key is pending or gated and `idle()` (asked under the
        fence's lock, which arming takes too: the circuit has not opened meanwhile)."""
        with self._lock:
            if not self.pending and not self.gated:
                self._fence.disarm(idle)

    # -- the ways in: each marks the key and queues its message in one step -------------------

    def queue(self, msg: NewMessage, cb: DeliveryCallback | None, cost: int = 0) -> None:
        """Count `msg` as bound for the outbox and queue it: behind its key's first sends still
        in librdkafka, in the hold-back, or for the writer. `cost`: its `message_cost`, if the
        caller has it (0: computed here)."""
        if msg.key is None:  # no key, no order to keep: no lock
            self._queue(msg, cb, cost)
            return
        with self._lock:
            self._queue(msg, cb, cost)

    def queue_behind_key(self, msg: NewMessage, cb: DeliveryCallback | None, cost: int) -> bool:
        """A keyed message admitted as waiting behind its key: queue it (or hold it, if the key is
        gated) and return True; False if the key was released since it was admitted."""
        assert msg.key is not None
        key = (msg.topic, msg.key)
        with self._lock:
            if key not in self.pending:
                return False
            if not self._hold_gated(key, (msg, cb), cost):
                self._queue(msg, cb, cost)
            return True

    def queue_held(self, held: Held) -> None:
        """Messages a gate held (or that could not be sent after it), queued in order."""
        with self._lock:
            for msg, cb in held:
                self._queue(msg, cb, 0)

    def queue_stored(self, msg: NewMessage, cb: DeliveryCallback | None) -> Any:
        """Write-ahead: a row stored for the drain workers, never held back; returns the writer's batch."""
        with self._lock:
            self._note(msg, cb)
            return self._writer.add_new(msg)

    def forward_fenced(self, held: list[Fenced]) -> None:
        """Messages that waited behind their key's first sends go on to the writer, in order."""
        if held:
            with self._lock:  # a check must see them either held or in the writer
                for msg, _, cost in held:
                    self._to_writer(msg, cost)

    def release_hold(self, *, source_empty: bool) -> None:
        """The hold-back's messages go to the writer in produce order, if its time has come."""
        with self._lock:  # a check must see these either held or in the writer
            for msg in self._hold.release(source_empty=source_empty):
                self._writer.add_new(msg)

    def _note(self, msg: NewMessage, cb: DeliveryCallback | None) -> None:
        """Under the lock if keyed: count a message bound for the outbox and mark its key."""
        if msg.key is not None:
            self.pending.add((msg.topic, msg.key))
            self._mark += 1
            self._marks[(msg.topic, msg.key)] = self._mark
        if cb is not None:
            self._waiting[msg.msg_id] = cb
        self.outboxed.add()

    def _queue(self, msg: NewMessage, cb: DeliveryCallback | None, cost: int) -> None:
        self._note(msg, cb)
        if not cost:
            cost = message_cost(msg)
        if msg.key is not None and self._fence.hold(msg, cb, cost):
            return
        self._to_writer(msg, cost)

    def _to_writer(self, msg: NewMessage, cost: int) -> None:
        if not (self._hold.active and self._hold.offer(msg, cost)):
            self._writer.add_new(msg, cost=cost)

    def _holding(self) -> bool:
        """Are messages bound for the outbox held in memory (in neither the writer nor the store)?"""
        return self._hold.active or self._fence.active

    def _hold_gated(self, key: Key, message: HeldMessage, cost: int) -> bool:
        """Under the lock: keep `message` (costing `cost` bytes) in memory if its key is gated
        (True), else False.

        With the memory budget full the key's gate ends here: its held messages go to the
        outbox first and False tells the caller to queue this one behind them.
        """
        held = self.gated.get(key)
        if held is None:
            return False
        if self._budget is None or not self._budget.full(cost):
            held.append(message)
            self.held += 1
            self.held_bytes += cost
            self._gated_bytes[key] = self._gated_bytes.get(key, 0) + cost
            return True
        self._end_gate(key, released=False)
        return False

    def store_gated(self) -> None:
        """End every gate, queueing what it held for the outbox: the memory budget is full, and
        the writer can make room by committing, where a gate would keep it until it ends."""
        with self._lock:
            for k in list(self.gated):
                self._end_gate(k, released=False)

    def drained(self, keys: Iterable[Key]) -> None:
        """A drain delivered or dead-lettered rows of these keys: check soon if one is pending."""
        if any(k in self.pending for k in keys):
            self._drained.set()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._drained.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def release_delivered(self, candidates: set[Key]) -> set[Key]:
        """Release the candidates with no row left in the store and no message marked since.

        Returns the candidates that still have rows (all of them while messages are held back).
        """
        with self._lock:
            if self._holding():  # held messages are in neither the writer nor the store yet
                return candidates
            seen = self._mark  # every message marked up to here is already in the writer
        # Not under the lock: produce() needs it for every message of a pending key, and the
        # commit and the query take milliseconds (holding it stalled the application).
        self._writer.flush()  # rows queued up to `seen` are committed: the query sees them
        still = self._store.keys_with_pending(sorted(candidates))
        with self._lock:
            for k in candidates - still:
                if self._marks.get(k, 0) <= seen:  # nothing bound for the outbox since we looked
                    self.pending.discard(k)
                    self._marks.pop(k, None)
        return still

    def hand_back(self, keys: set[Key], *, clock: Callable[[], float] = time.monotonic) -> int:
        """Gate `keys` and release those whose stored rows are delivered within `GATE_SECONDS`.

        Returns how many keys were released. Every gate has ended when it returns.
        """
        with self._lock:
            if self._send is None or self._holding():
                return 0
            for k in keys:
                if k in self.pending:
                    self.gated[k] = []
            # From here no message of a gated key is marked (produce() holds it), except a failed
            # first send stored by the delivery thread: the mark check below keeps that key.
            seen = self._mark
        released = 0
        try:
            self._writer.flush()  # every message of these keys marked so far is in the store
            deadline = clock() + GATE_SECONDS
            with self._lock:  # produce() may end a gate (memory budget) meanwhile
                left = set(self.gated)
            while left:
                still = self._store.keys_with_pending(sorted(left))
                with self._lock:
                    for k in left - still:
                        if k in self.gated:
                            ok = self._marks.get(k, 0) <= seen and not self._holding()
                            released += self._end_gate(k, released=ok)
                left = still & set(self.gated)
                if not left or clock() >= deadline or self._stop.is_set() or self._holding():
                    break
                self._drained.wait(0.05)  # a drain delivery of a pending key wakes it early
                self._drained.clear()
        finally:
            with self._lock:
                for k in list(self.gated):
                    self._end_gate(k, released=False)
        return released

    def _end_gate(self, key: Key, *, released: bool) -> bool:
        """Under `lock`: end `key`'s gate, releasing the key and sending its held messages, or
        keeping it pending and queueing them for the outbox behind its rows. True: released."""
        held = self.gated.pop(key)
        if self._budget is not None:
            self._budget.sample()  # the most held is reached just before a decrease
        self.held -= len(held)
        # From here they count in the writer (queued for the outbox below) or are librdkafka's.
        self.held_bytes -= self._gated_bytes.pop(key, 0)
        if released:
            # Sent while the key is still pending: a produce() of it on another thread waits for
            # this lock and so comes after them.
            mark = self._marks.get(key, 0)
            if held:
                assert self._send is not None
                self._send(key, held)
            if self._marks.get(key, 0) == mark:  # none of them went to the outbox instead
                self.pending.discard(key)
                self._marks.pop(key, None)
                return True
        elif held:
            self.queue_held(held)
        return False

    def _gate(self, keys: set[Key]) -> None:
        """Hand keys back, pausing longer after each gate that released none."""
        if self.hand_back(keys):
            self._gate_pause = 0.0
        else:
            self._gate_pause = min(max(GATE_PAUSE, 2 * self._gate_pause), GATE_PAUSE_MAX)
        self._next_gate = time.monotonic() + self._gate_pause

    def _load(self, *, report: bool) -> bool:
        """Add every key with a PENDING row in the store (one pass over the pending rows).

        At start-up, and again by the thread if the store could not answer then: until it does,
        a key's new messages may overtake rows an earlier process left (logged once).
        """
        try:
            keys = self._store.pending_keys()
        except StoreError as exc:
            if report:
                log.warning(
                    "outbox: cannot read which keys have messages in the outbox (retrying); until then "
                    "new messages of those keys may overtake them: %s", exc,
                )
            return False
        with self._lock:
            if keys:
                self._fence.arm()  # their new messages are routed behind them
            self.pending |= keys
        return True

    def _watch(self) -> None:
        """Release keys whose backlog is delivered (the `outbox-keys` thread).

        Woken early when this process's drain delivers a pending key's row, and at least every
        `WATCH_EVERY` seconds for rows delivered by anyone else (`outbox drain`, a sidecar with
        `drain_workers=0`, another producer of a PostgreSQL fleet). The drain workers never wait
        for a check: it flushes the writer first, and a drain worker that waited for the writer's
        commit spent nearly a fifth of its time there (a recovery profile).
        """
        failing = False
        rest = RELEASE_EVERY
        while not self._stop.wait(rest):  # at least `rest` between two checks
            self._drained.wait(WATCH_EVERY - rest)
            self._drained.clear()
            if self._stop.is_set():
                return
            if not self._loaded:
                self._loaded = self._load(report=False)
            if not self.pending or not self._may_check():
                continue
            try:
                started = time.monotonic()
                with self._lock:
                    keys = set(self.pending)
                still = self.release_delivered(keys)
                # At most a tenth of a thread's time: with very many keys one check takes long.
                rest = max(RELEASE_EVERY, 10 * (time.monotonic() - started))
                if still and self._send is not None and time.monotonic() >= self._next_gate:
                    self._gate(still)
                failing = False
            except StoreError as exc:  # looked at again next round; logged once per failing spell
                if not failing:
                    log.warning("outbox: cannot check which keys still have messages in the outbox: %s", exc)
                failing = True
            except Exception:  # never die silently: the next round tries again
                log.exception("outbox key watcher failed; retrying")
