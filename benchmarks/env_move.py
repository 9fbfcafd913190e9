"""What moving a stateful environment costs: save it on one worker's store, restore it on another's.

    python benchmarks/env_move.py [--mb 100] [--changed-mb 2] [--source DIR] [--repeat 3]

Makes a checkout of the first ``--mb`` MB of ``*.py`` files under ``--source`` (default: this
interpreter's site-packages, a stand-in for a repository), then times the two halves of a move as
the workers do them -- the holder's snapshot (a tar.gz with the environment's journal) and the
next worker's restore -- each ``--repeat`` times, and prints the medians, for two environments
side by side:

* *whole*: an empty environment the checkout was copied into (everything is saved);
* *delta*: an environment made from the checkout as its template, in which ``--changed-mb`` MB
  of files were rewritten and 20 files added (only those are saved; the next worker starts from
  a ready-made copy of the template, as its warm pool keeps one).  The first save of a template's
  base, once per run, is timed apart.

The scheduler's first guess of a move's cost (``[coordinator] env_move_s``) and a workload's
``[cluster] env_move_s`` are meant to be set from figures like these, doubled where snapshots go to a
shared file system.
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


def change(env: Path, limit: int) -> int:
    """Rewrite files of ``env`` (same size, new bytes) until ``limit`` bytes, and add 20; returns the bytes."""
    done = 0
    for path in sorted(env.rglob("*.py")):
        size = path.stat().st_size
        path.write_bytes(os.urandom(size // 2).hex().encode()[:size])
        done += size
        if done >= limit:
            break
    for k in range(20):
        (env / f"added-{k}.txt").write_text(f"new file {k}\n")
    return done


def wait_warm(store: EnvStore, template: str) -> None:
    deadline = time.monotonic() + 300
    while store.warm_count(template) < 1:
        if time.monotonic() > deadline:
            raise SystemExit("the warm pool made no environment in 300 s")
        time.sleep(0.01)


def moves(root: Path, holder: EnvStore, templates: dict, warm: bool, repeat: int) -> tuple[list, list, int]:
    """Save and restore ``bench`` ``repeat`` times, each to a new store; (save s, restore s, bytes saved)."""
    saves, restores, packed = [], [], 0
    for gen in range(1, repeat + 1):
        nxt = EnvStore(root / f"next-{gen}", templates, "repo" if templates else "empty", None, int(warm), False)
        if warm:
            wait_warm(nxt, "repo")
        t0 = time.perf_counter()
        snap = holder.snapshot("bench", root / "snapshots", gen)
        t1 = time.perf_counter()
        nxt.restore("bench", snap)
        t2 = time.perf_counter()
        saves.append(t1 - t0)
        restores.append(t2 - t1)
        packed = os.path.getsize(snap)
        holder.close()
        holder = nxt      # the restored copy is the one saved next
        os.remove(snap)
    holder.close()
    return saves, restores, packed


def report(what: str, saves: list, restores: list, packed: int) -> None:
    save, restore = statistics.median(saves), statistics.median(restores)
    print(f"{what}: save {save:.3f} s, restore {restore:.3f} s, move {save + restore:.3f} s, snapshot "
          f"{packed / 2**20:.1f} MB tar.gz (medians of {len(saves)}; saves {', '.join(f'{x:.3f}' for x in saves)})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0, help="size of the checkout in MB (default 100)")
    ap.add_argument("--changed-mb", type=float, default=2.0, help="MB of files rewritten in the delta run (default 2)")
    ap.add_argument("--source", default=sysconfig.get_paths()["purelib"], help="where to take files from")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tangram-env-move-") as tmp:
        root = Path(tmp)
        checkout = root / "checkout"
        checkout.mkdir()
        size, files = fill(checkout, Path(a.source), int(a.mb * 2**20))
        print(f"checkout: {size / 2**20:.0f} MB in {files:,} files")

        holder = EnvStore(root / "whole" / "holder", {}, "empty", None, 0, False)
        env = holder.acquire("bench", None)
        holder.release(env)
        shutil.copytree(checkout, env.path, dirs_exist_ok=True)
        report("whole", *moves(root / "whole", holder, {}, False, a.repeat))

        templates = {"repo": {"kind": "tree", "source": str(checkout)}}
        holder = EnvStore(root / "delta" / "holder", templates, "repo", None, 0, False)
        env = holder.acquire("bench", None)
        holder.release(env)
        changed = change(env.path, int(a.changed_mb * 2**20))
        t0 = time.perf_counter()
        os.remove(holder.snapshot("bench", root / "delta" / "snapshots", 0))   # the first also saves the base
        print(f"delta: the first save, with the template's base (once per checkout), took "
              f"{time.perf_counter() - t0:.2f} s; {changed / 2**20:.1f} MB rewritten and 20 files added")
        report("delta", *moves(root / "delta", holder, templates, True, a.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
