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
  learned by weighted least squares of the observed run time on ``1/c``
  (``t = a + b/c`` with ``a = d1 (1-p)``, ``b = d1 p``).  The fit only counts
  once the observations span at least two core counts; until then the prior
  ``p`` stands.  The elastic scheduler grants different core counts depending
  on load, so the spread comes by itself.

A run time observed at ``c`` cores is turned into a one-core duration with
the current ``p`` before it enters the mean, so observations at any core
count teach the same number.  The client's ``duration_hint`` (seconds at
``min_cores``) is the prior of a class nobody has seen yet.

Pure: no clock, no I/O; the same observations give the same predictions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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
    # weighted least squares of t on x = 1/c, with exponential forgetting
    sw: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    p: float | None = None   # learned parallel fraction, None until the fit is defined

    def median(self) -> float:
        return math.exp(self.mu)

    def mean(self) -> float:
        return math.exp(self.mu + 0.5 * self.var)


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
            x = 1.0 / cores
            keep = 1.0 - a
            st.sw = st.sw * keep + 1.0
            st.sx = st.sx * keep + x
            st.sy = st.sy * keep + run_time
            st.sxx = st.sxx * keep + x * x
            st.sxy = st.sxy * keep + x * run_time
            den = st.sw * st.sxx - st.sx * st.sx
            if den > 1e-9 * st.sw * st.sw:
                b = (st.sw * st.sxy - st.sx * st.sy) / den
                a0 = (st.sy - b * st.sx) / st.sw
                if a0 + b > 0:
                    st.p = min(1.0, max(0.0, b / (a0 + b)))
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
