"""Shared pieces of the Slurm tests: the dev-cluster fixture and small job helpers."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from support import wait_until  # noqa: F401  (the Slurm tests import it from here)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "slurm"
DEV_CLUSTER = REPO / "scripts" / "dev-cluster.sh"


def cluster_up() -> bool:
    try:
        out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "is UP" in out


def _unavailable(why: str) -> None:
    # In CI the Slurm tests must run: a cluster that cannot start is a failure, not a skip.
    if os.environ.get("CI"):
        pytest.fail(f"dev Slurm cluster unavailable in CI: {why}")
    pytest.skip(f"dev Slurm cluster unavailable: {why}")


@pytest.fixture(scope="session")
def dev_cluster() -> None:
    """A running dev cluster: started with scripts/dev-cluster.sh when not up."""
    if cluster_up():
        return
    if os.geteuid() != 0:
        _unavailable("not up, and starting it needs root")
    proc = subprocess.run([str(DEV_CLUSTER), "start"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not cluster_up():
        _unavailable(f"scripts/dev-cluster.sh start failed ({proc.returncode}): {proc.stderr[-2000:]}")




def sbatch(*args: str) -> int:
    out = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", *args], capture_output=True,
                         text=True, check=True, timeout=30).stdout
    return int(out.strip().split(";")[0])


TESTS_DIR = Path(__file__).resolve().parent


def fake_worker(argv: list[str]) -> int:
    """Stand-in for tangram_hpc.worker.main in backend tests: records how it was started.

    Writes ``<dir of connection file>/<handle>.json`` with its argv and the
    Slurm/GPU environment, then sleeps ``--sleep`` seconds or exits ``--exit``.
    """
    import argparse
    import json
    p = argparse.ArgumentParser()
    p.add_argument("--connection-file", required=True)
    p.add_argument("--cores", type=int, required=True)
    p.add_argument("--gpus", type=int, default=0)
    p.add_argument("--handle", required=True)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--exit", type=int, default=0)
    a = p.parse_args(argv)
    out = Path(a.connection_file).parent / f"{a.handle}.json"
    env = {k: os.environ.get(k) for k in ("TANGRAM_WORKER_HANDLE", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID",
                                          "SLURM_CPUS_PER_TASK", "SLURM_JOB_NAME")}
    out.write_text(json.dumps({"argv": argv, "cores": a.cores, "gpus": a.gpus, "env": env}))
    if a.exit:
        return a.exit
    time.sleep(a.sleep)
    return 0
