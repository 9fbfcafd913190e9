"""The Slurm pool as an HPC user drives it: settings refused at start in the cluster's own words,
queued worker jobs withdrawn once the backlog clears, the launch throttle on real failed jobs,
its state in ``status`` and ``tangram-hpc pool resume``.

The pure parts (time-limit arithmetic, withdraw decisions) run anywhere; the ``slurm`` ones start
a coordinator with the Slurm backend on this machine against the loopback cluster.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from slurm_support import REPO, dev_cluster, wait_until  # noqa: F401
from tangram_hpc.actions import ActionSpec, Demand
from tangram_hpc.backends.slurm import check_time_limits
from tangram_hpc.config import ConfigError, SlurmSettings
from tangram_hpc.policy.base import PoolView, Withdraw, WorkerStatus
from tangram_hpc.policy.pool import PoolConfig, PoolController
from tangram_hpc.resources import WorkerInfo, WorkerShape
from tangram_hpc.slurm.cli_view import CliClusterView

ONE = WorkerShape(cores=1)


# -- pure: time limits -------------------------------------------------------------------------

def test_time_limits_that_leave_a_worker_no_time_are_refused():
    check_time_limits(SlurmSettings())                                   # 60 min, replaced 180 s before
    check_time_limits(SlurmSettings(time_min=4))                         # 60 s to serve: the least allowed
    with pytest.raises(ConfigError, match=r"--slurm-time\) = 1 min leaves a worker 0 s to serve.*4 min or more"):
        check_time_limits(SlurmSettings(time_min=1))
    with pytest.raises(ConfigError, match=r"twice \[slurm\] startup_s.*6 min or more"):
        check_time_limits(SlurmSettings(time_min=5, startup_s=90))       # 120 s to serve, 180 s needed
    # Slurm may send submitit's warning (90 s before the limit) up to 60 s early: a drain 120 s
    # before the limit can come after it.
    with pytest.raises(ConfigError, match=r"--slurm-replace-before\) = 120 s is shorter than the 150 s.*60 s early"):
        check_time_limits(SlurmSettings(replace_before_s=120))
    check_time_limits(SlurmSettings(replace_before_s=150, time_min=4))   # 90 s to serve


# -- pure: withdrawing launches nobody needs ----------------------------------------------------

def _busy(wid: str, cores: int, busy: int) -> WorkerStatus:
    return WorkerStatus(WorkerInfo(wid, cores), busy_cores=busy, running=busy, idle_since=None if busy else 0.0)


def _work(n: int) -> list[ActionSpec]:
    return [ActionSpec("sandbox", {"cmd": "true"}, demand=Demand(1, 1), duration_hint=60) for _ in range(n)]


def test_launches_still_starting_are_withdrawn_once_nothing_waits():
    pc = PoolController(PoolConfig([ONE], max_workers={"cpu": 8}, startup_s=30, hold_steps=False))
    starting = [(ONE, 10.0), (ONE, 11.0), (ONE, 12.0)]
    # work waits: nothing is withdrawn (and nothing more launched: the three starting cover it)
    assert not [d for d in pc.decide(PoolView(20.0, _work(2), [], starting, offered_load={})) if isinstance(d, Withdraw)]
    # the backlog cleared, nothing runs: all three go
    assert pc.decide(PoolView(20.0, [], [], starting, offered_load={})) == [Withdraw(ONE, 3, "no cpu work waiting")]
    # 4 busy cores and work arriving at 4.5 cores' worth a second want 4.5 / 0.75 = 6 cores: one of the three goes
    out = pc.decide(PoolView(20.0, [], [_busy("w", 4, 4)], starting, offered_load={"cpu": 4.5}))
    assert [d for d in out if isinstance(d, Withdraw)] == [Withdraw(ONE, 1, "no cpu work waiting")]
    # min_workers are kept
    pc = PoolController(PoolConfig([ONE], min_workers={"cpu": 2}, hold_steps=False))
    out = pc.decide(PoolView(20.0, [], [], starting, offered_load={}))
    assert out == [Withdraw(ONE, 1, "no cpu work waiting")]      # and a withdrawal never turns into a launch


def test_capacity_held_for_the_next_step_is_withdrawn_only_once_the_run_goes_quiet():
    pc = PoolController(PoolConfig([ONE], max_workers={"cpu": 8}, startup_s=30, idle_ttl_s=30))
    starting = [(ONE, 10.0), (ONE, 11.0), (ONE, 12.0)]
    pc.decide(PoolView(20.0, _work(2), [], starting, offered_load={}))     # 2 x 60 core-s: 4 cores wanted
    assert not [d for d in pc.decide(PoolView(25.0, [], [], starting, offered_load={})) if isinstance(d, Withdraw)]
    assert pc.decide(PoolView(51.0, [], [], starting, offered_load={})) == [Withdraw(ONE, 3, "no cpu work waiting")]


# -- live: a coordinator with the Slurm backend ----------------------------------------------------

def coordinator_cmd(run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "tangram_hpc.cli", "coordinator", "--backend", "slurm", "--run-dir", str(run_dir),
            "--host", "127.0.0.1", "--slurm-worker-cores", "1", "--slurm-time", "5", *args]


def env_without_job() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.slurm
@pytest.mark.parametrize("args,words", [
    (("--slurm-partition", "nosuch"), "sbatch: error: invalid partition specified: nosuch"),
    (("--slurm-qos", "nosuch"), "[slurm] qos (--slurm-qos) = 'nosuch': Slurm's accounting knows no QOS of that "
                                "name (sacctmgr show qos: normal)"),
    (("--slurm-account", "nosuch"), "knows no account of that name (sacctmgr show account: root)"),
    (("--slurm-worker-cores", "64"), "Requested node configuration is not available"),
    (("--slurm-time", "1"), "every worker would expire at birth"),
])
def test_settings_slurm_would_refuse_stop_the_coordinator_at_start(tmp_path, dev_cluster, args, words):
    r = subprocess.run(coordinator_cmd(tmp_path / "run", *args), capture_output=True, text=True, timeout=120,
                       env=env_without_job())
    assert r.returncode == 2 and words in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "run" / "connection.json").exists()


@pytest.mark.slurm
def test_no_sbatch_on_path_is_said_at_start(tmp_path, dev_cluster):
    env = dict(env_without_job(), PATH=str(tmp_path))
    r = subprocess.run(coordinator_cmd(tmp_path / "run"), capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "needs sbatch, srun, squeue, scancel, not on PATH" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


class Coordinator:
    """``tangram-hpc coordinator --backend slurm`` on this machine, its log, and a client."""

    def __init__(self, run_dir: Path, *args: str):
        from tangram_hpc import Client
        self.run_dir = run_dir
        run_dir.mkdir(parents=True)
        self.log = run_dir / "coordinator.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(coordinator_cmd(run_dir, *args), stdout=out, stderr=subprocess.STDOUT,
                                         env=env_without_job())
        self.conn = run_dir / "connection.json"
        wait_until(lambda: self.conn.exists() or self.proc.poll() is not None, 60, what="the connection file")
        assert self.proc.poll() is None, self.log.read_text()
        self.client = Client(connection_file=str(self.conn))

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tangram_hpc.cli", *args, "-c", str(self.conn)],
                              capture_output=True, text=True, timeout=120, env=env_without_job())

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


def job_ids(allocs: list[dict]) -> list[int]:
    return [int(a["job_id"]) for a in allocs if a["job_id"]]


@pytest.mark.slurm
def test_queued_worker_jobs_are_cancelled_when_the_backlog_clears(tmp_path, dev_cluster):
    # Worker jobs that cannot start for an hour (--begin): they wait in the queue as on a busy cluster.
    co = Coordinator(tmp_path / "run", "--slurm-sbatch", "begin=now+3600", "--slurm-max-workers", "3", "--slurm-idle", "2")
    view = CliClusterView()
    try:
        specs = [ActionSpec("function", {"fn": "time:sleep", "args": [1]}, demand=Demand(1, 1), duration_hint=60)
                 for _ in range(6)]
        futs = [co.client.submit(s) for s in specs]
        allocs = wait_until(lambda: len(a := co.client.status(allocations=True)["allocations"]) == 3
                            and all(x["state"] == "pending" and x["job_id"] for x in a) and a,
                            60, what="three queued worker jobs")
        ids = job_ids(allocs)
        assert {j.job_id: j.reason for j in view.jobs(ids)} == {i: "BeginTime" for i in ids}
        co.client.cancel([s.id for s in specs])               # the backlog clears
        assert all(f.result(30).status == "cancelled" for f in futs)
        def all_ended():
            a = co.client.status(allocations=True)["allocations"]
            return all(x["state"] == "ended" for x in a) and a
        allocs = wait_until(all_ended, 60, what="the queued jobs to be cancelled")
        assert all(x["reason"] == "cancelled while queued: no cpu work waiting" and not x["started"]
                   for x in allocs), allocs
        assert not [j for j in view.jobs(ids) if j.active]
        recs = wait_until(lambda: len(r := view.accounting(ids)) == 3 and r, 30, what="sacct records")
        assert {r.state for r in recs} == {"CANCELLED"} and all(r.elapsed_s == 0 for r in recs)
        text = co.cli("status", "--allocations").stdout
        assert "allocations: 3 (3 ended)" in text and text.count("cancelled while queued") == 3
        log = co.log.read_text()
        assert log.count("cancelling queued worker job") == 3 and "launched 3 worker(s) of 1 cores" in log
    finally:
        co.close()


@pytest.mark.slurm
def test_failed_worker_jobs_stop_launches_until_resumed(tmp_path, dev_cluster):
    # Every worker job fails before its worker starts (a broken setup line, as a missing module would).
    co = Coordinator(tmp_path / "run", "--slurm-setup", "exit 3", "--slurm-max-workers", "1",
                     "--launch-backoff", "0", "--launch-breaker", "2", "--launch-breaker-cooldown", "600")
    try:
        co.client.submit(ActionSpec("function", {"fn": "time:sleep", "args": [1]}, demand=Demand(1, 1)))
        st = wait_until(lambda: (s := co.client.status())["launch"]["state"] == "stopped" and s, 90,
                        what="the breaker to stop launches")
        launch = st["launch"]
        assert st["launch_failures"] == 2 and "2 worker starts failed within 300 s" in launch["reason"]
        assert ("failed NonZeroExitCode" in launch["reason"] or "failed exit code 3" in launch["reason"]) \
            and "its log: " in launch["reason"], launch
        retry = datetime.fromisoformat(launch["retry_at"]).timestamp()   # a wall-clock time
        assert 500 < retry - time.time() <= 600 and 500 < launch["retry_in_s"] <= 600
        text = co.cli("status").stdout
        assert "launches stopped: 2 worker starts failed" in text and "'tangram-hpc pool resume' retries now" in text
        # a user waiting on an action is told why nothing runs, and the action does not linger
        r = co.cli("submit", "--wait", "2", "echo hi")
        assert r.returncode == 124 and "no result within 2 s (--wait)" in r.stderr and "launches stopped" in r.stderr
        assert "Traceback" not in r.stderr
        time.sleep(3)
        assert len(co.client.status(allocations=True)["allocations"]) == 2      # still stopped
        r = co.cli("pool", "resume")
        assert r.returncode == 0 and r.stdout.startswith("launches resumed; now: launches ok"), r.stdout + r.stderr
        wait_until(lambda: len(co.client.status(allocations=True)["allocations"]) == 3, 60, what="a new launch")
        log = co.log.read_text()
        assert "worker start failed: tgw-" in log and "launches stopped: 2 worker starts failed" in log
        assert "launches resumed by an operator" in log
    finally:
        co.close()


class ShortPartitionView(CliClusterView):
    """The live cluster, as if its partitions had a MaxTime of 30 minutes (the dev cluster's is unlimited)."""

    def partitions(self):
        from tangram_hpc.slurm.cli_view import parse_scontrol_partitions
        text = self._run(["scontrol", "show", "partition", "-o"]).replace("MaxTime=UNLIMITED", "MaxTime=00:30:00")
        return parse_scontrol_partitions(text, self.nodes())


@pytest.mark.slurm
def test_a_time_limit_over_the_partitions_maxtime_is_refused(tmp_path, dev_cluster):
    from tangram_hpc.backends.slurm import SlurmBackend, backend_config, slurm_shapes
    s = SlurmSettings(time_min=45)
    be = SlurmBackend(backend_config(s, tmp_path), view=ShortPartitionView())
    with pytest.raises(ConfigError, match=r"time_min \(--slurm-time\) = 45 min is longer than partition cpu's "
                                          r"MaxTime \(30 min"):
        be.preflight(slurm_shapes(s))
    s = SlurmSettings(time_min=30)
    SlurmBackend(backend_config(s, tmp_path), view=ShortPartitionView()).preflight(slurm_shapes(s))
