"""Online duration and speedup estimates per action class, refined by per-action features.

Durations in agentic RL are not known in advance, but actions of one class
(``ActionSpec.action_class``: ``sandbox:pytest``, ``reward:judge-7b`` ...)
are alike enough that completed ones predict the next.  For every class this
module keeps:

* the *one-core duration* ``d1``: an exponentially weighted mean and variance
  of ``log(d1)``.  Log space because action durations are heavy-tailed
  (roughly lognormal): one 10-minute outlier must not make every later
  prediction ten times too long.  ``median = exp(mu)``, ``mean = exp(mu + var/2)``.
* the *parallel fraction* ``p`` of Amdahl's law, ``t(c) = d1 * ((1 - p) + p / c)``,
  fitted to the mean log run time observed at each granted core count.

Robustness.

* **Prior first.**  ``p`` stays at the prior until two core counts have each
  been seen ``min_fit_runs`` times; after that the fit is a posterior: the
  data term is weighted by the observed spread of the class (runs at 7 and 8
  cores say almost nothing about ``p`` when run times vary by 2x) against a
  prior of standard deviation ``prior_parallel_sd``.  So ``p`` moves only as
  far as the evidence carries it.
* **Early completions.**  The first runs of a class to finish are its short
  ones.  Speed-up evidence is therefore counted in start order: a run's time
  enters the fit only once every run of its class started before it has
  ended, so the runs at each core count are a fair sample, not the quick ones.
  For the duration itself, the first runs to finish are the short ones.  Until ``warm_runs`` runs have finished and no more than a quarter as
  many are still running, the estimate also counts the class's running actions: each is known to take longer than it has run
  so far, and enters as the expected log duration of a lognormal conditioned
  on that (:func:`censored_log_mean`).  The driver reports starts with
  :meth:`Predictor.started`.
* **Per-action features.**  A ``duration_hint`` is calibrated per class (the
  mean log ratio of what ran to what was hinted), so a client's per-action
  guesses rank actions inside a class, where the spread is largest.  Actions
  without a label are keyed by their command's program name
  (``sandbox:pytest``), so unlabelled commands still separate.

A run time observed at ``c`` cores is turned into a one-core duration with
the current ``p`` before it enters the mean, so observations at any core
count teach the same number.  The hint is the prior of a class nobody has
seen yet.

Pure: no clock (times come in as arguments), no I/O; the same calls give the
same predictions.
"""
from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from ..actions import ActionSpec
from .base import mypyc_attr

__all__ = ["Predictor", "ClassStats", "amdahl_time", "feature_key", "censored_log_mean"]


def amdahl_time(d1: float, p: float, cores: int) -> float:
    """Run time at ``cores`` cores of work that takes ``d1`` on one core with parallel fraction ``p``."""
    return d1 * ((1.0 - p) + p / max(1, cores))


def feature_key(spec: ActionSpec) -> str:
    """The key durations are learned under: the action class, or for an unlabelled command its program."""
    if spec.label or spec.demand.service:
        return spec.action_class
    payload = spec.payload
    if isinstance(payload, dict):
        cmd = payload.get("cmd")
        if isinstance(cmd, str):
            words = cmd.split(None, 2)
            if words:
                prog = words[0].rsplit("/", 1)[-1]
                if prog in ("python", "python3", "bash", "sh", "uv", "env") and len(words) > 1:
                    prog = f"{prog} {words[1].rsplit('/', 1)[-1]}"
                return f"{spec.kind}:{prog[:64]}"
        fn = payload.get("fn")
        if isinstance(fn, str):
            return f"{spec.kind}:{fn[:128]}"
    return spec.kind


