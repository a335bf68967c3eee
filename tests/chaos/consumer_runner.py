"""One run of a consumer fault schedule: a `ResilientConsumer(ordering="key", dedup=True)` in a
process of its own handles keyed messages, some failing through the retry tiers, while the
schedule plays on a proxied cluster; the process is killed with SIGKILL part-way and started
again in the same group; then its effect log is checked (`outbox.testing.handled`)."""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from confluent_kafka import OFFSET_INVALID, Consumer, TopicPartition

from outbox import ResilientProducer
from outbox.consumer.tiers import dlq_name, retry_tier_name
from outbox.testing import KafkaCluster
from outbox.testing.consume import topic_size
from outbox.testing.handled import Handled, check_handled
from outbox.testing.history import History, Verdict
from outbox.testing.schedule import Fault, play

from ..group_protocols import group_settings
from ..waiting import wait_until
from .consumer_worker import DELAYS, STATS
from .runner import delivered_everything

WORKER = Path(__file__).with_name("consumer_worker.py")
ROOT = Path(__file__).resolve().parents[2]  # the worker imports this tree's outbox, not an installed one
KEYS = 40


@dataclass(frozen=True)
class ConsumerSetup:
    """The consumer's side of one run."""

    partitions: int = 6
    messages: int = 3000
    batch_size: int = 100
    seed: int = 0  # which messages fail, and how often
    #: The consumer process is killed (SIGKILL) once this fraction of the messages has taken effect, for each.
    kills: tuple[float, ...] = (0.4,)
    #: The group's protocol: "classic" or "consumer" (KIP-848).
    protocol: str = "classic"

    def __str__(self) -> str:
        kills = ", ".join(f"{k:.0%}" for k in self.kills)
        return (
            f"{self.messages} messages, {self.partitions} partitions, batch {self.batch_size}, seed {self.seed}, "
            f"killed at {kills}, group.protocol {self.protocol}"
        )


@dataclass
class ConsumerRun:
    setup: ConsumerSetup
    schedule: list[Fault]
    handled: Handled
    topic: Verdict  # the topic as the producer left it: a reorder there is not the consumer's
    dlq: int  # records in the DLQ topic
    lag: int  # records of the ladder past the group's committed offsets once the consumer stopped
    stats: dict[str, int] = field(default_factory=dict)  # summed over the consumer's processes
    failing: int = 0  # messages planned to fail at least once

    def line(self) -> str:
        return (
            f"[consumer: {self.setup}] {len(self.schedule)} faults "
            f"({'; '.join(map(str, self.schedule)) or 'none'}): {self.handled.summary()}, "
            f"{self.dlq} in the DLQ, {self.lag} left uncommitted; "
            f"{self.failing} failing, {self.stats.get('retried', 0)} hops, {self.stats.get('parked', 0)} parked, "
            f"{self.stats.get('duplicates_skipped', 0)} copies skipped; topic: {self.topic.summary()}"
        )

    def record(self) -> dict[str, Any]:
        h = self.handled
        return {
            "side": "consumer",
            "setup": asdict(self.setup),
            "schedule": [asdict(f) for f in self.schedule],
            "messages": h.messages,
            "effects": h.effects,
            "missing": len(h.missing),
            "twice": len(h.twice),
            "reordered_keys": len(h.reordered),
            "unknown": h.unknown,
            "dlq": self.dlq,
            "lag": self.lag,
            "failing": self.failing,
            "records": self.topic.records,
            "topic_duplicates": self.topic.duplicates,
            "topic_reordered_keys": len(self.topic.reordered),
            **{k: self.stats.get(k, 0) for k in STATS},
        }


def plan(seed: int, messages: int) -> list[tuple[bytes, bytes]]:
    """The messages, (key, value), in produce order: value ``<key>:<seq>:<fails>``, `seq` counting
    per key; most never fail, some fail once, a few fail twice."""
    rng = random.Random(seed)
    seqs = [0] * KEYS
    out = []
    for _ in range(messages):
        k = rng.randrange(KEYS)
        fails = rng.choices([0, 1, 2], weights=[90, 7, 3])[0]
        key = b"key-%02d" % k
        out.append((key, b"%s:%d:%d" % (key, seqs[k], fails)))
        seqs[k] += 1
    return out


