"""SlurmBackend against the real dev cluster (submitit jobs, squeue, sacct, scancel)."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import msgpack
import pytest

from slurm_support import TESTS_DIR, dev_cluster, wait_until  # noqa: F401
from tangram_hpc.backends.base import WorkerLaunchSpec
from tangram_hpc.backends.slurm import (
    SLURM_JOBS_LOG, LaunchRefused, SlurmBackend, SlurmBackendConfig, backend_config)
from tangram_hpc.config import ConfigError
from tangram_hpc.config_cli import add_arguments, settings_from_args
from tangram_hpc.launch import pool_from_settings
from tangram_hpc.resources import WorkerShape
from tangram_hpc.slurm.cli_view import CliClusterView

class CountingView(CliClusterView):
    """The real CLI view, counting how often each query runs."""

    def __init__(self):
        super().__init__()
        self.calls = {"jobs": 0, "accounting": 0}

    def jobs(self, *a, **kw):
        self.calls["jobs"] += 1
        return super().jobs(*a, **kw)

    def accounting(self, *a, **kw):
        self.calls["accounting"] += 1
        return super().accounting(*a, **kw)


def make_backend(tmp_path: Path, **kw) -> tuple[SlurmBackend, CountingView]:
    cfg = SlurmBackendConfig(run_dir=str(tmp_path / "run"), entry="slurm_support:fake_worker",
                             setup=(f'export PYTHONPATH="{TESTS_DIR}:$PYTHONPATH"',), time_min=10, **kw)
    view = CountingView()
    return SlurmBackend(cfg, view=view), view


def spec(tmp_path: Path, shape: WorkerShape, *extra: str) -> WorkerLaunchSpec:
    return WorkerLaunchSpec(str(tmp_path / "conn.json"), shape, tuple(extra))


def collect(backend: SlurmBackend, until, timeout: float = 30.0) -> list:
    """Poll about 5 times a second until ``until(events so far)`` holds."""
    events = []
    deadline = time.monotonic() + timeout
    while True:
        events += backend.poll()
        if until(events):
            return events
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; events so far: {events}")
        time.sleep(0.2)


def states(events, handle):
    return [e.state for e in events if e.handle == handle]


@pytest.mark.slurm
def test_launch_run_reclaim_and_account(tmp_path, dev_cluster):
    be, view = make_backend(tmp_path)
    try:
        [h] = be.launch(spec(tmp_path, WorkerShape(cores=2, mem_mb=300), "--sleep", "120"))
        marker = tmp_path / f"{h}.json"
        ev = collect(be, lambda e: "running" in states(e, h) and marker.exists())
        assert states(ev, h)[0] == "pending"
        started = json.loads(marker.read_text())
        # the real worker's argv shape, with the handle known before the job started
        assert started["argv"][:8] == ["--connection-file", str(tmp_path / "conn.json"), "--cores", "2",
                                       "--gpus", "0", "--handle", h]
        assert started["env"]["TANGRAM_WORKER_HANDLE"] == h
        assert started["env"]["SLURM_JOB_NAME"] == h
        assert started["env"]["SLURM_CPUS_PER_TASK"] == "2"
        job_id = be.job_id(h)
        assert started["env"]["SLURM_JOB_ID"] == job_id
        [info] = view.jobs([int(job_id)])
        assert info.state == "RUNNING" and info.cpus == 2 and info.name == h
        limit = be.time_limit(h)
        assert limit is not None and 9 * 60 < limit - time.time() <= 10 * 60
        be.reclaim(h)
        ev = collect(be, lambda e: "ended" in states(e, h))
        assert [e.reason for e in ev if e.handle == h and e.state == "ended"] == ["reclaimed"]
        rec = wait_until(lambda: [r for r in view.accounting([int(job_id)]) if r.state == "CANCELLED" and r.name == h],
                         30, what="sacct record")[0]
        assert rec.alloc_cpus == 2 and rec.alloc_mem_mb == 300 and rec.elapsed_s >= 0
        with open(tmp_path / "run" / SLURM_JOBS_LOG, "rb") as f:
            records = list(msgpack.Unpacker(f))
        assert [r[1:] for r in records] == [[h, int(job_id), 2, 0, None]]
        assert (be.folder.parent.name == "submitit") and be.folder.is_dir()
    finally:
        be.shutdown()


@pytest.mark.slurm
def test_launch_from_inside_an_allocation(tmp_path, dev_cluster, monkeypatch):
    # what the coordinator sees when it runs in an sbatch job with --mem
    for k, v in {"SLURM_JOB_ID": "1", "SLURM_MEM_PER_NODE": "2048", "SLURM_CPUS_PER_TASK": "2",
                 "SBATCH_PARTITION": "nosuch"}.items():
        monkeypatch.setenv(k, v)
    be, _ = make_backend(tmp_path)
    [h] = be.launch(spec(tmp_path, WorkerShape(cores=1)))
    ev = collect(be, lambda e: "ended" in states(e, h) or "failed" in states(e, h))
    assert [e.reason for e in ev if e.handle == h][-1] == "completed", ev
    started = json.loads((tmp_path / f"{h}.json").read_text())
    assert started["env"]["SLURM_JOB_ID"] == be.job_id(h) and started["env"]["SLURM_CPUS_PER_TASK"] == "1"
    import os
    assert os.environ["SLURM_MEM_PER_NODE"] == "2048"   # restored for the coordinator


@pytest.mark.slurm
def test_one_squeue_per_poll_for_many_jobs(tmp_path, dev_cluster):
    be, view = make_backend(tmp_path)
    try:
        hs = be.launch(spec(tmp_path, WorkerShape(cores=1), "--sleep", "60"), count=4)
        assert len(hs) == 4
        ev = collect(be, lambda e: all("running" in states(e, h) for h in hs))
        polls = view.calls["jobs"]
        assert polls >= 1 and view.calls["accounting"] == 0
        n = view.calls["jobs"]
        be.poll()
        assert view.calls["jobs"] == n + 1
        be.shutdown()   # one scancel for all
        ev = collect(be, lambda e: all("ended" in states(e, h) for h in hs))
        assert {e.reason for e in ev if e.state == "ended"} == {"reclaimed"}
    finally:
        be.shutdown()


@pytest.mark.slurm
def test_gpu_worker_gets_gres_devices(tmp_path, dev_cluster):
    be, view = make_backend(tmp_path, gpu_partition="gpu")
    try:
        [h] = be.launch(spec(tmp_path, WorkerShape(cores=1, gpus=2)))
        marker = tmp_path / f"{h}.json"
        collect(be, lambda e: "ended" in states(e, h))
        started = json.loads(marker.read_text())
        assert started["gpus"] == 2 and "--gpus" in started["argv"]
        assert sorted(started["env"]["CUDA_VISIBLE_DEVICES"].split(",")) == ["0", "1"]
        rec = wait_until(lambda: [r for r in view.accounting([int(be.job_id(h))]) if r.name == h and r.end_time],
                         30, what="sacct record")[0]
        assert rec.alloc_gpus == 2 and rec.partition == "gpu" and rec.state == "COMPLETED"
    finally:
        be.shutdown()


@pytest.mark.slurm
def test_scancel_from_outside_is_seen(tmp_path, dev_cluster):
    be, _ = make_backend(tmp_path)
    try:
        [h] = be.launch(spec(tmp_path, WorkerShape(cores=1), "--sleep", "120"))
        collect(be, lambda e: "running" in states(e, h))
        subprocess.run(["scancel", be.job_id(h)], check=True)
        ev = collect(be, lambda e: "ended" in states(e, h) or "failed" in states(e, h))
        [end] = [e for e in ev if e.handle == h and e.state in ("ended", "failed")]
        assert "outside" in end.reason
        assert be.handles() == []
    finally:
        be.shutdown()


@pytest.mark.slurm
def test_vanished_job_resolved_by_one_sacct_call(tmp_path, dev_cluster):
    class ForgetfulView(CountingView):
        """squeue as it looks after MinJobAge: our finished jobs are gone from it."""
        def jobs(self, *a, **kw):
            return [j for j in super().jobs(*a, **kw) if j.active]

    cfg = SlurmBackendConfig(run_dir=str(tmp_path / "run"), entry="slurm_support:fake_worker",
                             setup=(f'export PYTHONPATH="{TESTS_DIR}:$PYTHONPATH"',), time_min=10)
    view = ForgetfulView()
    be = SlurmBackend(cfg, view=view)
    hs = be.launch(spec(tmp_path, WorkerShape(cores=1)), count=2)   # exit at once
    ev = collect(be, lambda e: all("ended" in states(e, h) for h in hs))
    assert {e.reason for e in ev if e.state == "ended"} == {"completed"}
    assert view.calls["accounting"] <= view.calls["jobs"]


@pytest.mark.slurm
def test_failed_jobs_are_reported_and_an_sbatch_error_stops_the_launch(tmp_path, dev_cluster):
    be, _ = make_backend(tmp_path)
    hs = be.launch(spec(tmp_path, WorkerShape(cores=1), "--exit", "3"), count=2)
    ev = collect(be, lambda e: all("failed" in states(e, h) for h in hs))
    failed = [e for e in ev if e.state == "failed"]
    for e in failed:   # how it failed (squeue's reason, or sacct's exit code) and where its log says why
        how, _, log_path = e.reason.partition("; its log: ")
        assert how in ("NonZeroExitCode", "exit code 3") and Path(log_path).is_file(), e.reason
    # sbatch refuses (an option the controller rejects): the other launches are not tried
    be.config.extra_sbatch["constraint"] = "nosuchfeature"
    [h] = be.launch(spec(tmp_path, WorkerShape(cores=1)), count=3)
    [failed] = [e for e in be.poll() if e.handle == h]
    assert failed.state == "failed" and "sbatch failed" in failed.reason and be.job_id(h) is None


@pytest.mark.slurm
def test_unfit_shape_is_refused(tmp_path, dev_cluster):
    be, _ = make_backend(tmp_path)
    with pytest.raises(LaunchRefused, match="no node in partition cpu"):
        be.launch(spec(tmp_path, WorkerShape(cores=64)))
    with pytest.raises(LaunchRefused, match="does not exist"):
        be.launch(spec(tmp_path, WorkerShape(cores=1, partition="nosuch")))


def test_cli_arguments_build_the_config(tmp_path, monkeypatch):
    import argparse
    p = argparse.ArgumentParser()
    add_arguments(p, "coordinator")

    def slurm(*argv):
        return settings_from_args(p.parse_args(list(argv))).slurm
    cfg = backend_config(slurm("--slurm-partition", "cpu", "--slurm-time", "30", "--slurm-sbatch", "constraint=ib"),
                         run_dir=tmp_path)
    assert (cfg.partition, cfg.time_min, cfg.extra_sbatch, cfg.run_dir) == ("cpu", 30, {"constraint": "ib"},
                                                                            str(tmp_path))
    launch = settings_from_args(p.parse_args(["--launch-breaker", "3", "--launch-rate", "2"])).launch
    assert (launch.breaker, launch.rate, launch.burst) == (3, 2.0, 8)
    with pytest.raises(ConfigError, match="sbatch wants KEY=VALUE"):
        backend_config(slurm("--slurm-sbatch", "constraint"))
    # options the backend sets itself would pass the checks made on their settings (a time limit
    # shorter than the checked time_min drained every worker at birth, one launch after another)
    for item, setting in [("time=1", "time_min"), ("--time=1", "time_min"), ("cpus_per_task=8", "worker_cores"),
                          ("signal=B:TERM@5", "time-limit warning")]:
        with pytest.raises(ConfigError, match=f"sbatch may not set .*: the backend sets it from .*{setting}"):
            backend_config(slurm(f"--slurm-sbatch={item}"))
    # TANGRAM_SETUP ([slurm] setup_file) is sourced before the setup lines, which it does not replace
    site = tmp_path / "site setup.sh"
    site.write_text("export FROM_SITE=1\n")
    monkeypatch.setenv("TANGRAM_SETUP", str(site))
    cfg = backend_config(slurm("--slurm-setup", "export FROM_CONFIG=1"), tmp_path / "run")
    setup = SlurmBackend(cfg, view=CountingView())._parameters(WorkerShape(cores=1), "tgw-x-1")["setup"]
    assert setup[1:] == [f"source '{site}'", "export FROM_CONFIG=1"], setup
    site.unlink()
    with pytest.raises(ConfigError, match="setup_file .TANGRAM_SETUP.: no file"):
        backend_config(slurm())
    monkeypatch.delenv("TANGRAM_SETUP")
    pool = pool_from_settings(slurm("--slurm-worker-cores", "2", "--slurm-max-workers", "3", "--slurm-gpu-workers",
                                    "1", "--slurm-partition", "cpu", "--slurm-gpu-partition", "gpu",
                                    "--slurm-idle", "7"))
    cpu, gpu = pool.config.shapes
    assert (cpu.cores, cpu.partition, gpu.gpus, gpu.partition) == (2, "cpu", 1, "gpu")
    assert pool.config.max_workers == {"cpu": 3, "gpu": 1} and pool.config.idle_ttl_s == 7
    assert pool.config.env_idle_ttl_s == 14    # twice the idle time unless set


def test_capacity_from_the_live_partitions(dev_cluster, tmp_path):
    be = SlurmBackend(SlurmBackendConfig(run_dir=str(tmp_path)))
    cap = be.capacity()
    assert cap is not None and cap.partitions[None] == cap.partitions["cpu"]  # cpu is the default
    gpu = cap.partitions["gpu"]
    assert gpu.max_node_cores == 16 and gpu.max_node_gpus == 4
    assert cap.holds(WorkerShape(cores=4, gpus=1, partition="gpu"))
    assert not cap.holds(WorkerShape(cores=64, partition="cpu"))


def test_a_forced_pyslurm_view_that_cannot_work_is_a_config_error(tmp_path, monkeypatch):
    """Refused at start in one line (exit 2), like every other setting Slurm cannot honour."""
    import tangram_hpc.backends.slurm as backend_mod
    from tangram_hpc.slurm import SlurmCommandError

    def broken(prefer, **_):
        raise SlurmCommandError("pyslurm cannot be used: pyslurm not importable: ModuleNotFoundError")
    monkeypatch.setattr(backend_mod, "cluster_view", broken)
    with pytest.raises(ConfigError, match=r"\[slurm\] view = pyslurm: pyslurm cannot be used"):
        SlurmBackend(SlurmBackendConfig(run_dir=str(tmp_path), cluster_view="pyslurm"))
    with pytest.raises(SlurmCommandError):          # auto or cli: not a setting's fault
        SlurmBackend(SlurmBackendConfig(run_dir=str(tmp_path), cluster_view="auto"))
