"""What a simulated run measured (:class:`SimResult`), and the per-class facts every action of a
class shares (:class:`ActionClassRow`: what it submits, how it runs)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..actions import Demand
from ..resources import WorkerShape
from .machines import SimWorker
from .workload import Plan, Workload

__all__ = ["ActionClassRow", "SimResult", "action_specs_for", "allocated_seconds", "lower_bounds"]


@dataclass(slots=True, frozen=True)
class ActionClassRow:
    kind: str
    demand: Demand
    label: str
    uses_env: bool
    parallel_fraction: float
    service: str | None
    timeout_s: float
    mem_mean_mb: int


def action_specs_for(w: Workload) -> list[ActionClassRow]:
    """Per action class: what every action of it submits, and how it runs."""
    out = []
    for a in w.actions:
        lo, hi = w.action_cores(a)
        gmem = w.services[a.service].gpu_mem_mb if a.service else 0
        out.append(ActionClassRow(a.kind, Demand(lo, hi, a.mem_mb, gmem, a.service), a.name, a.uses_env,
                                  a.parallel_fraction, a.service, a.timeout_s or float("inf"),
                                  a.mem_mean_mb))
    return out


@dataclass
class SimResult:
    name: str
    submit: np.ndarray
    start: np.ndarray
    finish: np.ndarray
    cores: np.ndarray
    lower_bound: np.ndarray         # per action: alone at its best core count, no wait, no load
    step_durations: list[float]
    cpu_core_s: float               # allocated CPU core-seconds
    gpu_s: float                    # allocated GPU-seconds
    cpu_busy_core_s: float
    gpu_busy_slot_s: float
    gpu_slot_s: float
    makespan: float
    cpu_cores_max: int = 0          # most CPU cores allocated at once
    gpu_slots_max: int = 0
    mem_reserved_mb_s: float = 0.0  # peak memory reserved by running actions, integrated
    mem_used_mb_s: float = 0.0      # their mean memory, integrated
    trace: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    wall_s: float = 0.0
    events: int = 0
    pool_notes: list[str] = field(default_factory=list)
    is_gpu: np.ndarray | None = None   # per action: ran on a GPU worker
    env_moves: int = 0              # environments moved between workers (each cost the workload's env_move_s)
    prefetched: list[tuple[float, str, str]] = field(default_factory=list)  # (time, worker, service) the policy asked

    @property
    def act(self) -> np.ndarray:
        return self.finish - self.submit

    @property
    def mean_step(self) -> float:
        return float(np.mean(self.step_durations)) if self.step_durations else 0.0

    @property
    def cpu_util(self) -> float:
        return self.cpu_busy_core_s / self.cpu_core_s if self.cpu_core_s else 0.0

    @property
    def gpu_util(self) -> float:
        return self.gpu_busy_slot_s / self.gpu_slot_s if self.gpu_slot_s else 0.0


def allocated_seconds(workers: list[SimWorker], starting: list[tuple[WorkerShape, float]],
                      end: float) -> tuple[float, float, float]:
    """(CPU core-seconds, GPU-seconds, GPU slot-seconds) allocated until ``end``: each worker from
    its request to its reclaim (or ``end``), each start still pending from its request."""
    cpu_cs = gpu_s = gpu_ss = 0.0
    for sw in workers:
        life = (sw.alloc_end if sw.alloc_end is not None else end) - sw.alloc_start
        if sw.shape.gpus:
            gpu_s += life * sw.shape.gpus
            gpu_ss += life * sw.shape.cores
        else:
            cpu_cs += life * sw.shape.cores
    for shape, at in starting:
        if shape.gpus:
            gpu_s += (end - at) * shape.gpus
            gpu_ss += (end - at) * shape.cores
        else:
            cpu_cs += (end - at) * shape.cores
    return cpu_cs, gpu_s, gpu_ss


def lower_bounds(plan: Plan, classes: list[ActionClassRow]) -> tuple[np.ndarray, np.ndarray]:
    """Per action: its run time alone at its best core count (no wait, no load), and whether it
    runs on a GPU worker."""
    # per class, then per action: one array per action at a time instead of seven
    pfa = np.array([r.parallel_fraction for r in classes])
    maxc = np.array([r.demand.max_cores for r in classes])
    tmo = np.array([r.timeout_s for r in classes])
    lb = plan.d1 * ((1.0 - pfa) + pfa / np.maximum(1, maxc))[plan.cls]
    np.minimum(lb, tmo[plan.cls], out=lb)
    is_gpu = np.array([r.service is not None for r in classes])[plan.cls]
    return lb, is_gpu
