"""One benchmark scenario per child process: ``python -m benchmarks.scenarios NAME 'JSON'``.

The child prints ``RESULT {json}`` on stdout as its last line and exits with ``os._exit`` (the
cleanup of a producer is not part of any measurement, and a dead cluster would make it slow).
Interactive scenarios (recovery, retry comparison) print ``READY`` and then read ``GO`` / ``UP``
lines on stdin from the parent, which owns the cluster and decides when brokers come back.

Every timed loop has the same shape: produce N messages (latency of every `sample`-th call
taken with perf_counter_ns), then wait until the N are complete (delivered, or committed to
the outbox for the outage scenarios). msgs/s = N / that time.
"""

from __future__ import annotations

import atexit
import functools
import gc
import hashlib
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, Message, Producer

from benchmarks.threadcpu import ThreadCPU, by_stage

if TYPE_CHECKING:
    from outbox.stores.encryption import Key

ID_HEADER = "outbox-id"
Params = dict[str, Any]
Result = dict[str, Any]
SCENARIOS: dict[str, Callable[[Params], Result]] = {}

# librdkafka logs "connection refused" loudly while brokers are down; the parent keeps stderr.
logging.basicConfig(level=logging.ERROR, stream=sys.stderr)


def scenario(name: str) -> Callable[[Callable[[Params], Result]], Callable[[Params], Result]]:
    def register(fn: Callable[[Params], Result]) -> Callable[[Params], Result]:
        SCENARIOS[name] = fn
        return fn

    return register


# -- measurement helpers ---------------------------------------------------------------------


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def rss_mb() -> float:
    """Current resident set size (VmRSS)."""
    return _status_kb("VmRSS:") / 1024


def peak_rss_mb() -> float:
    """Peak resident set size of this process (VmHWM)."""
    return _status_kb("VmHWM:") / 1024


def percentile(samples: list[int], q: float) -> float | None:
    if not samples:
        return None
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] / 1000.0  # ns -> µs


def kafka_config(p: Params, *, batch_stats: bool = False, **extra: Any) -> dict[str, Any]:
    """The happy-path producer settings: acks=all, idempotent, linger.ms=5, plus a
    run's own `kafka` settings (the burst runs' small local queue).

    batch_stats: librdkafka's statistics every 250 ms, from which `result()` gives the messages
    per produce batch (`msgs_per_batch`) of the timed part: each request costs the brokers about
    the same, so fewer messages per batch means more broker CPU per message.
    """
    stats = {"statistics.interval.ms": 250, "stats_cb": _BATCHES.add} if batch_stats else {}
    return {
        "bootstrap.servers": p["bootstrap"],
        "acks": "all",
        "enable.idempotence": True,
        "linger.ms": 5,
        **p.get("kafka", {}),
        **stats,
        **extra,
    }


class _BatchCounts:
    """Batches and messages of the run's topic that librdkafka reports (its `batchcnt` window
    statistics, one window per report), counted once the timed part has started."""

    def __init__(self) -> None:
        self.topic: str | None = None  # set by start_clock(): None counts nothing
        self.batches = 0
        self.messages = 0

    def add(self, stats_json: str) -> None:
        if self.topic is None:
            return
        window = json.loads(stats_json).get("topics", {}).get(self.topic, {}).get("batchcnt", {})
        self.batches += window.get("cnt", 0)
        self.messages += window.get("sum", 0)

    def per_batch(self) -> float | None:
        return self.messages / self.batches if self.batches else None


_BATCHES = _BatchCounts()


_CPU0: list[float] = []
_THREADS: list[ThreadCPU] = []


def start_clock(*, by_thread: bool = False, brokers: bool = True, topic: str | None = None) -> float:
    """Start of the timed part: wall clock, and CPU time (all threads, librdkafka's too, and the
    children waited for: a sidecar drain, the `drain_in="process"` child once closed).

    by_thread: also each thread's CPU, and the brokers' (the parent's java children) unless
    `brokers` is False (a run that restarts them): `result()` gives it by stage (`threadcpu`).
    topic: count the batches of this topic from now on (`kafka_config(batch_stats=True)`).
    """
    _CPU0[:] = [sum(os.times()[:4])]
    _BATCHES.topic = topic
    _THREADS.clear()
    if by_thread:
        _THREADS.append(ThreadCPU(os.getppid() if brokers else None))
        _THREADS[0].start()
    return time.perf_counter()


def warm_up(meta: Producer, topic: str, send: Callable[[int], Any], flush: Callable[[float], Any]) -> None:
    """One message to each partition and a flush, before the clock starts: a fresh producer's
    connections to every leader and its idempotent producer id then exist. Without it, a third
    of the 100,000-message raw runs (0.3 s when warm) stall 0.4-0.9 s on them, and R0's
    repetitions spread by a factor of two.

    `meta` reads the topic's partitions (and loads its metadata); `send(k)` sends to partition k."""
    for k in range(len(meta.list_topics(topic, timeout=10).topics[topic].partitions)):
        send(k)
    flush(30)


def result(
    p: Params, n: int, seconds: float, lat: list[int] | None = None, *, main_stage: str = "application",
    **extra: Any,
) -> Result:
    """A run's result line; `main_stage` names what the scenario's own thread did (`by_stage`)."""
    size = int(p.get("size", 200))
    stages = by_stage(_THREADS.pop().stop(), n, main_stage) if _THREADS and n else None
    return {
        "n": n,
        "size": size,
        "seconds": seconds,
        "msgs_per_s": n / seconds if seconds > 0 else None,
        "mb_per_s": n * size / seconds / 1e6 if seconds > 0 else None,
        "p50_us": percentile(lat or [], 0.50),
        "p99_us": percentile(lat or [], 0.99),
        "samples": len(lat or []),
        # CPU per message is far steadier than msgs/s on a shared machine: it is what the
        # process spent, whoever else competes for the cores.
        "cpu_us_per_msg": (sum(os.times()[:4]) - _CPU0[0]) / n * 1e6 if _CPU0 and n else None,
        "cpu_by_stage": stages,
        "main_stage": main_stage,
        "msgs_per_batch": _BATCHES.per_batch(),
        **extra,
    }


def ids(prefix: str, n: int) -> list[bytes]:
    """The same ids as outbox.headers.IdGenerator: 16 hex random prefix + 16 hex counter."""
    return [f"{prefix}{i:016x}".encode() for i in range(1, n + 1)]


def _wait_line(expected: str) -> float:
    line = sys.stdin.readline().strip()
    if line != expected:
        raise SystemExit(f"expected {expected!r} from the parent, got {line!r}")
    return time.monotonic()


def _say(word: str) -> None:
    sys.stdout.write(word + "\n")
    sys.stdout.flush()


# -- 1. raw producer baselines ---------------------------------------------------------------


