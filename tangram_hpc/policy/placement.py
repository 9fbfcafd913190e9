"""Placement machinery shared by the action-level policies (elastic, FIFO, the pooled baselines).

The policies place the same way -- environment affinity, memory, GPU memory,
service residency, draining -- and differ only in the order they take waiting
actions (:meth:`PlacementPolicy._key`), how many cores they grant
(:meth:`PlacementPolicy._grant`) and when they load another replica of a GPU
service (:meth:`PlacementPolicy._should_load`).

Records.  The policy's state is a handful of public records, so that other
policies (and the baselines in :mod:`tangram_hpc.sim.baselines`) build on them:

* :class:`ActionRecord` -- one submitted action (:class:`ActionState`
  ``PENDING -> RUNNING -> GONE``, or ``PENDING -> GONE`` when cancelled);
* :class:`WorkerRecord` -- what the policy believes about one worker: free
  cores and memory, resident service replicas, hosted environments.  It is not
  the coordinator's record of the worker (a connection with heartbeats and
  attempt numbers) nor the simulator's (a simulated machine whose services
  really load): the three have different owners of the truth, and this one
  changes only through the policy's own events, so that its decisions are a
  pure function of them;
* :class:`ServiceReplica` -- a service resident (or loading) on a worker;
* :class:`PlacementQueue` -- waiting actions that need the same thing;
* :class:`Tally` -- every count the policy keeps by hand, changed in one place
  by the four transitions of an action (:meth:`Tally.submitted`,
  :meth:`Tally.started`, :meth:`Tally.withdrawn`, :meth:`Tally.ended`).

Cost model.  Waiting actions never get scanned one by one.  They sit in
queues, each a heap of ``(key, seq, record)``:

* a *bucket* per placement class ``(kind, min_cores, mem, per-action GPU memory)``
  for actions that may go to any worker serving their kind;
* a *service queue* per ``(kind, service, min_cores, mem)`` for reward calls;
* an *env queue* per worker for actions whose environment lives there.

All actions of a queue need the same thing (env queues: the same worker), so
when a queue's head cannot be placed none of it can, and the queue is not
looked at again until something it could use changes (a worker of its kind
frees capacity or joins, a replica of its service frees a slot, an action
joins it): such queues are *armed*.  :meth:`schedule` merges the heads of
armed queues in one small heap and places them in key order, so a call costs
``O(A + k log(A + W))`` for ``A`` armed queues, ``W`` workers and ``k``
starts -- independent of how many actions wait.  Free capacity is a max-heap
of workers by free cores per set of kinds served, with lazy invalidation (an
entry is valid while its count is the worker's free cores): capacity that
rises is pushed at once unless the worker has an entry at that count already,
capacity that falls is refreshed when the entry is read, so the index always
overstates and a search may stop at the first entry too small.  A worker
whose free cores go up and down between a few counts (an action ends, the
next starts) so pushes nothing most of the time.

Cores are granted in two phases.  Every start of a :meth:`schedule` call first
takes ``min_cores``; once everything placeable has started, elastic starts
grow to their grant (:meth:`_grant`), which sees what is still waiting
(:meth:`waiting_for`).  So the cores the waiting work could use are not handed
out before it had its chance.

Moving environments.  An environment pins its actions to one worker, so a
worker whose cores are all taken makes them wait while other workers idle.
With ``env_move_s`` set, when the head of a worker's env queue cannot start
there the policy compares its predicted finish there (the wait for cores,
from the running actions' predicted ends, plus its run time) with moving the
environment to the worker with the most free cores (the move's cost plus its
run time there), and asks for the move when that is sooner
(:meth:`env_moves`).  Moving is cheaper still while nobody waits for the
environment: when an action ends on a crowded worker (its own queue has
actions waiting for cores, or it could not give the kind's widest elastic
action its grant), its environment is moved off while its agent thinks, if
fewer than ``REBALANCE_EARLY_SHARE`` of the next actions would come before the
move is done (think times, the gaps between an environment's actions, learned
as lognormal: they are long-tailed, and a mean says too little) and another
worker has clearly more free cores.  Only an environment with nothing running
is moved.  The driver carries a move out
like a drain does for one environment: it takes the environment's waiting
actions back, has the holder save it, calls :meth:`close_env`, and submits
them again once it is saved; the next worker restores it.
:meth:`observe_env_move` keeps the cost estimate honest.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from enum import Enum
from statistics import NormalDist
from typing import ClassVar, Final, Iterable, Mapping, Sequence

from ..actions import ActionSpec, Demand
from ..resources import CPU, GPU, ResourceClass, ServiceInfo, WorkerInfo, WorkerShape
from .base import Assignment, SchedulingPolicy, light_capacity, mypyc_attr
from .predict import ClassStats, Predictor
from .residency import Resident, choose_victims

__all__ = ["ActionState", "ActionRecord", "ServiceReplica", "WorkerRecord", "PlacementQueue", "ShapeLimit",
           "KindLoad", "Tally", "PlacementPolicy", "water_level"]

_INF: Final = float("inf")
_SEQ_BITS: Final = 32
_SEQ_MASK: Final = (1 << _SEQ_BITS) - 1


def _index_entry(free: int, seq: int) -> int:
    """A free-capacity index entry: most free cores first, then the older worker.  One int, not a
    tuple: the heap compares ints, and an int is no object the cyclic collector tracks.  Read back
    as ``-(e >> _SEQ_BITS)`` (free cores) and ``e & _SEQ_MASK`` (the worker's seq)."""
    return -(free << _SEQ_BITS) | seq


class ActionState(Enum):
    PENDING = "pending"
    RUNNING = "running"
    GONE = "gone"


# Final: C constants in the native build, where a plain module name is a dictionary look-up
_PENDING: Final = ActionState.PENDING
_RUNNING: Final = ActionState.RUNNING
_GONE: Final = ActionState.GONE


class EnvState:
    """One environment as the policy tracks it: where it lives, and its actions there or on their way.

    One record per environment, reached from its actions' records, rather than a map per fact
    keyed by name: an action's life then looks its environment up once (at submit), not at
    every step (maps of 100,000 names are what a large run spends its time in)."""

    __slots__ = ("name", "host", "first", "wait", "idle", "busy", "live")

    def __init__(self, name: str):
        self.name = name
        self.host: WorkerRecord | None = None       # the worker it lives on (the first of its actions to start decides)
        self.first: ActionRecord | None = None      # with no host: its pending action routed first ...
        self.wait: list[ActionRecord] = []          # ... and the later ones, held until that one starts
        self.idle = -1.0                            # when its last action ended (-1: running, or not known)
        self.busy = 0                               # its actions running
        self.live = 0                               # its actions pending or running


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
        self.state = _PENDING
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
                 "listed", "env_queue", "light", "light_cap", "rigid_env", "rigid_avg", "rigid_at")

    def __init__(self, info: WorkerInfo, seq: int):
        self.id = info.id
        self.info = info
        self.seq = seq
        self.cores = info.cores
        self.free_cores = info.cores
        self.mem = info.mem_mb if info.mem_mb > 0 else _INF
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
        self.env_queue: PlacementQueue | None = None
        self.light = 0                       # zero-core actions it holds
        self.light_cap = light_capacity(info)
        # cores its environments' fixed-size actions use: now, and averaged over time (see _reserve)
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


