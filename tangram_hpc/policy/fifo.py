"""First-come first-served placement at ``min_cores``: the simple policy and baseline."""
from __future__ import annotations

from collections import deque

from ..actions import ActionSpec
from ..resources import WorkerInfo
from .base import Assignment, SchedulingPolicy, light_capacity


class _Worker:
    __slots__ = ("info", "free_cores", "free_mem", "free_gpu_mem", "draining", "running", "light", "light_cap")

    def __init__(self, info: WorkerInfo):
        self.info = info
        self.free_cores = info.cores
        self.free_mem = info.mem_mb
        self.free_gpu_mem = info.gpu_mem_mb
        self.draining = False
        self.running: set[str] = set()
        self.light = 0
        self.light_cap = light_capacity(info)

    def fits(self, a: ActionSpec) -> bool:
        d = a.demand
        i = self.info
        return (not self.draining and a.kind in i.kinds
                and (self.free_cores >= d.min_cores if d.min_cores else self.light < self.light_cap)
                and (not i.mem_mb or self.free_mem >= d.mem_mb)
                and self.free_gpu_mem >= d.gpu_mem_mb
                and (d.service is None or d.service in i.services))


class FifoPolicy(SchedulingPolicy):
    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        self._pending: deque[ActionSpec] = deque()
        self._running: dict[str, tuple[str, ActionSpec]] = {}
        self._env_home: dict[str, str] = {}

    def add_worker(self, info: WorkerInfo, now: float) -> None:
        self._workers[info.id] = _Worker(info)

    def remove_worker(self, worker_id: str, now: float) -> list[str]:
        w = self._workers.pop(worker_id, None)
        if w is None:
            return []
        for env, home in list(self._env_home.items()):
            if home == worker_id:
                del self._env_home[env]
        for aid in w.running:
            self._running.pop(aid, None)
        return sorted(w.running)

    def set_draining(self, worker_id: str, draining: bool) -> None:
        w = self._workers.get(worker_id)
        if w is not None:
            w.draining = draining

    def submit(self, action: ActionSpec, now: float) -> None:
        self._pending.append(action)

    def cancel(self, action_id: str) -> bool:
        for a in self._pending:
            if a.id == action_id:
                self._pending.remove(a)
                return True
        return False

    def finished(self, action_id: str, now: float, *, ok: bool = True, run_time: float | None = None) -> None:
        entry = self._running.pop(action_id, None)
        if entry is None:
            return
        wid, a = entry
        w = self._workers.get(wid)
        if w is not None:
            w.running.discard(action_id)
            w.free_cores += a.demand.min_cores
            if not a.demand.min_cores:
                w.light -= 1
            w.free_mem += a.demand.mem_mb
            w.free_gpu_mem += a.demand.gpu_mem_mb

    def schedule(self, now: float) -> list[Assignment]:
        out: list[Assignment] = []
        pending = self._pending
        workers = list(self._workers.values())
        while pending:
            a = pending[0]
            home = self._env_home.get(a.env) if a.env else None
            cand = [self._workers[home]] if home in self._workers else workers
            chosen = next((w for w in cand if w.fits(a)), None)
            if chosen is None:
                break  # strict FIFO: the head waits, and so does everything behind it
            pending.popleft()
            d = a.demand
            chosen.free_cores -= d.min_cores
            if not d.min_cores:
                chosen.light += 1
            chosen.free_mem -= d.mem_mb
            chosen.free_gpu_mem -= d.gpu_mem_mb
            chosen.running.add(a.id)
            self._running[a.id] = (chosen.info.id, a)
            if a.env:
                self._env_home[a.env] = chosen.info.id
            out.append(Assignment(a.id, chosen.info.id, d.min_cores))
        return out

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def running_count(self) -> int:
        return len(self._running)

    def pending_actions(self) -> list[ActionSpec]:
        return list(self._pending)
