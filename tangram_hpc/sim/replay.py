"""Replaying a sampled workload through any client, to check the simulator's fidelity.

:func:`replay` drives a client (``submit(spec) -> Future``, e.g. a
:class:`tangram_hpc.client.Client`) through the same
:class:`~tangram_hpc.sim.workload.Plan` the simulator plays: steps one after
another, trajectories in parallel, think time then one action per turn.  A
``function`` action runs :func:`sleep_action` for the planned run time
(Amdahl-scaled on the cores the worker pinned it to); a ``sandbox`` action
runs a shell ``sleep`` as long (scaled on ``$TANGRAM_NCPUS``) in a real
sandbox, in its trajectory's environment when its class uses one.  The client is
passed in, so the simulator package stays free of the live launch code;
:mod:`tangram_hpc.fidelity` (``tangram-hpc fidelity``) starts a local cluster
and compares both.

Only CPU actions without joined groups or per-turn barriers can be replayed
this way (reward services need real models).
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

__all__ = ["sleep_action", "sleep_command", "replay", "ReplayResult", "scaled_plan", "check_replayable"]

SLEEP_TARGET = "tangram_hpc.sim.replay:sleep_action"


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

    @property
    def act(self) -> np.ndarray:
        return self.finish - self.submit


def _spec_for(plan: Plan, i: int, traj: str, step: int, sandbox_cost_s: float) -> ActionSpec:
    w = plan.workload
    a = w.actions[int(plan.cls[i])]
    if a.service is not None:
        raise WorkloadError(f"action class {a.name!r} uses GPU service {a.service!r}: "
                            f"the live replay runs CPU actions only")
    lo, hi = w.action_cores(a)
    hint = float(plan.hint[i])
    payload: dict[str, Any]
    if a.kind == "sandbox":
        kind, payload = "sandbox", {"cmd": sleep_command(float(plan.d1[i]), a.parallel_fraction, sandbox_cost_s)}
    else:
        kind, payload = "function", {"fn": SLEEP_TARGET, "args": [float(plan.d1[i]), a.parallel_fraction]}
    return ActionSpec(kind, payload, env=traj if a.uses_env else None,
                      demand=Demand(lo, hi, a.mem_mb), duration_hint=hint or None, timeout=a.timeout_s,
                      trajectory=traj, step=step, label=a.name, id=f"r{os.getpid()}-{i}")


def check_replayable(plan: Plan) -> None:
    """Raise :class:`WorkloadError` for what the live replay cannot play."""
    w = plan.workload
    if w.cluster.gpu_workers or any(a.service for a in w.actions):
        raise WorkloadError("the live replay runs CPU-only workloads (reward services need real models)")
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
                submit[i], finish[i], cores[i] = r.submitted, r.finished, r.cores
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
    return ReplayResult(submit, finish, cores, steps, failed)
