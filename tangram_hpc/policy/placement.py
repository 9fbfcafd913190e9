"""Placement: the state shared by the action-level policies, and the strategies that set them apart.

The policies place the same way -- environment affinity, memory, GPU memory, service residency,
draining -- and differ in a few decisions, each a small strategy object that
:class:`PlacementPolicy` is composed with (think of a policy as a set of strategies):

=====================  ===========================================  ==================================
strategy               decides                                      implementations
=====================  ===========================================  ==================================
:mod:`.order`          the key waiting actions are taken in         ``SubmitOrder``, ``ShortestFirst``,
                                                                    ``AgedSrpt``
:mod:`.grants`         how many cores an action gets, and whether   ``Grant`` (``min_cores``),
                       an elastic one waits for more                ``AtMaxCores``, ``ElasticGrant``
:mod:`.loading`        which replica a reward call goes to, when    ``LoadAtOnce``, ``KeepLayout``,
                       another loads, what it evicts; the pool's    ``LoadWhenWorthIt``; ``Layout``
                       layout of kinds and preloaded services
:mod:`.moves`          when an environment moves to another worker  ``EnvMoves`` (never),
                                                                    ``MoveWhenSooner``
=====================  ===========================================  ==================================

FIFO (:mod:`.fifo`), the elastic scheduler (:mod:`.elastic`) and the baselines
(:mod:`tangram_hpc.sim.baselines`) are such sets.  A strategy gets the policy it serves once
(``attach``) and reads its state; the state changes only here, through an action's transitions.

The state is the policy's records (:mod:`.records`): one :class:`ActionRecord` per action, one
:class:`WorkerRecord` per worker, one :class:`EnvState` per environment, the :class:`Tally` of
counts; the placement queues (:mod:`.queues`: waiting actions are never scanned one by one), the
free-capacity index (:mod:`.capacity`), the services and their replicas with the check of what
fits the pool at all and the actions that fit nothing (:mod:`.replicas`), where each environment
lives (:mod:`.homes`).

Cores are granted in two phases.  Every start of a :meth:`~PlacementPolicy.schedule` call first
takes ``min_cores``; once everything placeable has started, elastic starts grow to their grant
(:meth:`.grants.Grant.grow`), which sees what is still waiting (:func:`.queues.waiting_for`).
So the cores the waiting work could use are not handed out before it had its chance.
"""
from __future__ import annotations

from typing import ClassVar, Iterable, Mapping, Sequence

from ..actions import ActionSpec, Demand
from ..resources import ResourceClass, ServiceInfo, WorkerInfo, WorkerShape
from .base import Assignment, SchedulingPolicy, mypyc_attr
from .capacity import CapacityIndex, fits
from .grants import Grant, rigid_change
from .homes import EnvHomes
from .loading import Layout, LoadAtOnce, Loading
from .moves import EnvMoves, MoveWhenSooner
from .order import Order, SubmitOrder
from .predict import Predictor
from .prefetch import Prefetch
from .queues import PlacementQueues
from .records import (GONE, PENDING, RUNNING, ActionRecord, ActionState, KindLoad, OfferedLoad, PlacementQueue,
                      ServiceReplica, ShapeLimit, Tally, WorkerRecord, water_level)
from .replicas import FitCheck, ServiceTable

__all__ = ["PlacementPolicy", "ActionState", "ActionRecord", "ServiceReplica", "WorkerRecord", "PlacementQueue",
           "ShapeLimit", "KindLoad", "Tally", "water_level"]