@mypyc_attr(allow_interpreted_subclasses=True)
class PlacementPolicy(SchedulingPolicy):
    """Common machinery; see the module docstring.  Subclasses set the order and the grant."""

    #: Core-bound actions whose class is learned to take less than this run pipelined (see submit).
    PIPELINE_BELOW_S: ClassVar[float] = 0.001
    #: Services the run did not declare whose numbers are kept while idle; past this many the idle
    #: ones are forgotten (see _forget_idle_services).
    MAX_UNDECLARED_SERVICES: ClassVar[int] = 1024
    #: An environment leaves a crowded worker only for one with at least this many more free cores.
    REBALANCE_MARGIN_CORES: ClassVar[int] = 8
    #: ... and, while its agent thinks, only if fewer than this share of the next actions would come
    #: before the move is done (think times learned as lognormal).
    REBALANCE_EARLY_SHARE: ClassVar[float] = 0.15
    #: The spread (variance of log seconds) assumed for think times until gaps are seen.
    THINK_PRIOR_VAR: ClassVar[float] = 0.5
    #: Time constant (seconds) of a worker's average of the cores its environments' fixed-size actions use.
    RIGID_WINDOW_S: ClassVar[float] = 60.0
    #: The fewest cores a worker keeps out of elastic grants for its environments' fixed-size actions,
    #: once they use any (see _reserve).
    RIGID_RESERVE_CORES: ClassVar[int] = 1

    def __init__(self, predictor: Predictor | None = None, *, shapes: Sequence[WorkerShape] = (),
                 services: Mapping[str, ServiceInfo] | None = None, pipeline_below_s: float | None = None,
                 env_move_s: float | None = None):
        if env_move_s is not None and env_move_s < 0:
            raise ValueError("env_move_s must be >= 0 (or None: environments never move)")
        self.predictor = predictor if predictor is not None else Predictor()
        #: predicted seconds to move an environment (save, restore); None: environments stay put
        self.env_move_s = env_move_s
        self._moves: list[str] = []
        # the gaps between an environment's actions (its agent's think time): [mean, variance] of their
        # logs and how many were seen; and the gap that only REBALANCE_EARLY_SHARE of them are under
        self._think: list[float] | None = None
        self._quick_think_s: float | None = None
        self._early_z = NormalDist().inv_cdf(self.REBALANCE_EARLY_SHARE)
        self.pipeline_below_s = self.PIPELINE_BELOW_S if pipeline_below_s is None else pipeline_below_s
        self.tally = Tally()
        self._recs: dict[str, ActionRecord] = {}
        self._waiting: dict[str, ActionRecord] = {}    # the pending ones
        self._workers: dict[str, WorkerRecord] = {}
        self._queues: dict[tuple, PlacementQueue] = {}
        self._armed: dict[int, PlacementQueue] = {}     # queues whose head may be placeable now
        self._shared: dict[str, dict[int, PlacementQueue]] = {}   # kind -> its non-env queues with live entries
        self._kinds: dict[str, KindLoad] = {}
        # free-capacity index: per set of kinds served, a heap of entries (_index_entry)
        self._index: dict[frozenset[str], list[int]] = {}
        self._kind_index: dict[str, list[list[int]]] = {}    # kind -> the heaps of the workers serving it
        self._by_seq: dict[int, WorkerRecord] = {}          # the registered workers by seq
        self._envs: dict[str, EnvState] = {}     # environments with a host, a live action or a known idle time
        self._services: dict[str, ServiceInfo] = {}
        self._declared: set[str] = set()              # the run declared their size (it stays; all are in _services)
        self._undeclared_cap = self.MAX_UNDECLARED_SERVICES   # see _forget_idle_services
        self._svc_replicas: dict[str, dict[str, WorkerRecord]] = {}
        self._svc_step: dict[str, int] = {}          # service -> last RL step that called it
        self._step = 0                                # highest RL step seen
        self._step_seen = False
        self._seq = 0
        self._wseq = 0
        self._qseq = 0
        self._limits: tuple[ShapeLimit, ...] = ()
        self._hosted: frozenset[str] | None = None
        self._unplaceable: dict[str, tuple[ActionRecord, str]] = {}
        # (kind, id(demand)) and (kind, demand) -> (the demand, why it fits nothing (None: fits)).
        # By identity first: a frozen dataclass hashes in interpreted code, and the simulator's
        # actions of a class share one Demand (the entry holds it, so its id is not reused while
        # the entry stands); by value for a client's actions, which each bring their own.
        self._fit_memo: dict[tuple, tuple[Demand, str | None]] = {}
        self._heads: list | None = None
        self._grow: list[tuple[ActionRecord, WorkerRecord]] = []
        self.load_window_s = 60.0
        self._offered: dict[ResourceClass, list[float]] = {}   # resource -> [cores, at time]
        if services:
            self.set_services(services)
        self.set_shapes(shapes)

    # -- configuration ---------------------------------------------------------
    def set_shapes(self, shapes: Iterable[WorkerShape | ShapeLimit], hosted: Iterable[str] | None = None) -> None:
        """The worker shapes the pool can ever provide; actions larger than all are unplaceable.

        An action is unplaceable when it fits neither any of these shapes nor
        any registered worker.  With no shapes configured nothing is declared
        unplaceable (the driver may add workers of any size).  ``hosted``: the
        services the pool's service workers are started with (None: any), so a
        call of another service, or of any when no shape serves, is unplaceable.
        """
        self._limits = tuple(s if isinstance(s, ShapeLimit) else ShapeLimit.of(s) for s in shapes)
        self._hosted = None if hosted is None else frozenset(hosted)
        self._fit_memo.clear()
        for rec in list(self._recs.values()):
            if rec.state is not _PENDING:
                continue
            why = self._too_big(rec.spec)
            aid = rec.aid
            if why and aid not in self._unplaceable:
                self._set_aside(rec, why)
            elif not why and aid in self._unplaceable:
                del self._unplaceable[aid]
                if rec.service:
                    self._note_service(rec)
                self._route(rec)

    def set_services(self, services: Mapping[str, ServiceInfo]) -> None:
        """The reward-model services of the run: size, batch limit, known load time.

        Workers load the services they are configured with when they start
        (``WorkerInfo.services``); knowing the sizes, the policy counts those
        loads from the moment a worker registers.
        """
        self._services.update(services)
        self._declared.update(services)
        self._fit_memo.clear()          # a service's size decides where its calls fit
        for name, s in services.items():
            if s.load_s is not None:
                self.predictor.seed_load_time(name, s.load_s)

    def _set_aside(self, rec: ActionRecord, why: str) -> None:
        """Hold a pending action outside every queue until the driver cancels it."""
        es = rec.envst
        if es is not None and es.first is rec:
            self._release_first(es)
        elif es is not None and rec.queue is None and rec in es.wait:
            es.wait.remove(rec)
        self._unqueue(rec)
        self._unplaceable[rec.aid] = (rec, why)

    def _release_first(self, es: EnvState) -> None:
        """``es``'s first action no longer holds the others back (it started, or left): route them."""
        es.first = None
        held, es.wait = es.wait, []
        for r in held:
            self._route(r)

    def _env_state(self, env: str) -> EnvState:
        es = self._envs.get(env)
        if es is None:
            es = self._envs[env] = EnvState(env)
        return es

    def _forget_env(self, es: EnvState) -> None:
        """Drop ``es`` once nothing refers to it: no host, no action of it live, no idle time kept."""
        if es.live == 0 and es.host is None and es.idle < 0 and self._envs.get(es.name) is es:
            del self._envs[es.name]

    def _too_big(self, spec: ActionSpec) -> str | None:
        if not self._limits:
            return None
        d = spec.demand
        memo = self._fit_memo
        key = (spec.kind, id(d))
        hit = memo.get(key)
        if hit is not None and hit[0] is d:
            return hit[1]
        if len(memo) >= 4096:     # clients may send any number of distinct demands
            memo.clear()
        by_value = (spec.kind, d)
        hit = memo.get(by_value)
        if hit is None:
            hit = memo[by_value] = (d, self._too_big_now(spec))
        memo[key] = (d, hit[1])
        return hit[1]

    def _too_big_now(self, spec: ActionSpec) -> str | None:
        d = spec.demand
        svc = d.service
        hosted = self._hosted
        gpu_mem = d.gpu_mem_mb
        info = self._services.get(svc) if svc else None
        if info is not None and info.gpu_mem_mb > gpu_mem:
            # where it cannot load, it cannot run: its declared size (kept, see submit), else the
            # size its calls gave it
            gpu_mem = info.gpu_mem_mb
        for lim in self._limits:
            if lim.holds(d.min_cores, d.mem_mb, gpu_mem) and (
                    not svc or lim.serves and (hosted is None or svc in hosted)):
                return None
        for w in self._workers.values():    # a registered worker larger than the shapes counts too
            if (w.cores >= d.min_cores and w.mem >= d.mem_mb and w.gpu_mem >= gpu_mem
                    and spec.kind in w.kinds and (not svc or self._can_host(w, svc))):
                return None
        if svc and not any(lim.serves for lim in self._limits):
            return f"service {svc!r}: the pool starts no service workers and no registered worker hosts it"
        if svc and hosted is not None and svc not in hosted:
            return f"service {svc!r} is hosted by no worker (the run's services: {', '.join(sorted(hosted)) or 'none'})"
        big = max(self._limits, key=lambda s: (s.cores, s.mem_mb, s.gpu_mem_mb or 0))
        gpu = "unlimited" if big.gpu_mem_mb is None else big.gpu_mem_mb
        if gpu_mem > d.gpu_mem_mb:
            most = max((lim.gpu_mem_mb or 0 for lim in self._limits if lim.serves), default=0)
            return (f"service {svc!r} needs {gpu_mem} MB of (GPU) memory; the largest service worker has "
                    f"{most} MB")
        return (f"demand min_cores={d.min_cores} mem_mb={d.mem_mb} gpu_mem_mb={d.gpu_mem_mb} exceeds "
                f"every worker shape (largest: cores={big.cores} mem_mb={big.mem_mb or 'unlimited'} "
                f"gpu_mem_mb={gpu})")

    # -- hooks -------------------------------------------------------------------
    def _key(self, rec: ActionRecord) -> float:
        raise NotImplementedError

    def _grant(self, rec: ActionRecord, w: WorkerRecord) -> int:
        """Cores for an elastic action that starts on ``w`` when nothing else waits (``min_cores`` there)."""
        return rec.min_cores

    def _should_load(self, rec: ActionRecord, q: PlacementQueue, now: float) -> bool:
        raise NotImplementedError

    # -- workers -----------------------------------------------------------------
    def _kind(self, kind: str) -> KindLoad:
        kl = self._kinds.get(kind)
        if kl is None:
            kl = self._kinds[kind] = KindLoad()
        return kl

    def add_worker(self, info: WorkerInfo, now: float) -> None:
        if info.id in self._workers:
            raise ValueError(f"worker {info.id} already added")
        self._wseq += 1
        w = WorkerRecord(info, self._wseq)
        self._workers[w.id] = w
        self._by_seq[w.seq] = w
        self._fit_memo.clear()          # a worker larger than the shapes makes more fit
        self.tally.free_cores += w.free_cores
        for k in w.kinds:
            self._kind(k).capacity += w.cores
        for name, s in self._services.items():   # the worker preloads what it is configured with
            if name in info.services and w.gpu_mem - w.gpu_used >= s.gpu_mem_mb:
                self._make_resident(w, name, s.gpu_mem_mb, now + self.predictor.load_time(name))
        self._touch(w)

    def remove_worker(self, worker_id: str, now: float) -> list[str]:
        w = self._workers.pop(worker_id, None)
        if w is None:
            return []
        del self._by_seq[w.seq]
        self._fit_memo.clear()
        lost = list(w.running)
        for rec in w.running.values():
            self._end_running(rec, now)
            self.predictor.observe(rec.spec, None, rec.cores, now, rec.stats)
        w.running.clear()
        self.tally.free_cores -= w.free_cores
        if not w.draining:
            for k in w.kinds:
                self._kind(k).capacity -= w.cores
        for svc in w.services:
            self._drop_replica(svc, w)
        for env in w.envs:
            es = self._envs.get(env)
            if es is not None and es.host is w:
                es.host = None
                self._forget_env(es)
        w.envs.clear()
        q = w.env_queue
        if q is not None:
            self._armed.pop(q.idx, None)
            stranded = [e[2] for e in sorted(q.heap) if e[2].state is _PENDING and e[2].queue is q]
            q.heap.clear()
            for rec in stranded:    # their environment is gone: start over elsewhere
                self._unqueue(rec)
                self._route(rec)
        return lost

    def set_draining(self, worker_id: str, draining: bool) -> None:
        w = self._workers.get(worker_id)
        if w is None or w.draining == draining:
            return
        w.draining = draining
        sign = -1 if draining else 1
        for k in w.kinds:
            self._kind(k).capacity += sign * w.cores
        self._touch(w)

    def update_worker(self, worker_id: str, *, services: frozenset[str] | None = None,
                      envs: frozenset[str] | None = None, now: float = 0.0) -> None:
        """Worker-reported state.

        ``services``: the services resident on the worker now.  They are ready
        from now on; a resident one not reported (and idle) was evicted; one
        the policy counts as loading stays until its load is due.
        """
        w = self._workers.get(worker_id)
        if w is None:
            return
        if services is not None:
            for svc in services:
                st = w.services.get(svc)
                if st is None:
                    self._make_resident(w, svc, self._service_mem(svc, 0), now)
                elif st.ready_at > now:
                    st.ready_at = now
            for svc in [s for s, st in w.services.items()
                        if s not in services and st.running == 0 and st.ready_at <= now]:
                self._evict(w, svc)
            self._touch(w)
        if envs is not None:
            for env in envs:
                if env not in w.envs:
                    es = self._env_state(env)
                    if es.host is not None:
                        es.host.envs.discard(env)
                    es.host = w
                    w.envs.add(env)
            for env in [e for e in w.envs if e not in envs]:
                w.envs.discard(env)
                gone = self._envs.get(env)
                if gone is not None and gone.host is w:
                    gone.host = None
                    self._forget_env(gone)

    def _touch(self, w: WorkerRecord) -> None:
        """A worker gained capacity (or joined): re-index it and arm the queues it may serve.

        (Capacity that falls needs nothing: the worker's entries above its free cores are stale,
        and overstate it until they are read.)
        """
        q = w.env_queue
        if q is not None and q.live:
            self._armed[q.idx] = q
        if w.draining:
            return
        if w.free_cores not in w.listed:
            self._list(w)
        for k in w.kinds:
            shared = self._shared.get(k)
            if shared:
                self._armed.update(shared)

    @classmethod
    def _rigid_change(cls, w: WorkerRecord, delta: int, now: float) -> None:
        """The cores ``w``'s environments' fixed-size actions use change by ``delta`` at ``now``
        (their time average follows the use until now first)."""
        dt = now - w.rigid_at
        if dt > 0:
            w.rigid_avg += (1.0 - math.exp(-dt / cls.RIGID_WINDOW_S)) * (w.rigid_env - w.rigid_avg)
            w.rigid_at = now
        w.rigid_env += delta

    @classmethod
    def _reserve(cls, w: WorkerRecord, now: float) -> int:
        """Free cores an elastic grant leaves on ``w`` for its environments' fixed-size actions.

        Grants are final, so the cores a long parallel action takes are gone for
        its whole run; a one-core command of an environment ``w`` hosts that then
        finds no free core waits for one, or for its environment to move.  So a
        worker whose environments' fixed-size actions kept half a core or more
        busy lately keeps some out of elastic grants: that costs a wide action a
        few per cent of its run, while the command it spares a wait is often
        shorter than the wait.  How many: the commands come at random, so the
        cores they use swing around their average by about its square root
        (a Poisson count's spread), and that is the margin kept, one core at
        least.  (Holding back their whole average use starves the parallel
        actions of a worker crowded with short commands; one core alone is
        taken by the first of a burst of commands on such a worker, and the
        next waits.)  At most an eighth of the worker: a small one keeps none.
        """
        most = w.cores >> 3
        if most < cls.RIGID_RESERVE_CORES:
            return 0
        cls._rigid_change(w, 0, now)        # the average brought up to now
        avg = w.rigid_avg
        if avg < 0.5:
            return 0
        return min(most, max(cls.RIGID_RESERVE_CORES, int(math.sqrt(avg) + 0.5)))

    def _list(self, w: WorkerRecord) -> None:
        """Index the worker's current free cores under the kinds it serves (unless an entry has them)."""
        free = w.free_cores
        if free in w.listed:
            return
        heap = self._index.get(w.kinds)
        if heap is None:
            heap = self._index[w.kinds] = []
            for k in w.kinds:
                self._kind_index.setdefault(k, []).append(heap)
        if len(heap) > 4 * len(self._workers) + 64:      # mostly stale entries: rebuild
            heap.clear()
            for o in self._workers.values():
                if o.kinds == w.kinds:
                    o.listed.clear()
                    if not o.draining and o is not w:
                        heap.append(_index_entry(o.free_cores, o.seq))
                        o.listed.add(o.free_cores)
            heapq.heapify(heap)
        heapq.heappush(heap, _index_entry(free, w.seq))
        w.listed.add(free)

    # -- residency ---------------------------------------------------------------
    def _service_mem(self, svc: str, default: int) -> int:
        s = self._services.get(svc)
        return s.gpu_mem_mb if s is not None else default

    def _make_resident(self, w: WorkerRecord, svc: str, mem: int, ready_at: float) -> ServiceReplica:
        st = ServiceReplica(mem, ready_at)
        w.services[svc] = st
        w.gpu_used += mem
        self._svc_replicas.setdefault(svc, {})[w.id] = w
        return st

    def _evict(self, w: WorkerRecord, svc: str) -> None:
        st = w.services.pop(svc)
        w.gpu_used -= st.mem
        self._drop_replica(svc, w)

    def _drop_replica(self, svc: str, w: WorkerRecord) -> None:
        reps = self._svc_replicas.get(svc)
        if reps is not None:
            reps.pop(w.id, None)
            if not reps:            # a service no worker holds keeps no entry (see _forget_idle_services)
                del self._svc_replicas[svc]

    def _victims(self, w: WorkerRecord, need: int, now: float) -> list[str] | None:
        """What the worker's service manager would evict to fit ``need`` MB (the shared rule)."""
        free = w.gpu_mem - w.gpu_used
        if free >= need:
            return []
        pending = self.tally.service_pending
        residents = [Resident(s, st.mem, pending.get(s, 0), now - st.last_used, self.predictor.load_time(s), 0.0)
                     for s, st in w.services.items() if st.running == 0 and st.ready_at <= now]
        return choose_victims(residents, need, free)

    def _needed_soon(self, svc: str) -> bool:
        """A service somebody waits for, or one this or the previous RL step called (its step's tail will)."""
        return self.tally.service_pending.get(svc, 0) > 0 or self._svc_step.get(svc, -10) >= self._step - 1

    # -- submission --------------------------------------------------------------
    def submit(self, action: ActionSpec, now: float) -> None:
        aid = action.id
        old = self._recs.get(aid)
        if old is not None and old.state is not _GONE:
            raise ValueError(f"action {aid} is already pending or running")
        self._seq += 1
        d = action.demand
        if (d.min_cores and self.pipeline_below_s and action.env is None and not (d.mem_mb or d.gpu_mem_mb or d.service)
                and self.predictor.is_tiny(action, self.pipeline_below_s)):
            action = _pipelined(action)
        rec = ActionRecord(action, now, self._seq, self._kind(action.kind))
        self._recs[aid] = rec
        self._waiting[aid] = rec
        if action.env is not None:
            es = rec.envst = self._env_state(action.env)
            es.live += 1
            if es.idle >= 0:
                if self.env_move_s is not None:     # the gap between an environment's actions: its agent's think time
                    self._learn_think(now - es.idle)
                es.idle = -1.0
        st = rec.stats = self.predictor.class_stats(action)
        rec.d1, rec.p, rec.tail = self.predictor.estimate(action, st)
        if not rec.light:
            rec.work = rec.time_at(rec.min_cores) * rec.min_cores
        rec.key = self._key(rec)
        step = action.step
        if step is not None:
            self._step_seen = True
            if step > self._step:
                self._step = step
        why = self._too_big(action)
        if rec.service and (why is None or rec.service in self._services):
            # a refused call of a service nobody knows leaves nothing behind: clients may name any
            self._note_service(rec)
            self._arrived(rec.service, now)
        self.tally.submitted(rec)
        self._count_offered(rec, now)
        if why:
            self._unplaceable[aid] = (rec, why)
            return
        self._route(rec)

    def _note_service(self, rec: ActionRecord) -> None:
        """``rec`` calls its service: learn the size of an undeclared one, and the step it was last called in."""
        svc = rec.service
        assert svc is not None
        known = self._services.get(svc)
        if known is None:
            if len(self._services) - len(self._declared) >= self._undeclared_cap:
                self._forget_idle_services()
            self._services[svc] = ServiceInfo(rec.gpu_mem_mb)
        elif rec.gpu_mem_mb > known.gpu_mem_mb and svc not in self._declared:
            # an undeclared service is as large as its calls say; a declared one keeps its size
            # (a call claiming more is refused alone, by the fit check)
            self._services[svc] = replace(known, gpu_mem_mb=rec.gpu_mem_mb)
            self._fit_memo.clear()
        step = rec.spec.step
        self._svc_step[svc] = self._step if step is None else step

    def _forget_idle_services(self) -> None:
        """Forget the undeclared services nothing waits for and no worker holds (their size, last
        step and what subclasses and the predictor keep per service): where the pool declares no
        list of services, clients may name any number of them.  A later call learns one again."""
        pending, declared = self.tally.service_pending, self._declared
        for svc in [s for s in self._services
                    if s not in declared and not pending.get(s) and s not in self._svc_replicas]:
            del self._services[svc]
            self._svc_step.pop(svc, None)
            self._forget_service(svc)
        # twice what is still in use: a table full of busy services is not scanned at every call
        self._undeclared_cap = max(self.MAX_UNDECLARED_SERVICES, 2 * (len(self._services) - len(declared)))
        self._fit_memo.clear()          # a forgotten service's learned size decided where its calls fit

    def _forget_service(self, svc: str) -> None:
        """``svc`` is forgotten (an idle undeclared one): drop what is kept for it."""
        self.predictor.forget_service(svc)

    def _arrived(self, service: str, now: float) -> None:
        """A request for ``service`` arrived (subclasses track arrival rates)."""

    def _best_cores(self, rec: ActionRecord) -> int:
        """Cores the action would run on with nothing waiting (the elastic scheduler grows it)."""
        return max(1, rec.min_cores)

    def _count_offered(self, rec: ActionRecord, now: float) -> None:
        if rec.light:
            return
        res = GPU if rec.service or rec.gpu_mem_mb else CPU
        c = self._best_cores(rec)
        work = rec.time_at(c) * c / self.load_window_s
        r = self._offered.get(res)
        if r is None:
            self._offered[res] = [work, now]
        elif now - r[1] < 0.5:
            r[0] += work            # decay in half-second steps: submits come in bursts
        else:
            r[0] = r[0] * math.exp(-(now - r[1]) / self.load_window_s) + work
            r[1] = now

    @property
    def current_step(self) -> int | None:
        return self._step if self._step_seen else None

    def offered_load(self, now: float) -> dict[ResourceClass, float]:
        return {res: r[0] * math.exp(-max(0.0, now - r[1]) / self.load_window_s)
                for res, r in self._offered.items()}

    def _route(self, rec: ActionRecord) -> None:
        """Put a pending action in the queue that matches its placement constraint."""
        es = rec.envst
        if es is not None:
            host = es.host
            if host is not None:
                q = host.env_queue
                if q is None:
                    self._qseq += 1
                    q = host.env_queue = PlacementQueue(self._qseq, rec.kind, None, 0, 0, 0, host)
                self._push(q, rec)
                return
            first = es.first
            if first is not None and first is not rec:
                es.wait.append(rec)
                return
            es.first = rec
        qk: tuple
        if rec.service:
            qk = (rec.kind, rec.service, rec.min_cores, rec.mem_mb)
            gpu = 0
        else:
            qk = (rec.kind, None, rec.min_cores, rec.mem_mb, rec.gpu_mem_mb)
            gpu = rec.gpu_mem_mb
        q = self._queues.get(qk)
        if q is None:
            self._qseq += 1
            q = self._queues[qk] = PlacementQueue(self._qseq, rec.kind, rec.service, rec.min_cores,
                                                  rec.mem_mb, gpu, key=qk)
        self._push(q, rec)

    def _push(self, q: PlacementQueue, rec: ActionRecord) -> None:
        rec.queue = q
        q.live += 1
        q.work += rec.work
        if q.worker is None:
            if q.live == 1:     # kept apart, so that a worker's every change does not look at idle queues
                shared = self._shared.get(q.kind)
                if shared is None:
                    shared = self._shared[q.kind] = {}
                shared[q.idx] = q
            if not rec.light:
                rec.load.queued += 1
                rec.load.queued_work += rec.work
        heapq.heappush(q.heap, (rec.key, rec.seq, rec))
        self._armed[q.idx] = q
        if self._heads is not None:     # routed during schedule(): eligible in this same call
            heapq.heappush(self._heads, (rec.key, rec.seq, q.idx, q))

    def _unqueue(self, rec: ActionRecord) -> None:
        """Take a record out of its queue's live count (its heap entry goes stale and is skipped)."""
        q = rec.queue
        if q is None:
            return
        q.live -= 1
        q.work -= rec.work
        if q.worker is None:
            if q.live == 0:
                # nothing waits in it: forget it, as clients may send any number of distinct
                # demands (its stale heap entries are skipped by whoever still holds it)
                del self._shared[q.kind][q.idx]
                if self._queues.get(q.key) is q:
                    del self._queues[q.key]
            if not rec.light:
                rec.load.queued -= 1
                rec.load.queued_work -= rec.work
        rec.queue = None

    def cancel(self, action_id: str) -> bool:
        rec = self._recs.get(action_id)
        if rec is None or rec.state is not _PENDING:
            return False
        self._drop_pending(rec)
        return True

    def _drop_pending(self, rec: ActionRecord) -> None:
        rec.state = _GONE
        self._recs.pop(rec.aid, None)
        del self._waiting[rec.aid]
        self.tally.withdrawn(rec)
        es = rec.envst
        if self._unplaceable.pop(rec.aid, None) is None:       # (one set aside left its environment already)
            self._unqueue(rec)
            if es is not None:
                if rec in es.wait:
                    es.wait.remove(rec)
                if es.first is rec:
                    self._release_first(es)
        if es is not None:
            es.live -= 1
            self._forget_env(es)

    # -- completion --------------------------------------------------------------
    def finished(self, action_id: str, now: float, *, ok: bool = True, run_time: float | None = None) -> None:
        rec = self._recs.pop(action_id, None)
        if rec is None:
            return
        if rec.state is not _RUNNING:
            self._recs[action_id] = rec     # a finish for an attempt no longer running: the waiting one stays
            return
        w = rec.worker
        es = rec.envst
        if es is not None and w is not None and self.env_move_s is not None:
            es.idle = now
        self._end_running(rec, now)
        if w is not None:
            del w.running[action_id]
            self._touch(w)
            if es is not None and self.env_move_s is not None:
                self._rebalance(rec.kind, es, w, now)
        spec = rec.spec
        if not ok or run_time is None:
            self.predictor.observe(spec, None, rec.cores, now, rec.stats)
        elif rec.load_wait > 0 and spec.demand.service is not None:
            warm = self.predictor.predict(spec, rec.cores)
            self.predictor.observe_load(spec.demand.service, max(0.0, run_time - warm))
            self.predictor.observe(spec, None, rec.cores, now, rec.stats)
        else:
            self.predictor.observe(spec, run_time, rec.cores, now, rec.stats)

    def _end_running(self, rec: ActionRecord, now: float) -> None:
        rec.state = _GONE
        w = rec.worker
        self.tally.ended(rec, w)
        es = rec.envst
        if es is not None:
            es.live -= 1
            if w is not None:
                es.busy -= 1
                if not rec.elastic and rec.cores:
                    self._rigid_change(w, -rec.cores, now)
            self._forget_env(es)
        if w is None:
            return
        w.ends = None
        if rec.light:
            w.light -= 1
        w.free_mem += rec.mem_mb
        if rec.service:
            st = w.services.get(rec.service)
            if st is not None:
                st.running -= 1
                st.last_used = max(st.last_used, rec.started)
        else:
            w.gpu_used -= rec.gpu_mem_mb

    # -- scheduling --------------------------------------------------------------
    def schedule(self, now: float) -> list[Assignment]:
        t = self.tally
        if t.pending == 0 or not self._armed or (t.free_cores <= 0 and t.light_pending <= 0):
            return []
        heads = []
        for q in list(self._armed.values()):
            h = q.heap
            while h and h[0][2].queue is not q:
                heapq.heappop(h)
            if not h:
                del self._armed[q.idx]
                continue
            w = q.worker
            if w is not None and w.free_cores < h[0][2].min_cores:
                del self._armed[q.idx]
                if self.env_move_s is not None:
                    self._consider_move(h[0][2], w, now)
                continue
            heads.append((h[0][0], h[0][1], q.idx, q))
        if not heads:
            return []
        heapq.heapify(heads)
        started: list[ActionRecord] = []
        self._heads = heads
        try:
            self._drain_heads(heads, now, started)
        finally:
            self._heads = None
        if self._grow:
            self._grow_grants()
        predictor = self.predictor
        out = []
        for r in started:
            w = r.worker
            assert w is not None
            predictor.started(r.spec, r.cores, now, r.stats)     # a method, not a bound one kept: a native call when compiled
            r.expect = r.time_at(r.cores)
            r.ends_at = r.started + r.expect
            w.ends = None
            out.append(Assignment(r.aid, w.id, r.cores))
        return out

    def _drain_heads(self, heads: list, now: float, started: list[ActionRecord]) -> None:
        t = self.tally
        while heads and (t.free_cores > 0 or t.light_pending > 0):
            _, _, _, q = heapq.heappop(heads)
            h = q.heap
            while h and h[0][2].queue is not q:
                heapq.heappop(h)
            if not h:
                self._armed.pop(q.idx, None)
                continue
            rec = h[0][2]
            if not self._place(rec, q, now, started):
                self._armed.pop(q.idx, None)     # until something it could use changes
                continue
            heapq.heappop(h)
            while h and h[0][2].queue is not q:
                heapq.heappop(h)
            if h:
                heapq.heappush(heads, (h[0][0], h[0][1], q.idx, q))
            else:
                self._armed.pop(q.idx, None)

    def _grow_grants(self) -> None:
        """Second phase: the elastic starts of this call grow towards their grants (:meth:`_grant`).

        Per worker, the free cores go one at a time to the start whose predicted
        run time the next core shortens most (Amdahl: ``d1 p / (c (c + 1))``), so
        a long parallel action is not left with the crumbs of shorter ones
        started in the same call.
        """
        grow, self._grow = self._grow, []
        by_worker: dict[str, list[ActionRecord]] = {}
        for rec, on in grow:
            if rec.state is _RUNNING and rec.worker is on:
                by_worker.setdefault(on.id, []).append(rec)
        for recs in by_worker.values():
            w = recs[0].worker
            assert w is not None
            if len(recs) == 1:
                rec = recs[0]
                extra = min(self._grant(rec, w), rec.max_cores) - rec.cores
                if 0 < extra <= w.free_cores:
                    self.tally.regranted(rec, w, extra)
                continue
            heap = []
            for rec in recs:
                cap = min(self._grant(rec, w), rec.max_cores)
                if cap > rec.cores:
                    # one more core than c saves d1 * p / (c (c + 1)) seconds (Amdahl)
                    scale = rec.d1 * rec.p
                    c = rec.cores
                    heap.append((-scale / (c * (c + 1)), rec.seq, rec, cap, scale))
            heapq.heapify(heap)
            keep = self._reserve(w, recs[0].started)
            while heap and w.free_cores > keep:
                _, _, rec, cap, scale = heapq.heappop(heap)
                self.tally.regranted(rec, w, 1)
                c = rec.cores
                if c < cap:
                    heapq.heappush(heap, (-scale / (c * (c + 1)), rec.seq, rec, cap, scale))

    @staticmethod
    def waiting_for(rec: ActionRecord, w: WorkerRecord) -> tuple[int, float]:
        """Core-binding actions waiting that could use ``w``'s cores, ``rec`` aside, and the seconds they take to drain.

        The kind's shared queues drain over the kind's capacity, ``w``'s own over its cores.
        """
        q = w.env_queue
        kl = rec.load
        mine = rec.queue is not None
        n = kl.queued + (q.live if q is not None else 0) - mine
        work = kl.queued_work + (q.work if q is not None else 0.0) - (rec.work if mine else 0.0)
        env_work = q.work - (rec.work if mine and rec.queue is q else 0.0) if q is not None else 0.0
        drain = (work - env_work) / max(1, kl.capacity) + env_work / max(1, w.cores)
        return n, max(0.0, drain)

    def _fits(self, w: WorkerRecord, d: Need) -> bool:
        return ((w.free_cores >= d.min_cores if d.min_cores else w.light < w.light_cap)
                and w.free_mem >= d.mem_mb
                and (d.service is not None or w.gpu_mem - w.gpu_used >= d.gpu_mem_mb))

    def _has_slot(self, w: WorkerRecord, svc: str) -> bool:
        """The service's replica on ``w`` takes another request (its batch limit)."""
        info = self._services.get(svc)
        return info is None or not info.max_batch or w.services[svc].running < info.max_batch

    def _best_worker(self, kind: str, d: Need) -> WorkerRecord | None:
        """The non-draining worker serving ``kind`` with the most free cores that fits ``d``."""
        heaps = self._kind_index.get(kind)
        if not heaps:
            return None
        if len(heaps) == 1:
            return self._top_fit(heaps[0], d)
        best = None
        for heap in heaps:
            w = self._top_fit(heap, d)
            if w is not None and (best is None or (-w.free_cores, w.seq) < (-best.free_cores, best.seq)):
                best = w
        return best

    def _top_fit(self, heap: list[int], d: Need) -> WorkerRecord | None:
        skipped: list[int] = []
        found: WorkerRecord | None = None
        by_seq = self._by_seq
        while heap:
            e = heap[0]
            listed = -(e >> _SEQ_BITS)
            w = by_seq.get(e & _SEQ_MASK)
            if w is None or w.draining:
                heapq.heappop(heap)
                if w is not None:
                    w.listed.discard(listed)
                continue
            free = w.free_cores
            if listed != free:
                heapq.heappop(heap)
                w.listed.discard(listed)
                if free not in w.listed:
                    heapq.heappush(heap, _index_entry(free, w.seq))   # refresh a fallen one
                    w.listed.add(free)
                continue
            if d.min_cores and listed < d.min_cores:
                break            # nothing below has the cores either
            if self._fits(w, d):
                found = w
                break
            skipped.append(heapq.heappop(heap))
        for e in skipped:
            heapq.heappush(heap, e)
        return found

    def _place(self, rec: ActionRecord, q: PlacementQueue, now: float, started: list[ActionRecord]) -> bool:
        w = q.worker
        if w is not None:                       # env queue: only that worker
            if rec.kind not in w.kinds or not self._fits(w, rec):
                if self.env_move_s is not None and not rec.light:
                    self._consider_move(rec, w, now)
                return False
            if (self.env_move_s is not None and rec.elastic and w.free_cores < rec.max_cores
                    and self._consider_move(rec, w, now)):
                return False
            if rec.service and not self._service_ready_on(w, rec, now):
                return False
        elif rec.service:
            w = self._service_worker(rec, q, now)
            if w is None:
                return False
        else:
            w = self._best_worker(rec.kind, rec)
            if w is None:
                return False
        if rec.elastic and not self._startable(rec, w, now):
            return False
        self._start(rec, w, now, started)
        return True

    def _startable(self, rec: ActionRecord, w: WorkerRecord, now: float) -> bool:
        """Whether an elastic action should start on ``w`` now rather than wait there for more cores."""
        return True

    @staticmethod
    def _wait_for_cores(w: WorkerRecord, need: int, now: float) -> float:
        """Expected seconds until ``need`` more cores are free on ``w`` (from its actions' predicted ends)."""
        if need <= 0:
            return 0.0
        if w.cores - w.free_cores < need:
            return _INF             # not even when all of its actions have ended
        got = 0
        for left, cores in PlacementPolicy._ends(w, now):
            got += cores
            if got >= need:
                return left
        return _INF

    @staticmethod
    def _ends(w: WorkerRecord, now: float) -> list[tuple[float, int]]:
        """(seconds until it ends, cores) of each core-binding action running on ``w``, soonest first.

        Kept until the worker's running actions (or their grants) change or the clock moves: a
        placement asks it for several core counts (the move rule, then the wait for cores).
        """
        memo = w.ends
        if memo is not None and memo[0] == now:
            return memo[1]
        ends = []
        for r in w.running.values():
            c = r.cores
            if c:
                left = r.ends_at - now
                soonest = 0.25 * r.expect
                ends.append((left if left > soonest else soonest, c))
        ends.sort()
        w.ends = (now, ends)
        return ends

    # -- moving environments -------------------------------------------------------
    def _movable(self, es: EnvState, w: WorkerRecord) -> bool:
        """The environment lives on ``w``, is not asked to move yet, and nothing runs in it (a move
        would wait for its copy to be free anyway)."""
        return es.busy == 0 and es.host is w and es.name not in self._moves

    def _consider_move(self, rec: ActionRecord, w: WorkerRecord, now: float) -> bool:
        """Ask to move ``rec``'s environment off ``w``, its host, when ``rec`` would finish sooner on
        the worker with the most free cores, the move included, than on ``w`` (now on what is free
        there, or after waiting for cores).  Returns whether it asked."""
        es = rec.envst
        if es is None or not self._movable(es, w):
            return False
        lo, free, tail = rec.min_cores, w.free_cores, rec.tail
        move_s = self.env_move_s
        assert move_s is not None           # asked only where environments move
        # its finish here: at its minimum cores after the wait for them, or (elastic) now on
        # what is free here
        here = self._wait_for_cores(w, lo - free, now) + rec.time_at(lo) * tail
        if rec.elastic and free > lo:
            here = min(here, rec.time_at(min(free, rec.max_cores)) * tail)
        # no worker can make the move pay, even at its most cores: spare the search for one
        if move_s + rec.time_at(rec.max_cores if rec.elastic else lo) * tail >= here:
            return False
        there = self._best_worker(rec.kind, rec)
        if there is None or there is w:
            return False
        c = max(lo, min(rec.max_cores, there.free_cores)) if rec.elastic else lo
        moved = move_s + rec.time_at(c) * tail
        if rec.elastic and c > free and moved < here:
            # or here on as many cores as it would get there, after the wait for them
            here = min(here, self._wait_for_cores(w, c - free, now) + rec.time_at(c) * tail)
        if moved < here:
            self._moves.append(es.name)
            return True
        return False

    def _learn_think(self, gap: float) -> None:
        """One more gap between an environment's actions: update the log-normal fit of think times."""
        y = math.log(max(gap, 1e-3))
        t = self._think
        if t is None:
            t = self._think = [y, self.THINK_PRIOR_VAR, 1.0]
        else:
            t[2] += 1.0
            a = max(0.05, 1.0 / t[2])        # the plain mean while few gaps are known, then a moving one
            d = y - t[0]
            t[0] += a * d
            t[1] = (1.0 - a) * (t[1] + a * d * d)
        self._quick_think_s = math.exp(t[0] + self._early_z * math.sqrt(t[1]))

    def _rebalance(self, kind: str, es: EnvState, w: WorkerRecord, now: float) -> None:
        """An action of environment ``es`` ended on ``w``, a crowded worker: one whose own queue has actions
        waiting for cores, or whose free cores could not give the kind's widest elastic action its
        grant (the environment's next action may be one).  Move it while its agent thinks,
        when the move is done before all but a few next actions come (think times are long-tailed:
        a quarter of the math preset's are shorter than half their mean) and another worker has
        clearly more free cores (its next action goes there)."""
        q = w.env_queue
        if (w.draining or self._quick_think_s is None or self.env_move_s is None
                or self.env_move_s >= self._quick_think_s):
            return
        if q is None or not q.live:
            need = min(w.cores, self._kinds[kind].widest)
            free = w.free_cores
            if need == 0 or free > need + self.RIGID_RESERVE_CORES or free - self._reserve(w, now) >= need:
                return          # roomy: it can give the widest grant, the core for commands aside
        if not self._movable(es, w):
            return
        there = self._best_worker(kind, _ONE_CORE)
        if there is not None and there is not w and there.free_cores >= w.free_cores + self.REBALANCE_MARGIN_CORES:
            self._moves.append(es.name)

    def env_moves(self) -> list[str]:
        out = self._moves
        if out:             # asked after every schedule(): no new list while there is nothing to move
            self._moves = []
        return out

    def observe_env_move(self, seconds: float) -> None:
        if self.env_move_s is not None and seconds >= 0:
            self.env_move_s = 0.8 * self.env_move_s + 0.2 * seconds

    @staticmethod
    def _can_host(w: WorkerRecord, svc: str) -> bool:
        """A worker that declares the services it can host takes only those; one that declares none, any."""
        hostable = w.info.services
        return not hostable or svc in hostable

    def _service_ready_on(self, w: WorkerRecord, rec: ActionRecord, now: float) -> bool:
        svc = rec.service
        assert svc is not None
        if svc in w.services:
            return self._has_slot(w, svc)
        if not self._can_host(w, svc):
            return False
        ev = self._victims(w, self._service_mem(svc, rec.gpu_mem_mb), now)
        if ev is None:
            return False
        self._load(w, rec, ev, now)
        return True

    def _service_worker(self, rec: ActionRecord, q: PlacementQueue, now: float) -> WorkerRecord | None:
        svc = rec.service
        assert svc is not None
        best = None
        reps = self._svc_replicas.get(svc)
        if reps:
            rank: tuple = ()
            for w in reps.values():
                if (not w.draining and rec.kind in w.kinds and self._fits(w, rec)
                        and self._has_slot(w, svc)):
                    r = self._replica_rank(w, svc)
                    if best is None or r < rank:
                        best, rank = w, r
            if best is not None:
                return best
        if not self._should_load(rec, q, now):
            return None
        # load a new replica where it evicts nothing needed soon, then the fewest, most free memory
        need = self._service_mem(svc, rec.gpu_mem_mb)
        choice = None
        for w in self._workers.values():
            if w.draining or w.gpu_mem < need or rec.kind not in w.kinds:
                continue
            if svc in w.services or not self._fits(w, rec) or not self._can_host(w, svc):
                continue
            ev = self._victims(w, need, now)
            if ev is None:
                continue
            waited_for = sum(1 for s in ev if self.tally.service_pending.get(s, 0) > 0)
            if waited_for:
                continue        # somebody waits for a victim: loading here would only trade places
            rank = (sum(1 for s in ev if self._needed_soon(s)), len(ev), -(w.gpu_mem - w.gpu_used),
                    -w.free_cores, w.seq)
            if choice is None or rank < choice[0]:
                choice = (rank, w, ev)
        if choice is None:
            return None
        _, w, ev = choice
        self._load(w, rec, ev, now)
        return w

    @staticmethod
    def _replica_rank(w: WorkerRecord, svc: str) -> tuple:
        """Order of preference among the replicas of ``svc`` that can take a request: ready first, least busy worker."""
        return (w.services[svc].ready_at, -w.free_cores, w.seq)

    def _load(self, w: WorkerRecord, rec: ActionRecord, evict: list[str], now: float) -> None:
        svc = rec.service
        assert svc is not None
        for s in evict:
            self._evict(w, s)
        self._make_resident(w, svc, self._service_mem(svc, rec.gpu_mem_mb),
                            now + self.predictor.load_time(svc))

    def _start(self, rec: ActionRecord, w: WorkerRecord, now: float, started: list[ActionRecord]) -> None:
        self._unqueue(rec)
        del self._waiting[rec.aid]
        rec.state = _RUNNING
        rec.worker = w
        rec.cores = rec.min_cores
        rec.started = now
        rec.ends_at = now             # until schedule() sets its expected run time
        w.ends = None
        self.tally.started(rec, w)
        if rec.light:
            w.light += 1
        w.free_mem -= rec.mem_mb
        if rec.service:
            st = w.services[rec.service]
            st.running += 1
            st.last_used = now
            if st.ready_at > now:
                rec.load_wait = st.ready_at - now
        else:
            w.gpu_used += rec.gpu_mem_mb
        w.running[rec.aid] = rec
        es = rec.envst
        if es is not None:
            if not rec.elastic and rec.cores:
                self._rigid_change(w, rec.cores, now)
            es.busy += 1
            if es.host is None:         # its first action to start: the environment lives here now
                es.host = w
                w.envs.add(es.name)
                self._release_first(es)
            elif es.first is rec:
                es.first = None
        if rec.elastic:
            self._grow.append((rec, w))
        started.append(rec)

    # -- views -------------------------------------------------------------------
    @property
    def pending_count(self) -> int:
        return self.tally.pending

    @property
    def running_count(self) -> int:
        return self.tally.running

    def pending_actions(self) -> list[ActionSpec]:
        return [r.spec for r in self._waiting.values() if r.aid not in self._unplaceable]

    def unplaceable(self, now: float) -> list[tuple[str, str]]:
        """Pending actions larger than every configured shape; they stay pending until cancelled."""
        return [(aid, why) for aid, (_, why) in self._unplaceable.items()]

    def resident_services(self, worker_id: str) -> frozenset[str]:
        w = self._workers.get(worker_id)
        return frozenset(w.services) if w is not None else frozenset()

    def env_host(self, env: str) -> str | None:
        es = self._envs.get(env)
        return es.host.id if es is not None and es.host is not None else None

    def close_env(self, env: str) -> None:
        """Stop pinning actions to ``env``: it was destroyed (its trajectory ended), saved for a move,
        or it is only a placement hint the scheduler wants elsewhere.  Its actions still waiting on
        its worker go back to the shared queues (the next to start pins it again)."""
        es = self._envs.get(env)
        if es is None:
            return
        w = es.host
        es.host = None
        es.idle = -1.0
        self._forget_env(es)
        if w is None:
            return
        w.envs.discard(env)
        q = w.env_queue
        # (live > busy: some of its actions wait; an ended trajectory's have not, so its worker's
        # queue, where other environments' actions may wait, is not scanned)
        if q is not None and q.live and es.live > es.busy:
            for rec in [e[2] for e in q.heap if e[2].queue is q and e[2].envst is es]:
                self._unqueue(rec)
                self._route(rec)


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
    return _INF



_NO_CORE = Demand(0, 0)
_ONE_CORE = Need(1, 0, 0, None)


def _pipelined(spec: ActionSpec) -> ActionSpec:
    """The spec as placed when its class is known to finish in well under a round trip.

    Binding a core for such an action costs a coordinator round trip per action
    (a worker holds only as many as it has cores, so frames carry one or two),
    while the call itself takes microseconds.  Placed as a *light* action it is
    pipelined like a zero-core one; the worker runs it on its I/O side, and the
    result reports ``cores=0``.  Learning keeps it honest: one slow run puts the
    class over the limit, and its next actions bind cores again.
    """
    return ActionSpec(kind=spec.kind, payload=spec.payload, env=None, demand=_NO_CORE,
                      duration_hint=spec.duration_hint, timeout=spec.timeout, priority=spec.priority,
                      trajectory=spec.trajectory, step=spec.step, label=spec.label,
                      idempotency_key=spec.idempotency_key, id=spec.id)
