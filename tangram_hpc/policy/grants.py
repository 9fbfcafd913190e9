"""Grants: how many cores an action gets.

Cores are granted in two phases.  Every start of a :meth:`~PlacementPolicy.schedule` call first
takes ``min_cores``; once everything placeable has started, elastic starts grow to their grant
(:meth:`Grant.grow`), which sees what is still waiting (:func:`~tangram_hpc.policy.queues.waiting_for`).  So
the cores the waiting work could use are not handed out before it had its chance.

* :class:`Grant` -- every action at ``min_cores``;
* :class:`AtMaxCores` -- every elastic action rigid at its ``max_cores`` (it waits until that
  many cores are free on one worker);
* :class:`GreedyGrant` -- every elastic action grows to what is free on its worker (a baseline);
* :class:`ElasticGrant` -- the elastic scheduler's load-dependent shares (see "Cores" and
  "Barriers" in :mod:`tangram_hpc.policy.elastic`).

:func:`reserve` is the rule by which a worker keeps cores out of elastic grants for its
environments' fixed-size actions.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar, Final

from ..actions import ActionSpec, Demand
from .base import mypyc_attr
from .capacity import wait_for_cores
from .queues import waiting_for
from .records import RUNNING, ActionRecord, WorkerRecord, water_level

if TYPE_CHECKING:
    from .placement import PlacementPolicy

__all__ = ["Grant", "AtMaxCores", "GreedyGrant", "ElasticGrant", "reserve", "rigid_change", "RIGID_WINDOW_S",
           "RIGID_RESERVE_CORES"]

#: Time constant (seconds) of a worker's average of the cores its environments' fixed-size actions use.
RIGID_WINDOW_S: Final = 60.0
#: The fewest cores a worker keeps out of elastic grants for its environments' fixed-size actions,
#: once they use any (see reserve).
RIGID_RESERVE_CORES: Final = 1


def rigid_change(w: WorkerRecord, delta: int, now: float) -> None:
    """The cores ``w``'s environments' fixed-size actions use change by ``delta`` at ``now``
    (their time average follows the use until now first)."""
    dt = now - w.rigid_at
    if dt > 0:
        w.rigid_avg += (1.0 - math.exp(-dt / RIGID_WINDOW_S)) * (w.rigid_env - w.rigid_avg)
        w.rigid_at = now
    w.rigid_env += delta


def reserve(w: WorkerRecord, now: float) -> int:
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
    if most < RIGID_RESERVE_CORES:
        return 0
    rigid_change(w, 0, now)        # the average brought up to now
    avg = w.rigid_avg
    if avg < 0.5:
        return 0
    return min(most, max(RIGID_RESERVE_CORES, int(math.sqrt(avg) + 0.5)))


@mypyc_attr(allow_interpreted_subclasses=True)
class Grant:
    """Every action at ``min_cores``.  :meth:`attach` hands it the placement state it serves."""

    def __init__(self) -> None:
        self._policy: PlacementPolicy | None = None

    def attach(self, policy: PlacementPolicy) -> None:
        self._policy = policy

    def shape(self, action: ActionSpec) -> ActionSpec:
        """The action as placed (a rigid size rewrites its demand); called once, at submit."""
        return action

    def best_cores(self, rec: ActionRecord) -> int:
        """Cores the action would run on with nothing waiting (for the offered load)."""
        return max(1, rec.min_cores)

    def startable(self, rec: ActionRecord, w: WorkerRecord, now: float) -> bool:
        """Whether an elastic action should start on ``w`` now rather than wait there for more cores."""
        return True

    def grant(self, rec: ActionRecord, w: WorkerRecord) -> int:
        """Cores for an elastic action that started on ``w`` (``min_cores`` there), to grow to."""
        return rec.min_cores

    def grow(self, grow: list[tuple[ActionRecord, WorkerRecord]]) -> None:
        """Second phase: the elastic starts of this call grow towards their grants (:meth:`grant`).

        Per worker, the free cores go one at a time to the start whose predicted
        run time the next core shortens most (Amdahl: ``d1 p / (c (c + 1))``), so
        a long parallel action is not left with the crumbs of shorter ones
        started in the same call.
        """
        policy = self._policy
        assert policy is not None
        tally = policy.tally
        by_worker: dict[str, list[ActionRecord]] = {}
        for rec, on in grow:
            if rec.state is RUNNING and rec.worker is on:
                by_worker.setdefault(on.id, []).append(rec)
        for recs in by_worker.values():
            w = recs[0].worker
            assert w is not None
            if len(recs) == 1:
                rec = recs[0]
                extra = min(self.grant(rec, w), rec.max_cores) - rec.cores
                if 0 < extra <= w.free_cores:
                    tally.regranted(rec, w, extra)
                continue
            heap = []
            for rec in recs:
                cap = min(self.grant(rec, w), rec.max_cores)
                if cap > rec.cores:
                    # one more core than c saves d1 * p / (c (c + 1)) seconds (Amdahl)
                    scale = rec.d1 * rec.p
                    c = rec.cores
                    heap.append((-scale / (c * (c + 1)), rec.seq, rec, cap, scale))
            heapq.heapify(heap)
            keep = reserve(w, recs[0].started)
            while heap and w.free_cores > keep:
                _, _, rec, cap, scale = heapq.heappop(heap)
                tally.regranted(rec, w, 1)
                c = rec.cores
                if c < cap:
                    heapq.heappush(heap, (-scale / (c * (c + 1)), rec.seq, rec, cap, scale))


@mypyc_attr(allow_interpreted_subclasses=True)
class AtMaxCores(Grant):
    """Every elastic action at its ``max_cores``, as a rigid size: it waits until that many cores
    are free on one worker (the baseline of a user who sizes every sandbox for the largest run)."""

    def __init__(self) -> None:
        super().__init__()
        self._rigid: dict[Demand, Demand] = {}

    def shape(self, action: ActionSpec) -> ActionSpec:
        d = action.demand
        if d.max_cores > d.min_cores and d.min_cores > 0:
            rigid = self._rigid.get(d)
            if rigid is None:
                rigid = self._rigid[d] = replace(d, min_cores=d.max_cores)
            return replace(action, demand=rigid)
        return action


@mypyc_attr(allow_interpreted_subclasses=True)
class GreedyGrant(Grant):
    """Every elastic action grows to all it can use of what is free on its worker (up to its
    ``max_cores``), whatever waits: the baseline of a greedy elastic pool."""

    def grant(self, rec: ActionRecord, w: WorkerRecord) -> int:
        return min(rec.max_cores, rec.cores + w.free_cores)


@mypyc_attr(allow_interpreted_subclasses=True)
class ElasticGrant(Grant):
    """Load-dependent elastic shares (water-filling, cut at the Amdahl knee and by the queue).

    ``min_gain``: smallest relative speedup one more core must bring to be granted.
    ``barriers``: synchronous rollouts (see "Barriers" in :mod:`tangram_hpc.policy.elastic`).
    """

    #: Barrier mode: an elastic action is weighed as if it were its turn's straggler, this many
    #: standard deviations of its class's log durations above the median (see _startable_at_barrier).
    BARRIER_TAIL_Z: ClassVar[float] = 3.0

    def __init__(self, min_gain: float = 0.005, barriers: bool = False):
        super().__init__()
        self.min_gain = min_gain
        self.barriers = barriers
        # barrier mode: worker id -> cores promised to this schedule() call's elastic starts there,
        # beyond the min_cores they took
        self._promised: dict[str, int] = {}

    def grant(self, rec: ActionRecord, w: WorkerRecord) -> int:
        hi = min(rec.max_cores, rec.cores + max(0, w.free_cores - reserve(w, rec.started)))
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
        queued, drain, held = waiting_for(rec, w)
        if held:
            # memory is scheduled too: where it binds, the actions it holds back do not share these
            # cores now (they would idle meanwhile): only those running here and those that fit do
            sharing = queued + (rec.worker is not w)
            for r in w.running.values():
                sharing += r.elastic
            share = w.cores / max(1, sharing)
        else:
            share = water_level(kl.capacity - rigid, kl.by_max)
        c = max(lo, min(hi, int(share) if share != float("inf") else hi))
        if c <= lo:
            return lo
        c = self._knee(rec.p, lo, c)
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

    def startable(self, rec: ActionRecord, w: WorkerRecord, now: float) -> bool:
        # Grants are final, so an elastic action that would start on the leftovers of a busy worker
        # (a long final test run on one core, on the critical path of the step) waits there for
        # the cores it should have -- when the time they save it exceeds the expected wait.
        free = w.free_cores
        most = max(rec.min_cores, min(rec.max_cores, w.cores - reserve(w, now)))
        target = self._cores_for(rec, w, most, later=True)
        rec.target = target
        if self.barriers:
            return self._startable_at_barrier(rec, w, free, target, now)
        if free >= target:
            return True
        # expected times, not medians: durations are heavy-tailed, and the long ones are the ones
        # that decide a step's end
        gain = (rec.time_at(max(free, rec.min_cores)) - rec.time_at(target)) * rec.tail
        return gain <= wait_for_cores(w, target - free, now)

    def _startable_at_barrier(self, rec: ActionRecord, w: WorkerRecord, free: int, target: int,
                              now: float) -> bool:
        """Barrier mode: a turn ends with its slowest action, and any long elastic action of a burst
        may be it.  The cores promised to this call's earlier elastic starts on ``w`` are theirs
        (:meth:`grow` gives them first), and an action that finds fewer than its target
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
            if gain > wait_for_cores(w, target - free, now):
                return False
            target = rec.target = max(free, lo)
        self._promised[w.id] = promised + target - lo
        return True

    def grow(self, grow: list[tuple[ActionRecord, WorkerRecord]]) -> None:
        if self.barriers:
            # each elastic start first gets the cores it waited for (the cores kept for commands
            # too: it was judged worth them), then the rest is shared as without barriers
            policy = self._policy
            assert policy is not None
            self._promised.clear()
            for rec, on in grow:
                if rec.state is RUNNING and rec.worker is on:
                    extra = min(rec.target, on.free_cores + rec.cores) - rec.cores
                    if extra > 0:
                        policy.tally.regranted(rec, on, extra)
        super().grow(grow)

    def best_cores(self, rec: ActionRecord) -> int:
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
