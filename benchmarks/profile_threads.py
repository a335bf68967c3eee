"""CPU µs per message of each thread of a producing process: where the outbox path's time goes.

Standalone (not collected by pytest):

    python benchmarks/profile_threads.py                       # write-ahead, 300,000 messages
    python benchmarks/profile_threads.py --mode fallback --messages 500000
    python benchmarks/profile_threads.py --mode drain --messages 500000 [--workers 2] [--batch 5000]
    python benchmarks/profile_threads.py --mode raw --brokers 3          # the raw producer, for scale

A local cluster (`outbox.testing.KafkaCluster`, one broker unless `--brokers`), a topic of 3 partitions, 200-byte
unkeyed values, `acks=all`. After 20,000 warm-up messages it produces `--messages` as fast as
`produce()` returns, flushes, and prints the rate and each thread's CPU time (from
`/proc/self/task`, named after the Python thread that owns it) divided by the messages.
In `drain` mode it stores the messages first (`enqueue`, 10,000 at a time, as `make bench`'s drain
template) and measures `Drainer(workers=W, batch_size=B).run(until_empty=True)` instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from confluent_kafka import Producer  # noqa: E402

from benchmarks.threadcpu import BROKERS, ThreadCPU  # noqa: E402
from outbox import Drainer, ResilientProducer  # noqa: E402
from outbox.headers import ID_HEADER  # noqa: E402
from outbox.records import NewMessage  # noqa: E402
from outbox.stores.base import Outbox  # noqa: E402
from outbox.stores.sqlite import SQLiteOutbox  # noqa: E402
from outbox.testing import KafkaCluster  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("write-ahead", "fallback", "drain", "raw"), default="write-ahead")
    ap.add_argument("--messages", type=int, default=300_000)
    ap.add_argument("--workers", type=int, default=2, help="drain mode: Drainer workers")
    ap.add_argument("--batch", type=int, default=5000, help="drain mode: rows per claim")
    ap.add_argument("--brokers", type=int, default=1, help="brokers (the topic's replication factor: up to 3)")
    args = ap.parse_args()
    n = args.messages
    with KafkaCluster(brokers=args.brokers) as cluster, tempfile.TemporaryDirectory() as tmp:
        cluster.create_topic("profile", partitions=3)
        config = {"bootstrap.servers": cluster.bootstrap_servers, "acks": "all", "enable.idempotence": True,
                  "linger.ms": 5}
        Producer(config).list_topics("profile", timeout=10)
        value = os.urandom(200)
        if args.mode == "drain":
            report(args.mode, n, *drain(config, os.path.join(tmp, "d.db"), value, n, args.workers, args.batch))
            return
        if args.mode == "raw":
            report(args.mode, n, *raw(config, value, n))
            return
        producer = ResilientProducer(config, outbox=os.path.join(tmp, "o.db"), mode=args.mode)
        for _ in range(20_000):
            producer.produce("profile", value)
        producer.flush(60)
        cpu = ThreadCPU(brokers_parent=os.getpid())
        cpu.start()
        started = time.perf_counter()
        for _ in range(n):
            producer.produce("profile", value)
        producer.flush(120)
        seconds = time.perf_counter() - started
        spent = cpu.stop()
        outboxed = producer.stats()["outboxed"]
        producer.close(30)
    report(args.mode, n, seconds, spent, f"{outboxed:,} went through the outbox")


Profile = tuple[float, dict[str, float], str]  # seconds, CPU by thread name, note


def drain(config: dict[str, object], path: str, value: bytes, n: int, workers: int, batch: int) -> Profile:
    """Drain `n` stored messages with `workers` workers claiming `batch` rows at a time (after
    an unmeasured drain of 100,000, which warms the brokers up as the other modes' 20,000 do)."""

    def store_messages(store: Outbox, start: int, count: int) -> None:
        for k in range(start, start + count, 10_000):
            ids = [f"{os.getpid():016x}{i:016x}" for i in range(k, min(k + 10_000, start + count))]
            store.enqueue([NewMessage("profile", value, None, [(ID_HEADER, m.encode())], -1, m) for m in ids])

    with SQLiteOutbox(path, synchronous="NORMAL") as store:
        drainer = Drainer(store, config, workers=workers, batch_size=batch)
        store_messages(store, 0, 100_000)
        drainer.run(until_empty=True)
        store_messages(store, 100_000, n)
        cpu = ThreadCPU(brokers_parent=os.getpid())
        cpu.start()
        started = time.perf_counter()
        res = drainer.run(until_empty=True)
        seconds = time.perf_counter() - started
        spent = cpu.stop()
    return seconds, spent, f"{res.delivered:,} delivered, {res.remaining:,} left"


def raw(config: dict[str, object], value: bytes, n: int) -> Profile:
    """The baseline: a confluent_kafka.Producer sending `n` messages with an id header each."""
    producer = Producer(config)
    Header = tuple[str, str | bytes | None]
    headers: list[list[Header]] = [[(ID_HEADER, f"{i:032x}".encode())] for i in range(n + 20_000)]

    def send(start: int, count: int) -> None:
        for i in range(start, start + count):
            while True:
                try:
                    producer.produce("profile", value, headers=headers[i])
                    break
                except BufferError:
                    producer.poll(0.005)
            if not i % 1000:
                producer.poll(0)
        producer.flush(120)

    send(0, 20_000)  # warm-up
    cpu = ThreadCPU(brokers_parent=os.getpid())
    cpu.start()
    started = time.perf_counter()
    send(20_000, n)
    seconds = time.perf_counter() - started
    return seconds, cpu.stop(), "raw confluent_kafka.Producer, id header"


def report(mode: str, n: int, seconds: float, spent: dict[str, float], note: str) -> None:
    print(f"{mode}: {n / seconds:,.0f} msgs/s; {note}")
    brokers = spent.pop(BROKERS, 0.0)
    for name, cpu in sorted(spent.items(), key=lambda kv: -kv[1]):
        if cpu > 0.005:
            print(f"  {name:22s} {cpu / n * 1e6:6.2f} µs/msg")
    print(f"  {'all threads':22s} {sum(spent.values()) / n * 1e6:6.2f} µs/msg")
    print(f"  {BROKERS:22s} {brokers / n * 1e6:6.2f} µs/msg; machine: {os.cpu_count()} cores, "
          f"{(sum(spent.values()) + brokers) / seconds:.2f} busy on average")


if __name__ == "__main__":
    main()
