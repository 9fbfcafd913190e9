"""``tangram-hpc bench``: tangram against the setups users deploy, in the simulator.

Runs one workload (a file or a preset name) under

* ``trajectory-max`` -- every trajectory holds a sandbox of the largest
  ``max_cores`` of any action for its whole life;
* ``trajectory-best`` -- the same at the best fixed sandbox size (every size
  from 1 to the largest is tried; the one with the lowest mean ACT is kept);
* ``task-isolated`` -- fixed per-task pools sized from a profiling run;
* ``pooled-{fifo,sjf}-{min,max}`` -- one shared CPU pool, first come first
  served or shortest predicted first, every action at its min or max cores;
* ``tangram`` -- :class:`~tangram_hpc.policy.elastic.ElasticScheduler` with
  :class:`~tangram_hpc.policy.pool.PoolController`,

all on the same sampled plan and cluster; every baseline's GPU side is a
reward server with the services kept loaded (:mod:`tangram_hpc.sim.baselines`).
It prints mean/p50/p99 ACT, step duration, allocated CPU core-seconds and
GPU-seconds, utilisation, two lower bounds on the mean ACT (per action, and
capacity-aware: :mod:`tangram_hpc.sim.bounds`) and the ratios of every
baseline to tangram.  Savings are per resource (CPU core-seconds, GPU-seconds
apart) and at equal step time on both sides: each baseline is cut to the
smallest cluster that still reaches its own step duration, tangram's pool
maximum to the smallest that reaches the same.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from functools import partial
from typing import Any, Callable, cast

import numpy as np

from . import native
from .policy.elastic import ElasticScheduler
from .policy.prefetch import Prefetch
from .policy.pool import PoolConfig, PoolController
from .policy.predict import Predictor
from .progress import progress_reporter
from .resources import CPU, GPU
from .sim.baselines import (PooledPolicy, TaskIsolatedPolicy, TrajectoryBoundPolicy, isolated_split, sandbox_mem_mb,
                             unconstrained_peaks)
from .sim.bounds import capacity_bound
from .sim.engine import SimResult, SimulationStalled, cluster_shapes, service_infos, simulate
from .sim.layout import ServiceNotHosted, workload_layout
from .sim.workload import Plan, Workload, WorkloadError, load_workload, preset_names

__all__ = ["add_arguments", "main", "run_bench", "run_seeds", "seed_spread", "parse_seeds", "tangram_run",
           "baseline_makers", "BASELINES"]


#: baselines in the order they are reported
BASELINES = ("trajectory-max", "trajectory-best", "task-isolated", "pooled-fifo-min", "pooled-fifo-max",
             "pooled-fifo-elastic", "pooled-sjf-min", "pooled-sjf-max", "pooled-sjf-elastic")
STEP_TOLERANCE = 0.01    # a cut cluster "reaches" a step time within 1 %
MAX_SEEDS = 1000
#: "no worse" across seeds allows this relative difference: sums of the same times in another order
TIE_TOLERANCE = 1e-9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload",
                        help=f"workload TOML file or preset name ({', '.join(preset_names())}); or --family")
    parser.add_argument("--family", type=_positive(int), metavar="N",
                        help="instead of one workload, N generated ones (drawn from --family-seed across what "
                             "the format expresses): how often and by how much each baseline beats tangram")
    parser.add_argument("--family-seed", type=int, default=0, metavar="S", help="the family's seed (default 0)")
    parser.add_argument("--family-out", metavar="DIR",
                        help="write the family's worst runs for tangram here as workload files (default "
                             "family-S-worst in the current directory)")
    parser.add_argument("--family-worst", type=int, default=5, metavar="K",
                        help="how many worst runs to write (default 5)")
    parser.add_argument("--service-costs", metavar="PATH",
                        help="the services' load times as measured on a device: a costs file or report of "
                             "benchmarks/gpu_services.py (docs/services.md, 'Measured costs in the simulator')")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--plot", metavar="DIR", help="write PNG plots (ACT CDF, utilisation) to DIR")
    parser.add_argument("--scale", type=_positive(float), default=1.0,
                        help="multiply trajectories per step by this (default 1)")
    parser.add_argument("--cluster-scale", type=_positive(float), default=1.0,
                        help="multiply the cluster's worker counts by this (default 1)")
    parser.add_argument("--steps", type=_positive(int), default=None, help="override the number of RL steps")
    parser.add_argument("--seed", type=parse_seeds, default=None, metavar="SEEDS",
                        help="override the workload's seed; several (100-104, or 1,5,9) run the bench once per "
                             "seed and print the spread of each figure and on how many seeds tangram was no "
                             "worse than each baseline (without the savings search)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="run N simulations at once, each in its own process: the seeds, with several; "
                             "with one, the sandbox sizes, the baselines and tangram, then the savings "
                             "searches (default 1; 0: one per CPU this process may use). The figures are the "
                             "same as with one")
    parser.add_argument("--no-search", action="store_true",
                        help="skip the savings (the searches for the smallest clusters at equal step time)")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress on stderr (there is none when stderr is not a terminal)")


def _positive(typ: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            v = typ(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not 0 < v < float("inf"):
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        return v
    parse.__name__ = typ.__name__      # argparse names the type in its messages
    return parse


def tangram_run(plan: Plan, *, cpu_workers: int | None = None, gpu_workers: int | None = None,
                progress: Callable[[str], None] | None = None, name: str = "tangram") -> SimResult:
    """Simulate tangram (elastic scheduler + pool controller) with the given maximum pool size."""
    w = plan.workload
    cpu = w.cluster.cpu_workers if cpu_workers is None else cpu_workers
    gpu = w.cluster.gpu_workers if gpu_workers is None else gpu_workers
    shapes = cluster_shapes(w)
    pred = Predictor()
    # decide() states the launches it wants; throttling submissions is the pool driver's business
    cfg = PoolConfig(list(shapes.values()), max_workers={CPU: cpu, GPU: gpu}, startup_s=w.cluster.startup_s,
                     idle_ttl_s=w.cluster.idle_ttl_s)
    sched = ElasticScheduler(pred, shapes=list(shapes.values()), services=service_infos(w),
                             env_move_s=w.cluster.env_move_s, barriers=w.rollout.sync_turns,
                             gpu_layout=workload_layout(w, gpu), prefetch=Prefetch())   # as the coordinator runs it
    return simulate(plan, sched, pool=PoolController(cfg, pred), name=name,
                    workers={CPU: cpu, GPU: gpu}, progress=progress, clock=time.perf_counter)


def _sandbox_sizes(w: Workload) -> list[int]:
    cpu = [a for a in w.actions if not a.service]
    biggest = max((a.max_cores for a in cpu), default=1)
    smallest = max((a.min_cores for a in cpu), default=1)
    return list(range(smallest, biggest + 1))


def trajectory_bound(w: Workload, size: int) -> TrajectoryBoundPolicy:
    """The trajectory-bound baseline with ``size``-core sandboxes that reserve their largest action's memory."""
    infos = service_infos(w)
    return TrajectoryBoundPolicy(size, {k: v.gpu_mem_mb for k, v in infos.items()},
                                 {k: v.max_batch for k, v in infos.items()}, layout=workload_layout(w),
                                 sandbox_mem_mb=sandbox_mem_mb(w))


