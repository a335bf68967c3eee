"""SendFence: a key's outbox-bound messages wait while librdkafka still holds first sends of it.

The drain re-sends stored messages with producers of its own. A message stored while the
circuit is closed (librdkafka's queue stayed full, or its key already waits in the outbox) can
have older messages of its key still in the fast path's producer: one partition's leader is
gone for a few seconds, say, while the others take messages. Stored at once, it could be
drained before librdkafka delivers them, and a key's messages would reach Kafka out of order.
Nor do librdkafka's reports of one key come in produce order once some are handed back: a purge
reports what waits in the queue at once, and what is on the wire only when its request ends.

So while librdkafka holds any first send of a key, every message of that key bound for the
outbox is held here, in memory. When librdkafka has reported the last of them (delivered, or
failed and so held here too), the held messages are handed on sorted by the `outbox-id` counter,
which is produce order.

Knowing which keys librdkafka holds needs success reports: with `delivery.report.only.error`
they are not heard, nothing is tracked and nothing is held (the window in docs/guarantees.md).

Bounds: held messages count against the memory budget; once it is full the owner is asked to
purge what librdkafka holds, whose reports end every fence. And a fence lasts at most
`longest` seconds (`message.timeout.ms` + 1 s: by then librdkafka has reported every message
it held), so a report that never comes cannot keep messages in memory for good.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from outbox.budget import MemoryBudget
from outbox.records import Key, NewMessage

#: A held message: the row, its `on_delivery`, its cost in bytes.
Held = tuple[NewMessage, Any, int]


class SendFence:
    """Keys with first sends in librdkafka, and the outbox-bound messages that wait behind them.

    Args:
        tracking: whether success reports are heard (see the module doc); False: a no-op.
        budget: the memory budget the held messages count against (this is one of its parts).
        on_full: called when the budget is full while messages are held (purge librdkafka).
        clock: monotonic seconds.
        longest: the most a fence lasts, in seconds.
    """

    def __init__(
        self,
        *,
        tracking: bool,
        budget: MemoryBudget,
        on_full: Callable[[], None],
        clock: Callable[[], float],
        longest: float,
    ) -> None:
        self.tracking = tracking
        self._on_full = on_full
        self._clock = clock
        self._longest = longest
        self._lock = threading.Lock()
        self._sending: dict[Key, int] = {}  # key -> its first sends librdkafka holds
        self._held: dict[Key, list[Held]] = {}
        self._since: dict[Key, float] = {}
        self.held_bytes = 0  # under the lock (outbox.budget)
        self._count = 0  # messages held, under the lock
        self.fences = 0  # fences begun (stats, tests)
        self._budget = budget
        budget.add_part(self)

    @property
    def active(self) -> bool:
        """Whether any message is held (one attribute read: the key backlog asks it often)."""
        return bool(self._held)

    def __len__(self) -> int:
        return self._count  # a plain read: no walk of a dict another thread may change

    # -- first sends (application threads, the delivery thread) ------------------------------

    def sending(self, key: Key) -> None:
        """Before librdkafka is given a message of `key`: one more first send of it held there."""
        with self._lock:
            self._sending[key] = self._sending.get(key, 0) + 1

    def reported(self, key: Key) -> list[Held]:
        """librdkafka reported a first send of `key` (delivery thread), or did not take it after
        all (the sending thread). If it was the last one it held, the key's held messages are
        returned, in produce order, to be queued."""
        with self._lock:
            left = self._sending.get(key, 0) - 1
            if left > 0:
                self._sending[key] = left
                return []
            self._sending.pop(key, None)
            return self._end(key)

    def others_sending(self, key: Key) -> bool:
        """Delivery thread, serving a report of `key`: does librdkafka hold other first sends of it?"""
        return self._sending.get(key, 0) > 1  # the reported one is counted until `reported`

    # -- messages bound for the outbox (under the key backlog's lock) -----------------------

    def hold(self, msg: NewMessage, cb: Any, cost: int) -> bool:
        """Hold a keyed message bound for the outbox while librdkafka holds a first send of its
        key (or messages of its key are held already). False: queue it now."""
        if not self.tracking or msg.key is None:
            return False
        key = (msg.topic, msg.key)
        with self._lock:
            held = self._held.get(key)
            if held is None:
                if not self._sending.get(key):
                    return False
                held = self._held[key] = []
                self._since[key] = self._clock()
                self.fences += 1
            if self._budget.full(cost):
                self._on_full()
            held.append((msg, cb, cost))
            self.held_bytes += cost
            self._count += 1
            return True

    def overdue(self, *, force: bool = False) -> list[Held]:
        """Delivery thread: the messages of fences past `longest` (all, with `force`), in produce
        order per key."""
        if not self._held:
            return []
        now = self._clock()
        out: list[Held] = []
        with self._lock:
            for key in [k for k, t in self._since.items() if force or now - t >= self._longest]:
                self._sending.pop(key, None)
                out += self._end(key)
        return out

    def _end(self, key: Key) -> list[Held]:
        """Under the lock: the key's held messages, sorted by produce order, and its fence ended."""
        held = self._held.pop(key, None)
        if held is None:
            return []
        del self._since[key]
        self._budget.sample()  # the most held is reached just before a decrease
        self.held_bytes -= sum(cost for _, _, cost in held)
        self._count -= len(held)
        held.sort(key=lambda h: h[0].msg_id)
        return held
