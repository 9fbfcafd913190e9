"""Descriptions of worker resources shared by the policies, the backends and the wire."""
from __future__ import annotations

from dataclasses import dataclass, field

from .actions import BUILTIN_KINDS


@dataclass(slots=True, frozen=True)
class WorkerShape:
    """What one worker job asks a backend for.

    ``gpus`` whole GPUs of ``gpu_mem_mb`` each.  ``partition`` is a backend
    hint (a Slurm partition); the local backend ignores it.
    """

    cores: int
    mem_mb: int = 0
    gpus: int = 0
    gpu_mem_mb: int = 0
    partition: str | None = None

    @property
    def kind(self) -> str:
        return "gpu" if self.gpus else "cpu"


@dataclass(slots=True)
class WorkerInfo:
    """A registered worker as the scheduler sees it.

    ``gpu_mem_mb`` is the total over the worker's GPUs (or the host-RAM byte
    budget standing in for one when services run on the CPU).  ``kinds`` are
    the action kinds it serves; ``services`` the reward-model services it can
    host.  ``handle`` ties the worker to the backend job that runs it.
    """

    id: str
    cores: int
    mem_mb: int = 0
    gpus: int = 0
    gpu_mem_mb: int = 0
    kinds: frozenset[str] = frozenset(BUILTIN_KINDS)
    services: frozenset[str] = frozenset()
    handle: str | None = None
    host: str = ""
    partition: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def shape(self) -> WorkerShape:
        per_gpu = self.gpu_mem_mb // self.gpus if self.gpus else self.gpu_mem_mb
        return WorkerShape(self.cores, self.mem_mb, self.gpus, per_gpu, self.partition)