@scenario("raw")
def raw(p: Params) -> Result:
    """R0 (header=False) / R1 (header=True): confluent_kafka.Producer in a tight loop."""
    from outbox.headers import IdGenerator

    n, topic, every = int(p["n"]), p["topic"], int(p["sample"])
    value = os.urandom(int(p["size"]))
    keys = _keys(p)
    prod = Producer(kafka_config(p, batch_stats=True))
    produce, poll = prod.produce, prod.poll
    # Ids made by the wrapper's own IdGenerator, so that R1 pays for its id header what the
    # wrapper pays, no more.
    next_id = IdGenerator().next
    header = bool(p["header"])
    # on_delivery: one callback for every message, as an application that hears each delivery has
    heard = _Heard()
    cb = heard if p.get("on_delivery") else None
    lat: list[int] = []
    pc = time.perf_counter_ns
    warm_up(prod, topic, lambda k: produce(topic, value, partition=k), prod.flush)
    t0 = start_clock(by_thread=True, topic=topic)
    for i in range(n):
        hdrs: list[tuple[str, str | bytes | None]] | None = [(ID_HEADER, next_id().encode())] if header else None
        key = keys[i % len(keys)] if keys else None
        if i % every:
            while True:
                try:
                    if cb is None:
                        produce(topic, value, key, headers=hdrs)
                    else:
                        produce(topic, value, key, headers=hdrs, on_delivery=cb)
                    break
                except BufferError:
                    poll(0.005)
        else:
            s = pc()
            while True:
                try:
                    if cb is None:
                        produce(topic, value, key, headers=hdrs)
                    else:
                        produce(topic, value, key, headers=hdrs, on_delivery=cb)
                    break
                except BufferError:
                    poll(0.005)
            lat.append(pc() - s)
        if not i % 1000:
            poll(0)  # serve delivery reports, as any real producing loop must
    left = prod.flush(120)
    seconds = time.perf_counter() - t0
    return result(p, n, seconds, lat, undelivered=left, heard=heard.n)


def _keys(p: Params) -> list[bytes]:
    """The run's message keys: `keys` distinct ones, used in turn (none: unkeyed messages)."""
    return [b"key-%04d" % k for k in range(int(p.get("keys", 0)))]


class _Heard:
    """An application's `on_delivery`: counts the reports it hears."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, err: KafkaError | None, msg: Message | None) -> None:
        self.n += 1


# -- 2./3. ResilientProducer happy paths -----------------------------------------------------


def _wait_delivered(rp: Any, n: int, timeout: float = 300) -> int:
    """flush(), then wait until `n` deliveries were reported (public API: `stats()`)."""
    rp.flush(timeout)
    deadline = time.monotonic() + timeout
    delivered = int(rp.stats()["delivered"])
    while delivered < n and time.monotonic() < deadline:
        time.sleep(0.01)
        rp.flush(timeout)
        delivered = int(rp.stats()["delivered"])
    return delivered


@scenario("resilient")
def resilient(p: Params) -> Result:
    """ResilientProducer, circuit closed, brokers up: fallback or write-ahead."""
    from outbox import ResilientProducer

    n, topic, every = int(p["n"]), p["topic"], int(p["sample"])
    value = os.urandom(int(p["size"]))
    threads = int(p.get("threads", 1))
    path = os.path.join(p["workdir"], f"resilient-{os.getpid()}.db")
    # only_errors: successes go unreported, as librdkafka's delivery.report.only.error
    reports = {"delivery.report.only.error": True} if p.get("only_errors") else {}
    # queue_full_timeout: the burst runs compare the default wait for room with none (0: a full
    # local queue stores the message at once).
    waits: dict[str, Any] = {"queue_full_timeout": float(p["queue_full_timeout"])} if "queue_full_timeout" in p else {}
    rp = ResilientProducer(
        kafka_config(p, batch_stats=True, **reports), outbox=f"sqlite:///{path}", mode=p["mode"],
        durability=p.get("durability", "batch"),
        **waits,
    )
    warm_up(Producer(kafka_config(p)), topic, lambda k: rp.produce(topic, value, partition=k), rp.flush)
    warmed = int(rp.stats()["delivered"])  # counted apart: the timed part's deliveries follow
    flush_early = 0
    lats: list[list[int]] = [[] for _ in range(threads)]

    heard = _Heard()
    cb = heard if p.get("on_delivery") else None
    keys = _keys(p)

    def loop(k: int, count: int) -> None:
        produce = rp.produce
        lat = lats[k]
        pc = time.perf_counter_ns
        for i in range(count):
            key = keys[i % len(keys)] if keys else None
            if i % every:
                if cb is None:
                    produce(topic, value, key)
                else:
                    produce(topic, value, key, on_delivery=cb)
            else:
                s = pc()
                if cb is None:
                    produce(topic, value, key)
                else:
                    produce(topic, value, key, on_delivery=cb)
                lat.append(pc() - s)

    t0 = start_clock(by_thread=True, topic=topic)
    if threads == 1:
        loop(0, n)
    else:
        per = n // threads
        n = per * threads
        ts = [threading.Thread(target=loop, args=(k, per)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    left = rp.flush(300)
    st = rp.stats()
    if st["delivered"] - warmed < n - st["outboxed"]:
        flush_early = n - st["outboxed"] - (st["delivered"] - warmed)
    delivered = _wait_delivered(rp, warmed + n - st["outboxed"]) - warmed
    seconds = time.perf_counter() - t0
    st = rp.stats()
    return result(
        p,
        n,
        seconds,
        [x for lat in lats for x in lat],
        delivered=delivered,
        outboxed=st["outboxed"],
        queue_full_waits=st["queue_full_waits"],
        pending=st["pending"],
        flush_left=left,
        flush_returned_before_delivery=flush_early,
        threads=threads,
        heard=heard.n,
        build=_build(),
    )


def _build() -> str:
    """Which build of produce()'s modules this child runs: "compiled" (mypyc's C extensions,
    `make bench`) or "pure" (Python)."""
    import outbox.producer.resilient

    return "pure" if (outbox.producer.resilient.__file__ or "").endswith(".py") else "compiled"


# -- 5. the naive durable approach -----------------------------------------------------------


def _sqlite(path: str) -> sqlite3.Connection:
    """A plain connection with the store's settings (WAL, FULL), transactions explicit."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    return conn


