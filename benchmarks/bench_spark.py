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
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after PYTHONPATH: the Spark workers see PYTHONPATH only

from outbox.records import NewMessage  # noqa: E402
from outbox.stores import open_outbox  # noqa: E402

VALUE = b"v" * 200  # the benchmarks' message size (docs/benchmarks.md)


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


def tree(pid: int) -> list[int]:
    """A process and all its descendants now (/proc)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            continue
        found.append(p)
    return found


def _status(pid: int, field: str) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field + ":")), "")
    except FileNotFoundError:
        return ""


def live_heap(pid: int) -> int:
    """Bytes a JVM's live objects hold: `jcmd GC.class_histogram` collects the heap first (so the
    JVM's resident size, which tells how far its heap has grown, is not what is measured)."""
    out = subprocess.run(["jcmd", str(pid), "GC.class_histogram"], capture_output=True, text=True, timeout=60)
    total = [line.split() for line in out.stdout.splitlines() if line.startswith("Total")]
    return int(total[-1][2]) if total else 0


def timed(
    cmd: list[str], env: dict[str, str], *, heap_every: float | None = None
) -> tuple[float, float, str, int, int]:
    """(wall seconds, CPU seconds of the process and its children, stdout, peak resident bytes of
    the process and its descendants, sampled every 0.1 s, and the peak of its JVMs' live heaps,
    sampled every `heap_every` seconds when given: each sample is a full collection) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = [0, 0]

    def sample() -> None:
        next_heap = time.monotonic() + (heap_every or 0)
        while proc.poll() is None:
            pids = tree(proc.pid)
            peak[0] = max(peak[0], sum(int((_status(p, "VmRSS") or "0 kB").split()[0]) * 1024 for p in pids))
            if heap_every is not None and time.monotonic() >= next_heap:
                jvms = [p for p in pids if _status(p, "Name") == "java"]
                peak[1] = max([peak[1], *(live_heap(p) for p in jvms)])
                next_heap = time.monotonic() + heap_every
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate(timeout=3600)
    wall = time.perf_counter() - started
    sampler.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({proc.returncode}): {stderr[-2000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return wall, cpu, stdout, peak[0], peak[1]


def _env(**extra: str) -> dict[str, str]:
    # The caller's PYTHONPATH first, then this checkout: every process runs the same outbox code.
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    return dict(os.environ, PYTHONPATH=path, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
                SPARK_LOCAL_IP="127.0.0.1", **extra)


def spark_drain(
    url: str, bootstrap: str, master: str, cores_max: int | None = None, *, heap_every: float | None = None
) -> tuple[float, float, int, int]:
    """(wall, CPU, the driver's peak resident bytes, its JVM's peak live heap) of
    `python -m spark_drain` draining `url` to empty. The driver is the Python process and its
    JVM: on a standalone cluster the executors run in the workers' JVMs, in `local[*]` in the
    driver's."""
    extra = {}
    if cores_max is not None:  # one core per executor on the test bed's workers
        extra["PYSPARK_SUBMIT_ARGS"] = f"--conf spark.cores.max={cores_max} pyspark-shell"
    wall, cpu, out, peak, heap = timed(
        [sys.executable, "-m", "spark_drain", "--master", master, "--outbox", url, "--bootstrap-servers",
         bootstrap, "--partitions", "2"], _env(**extra), heap_every=heap_every,
    )
    assert "TOTAL" in out, out
    return wall, cpu, peak, heap


def cli_drain(url: str, bootstrap: str) -> tuple[float, float]:
    """(wall, CPU) of `outbox drain --until-empty` draining `url`."""
    code = "from outbox_cli.main import main; main()"
    wall, cpu, _, _, _ = timed(
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
    driver_memory: dict[int, tuple[int, int]] = {}  # rows -> the standalone driver's peak (resident, live heap)
    try:
        boxes = Outboxes("sqlite", rows, args.keys, topic, work, None)
        for rep in range(args.reps):
            for name in ("outbox drain", "spark local[2]"):
                url = boxes.fresh()
                if name == "outbox drain":
                    wall, cpu = cli_drain(url, bootstrap)
                else:
                    wall, cpu, _, _ = spark_drain(url, bootstrap, "local[2]")
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
                    wall, cpu, _, _ = spark_drain(url, bootstrap, sa.master_url, cores_max=n)
                    walls[name], cpus[name] = [wall], [cpu]
                    print(f"{name}: {wall:.1f} s", file=sys.stderr, flush=True)
                    os.remove(url.removeprefix("sqlite:///"))
                # The driver's memory at the backlog and at a tenth of it, in runs of their own (a
                # live-heap sample is a full collection): nothing on the driver grows with the rows.
                for box in (Outboxes("sqlite", rows // 10, args.keys, topic, work, None), boxes):
                    url = box.fresh()
                    _, _, rss, heap = spark_drain(url, bootstrap, sa.master_url, cores_max=2, heap_every=2.0)
                    driver_memory[box.rows] = (rss, heap)
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
    if driver_memory:
        print("the driver on the standalone cluster (its Python process and JVM; the executors run in the workers), "
              "peaks: resident (how far the JVM's heap grew) / the JVM's live heap (after a full collection, "
              "every 2 s)")
        for n, (rss, heap) in sorted(driver_memory.items()):
            print(f"  {n:>9,} rows: {rss / 2**20:,.0f} MB resident, {heap / 2**20:,.1f} MB live heap")
    if "standalone, 1 executor(s)" in walls:
        print(paper(rows / walls["standalone, 1 executor(s)"][0], rows / walls["standalone, 2 executor(s)"][0]))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(
            {"args": vars(args), "walls": walls, "cpus": cpus, "driver_memory_bytes": driver_memory}, indent=2
        ))


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
