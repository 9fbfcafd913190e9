"""tangram-hpc report: synthetic run logs, captured sacct records, and live accounting."""
from __future__ import annotations

import argparse
import csv
import io
import json
import time
from pathlib import Path

import msgpack
import pytest

from slurm_support import FIXTURES, TESTS_DIR, dev_cluster, wait_until  # noqa: F401
from tangram_hpc import report
from tangram_hpc.slurm.cli_view import CliClusterView, parse_sacct_json
from tangram_hpc.slurm.view import ClusterView


def write_log(path: Path, records: list[list], torn: bool = False) -> None:
    with open(path, "ab") as f:
        for r in records:
            f.write(msgpack.packb(r))
        if torn:
            f.write(msgpack.packb(["torn", "record", "x" * 50])[:-10])


def local_run(tmp_path: Path) -> Path:
    """Two workers and three actions in two trajectories, with numbers easy to check by hand."""
    rd = tmp_path / "run"
    rd.mkdir()
    write_log(rd / "workers.log", [
        [100.0, "register", "w1", "h1", 4, 0],
        [100.0, "register", "w2", "h2", 2, 1],
        [150.0, "exit", "w2", "h2", 2, 1],
        [200.0, "reclaimed", "w1", "h1", 4, 0],
    ])
    # [id, kind, class, worker, cores, submitted, started, finished, status, attempts, trajectory]
    write_log(rd / "actions.log", [
        ["a1", "sandbox", "sandbox:pytest", "w1", 2, 100.0, 100.0, 110.0, "ok", 1, "A"],
        ["a2", "sandbox", "sandbox:pytest", "w1", 2, 120.0, 120.0, 130.0, "ok", 2, "A"],
        ["b1", "reward", "reward:rm", "w2", 1, 100.0, 105.0, 115.0, "failed", 1, "B"],
    ], torn=True)
    return rd


def test_local_run_totals(tmp_path):
    rep = report.load_run(local_run(tmp_path), now=300.0)
    s = rep.summary
    assert s["source"] == "workers.log" and s["worker_jobs"] == 2 and s["actions"] == 3  # torn record skipped
    assert s["allocated_core_hours"] * 3600 == pytest.approx(4 * 100 + 2 * 50)
    assert s["busy_core_hours"] * 3600 == pytest.approx(2 * 10 + 2 * 10 + 1 * 10)
    assert s["core_utilisation"] == pytest.approx(50 / 500)
    assert s["allocated_gpu_hours"] * 3600 == pytest.approx(50)
    assert s["gpu_utilisation"] == pytest.approx(10 / 50)
    assert s["mean_act_s"] == pytest.approx((10 + 10 + 15) / 3)
    assert s["actions_by_status"] == {"ok": 2, "failed": 1} and s["retried_actions"] == 1
    # trajectory A: 2 cores from 100 to 130; B: 1 core and one GPU from 100 to 115
    assert s["trajectory_bound_core_hours"] * 3600 == pytest.approx(2 * 30 + 1 * 15)
    assert s["trajectory_bound_gpu_hours"] * 3600 == pytest.approx(15)
    assert s["core_hours_saved"] * 3600 == pytest.approx(75 - 500)


def test_trajectory_bound_counts_concurrent_cores():
    A = report.ActionRow
    acts = [A("x", "sandbox", "s", "w", 2, 0.0, 0.0, 10.0, "ok", 1, "T"),
            A("y", "sandbox", "s", "w", 3, 0.0, 5.0, 20.0, "ok", 1, "T"),     # overlaps x: 5 cores at once
            A("z", "function", "f", "w", 1, 50.0, 50.0, 52.0, "ok", 1, None)]  # alone
    tb = report.trajectory_bound(acts)
    assert tb["trajectories"] == 2
    assert tb["core_seconds"] == pytest.approx(5 * 20 + 1 * 2)


def test_window_clips_allocations(tmp_path):
    rep = report.load_run(local_run(tmp_path), since=125.0, until=175.0, now=300.0)
    assert rep.summary["allocated_core_hours"] * 3600 == pytest.approx(4 * 50 + 2 * 25)
    assert [a.id for a in rep.actions] == ["a2"]


class FixtureView(ClusterView):
    """Accounting answered from real sacct JSON captured on the dev cluster."""
    name = "fixture"

    def __init__(self):
        self.records = parse_sacct_json(json.loads((FIXTURES / "sacct-22.05.json").read_text()))

    def nodes(self):
        return []

    def partitions(self):
        return []

    def jobs(self, job_ids=None, **kw):
        return []

    def accounting(self, job_ids=None, **kw):
        return [r for r in self.records if job_ids is None or r.job_id in set(job_ids)]


