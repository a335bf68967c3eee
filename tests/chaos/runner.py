"""One run of a fault schedule: threads produce keyed messages through a `ResilientProducer` while
the schedule plays on a proxied cluster, then everything is delivered and the history checked."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from outbox import PRODUCER_DEFAULTS, DeadLetter, Listener, ResilientProducer
from outbox.events import Committed, Drained
from outbox.headers import ID_HEADER
from outbox.testing import KafkaCluster
from outbox.testing.history import History, Verdict
from outbox.testing.schedule import Fault, play

from ..waiting import wait_until

#: Distinct keys per producing thread (each thread has its own: a key's order is one thread's).
KEYS_PER_THREAD = 30
#: A message past this many bytes runs with a small memory budget, so queue-full waits happen.
LARGE = 4096
SMALL_BUDGET = 4 * 1024 * 1024


@dataclass(frozen=True)
class Setup:
    """The producer's configuration in one run."""

    mode: str = "fallback"  # or "write-ahead"
    drain_in: str = "threads"  # or "process"
    store: str = "sqlite"  # or "postgresql"
    size: int = 200  # value bytes
    threads: int = 3

    def __str__(self) -> str:
        return f"{self.mode}, drain in {self.drain_in}, {self.store}, {self.size} B, {self.threads} threads"


class Fates(Listener):
    """What the producer's events said of each message that left the happy path, by outbox-id:
    committed (born leased to the producer in write-ahead mode, or left to the drain), retried,
    delivered by a drain worker, dead. A lost message's fates say which path took it as sent."""

    def __init__(self) -> None:
        self.of: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def _add(self, msg_id: str, what: str) -> None:
        with self._lock:
            self.of.setdefault(msg_id, []).append(f"{what} at {time.monotonic():.3f}")

    def committed(self, batch: Committed) -> None:
        for m, leased in zip(batch.new, batch.leased, strict=True):
            self._add(m.msg_id, f"committed {'leased to the producer' if leased else 'for the drain'} ({m.last_error})")

    def delivered(self, rows: Sequence[Drained]) -> None:
        for r in rows:
            self._add(r.msg_id, f"delivered by the drain (attempt {r.attempts + 1})")

    def retried(self, rows: Sequence[Drained]) -> None:
        for r in rows:
            self._add(r.msg_id, "retried")

    def dead(self, letter: DeadLetter) -> None:
        self._add(letter.msg_id, f"dead ({letter.last_error})")

    def of_lost(self, lost: Sequence[str], most: int = 5) -> list[str]:
        return [f"lost {i}: {'; '.join(self.of.get(i, ['no event: sent on its first try']))}" for i in lost[:most]]


@dataclass
class Run:
    setup: Setup
    schedule: list[Fault]
    verdict: Verdict
    dead: int
    pending: int
    circuit_opens: int
    #: Why the circuit opened, each time (the reason its warning names).
    circuit_reasons: list[str]
    #: A plain `confluent_kafka.Producer` with the same settings beside it, under the same faults.
    raw: Verdict
    #: What the events said of the lost messages (`Fates.of_lost`).
    lost_fates: list[str] = field(default_factory=list)

    def line(self) -> str:
        return "\n".join([
            f"[{self.setup}] {len(self.schedule)} faults ({'; '.join(map(str, self.schedule)) or 'none'}): "
            f"{self.verdict.summary()}, {self.dead} dead, {self.pending} pending, "
            f"circuit opened {self.circuit_opens}x{self.why()}; raw producer beside it: {self.raw.summary()}",
            *self.lost_fates,
        ])

    def why(self) -> str:
        return f" ({'; '.join(self.circuit_reasons)})" if self.circuit_reasons else ""

    def record(self) -> dict[str, Any]:
        v = self.verdict
        return {
            "setup": asdict(self.setup),
            "schedule": [asdict(f) for f in self.schedule],
            "messages": v.accepted,
            "records": v.records,
            "lost": len(v.lost),
            "reordered_keys": len(v.reordered),
            "duplicates": v.duplicates,
            "without_id": v.without_id,
            "dead": self.dead,
            "pending": self.pending,
            "circuit_opens": self.circuit_opens,
            "circuit_reasons": self.circuit_reasons,
            "one_broker_at_a_time": one_broker_at_a_time(self.schedule),
            "raw_messages": self.raw.accepted,
            "raw_lost": len(self.raw.lost),
            "raw_reordered_keys": len(self.raw.reordered),
            "raw_duplicates": self.raw.duplicates,
            "lost_fates": self.lost_fates,
        }