@mypyc_attr(allow_interpreted_subclasses=True)
class PlacementPolicy(SchedulingPolicy):
    """Placement state composed with strategies (see the module docstring).

    The defaults are FIFO: submission order, ``min_cores``, a replica loaded as soon as none has a
    slot, environments kept where they started (``env_move_s`` None; set, they move by
    :class:`~tangram_hpc.policy.moves.MoveWhenSooner`).
    """

    #: Core-bound actions whose class is learned to take less than this run pipelined (see submit).
    PIPELINE_BELOW_S: ClassVar[float] = 0.001
    #: An environment keeping live processes on its worker is not moved off it (see env_processes).
    pin_live_envs: bool = True

    def __init__(self, predictor: Predictor | None = None, *, shapes: Sequence[WorkerShape] = (),
                 services: Mapping[str, ServiceInfo] | None = None, pipeline_below_s: float | None = None,
                 env_move_s: float | None = None, order: Order | None = None, grant: Grant | None = None,
                 loading: Loading | None = None, moves: EnvMoves | None = None, layout: Layout | None = None,
                 prefetch: Prefetch | None = None):
        if moves is not None and env_move_s is not None:
            raise ValueError("give env_move_s or a moves strategy, not both")
        self.predictor = predictor if predictor is not None else Predictor()
        self.order = order if order is not None else SubmitOrder()
        self.grant = grant if grant is not None else Grant()
        self.loading = loading if loading is not None else LoadAtOnce()
        self.moves = moves if moves is not None else EnvMoves() if env_move_s is None else MoveWhenSooner(env_move_s)
        self.layout = layout if layout is not None else Layout()
        self.prefetch = prefetch        # None: services load only when a call is dispatched
        self.pipeline_below_s = self.PIPELINE_BELOW_S if pipeline_below_s is None else pipeline_below_s
        self.tally = Tally()
        self._recs: dict[str, ActionRecord] = {}
        self._waiting: dict[str, ActionRecord] = {}    # the pending ones
        self.workers: dict[str, WorkerRecord] = {}
        self._kinds: dict[str, KindLoad] = {}
        self._seq = 0
        self._wseq = 0
        self._grow: list[tuple[ActionRecord, WorkerRecord]] = []
        self.offered = OfferedLoad()
        self.queues = PlacementQueues(self)
        self.homes = EnvHomes(self.queues)
        self.capacity = CapacityIndex(self.workers)
        self.replicas = ServiceTable(self)
        self.fit = FitCheck(self)
        for strategy in (self.order, self.grant, self.loading, self.moves):
            strategy.attach(self)
        if prefetch is not None:
            prefetch.attach(self)
        if services:
            self.set_services(services)
        self.set_shapes(shapes)

    @property
    def env_move_s(self) -> float | None:
        """Predicted seconds to move an environment (save, restore); None: environments stay put."""
        return self.moves.move_s

    # -- configuration ---------------------------------------------------------
    def set_shapes(self, shapes: Iterable[WorkerShape | ShapeLimit], hosted: Iterable[str] | None = None) -> None:
        """The worker shapes the pool can ever provide; actions larger than all are unplaceable.

        An action is unplaceable when it fits neither any of these shapes nor
        any registered worker.  With no shapes configured nothing is declared
        unplaceable (the driver may add workers of any size).  ``hosted``: the
        services the pool's service workers are started with (None: any), so a
        call of another service, or of any when no shape serves, is unplaceable.
        """
        self.fit.set_shapes(shapes, hosted, list(self._recs.values()))

    def set_services(self, services: Mapping[str, ServiceInfo]) -> None:
        """The reward-model services of the run: size, batch limit, known load time.

        Workers load the services they are configured with when they start
        (``WorkerInfo.services``); knowing the sizes, the policy counts those
        loads from the moment a worker registers.
        """
        self.replicas.declare(services)
        self.fit.changed()          # a service's size decides where its calls fit

    def waiting(self, action_id: str) -> ActionRecord | None:
        """The record of a pending action (None: not pending)."""
        return self._waiting.get(action_id)

    # -- workers -----------------------------------------------------------------
    def kind_load(self, kind: str) -> KindLoad:
        kl = self._kinds.get(kind)
        if kl is None:
            kl = self._kinds[kind] = KindLoad()
        return kl

    def add_worker(self, info: WorkerInfo, now: float) -> None:
        if info.id in self.workers:
            raise ValueError(f"worker {info.id} already added")
        info = self.layout.admit(info)
        self._wseq += 1
        w = WorkerRecord(info, self._wseq)
        self.workers[w.id] = w
        self.capacity.by_seq[w.seq] = w
        self.fit.changed()          # a worker larger than the shapes makes more fit
        self.tally.free_cores += w.free_cores
        for k in w.kinds:
            self.kind_load(k).capacity += w.cores
        self.replicas.preload(w, self.layout.starts_with(info), now)
        self._touch(w)

    def remove_worker(self, worker_id: str, now: float) -> list[str]:
        self.order.worker_removed(worker_id)
        w = self.workers.pop(worker_id, None)
        if w is None:
            return []
        del self.capacity.by_seq[w.seq]
        self.fit.changed()
        lost = list(w.running)
        for rec in w.running.values():
            self._end_running(rec, now)
            self.predictor.observe(rec.spec, None, rec.cores, now, rec.stats)
        w.running.clear()
        self.tally.free_cores -= w.free_cores
        if not w.draining:
            for k in w.kinds:
                self.kind_load(k).capacity -= w.cores
        for svc in w.services:
            self.replicas.drop_replica(svc, w)
        self.homes.lost(w)
        self.queues.strand(w)
        return lost

    def set_draining(self, worker_id: str, draining: bool) -> None:
        w = self.workers.get(worker_id)
        if w is None or w.draining == draining:
            return
        w.draining = draining
        sign = -1 if draining else 1
        for k in w.kinds:
            self.kind_load(k).capacity += sign * w.cores
        self._touch(w)

    def update_worker(self, worker_id: str, *, services: frozenset[str] | None = None,
                      envs: frozenset[str] | None = None, now: float = 0.0) -> None:
        """Worker-reported state: the services resident on it (see
        :meth:`~.replicas.ServiceTable.reported`) and the environments it holds."""
        w = self.workers.get(worker_id)
        if w is None:
            return
        if services is not None:
            self.replicas.reported(w, services, now)
            self._touch(w)
        if envs is not None:
            self.homes.reported(w, envs)

    def _touch(self, w: WorkerRecord) -> None:
        """A worker gained capacity (or joined): re-index it and arm the queues it may serve.

        (Capacity that falls needs nothing: the worker's entries above its free cores are stale,
        and overstate it until they are read.)
        """
        self.queues.arm(w)
        if not w.draining and w.free_cores not in w.listed:
            self.capacity.index(w)

    # -- submission --------------------------------------------------------------
    def submit(self, action: ActionSpec, now: float) -> None:
        action = self.grant.shape(action)
        aid = action.id
        old = self._recs.get(aid)
        if old is not None and old.state is not GONE:
            raise ValueError(f"action {aid} is already pending or running")
        self._seq += 1
        d = action.demand
        if (d.min_cores and self.pipeline_below_s and action.env is None and not (d.mem_mb or d.gpu_mem_mb or d.service)
                and self.predictor.is_tiny(action, self.pipeline_below_s)):
            action = _pipelined(action)
        rec = ActionRecord(action, now, self._seq, self.kind_load(action.kind))
        self._recs[aid] = rec
        self._waiting[aid] = rec
        if action.env is not None:
            es = rec.envst = self.homes.state(action.env)
            es.live += 1
            if es.idle >= 0:        # the gap between an environment's actions: its agent's think time
                self.moves.resumed(es, now)
                es.idle = -1.0
        st = rec.stats = self.predictor.class_stats(action)
        rec.d1, rec.p, rec.tail = self.predictor.estimate(action, st)
        if not rec.light:
            rec.work = rec.time_at(rec.min_cores) * rec.min_cores
        rec.key = self.order.key(rec)
        replicas = self.replicas
        if action.step is not None:
            replicas.saw_step(action.step)
        why = self.fit.too_big(action)
        if rec.service and (why is None or rec.service in replicas.info):
            # a refused call of a service nobody knows leaves nothing behind: clients may name any
            replicas.note(rec)
            self.loading.arrived(rec.service, now)
        self.tally.submitted(rec)
        if not rec.light:
            self.offered.count(rec, self.grant.best_cores(rec), now)
        if why:
            self.fit.held[aid] = (rec, why)
            return
        self.queues.route(rec)

    @property
    def current_step(self) -> int | None:
        return self.replicas.step if self.replicas.step_seen else None

    def offered_load(self, now: float) -> dict[ResourceClass, float]:
        return self.offered.at(now)

    def cancel(self, action_id: str) -> bool:
        rec = self._recs.get(action_id)
        if rec is None or rec.state is not PENDING:
            return False
        rec.state = GONE
        self._recs.pop(rec.aid, None)
        del self._waiting[rec.aid]
        self.tally.withdrawn(rec)
        es = rec.envst
        if self.fit.held.pop(rec.aid, None) is None:       # (one set aside left its environment already)
            self.queues.withdraw(rec)
        if es is not None:
            es.live -= 1
            self.homes.forget(es)
        return True

    # -- completion --------------------------------------------------------------
    def finished(self, action_id: str, now: float, *, ok: bool = True, run_time: float | None = None) -> None:
        rec = self._recs.pop(action_id, None)
        if rec is None:
            return
        if rec.state is not RUNNING:
            self._recs[action_id] = rec     # a finish for an attempt no longer running: the waiting one stays
            return
        w = rec.worker
        es = rec.envst
        if es is not None and w is not None and self.moves.move_s is not None:
            es.idle = now           # (kept only where environments move: the think time it starts)
        self._end_running(rec, now)
        if w is not None:
            del w.running[action_id]
            self._touch(w)
            if es is not None:
                self.moves.ended(rec.kind, es, w, now)
        spec = rec.spec
        if not ok or run_time is None:
            self.predictor.observe(spec, None, rec.cores, now, rec.stats)
        elif rec.load_wait > 0 and spec.demand.service is not None:
            warm = self.predictor.predict(spec, rec.cores)
            self.predictor.observe_load(spec.demand.service, max(0.0, run_time - warm))
            self.predictor.observe(spec, None, rec.cores, now, rec.stats)
        else:
            self.predictor.observe(spec, run_time, rec.cores, now, rec.stats)

    def revoke(self, action_id: str, now: float) -> None:
        rec = self._recs.get(action_id)
        if rec is None or rec.state is not RUNNING:
            return
        del self._recs[action_id]
        w = rec.worker
        self._end_running(rec, now)     # no run to learn from, and no reason to move its environment
        if w is not None:
            del w.running[action_id]
            self._touch(w)

    def _end_running(self, rec: ActionRecord, now: float) -> None:
        rec.state = GONE
        w = rec.worker
        self.tally.ended(rec, w)
        es = rec.envst
        if es is not None:
            es.live -= 1
            if w is not None:
                es.busy -= 1
                if not rec.elastic and rec.cores:
                    rigid_change(w, -rec.cores, now)
            self.homes.forget(es)
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
        loads = self.replicas.loads
        if loads and loads[0][0] <= now:
            # a load the policy placed is due: what waited for it (a slot, or memory to evict) may
            # be placeable now, though no heartbeat reports it (a worker's list may not change)
            workers = self.workers
            for w in self.replicas.due_loads(now):
                if workers.get(w.id) is w:
                    self._touch(w)
        if t.pending == 0 or not self.queues.armed or (t.free_cores <= 0 and t.light_pending <= 0):
            return []
        started: list[ActionRecord] = []
        self.queues.place(now, started)
        if not started:
            return []
        if self._grow:
            grow, self._grow = self._grow, []
            self.grant.grow(grow)
        predictor = self.predictor
        out = []
        for r in started:
            on = r.worker
            assert on is not None
            predictor.started(r.spec, r.cores, now, r.stats)     # a method, not a bound one kept: a native call when compiled
            r.expect = r.time_at(r.cores)
            r.ends_at = r.started + r.expect
            on.ends = None
            out.append(Assignment(r.aid, on.id, r.cores))
        return out

    def prefetches(self, now: float) -> list[tuple[str, str]]:
        return self.prefetch.decide(now) if self.prefetch is not None else []

    def prefetch_counts(self) -> dict[str, int] | None:
        return self.prefetch.counts() if self.prefetch is not None else None

    def place(self, rec: ActionRecord, q: PlacementQueue, now: float, started: list[ActionRecord]) -> bool:
        """Start ``rec``, the head of ``q``, where it fits now; False: nowhere (or it waits for more cores)."""
        w = q.worker
        if w is not None:                       # env queue: only that worker
            if rec.kind not in w.kinds or not fits(w, rec):
                if not rec.light:
                    self.moves.consider(rec, w, now)
                return False
            if rec.elastic and w.free_cores < rec.max_cores and self.moves.consider(rec, w, now):
                return False
            if rec.service and not self.replicas.ready_on(w, rec, now):
                return False
        elif rec.service:
            w = self.replicas.worker_for(rec, q, now)
            if w is None:
                return False
        else:
            w = self.capacity.best(rec.kind, rec)
            if w is None:
                return False
        if rec.elastic and not self.grant.startable(rec, w, now):
            return False
        self._start(rec, w, now, started)
        return True

    def _start(self, rec: ActionRecord, w: WorkerRecord, now: float, started: list[ActionRecord]) -> None:
        self.queues.unqueue(rec)
        del self._waiting[rec.aid]
        rec.state = RUNNING
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
            if self.prefetch is not None:
                self.prefetch.started(w.id, rec.service)
        else:
            w.gpu_used += rec.gpu_mem_mb
        w.running[rec.aid] = rec
        es = rec.envst
        if es is not None:
            if not rec.elastic and rec.cores:
                rigid_change(w, rec.cores, now)
            es.busy += 1
            if es.host is None:
                self.homes.settle(es, w)
            elif es.first is rec:
                es.first = None
        if rec.elastic:
            self._grow.append((rec, w))
        started.append(rec)

    # -- environments ------------------------------------------------------------
    def env_processes(self, env: str, live: bool) -> None:
        self.homes.pin(env, live and self.pin_live_envs)

    def env_moves(self) -> list[str]:
        return self.moves.take()

    def observe_env_move(self, seconds: float) -> None:
        self.moves.observe(seconds)

    def env_host(self, env: str) -> str | None:
        w = self.homes.host(env)
        return w.id if w is not None else None

    def close_env(self, env: str) -> None:
        """Stop pinning actions to ``env``: it was destroyed (its trajectory ended), saved for a move,
        or it is only a placement hint the scheduler wants elsewhere.  Its actions still waiting on
        its worker go back to the shared queues (the next to start pins it again)."""
        self.homes.close(env)

    # -- views -------------------------------------------------------------------
    @property
    def pending_count(self) -> int:
        return self.tally.pending

    @property
    def running_count(self) -> int:
        return self.tally.running

    def pending_actions(self) -> list[ActionSpec]:
        held = self.fit.held
        return [r.spec for r in self._waiting.values() if r.aid not in held]

    def unplaceable(self, now: float) -> list[tuple[str, str]]:
        """Pending actions larger than every configured shape; they stay pending until cancelled."""
        return [(aid, why) for aid, (_, why) in self.fit.held.items()]

    def resident_services(self, worker_id: str) -> frozenset[str]:
        w = self.workers.get(worker_id)
        return frozenset(w.services) if w is not None else frozenset()


_NO_CORE = Demand(0, 0)


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
