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

import functools
import json
import logging
import os
import shutil
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

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


def kafka_config(p: Params, **extra: Any) -> dict[str, Any]:
    """The happy-path producer settings of issue 7: acks=all, idempotent, linger.ms=5."""
    return {
        "bootstrap.servers": p["bootstrap"],
        "acks": "all",
        "enable.idempotence": True,
        "linger.ms": 5,
        **extra,
    }


_CPU0: list[float] = []


def start_clock() -> float:
    """Start of the timed part: wall clock, and process CPU time (all threads, librdkafka's too)."""
    t = os.times()
    _CPU0[:] = [t.user + t.system]
    return time.perf_counter()


def result(p: Params, n: int, seconds: float, lat: list[int] | None = None, **extra: Any) -> Result:
    size = int(p.get("size", 200))
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
        "cpu_us_per_msg": (sum(os.times()[:2]) - _CPU0[0]) / n * 1e6 if _CPU0 and n else None,
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
    n, topic, every = int(p["n"]), p["topic"], int(p["sample"])
    value = os.urandom(int(p["size"]))
    prod = Producer(kafka_config(p))
    produce, poll = prod.produce, prod.poll
    prefix = os.urandom(8).hex()
    header = bool(p["header"])
    lat: list[int] = []
    pc = time.perf_counter_ns
    prod.list_topics(topic, timeout=10)  # metadata + connections up front, as the wrapper's are
    t0 = start_clock()
    for i in range(n):
        # The id is built per message, exactly like the wrapper's IdGenerator (minus its lock).
        hdrs = [(ID_HEADER, f"{prefix}{i:016x}".encode())] if header else None
        if i % every:
            while True:
                try:
                    produce(topic, value, headers=hdrs)
                    break
                except BufferError:
                    poll(0.005)
        else:
            s = pc()
            while True:
                try:
                    produce(topic, value, headers=hdrs)
                    break
                except BufferError:
                    poll(0.005)
            lat.append(pc() - s)
        if not i % 1000:
            poll(0)  # serve delivery reports, as any real producing loop must
    left = prod.flush(120)
    seconds = time.perf_counter() - t0
    return result(p, n, seconds, lat, undelivered=left)


# -- 2./3. ResilientProducer happy paths -----------------------------------------------------


def _wait_delivered(rp: Any, n: int, timeout: float = 300) -> int:
    """flush(), then wait until `n` deliveries were reported (flush() alone can return while
    write-ahead rows are committed but not yet handed to librdkafka)."""
    rp.flush(timeout)
    deadline = time.monotonic() + timeout
    while rp._delivered + rp._drain_delivered < n and time.monotonic() < deadline:
        time.sleep(0.002)
        rp.flush(timeout)
    return int(rp._delivered + rp._drain_delivered)


@scenario("resilient")
def resilient(p: Params) -> Result:
    """ResilientProducer, circuit closed, brokers up: fallback or write-ahead."""
    from outbox import ResilientProducer

    n, topic, every = int(p["n"]), p["topic"], int(p["sample"])
    value = os.urandom(int(p["size"]))
    threads = int(p.get("threads", 1))
    path = os.path.join(p["workdir"], f"resilient-{os.getpid()}.db")
    rp = ResilientProducer(
        kafka_config(p), outbox=f"sqlite:///{path}", mode=p["mode"], durability=p.get("durability", "batch")
    )
    rp._kafka.list_topics(topic, timeout=10)
    flush_early = 0
    lats: list[list[int]] = [[] for _ in range(threads)]

    def loop(k: int, count: int) -> None:
        produce = rp.produce
        lat = lats[k]
        pc = time.perf_counter_ns
        for i in range(count):
            if i % every:
                produce(topic, value)
            else:
                s = pc()
                produce(topic, value)
                lat.append(pc() - s)

    t0 = start_clock()
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
    if rp._delivered + rp._drain_delivered < n - rp._outboxed:
        flush_early = n - rp._outboxed - rp._delivered - rp._drain_delivered
    delivered = _wait_delivered(rp, n - rp._outboxed)
    seconds = time.perf_counter() - t0
    st = rp.stats()
    return result(
        p,
        n,
        seconds,
        [x for lat in lats for x in lat],
        delivered=delivered,
        outboxed=st["outboxed"],
        pending=st["pending"],
        flush_left=left,
        flush_returned_before_delivery=flush_early,
        threads=threads,
    )


