"""The resource-management setups tangram is measured against, as users deploy them.

All of them are :class:`~tangram_hpc.policy.base.SchedulingPolicy` objects,
so the simulator runs them exactly like the real schedulers, on the same plan
and the same static cluster.  On the GPU side every one of them is a *reward
server*: the services are loaded before the run and kept loaded (the
verl/SkyRL setup), on a fixed layout (:class:`StaticLayout`), each
replica batching up to its ``max_batch`` requests.

* :class:`TrajectoryBoundPolicy` -- a trajectory gets a sandbox of
  ``sandbox_cores`` cores when its first action arrives and holds it,
  thinking or not, until it ends; its actions run in it at once with
  ``min(max_cores, sandbox_cores)`` cores, several at once (parallel finals)
  splitting the sandbox's free cores, one that finds fewer than its
  ``min_cores`` free waiting for a sibling to end (the bench's sizes start at
  the largest ``min_cores``).  A trajectory that finds no free sandbox waits
  (its action's ACT includes that wait).  Its reward calls go to the GPU
  worker it was bound to (round robin over the replicas of the service), in
  order per model there.  The bench runs it at the largest ``max_cores`` and at
  the best fixed size, found by trying them.
* :class:`PooledPolicy` -- one shared pool of CPU workers and the reward
  server; waiting actions first come first served (``fifo``) or shortest
  predicted first (``sjf``, with the same online predictor tangram uses), each
  at its ``min_cores`` or at its ``max_cores`` (a rigid size: it waits until
  that many cores are free on one worker).
* :class:`TaskIsolatedPolicy` -- a fixed CPU pool per action kind and GPU
  workers per service, sized in proportion to each one's peak demand in a
  profiling run (another sample of the workload), FIFO at ``max_cores``.
"""
from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import replace
from typing import Mapping

import numpy as np

from ..actions import ActionSpec
from ..policy.base import Assignment, SchedulingPolicy, mypyc_attr
from ..policy.grants import AtMaxCores, Grant, GreedyGrant
from ..policy.loading import KeepLayout, Layout
from ..policy.order import ShortestFirst, SubmitOrder
from ..policy.placement import PlacementPolicy
from ..policy.predict import Predictor
from ..resources import ServiceInfo, WorkerInfo
from .layout import ServiceNotHosted, layout_for, service_layout, workload_layout
from .workload import Plan, Workload

__all__ = ["TrajectoryBoundPolicy", "PooledPolicy", "TaskIsolatedPolicy", "StaticLayout", "TaskPools",
           "unconstrained_peaks", "isolated_split", "sandbox_mem_mb"]


def _default_layout(sizes: Mapping[str, int], gpu_mem_mb: int) -> list[list[str]]:
    """Without a planned layout: every service alike, one layout per service for the round robin."""
    return service_layout(sizes, None, gpu_mem_mb, max(1, len(sizes)))


def sandbox_mem_mb(w: Workload) -> int:
    """The memory a trajectory's sandbox reserves: the largest peak of the actions it may run."""
    return max((a.mem_mb for a in w.actions if not a.service), default=0)


