"""Before against after: the producer's scenarios from two checkouts, in alternating pairs.

    python -m benchmarks.compare BEFORE_DIR AFTER_DIR [--reps 6] [--messages 500000] [--cases ...]

Each checkout's `benchmarks.scenarios` children run with that checkout as their import root, on
one local 3-broker cluster, at 200 B: A B, then B A, and so on, so a drift of the machine's
speed falls on both. Printed per case: each side's median CPU µs per message (the process's,
all threads) and wall-clock msgs/s, and the medians of the pairs' after/before ratios, with
their spread.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.__main__ import Runner
from outbox.testing import KafkaCluster, create_topic

#: Each case: a scenario of `benchmarks.scenarios` ("resilient" unless it says) and its parameters.
CASES: dict[str, dict[str, Any]] = {
    "fallback": {"mode": "fallback"},
    "fallback-only-error": {"mode": "fallback", "only_errors": True},
    "fallback-on-delivery": {"mode": "fallback", "on_delivery": True},
    # As most services produce: 1,000 keys in turn, a callback for every message.
    "fallback-keyed": {"mode": "fallback", "on_delivery": True, "keys": 1000},
    "write-ahead": {"mode": "write-ahead", "durability": "batch"},
    # The outage spill: the circuit tripped, every message stored (no broker answers there).
    "spill": {"scenario": "spill", "bootstrap": "127.0.0.1:1", "circuit_reset_timeout": 3600},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--messages", type=int, default=500_000)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="outbox-compare-")
    sides = {"before": Runner(work, args.before.resolve()), "after": Runner(work, args.after.resolve())}
    with KafkaCluster(brokers=3) as cluster:
        bootstrap = cluster.bootstrap_servers
        topic = create_topic(bootstrap, f"compare-{int(time.time())}", 3, 3, {"min.insync.replicas": "2"})
        common = {"bootstrap": bootstrap, "topic": topic, "sample": 64, "n": args.messages, "size": 200}
        sides["before"].run("raw", {**common, "header": True})  # warm-up: brokers, page cache
        for case in args.cases.split(","):
            cpu: dict[str, list[float]] = {"before": [], "after": []}
            rate: dict[str, list[float]] = {"before": [], "after": []}
            for rep in range(args.reps):
                for side in ("before", "after") if rep % 2 == 0 else ("after", "before"):
                    params = {**common, **CASES[case]}
                    scenario = params.pop("scenario", "resilient")
                    got = sides[side].run(scenario, params)
                    cpu[side].append(got["cpu_us_per_msg"])
                    rate[side].append(got["msgs_per_s"])
            for what, samples, fmt in (("CPU µs/msg", cpu, ".2f"), ("msgs/s", rate, ",.0f")):
                ratios = [a / b for a, b in zip(samples["after"], samples["before"], strict=True)]
                print(
                    f"{case}: {what}, medians: before {statistics.median(samples['before']):{fmt}}, "
                    f"after {statistics.median(samples['after']):{fmt}}; after/before, median of {len(ratios)} "
                    f"pairs: {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
