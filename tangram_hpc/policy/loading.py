"""Service loading: which replica a reward call goes to, when another replica is loaded, what it
evicts, and which services a worker starts with.

A reward call goes to a worker where its service is resident (or loading) with a free slot, the
best by :meth:`Loading.replica_rank`; with none, :meth:`Loading.should_load` says whether to load
another replica now (where, and what it evicts, is the placement state's search, by the rule of
:meth:`Loading.victims`) or to wait for a slot.

* :class:`LoadAtOnce` -- load a replica as soon as none has a slot (FIFO);
* :class:`KeepLayout` -- never load: the services stay where the pool's layout put them (a reward
  server, :class:`Layout`);
* :class:`LoadWhenWorthIt` -- the elastic scheduler's rule: load when the wait for a slot is
  longer than the load, or when the arrivals would keep the replicas busier than ``service_util``.

:class:`Layout` is the pool's side of it: the kinds a worker serves and the services it is
started with (a static layout for the baselines; for the schedulers none, or a
:class:`PlannedLayout` that only sets where loading starts from).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

from ..resources import WorkerInfo
from .base import mypyc_attr
from .records import ActionRecord, PlacementQueue, WorkerRecord
from .residency import Resident, choose_victims

if TYPE_CHECKING:
    from .placement import PlacementPolicy

__all__ = ["Loading", "LoadAtOnce", "KeepLayout", "LoadWhenWorthIt", "Layout", "PlannedLayout"]


@mypyc_attr(allow_interpreted_subclasses=True)
class Loading:
    """When to load a service replica, and which one a call goes to.  :meth:`attach` hands it the
    placement state it serves."""

    def __init__(self) -> None:
        self._policy: PlacementPolicy | None = None

    def attach(self, policy: PlacementPolicy) -> None:
        self._policy = policy

    def should_load(self, rec: ActionRecord, q: PlacementQueue, now: float) -> bool:
        """No replica of ``rec``'s service has a slot for it: load another one now?"""
        raise NotImplementedError

    def replica_rank(self, w: WorkerRecord, svc: str) -> tuple:
        """Order of preference among the replicas of ``svc`` that can take a request: ready first, least busy worker."""
        return (w.services[svc].ready_at, -w.free_cores, w.seq)

    def victims(self, w: WorkerRecord, need: int, now: float) -> list[str] | None:
        """What the worker's service manager would evict to fit ``need`` MB (the shared rule of
        :mod:`tangram_hpc.policy.residency`); None: it cannot fit."""
        free = w.gpu_mem - w.gpu_used
        if free >= need:
            return []
        policy = self._policy
        assert policy is not None
        pending = policy.tally.service_pending
        predictor = policy.predictor
        residents = [Resident(s, st.mem, pending.get(s, 0), now - st.last_used, predictor.load_time(s), 0.0)
                     for s, st in w.services.items() if st.running == 0 and st.ready_at <= now]
        return choose_victims(residents, need, free)

    def arrived(self, service: str, now: float) -> None:
        """A request for ``service`` arrived."""

    def forget(self, service: str) -> None:
        """``service`` is forgotten (an idle undeclared one): drop what is kept for it."""


@mypyc_attr(allow_interpreted_subclasses=True)
class LoadAtOnce(Loading):
    def should_load(self, rec: ActionRecord, q: PlacementQueue, now: float) -> bool:
        return True


@mypyc_attr(allow_interpreted_subclasses=True)
class KeepLayout(Loading):
    def should_load(self, rec: ActionRecord, q: PlacementQueue, now: float) -> bool:
        return False             # the reward server keeps its layout


