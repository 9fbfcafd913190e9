"""The simulated machines: workers, the services resident on their GPUs, how a service loads, and
the launches not up yet.

A :class:`SimWorker` is what the simulated machine does, the ground truth that the policy's
belief follows only through events: which services are loaded (and when they are ready), how a
fuller batch slows a call, and how long the worker's resources were allocated.  Loading evicts
by the rule the live service manager applies (:mod:`tangram_hpc.policy.residency`).
"""
from __future__ import annotations

from ..policy.base import WorkerStatus
from ..policy.residency import Resident, choose_victims
from ..resources import CPU, GPU, ResourceClass, ServiceInfo, WorkerInfo, WorkerShape
from .layout import services_by_demand
from .workload import Service, Workload

__all__ = ["CPU_KINDS", "GPU_KINDS", "Launches", "Replica", "SimWorker", "cluster_shapes", "service_infos"]

CPU_KINDS = frozenset({"sandbox", "function"})
GPU_KINDS = frozenset({"reward"})


def cluster_shapes(w: Workload) -> dict[ResourceClass, WorkerShape]:
    c = w.cluster
    out = {CPU: WorkerShape(c.cpu_cores, c.cpu_mem_mb)}
    if c.gpu_workers or w.services:
        out[GPU] = WorkerShape(c.gpu_slots, 0, c.gpus, c.gpu_mem_mb)
    return out


def service_infos(w: Workload) -> dict[str, ServiceInfo]:
    """The workload's services as the scheduler is told about them (sizes, batch limits, load times),
    the most demanded first: a worker preloads them in this order while they fit."""
    return {name: ServiceInfo(w.services[name].gpu_mem_mb, w.services[name].max_batch, w.services[name].load_s)
            for name in services_by_demand(w)}


def _info(wid: str, shape: WorkerShape, services: frozenset[str]) -> WorkerInfo:
    if shape.gpus:
        return WorkerInfo(wid, shape.cores, shape.mem_mb, shape.gpus, shape.gpus * shape.gpu_mem_mb,
                          kinds=GPU_KINDS, services=services)
    return WorkerInfo(wid, shape.cores, shape.mem_mb, kinds=CPU_KINDS)


class Replica:
    """A service on a simulated GPU worker (the ground truth the policy's belief follows)."""

    __slots__ = ("ready_at", "running", "last_used", "mem")

    def __init__(self, ready_at: float, mem: int):
        self.ready_at = ready_at
        self.running = 0
        self.last_used = ready_at
        self.mem = mem


class SimWorker:
    """A simulated worker.

    ``status`` is the very :class:`WorkerStatus` record the pool policy reads,
    kept current in place.  The rest is what the simulated machine does and the
    policy only learns through events: which services are loaded (and when
    they are ready), and how long the worker's resources were allocated.
    """

    __slots__ = ("id", "shape", "resource", "status", "alloc_start", "alloc_end", "services", "gpu_used",
                 "slots")

    def __init__(self, wid: str, shape: WorkerShape, services: frozenset[str], now: float, requested: float):
        self.id = wid
        self.shape = shape
        self.resource = shape.resource
        self.status = WorkerStatus(_info(wid, shape, services), idle_since=now, started_at=now, shape=shape,
                                   launched_at=requested if requested < now else None)
        self.alloc_start = requested
        self.alloc_end: float | None = None
        self.services: dict[str, Replica] = {}
        self.gpu_used = 0
        self.slots = shape.cores

    def ready_services(self, now: float) -> frozenset[str]:
        """The services loaded and ready by ``now`` (what a live worker's heartbeat reports)."""
        return frozenset(k for k, r in self.services.items() if r.ready_at <= now)

    def preload(self, names, svc_defs: dict[str, Service], now: float, warm: bool) -> None:
        """Load ``names`` at start, in that order, while they fit (``warm``: loaded before the run)."""
        cap = self.status.info.gpu_mem_mb
        for name in names:
            svc = svc_defs.get(name)
            if svc is None or self.gpu_used + svc.gpu_mem_mb > cap:
                continue
            self.services[name] = Replica(now if warm else now + svc.load_s, svc.gpu_mem_mb)
            self.gpu_used += svc.gpu_mem_mb

    def batch_factor(self, svc: Service, in_batch: int) -> float:
        """How much slower a call of ``svc`` runs with ``in_batch`` calls in its batch."""
        if not svc.batch_slowdown or in_batch <= 1:
            return 1.0
        full = svc.max_batch or self.slots
        return 1.0 + svc.batch_slowdown * min(1.0, (in_batch - 1) / max(1, full - 1))

    def load(self, name: str, svc_defs: dict[str, Service], now: float) -> tuple[Replica, bool]:
        """Load service ``name``, evicting by the service manager's rule; the replica, and whether it
        was loaded over the GPU memory (residents in use held it: the policy should not ask)."""
        svc = svc_defs[name]
        cap = self.status.info.gpu_mem_mb
        free = cap - self.gpu_used
        residents = [Resident(s, r.mem, 0, now - r.last_used, svc_defs[s].load_s, 0.0)
                     for s, r in self.services.items() if r.running == 0 and r.ready_at <= now]
        victims = choose_victims(residents, svc.gpu_mem_mb, free)
        over = victims is None
        if victims is None:
            victims = [r.name for r in residents]
        for s in victims:
            self.gpu_used -= self.services.pop(s).mem
        rep = Replica(now + svc.load_s, svc.gpu_mem_mb)
        self.services[name] = rep
        self.gpu_used += svc.gpu_mem_mb
        return rep, over


class Launches:
    """Workers the pool policy launched that are not up yet, as a batch system holds them: each
    comes up after the cluster's startup time unless withdrawn meanwhile.  The first
    ``start_failures`` launches fail (to exercise a pool policy's circuit breaker)."""

    __slots__ = ("starting", "withdrawn", "failures", "fail_left")

    def __init__(self, start_failures: int):
        self.starting: list[tuple[WorkerShape, float]] = []        # (shape, when launched)
        self.withdrawn: dict[tuple[WorkerShape, float], int] = {}  # withdrawn launches still due to come up
        self.failures: list[tuple[float, str]] = []
        self.fail_left = start_failures

    def launch(self, shape: WorkerShape, now: float) -> bool:
        """One launch of ``shape``: False if it failed at once."""
        if self.fail_left > 0:
            self.fail_left -= 1
            self.failures.append((now, "simulated start failure"))
            return False
        self.starting.append((shape, now))
        return True

    def withdraw(self, shape: WorkerShape, count: int) -> None:
        """Take back ``count`` launches of ``shape``, newest first: as jobs cancelled while queued, they held nothing."""
        for key in sorted((p for p in self.starting if p[0] == shape), key=lambda p: -p[1])[:count]:
            self.starting.remove(key)
            self.withdrawn[key] = self.withdrawn.get(key, 0) + 1

    def up(self, shape: WorkerShape, requested: float) -> bool:
        """The launch of ``shape`` at ``requested`` comes up: False if it was withdrawn meanwhile."""
        key = (shape, requested)
        if self.withdrawn.get(key):
            self.withdrawn[key] -= 1
            return False
        self.starting.remove(key)
        return True
