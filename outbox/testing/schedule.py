"""Fault schedules: which fault, on which broker, when and for how long, played on a real cluster.

A `Fault` names one fault of the test bed's catalogue (`KINDS`) for one broker or the whole
cluster; a schedule is a list of them, each starting `at` seconds after the schedule starts and
lasting `seconds`. `play(cluster, schedule)` runs it on its own thread while the code under test
keeps working, and ends every fault it began, even when the caller stops it early. Network
faults need a `KafkaCluster(proxied=True)`.

Schedules are plain data, so a failing one can be printed, stored and replayed as it is.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from outbox.testing.cluster import KafkaCluster

__all__ = ["KINDS", "NETWORK_KINDS", "Fault", "FaultPlayer", "play"]

#: Broker faults: stopped cleanly, killed (SIGKILL), frozen (SIGSTOP).
BROKER_KINDS = ("stop", "kill", "freeze")
#: Faults of the network between the clients and a broker (a proxied cluster only).
NETWORK_KINDS = ("latency", "blackhole", "reset", "bandwidth")
KINDS = BROKER_KINDS + NETWORK_KINDS

#: What `latency` adds (seconds) and `bandwidth` allows (bytes per second).
LATENCY = 0.2
BANDWIDTH = 64 * 1024


@dataclass(frozen=True)
class Fault:
    """One fault: `kind` (of `KINDS`) on broker `broker` (None: every broker), from `at` seconds
    after the schedule starts, for `seconds`."""

    kind: str
    broker: int | None
    at: float
    seconds: float

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {KINDS}, got {self.kind!r}")
        if self.at < 0 or self.seconds <= 0:
            raise ValueError(f"a fault starts at >= 0 s and lasts > 0 s, got at={self.at} seconds={self.seconds}")

    def __str__(self) -> str:
        where = "all brokers" if self.broker is None else f"broker {self.broker}"
        return f"{self.kind} {where} at {self.at:.1f} s for {self.seconds:.1f} s"


class FaultPlayer:
    """A schedule being played (see `play`); `stop()` ends it and every fault it began."""

    def __init__(self, cluster: KafkaCluster, schedule: Sequence[Fault]) -> None:
        if any(f.kind in NETWORK_KINDS for f in schedule) and not cluster.proxied:
            raise ValueError("network faults need KafkaCluster(proxied=True)")
        self._cluster = cluster
        self._schedule = sorted(schedule, key=lambda f: f.at)
        self._stop = threading.Event()
        self._ends: list[tuple[float, Callable[[], None]]] = []  # (when, how) of each begun fault
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="outbox-fault-schedule", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait until every fault has begun and ended."""
        self._thread.join(timeout)

    def stop(self) -> None:
        """End the schedule now: faults not begun never begin, begun ones end."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        start = time.monotonic()
        pending = list(self._schedule)
        try:
            while (pending or self._ends) and not self._stop.is_set():
                now = time.monotonic() - start
                while pending and pending[0].at <= now:
                    fault = pending.pop(0)
                    self._ends += [(fault.at + fault.seconds, end) for end in self._begin(fault)]
                for when, end in [e for e in self._ends if e[0] <= now]:
                    self._ends.remove((when, end))
                    end()
                self._stop.wait(0.05)
        except BaseException as exc:  # noqa: BLE001 - kept for the caller, after the faults end
            self.errors.append(exc)
        finally:
            for _, end in self._ends:
                try:
                    end()
                except BaseException as exc:  # noqa: BLE001
                    self.errors.append(exc)
            self._ends.clear()

    def _begin(self, fault: Fault) -> list[Callable[[], None]]:
        """Begin `fault`; returns what ends it (one callable per broker it hit)."""
        c = self._cluster
        brokers = c.running_brokers() if fault.broker is None else [fault.broker]
        ends: list[Callable[[], None]] = []
        for i in brokers:
            if fault.kind in BROKER_KINDS:
                if i not in c.running_brokers() or i in c.frozen_brokers:
                    continue  # already down or frozen by an overlapping fault: that one ends it
                if fault.kind == "freeze":
                    c.freeze_broker(i)
                    ends.append(functools.partial(c.thaw_broker, i))
                else:
                    (c.kill_broker if fault.kind == "kill" else c.stop_broker)(i)
                    ends.append(functools.partial(c.start_broker, i))
            else:
                net = c.network
                if fault.kind == "latency":
                    net.latency(i, LATENCY)
                elif fault.kind == "bandwidth":
                    net.bandwidth(i, BANDWIDTH)
                elif fault.kind == "blackhole":
                    net.blackhole(i)
                else:
                    net.reset(i)
                ends.append(functools.partial(net.heal, i))
        return ends


def play(cluster: KafkaCluster, schedule: Sequence[Fault]) -> FaultPlayer:
    """Start playing `schedule` on `cluster` in the background and return its player.

    Example::

        player = play(cluster, [Fault("freeze", None, at=1.0, seconds=4.5), Fault("kill", 1, at=8, seconds=2.6)])
        ...  # produce meanwhile
        player.join()
    """
    return FaultPlayer(cluster, schedule)
