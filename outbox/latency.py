"""A fixed-bucket latency histogram written by one thread without a lock.

For timings taken once per batch (a group commit), not per message. Exporters read it at scrape
time (outbox.metrics); a reader may see one observation half-applied, which a monitoring
figure tolerates, so the writer never takes a lock.
"""

from __future__ import annotations

import bisect

#: Upper bounds in seconds: from a fast SQLite commit (~1 ms) to a stalled disk or network.
DEFAULT_BOUNDS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LatencyHistogram:
    """Counts of observations per bucket, plus their sum. One writing thread only.

    Args:
        bounds: increasing bucket upper bounds in seconds; a last, unbounded (+Inf) bucket is added.
    """

    def __init__(self, bounds: tuple[float, ...] = DEFAULT_BOUNDS) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds must be strictly increasing, got {bounds}")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def cumulative(self) -> tuple[list[tuple[str, int]], float]:
        """Prometheus-style buckets ``[(le, cumulative count), ..., ("+Inf", total)]`` and the sum."""
        counts, total = list(self.counts), self.sum
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), counts, strict=True):
            running += n
            out.append((bound, running))
        return out, total
