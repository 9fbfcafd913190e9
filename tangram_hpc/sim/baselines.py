"""The resource-management baselines tangram is measured against.

All of them are :class:`~tangram_hpc.policy.base.SchedulingPolicy` objects,
so the simulator runs them exactly like the real schedulers on the same plan
and the same static cluster.

(a) :class:`TrajectoryBoundPolicy` -- how agentic-RL rollouts commonly use
    external resources: a trajectory gets a sandbox of ``sandbox_cores`` cores
    when its first action arrives and holds it, thinking or not, until it
    ends; its actions run in it at once with ``min(max_cores, sandbox_cores)``
    cores.  A trajectory that finds no free sandbox waits (its action's ACT
    includes that wait).  Reward calls go to the GPU worker the trajectory was
    bound to (round robin over the replicas of the service, for its whole
    life), FIFO there; services are preloaded statically and never move.
(b) :class:`TaskIsolatedPolicy` -- a fixed pool per task: CPU workers split
    between action kinds and GPU workers between services in proportion to
    each one's peak demand; inside a pool, FIFO, every action at its
    ``max_cores`` (sized for its peak), services preloaded on their own GPUs.
(c) :class:`~tangram_hpc.policy.fifo.FifoPolicy` -- action-level pooling but
    FIFO at ``min_cores``, loading services on demand.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from ..actions import ActionSpec
from ..policy._placement import PlacementPolicy, _Queue, _Rec, _Worker
from ..policy.base import Assignment, SchedulingPolicy
from ..resources import WorkerInfo
from .workload import Plan, Workload

__all__ = ["TrajectoryBoundPolicy", "TaskIsolatedPolicy", "unconstrained_peaks", "isolated_split",
           "static_service_layout"]


def static_service_layout(services: dict[str, int], gpu_mem_mb: int, index: int) -> list[str]:
    """Services the ``index``-th GPU worker hosts when every worker is preloaded statically.

    All of them when they fit together; otherwise worker ``i`` starts at
    service ``i`` (round robin) and adds the next ones while they fit.
    """
    names = sorted(services)
    if not names:
        return []
    if sum(services.values()) <= gpu_mem_mb:
        return names
    out, used = [], 0
    for k in range(len(names)):
        s = names[(index + k) % len(names)]
        if used + services[s] <= gpu_mem_mb:
            out.append(s)
            used += services[s]
    return out


class TrajectoryBoundPolicy(SchedulingPolicy):
    def __init__(self, sandbox_cores: int, services: dict[str, int]):
        if sandbox_cores < 1:
            raise ValueError("sandbox_cores must be at least 1")
        self.sandbox_cores = sandbox_cores
        self.services = dict(services)
        self._cpu: dict[str, list] = {}        # wid -> [free cores, info]
        self._gpu: dict[str, list] = {}        # wid -> [free slots, info, deque of pending specs, services]
        self._gpu_order: list[str] = []
        self._sandbox: dict[str, str] = {}     # trajectory -> worker holding its sandbox
        self._waiting: deque[str] = deque()    # trajectories waiting for a sandbox
        self._held: dict[str, list[ActionSpec]] = {}   # their actions
        self._ready: list[ActionSpec] = []
        self._bind: dict[tuple[str, str], str] = {}
        self._rr: dict[str, int] = {}
        self._running: dict[str, tuple[str, int, bool]] = {}
        self._solo: set[str] = set()           # actions with no trajectory: release at finish
        self._dirty: set[str] = set()
        self._pending = 0

    def add_worker(self, info: WorkerInfo, now: float) -> None:
        if info.gpus:
            svcs = static_service_layout(self.services, info.gpu_mem_mb, len(self._gpu_order))
            self._gpu[info.id] = [info.cores, info, deque(), svcs]
            self._gpu_order.append(info.id)
        else:
            self._cpu[info.id] = [info.cores, info]

    def resident_services(self, worker_id: str) -> frozenset[str]:
        g = self._gpu.get(worker_id)
        return frozenset(g[3]) if g else frozenset()

    def remove_worker(self, worker_id: str, now: float) -> list[str]:
        self._cpu.pop(worker_id, None)
        self._gpu.pop(worker_id, None)
        lost = [a for a, (w, _, _) in self._running.items() if w == worker_id]
        for a in lost:
            del self._running[a]
        for t in [t for t, w in self._sandbox.items() if w == worker_id]:
            del self._sandbox[t]
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
                    raise ValueError(f"no GPU worker hosts service {svc}")
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
        if wid is not None and wid in self._cpu:
            self._cpu[wid][0] += self.sandbox_cores
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
        wid, cores, gpu = ent
        if gpu and wid in self._gpu:
            self._gpu[wid][0] += cores
            self._dirty.add(wid)
        if action_id in self._solo:
            self._solo.discard(action_id)
            self.trajectory_done(f"solo:{action_id}", now)

    def schedule(self, now: float) -> list[Assignment]:
        out = []
        while self._waiting:
            t = self._waiting[0]
            wid = next((w for w, st in self._cpu.items() if st[0] >= self.sandbox_cores), None)
            if wid is None:
                break
            self._waiting.popleft()
            self._cpu[wid][0] -= self.sandbox_cores
            self._sandbox[t] = wid
            self._ready.extend(self._held.pop(t))
        for a in self._ready:
            wid = self._sandbox[self._traj(a)]
            c = max(a.demand.min_cores, min(a.demand.max_cores, self.sandbox_cores))
            self._running[a.id] = (wid, c, False)
            out.append(Assignment(a.id, wid, c))
        self._pending -= len(self._ready)
        self._ready = []
        for wid in sorted(self._dirty):
            g = self._gpu.get(wid)
            if g is None:
                continue
            q = g[2]
            while q and g[0] >= q[0].demand.min_cores:
                a = q.popleft()
                g[0] -= a.demand.min_cores
                self._running[a.id] = (wid, a.demand.min_cores, True)
                self._pending -= 1
                out.append(Assignment(a.id, wid, a.demand.min_cores))
        self._dirty.clear()
        return out

    @property
    def pending_count(self) -> int:
        return self._pending

    @property
    def running_count(self) -> int:
        return len(self._running)


class TaskIsolatedPolicy(PlacementPolicy):
    """Fixed per-task pools, FIFO inside, every action at ``max_cores``, services pinned."""

    def __init__(self, cpu_plan: list[str], gpu_plan: list[list[str]], services: dict[str, int]):
        super().__init__()
        self._cpu_plan = cpu_plan or ["sandbox"]
        self._gpu_plan = gpu_plan
        self._svc_sizes = dict(services)
        self._ncpu = 0
        self._ngpu = 0

    def add_worker(self, info: WorkerInfo, now: float) -> None:
        from dataclasses import replace
        if info.gpus:
            svcs = self._gpu_plan[self._ngpu % len(self._gpu_plan)] if self._gpu_plan else []
            self._ngpu += 1
            super().add_worker(info, now)
            w = self._workers[info.id]
            for s in svcs:
                self._svc_mem[s] = self._svc_sizes[s]
                self._make_resident(w, s, self._svc_sizes[s], now)
        else:
            kind = self._cpu_plan[self._ncpu % len(self._cpu_plan)]
            self._ncpu += 1
            super().add_worker(replace(info, kinds=frozenset({kind})), now)

    def _key(self, rec: _Rec) -> float:
        return float(rec.seq)

    def _fits(self, w: _Worker, d) -> bool:
        return (w.free_cores >= d.max_cores and w.free_mem >= d.mem_mb
                and (d.service is not None or w.gpu_mem - w.gpu_used >= d.gpu_mem_mb))

    def _grant(self, rec: _Rec, w: _Worker) -> int:
        return rec.spec.demand.max_cores

    def _should_load(self, rec: _Rec, q: _Queue, now: float) -> bool:
        return False


def unconstrained_peaks(plan: Plan) -> dict[str, float]:
    """Peak concurrent demand per task when every action runs at once at its best core count.

    Keys ``cpu:<kind>`` (cores) and ``svc:<service>`` (request slots); from
    the first step of the plan.
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


def isolated_split(w: Workload, peaks: dict[str, float]) -> tuple[list[str], list[list[str]]]:
    """Split the cluster's workers into per-task pools in proportion to peak demand."""
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
            mem = w.cluster.gpus * w.cluster.gpu_mem_mb
            sizes = {s: w.services[s].gpu_mem_mb for s in svc_demand}
            gpu_plan = [static_service_layout(sizes, mem, i) for i in range(w.cluster.gpu_workers)]
    # interleave so that worker i of the cluster gets plan[i]
    return cpu_plan, gpu_plan