@scenario("naive")
def naive(p: Params) -> Result:
    """Commit each message to SQLite (own transaction, synchronous=FULL), then produce it.

    Deliveries are deleted in one transaction per 1,000 messages — kinder to the naive
    approach than one DELETE transaction per message, so the speed-up we report is a floor.
    """
    from outbox.stores.codec import encode_headers
    from outbox.stores.sqlite import SQLiteOutbox

    n, topic, every = int(p["n"]), p["topic"], int(p["sample"])
    value = os.urandom(int(p["size"]))
    path = os.path.join(p["workdir"], f"naive-{os.getpid()}.db")
    SQLiteOutbox(path, synchronous="FULL").close()  # the outbox schema
    conn = _sqlite(path)
    prod = Producer(kafka_config(p))
    warm_up(prod, topic, lambda k: prod.produce(topic, value, partition=k), prod.flush)
    done: list[int] = []

    def report(row_id: int, err: KafkaError | None, msg: Message) -> None:
        if err is None:
            done.append(row_id)

    def delete_done() -> None:
        if done:
            batch = done[:]
            del done[: len(batch)]
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in batch])
            conn.execute("COMMIT")

    insert = (
        "INSERT INTO outbox (msg_id, topic, key, value, headers, partition, status, attempts, "
        "created_at, next_attempt_at) VALUES (?,?,?,?,?,?,?,?,?,?)"
    )
    prefix = os.urandom(8).hex()
    lat: list[int] = []
    pc = time.perf_counter_ns
    t0 = start_clock()
    for i in range(n):
        s = pc()
        msg_id = f"{prefix}{i:016x}"
        hdrs: list[tuple[str, bytes | None]] = [(ID_HEADER, msg_id.encode())]
        now = time.time()
        conn.execute("BEGIN IMMEDIATE")
        row_id = conn.execute(insert, (msg_id, topic, None, value, encode_headers(hdrs), -1, 0, 0, now, now)).lastrowid
        assert row_id is not None
        conn.execute("COMMIT")
        prod.produce(topic, value, headers=hdrs, on_delivery=functools.partial(report, row_id))  # type: ignore[arg-type]
        prod.poll(0)
        if not i % every:
            lat.append(pc() - s)
        if not i % 1000:
            delete_done()
    left = prod.flush(120)
    delete_done()
    seconds = time.perf_counter() - t0
    remaining = conn.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]
    return result(p, n, seconds, lat, undelivered=left, rows_left=remaining)


# -- 4./7. outage spill ----------------------------------------------------------------------


