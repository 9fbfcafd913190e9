"""Descriptions of worker resources shared by the policies, the backends and the wire."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping

from .actions import BUILTIN_KINDS

#: Share of a GPU's memory a worker gives its services; the rest is left for activations and the
#: CUDA context.  A service replica lives on one GPU, so no service may be larger than this share.
GPU_MEMORY_SHARE = 0.9


class ResourceClass(str, Enum):
    """The class of resource a worker offers: plain cores, or GPUs hosting reward-model services.

    A ``str`` enum, so ``{"cpu": 4}`` style mappings (configuration, JSON)
    look members up by their value.
    """

    CPU = "cpu"
    GPU = "gpu"

    __hash__ = str.__hash__    # hash like the value, on every Python version

    def __str__(self) -> str:
        return self.value


# The members as module constants, for the code that asks per action and per worker (the
# schedulers, the pool controller, the simulator): reading one off the enum class costs a few
# hundred nanoseconds on Python 3.11.
CPU, GPU = ResourceClass.CPU, ResourceClass.GPU


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
    def resource(self) -> ResourceClass:
        """GPU for workers that host reward-model services (GPUs, or a memory budget standing in)."""
        return GPU if self.gpus or self.gpu_mem_mb else CPU


@dataclass(slots=True, frozen=True)
class ServiceInfo:
    """A reward-model service as the scheduler sees it.

    ``gpu_mem_mb``: its resident size; ``max_batch``: requests one replica
    serves at once (0: as many as the worker's slots); ``load_s``: seconds to
    make it resident, when known (the scheduler learns it anyway).
    """

    gpu_mem_mb: int
    max_batch: int = 0
    load_s: float | None = None


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


@dataclass(slots=True, frozen=True)
class PartitionFree:
    """Idle resources of one partition right now."""

    cores: int
    gpus: int = 0
    nodes: int = 0
    max_node_cores: int = 0   # largest node's cores (0: unknown)
    max_node_gpus: int = 0

    def holds(self, shape: WorkerShape) -> bool:
        """Some node could ever run one worker of ``shape`` (it may have to queue)."""
        if self.max_node_cores and shape.cores > self.max_node_cores:
            return False
        return not shape.gpus or shape.gpus <= self.max_node_gpus


@dataclass(slots=True, frozen=True)
class ClusterCapacity:
    """What the batch system could start now, per partition (None partition: the default)."""

    partitions: Mapping[str | None, PartitionFree] = field(default_factory=dict)
    at: float = 0.0

    def fits(self, shape: WorkerShape) -> int:
        """How many workers of ``shape`` the partition can hold now (a large number when unknown)."""
        p = self.partitions.get(shape.partition)
        if p is None:
            return 1 << 30
        n = p.cores // max(1, shape.cores)
        if shape.gpus:
            n = min(n, p.gpus // shape.gpus)
        return max(0, n)

    def holds(self, shape: WorkerShape) -> bool:
        p = self.partitions.get(shape.partition)
        return p is None or p.holds(shape)

    def idle_score(self, shape: WorkerShape) -> float:
        p = self.partitions.get(shape.partition)
        if p is None:
            return 0.0
        return p.gpus * 1000.0 + p.cores if shape.gpus else float(p.cores)
