"""One run of a fault schedule: threads produce keyed messages through a `ResilientProducer` while
the schedule plays on a proxied cluster, then everything is delivered and the history checked."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from outbox import PRODUCER_DEFAULTS, DeadLetter, Drainer, Listener, ResilientProducer, RetryPolicy, open_outbox
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
    #: A fault of the producing process (`PROCESS_FAULTS`), `process_at` seconds into the schedule:
    #: "sigterm" stops it (a new process on the same outbox goes on with the same keys), "fork"
    #: forks it (the child makes a producer of its own). "none": the producer runs in this process.
    process: str = "none"
    process_at: float = 1.0

    def __str__(self) -> str:
        text = f"{self.mode}, drain in {self.drain_in}, {self.store}, {self.size} B, {self.threads} threads"
        return text if self.process == "none" else f"{text}, {self.process} at {self.process_at:.1f} s"


PROCESS_FAULTS = ("none", "sigterm", "fork")


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
    #: None: the producer ran in processes of their own (`Setup.process`), whose circuit this
    #: process does not see.
    circuit_opens: int | None
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
            f"{self.circuit()}; raw producer beside it: {self.raw.summary()}",
            *self.lost_fates,
        ])

    def circuit(self) -> str:
        if self.circuit_opens is None:
            return "circuit not seen (the producer ran in processes of its own)"
        return f"circuit opened {self.circuit_opens}x{self.why()}"

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
    if setup.process != "none":
        assert not settings and not options, "a process fault runs the producer's defaults"
        with tempfile.TemporaryDirectory() as tmp:
            url = store_url or f"sqlite:///{Path(tmp) / 'o.db'}"
            return run_in_processes(cluster, setup, schedule, url, topic, raw_topic, history, raw_history)
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
    verdict, raw_verdict = judged(cluster, topic, raw_topic, history, raw_history)
    dead, pending = stats["dead"] or 0, stats["pending"] or 0
    return Run(setup, schedule, verdict, dead, pending, opens, reasons.seen, raw_verdict, fates.of_lost(verdict.lost))


def run_in_processes(
    cluster: KafkaCluster, setup: Setup, schedule: list[Fault], url: str, topic: str, raw_topic: str,
    history: History, raw_history: History,
) -> Run:
    """`run` with the producer in processes of its own (`producer_process`), and the process fault."""
    bootstrap = cluster.bootstrap_servers
    raw = Producer({**PRODUCER_DEFAULTS, "enable.idempotence": True, "bootstrap.servers": bootstrap})
    player = play(cluster, schedule)
    ends = max((f.at + f.seconds for f in schedule), default=0.0) + 1.0
    ends = max(ends, setup.process_at + 1.0, 2.0)
    beside = threading.Thread(target=produce_raw_until, args=(raw, raw_topic, raw_history, setup, ends))
    beside.start()
    started = time.monotonic()
    if setup.process == "sigterm":
        first = ProducingProcess(bootstrap, url, topic, setup, history, seconds=-1)
        time.sleep(max(0.0, setup.process_at - (time.monotonic() - started)))
        first.terminate()
        # A new process on the same outbox (a deploy's new pod) goes on with the same keys.
        ProducingProcess(bootstrap, url, topic, setup, history, seconds=max(0.5, ends - setup.process_at)).wait()
    else:
        ProducingProcess(bootstrap, url, topic, setup, history, seconds=ends, fork_at=setup.process_at).wait()
    beside.join()
    player.join()
    assert not player.errors, player.errors
    cluster.wait_until_healthy()
    dead, pending = drain_outbox(url, bootstrap)
    verdict, raw_verdict = judged(cluster, topic, raw_topic, history, raw_history)
    return Run(setup, schedule, verdict, dead, pending, None, [], raw_verdict)


def judged(
    cluster: KafkaCluster, topic: str, raw_topic: str, history: History, raw_history: History
) -> tuple[Verdict, Verdict]:
    """Both topics read back and checked, then deleted: (the wrapper's verdict, the raw producer's)."""
    verdict = history.check(cluster.bootstrap_servers, topic)
    raw_verdict = raw_history.check(cluster.bootstrap_servers, raw_topic)
    # Hundreds of schedules share one cluster: a broker killed later recovers every partition it
    # holds before it serves (one restarted under load took over 90 s with some 1,100).
    for name in (topic, raw_topic):
        cluster.delete_topic(name)
    return verdict, raw_verdict


class ProducingProcess:
    """One `producer_process`, its accepted messages fed to `history` as it prints them."""

    def __init__(
        self, bootstrap: str, url: str, topic: str, setup: Setup, history: History, *, seconds: float,
        fork_at: float = -1.0,
    ) -> None:
        self._history, self._topic = history, topic
        self.errors: list[str] = []
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in _end) a file, not a pipe: logging never blocks it
        self.child = subprocess.Popen(
            [sys.executable, "-m", "tests.chaos.producer_process", bootstrap, url, topic, setup.mode,
             setup.drain_in, str(setup.size), str(setup.threads), "", str(seconds), str(fork_at)],
            stdout=subprocess.PIPE, stderr=self._stderr, text=True, cwd=Path(__file__).resolve().parents[2],
        )
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read)
        self._reader.start()
        assert self._ready.wait(60), "the producing process did not start"

    def _read(self) -> None:
        assert self.child.stdout is not None
        for line in self.child.stdout:
            what, *rest = line.split()
            if what == "ACCEPTED":
                self._history.accepted(self._topic, rest[0].encode(), rest[1])
            elif what == "READY":
                self._ready.set()
            else:
                self.errors.append(line.strip())
        self._ready.set()

    def terminate(self) -> None:
        """SIGTERM, as a deploy sends it: the process must end by the signal."""
        self.child.send_signal(signal.SIGTERM)
        self._end(-signal.SIGTERM)

    def wait(self) -> None:
        self._end(0)

    def _end(self, expected: int) -> None:
        self.child.wait(240)
        self._reader.join(240)  # until every writer of the pipe (a forked child too) closed it
        self._stderr.seek(0)
        err = self._stderr.read()[-4000:]
        self._stderr.close()
        assert self.child.returncode == expected and not self.errors, (self.child.returncode, self.errors, err)


def drain_outbox(url: str, bootstrap: str) -> tuple[int, int]:
    """Deliver what the producing processes left in the outbox; (dead, pending) afterwards."""
    store = open_outbox(url)
    try:
        drainer = Drainer(store, {"bootstrap.servers": bootstrap}, retry=RetryPolicy(max_attempts=20))
        wait_until(lambda: drainer.run(until_empty=True) is not None and store.stats(now=time.time()).pending == 0,
                   240, "the outbox drained")
        stats = store.stats(now=time.time())
        return stats.dead, stats.pending
    finally:
        store.close()


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
