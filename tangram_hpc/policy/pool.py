"""Pool sizing: how many workers of which shape to ask for, and which to give back.

:class:`PoolController` is pure (the clock comes in the :class:`PoolView`);
it keeps only its own history (peaks per RL step).  ``decide()`` states the
workers it *wants*: the pool driver's one launch throttle (rate, back-off,
breaker) holds launches back, for every backend alike.

Demand.  For each resource class (``cpu``: cores, ``gpu``: request slots)
the capacity wanted is

    wanted = offered load / target_util + backlog core-seconds / startup_s

``offered load`` is the work submitted per second lately, counted at the
cores each action would get with nothing waiting (``PoolView.offered_load``,
from the scheduling policy): Little's law turns it into the cores that keep
up; it counts only while the class is active (an action ran or waited within
``hold_idle_s``), so a decaying estimate never keeps an idle pool.  The
backlog term clears what already waits within one worker start-up:
``startup_s`` is learned as the median start-up of the current workers
(``WorkerStatus.launched_at`` to joining), with the configured value as the
guess before any.
The pool grows to ``wanted`` in one wave -- in proportion to demand, not by a
fixed factor per start-up.  Without an offered load (a driver that does not
provide it) the controller falls back to growing while busy cores exceed
``target_util`` of the capacity.

RL steps repeat.  The controller remembers the largest ``wanted`` (or busy
cores, when elastic actions grew into more) of the current and of the
previous step (``PoolView.step``) and, while the run is active (an action ran or waited within ``hold_idle_s``), never lets capacity
fall below it: the tail of a step, when a few long trajectories keep most
workers idle, is followed at once by the next step's burst, which a worker
started only then would reach a start-up too late.  A new step that finds
less capacity than the previous step's peak pre-scales to it at once.

Cluster view.  With a :class:`ClusterCapacity` (free cores/GPUs per
partition, from the batch system) the controller only asks for shapes whose
partition can hold them now and prefers the partition with the most idle
resources; with several shapes of a kind in the config, that is how it picks.

Time limits.  A worker whose batch job ends within ``time_limit_margin_s``
is drained (its running actions finish, its environments are snapshotted)
and no longer counts as capacity, so a replacement is launched in time.
While work of its class waits, the last worker of the class that accepts
work is drained only once another has joined: no drain leaves the pool
with nothing accepting work that waits.

Scale down.  A worker idle (no running action) for ``idle_ttl_s`` is
reclaimed, down to ``min_workers`` of its class, never while work of its
class waits and never below the capacity wanted or held (GPU workers: the
step holds all it had while the run is active, as the models resident on
them, not their busy slots, are what a call would otherwise wait for); one that hosts
sandbox environments waits ``env_idle_ttl_s`` instead (reclaiming drains it,
and a stopping worker snapshots its environments for the next worker to
restore).  A worker that runs actions is never reclaimed; a draining worker
is reclaimed once it is empty.

Withdrawing.  Once nothing of a class waits, launches still starting beyond
the capacity wanted (and ``min_workers``) are withdrawn, newest first: the
driver cancels the jobs still queued in the batch system, as dask-jobqueue's
adapt and Parsl's scale-in do, instead of letting them start after the work
is done.

Limits.  Launches are capped by the per-class and total maxima.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from ..actions import ActionSpec
from ..resources import CPU, GPU, ClusterCapacity, PartitionFree, ResourceClass, WorkerShape
from .base import Launch, PoolPolicy, PoolView, Reclaim, Withdraw, mypyc_attr
from .predict import Predictor

__all__ = ["PoolController", "PoolConfig", "ClusterCapacity", "PartitionFree", "resource_for"]


@dataclass(slots=True)
class PoolConfig:
    """Limits and timings of the pool.

    shapes: the worker shapes to use, e.g. one CPU shape and one GPU shape
        (several of a class: alternative partitions).
    max_workers / min_workers: per resource class (``cpu``/``gpu``); missing
        classes are unbounded except by ``max_total``.
    hold_steps: keep the current and the previous RL step's peak demand while
        the run is active (see the module docstring).
    hold_idle_s: how long without any action before the held capacity is let
        go (default: ``idle_ttl_s``).
    """

    shapes: list[WorkerShape]
    max_workers: dict[str, int] = field(default_factory=dict)
    min_workers: dict[str, int] = field(default_factory=dict)
    max_total: int = 1 << 30
    startup_s: float = 60.0
    idle_ttl_s: float = 300.0
    env_idle_ttl_s: float = 600.0   # idle time before a worker hosting environments is drained
    time_limit_margin_s: float = 120.0
    target_util: float = 0.75
    hold_steps: bool = True
    hold_idle_s: float | None = None

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError("PoolConfig needs at least one worker shape")
        for name in ("startup_s", "idle_ttl_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if not 0 < self.target_util <= 1:
            raise ValueError("target_util must be in (0, 1]")


def resource_for(spec: ActionSpec) -> ResourceClass:
    """The class of worker an action needs."""
    d = spec.demand
    return GPU if (d.service or d.gpu_mem_mb) else CPU


@dataclass(slots=True)
class _Demand:
    """One resource class at one decision point."""

    count: int = 0           # workers (draining and expiring included)
    busy: int = 0            # busy cores
    cap: int = 0             # cores of workers that take new work
    free: int = 0
    starting: int = 0        # workers starting
    starting_cores: int = 0
    backlog: float = 0.0     # waiting core-seconds (mean)
    waiting: int = 0         # waiting actions
    biggest: int = 0         # largest min_cores waiting
    running: int = 0         # actions running


@mypyc_attr(allow_interpreted_subclasses=True)
class PoolController(PoolPolicy):
    #: Waiting actions of one resource class whose predicted core-seconds a decision adds up; past
    #: this many, every k-th (a different offset each decision) and the sum scaled to them all.
    #: Each costs a predictor call, in the coordinator's loop: 100,000 waiting took 0.3 s a decision.
    BACKLOG_SAMPLE: ClassVar[int] = 10_000

    def __init__(self, config: PoolConfig, predictor: Predictor | None = None):
        self.config = config
        self.shapes = list(config.shapes)
        self.predictor = predictor if predictor is not None else Predictor()
        self.cluster: ClusterCapacity | None = None
        self._last = ""
        self._held_drives: dict[ResourceClass, bool] = {}    # whether the held step peak, not the load, sets wanted
        self._step: int | None = None
        self._peak: dict[ResourceClass, float] = {}        # largest wanted capacity in this step
        self._prev_peak: dict[ResourceClass, float] = {}   # ... in the previous step
        self._active_at: dict[ResourceClass, float] = {}   # last time an action of the class ran or waited
        self._decisions = 0

    def update_cluster(self, capacity: ClusterCapacity | None) -> None:
        """The batch system's current free resources (the Slurm backend polls them)."""
        self.cluster = capacity

    def explain(self) -> str:
        return self._last

    def held(self, resource: ResourceClass | str, now: float) -> float:
        """Cores the step memory keeps for ``resource`` now (0 when the run went quiet)."""
        res = ResourceClass(resource)
        if not self.config.hold_steps or not self._holding(res, now):
            return 0.0
        return max(self._peak.get(res, 0.0), self._prev_peak.get(res, 0.0))

    def _holding(self, res: ResourceClass, now: float) -> bool:
        """Whether the step memory holds ``res`` now: its class is active, or for GPU workers the
        run's CPU side is (reward calls may come minutes apart: the trajectories calling them still act)."""
        return self._active(res, now) or (res is GPU and self._active(CPU, now))

    def _active(self, res: ResourceClass, now: float) -> bool:
        """An action of the class ran or waited within ``hold_idle_s`` (the run has not gone quiet)."""
        cfg = self.config
        quiet = cfg.hold_idle_s if cfg.hold_idle_s is not None else cfg.idle_ttl_s
        return now - self._active_at.get(res, -float("inf")) <= quiet

    def startup_s(self, view: PoolView) -> float:
        """Seconds from asking for a worker to its joining: the median seen among the current
        workers, else the configured guess (a queue-less dev cluster starts in seconds, a busy
        site's in minutes; a guess far off either way over- or under-sizes every wave)."""
        seen = sorted(w.started_at - w.launched_at for w in view.workers if w.launched_at is not None)
        return seen[len(seen) // 2] if seen else self.config.startup_s

    # -- decision ------------------------------------------------------------
    def _tally(self, view: PoolView) -> dict[ResourceClass, _Demand]:
        now = view.now
        out: dict[ResourceClass, _Demand] = {}
        by_res: dict[ResourceClass, list[ActionSpec]] = {}
        for spec in view.pending:
            k = resource_for(spec)
            waiting = by_res.get(k)
            if waiting is None:
                waiting = by_res[k] = []
                out[k] = _Demand()
            waiting.append(spec)
        self._decisions += 1
        core_seconds = self.predictor.mean_core_seconds
        for k, waiting in by_res.items():
            d = out[k]
            d.waiting = len(waiting)
            d.biggest = max(spec.demand.min_cores for spec in waiting)
            every = -(-len(waiting) // self.BACKLOG_SAMPLE)
            sample = waiting[self._decisions % every::every] if every > 1 else waiting
            d.backlog = sum(map(core_seconds, sample)) * (len(waiting) / len(sample))
        for ws in view.workers:
            k = ws.launched_shape.resource
            d = out.get(k) or out.setdefault(k, _Demand())
            d.count += 1
            d.busy += ws.busy_cores
            d.running += ws.running
            if not ws.draining and not self._expiring(ws, now):
                d.free += max(0, ws.info.cores - ws.busy_cores)
                d.cap += ws.info.cores
        for shape, _at in view.starting:
            d = out.get(shape.resource) or out.setdefault(shape.resource, _Demand())
            d.starting += 1
            d.starting_cores += shape.cores
        return out

    def _wanted(self, view: PoolView, res: ResourceClass, d: _Demand) -> float:
        """Cores the class should have now (demand, then the step memory)."""
        cfg = self.config
        now = view.now
        if d.running or d.waiting:
            self._active_at[res] = now
        backlog = d.backlog / max(self.startup_s(view), 1.0)
        if view.offered_load is not None:
            # The offered load decays slowly; once the class went quiet it no longer keeps workers.
            load = view.offered_load.get(res, 0.0) if self._active(res, now) else 0.0
            want = load / cfg.target_util + backlog
        else:   # no offered load: grow while the pool runs hot
            want = max(d.busy / cfg.target_util, d.cap + d.starting_cores - d.free + backlog)
        # what the step used counts too: elastic actions grow into idle cores and run shorter for it
        peak = max(self._peak.get(res, 0.0), want, float(d.busy))
        if res is GPU and self._holding(res, now):
            # a GPU worker's worth is the models resident on it, not its busy slots: a call that
            # finds none waits a start-up and a load (up to minutes), so the step holds its GPU workers
            peak = max(peak, float(d.cap))
        self._peak[res] = peak
        held = self.held(res, now)
        self._held_drives[res] = held > want
        return max(want, held)

    def _new_step(self, view: PoolView) -> None:
        if view.step is None or view.step == self._step:
            return
        if self._step is not None and view.step > self._step:
            self._prev_peak = dict(self._peak)
            self._peak = {}
        self._step = view.step

    def decide(self, view: PoolView) -> list[Launch | Reclaim | Withdraw]:
        cfg = self.config
        now = view.now
        cluster = view.cluster or self.cluster
        out: list[Launch | Reclaim | Withdraw] = []
        self._new_step(view)
        demand = self._tally(view)
        wanted = {k: self._wanted(view, k, d) for k, d in demand.items()}
        total = len(view.workers) + len(view.starting)

        # -- scale down first (frees room under max_total for the other class)
        kept = {k: d.count for k, d in demand.items()}
        cap_left = {k: d.cap + d.starting_cores for k, d in demand.items()}
        # busy workers are never reclaimed: only the others are ordered (longest idle first)
        candidates = [ws for ws in view.workers
                      if not (ws.running or ws.busy_cores) or (ws.ends_at is not None and not ws.draining)]
        accepting: dict[ResourceClass, int] = {}
        for ws in view.workers:
            if not ws.draining:
                k = ws.launched_shape.resource
                accepting[k] = accepting.get(k, 0) + 1
        for ws in sorted(candidates, key=lambda s: (s.idle_since if s.idle_since is not None else now, s.info.id)):
            k = ws.launched_shape.resource
            if self._expiring(ws, now) and not ws.draining:
                # Its replacement is launched below.  While work of its class waits, the last worker
                # that accepts it is drained only once another one has joined: the time limit may
                # cut a few attempts short (they run again), a pool that accepts nothing stalls all.
                if demand[k].waiting and accepting.get(k, 0) <= 1:
                    continue
                out.append(Reclaim(ws.info.id, "time limit"))
                accepting[k] -= 1
                kept[k] -= 1
                continue
            if ws.running or ws.busy_cores:
                continue                      # busy: never
            if ws.draining:
                out.append(Reclaim(ws.info.id, "drained"))
                kept[k] -= 1
                continue
            if demand[k].waiting:
                continue
            if cap_left[k] - ws.info.cores < wanted[k]:
                continue                      # the demand, or the next step, needs it
            # Reclaiming drains: a worker snapshots its environments when it stops, and they are
            # restored where their trajectory acts next, so environments only make it wait longer.
            ttl = cfg.env_idle_ttl_s if ws.envs else cfg.idle_ttl_s
            if ws.idle_since is None or now - ws.idle_since < ttl:
                continue
            if kept[k] - 1 < cfg.min_workers.get(k, 0):
                continue
            out.append(Reclaim(ws.info.id, "idle"))
            accepting[k] -= 1
            kept[k] -= 1
            cap_left[k] -= ws.info.cores
        total -= len(out)
        withdrawn = self._withdrawals(view, demand, wanted, cap_left, kept)
        out += withdrawn
        total -= sum(w.count for w in withdrawn)

        # -- scale up
        reasons = []
        for k in sorted(set(demand) | {ResourceClass(m) for m in cfg.min_workers}):
            d = demand.get(k) or _Demand()
            shapes = [s for s in cfg.shapes if s.resource == k and s.cores >= d.biggest]
            if not shapes:
                if d.waiting:
                    reasons.append(f"no {k} shape large enough for waiting actions")
                continue
            have = kept.get(k, 0) + d.starting
            room = min(cfg.max_workers.get(k, 1 << 30) - have, cfg.max_total - total)
            missing = wanted.get(k, 0.0) - d.cap - d.starting_cores
            need = math.ceil(missing / shapes[0].cores - 1e-9) if missing > 0 else 0
            if d.waiting and have == 0:
                need = max(need, 1)
            need = max(need, cfg.min_workers.get(k, 0) - have)
            if need <= 0:
                continue
            if room <= 0:
                reasons.append(f"{k} pool at its maximum ({have} workers)")
                continue
            n = min(need, room)
            why = (f"the step peak of {self.held(k, now):.0f} {k} cores, held for the next step"
                   if self._held_drives.get(k) else "")
            for shape, m in self._split(shapes, n, cluster):
                out.append(Launch(shape, m, why))
                total += m
                n -= m
            if n > 0:
                reasons.append(f"partitions cannot hold {n} more {k} workers now")
        self._last = "; ".join(reasons) if reasons else "ok"
        return out

    def _withdrawals(self, view: PoolView, demand: dict[ResourceClass, _Demand], wanted: dict[ResourceClass, float],
                     cap_left: dict[ResourceClass, int], kept: dict[ResourceClass, int]) -> list[Withdraw]:
        """Launches still starting that nothing needs any more: none of their class waits, and the
        capacity without them still covers what is wanted (and ``min_workers``)."""
        out = []
        by_class: dict[ResourceClass, list[tuple[float, WorkerShape]]] = {}
        for shape, at in view.starting:
            by_class.setdefault(shape.resource, []).append((at, shape))
        for k, starting in by_class.items():
            if demand[k].waiting:
                continue
            surplus = cap_left[k] - wanted[k]
            keep_at_least = self.config.min_workers.get(k, 0) - kept.get(k, 0)
            count: dict[WorkerShape, int] = {}
            left = len(starting)
            for _, shape in sorted(starting, key=lambda p: -p[0]):   # newest first
                if left <= keep_at_least or surplus < shape.cores:
                    break
                count[shape] = count.get(shape, 0) + 1
                surplus -= shape.cores
                left -= 1
            out += [Withdraw(shape, n, f"no {k} work waiting") for shape, n in count.items()]
        return out

    def _expiring(self, ws, now: float) -> bool:
        return ws.ends_at is not None and ws.ends_at - now < self.config.time_limit_margin_s

    def _split(self, shapes: list[WorkerShape], n: int, cluster: ClusterCapacity | None
               ) -> list[tuple[WorkerShape, int]]:
        """Spread ``n`` launches over the shapes whose partitions can hold them, idlest first.

        When no partition can start one now, they go to the idlest partition that can hold them
        at all (the jobs queue there), so a busy cluster delays workers instead of never asking.
        """
        if cluster is None:
            return [(shapes[0], n)]
        ranked = sorted((s for s in shapes if cluster.holds(s)), key=lambda s: -cluster.idle_score(s))
        out: dict[WorkerShape, int] = {}
        for s in ranked:
            m = min(n, cluster.fits(s))
            if m > 0:
                out[s] = m
                n -= m
            if n == 0:
                break
        if not out and ranked:
            out[ranked[0]] = n
        return list(out.items())
