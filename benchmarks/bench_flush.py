"""produce() then flush(), one message at a time: ResilientProducer against confluent_kafka.Producer.

Standalone (not collected by pytest):

    python benchmarks/bench_flush.py              # 3 interleaved repetitions of 500 round trips each
    python benchmarks/bench_flush.py --quick      # 2 repetitions of 200
    KAFKA_BOOTSTRAP_SERVERS=host:9092 python benchmarks/bench_flush.py

Without KAFKA_BOOTSTRAP_SERVERS a local outbox.testing.KafkaCluster of one broker is started.
What is measured: a service that must know a message is safe before it answers (a request
handler that produces one event, then flushes). Each round trip is `produce()` of one 100 B
message with a key, then `flush()`, on a 1-partition topic, `linger.ms: 0`, both producers
alive in one process and both warmed up. Repetitions are interleaved (confluent, resilient,
confluent, ...). Printed: the median, p90 and p99 round trip of each, the ratio of the medians
(resilient / confluent: lower is better, 1.0 is the baseline), and the process's CPU time (all
threads) per round trip.
"""

from __future__ import annotations

import argparse
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

TOPIC = "bench-flush"
VALUE = b"v" * 100


def round_trips(producer: Any, n: int) -> tuple[list[float], float]:
    """`n` produce-then-flush round trips: their times (ms) and the CPU µs per round trip."""
    times = []
    cpu0 = time.process_time()
    for i in range(n):
        t = time.perf_counter()
        producer.produce(TOPIC, VALUE, b"key-%d" % (i % 10))
        left = producer.flush(30)
        times.append((time.perf_counter() - t) * 1000)
        assert left == 0, f"{left} message(s) not delivered within 30 s"
    return times, (time.process_time() - cpu0) * 1e6 / n


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n", type=int, default=500, help="round trips per repetition")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    reps, n = (2, 200) if args.quick else (args.reps, args.n)
    with ExitStack() as stack:
        bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        if not bootstrap:
            bootstrap = stack.enter_context(KafkaCluster(brokers=1)).bootstrap_servers
        create_topic(bootstrap, TOPIC, 1, 1)
        config = {"bootstrap.servers": bootstrap, "linger.ms": 0}
        outbox_dir = stack.enter_context(tempfile.TemporaryDirectory())
        resilient = ResilientProducer(config, outbox=f"sqlite:///{outbox_dir}/outbox.db")
        stack.callback(resilient.close)
        producers: dict[str, Any] = {"confluent_kafka.Producer": Producer(config), "ResilientProducer": resilient}
        for p in producers.values():
            round_trips(p, 50)  # connections, metadata, the first batches
        times: dict[str, list[float]] = {name: [] for name in producers}
        cpu: dict[str, list[float]] = {name: [] for name in producers}
        for _ in range(reps):
            for name, p in producers.items():
                t, c = round_trips(p, n)
                times[name] += t
                cpu[name].append(c)
        base = statistics.median(times["confluent_kafka.Producer"])
        print(f"produce() then flush(), {reps} × {n} round trips each, interleaved:")
        for name in producers:
            median = statistics.median(times[name])
            print(
                f"{name:26} median {median:6.2f} ms  p90 {pct(times[name], 0.9):6.2f} ms  "
                f"p99 {pct(times[name], 0.99):6.2f} ms  ratio {median / base:5.2f}  "
                f"CPU {statistics.median(cpu[name]):6.0f} µs/round trip"
            )


if __name__ == "__main__":
    main()
