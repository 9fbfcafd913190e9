"""Orders: the key a waiting action is ranked by (smaller first) in its placement queue.

A key is computed once, at submit, and never again: the queues are plain heaps.  So an order is
a function of the action's record (and of what the order itself remembers), never of the time
at which the queues are read.

* :class:`SubmitOrder` -- first come, first served;
* :class:`ShortestFirst` -- shortest predicted run time at ``min_cores`` first;
* :class:`AgedSrpt` -- the elastic scheduler's order: shortest predicted first, with static
  aging (at a rate :class:`DrainAging` sets from the queue) and priorities (see
  :mod:`tangram_hpc.policy.elastic`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .base import mypyc_attr
from .records import ActionRecord

if TYPE_CHECKING:
    from .placement import PlacementPolicy

__all__ = ["Order", "SubmitOrder", "ShortestFirst", "AgedSrpt", "DrainAging"]


@mypyc_attr(allow_interpreted_subclasses=True)
class Order:
    """How waiting actions are ranked.  :meth:`attach` hands it the placement state it serves."""

    def attach(self, policy: PlacementPolicy) -> None:
        pass

    def key(self, rec: ActionRecord) -> float:
        raise NotImplementedError

    def worker_removed(self, worker_id: str) -> None:
        """``worker_id`` left the pool (an order that remembers something per worker forgets it)."""


@mypyc_attr(allow_interpreted_subclasses=True)
class SubmitOrder(Order):
    """First come, first served (ties cannot happen: submission numbers are unique)."""

    def key(self, rec: ActionRecord) -> float:
        return float(rec.seq)


@mypyc_attr(allow_interpreted_subclasses=True)
class ShortestFirst(Order):
    """Shortest predicted run time at ``min_cores`` first (the online predictor's estimate at submit)."""

    def key(self, rec: ActionRecord) -> float:
        return rec.time_at(rec.min_cores)


class DrainAging:
    """The aged clock of the SRPT keys: it runs at the kind's capacity over its queued actions,
    clamped to ``[floor, ceiling]`` (see "Order" in :mod:`tangram_hpc.policy.elastic`)."""

    __slots__ = ("ceiling", "floor", "clock", "at", "rate")

    def __init__(self, ceiling: float, floor: float):
        self.ceiling = ceiling
        self.floor = min(floor, ceiling)
        self.clock = 0.0
        self.at = 0.0
        self.rate = ceiling

    def stamp(self, now: float, queued: int, capacity: int) -> float:
        """The clock at ``now`` (never backwards); then the rate the queue sets from here on."""
        if now > self.at:
            self.clock += self.rate * (now - self.at)
            self.at = now
        self.rate = min(self.ceiling, max(self.floor, capacity / queued)) if queued > 0 else self.ceiling
        return self.clock


@mypyc_attr(allow_interpreted_subclasses=True)
class AgedSrpt(Order):
    """``predicted size + aged clock at submit - priority_weight * priority`` (clamped), the
    elastic scheduler's order; see "Order" in :mod:`tangram_hpc.policy.elastic` for why it
    bounds every wait.  The clock (:class:`DrainAging`) runs at the kind's capacity over its
    queued actions, between ``aging_floor`` and ``aging`` seconds of size per second of waiting
    (``aging_floor`` at ``aging`` or above: a fixed rate of ``aging``).

    ``in_class_order`` (barrier mode): an action without a hint ranks no earlier than the last
    action of its class waiting in the same queue (see :meth:`_in_class_order`).
    """

    def __init__(self, aging: float = 0.5, priority_weight: float = 30.0, priority_clamp: int = 16,
                 in_class_order: bool = False, aging_floor: float | None = None):
        floor = aging if aging_floor is None else aging_floor
        if aging <= 0 or floor <= 0:
            raise ValueError("aging and aging_floor must be positive (they bound the wait of every action)")
        self.aging = aging
        self.aged = DrainAging(aging, floor)
        self.priority_weight = priority_weight
        self.priority_clamp = priority_clamp
        self.in_class_order = in_class_order
        self._policy: PlacementPolicy | None = None
        # per (class, min_cores, host worker or ""), the last action submitted (its id and
        # submission number, not its record: a long run sees many workers, and a record holds its
        # payload) and its rank (see _in_class_order)
        self._class_last: dict[tuple[int, int, str], tuple[str, int, float]] = {}

    def attach(self, policy: PlacementPolicy) -> None:
        self._policy = policy

    def wait_bound(self, size: float, priority_gap: int) -> float:
        """Time after which no newly submitted action outranks one of ``size``.

        ``priority_gap``: how many priority levels newer actions may have above it.
        """
        gap = min(max(priority_gap, 0), 2 * self.priority_clamp)
        return (size + self.priority_weight * gap) / self.aged.floor

    def key(self, rec: ActionRecord) -> float:
        spec = rec.spec
        prio = spec.priority
        if prio > self.priority_clamp or prio < -self.priority_clamp:
            prio = max(-self.priority_clamp, min(self.priority_clamp, prio))
        kl = rec.load
        rank = rec.time_at(rec.min_cores) + self.aged.stamp(rec.submit, kl.queued, kl.capacity)
        if self.in_class_order:
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
            assert self._policy is not None
            waiting = self._policy.waiting(last[0])
            if waiting is not None and waiting.seq == last[1]:
                rank = last[2]
        self._class_last[ck] = (rec.aid, rec.seq, rank)
        return rank

    def worker_removed(self, worker_id: str) -> None:
        if self._class_last:        # (barrier mode) a long run sees many workers come and go
            self._class_last = {k: v for k, v in self._class_last.items() if k[2] != worker_id}
