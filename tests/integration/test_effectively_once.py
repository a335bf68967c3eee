"""Effectively once, end to end: a ResilientProducer under broker chaos (its duplicates share an
outbox-id) feeds a ResilientConsumer(dedup=True) whose transactional handler inserts one row per
message in the consumer's own SQLite store; the consumer process is killed with SIGKILL twice
mid-stream and restarted. Every message's row exists exactly once."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from outbox import ResilientProducer
from outbox.testing import KafkaCluster

from .. import waiting

WORKER = Path(__file__).with_name("effectively_once_worker.py")
N = 3000


def rows(path: Path) -> tuple[int, int]:
    """(rows, distinct values) in the handler's table so far."""
    if not path.exists():
        return 0, 0
    with sqlite3.connect(path, timeout=30) as c:
        try:
            return c.execute("SELECT count(*), count(DISTINCT v) FROM effects").fetchone()  # type: ignore[no-any-return]
        except sqlite3.OperationalError:  # the table is not created yet
            return 0, 0


@pytest.mark.chaos
def test_every_message_applied_exactly_once_through_broker_chaos_and_consumer_kills(
    chaos_cluster: KafkaCluster, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    bootstrap = chaos_cluster.bootstrap_servers
    topic = make_topic(partitions=3)
    group = f"g{uuid.uuid4().hex[:8]}"
    store = tmp_path / "consumer.db"
    errors: list[BaseException] = []

    skips: list[Path] = []  # each incarnation's count of skipped copies, rewritten as it runs

    def start() -> subprocess.Popen[bytes]:
        skips.append(tmp_path / f"skips-{len(skips)}")
        return subprocess.Popen(
            [sys.executable, str(WORKER), bootstrap, topic, group, str(store), str(skips[-1])],
            stderr=open(tmp_path / "worker.log", "ab"),  # noqa: SIM115 - the child keeps it
        )

    producer = ResilientProducer(
        {"bootstrap.servers": bootstrap, "acks": "all", "message.timeout.ms": 3000},
        outbox=f"sqlite:///{tmp_path / 'producer.db'}", drain_poll_interval=0.2,
    )

    def feed() -> None:
        try:
            for i in range(N):
                producer.produce(topic, b"m-%05d" % i, key=b"k%d" % (i % 50))
                time.sleep(0.008)  # ~25 s of producing: the chaos and the kills happen mid-stream
        except BaseException as exc:
            errors.append(exc)

    worker = start()

    def alive() -> None:
        if worker.poll() is not None:
            raise AssertionError(f"the consumer exited with {worker.returncode}: see {tmp_path / 'worker.log'}")

    feeding = threading.Thread(target=feed)
    feeding.start()
    try:
        # Its tier topics exist (created at start-up, with every broker up) once it handles messages.
        waiting.wait_until(lambda: rows(store)[0] >= 100, 90, "the consumer started", check=alive)
        chaos_cluster.stop_broker(1)
        waiting.wait_until(lambda: rows(store)[0] >= N // 5, 90, "a fifth handled", check=alive)
        worker.kill()  # SIGKILL: nothing is flushed or committed
        worker.wait()
        chaos_cluster.start_broker(1)
        worker = start()
        chaos_cluster.kill_broker(2)
        waiting.wait_until(lambda: rows(store)[0] >= N // 2, 90, "half handled", check=alive)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        worker = start()
        chaos_cluster.start_broker(2)
        feeding.join(120)
        assert not errors, errors
        assert producer.flush(120) == 0
        waiting.wait_until(lambda: producer.stats()["pending"] == 0, 120, "the producer's outbox drained")
        waiting.wait_until(lambda: rows(store)[1] == N, 120, f"all {N} messages applied", check=alive)
        time.sleep(3)  # room for a late copy to be applied a second time, if it could be
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
        producer.close(30)
    with sqlite3.connect(store) as c:
        twice = c.execute("SELECT v, count(*) FROM effects GROUP BY v HAVING count(*) > 1 LIMIT 5").fetchall()
        values = {v for (v,) in c.execute("SELECT v FROM effects")}
        marks = c.execute("SELECT count(*) FROM outbox_inbox WHERE grp = ?", (group,)).fetchone()[0]
    assert twice == [], f"applied more than once: {twice}"
    assert values == {f"m-{i:05d}" for i in range(N)}
    assert marks == N
    # The kills left handled messages uncommitted (auto commit every 5 s): their copies were read again.
    skipped = sum(int(p.read_text() or 0) for p in skips if p.exists())
    assert skipped > 0, "no copy reached the consumer: the test proved nothing"
