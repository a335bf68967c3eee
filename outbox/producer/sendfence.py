"""SendFence: a key's messages bound for the outbox wait behind its first sends in librdkafka.

The drain re-sends stored messages with producers of its own. A message stored while older
messages of its key are still in the fast path's producer (one partition's leader is gone for a
few seconds while the others take messages, say) could be drained before librdkafka delivers
them, and a key's messages would reach Kafka out of order. Nor do librdkafka's reports of one
key come in produce order once some are handed back: a purge reports what waits in the queue at
once, and what is on the wire only when its request ends. So while librdkafka holds any first
send of a key, every message of that key bound for the outbox is held here, in memory. When
librdkafka has reported the last of them (delivered, or failed and so held here too), the held
messages are handed on sorted by the `outbox-id` counter, which is produce order.

This is also what keeps order when the circuit opens: librdkafka hands back what it held (purged
at once, or at `message.timeout.ms` if on the wire), and a message of the same key stored in
between waits here until the last of its key's first sends is back. A key that had first sends
in librdkafka when it was asked to hand them back (`handed_back`: the opening's purge, or any
other) has its new messages stored, not sent, until all of them are reported, even if the
circuit closed again meanwhile: the failures of those handed back may not be served yet, and a
new send would overtake them.

**Counted only when it can matter.** Nearly always nothing is bound for the outbox, and a count
per key of every first send (a lock and two dict updates per message on two threads) was a fifth
of produce()'s time on the keyed happy path. So the fence is *armed* only while something may be
bound for the outbox: a key has messages in the outbox (the key backlog), the circuit is not
closed, or messages are held here. While it is not armed a first send costs one dict entry (its
report in `inflight`, removed when librdkafka reports it) and one attribute read. Arming counts
every report in `inflight`, by key, and from then on every first send is counted as it is made.

The race between the two is closed by the order of two steps on each side (the interpreter lock
makes each step atomic): a first send puts its report in `inflight` and *then* reads `armed`;
arming sets `armed` and *then* reads `inflight`. A send that read `armed` false is in the
snapshot (or already reported); one that read it true takes the counted path. Disarming moves to
a new `epoch`, which voids every count: a report counts down only a send of the current epoch.

**A held message older than a send of its key still queued** (a produce() that saw the fence
unarmed an instant before the circuit opened, whose message entered librdkafka's queue after the
opening's purge) would be overtaken by it. The owner is asked to purge librdkafka's queue
(`on_overtaken`), and again at every tick until that send is reported (`overtaking`): it may
enter the queue after a purge, from a produce() still under way. It comes back failed and is held
behind the older one. What is already on the wire may still overtake it: the window in
docs/guarantees.md.

Knowing which keys librdkafka holds needs success reports: with `delivery.report.only.error` they
are not heard (`tracking` false), nothing is counted, nothing is held, and the hold-back
(`outbox.producer.keyorder.Holdback`) keeps order in the coarser way instead.

Bounds: held messages count against the memory budget; once it is full the owner is asked to
purge what librdkafka holds (`on_full`), whose reports end every fence. And a fence lasts at most
`longest` seconds (`message.timeout.ms` + 1 s: by then librdkafka has reported every message it
held), so a report that never comes cannot keep messages in memory for good.

Lock order: the key backlog's lock, then this one; nothing is called out of this module while it
is held but the budget's reads and the owner's two purge requests, which only set flags.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from outbox.budget import MemoryBudget
from outbox.lockorder import new_lock
from outbox.message import as_bytes
from outbox.records import Key, NewMessage

#: A message waiting behind its key's first sends: the row, its `on_delivery`, its cost in bytes.
Fenced = tuple[NewMessage, Any, int]


class SentReport(Protocol):
    """What the fence reads and marks on a first send's delivery report (`outbox.producer.firstsend`)."""

    msg_id: str
    topic: str
    key: Any  # as given to produce(): bytes, str or None
    epoch: int  # the epoch it was counted in; 0: never counted


def key_of(report: SentReport) -> Key:
    key = report.key
    return (report.topic, key if key.__class__ is bytes else as_bytes(key))  # type: ignore[return-value]


