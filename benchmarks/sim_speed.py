"""Simulator speed and memory at scale: N trajectories of a preset through tangram.

Prints, per run, the time to sample the plan, the wall and CPU seconds of the
simulation (the machine may be shared: CPU seconds are the steadier figure),
the peak resident memory of the process, and tangram's mean ACT, so a scale
sweep also shows whether the scheduler's quality holds at scale (with the
learned parallel fraction, and with ``--fixed-p`` the prior alone).  The
cluster grows with the trajectories, keeping the preset's load per core.
It first says whether the native build runs (``TANGRAM_NATIVE=1`` runs it;
without, the Python sources, to compare).

    python3 benchmarks/sim_speed.py                         # 100,000 trajectories of swe, one step
    python3 benchmarks/sim_speed.py --trajectories 1000,10000,100000 --fixed-p
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tangram_hpc import native  # noqa: E402
from tangram_hpc.policy.elastic import ElasticScheduler  # noqa: E402
from tangram_hpc.policy.pool import PoolConfig, PoolController  # noqa: E402
from tangram_hpc.policy.predict import Predictor  # noqa: E402
from tangram_hpc.sim.engine import cluster_shapes, service_infos, simulate  # noqa: E402
from tangram_hpc.sim.workload import load_workload  # noqa: E402


def run(preset: str, trajectories: int, steps: int, learn: bool) -> dict:
    base = load_workload(preset)
    ratio = trajectories / base.rollout.trajectories_per_step
    w = base.scaled(trajectories=ratio, cluster=ratio, steps=steps)
    t0 = time.perf_counter()
    plan = w.sample()
    sample_s = time.perf_counter() - t0
    shapes = cluster_shapes(w)
    pred = Predictor(learn_parallel=learn)
    cfg = PoolConfig(list(shapes.values()), max_workers={"cpu": w.cluster.cpu_workers, "gpu": w.cluster.gpu_workers},
                     startup_s=w.cluster.startup_s, idle_ttl_s=w.cluster.idle_ttl_s)
    sched = ElasticScheduler(pred, shapes=list(shapes.values()), services=service_infos(w),
                             env_move_s=w.cluster.env_move_s)
    c0 = time.process_time()
    r = simulate(plan, sched, pool=PoolController(cfg, pred),
                 workers={"cpu": w.cluster.cpu_workers, "gpu": w.cluster.gpu_workers}, clock=time.perf_counter)
    return {"trajectories": plan.n_trajectories, "actions": plan.n_actions, "sample_s": sample_s,
            "wall_s": r.wall_s, "cpu_s": time.process_time() - c0, "events": r.events,
            "mean_act": float(r.act.mean()), "step_s": r.mean_step, "workers": w.cluster.cpu_workers,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="swe")
    ap.add_argument("--trajectories", default="100000", help="comma-separated trajectory counts (default 100000)")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--fixed-p", action="store_true", help="also run with the prior parallel fraction only")
    a = ap.parse_args()
    print(f"simulator: {native.status()}", flush=True)
    for n in [int(x) for x in a.trajectories.split(",")]:
        for learn in ([True, False] if a.fixed_p else [True]):
            f = run(a.preset, n, a.steps, learn)
            print(f"{a.preset} x {f['trajectories']:,} trajectories ({f['actions']:,} actions, {f['workers']} CPU "
                  f"workers, {'learned' if learn else 'prior'} p): sampled in {f['sample_s']:.1f}s, simulated in "
                  f"{f['wall_s']:.1f}s wall / {f['cpu_s']:.1f}s CPU ({f['actions'] / f['cpu_s']:,.0f} actions per "
                  f"CPU second); peak RSS {f['peak_rss_mb']:.0f} MB; mean ACT {f['mean_act']:.2f}s, "
                  f"step {f['step_s']:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
