"""Replaying a sampled workload on a live coordinator, to check the simulator's fidelity.

:func:`replay` drives a :class:`tangram_hpc.client.Client` through the same
:class:`~tangram_hpc.sim.workload.Plan` the simulator plays: steps one after
another, trajectories in parallel, think time then one action per turn, each
action a ``function`` action running :func:`sleep_action` for the planned run
time (Amdahl-scaled on the cores the worker pinned it to).  :func:`fidelity`
runs a small workload both ways and returns both mean ACTs::

    python3 -m tangram_hpc.sim.replay --workload mini

Only CPU actions can be replayed this way (reward services need real models).
"""
from __future__ import annotations

import argparse
import heapq
import os
import queue
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from ..actions import ActionSpec, Demand
from ..progress import progress_reporter
from .workload import Plan, Workload, WorkloadError, load_workload

__all__ = ["sleep_action", "replay", "ReplayResult", "fidelity", "scaled_plan"]

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


def _spec_for(plan: Plan, i: int, traj: str, step: int) -> ActionSpec:
    w = plan.workload
    a = w.actions[int(plan.cls[i])]
    if a.service is not None:
        raise WorkloadError(f"action class {a.name!r} uses GPU service {a.service!r}: "
                            f"the live replay runs CPU actions only")
    lo, hi = w.action_cores(a)
    return ActionSpec("function", {"fn": SLEEP_TARGET, "args": [float(plan.d1[i]), a.parallel_fraction]},
                      demand=Demand(lo, hi, a.mem_mb), trajectory=traj, step=step, label=a.name,
                      id=f"r{os.getpid()}-{i}")


def replay(plan: Plan, client: Any, *, progress: Callable[[str], None] | None = None,
           timeout_s: float = 3600.0) -> ReplayResult:
    """Play ``plan`` against a live coordinator through ``client`` (``submit(spec) -> Future``)."""
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
                fut = client.submit(_spec_for(plan, i, f"s{s}t{j}", s))
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


def fidelity(workload: Workload, *, time_scale: float = 1.0, policy: str = "elastic",
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``workload`` on a local live cluster and in the simulator; return both mean ACTs."""
    from ..launch import LocalCluster
    from ..policy.elastic import ElasticScheduler
    from ..policy.fifo import FifoPolicy
    from .engine import simulate

    if workload.cluster.gpu_workers:
        raise WorkloadError("the live fidelity check runs CPU-only workloads")
    plan = scaled_plan(workload.sample(), time_scale)
    c = workload.cluster
    with LocalCluster(workers=c.cpu_workers, cores=c.cpu_cores, policy=policy) as cluster, \
            cluster.client() as client:
        live = replay(plan, client, progress=progress)
    sim_policy = ElasticScheduler() if policy == "elastic" else FifoPolicy()
    sim_w = replace(workload, actions=tuple(replace(a, kind="function", uses_env=False)
                                            for a in workload.actions))
    sim = simulate(replace(plan, workload=sim_w), sim_policy, name=f"sim-{policy}")
    out = {"workload": workload.name, "policy": policy, "actions": plan.n_actions,
           "live_mean_act": float(live.act.mean()), "sim_mean_act": float(sim.act.mean()),
           "live_step_s": live.step_durations, "sim_step_s": sim.step_durations,
           "live_failed": live.failed, "live_mean_cores": float(live.cores.mean()),
           "sim_mean_cores": float(sim.cores.mean())}
    out["act_error"] = out["live_mean_act"] / out["sim_mean_act"] - 1.0
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workload", default="mini", help="preset name or workload TOML file (default: mini)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply all durations (default 1)")
    ap.add_argument("--policy", choices=("elastic", "fifo"), default="elastic")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress on stderr (there is none when stderr is not a terminal)")


def main(a: argparse.Namespace | list[str] | None = None) -> int:
    if not isinstance(a, argparse.Namespace):
        ap = argparse.ArgumentParser(prog="tangram-hpc fidelity",
                                     description="Run a small CPU workload live and in the simulator; compare mean ACT.")
        add_arguments(ap)
        a = ap.parse_args(a)
    try:
        w = load_workload(a.workload)
    except WorkloadError as e:
        print(e, file=sys.stderr)
        return 2
    with progress_reporter(a.quiet) as progress:
        progress(f"{w.name}: starting local workers ...")
        res = fidelity(w, time_scale=a.time_scale, policy=a.policy, progress=progress)
    print(f"{res['workload']} ({res['actions']} actions, policy {res['policy']}): "
          f"live mean ACT {res['live_mean_act']:.3f}s, simulated {res['sim_mean_act']:.3f}s "
          f"({res['act_error']:+.1%}); steps live {[round(x, 1) for x in res['live_step_s']]} "
          f"sim {[round(x, 1) for x in res['sim_step_s']]}; mean cores live {res['live_mean_cores']:.2f} "
          f"sim {res['sim_mean_cores']:.2f}; failed {res['live_failed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
