"""Replaying a sampled workload through any client, to check the simulator's fidelity.

:func:`replay` drives a client (``submit(spec) -> Future``, e.g. a
:class:`tangram_hpc.client.Client`) through the same
:class:`~tangram_hpc.sim.workload.Plan` the simulator plays: steps one after
another, trajectories in parallel, think time then one action per turn.  A
``function`` action runs :func:`sleep_action` for the planned run time
(Amdahl-scaled on the cores the worker pinned it to); a ``sandbox`` action
runs a shell ``sleep`` as long (scaled on ``$TANGRAM_NCPUS``) in a real
sandbox, in its trajectory's environment when its class uses one; a ``reward``
action is a call to its service, a :class:`SleepService` on a reward worker's
CPU stand-in device whose score sleeps the planned time and whose load onto
the device sleeps the service's load time.  The client is
passed in, so the simulator package stays free of the live launch code;
:mod:`tangram_hpc.fidelity` (``tangram-hpc fidelity``) starts a local cluster
and compares both.

Only workloads without joined groups or per-turn barriers can be replayed this
way, and at most one GPU worker, as the local backend runs it on the CPU
stand-in: one device with one scoring thread, so one slot.
"""
from __future__ import annotations

import heapq
import os
import queue
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from ..actions import ActionSpec, Demand
from .workload import Plan, WorkloadError

__all__ = ["sleep_action", "sleep_command", "SleepService", "sleep_service", "replay", "ReplayResult",
           "scaled_plan", "check_replayable"]

SLEEP_TARGET = "tangram_hpc.sim.replay:sleep_action"
SLEEP_SERVICE = "tangram_hpc.sim.replay:sleep_service"


def sleep_action(seconds: float, parallel_fraction: float = 0.0, cores: int | None = None) -> float:
    """Sleep as long as ``seconds`` of one-core work takes on the cores this thread may use.

    ``cores``: override the count (default: the size of this thread's CPU
    affinity mask, which the worker sets to the cores it granted -- exact when
    a worker offers no more cores than the machine has).
    """
    c = cores if cores is not None else len(os.sched_getaffinity(0))
    t = seconds * ((1.0 - parallel_fraction) + parallel_fraction / max(1, c))
    time.sleep(t)
    return t


def sleep_command(seconds: float, parallel_fraction: float = 0.0, less_s: float = 0.0) -> str:
    """A shell command sleeping as long as ``seconds`` of one-core work takes on the cores it was granted,
    less ``less_s`` (the sandbox's own fixed cost, so that the action as a whole takes the planned time).

    The sandbox says how many cores in ``TANGRAM_NCPUS``; awk does the arithmetic, so no
    interpreter starts.
    """
    p = parallel_fraction
    return (f"sleep $(LC_ALL=C awk -v c=\"${{TANGRAM_NCPUS:-1}}\" 'BEGIN {{ "
            f"t = {seconds!r} * ((1 - {p!r}) + {p!r} / c) - {less_s!r}; printf \"%.6f\", (t > 0 ? t : 0) }}')")


class SleepService:
    """A reward model standing in for a real one in the replay: scoring an input (seconds) sleeps that
    long, and a load onto the device sleeps ``load_s``, so that loads and evictions cost what the
    workload says without a GPU."""

    def __init__(self, load_s: float) -> None:
        self.load_s = load_s
        self._resident = False

    def to(self, device: str) -> "SleepService":
        # On the CPU stand-in device a load and an eviction are both to("cpu"); the service
        # manager never makes a resident model resident again, so they alternate.
        if not self._resident:
            time.sleep(self.load_s)
        self._resident = not self._resident
        return self

    def score(self, inputs: list) -> list[float]:
        time.sleep(sum(float(x) for x in inputs))
        return [1.0] * len(inputs)


def sleep_service(load_s: float = 0.0) -> SleepService:
    """The loader of a :class:`SleepService` (``--service NAME=tangram_hpc.sim.replay:sleep_service,load_s=S``)."""
    return SleepService(float(load_s))


def scaled_plan(plan: Plan, time_scale: float) -> Plan:
    """The same plan with every duration and think time multiplied by ``time_scale``."""
    return replace(plan, d1=plan.d1 * time_scale, think=plan.think * time_scale)


@dataclass
class ReplayResult:
    submit: np.ndarray
    finish: np.ndarray
    cores: np.ndarray
    step_durations: list[float]
    failed: int
    workers: list[str | None]       # per action: the worker of its final attempt

    @property
    def act(self) -> np.ndarray:
        return self.finish - self.submit


