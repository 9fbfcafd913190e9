"""``tangram-hpc fidelity``: one small workload live on local workers and in the simulator.

Starts a :class:`~tangram_hpc.launch.LocalCluster` with the workload's CPU
workers and, when it calls services, its reward workers (each serving the
workload's services as :class:`~tangram_hpc.sim.replay.SleepService` models on
the CPU stand-in device), replays the sampled plan through a client
(:func:`tangram_hpc.sim.replay.replay`: function actions, real sandboxes in
their trajectories' environments, reward calls), simulates the same plan with
the same policy and static cluster, with the services' load times as the live
reward workers measured them, and reports both mean ACTs and the relative error.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from typing import Any, Callable

from .progress import progress_reporter
from .sim.costs import MeasuredCosts, with_measured_costs
from .sim.layout import services_by_demand
from .sim.replay import SLEEP_SERVICE, check_replayable, replay, scaled_plan
from .sim.workload import Workload, WorkloadError, load_workload

__all__ = ["fidelity", "add_arguments", "main"]


def fidelity(workload: Workload, *, time_scale: float = 1.0, policy: str = "elastic",
             progress: Callable[[str], None] | None = None, run_dir: str | None = None) -> dict[str, Any]:
    """Run ``workload`` on a local live cluster and in the simulator; return both mean ACTs
    (``run_dir``: the live coordinator's, default a new one under the runs root)."""
    from .launch import LocalCluster
    from .policy.elastic import ElasticScheduler
    from .policy.fifo import FifoPolicy
    from .policy.prefetch import Prefetch
    from .sim.engine import service_infos, simulate

    plan = scaled_plan(workload.sample(), time_scale)
    check_replayable(plan)
    c = workload.cluster
    # Both sides start from the workload's guess of what moving an environment costs; live, the
    # coordinator then learns it from the moves it makes, as in production.
    move_s = c.env_move_s if any(a.uses_env for a in workload.actions) else None
    extra = ["--env-move-s", str(move_s)] if move_s else []
    services: list[str] = []
    if workload.services:
        # Declared most demanded first: a reward worker starts with those that fit, in that order,
        # as the simulator's workers do.
        services = [f"{n}={SLEEP_SERVICE},memory_mb={workload.services[n].gpu_mem_mb},max_wait_ms=0,"
                    f"load_s={workload.services[n].load_s * time_scale!r}" for n in services_by_demand(workload)]
        extra += ["--service-budget-mb", str(c.gpu_mem_mb)]
    with LocalCluster(workers=c.cpu_workers, cores=c.cpu_cores, policy=policy, run_dir=run_dir,
                      reward_workers=c.gpu_workers, services=services, extra_args=extra) as cluster, \
            cluster.client() as client:
        before: dict[str, dict[str, Any]] = {}
        if services:
            before = warm_services(client, workload)
        cost = sandbox_cost(client) if any(a.kind == "sandbox" for a in workload.actions) else 0.0
        live = replay(plan, client, progress=progress, sandbox_cost_s=cost)
        status = reported_since(client, time.monotonic()) if services else client.status()
    moves = status["env_moves"]
    svc_moves = _service_moves(status)
    run_moves = {n: {k: m[k] - before.get(n, {}).get(k, 0) for k in ("loads", "evictions")} for n, m in svc_moves.items()}
    if services:
        # the simulator loads each service as long as the live reward workers measured
        measured = {n: m["load_s"] for n, m in svc_moves.items() if m["load_s"] is not None}
        plan = replace(plan, workload=with_measured_costs(plan.workload, MeasuredCosts(measured, None)))
    cls = ElasticScheduler if policy == "elastic" else FifoPolicy
    sim_policy = cls(env_move_s=move_s, services=service_infos(plan.workload),
                     prefetch=Prefetch() if services else None)      # prefetch: on live by default
    sim = simulate(plan, sim_policy, name=f"sim-{policy}")
    out = {"workload": workload.name, "policy": policy, "actions": plan.n_actions, "time_scale": time_scale,
           "live_mean_act": float(live.act.mean()), "sim_mean_act": float(sim.act.mean()),
           "live_step_s": live.step_durations, "sim_step_s": sim.step_durations,
           "live_failed": live.failed, "live_mean_cores": float(live.cores.mean()),
           "sim_mean_cores": float(sim.cores.mean()), "sandbox_cost_s": cost,
           "live_env_moves": moves, "sim_env_moves": sim.env_moves,
           "live_moved_trajectories": moved_trajectories(plan, live.workers),
           "live_service_loads": sum(m["loads"] for m in run_moves.values()),
           "live_service_evictions": sum(m["evictions"] for m in run_moves.values()),
           "service_load_s": {n: m["load_s"] for n, m in svc_moves.items()},
           "live_prefetch": status.get("prefetch") if services else None,
           "sim_prefetches": len(sim.prefetched)}
    names = [a.name for a in workload.actions]
    out["act_by_class"] = {names[k]: (float(live.act[plan.cls == k].mean()), float(sim.act[plan.cls == k].mean()))
                           for k in sorted(set(plan.cls.tolist()))}
    out["act_error"] = out["live_mean_act"] / out["sim_mean_act"] - 1.0
    return out


def preloaded(w: Workload) -> list[str]:
    """The services a GPU worker starts with: the most demanded, while they fit (as the simulator
    preloads them)."""
    used, out = 0, []
    for name in services_by_demand(w):
        if used + w.services[name].gpu_mem_mb <= w.cluster.gpu_mem_mb:
            used += w.services[name].gpu_mem_mb
            out.append(name)
    return out


def warm_services(client: Any, w: Workload) -> dict[str, dict[str, Any]]:
    """Load every service once on the reward worker, then leave those it starts with resident.

    The live scheduler learns a service's load time from the worker's first measured load (until
    then it assumes a long one), while the simulated one is told the measured times: one call (of
    no duration) to each service not yet loaded gives the live one the same knowledge, and calls
    to the starting services evicted meanwhile give both runs the same residents at the start.
    Returns the service counts after it (the run's loads and evictions are counted from there).
    """
    from .actions import ActionSpec, Demand

    def call(name: str) -> dict:
        spec = ActionSpec("reward", {"inputs": [0.0]}, demand=Demand(1, 1, 0, w.services[name].gpu_mem_mb, name))
        r = client.submit(spec).result(120)
        if not r.ok:
            raise RuntimeError(f"a call to service {name} failed on the live cluster: {r.error}")
        return reported_since(client, time.monotonic())

    def resident(st: dict) -> set[str]:
        return {s for x in st["workers"] if "reward" in x["kinds"] for s in x["services"]}

    start = preloaded(w)
    deadline = time.monotonic() + 120
    while not set(start) <= resident(st := client.status()):     # the worker's own preload first
        if time.monotonic() > deadline:
            raise RuntimeError(f"the reward worker did not load {start} at its start in 120s")
        time.sleep(0.1)
    for name in services_by_demand(w):
        if name not in start:
            st = call(name)
    # A call to a missing starting service evicts the resident of least value (cost to reload over
    # time unused, policy/residency.py): a costly service loaded above can outvalue a cheap starting
    # one for as long as its reload cost outweighs its idle time, and two starting services then evict
    # each other.  Waiting between rounds lets the unused one age out (what the value's LRU part is
    # for), so the warm-up ends by the residency rule, whatever the machine's load did to the costs.
    deadline, pause = time.monotonic() + 300, 0.5
    while True:
        missing = [n for n in start if n not in resident(st)]
        if not missing:
            return _service_moves(st)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the reward worker did not keep {start} resident in 300s")
        for name in missing:
            st = call(name)
        if [n for n in start if n not in resident(st)]:
            time.sleep(pause)
            pause = min(2 * pause, 16.0)


def reported_since(client: Any, since: float, timeout_s: float = 30.0) -> dict:
    """The status once every reward worker was heard from after ``since`` (monotonic): with no
    action left to run, that is a heartbeat, whose service counts include every load of the run."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = client.status()
        ago = time.monotonic() - since
        # (last_seen_s is rounded to 10 ms: a frame seen that much after ``since`` is a newer one)
        if all(w["last_seen_s"] + 0.01 < ago for w in st["workers"] if "reward" in w["kinds"]):
            return st
        if time.monotonic() > deadline:
            raise RuntimeError(f"the reward workers sent no heartbeat in {timeout_s:g}s")
        time.sleep(0.1)


def _service_moves(status: dict) -> dict[str, dict[str, Any]]:
    """Loads, evictions and the mean load seconds of each service, over all reward workers."""
    out: dict[str, dict[str, Any]] = {}
    for w in status["workers"]:
        for name, m in (w.get("service_moves") or {}).items():
            o = out.setdefault(name, {"loads": 0, "evictions": 0, "load_s": None, "_s": 0.0})
            o["loads"] += m["loads"]
            o["evictions"] += m["evictions"]
            if m["load_s"] is not None:
                o["_s"] += m["load_s"] * m["loads"]
    for o in out.values():
        s = o.pop("_s")
        o["load_s"] = s / o["loads"] if o["loads"] and s else None
    return out


def moved_trajectories(plan: Any, workers: list[str | None]) -> int:
    """Trajectories whose environment's actions ran on more than one worker (moved while alive)."""
    w = plan.workload
    env_cls = {i for i, a in enumerate(w.actions) if a.uses_env}
    n = 0
    for starts, lens in zip(plan.step_traj_start, plan.step_traj_len):
        for st, ln in zip(starts.tolist(), lens.tolist()):
            ran = {workers[i] for i in range(st, st + ln) if int(plan.cls[i]) in env_cls and workers[i]}
            n += len(ran) > 1
    return n


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
                                     description="Run a small workload live on local workers and in the simulator; "
                                                 "compare mean ACT.")
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
          + (f"; services loaded {res['live_service_loads']} times, evicted {res['live_service_evictions']} "
             f"(load s measured {({n: round(s, 2) for n, s in res['service_load_s'].items() if s})})"
             if res["live_service_loads"] else "")
          + (f"; sandbox cost {res['sandbox_cost_s'] * 1000:.0f} ms (taken off each command)"
             if res["sandbox_cost_s"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
