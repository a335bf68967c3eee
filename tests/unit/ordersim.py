"""A deterministic simulator of per-key order on the fallback producer's way to Kafka.

The real `SendFence` (`outbox.producer.sendfence`) is driven through seeded random schedules by
a model of what surrounds it: the application's produce() calls, cut into the steps between
which another thread can run; librdkafka's partitions, which deliver in order, hand back
everything undelivered on a purge and report those failures in any order; the circuit; the key
backlog's pending keys; the writer and the outbox; and the drain, which sends a key's rows in
row order. No thread, clock or network: one schedule is a list of steps chosen by a seeded
`random.Random`, and the same seed replays the same schedule.

After every step the history is checked: the first copy of each message in the simulated topic
comes in produce order within its key. At the end of a schedule everything is let through
(circuit closed, every partition delivered, the outbox drained) and every accepted message must
be in the topic: nothing lost.

`Rules` names the model's parts that keep order, so a test can remove one and see a schedule
fail (a mutation check).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from outbox.budget import MemoryBudget
from outbox.producer.sendfence import SendFence
from outbox.records import NewMessage


@dataclass
class Rules:
    """The order-keeping rules the simulator can switch off, one at a time (mutation checks)."""

    #: produce() puts its report in flight before it reads `armed` (the fence's race rule).
    in_flight_before_armed: bool = True
    #: A message of a pending key is stored behind it (admission's HOLD route).
    hold_pending_keys: bool = True
    #: The circuit opens (librdkafka's queue handed back) when a send fails on its own while
    #: later sends of its key wait in librdkafka.
    trip_on_lone_failure: bool = True
    #: A key is released only when none of its messages is held or in the outbox.
    release_only_when_empty: bool = True
    #: The tick purges librdkafka's queue while a held message is older than a send of its key.
    purge_while_overtaking: bool = True
    #: A key with sends in librdkafka when it was asked to hand them back has its new messages
    #: stored until they are all reported (admission's STORE on `SendFence.handed_back`).
    store_keys_handed_back: bool = True
    #: A fast-path send armed under it, of a key with sends in librdkafka at the opening, has
    #: librdkafka's queue purged again (`Spill.straggled`).
    purge_stragglers: bool = True
    #: The fence stays armed until the failures a purge handed back are served (`SendFence.purged`).
    note_purges: bool = True


@dataclass
class Report:
    """A first send's delivery report, as `outbox.producer.firstsend._Report` is to the fence."""

    msg_id: str
    key: Any
    topic: str = "t"
    epoch: int = 0