# -- 5. the naive durable approach -----------------------------------------------------------


@scenario("naive")
def naive(p: Params) -> Result:
    """Commit each message to SQLite (own transaction, synchronous=FULL), then produce it.

    Deliveries are deleted in one transaction per 1,000 messages — kinder to the naive
    approach than one DELETE transaction per message, so the speed-up we report is a floor.
    """
    from outbox.codec import encode_headers
    from outbox.stores.sqlite import SQLiteOutbox

    n, topic, every = int(p["n"]), p["topic"], int(p["sample"])
    value = os.urandom(int(p["size"]))
    path = os.path.join(p["workdir"], f"naive-{os.getpid()}.db")
    store = SQLiteOutbox(path, synchronous="FULL")
    conn = store._conn()
    prod = Producer(kafka_config(p))
    prod.list_topics(topic, timeout=10)
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
        hdrs = [(ID_HEADER, msg_id.encode())]
        now = time.time()
        conn.execute("BEGIN IMMEDIATE")
        row_id = conn.execute(insert, (msg_id, topic, None, value, encode_headers(hdrs), -1, 0, 0, now, now)).lastrowid
        conn.execute("COMMIT")
        prod.produce(topic, value, headers=hdrs, on_delivery=functools.partial(report, row_id))
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
    """Brokers down, circuit open: produce N into the outbox; done when flush() returns 0."""
    from outbox import ResilientProducer

    n, topic, every = int(p["n"]), p["topic"], int(p["sample"])
    value = os.urandom(int(p["size"]))
    path = os.path.join(p["workdir"], f"spill-{os.getpid()}.db")
    rp = ResilientProducer(kafka_config(p), outbox=f"sqlite:///{path}", mode="fallback")
    rp.circuit.trip("benchmark: brokers are down")
    marks = {n * q // 4 - 1: q * 25 for q in (1, 2, 3, 4)}
    rss: dict[str, float] = {"0": rss_mb()}
    backlog: dict[str, int] = {}  # accepted but not yet committed, at each quarter
    lat: list[int] = []
    produce = rp.produce
    pc = time.perf_counter_ns
    t0 = start_clock()
    for i in range(n):
        if i % every:
            produce(topic, value)
        else:
            s = pc()
            produce(topic, value)
            lat.append(pc() - s)
        if i in marks:
            rss[str(marks[i])] = rss_mb()
            backlog[str(marks[i])] = rp.writer.pending()
    left = rp.flush(600)
    seconds = time.perf_counter() - t0
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
        db_path=path,
        db_mb=db_mb,
    )


@scenario("sqlite_batch")
def sqlite_batch(p: Params) -> Result:
    """Baseline of the spill: the same rows, executemany in 1,000-row FULL transactions."""
    from outbox.codec import encode_headers
    from outbox.stores.sqlite import SQLiteOutbox

    n, topic = int(p["n"]), p["topic"]
    value = os.urandom(int(p["size"]))
    path = os.path.join(p["workdir"], f"sqlite-{os.getpid()}.db")
    store = SQLiteOutbox(path, synchronous="FULL")
    conn = store._conn()
    now = time.time()
    # Exactly the columns SQLiteOutbox._insert writes for a spilled message.
    rows = [
        (
            m.decode(),
            topic,
            None,
            value,
            encode_headers([(ID_HEADER, m)]),
            -1,
            0,
            0,
            now,
            None,
            None,
            now,
            "not sent: circuit open",
            None,
        )
        for m in ids(os.urandom(8).hex(), n)
    ]
    sql = (
        "INSERT INTO outbox (msg_id, topic, key, value, headers, partition, status, attempts, "
        "created_at, first_failed_at, last_failed_at, next_attempt_at, last_error, lease_owner) "
        "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
    )
    t0 = start_clock()
    for k in range(0, n, 1000):
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(sql, rows[k : k + 1000])
        conn.execute("COMMIT")
    seconds = time.perf_counter() - t0
    return result(p, n, seconds)


# -- 6. drain --------------------------------------------------------------------------------


