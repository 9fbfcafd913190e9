"""Request metrics of ``tangram-hpc serve``: counters and latency histograms, no I/O.

Plain numbers that an exporter reads with :meth:`RequestMetrics.snapshot`
(today the ``/stats`` JSON endpoint; a Prometheus endpoint can map the same
counters and the cumulative histogram buckets one to one).
"""
from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

__all__ = ["RequestMetrics", "LATENCY_BUCKETS_S"]

#: Upper bounds (seconds) of the latency histogram buckets; the last catches the rest.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                     float("inf"))


class RequestMetrics:
    """Counts requests by route and HTTP status, run_code outcomes, in-flight requests."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.outcomes: Counter[str] = Counter()   # run_code: Success / Failed / SandboxError
        self.in_flight = 0
        self.peak_in_flight = 0
        self._buckets: dict[str, list[int]] = {}
        self._sum: Counter[str] = Counter()

    def started(self) -> None:
        self.in_flight += 1
        if self.in_flight > self.peak_in_flight:
            self.peak_in_flight = self.in_flight

    def finished(self, route: str, status: int, seconds: float, outcome: str | None = None,
                 *, counted: bool = True) -> None:
        """Record one answered request; ``counted``: it was in flight (``started`` was called)."""
        if counted:
            self.in_flight -= 1
        self.requests[(route, status)] += 1
        if outcome is not None:
            self.outcomes[outcome] += 1
        b = self._buckets.get(route)
        if b is None:
            b = self._buckets[route] = [0] * len(LATENCY_BUCKETS_S)
        b[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self._sum[route] += seconds

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready: counters, and per route the cumulative bucket counts and the sum."""
        latency = {}
        for route, counts in self._buckets.items():
            cumulative, total = [], 0
            for c in counts:
                total += c
                cumulative.append(total)
            latency[route] = {"le": [str(b) if b != float("inf") else "+Inf" for b in LATENCY_BUCKETS_S],
                              "cumulative": cumulative, "count": total, "sum_s": round(self._sum[route], 6)}
        return {
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "requests": [{"route": r, "status": s, "count": n} for (r, s), n in sorted(self.requests.items())],
            "run_code_outcomes": dict(self.outcomes),
            "latency": latency,
        }
