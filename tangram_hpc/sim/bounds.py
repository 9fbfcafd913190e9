"""Lower bounds on the mean action completion time of a run.

Two bounds, both for the submit times a run actually had (an action's submit
time depends on when its trajectory's previous action ended, so every run
has its own; a bound for a run's own submit times is a true bound for it):

* **per action** -- every action alone at its best core count, no wait, no
  service load (``SimResult.lower_bound``);
* **capacity-aware** -- the larger of that and what a scheduler with the
  cluster's whole capacity as one machine could reach: preemptive shortest
  remaining work first on a single machine of ``C`` cores (the optimum for
  the sum of completion times on one machine, and one machine of speed
  ``C`` does at least what ``C`` unit machines do), each action's work being
  its core-seconds at its smallest core count (Amdahl: more cores never take
  fewer core-seconds).  CPU and GPU actions are bounded apart, each by its
  own capacity.  The max of two lower bounds on the same sum is one too.
  An action the run pipelined (zero cores: a class learned to take under a
  millisecond) used no capacity, so only its per-action bound counts.

The GPU side is also bounded per service, from what its replicas can serve
(:func:`replica_throughput`): one replica per GPU worker (the most a worker
holds of a service), each running at most ``max_batch`` requests (and no more
than the worker's slots allow), a request in a batch of ``b`` taking
``1 + batch_slowdown * (b - 1) / (full - 1)`` times as long as alone.  A
service's calls are then at best shortest work first on one machine as fast
as all those replicas at their best batch together; the sum over services
bounds the GPU side's sum too, and the larger of the two GPU bounds counts.
Load times are not counted (a bound for a run whose replicas were all
resident from the start), so the bound stays below any run's figure.
"""
from __future__ import annotations

import heapq

import numpy as np

from .engine import SimResult, action_specs_for
from .workload import Plan

__all__ = ["srpt_flow_sum", "capacity_bound", "replica_throughput"]


def srpt_flow_sum(release: np.ndarray, work: np.ndarray, speed: float) -> float:
    """Sum of completion minus release times under preemptive SRPT on one machine of ``speed``."""
    if speed <= 0 or not len(release):
        return float("inf") if len(release) else 0.0
    order = np.argsort(release, kind="stable")
    rel = release[order].tolist()
    wk = (work[order] / speed).tolist()
    heap: list[tuple[float, float]] = []     # (remaining time, release)
    t = 0.0
    total = 0.0
    i, n = 0, len(rel)
    while i < n or heap:
        if not heap:
            t = max(t, rel[i])
        while i < n and rel[i] <= t:
            heapq.heappush(heap, (wk[i], rel[i]))
            i += 1
        rem, r = heap[0]
        nxt = rel[i] if i < n else float("inf")
        if t + rem <= nxt:
            heapq.heappop(heap)
            t += rem
            total += t - r
        else:
            heapq.heapreplace(heap, (rem - (nxt - t), r))
            t = nxt
    return total


def replica_throughput(max_batch: int, batch_slowdown: float, slots: int, request_cores: int) -> float:
    """Seconds of requests (as each would take alone) one replica serves per second, at its best batch."""
    full = max_batch or slots
    most = min(max_batch or slots, slots // max(1, request_cores))
    best = 1.0
    for b in range(2, most + 1):
        best = max(best, b / (1.0 + batch_slowdown * min(1.0, (b - 1) / max(1, full - 1))))
    return best if most >= 1 else 0.0


def _per_service(result: SimResult, plan: Plan, t_min: np.ndarray, mask: np.ndarray) -> float:
    """The sum over services of each one's bound (see the module docstring)."""
    w = plan.workload
    rows = action_specs_for(w)
    svc_of = np.array([r.service or "" for r in rows])[plan.cls]
    total = 0.0
    for name, svc in w.services.items():
        m = mask & (svc_of == name)
        if not m.any():
            continue
        per_action = float(result.lower_bound[m].sum())
        cores = max(r.demand.min_cores for r in rows if r.service == name)
        hosts = w.cluster.gpu_workers if svc.gpu_mem_mb <= w.cluster.gpus * w.cluster.gpu_mem_mb else 0
        speed = hosts * replica_throughput(svc.max_batch, svc.batch_slowdown, w.cluster.gpu_slots, cores)
        total += max(per_action, srpt_flow_sum(result.submit[m], t_min[m], speed))
    return total


def capacity_bound(result: SimResult, plan: Plan, cpu_cores: int, gpu_slots: int) -> float:
    """Capacity-aware lower bound on ``result``'s mean ACT (see the module docstring)."""
    rows = action_specs_for(plan.workload)
    pf = np.array([r.parallel_fraction for r in rows])[plan.cls]
    lo = np.maximum(1, np.array([r.demand.min_cores for r in rows]))[plan.cls]
    tmo = np.array([r.timeout_s for r in rows])[plan.cls]
    t_min = np.minimum(plan.d1 * ((1.0 - pf) + pf / lo), tmo)
    work = t_min * lo
    gpu = np.array([r.service is not None for r in rows])[plan.cls]
    total = 0.0
    light = result.cores == 0
    for mask, cap in ((~gpu, cpu_cores), (gpu, gpu_slots)):
        if not mask.any():
            continue
        per_action = float(result.lower_bound[mask].sum())
        bound = mask & ~light
        queueing = srpt_flow_sum(result.submit[bound], work[bound], float(cap))
        part = max(per_action, queueing + float(result.lower_bound[mask & light].sum()))
        if cap is gpu_slots and plan.workload.services:
            part = max(part, _per_service(result, plan, t_min, mask & ~light)
                       + float(result.lower_bound[mask & light].sum()))
        total += part
    return total / max(1, plan.n_actions)
