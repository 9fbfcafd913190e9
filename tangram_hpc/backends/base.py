"""The one interface every worker backend implements.

A backend starts worker processes somewhere (this machine, Slurm jobs),
reports what happened to them, and stops them.  The coordinator never knows
which backend it drives: it calls :meth:`WorkerBackend.launch` with a shape,
polls :meth:`WorkerBackend.poll` about once a second, and calls
:meth:`WorkerBackend.reclaim` once a worker is drained (or to cancel a job
still queued that is no longer needed).  Launches are throttled by the pool
driver, not here: a backend launches what it is asked to.

A started worker connects back to the coordinator on its own and registers
with the ``handle`` it was given (environment variable
``TANGRAM_WORKER_HANDLE``), which is how the coordinator ties a registered
worker to the job that runs it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum

from ..resources import ClusterCapacity, WorkerShape

#: The variable that carries a started worker's handle into its process.
HANDLE_ENV = "TANGRAM_WORKER_HANDLE"


class JobState(str, Enum):
    """Where a worker job is in its life (a ``str`` enum: members equal their values)."""

    PENDING = "pending"        # queued
    RUNNING = "running"
    ENDED = "ended"            # exited by itself or reclaimed
    FAILED = "failed"          # could not start, crashed, node failure
    PREEMPTED = "preempted"
    TIMEOUT = "timeout"        # hit its time limit

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]

    @property
    def live(self) -> bool:
        return self in (JobState.PENDING, JobState.RUNNING)


@dataclass(slots=True, frozen=True)
class BackendEvent:
    """A change in a worker job's life; ``state`` may be given as its string value."""

    handle: str
    state: JobState
    reason: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", JobState(self.state))   # a misspelt state fails here, not later


@dataclass(slots=True, frozen=True)
class WorkerLaunchSpec:
    """Everything a worker process needs to find and join the coordinator."""

    connection_file: str
    shape: WorkerShape
    extra_args: tuple[str, ...] = ()


class WorkerBackend(ABC):
    name: str = "abstract"

    @abstractmethod
    def launch(self, spec: WorkerLaunchSpec, count: int = 1) -> list[str]:
        """Start ``count`` workers of ``spec.shape``; return their handles."""

    @abstractmethod
    def poll(self) -> list[BackendEvent]:
        """State changes since the last poll (one cheap query for all jobs)."""

    @abstractmethod
    def reclaim(self, handle: str) -> None:
        """Stop a worker (the coordinator drains it first)."""

    def capacity(self) -> ClusterCapacity | None:
        """Free resources per partition right now, for the pool policy (None: unknown)."""
        return None

    def time_limit(self, handle: str) -> float | None:
        """Wall-clock time at which the worker's job will be killed, if known."""
        return None

    def job_id(self, handle: str) -> str | None:
        """The batch system's id of the worker's job (None: no such thing, or not submitted)."""
        return None

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker this backend started."""
