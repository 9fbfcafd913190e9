"""The services placement knows and where their replicas are; and what fits the pool at all.

:class:`ServiceTable` keeps the run's services (declared sizes and batch limits, or sizes learned
from their calls), the workers where each is resident or loading, and the RL step that last
called each.  It places a reward call: on a replica with a free slot (the best by the loading
strategy's rank), or, when the strategy says so, on a worker where a new replica loads, evicting
by the strategy's rule.

:class:`FitCheck` says why an action fits no worker the pool can ever provide (its shapes, or a
larger registered worker), so that it is set aside instead of waiting for good.
"""
from __future__ import annotations

import heapq
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar, Iterable, Mapping

from ..actions import ActionSpec, Demand
from ..resources import ServiceInfo, WorkerShape
from .base import mypyc_attr
from .capacity import fits
from .records import PENDING, ActionRecord, PlacementQueue, ServiceReplica, ShapeLimit, WorkerRecord

if TYPE_CHECKING:
    from .placement import PlacementPolicy

__all__ = ["ServiceTable", "FitCheck", "can_host"]


def can_host(w: WorkerRecord, svc: str) -> bool:
    """A worker that declares the services it can host takes only those; one that declares none, any."""
    hostable = w.info.services
    return not hostable or svc in hostable


class ServiceTable:
    """The run's services, their replicas, and the step each was last called in (see the module docstring)."""

    #: Services the run did not declare whose numbers are kept while idle; past this many the idle
    #: ones are forgotten (see forget_idle).
    MAX_UNDECLARED_SERVICES: ClassVar[int] = 1024

    def __init__(self, policy: PlacementPolicy):
        self._policy = policy
        self.info: dict[str, ServiceInfo] = {}
        self.declared: set[str] = set()               # the run declared their size (it stays; all are in info)
        self._undeclared_cap = self.MAX_UNDECLARED_SERVICES   # see forget_idle
        self.where: dict[str, dict[str, WorkerRecord]] = {}   # service -> worker id -> worker with a replica
        self.last_step: dict[str, int] = {}          # service -> last RL step that called it
        self.step = 0                                 # highest RL step seen
        self.step_seen = False
        # (ready_at, n, worker) of the replicas placed loading: when one is due, its worker's queues
        # are armed again (see due_loads), as a call that found every replica still loading, or the
        # worker's memory held by loads, is placeable then without any other event
        self.loads: list[tuple[float, int, WorkerRecord]] = []
        self._nloads = 0

    def declare(self, services: Mapping[str, ServiceInfo]) -> None:
        self.info.update(services)
        self.declared.update(services)
        predictor = self._policy.predictor
        for name, s in services.items():
            if s.load_s is not None:
                predictor.seed_load_time(name, s.load_s)

    def mem(self, svc: str, default: int) -> int:
        s = self.info.get(svc)
        return s.gpu_mem_mb if s is not None else default

    def make_resident(self, w: WorkerRecord, svc: str, mem: int, ready_at: float) -> ServiceReplica:
        st = ServiceReplica(mem, ready_at)
        w.services[svc] = st
        w.gpu_used += mem
        self.where.setdefault(svc, {})[w.id] = w
        self._nloads += 1
        heapq.heappush(self.loads, (ready_at, self._nloads, w))
        return st

    def preload(self, w: WorkerRecord, starts: frozenset[str], now: float) -> None:
        """``w`` joined, configured to load ``starts``: count those loading that its GPU memory holds."""
        for name, s in self.info.items():
            if name in starts and w.gpu_mem - w.gpu_used >= s.gpu_mem_mb:
                self.make_resident(w, name, s.gpu_mem_mb, now + self._policy.predictor.load_time(name))

    def reported(self, w: WorkerRecord, services: frozenset[str], now: float) -> None:
        """``w`` reports ``services`` resident: they are ready from now on; a resident one not
        reported (and idle) was evicted; one counted as loading stays until its load is due."""
        for svc in services:
            st = w.services.get(svc)
            if st is None:
                self.make_resident(w, svc, self.mem(svc, 0), now)
            elif st.ready_at > now:
                st.ready_at = now
        for svc in [s for s, st in w.services.items()
                    if s not in services and st.running == 0 and st.ready_at <= now]:
            self.evict(w, svc)

    def saw_step(self, step: int) -> None:
        """An action of RL step ``step`` was submitted."""
        self.step_seen = True
        if step > self.step:
            self.step = step

    def due_loads(self, now: float) -> list[WorkerRecord]:
        """The workers where a replica placed loading is due by ``now`` (each once, popped)."""
        loads = self.loads
        out: list[WorkerRecord] = []
        while loads and loads[0][0] <= now:
            w = heapq.heappop(loads)[2]
            if not out or out[-1] is not w:
                out.append(w)
        return out

    def evict(self, w: WorkerRecord, svc: str) -> None:
        st = w.services.pop(svc)
        w.gpu_used -= st.mem
        self.drop_replica(svc, w)

    def drop_replica(self, svc: str, w: WorkerRecord) -> None:
        prefetch = self._policy.prefetch
        if prefetch is not None:
            prefetch.dropped(w.id, svc)
        reps = self.where.get(svc)
        if reps is not None:
            reps.pop(w.id, None)
            if not reps:            # a service no worker holds keeps no entry (see forget_idle)
                del self.where[svc]

    def needed_soon(self, svc: str) -> bool:
        """A service somebody waits for, or one this or the previous RL step called (its step's tail will)."""
        return self._policy.tally.service_pending.get(svc, 0) > 0 or self.last_step.get(svc, -10) >= self.step - 1

    def _only_replica(self, svc: str, w: WorkerRecord) -> bool:
        """``w`` holds the only replica of ``svc``."""
        reps = self.where.get(svc)
        return reps is None or len(reps) == 1 and w.id in reps

    def note(self, rec: ActionRecord) -> None:
        """``rec`` calls its service: learn the size of an undeclared one (which decides where its
        calls fit), and the step it was last called in."""
        svc = rec.service
        assert svc is not None
        known = self.info.get(svc)
        changed = False
        if known is None:
            if len(self.info) - len(self.declared) >= self._undeclared_cap:
                self.forget_idle()
                changed = True
            self.info[svc] = ServiceInfo(rec.gpu_mem_mb)
        elif rec.gpu_mem_mb > known.gpu_mem_mb and svc not in self.declared:
            # an undeclared service is as large as its calls say; a declared one keeps its size
            # (a call claiming more is refused alone, by the fit check)
            self.info[svc] = replace(known, gpu_mem_mb=rec.gpu_mem_mb)
            changed = True
        step = rec.spec.step
        self.last_step[svc] = self.step if step is None else step
        if changed:
            self._policy.fit.changed()

    def forget_idle(self) -> None:
        """Forget the undeclared services nothing waits for and no worker holds (their size, last
        step and what the loading strategy and the predictor keep per service): where the pool
        declares no list of services, clients may name any number of them.  A later call learns
        one again."""
        policy = self._policy
        pending, declared = policy.tally.service_pending, self.declared
        for svc in [s for s in self.info if s not in declared and not pending.get(s) and s not in self.where]:
            del self.info[svc]
            self.last_step.pop(svc, None)
            policy.loading.forget(svc)
            policy.predictor.forget_service(svc)
        # twice what is still in use: a table full of busy services is not scanned at every call
        self._undeclared_cap = max(self.MAX_UNDECLARED_SERVICES, 2 * (len(self.info) - len(declared)))

    def has_slot(self, w: WorkerRecord, svc: str) -> bool:
        """The service's replica on ``w`` takes another request (its batch limit)."""
        info = self.info.get(svc)
        return info is None or not info.max_batch or w.services[svc].running < info.max_batch

    def ready_on(self, w: WorkerRecord, rec: ActionRecord, now: float) -> bool:
        """``rec``'s service has a slot on ``w`` (an env queue's worker), or loads there now."""
        svc = rec.service
        assert svc is not None
        if svc in w.services:
            return self.has_slot(w, svc)
        if not can_host(w, svc):
            return False
        ev = self._policy.loading.victims(w, self.mem(svc, rec.gpu_mem_mb), now)
        if ev is None:
            return False
        self._load(w, rec, ev, now)
        return True

    def worker_for(self, rec: ActionRecord, q: PlacementQueue, now: float) -> WorkerRecord | None:
        """The worker a reward call goes to: a replica with a slot, or one where a replica loads now."""
        svc = rec.service
        assert svc is not None
        policy = self._policy
        loading = policy.loading
        best = None
        reps = self.where.get(svc)
        if reps:
            rank: tuple = ()
            for w in reps.values():
                if not w.draining and rec.kind in w.kinds and fits(w, rec) and self.has_slot(w, svc):
                    r = loading.replica_rank(w, svc)
                    if best is None or r < rank:
                        best, rank = w, r
            if best is not None:
                return best
        if not loading.should_load(rec, q, now):
            return None
        # load a new replica where it evicts nothing needed soon, then the fewest, most free memory
        need = self.mem(svc, rec.gpu_mem_mb)
        pending = policy.tally.service_pending
        choice = None
        for w in policy.workers.values():
            if w.draining or w.gpu_mem < need or rec.kind not in w.kinds:
                continue
            if svc in w.services or not fits(w, rec) or not can_host(w, svc):
                continue
            ev = loading.victims(w, need, now)
            if ev is None:
                continue
            waited_for = sum(1 for s in ev if pending.get(s, 0) > 0)
            if waited_for:
                continue        # somebody waits for a victim: loading here would only trade places
            if reps and any(self.needed_soon(s) and self._only_replica(s, w) for s in ev):
                # a replica more of a service that has one must not take the only one of a service
                # still in use: its next call would wait a whole load for what this one saves
                continue
            rank = (sum(1 for s in ev if self.needed_soon(s)), len(ev), -(w.gpu_mem - w.gpu_used),
                    -w.free_cores, w.seq)
            if choice is None or rank < choice[0]:
                choice = (rank, w, ev)
        if choice is None:
            return None
        _, w, ev = choice
        self._load(w, rec, ev, now)
        return w

    def _load(self, w: WorkerRecord, rec: ActionRecord, evict: list[str], now: float) -> None:
        svc = rec.service
        assert svc is not None
        for s in evict:
            self.evict(w, s)
        self.make_resident(w, svc, self.mem(svc, rec.gpu_mem_mb), now + self._policy.predictor.load_time(svc))


