"""Request metrics of ``tangram-hpc serve``: counters and latency histograms, no I/O.

Plain numbers, read by ``GET /stats`` (:meth:`RequestMetrics.snapshot`, JSON)
and ``GET /metrics`` (:meth:`RequestMetrics.families`, Prometheus text through
:func:`tangram_hpc.metrics.render`).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from ..metrics import Family, Histogram

__all__ = ["RequestMetrics", "LATENCY_BUCKETS_S"]

#: Upper bounds (seconds) of the latency histogram buckets; larger values land in the overflow bucket.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RequestMetrics:
    """Counts requests by route and HTTP status, run_code outcomes, in-flight requests."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.outcomes: Counter[str] = Counter()   # run_code: Success / Failed / SandboxError
        self.in_flight = 0
        self.peak_in_flight = 0
        self.latency: dict[str, Histogram] = {}

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
        h = self.latency.get(route)
        if h is None:
            h = self.latency[route] = Histogram(LATENCY_BUCKETS_S)
        h.observe(seconds)

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready: counters, and per route the cumulative bucket counts and the sum."""
        latency = {}
        for route, h in self.latency.items():
            buckets = h.prometheus_buckets()
            latency[route] = {"le": [le for le, _ in buckets], "cumulative": [int(n) for _, n in buckets],
                              "count": h.count, "sum_s": round(h.sum, 6)}
        return {
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "requests": [{"route": r, "status": s, "count": n} for (r, s), n in sorted(self.requests.items())],
            "run_code_outcomes": dict(self.outcomes),
            "latency": latency,
        }

    def families(self) -> list[Family]:
        """The same numbers as Prometheus metric families (``tangram_serve_*``)."""
        req = Family("tangram_serve_requests_total", "counter", "HTTP requests answered, by route and status code",
                     ("route", "code"))
        for (route, status), n in sorted(self.requests.items()):
            req.add(n, route, status)
        out = Family("tangram_serve_run_code_outcomes_total", "counter",
                     "run_code answers by SandboxFusion status (Success, Failed, SandboxError)", ("status",))
        for outcome, n in sorted(self.outcomes.items()):
            out.add(n, outcome)
        lat = Family("tangram_serve_request_duration_seconds", "histogram",
                     "time from a request's arrival to its answer, by route", ("route",))
        for route, h in sorted(self.latency.items()):
            lat.add(h, route)
        return [req, out, lat,
                Family("tangram_serve_requests_in_flight", "gauge", "requests being answered now").add(self.in_flight),
                Family("tangram_serve_requests_in_flight_peak", "gauge",
                       "most requests in flight at once since start").add(self.peak_in_flight)]