@mypyc_attr(allow_interpreted_subclasses=True)
class LoadWhenWorthIt(Loading):
    """Load a replica when the predicted wait for a resident slot is longer than the learned load
    time (a load is pure overhead for the call that triggers it), or when the service's arrival
    rate times its service time would keep the replicas' slots busier than ``service_util`` (a
    throughput rule: a queue that has not formed yet will).

    ``rate_window_s``: time constant of the arrival-rate estimate per service.
    """

    def __init__(self, service_util: float = 0.85, rate_window_s: float = 30.0):
        super().__init__()
        self.service_util = service_util
        self.rate_window_s = rate_window_s
        self._rates: dict[str, list[float]] = {}     # service -> [rate per second, at time]

    def replica_rank(self, w: WorkerRecord, svc: str) -> tuple:
        # the replica with the smallest batch: a request's latency grows with the batch it joins
        st = w.services[svc]
        return (st.ready_at, st.running, -w.free_cores, w.seq)

    def arrived(self, service: str, now: float) -> None:
        r = self._rates.get(service)
        if r is None:
            self._rates[service] = [1.0 / self.rate_window_s, now]
            return
        r[0] = r[0] * math.exp(-(now - r[1]) / self.rate_window_s) + 1.0 / self.rate_window_s
        r[1] = now

    def forget(self, service: str) -> None:
        self._rates.pop(service, None)

    def arrival_rate(self, service: str, now: float) -> float:
        """Requests per second for ``service`` lately (exponentially decaying count)."""
        r = self._rates.get(service)
        if r is None:
            return 0.0
        return r[0] * math.exp(-max(0.0, now - r[1]) / self.rate_window_s)

    def should_load(self, rec: ActionRecord, q: PlacementQueue, now: float) -> bool:
        policy = self._policy
        assert policy is not None
        svc = rec.service
        assert svc is not None
        reps = policy.replicas.where.get(svc)
        slots = 0
        if reps:
            per = max(1, rec.min_cores)
            info = policy.replicas.info.get(svc)
            batch = info.max_batch if info is not None and info.max_batch else 1 << 30
            for w in reps.values():
                if not w.draining:
                    slots += min(w.cores // per, batch)
        if slots == 0:
            return True
        service_s = rec.time_at(rec.min_cores)
        if self.arrival_rate(svc, now) * service_s > self.service_util * slots:
            return True        # throughput: the replicas cannot keep up with the arrivals
        waiting = policy.tally.service_pending.get(svc, 1)
        rounds = -(-waiting // slots)
        return rounds * service_s > policy.predictor.load_time(svc)


@mypyc_attr(allow_interpreted_subclasses=True)
class Layout:
    """The workers as they come: the kinds they say they serve, the services they are started with."""

    def admit(self, info: WorkerInfo) -> WorkerInfo:
        """The worker as placed (a layout may narrow the kinds it serves)."""
        return info

    def starts_with(self, info: WorkerInfo) -> frozenset[str]:
        """The services the (admitted) worker is placed with as resident, loading from its start:
        those it is configured with (``info.services``, which also says what it may host)."""
        return info.services

    def preloaded(self, worker_id: str) -> list[str] | None:
        """The services the layout loads on ``worker_id`` before the run (None: no layout)."""
        return None


@mypyc_attr(allow_interpreted_subclasses=True)
class PlannedLayout(Layout):
    """GPU workers start with their share of a planned layout instead of the services they are
    configured with: the ``i``-th GPU worker to join gets ``plan[i]`` (round robin past the end),
    e.g. weighted by expected demand (:func:`~tangram_hpc.sim.layout.service_layout`).  Only the
    start: the worker may still host any service it is configured with, and loads and evictions
    go on as usual from there (the services the placement state knows that fit, in its order)."""

    def __init__(self, plan: Sequence[Sequence[str]]):
        if not plan:
            raise ValueError("a planned layout needs at least one worker's services")
        self._plan = [list(h) for h in plan]
        self.shares: dict[str, list[str]] = {}      # GPU worker -> its share of the plan

    def starts_with(self, info: WorkerInfo) -> frozenset[str]:
        if not info.gpus:
            return info.services
        mine = self.shares.get(info.id)
        if mine is None:
            mine = self.shares[info.id] = self._plan[len(self.shares) % len(self._plan)]
        return frozenset(mine)
