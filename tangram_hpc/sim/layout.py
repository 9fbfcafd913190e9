"""Where GPU services sit before a run: one layout, weighted by expected demand.

Every static baseline keeps this layout for the whole run, and the simulator
preloads tangram's GPU workers with it, so no setup starts from the order in
which a workload file happens to list its services.

A service's *demand* is the replica-seconds a trajectory is expected to need
from it: its expected requests (per-turn share times the expected turns,
follow-ups, final calls) times their mean duration, divided by what one
replica serves at once (a full batch, slowed by its batch slowdown).  The
layout gives every service one replica first (the most demanded first),
then adds replicas to the service with the most demand per replica, each on
the worker with the most free GPU memory that does not hold it yet, until
nothing more fits.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from ..errors import TangramError
from .workload import Workload

__all__ = ["ServiceNotHosted", "expected_turns", "service_demand", "service_layout", "workload_layout", "layout_for",
           "services_by_demand"]


class ServiceNotHosted(TangramError, ValueError):
    """A static layout with no replica of a service the run calls: the setup cannot run this workload."""


def expected_turns(w: Workload) -> float:
    """The mean number of turns of a trajectory (a lognormal count clipped to its bounds, approximately)."""
    t = w.rollout.turns
    if not t.lognormal:
        return (t.min + t.max) / 2
    return min(float(t.max), max(float(t.min), t.median * math.exp(0.5 * t.sigma ** 2)))


def service_demand(w: Workload) -> dict[str, float]:
    """Per service, the replica-seconds one trajectory is expected to need (see the module docstring)."""
    total_weight = sum(a.weight for a in w.actions)
    base = {a.name: a.weight / total_weight if total_weight else 0.0 for a in w.actions}
    share = dict(base)
    for a in w.actions:          # follow-ups have none of their own (one level)
        for f in a.followups:
            share[f.action] += base[a.name] * f.probability
    turns = expected_turns(w)
    out = {name: 0.0 for name in w.services}
    for a in w.actions:
        if a.service is None:
            continue
        svc = w.services[a.service]
        per_replica = max(1.0, svc.max_batch / (1.0 + svc.batch_slowdown)) if svc.batchable else 1.0
        calls = turns * share[a.name] + a.final
        seconds = a.duration_s.mean if a.timeout_s is None else min(a.duration_s.mean, a.timeout_s)
        out[a.service] += calls * seconds / per_replica
    return out


def service_layout(sizes: Mapping[str, int], demand: Mapping[str, float] | None, gpu_mem_mb: int,
                   workers: int) -> list[list[str]]:
    """The services each of ``workers`` GPU workers of ``gpu_mem_mb`` hosts (see the module docstring).

    ``demand`` None: every service alike.  A service that fits no worker is left out (the caller
    decides whether that is an error).
    """
    n = max(1, workers)
    free = [gpu_mem_mb] * n
    hosts: list[list[str]] = [[] for _ in range(n)]
    want = {s: 1.0 if demand is None else demand.get(s, 0.0) for s in sizes}
    replicas = {s: 0 for s in sizes}

    def place(s: str) -> bool:
        fits = [i for i in range(n) if s not in hosts[i] and free[i] >= sizes[s]]
        if not fits:
            return False
        i = max(fits, key=lambda i: (free[i], -i))
        hosts[i].append(s)
        free[i] -= sizes[s]
        replicas[s] += 1
        return True

    for s in sorted(sizes, key=lambda s: (-want[s], s)):
        place(s)
    open_ = {s for s in sizes if replicas[s]}
    while open_:
        s = max(open_, key=lambda s: (want[s] / replicas[s], -sizes[s], s))
        if not place(s):
            open_.discard(s)
    order = {s: k for k, s in enumerate(sorted(sizes, key=lambda s: (-want[s], s)))}
    return [sorted(h, key=order.__getitem__) for h in hosts]


def workload_layout(w: Workload, gpu_workers: int | None = None) -> list[list[str]]:
    """:func:`service_layout` for the workload's services on its (or ``gpu_workers``) GPU workers."""
    c = w.cluster
    n = c.gpu_workers if gpu_workers is None else gpu_workers
    return service_layout({k: s.gpu_mem_mb for k, s in w.services.items()}, service_demand(w),
                          c.gpus * c.gpu_mem_mb, n)


def layout_for(layout: Sequence[Sequence[str]], index: int) -> list[str]:
    """The ``index``-th GPU worker's services (round robin when more workers come than were planned)."""
    return list(layout[index % len(layout)]) if layout else []


def services_by_demand(w: Workload) -> list[str]:
    """The workload's services, the most demanded first (ties by name): what a worker that loads
    whatever fits, without a planned layout, starts with."""
    d = service_demand(w)
    return sorted(d, key=lambda s: (-d[s], s))