@dataclass(slots=True)
class ClassStats:
    n: int = 0
    mu: float = 0.0          # EWMA of log(one-core duration)
    var: float = 0.0         # EWMA of the squared deviation of log(d1)
    # per granted core count: [weight, mean log run time] with bounded weight (slow forgetting)
    by_cores: dict = field(default_factory=dict)
    p: float | None = None   # fitted parallel fraction, None until the evidence is there
    hint_n: int = 0
    hint_bias: float = 0.0   # EWMA of log(one-core duration / one-core hint)
    # while young: the finished runs' log one-core durations (count, sum), and the running ones' starts
    done: list | None = field(default_factory=lambda: [0, 0.0])
    running: dict | None = field(default_factory=dict)   # action id -> (start, one-core factor)
    mu_adj: float | None = None   # warm-up estimate counting the running actions
    # speed-up evidence enters in start order (a run waits until every run started before it ended)
    seq: int = 0
    fed: int = 0                                    # runs counted for the speed-up
    cohort: dict = field(default_factory=dict)      # action id -> start number, while it runs
    order: deque = field(default_factory=deque)     # action ids in start order: numbers seq - len + 1 .. seq
    ended: dict = field(default_factory=dict)       # start number -> (run time, cores), not yet counted

    def median(self) -> float:
        return math.exp(self.mu if self.mu_adj is None else self.mu_adj)

    def mean(self) -> float:
        return math.exp((self.mu if self.mu_adj is None else self.mu_adj) + 0.5 * self.var)


_P_GRID: Final = tuple(i / 40 for i in range(41))
_BUCKET_CAP: Final = 200.0     # a core count's mean log time forgets after about this many runs
_CENSORED_CAP: Final = 128     # running actions counted in a warm-up estimate
_SQRT2 = math.sqrt(2.0)
_SQRT_2PI = math.sqrt(2.0 * math.pi)


@functools.lru_cache(maxsize=None)     # one entry per core count ever granted: a few
def _log_amdahl(cores: int) -> tuple[float, ...]:
    """``log((1 - p) + p / cores)`` at every ``p`` of the grid (a refit would otherwise take 41 logs per core count)."""
    return tuple(math.log((1.0 - p) + p / cores) for p in _P_GRID)


def fit_parallel_fraction(by_cores: dict[int, list[float]], prior: float, noise_var: float, prior_sd: float) -> float:
    """Posterior mode of Amdahl's p given the mean log run time at each core count.

    Each bucket's mean has variance ``noise_var / weight``; the unknown
    one-core time is profiled out; the prior is normal around ``prior`` with
    standard deviation ``prior_sd``.
    """
    best, best_cost = prior, float("inf")
    ws: list[float] = []
    means: list[float] = []
    logs: list[tuple[float, ...]] = []      # per bucket, its log Amdahl factor at every grid point
    for c, wm in by_cores.items():
        ws.append(wm[0])
        means.append(wm[1])
        logs.append(_log_amdahl(c))
    wsum = sum(ws)
    inv_noise = 1.0 / max(noise_var, 0.01)
    inv_prior = 1.0 / (prior_sd * prior_sd)
    k = len(ws)
    # plain loops over floats, no list per grid point: a refit every 32 runs of a class adds up
    for j in range(len(_P_GRID)):
        p = _P_GRID[j]
        total = 0.0
        for i in range(k):
            total += ws[i] * (means[i] - logs[i][j])
        mean = total / wsum
        spread = 0.0
        for i in range(k):
            spread += ws[i] * (means[i] - logs[i][j] - mean) ** 2
        cost = inv_noise * spread + inv_prior * (p - prior) ** 2
        if cost < best_cost:
            best, best_cost = p, cost
    return best


def censored_log_mean(done_n: int, done_sum: float, censored: list[float], sd: float, rounds: int = 5) -> float:
    """Mean of log durations when ``done_n`` (summing to ``done_sum``) finished and ``censored`` are only known to be longer.

    Each censored value ``c`` is replaced by ``E[y | y > c]`` under a normal
    of the current mean and ``sd`` (a few rounds of this EM step).
    """
    n = done_n + len(censored)
    if not censored:
        return done_sum / done_n
    mu = (done_sum + sum(censored)) / n
    sd = max(sd, 0.1)
    erfc, exp = math.erfc, math.exp
    for _ in range(rounds):
        total = done_sum
        for c in censored:
            a = (c - mu) / sd
            tail = 0.5 * erfc(a / _SQRT2)
            if tail < 1e-12:
                total += c
            else:
                total += mu + sd * exp(-0.5 * a * a) / _SQRT_2PI / tail
        mu = total / n
    return mu