def baseline_makers(plan: Plan) -> dict[str, Callable[[], Any]]:
    """Fresh policy objects per baseline (``trajectory-best`` is searched in :func:`baseline_runs`).

    Every static GPU side keeps the one demand-weighted layout (:mod:`tangram_hpc.sim.layout`);
    the pooled ones move environments by the rule and cost tangram has."""
    w = plan.workload
    infos = service_infos(w)
    layout = workload_layout(w)

    def task_isolated() -> TaskIsolatedPolicy:
        # pools sized from a profiling run: another sample of the same workload, not this plan's
        # durations (sampled only for this baseline: the savings search makes many of the others)
        profile = w.sample((w.seed or 0) + 1_000_003)
        cpu_plan, gpu_plan = isolated_split(w, unconstrained_peaks(profile), layout)
        return TaskIsolatedPolicy(cpu_plan, gpu_plan, infos)

    out: dict[str, Callable[[], Any]] = {
        "trajectory-max": lambda: trajectory_bound(w, max(_sandbox_sizes(w))),
        "task-isolated": task_isolated,
    }
    for order in ("fifo", "sjf"):
        for cores in ("min", "max", "elastic"):
            out[f"pooled-{order}-{cores}"] = partial(PooledPolicy, order, cores, infos, layout=layout,
                                                     env_move_s=w.cluster.env_move_s)
    return out


def _cluster(plan: Plan, cpu: int, gpu: int) -> Plan:
    w = plan.workload
    return replace(plan, workload=replace(w, cluster=replace(w.cluster, cpu_workers=cpu, gpu_workers=gpu)))


def run_baseline(plan: Plan, name: str, *, size: int | None = None, progress=None) -> SimResult:
    w = plan.workload
    if name == "trajectory-best":
        pol = trajectory_bound(w, size or 1)
    else:
        pol = baseline_makers(plan)[name]()
    return simulate(plan, pol, name=name, progress=progress, clock=time.perf_counter)


#: one simulation of the bench: a baseline (with its sandbox size for the trajectory-bound ones) or tangram
SimTask = tuple[str, int | None]

_PLAN: Plan | None = None       # the plan a pool process simulates (sent once per process)
_TANGRAM_CUTS: dict[tuple[int, int], SimResult] = {}     # a pool process's tangram runs on cut clusters


def _set_plan(plan: Plan) -> None:
    global _PLAN
    _PLAN = plan
    _TANGRAM_CUTS.clear()


