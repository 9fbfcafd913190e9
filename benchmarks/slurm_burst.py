"""A burst of actions through a coordinator on the loopback Slurm cluster, with part of the cluster busy.

    python benchmarks/slurm_burst.py [--actions 400] [--max-workers 8] [--busy-cpus 8] [--idle 8]

Another user's job holds ``--busy-cpus`` of the node's CPUs (a busy cluster), so of the worker jobs the
pool asks for, some start and some wait in the queue.  ``--actions`` one-core actions (0.2-1 s each)
are submitted at once; the script samples ``squeue`` every half second and prints

* the timeline of the worker jobs: started, queued, cancelled while queued, drained and gone;
* the coordinator's allocation history (``tangram-hpc status --allocations``);
* ``tangram-hpc report`` of the run, and ``sacct`` of the same jobs to check it against.

Needs the dev cluster (``scripts/dev-cluster.sh start``) and the checkout's ``.venv``.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tangram_hpc import Client, function  # noqa: E402
from tangram_hpc.commands import format_allocations  # noqa: E402
from tangram_hpc.slurm.cli_view import CliClusterView  # noqa: E402


def sample(view: CliClusterView, prefix: str, t0: float, out: list, stop: threading.Event) -> None:
    while not stop.is_set():
        jobs = {j.name[-4:]: j.state[:3] for j in view.jobs(name_prefix=prefix) if j.active}
        out.append((time.time() - t0, jobs))
        stop.wait(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--actions", type=int, default=400)
    ap.add_argument("--max-workers", type=int, default=8)
    ap.add_argument("--busy-cpus", type=int, default=8, help="CPUs another job holds during the burst")
    ap.add_argument("--idle", type=float, default=8, help="seconds idle before a worker is drained")
    a = ap.parse_args()

    shared = Path(tempfile.mkdtemp(prefix="tangram-burst-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(TANGRAM_WORKER_CORES="2", TANGRAM_MAX_WORKERS=str(a.max_workers), TANGRAM_IDLE=str(a.idle),
               TANGRAM_WORKER_TIME="30")
    blocker = subprocess.run(["sbatch", "--parsable", "-J", "tgburst-other-user", "-c", str(a.busy_cpus), "-o",
                              "/dev/null", "--wrap", "sleep 900"], capture_output=True, text=True,
                             check=True).stdout.strip().split(";")[0]
    out = subprocess.run([str(REPO / "scripts" / "launch-coordinator.sh"), "--shared", str(shared)],
                         capture_output=True, text=True, env=env, check=True).stdout
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    job, conn = lines["job"], lines["connection"]
    print(f"coordinator job {job}; another job ({blocker}) holds {a.busy_cpus} CPUs; run dir {shared}/runs/{job}")
    view = CliClusterView()
    samples: list = []
    stop = threading.Event()
    t0 = time.time()
    with Client(connection_file=conn) as c:
        prefix = None
        rng = random.Random(0)
        futs = c.submit_many([function("time:sleep", round(rng.uniform(0.2, 1.0), 2), cores=1)
                              for _ in range(a.actions)])
        while prefix is None:      # the run's job name prefix, from its first worker job
            allocs = c.status(allocations=True)["allocations"]
            prefix = allocs[0]["handle"][:-4] if allocs else None
            time.sleep(0.1)
        th = threading.Thread(target=sample, args=(view, prefix, t0, samples, stop), daemon=True)
        th.start()
        results = c.gather(futs, timeout=600)
        done = time.time() - t0
        ok = sum(r.ok for r in results)
        deadline = time.time() + 120
        while time.time() < deadline and (not samples or samples[-1][1]):
            time.sleep(0.5)
        stop.set()
        th.join()
        allocs = c.status(allocations=True)["allocations"]
    print(f"\n{a.actions} actions submitted at +0.0 s, all answered at +{done:.1f} s ({ok} ok)\n")
    print("squeue of the run's worker jobs (last 4 digits of the job name: RUN/PEN), when it changed:")
    last = None
    for t, jobs in samples:
        if jobs != last:
            print(f"  +{t:5.1f} s  " + (" ".join(f"{h}:{s}" for h, s in sorted(jobs.items())) or "(none)"))
            last = jobs
    print("\n" + format_allocations(allocs))
    subprocess.run(["scancel", "--batch", "--signal=TERM", job])
    subprocess.run(["scancel", blocker])
    ids = ",".join(x["job_id"] for x in allocs if x["job_id"])
    time.sleep(3)
    run_dir = shared / "runs" / job
    print(f"\n$ tangram-hpc report --run-dir {run_dir}")
    subprocess.run([sys.executable, "-m", "tangram_hpc.cli", "report", "--run-dir", str(run_dir)],
                   env=dict(env, PYTHONPATH=str(REPO)))
    print(f"\n$ sacct -X -j {ids} --format=JobID,JobName%20,State,Start,End,Elapsed,AllocCPUS")
    subprocess.run(["sacct", "-X", "-j", ids, "--format=JobID,JobName%20,State,Start,End,Elapsed,AllocCPUS"])
    print(f"\n$ sacct -j {ids} --format=JobID,JobName%20,TotalCPU   (steps included)")
    subprocess.run(["sacct", "-j", ids, "--format=JobID,JobName%20,TotalCPU"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