@mypyc_attr(allow_interpreted_subclasses=True)
class Predictor:
    """Per-class duration and speedup model.

    Parameters
    ----------
    alpha: weight of a new observation in the moving averages (0..1].
    default_duration: prediction for a class with neither observations nor a hint.
    prior_parallel: parallel fraction assumed for a multi-core action (clients
        only declare ``max_cores > 1`` for work that they expect to parallelise).
    prior_parallel_sd: how far from the prior the evidence must pull ``p``.
    min_fit_runs: runs needed at each of two core counts before ``p`` is fitted.
    warm_runs: finished runs of a class before running ones stop counting.
    learn_parallel: fit ``p`` at all (False: the prior stands).
    default_load_time: seconds a GPU service is assumed to take to load before
        one has been measured.
    max_classes: classes learned at most.  Labels and programs come from clients,
        who may send any number: past this, an action of a new class is learned
        and predicted under its kind (``sandbox``, ``reward`` ...), which every
        kind may still add.
    """

    def __init__(self, *, alpha: float = 0.2, default_duration: float = 1.0,
                 prior_parallel: float = 0.7, prior_parallel_sd: float = 0.12, min_fit_runs: int = 20,
                 warm_runs: int = 30, learn_parallel: bool = True, default_load_time: float = 30.0,
                 max_classes: int = 4096):
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.default_duration = default_duration
        self.prior_parallel = prior_parallel
        self.prior_parallel_sd = prior_parallel_sd
        self.min_fit_runs = min_fit_runs
        self.warm_runs = warm_runs
        self.learn_parallel = learn_parallel
        self.default_load_time = default_load_time
        self.max_classes = max_classes
        self._classes: dict[str, ClassStats] = {}
        # (kind, label, service) -> its class's stats, once they exist (a labelled class found without its key string)
        self._by_ck: dict[tuple, ClassStats] = {}
        self._load: dict[str, float] = {}
        # the last tail computed and its variance: the actions of a class submitted between two of its
        # runs share one float (24 B of each queued action)
        self._tail_var = 0.5
        self._tail = math.exp(0.25)

    # -- reading -------------------------------------------------------------
    def stats(self, key: str) -> ClassStats | None:
        return self._classes.get(key)

    def _key(self, spec: ActionSpec) -> str:
        """The class ``spec`` learns under: its feature key, unless that is new and the classes are full."""
        key = feature_key(spec)
        if len(self._classes) < self.max_classes or key in self._classes:
            return key
        return spec.kind

    def _stats_of(self, spec: ActionSpec) -> ClassStats | None:
        if spec.label or spec.demand.service:       # three look-ups per action: skip the key string
            st = self._by_ck.get((spec.kind, spec.label, spec.demand.service))
            if st is not None:
                return st
        return self._classes.get(self._key(spec))

    def parallel_fraction(self, spec: ActionSpec, st: ClassStats | None = None) -> float:
        if spec.demand.max_cores <= 1:
            return 0.0
        if st is None:
            st = self._stats_of(spec)
        if st is not None and st.p is not None:
            return st.p
        return self.prior_parallel

    def one_core(self, spec: ActionSpec, st: ClassStats | None = None) -> float:
        """Predicted one-core duration (median): the calibrated hint, else the class median, else the default."""
        if st is None:
            st = self._stats_of(spec)
        hint = spec.duration_hint
        if hint is not None and hint > 0:
            p = self.parallel_fraction(spec, st)
            # the hint itself where there is nothing to scale: a float is 24 B of each queued action
            h1 = hint / ((1.0 - p) + p / max(1, spec.demand.min_cores)) if p else hint
            if st is not None and st.hint_n:
                return h1 * math.exp(st.hint_bias)
            return h1
        if st is not None and st.n:
            return st.median()
        return self.default_duration

    def estimate(self, spec: ActionSpec, stats: ClassStats | None = None) -> tuple[float, float, float]:
        """(predicted one-core duration (median), parallel fraction, mean / median) in one look-up.

        The last is the class's tail: durations are heavy-tailed, so the expected
        time of an action is this much above its median (``exp(var / 2)`` of the
        log durations; ``exp(0.25)`` before two runs were seen).  ``stats``: the
        action's :meth:`class_stats`, when the caller keeps them.
        """
        st = self._stats_of(spec) if stats is None else stats
        var = st.var if st is not None and st.n >= 2 else 0.5
        if var != self._tail_var:
            self._tail_var, self._tail = var, math.exp(0.5 * var)
        return self.one_core(spec, st), self.parallel_fraction(spec, st), self._tail

    def predict(self, spec: ActionSpec, cores: int | None = None) -> float:
        """Predicted run time (median) at ``cores`` (default ``min_cores``)."""
        st = self._stats_of(spec)
        c = spec.demand.min_cores if cores is None else cores
        return amdahl_time(self.one_core(spec, st), self.parallel_fraction(spec, st), max(1, c))

    def is_tiny(self, spec: ActionSpec, limit_s: float, min_runs: int = 20) -> bool:
        """Whether ``spec``'s class is known to take under ``limit_s`` (mean, after ``min_runs`` runs).

        A hint at or above the limit says otherwise, whatever the class did so far.
        """
        hint = spec.duration_hint
        if hint is not None and hint >= limit_s:
            return False
        st = self._stats_of(spec)
        return st is not None and st.n >= min_runs and st.mean() < limit_s

    def mean_core_seconds(self, spec: ActionSpec) -> float:
        """Expected core-seconds at ``min_cores`` (mean, not median: for capacity planning)."""
        st = self._stats_of(spec)
        scale = math.exp(0.5 * st.var) if st is not None and st.n else 1.0
        c = max(1, spec.demand.min_cores)
        return amdahl_time(self.one_core(spec, st), self.parallel_fraction(spec, st), c) * scale * c

    def load_time(self, service: str) -> float:
        return self._load.get(service, self.default_load_time)

    # -- learning ------------------------------------------------------------
    def class_stats(self, spec: ActionSpec) -> ClassStats:
        """The learned figures of ``spec``'s class, created empty if it is new.

        A caller that tracks an action from submit to finish can keep them and pass
        them as ``stats`` to :meth:`estimate`, :meth:`started` and :meth:`observe`:
        the class is then looked up once per action instead of at each call.
        """
        return self._class(spec)

    def _class(self, spec: ActionSpec) -> ClassStats:
        labelled = spec.label or spec.demand.service
        if labelled:
            st = self._by_ck.get((spec.kind, spec.label, spec.demand.service))
            if st is not None:
                return st
        key = self._key(spec)
        st = self._classes.get(key)
        if st is None:
            st = self._classes[key] = ClassStats()
        if labelled and key != spec.kind and len(self._by_ck) < 2 * self.max_classes:
            # (one label under many services is still one class: the short cut is bounded too)
            self._by_ck[(spec.kind, spec.label, spec.demand.service)] = st
        return st

    def started(self, spec: ActionSpec, cores: int, now: float, stats: ClassStats | None = None) -> None:
        """An action started (counts as a lower bound on its class's durations while the class is young)."""
        st = self._class(spec) if stats is None else stats
        if st.running is not None:
            p = self.parallel_fraction(spec, st)
            st.running[spec.id] = (now, (1.0 - p) + p / max(1, cores))
        if spec.demand.max_cores > 1 and self.learn_parallel:
            st.seq += 1
            st.cohort[spec.id] = st.seq
            st.order.append(spec.id)

    def observe(self, spec: ActionSpec, run_time: float | None, cores: int, now: float | None = None,
                stats: ClassStats | None = None) -> None:
        """Learn from one run of ``spec`` that took ``run_time`` on ``cores`` cores and ended at ``now``.

        ``run_time=None``: the run ended without a usable time (failed, lost); it only stops counting as running.
        """
        st = self._class(spec) if stats is None else stats
        if st.running is not None:
            st.running.pop(spec.id, None)
        usable = run_time is not None and run_time > 0.0 and not math.isinf(run_time)
        if spec.demand.max_cores > 1 and self.learn_parallel:
            # relative to its hint when it has one: a hinted action's grant follows its hint (a long
            # one gets more cores while work waits), so raw times would credit the cores with less
            # speed-up than they gave (0.65 learned for a true 0.9 in the swe preset, 0.75 so)
            hint = spec.duration_hint
            rel = None
            if run_time is not None and usable:
                rel = run_time / hint if hint is not None and hint > 0 else run_time
            self._speedup_in_start_order(st, spec.id, rel, max(1, cores))
        if not usable or run_time is None:
            return
        cores = max(1, cores)
        a = self.alpha
        p = self.parallel_fraction(spec, st)
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
        hint = spec.duration_hint
        if hint is not None and hint > 0:
            h1 = hint / ((1.0 - p) + p / max(1, spec.demand.min_cores))
            err = y - math.log(h1)
            st.hint_bias = err if st.hint_n == 0 else st.hint_bias + a * (err - st.hint_bias)
            st.hint_n += 1
        if st.done is not None:
            self._warm_estimate(st, y, now)

    def _speedup_in_start_order(self, st: ClassStats, aid: str, run_time: float | None, cores: int) -> None:
        """Count speed-up evidence in start order, so the runs at one core count are not just its short ones.

        Which runs end first depends on their length; which core count a run got
        depends on the load when it started.  Released in start order, every
        core count's runs are a fair sample of their class.
        """
        seq = st.cohort.pop(aid, None)
        if seq is None:            # never reported as started: nothing to order it by
            if run_time is not None:
                self._observe_speedup(st, run_time, cores)
            return
        if run_time is not None:
            st.ended[seq] = (run_time, cores)
        order, cohort, ended = st.order, st.cohort, st.ended
        while order and order[0] not in cohort:
            s0 = st.seq - len(order) + 1        # its start number (starts are numbered one by one)
            order.popleft()
            r = ended.pop(s0, None)
            if r is not None:
                self._observe_speedup(st, r[0], r[1])

    def _observe_speedup(self, st: ClassStats, run_time: float, cores: int) -> None:
        bucket = st.by_cores.get(cores)
        y_t = math.log(max(run_time, 1e-6))
        if bucket is None:
            st.by_cores[cores] = [1.0, y_t]
        else:
            bucket[0] = min(bucket[0] + 1.0, _BUCKET_CAP)
            bucket[1] += (y_t - bucket[1]) / bucket[0]
        st.fed += 1
        if st.p is not None and st.fed % max(16, st.fed >> 5):
            return          # refit every 16 runs, about every 32 after a few thousand: one run moves a posterior little
        solid = {c: b for c, b in st.by_cores.items() if b[0] >= self.min_fit_runs}
        if len(solid) >= 2:
            st.p = fit_parallel_fraction(solid, self.prior_parallel, max(st.var, 0.05), self.prior_parallel_sd)

    def _warm_estimate(self, st: ClassStats, y: float, now: float | None) -> None:
        """While the class is young: the mean log duration counting the runs still going.

        Young: fewer than ``warm_runs`` finished, or still more than a quarter as
        many running as finished (the first to finish are the short ones).
        """
        done, running = st.done, st.running
        assert done is not None and running is not None      # young: both kept
        done[0] += 1
        done[1] += y
        n = done[0]
        if n >= self.warm_runs and len(running) * 4 <= n:
            st.done = None      # enough evidence: the moving average alone from here
            st.running = None
            st.mu_adj = None
            return
        if n > 16 and n % max(8, n >> 4):
            return              # the estimate moves slowly by now: refresh it every 8 runs, about every 16 later
        if now is None or not running:
            st.mu_adj = None
            return
        censored = []
        for start, factor in running.values():   # oldest first: the most telling
            el = now - start
            if el > 0:
                censored.append(math.log(max(el / factor, 1e-6)))
                if len(censored) >= _CENSORED_CAP:
                    break
        # the finished runs are the short ones, so their spread says little yet: assume the
        # e-fold spread typical of action durations unless they already show more
        sd = max(1.0, math.sqrt(st.var))
        st.mu_adj = censored_log_mean(done[0], done[1], censored, sd) if censored else None

    def seed_load_time(self, service: str, load_time: float) -> None:
        """A known load time (configuration, a previous run) until one is measured."""
        if service not in self._load and load_time >= 0:
            self._load[service] = float(load_time)

    def forget_service(self, service: str) -> None:
        """Drop ``service``'s load time (the policy forgot the service: see its ``_forget_idle_services``)."""
        self._load.pop(service, None)

    def observe_load(self, service: str, load_time: float) -> None:
        """Learn how long loading ``service`` onto a GPU took."""
        if load_time < 0 or math.isinf(load_time):
            return
        old = self._load.get(service)
        self._load[service] = load_time if old is None else old + self.alpha * (load_time - old)
