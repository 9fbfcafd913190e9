#!/usr/bin/env python3
"""Capture a frame of ``tangram-hpc top`` as a terminal shows it (the capture in docs/operations.md).

    .venv/bin/python scripts/top-capture.py [COLUMNS]

Starts a local coordinator (two 2-core workers, a reward worker hosting ``judge``), runs
``tangram-hpc top`` in a pseudo-terminal of COLUMNS x 45 (default 130), puts load on the
coordinator, presses ``q`` and prints the last full frame without escape sequences.
"""
import os
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from pty_support import ANSI, press_and_drain, read_for, run_in_pty  # noqa: E402
from tangram_hpc import LocalCluster, function, reward, sandbox  # noqa: E402

SERVICE = "judge=tangram_hpc.managers.rewards:hashing_similarity,max_wait_ms=2"


def main() -> int:
    cols = int(sys.argv[1]) if len(sys.argv) > 1 else 130
    with tempfile.TemporaryDirectory() as run_dir, \
            LocalCluster(workers=2, cores=2, reward_workers=1, services=[SERVICE], run_dir=run_dir,
                         extra_args=["--metrics-port", "0"]) as cl, cl.client() as c:
        proc, master, _ = run_in_pty([sys.executable, "-m", "tangram_hpc.cli", "top", "-c", str(cl.connection_file),
                                      "--interval", "1"], rows=45, cols=cols)
        out = read_for(master, 1.5)
        c.map([function("math:sqrt", i, cores=0) for i in range(2000)])
        c.map([function("math:sqrt", -1.0) for _ in range(3)])
        for t in range(3):
            c.submit(sandbox("echo step > log.txt", env=f"traj-{t}")).result()
        c.submit_many([sandbox("sleep 8", cores=(2, 2)) for _ in range(3)])
        c.submit_many([sandbox("sleep 8", env="traj-1") for _ in range(2)])
        c.submit_many([function("time:sleep", 0.3) for _ in range(6)])
        c.map([reward("judge", [{"response": f"r{i}", "reference": "ref"}]) for i in range(40)])
        out += read_for(master, 4.2)
        out += press_and_drain(proc, master, b"q", 10)
        frame = out.decode("utf-8", "replace").split("\x1b[?1049l")[0].rsplit("\x1b[H", 1)[-1]
        print("\n".join(line.rstrip() for line in ANSI.sub("", frame).splitlines()).rstrip())
        return proc.wait(timeout=5)


if __name__ == "__main__":
    raise SystemExit(main())
