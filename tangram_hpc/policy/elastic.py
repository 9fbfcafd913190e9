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
    most ``2 * priority_clamp`` levels).

    The rate follows the queue (:class:`~tangram_hpc.policy.order.DrainAging`): ``aging * submit_time``
    is an aged clock that runs at ``capacity / queued`` predicted seconds per
    second (the kind's cores over its waiting actions), between
    ``aging_floor`` and ``aging`` (0.001 and 0.005 by default: on generated
    families of workloads a ceiling of 0.05 lost fewer runs to shortest-first
    baselines than 0.5, and 0.005 fewer again on three family seeds, a few more
    to first-come-first-served ones on step time; the presets moved by under
    1 %; see docs/scheduler.md).  Below a queue of ``capacity / aging`` actions
    the ceiling sets the rate.  Waiting one drain time of the queue (its
    work over its capacity) is then worth one mean queued size: in a burst of
    thousands of short actions sizes still decide (shortest first), where a
    fixed rate would let waiting dominate and serve them first come first
    served; with a short queue the rate is ``aging``.  Keys stay static (the
    clock only moves forward), and the wait bound holds at ``aging_floor``.
    Priorities are folded in as a head
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
    (:func:`~tangram_hpc.policy.grants.reserve`).

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

As a set of strategies (:mod:`tangram_hpc.policy.placement`): the order is
:class:`~tangram_hpc.policy.order.AgedSrpt`, the cores
:class:`~tangram_hpc.policy.grants.ElasticGrant`, the service loading
:class:`~tangram_hpc.policy.loading.LoadWhenWorthIt`, and environments move by
:class:`~tangram_hpc.policy.moves.MoveWhenSooner` when ``env_move_s`` is set.

Costs.  See :mod:`tangram_hpc.policy.queues`: waiting actions are kept in
heaps per placement class, so a :meth:`schedule` call costs
``O(Q + k log(Q + W))`` for Q non-empty queues, k starts and W workers.

The policy is pure: given the same calls with the same arguments it makes the
same decisions (ties break by submission order and worker registration order).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from ..resources import ServiceInfo, WorkerShape
from .base import mypyc_attr
from .grants import ElasticGrant
from .loading import LoadWhenWorthIt, PlannedLayout
from .prefetch import Prefetch
from .order import AgedSrpt
from .placement import PlacementPolicy
from .predict import Predictor

__all__ = ["ElasticScheduler"]


@mypyc_attr(allow_interpreted_subclasses=True)
class ElasticScheduler(PlacementPolicy):
    """SRPT-with-aging order, load-dependent elastic core shares, residency-aware placement.

    Parameters
    ----------
    predictor: shared duration/speedup model (a fresh one by default).
    shapes: worker shapes the pool can provide (for :meth:`unplaceable`).
    aging: seconds of predicted size one second of waiting is worth, at most.
    aging_floor: ... at least, however long the queue (see :class:`~tangram_hpc.policy.order.DrainAging`); ``aging`` or
        more keeps the rate fixed at ``aging``.
    priority_weight: seconds of head start per priority level.
    priority_clamp: priority levels beyond this count as this.
    min_gain: smallest relative speedup one more core must bring to be granted.
    services: the run's reward-model services (sizes, batch limits, load times).
    service_util: busiest a service's replicas may run (arrival rate x
        service time / slots) before another replica is loaded.
    rate_window_s: time constant of the arrival-rate estimate per service.
    env_move_s: predicted seconds to move an environment to another worker
        (save and restore); None keeps every environment where it started
        (see :mod:`tangram_hpc.policy.moves`).
    gpu_layout: the services each GPU worker should start with, one list per worker in the order
        they join (round robin past the end), e.g. weighted by expected demand
        (:func:`~tangram_hpc.sim.layout.service_layout`); None: the declared services that fit, in
        the order given.  Loads and evictions go on as usual from there (:class:`PlannedLayout`).
    barriers: the rollouts are synchronous -- a turn starts only when every
        trajectory finished the one before (per-turn barriers), so a turn ends
        with its slowest action.  The user's RL loop decides this and the
        scheduler cannot see it; set it for such loops.  Then an elastic action
        waits for the cores it is judged worth rather than start on a worker's
        leftovers, the elastic starts of one :meth:`schedule` call on a worker
        each get theirs before the rest is shared, and actions of one class
        keep their submission order (see "Barriers" in the module docstring).
    """

    def __init__(self, predictor: Predictor | None = None, *, shapes: Sequence[WorkerShape] = (),
                 services: Mapping[str, ServiceInfo] | None = None,
                 aging: float = 0.005, aging_floor: float = 0.001, priority_weight: float = 30.0,
                 priority_clamp: int = 16,
                 min_gain: float = 0.005, service_util: float = 0.85, rate_window_s: float = 30.0,
                 pipeline_below_s: float | None = None, env_move_s: float | None = None,
                 barriers: bool = False, gpu_layout: Sequence[Sequence[str]] | None = None,
                 prefetch: Prefetch | None = None):
        self.barriers = barriers
        super().__init__(predictor, shapes=shapes, services=services, pipeline_below_s=pipeline_below_s,
                         env_move_s=env_move_s,
                         order=AgedSrpt(aging, priority_weight, priority_clamp, in_class_order=barriers,
                                        aging_floor=aging_floor),
                         grant=ElasticGrant(min_gain, barriers), loading=LoadWhenWorthIt(service_util, rate_window_s),
                         layout=PlannedLayout(gpu_layout) if gpu_layout else None, prefetch=prefetch)

    def wait_bound(self, size: float, priority_gap: int) -> float:
        """Time after which no newly submitted action outranks one of ``size`` (:meth:`AgedSrpt.wait_bound`)."""
        order = self.order
        assert isinstance(order, AgedSrpt)
        return order.wait_bound(size, priority_gap)

    def planned_services(self, worker_id: str) -> list[str] | None:
        """What a GPU worker starts with under ``gpu_layout``: its share that the placement state
        made resident (None: no layout, or not such a worker; the simulator loads this)."""
        layout = self.layout
        if not isinstance(layout, PlannedLayout) or worker_id not in layout.shares:
            return None
        w = self.workers.get(worker_id)
        return list(w.services) if w is not None else list(layout.shares[worker_id])

    def arrival_rate(self, service: str, now: float) -> float:
        """Requests per second for ``service`` lately (:meth:`LoadWhenWorthIt.arrival_rate`)."""
        loading = self.loading
        assert isinstance(loading, LoadWhenWorthIt)
        return loading.arrival_rate(service, now)
