"""Environment moves: when to ask the driver to move an environment to another worker.

An environment pins its actions to one worker, so a worker whose cores are all taken makes them
wait while other workers idle.  :class:`EnvMoves` never moves one (every environment stays where
its first action started); :class:`MoveWhenSooner` asks for moves by two rules:

* when the head of a worker's env queue cannot start there, it compares its predicted finish
  there (the wait for cores, from the running actions' predicted ends, plus its run time) with
  moving the environment to the worker with the most free cores (the move's cost plus its run
  time there), and asks for the move when that is sooner (:meth:`MoveWhenSooner.consider`);
* moving is cheaper still while nobody waits for the environment: when an action ends on a
  crowded worker (its own queue has actions waiting for cores, or it could not give the kind's
  widest elastic action its grant), its environment is moved off while its agent thinks, if fewer
  than ``REBALANCE_EARLY_SHARE`` of the next actions would come before the move is done (think
  times, the gaps between an environment's actions, learned as lognormal: they are long-tailed,
  and a mean says too little) and another worker has clearly more free cores
  (:meth:`MoveWhenSooner.ended`).

Only an environment with nothing running is moved.  The driver carries a move out like a drain
does for one environment: it takes the environment's waiting actions back, has the holder save
it, calls :meth:`~PlacementPolicy.close_env`, and submits them again once it is saved; the next
worker restores it.  :meth:`~PlacementPolicy.observe_env_move` keeps the cost estimate honest.
"""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import TYPE_CHECKING, ClassVar

from .base import mypyc_attr
from .capacity import wait_for_cores
from .grants import RIGID_RESERVE_CORES, reserve
from .records import ActionRecord, EnvState, Need, WorkerRecord

if TYPE_CHECKING:
    from .placement import PlacementPolicy

__all__ = ["EnvMoves", "MoveWhenSooner"]

_ONE_CORE = Need(1, 0, 0, None)


@mypyc_attr(allow_interpreted_subclasses=True)
class EnvMoves:
    """Environments stay where their first action started.  :meth:`attach` hands a strategy the
    placement state it serves."""

    #: predicted seconds to move an environment (save, restore); None: environments stay put
    move_s: float | None = None

    def attach(self, policy: PlacementPolicy) -> None:
        pass

    def consider(self, rec: ActionRecord, w: WorkerRecord, now: float) -> bool:
        """``rec``, the head of ``w``'s env queue, cannot start there now (or only on fewer cores
        than it could use): ask to move its environment?  Returns whether it asked."""
        return False

    def resumed(self, es: EnvState, now: float) -> None:
        """An action of ``es`` was submitted after its last one ended (``es.idle``): its agent's think time."""

    def ended(self, kind: str, es: EnvState, w: WorkerRecord, now: float) -> None:
        """An action of ``es`` (of ``kind``) ended on ``w``, its host: move it while its agent thinks?"""

    def take(self) -> list[str]:
        """The environments asked to move since the last call (the driver's ``env_moves``)."""
        return []

    def observe(self, seconds: float) -> None:
        """A move took ``seconds`` (save and restore)."""