def run(
    cluster: KafkaCluster,
    setup: Setup,
    schedule: list[Fault],
    *,
    store_url: str | None = None,
    replication: int = 3,
    settings: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
) -> Run:
    """Produce while `schedule` plays (and 1 s more, 2 s at least), deliver everything, check.

    A plain `confluent_kafka.Producer` with the same settings produces beside it, one thread at
    one thread's pace, to a topic of its own: its duplicates are what the schedule costs any
    idempotent librdkafka producer, the baseline of the wrapper's. `replication`: of both topics
    (with 1, a stopped broker leaves its partitions leaderless); `settings`: producer settings
    for both producers beside the bootstrap servers; `options`: more `ResilientProducer` arguments."""
    topic, raw_topic = (
        cluster.create_topic(
            f"chaos-{os.urandom(4).hex()}",
            partitions=6,
            replication_factor=replication,
            config={"min.insync.replicas": str(min(2, replication))},
        )
        for _ in range(2)
    )
    history, raw_history = History(), History()
    reasons = CircuitReasons()
    with reasons, tempfile.TemporaryDirectory() as tmp:
        url = store_url or f"sqlite:///{Path(tmp) / 'o.db'}"
        config = {"bootstrap.servers": cluster.bootstrap_servers, **(settings or {})}
        producer = ResilientProducer(
            # Default settings: the producer is idempotent by default, which per-key order needs
            # (docs/guarantees.md, "Order per key").
            config,
            outbox=url,
            mode=setup.mode,
            drain_in=setup.drain_in,
            memory_budget=SMALL_BUDGET if setup.size >= LARGE else 16 * 1024 * 1024,
            **(options or {}),
        )
        fates = Fates()
        producer.subscribe(fates)
        try:
            # The raw producer gets what the wrapper's own librdkafka producer runs with.
            raw = Producer({**PRODUCER_DEFAULTS, "enable.idempotence": True, **config})
            player = play(cluster, schedule)
            ends = max((f.at + f.seconds for f in schedule), default=0.0) + 1.0
            beside = threading.Thread(target=produce_raw_until, args=(raw, raw_topic, raw_history, setup, ends))
            beside.start()
            produce_until(producer, topic, history, setup, ends)
            beside.join()
            player.join()
            assert not player.errors, player.errors
            cluster.wait_until_healthy()
            delivered_everything(producer)
            stats = producer.stats()
            opens = producer.circuit.opened_count
        finally:
            producer.close()
    verdict = history.check(cluster.bootstrap_servers, topic)
    raw_verdict = raw_history.check(cluster.bootstrap_servers, raw_topic)
    # Hundreds of schedules share one cluster: a broker killed later recovers every partition it
    # holds before it serves (one restarted under load took over 90 s with some 1,100).
    for name in (topic, raw_topic):
        cluster.delete_topic(name)
    dead, pending = stats["dead"] or 0, stats["pending"] or 0
    return Run(setup, schedule, verdict, dead, pending, opens, reasons.seen, raw_verdict, fates.of_lost(verdict.lost))


class CircuitReasons(logging.Handler):
    """Collects the reason of each opening from the circuit's own warning, while in a `with`."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []
        self._logger = logging.getLogger("outbox.producer.circuit")

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith("circuit open") and record.args:
            self.seen.append(str(record.args[0]))

    def __enter__(self) -> CircuitReasons:
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)


def produce_until(producer: ResilientProducer, topic: str, history: History, setup: Setup, seconds: float) -> None:
    pad = b"x" * setup.size
    deadline = time.monotonic() + max(seconds, 2.0)

    def work(w: int) -> None:
        i = 0
        while time.monotonic() < deadline:
            key = b"w%d-k%d" % (w, i % KEYS_PER_THREAD)
            history.accepted(topic, key, producer.produce(topic, pad, key=key))
            i += 1
            time.sleep(0.0005)  # a steady stream through the whole schedule

    threads = [threading.Thread(target=work, args=(w,)) for w in range(setup.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def produce_raw_until(producer: Producer, topic: str, history: History, setup: Setup, seconds: float) -> None:
    """One thread's stream through a plain producer, as an application writes it: wait while the
    queue is full, give each message an id header; then wait for every report (a message that
    timed out is lost, which the verdict counts)."""
    pad = b"x" * setup.size
    deadline = time.monotonic() + max(seconds, 2.0)
    i = 0
    while time.monotonic() < deadline:
        key = b"raw-k%d" % (i % KEYS_PER_THREAD)
        msg_id = f"raw-{i}"
        while True:
            try:
                producer.produce(topic, pad, key=key, headers=[(ID_HEADER, msg_id)])
                break
            except BufferError:
                producer.poll(0.1)
        history.accepted(topic, key, msg_id)
        producer.poll(0)
        i += 1
        time.sleep(0.0005)
    if producer.flush(240):
        raise AssertionError(f"the raw producer still holds {len(producer)} messages after 240 s")


def delivered_everything(producer: ResilientProducer) -> None:
    def done() -> bool:
        producer.flush(2)
        stats = producer.stats()
        return len(producer) == 0 and stats["pending"] == 0 and stats["in_memory"] == 0

    wait_until(done, 240, "every accepted message delivered and the outbox empty")


def report(run_: Run, *, window: bool = False) -> None:
    """Append the run to `$CHAOS_REPORT` (JSON lines), if set, and print its line. `window`: a
    schedule aimed at the window docs/guarantees.md leaves open, counted apart."""
    print(run_.line())
    path = os.environ.get("CHAOS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({**run_.record(), "window": window}) + "\n")


def one_broker_at_a_time(schedule: list[Fault]) -> bool:
    """Whether at most one broker is faulted at any moment (replication 3: the cluster can take
    every write, so the circuit has no reason to open)."""
    if any(f.broker is None for f in schedule):
        return False
    return not any(
        a.broker != b.broker and a.at < b.at + b.seconds and b.at < a.at + a.seconds
        for i, a in enumerate(schedule)
        for b in schedule[i + 1 :]
    )
