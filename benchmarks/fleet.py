"""The fleet scenario: PostgreSQL as the outbox of several producer and drain processes.

Run by ``python -m benchmarks --scenarios fleet`` with the brokers up. Spills go to an
unreachable bootstrap (a closed local port, circuit open), so every message is stored; drains are
the real ``outbox drain --until-empty`` CLI against the cluster, process start included.

N is `SCALE` times ``--messages`` (1,000,000 by default; ``--quick``: ``--messages``), and every
spill keeps its circuit open throughout (no probe message half-opens it midway).

1. One process: spill N messages to SQLite and to PostgreSQL (the `spill` scenario), then drain
   each with one ``outbox drain`` process. PostgreSQL's rates are compared with SQLite's.
2. Four producer processes spill N/4 each into one fresh PostgreSQL table at once (they wait for a
   common start time after they are set up, so the window is the spill, not the imports), then
   four ``outbox drain`` processes drain it at once. Aggregate msgs/s: all messages over the
   span from the first start to the last end, against step 1's single PostgreSQL process.

Every drained message is read back from the topic and counted by its ``outbox-id`` header:
each one exactly once, or the run fails. A drain's CPU µs/msg is its processes' own CPU (user +
system, process start included). The PostgreSQL server's (every local process named postgres, its
exited backends included) and the brokers' over the same step are printed beside it, per message.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from .threadcpu import brokers_cpu, postgres_cpu

Result = dict[str, Any]
#: Producer and drain processes of the fleet runs.
PROCESSES = 4
#: Targets: PostgreSQL against SQLite in one process, and four processes against one.
SPILL_VS_SQLITE = 0.6
DRAIN_VS_SQLITE = 0.8
FLEET_VS_ONE = 1.5
#: A full run's fleet rows store and drain this many times `--messages` (`--quick`: once): four
#: `outbox drain` processes start in about 0.3 s of CPU each, which at 100,000 messages was most
#: of a four-process drain.
SCALE = 10
#: Longer than any spill here: the circuit stays open throughout (`scenarios.spill`).
NO_PROBE = 3600.0
ID_HEADER = "outbox-id"


def _cli() -> str:
    return os.path.join(os.path.dirname(sys.executable), "outbox")


def _pg_url(base: str, table: str) -> str:
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}table={table}"


def drain_processes(urls: list[str], bootstrap: str, log_dir: str) -> Result:
    """Run one ``outbox drain --until-empty`` per URL at once: wall seconds, process start
    included, and the CPU seconds of those processes (nothing else is run meanwhile)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    procs = []
    for i, url in enumerate(urls):
        err = open(os.path.join(log_dir, f"fleet-drain-{i}-{os.getpid()}.log"), "wb")  # noqa: SIM115
        procs.append((subprocess.Popen(  # noqa: S603
            [_cli(), "drain", "--outbox", url, "-b", bootstrap, "--until-empty"],
            stdout=subprocess.DEVNULL, stderr=err,
        ), err))
    codes = []
    for proc, err in procs:
        codes.append(proc.wait(timeout=1800))
        err.close()
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    # 3 (PENDING) is how a drainer that finds the rest leased by the others stops; that every
    # message arrived once is checked by reading them back.
    if any(code not in (0, 3) for code in codes):
        raise RuntimeError(f"outbox drain exited with {codes}; logs in {log_dir}")
    return {"seconds": seconds, "cpu_s": cpu}


def drained(n: int, d: Result) -> Result:
    """A drain's result row: rate and CPU µs per message of the drain processes."""
    return {"n": n, "seconds": d["seconds"], "msgs_per_s": n / d["seconds"], "cpu_us_per_msg": d["cpu_s"] / n * 1e6}


def read_back(bootstrap: str, topic: str, expected: int, timeout: float = 300) -> Counter[bytes]:
    """Every `outbox-id` on the topic, counted (stops when `expected` were read or at `timeout`)."""
    from confluent_kafka import Consumer

    c = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"fleet-{uuid.uuid4().hex}",
        "auto.offset.reset": "earliest", "enable.auto.commit": False,
    })
    c.subscribe([topic])
    seen: Counter[bytes] = Counter()
    deadline = time.monotonic() + timeout
    read = 0
    try:
        while read < expected and time.monotonic() < deadline:
            for m in c.consume(10_000, 1.0):
                if m.error():
                    continue
                read += 1
                for h in m.headers() or []:
                    k, v = h[0], h[1]
                    if k == ID_HEADER and v is not None:
                        seen[v.encode() if isinstance(v, str) else v] += 1
    finally:
        c.close()
    return seen


