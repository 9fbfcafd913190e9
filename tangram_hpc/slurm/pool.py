"""A backlog-driven pool for Slurm workers: grow under load, shrink when idle.

A small :class:`~tangram_hpc.policy.base.PoolPolicy` for the Slurm backend
until (and besides) a smarter pool controller: it asks for just enough CPU
workers to cover the cores the waiting actions need beyond the free and
already-requested cores (jobs still queued in Slurm count as coming, so a
long queue never makes it ask again), one GPU worker at a time while
GPU/reward actions wait, drains workers idle for ``idle_s``, and drains
workers ``replace_before_s`` before their Slurm time limit so their actions
move to fresh workers in time.  With a cluster view it never asks for a
shape no partition can hold and prefers, among ``partitions``, one with
idle resources now.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..actions import ActionSpec
from ..policy.base import Launch, PoolPolicy, PoolView, Reclaim
from ..resources import WorkerShape
from .model import PartitionInfo

__all__ = ["BacklogPool", "BacklogPoolConfig", "needs_gpu"]


def needs_gpu(a: ActionSpec) -> bool:
    return bool(a.demand.gpu_mem_mb or a.demand.service or a.kind == "reward")


@dataclass
class BacklogPoolConfig:
    cpu_shape: WorkerShape = WorkerShape(cores=4)
    gpu_shape: WorkerShape | None = None
    max_workers: int = 8              # CPU workers, queued ones included
    max_gpu_workers: int = 1
    min_workers: int = 0
    idle_s: float = 30.0
    replace_before_s: float = 120.0
    max_launch_at_once: int = 4
    partitions: tuple[str, ...] = ()  # candidates for CPU workers, in order of preference


class BacklogPool(PoolPolicy):
    def __init__(self, config: BacklogPoolConfig | None = None,
                 partitions: Callable[[], Sequence[PartitionInfo]] | None = None):
        self.config = config or BacklogPoolConfig()
        self._partitions = partitions
        self._note = "no decision yet"

    def _place(self, shape: WorkerShape) -> WorkerShape | None:
        """The shape with a partition chosen, or None when no partition can hold it."""
        if self._partitions is None:
            return shape
        try:
            parts = list(self._partitions())
        except Exception:  # no view right now: let the backend decide
            return shape
        names = ([shape.partition] if shape.partition else list(self.config.partitions)) or \
            [p.name for p in parts if p.default]
        cand = [p for n in names for p in parts if p.name == n]
        fit = [p for p in cand if p.can_hold(shape.cores, shape.gpus, shape.mem_mb)]
        if not fit:
            return None
        now = [p for p in fit if p.can_start_now(shape.cores, shape.gpus, shape.mem_mb)]
        best = (now or fit)[0]
        return shape if best.name == shape.partition or (not shape.partition and best.default
                                                          and not self.config.partitions) \
            else replace(shape, partition=best.name)

    def decide(self, view: PoolView) -> list[Launch | Reclaim]:
        cfg, now = self.config, view.now
        out: list[Launch | Reclaim] = []
        notes = []
        retiring = set()
        for w in view.workers:
            if not w.draining and w.ends_at is not None and w.ends_at - now < cfg.replace_before_s:
                out.append(Reclaim(w.info.id, "time limit"))
                retiring.add(w.info.id)
        live = [w for w in view.workers if not w.draining and w.info.id not in retiring]
        cpu_w = [w for w in live if not w.info.gpus]
        gpu_w = [w for w in live if w.info.gpus]
        cpu_starting = [s for s, _ in view.starting if not s.gpus]
        gpu_starting = [s for s, _ in view.starting if s.gpus]
        pending_cpu = [a for a in view.pending if not needs_gpu(a)]
        pending_gpu = [a for a in view.pending if needs_gpu(a)]

        # grow: CPU cores
        demand = sum(a.demand.min_cores for a in pending_cpu)
        free = sum(max(0, w.info.cores - w.busy_cores) for w in cpu_w)
        coming = sum(s.cores for s in cpu_starting)
        have = len(cpu_w) + len(cpu_starting)
        want = max(math.ceil(max(0, demand - free - coming) / cfg.cpu_shape.cores), cfg.min_workers - have)
        n = min(want, cfg.max_workers - have, cfg.max_launch_at_once)
        if n > 0:
            shape = self._place(cfg.cpu_shape)
            if shape is None:
                notes.append(f"no partition can hold CPU workers of {cfg.cpu_shape.cores} cores")
            else:
                out.append(Launch(shape, n))
                notes.append(f"launch {n} CPU worker(s): {demand} cores waiting, {free} free, {coming} coming")
        elif want > 0:
            notes.append(f"at max_workers={cfg.max_workers} with {demand} cores waiting")

        # grow: GPU workers, one at a time
        if pending_gpu and cfg.gpu_shape and not gpu_starting and len(gpu_w) < cfg.max_gpu_workers \
                and all(w.busy_cores for w in gpu_w):
            shape = self._place(cfg.gpu_shape)
            if shape is None:
                notes.append(f"no partition can hold GPU workers with {cfg.gpu_shape.gpus} GPUs")
            else:
                out.append(Launch(shape, 1))
                notes.append(f"launch 1 GPU worker: {len(pending_gpu)} GPU actions waiting")

        # shrink: idle workers while nothing of their kind waits
        spare = len(cpu_w) - cfg.min_workers
        for group, waiting in ((cpu_w, pending_cpu), (gpu_w, pending_gpu)):
            if waiting:
                continue
            for w in sorted(group, key=lambda w: now if w.idle_since is None else w.idle_since):
                if w.running or w.idle_since is None or now - w.idle_since < cfg.idle_s:
                    continue
                if group is cpu_w:
                    if spare <= 0:
                        break
                    spare -= 1
                out.append(Reclaim(w.info.id, "idle"))
        reclaims = sum(isinstance(d, Reclaim) for d in out)
        if reclaims:
            notes.append(f"reclaim {reclaims} worker(s)")
        if notes:
            self._note = "; ".join(notes)
        elif not view.pending:
            self._note = f"idle: {len(cpu_w)} CPU, {len(gpu_w)} GPU workers"
        return out

    def explain(self) -> str:
        return self._note
