"""ResilientConsumer(dedup=True) against the same consumer without dedup, on SQLite and PostgreSQL stores.

Standalone (not collected by pytest):

    python -m benchmarks.bench_dedup                 # 100,000 messages, 3 interleaved repetitions
    python -m benchmarks.bench_dedup --n 20000 --reps 2

Without KAFKA_BOOTSTRAP_SERVERS a local outbox.testing.KafkaCluster (1 broker) is started; the
PostgreSQL store is a new database on OUTBOX_TEST_POSTGRES or a server outbox.testing starts.
The topic holds 200-byte values, each with its own `outbox-id` header, 3 partitions; a fresh group
per run; clock from the first message handled to the last (bench_consumer.measure). Loops:
    plain           ResilientConsumer, nothing failing, dedup off (the baseline of each store)
    dedup           dedup=True, handler(msg): marks per poll batch (SQLite: one lookup before it, one insert
                    after it; PostgreSQL: inserted in one statement as its transaction opens)
    dedup-tx        dedup=True, handler(msg, tx): one transaction per poll batch (the marks inserted when it
                    opens), a savepoint per message (a handler that writes nothing: the inbox's own cost)
Repetitions are interleaved; figures are medians; ratios are against `plain` on the same store in
the same run; CPU µs/msg is the process's CPU time (all threads) per message.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import uuid
from typing import Any

from confluent_kafka import Message, Producer

from outbox import ResilientConsumer, RetryTopics
from outbox.testing import KafkaCluster
from outbox.testing.cluster import create_topic

from .bench_consumer import FULL_SPEED_FETCH, Counter, Sample, measure

LOOPS = ("plain", "dedup", "dedup-tx")


def fill_with_ids(bootstrap: str, topic: str, n: int, size: int = 200) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.size": 1_000_000, "acks": "all"})
    pad = b"x" * max(0, size - 8)
    for i in range(n):
        while True:
            try:
                p.produce(topic, b"%08d" % i + pad, key=b"k%d" % (i % 1000), headers=[("outbox-id", b"id-%d" % i)])
                break
            except BufferError:
                p.poll(0.05)
    assert p.flush(120) == 0


def store_urls(workdir: str) -> dict[str, str]:
    """The stores compared: a SQLite file in `workdir`, and a new PostgreSQL database
    (OUTBOX_TEST_POSTGRES's server, or one outbox.testing starts)."""
    from outbox.testing.postgres import create_database, ensure_server

    return {
        "sqlite": f"sqlite:///{workdir}/dedup-consumer.db",
        "postgresql": create_database(os.environ.get("OUTBOX_TEST_POSTGRES") or ensure_server()),
    }


def run(bootstrap: str, topic: str, n: int, store: str, loop: str) -> Sample:
    counter = Counter(None)
    handler: Any = counter
    if loop == "dedup-tx":
        def handler(m: Message, tx: Any) -> None:
            counter(m)
    rc = ResilientConsumer(
        {"bootstrap.servers": bootstrap, "group.id": f"bench-dedup-{uuid.uuid4().hex[:8]}", **FULL_SPEED_FETCH},
        topics=[topic], handler=handler, strategy=RetryTopics(delays=[0.0]), outbox=store, dedup=loop != "plain",
    )

    def consume() -> None:
        while counter.n < n:
            rc.poll_once()

    try:
        return measure(consume, counter, n)
    finally:
        rc.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stores", default="sqlite,postgresql")
    args = ap.parse_args()
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    cluster = None if bootstrap else KafkaCluster(brokers=1).start()
    bootstrap = bootstrap or cluster.bootstrap_servers  # type: ignore[union-attr]
    try:
        topic = create_topic(bootstrap, f"bench-dedup-{uuid.uuid4().hex[:6]}", 3, None, None)
        fill_with_ids(bootstrap, topic, args.n)
        with tempfile.TemporaryDirectory() as work:
            stores = {k: v for k, v in store_urls(work).items() if k in args.stores.split(",")}
            samples: dict[tuple[str, str], list[Sample]] = {}
            for rep in range(args.reps):
                for kind, url in stores.items():
                    for loop in LOOPS:
                        s = run(bootstrap, topic, args.n, url, loop)
                        samples.setdefault((kind, loop), []).append(s)
                        print(f"rep {rep + 1} {kind:10} {loop:9} {s['msgs_s']:>10,.0f} msg/s "
                              f"{s['cpu_us']:>6.1f} CPU µs/msg", file=sys.stderr)
        print(f"\n{args.n:,} messages of 200 B, 3 partitions, medians of {args.reps} interleaved repetitions")
        print(f"{'store':10} {'loop':9} {'msg/s':>10} {'ratio':>6} {'CPU µs/msg':>11}")
        for kind in stores:
            base = statistics.median(s["msgs_s"] for s in samples[(kind, "plain")])
            for loop in LOOPS:
                rate = statistics.median(s["msgs_s"] for s in samples[(kind, loop)])
                cpu = statistics.median(s["cpu_us"] for s in samples[(kind, loop)])
                print(f"{kind:10} {loop:9} {rate:>10,.0f} {rate / base:>6.2f} {cpu:>11.1f}")
        return 0
    finally:
        if cluster is not None:
            cluster.close()


if __name__ == "__main__":
    sys.exit(main())
