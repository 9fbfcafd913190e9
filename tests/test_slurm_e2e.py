"""End to end on the dev cluster: the coordinator started with sbatch grows and shrinks its
worker jobs, survives a worker job cancelled from outside, and is reported from sacct.

The template passes the pool's settings as the variables tangram-hpc reads itself
(TANGRAM_WORKER_CORES, TANGRAM_MAX_WORKERS, TANGRAM_IDLE, TANGRAM_WORKER_TIME: the [slurm] section).
"""
from __future__ import annotations

import os
import subprocess

import pytest

from slurm_support import REPO, dev_cluster, wait_until  # noqa: F401
from tangram_hpc import report
from tangram_hpc.actions import ActionSpec, Demand
from tangram_hpc.slurm.cli_view import CliClusterView

pytestmark = pytest.mark.slurm


def sleep_action(seconds: float, traj: str) -> ActionSpec:
    return ActionSpec(kind="function", payload={"fn": "time:sleep", "args": [seconds]},
                      demand=Demand(1, 1), trajectory=traj, label="sleep")


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory, dev_cluster):
    shared = tmp_path_factory.mktemp("shared")
    env = dict(os.environ, TANGRAM_WORKER_CORES="2", TANGRAM_MAX_WORKERS="3", TANGRAM_IDLE="4",
               TANGRAM_WORKER_TIME="10", TANGRAM_STOP_GRACE="20")
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    out = subprocess.run([str(REPO / "scripts" / "launch-coordinator.sh"), "--shared", str(shared), "--wait", "60"],
                         capture_output=True, text=True, env=env, timeout=90)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    job, conn = lines["job"], lines["connection"]
    from tangram_hpc import Client
    client = Client.from_connection_file(conn)
    info = {"job": job, "conn": conn, "shared": shared, "client": client,
            "run_dir": shared / "runs" / job}
    yield info
    client.close()
    subprocess.run(["scancel", job])
    view = CliClusterView()
    # the trap drains the coordinator, which cancels its workers; the connection file goes
    wait_until(lambda: not [j for j in view.jobs(name_prefix="tgw-") if j.active]
               and not [j for j in view.jobs([int(job)]) if j.active], 60, what="coordinator and workers gone")
    assert not os.path.exists(conn)


def worker_jobs(view):
    return [j for j in view.jobs(name_prefix="tgw-") if j.active]


def test_workers_grow_under_load_and_shrink_after(coordinator):
    view, c = CliClusterView(), coordinator["client"]
    futures = [c.submit(sleep_action(1.0, f"t{i % 4}")) for i in range(18)]
    peak = wait_until(lambda: (n := len([j for j in worker_jobs(view) if j.state == "RUNNING"])) >= 2 and n,
                      60, what="worker jobs to start")
    results = [f.result(timeout=120) for f in futures]
    assert [r.status for r in results] == ["ok"] * 18
    assert len(worker_jobs(view)) <= 3 and peak <= 3
    wait_until(lambda: not worker_jobs(view), 60, what="idle workers to be reclaimed")
    rep = report.load_run(coordinator["run_dir"])
    assert rep.summary["actions"] >= 18 and rep.summary["worker_jobs"] >= 2
    assert all(j.cpus == 2 for j in rep.jobs if j.state != "UNKNOWN")
    assert rep.summary["busy_core_hours"] > 0 and rep.summary["allocated_core_hours"] >= rep.summary["busy_core_hours"]


def test_scancelled_worker_loses_no_action(coordinator):
    view, c = CliClusterView(), coordinator["client"]
    futures = [c.submit(sleep_action(3.0, f"s{i}")) for i in range(6)]

    def busy():
        for w in c.status().get("workers", []):
            if w.get("running") and w.get("handle"):
                return w
        return None
    victim = wait_until(busy, 60, what="a worker running actions")
    [job] = [j for j in view.jobs(name_prefix=victim["handle"]) if j.active]
    subprocess.run(["scancel", str(job.job_id)], check=True)
    results = [f.result(timeout=120) for f in futures]
    assert [r.status for r in results] == ["ok"] * 6
    # The cancelled worker left (SIGTERM): what it ran finished within its leave grace, or was
    # retried elsewhere once it had left; either way each action has its one ok result.
    assert any(r.worker == victim["id"] or r.attempts > 1 for r in results)
    st = c.status()
    assert st["workers_lost"] >= 1
    wait_until(lambda: not worker_jobs(view), 60, what="idle workers to be reclaimed")
