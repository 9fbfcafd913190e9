"""Cost of transactional environments: an action in a layered attempt (overlay mounted in a
namespace of its own, then merged) vs the same action run directly in the environment, side by
side; and the commit alone (the merge, the emptied attempt moved aside), per file of the
attempt's layer.

    python benchmarks/env_layers.py [--repeat 30] [--files 1 10 100 1000]

Prints medians in milliseconds and their ratio.  Rounds alternate which variant goes first so
drift on a shared machine hits both alike.  Needs root, bubblewrap and overlayfs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tangram_hpc.actions import ActionSpec, Status
from tangram_hpc.managers import Limits, SandboxManager
from tangram_hpc.managers import env_layers


def _action(mgr: SandboxManager, cpu: list[int], i: int) -> float:
    spec = ActionSpec("sandbox", {"cmd": f"echo {i} >> log; echo {i} > f{i % 8}"}, env="e")
    t0 = time.perf_counter()
    out = mgr.run(spec, cpu)
    took = time.perf_counter() - t0
    if out.status != Status.OK:
        raise SystemExit(f"action failed: {out}")
    return took


def _commit_per_file(tmp: Path, files: int, repeat: int) -> float:
    """Median seconds per file to commit an attempt whose layer holds ``files`` small new or changed
    files (the merge, and the emptied attempt moved aside for later removal)."""
    per = []
    trash = tmp / "trash"
    trash.mkdir(exist_ok=True)
    for r in range(repeat):
        lower, attempt = tmp / f"lower-{files}-{r}", tmp / f"attempt-{files}-{r}"
        for root in (lower, attempt / "upper"):
            for i in range(files):
                d = root / f"d{i % 10}"
                d.mkdir(parents=True, exist_ok=True)
                if root is not lower or i % 2:   # half of them replace a file the environment has
                    (d / f"f{i}").write_text(f"{root.name} {i}\n")
        (attempt / "action").write_text("a")
        t0 = time.perf_counter()
        if env_layers.settle(attempt, lower, lambda _aid: True, trash) != "committed":
            raise SystemExit("the attempt was not committed")
        per.append((time.perf_counter() - t0) / files)
    return statistics.median(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--files", type=int, nargs="+", default=[1, 10, 100, 1000])
    args = ap.parse_args()
    why = env_layers.overlay_supported()
    if why is not None:
        raise SystemExit(f"no layered attempts here: {why}")
    cpu = [sorted(os.sched_getaffinity(0))[0]]
    with tempfile.TemporaryDirectory() as tmp:
        limits = Limits(timeout_s=60)
        layered = SandboxManager(Path(tmp) / "layered", default_limits=limits)
        direct = SandboxManager(Path(tmp) / "direct", default_limits=limits, transactional=False)
        t_layered, t_direct = [], []
        try:
            for m in (layered, direct):
                _action(m, cpu, 0)     # create the environments first
            for i in range(1, args.repeat + 1):
                pair = [(layered, t_layered), (direct, t_direct)]
                for m, out in pair if i % 2 else reversed(pair):
                    out.append(_action(m, cpu, i))
        finally:
            layered.close()
            direct.close()
        ms = 1000.0
        lay, dir_ = statistics.median(t_layered), statistics.median(t_direct)
        print(f"action in a layered attempt  {lay * ms:8.2f} ms")
        print(f"action run directly          {dir_ * ms:8.2f} ms")
        print(f"layer cost per action        {(lay - dir_) * ms:8.2f} ms  (ratio {lay / dir_:.2f})")
        for n in args.files:
            print(f"commit of {n:5d} files         {_commit_per_file(Path(tmp), n, min(args.repeat, 10)) * 1e6:8.1f} us per file")


if __name__ == "__main__":
    main()
