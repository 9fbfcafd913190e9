"""One agent workload on one allocation: a container per agent, held for its life, against tangram sandboxes.

    python benchmarks/agent_containers.py [--agents 16] [--turns 4] [--think 1.0] [--burn 0.2] [--cores 2]

Each agent alternates model think time (``--think`` seconds, a sleep standing in for LLM
generation) and a command that burns ``--burn`` CPU seconds in a fresh ``python`` process, for
``--turns`` turns.  The same agents run twice, side by side in one run, on ``--cores`` cores:

* *containers*: what mini-swe-agent's Docker and Singularity environments do on an HPC
  allocation: each agent holds one core (a slot) from its first command to its last, thinking
  included; agents beyond the slots wait for one.  Its commands run as plain processes pinned to
  the slot's core (no container start-up or isolation cost is counted, which favours them);
* *tangram*: every agent at once through :class:`tangram_hpc.integrations.minisweagent.TangramEnvironment`
  against a local coordinator with one worker of ``--cores`` cores: each command is a sandbox
  action in the agent's own environment and binds a core only while it runs.

Printed per mode: wall time until every agent is done, agents served per minute, mean and p95
action completion time (a command's submission to its result, queueing included), mean agent
completion time, and the core-seconds held per agent (containers: the agent's whole life on its
slot; tangram: the cores bound to its commands), with the ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

from tangram_hpc.launch import LocalCluster  # noqa: E402

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\nprint('done')"


class Slots:
    """The allocation's cores, one per agent for its whole life (a container per agent)."""

    def __init__(self, cores: list[int]):
        self.free = list(cores)
        self.cond = threading.Condition()

    def take(self) -> int:
        with self.cond:
            while not self.free:
                self.cond.wait()
            return self.free.pop()

    def give(self, core: int) -> None:
        with self.cond:
            self.free.append(core)
            self.cond.notify()


def container_agent(slots: Slots, args: argparse.Namespace, acts: list[float]) -> tuple[float, float]:
    """One agent in its own held slot; returns (agent completion time, core-seconds held)."""
    t0 = time.monotonic()
    core = slots.take()
    held = time.monotonic()
    try:
        for _ in range(args.turns):
            time.sleep(args.think)
            a0 = time.monotonic()
            subprocess.run([sys.executable, "-c", BURN.format(s=args.burn)], check=True, capture_output=True,
                           preexec_fn=lambda: os.sched_setaffinity(0, {core}))
            acts.append(time.monotonic() - a0)
    finally:
        slots.give(core)
    end = time.monotonic()
    return end - t0, end - held


def tangram_agent(connection_file: str, args: argparse.Namespace, acts: list[float]) -> tuple[float, float]:
    from tangram_hpc.integrations.minisweagent import TangramEnvironment

    env = TangramEnvironment(connection_file=connection_file, timeout=600)
    t0 = time.monotonic()
    bound = 0.0
    try:
        for _ in range(args.turns):
            time.sleep(args.think)
            a0 = time.monotonic()
            out = env.execute({"command": f"python -c \"{BURN.format(s=args.burn)}\""})
            acts.append(time.monotonic() - a0)
            if out["returncode"] != 0:
                raise RuntimeError(f"command failed: {out}")
            bound += env.last_result.output["wall_s"]  # 1 core, bound while the command ran
    finally:
        env.cleanup()
    return time.monotonic() - t0, bound


def run(mode: str, agent, args: argparse.Namespace) -> dict:
    acts: list[float] = []
    t0 = time.monotonic()
    with ThreadPoolExecutor(args.agents) as pool:
        done = list(pool.map(lambda _: agent(acts), range(args.agents)))
    wall = time.monotonic() - t0
    acts.sort()
    return {"mode": mode, "wall_s": wall, "agents_per_min": args.agents / wall * 60,
            "act_mean_s": statistics.fmean(acts), "act_p95_s": acts[int(0.95 * (len(acts) - 1))],
            "agent_mean_s": statistics.fmean(d for d, _ in done),
            "core_s_per_agent": statistics.fmean(h for _, h in done)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--think", type=float, default=1.0, help="model think time per turn, seconds")
    p.add_argument("--burn", type=float, default=0.2, help="CPU seconds of each command")
    p.add_argument("--cores", type=int, default=2, help="cores of the allocation")
    args = p.parse_args()
    cores = sorted(os.sched_getaffinity(0))[:args.cores]
    slots = Slots(cores)
    rows = [run("containers", lambda acts: container_agent(slots, args, acts), args)]
    with tempfile.TemporaryDirectory(prefix="agent-bench-") as d:
        os.environ["MSWEA_GLOBAL_CONFIG_DIR"] = os.path.join(d, "mswea")
        with LocalCluster(workers=1, cores=args.cores, run_dir=os.path.join(d, "run")) as cl:
            rows.append(run("tangram", lambda acts: tangram_agent(str(cl.connection_file), args, acts), args))
    print(f"{args.agents} agents x {args.turns} turns ({args.think:g} s think, {args.burn:g} CPU-s command) "
          f"on {args.cores} cores")
    print(f"{'mode':<11} {'wall s':>7} {'agents/min':>10} {'ACT mean s':>10} {'ACT p95 s':>9} "
          f"{'agent mean s':>12} {'core-s/agent':>12}")
    for r in rows:
        print(f"{r['mode']:<11} {r['wall_s']:7.1f} {r['agents_per_min']:10.1f} {r['act_mean_s']:10.3f} "
              f"{r['act_p95_s']:9.3f} {r['agent_mean_s']:12.1f} {r['core_s_per_agent']:12.2f}")
    c, t = rows
    print(f"tangram / containers: agents/min {t['agents_per_min'] / c['agents_per_min']:.2f}x, "
          f"ACT mean {t['act_mean_s'] / c['act_mean_s']:.2f}x, "
          f"core-s per agent {t['core_s_per_agent'] / c['core_s_per_agent']:.2f}x")


if __name__ == "__main__":
    main()