def _with_plan(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(_PLAN, *args)


def _in_processes(fn: Callable[..., Any], calls: list[tuple], jobs: int, label: str, progress=None,
                  plan: Plan | None = None) -> list[Any]:
    """``fn(*args)`` for each ``args`` of ``calls`` (with ``plan``: ``fn(plan, *args)``, the plan sent
    once per process), ``jobs`` at a time, each in a process of its own; the results in the order
    of ``calls``.  A bar on ``progress`` counts the calls done."""
    n = min(jobs, len(calls))
    bar = getattr(progress, "task", None)
    bar = bar(f"{label}, {n} at a time", len(calls)) if bar else None
    init: tuple[Any, tuple] = (_set_plan, (plan,)) if plan is not None else (None, ())
    # spawned, not forked: the progress display's thread may hold a lock at the moment of a fork
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"), initializer=init[0],
                             initargs=init[1]) as pool:
        futures = [pool.submit(_with_plan, fn, *args) if plan is not None else pool.submit(fn, *args)
                   for args in calls]
        for _ in as_completed(futures):
            if bar is not None:
                bar.advance(1)
        return [f.result() for f in futures]


def _simulate_task(plan: Plan, task: SimTask, progress=None) -> SimResult | str:
    """The run of ``task`` on ``plan``, or why a baseline stalled."""
    name, size = task
    if name == "tangram":
        return tangram_run(plan, progress=progress)     # the product stalling is an error, not a figure
    try:
        return run_baseline(plan, name, size=size, progress=progress)
    except SimulationStalled as e:
        return e.reason
    except ServiceNotHosted as e:
        return str(e)


def _simulate_all(plan: Plan, tasks: list[SimTask], jobs: int, progress=None) -> dict[SimTask, SimResult | str]:
    """Every task's run: one after another, or ``jobs`` at a time, each in a process of its own
    (a simulation is deterministic: the figures are the same either way)."""
    if jobs <= 1 or len(tasks) <= 1:
        out = {}
        for task in tasks:
            if progress:
                name, size = task
                progress(f"simulating trajectory-bound with {size}-core sandboxes ..." if size is not None
                         else f"simulating {name} ...")
            out[task] = _simulate_task(plan, task, progress)
        return out
    results = _in_processes(_simulate_task, [(task,) for task in tasks], jobs, f"{len(tasks)} simulations",
                            progress, plan)
    return dict(zip(tasks, results))


def baseline_runs(plan: Plan, progress=None, *, jobs: int = 1,
                  tangram: bool = False) -> tuple[dict[str, SimResult], dict[str, Any]]:
    """Every baseline on the plan (and tangram, with ``tangram``); also which sandbox size was best,
    what each size gave, what cannot run.  ``jobs`` > 1: that many simulations at once.

    A setup that stalls cannot run the workload on this cluster (trajectory-bound sandboxes with
    per-turn barriers: every trajectory of the batch needs its sandbox at once); it is reported
    as infeasible instead of measured.
    """
    out: dict[str, SimResult] = {}
    meta: dict[str, Any] = {"infeasible": {}}
    w = plan.workload
    sizes = _sandbox_sizes(w)
    others = [n for n in BASELINES if n not in ("trajectory-best", "trajectory-max")]
    tasks: list[SimTask] = ([("trajectory-best", s) for s in sizes] + [(n, None) for n in others]
                            + ([("tangram", None)] if tangram else []))
    done = _simulate_all(plan, tasks, jobs, progress)
    tried = {s: r for (n, s), r in done.items() if n == "trajectory-best" and not isinstance(r, str)}
    stalled = {s: r for (n, s), r in done.items() if n == "trajectory-best" and isinstance(r, str)}
    meta["trajectory_sizes"] = {s: {"mean_act": float(r.act.mean()), "step_s": r.mean_step}
                                for s, r in tried.items()}
    meta["trajectory_sizes"].update({s: None for s in stalled})
    best = min(tried, key=lambda s: (float(tried[s].act.mean()), s)) if tried else None
    meta["trajectory_best_size"] = best
    biggest = max(sizes)
    for name in BASELINES:
        if name in ("trajectory-best", "trajectory-max"):
            size = best if name == "trajectory-best" else biggest
            if size in tried:
                out[name] = replace(tried[size], name=name)
            else:
                why = stalled.get(size) or "no sandbox size can run this workload on the cluster"
                at_once = ", all needed at once at a per-turn barrier" if w.rollout.sync_turns else ""
                meta["infeasible"][name] = (f"{size}-core sandboxes for {w.rollout.trajectories_per_step} "
                                            f"trajectories{at_once}: {why}" if size else why)
            continue
        r = done[(name, None)]
        if isinstance(r, str):
            meta["infeasible"][name] = r
        else:
            out[name] = r
    if tangram:
        out["tangram"] = cast(SimResult, done[("tangram", None)])
    return out, meta


