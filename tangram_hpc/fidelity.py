"""``tangram-hpc fidelity``: one small workload live on local workers and in the simulator.

Starts a :class:`~tangram_hpc.launch.LocalCluster` with the workload's CPU
workers, replays the sampled plan through a client
(:func:`tangram_hpc.sim.replay.replay`: function actions, or real sandboxes in
their trajectories' environments), simulates the same plan with the same
policy and static cluster, and reports both mean ACTs and the relative error.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from .progress import progress_reporter
from .sim.replay import check_replayable, replay, scaled_plan
from .sim.workload import Workload, WorkloadError, load_workload

__all__ = ["fidelity", "add_arguments", "main"]


def fidelity(workload: Workload, *, time_scale: float = 1.0, policy: str = "elastic",
             progress: Callable[[str], None] | None = None, run_dir: str | None = None) -> dict[str, Any]:
    """Run ``workload`` on a local live cluster and in the simulator; return both mean ACTs
    (``run_dir``: the live coordinator's, default a new one under the runs root)."""
    from .launch import LocalCluster
    from .policy.elastic import ElasticScheduler
    from .policy.fifo import FifoPolicy
    from .sim.engine import simulate

    plan = scaled_plan(workload.sample(), time_scale)
    check_replayable(plan)
    c = workload.cluster
    # Both sides start from the workload's guess of what moving an environment costs; live, the
    # coordinator then learns it from the moves it makes, as in production.
    move_s = c.env_move_s if any(a.uses_env for a in workload.actions) else None
    with LocalCluster(workers=c.cpu_workers, cores=c.cpu_cores, policy=policy, run_dir=run_dir,
                      extra_args=["--env-move-s", str(move_s)] if move_s else []) as cluster, \
            cluster.client() as client:
        cost = sandbox_cost(client) if any(a.kind == "sandbox" for a in workload.actions) else 0.0
        live = replay(plan, client, progress=progress, sandbox_cost_s=cost)
        moves = client.status()["env_moves"]
    cls = ElasticScheduler if policy == "elastic" else FifoPolicy
    sim = simulate(plan, cls(env_move_s=move_s), name=f"sim-{policy}")
    out = {"workload": workload.name, "policy": policy, "actions": plan.n_actions, "time_scale": time_scale,
           "live_mean_act": float(live.act.mean()), "sim_mean_act": float(sim.act.mean()),
           "live_step_s": live.step_durations, "sim_step_s": sim.step_durations,
           "live_failed": live.failed, "live_mean_cores": float(live.cores.mean()),
           "sim_mean_cores": float(sim.cores.mean()), "sandbox_cost_s": cost,
           "live_env_moves": moves, "sim_env_moves": sim.env_moves}
    out["act_error"] = out["live_mean_act"] / out["sim_mean_act"] - 1.0
    return out


def sandbox_cost(client: Any, runs: int = 9) -> float:
    """Median completion time of a sandbox command that does nothing, in an environment.

    The simulator knows only the commands' planned durations, so the replay takes this fixed cost
    (round trip, sandbox start, environment) off each sandbox command's sleep.
    """
    from .actions import sandbox
    acts = []
    for _ in range(runs + 1):
        r = client.submit(sandbox("true", env="fidelity-calibration")).result(60)
        if not r.ok:
            raise RuntimeError(f"a sandbox command failed on the live cluster: {r.error}")
        acts.append(r.act)
    client.close_env("fidelity-calibration")
    acts = sorted(acts[1:])      # the first one also creates the environment
    return acts[len(acts) // 2]


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
    except RuntimeError as e:      # the live cluster could not run the workload
        print(f"tangram-hpc fidelity: {e}", file=sys.stderr)
        return 1
    print(f"{res['workload']} ({res['actions']} actions, policy {res['policy']}): "
          f"live mean ACT {res['live_mean_act']:.3f}s, simulated {res['sim_mean_act']:.3f}s "
          f"({res['act_error']:+.1%}); steps live {[round(x, 1) for x in res['live_step_s']]} "
          f"sim {[round(x, 1) for x in res['sim_step_s']]}; mean cores live {res['live_mean_cores']:.2f} "
          f"sim {res['sim_mean_cores']:.2f}; environments moved live {res['live_env_moves']} "
          f"sim {res['sim_env_moves']}; failed {res['live_failed']}"
          + (f"; sandbox cost {res['sandbox_cost_s'] * 1000:.0f} ms (taken off each command)"
             if res["sandbox_cost_s"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
