"""The elastic, ACT-minimising action scheduler.

Goal: minimise the mean action completion time (ACT = finish - submit) of a
stream of heterogeneous actions on a pool of workers, without knowing
durations in advance and without preempting anything.

Order -- SRPT with static aging.
    SRPT (shortest remaining processing time first) minimises mean response
    time on one server: every second a short action waits behind a long one
    costs more waiting in total than the other way round.  Nothing here is
    preempted, so "remaining" is the whole predicted run time at ``min_cores``
    (:class:`~tangram_hpc.policy.predict.Predictor`, learned online per action
    class).  Pure SRPT starves long actions under a steady stream of short
    ones, so each action is ranked by the *static* key

        key = predicted_size + aging * submit_time - priority_weight * priority

    Subtracting ``aging * now`` from every key alike does not change the order,
    so this is "size minus aging times waiting time" -- and it never has to be
    recomputed: the waiting queues are plain heaps.  It also bounds the wait:
    an action submitted after ``t0 + (size + priority_weight * dp) / aging``
    has a larger key than one submitted at ``t0``, so the older one is overtaken
    only by the finitely many actions submitted before that instant (``dp``: at
    most ``2 * priority_clamp`` levels).  Priorities are folded in as a head
    start of ``priority_weight`` seconds per level, clamped to
    ``+-priority_clamp`` levels, so even a stream of high-priority actions cannot
    starve a low-priority one forever.

Cores -- heSRPT-inspired shares.
    For parallelisable jobs with sublinear speedup, heSRPT (Berg, Harchol-Balter
    et al., 2020) shows the optimal policy gives *every* job in the system a
    share of the cores (smaller jobs a larger share) rather than all cores to
    one job: the last cores given to a job buy little because of its serial
    part.  Without preemption we decide the core count once, at start: an
    elastic action (``max_cores > min_cores``) gets

        share = L such that  sum over elastic actions in the system of min(max_cores, L)
                           = cores of the kind - cores held or wanted by fixed-size actions

    (water-filling: what an action with a small ``max_cores`` cannot use goes
    to the others), clamped to ``[min_cores, min(max_cores, free cores of the
    worker)]`` and
    cut back to the point where one more core would speed it up by less than
    ``min_gain`` (Amdahl with the learned parallel fraction).  With an idle pool
    the share is the whole pool, so an action alone gets all the cores it can
    use ("grow when idle").  While work waits for cores the grant shrinks
    further: one more core is worth giving while the time it saves the action,
    ``d1 p / (c (c - 1))``, exceeds the delay its extra core-seconds impose on
    the ``q`` waiting actions (``1 / capacity`` each per core-second) -- ``d1
    (1 - p)`` of them, or only as many as the queue's drain time ``T`` when it
    clears sooner: ``c (c - 1) < d1 p capacity / (min(d1 (1 - p), T) q)``.
    Under a standing queue that is ``min_cores`` -- on an overloaded pool the
    most work per core-second is done at one core each -- while a moment's
    queue of a few short actions does not pin a long, parallel action to one
    core for its whole run.  (Grants are final: nothing is preempted or resized.)
    A worker whose environments' fixed-size actions used a core lately keeps
    one out of elastic grants for their next command
    (:meth:`~tangram_hpc.policy.placement.PlacementPolicy._reserve`).

Placement.
    Actions of an environment go to the worker that hosts it (the first of its
    actions to start decides).  Other actions go to the worker with the most
    free cores that fits their memory (so they can grow).  Reward calls go to
    a worker where their service is resident (or loading) with a free slot;
    a new replica is loaded -- evicting idle services, least recently used
    first -- only when the predicted wait for a resident slot is longer than
    the learned load time of the service, since a load is pure overhead for
    the action that triggers it, or when the service's arrival rate times
    its service time would keep the replicas' slots busier than
    ``service_util`` (a throughput rule: a queue that has not formed yet
    will).  Loads evict by the rule the worker's service manager applies
    (:mod:`tangram_hpc.policy.residency`), and the policy avoids workers where
    that would push out a model somebody waits for, or one this or the
    previous RL step called (it is needed again at the end of the step).
    Draining workers take only actions of the environments they already host.

Barriers (``barriers=True``, for synchronous rollout loops).
    When a turn starts only after every trajectory finished the one before, a
    turn ends with its slowest action, and which of a burst's long elastic
    actions that is cannot be told from their predictions (they carry no
    feature but their class; the tails are long).  Three rules then differ:
    an elastic action that finds fewer free cores than its target waits for
    them, unless the wait is longer than the cores would save it were it the
    turn's straggler (``BARRIER_TAIL_Z`` standard deviations of the class's
    log durations above the median); the elastic starts of one
    :meth:`schedule` call on a worker each get the cores they were judged worth
    (the cores kept for commands included) before the rest is shared -- rather
    than splitting a worker's free cores evenly among, say, three long actions
    of one size; and an action without a hint ranks no earlier than one of
    its class waiting in the same queue submitted before it (predicted sizes
    within a class differ only by the drift of the class estimate, so the
    oldest goes first).  Mean ACT alone would split and reorder; at a barrier
    the turn's end is what every trajectory waits for.  Without barriers none
    of this applies.

Costs.  See :mod:`tangram_hpc.policy.placement`: waiting actions are kept in
heaps per placement class, so a :meth:`schedule` call costs
``O(Q + k log(Q + W))`` for Q non-empty queues, k starts and W workers.

The policy is pure: given the same calls with the same arguments it makes the
same decisions (ties break by submission order and worker registration order).
"""
from __future__ import annotations

