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
    use ("grow when idle"); with a queue, shares shrink towards ``min_cores``
    so one action does not hog cores the queue needs.  The share is below
    ``max_cores`` only while there is competition, which is when it matters.

Placement.
    Actions of an environment go to the worker that hosts it (the first of its
    actions to start decides).  Other actions go to the worker with the most
    free cores that fits their memory (so they can grow).  Reward calls go to
    a worker where their service is resident (or loading) with a free slot;
    a new replica is loaded -- evicting idle services, least recently used
    first -- only when the predicted wait for a resident slot is longer than
    the learned load time of the service, since a load is pure overhead for
    the action that triggers it.  Draining workers take only actions of the
    environments they already host.

Costs.  See :mod:`tangram_hpc.policy._placement`: waiting actions are kept in
heaps per placement class, so a :meth:`schedule` call costs
``O(Q + k log(Q + W))`` for Q non-empty queues, k starts and W workers.

The policy is pure: given the same calls with the same arguments it makes the
same decisions (ties break by submission order and worker registration order).
"""
from __future__ import annotations

from typing import Sequence

from ..resources import WorkerShape
from ._placement import PlacementPolicy, _Queue, _Rec, _Worker, water_level
from .predict import Predictor

__all__ = ["ElasticScheduler"]


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
    """

    def __init__(self, predictor: Predictor | None = None, *, shapes: Sequence[WorkerShape] = (),
                 aging: float = 0.5, priority_weight: float = 30.0, priority_clamp: int = 16,
                 min_gain: float = 0.02):
        if aging <= 0:
            raise ValueError("aging must be positive (it bounds the wait of every action)")
        self.aging = aging
        self.priority_weight = priority_weight
        self.priority_clamp = priority_clamp
        self.min_gain = min_gain
        super().__init__(predictor, shapes=shapes)

    def wait_bound(self, size: float, priority_gap: int) -> float:
        """Time after which no newly submitted action outranks one of ``size``.

        ``priority_gap``: how many priority levels newer actions may have above it.
        """
        gap = min(max(priority_gap, 0), 2 * self.priority_clamp)
        return (size + self.priority_weight * gap) / self.aging

    def _key(self, rec: _Rec) -> float:
        spec = rec.spec
        prio = max(-self.priority_clamp, min(self.priority_clamp, spec.priority))
        return self.predictor.predict(spec) + self.aging * rec.submit - self.priority_weight * prio

    def _grant(self, rec: _Rec, w: _Worker) -> int:
        d = rec.spec.demand
        lo = d.min_cores
        hi = min(d.max_cores, w.free_cores)
        if hi <= lo or not rec.elastic:
            return lo
        kl = self._kinds[rec.spec.kind]
        share = water_level(kl.capacity - kl.rigid, kl.by_max)
        c = max(lo, min(hi, int(share) if share != float("inf") else hi))
        if c > lo:
            # stop where the next core buys less than min_gain (Amdahl knee)
            p = self.predictor.parallel_fraction(rec.spec)
            serial = 1.0 - p
            while c > lo:
                t_c = serial + p / c
                t_less = serial + p / (c - 1)
                if (t_less - t_c) / t_c >= self.min_gain:
                    break
                c -= 1
        return c

    def _should_load(self, rec: _Rec, q: _Queue, now: float) -> bool:
        svc = rec.spec.demand.service
        reps = self._svc_replicas.get(svc)
        slots = 0
        if reps:
            per = max(1, rec.spec.demand.min_cores)
            for w in reps.values():
                if not w.draining:
                    slots += w.cores // per
        if slots == 0:
            return True
        waiting = self._svc_pending.get(svc, 1)
        rounds = -(-waiting // slots)
        est_wait = rounds * self.predictor.predict(rec.spec)
        return est_wait > self.predictor.load_time(svc)