def trajectory_times(r: SimResult, plan: Plan) -> np.ndarray:
    """Per trajectory, from its first action's submit to its last action's end: a policy that holds
    whole trajectories back shows it here, where the wait counts once per action in ACT."""
    starts = np.concatenate(plan.step_traj_start).astype(np.int64)
    return np.maximum.reduceat(r.finish, starts) - r.submit[starts]


def _summary(r: SimResult, plan: Plan) -> dict[str, Any]:
    a = r.act
    c = plan.workload.cluster
    cap = capacity_bound(r, plan, c.cpu_workers * c.cpu_cores, c.gpu_workers * c.gpu_slots)
    return {"mean_act": float(a.mean()), "mean_traj_s": float(trajectory_times(r, plan).mean()),
            "p50_act": float(np.percentile(a, 50)),
            "p99_act": float(np.percentile(a, 99)), "step_s": r.mean_step,
            "steps_s": [float(x) for x in r.step_durations],
            "cpu_core_s": r.cpu_core_s, "gpu_s": r.gpu_s,
            "cpu_util": r.cpu_util, "gpu_util": r.gpu_util,
            "mem_util": r.mem_used_mb_s / r.mem_reserved_mb_s if r.mem_reserved_mb_s else None,
            "per_action_bound": float(r.lower_bound.mean()), "capacity_bound": cap,
            "bound_ratio": float(a.mean()) / cap if cap else math.inf,
            "env_moves": r.env_moves, "sim_wall_s": r.wall_s}


def _smallest(hi: int, good: Callable[[int], bool], lo: int = 1) -> int:
    """The smallest n in lo..hi with good(n), for a good() that stays true above it (bisection)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if good(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def smallest_cluster(plan: Plan, run: Callable[[Plan], SimResult], target_step: float,
                     uses_gpu: bool) -> tuple[int, int, SimResult] | None:
    """The fewest CPU workers, then GPU workers, whose run reaches ``target_step`` (None if the full cluster does not)."""
    c = plan.workload.cluster
    cache: dict[tuple[int, int], SimResult | None] = {}

    def res(cpu: int, gpu: int) -> SimResult | None:
        if (cpu, gpu) not in cache:
            try:
                cache[(cpu, gpu)] = run(_cluster(plan, cpu, gpu))
            except (SimulationStalled, ServiceNotHosted):   # the setup cannot run on so few workers
                cache[(cpu, gpu)] = None
        return cache[(cpu, gpu)]

    def ok(cpu: int, gpu: int) -> bool:
        r = res(cpu, gpu)
        return r is not None and r.mean_step <= target_step * (1 + STEP_TOLERANCE)

    C, G = c.cpu_workers, c.gpu_workers if uses_gpu else 0
    if not ok(C, G):
        return None
    cpu = _smallest(C, lambda n: ok(n, G))
    gpu = _smallest(G, lambda n: ok(cpu, n)) if G else 0
    r = res(cpu, gpu)
    assert r is not None
    return cpu, gpu, r


def savings(plan: Plan, runs: dict[str, SimResult], baselines: list[str], best_size: int,
            progress=None, *, jobs: int = 1) -> dict[str, Any]:
    """Per baseline: it and tangram, each cut to the smallest cluster reaching the baseline's step time.

    ``jobs`` > 1: that many baselines' searches at once, each in a process of its own."""
    targets = {name: runs[name].mean_step for name in baselines}
    if jobs <= 1 or len(baselines) <= 1:
        cuts: dict[tuple[int, int], SimResult] = {}       # tangram's runs, shared by the searches
        return {name: _saving(plan, name, targets[name], best_size, cuts, progress) for name in baselines}
    results = _in_processes(_saving, [(name, targets[name], best_size) for name in baselines], jobs,
                            f"savings: {len(baselines)} searches", progress, plan)
    return dict(zip(baselines, results))


def _saving(plan: Plan, name: str, target: float, best_size: int,
            cuts: dict[tuple[int, int], SimResult] | None = None, progress=None) -> dict[str, Any]:
    """One baseline's entry of :func:`savings` (``cuts``: tangram's runs so far; by default the
    process's own)."""
    cuts = cuts if cuts is not None else _TANGRAM_CUTS
    uses_gpu = any(a.service for a in plan.workload.actions)

    def tangram(p: Plan) -> SimResult:
        key = (p.workload.cluster.cpu_workers, p.workload.cluster.gpu_workers)
        if key not in cuts:
            if progress:
                progress(f"  tangram with at most {key[0]} CPU / {key[1]} GPU workers ...")
            cuts[key] = tangram_run(p, name=f"tangram[{key[0]},{key[1]}]")
        return cuts[key]

    if progress:
        progress(f"savings against {name} (step {target:.0f}s): cutting its cluster ...")
    cut = smallest_cluster(plan, lambda p: run_baseline(p, name, size=best_size), target, uses_gpu)
    mine = smallest_cluster(plan, tangram, target, uses_gpu)
    ent: dict[str, Any] = {"step_s": target}
    if cut is not None:
        ent["baseline"] = {"cpu_workers": cut[0], "gpu_workers": cut[1], "step_s": cut[2].mean_step,
                           "cpu_core_s": cut[2].cpu_core_s, "gpu_s": cut[2].gpu_s}
    if mine is None:
        ent["tangram"] = None
    else:
        ent["tangram"] = {"cpu_workers": mine[0], "gpu_workers": mine[1], "step_s": mine[2].mean_step,
                          "cpu_core_s": mine[2].cpu_core_s, "gpu_s": mine[2].gpu_s,
                          "mean_act": float(mine[2].act.mean())}
    if cut is not None and mine is not None:
        b, t = cut[2], mine[2]
        ent["cpu_saving"] = 1 - t.cpu_core_s / b.cpu_core_s if b.cpu_core_s else None
        ent["gpu_saving"] = (1 - t.gpu_s / b.gpu_s) if b.gpu_s else None
    return ent


