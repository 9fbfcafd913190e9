"""Interfaces of the pure policies.

The live coordinator and the simulator drive the *same* policy objects
through these methods, with the clock passed in as ``now``: a policy does no
I/O and reads no clock of its own, so a simulated result is a result about
the product.

Two policies exist side by side:

* a :class:`SchedulingPolicy` decides which pending action starts on which
  worker with how many cores;
* a :class:`PoolPolicy` decides how many workers of which shape to ask the
  backend for and which idle ones to give back.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from ..actions import ActionSpec
from ..resources import ClusterCapacity, WorkerInfo, WorkerShape


@dataclass(slots=True, frozen=True)
class Assignment:
    """Start ``action_id`` on ``worker_id`` with ``cores`` cores."""

    action_id: str
    worker_id: str
    cores: int


class SchedulingPolicy(ABC):
    """Places actions on workers.  Owns the resource accounting of its decisions.

    Event methods are called by the driver (coordinator or simulator) in the
    order events happen; :meth:`schedule` returns the starts to make now.  A
    running action's resources are held until :meth:`finished` or
    :meth:`remove_worker`.  On worker loss the driver resubmits the lost
    actions with :meth:`submit` (a new attempt).
    """

    @abstractmethod
    def add_worker(self, info: WorkerInfo, now: float) -> None: ...

    @abstractmethod
    def remove_worker(self, worker_id: str, now: float) -> list[str]:
        """Forget a worker; return the ids of the actions that were running on it."""

    @abstractmethod
    def set_draining(self, worker_id: str, draining: bool) -> None:
        """A draining worker gets no new actions (scale-down, time limit)."""

    def set_shapes(self, shapes: list[WorkerShape]) -> None:
        """The worker shapes the pool can ever provide (see :meth:`unplaceable`)."""

    def update_worker(self, worker_id: str, *, services: frozenset[str] | None = None,
                      envs: frozenset[str] | None = None, now: float = 0.0) -> None:
        """Worker-reported state: GPU-resident services, hosted environments."""

    def close_env(self, env: str) -> None:
        """The environment ended or left its worker: stop pinning its actions to a worker.

        Both drivers call it: the simulator when a trajectory ends, the coordinator when a client
        closes an environment or the environment moves off its worker (drain, a lost worker).
        """

    @abstractmethod
    def submit(self, action: ActionSpec, now: float) -> None: ...

    @abstractmethod
    def cancel(self, action_id: str) -> bool:
        """Drop a pending action; False when it is not pending (running or unknown)."""

    @abstractmethod
    def finished(self, action_id: str, now: float, *, ok: bool = True, run_time: float | None = None) -> None:
        """A running action ended: free its resources and learn from ``run_time``."""

    @abstractmethod
    def schedule(self, now: float) -> list[Assignment]: ...

    @property
    @abstractmethod
    def pending_count(self) -> int: ...

    @property
    @abstractmethod
    def running_count(self) -> int: ...

    def pending_actions(self) -> list[ActionSpec]:
        """Waiting actions (for the pool policy and status views); may be costly."""
        return []

    def unplaceable(self, now: float) -> list[tuple[str, str]]:
        """Pending actions no current or future worker shape can run, with why.

        The driver fails them with a clear error instead of holding them forever.
        """
        return []


def light_capacity(info: WorkerInfo) -> int:
    """How many zero-core actions a worker may hold at once.

    An action with ``min_cores == 0`` binds no core: a cheap Python call, an
    I/O-bound tool call, a reward-model request that the service batches.  Such
    actions are pipelined to workers (the worker runs them on its I/O side), so
    their rate is not capped by the number of cores; this bound keeps one worker
    from hoarding them.
    """
    return 64 + 32 * max(1, info.cores)


# -- pool sizing -------------------------------------------------------------

@dataclass(slots=True)
class WorkerStatus:
    info: WorkerInfo
    busy_cores: int = 0
    running: int = 0
    idle_since: float | None = None
    envs: int = 0
    draining: bool = False
    started_at: float = 0.0
    ends_at: float | None = None   # backend time limit, if any
    shape: WorkerShape | None = None  # the shape it was launched as, when a backend launched it

    @property
    def launched_shape(self) -> WorkerShape:
        return self.shape or self.info.shape


@dataclass(slots=True)
class PoolView:
    """What the pool policy sees at one decision point."""

    now: float
    pending: list[ActionSpec]
    workers: list[WorkerStatus]
    starting: list[tuple[WorkerShape, float]] = field(default_factory=list)  # (shape, requested at)
    failures: list[tuple[float, str]] = field(default_factory=list)          # (time, reason) of failed starts
    cluster: ClusterCapacity | None = None   # what the batch system could start now, when the backend knows


@dataclass(slots=True, frozen=True)
class Launch:
    shape: WorkerShape
    count: int = 1


@dataclass(slots=True, frozen=True)
class Reclaim:
    worker_id: str
    reason: str = "idle"


class PoolPolicy(ABC):
    #: every worker shape this policy may launch
    shapes: list[WorkerShape]

    @abstractmethod
    def decide(self, view: PoolView) -> list[Launch | Reclaim]: ...

    def explain(self) -> str:
        """One line on the state of the policy (e.g. why it stopped launching)."""
        return ""


class StaticPool(PoolPolicy):
    """Keep a fixed set of workers: launch them, replace lost ones, give back extras.

    After failed starts it waits before trying again, doubling the wait up to
    ``max_backoff_s``, so a broken worker command does not spawn a process a second.
    """

    def __init__(self, shapes: list[WorkerShape], *, first_backoff_s: float = 1.0, max_backoff_s: float = 60.0):
        self.shapes = list(shapes)
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self._note = ""

    def decide(self, view: PoolView) -> list[Launch | Reclaim]:
        want: dict[WorkerShape, int] = {}
        for s in self.shapes:
            want[s] = want.get(s, 0) + 1
        have: dict[WorkerShape, list[WorkerStatus]] = {}
        for w in view.workers:
            have.setdefault(w.launched_shape, []).append(w)
        starting: dict[WorkerShape, int] = {}
        for shape, _ in view.starting:
            starting[shape] = starting.get(shape, 0) + 1
        out: list[Launch | Reclaim] = []
        # A worker declared lost that comes back (a resumed hang) makes one too many: give back an idle one.
        for shape, ws in have.items():
            extra = len(ws) + starting.get(shape, 0) - want.get(shape, 0)
            for w in [w for w in ws if not w.running and not w.draining][:max(0, extra)]:
                out.append(Reclaim(w.info.id, "more workers than the pool keeps"))
        wait = self._backoff(view)
        self._note = f"backing off {wait:.0f}s after {self._streak(view)} failed starts" if wait else "ok"
        if wait:
            return out
        for shape, n in want.items():
            missing = n - len(have.get(shape, [])) - starting.get(shape, 0)
            if missing > 0:
                out.append(Launch(shape, missing))
        return out

    def _streak(self, view: PoolView) -> int:
        """Failed starts since the last worker registered."""
        last_ok = max((w.started_at for w in view.workers), default=0.0)
        return sum(1 for t, _ in view.failures if t > last_ok)

    def _backoff(self, view: PoolView) -> float:
        n = self._streak(view)
        if not n:
            return 0.0
        last = max(t for t, _ in view.failures)
        delay = min(self.max_backoff_s, self.first_backoff_s * 2 ** (n - 1))
        return max(0.0, last + delay - view.now)

    def explain(self) -> str:
        return self._note
