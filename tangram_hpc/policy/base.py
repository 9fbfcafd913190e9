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
from typing import Iterable

from ..actions import ActionSpec
from ..resources import ClusterCapacity, ResourceClass, WorkerInfo, WorkerShape

try:
    from mypy_extensions import mypyc_attr
except ImportError:     # no mypy here: the attribute matters only to the native build (tangram_hpc.native)
    def mypyc_attr(*_args, **_kw):  # type: ignore[no-redef,misc]
        return lambda cls: cls


class Assignment:
    """Start ``action_id`` on ``worker_id`` with ``cores`` cores.

    A value (compared and hashed by its fields; treat it as read-only).  A plain class rather
    than a frozen dataclass: a policy makes one per start, and in the native build a frozen
    dataclass is built by interpreted code (its generated ``__init__``), a plain class by C.
    """

    __slots__ = ("action_id", "worker_id", "cores")

    def __init__(self, action_id: str, worker_id: str, cores: int) -> None:
        self.action_id = action_id
        self.worker_id = worker_id
        self.cores = cores

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Assignment):
            return NotImplemented
        return (self.action_id == other.action_id and self.worker_id == other.worker_id
                and self.cores == other.cores)

    def __hash__(self) -> int:
        return hash((self.action_id, self.worker_id, self.cores))

    def __repr__(self) -> str:
        return f"Assignment(action_id={self.action_id!r}, worker_id={self.worker_id!r}, cores={self.cores!r})"

    def __reduce__(self) -> tuple:
        return (Assignment, (self.action_id, self.worker_id, self.cores))


@mypyc_attr(allow_interpreted_subclasses=True)    # a policy of one's own, compiled build or not
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

    def set_shapes(self, shapes: list[WorkerShape], hosted: Iterable[str] | None = None) -> None:
        """The worker shapes the pool can ever provide, and the services its service workers host
        (None: any; see :meth:`unplaceable`)."""

    def update_worker(self, worker_id: str, *, services: frozenset[str] | None = None,
                      envs: frozenset[str] | None = None, now: float = 0.0) -> None:
        """Worker-reported state: GPU-resident services, hosted environments."""

    def close_env(self, env: str) -> None:
        """The environment ended or left its worker: stop pinning its actions to a worker.

        Both drivers call it: the simulator when a trajectory ends, the coordinator when a client
        closes an environment or the environment moves off its worker (drain, a lost worker).
        """

    def env_moves(self) -> list[str]:
        """Environments to move off their worker, decided since the last call (then forgotten).

        The driver takes each one's waiting actions back (:meth:`cancel`), has its holder save it,
        calls :meth:`close_env` and submits the actions again once it is saved.  An environment
        that cannot move (it is not live on a worker) is simply left where it is.
        """
        return []

    def env_processes(self, env: str, live: bool) -> None:
        """Whether ``env`` keeps live processes on its worker (its last result said ``env_state``
        ``live``): such an environment is pinned there -- no move is asked for it -- unless the policy
        does not pin (``pin_live_envs`` off) or its worker is lost (processes cannot move)."""

    def observe_env_move(self, seconds: float) -> None:
        """How long a move took, save and restore (the coordinator sees the save and counts the
        restore as long; the simulator reports the workload's cost)."""

    @abstractmethod
    def submit(self, action: ActionSpec, now: float) -> None: ...

    @abstractmethod
    def cancel(self, action_id: str) -> bool:
        """Drop a pending action; False when it is not pending (running or unknown)."""

    @abstractmethod
    def finished(self, action_id: str, now: float, *, ok: bool = True, run_time: float | None = None) -> None:
        """A running action ended: free its resources and learn from ``run_time``."""

    def revoke(self, action_id: str, now: float) -> None:
        """Take back a start the driver could not carry out (the action's environment is not on that
        worker): free what it was given as if it had never started, and learn nothing from it.  The
        driver submits the action again or holds it.  A policy that learns from :meth:`finished`
        overrides this; the default frees the resources through it."""
        self.finished(action_id, now, ok=False)

    @abstractmethod
    def schedule(self, now: float) -> list[Assignment]: ...

    def prefetches(self, now: float) -> list[tuple[str, str]]:
        """Services to load ahead of their calls, as ``(worker id, service)``, decided after
        :meth:`schedule` (:mod:`tangram_hpc.policy.prefetch`); the driver starts each load."""
        return []

    def prefetch_counts(self) -> dict[str, int] | None:
        """Prefetches issued, used and wasted so far (None: this policy does not prefetch)."""
        return None

    @property
    @abstractmethod
    def pending_count(self) -> int: ...

    @property
    @abstractmethod
    def running_count(self) -> int: ...

    def pending_actions(self) -> list[ActionSpec]:
        """Waiting actions (for the pool policy and status views); may be costly."""
        return []

    def trajectory_done(self, trajectory: str, now: float) -> None:
        """A trajectory ended (its sandbox is gone; a trajectory-level policy frees what it held)."""

    @property
    def current_step(self) -> int | None:
        """The highest RL step (``ActionSpec.step``) submitted so far, None before any (for the pool policy)."""
        return None

    def offered_load(self, now: float) -> dict[ResourceClass, float]:
        """Cores' worth of work submitted per second lately, per resource class (for the pool policy).

        Work counts at the cores each action would run on when nothing waits,
        so a pool this large runs every action at its best core count.
        """
        return {}

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
    launched_at: float | None = None  # when the backend was asked for it (started_at - launched_at: its start-up)

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
    step: int | None = None                  # the RL step the actions now submitted belong to (highest seen)
    offered_load: dict[ResourceClass, float] | None = None  # SchedulingPolicy.offered_load(now)


@dataclass(slots=True, frozen=True)
class Launch:
    shape: WorkerShape
    count: int = 1
    reason: str = ""            # why, when it is not the actions waiting now (the driver says those)

    # a frozen dataclass of the native build unpickles (and copies) through its constructor
    def __reduce__(self) -> tuple:
        return (Launch, (self.shape, self.count, self.reason))


@dataclass(slots=True, frozen=True)
class Reclaim:
    worker_id: str
    reason: str = "idle"

    def __reduce__(self) -> tuple:
        return (Reclaim, (self.worker_id, self.reason))


@dataclass(slots=True, frozen=True)
class Withdraw:
    """Take back up to ``count`` launches of ``shape`` whose workers have not joined yet.

    The driver cancels those whose jobs still wait in the batch queue, newest first (a job
    already running is about to join and is left to the idle rule).
    """

    shape: WorkerShape
    count: int = 1
    reason: str = "no work waiting"

    def __reduce__(self) -> tuple:
        return (Withdraw, (self.shape, self.count, self.reason))


@mypyc_attr(allow_interpreted_subclasses=True)
class PoolPolicy(ABC):
    """Says which workers it wants (launches, reclaims, withdrawn launches); it does not throttle.

    The pool driver applies one launch throttle to what it asks, for every backend
    (``tangram_hpc.backends.guards.LaunchThrottle``).
    """

    #: every worker shape this policy may launch (set by a subclass's __init__)
    shapes: list[WorkerShape]

    @abstractmethod
    def decide(self, view: PoolView) -> list[Launch | Reclaim | Withdraw]: ...

    def explain(self) -> str:
        """One line on the state of the policy (e.g. why it stopped launching)."""
        return ""