@dataclass
class Sim:
    seed: int
    rules: Rules = field(default_factory=Rules)
    keys: int = 3
    partitions: int = 2

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.now = 0.0
        self.purges = 0
        self.fence = SendFence(
            tracking=True, budget=MemoryBudget(1 << 30), on_full=self._purge_soon, on_overtaken=self._purge_soon,
            clock=lambda: self.now, longest=1e9,
        )
        self.seq = 0
        self.produced: list[tuple[bytes, str]] = []
        self.queues: list[list[Report]] = [[] for _ in range(self.partitions)]  # undelivered, in send order
        self.failed: list[Report] = []  # handed back, their failure reports not yet served
        self.pending: set[bytes] = set()
        self.writer: list[NewMessage] = []  # queued for the outbox, not yet committed
        self.store: list[NewMessage] = []  # committed rows, in row order
        self.topic: list[tuple[bytes, str]] = []
        self.first: dict[str, int] = {}  # msg_id -> its first copy's place in the topic
        self.circuit_open = False
        self.purge_asked = False
        self.threads: list[list[Callable[[], None]]] = []  # produce() calls cut into steps
        self._key_names = [b"k%d" % k for k in range(self.keys)]
        self._producing: set[bytes] = set()  # keys with a produce() call under way
        self._checked = 0  # the topic's entries checked so far
        self._last: dict[bytes, str] = {}  # key -> the latest id of its first copies checked

    # -- librdkafka ---------------------------------------------------------------------------

    def _partition(self, key: bytes) -> int:
        return int(key[1:]) % self.partitions

    def _purge_soon(self) -> None:
        """`KafkaLink.purge_queue_soon`: the delivery thread purges at its next tick."""
        self.purge_asked = True

    def _purge(self) -> None:
        """Everything undelivered comes back as failures, reported later in any order."""
        self.purges += 1
        for q in self.queues:
            self.failed += q
            q.clear()
        if self.rules.note_purges:
            self.fence.purged()

    def _deliver(self, p: int) -> None:
        report = self.queues[p].pop(0)
        self._to_topic(report.key, report.msg_id)
        self._reported(report, failed=False)

    def _reported(self, report: Report, *, failed: bool) -> None:
        """The delivery thread serves a report (`_Report.__call__`)."""
        self.fence.inflight.pop(report.msg_id, None)
        if failed:
            row = NewMessage("t", b"", report.key, [], -1, report.msg_id)
            self._queue(row)
            if (
                self.rules.trip_on_lone_failure and not self.circuit_open
                and self.fence.others_sending(report)  # type: ignore[arg-type]
            ):
                self._open()
        if self.fence.armed:
            self.writer += [m for m, _, _ in self.fence.reported(report)]  # type: ignore[arg-type]

    # -- the producer's shell -----------------------------------------------------------------

    def _queue(self, row: NewMessage) -> None:
        """`KeyBacklog.queue`: the key is pending, the row held behind its key's sends or queued."""
        self.pending.add(row.key)  # type: ignore[arg-type]
        if not self.fence.hold(row, None, 1):
            self.writer.append(row)

    def _open(self) -> None:
        self.circuit_open = True
        self.fence.arm()
        self._purge()

    def _produce(self, key: bytes) -> None:
        """Start a produce() call: an id, then the steps it takes, each a chance for others to run."""
        self.seq += 1
        msg_id = f"{self.seq:016x}"
        self.produced.append((key, msg_id))
        report = Report(msg_id, key)
        state: dict[str, Any] = {}

        def fast() -> None:
            if self.rules.in_flight_before_armed:
                self.fence.inflight[msg_id] = report  # type: ignore[assignment]
            state["armed"] = self.fence.armed

        def decide() -> None:
            if not self.rules.in_flight_before_armed and not state["armed"]:
                self.fence.inflight[msg_id] = report  # type: ignore[assignment]
            if not state["armed"]:
                state["route"] = "send"
                return
            self.fence.inflight.pop(msg_id, None)
            if self.fence.armed:
                self.writer += [m for m, _, _ in self.fence.reported(report)]  # type: ignore[arg-type]
            behind = (self.rules.hold_pending_keys and key in self.pending) or (
                self.rules.store_keys_handed_back and ("t", key) in self.fence.handed_back
            )
            state["route"] = "store" if behind or self.circuit_open else "send"
            if state["route"] == "send":
                self.fence.inflight[msg_id] = report  # type: ignore[assignment]
                if self.fence.armed:
                    state["purges"] = self.fence.purges
                    self.fence.count(report)  # type: ignore[arg-type]

        def act() -> None:
            if state["route"] == "send":
                self.queues[self._partition(key)].append(report)
                straggled = not state["armed"] or self.fence.purges != state.get("purges", -1)
                if self.rules.purge_stragglers and report.epoch and straggled and (
                    ("t", key) in self.fence.handed_back
                ):
                    self.purge_asked = True  # `Spill.straggled`
            else:
                self._queue(NewMessage("t", b"", key, [], -1, msg_id))

        def done() -> None:
            self._producing.discard(key)

        self._producing.add(key)
        self.threads.append([fast, decide, act, done])

    def _commit(self) -> None:
        self.store += self.writer
        self.writer.clear()

    def _drain(self, key: bytes) -> None:
        """The drain sends a key's oldest row (row order per key)."""
        for i, row in enumerate(self.store):
            if row.key == key:
                del self.store[i]
                self._to_topic(key, row.msg_id)
                return

    def _release(self, key: bytes) -> None:
        """`KeyBacklog.release_delivered` for one key."""
        if key not in self.pending:
            return
        if self.rules.release_only_when_empty and (
            self.fence.active or self.writer or any(r.key == key for r in self.store)
        ):
            return
        self.pending.discard(key)

    def _tick(self) -> None:
        """The delivery thread's tick (`Spill.tick`): purges asked for, overdue fences, and the
        disarm once nothing may be bound for the outbox."""
        if self.purge_asked:
            self.purge_asked = False
            self._purge()
        if self.fence.active:
            self.writer += [m for m, _, _ in self.fence.overdue()]
            if self.rules.purge_while_overtaking and (
                self.fence.overtaking or (self.circuit_open and any(self.queues))
            ):
                self._purge()
        elif self.fence.armed and not self.pending:
            self.fence.disarm(lambda: not self.circuit_open)

    def _to_topic(self, key: bytes, msg_id: str) -> None:
        self.topic.append((key, msg_id))
        if msg_id not in self.first:
            self.first[msg_id] = len(self.topic) - 1

    # -- a schedule ---------------------------------------------------------------------------

    def step(self) -> None:
        rng = self.rng
        # Order is promised between produce() calls that do not overlap: at most one call per key
        # is under way at a time (calls of different keys interleave freely).
        free = [k for k in self._key_names if k not in self._producing]
        choices: list[Callable[[], None]] = [lambda: self._produce(rng.choice(free))] * 4 if free else []
        if self.threads:
            choices += [self._run_thread] * 6
        # librdkafka's linger outlasts the delivery thread's reaction: a purge asked for is done
        # before what is queued goes on the wire (what is on the wire then is the documented
        # window, outside this model).
        may_send = not self.circuit_open and not self.purge_asked
        for p, q in enumerate(self.queues):
            if q and may_send:
                choices += [lambda p=p: self._deliver(p)] * 2  # type: ignore[misc]
        if self.failed:
            choices += [self._serve_failure] * 3
        undelivered = [r for q in self.queues for r in q]
        if undelivered and not self.circuit_open:
            choices.append(lambda: self._lone_failure(rng.choice(undelivered)))
        choices.append(self._open if not self.circuit_open else self._close)
        choices += [self._commit, self._tick]
        if self.store and not self.circuit_open:
            choices += [lambda: self._drain(rng.choice(self.store).key)] * 2  # type: ignore[arg-type]
        if self.pending:
            choices.append(lambda: self._release(rng.choice(sorted(self.pending))))
        rng.choice(choices)()
        self.check_order()

    def _run_thread(self) -> None:
        t = self.rng.choice(self.threads)
        t.pop(0)()
        if not t:
            self.threads.remove(t)

    def _serve_failure(self) -> None:
        report = self.failed.pop(self.rng.randrange(len(self.failed)))
        self._reported(report, failed=True)

    def _lone_failure(self, report: Report) -> None:
        """One message fails on its own (its partition leaderless past message.timeout.ms)."""
        for q in self.queues:
            if report in q:
                q.remove(report)
        self._reported(report, failed=True)

    def _close(self) -> None:
        self.circuit_open = False

    def check_order(self) -> None:
        """The first copies of each key's messages are in produce order (ids count up)."""
        for place in range(self._checked, len(self.topic)):
            key, msg_id = self.topic[place]
            if self.first[msg_id] != place:
                continue  # a later copy of a message already there
            prev = self._last.get(key, "")
            if msg_id < prev:
                raise AssertionError(f"seed {self.seed}: key {key!r}: {msg_id} reached Kafka after {prev}")
            self._last[key] = msg_id
        self._checked = len(self.topic)

    def settle(self) -> None:
        """Let everything through, then check that nothing accepted was lost."""
        self.circuit_open = False
        for _ in range(10_000):
            if self.threads:
                self._run_thread()
            elif self.failed:
                self._serve_failure()
            elif self.purge_asked:
                self._tick()
            elif any(self.queues):
                self._deliver(next(p for p, q in enumerate(self.queues) if q))
            elif self.writer or self.fence.active:
                self._commit()
                self.writer += [m for m, _, _ in self.fence.overdue(force=True)]
            elif self.store:
                self._drain(self.store[0].key)  # type: ignore[arg-type]
            else:
                break
            self.check_order()
        lost = {m for _, m in self.produced} - set(self.first)
        if lost:
            raise AssertionError(f"seed {self.seed}: {len(lost)} lost, e.g. {sorted(lost)[:3]}")


def run(seed: int, steps: int, rules: Rules | None = None) -> Sim:
    sim = Sim(seed, rules or Rules())
    for _ in range(steps):
        sim.step()
    sim.settle()
    return sim
