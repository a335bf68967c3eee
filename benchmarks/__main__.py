"""``python -m benchmarks``: run the scenarios side by side and print one table.

The parent process owns the Kafka cluster (a local 3-broker outbox.testing.KafkaCluster, or
KAFKA_BOOTSTRAP_SERVERS), runs every scenario in a fresh child process, interleaves the
repetitions (A B A B ...), and reports medians with each scenario's ratio to a baseline
measured in the same run. Results go to benchmarks/results/<date>.json (<date>-quick.json for
--quick); a full run of every scenario also refreshes the table in benchmarks/README.md.

Phases: (1) brokers up: raw baselines, fallback, a burst into a small local queue, write-ahead,
naive durable, drain;
(2) brokers down: spill vs raw SQLite, memory during a long outage, then one shared outage
window for the recovery and simple-retry scenarios, ended by restarting the brokers;
then recovery, recovery headroom (a bisection over the steady rate), Spark, and the consumer side
(ResilientConsumer against a raw consumer loop).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import inspect
import itertools
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from .bench_spark import FIRST_MESSAGE_S, SPARK_VS_CLI_CPU, TRANSFORM_CPU, VARIANTS
from .threadcpu import BROKERS, OTHER, STAGES

ROOT = Path(__file__).resolve().parent.parent
#: The rows of the compiled build (`--compiled`) carry this after the pure-Python rows' label.
COMPILED_LABEL = ", compiled (mypyc)"
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = Path(__file__).resolve().parent / "README.md"
# (fraction of R0, longest wait for an empty outbox after the restart, seconds)
RECOVERY: tuple[tuple[float, float], ...] = ((0.10, 90.0), (0.25, 200.0), (0.50, 120.0))
RECOVERY_QUICK: tuple[tuple[float, float], ...] = ((0.10, 45.0),)
#: The burst runs' local queue (`queue.buffering.max.messages`): small enough that a run's
#: messages, produced as fast as `produce()` returns, fill it many times over.
BURST_QUEUE = 10_000
#: The keyed happy-path rows' keys: each message has one of them, in turn.
KEYED_KEYS = 1_000
#: The memory runs' message sizes (bytes): small to large, against the same byte budget, each in
#: a fresh process. The first one's outbox is the drain scenario's backlog.
MEMORY_SIZES = (200, 1024, 4096)
#: A memory run's targets: peak RSS; its growth over the process's size before the outage; and
#: growth of the resident set after the first quarter (flat).
MEMORY_PEAK_MB = 150
MEMORY_GROWTH_MB = 60
MEMORY_FLAT_MB = 20
#: What encryption at rest may cost the outage spill and the drain: their rate encrypted, at least
#: this share of their rate without it (200 B, `--drain-rows` messages, the same run).
ENCRYPTED_VS_CLEAR = 0.90
#: The rotate scenario: produce() of 200 B at this rate (msgs/s), to an open circuit's outbox
#: while `outbox keys rotate` re-encrypts `--drain-rows` rows of it in another process; and the
#: longest produce() it may take meanwhile (milliseconds).
ROTATE_RATE = 5000.0
ROTATE_TARGET_MS = 20.0
#: Recovery headroom: the highest steady rate, as a share of R0, at which the backlog of a
#: `--outage` s whole-cluster outage empties within HEADROOM_EMPTY_S of the restart (default
#: settings). Found by bisection over (0, HEADROOM_CEILING] in HEADROOM_PROBES runs, the first at
#: the target share; each run is a recovery run through its own outage.
HEADROOM_TARGET = 0.25
HEADROOM_EMPTY_S = 60.0
HEADROOM_CEILING = 0.5
HEADROOM_PROBES = 5
HEADROOM_PROBES_QUICK = 2
#: The soak's traffic: a producer and a consumer in one process (msgs/s of 1 KiB), through two
#: whole-cluster outages of `--outage` seconds; what it measures is the memory given back.
SOAK_RATE = 4000.0
#: What the soak's process may keep of what its outages took (MB, after against before).
SOAK_KEPT_MB = 20

# Where a recovery run drains (`--recovery-drain`), as the table and the curves name it.
DRAIN_PLACES = {
    "threads": "drain threads in the producer",
    "process": "drain_in='process' (drain in a child process)",
    "sidecar": "drain_workers=0 + `outbox drain --follow` beside it",
}
LINE_STYLES = {"threads": "-", "process": "--", "sidecar": ":"}
ALL = (
    "raw", "fallback", "burst", "write-ahead", "naive", "spill", "memory", "drain", "recovery", "headroom", "retry",
    "spark", "consumer", "dedup", "loop-lag", "soak", "encryption", "rotate", "fleet",
)
#: The loop-lag scenario's traffic (msgs/s over 100 keys, four producing tasks): a service, not a
#: throughput run; what is measured is how late its event loop wakes.
LOOP_LAG_RATE = 2000.0
#: The event-loop delay the producer may cause, at most (milliseconds, on an idle machine).
LOOP_LAG_TARGET_MS = 20.0
#: The loop-lag cluster's JVMs run at this `nice` increment (see the phase).
LOOP_LAG_NICENESS = 19
Result = dict[str, Any]
#: What the CPU table's columns are (printed with it).
STAGE_NOTE = (
    ": each thread's CPU from /proc over the timed part, grouped by what it does (application: the"
    " scenario's own producing thread; in the drain row that thread is a drain worker), and the local"
    " brokers' JVMs (not measured in recovery runs, which restart them); messages per produce batch"
    " from librdkafka's statistics (each batch costs the brokers about the same, so fewer messages per"
    " batch cost them more per message). A row's gap to its baseline is where it spends more."
)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class BenchError(RuntimeError):
    """A scenario child failed."""


class Runner:
    """Starts scenario children and collects their RESULT lines."""

    def __init__(self, workdir: str, outbox_dir: Path | None = None) -> None:
        """`outbox_dir`: a build of the package (`make bench`'s compiled one) that the children
        import instead of the source tree's; they run from it, so that it comes first."""
        self.workdir = workdir
        self.cwd = ROOT if outbox_dir is None else outbox_dir
        first = [] if outbox_dir is None else [str(outbox_dir)]
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([*first, str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        self.n = 0

    def _cmd(self, name: str, params: dict[str, Any]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "benchmarks.scenarios",
            name,
            json.dumps({"workdir": self.workdir, **params}),
        ]

    def _log(self, name: str) -> Path:
        self.n += 1
        return Path(self.workdir) / f"{self.n:03d}-{name}.log"

    def run(self, name: str, params: dict[str, Any], timeout: float = 600) -> Result:
        logf = self._log(name)
        with open(logf, "wb") as err:
            proc = subprocess.run(
                self._cmd(name, params),
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=self.cwd,
                env=self.env,
                timeout=timeout,
                text=True,
            )
        return self._parse(name, proc.returncode, proc.stdout, logf)

    def start(self, name: str, params: dict[str, Any]) -> Child:
        logf = self._log(name)
        err = open(logf, "wb")  # noqa: SIM115 - closed by Child.result
        proc = subprocess.Popen(
            self._cmd(name, params),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=self.cwd,
            env=self.env,
            text=True,
            bufsize=1,
        )
        return Child(self, name, proc, err, logf)

    @staticmethod
    def _parse(name: str, code: int, out: str, logf: Path) -> Result:
        for line in reversed(out.splitlines()):
            if line.startswith("RESULT "):
                r: Result = json.loads(line[7:])
                return r
        tail = "\n".join(logf.read_text(errors="replace").splitlines()[-25:])
        raise BenchError(f"scenario {name} failed (exit {code}); stderr tail:\n{tail}")


def whole_outage(c: Child, cluster: Any, seconds: float, *, say_stop: bool = True) -> None:
    """Stop every broker for `seconds`, then start them, telling the child each step: STOP before
    (`say_stop`), DOWN once they are stopped, UP once they are started."""
    if say_stop:
        c.send("STOP")
    cluster.stop_all()
    c.send("DOWN")
    time.sleep(seconds)
    cluster.start_all()
    c.send("UP")


class Child:
    """An interactive scenario child (READY / GO / UP on its stdin and stdout)."""

    def __init__(self, runner: Runner, name: str, proc: subprocess.Popen[str], err: IO[bytes], logf: Path) -> None:
        self.runner, self.name, self.proc, self.err, self.logf = runner, name, proc, err, logf
        self.lines: list[str] = []

    def expect(self, word: str, timeout: float) -> None:
        assert self.proc.stdout is not None
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(timeout)
        if not box or box[0].strip() != word:
            self.proc.kill()
            raise BenchError(
                f"{self.name}: expected {word!r}, got {box[0] if box else 'nothing'!r}; see {self.logf}\n"
                + "\n".join(self.logf.read_text(errors="replace").splitlines()[-15:])
            )

    def send(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def result(self, timeout: float) -> Result:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        self.err.close()
        return Runner._parse(self.name, self.proc.returncode, out, self.logf)


# -- statistics and the table ----------------------------------------------------------------


def emptied_in_time(run: Result) -> bool:
    """Did a recovery run's outbox empty within HEADROOM_EMPTY_S of the restart?"""
    after = run.get("empty_after_up_s")
    return after is not None and after <= HEADROOM_EMPTY_S


def headroom_row(table: Table, probes: list[Result], outage: float, r0: float | None, where: str) -> None:
    """The headroom row: the highest share of R0 whose backlog emptied in time, and every probe."""
    emptied = [p["share_of_r0"] for p in probes if emptied_in_time(p)]
    best = max(emptied, default=None)
    bound = min(
        (p["share_of_r0"] for p in probes if not emptied_in_time(p) and (best is None or p["share_of_r0"] > best)),
        default=None,
    )

    def probe_note(p: Result) -> str:
        after = p.get("empty_after_up_s")
        state = f"empty after {after:.1f}s" if after is not None else f"NOT empty, {p.get('pending_left') or 0:,} left"
        return f"{p['share_of_r0']:.1%} ({p['rate_achieved']:,.0f}/s offered): {state}"

    if best is None:
        answer = f"below {bound:.1%} of R0 (no probe emptied)"
    else:
        answer = f"{best:.1%} of R0" + (f", below {bound:.1%}" if bound is not None else "")
    table.add(
        f"recovery headroom: highest steady rate whose {outage:.0f}s outage empties within "
        f"{HEADROOM_EMPTY_S:.0f}s, {where}",
        {"msgs_per_s": None if best is None or r0 is None else best * r0},
        ratio=best,
        target=f">= {HEADROOM_TARGET:.0%} of R0",
        met=best is not None and best >= HEADROOM_TARGET,
        notes=f"{answer}; bisection, probes in order: " + "; ".join(probe_note(p) for p in probes),
    )


def med(results: list[Result], field: str) -> float | None:
    vals = [r[field] for r in results if r.get(field) is not None]
    return statistics.median(vals) if vals else None


def summarize(results: list[Result]) -> Result:
    out: Result = {"reps": len(results)}
    for f in (
        "msgs_per_s", "mb_per_s", "p50_us", "p99_us", "cpu_us_per_msg", "peak_rss_mb", "seconds", "n", "size",
        "server_cpu_us_per_msg", "brokers_cpu_us_per_msg",
    ):
        out[f] = med(results, f)
    return out


def fmt(v: Any, digits: int = 0) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if digits == 0 and abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:,.{max(digits, 1)}f}"
    return str(v)


class Table:
    HEAD = (
        "scenario",
        "msgs/s",
        "MB/s",
        "p50 µs",
        "p99 µs",
        "CPU µs/msg",
        "peak RSS MB",
        "ratio",
        "target",
        "met?",
        "notes",
    )

    def __init__(self) -> None:
        self.rows: list[Result] = []

    def add(
        self,
        scenario: str,
        s: Result | None,
        *,
        ratio: float | None = None,
        target: str = "",
        met: bool | None = None,
        notes: str = "",
    ) -> None:
        s = s or {}
        self.rows.append(
            {
                "scenario": scenario,
                "msgs_per_s": s.get("msgs_per_s"),
                "mb_per_s": s.get("mb_per_s"),
                "p50_us": s.get("p50_us"),
                "p99_us": s.get("p99_us"),
                "cpu_us_per_msg": s.get("cpu_us_per_msg"),
                "peak_rss_mb": s.get("peak_rss_mb"),
                "ratio": ratio,
                "target": target,
                "met": met,
                "notes": notes,
            }
        )

    def cells(self, r: Result) -> list[str]:
        met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
        return [
            r["scenario"],
            fmt(r["msgs_per_s"]),
            fmt(r["mb_per_s"], 1),
            fmt(r["p50_us"], 1),
            fmt(r["p99_us"], 1),
            fmt(r["cpu_us_per_msg"], 1),
            fmt(r["peak_rss_mb"]),
            "" if r["ratio"] is None else f"{r['ratio']:.2f}",
            r["target"],
            met,
            r["notes"],
        ]

    def text(self) -> str:
        return text_table(self.HEAD, [self.cells(r) for r in self.rows], left=(0, 8, 10))

    def markdown(self) -> str:
        return markdown_table(self.HEAD, [self.cells(r) for r in self.rows])


def text_table(head: Sequence[str], rows: list[list[str]], left: Sequence[int] = (0,)) -> str:
    """Aligned columns: those in `left` flush left, the others (numbers) flush right."""
    rows = [list(head), *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for k, row in enumerate(rows):
        lines.append(
            "  ".join(
                c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(head: Sequence[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(out)


# -- where the CPU goes ----------------------------------------------------------------------


def stage_medians(results: list[Result]) -> dict[str, float] | None:
    """Median CPU µs per message of each stage over a scenario's repetitions (`cpu_by_stage`)."""
    measured = [r["cpu_by_stage"] for r in results if r.get("cpu_by_stage")]
    if not measured:
        return None
    stages = {s for m in measured for s in m}
    return {s: statistics.median(m.get(s, 0.0) for m in measured) for s in stages}


def cpu_by_stage(
    runs: dict[str, list[Result]], rows: Sequence[tuple[str, str, str | None]]
) -> tuple[str, str, list[Result]]:
    """The CPU table: for each (label, run key, baseline key) measured, CPU µs per message of each
    stage (`benchmarks.threadcpu.STAGES`, one thread or group of threads each), and where the row
    spends more than its baseline (the stages that differ most; a row whose own thread is not the
    application's, the drain's, is compared stage for stage with the baseline's application
    thread). Returns text, markdown, rows."""
    medians = {key: stage_medians(runs.get(key, [])) for _, key, _ in rows}
    stages = dict.fromkeys((*(st for _, st in STAGES), OTHER))  # in order, each once: two prefixes share a stage
    used = [s for s in stages if any(m and m.get(s, 0) >= 0.05 for m in medians.values())]
    head = ["scenario", *used, "this process", BROKERS, "msgs/batch", "more than its baseline, by stage"]
    cells: list[list[str]] = []
    out: list[Result] = []
    for label, key, baseline in rows:
        m = medians.get(key)
        if m is None:
            continue
        own = sum(v for s, v in m.items() if s != BROKERS)
        gap = ""
        b = medians.get(baseline) if baseline else None
        if b is not None:
            main = runs[key][0].get("main_stage", "application")
            b = {(main if s == "application" else s): v for s, v in b.items()}
            diff = {s: m.get(s, 0.0) - b.get(s, 0.0) for s in {*m, *b}}
            total = own - sum(v for s, v in b.items() if s != BROKERS)
            worst = sorted((d, s) for s, d in diff.items() if abs(d) >= 0.3)[::-1]
            gap = f"{total:+.1f} µs in this process: " + ", ".join(f"{s} {d:+.1f}" for d, s in worst)
        per_batch = fmt(med(runs[key], "msgs_per_batch"), 1)
        cells.append([label, *(f"{m.get(s, 0.0):.1f}" for s in used), f"{own:.1f}",
                      "–" if BROKERS not in m else f"{m[BROKERS]:.1f}", per_batch, gap])
        out.append({"scenario": label, "key": key, "baseline": baseline, "cpu_us_per_msg_by_stage": m,
                    "msgs_per_batch": med(runs[key], "msgs_per_batch")})
    left = (0, len(head) - 1)
    return text_table(head, cells, left), markdown_table(head, cells), out


# -- machine and cluster ---------------------------------------------------------------------


def spark_runs(bootstrap: str, rows: int, workdir: str) -> dict[str, Result]:
    """benchmarks/bench_spark.py in its own process: Spark local[2] (as it is, with `--set value=`
    and with `--transform`) and `outbox drain --until-empty` on copies of one outbox, and the
    standalone cluster at 1 and 2 executors (wall time from each drain process's start to its exit,
    start-up included; CPU of the whole process tree per row, by kind of process; launch to the
    first message on the broker). Its printed table (with the paper sizing of a 16-executor
    cluster) is passed through."""
    out = Path(workdir) / "spark.json"
    args = ["--drain-rows", str(rows), "--json", str(out)]
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=bootstrap)
    proc = subprocess.run(
        [sys.executable, str(HERE / "bench_spark.py"), *args], capture_output=True, text=True, env=env, timeout=7200
    )
    if proc.returncode != 0:
        raise BenchError(f"bench_spark.py {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    print(proc.stdout, flush=True)
    data = json.loads(out.read_text())
    firsts = {name: [f for f in fs if f is not None] for name, fs in data["first_message_s"].items()}
    return {
        name: {"n": rows, "msgs_per_s": rows / statistics.median(w), "seconds": statistics.median(w),
               "cpu_us_per_msg": statistics.median(data["cpus"][name]) / rows * 1e6,
               "cpu_us_per_msg_by_kind": data["cpu_us_per_row_by_kind"][name],
               "first_message_s": statistics.median(firsts[name]) if firsts[name] else None}
        for name, w in data["walls"].items()
    }


def _rotate_row(runs: list[Result], rows: int) -> tuple[str, Result, dict[str, Any]]:
    """The table row of the rotate runs: the longest produce() while `outbox keys rotate` ran
    (median over the repetitions), against the longest in the seconds before it started."""
    worst = statistics.median(r["during"]["max_ms"] for r in runs)
    before = statistics.median(r["baseline"]["max_ms"] for r in runs)
    p999 = statistics.median(r["during"]["p999_ms"] for r in runs)
    took = statistics.median(r["rotation_s"] for r in runs)
    done = "/".join(str(r["reencrypted"]) for r in runs)
    failed = [r["rotation_exit"] for r in runs if r["rotation_exit"] != 0]
    return f"key rotation of {rows:,} rows in another process, produce() at {ROTATE_RATE:,.0f}/s", summarize(runs), {
        "ratio": worst / before if before else None,
        "target": f"max produce() < {ROTATE_TARGET_MS:.0f} ms during rotation",
        "met": worst < ROTATE_TARGET_MS and not failed,
        "notes": f"max {worst:.1f} ms, p99.9 {p999:.2f} ms during; max {before:.1f} ms before it started; "
        f"rotation {took:.1f} s (with its process start), re-encrypted {done}"
        + (f"; rotation exit codes {failed}" if failed else ""),
    }


def _loop_lag_row(runs: list[Result], outage: float) -> tuple[str, Result, dict[str, Any]]:
    """The table row of the loop-lag runs: the event loop's worst lateness through the outage and
    recovery (median over the repetitions), against the probe alone in a process of its own."""
    worst = statistics.median(r["lag"]["whole"]["max_ms"] for r in runs)
    alone = statistics.median(r["lag_alone"]["whole"]["max_ms"] for r in runs)

    def phases(key: str) -> str:
        return ", ".join(
            f"{ph} {statistics.median(r[key][ph]['max_ms'] for r in runs if ph in r[key]):.1f}"
            f"/{statistics.median(r[key][ph]['p99_ms'] for r in runs if ph in r[key]):.1f}"
            for ph in ("before", "outage", "recovery")
            if all(ph in r[key] for r in runs)
        )

    loads = "/".join(f"{r['loadavg'][0]:.1f}" for r in runs)
    passes = [len(r.get("gc_pauses", [])) for r in runs]
    longest = max((g[2] for r in runs for g in r.get("gc_pauses", [])), default=0.0)
    longest_cpu = max((g[3] for r in runs for g in r.get("gc_pauses", []) if len(g) > 3), default=0.0)
    empty = [r["empty_after_up_s"] for r in runs if r.get("empty_after_up_s") is not None]
    emptied = f"empty {statistics.median(empty):.1f} s after the restart" if empty else "never empty"
    if len(empty) not in (0, len(runs)):
        emptied += f" ({len(empty)} of {len(runs)} runs)"
    label = f"loop lag: AsyncResilientProducer, all brokers down {outage:.0f}s, recovery (1 ms probe)"
    return label, summarize(runs), {
        "ratio": worst / alone if alone else None,
        "target": f"max < {LOOP_LAG_TARGET_MS:.0f} ms",
        "met": worst < LOOP_LAG_TARGET_MS,
        "notes": f"max {worst:.1f} ms (probe alone {alone:.1f} ms); max/p99 ms this loop: {phases('lag')}; "
        f"probe alone: {phases('lag_alone')}; garbage-collector passes of 5 ms+ per run "
        f"{'/'.join(map(str, passes))} (longest {longest:.0f} ms, {longest_cpu:.0f} ms of CPU); {emptied}; "
        f"load average {loads}",
    }


def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}s"


def _cpu_split(r: Result) -> str:
    """Where a recovery run's CPU went: the application's process, and a drain process beside it."""
    child = r.get("drain_child_cpu_us_per_msg")
    if not child or r.get("cpu_us_per_msg") is None:
        return ""
    return f"; CPU µs/msg: application process {r['cpu_us_per_msg'] - child:.1f}, drain process {child:.1f}"


def plot_recovery(runs: dict[str, list[Result]], outage: float, quick: bool) -> Path | None:
    """Pending rows over time for every recovery run, one PNG (benchmarks/recovery[-quick].png)."""
    keys = sorted((k for k in runs if k.startswith("recovery/")), key=lambda k: int(k.split("/")[1]))
    if not keys:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (make venv, or pip install matplotlib): no recovery PNG")
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors: dict[str, str] = {}
    for k in keys:
        r = runs[k][0]
        pct = k.split("/")[1]
        place = r.get("drain", "threads")
        down = r.get("down_at") or 0.0
        xs = [t - down for t, _ in r["pending_curve"]]
        ys = [n for _, n in r["pending_curve"]]
        where = DRAIN_PLACES[place]
        (line,) = ax.plot(
            xs, ys, color=colors.get(pct), linestyle=LINE_STYLES[place],
            label=f"{pct}% of R0 ({r['rate_wanted']:,.0f} msgs/s), {where}",
        )
        colors.setdefault(pct, matplotlib.colors.to_hex(line.get_color()))
        if r.get("up_at") is not None:
            ax.axvline(r["up_at"] - down, color="grey", linestyle=":", linewidth=1)
    ax.axvline(0, color="red", linestyle="--", linewidth=1, label="all brokers stopped")
    ax.set_xlabel("seconds since all brokers were stopped (dotted: started again)")
    ax.set_ylabel("pending rows in the outbox")
    ax.set_title(f"Recovery after a {outage:.0f}s outage of every broker (1,000 keys, 200 B)")
    ax.legend()
    ax.grid(alpha=0.3)
    out = HERE / f"recovery{'-quick' if quick else ''}.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def machine() -> Result:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import confluent_kafka

    mem = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024 // 1024
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": mem,
        "python": platform.python_version(),
        "confluent_kafka": confluent_kafka.version()[0],
        "librdkafka": confluent_kafka.libversion()[0],
        "kernel": platform.release(),
        "git": git_rev(),
        "loadavg_start": os.getloadavg(),
    }


def prepare_template(src: str, dst: str) -> None:
    """Turn the memory run's outbox into the drain backlog: WAL folded in, leases released.

    The spilling producer's drain workers claimed a few batches before the child exited; a
    restarted application would get them back when the lease expires, we release them now.
    """
    import sqlite3

    conn = sqlite3.connect(src, isolation_level=None)
    conn.execute("UPDATE outbox SET lease_owner = NULL, next_attempt_at = 0 WHERE status = 0")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    shutil.copyfile(src, dst)
    os.unlink(src)


def git_rev() -> str:
    """The last commit of outbox/, "+dirty" when it has uncommitted changes (what was measured)."""
    try:
        rev = subprocess.run(  # the last commit that touched the SDK, not HEAD
            ["git", "log", "-1", "--format=%h", "--", "outbox"], cwd=ROOT, capture_output=True, text=True
        ).stdout
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "outbox"], cwd=ROOT, capture_output=True, text=True
        ).stdout
        return rev.strip() + ("+dirty" if dirty.strip() else "")
    except OSError:
        return "?"


def closed_port() -> tuple[str, socket.socket]:
    """A bound, not listening port: connections are refused (the external-cluster outage)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return f"127.0.0.1:{s.getsockname()[1]}", s


# -- the run ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, help="messages per happy-path/spill run (default 100000; --quick 30000)")
    ap.add_argument("--size", type=str, help="value sizes in bytes, comma-separated (default 200,4096; --quick 200)")
    ap.add_argument("--quick", action="store_true", help="small sizes; finishes in under 2 minutes")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions per scenario (default 3)")
    ap.add_argument("--scenarios", type=str, default=",".join(ALL), help=f"comma-separated subset of: {','.join(ALL)}")
    ap.add_argument(
        "--drain-rows", type=int, help="pending rows for the drain scenario (default 1000000; --quick 100000)"
    )
    ap.add_argument("--outage", type=float, help="seconds of outage for the retry comparison (default 30; --quick 10)")
    ap.add_argument(
        "--recovery-drain",
        type=str,
        default="threads,process",
        help="where the recovery and headroom runs drain, comma-separated: threads (the producer's drain workers), "
        "process (drain_in='process': those workers in a child process), sidecar (drain_workers=0 and "
        "`outbox drain --follow` beside it); default threads,process",
    )
    ap.add_argument(
        "--recovery-at",
        type=str,
        help="comma-separated percentages of R0 for the recovery runs, out of "
        f"{','.join(f'{f:.0%}'.rstrip('%') for f, _ in RECOVERY)} (default all; --quick 10)",
    )
    ap.add_argument(
        "--recovery-rate",
        type=float,
        help="offer this many msgs/s in every recovery run instead of a share of R0 (R0 moves by "
        "+-40%% between runs on a shared machine: for comparing two versions of the code)",
    )
    ap.add_argument(
        "--compiled",
        type=Path,
        help="a compiled build of produce()'s hot modules (`make bench` builds it into build/compiled "
        "with mypyc): each fallback run is repeated with it, and the table shows both builds",
    )
    ap.add_argument("--no-write", action="store_true", help="do not write results/, README.md or the recovery curves")
    ap.add_argument(
        "--from-runs",
        type=Path,
        help="measure nothing: make the table, results/ and the curves from a run's saved runs "
        "(results/.last-runs.json, kept when the table or the plot failed)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_runs is not None:
        saved = json.loads(args.from_runs.read_text())
        return report(args, saved["config"], saved["runs"])
    t_start = time.monotonic()
    load0 = os.getloadavg()
    rev0 = git_rev()  # children import outbox/ afresh: note if it changes during the run
    quick = args.quick
    selected = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(selected) - set(ALL)
    if unknown:
        print(f"unknown scenarios: {', '.join(sorted(unknown))} (choose from {', '.join(ALL)})", file=sys.stderr)
        return 2
    sel = set(selected)
    n = args.messages or (30_000 if quick else 100_000)
    sizes = [int(x) for x in args.size.split(",")] if args.size else ([200] if quick else [200, 4096])
    base = sizes[0]
    reps = max(1, args.reps)
    drain_rows = args.drain_rows or (100_000 if quick else 1_000_000)
    mem_n = drain_rows  # the memory run's outbox is the drain scenario's backlog
    rec_n = 20_000 if quick else 50_000
    outage = args.outage or (10.0 if quick else 30.0)
    recovery_drains = [d.strip() for d in args.recovery_drain.split(",") if d.strip()]
    recovery_steps = RECOVERY_QUICK if quick else RECOVERY
    if args.recovery_at:
        wanted = {p.strip() for p in args.recovery_at.split(",") if p.strip()}
        recovery_steps = tuple(step for step in RECOVERY if str(round(step[0] * 100)) in wanted)
        if len(recovery_steps) != len(wanted):
            print(f"--recovery-at takes percentages out of {[round(f * 100) for f, _ in RECOVERY]}", file=sys.stderr)
            return 2
    if set(recovery_drains) - set(DRAIN_PLACES):
        print(f"--recovery-drain takes {', '.join(DRAIN_PLACES)}", file=sys.stderr)
        return 2
    sample = 64
    config: Result = {
        "quick": quick,
        "messages": n,
        "sizes": sizes,
        "reps": reps,
        "drain_rows": drain_rows,
        "memory_messages": mem_n,
        "recovery_rows": rec_n,
        "outage_s": outage,
        "sample_every": sample,
        "scenarios": selected,
        "producer": {"acks": "all", "enable.idempotence": True, "linger.ms": 5},
    }
    workdir = tempfile.mkdtemp(prefix="outbox-bench-")
    runner = Runner(workdir)
    compiled = None if args.compiled is None else Runner(workdir, args.compiled.resolve())
    config["compiled"] = None if args.compiled is None else str(args.compiled)
    runs: dict[str, list[Result]] = {}

    def record(key: str, r: Result) -> Result:
        runs.setdefault(key, []).append(r)
        extra = f" ({r['msgs_per_s']:,.0f} msgs/s)" if r.get("msgs_per_s") else ""
        log(f"  {key}{extra}")
        return r

    def recovery_r0() -> float:
        """R0 for the recovery and headroom runs: this run's raw rate, measured now if not yet."""
        r0 = med(runs.get(f"raw/{base}", []), "msgs_per_s")
        if r0 is None:
            log("recovery: measuring R0 first (after a warm-up run)")
            runner.run("raw", {**common, "n": n, "size": base, "header": True})
            r0 = record(f"raw/{base}", runner.run("raw", {**common, "n": n, "size": base, "header": False}))[
                "msgs_per_s"
            ]
        assert r0 is not None
        config["recovery_r0"] = r0
        return float(r0)

    def recovery_run(rate: float, drain: str, wait: float) -> Result:
        """One recovery run: 200 B over 1,000 keys at `rate` msgs/s, draining in `drain`, through
        a whole-cluster outage of its own; it waits up to `wait` s after the restart for empty."""
        c = runner.start(
            "recovery", {**common, "size": base, "rate": rate, "keys": 1000, "max_wait": wait, "drain": drain}
        )
        c.expect("READY", 120)
        whole_outage(c, cluster, outage, say_stop=False)
        return c.result(wait + 300)

    def fallback_run(name: str, size: int, params: Result) -> None:
        """A fallback run, then the same one with the compiled build (`--compiled`): `<name>_c`."""
        record(f"{name}/{size}", runner.run("resilient", params))
        if compiled is not None:
            r = compiled.run("resilient", params)
            if r.get("build") != "compiled":
                raise BenchError(f"--compiled {args.compiled}: its children ran the {r.get('build')} build")
            record(f"{name}_c/{size}", r)

    cluster = None
    external = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    try:
        if external:
            bootstrap = external
            log(f"using KAFKA_BOOTSTRAP_SERVERS={external}")
        else:
            from outbox.testing import KafkaCluster

            log("starting a local 3-broker Kafka cluster")
            cluster = KafkaCluster(brokers=3).start()
            bootstrap = cluster.bootstrap_servers
        from confluent_kafka.admin import AdminClient

        from outbox.testing import create_topic

        nbrokers = len(AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30).brokers)
        rf = min(3, nbrokers)
        # Only what is produced is measured, nothing is read back: keep at most 1 GiB per partition
        # replica (a full run writes tens of GB at RF 3 and once filled the disk under the Spark runs).
        retention = {"retention.bytes": str(1 << 30), "segment.bytes": str(128 << 20)}
        topic_config = {**retention, "min.insync.replicas": "2"} if rf >= 3 else retention
        topic = create_topic(bootstrap, f"bench-{int(time.time())}", 3, rf, topic_config)
        config.update(
            bootstrap=("external" if external else f"local KafkaCluster, {nbrokers} brokers"),
            topic_rf=rf,
            topic_partitions=3,
        )
        log(f"topic {topic} (3 partitions, RF {rf}); cluster ready after {time.monotonic() - t_start:.0f}s")
        common = {"bootstrap": bootstrap, "topic": topic, "sample": sample}

        def budget_left() -> float:
            return (110.0 if quick else 570.0) - (time.monotonic() - t_start)

        # -- phase 1: brokers up ----------------------------------------------------------
        happy = sel & {"raw", "fallback", "burst", "write-ahead", "naive"}
        if happy:
            # Warm-up (not recorded): JIT of the brokers, idempotence PIDs, page cache.
            runner.run("raw", {**common, "n": n, "size": base, "header": True})
        for rep in range(reps if happy else 0):
            log(f"phase 1, repetition {rep + 1}/{reps}")
            for size in sizes:
                # 4 KiB runs carry about twice the bytes of the 200-byte runs, not 20x more.
                ns = n if size == base else max(2_000, n * base // size * 2)
                p = {**common, "n": ns, "size": size}
                record(f"raw/{size}", runner.run("raw", {**p, "header": False}))
                record(f"raw_hdr/{size}", runner.run("raw", {**p, "header": True}))
                if "fallback" in sel:
                    fallback_run("fallback", size, {**p, "mode": "fallback"})
                    fallback_run("fallback_oe", size, {**p, "mode": "fallback", "only_errors": True})
                    # Every message with an on_delivery, against the raw producer with the same one.
                    record(f"raw_cb/{size}", runner.run("raw", {**p, "header": True, "on_delivery": True}))
                    fallback_run("fallback_cb", size, {**p, "mode": "fallback", "on_delivery": True})
                    # The same over 1,000 keys, as most services produce: what per-key order costs.
                    keyed = {**p, "on_delivery": True, "keys": KEYED_KEYS}
                    record(f"raw_keyed/{size}", runner.run("raw", {**keyed, "header": True}))
                    fallback_run("fallback_keyed", size, {**keyed, "mode": "fallback"})
                if "burst" in sel and size == base:
                    # A healthy cluster and a full local queue: wait for room (the default) or
                    # store at once (queue_full_timeout=0), against the raw producer's poll loop.
                    burst = {**p, "kafka": {"queue.buffering.max.messages": BURST_QUEUE}}
                    record("burst_raw", runner.run("raw", {**burst, "header": True}))
                    record("burst", runner.run("resilient", {**burst, "mode": "fallback"}))
                    nowait = {**burst, "mode": "fallback", "queue_full_timeout": 0}
                    record("burst_nowait", runner.run("resilient", nowait))
                if sel & {"write-ahead", "naive"}:
                    wa = {**p, "mode": "write-ahead", "durability": "batch"}
                    record(f"wa_batch/{size}", runner.run("resilient", wa))
                if size != base:
                    continue
                if "write-ahead" in sel:
                    sync = {
                        **p,
                        "n": max(800, n // 40),
                        "mode": "write-ahead",
                        "durability": "sync",
                        "threads": 8,
                    }
                    record(f"wa_sync/{size}", runner.run("resilient", sync))
                if "naive" in sel:
                    record(f"naive/{size}", runner.run("naive", {**p, "n": max(500, n // 60)}))

        # -- phase 2: brokers down ---------------------------------------------------------
        # One outage window: the recovery child spills first, the retry children start, then
        # the spill and memory runs are measured; the window lasts at least `outage` seconds.
        template: str | None = None
        if sel & {"spill", "memory", "retry"}:
            hold: socket.socket | None = None
            if cluster is not None:
                log("stopping all brokers")
                cluster.stop_all()
                down = bootstrap
            else:
                down, hold = closed_port()
            pd = {**common, "bootstrap": down, "size": base}
            children: list[Child] = []
            outage_from = time.monotonic()
            if cluster is not None and "retry" in sel:
                pr = {**common, "size": base, "rate": 200, "tail": 3.0, "settle": 45 if quick else 90}
                simple = runner.start("simple_retry", pr)
                resil = runner.start("resilient_retry", pr)
                simple.expect("READY", 60)
                resil.expect("READY", 60)
                simple.send("GO")
                resil.send("GO")
                outage_from = time.monotonic()
                log(f"retry comparison: outage of at least {outage:.0f}s starts")
                children += [simple, resil]
            if "spill" in sel:
                for rep in range(reps):
                    log(f"outage spill, repetition {rep + 1}/{reps}")
                    record("spill", runner.run("spill", {**pd, "n": n}))
                    record("sqlite", runner.run("sqlite_batch", {**pd, "n": n}))
            if sel & {"memory", "drain"}:
                # Values of their own (as an application's are), at each size: the producer's
                # memory is bounded in bytes, so the large messages are the test. The first
                # size's outbox is the drain scenario's backlog.
                for size in MEMORY_SIZES if "memory" in sel else MEMORY_SIZES[:1]:
                    log(f"memory during an outage: {mem_n:,} messages of {size:,} B")
                    keep = size == MEMORY_SIZES[0]
                    mp = {**pd, "n": mem_n, "size": size, "distinct": True, "keep": keep}
                    m = record(f"memory/{size}", runner.run("spill", mp, timeout=3600))
                    if keep:
                        template = os.path.join(workdir, "drain-template.db")
                        prepare_template(m["db_path"], template)
            if hold is not None:
                hold.close()
            if "retry" in sel and cluster is None:
                log("retry comparison needs a local cluster to stop and restart: skipped")
            if cluster is not None:
                time.sleep(max(0.0, outage - (time.monotonic() - outage_from)))
                log("starting the brokers again")
                cluster.start_all()
                for c in children:
                    c.send("UP")
                for c in children:
                    record(c.name, c.result(600))
                config["outage_window_s"] = time.monotonic() - outage_from

        # -- phase 3: brokers up again: drain ----------------------------------------------
        if "drain" in sel:
            if template is None:
                template = os.path.join(workdir, "drain-template.db")
                log(f"filling the drain template: {drain_rows:,} rows")
                record("fill", runner.run("fill", {**common, "n": drain_rows, "size": base, "path": template}))
            for rep in range(reps):
                log(f"drain, repetition {rep + 1}/{reps}")
                p = {**common, "n": drain_rows, "size": base, "template": template}
                t0 = time.monotonic()
                record("drain", runner.run("drain", p))
                record("raw_rows", runner.run("raw_rows", p))
                if rep + 1 < reps and budget_left() < (time.monotonic() - t0) * 1.1:
                    log(f"drain: {rep + 1} repetition(s); another would break the time budget")
                    break
            config["drain_reps"] = len(runs.get("drain", []))

        # -- encryption at rest: the spill and the drain, encrypted against in clear -------
        if "encryption" in sel:
            down, hold = closed_port()
            templates = {}
            for enc in (False, True):
                path = os.path.join(workdir, f"drain-template{'-encrypted' if enc else '-clear'}.db")
                fp = {**common, "n": drain_rows, "size": base, "path": path, "encryption": enc}
                log(f"encryption: filling a drain template of {drain_rows:,} rows{' (encrypted)' if enc else ''}")
                runner.run("fill", fp)
                templates[enc] = path
            for rep in range(reps):
                log(f"encryption, repetition {rep + 1}/{reps}: spill and drain, in clear and encrypted")
                for enc in (False, True):
                    sfx = "encrypted" if enc else "clear"
                    sp = {**common, "bootstrap": down, "n": drain_rows, "size": base, "distinct": True,
                          "circuit_reset_timeout": 3600, "encryption": enc}
                    record(f"encryption/spill/{sfx}", runner.run("spill", sp, timeout=3600))
                    dp = {**common, "n": drain_rows, "size": base, "template": templates[enc], "encryption": enc}
                    record(f"encryption/drain/{sfx}", runner.run("drain", dp, timeout=3600))
            hold.close()

        # -- key rotation under traffic: produce() while `outbox keys rotate` runs -----------
        if "rotate" in sel:
            down, hold = closed_port()
            for rep in range(reps):
                log(f"rotate, repetition {rep + 1}/{reps}: {drain_rows:,} rows re-encrypted while producing")
                rp = {**common, "bootstrap": down, "n": drain_rows, "size": base, "rate": ROTATE_RATE}
                record("rotate", runner.run("rotate_latency", rp, timeout=3600))
            hold.close()

        # -- the fleet: PostgreSQL against SQLite, and four processes against one -----------
        if "fleet" in sel:
            from outbox.testing.postgres import create_database, drop_database

            from . import fleet

            pg = create_database(prefix="outbox_bench_fleet_")
            down, hold = closed_port()
            try:
                fleet.run(runner, common, n if quick else n * fleet.SCALE, reps, down, pg, workdir, record, log)
            finally:
                hold.close()
                drop_database(pg)

        # -- phase 4: recovery at 10 / 25 / 50 % of R0, each through its own full outage ---
        if "recovery" in sel and cluster is None:
            log("recovery needs a local cluster to stop and restart: skipped")
        elif "recovery" in sel:
            r0 = recovery_r0()
            if args.recovery_rate:
                config["recovery_rate"] = args.recovery_rate
            for frac, wait in recovery_steps:
                rate = args.recovery_rate or r0 * frac
                for drain in recovery_drains:
                    suffix = "" if drain == "threads" else f"/{drain}"
                    log(f"recovery at {frac:.0%} of R0 ({rate:,.0f} msgs/s, 1,000 keys), drain in {drain}: "
                        f"outage {outage:.0f}s")
                    record(f"recovery/{round(frac * 100)}{suffix}", recovery_run(rate, drain, wait))

        # -- phase 4a: recovery headroom, by bisection over the share of R0 -----------------
        if "headroom" in sel and cluster is None:
            log("headroom needs a local cluster to stop and restart: skipped")
        elif "headroom" in sel:
            r0 = recovery_r0()
            for drain in recovery_drains:
                lo, hi, frac = 0.0, HEADROOM_CEILING, HEADROOM_TARGET
                for _ in range(HEADROOM_PROBES_QUICK if quick else HEADROOM_PROBES):
                    rate = r0 * frac
                    log(f"headroom, drain in {drain}: {frac:.1%} of R0 ({rate:,.0f} msgs/s, 1,000 keys), "
                        f"outage {outage:.0f}s, empty within {HEADROOM_EMPTY_S:.0f}s?")
                    probe = record(
                        f"headroom/{drain}", {**recovery_run(rate, drain, HEADROOM_EMPTY_S), "share_of_r0": frac}
                    )
                    if emptied_in_time(probe):
                        lo = frac
                    else:
                        hi = frac
                    frac = (lo + hi) / 2

        # -- phase 4b: an asyncio service's event loop through a full outage ----------------
        if "loop-lag" in sel and cluster is None:
            log("loop-lag needs a local cluster to stop and restart: skipped")
        elif "loop-lag" in sel:
            from outbox.testing import KafkaCluster

            # A cluster of its own, its JVMs at nice 19: on this machine's few cores a broker's
            # start-up otherwise delays every process's wake-ups (the probe alone saw 75-89 ms),
            # where a real cluster runs on other machines. The probe alone still measures the machine.
            log(f"loop lag: a 3-broker cluster of its own at nice {LOOP_LAG_NICENESS}")
            with KafkaCluster(brokers=3, niceness=LOOP_LAG_NICENESS) as lag_cluster:
                lag_common = {**common, "bootstrap": lag_cluster.bootstrap_servers,
                              "topic": create_topic(lag_cluster.bootstrap_servers, topic, 3, 3, None)}
                for rep in range(reps):
                    log(f"loop lag {rep + 1}/{reps}: AsyncResilientProducer at {LOOP_LAG_RATE:,.0f} msgs/s, "
                        f"all brokers down {outage:.0f}s")
                    c = runner.start("loop_lag", {**lag_common, "rate": LOOP_LAG_RATE, "keys": 100, "max_wait": 120})
                    c.expect("READY", 120)
                    whole_outage(c, lag_cluster, outage)
                    record("loop-lag", c.result(300))

        # -- phase 4c: a producer and a consumer in one process, through two outages ---------
        if "soak" in sel and cluster is None:
            log("soak needs a local cluster to stop and restart: skipped")
        elif "soak" in sel:
            assert cluster is not None
            log(f"soak: producer + ResilientConsumer in one process at {SOAK_RATE:,.0f} msgs/s, "
                f"two outages of {outage:.0f}s")
            c = runner.start("soak", {**common, "rate": SOAK_RATE, "size": 1024, "rf": rf, "outages": 2})
            c.expect("READY", 120)
            for _ in range(2):
                whole_outage(c, cluster, outage)
                c.expect("CAUGHT_UP", 600)
            record("soak", c.result(300))

        # -- phase 5: Spark bulk drain vs the CLI drain on copies of one outbox; standalone 1 / 2 executors ---
        if "spark" in sel:
            spark_rows = drain_rows  # --drain-rows: the same backlog as the drain scenario's
            log(f"spark bulk drain vs outbox drain ({spark_rows:,} rows, 1,000 keys), standalone 1/2 executors")
            for name, result in spark_runs(bootstrap, spark_rows, workdir).items():
                record(f"spark/{name}", result)

        # -- phase 6: the consumer side: raw consumer loop, ResilientConsumer, 1 % failing, delays ---
        if "consumer" in sel:
            from .bench_consumer import fill

            consumer_n = n if quick else 20 * n  # a raw loop reads ~1M msgs/s: 2M messages last ~2 s
            ctopic = create_topic(bootstrap, f"bench-consumer-{int(time.time())}", 3, rf, None)
            log(f"consumer: filling {ctopic} with {consumer_n:,} messages of {base} B")
            fill(bootstrap, ctopic, consumer_n, base)
            pc = {**common, "topic": ctopic, "n": consumer_n, "size": base}
            for rep in range(reps):
                log(f"consumer, repetition {rep + 1}/{reps}")
                for loop in ("raw", "happy", "fail"):
                    record(f"consumer/{loop}", runner.run("consumer", {**pc, "loop": loop}))
            log("consumer: retry-tier delay precision (300 messages through RetryTopics([0.5, 1, 2]))")
            record("consumer/precision", runner.run("consumer", {**common, "loop": "precision", "n": 300}))

        # -- phase 7: the consumer's inbox: dedup=True against without, per store ---------------
        if "dedup" in sel:
            from .bench_dedup import LOOPS, fill_with_ids, store_urls

            dedup_n = n if quick else 3 * n
            dtopic = create_topic(bootstrap, f"bench-dedup-{int(time.time())}", 3, rf, None)
            log(f"dedup: filling {dtopic} with {dedup_n:,} messages of 200 B, each with its outbox-id")
            fill_with_ids(bootstrap, dtopic, dedup_n)
            dedup_stores = store_urls(workdir)
            for rep in range(reps):
                log(f"dedup, repetition {rep + 1}/{reps}")
                for kind, url in dedup_stores.items():
                    for loop in LOOPS:
                        record(f"dedup/{kind}/{loop}", runner.run(
                            "dedup", {**common, "topic": dtopic, "n": dedup_n, "store": url, "loop": loop}
                        ))
    finally:
        if cluster is not None:
            cluster.close()
        shutil.rmtree(workdir, ignore_errors=True)

    # The raw runs first: a bug in the table below must not lose them. With --no-write they go to
    # the temporary directory, for a look at what the table leaves out (curves, samples).
    if args.no_write:
        raw_runs = Path(tempfile.gettempdir()) / "outbox-bench-last-runs.json"
    else:
        RESULTS.mkdir(exist_ok=True)
        raw_runs = RESULTS / ".last-runs.json"
    config["elapsed_s"] = time.monotonic() - t_start
    config["loadavg_start"] = load0
    config["git_at_start"] = rev0
    raw_runs.write_text(json.dumps({"config": config, "runs": runs}, default=str) + "\n")
    print(f"runs: {raw_runs}")

    return report(args, config, runs)


def report(args: argparse.Namespace, config: Result, runs: dict[str, list[Result]]) -> int:
    """Print the table (and write results/, the README table and the recovery curves) from the runs."""
    quick, sizes, reps, outage = config["quick"], config["sizes"], config["reps"], config["outage_s"]
    base, drain_rows, mem_n = config["sizes"][0], config["drain_rows"], config["memory_messages"]
    selected, rev0 = config["scenarios"], config["git_at_start"]
    # Kept with the runs from now on; a replay of an older run's file says it was not recorded.
    load0 = config.get("loadavg_start")
    load_at_start = "not recorded" if load0 is None else f"{load0[0]:.1f}"
    # -- the table -------------------------------------------------------------------------
    table = Table()
    summary: dict[str, Result] = {k: summarize(v) for k, v in runs.items()}

    def ratio(a: str, b: str) -> float | None:
        x, y = summary.get(a, {}).get("msgs_per_s"), summary.get(b, {}).get("msgs_per_s")
        return x / y if x and y else None

    def check(r: float | None, target: float) -> bool | None:
        return None if r is None else r >= target

    for size in sizes:
        sfx = f" [{size} B]"
        if f"raw/{size}" in summary:
            table.add("R0 raw producer, no header" + sfx, summary[f"raw/{size}"], ratio=1.0, target="baseline")
        if f"raw_hdr/{size}" in summary:
            table.add(
                "R1 raw producer + id header" + sfx,
                summary[f"raw_hdr/{size}"],
                ratio=ratio(f"raw_hdr/{size}", f"raw/{size}"),
                target="(vs R0)",
            )
        if f"raw_cb/{size}" in summary:
            table.add(
                "R1 + on_delivery per message" + sfx,
                summary[f"raw_cb/{size}"],
                ratio=ratio(f"raw_cb/{size}", f"raw/{size}"),
                target="(vs R0)",
            )
        if f"raw_keyed/{size}" in summary:
            table.add(
                f"R1 + {KEYED_KEYS:,} keys + on_delivery per message" + sfx,
                summary[f"raw_keyed/{size}"],
                ratio=ratio(f"raw_keyed/{size}", f"raw/{size}"),
                target="(vs R0)",
            )
        for name, label, aside, baseline in (
            ("fallback", "fallback mode, happy path", " (aim >= 0.90)", "raw_hdr"),
            (
                "fallback_oe", "fallback, happy path, delivery.report.only.error", "; on_delivery hears failures only",
                "raw_hdr",
            ),
            ("fallback_cb", "fallback, happy path, on_delivery per message", "; ratio vs R1 + on_delivery", "raw_cb"),
            (
                "fallback_keyed", f"fallback, {KEYED_KEYS:,} keys, on_delivery per message",
                "; ratio vs R1 with the same keys and on_delivery", "raw_keyed",
            ),
        ):
            # The pure-Python build, then the compiled one (`--compiled`) when it ran.
            for key, build in ((f"{name}/{size}", ""), (f"{name}_c/{size}", COMPILED_LABEL)):
                if key not in summary:
                    continue
                r1 = ratio(key, f"{baseline}/{size}")
                r0 = ratio(key, f"raw/{size}")
                spilled = med(runs[key], "outboxed")
                note = f"vs R0: {r0:.2f}{aside}" if r0 else ""
                if build:
                    vs_pure = ratio(key, f"{name}/{size}")
                    note = (f"vs pure Python: {vs_pure:.2f}; " if vs_pure else "") + note
                if spilled:
                    note += f"; median {spilled:.0f} spilled (queue full)"
                table.add(
                    label + build + sfx, summary[key], ratio=r1, target=">= 0.95 x R1", met=check(r1, 0.95), notes=note
                )
        if f"wa_batch/{size}" in summary:
            r = ratio(f"wa_batch/{size}", f"raw/{size}")
            early = sum(1 for x in runs[f"wa_batch/{size}"] if x.get("flush_returned_before_delivery"))
            table.add(
                "write-ahead, durability=batch" + sfx,
                summary[f"wa_batch/{size}"],
                ratio=r,
                target=">= 0.60 x R0",
                met=check(r, 0.60),
                notes=f"flush() returned once committed, before all deliveries, in {early} run(s)" if early else "",
            )
        if f"wa_sync/{size}" in summary:
            table.add(
                "write-ahead, durability=sync, 8 threads" + sfx,
                summary[f"wa_sync/{size}"],
                ratio=ratio(f"wa_sync/{size}", f"raw/{size}"),
                target="report (vs R0)",
            )
        if f"naive/{size}" in summary:
            sp = ratio(f"wa_batch/{size}", f"naive/{size}")
            table.add(
                "naive durable: 1 txn/msg FULL, then produce" + sfx,
                summary[f"naive/{size}"],
                ratio=sp,
                target="WA >= 30x naive",
                met=None if sp is None else sp >= 30,
                notes=f"write-ahead is {sp:.1f}x faster" if sp else "",
            )
    if "burst_raw" in summary:
        table.add(
            f"burst: raw producer + id header, {BURST_QUEUE:,}-message local queue [{base} B]",
            summary["burst_raw"], ratio=1.0, target="baseline",
        )
        for name, label in (
            ("burst", "burst: fallback, queue_full_timeout=0.5 (default)"),
            ("burst_nowait", "burst: fallback, queue_full_timeout=0 (store at once)"),
        ):
            stored, waits = med(runs[name], "outboxed"), med(runs[name], "queue_full_waits")
            table.add(
                f"{label} [{base} B]", summary[name], ratio=ratio(name, "burst_raw"), target="report (vs raw)",
                notes=f"median {fmt(stored)} of {fmt(summary[name]['n'])} stored in the outbox, "
                f"{fmt(waits)} waits for room",
            )
    if "spill" in summary:
        r = ratio("spill", "sqlite")
        table.add("raw SQLite executemany, 1000-row txns FULL", summary["sqlite"], ratio=1.0, target="baseline")
        table.add(
            "outage spill (circuit open) to flush()==0",
            summary["spill"],
            ratio=r,
            target=">= 0.80 x SQLite",
            met=check(r, 0.80),
        )
    if "fleet/spill/sqlite" in summary:
        from .fleet import DRAIN_VS_SQLITE, FLEET_VS_ONE, PROCESSES, SPILL_VS_SQLITE

        fleet_rows = (
            ("fleet/spill/sqlite", None, "baseline", None, "spill, 1 process, SQLite"),
            ("fleet/spill/postgresql", "fleet/spill/sqlite", f">= {SPILL_VS_SQLITE} x SQLite", SPILL_VS_SQLITE,
             "spill, 1 process, PostgreSQL"),
            ("fleet/spill/postgresql x4", "fleet/spill/postgresql", f">= {FLEET_VS_ONE} x 1 process", FLEET_VS_ONE,
             f"spill, {PROCESSES} processes into one PostgreSQL table (aggregate)"),
            ("fleet/drain/sqlite", None, "baseline", None, "`outbox drain`, 1 process, SQLite"),
            ("fleet/drain/postgresql", "fleet/drain/sqlite", f">= {DRAIN_VS_SQLITE} x SQLite", DRAIN_VS_SQLITE,
             "`outbox drain`, 1 process, PostgreSQL"),
            ("fleet/drain/postgresql x4", "fleet/drain/postgresql", f">= {FLEET_VS_ONE} x 1 process", FLEET_VS_ONE,
             f"`outbox drain`, {PROCESSES} processes on one PostgreSQL table (aggregate)"),
        )
        for key, against, target, floor, label in fleet_rows:
            if key not in summary:
                continue
            r = ratio(key, against) if against else 1.0
            row = summary[key]
            servers = "; CPU µs/msg beside the row's own: " + ", ".join(
                f"{what} {fmt(row.get(field), 1)}"
                for what, field in (("PostgreSQL server", "server_cpu_us_per_msg"),
                                    ("brokers", "brokers_cpu_us_per_msg"))
                if "postgresql" in key or what == "brokers"
            )
            table.add(
                f"fleet: {label}", row, ratio=r, target=target,
                met=None if floor is None else check(r, floor),
                notes=("drains include process start; every message read back once by outbox-id"
                       if "drain" in key else "spilled to a closed port: no broker is sent to") + servers,
            )
    if "drain" in summary:
        r = ratio("drain", "raw_rows")
        from outbox import Drainer

        defaults = inspect.signature(Drainer).parameters
        drain_defaults = f"{defaults['workers'].default} worker, {defaults['batch_size'].default:,}-row claims"
        rem = max((x.get("remaining", 0) for x in runs["drain"]), default=0)
        table.add(
            f"raw producer, same rows from memory ({drain_rows:,})",
            summary["raw_rows"],
            ratio=1.0,
            target="baseline",
        )
        table.add(
            f"drain {drain_rows:,} rows, Drainer's defaults ({drain_defaults})",
            summary["drain"],
            ratio=r,
            target=">= 0.80 x raw",
            met=check(r, 0.80),
            notes=f"{rem} rows left" if rem else "",
        )
    for what in ("spill", "drain"):
        clear, sealed_ = f"encryption/{what}/clear", f"encryption/{what}/encrypted"
        if clear in summary and sealed_ in summary:
            label = "outage spill to flush()==0" if what == "spill" else "drain, the Drainer's defaults"
            table.add(f"{label}, {drain_rows:,} x {base} B, in clear", summary[clear], ratio=1.0, target="baseline")
            r = ratio(sealed_, clear)
            table.add("same, encrypted at rest (AES-256-GCM)", summary[sealed_], ratio=r,
                      target=f">= {ENCRYPTED_VS_CLEAR:.2f} x in clear", met=check(r, ENCRYPTED_VS_CLEAR))
    if "rotate" in runs:
        label, row, how = _rotate_row(runs["rotate"], drain_rows)
        table.add(label, row, **how)
    for size in MEMORY_SIZES:
        key = f"memory/{size}"
        if key not in runs and size == MEMORY_SIZES[0] and "memory" in runs:
            key = "memory"  # saved by an earlier version: one run, at the base size
        if key not in runs:
            continue
        m = runs[key][0]
        curve = m.get("rss_mb_at_pct", {})
        pts = [curve.get(k) for k in ("25", "50", "75", "100") if curve.get(k) is not None]
        # Flat: what a quarter of the outage left resident grows by less than MEMORY_FLAT_MB
        # over the other three quarters (a count bound grew with every message until its cap).
        growth = (max(pts) - pts[0]) if len(pts) >= 2 else None
        flat = growth is not None and growth < MEMORY_FLAT_MB
        before = curve.get("0")  # the producer built, before the first message of the outage
        over = m["peak_rss_mb"] - before if before is not None else None
        held, budget = m.get("memory_held_peak"), m.get("memory_budget")
        held_note = ""
        if held is not None and budget is not None:  # the producer's own count (stats())
            held_note = f"; held at most {held / 2**20:.1f} of {budget / 2**20:.0f} MiB"
        table.add(
            f"memory: {mem_n:,}-message outage, {m.get('size', base):,} B each",
            summarize(runs[key]),
            target=f"< {MEMORY_PEAK_MB} MB, < +{MEMORY_GROWTH_MB} MB, flat",
            met=(m["peak_rss_mb"] < MEMORY_PEAK_MB and over is not None and over < MEMORY_GROWTH_MB and flat),
            notes="RSS MB at 25/50/75/100%: "
            + "/".join(f"{x:.0f}" for x in pts)
            + f"; peak {m['peak_rss_mb']:.0f}, {fmt(over, 1)} MB over {fmt(before, 0)} before the outage"
            + f"; growth after 25%: {fmt(growth, 1)} MB"
            + held_note
            + f"; uncommitted at 100%: {m.get('uncommitted_at_pct', {}).get('100', '?'):,}",
        )
    for (pct, target_s), place in itertools.product(((10, 60.0), (25, 180.0), (50, None)), DRAIN_PLACES):
        key = f"recovery/{pct}" + ("" if place == "threads" else f"/{place}")
        if key not in summary:
            continue
        run = runs[key][0]
        where = ", " + DRAIN_PLACES[place]
        after = run.get("empty_after_up_s")
        p50, p99 = run.get("latency_p50_s"), run.get("latency_p99_s")
        lat = f"post-restart latency p50 {fmt_s(p50)} / p99 {fmt_s(p99)}"
        if after is not None:
            state = f"empty {after:.1f}s after restart"
        else:
            state = f"NOT empty when the run ended, {run.get('pending_left') or 0:,} left"
        share = "fixed rate" if config.get("recovery_rate") else f"{pct}% of R0"
        table.add(
            f"recovery at {share} ({run['rate_wanted']:,.0f}/s), all brokers down {outage:.0f}s{where}",
            summary[key],
            target=f"empty <= {target_s:.0f}s" if target_s else "report",
            met=None if target_s is None else (after is not None and after <= target_s),
            notes=f"{state}; {lat}; pending at restart {run.get('pending_at_up') or 0:,}, max {run['pending_max']:,}; "
            f"offered {run['rate_achieved']:,.0f}/s; {run['not_delivered_after_up']:,} post-restart msgs undelivered"
            + _cpu_split(run),
        )
    for place in DRAIN_PLACES:
        probes = runs.get(f"headroom/{place}")
        if probes:
            headroom_row(table, probes, outage, config.get("recovery_r0"), DRAIN_PLACES[place])
    spark_cpu = summary.get("spark/spark local[2]", {}).get("cpu_us_per_msg")
    cli_cpu = summary.get("spark/outbox drain", {}).get("cpu_us_per_msg")
    for name in ("outbox drain", *VARIANTS, "standalone, 1 executor(s)", "standalone, 2 executor(s)"):
        key = f"spark/{name}"
        if key not in summary:
            continue
        run = runs[key][0]
        cpu = summary[key]["cpu_us_per_msg"]
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(run.get("cpu_us_per_msg_by_kind", {}).items(),
                                                             key=lambda kv: -kv[1]))
        first = run.get("first_message_s")
        notes = f"CPU µs/row of the whole process tree: {kinds}" + (
            f"; launch to first message {first:.1f} s" if first is not None else "")
        if name == "spark local[2]":  # wall, then CPU per row against the CLI's of the same run
            table.add(
                f"drain to empty: {name}, {run['n']:,} rows (start-up included)", summary[key],
                ratio=ratio(key, "spark/outbox drain"), target="wall <= 1.5x outbox drain",
                met=summary[key]["seconds"] <= 1.5 * summary["spark/outbox drain"]["seconds"], notes=notes,
            )
            r = cpu / cli_cpu if cpu and cli_cpu else None
            table.add("same: CPU per row (whole process tree) vs outbox drain's", summary[key], ratio=r,
                      target=f"CPU/row <= {SPARK_VS_CLI_CPU}x outbox drain",
                      met=None if r is None else r <= SPARK_VS_CLI_CPU)
        elif name in VARIANTS:  # a change that rewrites every value, against the job without it
            r = cpu / spark_cpu if cpu and spark_cpu else None
            table.add(f"drain to empty: {name} ({' '.join(VARIANTS[name])}), CPU per row vs spark local[2]'s",
                      summary[key], ratio=r, target=f"CPU/row <= {TRANSFORM_CPU}x spark local[2]",
                      met=None if r is None else r <= TRANSFORM_CPU, notes=notes)
        else:
            table.add(f"drain to empty: {name}, {run['n']:,} rows (start-up included)", summary[key],
                      ratio=ratio(key, "spark/outbox drain"),
                      target="baseline" if name == "outbox drain" else "report (vs outbox drain)", notes=notes)
        if name in VARIANTS:
            table.add(f"same: launch to first message on the broker ({fmt(first, 1)} s)", None,
                      target=f"<= {FIRST_MESSAGE_S:.0f} s", met=first is not None and first <= FIRST_MESSAGE_S)
    if "consumer/raw" in summary:
        table.add(f"consumer: raw confluent_kafka.Consumer loop [{base} B]", summary["consumer/raw"], ratio=1.0,
                  target="baseline")
        for key, label, goal in (("consumer/happy", "ResilientConsumer, nothing failing", 0.90),
                                 ("consumer/fail", "ResilientConsumer, 1 % failing once", 0.80)):
            if key not in summary:
                continue
            r = ratio(key, "consumer/raw")
            # Paired: each repetition against the raw run just before it (cancels the drift of a shared machine).
            paired = statistics.median(
                x["msgs_per_s"] / y["msgs_per_s"] for x, y in zip(runs[key], runs["consumer/raw"], strict=False)
            )
            table.add(f"consumer: {label} [{base} B]", summary[key], ratio=r, target=f">= {goal:.2f} x raw",
                      met=check(r, goal), notes=f"median paired ratio {paired:.2f}")
    for kind in ("sqlite", "postgresql"):
        plain = f"dedup/{kind}/plain"
        if plain not in summary:
            continue
        table.add(f"consumer: dedup off, {kind} store [200 B]", summary[plain], ratio=1.0, target="baseline")
        goals: tuple[tuple[str, str, float | None], ...] = (
            ("dedup", "dedup=True, handler(msg)", 0.80), ("dedup-tx", "dedup=True, handler(msg, tx)", None),
        )
        for dloop, dlabel, dgoal in goals:
            key = f"dedup/{kind}/{dloop}"
            if key in summary:
                r = ratio(key, plain)
                table.add(f"consumer: {dlabel}, {kind} [200 B]", summary[key], ratio=r,
                          target="report" if dgoal is None else f">= {dgoal:.2f} x dedup off",
                          met=None if dgoal is None else check(r, dgoal),
                          notes="one transaction per message" if dgoal is None else "marks per poll batch")
    if "consumer/precision" in runs:
        prec = runs["consumer/precision"][0]["precision"]
        table.add(
            "consumer: retry-tier delay precision (how late)",
            None,
            target="report",
            notes="; ".join(f"{tier} p50 {v['p50_ms']:.0f} ms / p99 {v['p99_ms']:.0f} ms (min {v['min_ms']:.0f})"
                            for tier, v in prec.items()),
        )
    if "loop-lag" in runs:
        label, row, how = _loop_lag_row(runs["loop-lag"], outage)
        table.add(label, row, **how)
    if "soak" in runs:
        soak = runs["soak"][0]
        table.add(
            f"soak: producer + ResilientConsumer in one process, two {outage:.0f}s outages [1 KiB]",
            soak,
            target=f"RSS after the last outage < +{SOAK_KEPT_MB} MB over before the first",
            met=soak["growth_mb"] < SOAK_KEPT_MB,
            notes=f"RSS before {soak['rss_before_mb']:.0f} MB, after {soak['rss_after_mb']:.0f} MB "
            f"({soak['growth_mb']:+.0f} MB), peak {soak['peak_rss_mb']:.0f} MB; caught up "
            + "/".join(f"{x:.0f}" for x in soak["caught_up_after_up_s"]) + " s after each restart; "
            f"{soak['handled']:,} of {soak['n']:,} handled",
        )
    png = None if args.no_write else plot_recovery(runs, outage, quick)
    if png is not None:
        print(f"recovery curves: {png.relative_to(ROOT)}")
    for key, label in (
        ("simple_retry", "simple retry: tenacity + produce()+flush()"),
        ("resilient_retry", "ResilientProducer, same app"),
    ):
        if key in summary:
            run = runs[key][0]
            table.add(
                f"{label}, {run['outage_s']:.0f}s outage",
                None,
                target="0 lost" if key == "resilient_retry" else "report",
                met=(run["lost"] == 0) if key == "resilient_retry" else None,
                notes=f"blocked {run['blocked_s']:.2f}s (longest call {run['longest_call_s']:.2f}s), "
                f"lost {run['lost']}, dead-lettered {run.get('dead', '?')}, sent {run['attempted']}/{run['wanted']} "
                "wanted",
            )
    stage_rows: list[tuple[str, str, str | None]] = []
    for size in sizes:
        sfx = f" [{size} B]"
        stage_rows += [
            ("R1 raw producer + id header" + sfx, f"raw_hdr/{size}", None),
            ("fallback mode, happy path" + sfx, f"fallback/{size}", f"raw_hdr/{size}"),
            ("fallback mode, happy path" + COMPILED_LABEL + sfx, f"fallback_c/{size}", f"raw_hdr/{size}"),
            ("fallback, only-error reports" + sfx, f"fallback_oe/{size}", f"raw_hdr/{size}"),
            ("fallback, only-error reports" + COMPILED_LABEL + sfx, f"fallback_oe_c/{size}", f"raw_hdr/{size}"),
            ("R1 + on_delivery per message" + sfx, f"raw_cb/{size}", None),
            ("fallback, on_delivery per message" + sfx, f"fallback_cb/{size}", f"raw_cb/{size}"),
            (f"R1 + {KEYED_KEYS:,} keys + on_delivery" + sfx, f"raw_keyed/{size}", None),
            (f"fallback, {KEYED_KEYS:,} keys + on_delivery" + sfx, f"fallback_keyed/{size}", f"raw_keyed/{size}"),
            (
                "fallback, on_delivery per message" + COMPILED_LABEL + sfx, f"fallback_cb_c/{size}",
                f"raw_cb/{size}",
            ),
            ("R0 raw producer, no header" + sfx, f"raw/{size}", None),
            ("write-ahead, durability=batch" + sfx, f"wa_batch/{size}", f"raw/{size}"),
        ]
    stage_rows += [("raw producer, same rows from memory", "raw_rows", None), ("drain", "drain", "raw_rows")]
    stage_rows += [(f"recovery at {k.split('/', 1)[1]}", k, None) for k in runs if k.startswith("recovery/")]
    stage_text, stage_md, stage_json = cpu_by_stage(runs, stage_rows)
    elapsed = config["elapsed_s"]
    text = table.text()
    print(text)
    if stage_json:
        print(f"\nWhere the CPU goes: µs per message of each thread (medians){STAGE_NOTE}\n{stage_text}")
    print(
        f"\n{'quick' if quick else 'full'} run, {reps} reps, medians; {elapsed:.0f}s; "
        f"load average at start {load_at_start}" + ("" if args.from_runs else f", now {os.getloadavg()[0]:.1f}")
    )

    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        date = _dt.date.today().isoformat()
        info = machine()
        info["loadavg_end"] = None if args.from_runs else os.getloadavg()
        info["git_at_start"] = rev0
        info["loadavg_start"] = load0
        if args.from_runs:  # what was measured is the code at the run's start, not this checkout
            info["git"] = rev0
            info["table_from"] = str(args.from_runs)
        if rev0 != info["git"]:
            print(f"WARNING: outbox/ changed during the run ({rev0} -> {info['git']})", file=sys.stderr)
        out = RESULTS / f"{date}{'-quick' if quick else ''}.json"
        out.write_text(
            json.dumps(
                {
                    "date": _dt.datetime.now().isoformat(timespec="seconds"),
                    "elapsed_s": elapsed,
                    "machine": info,
                    "config": config,
                    "table": table.rows,
                    "cpu_by_stage": stage_json,
                    "summary": summary,
                    "runs": runs,
                },
                indent=1,
                default=str,
            )
            + "\n"
        )
        (RESULTS / ".last-runs.json").unlink(missing_ok=True)
        print(f"results: {out.relative_to(ROOT)}")
        if not quick and set(selected) == set(ALL) and README.exists():
            md = (
                f"Run {date}, full, {reps} interleaved reps (medians), {elapsed:.0f} s; "
                f"{info['cores']} cores ({info['cpu']}), {info['mem_gib']} GiB, Python {info['python']}, "
                f"librdkafka {info['librdkafka']}, load average at start {load_at_start} "
                f"(shared machine).\n\n{table.markdown()}\n\nWhere the CPU goes: µs per message of each "
                f"thread (medians){STAGE_NOTE}\n\n{stage_md}\n"
            )
            body = README.read_text()
            new = re.sub(
                r"(<!-- table:start -->\n).*?(<!-- table:end -->)",
                lambda mt: mt.group(1) + md + mt.group(2),
                body,
                flags=re.S,
            )
            README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
