"""``tangram-hpc bench``: tangram against the resource-management baselines, in the simulator.

Runs one workload (a file or a preset name) under

* ``trajectory-bound`` -- every trajectory holds a sandbox of its largest
  ``max_cores`` and a bound share of the reward GPUs for its whole life;
* ``trajectory-share`` -- the same, with the cluster's cores split evenly
  between the step's trajectories (every trajectory gets a sandbox at once);
* ``task-isolated`` -- fixed per-task pools sized for their peak;
* ``fifo`` -- action-level pooling, FIFO, ``min_cores``, no elasticity;
* ``tangram`` -- :class:`~tangram_hpc.policy.elastic.ElasticScheduler` with
  :class:`~tangram_hpc.policy.pool.PoolController`,

all on the same sampled plan and the same cluster, and prints mean/p50/p99
ACT, step duration, allocated resource-seconds and utilisation, the ratios of
tangram against each baseline, the ACT lower bound (each action alone at its
best core count, no waiting, no service load) and -- by bisection over the
pool's maximum size -- the resources tangram needs to match each
trajectory-bound baseline's step duration.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, Callable

import numpy as np

from .policy.elastic import ElasticScheduler
from .policy.fifo import FifoPolicy
from .policy.pool import PoolConfig, PoolController
from .policy.predict import Predictor
from .progress import progress_reporter
from .sim.baselines import TaskIsolatedPolicy, TrajectoryBoundPolicy, isolated_split, unconstrained_peaks
from .sim.engine import SimResult, cluster_shapes, simulate
from .sim.workload import Plan, Workload, WorkloadError, load_workload, preset_names

__all__ = ["add_arguments", "main", "run_bench", "tangram_run"]

# Done-when targets of the benchmark (from the ARL-Tangram paper's headline figures)
TARGET_ACT_RATIO = 4.3
TARGET_STEP_RATIO = 1.5
TARGET_SAVING = 0.71
TARGET_LB_RATIO = 1.3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True,
                        help=f"workload TOML file or preset name ({', '.join(preset_names())})")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--plot", metavar="DIR", help="write PNG plots (ACT CDF, utilisation) to DIR")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply trajectories per step by this (default 1)")
    parser.add_argument("--cluster-scale", type=float, default=1.0,
                        help="multiply the cluster's worker counts by this (default 1)")
    parser.add_argument("--steps", type=int, default=None, help="override the number of RL steps")
    parser.add_argument("--seed", type=int, default=None, help="override the workload's seed")
    parser.add_argument("--no-search", action="store_true",
                        help="skip the search for the pool size matching the trajectory-bound step duration")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress on stderr (there is none when stderr is not a terminal)")


def tangram_run(plan: Plan, *, cpu_workers: int | None = None, gpu_workers: int | None = None,
                progress: Callable[[str], None] | None = None, name: str = "tangram") -> SimResult:
    """Simulate tangram (elastic scheduler + pool controller) with the given maximum pool size."""
    w = plan.workload
    cpu = w.cluster.cpu_workers if cpu_workers is None else cpu_workers
    gpu = w.cluster.gpu_workers if gpu_workers is None else gpu_workers
    shapes = cluster_shapes(w)
    pred = Predictor()
    cfg = PoolConfig(list(shapes.values()), max_workers={"cpu": cpu, "gpu": gpu},
                     startup_s=w.cluster.startup_s, idle_ttl_s=w.cluster.idle_ttl_s)
    sched = ElasticScheduler(pred, shapes=list(shapes.values()))
    return simulate(plan, sched, pool=PoolController(cfg, pred), name=name,
                    workers={"cpu": cpu, "gpu": gpu}, progress=progress)


def _services(w: Workload) -> dict[str, int]:
    return {k: v.gpu_mem_mb for k, v in w.services.items()}


def _sandbox_sizes(w: Workload) -> tuple[int, int]:
    cpu = [a for a in w.actions if not a.service]
    biggest = max((a.max_cores for a in cpu), default=1)
    smallest_ok = max((a.min_cores for a in cpu), default=1)
    share = w.cluster.cpu_workers * w.cluster.cpu_cores // max(1, w.rollout.trajectories_per_step)
    return biggest, max(smallest_ok, min(biggest, share))


def baseline_runs(plan: Plan, progress=None) -> dict[str, SimResult]:
    w = plan.workload
    svcs = _services(w)
    big, share = _sandbox_sizes(w)
    cpu_plan, gpu_plan = isolated_split(w, unconstrained_peaks(plan))
    makers: list[tuple[str, Callable[[], Any]]] = [
        ("trajectory-bound", lambda: TrajectoryBoundPolicy(big, svcs)),
        ("trajectory-share", lambda: TrajectoryBoundPolicy(share, svcs)),
        ("task-isolated", lambda: TaskIsolatedPolicy(cpu_plan, gpu_plan, svcs)),
        ("fifo", lambda: FifoPolicy(shapes=list(cluster_shapes(w).values()))),
    ]
    out = {}
    for name, make in makers:
        if progress:
            progress(f"simulating {name} ...")
        out[name] = simulate(plan, make(), name=name, progress=progress)
    return out


def _resources(r: SimResult) -> float:
    """CPU core-seconds plus GPU-seconds, each relative to its own baseline is reported separately."""
    return r.cpu_core_s + r.gpu_s


def match_step(plan: Plan, target_step: float, progress=None) -> dict[str, Any]:
    """Smallest pool (CPU workers, then GPU workers) whose tangram step duration is <= ``target_step``."""
    w = plan.workload
    cache: dict[tuple[int, int], SimResult] = {}

    def run(c: int, g: int) -> SimResult:
        if (c, g) not in cache:
            if progress:
                progress(f"  search: tangram with at most {c} CPU / {g} GPU workers ...")
            cache[(c, g)] = tangram_run(plan, cpu_workers=c, gpu_workers=g, name=f"tangram[{c},{g}]")
        return cache[(c, g)]

    def ok(r: SimResult) -> bool:
        return r.mean_step <= target_step

    C, G = w.cluster.cpu_workers, w.cluster.gpu_workers
    if not ok(run(C, G)):
        return {"matched": False, "cpu_workers": C, "gpu_workers": G, "result": run(C, G)}
    c = _smallest(C, lambda n: ok(run(n, G)))      # fewest CPU workers that still match
    g = _smallest(G, lambda n: ok(run(c, n))) if G else G
    return {"matched": True, "cpu_workers": c, "gpu_workers": g, "result": run(c, g)}


def _smallest(hi: int, good) -> int:
    """The smallest n in 1..hi with good(n), for a good() that stays true above it (bisection)."""
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        if good(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _summary(r: SimResult) -> dict[str, Any]:
    a = r.act
    return {"mean_act": float(a.mean()), "p50_act": float(np.percentile(a, 50)),
            "p99_act": float(np.percentile(a, 99)), "step_s": r.mean_step,
            "steps_s": [float(x) for x in r.step_durations],
            "cpu_core_s": r.cpu_core_s, "gpu_s": r.gpu_s,
            "cpu_util": r.cpu_util, "gpu_util": r.gpu_util, "sim_wall_s": r.wall_s}


def run_bench(w: Workload, *, search: bool = True, progress=None) -> tuple[dict[str, Any], dict[str, SimResult]]:
    plan = w.sample()
    if progress:
        progress(f"{w.name}: {plan.n_trajectories:,} trajectories, {plan.n_actions:,} actions")
    runs = baseline_runs(plan, progress)
    if progress:
        progress("simulating tangram ...")
    runs["tangram"] = tangram_run(plan, progress=progress)
    t = runs["tangram"]
    lb = float(plan_lb(t))
    fig: dict[str, Any] = {
        "workload": w.name, "source": w.source, "trajectories": plan.n_trajectories,
        "actions": plan.n_actions, "lower_bound_mean_act": lb,
        "policies": {k: _summary(r) for k, r in runs.items()},
        "tangram_vs": {}, "match_step": {},
    }
    fig["tangram_lb_ratio"] = float(t.act.mean()) / lb if lb else math.inf
    for k, r in runs.items():
        if k == "tangram":
            continue
        fig["tangram_vs"][k] = {
            "act_ratio": float(r.act.mean() / t.act.mean()),
            "step_ratio": r.mean_step / t.mean_step,
            "cpu_core_s_ratio": r.cpu_core_s / t.cpu_core_s if t.cpu_core_s else None,
            "gpu_s_ratio": r.gpu_s / t.gpu_s if t.gpu_s else None,
        }
    if search:
        for k in ("trajectory-bound", "trajectory-share"):
            base = runs[k]
            if progress:
                progress(f"searching the pool that matches {k}'s step duration ({base.mean_step:.0f}s) ...")
            m = match_step(plan, base.mean_step, progress)
            r = m.pop("result")
            m.update(step_s=r.mean_step, mean_act=float(r.act.mean()), cpu_core_s=r.cpu_core_s, gpu_s=r.gpu_s,
                     cpu_saving=1 - r.cpu_core_s / base.cpu_core_s if base.cpu_core_s else None,
                     gpu_saving=1 - r.gpu_s / base.gpu_s if base.gpu_s else None,
                     saving=1 - _resources(r) / _resources(base) if _resources(base) else None)
            fig["match_step"][k] = m
    fig["done_when"] = _done_when(fig)
    return fig, runs


def plan_lb(r: SimResult) -> float:
    return float(r.lower_bound.mean())


def _done_when(fig: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k in ("trajectory-bound", "trajectory-share"):
        vs = fig["tangram_vs"][k]
        d = {"act_ratio": vs["act_ratio"] >= TARGET_ACT_RATIO,
             "step_ratio": vs["step_ratio"] >= TARGET_STEP_RATIO}
        m = fig["match_step"].get(k)
        if m:
            savings = [s for s in (m["cpu_saving"], m["gpu_saving"]) if s is not None]
            d["saving"] = bool(m["matched"] and savings and min(savings) >= TARGET_SAVING)
        out[k] = d
    out["lb_ratio"] = fig["tangram_lb_ratio"] <= TARGET_LB_RATIO
    return out


def _fmt_table(fig: dict[str, Any]) -> str:
    lines = []
    hdr = (f"{'policy':18s} {'mean ACT':>9s} {'p50':>8s} {'p99':>9s} {'step s':>8s} "
           f"{'core-s':>11s} {'GPU-s':>9s} {'CPU util':>8s} {'GPU util':>8s}")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for k, s in fig["policies"].items():
        lines.append(f"{k:18s} {s['mean_act']:9.2f} {s['p50_act']:8.2f} {s['p99_act']:9.1f} {s['step_s']:8.0f} "
                     f"{s['cpu_core_s']:11.0f} {s['gpu_s']:9.0f} {s['cpu_util']:8.0%} {s['gpu_util']:8.0%}")
    lines.append("")
    lines.append(f"ACT lower bound (each action alone, best cores, no wait): {fig['lower_bound_mean_act']:.2f} s; "
                 f"tangram / bound = {fig['tangram_lb_ratio']:.2f}x")
    lines.append("")
    lines.append(f"{'tangram vs':18s} {'ACT':>8s} {'step':>8s} {'core-s':>8s} {'GPU-s':>8s}   (baseline / tangram)")
    for k, v in fig["tangram_vs"].items():
        def f(x):
            return f"{x:7.2f}x" if x is not None else "       -"
        lines.append(f"{k:18s} {f(v['act_ratio'])} {f(v['step_ratio'])} {f(v['cpu_core_s_ratio'])} "
                     f"{f(v['gpu_s_ratio'])}")
    for k, m in fig["match_step"].items():
        lines.append("")
        base = fig["policies"][k]
        if not m["matched"]:
            lines.append(f"matching {k}'s step duration ({base['step_s']:.0f}s): not reached even with the "
                         f"full cluster (tangram: {m['step_s']:.0f}s)")
            continue
        def pct(x):
            return f"{x:.1%}" if x is not None else "-"
        lines.append(f"matching {k}'s step duration ({base['step_s']:.0f}s): tangram needs at most "
                     f"{m['cpu_workers']} CPU / {m['gpu_workers']} GPU workers -> step {m['step_s']:.0f}s, "
                     f"{m['cpu_core_s']:.0f} core-s ({pct(m['cpu_saving'])} fewer), "
                     f"{m['gpu_s']:.0f} GPU-s ({pct(m['gpu_saving'])} fewer)")
    lines.append("")
    dw = fig["done_when"]
    for k in ("trajectory-bound", "trajectory-share"):
        d = dw[k]
        marks = ", ".join(f"{n} {'PASS' if ok else 'MISS'}" for n, ok in d.items())
        lines.append(f"targets vs {k}: ACT >= {TARGET_ACT_RATIO}x, step >= {TARGET_STEP_RATIO}x, "
                     f"saving >= {TARGET_SAVING:.0%}: {marks}")
    lines.append(f"target tangram / lower bound <= {TARGET_LB_RATIO}: {'PASS' if dw['lb_ratio'] else 'MISS'}")
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
    ax.legend()
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
    try:
        w = load_workload(args.workload)
    except WorkloadError as e:
        print(f"tangram-hpc bench: {e}", file=sys.stderr)
        return 2
    if args.scale != 1.0 or args.cluster_scale != 1.0 or args.steps is not None:
        w = w.scaled(trajectories=args.scale, cluster=args.cluster_scale, steps=args.steps)
    if args.seed is not None:
        from dataclasses import replace
        w = replace(w, seed=args.seed)
    t0 = time.perf_counter()
    with progress_reporter(args.quiet) as progress:
        fig, runs = run_bench(w, search=not args.no_search, progress=progress)
    fig["bench_wall_s"] = time.perf_counter() - t0
    print(f"workload {w.name} ({w.source}): {fig['trajectories']:,} trajectories, {fig['actions']:,} actions")
    print(_fmt_table(fig))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=2)
    if args.plot:
        for p in write_plots(runs, args.plot, w.name):
            print(f"wrote {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":   # python -m tangram_hpc.bench --workload swe
    ap = argparse.ArgumentParser(prog="tangram-hpc bench", description=__doc__.splitlines()[0])
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