def parse_seeds(text: str) -> list[int]:
    """``7``, ``100-104`` or ``1,5,9-11`` as the list of seeds it names, in order, each once."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"seed {part.strip()!r}: expected N or N-M (N, M >= 0)") from None
        if first < 0 or last < first or last - first >= MAX_SEEDS:
            raise argparse.ArgumentTypeError(f"seed range {part.strip()!r}: expected N-M with 0 <= N <= M "
                                             f"and at most {MAX_SEEDS} seeds")
        seeds.extend(s for s in range(first, last + 1) if s not in seeds)
    if len(seeds) > MAX_SEEDS:
        raise argparse.ArgumentTypeError(f"{len(seeds)} seeds: at most {MAX_SEEDS}")
    return seeds


def run_bench(w: Workload, *, search: bool = True, jobs: int = 1,
              progress=None) -> tuple[dict[str, Any], dict[str, SimResult]]:
    """The bench on one sample of ``w``; ``jobs`` > 1 runs that many of its simulations at once."""
    plan = w.sample()
    if progress:
        progress(f"{w.name}: {plan.n_trajectories:,} trajectories, {plan.n_actions:,} actions")
    runs, meta = baseline_runs(plan, progress, jobs=jobs, tangram=True)
    t = runs["tangram"]
    fig: dict[str, Any] = {
        "workload": w.name, "source": w.source, "trajectories": plan.n_trajectories,
        "actions": plan.n_actions, "steps": w.rollout.steps,
        "cluster": {"cpu_workers": w.cluster.cpu_workers, "cpu_cores": w.cluster.cpu_cores,
                    "gpu_workers": w.cluster.gpu_workers, "gpu_slots": w.cluster.gpu_slots},
        "policies": {k: _summary(r, plan) for k, r in runs.items()},
        "trajectory_best_size": meta["trajectory_best_size"], "trajectory_sizes": meta["trajectory_sizes"],
        "infeasible": meta["infeasible"], "tangram_vs": {}, "savings": {}, "env_move_s": w.cluster.env_move_s,
    }
    ts = fig["policies"]["tangram"]
    for k, r in runs.items():
        if k == "tangram":
            continue
        fig["tangram_vs"][k] = {
            "act_ratio": float(r.act.mean() / t.act.mean()),
            "traj_ratio": fig["policies"][k]["mean_traj_s"] / ts["mean_traj_s"],
            # no scheduler can do better than every action alone on its best cores, unqueued
            "act_ratio_ceiling": float(r.act.mean()) / ts["per_action_bound"],
            "step_ratio": r.mean_step / t.mean_step,
            "cpu_core_s_ratio": r.cpu_core_s / t.cpu_core_s if t.cpu_core_s else None,
            "gpu_s_ratio": r.gpu_s / t.gpu_s if t.gpu_s else None,
        }
    fig["tangram_bound_ratio"] = ts["bound_ratio"]
    if search:
        fig["savings"] = savings(plan, runs, [b for b in BASELINES if b in runs], meta["trajectory_best_size"],
                                 progress, jobs=jobs)
    return fig, runs


def _seed_fig(w: Workload, seed: int, progress=None) -> dict[str, Any]:
    fig, _ = run_bench(replace(w, seed=seed), search=False, progress=progress)
    fig["seed"] = seed
    return fig


def run_seeds(w: Workload, seeds: list[int], *, jobs: int = 1, progress=None) -> dict[str, Any]:
    """The bench (without the savings search) on each seed of ``w``, and the spread (:func:`seed_spread`).

    ``jobs`` > 1 runs that many seeds at once, each in a process of its own (a seed's figures do
    not depend on what else runs).
    """
    if jobs > 1 and len(seeds) > 1:
        figs = _in_processes(_seed_fig, [(w, seed) for seed in seeds], jobs, f"{len(seeds)} seeds", progress)
    else:
        figs = []
        for n, seed in enumerate(seeds, 1):
            def said(msg: str, head: str = f"seed {seed} ({n}/{len(seeds)})") -> None:
                progress(f"{head}: {msg}")
            figs.append(_seed_fig(w, seed, said if progress else None))
    return {"workload": w.name, "source": w.source, "seeds": list(seeds), "steps": w.rollout.steps,
            "spread": seed_spread(figs), "runs": figs}


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": float(np.median(xs)), "min": float(min(xs)), "max": float(max(xs))}


def seed_spread(figs: list[dict[str, Any]]) -> dict[str, Any]:
    """Across the figures of several seeds: median, min and max of each policy's mean ACT and step,
    of each baseline's ratio to tangram, and on how many seeds tangram's were no worse than the
    baseline's (within :data:`TIE_TOLERANCE`).  A policy infeasible on some seeds counts over the rest."""
    names = list(dict.fromkeys(k for f in figs for k in f["policies"]))
    policies: dict[str, Any] = {}
    vs: dict[str, dict[str, Any]] = {}
    for k in names:
        have = [f["policies"][k] for f in figs if k in f["policies"]]
        policies[k] = {"seeds": len(have), "mean_act": _spread([p["mean_act"] for p in have]),
                       "mean_traj_s": _spread([p["mean_traj_s"] for p in have]),
                       "step_s": _spread([p["step_s"] for p in have])}
        if k == "tangram":
            continue
        pairs = [(f["policies"][k], f["policies"]["tangram"]) for f in figs if k in f["policies"]]
        vs[k] = {"seeds": len(pairs)}
        for fig_key, out in (("mean_act", "act"), ("mean_traj_s", "traj"), ("step_s", "step")):
            vs[k][f"{out}_ratio"] = _spread([b[fig_key] / t[fig_key] for b, t in pairs])
            vs[k][f"no_worse_{out}"] = sum(t[fig_key] <= b[fig_key] * (1 + TIE_TOLERANCE) for b, t in pairs)
        vs[k]["act_ratio_ceiling"] = _spread([f["tangram_vs"][k]["act_ratio_ceiling"] for f in figs
                                              if k in f["policies"]])
    return {"seeds": len(figs), "policies": policies, "tangram_vs": vs,
            "trajectory_best_sizes": [f.get("trajectory_best_size") for f in figs],
            "infeasible": {k: {"seeds": sum(k in f.get("infeasible", {}) for f in figs),
                               "why": next(f["infeasible"][k] for f in figs if k in f.get("infeasible", {}))}
                           for k in dict.fromkeys(k for f in figs for k in f.get("infeasible", {}))},
            "bound_ratio": _spread([f["tangram_bound_ratio"] for f in figs])}