class SendFence:
    """First sends librdkafka holds, by key, and the outbox-bound messages that wait behind them.

    Args:
        tracking: whether success reports are heard (see the module doc); False: a no-op.
        budget: the memory budget the held messages count against (this is one of its parts).
        on_full: called when the budget is full while messages are held (purge librdkafka).
        on_overtaken: called when a held message is older than a send of its key that librdkafka
            may still have queued (purge librdkafka's queue).
        clock: monotonic seconds.
        longest: the most a fence lasts, in seconds.
    """

    def __init__(
        self,
        *,
        tracking: bool,
        budget: MemoryBudget,
        on_full: Callable[[], None],
        on_overtaken: Callable[[], None] = lambda: None,
        clock: Callable[[], float],
        longest: float,
    ) -> None:
        self.tracking = tracking
        self._on_full = on_full
        self._on_overtaken = on_overtaken
        self._clock = clock
        self._longest = longest
        self._lock = new_lock("send fence")
        #: Every first send's report until librdkafka reports it, by message id: written by the
        #: sending threads and the delivery thread without the lock (one dict operation each).
        self.inflight: dict[str, SentReport] = {}
        #: Whether first sends are counted (module doc); a plain attribute: one read per send.
        #: Untracked, always: every message then asks admission (no fast path without it).
        self.armed = not tracking
        self._epoch = 0
        self._sending: dict[Key, int] = {}  # key -> its counted first sends librdkafka holds
        self._youngest: dict[Key, str] = {}  # key -> the id of its latest counted first send
        self._latest = ""  # the id of the latest first send counted
        self._purged_up_to = ""  # `_latest` when librdkafka was last asked to hand messages back
        self._held: dict[Key, list[Fenced]] = {}
        self._since: dict[Key, float] = {}
        self._overtaking: set[Key] = set()  # keys with a held message older than a counted send
        #: Keys that had first sends in librdkafka when it was last asked to hand messages back,
        #: until it has reported them all: some may be handed back, their failures not yet
        #: served, so the key's new messages are stored behind them (`outbox.producer.admission`).
        self.handed_back: set[Key] = set()
        self.held_bytes = 0  # under the lock (outbox.budget)
        self._count = 0  # messages held, under the lock
        self.fences = 0  # fences begun (stats, tests)
        self.arms = 0  # times armed (stats, tests)
        self.purges = 0  # purges noted while armed (`purged`); a send compares it before and after
        self._budget = budget
        budget.add_part(self)

    @property
    def active(self) -> bool:
        """Whether any message is held (one attribute read: the key backlog asks it often)."""
        return bool(self._held)

    @property
    def overtaking(self) -> bool:
        """Whether a held message is older than a first send of its key that librdkafka has yet
        to report: until it has, the owner purges librdkafka's queue at every tick (the send
        may have entered the queue after the last purge)."""
        return bool(self._overtaking)

    def __len__(self) -> int:
        return self._count  # a plain read: no walk of a dict another thread may change

    # -- arming ------------------------------------------------------------------------------

    def arm(self) -> None:
        """Count first sends from now on, those librdkafka holds already included.

        Always under the lock, even when armed already: a `disarm` that found the circuit
        closed an instant before it opened has then either disarmed first (and this arms again)
        or not begun."""
        if not self.tracking:
            return
        with self._lock:
            self._arm()

    def _arm(self) -> None:
        if self.armed:
            return
        self._epoch += 1
        self.arms += 1
        self.armed = True  # before the snapshot (module doc)
        for report in list(self.inflight.values()):  # one C call: no send or report runs during it
            if report.key is not None:
                self._count_one(report)

    def purged(self) -> None:
        """librdkafka has been asked to hand back what it holds (delivery thread, after the call):
        until the failures it hands back are served, the fence stays armed, and the keys it held
        sends of store their new messages (`handed_back`)."""
        if not self.armed:
            return  # nothing counted: nothing handed back can be told from the rest (see `arm`)
        with self._lock:
            self.purges += 1
            self._purged_up_to = self._latest
            self.handed_back |= {k for k, n in self._sending.items() if n}

    def disarm(self, idle: Callable[[], bool]) -> bool:
        """Stop counting if nothing is held and `idle()`, asked under the lock: nothing else may be
        bound for the outbox (the owner's circuit is closed, say). Returns whether it is disarmed."""
        if not self.tracking:
            return False
        if not self.armed:
            return True
        with self._lock:
            if self._held or not idle():
                return False
            # A send handed back by a purge is in flight until its failure is served, which then
            # stores it: a key's new message sent unarmed meanwhile would overtake it. (A walk of
            # what is in flight, only on a tick that would disarm.)
            oldest = min(self.inflight, default=None)
            if oldest is not None and oldest <= self._purged_up_to:
                return False
            self.armed = False
            self._epoch += 1  # voids every count (module doc)
            self._sending.clear()
            self._youngest.clear()
            self.handed_back = set()
            return True

    # -- first sends (application threads, the delivery thread) ------------------------------

    def count(self, report: SentReport) -> None:
        """A keyed first send routed while armed, its report already in `inflight`: count it."""
        with self._lock:
            if self.armed and report.epoch != self._epoch:  # not counted by an arming meanwhile
                self._count_one(report)

    def _count_one(self, report: SentReport) -> None:
        """Under the lock: one more first send of the report's key librdkafka holds."""
        key = key_of(report)
        report.epoch = self._epoch
        self._sending[key] = self._sending.get(key, 0) + 1
        if report.msg_id > self._youngest.get(key, ""):
            self._youngest[key] = report.msg_id
        if report.msg_id > self._latest:
            self._latest = report.msg_id

    def reported(self, report: SentReport) -> list[Fenced]:
        """librdkafka reported a counted first send (delivery thread), or did not take it after all
        (the sending thread); its report is out of `inflight` already. If it was the last of its
        key librdkafka held, the key's held messages are returned, in produce order, to be queued."""
        with self._lock:
            if report.epoch != self._epoch or not self.armed:
                return []  # counted before a disarm: void
            report.epoch = 0
            key = key_of(report)
            left = self._sending.get(key)
            if left is None:  # its fence ended when overdue: no count is left to take down
                return []
            if left > 1:
                self._sending[key] = left - 1
                return []
            del self._sending[key]
            self._youngest.pop(key, None)
            self.handed_back.discard(key)
            return self._end(key)

    def others_sending(self, report: SentReport) -> bool:
        """Delivery thread, serving a failure report: does librdkafka hold other first sends of its key?"""
        with self._lock:
            if not self.armed or report.key is None:
                return False
            mine = 1 if report.epoch == self._epoch else 0  # counted until `reported`
            return self._sending.get(key_of(report), 0) > mine

    # -- messages bound for the outbox (under the key backlog's lock) -----------------------

    def hold(self, msg: NewMessage, cb: Any, cost: int) -> bool:
        """Hold a keyed message bound for the outbox while librdkafka holds a first send of its
        key (or messages of its key are held already). False: queue it now."""
        if not self.tracking or msg.key is None:
            return False
        key = (msg.topic, msg.key)
        with self._lock:
            self._arm()
            held = self._held.get(key)
            if held is None:
                if not self._sending.get(key):
                    return False
                held = self._held[key] = []
                self._since[key] = self._clock()
                self.fences += 1
            if msg.msg_id < self._youngest.get(key, ""):
                self._overtaking.add(key)
                self._on_overtaken()
            if self._budget.full(cost):
                self._on_full()
            held.append((msg, cb, cost))
            self.held_bytes += cost
            self._count += 1
            return True

    def overdue(self, *, force: bool = False) -> list[Fenced]:
        """Delivery thread: the messages of fences past `longest` (all, with `force`), in produce
        order per key."""
        if not self._held:
            return []
        now = self._clock()
        out: list[Fenced] = []
        with self._lock:
            for key in [k for k, t in self._since.items() if force or now - t >= self._longest]:
                self._sending.pop(key, None)
                self._youngest.pop(key, None)
                self.handed_back.discard(key)
                out += self._end(key)
        return out

    def _end(self, key: Key) -> list[Fenced]:
        """Under the lock: the key's held messages, sorted by produce order, and its fence ended."""
        held = self._held.pop(key, None)
        if held is None:
            return []
        del self._since[key]
        self._overtaking.discard(key)
        self._budget.sample()  # the most held is reached just before a decrease
        self.held_bytes -= sum(cost for _, _, cost in held)
        self._count -= len(held)
        held.sort(key=lambda h: h[0].msg_id)
        return held