class TrajectoryBoundPolicy(SchedulingPolicy):
    def __init__(self, sandbox_cores: int, services: Mapping[str, int],
                 max_batch: Mapping[str, int] | None = None, *, layout: list[list[str]] | None = None,
                 sandbox_mem_mb: int = 0):
        if sandbox_cores < 1:
            raise ValueError("sandbox_cores must be at least 1")
        self.sandbox_cores = sandbox_cores
        self.sandbox_mem_mb = sandbox_mem_mb
        self.services = dict(services)
        self.max_batch = dict(max_batch or {})
        self._layout = layout
        self._cpu: dict[str, list] = {}        # wid -> [free cores, info, free memory (MB; None: not counted)]
        self._gpu: dict[str, list] = {}        # wid -> [free slots, info, deque of pending specs, services, running per service]
        self._gpu_order: list[str] = []
        self._sandbox: dict[str, str] = {}     # trajectory -> worker holding its sandbox
        self._sandbox_free: dict[str, int] = {}    # trajectory -> its sandbox's cores no action of it uses
        self._in_sandbox: dict[str, str] = {}  # running sandbox action -> its trajectory
        self._waiting: deque[str] = deque()    # trajectories waiting for a sandbox
        self._held: dict[str, list[ActionSpec]] = {}   # their actions
        self._ready: list[ActionSpec] = []
        self._bind: dict[tuple[str, str], str] = {}
        self._rr: dict[str, int] = {}
        self._running: dict[str, tuple[str, int, str | None]] = {}
        self._solo: set[str] = set()           # actions with no trajectory: release at finish
        self._dirty: set[str] = set()
        self._pending = 0

    def add_worker(self, info: WorkerInfo, now: float) -> None:
        if info.gpus:
            if self._layout is None:
                self._layout = _default_layout(self.services, info.gpu_mem_mb)
            svcs = layout_for(self._layout, len(self._gpu_order))
            self._gpu[info.id] = [info.cores, info, deque(), svcs, {}]
            self._gpu_order.append(info.id)
        else:
            self._cpu[info.id] = [info.cores, info, info.mem_mb if info.mem_mb > 0 else None]

    def preloaded_services(self, worker_id: str, info: WorkerInfo) -> list[str]:
        """The static layout: loaded before the run, never moved."""
        g = self._gpu.get(worker_id)
        return list(g[3]) if g else []

    def remove_worker(self, worker_id: str, now: float) -> list[str]:
        self._cpu.pop(worker_id, None)
        self._gpu.pop(worker_id, None)
        lost = [a for a, (w, _, _) in self._running.items() if w == worker_id]
        for a in lost:
            del self._running[a]
            self._in_sandbox.pop(a, None)
        for t in [t for t, w in self._sandbox.items() if w == worker_id]:
            del self._sandbox[t]
            self._sandbox_free.pop(t, None)
        return lost

    def set_draining(self, worker_id: str, draining: bool) -> None:
        pass

    def _traj(self, spec: ActionSpec) -> str:
        return spec.trajectory or f"solo:{spec.id}"

    def submit(self, action: ActionSpec, now: float) -> None:
        self._pending += 1
        svc = action.demand.service
        t = self._traj(action)
        if action.trajectory is None:
            self._solo.add(action.id)
        if svc:
            key = (t, svc)
            wid = self._bind.get(key)
            if wid is None or wid not in self._gpu:
                reps = [w for w in self._gpu_order if w in self._gpu and svc in self._gpu[w][3]]
                if not reps:
                    raise ServiceNotHosted(f"no GPU worker of the static layout hosts service {svc}")
                k = self._rr.get(svc, 0)
                self._rr[svc] = k + 1
                wid = self._bind[key] = reps[k % len(reps)]
            self._gpu[wid][2].append(action)
            self._dirty.add(wid)
            return
        if t in self._sandbox:
            self._ready.append(action)
        elif t in self._held:
            self._held[t].append(action)
        else:
            self._held[t] = [action]
            self._waiting.append(t)

    def trajectory_done(self, trajectory: str, now: float) -> None:
        wid = self._sandbox.pop(trajectory, None)
        self._sandbox_free.pop(trajectory, None)
        if wid is not None and wid in self._cpu:
            st = self._cpu[wid]
            st[0] += self.sandbox_cores
            if st[2] is not None:
                st[2] += self.sandbox_mem_mb
        for key in [k for k in ((trajectory, s) for s in self.services) if k in self._bind]:
            del self._bind[key]

    def cancel(self, action_id: str) -> bool:
        for lst in [self._ready] + list(self._held.values()) + [g[2] for g in self._gpu.values()]:
            for a in lst:
                if a.id == action_id:
                    lst.remove(a)
                    self._pending -= 1
                    return True
        return False

    def finished(self, action_id: str, now: float, *, ok: bool = True, run_time: float | None = None) -> None:
        ent = self._running.pop(action_id, None)
        if ent is None:
            return
        wid, cores, svc = ent
        t = self._in_sandbox.pop(action_id, None)
        if t in self._sandbox_free:
            self._sandbox_free[t] += cores
        g = self._gpu.get(wid) if svc is not None else None
        if g is not None:
            g[0] += cores
            g[4][svc] -= 1
            self._dirty.add(wid)
        if action_id in self._solo:
            self._solo.discard(action_id)
            self.trajectory_done(f"solo:{action_id}", now)

    def schedule(self, now: float) -> list[Assignment]:
        out = []
        while self._waiting:
            t = self._waiting[0]
            # a sandbox reserves its cores and the memory its largest action may peak at
            wid = next((w for w, st in self._cpu.items() if st[0] >= self.sandbox_cores
                        and (st[2] is None or st[2] >= self.sandbox_mem_mb)), None)
            if wid is None:
                break
            self._waiting.popleft()
            st = self._cpu[wid]
            st[0] -= self.sandbox_cores
            if st[2] is not None:
                st[2] -= self.sandbox_mem_mb
            self._sandbox[t] = wid
            self._sandbox_free[t] = self.sandbox_cores
            self._ready.extend(self._held.pop(t))
        if self._ready:
            # A trajectory's actions share its sandbox's cores: several at once (parallel finals)
            # split what is free, and one that finds too little waits for a sibling to end.
            left = Counter(self._traj(a) for a in self._ready)
            waiting = []
            for a in self._ready:
                t = self._traj(a)
                free = self._sandbox_free[t]
                r = left[t]
                left[t] = r - 1
                d = a.demand
                if free < d.min_cores:
                    waiting.append(a)
                    continue
                c = max(d.min_cores, min(d.max_cores, free // r))
                self._sandbox_free[t] = free - c
                self._in_sandbox[a.id] = t
                self._running[a.id] = (self._sandbox[t], c, None)
                out.append(Assignment(a.id, self._sandbox[t], c))
            self._pending -= len(self._ready) - len(waiting)
            self._ready = waiting
        for wid in sorted(self._dirty):
            g = self._gpu.get(wid)
            if g is None:
                continue
            q = g[2]
            if not q or g[0] <= 0:
                continue
            # a queue per model, as a reward server has: each service's requests start in order,
            # and one whose replica is full does not hold up the others
            blocked: set[str] = set()
            kept: deque[ActionSpec] = deque()
            while q and g[0] > 0:
                a = q.popleft()
                svc = a.demand.service
                if svc in blocked or g[0] < a.demand.min_cores or \
                        g[4].get(svc, 0) >= self.max_batch.get(svc, 0) > 0:
                    blocked.add(svc)
                    kept.append(a)
                    continue
                g[0] -= a.demand.min_cores
                g[4][svc] = g[4].get(svc, 0) + 1
                self._running[a.id] = (wid, a.demand.min_cores, svc)
                self._pending -= 1
                out.append(Assignment(a.id, wid, a.demand.min_cores))
            kept.extend(q)
            g[2] = kept
        self._dirty.clear()
        return out

    @property
    def pending_count(self) -> int:
        return self._pending

    @property
    def running_count(self) -> int:
        return len(self._running)


@mypyc_attr(allow_interpreted_subclasses=True)
class StaticLayout(Layout):
    """The reward server's layout: the ``i``-th GPU worker to join is preloaded with
    ``layout_for(plan, i)`` (the demand-weighted plan every baseline shares; without one, every
    service alike) and the policy believes exactly that resident; CPU workers serve the kinds they say."""

    def __init__(self, services: Mapping[str, ServiceInfo], plan: list[list[str]] | None = None):
        self._sizes = {k: v.gpu_mem_mb for k, v in services.items()}
        self._ngpu = 0
        self._plan = plan
        self._layout: dict[str, list[str]] = {}

    def admit(self, info: WorkerInfo) -> WorkerInfo:
        if info.gpus:
            self._layout[info.id] = self._gpu_services(info)
            self._ngpu += 1
            # the policy believes exactly the static layout resident, as the simulator loads it
            info = replace(info, services=frozenset(self._layout[info.id]))
        return info

    def _gpu_services(self, info: WorkerInfo) -> list[str]:
        if self._plan is None:
            self._plan = _default_layout(self._sizes, info.gpu_mem_mb)
        return layout_for(self._plan, self._ngpu)

    def preloaded(self, worker_id: str) -> list[str] | None:
        return self._layout.get(worker_id, [])


@mypyc_attr(allow_interpreted_subclasses=True)
class TaskPools(StaticLayout):
    """Fixed per-task pools: the ``i``-th CPU worker serves only the kind ``cpu_plan[i]`` (round
    robin), the ``i``-th GPU worker hosts the services ``gpu_plan[i]``."""

    def __init__(self, cpu_plan: list[str], gpu_plan: list[list[str]], services: Mapping[str, ServiceInfo]):
        super().__init__(services, gpu_plan)
        self._cpu_plan = cpu_plan or ["sandbox"]
        self._gpu_plan = gpu_plan
        self._ncpu = 0

    def admit(self, info: WorkerInfo) -> WorkerInfo:
        if info.gpus:
            return super().admit(info)
        kind = self._cpu_plan[self._ncpu % len(self._cpu_plan)]
        self._ncpu += 1
        return replace(info, kinds=frozenset({kind}))

    def _gpu_services(self, info: WorkerInfo) -> list[str]:
        return layout_for(self._gpu_plan, self._ngpu)


@mypyc_attr(allow_interpreted_subclasses=True)
class PooledPolicy(PlacementPolicy):
    """One shared pool, FIFO or shortest-first, every action at its min or max cores or greedily
    at as many as are free (up to its max); a reward server; environments move by tangram's rule.

    As a set of strategies: :class:`~tangram_hpc.policy.order.SubmitOrder` (``fifo``) or
    :class:`~tangram_hpc.policy.order.ShortestFirst` (``sjf``), :class:`~tangram_hpc.policy.grants.Grant`
    (``min``), :class:`~tangram_hpc.policy.grants.AtMaxCores` (``max``) or
    :class:`~tangram_hpc.policy.grants.GreedyGrant` (``elastic``),
    :class:`~tangram_hpc.policy.loading.KeepLayout` on a :class:`StaticLayout` of ``layout`` (the
    plan of every GPU worker's services; a :class:`StaticLayout` itself is taken as it is).
    """

    def __init__(self, order: str, cores: str, services: Mapping[str, ServiceInfo],
                 predictor: Predictor | None = None, *, layout: list[list[str]] | StaticLayout | None = None,
                 env_move_s: float | None = None):
        if order not in ("fifo", "sjf") or cores not in ("min", "max", "elastic"):
            raise ValueError("order is fifo or sjf, cores is min, max or elastic")
        self.static_layout = layout if isinstance(layout, StaticLayout) else StaticLayout(services, layout)
        grant = AtMaxCores() if cores == "max" else GreedyGrant() if cores == "elastic" else Grant()
        super().__init__(predictor, services=services, env_move_s=env_move_s,
                         order=SubmitOrder() if order == "fifo" else ShortestFirst(),
                         grant=grant, loading=KeepLayout(), layout=self.static_layout)

    def preloaded_services(self, worker_id: str, info: WorkerInfo) -> list[str]:
        """The static layout: loaded before the run, never moved."""
        return self.static_layout.preloaded(worker_id) or []


class TaskIsolatedPolicy(PooledPolicy):
    """Fixed per-task pools, FIFO inside, every action at ``max_cores``, services pinned per GPU worker."""

    def __init__(self, cpu_plan: list[str], gpu_plan: list[list[str]], services: Mapping[str, ServiceInfo]):
        super().__init__("fifo", "max", services, layout=TaskPools(cpu_plan, gpu_plan, services))


def unconstrained_peaks(plan: Plan) -> dict[str, float]:
    """Peak concurrent demand per task when every action runs at once at its best core count.

    Keys ``cpu:<kind>`` (cores) and ``svc:<service>`` (request slots); from
    the first step of the plan (joined actions and barriers ignored: a profile).
    """
    w = plan.workload
    st, ln = plan.step_traj_start[0], plan.step_traj_len[0]
    lo, hi = int(st[0]), int(st[-1] + ln[-1])
    cls = plan.cls[lo:hi]
    pf = np.array([a.parallel_fraction for a in w.actions])[cls]
    cores = np.array([w.action_cores(a)[1] for a in w.actions])[cls]
    dur = plan.d1[lo:hi] * ((1 - pf) + pf / cores)
    seg = plan.think[lo:hi] + dur
    cs = np.cumsum(seg)
    first = st - lo
    base = np.repeat(cs[first] - seg[first], ln)
    end = cs - base
    start = end - dur
    keys = [f"svc:{a.service}" if a.service else f"cpu:{a.kind}" for a in w.actions]
    out: dict[str, float] = {}
    for k in sorted(set(keys)):
        idx = np.isin(cls, [i for i, kk in enumerate(keys) if kk == k])
        t = np.concatenate([start[idx], end[idx]])
        dlt = np.concatenate([cores[idx], -cores[idx]])
        order = np.lexsort((dlt, t))   # at equal times, ends (negative) first
        out[k] = float(np.max(np.cumsum(dlt[order]))) if len(t) else 0.0
    return out


def isolated_split(w: Workload, peaks: dict[str, float],
                   layout: list[list[str]] | None = None) -> tuple[list[str], list[list[str]]]:
    """Split the cluster's workers into per-task pools in proportion to peak demand; with fewer GPU
    workers than services, the GPU side shares ``layout`` (the static one every baseline has)."""
    def split(n: int, demands: dict[str, float]) -> dict[str, int]:
        keys = sorted(demands)
        if not keys or n == 0:
            return {}
        tot = sum(demands.values()) or 1.0
        alloc = {k: max(1, math.floor(n * demands[k] / tot)) for k in keys}
        while sum(alloc.values()) > n and max(alloc.values()) > 1:
            k = max(alloc, key=lambda k: (alloc[k], k))
            alloc[k] -= 1
        while sum(alloc.values()) < n:    # largest shortfall gets the next worker
            k = max(keys, key=lambda k: (demands[k] / tot * n - alloc[k], k))
            alloc[k] += 1
        return alloc

    cpu = split(w.cluster.cpu_workers, {k[4:]: v for k, v in peaks.items() if k.startswith("cpu:")})
    cpu_plan = [k for k in sorted(cpu) for _ in range(cpu[k])]
    svc_demand = {k[4:]: v for k, v in peaks.items() if k.startswith("svc:")}
    gpu_plan: list[list[str]] = []
    if w.cluster.gpu_workers and svc_demand:
        if w.cluster.gpu_workers >= len(svc_demand):
            g = split(w.cluster.gpu_workers, svc_demand)
            gpu_plan = [[k] for k in sorted(g) for _ in range(g[k])]
        else:
            gpu_plan = layout if layout is not None else workload_layout(w)
    return cpu_plan, gpu_plan