@mypyc_attr(allow_interpreted_subclasses=True)
class MoveWhenSooner(EnvMoves):
    """Move an environment when its next action would finish sooner elsewhere, the move included,
    or while its agent thinks, off a crowded worker (see the module docstring).

    ``move_s``: predicted seconds to move an environment (save and restore), learned from the moves seen.
    """

    #: An environment leaves a crowded worker only for one with at least this many more free cores.
    REBALANCE_MARGIN_CORES: ClassVar[int] = 8
    #: ... and, while its agent thinks, only if fewer than this share of the next actions would come
    #: before the move is done (think times learned as lognormal).
    REBALANCE_EARLY_SHARE: ClassVar[float] = 0.15
    #: The spread (variance of log seconds) assumed for think times until gaps are seen.
    THINK_PRIOR_VAR: ClassVar[float] = 0.5

    def __init__(self, move_s: float):
        if move_s < 0:
            raise ValueError("env_move_s must be >= 0 (or None: environments never move)")
        self.move_s = move_s
        self._policy: PlacementPolicy | None = None
        self._moves: list[str] = []
        # the gaps between an environment's actions (its agent's think time): [mean, variance] of their
        # logs and how many were seen; and the gap that only REBALANCE_EARLY_SHARE of them are under
        self._think: list[float] | None = None
        self._quick_think_s: float | None = None
        self._early_z = NormalDist().inv_cdf(self.REBALANCE_EARLY_SHARE)

    def attach(self, policy: PlacementPolicy) -> None:
        self._policy = policy

    def _movable(self, es: EnvState, w: WorkerRecord) -> bool:
        """The environment lives on ``w``, is not asked to move yet, nothing runs in it (a move
        would wait for its copy to be free anyway) and it keeps no live processes there (pinned)."""
        return es.busy == 0 and es.host is w and not es.pinned and es.name not in self._moves

    def consider(self, rec: ActionRecord, w: WorkerRecord, now: float) -> bool:
        """Ask to move ``rec``'s environment off ``w``, its host, when ``rec`` would finish sooner on
        the worker with the most free cores, the move included, than on ``w`` (now on what is free
        there, or after waiting for cores).  Returns whether it asked."""
        es = rec.envst
        if es is None or not self._movable(es, w):
            return False
        lo, free, tail = rec.min_cores, w.free_cores, rec.tail
        move_s = self.move_s
        assert move_s is not None
        # its finish here: at its minimum cores after the wait for them, or (elastic) now on
        # what is free here
        here = wait_for_cores(w, lo - free, now) + rec.time_at(lo) * tail
        if rec.elastic and free > lo:
            here = min(here, rec.time_at(min(free, rec.max_cores)) * tail)
        # no worker can make the move pay, even at its most cores: spare the search for one
        if move_s + rec.time_at(rec.max_cores if rec.elastic else lo) * tail >= here:
            return False
        policy = self._policy
        assert policy is not None
        there = policy.capacity.best(rec.kind, rec)
        if there is None or there is w:
            return False
        c = max(lo, min(rec.max_cores, there.free_cores)) if rec.elastic else lo
        moved = move_s + rec.time_at(c) * tail
        if rec.elastic and c > free and moved < here:
            # or here on as many cores as it would get there, after the wait for them
            here = min(here, wait_for_cores(w, c - free, now) + rec.time_at(c) * tail)
        if moved < here:
            self._moves.append(es.name)
            return True
        return False

    def resumed(self, es: EnvState, now: float) -> None:
        self._learn_think(now - es.idle)

    def _learn_think(self, gap: float) -> None:
        """One more gap between an environment's actions: update the log-normal fit of think times."""
        y = math.log(max(gap, 1e-3))
        t = self._think
        if t is None:
            t = self._think = [y, self.THINK_PRIOR_VAR, 1.0]
        else:
            t[2] += 1.0
            a = max(0.05, 1.0 / t[2])        # the plain mean while few gaps are known, then a moving one
            d = y - t[0]
            t[0] += a * d
            t[1] = (1.0 - a) * (t[1] + a * d * d)
        self._quick_think_s = math.exp(t[0] + self._early_z * math.sqrt(t[1]))

    def ended(self, kind: str, es: EnvState, w: WorkerRecord, now: float) -> None:
        """An action of environment ``es`` ended on ``w``, a crowded worker: one whose own queue has actions
        waiting for cores, or whose free cores could not give the kind's widest elastic action its
        grant (the environment's next action may be one).  Move it while its agent thinks,
        when the move is done before all but a few next actions come (think times are long-tailed:
        a quarter of the math preset's are shorter than half their mean) and another worker has
        clearly more free cores (its next action goes there)."""
        move_s = self.move_s
        if w.draining or self._quick_think_s is None or move_s is None or move_s >= self._quick_think_s:
            return
        policy = self._policy
        assert policy is not None
        if not w.env_live:
            need = min(w.cores, policy.kind_load(kind).widest)
            free = w.free_cores
            if need == 0 or free > need + RIGID_RESERVE_CORES or free - reserve(w, now) >= need:
                return          # roomy: it can give the widest grant, the core for commands aside
        if not self._movable(es, w):
            return
        there = policy.capacity.best(kind, _ONE_CORE)
        if there is not None and there is not w and there.free_cores >= w.free_cores + self.REBALANCE_MARGIN_CORES:
            self._moves.append(es.name)

    def take(self) -> list[str]:
        out = self._moves
        if out:             # asked after every schedule(): no new list while there is nothing to move
            self._moves = []
        return out

    def observe(self, seconds: float) -> None:
        if self.move_s is not None and seconds >= 0:
            self.move_s = 0.8 * self.move_s + 0.2 * seconds