def test_sacct_records_joined_with_submitted_jobs(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    # captured: job 2 tg-run 4 CPUs for 8 s; job 3 tg-gpu 2 CPUs + 2 GPUs for 20 s
    write_log(rd / "slurm_jobs.log", [[0.0, "tgw-x-0001", 2, 4, 0, "cpu"], [0.0, "tgw-x-0002", 3, 2, 2, "gpu"],
                                      [0.0, "tgw-x-0003", 999, 1, 0, "cpu"]])
    rep = report.load_run(rd, view=FixtureView())
    by = {j.job_id: j for j in rep.jobs}
    assert by["2"].handle == "tgw-x-0001" and by["2"].state == "CANCELLED" and by["2"].cpus == 4
    assert by["3"].gpus == 2 and by["999"].state == "UNKNOWN"
    assert rep.summary["allocated_core_hours"] * 3600 == pytest.approx(4 * 8 + 2 * 20)
    assert rep.summary["allocated_gpu_hours"] * 3600 == pytest.approx(2 * 20)
    text = report.format_table(rep)
    assert "tgw-x-0002" in text and "CANCELLED" in text and "core-h" in text


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    report.add_arguments(p)
    return p.parse_args(argv)


def test_cli_json_csv_and_plots(tmp_path, capsys):
    rd = local_run(tmp_path)
    assert report.main(_args("--run-dir", str(rd), "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["actions"] == 3 and len(doc["jobs"]) == 2
    assert report.main(_args("--run-dir", str(rd), "--csv")) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert sorted(r["cpus"] for r in rows) == ["2", "4"]
    plots = tmp_path / "plots"
    assert report.main(_args("--run-dir", str(rd), "--plot", str(plots))) == 0
    out = capsys.readouterr().out
    assert "utilisation" in out and "cores 10.0%" in out
    for name in ("allocation.png", "act_cdf.png"):
        data = (plots / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert report.main(_args("--run-dir", str(tmp_path / "nope"))) == 2


def test_parse_time():
    assert report.parse_time("1700000000") == 1700000000.0
    assert abs(report.parse_time("-2h") - (time.time() - 7200)) < 5


@pytest.mark.slurm
def test_report_over_real_sacct(tmp_path, dev_cluster, capsys):
    from tangram_hpc.backends.base import WorkerLaunchSpec
    from tangram_hpc.backends.slurm import SlurmBackend, SlurmBackendConfig
    from tangram_hpc.resources import WorkerShape

    rd = tmp_path / "run"
    be = SlurmBackend(SlurmBackendConfig(run_dir=str(rd), entry="slurm_support:fake_worker",
                                         setup=(f'export PYTHONPATH="{TESTS_DIR}:$PYTHONPATH"',), time_min=10,
                                         gpu_partition="gpu"))
    conn = str(tmp_path / "conn.json")
    hs = be.launch(WorkerLaunchSpec(conn, WorkerShape(cores=3), ("--sleep", "2")))
    hs += be.launch(WorkerLaunchSpec(conn, WorkerShape(cores=1, gpus=1), ("--sleep", "2")))
    ended: set[str] = set()

    def all_ended():
        ended.update(e.handle for e in be.poll() if e.state == "ended")
        return ended == set(hs)
    wait_until(all_ended, 40, what="both worker jobs to end")
    ids = [int(be.job_id(h)) for h in hs]
    view = CliClusterView()
    recs = wait_until(lambda: (r := view.accounting(ids)) and all(x.end_time and x.name.startswith("tgw-")
                                                                 for x in r) and len(r) == 2 and r,
                      30, what="sacct records")
    now = time.time()
    write_log(rd / "actions.log", [["a1", "function", "function", "w1", 3, now - 5, now - 4, now - 3, "ok", 1, "T"]])
    assert report.main(_args("--run-dir", str(rd), "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    jobs = {j["handle"]: j for j in doc["jobs"]}
    assert set(jobs) == set(hs)
    assert [jobs[h]["state"] for h in hs] == ["COMPLETED", "COMPLETED"]
    assert (jobs[hs[0]]["cpus"], jobs[hs[1]]["cpus"], jobs[hs[1]]["gpus"]) == (3, 1, 1)
    expect = sum(r.alloc_cpus * r.elapsed_s for r in recs) / 3600
    assert doc["summary"]["allocated_core_hours"] == pytest.approx(expect)
    assert all(j["elapsed_s"] >= 2 for j in doc["jobs"])
    assert doc["summary"]["actions"] == 1 and doc["summary"]["source"] == "sacct"
    assert report.main(_args("--run-dir", str(rd))) == 0
    assert hs[1] in capsys.readouterr().out
