"""End to end on the dev cluster: the coordinator started with sbatch grows and shrinks its
worker jobs, survives a worker job cancelled from outside, shows its worker jobs in ``status``,
is reported from sacct, and a graceful stop ends its job COMPLETED.

The template passes the pool's settings as the variables tangram-hpc reads itself
(TANGRAM_WORKER_CORES, TANGRAM_MAX_WORKERS, TANGRAM_IDLE, TANGRAM_WORKER_TIME: the [slurm] section).
The coordinator binds and advertises a second loopback address (127.0.0.2), as it would the
address of a cluster network: the worker jobs reach it there, not at 127.0.0.1.
"""
from __future__ import annotations

import os
import socket
import subprocess

import msgpack
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
               TANGRAM_WORKER_TIME="10", TANGRAM_STOP_GRACE="20",
               TANGRAM_EXTRA_ARGS="--host 127.0.0.2 --advertise-host 127.0.0.2")
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
    subprocess.run(["scancel", job])     # a no-op after test_graceful_stop_ends_the_job_completed
    view = CliClusterView()
    # the trap drains the coordinator, which cancels its workers; the connection file goes
    # its own workers only: another run on the same cluster (the fault runs, a second checkout) has
    # tgw- jobs of its own
    wait_until(lambda: not worker_jobs(view, info)
               and not [j for j in view.jobs([int(job)]) if j.active], 60, what="coordinator and workers gone")
    assert not os.path.exists(conn)


def worker_jobs(view, coordinator=None):
    """Active worker jobs: this coordinator's when given (a job of an earlier test may still end)."""
    jobs = [j for j in view.jobs(name_prefix="tgw-") if j.active]
    if coordinator is None:
        return jobs
    mine = _submitted(coordinator)
    return [j for j in jobs if str(j.job_id) in mine]


def _submitted(coordinator) -> set[str]:
    try:
        with open(coordinator["run_dir"] / "slurm_jobs.log", "rb") as f:
            return {str(r[2]) for r in msgpack.Unpacker(f)}
    except FileNotFoundError:
        return set()


def test_a_second_launch_on_the_same_connection_file_is_refused_and_leaves_it(coordinator):
    from tangram_hpc.connection import ConnectionInfo
    before = ConnectionInfo.read(coordinator["conn"])
    assert before.slurm_job_id == coordinator["job"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run([str(REPO / "scripts" / "launch-coordinator.sh"), "--shared", str(coordinator["shared"]),
                          "--wait", "10"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 1 and f"a coordinator (job {coordinator['job']}, RUNNING) runs with" in out.stderr, out
    assert ConnectionInfo.read(coordinator["conn"]) == before
    assert coordinator["client"].status()["workers"] is not None      # still reachable


def test_workers_reach_the_advertised_second_loopback_address(coordinator):
    from tangram_hpc.connection import ConnectionInfo
    info = ConnectionInfo.read(coordinator["conn"])
    assert info.client_address.startswith("tcp://127.0.0.2:") and info.worker_address.startswith("tcp://127.0.0.2:")
    port = int(info.worker_address.rsplit(":", 1)[1])
    with socket.socket() as s:                 # bound to 127.0.0.2 only
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_workers_grow_under_load_and_shrink_after(coordinator):
    view, c = CliClusterView(), coordinator["client"]
    futures = [c.submit(sleep_action(1.0, f"t{i % 4}")) for i in range(18)]
    peak = wait_until(lambda: (n := len([j for j in worker_jobs(view, coordinator) if j.state == "RUNNING"])) >= 2 and n,
                      60, what="worker jobs to start")
    # each worker: the Slurm job running it and the time its job has left (a 10-minute limit)
    running = {str(j.job_id): j for j in worker_jobs(view, coordinator)}
    ws = wait_until(lambda: [w for w in c.status()["workers"] if w["job_id"] in running], 30, what="workers")
    for w in ws:
        assert running[w["job_id"]].name == w["handle"] and 0 < w["time_left_s"] <= 600
    results = [f.result(timeout=120) for f in futures]
    assert [r.status for r in results] == ["ok"] * 18
    assert len(worker_jobs(view, coordinator)) <= 3 and peak <= 3
    wait_until(lambda: not worker_jobs(view, coordinator), 60, what="idle workers to be reclaimed")
    # the allocation history: every job the coordinator submitted, how it went, and why it ended
    submitted = _submitted(coordinator)
    def ended():
        allocs = c.status(allocations=True)["allocations"]
        return {a["job_id"] for a in allocs if a["state"] == "ended"} == submitted and allocs
    allocs = wait_until(ended, 30, what="every submitted job to have ended in the allocation history")
    assert {a["job_id"] for a in allocs} == submitted
    for a in allocs:
        if not a["worker"]:     # a job still queued when the backlog cleared is taken back unused
            assert a["reason"].startswith("cancelled while queued"), a
            continue
        assert a["started"] <= a["joined"] <= a["ended"] and a["reason"] == "completed", a
    assert len([a for a in allocs if a["worker"]]) >= 2
    log = (coordinator["shared"] / f"tangram-coordinator-{coordinator['job']}.out").read_text()
    assert "launched " in log and "actions waiting" in log
    assert "draining worker " in log and ": idle" in log and "stopping drained worker " in log
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
    # It is gone from the pool, and its allocation's history says its job ended.
    def ended():
        st = c.status(allocations=True)
        [alloc] = [a for a in st["allocations"] if a["handle"] == victim["handle"]]
        return alloc if alloc["ended"] and victim["id"] not in {w["id"] for w in st["workers"]} else None
    alloc = wait_until(ended, 60, what="the cancelled worker's job to end")
    assert alloc["worker"] == victim["id"] and alloc["state"] != "RUNNING", alloc
    wait_until(lambda: not worker_jobs(view, coordinator), 60, what="idle workers to be reclaimed")


def test_graceful_stop_ends_the_job_completed(coordinator):
    """The documented stop: only the batch shell gets SIGTERM; its trap stops the coordinator."""
    job = coordinator["job"]
    subprocess.run(["scancel", "--batch", "--signal=TERM", job], check=True)
    view = CliClusterView()
    rec = wait_until(lambda: [r for r in view.accounting([int(job)]) if r.state not in ("RUNNING", "PENDING")],
                     60, what="the coordinator job to end")[0]
    assert rec.state == "COMPLETED" and rec.exit_code == 0, rec
    assert not os.path.exists(coordinator["conn"])
    out = (coordinator["shared"] / f"tangram-coordinator-{job}.out").read_text()
    assert "coordinator stopped (exit status 0)" in out


def test_a_coordinator_job_too_short_for_its_drain_signal_says_so(tmp_path, dev_cluster):
    """--signal=B:TERM@300 would stop it at once under a limit of 5 minutes: the job says why and fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(TANGRAM_SHARED=str(tmp_path), TANGRAM_PYTHON=str(REPO / ".venv" / "bin" / "python"),
               PYTHONPATH=str(REPO))
    job = subprocess.run(["sbatch", "--parsable", "--time=3", "--chdir", str(tmp_path), "--export=ALL",
                          str(REPO / "slurm_templates" / "coordinator.sbatch")],
                         capture_output=True, text=True, env=env, check=True).stdout.strip().split(";")[0]
    view = CliClusterView()
    wait_until(lambda: not [j for j in view.jobs([int(job)]) if j.active], 60, what="the short job to end")
    out = (tmp_path / f"tangram-coordinator-{job}.out").read_text()
    assert "it needs a --time of 10 minutes or more" in out, out
    assert not (tmp_path / "coordinator.json").exists()
