"""CPU time of each thread of this process, and of the local brokers and PostgreSQL, over a span.

Shared by the scenarios (`python -m benchmarks` prints where each row's CPU went) and by
`profile_threads.py`. Threads are named after the Python thread that owns them (the outbox's
own threads are named `outbox-*`) or, for librdkafka's, after the name it gives them (`rdk:*`).
"""

from __future__ import annotations

import glob
import os
import threading
from collections.abc import Iterator, Mapping

BROKERS = "Kafka brokers (JVMs)"
_TICK = os.sysconf("SC_CLK_TCK")
_SAMPLER = "cpu-sampler"

#: What a run's threads are, by the start of their names: one column each in `python -m
#: benchmarks`'s CPU table. The first match wins; `MainThread` is the scenario's own caller.
STAGES: tuple[tuple[str, str], ...] = (
    ("MainThread", "application"),
    ("outbox-delivery", "delivery thread"),
    ("outbox-writer", "writer"),
    ("outbox-drain-events", "drain process's reports"),  # drain_in="process": its reader thread here
    ("outbox-drain", "drain workers"),
    ("outbox-claim", "drain workers"),  # a drain worker's claim thread
    ("outbox-keys", "key watcher"),
    ("rdk:", "librdkafka"),
)
OTHER = "other threads"


def thread_cpu() -> dict[int, tuple[str, float]]:
    """(name, CPU seconds so far) of each live thread of this process, by thread id."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[int, tuple[str, float]] = {}
    for task in glob.glob(f"/proc/{os.getpid()}/task/*"):
        try:
            with open(f"{task}/comm") as f:
                comm = f.read().strip()
            with open(f"{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        tid = int(task.rsplit("/", 1)[1])
        out[tid] = (names.get(tid, comm), (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def _processes() -> Iterator[tuple[int, str, list[str]]]:
    """(pid, command name, the `/proc/PID/stat` fields after the name) of each running process."""
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                head, rest = f.read().rsplit(")", 1)
        except OSError:
            continue  # the process ended
        pid, _, name = head.partition(" (")
        yield int(pid), name, rest.split()


def _cpu(fields: list[str], *, exited_children: bool = False) -> float:
    """CPU seconds (user + system) in `fields`, plus its exited children's when asked."""
    ticks = int(fields[11]) + int(fields[12])
    if exited_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _TICK


def brokers_cpu(parent: int) -> float | None:
    """CPU seconds so far of the processes named java whose parent is `parent` (the local
    cluster's brokers: `outbox.testing.KafkaCluster` starts them as its own children); None if
    there are none (a cluster elsewhere)."""
    times = [_cpu(fields) for _, name, fields in _processes() if name == "java" and int(fields[1]) == parent]
    return sum(times) if times else None


def postgres_cpu() -> float | None:
    """CPU seconds so far of this machine's PostgreSQL server processes (every process named
    postgres, plus what its postmaster's children that have exited spent: backends end with
    their connections); None if no server runs here."""
    servers = {pid: fields for pid, name, fields in _processes() if name == "postgres"}
    if not servers:
        return None
    # A postmaster is the one whose parent is not a postgres process.
    return sum(_cpu(fields, exited_children=int(fields[1]) not in servers) for fields in servers.values())


class ThreadCPU:
    """CPU seconds each thread spent between `start()` and `stop()`, by thread name, plus the
    brokers' (`BROKERS`) when `brokers_parent` is the process whose children they are (None: not
    measured, e.g. across a restart of the brokers, whose new processes start from zero).

    Sampled every 50 ms, because threads that end before `stop()` (a drain's workers and their
    producers' librdkafka threads) take their counters with them: such a thread loses at most
    its last 50 ms. The sampler's own thread is left out (about 0.3 ms of CPU per sample).
    """

    def __init__(self, brokers_parent: int | None) -> None:
        self._brokers_parent = brokers_parent
        self._first: dict[int, float] = {}
        self._brokers: float | None = None
        self._last: dict[int, tuple[str, float]] = {}
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample_until_done, name=_SAMPLER, daemon=True)

    def start(self) -> None:
        if self._brokers_parent is not None:
            self._brokers = brokers_cpu(self._brokers_parent)
        self._first = {tid: cpu for tid, (_, cpu) in thread_cpu().items()}
        self._sampler.start()

    def stop(self) -> dict[str, float]:
        self._done.set()
        self._sampler.join()
        self._sample()
        spent: dict[str, float] = {}
        for tid, (name, cpu) in self._last.items():
            if name != _SAMPLER:
                spent[name] = spent.get(name, 0.0) + cpu - self._first.get(tid, 0.0)
        now = None if self._brokers_parent is None else brokers_cpu(self._brokers_parent)
        if now is not None and self._brokers is not None:
            spent[BROKERS] = now - self._brokers
        return spent

    def _sample(self) -> None:
        self._last.update(thread_cpu())

    def _sample_until_done(self) -> None:
        while not self._done.wait(0.05):
            self._sample()


def by_stage(spent: Mapping[str, float], n: int, main: str = "application") -> dict[str, float]:
    """`ThreadCPU.stop()`'s seconds by thread, as CPU µs per message of each stage (`STAGES`);
    `main` names what the scenario's own thread does (a drain run's is a drain worker)."""
    out: dict[str, float] = {}
    for name, seconds in spent.items():
        if name == BROKERS:
            stage = BROKERS
        else:
            stage = next((s for prefix, s in STAGES if name.startswith(prefix)), OTHER)
            stage = main if stage == "application" else stage
        out[stage] = out.get(stage, 0.0) + seconds / n * 1e6
    return out