def _fmt_seeds(res: dict[str, Any]) -> str:
    sp = res["spread"]
    n = sp["seeds"]

    def rng(s, fmt):
        return f"{format(s['median'], fmt)} [{format(s['min'], fmt)}, {format(s['max'], fmt)}]"
    lines = [f"{'policy':18s} {'mean ACT: median [min, max]':>30s} {'traj s: median [min, max]':>28s} "
             f"{'step s: median [min, max]':>28s}"]
    lines.append("-" * len(lines[0]))
    for k, p in sp["policies"].items():
        note = f"  (on {p['seeds']} of {n} seeds)" if p["seeds"] < n else ""
        if k == "trajectory-best":
            note += f"  (sizes {', '.join(map(str, sp['trajectory_best_sizes']))})"
        lines.append(f"{k:18s} {rng(p['mean_act'], '.3f'):>30s} {rng(p['mean_traj_s'], '.1f'):>28s} "
                     f"{rng(p['step_s'], '.1f'):>28s}{note}")
    for k, v in sp["infeasible"].items():
        lines.append(f"{k:18s} cannot run here on {v['seeds']} of {n} seeds: {v['why']}")
    lines.append("")
    lines.append(f"tangram / capacity-aware bound: {rng(sp['bound_ratio'], '.2f')}")
    lines.append("")
    lines.append(f"{'baseline / tangram':18s} {'ACT: median [min, max]':>26s} {'step: median [min, max]':>26s} "
                 f"{'tangram no worse: ACT, step':>28s}")
    for k, v in sp["tangram_vs"].items():
        lines.append(f"{k:18s} {rng(v['act_ratio'], '.3f'):>26s} {rng(v['step_ratio'], '.3f'):>26s} "
                     f"{str(v['no_worse_act']) + ' / ' + str(v['seeds']):>14s} "
                     f"{str(v['no_worse_step']) + ' / ' + str(v['seeds']):>13s}")
    lines.append("")
    lines.append(f"{'any scheduler, at most':22s} {'ACT ratio: median [min, max]':>28s}  (the baseline's mean ACT over "
                 "the per-action bound)")
    for k, v in sp["tangram_vs"].items():
        lines.append(f"{k:22s} {rng(v['act_ratio_ceiling'], '.3f'):>28s}")
    return "\n".join(lines)


