"""Simulator throughput: 10,000 trajectories and about 1,000,000 actions through tangram.

Prints the wall time of sampling the plan and of simulating it with the
elastic scheduler and the pool controller (one core).  Usage:

    python3 benchmarks/sim_speed.py [--trajectories 10000] [--turns 100] [--policy tangram|fifo]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tangram_hpc.bench import tangram_run
from tangram_hpc.policy.fifo import FifoPolicy
from tangram_hpc.sim.engine import simulate
from tangram_hpc.sim.workload import load_workload


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="swe")
    ap.add_argument("--trajectories", type=int, default=10_000)
    ap.add_argument("--turns", type=int, default=99, help="turns per trajectory (plus the final actions)")
    ap.add_argument("--policy", default="tangram", choices=["tangram", "fifo"])
    a = ap.parse_args()
    w = load_workload(a.preset)
    w = replace(w, rollout=replace(w.rollout, steps=1, trajectories_per_step=a.trajectories,
                                   turns_min=a.turns, turns_max=a.turns))
    # keep the load per core as in the preset
    w = w.scaled(cluster=a.trajectories / load_workload(a.preset).rollout.trajectories_per_step)
    t0 = time.perf_counter()
    plan = w.sample()
    t1 = time.perf_counter()
    print(f"sampled {plan.n_trajectories:,} trajectories / {plan.n_actions:,} actions in {t1 - t0:.2f}s",
          flush=True)
    prog = lambda m: print(m, file=sys.stderr, flush=True)
    if a.policy == "tangram":
        r = tangram_run(plan, progress=prog)
    else:
        r = simulate(plan, FifoPolicy(), name="fifo", progress=prog)
    print(f"simulated {a.policy} on {w.cluster.cpu_workers} CPU workers: {r.events:,} events in {r.wall_s:.1f}s "
          f"({plan.n_actions / r.wall_s:,.0f} actions/s); mean ACT {r.act.mean():.2f}s, "
          f"step {r.mean_step:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
