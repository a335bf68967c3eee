"""Spark bulk drain vs `outbox drain --until-empty` on copies of one outbox, wall time start-up included;
the job's rate against executor count on a Spark standalone cluster; a paper sizing of a large cluster.

Standalone (not collected by pytest)::

    python benchmarks/bench_spark.py                      # 1,000,000 rows
    python benchmarks/bench_spark.py --drain-rows 200000  # a quick run

Every run drains a copy of one template SQLite outbox (200 B values, 1,000 keys) as a process of
its own, timed from its start to its exit: `python -m spark_drain --master local[2] --partitions 2`
(Spark's start-up included), the same with `--set value=...` and with `--transform` rewriting every
value, and `outbox drain --until-empty`, interleaved `--reps` times so that background load hits
all alike. Then a standalone cluster (`outbox.testing.spark_cluster`, two one-core workers) drains
a copy with 1 and with 2 executors (`spark.cores.max`). Kafka: $KAFKA_BOOTSTRAP_SERVERS, or a
local 3-broker outbox.testing.KafkaCluster.

Per run: wall time; CPU of the whole process tree (each process's own time from /proc, sampled
every 0.1 s; on the standalone cluster with the executors' processes), by kind of process; and the
launch to the first message on the broker (the topic stamps messages with LogAppendTime).
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
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
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


CLK_TCK = os.sysconf("SC_CLK_TCK")
SAMPLE_EVERY = 0.1  # seconds; what a process spends in its last interval before it exits is not seen
#: What the whole-tree accounting cannot see, printed with its numbers.
NOT_COUNTED = (
    "not counted: each process's CPU in its last < 0.1 s before it exits (sampled every 0.1 s), "
    "processes that live less than 0.1 s (e.g. the spark-submit launcher's own short JVM), "
    "and the brokers' CPU (the same messages for every variant)"
)


def _stat(pid: int) -> tuple[float, int] | None:
    """(the process's own user + system CPU seconds, its start time in ticks) from /proc/<pid>/stat:
    fields 14 and 15 only, never 16 and 17 (its reaped children's), which are followed on their own
    and would be counted twice."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLK_TCK, int(fields[19])


def _kind(pid: int, root: int, executor: bool) -> str | None:
    """What a process of a Spark drain is, from its name and command line (None: it has exited,
    its command line is gone)."""
    if pid == root:
        return "Python driver"
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    if not cmd:
        return None
    prefix = "executor " if executor else ""
    if comm == "java":
        return "launcher JVM" if "org.apache.spark.launcher.Main" in cmd else prefix + "JVM"
    if comm.startswith("python"):
        return prefix + "Python workers"
    return "other"  # spark-submit's shell scripts


class TreeCpu:
    """Own CPU of every process of a tree, and of the processes under other roots (a standalone
    cluster's workers, whose executors run the job's tasks), sampled every 0.1 s: the last value
    seen per process (a pid and its start time, so a reused pid is another process). A process
    once seen is followed until it exits even when it leaves the tree (a JVM outliving the driver
    is given to init)."""

    def __init__(self, root: int, executors_under: Sequence[int] = ()) -> None:
        self.root, self.executors_under = root, executors_under
        self.cpu: dict[tuple[int, int], float] = {}
        self.kind: dict[tuple[int, int], str] = {}
        self.reaped = False  # then the root's pid may be another process's: only the known are followed

    def sample(self) -> list[int]:
        """Takes one sample; returns the pids of the driver's tree now."""
        driver = [] if self.reaped else tree(self.root)
        under = [p for w in self.executors_under for p in tree(w)[1:]]  # not the worker JVMs themselves
        followed = {pid for pid, _ in self.cpu}
        now = {*driver, *under}
        for pid in now | followed:
            st = _stat(pid)
            if st is None:
                continue
            key = (pid, st[1])
            if pid not in now and key not in self.cpu:
                continue  # a followed process's pid, now another process's
            # Again every time: spark-submit's shell scripts exec the JVM under the same pid.
            kind = _kind(pid, self.root, pid in under or self.kind.get(key, "").startswith("executor "))
            self.kind[key] = kind or self.kind.get(key, "other")
            self.cpu[key] = st[0]
        return driver

    def running(self) -> int:
        """How many processes followed, other than the root, have not exited."""
        return sum(
            1 for pid, start in self.cpu
            if pid != self.root and (st := _stat(pid)) is not None and st[1] == start
            and _status(pid, "State")[:1] != "Z"
        )

    def alive(self) -> bool:
        return self.running() > 0

    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, seconds in self.cpu.items():
            out[self.kind[key]] = out.get(self.kind[key], 0.0) + seconds
        return out


@dataclass
class Run:
    """One drain process, from its start to its exit."""

    wall: float  # seconds from the launch to the exit of the process started
    cpu: float  # seconds of CPU of the whole tree (and of the executors when on a standalone cluster)
    cpu_by_kind: dict[str, float]
    processes: int  # processes seen
    stdout: str
    launched: float  # time.time() just before the launch
    peak_rss: int = 0
    peak_heap: int = 0
    outlived: float = 0.0  # seconds its other processes (a JVM, executors) ran on after it exited
    cut_off: int = 0  # processes still running 10 s after it exited: their CPU since is not counted
    first_message_s: float | None = None  # launch to the broker's timestamp of the run's first message


def timed(
    cmd: list[str], env: dict[str, str], *, heap_every: float | None = None, executors_under: Sequence[int] = ()
) -> Run:
    """One command from its launch to its exit: wall time; the own CPU of every process of its
    tree and of the processes under `executors_under`, followed until they exit (at most 10 s after
    the command's); the peak resident bytes of its tree, sampled every 0.1 s; and the peak of its
    JVMs' live heaps, sampled every `heap_every` seconds when given (each sample is a full collection)."""
    launched = time.time()
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    acc = TreeCpu(proc.pid, executors_under)
    output: dict[str, str] = {}
    readers = [
        threading.Thread(target=lambda name=name, stream=stream: output.__setitem__(name, stream.read()), daemon=True)
        for name, stream in (("out", proc.stdout), ("err", proc.stderr))
    ]
    for r in readers:
        r.start()
    peak = [0, 0]
    exited = threading.Event()

    def sample() -> None:
        next_heap = time.monotonic() + (heap_every or 0)
        while not exited.is_set():
            pids = acc.sample()
            peak[0] = max(peak[0], sum(int((_status(p, "VmRSS") or "0 kB").split()[0]) * 1024 for p in pids))
            if heap_every is not None and time.monotonic() >= next_heap:
                jvms = [p for p in pids if _status(p, "Name") == "java"]
                peak[1] = max([peak[1], *(live_heap(p) for p in jvms)])
                next_heap = time.monotonic() + heap_every
            time.sleep(SAMPLE_EVERY)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    # Waited for without reaping: the exited root's /proc/<pid>/stat holds its final own CPU, while
    # wait4's rusage would add the children it reaped, which are counted on their own.
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    wall = time.perf_counter() - started
    exited.set()
    sampler.join()
    acc.sample()
    _, status, _ = os.wait4(proc.pid, 0)
    acc.reaped = True
    proc.returncode = os.waitstatus_to_exitcode(status)
    ended = time.monotonic()
    deadline = ended + 10  # a JVM and executors stop after the driver: their shutdown is the job's too
    while acc.alive() and time.monotonic() < deadline:
        time.sleep(SAMPLE_EVERY)
        acc.sample()
    outlived = time.monotonic() - ended
    cut_off = acc.running()
    for r in readers:
        r.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({proc.returncode}): {output.get('err', '')[-2000:]}")
    kinds = acc.by_kind()
    return Run(wall, sum(kinds.values()), kinds, len(acc.cpu), output.get("out", ""), launched, peak[0], peak[1],
               outlived, cut_off)


def _env(**extra: str) -> dict[str, str]:
    # The caller's PYTHONPATH first, then this checkout: every process runs the same outbox code,
    # and Spark's Python workers import benchmarks.spark_transforms.
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    return dict(os.environ, PYTHONPATH=path, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
                SPARK_LOCAL_IP="127.0.0.1", **extra)


class FirstMessage:
    """Launch to first message: the topic stamps each message with the broker's clock when it is
    appended (`message.timestamp.type=LogAppendTime`, so a message's own timestamp, the stored
    row's, does not count); a run's messages are those after the end offsets before it."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap, self.topic = bootstrap, topic

    def ends(self) -> dict[int, int]:
        from confluent_kafka import Consumer, TopicPartition

        c = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "bench-spark-marks"})
        try:
            parts = c.list_topics(self.topic, timeout=30).topics[self.topic].partitions
            return {p: c.get_watermark_offsets(TopicPartition(self.topic, p), timeout=30)[1] for p in parts}
        finally:
            c.close()

    def seconds_after(self, launched: float, before: dict[int, int]) -> float | None:
        """The earliest broker timestamp of the messages after `before`, less `launched`."""
        from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, Consumer, TopicPartition

        after = self.ends()
        todo = {p for p, end in after.items() if end > before.get(p, 0)}
        c = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "bench-spark-first",
                      "enable.auto.commit": False})
        first: float | None = None
        try:
            c.assign([TopicPartition(self.topic, p, before.get(p, 0)) for p in todo])
            deadline = time.monotonic() + 60
            while todo and time.monotonic() < deadline:
                msg = c.poll(1.0)
                if msg is None or msg.error() or msg.partition() not in todo:
                    continue
                kind, ms = msg.timestamp()
                assert kind == TIMESTAMP_LOG_APPEND_TIME, "the topic must stamp messages with LogAppendTime"
                todo.discard(msg.partition())  # a partition's first message is its earliest appended
                first = ms / 1000 if first is None else min(first, ms / 1000)
        finally:
            c.close()
        return None if first is None else first - launched


def spark_drain(
    url: str, bootstrap: str, master: str, cores_max: int | None = None, *, heap_every: float | None = None,
    change: Sequence[str] = (), first: FirstMessage | None = None, executors_under: Sequence[int] = (),
) -> Run:
    """`python -m spark_drain` draining `url` to empty, `change` (e.g. `--set value=...`) applied.
    The driver is the Python process and its JVM: on a standalone cluster the executors run under
    the workers' JVMs (followed through `executors_under`), in `local[*]` in the driver's JVM."""
    extra = {}
    if cores_max is not None:  # one core per executor on the test bed's workers
        extra["PYSPARK_SUBMIT_ARGS"] = f"--conf spark.cores.max={cores_max} pyspark-shell"
    before = first.ends() if first else {}
    run = timed(
        [sys.executable, "-m", "spark_drain", "--master", master, "--outbox", url, "--bootstrap-servers",
         bootstrap, "--partitions", "2", *change], _env(**extra), heap_every=heap_every,
        executors_under=executors_under,
    )
    assert "TOTAL" in run.stdout, run.stdout
    if first is not None:
        run.first_message_s = first.seconds_after(run.launched, before)
    return run


def cli_drain(url: str, bootstrap: str, first: FirstMessage | None = None) -> Run:
    """`outbox drain --until-empty` draining `url`."""
    code = "from outbox_cli.main import main; main()"
    before = first.ends() if first else {}
    run = timed([sys.executable, "-c", code, "drain", "--outbox", url, "-b", bootstrap, "--until-empty"], _env())
    run.cpu_by_kind = {"Python (the CLI)": run.cpu}
    if first is not None:
        run.first_message_s = first.seconds_after(run.launched, before)
    return run


def warm_up(url: str, bootstrap: str) -> None:
    """A dry run before the measured ones: a machine's first `python -m spark_drain` writes the
    driver JVM's class archive as it exits (`spark_drain.classcache`), once, which no run measures."""
    subprocess.run(
        [sys.executable, "-m", "spark_drain", "--master", "local[2]", "--outbox", url, "--bootstrap-servers",
         bootstrap, "--dry-run"], env=_env(), check=True, capture_output=True, timeout=600,
    )
    os.remove(url.removeprefix("sqlite:///"))


def standalone_workers(master_url: str) -> list[int]:
    """The pids of the worker JVMs of the cluster at `master_url` (its executors run under them;
    another cluster on this machine has another master port)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if "org.apache.spark.deploy.worker.Worker" in cmd and master_url in cmd:
            found.append(int(entry))
    return found


#: The Spark runs in `local[2]`: the job as it is, and with a change that rewrites every value, in
#: SQL and in a pyarrow function (what a transform costs is measured against the first).
VARIANTS: dict[str, list[str]] = {
    "spark local[2]": [],
    "spark local[2] --set value": ["--set", "value=concat(value, X'21')"],
    "spark local[2] --transform": ["--transform", "benchmarks.spark_transforms:mark_values"],
}
SPARK_VS_CLI_CPU = 1.5  # Spark local[2]'s CPU per row at most this many times the CLI's
TRANSFORM_CPU = 1.3  # a value-rewriting change at most this many times the unchanged job's CPU per row
FIRST_MESSAGE_S = 8.0  # launch of the Spark process to its first message on the broker


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

    # The broker's clock on every message appended: the launch-to-first-message time reads it back.
    topic = create_topic(bootstrap, f"bench-spark-{uuid.uuid4().hex[:8]}", partitions=6,
                         config={"message.timestamp.type": "LogAppendTime"})
    first = FirstMessage(bootstrap, topic)
    work = tempfile.mkdtemp(prefix="bench-spark-")
    runs: dict[str, list[Run]] = {name: [] for name in ("outbox drain", *VARIANTS)}
    driver_memory: dict[int, tuple[int, int]] = {}  # rows -> the standalone driver's peak (resident, live heap)
    try:
        boxes = Outboxes("sqlite", rows, args.keys, topic, work, None)
        warm_up(boxes.fresh(), bootstrap)
        for rep in range(args.reps):
            for name in runs:
                url = boxes.fresh()
                if name == "outbox drain":
                    run = cli_drain(url, bootstrap, first)
                else:
                    run = spark_drain(url, bootstrap, "local[2]", change=VARIANTS[name], first=first)
                runs[name].append(run)
                print(f"rep {rep + 1}: {name}: {run.wall:.1f} s ({rows / run.wall:,.0f} rows/s), CPU {run.cpu:.1f} s",
                      file=sys.stderr, flush=True)
                os.remove(url.removeprefix("sqlite:///"))
        if not args.no_standalone:
            from outbox.testing.spark_cluster import SparkStandalone

            with SparkStandalone(workers=2) as sa:
                workers = standalone_workers(sa.master_url)
                for n in (1, 2):
                    name = f"standalone, {n} executor(s)"
                    url = boxes.fresh()
                    run = spark_drain(url, bootstrap, sa.master_url, cores_max=n, first=first,
                                      executors_under=workers)
                    runs[name] = [run]
                    print(f"{name}: {run.wall:.1f} s, CPU {run.cpu:.1f} s", file=sys.stderr, flush=True)
                    os.remove(url.removeprefix("sqlite:///"))
                # The driver's memory at the backlog and at a tenth of it, in runs of their own (a
                # live-heap sample is a full collection): nothing on the driver grows with the rows.
                for box in (Outboxes("sqlite", rows // 10, args.keys, topic, work, None), boxes):
                    url = box.fresh()
                    run = spark_drain(url, bootstrap, sa.master_url, cores_max=2, heap_every=2.0)
                    driver_memory[box.rows] = (run.peak_rss, run.peak_heap)
                    os.remove(url.removeprefix("sqlite:///"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if cluster is not None:
            cluster.close()

    walls = {name: [r.wall for r in rs] for name, rs in runs.items()}
    us_per_row = {name: statistics.median(r.cpu for r in rs) / rows * 1e6 for name, rs in runs.items()}
    kinds = {name: _median_kinds(rs, rows) for name, rs in runs.items()}
    firsts = {name: _median_first(rs) for name, rs in runs.items()}
    cli = statistics.median(walls["outbox drain"])
    print(f"\n{rows:,} rows, {args.keys} keys, SQLite copies, 3 brokers; wall time from process start to exit, "
          f"medians of {args.reps}; load {os.getloadavg()[0]:.1f}")
    print("CPU: the own user + system time of every process of each drain's tree (/proc/<pid>/stat, sampled "
          "every 0.1 s, the last value per process; the process started: its final time once it exited), "
          "on a standalone cluster with its executors' processes")
    print(f"  {NOT_COUNTED}")
    print(f"{'variant':<30} {'seconds':>8} {'rows/s':>10} {'vs outbox drain':>16} {'CPU s':>7} {'CPU us/row':>11} "
          f"{'first msg s':>12}")
    for name, ws in walls.items():
        w = statistics.median(ws)
        cpu_s = statistics.median(r.cpu for r in runs[name])
        f = firsts[name]
        print(f"{name:<30} {w:>8.1f} {rows / w:>10,.0f} {w / cli:>15.2f}x {cpu_s:>7.1f} {us_per_row[name]:>11.1f} "
              f"{'-' if f is None else f'{f:.1f}':>12}")
    print("CPU us per row by process:")
    for name, by_kind in kinds.items():
        procs = statistics.median(r.processes for r in runs[name])
        after = max(r.outlived for r in runs[name])
        cut = max(r.cut_off for r in runs[name])
        print(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]))
              + f" ({procs:.0f} processes; the last exited {after:.1f} s after the launched one"
              + (f"; {cut} still running 10 s after it, not counted since" if cut else "") + ")")

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    targets: dict[str, float | None] = {
        "spark_vs_cli_wall": statistics.median(walls["spark local[2]"]) / cli,
        "spark_vs_cli_cpu_per_row": us_per_row["spark local[2]"] / us_per_row["outbox drain"],
    }
    spark_wall = targets["spark_vs_cli_wall"] or 0.0
    print(f"target: spark local[2] wall <= 1.5x outbox drain: {verdict(spark_wall <= 1.5)} ({spark_wall:.2f}x)")
    r = targets["spark_vs_cli_cpu_per_row"] or 0.0
    print(f"target: spark local[2] CPU per row <= {SPARK_VS_CLI_CPU}x outbox drain's: "
          f"{verdict(r <= SPARK_VS_CLI_CPU)} ({r:.2f}x: {us_per_row['spark local[2]']:.1f} / "
          f"{us_per_row['outbox drain']:.1f} us)")
    for name, key in (("spark local[2] --set value", "set"), ("spark local[2] --transform", "transform")):
        r = us_per_row[name] / us_per_row["spark local[2]"]
        targets[f"{key}_vs_spark_cpu_per_row"] = r
        print(f"target: {name} ({' '.join(VARIANTS[name])}) CPU per row <= {TRANSFORM_CPU}x spark local[2]'s: "
              f"{verdict(r <= TRANSFORM_CPU)} ({r:.2f}x)")
    for name in VARIANTS:
        f = firsts[name]
        ok = f is not None and f <= FIRST_MESSAGE_S
        print(f"target: {name} launch to first message <= {FIRST_MESSAGE_S:.0f} s: {verdict(ok)} "
              f"({'no message' if f is None else f'{f:.1f} s'}, the broker's append time less the launch's)")
    if driver_memory:
        print("the driver on the standalone cluster (its Python process and JVM; the executors run in the workers), "
              "peaks: resident (how far the JVM's heap grew) / the JVM's live heap (after a full collection, "
              "every 2 s)")
        for n, (rss, heap) in sorted(driver_memory.items()):
            print(f"  {n:>9,} rows: {rss / 2**20:,.0f} MB resident, {heap / 2**20:,.1f} MB live heap")
    if "standalone, 1 executor(s)" in walls:
        one = kinds["standalone, 1 executor(s)"]
        print(paper(rows / walls["standalone, 1 executor(s)"][0], rows / walls["standalone, 2 executor(s)"][0],
                    sum(v for k, v in one.items() if k.startswith("executor "))))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(
            {"args": vars(args), "walls": walls, "cpus": {name: [r.cpu for r in rs] for name, rs in runs.items()},
             "cpu_by_kind": {name: [r.cpu_by_kind for r in rs] for name, rs in runs.items()},
             "processes": {name: [r.processes for r in rs] for name, rs in runs.items()},
             "outlived_s": {name: [r.outlived for r in rs] for name, rs in runs.items()},
             "cut_off": {name: [r.cut_off for r in rs] for name, rs in runs.items()},
             "first_message_s": {name: [r.first_message_s for r in rs] for name, rs in runs.items()},
             "cpu_us_per_row": us_per_row, "cpu_us_per_row_by_kind": kinds, "targets": targets,
             "not_counted": NOT_COUNTED, "driver_memory_bytes": driver_memory}, indent=2
        ))


def _median_kinds(rs: list[Run], rows: int) -> dict[str, float]:
    """CPU us per row of each kind of process, the median over the runs (0 in a run without it)."""
    names = {k for r in rs for k in r.cpu_by_kind}
    return {k: statistics.median(r.cpu_by_kind.get(k, 0.0) for r in rs) / rows * 1e6 for k in names}


def _median_first(rs: list[Run]) -> float | None:
    seen = [r.first_message_s for r in rs if r.first_message_s is not None]
    return statistics.median(seen) if seen else None


def paper(one: float, two: float, executor_us: float) -> str:
    """A 16-executor cluster draining a fleet's PostgreSQL outbox, on paper, from measured rates
    and one executor's measured CPU per row."""
    per_core = 1e6 / executor_us
    return (
        "\npaper: 16 executors draining a fleet's PostgreSQL outbox\n"
        f"  measured here (start-up included): 1 executor {one:,.0f} rows/s, 2 executors {two:,.0f} rows/s "
        f"({two / one:.2f}x on this 2-core machine)\n"
        f"  one executor's processes (its JVM and Python workers, their start-up included) took "
        f"{executor_us:.1f} us of CPU per row: {per_core:,.0f} rows/s per core it is given; each executor sends "
        f"and settles its own key range with its own producer and connection: 16 x {per_core:,.0f} = "
        f"{16 * per_core:,.0f} rows/s if nothing else binds (the executor's start-up is in its CPU: the smaller "
        "the backlog, the more it weighs, and the lower these rates)\n"
        "  what binds first: the database's deletes (one DELETE per 5,000 rows and executor, 16 at a time), "
        "then the brokers' produce rate (the brokers' CPU is not in the executor's);\n"
        f"  100 M rows at {16 * per_core:,.0f} rows/s: {100e6 / (16 * per_core) / 60:,.0f} min plus start-up"
    )


if __name__ == "__main__":
    main()