def _fmt_table(fig: dict[str, Any]) -> str:
    lines = []
    hdr = (f"{'policy':20s} {'mean ACT':>9s} {'p50':>7s} {'p99':>8s} {'traj s':>7s} {'step s':>7s} {'core-s':>10s} "
           f"{'GPU-s':>9s} {'CPU util':>8s} {'GPU util':>8s} {'bound':>7s} {'/bound':>6s}")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for k, s in fig["policies"].items():
        name = f"{k} ({fig['trajectory_best_size']})" if k == "trajectory-best" else k
        lines.append(f"{name:20s} {s['mean_act']:9.2f} {s['p50_act']:7.2f} {s['p99_act']:8.1f} "
                     f"{s['mean_traj_s']:7.1f} {s['step_s']:7.0f} "
                     f"{s['cpu_core_s']:10.0f} {s['gpu_s']:9.0f} {s['cpu_util']:8.0%} {s['gpu_util']:8.0%} "
                     f"{s['capacity_bound']:7.2f} {s['bound_ratio']:5.2f}x")
    for k, why in fig.get("infeasible", {}).items():
        lines.append(f"{k:20s} cannot run here: {why}")
    lines.append("")
    ts = fig["policies"]["tangram"]
    lines.append(f"lower bounds on tangram's mean ACT: {ts['per_action_bound']:.2f} s per action (alone, best "
                 f"cores, no wait), {ts['capacity_bound']:.2f} s capacity-aware (the cluster as one machine, "
                 f"shortest work first); tangram / capacity-aware bound = {ts['bound_ratio']:.2f}x")
    if ts.get("env_moves"):
        n = ts["env_moves"]
        lines.append(f"tangram moved environments between workers {n:,} times ({n / fig['trajectories']:.1f} per "
                     f"trajectory, {n / fig['actions']:.2f} per action), at {fig['env_move_s']:g} s each")
    lines.append("")
    lines.append(f"{'baseline / tangram':20s} {'ACT':>8s} {'traj':>8s} {'step':>8s} {'core-s':>8s} {'GPU-s':>8s} "
                 f"{'ACT, any scheduler at most':>27s}")

    def f(x):
        return f"{x:7.2f}x" if x is not None else "       -"
    for k, v in fig["tangram_vs"].items():
        lines.append(f"{k:20s} {f(v['act_ratio'])} {f(v['traj_ratio'])} {f(v['step_ratio'])} {f(v['cpu_core_s_ratio'])} "
                     f"{f(v['gpu_s_ratio'])} {f(v['act_ratio_ceiling']):>27s}")
    lines.append("(at most: the baseline's mean ACT over the per-action bound, what a scheduler that never "
                 "queues an action would reach)")
    if fig["savings"]:
        lines.append("")
        lines.append("savings at equal step time (each side cut to the smallest cluster that reaches the "
                     "baseline's step time):")

        def pct(x):
            if x is None:
                return "      -"
            return f"{x:6.1%} fewer" if x >= 0 else f"{-x:6.1%} more"
        for k, e in fig["savings"].items():
            b, t = e.get("baseline"), e.get("tangram")
            if b is None:
                lines.append(f"  {k:18s} its step time is not reproducible on its own cluster")
                continue
            if t is None:
                lines.append(f"  {k:18s} step {e['step_s']:.0f}s: tangram does not reach it with the full cluster")
                continue
            lines.append(f"  {k:18s} step {e['step_s']:6.0f}s: baseline {b['cpu_workers']} CPU / {b['gpu_workers']} "
                         f"GPU workers, tangram at most {t['cpu_workers']} / {t['gpu_workers']}: CPU core-s "
                         f"{pct(e.get('cpu_saving'))}, GPU-s {pct(e.get('gpu_saving'))}")
    return "\n".join(lines)


def write_plots(runs: dict[str, SimResult], out_dir: str, title: str) -> list[str]:
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, r in runs.items():
        a = np.sort(r.act)
        ax.plot(np.maximum(a, 1e-3), np.arange(1, len(a) + 1) / len(a), label=k)
    ax.set_xscale("log")
    ax.set_xlabel("action completion time (s)")
    ax.set_ylabel("fraction of actions")
    ax.set_title(f"{title}: ACT CDF")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    p = os.path.join(out_dir, f"{title}-act-cdf.png")
    fig.savefig(p, dpi=120, bbox_inches="tight")
    plt.close(fig)
    paths.append(p)
    has_gpu = any(r.gpu_slot_s for r in runs.values())
    fig, axes = plt.subplots(2 if has_gpu else 1, 1, figsize=(8, 6 if has_gpu else 3.5), squeeze=False)
    for k, r in runs.items():
        tr = np.array(r.trace, dtype=float)
        if not len(tr):
            continue
        axes[0][0].plot(tr[:, 0], tr[:, 1] / np.maximum(tr[:, 2], 1), label=k, lw=0.8)
        if has_gpu:
            axes[1][0].plot(tr[:, 0], tr[:, 3] / np.maximum(tr[:, 4], 1), label=k, lw=0.8)
    axes[0][0].set_ylabel("CPU busy / allocated")
    axes[0][0].set_title(f"{title}: utilisation over time")
    axes[0][0].legend(fontsize=7)
    if has_gpu:
        axes[1][0].set_ylabel("GPU slots busy / allocated")
    axes[-1][0].set_xlabel("simulated time (s)")
    p = os.path.join(out_dir, f"{title}-utilisation.png")
    fig.savefig(p, dpi=120, bbox_inches="tight")
    plt.close(fig)
    paths.append(p)
    return paths


