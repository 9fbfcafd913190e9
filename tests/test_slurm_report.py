"""tangram-hpc report: synthetic run logs, captured sacct records, and live accounting."""
from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
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
    # trajectory A: 2 cores from 100 to 130; B: 1 core and one GPU from 100 to 115, less the 5 s b1 only
    # waited in the pool's queue (with resources of its own it would not have)
    assert s["trajectory_bound_core_hours"] * 3600 == pytest.approx(2 * 30 + 1 * 10)
    assert s["trajectory_bound_gpu_hours"] * 3600 == pytest.approx(10)
    assert s["core_hours_saved"] * 3600 == pytest.approx(70 - 500)
    assert s["gpu_hours_saved"] * 3600 == pytest.approx(10 - 50) and s["gpu_savings"] == pytest.approx(1 - 50 / 10)
    line = next(ln for ln in report.format_table(rep).splitlines() if ln.startswith("saved vs trajectory-bound"))
    assert line.endswith("-0.1194 core-h (-614.3%), -0.0111 GPU-h (-400.0%)"), line


def test_a_run_of_reward_calls_only_compares_its_gpus(tmp_path):
    """Reward calls bind no core: the cores have nothing to compare, the GPUs do (it said
    'no action ran to its end' of a run whose every call was ok)."""
    rd = tmp_path / "run"
    rd.mkdir()
    write_log(rd / "workers.log", [[100.0, "register", "g1", "h1", 1, 1], [200.0, "exit", "g1", "h1", 1, 1]])
    write_log(rd / "actions.log", [[f"r{i}", "reward", "reward:rm", "g1", 0, 100.0 + 10 * i, 100.0 + 10 * i,
                                    105.0 + 10 * i, "ok", 1, f"T{i}"] for i in range(5)])
    s = report.load_run(rd, now=300.0).summary
    assert s["core_savings"] is None and s["gpu_savings"] == pytest.approx(1 - 100 / 25)
    line = next(ln for ln in report.format_table(report.load_run(rd, now=300.0)).splitlines()
                if ln.startswith("saved vs trajectory-bound"))
    assert line.endswith("cores n/a (no action ran to its end on a core), -0.0208 GPU-h (-300.0%)"), line


def test_no_saving_is_claimed_when_no_action_ran_to_its_end(tmp_path):
    """Every attempt lost with a departing worker: the logged action never started, so there is no
    trajectory-bound use to compare the allocation with (it made a saving of -300,000 %)."""
    rd = tmp_path / "run"
    rd.mkdir()
    write_log(rd / "workers.log", [[100.0, "register", "w1", "h1", 2, 0], [400.0, "exit", "w1", "h1", 2, 0]])
    write_log(rd / "actions.log", [["a1", "sandbox", "sandbox:x", None, 0, 100.0, 0.0, 380.0, "error", 3, "A"]])
    rep = report.load_run(rd, now=500.0)
    assert rep.summary["busy_core_hours"] == 0 and rep.summary["core_savings"] is None
    line = next(ln for ln in report.format_table(rep).splitlines() if ln.startswith("saved vs trajectory-bound"))
    assert line.endswith("n/a (no action ran to its end)"), line


def test_trajectory_bound_counts_concurrent_cores():
    A = report.ActionRow
    acts = [A("x", "sandbox", "s", "w", 2, 1000.0, 1000.0, 1010.0, "ok", 1, "T"),
            A("y", "sandbox", "s", "w", 3, 1000.0, 1005.0, 1020.0, "ok", 1, "T"),   # overlaps x: 5 cores at once
            A("z", "function", "f", "w", 1, 1050.0, 1050.0, 1052.0, "ok", 1, None)]  # alone
    tb = report.trajectory_bound(acts)
    assert tb["trajectories"] == 2
    # y waited 0..5 while x ran: that is not queueing of the trajectory, which ran all along
    assert tb["core_seconds"] == pytest.approx(5 * 20 + 1 * 2)


def test_trajectory_bound_leaves_out_the_pools_own_queueing():
    A = report.ActionRow
    acts = [A("x", "sandbox", "s", "w", 2, 1000.0, 1030.0, 1040.0, "ok", 1, "T"),   # 30 s waiting for a worker
            A("y", "sandbox", "s", "w", 2, 1050.0, 1055.0, 1060.0, "ok", 1, "T"),   # 5 s more; 10 s thinking before
            A("z", "sandbox", "s", "w", 2, 1070.0, 0.0, 1075.0, "cancelled", 1, "T")]  # never ran: all waiting
    tb = report.trajectory_bound(acts)
    assert tb["core_seconds"] == pytest.approx(2 * (75 - 30 - 5 - 5))


