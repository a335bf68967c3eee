"""ResilientConsumer against a raw confluent_kafka.Consumer loop, and the retry tiers' delay precision.

Standalone (not collected by pytest):

    python benchmarks/bench_consumer.py                  # 2,000,000 messages, 3 interleaved repetitions
    python benchmarks/bench_consumer.py --quick          # 50,000 messages, 2 repetitions
    KAFKA_BOOTSTRAP_SERVERS=host:9092 python benchmarks/bench_consumer.py

Without KAFKA_BOOTSTRAP_SERVERS a local outbox.testing.KafkaCluster (--brokers, default 1) is started.
What is measured (200-byte values, 3 partitions, a fresh group per run, every consumer fetching at
full speed (`FULL_SPEED_FETCH`), clock from the first message to the last one handled, so group
joins are not counted):
    raw          a confluent_kafka.Consumer ``consume(500)`` loop calling the handler, auto commit
    happy        ResilientConsumer(RetryTopics([0.0])) with the same handler, nothing failing
    fail-1%      the same with 1 % of the messages failing once on the main topic (handled from retry-1)
    precision    300 messages failing on the main topic and each tier but the last of
                 RetryTopics([0.5, 1, 2]): handled time minus (failure time + the tier's delay),
                 p50 / p99 per tier, in ms
Repetitions are interleaved (raw, happy, fail-1%, raw, ...); figures are medians, ratios are
against raw in the same run; CPU µs/msg is the process's CPU time (all threads) per message.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from confluent_kafka import Consumer, Message, Producer  # noqa: E402

from outbox import ResilientConsumer, RetryTopics  # noqa: E402
from outbox.consumer import headers as H  # noqa: E402
from outbox.testing import KafkaCluster  # noqa: E402
from outbox.testing.cluster import create_topic  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
Sample = dict[str, float]

# Every loop's consumer, raw or not, fetches at full speed. librdkafka postpones a partition's next
# fetch by `fetch.queue.backoff.ms` (1 s by default) once its fetch queue is over the thresholds
# (`queued.min.messages`, `queued.max.messages.kbytes`); a loop that empties the queue within that second then
# waits for the rest of it. A few hundred thousand 200-byte messages fill the queue once, so a run
# read either at full speed or a second slower, by chance, and that second, not the loop, was most
# of what the ratios measured.
FULL_SPEED_FETCH = {"fetch.queue.backoff.ms": 10}


def fill(bootstrap: str, topic: str, n: int, size: int) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.size": 1_000_000, "acks": "all"})
    pad = b"x" * max(0, size - 8)
    for i in range(n):
        while True:
            try:
                p.produce(topic, b"%08d" % i + pad, key=b"k%d" % (i % 1000))
                break
            except BufferError:
                p.poll(0.05)
        if i % 10000 == 0:
            p.poll(0)
    assert p.flush(120) == 0


def fails_once(value: bytes) -> bool:
    return int(value[:8]) % 100 == 0


class Counter:
    """The handler every loop calls: counts, and (when asked) fails 1 % of main-topic messages once.

    Every loop pays for the same predicate, so that the ratios compare the loops, not the handlers.
    """

    def __init__(self, main: str | None) -> None:
        self.n = 0
        self.first: float | None = None
        self.main = main

    def __call__(self, msg: Message) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        if fails_once(msg.value() or b"0") and self.main is not None and msg.topic() == self.main:
            raise TimeoutError("fails once")
        self.n += 1


def measure(loop: Callable[[], None], counter: Counter, n: int) -> Sample:
    cpu0 = time.process_time()
    loop()
    end = time.perf_counter()
    cpu = time.process_time() - cpu0
    assert counter.first is not None and counter.n == n, counter.n
    secs = end - counter.first
    return {"msgs_s": n / secs, "cpu_us": cpu * 1e6 / n, "seconds": secs}


def run_raw(bootstrap: str, topic: str, n: int) -> Sample:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-raw-{uuid.uuid4().hex[:8]}",
                  "auto.offset.reset": "earliest", **FULL_SPEED_FETCH})
    c.subscribe([topic])
    counter = Counter(None)

    def loop() -> None:
        while counter.n < n:
            for m in c.consume(500, 0.1):
                if m.error() is None:
                    counter(m)

    try:
        return measure(loop, counter, n)
    finally:
        c.close()


def run_resilient(bootstrap: str, topic: str, n: int, workdir: str, *, failing: bool) -> Sample:
    group = f"bench-rc-{uuid.uuid4().hex[:8]}"
    counter = Counter(topic if failing else None)
    rc = ResilientConsumer(
        {"bootstrap.servers": bootstrap, "group.id": group, **FULL_SPEED_FETCH},
        topics=[topic],
        handler=counter,
        strategy=RetryTopics(delays=[0.0]),
        outbox=f"sqlite:///{workdir}/{group}.db",
    )

    def loop() -> None:
        while counter.n < n:
            rc.poll_once()

    try:
        sample = measure(loop, counter, n)
        sample["retried"] = rc.stats()["retried"]
        return sample
    finally:
        rc.close()


def run_precision(bootstrap: str, workdir: str, count: int) -> dict[str, dict[str, float]]:
    topic = create_topic(bootstrap, f"bench-precision-{uuid.uuid4().hex[:6]}", 3, None, None)
    fill(bootstrap, topic, count, 200)
    delays = [0.5, 1.0, 2.0]
    group = f"bench-prec-{uuid.uuid4().hex[:8]}"
    tiers = {topic: 0, **{f"{topic}.{group}.retry-{k}": k for k in (1, 2, 3)}}
    failed_at: dict[tuple[bytes, int], float] = {}
    lateness: dict[int, list[float]] = {1: [], 2: [], 3: []}
    done: set[bytes] = set()

    def handle(msg: Message) -> None:
        now = time.time()
        k = tiers[msg.topic() or ""]
        v = msg.value() or b""
        if k:
            lateness[k].append(now - failed_at[(v, k - 1)] - delays[k - 1])
            assert now >= int(dict(msg.headers() or [])[H.DUE_AT] or 0) / 1000
        if k < 3:
            failed_at[(v, k)] = now
            raise TimeoutError("again")
        done.add(v)

    rc = ResilientConsumer({"bootstrap.servers": bootstrap, "group.id": group}, topics=[topic], handler=handle,
                           strategy=RetryTopics(delays=delays), outbox=f"sqlite:///{workdir}/{group}.db")
    try:
        deadline = time.monotonic() + 120
        while len(done) < count and time.monotonic() < deadline:
            rc.poll_once()
    finally:
        rc.close()
    out: dict[str, dict[str, float]] = {}
    for k, xs in lateness.items():
        xs.sort()
        out[f"retry-{k} ({delays[k - 1]:g} s)"] = {
            "n": len(xs),
            "p50_ms": 1000 * xs[len(xs) // 2],
            "p99_ms": 1000 * xs[min(len(xs) - 1, int(len(xs) * 0.99))],
            "min_ms": 1000 * xs[0],
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=2_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--size", type=int, default=200)
    ap.add_argument("--brokers", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.messages, args.reps = 50_000, 2
    logging.basicConfig(level=logging.WARNING)
    cluster = None
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        cluster = KafkaCluster(brokers=args.brokers).start()
        bootstrap = cluster.bootstrap_servers
    try:
        with tempfile.TemporaryDirectory(prefix="bench-consumer-") as workdir:
            topic = create_topic(bootstrap, f"bench-consumer-{uuid.uuid4().hex[:6]}", 3, None, None)
            t0 = time.perf_counter()
            fill(bootstrap, topic, args.messages, args.size)
            print(f"filled {args.messages:,} messages in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
            runs: dict[str, list[Sample]] = {"raw": [], "happy": [], "fail-1%": []}
            for rep in range(args.reps):
                runs["raw"].append(run_raw(bootstrap, topic, args.messages))
                runs["happy"].append(run_resilient(bootstrap, topic, args.messages, workdir, failing=False))
                runs["fail-1%"].append(run_resilient(bootstrap, topic, args.messages, workdir, failing=True))
                print(f"rep {rep + 1}: " + ", ".join(f"{k} {v[-1]['msgs_s']:,.0f}/s" for k, v in runs.items()),
                      file=sys.stderr)
            precision = run_precision(bootstrap, workdir, 300)
    finally:
        if cluster is not None:
            cluster.close()
    med = {k: {f: statistics.median(s[f] for s in v) for f in ("msgs_s", "cpu_us")} for k, v in runs.items()}
    base = med["raw"]["msgs_s"]
    targets = {"raw": None, "happy": 0.90, "fail-1%": 0.80}
    print(f"\n{args.messages:,} messages x {args.reps} reps, {args.size} B, {args.brokers} broker(s), medians")
    # Two ratios: of the medians, and the median of each repetition's ratio to the raw run just
    # before it (pairs cancel the shared machine's drift between repetitions).
    paired = {k: statistics.median(s["msgs_s"] / r["msgs_s"] for s, r in zip(v, runs["raw"], strict=True))
              for k, v in runs.items()}
    print("| loop | msgs/s | ratio of medians | median paired ratio | CPU µs/msg | target | met (paired)? |")
    print("|---|---|---|---|---|---|---|")
    for k, m in med.items():
        ratio = m["msgs_s"] / base
        t = targets[k]
        met = "-" if t is None else ("yes" if paired[k] >= t else "no")
        target = "" if t is None else f">= {t}"
        print(f"| {k} | {m['msgs_s']:,.0f} | {ratio:.2f} | {paired[k]:.2f} | {m['cpu_us']:.2f} | {target} | {met} |")
    print("\n| tier | n | p50 late ms | p99 late ms | min ms |")
    print("|---|---|---|---|---|")
    for tier, st in precision.items():
        print(f"| {tier} | {st['n']:.0f} | {st['p50_ms']:.1f} | {st['p99_ms']:.1f} | {st['min_ms']:.1f} |")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{_dt.date.today().isoformat()}-consumer{'-quick' if args.quick else ''}.json"
    out.write_text(json.dumps({"args": vars(args), "runs": runs, "medians": med, "paired_ratios": paired,
                               "precision": precision},
                              indent=2))
    print(f"\nsaved {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