def check_once(seen: Counter[bytes], expected: int, what: str) -> None:
    dupes = sum(1 for v in seen.values() if v > 1)
    if len(seen) != expected or dupes:
        raise RuntimeError(f"{what}: {len(seen):,} distinct outbox-ids of {expected:,}, {dupes:,} duplicated")


class ServersCPU:
    """The CPU that this machine's PostgreSQL server and the local brokers spend from `start()`
    to `add_to()`, per message (None where not measured: a server elsewhere)."""

    def start(self) -> ServersCPU:
        self._at = (postgres_cpu(), brokers_cpu(os.getpid()))
        return self

    def add_to(self, result: Result, n: int) -> Result:
        now = (postgres_cpu(), brokers_cpu(os.getpid()))
        for field, a, b in zip(("server_cpu_us_per_msg", "brokers_cpu_us_per_msg"), self._at, now, strict=True):
            result[field] = None if a is None or b is None else (b - a) / n * 1e6
        return result


def drain_all(urls: list[str], bootstrap: str, log_dir: str, n: int) -> Result:
    """`drain_processes` of `n` messages in all, as a result row with the servers' CPU."""
    servers = ServersCPU().start()
    return servers.add_to(drained(n, drain_processes(urls, bootstrap, log_dir)), n)


def spill_together(runner: Any, p: Result, processes: int) -> Result:
    """`processes` spill children of `p["n"]` messages each, started together at `p["start_at"]`:
    their aggregate rate over the span from the first start to the last end, and the servers'
    CPU from the common start on (not over the children's set-up)."""
    children = [runner.start("spill", p) for _ in range(processes)]
    time.sleep(max(0.0, float(p["start_at"]) - time.time()))
    servers = ServersCPU().start()
    parts = [c.result(1800) for c in children]
    span = max(r["ended_at"] for r in parts) - min(r["started_at"] for r in parts)
    total = int(p["n"]) * processes
    cpu = sum(r["cpu_us_per_msg"] for r in parts) / len(parts)  # each process spilled p["n"]
    return servers.add_to({"n": total, "seconds": span, "msgs_per_s": total / span, "cpu_us_per_msg": cpu}, total)


def run(
    runner: Any, common: Result, n: int, reps: int, down: str, postgres: str, workdir: str,
    record: Callable[[str, Result], Result], log: Callable[[str], None],
) -> None:
    """The fleet runs (see the module docstring); results under fleet/*."""
    from outbox.testing import create_topic

    bootstrap = common["bootstrap"]
    for rep in range(reps):
        log(f"fleet, repetition {rep + 1}/{reps}")
        stem = f"f{uuid.uuid4().hex[:8]}"
        # -- one process: SQLite and PostgreSQL, spill then drain --------------------------
        for store in ("sqlite", "postgresql"):
            topic = create_topic(bootstrap, f"fleet-{stem}-{store}", 3, 3, {})
            sqlite_path = os.path.join(workdir, f"fleet-{stem}.db")
            url = f"sqlite:///{sqlite_path}" if store == "sqlite" else _pg_url(postgres, f"{stem}_one")
            p = {**common, "bootstrap": down, "topic": topic, "n": n, "size": 200, "outbox": url,
                 "circuit_reset_timeout": NO_PROBE}
            servers = ServersCPU().start()
            record(f"fleet/spill/{store}", servers.add_to(runner.run("spill", p), n))
            d = drain_all([url], bootstrap, workdir, n)
            check_once(read_back(bootstrap, topic, n), n, f"{store} drain")
            record(f"fleet/drain/{store}", d)
        # -- four processes into one PostgreSQL table ----------------------------------------
        topic = create_topic(bootstrap, f"fleet-{stem}-four", 3, 3, {})
        url = _pg_url(postgres, f"{stem}_four")
        share = n // PROCESSES
        start_at = time.time() + 10.0
        p = {**common, "bootstrap": down, "topic": topic, "n": share, "size": 200, "outbox": url,
             "start_at": start_at, "circuit_reset_timeout": NO_PROBE}
        total = share * PROCESSES
        record("fleet/spill/postgresql x4", spill_together(runner, p, PROCESSES))
        d = drain_all([url] * PROCESSES, bootstrap, workdir, total)
        check_once(read_back(bootstrap, topic, total), total, "4-process drain")
        record("fleet/drain/postgresql x4", d)