def main(args: argparse.Namespace) -> int:
    if args.family is not None:
        return _main_family(args)
    if args.workload is None:
        print("tangram-hpc bench: give --workload FILE-OR-PRESET or --family N", file=sys.stderr)
        return 2
    try:
        w = load_workload(args.workload)
    except WorkloadError as e:
        print(f"tangram-hpc bench: {e}", file=sys.stderr)
        return 2
    if args.scale != 1.0 or args.cluster_scale != 1.0 or args.steps is not None:
        w = w.scaled(trajectories=args.scale, cluster=args.cluster_scale, steps=args.steps)
    if args.service_costs:
        from .sim.costs import read_costs, with_measured_costs
        try:
            w = with_measured_costs(w, read_costs(args.service_costs))
        except WorkloadError as e:
            print(f"tangram-hpc bench: {e}", file=sys.stderr)
            return 2
        print("service load times as measured: " + ", ".join(f"{n} {s.load_s:.3g} s" for n, s in w.services.items()),
              file=sys.stderr)
    if args.jobs < 0:
        print("tangram-hpc bench: --jobs must be 0 (one per CPU) or more", file=sys.stderr)
        return 2
    jobs = args.jobs or len(os.sched_getaffinity(0))
    if args.seed is not None and len(args.seed) > 1:
        return _main_seeds(args, w, jobs)
    if args.seed is not None:
        w = replace(w, seed=args.seed[0])
    t0 = time.perf_counter()
    with progress_reporter(args.quiet) as progress:
        fig, runs = run_bench(w, search=not args.no_search, jobs=jobs, progress=progress)
    fig["bench_wall_s"] = time.perf_counter() - t0
    fig["bench_native"] = native.active()       # whether the compiled simulator ran (same figures, faster)
    print(f"workload {w.name} ({w.source}): {fig['trajectories']:,} trajectories, {fig['actions']:,} actions, "
          f"{w.rollout.steps} step{'s' if w.rollout.steps != 1 else ''}")
    print(_fmt_table(fig))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=2)
    if args.plot:
        for p in write_plots(runs, args.plot, w.name):
            print(f"wrote {p}", file=sys.stderr)
    return 0


def _main_family(args: argparse.Namespace) -> int:
    from .bench_family import format_family, run_family, write_worst
    if args.workload is not None or args.plot or args.scale != 1.0 or args.cluster_scale != 1.0 or args.steps:
        print("tangram-hpc bench: --family draws its own workloads (no --workload, --plot, --scale, "
              "--cluster-scale or --steps)", file=sys.stderr)
        return 2
    if args.jobs < 0:
        print("tangram-hpc bench: --jobs must be 0 (one per CPU) or more", file=sys.stderr)
        return 2
    jobs = args.jobs or len(os.sched_getaffinity(0))
    t0 = time.perf_counter()
    with progress_reporter(args.quiet) as progress:
        res = run_family(args.family, args.family_seed, args.seed, jobs=jobs, progress=progress)
    res["bench_wall_s"] = time.perf_counter() - t0
    seeds = f" at seeds {', '.join(map(str, args.seed))}" if args.seed else " at each one's own seed"
    print(f"family of {args.family} workloads (family seed {args.family_seed}){seeds}: {res['summary']['runs']} runs, "
          "no savings search")
    print(format_family(res))
    out = args.family_out or f"family-{args.family_seed}-worst"
    paths = write_worst(res, out, args.family_worst)
    if paths:
        print(f"the {len(paths)} runs where a baseline led by most, as workload files: {', '.join(paths)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _main_seeds(args: argparse.Namespace, w: Workload, jobs: int) -> int:
    if args.plot:
        print("tangram-hpc bench: --plot draws one run: give one seed", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with progress_reporter(args.quiet) as progress:
        res = run_seeds(w, args.seed, jobs=jobs, progress=progress)
    res["bench_wall_s"] = time.perf_counter() - t0
    res["bench_native"] = native.active()
    first = res["runs"][0]
    print(f"workload {w.name} ({w.source}): {len(args.seed)} seeds ({', '.join(map(str, args.seed))}), "
          f"{first['trajectories']:,} trajectories and about {first['actions']:,} actions each, "
          f"{w.rollout.steps} step{'s' if w.rollout.steps != 1 else ''} each; no savings search (it runs with "
          f"one seed)")
    print(_fmt_seeds(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":   # python -m tangram_hpc.bench --workload swe
    ap = argparse.ArgumentParser(prog="tangram-hpc bench", description=__doc__.splitlines()[0])
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
