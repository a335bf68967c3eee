"""SIGTERM and fork: what a deploy does to a process loses none of the messages it accepted.

Each case runs a real process that produces to the session cluster, stops it the way a platform
does, and counts every id the process was given by `produce()` in Kafka plus the outbox.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from outbox import SQLiteOutbox
from outbox.producer.writeahead import CRASH_WINDOW_ROWS
from outbox.records import Status

from .delivery import read_topic

# A worker as users write one: produce, print each id it was given (line-buffered: printed is
# what the parent counts), then go on with its work (a sleep) until the platform stops it.
WORKER = textwrap.dedent(
    """
    import signal, sys, time
    from outbox import ResilientProducer
    sys.stdout.reconfigure(line_buffering=True)
    bootstrap, path, topic, mode, durability, count, own_handler, pad = sys.argv[1:9]
    pad = b"." * int(pad)
    if own_handler == "1":
        import outbox
        def stop(signum, frame):
            print("APP HANDLER", file=sys.stderr, flush=True)
            outbox.on_sigterm(signum, frame)
        signal.signal(signal.SIGTERM, stop)
    p = ResilientProducer(
        {"bootstrap.servers": bootstrap, "linger.ms": 200}, outbox=f"sqlite:///{path}", mode=mode,
        durability=durability,
    )
    if own_handler == "1":
        assert signal.getsignal(signal.SIGTERM) is stop  # the application's handler is kept
    count = int(count)
    i = 0
    while count < 0 or i < count:  # count < 0: without end (the signal lands in a tight loop)
        print(p.produce(topic, pad + b"k%d:%d" % (i % 50, i), key=b"k%d" % (i % 50)))
        i += 1
    print("PRODUCED")
    time.sleep(600)
    """
)

ASYNC_WORKER = textwrap.dedent(
    """
    import asyncio, sys
    from outbox import AsyncResilientProducer
    sys.stdout.reconfigure(line_buffering=True)
    bootstrap, path, topic = sys.argv[1:4]
    async def main():
        # Built off the loop, in a thread: the handler is installed from the loop's (main) thread.
        p = await AsyncResilientProducer.create(
            {"bootstrap.servers": bootstrap, "linger.ms": 200}, outbox=f"sqlite:///{path}"
        )
        for i in range(5000):
            print(await p.produce(topic, b"k%d:%d" % (i % 50, i), key=b"k%d" % (i % 50)))
        print("PRODUCED")
        await asyncio.sleep(600)
    asyncio.run(main())
    """
)

# A producer made and used in the parent, then a fork: the child's first call on it fails loudly
# and takes nothing; the child makes its own producer, as the error says, and it delivers.
FORK = textwrap.dedent(
    """
    import os, sys
    from outbox import ProducerForkedError, ResilientProducer
    bootstrap, path, topic = sys.argv[1:4]
    p = ResilientProducer({"bootstrap.servers": bootstrap}, outbox=f"sqlite:///{path}")
    ids = [p.produce(topic, b"parent:%d" % i, key=b"p%d" % (i % 5)) for i in range(200)]
    pid = os.fork()
    if pid == 0:
        try:
            p.produce(topic, b"child-on-parent-producer", key=b"c")
        except ProducerForkedError as exc:
            print("FORKED ERROR", exc, file=sys.stderr)
        else:
            print("the child's produce() on the parent's producer was accepted", file=sys.stderr)
            sys.exit(3)
        child = ResilientProducer({"bootstrap.servers": bootstrap}, outbox=f"sqlite:///{path}.child")
        for i in range(1000):
            print(child.produce(topic, b"child:%d" % i, key=b"c%d" % (i % 5)))
        sys.exit(0 if child.flush(30) == 0 else 4)
    ids += [p.produce(topic, b"parent-after:%d" % i, key=b"p%d" % (i % 5)) for i in range(200)]
    _, status = os.waitpid(pid, 0)
    print("\\n".join(ids))
    sys.exit(os.waitstatus_to_exitcode(status) or (0 if p.flush(30) == 0 else 5))
    """
)


def _start(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _read_ids(child: subprocess.Popen[str], ids: list[str], until: str | None) -> None:
    assert child.stdout is not None
    for line in child.stdout:
        line = line.strip()
        if line == until:
            return
        ids.append(line)


def _terminate(child: subprocess.Popen[str]) -> str:
    """SIGTERM, as a deploy sends it; the child must end by it within its exit_timeout."""
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    return err


def _pending(path: Path) -> set[str]:
    if not path.exists():
        return set()
    with SQLiteOutbox(str(path), create=False) as store:
        return {m.msg_id for m in store.messages() if m.status is Status.PENDING}


def _lost(bootstrap: str, topic: str, ids: list[str], *outboxes: Path, timeout: float = 60) -> tuple[int, int, int]:
    """(in Kafka, in the outbox, lost) of the accepted `ids`; `timeout`: the longest wait for Kafka."""
    stored: set[str] = set()
    for path in outboxes:
        stored |= _pending(path)
    accepted = set(ids)
    got = read_topic(bootstrap, topic, len(accepted - stored), timeout=timeout)
    lost = accepted - set(got.by_id) - stored
    return len(accepted & set(got.by_id)), len(accepted & stored), len(lost)


def _sigterm_after_producing(
    kafka_bootstrap: str, topic: str, tmp_path: Path, mode: str, durability: str, count: int, own_handler: bool = False
) -> tuple[list[str], str]:
    path = tmp_path / "o.db"
    handler = "1" if own_handler else "0"
    child = _start(WORKER, kafka_bootstrap, str(path), topic, mode, durability, str(count), handler, "0")
    ids: list[str] = []
    _read_ids(child, ids, "PRODUCED")
    err = _terminate(child)
    assert child.returncode == -signal.SIGTERM, err  # ended by the signal, as without a handler
    assert len(ids) == count, err
    delivered, stored, lost = _lost(kafka_bootstrap, topic, ids, path)
    assert (lost, delivered + stored) == (0, count), err
    return ids, err


def test_sigterm_after_a_burst_loses_none_of_20000(kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    """The probe: defaults but linger.ms 200, 20,000 messages over 50 keys, then SIGTERM."""
    _sigterm_after_producing(kafka_bootstrap, topic, tmp_path, "fallback", "batch", 20000)


def test_sigterm_in_write_ahead_batch_mode_loses_none(kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    _sigterm_after_producing(kafka_bootstrap, topic, tmp_path, "write-ahead", "batch", 20000)


def test_sigterm_in_write_ahead_sync_mode_loses_none(kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    _sigterm_after_producing(kafka_bootstrap, topic, tmp_path, "write-ahead", "sync", 1000)


def test_kill_9_after_a_burst_in_write_ahead_batch_mode_loses_no_more_than_its_window(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    """No handler runs after a `kill -9`: the loss is bounded by the commit under way and the batch behind it."""
    path = tmp_path / "o.db"
    # 4 KiB values: the burst outruns the commits, as a burst does on a slower disk.
    child = _start(WORKER, kafka_bootstrap, str(path), topic, "write-ahead", "batch", "20000", "0", "4096")
    ids: list[str] = []
    _read_ids(child, ids, "PRODUCED")
    child.kill()
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL and len(ids) == 20000
    # What was delivered arrived before the kill; the rest waits in the outbox, or is lost.
    delivered, stored, lost = _lost(kafka_bootstrap, topic, ids, path, timeout=10)
    assert lost <= 2 * CRASH_WINDOW_ROWS, (delivered, stored, lost)


def test_the_applications_own_handler_runs_and_hands_over(kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    _, err = _sigterm_after_producing(kafka_bootstrap, topic, tmp_path, "fallback", "batch", 5000, own_handler=True)
    assert err.count("APP HANDLER") == 1, err


def test_sigterm_with_the_async_producer_loses_none(kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    child = _start(ASYNC_WORKER, kafka_bootstrap, str(path), topic)
    ids: list[str] = []
    _read_ids(child, ids, "PRODUCED")
    err = _terminate(child)
    assert child.returncode == -signal.SIGTERM, err
    assert len(ids) == 5000
    assert _lost(kafka_bootstrap, topic, ids, path)[2] == 0, err


def test_sigterm_landing_anywhere_in_a_tight_produce_loop_loses_nothing(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    """The signal interrupts produce() wherever it is, locks held too: no deadlock, nothing lost."""
    rng = random.Random()
    ids: list[str] = []
    outboxes = []
    for run in range(6):
        path = tmp_path / f"o{run}.db"
        outboxes.append(path)
        child = _start(WORKER, kafka_bootstrap, str(path), topic, "fallback", "batch", "-1", "0", "0")
        mine: list[str] = []
        reader = threading.Thread(target=_read_ids, args=(child, mine, None))
        reader.start()
        while len(mine) < 1000:  # producing: the loop is running
            assert child.poll() is None, child.stderr.read() if child.stderr else ""
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.3))
        err = _terminate(child)
        reader.join(30)
        assert child.returncode == -signal.SIGTERM, err
        ids += mine
    delivered, stored, lost = _lost(kafka_bootstrap, topic, ids, *outboxes)
    assert lost == 0 and delivered + stored == len(set(ids)), (delivered, stored, lost)


def test_a_fork_disowns_the_parents_producer_and_the_childs_own_delivers(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    path = tmp_path / "o.db"
    done = subprocess.run(
        [sys.executable, "-c", FORK, kafka_bootstrap, str(path), topic],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "FORKED ERROR this ResilientProducer was made in process" in done.stderr, done.stderr
    assert "Make the producer in the child, after the fork" in done.stderr
    ids = done.stdout.split()
    assert len(ids) == 1400  # the child's 1000 and the parent's 400
    delivered, stored, lost = _lost(kafka_bootstrap, topic, ids, path, Path(f"{path}.child"))
    assert (delivered, stored, lost) == (1400, 0, 0)
    got = read_topic(kafka_bootstrap, topic, 1400, timeout=10)
    assert b"child-on-parent-producer" not in got.values()  # refused, never sent


# -- servers that catch SIGTERM themselves ---------------------------------------------------

FASTAPI_APP = textwrap.dedent(
    """
    import contextlib, os
    from fastapi import FastAPI
    from outbox import AsyncResilientProducer

    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.producer = AsyncResilientProducer(
            {"bootstrap.servers": os.environ["BOOTSTRAP"], "linger.ms": 200}, outbox=os.environ["OUTBOX"]
        )
        yield
        await app.state.producer.close()

    app = FastAPI(lifespan=lifespan)

    @app.post("/orders/{n}")
    async def order(n: int) -> str:
        return await app.state.producer.produce(os.environ["TOPIC"], b"k%d:%d" % (n % 20, n), key=b"k%d" % (n % 20))
    """
)

WSGI_APP = textwrap.dedent(
    """
    import os
    from outbox import ResilientProducer

    producer = ResilientProducer(
        {"bootstrap.servers": os.environ["BOOTSTRAP"], "linger.ms": 200}, outbox=os.environ["OUTBOX"] % os.getpid()
    )

    def app(environ, start_response):
        n = int(environ["PATH_INFO"].rsplit("/", 1)[1])
        msg_id = producer.produce(os.environ["TOPIC"], b"k%d:%d" % (n % 20, n), key=b"k%d" % (n % 20))
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [msg_id.encode()]
    """
)


# The same as an ASGI app for gunicorn's uvicorn workers: the producer made at the module's import.
ASGI_APP = textwrap.dedent(
    """
    import os
    from outbox import ResilientProducer

    producer = ResilientProducer(
        {"bootstrap.servers": os.environ["BOOTSTRAP"], "linger.ms": 200}, outbox=os.environ["OUTBOX"] % os.getpid()
    )

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        n = int(scope["path"].rsplit("/", 1)[1])
        msg_id = producer.produce(os.environ["TOPIC"], b"k%d:%d" % (n % 20, n), key=b"k%d" % (n % 20))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": msg_id.encode()})
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Load:
    """Clients posting orders until the server goes away; each answered id was accepted."""

    def __init__(self, port: int, clients: int = 4) -> None:
        self.ids: list[str] = []
        self._port = port
        self._next = iter(range(10**9))
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run) for _ in range(clients)]

    def wait_for_server(self, server: subprocess.Popen[str]) -> None:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None and time.monotonic() < deadline, server.stderr.read() if server.stderr else ""
            try:
                with socket.create_connection(("127.0.0.1", self._port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def until(self, count: int) -> None:
        deadline = time.monotonic() + 60
        while len(self.ids) < count:
            assert time.monotonic() < deadline, f"only {len(self.ids)} orders answered"
            time.sleep(0.01)

    def join(self) -> None:
        for t in self._threads:
            t.join(60)

    def _run(self) -> None:
        while True:
            with self._lock:
                n = next(self._next)
            request = urllib.request.Request(f"http://127.0.0.1:{self._port}/orders/{n}", method="POST")
            try:
                with urllib.request.urlopen(request, timeout=30) as answer:
                    body = answer.read().decode().strip('"')
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                return  # the server stopped taking requests
            with self._lock:
                self.ids.append(body)


def _serve_then_sigterm(
    command: list[str], env: dict[str, str], port: int, tmp_path: Path
) -> tuple[list[str], str, int]:
    server = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    load = _Load(port)
    try:
        load.wait_for_server(server)
        load.start()
        load.until(2000)
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=90)
    finally:
        if server.poll() is None:
            server.kill()
    load.join()
    return load.ids, err, server.returncode


def test_uvicorn_stopped_by_sigterm_under_load_loses_nothing(kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    (tmp_path / "orders_app.py").write_text(FASTAPI_APP)
    path = tmp_path / "o.db"
    env = {"BOOTSTRAP": kafka_bootstrap, "OUTBOX": f"sqlite:///{path}", "TOPIC": topic, "PATH": "/usr/bin:/bin"}
    port = _free_port()
    ids, err, rc = _serve_then_sigterm(
        [sys.executable, "-m", "uvicorn", "orders_app:app", "--port", str(port), "--log-level", "warning"],
        env, port, tmp_path,
    )
    assert rc == -signal.SIGTERM, err  # uvicorn ends by the signal it caught, once shut down
    assert len(ids) >= 2000 and len(set(ids)) == len(ids)
    delivered, stored, lost = _lost(kafka_bootstrap, topic, ids, path)
    assert lost == 0, (delivered, stored, err)


@pytest.mark.parametrize("worker", ["sync", "uvicorn.workers.UvicornWorker"])
def test_gunicorn_stopped_by_sigterm_under_load_loses_nothing(
    kafka_bootstrap: str, topic: str, tmp_path: Path, worker: str
) -> None:
    """Two workers, each with the producer its app module made at import (no --preload)."""
    (tmp_path / "orders_app.py").write_text(WSGI_APP if worker == "sync" else ASGI_APP)
    env = {
        "BOOTSTRAP": kafka_bootstrap, "OUTBOX": f"sqlite:///{tmp_path}/o-%d.db", "TOPIC": topic,
        "PATH": "/usr/bin:/bin",
    }
    port = _free_port()
    ids, err, rc = _serve_then_sigterm(
        [sys.executable, "-m", "gunicorn", "-w", "2", "-k", worker, "-b", f"127.0.0.1:{port}", "orders_app:app"],
        env, port, tmp_path,
    )
    assert rc == 0, err  # gunicorn's master exits 0 after a graceful stop
    assert len(ids) >= 2000 and len(set(ids)) == len(ids)
    delivered, stored, lost = _lost(kafka_bootstrap, topic, ids, *tmp_path.glob("o-*.db"))
    assert lost == 0, (delivered, stored, err)


def test_gunicorn_preload_fails_loudly_on_the_first_produce(kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    """--preload makes the producer in the master: a worker's first produce() names the fix."""
    (tmp_path / "orders_wsgi.py").write_text(WSGI_APP)
    env = {
        "BOOTSTRAP": kafka_bootstrap, "OUTBOX": f"sqlite:///{tmp_path}/o-%d.db", "TOPIC": topic,
        "PATH": "/usr/bin:/bin",
    }
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "--preload", "-w", "1", "-b", f"127.0.0.1:{port}", "orders_wsgi:app"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        _Load(port).wait_for_server(server)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/orders/1", method="POST")
        try:
            urllib.request.urlopen(request, timeout=30)
            status = 200
        except urllib.error.HTTPError as exc:
            status = exc.code
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert status == 500
    assert "ProducerForkedError: this ResilientProducer was made in process" in err, err
    assert "gunicorn: in the post_fork hook" in err


# -- the consumer's own outbox ---------------------------------------------------------------

# Every message fails: each is handled by a hop to the retry tier (60 s away, so the hops stay
# there), published through the consumer's own producer and outbox. The loop is the
# application's own (poll_once), so SIGTERM reaches the producers' handler.
CONSUMER = textwrap.dedent(
    """
    import sys
    from outbox import ResilientConsumer, RetryTopics
    bootstrap, topic, group, path = sys.argv[1:5]
    def handle(msg):
        raise TimeoutError("downstream timed out")
    consumer = ResilientConsumer(
        {"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest"},
        topics=[topic], handler=handle, strategy=RetryTopics(delays=[60]), outbox=f"sqlite:///{path}",
    )
    print("ready", flush=True)
    while True:
        consumer.poll_once()
    """
)


def test_sigterm_keeps_every_hop_of_the_messages_a_consumer_committed(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    """A message's offset is committed only once its hop is durable: SIGTERM mid-stream loses no hop."""
    group = f"g-{topic}"
    values = [b"m:%d" % i for i in range(3000)]
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i, value in enumerate(values):
        producer.produce(topic, value, key=b"k%d" % (i % 30))
    assert producer.flush(30) == 0
    path = tmp_path / "consumer.db"
    child = _start(CONSUMER, kafka_bootstrap, topic, group, str(path))
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    tier = f"{topic}.{group}.retry-1"
    deadline = time.monotonic() + 60
    while len(_values_of(kafka_bootstrap, tier)) < 500:  # mid-stream: hops flowing
        assert child.poll() is None and time.monotonic() < deadline, child.stderr.read() if child.stderr else ""
    err = _terminate(child)
    assert child.returncode == -signal.SIGTERM, err
    check = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group})
    try:
        committed = check.committed([TopicPartition(topic, p) for p in range(3)], timeout=30)
    finally:
        check.close()
    done = sum(max(tp.offset, 0) for tp in committed)  # messages the group will not read again
    assert done > 0, committed
    hops = _values_of(kafka_bootstrap, tier)
    with SQLiteOutbox(str(path), create=False) as store:
        stored = {m.value for m in store.messages() if m.status is Status.PENDING}
    # Each message below a committed offset was handled: its hop is on the tier or in the outbox.
    reread = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"r-{group}", "auto.offset.reset": "earliest"})
    try:
        below = _values_below(reread, topic, committed)
    finally:
        reread.close()
    assert len(below) == done
    assert not below - hops - stored, (len(below - hops - stored), done, len(hops), len(stored))


def _values_of(bootstrap: str, topic: str) -> set[bytes]:
    got = read_topic(bootstrap, topic, 1 << 30, timeout=3) if _exists(bootstrap, topic) else None
    return set() if got is None else got.values()


def _exists(bootstrap: str, topic: str) -> bool:
    return topic in AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics


def _values_below(consumer: Consumer, topic: str, committed: list[TopicPartition]) -> set[bytes]:
    """The values of `topic` below each partition's committed offset."""
    out: set[bytes] = set()
    for tp in committed:
        if tp.offset <= 0:
            continue
        consumer.assign([TopicPartition(topic, tp.partition, 0)])
        seen = 0
        while seen < tp.offset:
            msg = consumer.poll(5)
            assert msg is not None, f"partition {tp.partition}: {seen} of {tp.offset} read"
            if msg.error():
                continue
            if msg.offset() < tp.offset:
                out.add(msg.value() or b"")
            seen = msg.offset() + 1
    return out
