"""A script that produces and returns without close(): nothing it was told is accepted is lost."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from outbox import Drainer, RetryPolicy, SQLiteOutbox
from outbox.records import Status
from outbox.testing import KafkaCluster

from .delivery import read_topic
from .test_producer import FAST

# The child: 2,000 messages while the circuit is closed (librdkafka queues them: the listener
# accepts connections and never answers), then every broker goes away (the listener closes: all
# brokers down, the circuit opens), 2,000 more, and a plain return. It prints each id it was given.
UNREACHABLE = textwrap.dedent(
    """
    import logging, socket, sys, threading, time
    from outbox import ResilientProducer
    logging.basicConfig(level=logging.WARNING)
    path, topic = sys.argv[1:3]
    server = socket.create_server(("127.0.0.1", 0))
    conns = []
    def accept():
        while True:
            try:
                conns.append(server.accept()[0])
            except OSError:
                return
    threading.Thread(target=accept, daemon=True).start()
    p = ResilientProducer(
        {"bootstrap.servers": "127.0.0.1:%d" % server.getsockname()[1], "message.timeout.ms": 30000},
        outbox=f"sqlite:///{path}", circuit_reset_timeout=60,
    )
    for i in range(2000):
        print(p.produce(topic, b"before:%d" % i, key=b"k%d" % (i % 10)))
    assert p.circuit.closed and len(p) == 2000, (p.circuit.state, len(p))
    server.shutdown(socket.SHUT_RDWR)
    server.close()
    for c in conns:
        c.close()
    deadline = time.monotonic() + 30
    while p.circuit.closed:
        assert time.monotonic() < deadline, "the circuit did not open"
        time.sleep(0.01)
    for i in range(2000):
        print(p.produce(topic, b"after:%d" % i, key=b"k%d" % (i % 10)))
    # One write: print() writes its pieces apart, and a log line from another thread can land between.
    sys.stderr.write("committed before exit: %d\\n" % p.stats()["pending"])
    """
)

# The same with the real cluster: connected, then every broker frozen (SIGSTOP: the 2,000 wait in
# librdkafka with the circuit closed), then killed (SIGKILL: all brokers down, the circuit opens).
FROZEN_THEN_KILLED = textwrap.dedent(
    """
    import logging, sys, time
    from outbox import ResilientProducer
    logging.basicConfig(level=logging.WARNING)
    bootstrap, path, topic = sys.argv[1:4]
    p = ResilientProducer(
        {"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, "linger.ms": 5},
        outbox=f"sqlite:///{path}", circuit_reset_timeout=60, drain_workers=0,
    )
    warm = p.produce(topic, b"warm-up")
    assert p.flush(60) == 0  # connected to every leader, idempotence id granted
    print("READY", warm, flush=True)
    assert sys.stdin.readline().strip() == "FROZEN"
    for i in range(2000):
        print(p.produce(topic, b"before:%d" % i, key=b"k%d" % (i % 10)))
    assert p.circuit.closed and len(p) >= 2000, (p.circuit.state, len(p))
    print("QUEUED", flush=True)
    assert sys.stdin.readline().strip() == "KILLED"
    deadline = time.monotonic() + 60
    while p.circuit.closed:
        assert time.monotonic() < deadline, "the circuit did not open"
        time.sleep(0.01)
    for i in range(2000):
        print(p.produce(topic, b"after:%d" % i, key=b"k%d" % (i % 10)))
    # One write: print() writes its pieces apart, and a log line from another thread can land between.
    sys.stderr.write("committed before exit: %d\\n" % p.stats()["pending"])
    """
)

HEALTHY = textwrap.dedent(
    """
    import logging, sys
    from outbox import ResilientProducer
    logging.basicConfig(level=logging.INFO)
    bootstrap, path, topic = sys.argv[1:4]
    p = ResilientProducer(
        {"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5}, outbox=f"sqlite:///{path}"
    )
    for i in range(4000):
        print(p.produce(topic, b"m:%d" % i, key=b"k%d" % (i % 10)))
    """
)

# The drain is busy at exit: 20,000 rows left by an earlier process, one new message, a return.
BACKLOG = textwrap.dedent(
    """
    import logging, sys
    from outbox import ResilientProducer, SQLiteOutbox
    from outbox.records import NewMessage
    logging.basicConfig(level=logging.WARNING)
    bootstrap, path, topic = sys.argv[1:4]
    with SQLiteOutbox(path) as store:
        store.enqueue([
            NewMessage(topic, b"b:%d" % i, b"k%d" % (i % 10), [("outbox-id", b"b%d" % i)], -1, "b%d" % i)
            for i in range(20000)
        ])
    p = ResilientProducer({"bootstrap.servers": bootstrap}, outbox=f"sqlite:///{path}", drain_batch_size=500)
    print(p.produce(topic, b"last", key=b"k0"))
    """
)


def _run(script: str, *args: str) -> tuple[list[str], str]:
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split(), done.stderr


def _drain(path: Path, bootstrap: str) -> None:
    store = SQLiteOutbox(str(path))
    drainer = Drainer(store, {"bootstrap.servers": bootstrap, **FAST}, retry=RetryPolicy(max_attempts=20))
    deadline = time.monotonic() + 120
    while store.stats(now=time.time()).pending:
        assert time.monotonic() < deadline, "the outbox was not drained"
        drainer.run(until_empty=True)
    store.close()


def _pending_ids(path: Path) -> list[str]:
    with SQLiteOutbox(str(path), create=False) as store:
        return [m.msg_id for m in store.messages() if m.status is Status.PENDING]


def test_a_plain_exit_with_every_broker_gone_commits_all_4000_accepted_messages(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    path = tmp_path / "exit.db"
    ids, stderr = _run(UNREACHABLE, str(path), topic)
    assert len(ids) == 4000
    # The count is logged: what was not yet in the outbox when the exit hook ran. The writer goes on
    # committing between the script's last line and the hook, so it is at most what was left then.
    before = int(re.findall(r"committed before exit: (\d+)", stderr)[0])
    assert "lost" not in stderr, stderr
    logged = re.findall(r"at exit, (\d+) undelivered messages were committed to the outbox", stderr)
    assert len(logged) <= 1 and all(0 < int(n) <= 4000 - before for n in logged), stderr
    stored = _pending_ids(path)
    assert len(stored) == 4000 and set(stored) == set(ids)
    # They are real messages: the drain delivers every one of them once a cluster is there.
    _drain(path, kafka_bootstrap)
    got = read_topic(kafka_bootstrap, topic, 4000)
    assert got.unique == 4000 and set(got.by_id) == set(ids)


def test_a_plain_exit_after_every_broker_died_mid_stream_commits_all_4000(
    chaos_cluster: KafkaCluster, topic: str, tmp_path: Path
) -> None:
    bs = chaos_cluster.bootstrap_servers
    path = tmp_path / "exit.db"
    child = subprocess.Popen(
        [sys.executable, "-c", FROZEN_THEN_KILLED, bs, str(path), topic],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    brokers = chaos_cluster.pids()[1:]  # the controller first
    try:
        ready, warm = child.stdout.readline().split()
        assert ready == "READY"
        for pid in brokers:
            os.kill(pid, signal.SIGSTOP)
        child.stdin.write("FROZEN\n")
        child.stdin.flush()
        ids = [child.stdout.readline().strip() for _ in range(2000)]
        assert child.stdout.readline().strip() == "QUEUED"
        for i in chaos_cluster.running_brokers():
            chaos_cluster.kill_broker(i)  # SIGKILL ends a stopped process too
        child.stdin.write("KILLED\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
        for pid in brokers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert child.returncode == 0, err
    ids += out.split()
    assert len(ids) == 4000 and "lost" not in err, err
    stored = _pending_ids(path)
    assert len(stored) == 4000 and set(stored) == set(ids)
    chaos_cluster.start_all()
    _drain(path, bs)
    got = read_topic(bs, topic, 4001)
    assert got.unique == 4001 and set(got.by_id) == set(ids) | {warm}  # the warm-up was delivered before


def test_a_plain_exit_with_the_cluster_up_delivers_all_4000(kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    path = tmp_path / "exit.db"
    ids, stderr = _run(HEALTHY, kafka_bootstrap, str(path), topic)
    assert len(ids) == 4000
    got = read_topic(kafka_bootstrap, topic, 4000)
    stored = _pending_ids(path)
    # Delivered, or (a slow machine's exit_timeout ran out) committed for the next drain: never lost.
    assert set(got.by_id) | set(stored) == set(ids), stderr
    assert got.unique == 4000, f"{4000 - got.unique} not delivered ({len(stored)} in the outbox): {stderr}"


def test_a_plain_exit_while_the_drain_is_busy_stops_it_without_a_worker_failure(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    # At exit, concurrent.futures refuses new work before the producer's exit hook stops the
    # drain: a worker's next claim raised, and the worker was logged as failed and restarted.
    path = tmp_path / "exit.db"
    ids, stderr = _run(BACKLOG, kafka_bootstrap, str(path), topic)
    assert len(ids) == 1
    assert "drain worker" not in stderr and "cannot schedule new futures" not in stderr, stderr
    _drain(path, kafka_bootstrap)
    got = read_topic(kafka_bootstrap, topic, 20001)
    assert got.unique == 20001 and set(ids) <= set(got.by_id)
