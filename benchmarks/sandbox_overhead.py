"""Overhead of the sandbox: a sandboxed ``python -c pass`` vs a bare subprocess, the same with
the seccomp filter and the disk quota switched off, and a warm environment (from the pool) vs a
cold one (created on demand), measured side by side.

    python benchmarks/sandbox_overhead.py [--repeat 30] [--tree-files 300]

Prints medians in milliseconds and their ratios.  Rounds interleave the
variants (alternating the order of the two sandboxed ones) so drift on a
shared machine hits them alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tangram_hpc.actions import ActionSpec, Status
from tangram_hpc.managers import Limits, SandboxManager, TreeTemplate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--tree-files", type=int, default=300, help="files in the project template")
    args = ap.parse_args()
    cpu = [sorted(os.sched_getaffinity(0))[0]]
    cmd = [sys.executable, "-c", "pass"]
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "project"
        for i in range(args.tree_files):
            d = tree / f"pkg{i % 10}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"mod{i}.py").write_text("x = 1\n" * 50)
        limits = Limits(timeout_s=60)
        tmpl = {"proj": TreeTemplate(tree)}
        warm = SandboxManager(Path(tmp) / "warm", templates=tmpl, default_template="proj",
                              warm_pool=2, default_limits=limits)
        cold = SandboxManager(Path(tmp) / "cold", templates=tmpl, default_template="proj",
                              warm_pool=0, default_limits=limits)
        plain = SandboxManager(Path(tmp) / "plain", default_limits=limits)
        unguarded = SandboxManager(Path(tmp) / "unguarded", seccomp=False,
                                   default_limits=Limits(timeout_s=60, disk_mb=None, disk_files=None))
        bare, boxed, t_unguarded, t_warm, t_cold = [], [], [], [], []
        try:
            for i in range(args.repeat):
                # The pool refills in the background after each round: let it finish first, so it
                # does not compete with the timed runs.
                while warm.envs.warm_count("proj") < 2:
                    time.sleep(0.005)
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True)
                bare.append(time.perf_counter() - t0)

                for mgr, times in ((plain, boxed), (unguarded, t_unguarded))[::1 if i % 2 else -1]:
                    t0 = time.perf_counter()
                    r = mgr.run(ActionSpec("sandbox", {"cmd": cmd}, env="same"), cpu)
                    times.append(time.perf_counter() - t0)
                    assert r.status == Status.OK, r

                t0 = time.perf_counter()
                r = warm.run(ActionSpec("sandbox", {"cmd": cmd}, env=f"w{i}"), cpu)
                t_warm.append(time.perf_counter() - t0)
                assert r.status == Status.OK, r

                t0 = time.perf_counter()
                r = cold.run(ActionSpec("sandbox", {"cmd": cmd}, env=f"c{i}"), cpu)
                t_cold.append(time.perf_counter() - t0)
                assert r.status == Status.OK, r
                warm.drop(f"w{i}")
                cold.drop(f"c{i}")
        finally:
            for m in (warm, cold, plain, unguarded):
                m.close()
    med = {k: statistics.median(v) * 1e3 for k, v in
           (("bare", bare), ("sandboxed", boxed), ("unguarded", t_unguarded), ("warm", t_warm), ("cold", t_cold))}
    print(f"isolation: {plain.isolation}, cgroups: {plain.cgroups}, repeat: {args.repeat}, "
          f"template: {args.tree_files} files")
    print(f"python -c pass   bare subprocess      median {med['bare']:8.2f} ms")
    print(f"python -c pass   sandboxed (same env) median {med['sandboxed']:8.2f} ms  "
          f"overhead {med['sandboxed'] - med['bare']:+.2f} ms  ratio {med['sandboxed'] / med['bare']:.2f}x")
    print(f"python -c pass   sandboxed, no seccomp filter and no disk quota   median {med['unguarded']:8.2f} ms  "
          f"(filter + quota cost {med['sandboxed'] - med['unguarded']:+.2f} ms)")
    print(f"new environment  warm (from pool)     median {med['warm']:8.2f} ms")
    print(f"new environment  cold (copy on demand) median {med['cold']:8.2f} ms  "
          f"cold/warm ratio {med['cold'] / med['warm']:.2f}x")


if __name__ == "__main__":
    main()
