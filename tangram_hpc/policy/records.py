"""The records placement keeps: actions, workers, service replicas, queues, per-kind load, tallies.

They are plain records (slots, no behaviour beyond their own counts) so that the placement state
(:mod:`tangram_hpc.policy.placement`) and its strategies (:mod:`~tangram_hpc.policy.order`,
:mod:`~tangram_hpc.policy.grants`, :mod:`~tangram_hpc.policy.loading`,
:mod:`~tangram_hpc.policy.moves`) and the baselines in :mod:`tangram_hpc.sim.baselines` all read
the same fields:

* :class:`ActionRecord` -- one submitted action (:class:`ActionState`
  ``PENDING -> RUNNING -> GONE``, or ``PENDING -> GONE`` when cancelled);
* :class:`WorkerRecord` -- what the policy believes about one worker: free
  cores and memory, resident service replicas, hosted environments.  It is not
  the coordinator's record of the worker (a connection with heartbeats and
  attempt numbers) nor the simulator's (a simulated machine whose services
  really load): the three have different owners of the truth, and this one
  changes only through the policy's own events, so that its decisions are a
  pure function of them;
* :class:`EnvState` -- one environment: where it lives, its actions there or on their way;
* :class:`ServiceReplica` -- a service resident (or loading) on a worker;
* :class:`PlacementQueue` -- waiting actions that need the same thing;
* :class:`KindLoad` -- per action kind: capacity and demand;
* :class:`OfferedLoad` -- the work submitted lately, per resource class;
* :class:`Tally` -- every count the policy keeps by hand, changed in one place
  by the four transitions of an action (:meth:`Tally.submitted`,
  :meth:`Tally.started`, :meth:`Tally.withdrawn`, :meth:`Tally.ended`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Final

from ..actions import ActionSpec
from ..resources import CPU, GPU, ResourceClass, WorkerInfo, WorkerShape
from .base import light_capacity
from .predict import ClassStats

__all__ = ["ActionState", "EnvState", "Need", "ActionRecord", "ServiceReplica", "WorkerRecord", "PlacementQueue",
           "ShapeLimit", "KindLoad", "Tally", "OfferedLoad", "water_level", "INF", "PENDING", "RUNNING", "GONE"]

INF: Final = float("inf")


class ActionState(Enum):
    PENDING = "pending"
    RUNNING = "running"
    GONE = "gone"


# Final: C constants in the native build, where a plain module name is a dictionary look-up
PENDING: Final = ActionState.PENDING
RUNNING: Final = ActionState.RUNNING
GONE: Final = ActionState.GONE


class EnvState:
    """One environment as the policy tracks it: where it lives, and its actions there or on their way.

    One record per environment, reached from its actions' records, rather than a map per fact
    keyed by name: an action's life then looks its environment up once (at submit), not at
    every step (maps of 100,000 names are what a large run spends its time in)."""

    __slots__ = ("name", "host", "first", "wait", "idle", "busy", "live", "pinned")

    def __init__(self, name: str):
        self.name = name
        self.host: WorkerRecord | None = None       # the worker it lives on (the first of its actions to start decides)
        self.first: ActionRecord | None = None      # with no host: its pending action routed first ...
        self.wait: list[ActionRecord] = []          # ... and the later ones, held until that one starts
        self.idle = -1.0                            # when its last action ended (-1: running, or not known)
        self.busy = 0                               # its actions running
        self.live = 0                               # its actions pending or running
        self.pinned = False                         # it keeps live processes on its host: never moved off it


class Need:
    """What a placement must find free on a worker: cores, memory, GPU memory, or a replica of ``service``.

    Its own record, not the :class:`~tangram_hpc.actions.Demand`: the placement loops read these
    fields many times per action, and a record compiled with the policy reads them directly."""

    __slots__ = ("min_cores", "mem_mb", "gpu_mem_mb", "service")

    def __init__(self, min_cores: int, mem_mb: int, gpu_mem_mb: int, service: str | None):
        self.min_cores = min_cores
        self.mem_mb = mem_mb
        self.gpu_mem_mb = gpu_mem_mb
        self.service = service


class ActionRecord(Need):
    """One submitted action as the policy tracks it (its spec's hot fields copied: see :class:`Need`)."""

    __slots__ = ("spec", "aid", "kind", "envst", "max_cores", "submit", "seq", "key", "state", "worker", "cores",
                 "started", "load_wait", "queue", "elastic", "light", "load", "expect", "ends_at", "d1", "p",
                 "tail", "work", "target", "stats")

    def __init__(self, spec: ActionSpec, submit: float, seq: int, load: "KindLoad"):
        d = spec.demand
        super().__init__(d.min_cores, d.mem_mb, d.gpu_mem_mb, d.service)
        self.spec = spec
        self.aid = spec.id
        self.kind = spec.kind
        self.envst: EnvState | None = None      # its environment's record (set at submit)
        self.max_cores = d.max_cores
        self.submit = submit
        self.seq = seq
        self.key = 0.0
        self.state = PENDING
        self.worker: WorkerRecord | None = None
        self.cores = 0
        self.started = 0.0
        self.load_wait = 0.0        # seconds it had to wait for its service to load
        self.queue: PlacementQueue | None = None
        # a zero-core ("light") action binds no core: it is pipelined, never grown
        self.light = d.min_cores == 0
        self.elastic = not self.light and d.max_cores > d.min_cores
        self.load = load            # the counters of its kind
        self.expect = 0.0           # predicted run time at its granted cores (set when it starts)
        self.ends_at = 0.0          # started + expect: when it is predicted to end
        self.d1 = 1.0               # predicted one-core duration and parallel fraction, at submit
        self.p = 0.0
        self.tail = 1.0             # expected duration / median duration of its class
        self.work = 0.0             # predicted core-seconds at min_cores
        self.target = 0             # the cores an elastic action waited for (0: none)
        self.stats: ClassStats | None = None    # its class's learned figures, looked up once (at submit)

    def time_at(self, cores: int) -> float:
        """Predicted run time at ``cores`` (Amdahl with the estimate made at submit)."""
        p = self.p
        return self.d1 * ((1.0 - p) + p / (cores if cores > 1 else 1))


class ServiceReplica:
    """A service resident, or loading until ``ready_at``, on one worker."""

    __slots__ = ("mem", "running", "last_used", "ready_at")

    def __init__(self, mem: int, ready_at: float):
        self.mem = mem
        self.running = 0
        self.last_used = ready_at
        self.ready_at = ready_at


class WorkerRecord:
    """The policy's belief about one registered worker (see the module docstring for why it is its own)."""

    __slots__ = ("id", "info", "seq", "cores", "free_cores", "mem", "free_mem", "gpu_mem",
                 "gpu_used", "services", "draining", "running", "ends", "envs", "kinds",
                 "listed", "env_queues", "env_live", "env_work", "env_mem", "light", "light_cap", "rigid_env", "rigid_avg", "rigid_at")

    def __init__(self, info: WorkerInfo, seq: int):
        self.id = info.id
        self.info = info
        self.seq = seq
        self.cores = info.cores
        self.free_cores = info.cores
        self.mem = info.mem_mb if info.mem_mb > 0 else INF
        self.free_mem = self.mem
        self.gpu_mem = info.gpu_mem_mb
        self.gpu_used = 0
        self.services: dict[str, ServiceReplica] = {}
        self.draining = False
        self.running: dict[str, ActionRecord] = {}
        self.ends: tuple[float, list] | None = None   # (now, when its running actions free their cores)
        self.envs: set[str] = set()
        self.kinds = info.kinds
        self.listed: set[int] = set()        # the free-core counts of its entries in the free-capacity index
        # its environments' waiting actions, one queue per demand (as the shared queues: a head that
        # cannot start -- no memory for it, too few cores -- holds back only what needs the same),
        # and their count, predicted core-seconds and memory over all of them
        self.env_queues: dict[tuple, PlacementQueue] = {}
        self.env_live = 0
        self.env_work = 0.0
        self.env_mem = 0
        self.light = 0                       # zero-core actions it holds
        self.light_cap = light_capacity(info)
        # cores its environments' fixed-size actions use: now, and averaged over time (see grants.reserve)
        self.rigid_env = 0
        self.rigid_avg = 0.0
        self.rigid_at = 0.0


class PlacementQueue:
    """Waiting actions that need the same thing; ``live`` of its heap entries are current.

    A shared queue (``worker`` None) is kept under ``key`` in the policy's table while
    anything waits in it.
    """

    __slots__ = ("idx", "heap", "kind", "service", "min_cores", "mem", "gpu_mem", "worker", "live", "work", "key")

    def __init__(self, idx: int, kind: str, service: str | None, min_cores: int, mem: int,
                 gpu_mem: int, worker: WorkerRecord | None = None, key: tuple = ()):
        self.idx = idx
        self.key = key
        self.heap: list = []
        self.kind = kind
        self.service = service
        self.min_cores = min_cores
        self.mem = mem
        self.gpu_mem = gpu_mem
        self.worker = worker
        self.live = 0
        self.work = 0.0             # predicted core-seconds of the live entries, at min_cores


@dataclass(slots=True, frozen=True)
class ShapeLimit:
    """The largest thing one worker of some shape can give an action.

    ``gpu_mem_mb`` is the total over the worker's GPUs, ``None`` when a GPU
    shape does not say its memory (it may host any service).
    """

    cores: int
    mem_mb: int = 0                  # 0: not limited
    gpu_mem_mb: int | None = 0
    serves: bool = False             # a worker of services (GPUs, or a memory budget standing in)

    def __reduce__(self) -> tuple:      # see Launch.__reduce__
        return (ShapeLimit, (self.cores, self.mem_mb, self.gpu_mem_mb, self.serves))

    @classmethod
    def of(cls, shape: WorkerShape) -> "ShapeLimit":
        if shape.gpus and shape.gpu_mem_mb:
            gpu: int | None = shape.gpus * shape.gpu_mem_mb
        elif shape.gpus:
            gpu = None                   # GPUs of unknown memory (a Slurm gres request)
        else:
            gpu = shape.gpu_mem_mb       # a memory budget standing in for a GPU (services on the CPU)
        return cls(shape.cores, shape.mem_mb, gpu, bool(shape.gpus or shape.gpu_mem_mb))

    def holds(self, min_cores: int, mem_mb: int, gpu_mem_mb: int) -> bool:
        return (self.cores >= min_cores and (self.mem_mb == 0 or self.mem_mb >= mem_mb)
                and (self.gpu_mem_mb is None or self.gpu_mem_mb >= gpu_mem_mb))


@dataclass(slots=True)
class KindLoad:
    """Per action kind: capacity, demand, and the free-capacity index."""

    capacity: int = 0        # cores of non-draining workers serving the kind
    rigid: int = 0           # min cores of fixed-size actions in the system
    rigid_running: int = 0   # ... of those running
    elastic: int = 0         # elastic actions in the system (pending + running)
    widest: int = 0          # the largest max_cores of an elastic action seen
    by_max: dict = field(default_factory=dict)    # elastic actions in the system per max_cores
    queued: int = 0          # pending core-binding actions waiting in the kind's shared queues
    queued_work: float = 0.0  # ... and their predicted core-seconds at min_cores
    queued_mem: int = 0       # ... and the memory they need (MB)


class Tally:
    """Every count the policy keeps by hand, changed only by an action's transitions and worker changes."""

    __slots__ = ("pending", "running", "free_cores", "light_pending", "service_pending")

    def __init__(self) -> None:
        self.pending = 0            # actions waiting (placeable or not)
        self.running = 0
        self.free_cores = 0         # free cores on all workers (a quick "nothing to do" test)
        self.light_pending = 0      # waiting zero-core actions (they need no free core)
        self.service_pending: dict[str, int] = {}

    def submitted(self, rec: ActionRecord) -> None:
        self.pending += 1
        if rec.light:
            self.light_pending += 1
        svc = rec.service
        if svc:
            self.service_pending[svc] = self.service_pending.get(svc, 0) + 1
        kl = rec.load
        if rec.elastic:
            kl.elastic += 1
            m = rec.max_cores
            kl.by_max[m] = kl.by_max.get(m, 0) + 1
            if m > kl.widest:
                kl.widest = m
        else:
            kl.rigid += rec.min_cores

    def _unpend(self, rec: ActionRecord) -> None:
        self.pending -= 1
        if rec.light:
            self.light_pending -= 1
        svc = rec.service
        if svc:
            sp = self.service_pending
            n = sp[svc] - 1
            if n:
                sp[svc] = n
            else:           # the names come from clients: keep only those waited for
                del sp[svc]

    def started(self, rec: ActionRecord, w: WorkerRecord) -> None:
        self._unpend(rec)
        self.running += 1
        self.free_cores -= rec.cores
        w.free_cores -= rec.cores
        if not rec.elastic:
            rec.load.rigid_running += rec.min_cores

    def regranted(self, rec: ActionRecord, w: WorkerRecord, extra: int) -> None:
        rec.cores += extra
        self.free_cores -= extra
        w.free_cores -= extra

    def withdrawn(self, rec: ActionRecord) -> None:
        self._unpend(rec)
        self._leave(rec)

    def ended(self, rec: ActionRecord, w: WorkerRecord | None) -> None:
        self.running -= 1
        if w is not None:
            self.free_cores += rec.cores
            w.free_cores += rec.cores
        if not rec.elastic:
            rec.load.rigid_running -= rec.min_cores
        self._leave(rec)

    @staticmethod
    def _leave(rec: ActionRecord) -> None:
        kl = rec.load
        if rec.elastic:
            kl.elastic -= 1
            m = rec.max_cores
            left = kl.by_max[m] - 1
            if left:
                kl.by_max[m] = left
            else:
                del kl.by_max[m]
        else:
            kl.rigid -= rec.min_cores


class OfferedLoad:
    """Cores' worth of work submitted per second lately, per resource class (an exponentially
    decaying sum over ``window_s``): what the pool policy sizes the pool for."""

    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self._by_res: dict[ResourceClass, list[float]] = {}   # resource -> [cores, at time]

    def count(self, rec: ActionRecord, cores: int, now: float) -> None:
        """``rec`` was submitted; it would run on ``cores`` with nothing waiting."""
        res = GPU if rec.service or rec.gpu_mem_mb else CPU
        work = rec.time_at(cores) * cores / self.window_s
        r = self._by_res.get(res)
        if r is None:
            self._by_res[res] = [work, now]
        elif now - r[1] < 0.5:
            r[0] += work            # decay in half-second steps: submits come in bursts
        else:
            r[0] = r[0] * math.exp(-(now - r[1]) / self.window_s) + work
            r[1] = now

    def at(self, now: float) -> dict[ResourceClass, float]:
        return {res: r[0] * math.exp(-max(0.0, now - r[1]) / self.window_s) for res, r in self._by_res.items()}


def water_level(cores: float, by_max: dict[int, int]) -> float:
    """Fair share ``L`` with ``sum(min(max_i, L)) == cores`` over the elastic actions ``by_max``.

    Actions that cannot use the level (small ``max_cores``) leave their
    remainder to the others; ``inf`` when everybody can have its maximum.
    """
    if cores <= 0:
        return 0.0
    left = cores
    n = sum(by_max.values())
    for m in sorted(by_max):
        if n <= 0:
            break
        if m * n <= left:
            cnt = by_max[m]
            left -= m * cnt
            n -= cnt
            continue
        return left / n
    return INF