@mypyc_attr(allow_interpreted_subclasses=True)
class FitCheck:
    """Why an action fits no worker the pool can provide (None: it fits), remembered per demand."""

    def __init__(self, policy: PlacementPolicy):
        self._policy = policy
        self.limits: tuple[ShapeLimit, ...] = ()
        self.hosted: frozenset[str] | None = None
        # (kind, id(demand)) and (kind, demand) -> (the demand, why it fits nothing (None: fits)).
        # By identity first: a frozen dataclass hashes in interpreted code, and the simulator's
        # actions of a class share one Demand (the entry holds it, so its id is not reused while
        # the entry stands); by value for a client's actions, which each bring their own.
        self._memo: dict[tuple, tuple[Demand, str | None]] = {}
        # pending actions that fit nothing, by id, with why: held outside every queue until cancelled
        # (or until new shapes make them fit)
        self.held: dict[str, tuple[ActionRecord, str]] = {}

    def set_shapes(self, shapes: Iterable[WorkerShape | ShapeLimit], hosted: Iterable[str] | None,
                   records: Iterable[ActionRecord] = ()) -> None:
        """The shapes the pool can provide, and the services they host (None: any); the pending
        actions among ``records`` are set aside, or routed again, by what fits them now."""
        self.limits = tuple(s if isinstance(s, ShapeLimit) else ShapeLimit.of(s) for s in shapes)
        self.hosted = None if hosted is None else frozenset(hosted)
        self._memo.clear()
        policy = self._policy
        held = self.held
        for rec in records:
            if rec.state is not PENDING:
                continue
            why = self.too_big(rec.spec)
            aid = rec.aid
            if why and aid not in held:
                policy.queues.leave(rec)
                held[aid] = (rec, why)
            elif not why and aid in held:
                del held[aid]
                if rec.service:
                    policy.replicas.note(rec)
                policy.queues.route(rec)

    def changed(self) -> None:
        """What fits may have changed (a worker came or went, a service's size is known): forget the answers."""
        self._memo.clear()

    def too_big(self, spec: ActionSpec) -> str | None:
        if not self.limits:
            return None
        d = spec.demand
        memo = self._memo
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
        hosted = self.hosted
        gpu_mem = d.gpu_mem_mb
        info = self._policy.replicas.info.get(svc) if svc else None
        if info is not None and info.gpu_mem_mb > gpu_mem:
            # where it cannot load, it cannot run: its declared size (kept, see submit), else the
            # size its calls gave it
            gpu_mem = info.gpu_mem_mb
        for lim in self.limits:
            if lim.holds(d.min_cores, d.mem_mb, gpu_mem) and (
                    not svc or lim.serves and (hosted is None or svc in hosted)):
                return None
        for w in self._policy.workers.values():    # a registered worker larger than the shapes counts too
            if (w.cores >= d.min_cores and w.mem >= d.mem_mb and w.gpu_mem >= gpu_mem
                    and spec.kind in w.kinds and (not svc or can_host(w, svc))):
                return None
        if svc and not any(lim.serves for lim in self.limits):
            return f"service {svc!r}: the pool starts no service workers and no registered worker hosts it"
        if svc and hosted is not None and svc not in hosted:
            return f"service {svc!r} is hosted by no worker (the run's services: {', '.join(sorted(hosted)) or 'none'})"
        big = max(self.limits, key=lambda s: (s.cores, s.mem_mb, s.gpu_mem_mb or 0))
        gpu = "unlimited" if big.gpu_mem_mb is None else big.gpu_mem_mb
        if gpu_mem > d.gpu_mem_mb:
            most = max((lim.gpu_mem_mb or 0 for lim in self.limits if lim.serves), default=0)
            return (f"service {svc!r} needs {gpu_mem} MB of (GPU) memory; the largest service worker has "
                    f"{most} MB")
        return (f"demand min_cores={d.min_cores} mem_mb={d.mem_mb} gpu_mem_mb={d.gpu_mem_mb} exceeds "
                f"every worker shape (largest: cores={big.cores} mem_mb={big.mem_mb or 'unlimited'} "
                f"gpu_mem_mb={gpu})")
