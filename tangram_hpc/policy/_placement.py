"""Shared bookkeeping of the action-level policies (elastic and FIFO).

Both policies place the same way -- env affinity, memory, GPU memory, service
residency, draining -- and differ only in the order they take waiting actions
(:meth:`PlacementPolicy._key`), how many cores they grant
(:meth:`PlacementPolicy._grant`) and when they load another replica of a GPU
service (:meth:`PlacementPolicy._should_load`).

Cost model.  Waiting actions never get scanned one by one.  They sit in
*queues*, each a heap of ``(key, seq, record)``:

* a *bucket* per placement class ``(kind, min_cores, mem, per-action GPU memory)``
  for actions that may go to any worker serving their kind;
* a *service queue* per ``(kind, service, min_cores, mem)`` for reward calls;
* an *env queue* per worker for actions whose environment lives there.

All actions of a queue need the same thing (env queues: the same worker), so
when a queue's head cannot be placed none of it can and the whole queue is
skipped for this call.  :meth:`schedule` merges the queue heads in one small
heap and places heads in key order, so a call costs
``O(Q + k log(Q + W))`` for ``Q`` non-empty queues, ``W`` workers and ``k``
starts -- independent of how many actions wait.  Free capacity per kind is a
max-heap of workers by free cores with lazy invalidation (a worker's entry is
valid while its version matches).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ..actions import ActionSpec
from ..resources import WorkerInfo, WorkerShape
from .base import Assignment, SchedulingPolicy, light_capacity
from .predict import Predictor

_INF = float("inf")

PENDING, RUNNING, GONE = 0, 1, 2


class _Rec:
    """One submitted action as the policy tracks it."""

    __slots__ = ("spec", "submit", "seq", "key", "state", "worker", "cores", "started",
                 "load_wait", "queue", "elastic")

    def __init__(self, spec: ActionSpec, submit: float, seq: int):
        self.spec = spec
        self.submit = submit
        self.seq = seq
        self.key = 0.0
        self.state = PENDING
        self.worker: _Worker | None = None
        self.cores = 0
        self.started = 0.0
        self.load_wait = 0.0        # seconds it had to wait for its service to load
        self.queue: _Queue | None = None
        d = spec.demand
        # a zero-core ("light") action binds no core: it is pipelined, never grown
        self.elastic = d.min_cores > 0 and d.max_cores > d.min_cores


class _Svc:
    __slots__ = ("mem", "running", "last_used", "ready_at")

    def __init__(self, mem: int, ready_at: float):
        self.mem = mem
        self.running = 0
        self.last_used = ready_at
        self.ready_at = ready_at


class _Worker:
    __slots__ = ("id", "info", "seq", "cores", "free_cores", "mem", "free_mem", "gpu_mem",
                 "gpu_used", "services", "draining", "running", "envs", "kinds", "version",
                 "env_queue", "light", "light_cap")

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
        self.services: dict[str, _Svc] = {}
        self.draining = False
        self.running: dict[str, _Rec] = {}
        self.envs: set[str] = set()
        self.kinds = info.kinds
        self.version = 0
        self.env_queue: _Queue | None = None
        self.light = 0                       # zero-core actions it holds
        self.light_cap = light_capacity(info)


class _Queue:
    __slots__ = ("idx", "heap", "kind", "service", "min_cores", "mem", "gpu_mem", "worker")

    def __init__(self, idx: int, kind: str, service: str | None, min_cores: int, mem: int,
                 gpu_mem: int, worker: _Worker | None = None):
        self.idx = idx
        self.heap: list = []
        self.kind = kind
        self.service = service
        self.min_cores = min_cores
        self.mem = mem
        self.gpu_mem = gpu_mem
        self.worker = worker


@dataclass(slots=True, frozen=True)
class ShapeLimit:
    """The largest thing one worker of some shape can give an action."""

    cores: int
    mem_mb: int = 0          # 0: not limited
    gpu_mem_mb: int = 0      # total over the worker's GPUs

    @classmethod
    def of(cls, shape: WorkerShape) -> "ShapeLimit":
        return cls(shape.cores, shape.mem_mb, shape.gpus * shape.gpu_mem_mb)


@dataclass(slots=True)
class _KindLoad:
    """Per-kind counters for the elastic share."""

    capacity: int = 0        # cores of non-draining workers serving the kind
    rigid: int = 0           # min cores of fixed-size actions in the system
    elastic: int = 0         # elastic actions in the system (pending + running)
    by_max: dict = field(default_factory=dict)    # elastic actions in the system per max_cores
    workers: list = field(default_factory=list)   # heap of (-free, seq, version, worker)


class PlacementPolicy(SchedulingPolicy):
    """Common machinery; see the module docstring.  Subclasses set the order and the grant."""

    def __init__(self, predictor: Predictor | None = None, *, shapes: Sequence[WorkerShape] = ()):
        self.predictor = predictor if predictor is not None else Predictor()
        self._recs: dict[str, _Rec] = {}
        self._workers: dict[str, _Worker] = {}
        self._queues: dict[tuple, _Queue] = {}
        self._nonempty: dict[int, _Queue] = {}
        self._kinds: dict[str, _KindLoad] = {}
        self._env_host: dict[str, _Worker] = {}
        self._env_first: dict[str, _Rec] = {}         # env -> its pending first action
        self._env_wait: dict[str, list[_Rec]] = {}    # later actions of an env with no host yet
        self._svc_mem: dict[str, int] = {}
        self._svc_pending: dict[str, int] = {}
        self._svc_replicas: dict[str, dict[str, _Worker]] = {}
        self._seq = 0
        self._wseq = 0
        self._qseq = 0
        self._n_pending = 0
        self._n_running = 0
        self._free_total = 0       # free cores on all workers (a quick "nothing to do" test)
        self._light_pending = 0    # waiting zero-core actions (they need no free core)
        self._limits: tuple[ShapeLimit, ...] = ()
        self._unplaceable: dict[str, tuple[_Rec, str]] = {}
        self._heads: list | None = None
        self.set_shapes(shapes)

    # -- configuration ---------------------------------------------------------
    def set_shapes(self, shapes: Iterable[WorkerShape | ShapeLimit]) -> None:
        """The worker shapes the pool can ever provide; actions larger than all are unplaceable.

        An action is unplaceable when it fits neither any of these shapes nor
        any registered worker.  With no shapes configured nothing is declared
        unplaceable (the driver may add workers of any size).
        """
        self._limits = tuple(s if isinstance(s, ShapeLimit) else ShapeLimit.of(s) for s in shapes)
        for rec in list(self._recs.values()):
            if rec.state != PENDING:
                continue
            why = self._too_big(rec.spec)
            aid = rec.spec.id
            if why and aid not in self._unplaceable:
                self._set_aside(rec, why)
            elif not why and aid in self._unplaceable:
                del self._unplaceable[aid]
                self._route(rec)

    def _set_aside(self, rec: _Rec, why: str) -> None:
        """Hold a pending action outside every queue until the driver cancels it."""
        env = rec.spec.env
        if env is not None and self._env_first.get(env) is rec:
            del self._env_first[env]
            for r in self._env_wait.pop(env, ()):
                self._route(r)
        elif env is not None and rec.queue is None and rec in self._env_wait.get(env, ()):
            self._env_wait[env].remove(rec)
        rec.queue = None         # its heap entry, if any, is now stale
        self._unplaceable[rec.spec.id] = (rec, why)

    def _too_big(self, spec: ActionSpec) -> str | None:
        if not self._limits:
            return None
        d = spec.demand
        for lim in self._limits:
            if (lim.cores >= d.min_cores and (lim.mem_mb == 0 or lim.mem_mb >= d.mem_mb)
                    and lim.gpu_mem_mb >= d.gpu_mem_mb):
                return None
        for w in self._workers.values():    # a registered worker larger than the shapes counts too
            if (w.cores >= d.min_cores and w.mem >= d.mem_mb and w.gpu_mem >= d.gpu_mem_mb
                    and spec.kind in w.kinds):
                return None
        big = max(self._limits, key=lambda s: (s.cores, s.mem_mb, s.gpu_mem_mb))
        return (f"demand min_cores={d.min_cores} mem_mb={d.mem_mb} gpu_mem_mb={d.gpu_mem_mb} exceeds "
                f"every worker shape (largest: cores={big.cores} mem_mb={big.mem_mb or 'unlimited'} "
                f"gpu_mem_mb={big.gpu_mem_mb})")

    # -- hooks -------------------------------------------------------------------
    def _key(self, rec: _Rec) -> float:
        raise NotImplementedError

    def _grant(self, rec: _Rec, w: _Worker) -> int:
        raise NotImplementedError

    def _should_load(self, rec: _Rec, q: _Queue, now: float) -> bool:
        raise NotImplementedError

    # -- workers -----------------------------------------------------------------
    def _kind(self, kind: str) -> _KindLoad:
        kl = self._kinds.get(kind)
        if kl is None:
            kl = self._kinds[kind] = _KindLoad()
        return kl

    def add_worker(self, info: WorkerInfo, now: float) -> None:
        if info.id in self._workers:
            raise ValueError(f"worker {info.id} already added")
        self._wseq += 1
        w = _Worker(info, self._wseq)
        self._workers[w.id] = w
        self._free_total += w.free_cores
        for k in w.kinds:
            self._kind(k).capacity += w.cores
        self._touch(w)

    def remove_worker(self, worker_id: str, now: float) -> list[str]:
        w = self._workers.pop(worker_id, None)
        if w is None:
            return []
        lost = list(w.running)
        for rec in w.running.values():
            self._forget_running(rec)
        self._n_running -= len(w.running)
        w.running.clear()
        self._free_total -= w.free_cores
        if not w.draining:
            for k in w.kinds:
                self._kind(k).capacity -= w.cores
        for svc in w.services:
            reps = self._svc_replicas.get(svc)
            if reps is not None:
                reps.pop(w.id, None)
        w.version += 1      # invalidates its free-capacity entries
        for env in list(w.envs):
            if self._env_host.get(env) is w:
                del self._env_host[env]
        w.envs.clear()
        q = w.env_queue
        if q is not None:
            self._nonempty.pop(q.idx, None)
            stranded = [e[2] for e in sorted(q.heap) if e[2].state == PENDING and e[2].queue is q]
            q.heap.clear()
            for rec in stranded:    # their environment is gone: start over elsewhere
                rec.queue = None
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
        w = self._workers.get(worker_id)
        if w is None:
            return
        if services is not None:
            for svc in services:
                if svc not in w.services:
                    self._make_resident(w, svc, self._svc_mem.get(svc, 0), now)
            for svc in [s for s, st in w.services.items() if s not in services and st.running == 0]:
                self._evict(w, svc)
        if envs is not None:
            for env in envs:
                if env not in w.envs:
                    old = self._env_host.get(env)
                    if old is not None:
                        old.envs.discard(env)
                    self._env_host[env] = w
                    w.envs.add(env)
            for env in [e for e in w.envs if e not in envs]:
                w.envs.discard(env)
                if self._env_host.get(env) is w:
                    del self._env_host[env]

    def _touch(self, w: _Worker) -> None:
        """Re-index a worker whose free capacity changed."""
        w.version += 1
        if w.draining:
            return
        entry = (-w.free_cores, w.seq, w.version, w)
        for k in w.kinds:
            kl = self._kinds.get(k) or self._kind(k)
            heap = kl.workers
            heapq.heappush(heap, entry)
            if len(heap) > 8 * len(self._workers) + 64:
                kl.workers = [e for e in heap if e[3].version == e[2] and e[3].id in self._workers]
                heapq.heapify(kl.workers)

    # -- residency ---------------------------------------------------------------
    def _make_resident(self, w: _Worker, svc: str, mem: int, ready_at: float) -> _Svc:
        st = _Svc(mem, ready_at)
        w.services[svc] = st
        w.gpu_used += mem
        self._svc_replicas.setdefault(svc, {})[w.id] = w
        return st

    def _evict(self, w: _Worker, svc: str) -> None:
        st = w.services.pop(svc)
        w.gpu_used -= st.mem
        reps = self._svc_replicas.get(svc)
        if reps is not None:
            reps.pop(w.id, None)

    def _evictable(self, w: _Worker, need: int) -> list[str] | None:
        """Idle services to evict (least recently used first) so ``need`` MB of GPU memory fit."""
        free = w.gpu_mem - w.gpu_used
        if free >= need:
            return []
        idle = sorted((st.last_used, s) for s, st in w.services.items() if st.running == 0)
        # services somebody waits for go last
        idle.sort(key=lambda t: self._svc_pending.get(t[1], 0) > 0)
        out = []
        for _, s in idle:
            out.append(s)
            free += w.services[s].mem
            if free >= need:
                return out
        return None

    # -- submission --------------------------------------------------------------
    def submit(self, action: ActionSpec, now: float) -> None:
        aid = action.id
        old = self._recs.get(aid)
        if old is not None and old.state != GONE:
            raise ValueError(f"action {aid} is already pending or running")
        self._seq += 1
        rec = _Rec(action, now, self._seq)
        self._recs[aid] = rec
        rec.key = self._key(rec)
        d = action.demand
        if d.service:
            if d.gpu_mem_mb > self._svc_mem.get(d.service, 0):
                self._svc_mem[d.service] = d.gpu_mem_mb
            self._svc_pending[d.service] = self._svc_pending.get(d.service, 0) + 1
        kl = self._kind(action.kind)
        if rec.elastic:
            kl.elastic += 1
            kl.by_max[d.max_cores] = kl.by_max.get(d.max_cores, 0) + 1
        else:
            kl.rigid += d.min_cores
        self._n_pending += 1
        if d.min_cores == 0:
            self._light_pending += 1
        why = self._too_big(action)
        if why:
            self._unplaceable[aid] = (rec, why)
            return
        self._route(rec)

    def _route(self, rec: _Rec) -> None:
        """Put a pending action in the queue that matches its placement constraint."""
        env = rec.spec.env
        if env is not None:
            host = self._env_host.get(env)
            if host is not None:
                q = host.env_queue
                if q is None:
                    self._qseq += 1
                    q = host.env_queue = _Queue(self._qseq, rec.spec.kind, None, 0, 0, 0, host)
                self._push(q, rec)
                return
            first = self._env_first.get(env)
            if first is not None and first is not rec:
                self._env_wait.setdefault(env, []).append(rec)
                rec.queue = None
                return
            self._env_first[env] = rec
        d = rec.spec.demand
        if d.service:
            qk = (rec.spec.kind, d.service, d.min_cores, d.mem_mb)
            gpu = 0
        else:
            qk = (rec.spec.kind, None, d.min_cores, d.mem_mb, d.gpu_mem_mb)
            gpu = d.gpu_mem_mb
        q = self._queues.get(qk)
        if q is None:
            self._qseq += 1
            q = self._queues[qk] = _Queue(self._qseq, rec.spec.kind, d.service, d.min_cores, d.mem_mb, gpu)
        self._push(q, rec)

    def _push(self, q: _Queue, rec: _Rec) -> None:
        rec.queue = q
        heapq.heappush(q.heap, (rec.key, rec.seq, rec))
        self._nonempty[q.idx] = q
        if self._heads is not None:     # routed during schedule(): eligible in this same call
            heapq.heappush(self._heads, (rec.key, rec.seq, q.idx, q))

    def cancel(self, action_id: str) -> bool:
        rec = self._recs.get(action_id)
        if rec is None or rec.state != PENDING:
            return False
        self._drop_pending(rec)
        return True

    def _drop_pending(self, rec: _Rec) -> None:
        rec.state = GONE
        if rec.spec.demand.min_cores == 0:
            self._light_pending -= 1
        if self._unplaceable.pop(rec.spec.id, None) is not None:
            self._recs.pop(rec.spec.id, None)
            self._n_pending -= 1
            self._leave_system(rec)
            if rec.spec.demand.service:
                self._svc_pending[rec.spec.demand.service] -= 1
            return
        self._recs.pop(rec.spec.id, None)
        self._n_pending -= 1
        self._leave_system(rec)
        svc = rec.spec.demand.service
        if svc:
            self._svc_pending[svc] -= 1
        env = rec.spec.env
        if rec.queue is None and env is not None:
            waiting = self._env_wait.get(env)
            if waiting and rec in waiting:
                waiting.remove(rec)
        if env is not None and self._env_first.get(env) is rec:
            del self._env_first[env]
            waiting = self._env_wait.pop(env, None)
            if waiting:
                for r in waiting:
                    self._route(r)
        # the heap entry stays and is skipped when it reaches the head

    def _leave_system(self, rec: _Rec) -> None:
        kl = self._kind(rec.spec.kind)
        if rec.elastic:
            kl.elastic -= 1
            m = rec.spec.demand.max_cores
            left = kl.by_max[m] - 1
            if left:
                kl.by_max[m] = left
            else:
                del kl.by_max[m]
        else:
            kl.rigid -= rec.spec.demand.min_cores

    # -- completion --------------------------------------------------------------
    def finished(self, action_id: str, now: float, *, ok: bool = True, run_time: float | None = None) -> None:
        rec = self._recs.pop(action_id, None)
        if rec is None or rec.state != RUNNING:
            return
        w = rec.worker
        self._forget_running(rec)
        self._n_running -= 1
        if w is not None:
            del w.running[action_id]
            self._touch(w)
        if ok and run_time is not None:
            spec = rec.spec
            if rec.load_wait > 0:
                warm = self.predictor.predict(spec, rec.cores)
                self.predictor.observe_load(spec.demand.service, max(0.0, run_time - warm))
            else:
                self.predictor.observe(spec, run_time, rec.cores)

    def _forget_running(self, rec: _Rec) -> None:
        rec.state = GONE
        self._leave_system(rec)
        w = rec.worker
        if w is None:
            return
        w.free_cores += rec.cores
        self._free_total += rec.cores
        d = rec.spec.demand
        if d.min_cores == 0:
            w.light -= 1
        w.free_mem += d.mem_mb
        if d.service:
            st = w.services.get(d.service)
            if st is not None:
                st.running -= 1
                st.last_used = max(st.last_used, rec.started)
        else:
            w.gpu_used -= d.gpu_mem_mb

    # -- scheduling --------------------------------------------------------------
    def schedule(self, now: float) -> list[Assignment]:
        if self._n_pending == 0 or (self._free_total <= 0 and self._light_pending <= 0):
            return []
        heads = []
        for q in list(self._nonempty.values()):
            h = q.heap
            while h and (h[0][2].state != PENDING or h[0][2].queue is not q):
                heapq.heappop(h)
            if not h:
                del self._nonempty[q.idx]
                continue
            w = q.worker
            if w is not None and w.free_cores < h[0][2].spec.demand.min_cores:
                continue
            heads.append((h[0][0], h[0][1], q.idx, q))
        if not heads:
            return []
        heapq.heapify(heads)
        out: list[Assignment] = []
        self._heads = heads
        try:
            self._drain_heads(heads, now, out)
        finally:
            self._heads = None
        return out

    def _drain_heads(self, heads: list, now: float, out: list[Assignment]) -> None:
        while heads and (self._free_total > 0 or self._light_pending > 0):
            _, _, _, q = heapq.heappop(heads)
            h = q.heap
            while h and (h[0][2].state != PENDING or h[0][2].queue is not q):
                heapq.heappop(h)
            if not h:
                self._nonempty.pop(q.idx, None)
                continue
            rec = h[0][2]
            if not self._place(rec, q, now, out):
                continue
            heapq.heappop(h)
            while h and (h[0][2].state != PENDING or h[0][2].queue is not q):
                heapq.heappop(h)
            if h:
                heapq.heappush(heads, (h[0][0], h[0][1], q.idx, q))
            else:
                self._nonempty.pop(q.idx, None)

    def _fits(self, w: _Worker, d) -> bool:
        return ((w.free_cores >= d.min_cores if d.min_cores else w.light < w.light_cap)
                and w.free_mem >= d.mem_mb
                and (d.service is not None or w.gpu_mem - w.gpu_used >= d.gpu_mem_mb))

    def _best_worker(self, kind: str, d) -> _Worker | None:
        """The non-draining worker serving ``kind`` with the most free cores that fits ``d``."""
        kl = self._kinds.get(kind)
        if kl is None:
            return None
        heap = kl.workers
        skipped = []
        found = None
        while heap:
            negfree, seq, ver, w = heap[0]
            if w.version != ver or w.draining or self._workers.get(w.id) is not w:
                heapq.heappop(heap)
                continue
            if d.min_cores and -negfree < d.min_cores:
                break            # nothing below has the cores either
            if self._fits(w, d):
                found = w
                break
            skipped.append(heapq.heappop(heap))
        for e in skipped:
            heapq.heappush(heap, e)
        return found

    def _place(self, rec: _Rec, q: _Queue, now: float, out: list[Assignment]) -> bool:
        d = rec.spec.demand
        w = q.worker
        if w is not None:                       # env queue: only that worker
            if rec.spec.kind not in w.kinds or not self._fits(w, d):
                return False
            if d.service and not self._service_ready_on(w, rec, now):
                return False
        elif d.service:
            w = self._service_worker(rec, q, now)
            if w is None:
                return False
        else:
            w = self._best_worker(rec.spec.kind, d)
            if w is None:
                return False
        self._start(rec, w, now, out)
        return True

    @staticmethod
    def _can_host(w: _Worker, svc: str) -> bool:
        """A worker that declares the services it can host takes only those; one that declares none, any."""
        hostable = w.info.services
        return not hostable or svc in hostable

    def _service_ready_on(self, w: _Worker, rec: _Rec, now: float) -> bool:
        d = rec.spec.demand
        if d.service in w.services:
            return True
        if not self._can_host(w, d.service):
            return False
        ev = self._evictable(w, d.gpu_mem_mb)
        if ev is None:
            return False
        self._load(w, rec, ev, now)
        return True

    def _service_worker(self, rec: _Rec, q: _Queue, now: float) -> _Worker | None:
        d = rec.spec.demand
        svc = d.service
        best = None
        reps = self._svc_replicas.get(svc)
        if reps:
            for w in reps.values():
                if not w.draining and rec.spec.kind in w.kinds and self._fits(w, d):
                    if best is None or (w.services[svc].ready_at, -w.free_cores, w.seq) < (
                            best.services[svc].ready_at, -best.free_cores, best.seq):
                        best = w
            if best is not None:
                return best
        if not self._should_load(rec, q, now):
            return None
        # load a new replica where it fits with the least eviction, most free GPU memory
        kl = self._kinds.get(rec.spec.kind)
        if kl is None:
            return None
        choice = None
        for w in self._workers.values():
            if w.draining or w.gpu_mem < d.gpu_mem_mb or rec.spec.kind not in w.kinds:
                continue
            if svc in w.services or not self._fits(w, d) or not self._can_host(w, svc):
                continue
            ev = self._evictable(w, d.gpu_mem_mb)
            if ev is None:
                continue
            rank = (len(ev), -(w.gpu_mem - w.gpu_used), -w.free_cores, w.seq)
            if choice is None or rank < choice[0]:
                choice = (rank, w, ev)
        if choice is None:
            return None
        _, w, ev = choice
        self._load(w, rec, ev, now)
        return w

    def _load(self, w: _Worker, rec: _Rec, evict: list[str], now: float) -> None:
        svc = rec.spec.demand.service
        for s in evict:
            self._evict(w, s)
        self._make_resident(w, svc, self._svc_mem.get(svc, rec.spec.demand.gpu_mem_mb),
                            now + self.predictor.load_time(svc))

    def _start(self, rec: _Rec, w: _Worker, now: float, out: list[Assignment]) -> None:
        spec = rec.spec
        d = spec.demand
        cores = self._grant(rec, w)
        rec.state = RUNNING
        rec.worker = w
        rec.cores = cores
        rec.started = now
        rec.queue = None
        w.free_cores -= cores
        self._free_total -= cores
        if d.min_cores == 0:
            w.light += 1
            self._light_pending -= 1
        w.free_mem -= d.mem_mb
        if d.service:
            st = w.services[d.service]
            st.running += 1
            st.last_used = now
            if st.ready_at > now:
                rec.load_wait = st.ready_at - now
            self._svc_pending[d.service] -= 1
        else:
            w.gpu_used += d.gpu_mem_mb
        w.running[spec.id] = rec
        self._n_pending -= 1
        self._n_running += 1
        env = spec.env
        if env is not None and env not in self._env_host:
            self._env_host[env] = w
            w.envs.add(env)
            if self._env_first.get(env) is rec:
                del self._env_first[env]
            for r in self._env_wait.pop(env, ()):
                self._route(r)
        elif env is not None and self._env_first.get(env) is rec:
            del self._env_first[env]
        self._touch(w)
        out.append(Assignment(spec.id, w.id, cores))

    # -- views -------------------------------------------------------------------
    @property
    def pending_count(self) -> int:
        return self._n_pending

    @property
    def running_count(self) -> int:
        return self._n_running

    def pending_actions(self) -> list[ActionSpec]:
        return [r.spec for r in self._recs.values() if r.state == PENDING and r.spec.id not in self._unplaceable]

    def unplaceable(self, now: float) -> list[tuple[str, str]]:
        """Pending actions larger than every configured shape; they stay pending until cancelled."""
        return [(aid, why) for aid, (_, why) in self._unplaceable.items()]

    def worker_load(self, worker_id: str) -> tuple[int, int, int]:
        """(busy cores, running actions, hosted environments) of a worker."""
        w = self._workers.get(worker_id)
        if w is None:
            return (0, 0, 0)
        return (w.cores - w.free_cores, len(w.running), len(w.envs))

    def resident_services(self, worker_id: str) -> frozenset[str]:
        w = self._workers.get(worker_id)
        return frozenset(w.services) if w is not None else frozenset()

    def env_host(self, env: str) -> str | None:
        w = self._env_host.get(env)
        return w.id if w is not None else None

    def close_env(self, env: str) -> None:
        """The environment was destroyed (its trajectory ended): stop pinning actions to it."""
        w = self._env_host.pop(env, None)
        if w is not None:
            w.envs.discard(env)


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
    return float("inf")


def ceil_div(a: float, b: float) -> int:
    return int(math.ceil(a / b))
