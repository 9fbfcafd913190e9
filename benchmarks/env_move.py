"""What moving a stateful environment costs: save it on one worker's store, restore it on another's.

    python benchmarks/env_move.py [--mb 100] [--source DIR] [--repeat 3]

Fills an environment with the first ``--mb`` MB of ``*.py`` files under ``--source`` (default:
this interpreter's site-packages, a stand-in for a repository checkout), then times the two halves
of a move as the workers do them -- the holder's snapshot (a tar.gz with the environment's journal)
and the next worker's restore -- each ``--repeat`` times, and prints the medians.  The scheduler's
first guess of a move's cost (``[coordinator] env_move_s``) and a workload's ``[cluster]
env_move_s`` are meant to be set from figures like these, doubled where snapshots go to a shared
file system.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tangram_hpc.managers.environments import EnvStore  # noqa: E402


def fill(dest: Path, source: Path, limit: int) -> tuple[int, int]:
    """Copy ``*.py`` files from ``source`` into ``dest`` until ``limit`` bytes; returns (bytes, files)."""
    total = files = 0
    for dirpath, dirnames, filenames in os.walk(source):
        dirnames.sort()
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            src = Path(dirpath) / name
            out = dest / src.relative_to(source)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, out)
            total += out.stat().st_size
            files += 1
            if total >= limit:
                return total, files
    return total, files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0, help="size of the environment in MB (default 100)")
    ap.add_argument("--source", default=sysconfig.get_paths()["purelib"], help="where to take files from")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tangram-env-move-") as tmp:
        root = Path(tmp)
        holder = EnvStore(root / "holder", {}, "empty", None, 0, False)
        env = holder.acquire("bench", None)
        size, files = fill(env.path, Path(a.source), int(a.mb * 2**20))
        holder.release(env)
        saves, restores = [], []
        for gen in range(1, a.repeat + 1):
            nxt = EnvStore(root / f"next-{gen}", {}, "empty", None, 0, False)
            t0 = time.perf_counter()
            snap = holder.snapshot("bench", root / "snapshots", gen)
            t1 = time.perf_counter()
            nxt.restore("bench", snap)
            t2 = time.perf_counter()
            saves.append(t1 - t0)
            restores.append(t2 - t1)
            packed = os.path.getsize(snap)
            holder, env = nxt, None      # the restored copy is the one saved next
            os.remove(snap)
        save, restore = statistics.median(saves), statistics.median(restores)
        print(f"environment: {size / 2**20:.0f} MB in {files:,} files (snapshot {packed / 2**20:.0f} MB tar.gz)")
        print(f"save {save:.2f} s, restore {restore:.2f} s, move {save + restore:.2f} s "
              f"(medians of {a.repeat}; save times {', '.join(f'{x:.2f}' for x in saves)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
