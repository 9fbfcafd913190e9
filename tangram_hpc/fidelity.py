"""``tangram-hpc fidelity``: one small workload live on local workers and in the simulator.

Starts a :class:`~tangram_hpc.launch.LocalCluster` with the workload's CPU
workers, replays the sampled plan through a client
(:func:`tangram_hpc.sim.replay.replay`), simulates the same plan with the same
policy and static cluster, and reports both mean ACTs and the relative error.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any, Callable

from .progress import progress_reporter
from .sim.replay import check_replayable, replay, scaled_plan
from .sim.workload import Workload, WorkloadError, load_workload

__all__ = ["fidelity", "add_arguments", "main"]


def fidelity(workload: Workload, *, time_scale: float = 1.0, policy: str = "elastic",
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``workload`` on a local live cluster and in the simulator; return both mean ACTs."""
    from .launch import LocalCluster
    from .policy.elastic import ElasticScheduler
    from .policy.fifo import FifoPolicy
    from .sim.engine import simulate

    plan = scaled_plan(workload.sample(), time_scale)
    check_replayable(plan)
    c = workload.cluster
    with LocalCluster(workers=c.cpu_workers, cores=c.cpu_cores, policy=policy) as cluster, \
            cluster.client() as client:
        live = replay(plan, client, progress=progress)
    sim_policy = ElasticScheduler() if policy == "elastic" else FifoPolicy()
    # live, every action is a function action with no sandbox environment
    sim_w = replace(workload, actions=tuple(replace(a, kind="function", uses_env=False)
                                            for a in workload.actions))
    sim = simulate(replace(plan, workload=sim_w), sim_policy, name=f"sim-{policy}")
    out = {"workload": workload.name, "policy": policy, "actions": plan.n_actions, "time_scale": time_scale,
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
        with progress_reporter(a.quiet) as progress:
            progress(f"{w.name}: starting local workers ...")
            res = fidelity(w, time_scale=a.time_scale, policy=a.policy, progress=progress)
    except WorkloadError as e:
        print(f"tangram-hpc fidelity: {e}", file=sys.stderr)
        return 2
    print(f"{res['workload']} ({res['actions']} actions, policy {res['policy']}): "
          f"live mean ACT {res['live_mean_act']:.3f}s, simulated {res['sim_mean_act']:.3f}s "
          f"({res['act_error']:+.1%}); steps live {[round(x, 1) for x in res['live_step_s']]} "
          f"sim {[round(x, 1) for x in res['sim_step_s']]}; mean cores live {res['live_mean_cores']:.2f} "
          f"sim {res['sim_mean_cores']:.2f}; failed {res['live_failed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
