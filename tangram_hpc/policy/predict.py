"""Online duration and speedup estimates per action class.

Durations in agentic RL are not known in advance, but actions of one class
(``ActionSpec.action_class``: ``sandbox:pytest``, ``reward:judge-7b`` ...)
are alike enough that a few completed ones predict the next.  For every class
this module keeps:

* the *one-core duration* ``d1``: an exponentially weighted mean and variance
  of ``log(d1)``.  Log space because action durations are heavy-tailed
  (roughly lognormal): one 10-minute outlier must not make every later
  prediction ten times too long.  ``median = exp(mu)``, ``mean = exp(mu + var/2)``.
* the *parallel fraction* ``p`` of Amdahl's law, ``t(c) = d1 * ((1 - p) + p / c)``,
  fitted to the mean log run time observed at each granted core count (a
  grid search over ``p`` with the one-core time profiled out; log space
  because the noise is multiplicative, and a linear fit of ``t`` on ``1/c``
  is thrown off by a few long runs).  The fit only counts once runs at two
  core counts exist; until then the prior ``p`` stands.  The elastic
  scheduler grants different core counts depending on load, so the spread
  comes by itself.

A run time observed at ``c`` cores is turned into a one-core duration with
the current ``p`` before it enters the mean, so observations at any core
count teach the same number.  The client's ``duration_hint`` (seconds at
``min_cores``) is the prior of a class nobody has seen yet.

Pure: no clock, no I/O; the same observations give the same predictions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..actions import ActionSpec

__all__ = ["Predictor", "ClassStats", "amdahl_time"]


def amdahl_time(d1: float, p: float, cores: int) -> float:
    """Run time at ``cores`` cores of work that takes ``d1`` on one core with parallel fraction ``p``."""
    return d1 * ((1.0 - p) + p / max(1, cores))


@dataclass(slots=True)
class ClassStats:
    n: int = 0
    mu: float = 0.0          # EWMA of log(one-core duration)
    var: float = 0.0         # EWMA of the squared deviation of log(d1)
    # per granted core count: [weight, mean log run time] with bounded weight (slow forgetting)
    by_cores: dict = field(default_factory=dict)
    p: float | None = None   # learned parallel fraction, None until two core counts were seen

    def median(self) -> float:
        return math.exp(self.mu)

    def mean(self) -> float:
        return math.exp(self.mu + 0.5 * self.var)


_P_GRID = tuple(i / 40 for i in range(41))
_BUCKET_CAP = 200.0     # a core count's mean log time forgets after about this many runs


def fit_parallel_fraction(by_cores: dict, prior: float, prior_weight: float = 2.0) -> float:
    """Amdahl's p that best explains the mean log run time seen at each core count.

    Least squares in log space (durations are multiplicative-noisy), with
    the unknown one-core time profiled out and a weak pull towards ``prior``.
    """
    best, best_cost = prior, float("inf")
    items = [(c, wm[0], wm[1]) for c, wm in by_cores.items()]
    wsum = sum(w for _, w, _ in items)
    for p in _P_GRID:
        res = [(w, m - math.log((1.0 - p) + p / c)) for c, w, m in items]
        mean = sum(w * r for w, r in res) / wsum
        cost = sum(w * (r - mean) ** 2 for w, r in res) + prior_weight * (p - prior) ** 2
        if cost < best_cost:
            best, best_cost = p, cost
    return best


class Predictor:
    """Per-class duration and speedup model.

    Parameters
    ----------
    alpha: weight of a new observation in the moving averages (0..1].
    default_duration: prediction for a class with neither observations nor a hint.
    prior_parallel: parallel fraction assumed for a multi-core action before
        the fit exists (clients only declare ``max_cores > 1`` for work that
        they expect to parallelise).
    default_load_time: seconds a GPU service is assumed to take to load before
        one has been measured.
    """

    def __init__(self, *, alpha: float = 0.2, default_duration: float = 1.0,
                 prior_parallel: float = 0.7, default_load_time: float = 30.0):
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.default_duration = default_duration
        self.prior_parallel = prior_parallel
        self.default_load_time = default_load_time
        self._classes: dict[str, ClassStats] = {}
        self._load: dict[str, float] = {}

    # -- reading -------------------------------------------------------------
    def stats(self, action_class: str) -> ClassStats | None:
        return self._classes.get(action_class)

    def parallel_fraction(self, spec: ActionSpec) -> float:
        if spec.demand.max_cores <= 1:
            return 0.0
        st = self._classes.get(spec.action_class)
        if st is not None and st.p is not None:
            return st.p
        return self.prior_parallel

    def one_core(self, spec: ActionSpec) -> float:
        """Median one-core duration of the action's class."""
        st = self._classes.get(spec.action_class)
        if st is not None and st.n:
            return math.exp(st.mu)
        if spec.duration_hint is not None:
            # the hint is at min_cores: convert to one core with the prior speedup
            p = self.parallel_fraction(spec)
            return spec.duration_hint / ((1.0 - p) + p / max(1, spec.demand.min_cores))
        return self.default_duration

    def predict(self, spec: ActionSpec, cores: int | None = None) -> float:
        """Predicted run time (median) at ``cores`` (default ``min_cores``)."""
        c = spec.demand.min_cores if cores is None else cores
        return amdahl_time(self.one_core(spec), self.parallel_fraction(spec), max(1, c))

    def mean_core_seconds(self, spec: ActionSpec) -> float:
        """Expected core-seconds at ``min_cores`` (mean, not median: for capacity planning)."""
        st = self._classes.get(spec.action_class)
        scale = math.exp(0.5 * st.var) if st is not None and st.n else 1.0
        c = max(1, spec.demand.min_cores)
        return self.predict(spec, c) * scale * c

    def speedup(self, spec: ActionSpec, cores: int) -> float:
        p = self.parallel_fraction(spec)
        return 1.0 / ((1.0 - p) + p / max(1, cores))

    def load_time(self, service: str) -> float:
        return self._load.get(service, self.default_load_time)

    # -- learning ------------------------------------------------------------
    def observe(self, spec: ActionSpec, run_time: float, cores: int) -> None:
        """Learn from one completed run of ``spec`` that took ``run_time`` on ``cores`` cores."""
        if not (run_time > 0.0) or math.isinf(run_time):
            return
        cores = max(1, cores)
        st = self._classes.get(spec.action_class)
        if st is None:
            st = self._classes[spec.action_class] = ClassStats()
        a = self.alpha
        if spec.demand.max_cores > 1:
            bucket = st.by_cores.get(cores)
            y_t = math.log(max(run_time, 1e-6))
            if bucket is None:
                st.by_cores[cores] = [1.0, y_t]
            else:
                bucket[0] = min(bucket[0] + 1.0, _BUCKET_CAP)
                bucket[1] += (y_t - bucket[1]) / bucket[0]
            if len(st.by_cores) >= 2 and (st.p is None or st.n % 4 == 0):
                st.p = fit_parallel_fraction(st.by_cores, self.prior_parallel)
        p = self.parallel_fraction(spec)
        d1 = run_time / ((1.0 - p) + p / cores)
        y = math.log(max(d1, 1e-6))
        if st.n == 0:
            st.mu = y
            st.var = 0.0
        else:
            dev = y - st.mu
            st.mu += a * dev
            st.var = (1.0 - a) * (st.var + a * dev * dev)
        st.n += 1

    def observe_load(self, service: str, load_time: float) -> None:
        """Learn how long loading ``service`` onto a GPU took."""
        if load_time < 0 or math.isinf(load_time):
            return
        old = self._load.get(service)
        self._load[service] = load_time if old is None else old + self.alpha * (load_time - old)
