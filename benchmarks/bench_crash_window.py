"""A keyed burst with a callback each: the default producer and write-ahead "batch" mode beside the raw
producer, and write-ahead's crash window.

Standalone (not collected by pytest):

    python benchmarks/bench_crash_window.py            # 5 interleaved repetitions of 100,000 messages
    python benchmarks/bench_crash_window.py --quick    # 2 repetitions of 30,000
    KAFKA_BOOTSTRAP_SERVERS=host:9092 python benchmarks/bench_crash_window.py

Without KAFKA_BOOTSTRAP_SERVERS a local outbox.testing.KafkaCluster of one broker is started.
What is measured: one thread produces a burst of 200 B messages over 50 keys, each with its own
delivery callback, as fast as `produce()` returns, then waits until every one is delivered.
Repetitions are interleaved (raw, fallback, write-ahead, raw, ...), each producer new and warmed
up; `ResilientProducer`s with their defaults otherwise (fallback: the happy path users run).
Printed per producer: the median throughput to the last delivery, the ratio of the medians
(to raw), the process's CPU time (all threads) per message, and for write-ahead the
crash window: the most messages accepted and not yet committed (`stats()["unsaved"]`, sampled
every 2,000 calls), which is what a `kill -9` at that moment loses.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from confluent_kafka import Producer  # noqa: E402

from outbox import ResilientProducer  # noqa: E402
from outbox.testing import KafkaCluster  # noqa: E402
from outbox.testing.cluster import create_topic  # noqa: E402

TOPIC = f"bench-crash-window-{os.urandom(4).hex()}"
VALUE = b"v" * 200
KEYS = [b"key-%d" % k for k in range(50)]
SAMPLE = 2000


class Heard:
    """The application's delivery callback: counts the deliveries it hears."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, err: object, msg: object) -> None:
        if err is None:
            self.n += 1


def unsaved(producer: ResilientProducer) -> int:
    """What a `kill -9` now would lose: accepted, not yet committed."""
    return int(producer.stats()["unsaved"])


def burst(producer: Any, n: int, sample: Any = None) -> tuple[float, float, int]:
    """Produce `n` keyed messages with callbacks, then wait for every delivery.

    Returns (messages/s, CPU µs per message, the most `sample()` returned)."""
    heard = Heard()
    most = 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i in range(n):
        while True:
            try:
                producer.produce(TOPIC, VALUE, KEYS[i % 50], on_delivery=heard)
                break
            except BufferError:  # the raw producer's full queue: wait for room, as its users do
                producer.poll(0.005)
        if not i % 1000:
            producer.poll(0)
        if sample is not None and not i % SAMPLE:
            most = max(most, sample())
    deadline = time.monotonic() + 120
    while heard.n < n:
        assert time.monotonic() < deadline, f"{n - heard.n} messages not delivered within 120 s"
        producer.flush(1)
    seconds = time.perf_counter() - t0
    return n / seconds, (time.process_time() - cpu0) * 1e6 / n, most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    reps, n = (2, 30_000) if args.quick else (5, 100_000)
    with ExitStack() as stack:
        bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        if not bootstrap:
            bootstrap = stack.enter_context(KafkaCluster(brokers=1)).bootstrap_servers
        create_topic(bootstrap, TOPIC, partitions=3, replication_factor=1)
        workdir = stack.enter_context(tempfile.TemporaryDirectory())
        config = {"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all", "enable.idempotence": True}
        rows: dict[str, list[tuple[float, float, int]]] = {"raw": [], "fallback": [], "write-ahead": []}
        for rep in range(reps):
            raw = Producer(config)
            raw.produce(TOPIC, b"warm-up")
            raw.flush(30)
            rows["raw"].append(burst(raw, n))
            fallback = ResilientProducer(config, outbox=f"sqlite:///{workdir}/f-{rep}.db")
            fallback.produce(TOPIC, b"warm-up")
            fallback.flush(30)
            rows["fallback"].append(burst(fallback, n))
            fallback.close()
            wa = ResilientProducer(config, outbox=f"sqlite:///{workdir}/o-{rep}.db", mode="write-ahead")
            wa.produce(TOPIC, b"warm-up")
            wa.flush(30)
            rows["write-ahead"].append(burst(wa, n, functools.partial(unsaved, wa)))
            wa.close()
        base = statistics.median(r[0] for r in rows["raw"])
        print(f"{n:,} messages of {len(VALUE)} B over 50 keys, a callback each, {reps} interleaved repetitions")
        print(f"{'producer':<12} {'msgs/s':>10} {'ratio':>6} {'CPU µs/msg':>11} {'crash window (most unsaved)':>28}")
        for name, got in rows.items():
            rate = statistics.median(r[0] for r in got)
            cpu = statistics.median(r[1] for r in got)
            window = f"{max(r[2] for r in got):,}" if name == "write-ahead" else "-"
            print(f"{name:<12} {rate:>10,.0f} {rate / base:>6.2f} {cpu:>11.1f} {window:>28}")


if __name__ == "__main__":
    main()
