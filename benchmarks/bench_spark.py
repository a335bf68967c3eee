"""Spark bulk drain vs `outbox drain --until-empty` on copies of one outbox, wall time start-up included;
the job's rate against executor count on a Spark standalone cluster; a paper sizing of a large cluster.

Standalone (not collected by pytest)::

    python benchmarks/bench_spark.py                      # 1,000,000 rows
    python benchmarks/bench_spark.py --drain-rows 200000  # a quick run

Every run drains a copy of one template SQLite outbox (200 B values, 1,000 keys) as a process of
its own, timed from its start to its exit: `python -m spark_drain --master local[2] --partitions 2`
(Spark's start-up included) and `outbox drain --until-empty`, interleaved `--reps` times so that
background load hits both alike. Then a standalone cluster (`outbox.testing.spark_cluster`, two
one-core workers) drains a copy with 1 and with 2 executors (`spark.cores.max`). Kafka:
$KAFKA_BOOTSTRAP_SERVERS, or a local 3-broker outbox.testing.KafkaCluster.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

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


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the process and its children, stdout) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({out.returncode}): {out.stderr[-2000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return wall, cpu, out.stdout


def _env(**extra: str) -> dict[str, str]:
    # The caller's PYTHONPATH first, then this checkout: every process runs the same outbox code.
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    return dict(os.environ, PYTHONPATH=path, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
                SPARK_LOCAL_IP="127.0.0.1", **extra)


def spark_drain(url: str, bootstrap: str, master: str, cores_max: int | None = None) -> tuple[float, float]:
    """(wall, CPU) of `python -m spark_drain` draining `url` to empty."""
    extra = {}
    if cores_max is not None:  # one core per executor on the test bed's workers
        extra["PYSPARK_SUBMIT_ARGS"] = f"--conf spark.cores.max={cores_max} pyspark-shell"
    wall, cpu, out = timed(
        [sys.executable, "-m", "spark_drain", "--master", master, "--outbox", url, "--bootstrap-servers",
         bootstrap, "--partitions", "2"], _env(**extra),
    )
    assert "TOTAL" in out, out
    return wall, cpu


def cli_drain(url: str, bootstrap: str) -> tuple[float, float]:
    """(wall, CPU) of `outbox drain --until-empty` draining `url`."""
    code = "from outbox_cli.main import main; main()"
    wall, cpu, _ = timed(
        [sys.executable, "-c", code, "drain", "--outbox", url, "-b", bootstrap, "--until-empty"], _env()
    )
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drain-rows", type=int, default=1_000_000)
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--no-standalone", action="store_true", help="skip the standalone cluster's runs")
    ap.add_argument("--json", dest="json_path", help="also write the results here")
    args = ap.parse_args()
    rows = args.drain_rows

    cluster = None
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        from outbox.testing import KafkaCluster

        cluster = KafkaCluster(brokers=3).start()
        bootstrap = cluster.bootstrap_servers
    from outbox.testing import create_topic

    topic = create_topic(bootstrap, f"bench-spark-{uuid.uuid4().hex[:8]}", partitions=6)
    work = tempfile.mkdtemp(prefix="bench-spark-")
    walls: dict[str, list[float]] = {"spark local[2]": [], "outbox drain": []}
    cpus: dict[str, list[float]] = {"spark local[2]": [], "outbox drain": []}
    try:
        boxes = Outboxes("sqlite", rows, args.keys, topic, work, None)
        for rep in range(args.reps):
            for name in ("outbox drain", "spark local[2]"):
                url = boxes.fresh()
                if name == "outbox drain":
                    wall, cpu = cli_drain(url, bootstrap)
                else:
                    wall, cpu = spark_drain(url, bootstrap, "local[2]")
                walls[name].append(wall)
                cpus[name].append(cpu)
                print(f"rep {rep + 1}: {name}: {wall:.1f} s ({rows / wall:,.0f} rows/s)", file=sys.stderr, flush=True)
                os.remove(url.removeprefix("sqlite:///"))
        if not args.no_standalone:
            from outbox.testing.spark_cluster import SparkStandalone

            with SparkStandalone(workers=2) as sa:
                for n in (1, 2):
                    name = f"standalone, {n} executor(s)"
                    url = boxes.fresh()
                    wall, cpu = spark_drain(url, bootstrap, sa.master_url, cores_max=n)
                    walls[name], cpus[name] = [wall], [cpu]
                    print(f"{name}: {wall:.1f} s", file=sys.stderr, flush=True)
                    os.remove(url.removeprefix("sqlite:///"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if cluster is not None:
            cluster.close()

    cli = statistics.median(walls["outbox drain"])
    print(f"\n{rows:,} rows, {args.keys} keys, SQLite copies, 3 brokers; wall time from process start to exit, "
          f"medians of {args.reps}; load {os.getloadavg()[0]:.1f}")
    print(f"{'variant':<28} {'seconds':>8} {'rows/s':>10} {'vs outbox drain':>16} {'CPU us/row':>11}")
    for name, ws in walls.items():
        w = statistics.median(ws)
        cpu_us = statistics.median(cpus[name]) / rows * 1e6
        print(f"{name:<28} {w:>8.1f} {rows / w:>10,.0f} {w / cli:>15.2f}x {cpu_us:>11.1f}")
    spark = statistics.median(walls["spark local[2]"])
    print("CPU: of the processes the drain waited for (all of the CLI's; of Spark the Python driver only: "
          "its JVM and the Python workers under it are not waited for): a lower bound for Spark")
    verdict = "met" if spark <= 1.5 * cli else "NOT met"
    print(f"target: spark local[2] <= 1.5x outbox drain: {verdict} ({spark / cli:.2f}x)")
    if "standalone, 1 executor(s)" in walls:
        print(paper(rows / walls["standalone, 1 executor(s)"][0], rows / walls["standalone, 2 executor(s)"][0]))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"args": vars(args), "walls": walls, "cpus": cpus}, indent=2))


def paper(one: float, two: float) -> str:
    """A 16-executor cluster draining a fleet's PostgreSQL outbox, on paper, from measured rates."""
    return (
        "\npaper: 16 executors draining a fleet's PostgreSQL outbox\n"
        f"  measured here (start-up included): 1 executor {one:,.0f} rows/s, 2 executors {two:,.0f} rows/s "
        f"({two / one:.2f}x on this 2-core machine)\n"
        f"  each executor sends and settles its own key range with its own producer and connection: "
        f"16 x {one:,.0f} = {16 * one:,.0f} rows/s if nothing else binds\n"
        "  what binds first: the database's deletes (one DELETE per 5,000 rows and executor, 16 at a time), "
        "then the brokers' produce rate;\n"
        f"  100 M rows at 16 x the 1-executor rate: {100e6 / (16 * one) / 60:,.0f} min plus start-up"
    )


if __name__ == "__main__":
    main()