import math
from typing import ClassVar, Mapping, Sequence

from ..resources import ServiceInfo, WorkerShape
from .base import mypyc_attr
from .placement import ActionRecord, ActionState, PlacementPolicy, PlacementQueue, WorkerRecord, water_level
from .predict import Predictor

__all__ = ["ElasticScheduler"]


@mypyc_attr(allow_interpreted_subclasses=True)
class ElasticScheduler(PlacementPolicy):
    """SRPT-with-aging order, load-dependent elastic core shares, residency-aware placement.

    Parameters
    ----------
    predictor: shared duration/speedup model (a fresh one by default).
    shapes: worker shapes the pool can provide (for :meth:`unplaceable`).
    aging: seconds of predicted size one second of waiting is worth.
    priority_weight: seconds of head start per priority level.
    priority_clamp: priority levels beyond this count as this.
    min_gain: smallest relative speedup one more core must bring to be granted.
    services: the run's reward-model services (sizes, batch limits, load times).
    service_util: busiest a service's replicas may run (arrival rate x
        service time / slots) before another replica is loaded.
    rate_window_s: time constant of the arrival-rate estimate per service.
    env_move_s: predicted seconds to move an environment to another worker
        (save and restore); None keeps every environment where it started
        (see "Moving environments" in :mod:`tangram_hpc.policy.placement`).
    barriers: the rollouts are synchronous -- a turn starts only when every
        trajectory finished the one before (per-turn barriers), so a turn ends
        with its slowest action.  The user's RL loop decides this and the
        scheduler cannot see it; set it for such loops.  Then an elastic action
        waits for the cores it is judged worth rather than start on a worker's
        leftovers, the elastic starts of one :meth:`schedule` call on a worker
        each get theirs before the rest is shared, and actions of one class
        keep their submission order (see "Barriers" in the module docstring).
    """

    #: Barrier mode: an elastic action is weighed as if it were its turn's straggler, this many
    #: standard deviations of its class's log durations above the median (see _startable_at_barrier).
    BARRIER_TAIL_Z: ClassVar[float] = 3.0

    def __init__(self, predictor: Predictor | None = None, *, shapes: Sequence[WorkerShape] = (),
                 services: Mapping[str, ServiceInfo] | None = None,
                 aging: float = 0.5, priority_weight: float = 30.0, priority_clamp: int = 16,
                 min_gain: float = 0.005, service_util: float = 0.85, rate_window_s: float = 30.0,
                 pipeline_below_s: float | None = None, env_move_s: float | None = None,
                 barriers: bool = False):
        if aging <= 0:
            raise ValueError("aging must be positive (it bounds the wait of every action)")
        self.aging = aging
        self.priority_weight = priority_weight
        self.priority_clamp = priority_clamp
        self.min_gain = min_gain
        self.service_util = service_util
        self.rate_window_s = rate_window_s
        self._rates: dict[str, list[float]] = {}     # service -> [rate per second, at time]
        self.barriers = barriers
        # barrier mode: worker id -> cores promised to this schedule() call's elastic starts there,
        # beyond the min_cores they took; and per (class, min_cores, host worker or ""), the last
        # action submitted (its id and submission number, not its record: a long run sees many
        # workers, and a record holds its payload) and its rank (see _in_class_order)
        self._promised: dict[str, int] = {}
        self._class_last: dict[tuple[int, int, str], tuple[str, int, float]] = {}
        super().__init__(predictor, shapes=shapes, services=services, pipeline_below_s=pipeline_below_s,
                         env_move_s=env_move_s)

    def wait_bound(self, size: float, priority_gap: int) -> float:
        """Time after which no newly submitted action outranks one of ``size``.

        ``priority_gap``: how many priority levels newer actions may have above it.
        """
        gap = min(max(priority_gap, 0), 2 * self.priority_clamp)
        return (size + self.priority_weight * gap) / self.aging

    def _key(self, rec: ActionRecord) -> float:
        spec = rec.spec
        prio = spec.priority
        if prio > self.priority_clamp or prio < -self.priority_clamp:
            prio = max(-self.priority_clamp, min(self.priority_clamp, prio))
        rank = rec.time_at(rec.min_cores) + self.aging * rec.submit
        if self.barriers:
            rank = self._in_class_order(rec, rank)
        return rank - self.priority_weight * prio

    def _in_class_order(self, rec: ActionRecord, rank: float) -> float:
        """Barrier mode: an action without a hint ranks no earlier than the last action of its
        class for the same queue (its environment's worker, or the shared queues) while that one
        still waits.  Their predicted sizes differ only by the drift of the class estimate between
        their submits, which says nothing about which of them will be long; at a barrier the
        oldest is served first.  (Only while it waits: a rank inherited for good would keep a
        spike of the estimate, a turn's stragglers just seen, in every later rank of the class.)"""
        spec = rec.spec
        hint = spec.duration_hint
        if hint is not None and hint > 0:
            return rank             # its own prediction
        host = rec.envst.host if rec.envst is not None else None
        # the class by its stats' identity (one per feature key, kept for good): no key string per action
        ck = (id(rec.stats), rec.min_cores, host.id if host is not None else "")
        last = self._class_last.get(ck)
        if last is not None and rank < last[2]:
            waiting = self._waiting.get(last[0])
            if waiting is not None and waiting.seq == last[1]:
                rank = last[2]
        self._class_last[ck] = (rec.aid, rec.seq, rank)
        return rank

    def remove_worker(self, worker_id: str, now: float) -> list[str]:
        if self._class_last:        # (barrier mode) a long run sees many workers come and go
            self._class_last = {k: v for k, v in self._class_last.items() if k[2] != worker_id}
        return super().remove_worker(worker_id, now)

    def _grant(self, rec: ActionRecord, w: WorkerRecord) -> int:
        hi = min(rec.max_cores, rec.cores + max(0, w.free_cores - self._reserve(w, rec.started)))
        if rec.target >= hi:
            return hi       # it waited for at least what is there (and _cores_for never exceeds hi)
        # an action that waited for its cores gets them
        return max(self._cores_for(rec, w, hi), min(rec.target, hi))

    def _cores_for(self, rec: ActionRecord, w: WorkerRecord, hi: int, *, later: bool = False) -> int:
        """The grant for ``rec`` on ``w`` with at most ``hi`` cores available.

        ``later``: the grant it should wait for -- the fixed-size actions running now will have
        ended by then, so only the waiting ones count against the elastic share.
        """
        lo = rec.min_cores
        if hi <= lo:
            return lo
        kl = rec.load
        rigid = kl.rigid - kl.rigid_running if later else kl.rigid
        share = water_level(kl.capacity - rigid, kl.by_max)
        c = max(lo, min(hi, int(share) if share != float("inf") else hi))
        if c <= lo:
            return lo
        c = self._knee(rec.p, lo, c)
        queued, drain = self.waiting_for(rec, w)
        if queued and c > lo and rec.p < 1.0:
            # Going from c-1 to c cores saves d1 p / (c (c-1)) seconds of this action.  It takes
            # d1 (1-p) more core-seconds, but only while the queue lasts do they delay anyone:
            # min(d1 (1-p), drain time) core-seconds, each delaying the `queued` waiting actions by
            # 1/capacity.  Under a standing queue that is min_cores (the most work per
            # core-second); a burst of short actions that drains in a second leaves long
            # parallel ones most of their cores.
            lost = min(rec.d1 * (1.0 - rec.p), drain)
            if lost > 0:
                limit = rec.d1 * rec.p * max(1, kl.capacity) / (lost * queued)
                while c > lo and c * (c - 1) >= limit:
                    c -= 1
        return c

    def _startable(self, rec: ActionRecord, w: WorkerRecord, now: float) -> bool:
        # Grants are final, so an elastic action that would start on the leftovers of a busy worker
        # (a long final test run on one core, on the critical path of the step) waits there for
        # the cores it should have -- when the time they save it exceeds the expected wait.
        free = w.free_cores
        most = max(rec.min_cores, min(rec.max_cores, w.cores - self._reserve(w, now)))
        target = self._cores_for(rec, w, most, later=True)
        rec.target = target
        if self.barriers:
            return self._startable_at_barrier(rec, w, free, target, now)
        if free >= target:
            return True
        # expected times, not medians: durations are heavy-tailed, and the long ones are the ones
        # that decide a step's end
        gain = (rec.time_at(max(free, rec.min_cores)) - rec.time_at(target)) * rec.tail
        return gain <= self._wait_for_cores(w, target - free, now)

    def _startable_at_barrier(self, rec: ActionRecord, w: WorkerRecord, free: int, target: int,
                              now: float) -> bool:
        """Barrier mode: a turn ends with its slowest action, and any long elastic action of a burst
        may be it.  The cores promised to this call's earlier elastic starts on ``w`` are theirs
        (:meth:`_grow_grants` gives them first), and an action that finds fewer than its target
        waits for them -- unless the wait (the running actions' predicted ends say how long) is
        longer than the cores would save it were it the straggler (its duration
        ``BARRIER_TAIL_Z`` standard deviations of the class's log durations above the median).
        Short of cores promised in this call, it waits for a later call, which knows when this
        call's starts end."""
        lo = rec.min_cores
        promised = self._promised.get(w.id, 0)
        free -= promised
        if free < target:
            if promised:
                return False    # what it would wait for is this call's: weighed in a later call
            sigma = math.sqrt(2.0 * math.log(rec.tail)) if rec.tail > 1.0 else 0.0
            gain = (rec.time_at(max(free, lo)) - rec.time_at(target)) * math.exp(self.BARRIER_TAIL_Z * sigma)
            if gain > self._wait_for_cores(w, target - free, now):
                return False
            target = rec.target = max(free, lo)
        self._promised[w.id] = promised + target - lo
        return True

    def _grow_grants(self) -> None:
        if self.barriers:
            # each elastic start first gets the cores it waited for (the cores kept for commands
            # too: it was judged worth them), then the rest is shared as without barriers
            self._promised.clear()
            for rec, on in self._grow:
                if rec.state is ActionState.RUNNING and rec.worker is on:
                    extra = min(rec.target, on.free_cores + rec.cores) - rec.cores
                    if extra > 0:
                        self.tally.regranted(rec, on, extra)
        super()._grow_grants()

    def _best_cores(self, rec: ActionRecord) -> int:
        if not rec.elastic:
            return max(1, rec.min_cores)
        return self._knee(rec.p, rec.min_cores, rec.max_cores)

    def _knee(self, p: float, lo: int, c: int) -> int:
        """Cut ``c`` back to where the next core buys less than ``min_gain`` (Amdahl with parallel fraction p)."""
        serial = 1.0 - p
        while c > lo:
            t_c = serial + p / c
            t_less = serial + p / (c - 1)
            if (t_less - t_c) / t_c >= self.min_gain:
                break
            c -= 1
        return c

    @staticmethod
    def _replica_rank(w: WorkerRecord, svc: str) -> tuple:
        # the replica with the smallest batch: a request's latency grows with the batch it joins
        st = w.services[svc]
        return (st.ready_at, st.running, -w.free_cores, w.seq)

    def _arrived(self, service: str, now: float) -> None:
        r = self._rates.get(service)
        if r is None:
            self._rates[service] = [1.0 / self.rate_window_s, now]
            return
        r[0] = r[0] * math.exp(-(now - r[1]) / self.rate_window_s) + 1.0 / self.rate_window_s
        r[1] = now

    def _forget_service(self, svc: str) -> None:
        self._rates.pop(svc, None)
        super()._forget_service(svc)

    def arrival_rate(self, service: str, now: float) -> float:
        """Requests per second for ``service`` lately (exponentially decaying count)."""
        r = self._rates.get(service)
        if r is None:
            return 0.0
        return r[0] * math.exp(-max(0.0, now - r[1]) / self.rate_window_s)

    def _should_load(self, rec: ActionRecord, q: PlacementQueue, now: float) -> bool:
        svc = rec.service
        assert svc is not None
        reps = self._svc_replicas.get(svc)
        slots = 0
        if reps:
            per = max(1, rec.min_cores)
            info = self._services.get(svc)
            batch = info.max_batch if info is not None and info.max_batch else 1 << 30
            for w in reps.values():
                if not w.draining:
                    slots += min(w.cores // per, batch)
        if slots == 0:
            return True
        service_s = rec.time_at(rec.min_cores)
        if self.arrival_rate(svc, now) * service_s > self.service_util * slots:
            return True        # throughput: the replicas cannot keep up with the arrivals
        waiting = self.tally.service_pending.get(svc, 1)
        rounds = -(-waiting // slots)
        return rounds * service_s > self.predictor.load_time(svc)