@scenario("fill")
def fill(p: Params) -> Result:
    """Write the drain template: N pending rows via SQLiteOutbox.enqueue in 10k batches."""
    from outbox.records import NewMessage
    from outbox.stores.sqlite import SQLiteOutbox

    n, topic = int(p["n"]), p["topic"]
    value = os.urandom(int(p["size"]))
    store = SQLiteOutbox(p["path"], synchronous="NORMAL")
    now = time.time()
    t0 = start_clock()
    all_ids = ids(os.urandom(8).hex(), n)
    for k in range(0, n, 10_000):
        store.enqueue(
            [
                NewMessage(topic, value, None, [(ID_HEADER, m)], -1, m.decode(), 0, None, None, now)
                for m in all_ids[k : k + 10_000]
            ]
        )
    store.close()
    return result(p, n, time.perf_counter() - t0)


@scenario("drain")
def drain(p: Params) -> Result:
    """Drainer(...).run(until_empty=True) over a copy of the template."""
    from outbox import Drainer
    from outbox.stores.sqlite import SQLiteOutbox

    path = os.path.join(p["workdir"], f"drain-{os.getpid()}.db")
    shutil.copyfile(p["template"], path)
    store = SQLiteOutbox(path)
    n = int(p["n"])
    drainer = Drainer(store, kafka_config(p), workers=int(p["workers"]), batch_size=int(p["batch"]))
    t0 = start_clock()
    res = drainer.run(until_empty=True)
    seconds = time.perf_counter() - t0
    return result(p, n, seconds, delivered=res.delivered, remaining=res.remaining, retried=res.retried)


@scenario("raw_rows")
def raw_rows(p: Params) -> Result:
    """Baseline of the drain: the same rows, loaded into memory first, sent by a raw producer."""
    from outbox.codec import decode_headers

    conn = sqlite3.connect(p["template"])
    rows = [
        (t, v, k, decode_headers(h))
        for t, v, k, h in conn.execute("SELECT topic, value, key, headers FROM outbox ORDER BY id")
    ]
    conn.close()
    n = len(rows)
    prod = Producer(kafka_config(p))
    produce, poll = prod.produce, prod.poll
    prod.list_topics(rows[0][0], timeout=10)
    t0 = start_clock()
    for i, (topic, value, key, hdrs) in enumerate(rows):
        while True:
            try:
                produce(topic, value, key, headers=hdrs)
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
    """Spill N with brokers down; after UP, time until the outbox is empty, traffic continuing."""
    from outbox import ResilientProducer

    n, topic = int(p["n"]), p["topic"]
    value = os.urandom(int(p["size"]))
    rate = float(p["rate"])
    path = os.path.join(p["workdir"], f"recovery-{os.getpid()}.db")
    rp = ResilientProducer(kafka_config(p), outbox=f"sqlite:///{path}", mode="fallback")
    rp.circuit.trip("benchmark: brokers are down")
    for _ in range(n):
        rp.produce(topic, value)
    rp.flush(600)
    spilled = rp.stats()["pending"]
    _say("READY")
    t_up = _wait_line("UP")
    # New traffic at `rate` msgs/s, paced in 10 ms slices, until the outbox is empty.
    sent = 0
    empty_at: float | None = None
    samples: list[tuple[float, int]] = []
    next_check = t_up
    deadline = t_up + float(p["max_wait"])
    while True:
        now = time.monotonic()
        due = int((now - t_up) * rate)
        while sent < due:
            rp.produce(topic, value)
            sent += 1
        if now >= next_check:
            pending = rp.store.stats(now=time.time()).pending
            samples.append((round(now - t_up, 2), pending))
            if pending == 0 and rp.writer.pending() == 0:
                empty_at = now
                break
            next_check = now + 0.25
        if now > deadline:
            break
        time.sleep(0.01)
    seconds = (empty_at or time.monotonic()) - t_up
    st = rp.stats()
    return result(
        p,
        spilled,
        seconds,
        None,
        empty=empty_at is not None,
        new_traffic_sent=sent,
        new_traffic_rate=sent / seconds if seconds else None,
        target_rate=rate,
        delivered_from_outbox=st["delivered_from_outbox"],
        pending_left=st["pending"],
        pending_curve=samples[:: max(1, len(samples) // 20)],
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
    prod = Producer(kafka_config(p, **{"message.timeout.ms": 5000}))

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
    r["lost"] = r["attempted"] - st["delivered"] - st["pending"]
    r["outboxed"] = st["outboxed"]
    return {**r, "n": r["attempted"], "seconds": r["window_s"]}


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