class Worker:
    """The consumer's processes, one at a time, in one group and one store."""

    def __init__(self, bootstrap: str, topic: str, group: str, tmp: Path, batch_size: int, protocol: str) -> None:
        settings = json.dumps(group_settings(protocol, max_poll_interval_ms=30000))
        self.args = [bootstrap, topic, group, str(tmp / "consumer.db"), "", str(batch_size), settings]
        self.db = tmp / "consumer.db"
        self.log = tmp / "consumer.log"
        self.tmp = tmp
        self.stats_paths: list[Path] = []
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.stats_paths.append(self.tmp / f"stats-{len(self.stats_paths)}.json")
        self.args[4] = str(self.stats_paths[-1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        log: IO[bytes] = open(self.log, "ab")  # noqa: SIM115 - the child keeps it
        with log:
            self.proc = subprocess.Popen([sys.executable, str(WORKER), *self.args], stderr=log, env=env)

    def started(self) -> bool:
        """Its consumer is constructed (the tier topics exist): it wrote its first stats."""
        self.alive()
        return self.stats_paths[-1].exists()

    def alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"the consumer exited with {self.proc.returncode}:\n{self.log_tail()}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()  # SIGKILL: nothing flushed, committed or closed
        self.proc.wait()
        self.proc = None

    def stop(self) -> int:
        """SIGTERM; its exit status."""
        if self.proc is None:
            return 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self.proc = None

    def effects(self) -> list[str]:
        """The effect log: the message id of each effect, in the order they committed."""
        with sqlite3.connect(self.db, timeout=30) as c:
            return [r[0] for r in c.execute("SELECT msg_id FROM effects ORDER BY n")]

    def applied(self) -> int:
        """Distinct messages that took effect so far."""
        if not self.db.exists():
            return 0
        with sqlite3.connect(self.db, timeout=30) as c:
            try:
                return int(c.execute("SELECT count(DISTINCT msg_id) FROM effects").fetchone()[0])
            except sqlite3.OperationalError:  # not created yet
                return 0

    def reached(self, n: int) -> bool:
        return self.applied() >= n

    def stats(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for p in self.stats_paths:
            if p.exists():
                for k, v in json.loads(p.read_text()).items():
                    total[k] = total.get(k, 0) + int(v)
        return total

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""


def run(cluster: KafkaCluster, setup: ConsumerSetup, schedule: list[Fault]) -> ConsumerRun:
    """Produce the plan while `schedule` plays and the consumer handles it, killing the consumer at
    each of `setup.kills`; wait until everything took effect and the group has committed every
    partition of its ladder to its end; stop the consumer and judge its effect log."""
    bootstrap = cluster.bootstrap_servers
    topic = cluster.create_topic(
        f"cchaos-{os.urandom(4).hex()}", partitions=setup.partitions, replication_factor=3,
        config={"min.insync.replicas": "2"},
    )
    group = f"g{uuid.uuid4().hex[:8]}"
    messages = plan(setup.seed, setup.messages)
    history = History()
    produced: list[tuple[bytes, str]] = []  # (key, outbox-id) in produce order
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        worker = Worker(bootstrap, topic, group, tmp, setup.batch_size, setup.protocol)
        producer = ResilientProducer({"bootstrap.servers": bootstrap}, outbox=f"sqlite:///{tmp / 'producer.db'}")
        player = None
        try:
            worker.start()
            wait_until(worker.started, 90, "the consumer started", check=worker.alive)
            player = play(cluster, schedule)
            errors: list[BaseException] = []
            feeding = threading.Thread(target=feed, args=(producer, topic, messages, history, produced, errors))
            feeding.start()
            for fraction in setup.kills:
                wanted = int(fraction * setup.messages)
                wait_until(functools.partial(worker.reached, wanted), 180, f"{wanted} messages took effect",
                           check=worker.alive)
                worker.kill()
                worker.start()
            feeding.join()
            assert not errors, errors
            player.join()
            assert not player.errors, player.errors
            cluster.wait_until_healthy()
            delivered_everything(producer)
            # A message that never takes effect, or a ladder never committed to its end, is for the
            # checker and the run's line to show: these waits end without failing.
            settled(functools.partial(worker.reached, setup.messages), 240, worker.alive)
            ladder = [topic, *(retry_tier_name(topic, group, n) for n in range(1, len(DELAYS) + 1))]
            settled(lambda: lag(bootstrap, group, ladder) == 0, 120, worker.alive)
            status = worker.stop()
            assert status == 0, f"the consumer exited with {status}:\n{worker.log_tail()}"
            left = lag(bootstrap, group, ladder)
            effects = worker.effects()
        finally:
            if player is not None:
                player.stop()
            if worker.proc is not None:
                worker.kill()
            producer.close()
        stats = worker.stats()
    return ConsumerRun(
        setup, schedule, check_handled(produced, effects), history.check(bootstrap, topic),
        dlq=topic_size(bootstrap, dlq_name(topic, group)), lag=left, stats=stats,
        failing=sum(1 for _, v in messages if not v.endswith(b":0")),
    )


def settled(cond: Callable[[], bool], timeout: float, check: Callable[[], None]) -> bool:
    """Whether `cond()` came true within `timeout` (`check` may raise to end the wait early)."""
    deadline = time.monotonic() + timeout
    while True:
        check()
        if cond():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def feed(
    producer: ResilientProducer, topic: str, messages: list[tuple[bytes, bytes]], history: History,
    produced: list[tuple[bytes, str]], errors: list[BaseException],
) -> None:
    """Produce `messages` in order over some 5 s, recording each id."""
    try:
        for key, value in messages:
            msg_id = producer.produce(topic, value, key=key)
            history.accepted(topic, key, msg_id)
            produced.append((key, msg_id))
            time.sleep(0.0015)  # a steady stream through the schedule
    except BaseException as exc:
        errors.append(exc)


def lag(bootstrap: str, group: str, topics: list[str]) -> int:
    """Records of `topics` past the group's committed offsets (a partition never committed counts from its start)."""
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        md = reader.list_topics(timeout=10)
        parts = [TopicPartition(t, p) for t in topics for p in md.topics[t].partitions]
        total = 0
        for c in reader.committed(parts, timeout=10):
            low, high = reader.get_watermark_offsets(TopicPartition(c.topic, c.partition), timeout=10)
            total += high - (low if c.offset == OFFSET_INVALID else c.offset)
        return total
    finally:
        reader.close()


def report(run_: ConsumerRun) -> None:
    """Append the run to `$CHAOS_REPORT` (JSON lines), if set, and print its line."""
    print(run_.line())
    path = os.environ.get("CHAOS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(run_.record()) + "\n")
