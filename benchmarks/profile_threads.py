"""CPU µs per message of each thread of a producing process: where the outbox path's time goes.

Standalone (not collected by pytest):

    python benchmarks/profile_threads.py                       # write-ahead, 300,000 messages
    python benchmarks/profile_threads.py --mode fallback --messages 500000

A local one-broker cluster (`outbox.testing.KafkaCluster`), a topic of 3 partitions, 200-byte
unkeyed values, `acks=all`. After 20,000 warm-up messages it produces `--messages` as fast as
`produce()` returns, flushes, and prints the rate and each thread's CPU time (from
`/proc/self/task`, named after the Python thread that owns it) divided by the messages.
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
import threading
import time

from confluent_kafka import Producer

from outbox import ResilientProducer
from outbox.testing import KafkaCluster


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each thread of this process, by thread name (summed per name)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in glob.glob(f"/proc/{os.getpid()}/task/*"):
        try:
            with open(f"{task}/comm") as f:
                comm = f.read().strip()
            with open(f"{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        name = names.get(int(task.rsplit("/", 1)[1]), comm)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("write-ahead", "fallback"), default="write-ahead")
    ap.add_argument("--messages", type=int, default=300_000)
    args = ap.parse_args()
    n = args.messages
    with KafkaCluster(brokers=1) as cluster, tempfile.TemporaryDirectory() as tmp:
        cluster.create_topic("profile", partitions=3)
        config = {"bootstrap.servers": cluster.bootstrap_servers, "acks": "all", "linger.ms": 5}
        Producer(config).list_topics("profile", timeout=10)
        value = os.urandom(200)
        producer = ResilientProducer(config, outbox=os.path.join(tmp, "o.db"), mode=args.mode)
        for _ in range(20_000):
            producer.produce("profile", value)
        producer.flush(60)
        before = thread_cpu()
        started = time.perf_counter()
        for _ in range(n):
            producer.produce("profile", value)
        producer.flush(120)
        seconds = time.perf_counter() - started
        after = thread_cpu()
        outboxed = producer.stats()["outboxed"]
        producer.close(30)
    print(f"{args.mode}: {n / seconds:,.0f} msgs/s; {outboxed:,} went through the outbox")
    spent = {name: cpu - before.get(name, 0.0) for name, cpu in after.items()}
    for name, cpu in sorted(spent.items(), key=lambda kv: -kv[1]):
        if cpu > 0.005:
            print(f"  {name:22s} {cpu / n * 1e6:6.2f} µs/msg")
    print(f"  {'all threads':22s} {sum(spent.values()) / n * 1e6:6.2f} µs/msg")


if __name__ == "__main__":
    main()
