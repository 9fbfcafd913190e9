"""Metrics shared by the coordinator and ``serve``: histograms, metric families, the Prometheus endpoint.

The numbers are kept in plain objects that know nothing of Prometheus:

* :class:`Histogram`: fixed bucket bounds, counts and a sum, updated one
  value at a time (a bisect on a short tuple) or a batch at a time (numpy);
  it estimates quantiles the way PromQL's ``histogram_quantile`` does, and
  travels in ``status`` replies as a small dict;
* :class:`Family`: one metric family (counter, gauge or histogram) with its
  labelled samples, built when someone asks (a scrape, ``status``).

Only :func:`render` and :func:`prometheus_collector` import ``prometheus_client``
(the optional ``metrics`` extra); everything else works without it.  The
coordinator's HTTP endpoint is in :mod:`tangram_hpc.coordinator.exporter`;
``serve`` answers ``/metrics`` on its own port.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

__all__ = ["ACT_BUCKETS_S", "Family", "Histogram", "prometheus_collector", "render", "require_prometheus"]

#: Upper bounds (seconds) of action completion and queue time buckets: a 1-2.5-5 series from
#: 0.5 ms (a light function through the coordinator) to 83 min (a long build); larger values
#: land in the overflow bucket (``+Inf``).
ACT_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0)

_INSTALL_HINT = "pip install 'tangram-hpc[metrics]'"


def require_prometheus():
    """The ``prometheus_client`` module, or an ImportError that says how to install it."""
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError(f"the Prometheus endpoint needs prometheus_client: {_INSTALL_HINT} ({e})") from None
    return prometheus_client


class Histogram:
    """Counts per bucket: ``counts[i]`` holds values ``<= bounds[i]`` and above the bound before
    it; the last count (one more than there are bounds) holds the values above every bound."""

    __slots__ = ("bounds", "counts", "sum", "_np_bounds")

    def __init__(self, bounds: Sequence[float] = ACT_BUCKETS_S, counts: Sequence[int] | None = None,
                 total: float = 0.0):
        self.bounds = tuple(float(b) for b in bounds)
        if any(b >= c for b, c in zip(self.bounds, self.bounds[1:])) or not all(map(np.isfinite, self.bounds)):
            raise ValueError(f"bucket bounds must be finite and increasing, got {bounds!r}")
        self.counts = list(counts) if counts is not None else [0] * (len(self.bounds) + 1)
        if len(self.counts) != len(self.bounds) + 1:
            raise ValueError(f"{len(self.bounds)} bounds need {len(self.bounds) + 1} counts, got {len(self.counts)}")
        self.sum = float(total)
        self._np_bounds: np.ndarray | None = None

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_many(self, values: np.ndarray) -> None:
        """Add a batch of values (one numpy call instead of a bisect each)."""
        if not len(values):
            return
        if self._np_bounds is None:
            self._np_bounds = np.asarray(self.bounds)
        # side="left": the first bound >= value, so a value equal to a bound counts in its bucket (le).
        idx = np.searchsorted(self._np_bounds, values, side="left")
        for i, n in enumerate(np.bincount(idx, minlength=len(self.counts)).tolist()):
            if n:
                self.counts[i] += n
        self.sum += float(values.sum())

    def cumulative(self) -> list[int]:
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1) by linear interpolation inside its bucket, as PromQL's
        ``histogram_quantile`` estimates it; None without values.  In the overflow bucket the
        answer is the largest bound (the estimate cannot say more)."""
        n = self.count
        if not n:
            return None
        rank = q * n
        seen = 0
        for i, c in enumerate(self.counts):
            if c and seen + c >= rank:
                if i == len(self.bounds):
                    return self.bounds[-1]
                lower = self.bounds[i - 1] if i else 0.0
                return lower + (self.bounds[i] - lower) * max(0.0, rank - seen) / c
            seen += c
        return self.bounds[-1]

    def mean(self) -> float | None:
        n = self.count
        return self.sum / n if n else None

    def minus(self, older: "Histogram") -> "Histogram":
        """What was observed since ``older`` (an earlier copy of the same histogram); a histogram
        that went backwards (a restarted coordinator) is taken whole."""
        if older.bounds != self.bounds or any(a < b for a, b in zip(self.counts, older.counts)):
            return Histogram(self.bounds, self.counts, self.sum)
        return Histogram(self.bounds, [a - b for a, b in zip(self.counts, older.counts)], self.sum - older.sum)

    def to_wire(self) -> dict[str, Any]:
        """A plain dict for ``status`` (JSON and msgpack safe: no infinite bound)."""
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Histogram":
        return cls(d["bounds"], d["counts"], d.get("sum", 0.0))

    def prometheus_buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs, ``+Inf`` last."""
        cum = self.cumulative()
        return [(_le(b), float(c)) for b, c in zip(self.bounds, cum)] + [("+Inf", float(cum[-1]))]


def _le(bound: float) -> str:
    return repr(float(bound))


@dataclass
class Family:
    """One metric family and its samples; a sample's value is a number, or a :class:`Histogram`
    for a histogram family.  ``name`` is the full metric name (counters end in ``_total``)."""

    name: str
    kind: str                    # "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, ...] = ()
    samples: list[tuple[tuple[str, ...], Any]] = field(default_factory=list)

    def add(self, value: Any, *label_values: Any) -> "Family":
        if len(label_values) != len(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, got {label_values!r}")
        self.samples.append((tuple("" if v is None else str(v) for v in label_values), value))
        return self

    def value(self, *label_values: str) -> Any:
        """The sample with these label values (tests and ``top`` read families this way)."""
        for labels, v in self.samples:
            if labels == tuple(label_values):
                return v
        raise KeyError(f"{self.name}{dict(zip(self.labels, label_values))}")


def _prometheus_families(families: Iterable[Family]):
    require_prometheus()
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    for f in families:
        m: Any      # one of the three families
        if f.kind == "counter":
            # CounterMetricFamily adds the _total suffix itself.
            m = CounterMetricFamily(f.name.removesuffix("_total"), f.help, labels=f.labels)
            for labels, v in f.samples:
                m.add_metric(labels, float(v))
        elif f.kind == "gauge":
            m = GaugeMetricFamily(f.name, f.help, labels=f.labels)
            for labels, v in f.samples:
                m.add_metric(labels, float(v))
        elif f.kind == "histogram":
            m = HistogramMetricFamily(f.name, f.help, labels=f.labels)
            for labels, h in f.samples:
                m.add_metric(labels, h.prometheus_buckets(), h.sum)
        else:
            raise ValueError(f"unknown metric kind {f.kind!r} of {f.name}")
        yield m


class _Collector:
    def __init__(self, fetch: Callable[[], list[Family]]):
        self.fetch = fetch

    def collect(self):
        return _prometheus_families(self.fetch())

    def describe(self):
        return []   # nothing known before the first scrape: do not collect at registration


def prometheus_collector(fetch: Callable[[], list[Family]]):
    """A ``prometheus_client`` registry whose one collector calls ``fetch`` at each collection."""
    pc = require_prometheus()
    registry = pc.CollectorRegistry(auto_describe=False)
    registry.register(_Collector(fetch))
    return registry


def render(families: list[Family]) -> tuple[bytes, str]:
    """The Prometheus text exposition of ``families`` and its content type."""
    pc = require_prometheus()
    return pc.generate_latest(prometheus_collector(lambda: families)), pc.CONTENT_TYPE_LATEST