def test_a_coordinator_restart_does_not_count_an_action_twice(tmp_path):
    rd = local_run(tmp_path)
    log = rd / "actions.log"
    log.write_bytes(b"".join(msgpack.packb(r) for r in report.read_records(log)))   # without the torn record
    # The first coordinator logged a2 (attempt 2) but its result never reached the client, which
    # resubmitted it to the next coordinator at 300; it ran again there, on w1, 310-320.
    write_log(log, [["a2", "sandbox", "sandbox:pytest", "w1", 2, 300.0, 310.0, 320.0, "ok", 1, "A"]])
    rep = report.load_run(rd, now=400.0)
    s = rep.summary
    assert s["actions"] == 3 and s["actions_by_status"] == {"ok": 2, "failed": 1}
    a2 = next(a for a in rep.actions if a.id == "a2")
    assert (a2.submitted, a2.finished, a2.attempts) == (120.0, 320.0, 3)   # ACT from the first submission
    assert s["mean_act_s"] == pytest.approx((10 + 200 + 15) / 3)
    assert s["busy_core_hours"] * 3600 == pytest.approx(2 * 10 + 2 * 10 + 1 * 10 + 2 * 10)  # both runs used cores


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
    assert sorted(r["cpus"] for r in rows[:-1]) == ["2", "4"]
    total = rows[-1]
    assert (total["job_id"], total["handle"], total["cpus"]) == ("total", "2 jobs", "6")
    assert float(total["core_hours"]) * 3600 == pytest.approx(4 * 100 + 2 * 50, abs=0.01)
    assert float(total["elapsed_s"]) == 150 and float(total["start"]) == 100 and float(total["end"]) == 200
    plots = tmp_path / "plots"
    assert report.main(_args("--run-dir", str(rd), "--plot", str(plots))) == 0
    out = capsys.readouterr().out
    assert "utilisation" in out and "cores 10.0%" in out
    for name in ("allocation.png", "act_cdf.png"):
        data = (plots / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert report.main(_args("--run-dir", str(tmp_path / "nope"))) == 2


def test_a_directory_that_is_not_a_run_is_refused_not_reported_as_empty(tmp_path, capsys):
    """The parent of a run directory (an easy slip) reported zero use and exit 0."""
    local_run(tmp_path)
    assert report.main(_args("--run-dir", str(tmp_path))) == 2
    err = capsys.readouterr().err
    assert "is not a coordinator run directory" in err and f"run directories in it: {tmp_path / 'run'}" in err
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "actions.log").write_text("hello\n")
    assert report.main(_args("--run-dir", str(junk))) == 0
    captured = capsys.readouterr()
    assert "actions.log holds no readable record" in captured.err
    assert "allocation source: none" in captured.out


def test_parse_time():
    assert report.parse_time("1700000000") == 1700000000.0
    assert abs(report.parse_time("-2h") - (time.time() - 7200)) < 5


def test_relative_since_on_the_command_line(tmp_path, capsys):
    """``--since -30m`` as documented: argparse alone would take -30m for an option."""
    from tangram_hpc import cli
    rd = local_run(tmp_path)
    assert cli.main(["report", "--run-dir", str(rd), "--since", "-30m", "--until", "-1s", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert abs(doc["window"][0] - (time.time() - 1800)) < 60 and abs(doc["window"][1] - time.time()) < 60
    assert doc["summary"]["actions"] == 0        # the synthetic run's actions are from 1970


def test_allocation_plot_has_a_gpu_panel_only_with_gpus(tmp_path):
    import matplotlib.image
    rd = local_run(tmp_path)
    rep = report.load_run(rd, now=300.0)
    with_gpu = matplotlib.image.imread(report.write_plots(rep, tmp_path / "a", now=300.0)[0])
    rep.jobs = [j for j in rep.jobs if not j.gpus]
    rep.worker_gpus = {}
    cpu_only = matplotlib.image.imread(report.write_plots(rep, tmp_path / "b", now=300.0)[0])
    assert with_gpu.shape[0] == 900 and cpu_only.shape[0] == 600   # two panels, then one


def test_cpu_time_is_the_sum_of_the_steps():
    # captured on the dev cluster: `sacct -j 177` gives TotalCPU 00:00.322 (batch 0.008987 + step 0 0.313787 s)
    # while the job-level total in the JSON is 0
    [rec] = parse_sacct_json(json.loads((FIXTURES / "sacct-steps-22.05.json").read_text()))
    assert rec.cpu_time_s == pytest.approx(0.008987 + 0.313787)


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
    # the CPU time the jobs used, as sacct's own TotalCPU column says (the steps' sum; [MM:]SS.mmm here)
    text = subprocess.run(["sacct", "-n", "-P", "-j", ",".join(map(str, ids)), "-o", "JobID,TotalCPU"],
                          capture_output=True, text=True, check=True).stdout   # not -X: that says 0
    total = {jid: sum(float(x) * 60 ** i for i, x in enumerate(reversed(t.split(":"))))
             for jid, t in (line.split("|") for line in text.split()) if "." not in jid}
    for h, jid in zip(hs, ids):
        assert jobs[h]["cpu_time_s"] > 0.05 and jobs[h]["cpu_time_s"] == pytest.approx(total[str(jid)], abs=0.002)
    assert report.main(_args("--run-dir", str(rd))) == 0
    assert hs[1] in capsys.readouterr().out


def test_a_clean_stop_reports_its_workers_stopped_not_lost(tmp_path):
    """The coordinator stopping (SIGTERM) tells its workers to leave: that is no fault, in its log,
    its counters or the report (it said 'worker ... lost' and 'worker jobs 1 (1 lost)')."""
    from tangram_hpc import LocalCluster, function
    with LocalCluster(workers=1, cores=1, run_dir=tmp_path) as cl, cl.client() as c:
        assert c.submit(function("tangram_hpc.handlers:noop", 1)).result(30).output == 1
    events = [r[1] for r in report.read_records(tmp_path / "workers.log")]
    assert events[0] == "register" and events[-1] == "stopped" and "lost" not in events, events
    assert " lost (" not in (tmp_path / "coordinator.log").read_text()
    s = report.load_run(tmp_path).summary
    assert s["job_states"] == {"stopped": 1} and s["actions"] == 1
