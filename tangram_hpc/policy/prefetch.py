"""Prefetch: which service each GPU worker loads next, before its calls are dispatched.

Reward calls that cannot start yet (the worker's cores or slots are taken, the batch is full)
wait in the placement queues; their service's load would then start only once a call is
dispatched, after the calls ahead of it.  :class:`Prefetch` looks at those queues after each
:meth:`~tangram_hpc.policy.placement.PlacementPolicy.schedule` and tells a GPU worker to load
the service the queue needs next, so that the load overlaps with the calls running now.

The rule, for the services with waiting calls and no replica anywhere, in the order their oldest
waiting call would be placed (the order strategy's key):

* on a worker that can host it, is not draining and has no prefetch of its own still loading;
* into free GPU memory, or by evicting idle residents that no waiting call needs (by the shared
  rule, :func:`~tangram_hpc.policy.residency.choose_victims`): a service queued work needs is
  never evicted for a guess;
* where nothing can make room (memory short), nothing is prefetched.

The policy then counts the replica as loading (ready after the learned load time), so the
service's calls go there; the driver -- the coordinator (a PREFETCH message) or the simulator
(its simulated load) -- starts the load.  A prefetch is *used* when a call starts on it, *wasted*
when it is evicted or its worker leaves first.  Pure: no clock but ``now``.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from .base import mypyc_attr
from .records import WorkerRecord
from .replicas import can_host
from .residency import Resident, choose_victims

if TYPE_CHECKING:
    from .placement import PlacementPolicy

__all__ = ["Prefetch"]


@mypyc_attr(allow_interpreted_subclasses=True)
class Prefetch:
    """The prefetch decision of one placement policy (see the module docstring)."""

    def __init__(self) -> None:
        self._policy: PlacementPolicy | None = None
        self.issued = 0
        self.used = 0
        self.wasted = 0
        self._open: dict[tuple[str, str], float] = {}     # (worker id, service) -> ready at, until used or gone

    def attach(self, policy: PlacementPolicy) -> None:
        self._policy = policy

    def counts(self) -> dict[str, int]:
        """Prefetches issued, used by a call, wasted (evicted or lost unused), and still open."""
        return {"issued": self.issued, "used": self.used, "wasted": self.wasted, "open": len(self._open)}

    # -- the decision ------------------------------------------------------------------
    def decide(self, now: float) -> list[tuple[str, str]]:
        """``(worker id, service)`` loads to start now; the policy counts each replica as loading."""
        policy = self._policy
        assert policy is not None
        if not policy.tally.service_pending:
            return []
        out: list[tuple[str, str]] = []
        busy = {wid for (wid, _), ready in self._open.items() if ready > now}   # one load at a time each
        for svc, kind in self.next_needed():
            if svc in policy.replicas.where:
                continue        # a replica is there or loading: its calls wait for a slot, not a load
            w, victims = self._where(svc, kind, busy, now)
            if w is None:
                continue
            for s in victims:
                policy.replicas.evict(w, s)
            ready = now + policy.predictor.load_time(svc)
            policy.replicas.make_resident(w, svc, policy.replicas.mem(svc, 0), ready)
            self._open[(w.id, svc)] = ready
            self.issued += 1
            busy.add(w.id)
            out.append((w.id, svc))
        return out

    def next_needed(self) -> list[tuple[str, str]]:
        """The services with waiting calls, with their kind, the one whose oldest call goes first first."""
        policy = self._policy
        assert policy is not None
        heads: dict[str, tuple] = {}
        kinds: dict[str, str] = {}
        for q in policy.queues.table.values():
            svc = q.service
            if svc is None or not q.live:
                continue
            h = q.heap
            while h and h[0][2].queue is not q:     # stale entries, as the queues skip them
                heapq.heappop(h)
            if h:
                head = (h[0][0], h[0][1])
                if svc not in heads or head < heads[svc]:
                    heads[svc] = head
                    kinds[svc] = q.kind
        return [(s, kinds[s]) for s in sorted(heads, key=heads.__getitem__)]

    def _where(self, svc: str, kind: str, busy: set[str], now: float) -> tuple[WorkerRecord | None, list[str]]:
        """The worker to load ``svc`` on and what it evicts there: the fewest victims, then the most
        free memory; (None, []) when no worker has room without evicting what waiting calls need."""
        policy = self._policy
        assert policy is not None
        need = policy.replicas.mem(svc, 0)
        if need <= 0:
            return None, []      # a size not known yet: nothing to plan a load with
        pending = policy.tally.service_pending
        best: tuple | None = None
        for w in policy.workers.values():
            if (w.draining or w.id in busy or w.gpu_mem < need or kind not in w.kinds or svc in w.services
                    or not can_host(w, svc)):
                continue
            free = w.gpu_mem - w.gpu_used
            idle = [Resident(s, st.mem, 0, now - st.last_used, policy.predictor.load_time(s), 0.0)
                    for s, st in w.services.items()
                    if st.running == 0 and st.ready_at <= now and not pending.get(s)]
            victims = choose_victims(idle, need, free)
            if victims is None:
                continue         # memory short: what could go is not enough, or is waited for
            rank = (len(victims), -free, w.seq)
            if best is None or rank < best[0]:
                best = (rank, w, victims)
        if best is None:
            return None, []
        return best[1], best[2]

    # -- what became of them -------------------------------------------------------------
    def started(self, worker_id: str, service: str) -> None:
        """A call of ``service`` started on the worker: a prefetch of it there was used."""
        if self._open.pop((worker_id, service), None) is not None:
            self.used += 1

    def dropped(self, worker_id: str, service: str) -> None:
        """The replica left the worker (evicted, the worker gone) before any call used it."""
        if self._open.pop((worker_id, service), None) is not None:
            self.wasted += 1