def _spec_for(plan: Plan, i: int, traj: str, step: int, sandbox_cost_s: float) -> ActionSpec:
    w = plan.workload
    a = w.actions[int(plan.cls[i])]
    lo, hi = w.action_cores(a)
    hint = float(plan.hint[i])
    payload: dict[str, Any]
    gpu_mem = 0
    if a.service is not None:
        kind, payload = "reward", {"inputs": [float(plan.d1[i])]}
        gpu_mem = w.services[a.service].gpu_mem_mb
    elif a.kind == "sandbox":
        kind, payload = "sandbox", {"cmd": sleep_command(float(plan.d1[i]), a.parallel_fraction, sandbox_cost_s)}
    else:
        kind, payload = "function", {"fn": SLEEP_TARGET, "args": [float(plan.d1[i]), a.parallel_fraction]}
    return ActionSpec(kind, payload, env=traj if a.uses_env else None,
                      demand=Demand(lo, hi, a.mem_mb, gpu_mem, a.service), duration_hint=hint or None, timeout=a.timeout_s,
                      trajectory=traj, step=step, label=a.name, id=f"r{os.getpid()}-{i}")


def check_replayable(plan: Plan) -> None:
    """Raise :class:`WorkloadError` for what the live replay cannot play."""
    w = plan.workload
    c = w.cluster
    if c.gpu_workers > 1 or c.gpu_workers and (c.gpus != 1 or c.gpu_slots != 1):
        raise WorkloadError("the live replay runs one GPU worker, as the local backend does on the CPU stand-in "
                            "device: gpu_workers = 1, gpus = 1 and gpu_slots = 1 (one device, one scoring thread)")
    odd = [a.name for a in w.actions if a.uses_env and a.kind != "sandbox"]
    if odd:
        raise WorkloadError(f"action class {odd[0]!r}: only sandbox actions run in an environment live")
    if w.rollout.sync_turns or bool(plan.joined.any()):
        raise WorkloadError("the live replay plays one action at a time per trajectory: no per-turn "
                            "barriers (sync_turns) or parallel final calls")


def replay(plan: Plan, client: Any, *, progress: Callable[[str], None] | None = None,
           timeout_s: float = 3600.0, sandbox_cost_s: float = 0.0) -> ReplayResult:
    """Play ``plan`` against a live coordinator through ``client`` (``submit(spec) -> Future``).

    ``sandbox_cost_s``: what a sandbox action costs beyond its command (starting the sandbox,
    entering its environment); each sandbox command sleeps that much less.
    """
    check_replayable(plan)
    n = plan.n_actions
    submit = np.zeros(n)
    finish = np.zeros(n)
    cores = np.zeros(n, dtype=int)
    workers: list[str | None] = [None] * n
    done_q: queue.SimpleQueue = queue.SimpleQueue()
    steps: list[float] = []
    failed = 0
    deadline = time.monotonic() + timeout_s
    for s, (starts, lens) in enumerate(zip(plan.step_traj_start, plan.step_traj_len)):
        t0 = time.time()
        timers: list[tuple[float, int, int]] = []       # (due wall time, action, trajectory)
        for j, st in enumerate(starts.tolist()):
            heapq.heappush(timers, (t0 + float(plan.think[st]), st, j))
        ends = (starts + lens - 1).tolist()
        left = len(ends)
        while left:
            if time.monotonic() > deadline:
                raise TimeoutError("replay did not finish in time")
            now = time.time()
            while timers and timers[0][0] <= now:
                _, i, j = heapq.heappop(timers)
                fut = client.submit(_spec_for(plan, i, f"s{s}t{j}", s, sandbox_cost_s))
                fut.add_done_callback(lambda f, i=i, j=j: done_q.put((i, j, f)))
            wait = max(0.0, timers[0][0] - time.time()) if timers else 1.0
            try:
                i, j, f = done_q.get(timeout=min(wait, 1.0))
            except queue.Empty:
                continue
            while True:
                r = f.result()
                submit[i], finish[i], cores[i], workers[i] = r.submitted, r.finished, r.cores, r.worker
                if not r.ok:
                    failed += 1
                if i == ends[j]:
                    left -= 1
                else:
                    k = i + 1
                    heapq.heappush(timers, (time.time() + float(plan.think[k]), k, j))
                try:
                    i, j, f = done_q.get_nowait()
                except queue.Empty:
                    break
        steps.append(time.time() - t0)
        if progress:
            progress(f"replay: step {s + 1}/{len(plan.step_traj_start)} took {steps[-1]:.1f}s")
    return ReplayResult(submit, finish, cores, steps, failed, workers)
