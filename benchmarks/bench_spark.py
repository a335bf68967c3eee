"""Spark bulk drain vs the CLI drain on the same outbox; the job's rate vs --partitions.

Standalone (not collected by pytest)::

    python benchmarks/bench_spark.py --rows 100000 --reps 3 --partitions 1,2,4
    python benchmarks/bench_spark.py --backend postgresql --postgres postgresql://outbox:outbox@127.0.0.1/postgres

Every repetition refills the outbox with the same rows (SQLite: a copy of one template file;
PostgreSQL: a fresh table filled in batches of 5,000), then runs each variant once, in
interleaved order (spark p=1, p=2, p=4, cli, spark p=1, ...), so background load on a shared
machine hits every variant alike. Reported: medians of delivered rows per second, measured
from the start of the drain to the last row marked (Spark session start-up is excluded: it is
paid once per job, not per row). Kafka: $KAFKA_BOOTSTRAP_SERVERS, or a local 3-broker
outbox.testing.KafkaCluster.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after PYTHONPATH: the Spark workers see PYTHONPATH only

from outbox.records import NewMessage  # noqa: E402
from outbox.stores import open_outbox  # noqa: E402

VALUE = b"v" * 200  # PERF-NOTES' message size


def fill(url: str, topic: str, rows: int, keys: int) -> None:
    with open_outbox(url) as store:
        for start in range(0, rows, 5000):
            store.enqueue(
                [
                    NewMessage(
                        topic=topic, value=VALUE, key=f"k{i % keys}".encode(),
                        headers=[("outbox-id", f"b{i}".encode())], msg_id=f"b{i}",
                    )
                    for i in range(start, min(rows, start + 5000))
                ]
            )


class Outboxes:
    """Fresh, identically filled outboxes, one per run."""

    def __init__(self, backend: str, rows: int, keys: int, topic: str, work: str, pg: str | None) -> None:
        self.backend, self.rows, self.keys, self.topic, self.work, self.pg = backend, rows, keys, topic, work, pg
        self.n = 0
        if backend == "sqlite":
            self.template = os.path.join(work, "template.db")
            fill(f"sqlite:///{self.template}", topic, rows, keys)

    def fresh(self) -> str:
        self.n += 1
        if self.backend == "sqlite":
            path = os.path.join(self.work, f"run{self.n}.db")
            shutil.copyfile(self.template, path)
            return f"sqlite:///{path}"
        assert self.pg is not None
        sep = "&" if "?" in self.pg else "?"
        url = f"{self.pg}{sep}table=bench_{self.n}_{uuid.uuid4().hex[:6]}"
        fill(url, self.topic, self.rows, self.keys)
        return url


def spark_run(spark: Any, url: str, bootstrap: str, partitions: int) -> float:
    from spark_drain import JobOptions, run_job

    report = run_job(spark, JobOptions(outbox=url, bootstrap_servers=bootstrap, partitions=partitions))
    assert report.total.delivered == report.total.read, report.to_dict()
    return report.total.delivered / report.elapsed_seconds


def cli_run(url: str, bootstrap: str, rows: int, workers: int) -> float:
    code = "from outbox_cli.main import main; main()"
    # The caller's PYTHONPATH first, as for the Spark workers: both variants use the same outbox code.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p))
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code, "drain", "--outbox", url, "-b", bootstrap, "--workers", str(workers), "--json"],
        capture_output=True, text=True, env=env, timeout=1800,
    )
    elapsed = time.perf_counter() - started
    if out.returncode not in (0, 3):  # 3: the drain stopped with rows still pending (retrying)
        raise RuntimeError(f"outbox drain failed ({out.returncode}): {out.stderr[-2000:]}")
    result = json.loads(out.stdout)
    if result["remaining"]:
        print(f"  cli drain left {result['remaining']} rows pending ({result['retried']} retried)",
              file=sys.stderr, flush=True)
    return int(result["delivered"]) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--partitions", default="1,2,4")
    ap.add_argument("--cli-workers", default="1,2", help="CLI drain --workers values ('' to skip the CLI)")
    ap.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    ap.add_argument("--postgres", help="PostgreSQL server URL (default: the test harness's server)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--json", dest="json_path", help="also write the results here")
    args = ap.parse_args()
    parts = [int(p) for p in args.partitions.split(",") if p]
    workers = [int(w) for w in args.cli_workers.split(",") if w]

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    cluster = None
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        from outbox.testing import KafkaCluster

        cluster = KafkaCluster(brokers=3).start()
        bootstrap = cluster.bootstrap_servers
    from pyspark.sql import SparkSession

    from outbox.testing import create_topic
    from outbox.testing.maven import jdbc_jar

    topic = create_topic(bootstrap, f"bench-spark-{uuid.uuid4().hex[:8]}", partitions=6)
    spark = (
        SparkSession.builder.master(args.master).appName("bench_spark")
        .config("spark.jars", f"{jdbc_jar('postgresql')},{jdbc_jar('sqlite')}")
        .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    work = tempfile.mkdtemp(prefix="bench-spark-")
    results: dict[str, list[float]] = {f"spark p={p}": [] for p in parts}
    results.update({f"cli drain workers={w}": [] for w in workers})
    try:
        if args.backend == "postgresql" and not args.postgres:
            from outbox.testing.postgres import ensure_server

            args.postgres = ensure_server()
        boxes = Outboxes(args.backend, args.rows, args.keys, topic, work, args.postgres)
        spark_run(spark, boxes.fresh(), bootstrap, parts[0])  # warm-up: JVM, JDBC driver, workers
        for rep in range(args.reps):
            for p in parts:
                rate = spark_run(spark, boxes.fresh(), bootstrap, p)
                results[f"spark p={p}"].append(rate)
                print(f"rep {rep + 1}: spark p={p}: {rate:,.0f} rows/s", file=sys.stderr, flush=True)
            for w in workers:
                rate = cli_run(boxes.fresh(), bootstrap, args.rows, w)
                results[f"cli drain workers={w}"].append(rate)
                print(f"rep {rep + 1}: cli workers={w}: {rate:,.0f} rows/s", file=sys.stderr, flush=True)
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
        if cluster is not None:
            cluster.close()

    base = statistics.median(results[f"spark p={parts[0]}"])
    print(f"\n{args.rows:,} rows, {args.keys} keys, {args.backend}, {args.master}, "
          f"medians of {args.reps} interleaved runs")
    print(f"{'variant':<22} {'rows/s':>10} {'vs spark p=' + str(parts[0]):>16}   runs")
    for name, rates in results.items():
        med = statistics.median(rates)
        runs = ", ".join(f"{r:,.0f}" for r in rates)
        print(f"{name:<22} {med:>10,.0f} {med / base:>15.2f}x   {runs}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"args": vars(args), "rows_per_s": results}, indent=2))


if __name__ == "__main__":
    main()
