"""What the cluster looks like: partitions, nodes, jobs and accounting records.

Plain dataclasses filled by either cluster view (CLI JSON or pyslurm), so the
pool controller, the Slurm backend and the report never see which one ran.
Times are unix seconds; ``None`` means unknown or unlimited.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NodeInfo", "PartitionInfo", "JobInfo", "AccountingRecord",
           "ACTIVE_STATES", "FINAL_STATES", "UNAVAILABLE_NODE_STATES"]

#: Slurm job states of a job that still holds or waits for resources.
ACTIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED",
                           "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING",
                           "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"})
#: Slurm job states after which the job will not run again.
FINAL_STATES = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "PREEMPTED", "NODE_FAIL",
                          "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT"})
#: Node states (or flags) in which no new job starts on the node.
UNAVAILABLE_NODE_STATES = frozenset({"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING",
                                     "INVAL", "FUTURE", "MAINTENANCE", "REBOOT_REQUESTED",
                                     "POWERED_DOWN", "POWER_DOWN", "NOT_RESPONDING", "UNKNOWN"})


@dataclass(slots=True, frozen=True)
class NodeInfo:
    name: str
    state: str                       # upper-case base state, e.g. "IDLE", "MIXED"
    flags: tuple[str, ...] = ()      # upper-case state flags, e.g. ("DRAIN",)
    partitions: tuple[str, ...] = ()
    cpus: int = 0
    alloc_cpus: int = 0
    gpus: int = 0
    alloc_gpus: int = 0
    mem_mb: int = 0
    alloc_mem_mb: int = 0
    reason: str = ""

    @property
    def available(self) -> bool:
        """New jobs can start here."""
        return self.state not in UNAVAILABLE_NODE_STATES and not (set(self.flags) & UNAVAILABLE_NODE_STATES)

    @property
    def free_cpus(self) -> int:
        return max(0, self.cpus - self.alloc_cpus) if self.available else 0

    @property
    def free_gpus(self) -> int:
        return max(0, self.gpus - self.alloc_gpus) if self.available else 0

    @property
    def free_mem_mb(self) -> int:
        return max(0, self.mem_mb - self.alloc_mem_mb) if self.available else 0


@dataclass(slots=True, frozen=True)
class PartitionInfo:
    """A partition and the sums over its nodes (a node in two partitions counts in both)."""

    name: str
    default: bool = False
    up: bool = True
    max_time_s: float | None = None
    nodes: tuple[NodeInfo, ...] = ()

    @property
    def total_cpus(self) -> int:
        return sum(n.cpus for n in self.nodes)

    @property
    def free_cpus(self) -> int:
        return sum(n.free_cpus for n in self.nodes)

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    @property
    def free_gpus(self) -> int:
        return sum(n.free_gpus for n in self.nodes)

    @property
    def free_mem_mb(self) -> int:
        return sum(n.free_mem_mb for n in self.nodes)

    def can_hold(self, cores: int, gpus: int = 0, mem_mb: int = 0) -> bool:
        """Some node of the partition is big enough for a one-node job of this size, ever."""
        return self.up and any(n.cpus >= cores and n.gpus >= gpus and n.mem_mb >= mem_mb
                               for n in self.nodes)

    def can_start_now(self, cores: int, gpus: int = 0, mem_mb: int = 0) -> bool:
        """Some available node has that much free right now."""
        return self.up and any(n.free_cpus >= cores and n.free_gpus >= gpus and n.free_mem_mb >= mem_mb
                               for n in self.nodes)


@dataclass(slots=True, frozen=True)
class JobInfo:
    """A job as the controller sees it now (squeue)."""

    job_id: int
    name: str
    state: str                       # e.g. "PENDING", "RUNNING", "CANCELLED"
    reason: str = ""                 # pending reason, or why it ended ("None" dropped)
    partition: str = ""
    user: str = ""
    cpus: int = 0
    gpus: int = 0
    submit_time: float | None = None
    start_time: float | None = None
    end_time: float | None = None    # expected end for running jobs when a limit is set
    time_limit_s: float | None = None
    nodes: str = ""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


@dataclass(slots=True, frozen=True)
class AccountingRecord:
    """One job from the accounting database (sacct), allocation level only."""

    job_id: int
    name: str
    state: str                       # e.g. "COMPLETED", "CANCELLED", "TIMEOUT"
    partition: str = ""
    user: str = ""
    account: str = ""
    exit_code: int = 0
    submit_time: float | None = None
    start_time: float | None = None
    end_time: float | None = None    # None while running
    elapsed_s: float = 0.0
    alloc_cpus: int = 0
    alloc_gpus: int = 0
    alloc_mem_mb: int = 0
    cpu_time_s: float = 0.0          # user + system CPU time actually used
    time_limit_s: float | None = None

    @property
    def core_seconds(self) -> float:
        """Cores held times wall time (what the allocation cost)."""
        return self.alloc_cpus * self.elapsed_s

    @property
    def gpu_seconds(self) -> float:
        return self.alloc_gpus * self.elapsed_s