@scenario("spill")
def spill(p: Params) -> Result:
    """Brokers down, circuit open: produce N into the outbox; done when flush() returns 0.

    `distinct`: every message gets a value of its own (as an application's are), so what the
    producer holds costs what it would; otherwise all share one value object (the spill-rate
    runs: the time, not the memory, is measured there). `memory_budget`: the producer's.
    `encryption`: true stores the messages encrypted (`bench_key`).
    """
    from outbox import ResilientProducer

    n, topic, every = int(p["n"]), p["topic"], int(p["sample"])
    size = int(p["size"])
    value = os.urandom(size)
    distinct = bool(p.get("distinct"))
    stem = value[: max(0, size - 8)]  # + the message number: a value of its own, `size` bytes
    path = os.path.join(p["workdir"], f"spill-{os.getpid()}.db")
    budget: dict[str, Any] = {"memory_budget": int(p["memory_budget"])} if p.get("memory_budget") else {}
    # `outbox`: another store (the fleet runs); `start_at`: an epoch time to wait for once set up,
    # so that processes started together spill together.
    outbox = p.get("outbox") or f"sqlite:///{path}"
    # `circuit_reset_timeout`: longer than the spill, so that no probe message half-opens the
    # circuit midway (after the default 5 s a probe waits in librdkafka for its timeout, and the
    # run measures that wait).
    if p.get("circuit_reset_timeout"):
        budget["circuit_reset_timeout"] = float(p["circuit_reset_timeout"])
    if p.get("encryption"):
        budget["encryption"] = bench_key()
    rp = ResilientProducer(kafka_config(p), outbox=outbox, mode="fallback", **budget)
    if p.get("start_at"):
        time.sleep(max(0.0, float(p["start_at"]) - time.time()))
    rp.circuit.trip("benchmark: brokers are down")  # after the wait: a tripped circuit half-opens in time
    marks = {n * q // 4 - 1: q * 25 for q in (1, 2, 3, 4)}
    rss: dict[str, float] = {"0": rss_mb()}
    backlog: dict[str, int] = {}  # accepted but not yet committed, at each quarter
    lat: list[int] = []
    produce = rp.produce
    pc = time.perf_counter_ns
    t0 = start_clock()
    for i in range(n):
        if distinct:
            value = stem + i.to_bytes(8, "big")
        if i % every:
            produce(topic, value)
        else:
            s = pc()
            produce(topic, value)
            lat.append(pc() - s)
        if i in marks:
            rss[str(marks[i])] = rss_mb()
            backlog[str(marks[i])] = rp.writer.pending()
    left = rp.flush(3600)
    seconds = time.perf_counter() - t0
    ended_at = time.time()
    rss["after_flush"] = rss_mb()
    st = rp.stats()
    db_mb = sum(os.path.getsize(path + x) for x in ("", "-wal") if os.path.exists(path + x)) / 1e6
    if not p.get("keep"):
        for x in ("", "-wal", "-shm"):
            if os.path.exists(path + x):
                os.unlink(path + x)
    return result(
        p,
        n,
        seconds,
        lat,
        flush_left=left,
        pending=st["pending"],
        circuit=st["circuit"],
        rss_mb_at_pct=rss,
        uncommitted_at_pct=backlog,
        memory_held_peak=st.get("memory_held_peak"),
        memory_budget=st.get("memory_budget"),
        db_path=path,
        db_mb=db_mb,
        started_at=ended_at - seconds,
        ended_at=ended_at,
    )


@scenario("sqlite_batch")
def sqlite_batch(p: Params) -> Result:
    """Baseline of the spill: the same rows, executemany in 1,000-row FULL transactions."""
    from outbox.records import NewMessage, Status
    from outbox.stores.base import insert_values
    from outbox.stores.sqlite import INSERT_SQL, SQLiteOutbox

    n, topic = int(p["n"]), p["topic"]
    value = os.urandom(int(p["size"]))
    path = os.path.join(p["workdir"], f"sqlite-{os.getpid()}.db")
    SQLiteOutbox(path, synchronous="FULL").close()  # the outbox schema
    conn = _sqlite(path)
    now = time.time()
    # Exactly the columns and values the store writes for a spilled message.
    rows = [
        insert_values(NewMessage(topic, value, None, [(ID_HEADER, m)], -1, m.decode(), 0, None, None, now),
                      Status.PENDING, None, None, now)
        for m in ids(os.urandom(8).hex(), n)
    ]
    t0 = start_clock()
    for k in range(0, n, 1000):
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(INSERT_SQL, rows[k : k + 1000])
        conn.execute("COMMIT")
    seconds = time.perf_counter() - t0
    return result(p, n, seconds)


def bench_secret(generation: int = 0) -> bytes:
    """The bytes of a benchmark key: fixed; `generation` 1 is the key a rotation moves to."""
    return hashlib.sha256(b"kafka-outbox benchmark key" + (b" %d" % generation if generation else b"")).digest()


def bench_key(generation: int = 0) -> Key:
    """The benchmarks' encryption key: fixed, so that a drain opens what a fill stored."""
    from outbox.stores.encryption import Key

    return Key(bench_secret(generation))


# -- key rotation under traffic ---------------------------------------------------------------


def _paced(produce: Callable[[], Any], rate: float, until: Callable[[], bool]) -> list[int]:
    """Call `produce` at `rate` calls/s until `until()` is true; every call's time (ns)."""
    lat: list[int] = []
    pc = time.perf_counter_ns
    start = pc()
    step = 1e9 / rate
    i = 0
    while not until():
        ahead = start + i * step - pc()
        if ahead > 0:
            time.sleep(ahead / 1e9)
        s = pc()
        produce()
        lat.append(pc() - s)
        i += 1
    return lat


def _latency_ms(lat: list[int]) -> dict[str, Any]:
    p999 = percentile(lat, 0.999)
    return {"calls": len(lat), "max_ms": max(lat) / 1e6 if lat else None,
            "p999_ms": p999 / 1000 if p999 is not None else None}


@scenario("rotate_latency")
def rotate_latency(p: Params) -> Result:
    """produce() while `outbox keys rotate` re-encrypts the same SQLite outbox in another process.

    N pending rows (`n`, default 1,000,000 x `size` 200 B) are stored under an old key
    (`bench_key()`); a ResilientProducer given `[new, old]` with its circuit tripped (brokers at a
    closed port) spills every message to that outbox, at `rate` msgs/s (default 5,000), each
    produce() timed. First `baseline_s` seconds (default 5) with no rotation running, then
    for as long as the rotation (`batch` messages a transaction, default 1,000) runs.
    """
    from outbox import ResilientProducer
    from outbox.stores.encryption import KeyRing
    from outbox.stores.sqlite import SQLiteOutbox

    n, topic, size = int(p.get("n", 1_000_000)), p["topic"], int(p.get("size", 200))
    rate, baseline_s = float(p.get("rate", 5000)), float(p.get("baseline_s", 5))
    path = os.path.join(p["workdir"], f"rotate-{os.getpid()}.db")
    key_files = []
    for generation in (1, 0):  # newest first
        kf = os.path.join(p["workdir"], f"rotate-{os.getpid()}-{generation}.key")
        with open(os.open(kf, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600), "w") as f:
            f.write(bench_secret(generation).hex())
        key_files.append(kf)
    store = SQLiteOutbox(path, synchronous="NORMAL")
    store.set_encryption(KeyRing([bench_key()]))
    _enqueue(store, n, topic, os.urandom(size))
    if p.get("one_message_rows", True):
        # The rotation's worst case: a transaction per `batch` one-message rows (what a drain
        # leaves of the groups it split), not one per group of up to 10,000 messages.
        store.explode_groups()
    store.close()

    rp = ResilientProducer(kafka_config(p), outbox=f"sqlite:///{path}", mode="fallback",
                           encryption=[bench_key(1), bench_key()], circuit_reset_timeout=3600)
    rp.circuit.trip("benchmark: brokers are down")
    value = os.urandom(size)

    def send() -> None:
        rp.produce(topic, value)

    t_base = time.monotonic()
    baseline = _paced(send, rate, lambda: time.monotonic() - t_base >= baseline_s)
    cli = os.path.join(os.path.dirname(sys.executable), "outbox")
    t0 = start_clock()
    rotation = subprocess.Popen(
        [cli, "keys", "rotate", "--outbox", path, "--key-file", key_files[0], "--key-file", key_files[1],
         "--batch", str(int(p.get("batch", 1000))), "--json"],
        stdout=subprocess.PIPE, text=True,
    )
    during = _paced(send, rate, lambda: rotation.poll() is not None)
    rotation_s = time.perf_counter() - t0
    out, _ = rotation.communicate()
    done = json.loads(out) if rotation.returncode == 0 else {}
    left = rp.flush(600)
    st = rp.stats()
    if not p.get("keep"):
        for x in ("", "-wal", "-shm"):
            if os.path.exists(path + x):
                os.unlink(path + x)
        for kf in key_files:
            os.unlink(kf)
    return result(
        p, len(during), rotation_s, during,
        rows=n,
        rate=rate,
        rotation_s=rotation_s,
        rotation_exit=rotation.returncode,
        reencrypted=done.get("reencrypted"),
        rotation_left=done.get("left"),
        baseline=_latency_ms(baseline),
        during=_latency_ms(during),
        flush_left=left,
        pending=st["pending"],
        circuit=st["circuit"],
    )


# -- 6. drain --------------------------------------------------------------------------------


@scenario("fill")
def fill(p: Params) -> Result:
    """Write the drain template: N pending rows via SQLiteOutbox.enqueue in 10k batches
    (`encryption`: true stores them encrypted with `bench_key`, for a drain given it too)."""
    from outbox.stores.encryption import KeyRing
    from outbox.stores.sqlite import SQLiteOutbox

    n, topic = int(p["n"]), p["topic"]
    value = os.urandom(int(p["size"]))
    store = SQLiteOutbox(p["path"], synchronous="NORMAL")
    if p.get("encryption"):
        store.set_encryption(KeyRing([bench_key()]))
    t0 = start_clock()
    _enqueue(store, n, topic, value)
    store.close()
    return result(p, n, time.perf_counter() - t0)


def _enqueue(store: Any, n: int, topic: str, value: bytes) -> None:
    """N pending messages of `value`, with ids as a producer's, 10,000 per `enqueue`."""
    from outbox.records import NewMessage

    now = time.time()
    all_ids = ids(os.urandom(8).hex(), n)
    for k in range(0, n, 10_000):
        store.enqueue(
            [
                NewMessage(topic, value, None, [(ID_HEADER, m)], -1, m.decode(), 0, None, None, now)
                for m in all_ids[k : k + 10_000]
            ]
        )


@scenario("drain")
def drain(p: Params) -> Result:
    """Drainer(store, config).run(until_empty=True) over a copy of the template (`encryption`:
    true gives the drain `bench_key`, for a template filled with it)."""
    from outbox import Drainer
    from outbox.stores.sqlite import SQLiteOutbox

    path = os.path.join(p["workdir"], f"drain-{os.getpid()}.db")
    shutil.copyfile(p["template"], path)
    store = SQLiteOutbox(path)
    n = int(p["n"])
    # The defaults, as `Drainer(store, config)` gives them.
    drainer = Drainer(store, kafka_config(p, batch_stats=True), encryption=bench_key() if p.get("encryption") else None)
    t0 = start_clock(by_thread=True, topic=p["topic"])
    res = drainer.run(until_empty=True)
    seconds = time.perf_counter() - t0
    return result(
        p, n, seconds, main_stage="drain workers", delivered=res.delivered, remaining=res.remaining,
        retried=res.retried,
    )


@scenario("raw_rows")
def raw_rows(p: Params) -> Result:
    """Baseline of the drain: the same rows WITH THE SAME HEADERS (the stored ones plus the
    re-send's `outbox-attempt`), loaded into memory first, sent by a raw producer."""
    from outbox.headers import for_resend
    from outbox.stores.sqlite import SQLiteOutbox

    store = SQLiteOutbox(p["template"], create=False)
    with store:
        rows = [
            (r.topic, r.value, r.key, for_resend(
                r.headers, msg_id=r.msg_id, attempt=r.attempts + 1, first_failed_at=r.first_failed_at,
                last_error=r.last_error,
            ))
            for r in store.messages()
        ]
    n = len(rows)
    prod = Producer(kafka_config(p, batch_stats=True))
    produce, poll = prod.produce, prod.poll
    prod.list_topics(rows[0][0], timeout=10)
    t0 = start_clock(by_thread=True, topic=rows[0][0])
    for i, (topic, value, key, hdrs) in enumerate(rows):
        while True:
            try:
                produce(topic, value, key, headers=hdrs)  # type: ignore[arg-type]  # list is invariant
                break
            except BufferError:
                poll(0.005)
        if not i % 1000:
            poll(0)
    left = prod.flush(120)
    seconds = time.perf_counter() - t0
    return result(p, n, seconds, undelivered=left)


# -- 8. recovery -----------------------------------------------------------------------------


@scenario("recovery")
def recovery(p: Params) -> Result:
    """Recovery as a user feels it: steady keyed traffic at `rate` msgs/s through a full outage.

    A service produces 200 B messages over `keys` keys at a steady rate (fallback mode, default
    settings). The parent stops every broker (``DOWN``), starts them after the outage (``UP``),
    and the service keeps producing throughout. Measured: the outbox's pending rows over time
    (`stats()["pending"]`, the curve), when the outbox is empty again after ``UP``, and the
    latency (produce() → on_delivery) of messages produced after ``UP``.
    """
    from outbox import ResilientProducer

    topic, rate, nkeys = p["topic"], float(p["rate"]), int(p.get("keys", 1000))
    # Every 5 s, not every second: stats() counts the pending rows (0.77 s of CPU at 626k rows), and
    # sampled every second it took most of a core from the recovery it was measuring.
    max_wait, tail, sample_every = float(p["max_wait"]), float(p.get("tail", 3.0)), float(p.get("sample_s", 5.0))
    value = os.urandom(int(p["size"]))
    keys = [f"key-{i:04d}".encode() for i in range(nkeys)]
    path = os.path.join(p["workdir"], f"recovery-{os.getpid()}.db")
    # Where the drain runs: "threads" (the producer's defaults), "process" (drain_in="process":
    # the producer's drain workers in a child process of their own), or "sidecar"
    # (drain_workers=0 and `outbox drain --follow` beside it: the producer runs no callback for
    # the rows the sidecar delivers, so post-restart latency counts only first sends).
    where = p.get("drain", "threads")
    sidecar = where == "sidecar"
    opts: dict[str, Any] = {"drain_workers": 0} if sidecar else {"drain_in": where}
    rp = ResilientProducer(kafka_config(p), outbox=f"sqlite:///{path}", mode="fallback", **opts)
    drainer = None
    if sidecar:
        cli = os.path.join(os.path.dirname(sys.executable), "outbox")
        drainer = subprocess.Popen(
            [cli, "drain", "--outbox", path, "-b", p["bootstrap"], "--follow", "--workers", "2"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        # Also when this scenario fails: an orphaned sidecar drained a vanished cluster for hours.
        atexit.register(drainer.terminate)
    Producer(kafka_config(p)).list_topics(topic, timeout=10)
    events: dict[str, float] = {}

    def listen() -> None:
        for line in sys.stdin:
            events.setdefault(line.strip(), time.monotonic())

    threading.Thread(target=listen, daemon=True).start()
    after_up: list[float] = []  # latency (s) of each delivered message produced after UP
    sent_after_up = 0

    def delivered(t0: float, err: KafkaError | None, msg: Message | None) -> None:
        if err is None:
            after_up.append(time.monotonic() - t0)

    samples: list[tuple[float, int]] = []
    # Keys whose messages are stored behind their backlog, and first-try deliveries, over time:
    # whether keys get back to the fast path while the service keeps producing.
    keys_curve: list[tuple[float, int, int]] = []
    sent = 0
    burst = max(1, int(rate * 0.02))  # at most 20 ms of traffic per step: the loop stays responsive
    t_start = start_clock(by_thread=True, brokers=False)
    m0 = time.monotonic()
    state: dict[str, float] = {}
    finished = threading.Event()

    def sample() -> None:
        # Its own thread: stats() counts the store's rows (a scan), which must not pace the
        # application's produce loop (py-spy: it did, at ~1 s per call with 100k rows).
        ready = False
        while not finished.is_set():
            now = time.monotonic()
            st = rp.stats()
            samples.append((round(now - m0, 2), int(st["pending"] or 0)))
            keys_curve.append((round(now - m0, 2), st["keys_waiting"], st["delivered_first_try"]))
            if not ready and now - m0 >= 3:
                ready = True
                _say("READY")
            if "UP" in events and "empty" not in state and st["pending"] == 0 and st["unsaved"] == 0:
                state["empty"] = now
            finished.wait(max(0.0, sample_every - (time.monotonic() - now)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    while True:
        now = time.monotonic()
        due = min(int((now - m0) * rate), sent + burst)
        up = events.get("UP")
        while sent < due:
            if up is not None:
                rp.produce(topic, value, keys[sent % nkeys], on_delivery=functools.partial(delivered, now))
                sent_after_up += 1
            else:
                rp.produce(topic, value, keys[sent % nkeys])
            sent += 1
        empty_at = state.get("empty")
        if empty_at is not None and now - empty_at >= tail:
            break
        if up is not None and now - up >= max_wait:
            break
        time.sleep(0.002)
    finished.set()
    sampler.join()
    seconds = time.perf_counter() - t_start
    st = rp.stats()
    rp.close(30)  # waits for a drain child: its CPU counts in the result
    if drainer is not None:
        drainer.terminate()  # SIGTERM: a background shell may have left SIGINT ignored
        drainer.wait(60)
    drain_child_cpu = sum(os.times()[2:4])  # the drain process or sidecar, once waited for
    down, up = events.get("DOWN"), events.get("UP")
    lat = sorted(after_up)
    lost_or_late = sent_after_up - len(lat)  # produced after UP, not delivered by the end

    def pct(q: float) -> float | None:
        # Undelivered messages count as later than any delivered one.
        if not sent_after_up:
            return None
        k = int(q * (sent_after_up - 1))
        return lat[k] if k < len(lat) else None

    return result(
        p,
        sent,
        seconds,
        None,
        rate_wanted=rate,
        rate_achieved=sent / (time.monotonic() - m0),
        down_at=None if down is None else down - m0,
        up_at=None if up is None else up - m0,
        empty=empty_at is not None,
        empty_after_up_s=None if empty_at is None or up is None else empty_at - up,
        pending_at_up=next((n for t, n in samples if up is not None and t >= up - m0), None),
        pending_max=max((n for _, n in samples), default=0),
        pending_left=st["pending"],
        sent_after_up=sent_after_up,
        not_delivered_after_up=lost_or_late,
        drain=where,
        drain_child_cpu_us_per_msg=drain_child_cpu / sent * 1e6 if sent else None,
        latency_p50_s=pct(0.50),
        latency_p99_s=pct(0.99),
        delivered_from_outbox=st["delivered_from_outbox"],
        pending_curve=samples,
        keys_curve=keys_curve,
    )


# -- 8b. the event loop of an asyncio application through a full outage ---------------------

#: The probe: a task that sleeps `LAG_PERIOD` seconds at a time and records how late it wakes.
LAG_PERIOD = 0.001
# The same probe alone in a process of its own, run beside the application: how late this
# machine wakes a sleeping task anyway (the baseline; time.monotonic() is system-wide).
_PROBE_ALONE = """
import asyncio, sys, time
async def main():
    loop = asyncio.get_running_loop()
    period = float(sys.argv[2])
    with open(sys.argv[1], "w") as out:
        while True:
            t0 = loop.time()
            await asyncio.sleep(period)
            out.write(f"{time.monotonic()} {loop.time() - t0 - period}\\n")
asyncio.run(main())
"""


def _lag_summary(lags: list[tuple[float, float]], spans: dict[str, tuple[float, float]]) -> Result:
    """Max / p99 / p99.9 lateness (ms) of the wake-ups in each span, and how many were late by 20 ms+."""
    out: Result = {}
    for name, (a, b) in spans.items():
        ds = sorted(d for t, d in lags if a <= t <= b)
        if not ds:
            continue
        out[name] = {
            "max_ms": ds[-1] * 1000,
            "p99_ms": ds[int(0.99 * (len(ds) - 1))] * 1000,
            "p999_ms": ds[int(0.999 * (len(ds) - 1))] * 1000,
            "over_20ms": sum(d >= 0.020 for d in ds),
            "wakeups": len(ds),
        }
    return out


@scenario("loop_lag")
def loop_lag(p: Params) -> Result:
    """An asyncio service on AsyncResilientProducer through a full outage: how late its loop wakes.

    Tasks produce 200 B messages over `keys` keys at `rate` msgs/s (each awaits its produce()),
    and a probe task sleeps 1 ms at a time and records how late it wakes. The parent stops every
    broker mid-stream (``STOP`` before, ``DOWN`` once stopped) and starts them after the outage
    (``UP`` once they are up); the service runs until
    the outbox is empty again (plus a tail). The probe alone in a second process, at the same
    time, is the baseline: how late this machine wakes a task that has nothing else to do.
    """
    import asyncio

    from outbox.producer.aio import AsyncResilientProducer

    topic, rate, nkeys = p["topic"], float(p["rate"]), int(p.get("keys", 100))
    max_wait, tail = float(p["max_wait"]), float(p.get("tail", 2.0))
    value = os.urandom(int(p.get("size", 200)))
    keys = [f"key-{i:03d}".encode() for i in range(nkeys)]
    path = os.path.join(p["workdir"], f"loop-lag-{os.getpid()}.db")
    alone_log = os.path.join(p["workdir"], f"loop-lag-alone-{os.getpid()}.txt")
    alone = subprocess.Popen([sys.executable, "-c", _PROBE_ALONE, alone_log, str(LAG_PERIOD)])
    atexit.register(alone.kill)
    events: dict[str, float] = {}

    def listen() -> None:
        for line in sys.stdin:
            events.setdefault(line.strip(), time.monotonic())

    threading.Thread(target=listen, daemon=True).start()
    lags: list[tuple[float, float]] = []
    state: dict[str, float] = {}
    # The garbage collector's passes that took 5 ms or more: (monotonic end, generation, seconds,
    # CPU seconds of the collecting thread). A collection holds the interpreter lock throughout,
    # whichever thread triggered it; its CPU time is what it costs on an idle machine (on a loaded
    # one the wall time also counts the thread's waits for a core).
    gc_pauses: list[tuple[float, int, float, float]] = []
    gc_started = [0.0, 0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        if phase == "start":
            gc_started[:] = [now, cpu]
        elif now - gc_started[0] >= 0.005:
            gc_pauses.append((time.monotonic(), info["generation"], now - gc_started[0], cpu - gc_started[1]))

    gc.callbacks.append(on_gc)

    async def service() -> int:
        loop = asyncio.get_running_loop()
        if p.get("debug"):  # asyncio's debug mode: each callback that holds the loop 5 ms+ is logged
            loop.set_debug(True)
            loop.slow_callback_duration = 0.005
            logging.getLogger("asyncio").setLevel(logging.WARNING)
        ap = await AsyncResilientProducer.create(kafka_config(p), outbox=f"sqlite:///{path}", **p.get("options", {}))
        done = asyncio.Event()

        async def probe() -> None:
            while not done.is_set():
                t0 = loop.time()
                await asyncio.sleep(LAG_PERIOD)
                lags.append((time.monotonic(), loop.time() - t0 - LAG_PERIOD))

        sent = [0]

        async def writer(k0: int, step: int) -> None:
            m0 = time.monotonic()
            mine = 0
            while not done.is_set():
                due = int((time.monotonic() - m0) * rate / step)
                while mine < due:
                    await ap.produce(topic, value, keys[(k0 + mine * step) % nkeys])
                    mine += 1
                    sent[0] += 1
                await asyncio.sleep(0.005)

        async def watch() -> None:
            ready = False
            while True:
                await asyncio.sleep(0.5)
                now = time.monotonic()
                if not ready and now - state["m0"] >= 3:
                    ready = True
                    _say("READY")
                up = events.get("UP")
                if up is None:
                    continue
                if "empty" not in state:
                    st = await ap.stats()
                    if st["pending"] == 0 and st["unsaved"] == 0:  # (librdkafka always holds some: live traffic)
                        state["empty"] = time.monotonic()
                if "empty" in state and now - state["empty"] >= tail or now - up >= max_wait:
                    done.set()
                    return

        state["m0"] = time.monotonic()
        tasks = [probe(), watch(), *(writer(k, 4) for k in range(4))]
        await asyncio.gather(*tasks)
        state["end"] = time.monotonic()
        await ap.close(30)
        return sent[0]

    t_start = start_clock()
    sent = asyncio.run(service())
    seconds = time.perf_counter() - t_start
    with open(f"/proc/{alone.pid}/stat") as f:  # the probe alone's CPU is not the service's
        alone_cpu = sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13]) / os.sysconf("SC_CLK_TCK")
    alone.kill()
    alone.wait()
    alone_lags = []
    with open(alone_log) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2:
                alone_lags.append((float(parts[0]), float(parts[1])))
    m0, end = state["m0"], state["end"]
    stop, up = events.get("STOP", end), events.get("UP", end)
    empty = state.get("empty", end)
    spans = {  # the outage from the first broker's stop (STOP) to the last one's start (UP)
        "before": (m0 + 3, stop),
        "outage": (stop, up),
        "recovery": (up, empty),
        "whole": (stop, empty),
    }
    return result(
        p, sent, seconds, None,
        cpu_us_per_msg=(sum(os.times()[:4]) - _CPU0[0] - alone_cpu) / sent * 1e6 if _CPU0 and sent else None,
        rate_wanted=rate,
        rate_achieved=sent / (end - m0),
        empty_after_up_s=None if "empty" not in state else empty - up,
        lag=_lag_summary(lags, spans),
        # The ten latest wake-ups: (seconds after STOP, ms late), to see what they coincide with.
        gc_pauses=[(round(t - stop, 3), g, round(d * 1000, 1), round(c * 1000, 1)) for t, g, d, c in gc_pauses],
        phases_s={k: round(events[k] - stop, 1) for k in ("DOWN", "UP") if k in events} | (
            {"empty": round(empty - stop, 1)} if "empty" in state else {}),
        lag_worst=sorted(((round(t - stop, 3), round(d * 1000, 1)) for t, d in lags), key=lambda x: -x[1])[:10],
        lag_alone=_lag_summary(alone_lags, spans),
        loadavg=os.getloadavg(),
    )


@scenario("soak")
def soak(p: Params) -> Result:
    """A service that produces and consumes in one process through whole-cluster outages: is the
    memory an outage took given back?

    A thread produces `rate` msgs/s of `size` B over 1,000 keys (`ResilientProducer`, its
    defaults), and a `ResilientConsumer(RetryTopics([1]))` in another thread reads them back, 1 %
    failing once. The parent stops every broker (``STOP``, ``DOWN``) and starts them again
    (``UP``) `outages` times; after each, the child says ``CAUGHT_UP`` once the outbox is empty and
    every message was handled. RSS is sampled every 0.5 s: `rss_before_mb` is the median of the
    5 s before the first ``STOP``, `rss_after_mb` the median of the 5 s that follow `settle`
    seconds after the last catch-up.
    """
    from outbox import ResilientConsumer, ResilientProducer, RetryTopics
    from outbox.testing.cluster import create_topic

    rate, size, outages = float(p["rate"]), int(p.get("size", 1024)), int(p.get("outages", 2))
    warm, settle = float(p.get("warm_up", 20)), float(p.get("settle", 10))
    top = int(rate * (warm + 300 * outages))  # messages it could produce: the bitmaps' size
    topic = create_topic(p["bootstrap"], f"soak-{os.getpid()}", 3, p.get("rf"), None)
    events: dict[str, float] = {}
    threading.Thread(target=lambda: [events.setdefault(x.strip(), time.monotonic()) for x in sys.stdin],
                     daemon=True).start()
    # Bitmaps allocated before the first sample: what the benchmark itself holds does not grow.
    handled, failed = bytearray(top // 8 + 1), bytearray(top // 8 + 1)
    count = [0, 0]  # produced, handled (distinct)
    stop = threading.Event()

    def handler(msg: Message) -> None:
        i = int.from_bytes((msg.value() or b"")[:8], "big")
        byte, bit = divmod(i, 8)
        if i % 100 == 0 and not failed[byte] >> bit & 1:
            failed[byte] |= 1 << bit
            raise TimeoutError("fails once")
        if not handled[byte] >> bit & 1:
            handled[byte] |= 1 << bit
            count[1] += 1

    rp = ResilientProducer(kafka_config(p), outbox=f"sqlite:///{p['workdir']}/soak-{os.getpid()}.db")
    rc = ResilientConsumer(
        {"bootstrap.servers": p["bootstrap"], "group.id": f"soak-{os.getpid()}", "auto.offset.reset": "earliest"},
        topics=[topic], handler=handler, strategy=RetryTopics(delays=[1.0]),
        outbox=f"sqlite:///{p['workdir']}/soak-consumer-{os.getpid()}.db",
    )
    pad, keys = os.urandom(max(0, size - 8)), [b"key-%03d" % k for k in range(1000)]

    def produce() -> None:
        m0 = time.monotonic()
        while not stop.is_set() and count[0] < top:
            due = min(top, int((time.monotonic() - m0) * rate))
            while count[0] < due:
                i = count[0]
                rp.produce(topic, i.to_bytes(8, "big") + pad, keys[i % 1000])
                count[0] += 1
            time.sleep(0.005)

    def consume() -> None:
        while not stop.is_set():
            rc.poll_once()

    samples: list[tuple[float, float]] = []

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.monotonic(), rss_mb()))
            time.sleep(0.5)

    workers = [threading.Thread(target=f, daemon=True) for f in (produce, consume, sample)]
    for t in workers:
        t.start()
    start_clock()
    time.sleep(warm)
    _say("READY")
    caught_up: list[float] = []
    first_stop: float | None = None
    for _ in range(outages):
        while "UP" not in events:
            time.sleep(0.1)
        up, stopped = events.pop("UP"), events.pop("STOP")
        events.pop("DOWN", None)
        first_stop = stopped if first_stop is None else first_stop
        while True:
            time.sleep(0.5)
            st = rp.stats()
            if st["pending"] == 0 and count[1] >= count[0] - int(rate):  # within a second of live traffic
                break
            if time.monotonic() - up > 600:
                raise SystemExit("soak: not caught up 10 minutes after the cluster came back")
        caught_up.append(time.monotonic() - up)
        _say("CAUGHT_UP")
    time.sleep(settle + 5)
    stop.set()
    for t in workers:
        t.join(30)
    end = samples[-1][0]
    produced, got = count
    rp.close(30)
    rc.close(30)

    def median_between(a: float, b: float) -> float:
        xs = sorted(r for t, r in samples if a <= t <= b)
        return xs[len(xs) // 2]

    assert first_stop is not None
    before = median_between(first_stop - 5, first_stop)
    after = median_between(end - 5, end)
    return result(
        p, produced, end - samples[0][0], None,
        handled=got,
        rss_before_mb=before,
        rss_after_mb=after,
        growth_mb=after - before,
        caught_up_after_up_s=caught_up,
        rss_timeline=[(round(t - first_stop, 1), round(r, 1)) for t, r in samples[::4]],
    )


# -- 9. simple retry vs ResilientProducer during an outage -----------------------------------


def _outage_app(p: Params, send: Callable[[bytes], bool]) -> Result:
    """The application: wants to send `rate` msgs/s; runs until UP + tail seconds.

    `send` returns False when the message was given up (lost). Blocked time is the time the
    application thread spends inside `send`.
    """
    rate, tail = float(p["rate"]), float(p["tail"])
    value = os.urandom(int(p["size"]))
    up: list[float] = []
    _say("READY")
    t_go = _wait_line("GO")

    def wait_up() -> None:
        up.append(_wait_line("UP"))

    threading.Thread(target=wait_up, daemon=True).start()
    attempted = lost = 0
    blocked = 0.0
    longest = 0.0
    while True:
        now = time.monotonic()
        if up and now > up[0] + tail:
            break
        if attempted >= int((now - t_go) * rate):
            time.sleep(0.001)
            continue
        s = time.monotonic()
        ok = send(value)
        d = time.monotonic() - s
        blocked += d
        longest = max(longest, d)
        attempted += 1
        lost += not ok
    end = time.monotonic()
    wanted = int((end - t_go) * rate)
    return {
        "outage_s": up[0] - t_go,
        "window_s": end - t_go,
        "wanted": wanted,
        "attempted": attempted,
        "not_attempted_backlog": max(0, wanted - attempted),
        "lost": lost,
        "blocked_s": blocked,
        "longest_call_s": longest,
    }


@scenario("simple_retry")
def simple_retry(p: Params) -> Result:
    """What a user writes without an outbox: tenacity around a blocking produce()+flush()."""
    import tenacity

    topic = p["topic"]
    # 5 s per attempt instead of librdkafka's 300 s, so that a retry happens at all.
    prod = Producer({**kafka_config(p), "message.timeout.ms": 5000})

    class SendFailed(Exception):
        pass

    @tenacity.retry(
        stop=tenacity.stop_after_attempt(3),
        wait=tenacity.wait_exponential(multiplier=1, max=10),
        retry=tenacity.retry_if_exception_type(SendFailed),
        reraise=True,
    )
    def send_once(value: bytes) -> None:
        box: list[KafkaError | None] = []
        prod.produce(topic, value, on_delivery=lambda err, msg: box.append(err))
        prod.flush(10)
        if not box or box[0] is not None:
            raise SendFailed(str(box[0]) if box else "no delivery report")

    def send(value: bytes) -> bool:
        try:
            send_once(value)
            return True
        except SendFailed:
            return False

    r = _outage_app(p, send)
    return {**r, "n": r["attempted"], "seconds": r["window_s"]}


@scenario("resilient_retry")
def resilient_retry(p: Params) -> Result:
    """The same application on ResilientProducer: produce() never blocks, nothing is lost."""
    from outbox import ResilientProducer

    topic = p["topic"]
    path = os.path.join(p["workdir"], f"retry-{os.getpid()}.db")
    rp = ResilientProducer(kafka_config(p), outbox=f"sqlite:///{path}", mode="fallback")

    def send(value: bytes) -> bool:
        rp.produce(topic, value)
        return True

    r = _outage_app(p, send)
    # Lost = neither delivered nor in the outbox once the backlog had time to drain.
    deadline = time.monotonic() + float(p["settle"])
    rp.flush(60)
    while time.monotonic() < deadline:
        st = rp.stats()
        if st["delivered"] >= r["attempted"]:
            break
        time.sleep(0.25)
    st = rp.stats()
    r["delivered"] = st["delivered"]
    r["still_in_outbox"] = st["pending"]
    # Dead letters are stored, not lost: a long outage can exhaust the retry policy's attempts.
    r["dead"] = st["dead"]
    r["lost"] = r["attempted"] - st["delivered"] - st["pending"] - (st["dead"] or 0)
    r["outboxed"] = st["outboxed"]
    return {**r, "n": r["attempted"], "seconds": r["window_s"]}


# -- 8. the consumer side (benchmarks/bench_consumer.py's loops, one per child) ----------------


@scenario("consumer")
def consumer(p: Params) -> Result:
    """One consumer loop over the parent's filled topic: ``loop`` is "raw" (a confluent_kafka.Consumer
    ``consume(500)`` loop), "happy" (ResilientConsumer, nothing failing), "fail" (1 % failing once)
    or "precision" (how late each retry tier hands out its messages). Same handler in every loop."""
    from . import bench_consumer as bc

    loop, n = p["loop"], int(p["n"])
    if loop == "precision":
        return {"n": n, "precision": bc.run_precision(p["bootstrap"], p["workdir"], n)}
    if loop == "raw":
        s = bc.run_raw(p["bootstrap"], p["topic"], n)
    else:
        s = bc.run_resilient(p["bootstrap"], p["topic"], n, p["workdir"], failing=loop == "fail")
    # bench_consumer times from the first message handled to the last (group joins not counted);
    # its CPU is the process's, all threads, over the same span plus the join.
    size = int(p.get("size", 200))
    return {"n": n, "size": size, "seconds": s["seconds"], "msgs_per_s": s["msgs_s"],
            "mb_per_s": s["msgs_s"] * size / 1e6, "cpu_us_per_msg": s["cpu_us"], "retried": s.get("retried")}


# -- 9. the consumer's inbox (benchmarks/bench_dedup.py's loops, one per child) -----------------


@scenario("dedup")
def dedup(p: Params) -> Result:
    """One ResilientConsumer over the parent's topic of messages with outbox-ids, on the store
    ``store``: ``loop`` is "plain" (dedup off), "dedup" (handler(msg)) or "dedup-tx" (handler(msg, tx))."""
    from . import bench_dedup as bd

    n = int(p["n"])
    s = bd.run(p["bootstrap"], p["topic"], n, p["store"], p["loop"])
    return {"n": n, "size": 200, "seconds": s["seconds"], "msgs_per_s": s["msgs_s"],
            "mb_per_s": s["msgs_s"] * 200 / 1e6, "cpu_us_per_msg": s["cpu_us"]}


# -- entry point -----------------------------------------------------------------------------


def main() -> None:
    name, params = sys.argv[1], json.loads(sys.argv[2])
    out = SCENARIOS[name](params)
    out["peak_rss_mb"] = peak_rss_mb()
    sys.stdout.write("RESULT " + json.dumps(out) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip producer/store teardown: not measured, and slow with brokers down


if __name__ == "__main__":
    main()
