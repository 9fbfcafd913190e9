"""A node lost mid-run, on the multi-node loopback cluster (``scripts/dev-cluster.sh multi``).

The coordinator runs on the head node; worker jobs run on the compute nodes.  While trajectories run
(every action appends its id to its environment's log.txt, as in tests/env_faults.py), the node of a
worker running actions loses its slurmd and every process of its jobs at once, as a node that
crashes does.  Every ok action's line must be in its environment exactly once, the lost worker's
environments must go on elsewhere, and the run's report (Slurm accounting) must show the lost jobs
as ended, with the time and the cores they held.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from env_faults import NODE_LOSS, run_fault
from slurm_support import DEV_CLUSTER, _unavailable, dev_cluster  # noqa: F401

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def multi_cluster(dev_cluster, tmp_path_factory):  # noqa: F811
    """A 3-node cluster beside the single-node one (its own controller, ports and state), started for
    this module and stopped after it: its environment variables (SLURM_CONF names it)."""
    if os.geteuid() != 0:
        _unavailable("the multi-node cluster needs root")
    env = {**os.environ, "TANGRAM_DEVCLUSTER_MULTI_DIR": str(tmp_path_factory.mktemp("multi-cluster"))}
    proc = subprocess.run([str(DEV_CLUSTER), "multi", "start", "3"], env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        subprocess.run([str(DEV_CLUSTER), "multi", "stop"], env=env, capture_output=True, timeout=120)
        _unavailable(f"scripts/dev-cluster.sh multi start failed ({proc.returncode}): {proc.stderr[-2000:]}")
    conf = subprocess.run([str(DEV_CLUSTER), "multi", "conf"], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()
    yield {"TANGRAM_DEVCLUSTER_MULTI_DIR": env["TANGRAM_DEVCLUSTER_MULTI_DIR"], "SLURM_CONF": conf}
    subprocess.run([str(DEV_CLUSTER), "multi", "stop"], env=env, capture_output=True, timeout=120)


def test_a_node_lost_mid_run_loses_no_line_and_its_job_is_accounted(tmp_path, multi_cluster, monkeypatch):
    for k, v in multi_cluster.items():
        monkeypatch.setenv(k, v)
    # (actions of 1.5 s: the node is lost while they run, as in the scancel scenario of test_env_faults)
    o = run_fault(NODE_LOSS, tmp_path, envs=12, steps=3, sleep_s=1.5, log=lambda *_: None)
    summary = f"{o.row()} {' '.join(o.notes)}"
    if os.environ.get("TANGRAM_FAULT_COUNTS"):      # scripts/fault-runs.sh totals these over its runs
        with open(os.environ["TANGRAM_FAULT_COUNTS"], "a") as f:
            f.write(json.dumps({"fault": NODE_LOSS, "actions": o.actions, "ok": o.ok, "lost": o.lost,
                                "duplicated": o.duplicated, "envs_lost": o.envs_lost,
                                "seconds": round(o.seconds, 1), "notes": o.notes[:20]}) + "\n")
    assert o.victim_jobs, summary
    assert o.actions >= 36 and o.ok == o.actions, summary
    assert o.lost == 0 and o.duplicated == 0 and o.envs_lost == 0, summary
    assert o.leaked_jobs == [], summary
    # every worker of the node (one or two fit) was lost with it, and its actions ran again elsewhere
    assert o.counters["workers_lost"] == len(o.victim_jobs) and o.counters["retried"] >= 1, summary
    # the node's processes died with it: its environments were taken from its worker's directory
    assert o.env_states["adopted"] > 0, summary

    from tangram_hpc.report import load_run
    assert len(o.run_dirs) == 1, summary
    rep = load_run(o.run_dirs[0])
    lost = [j for j in rep.jobs if j.job_id in o.victim_jobs]
    assert len(lost) == len(o.victim_jobs), (rep.jobs, summary)
    for job in lost:
        # Ended, with what it held until then.  Whoever acts first names the end: slurmctld, once
        # the node missed SlurmdTimeout (NODE_FAIL), or the coordinator, which cancels the job of a
        # worker it declared lost (CANCELLED; the job ends when the node is marked down).
        assert job.state in ("NODE_FAIL", "CANCELLED") and job.end is not None, (job, summary)
        assert job.elapsed_s > 0 and job.cpus == 2, (job, summary)
    assert rep.summary["worker_jobs"] > len(lost), rep.summary      # and the workers that took over
