"""``tangram-hpc top``: frames drawn from status replies, and the live command in a pseudo-terminal.

The frame tests feed :class:`TopView` status maps (with the per-worker Slurm fields the
coordinator adds: ``job_id``, ``time_left_s``) and read the text a terminal would
show.  The terminal test runs the real command in a pty against a real coordinator, reads its
screen, presses ``q`` and checks the terminal is given back as it was.
"""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import termios
import time

import numpy as np
import pytest
from rich.console import Console

from tangram_hpc import LocalCluster, function, sandbox
from tangram_hpc.metrics import Histogram
from tangram_hpc.top import TopView

from pty_support import press_and_drain, read_screen_until, run_in_pty


def text_of(view: TopView, width: int = 160) -> str:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    console.print(view.frame())
    return console.export_text()


def hist(*values: float) -> dict:
    h = Histogram()
    h.observe_many(np.array(values, dtype=float))
    return h.to_wire()


def status(**over) -> dict:
    st = {
        "coordinator": "c0ffee", "uptime_s": 3725.0, "pending": 7, "running": 3, "completed": 1000,
        "failed": 10, "retried": 2, "rejected": 1, "zombie_cores": 1, "starting_workers": 1,
        "pool": "growing: 7 actions waiting", "metrics_url": "http://n1:9100/metrics",
        "workers": [
            {"id": "w-node1-11-aaaa", "host": "node1", "handle": "tgw-run-0001", "job_id": "4242", "cores": 4,
             "busy_cores": 3, "zombie_cores": 1, "running": 2, "envs": 5, "services": [], "state": "ok",
             "time_left_s": 3000.0},
            {"id": "w-node2-12-bbbb", "host": "node2", "handle": "tgw-run-0002", "cores": 2, "busy_cores": 0,
             "zombie_cores": 0, "running": 0, "envs": 0, "services": ["judge"], "state": "draining",
             "time_left_s": 120.0},
        ],
        "queues": [{"kind": "sandbox", "service": "", "min_cores": 2, "mem_mb": 2048, "gpu_mem_mb": 0,
                    "pending": 6, "env_bound": 4, "oldest_s": 95.0},
                   {"kind": "reward", "service": "judge", "min_cores": 0, "mem_mb": 0, "gpu_mem_mb": 0,
                    "pending": 1, "env_bound": 0, "oldest_s": 0.5}],
        "act": {"sandbox": hist(1.0, 2.0), "function": hist(0.004)},
        "queue_time": {"sandbox": hist(0.1, 0.1), "function": hist(0.001)},
        "finished_by_kind": {"sandbox": {"ok": 990, "failed": 10}, "function": {"ok": 10}},
        "pool_decisions": [[10_000.0, "launch", "2 x 4 cores, partition cpu"],
                           [10_001.0, "drain", "w-node2-12-bbbb: job ends in 120s"],
                           [10_002.0, "launch failed", "tgw-run-0003: failed QOSMaxSubmitJobPerUserLimit"]],
        "recent_launch_failures": ["tgw-run-0003: failed QOSMaxSubmitJobPerUserLimit"],
        "launch": {"state": "backing-off", "reason": "1 failed start in a row", "retry_at": "10:00:40",
                   "retry_in_s": 38.0},
        "allocation_states": {"running": 2, "pending": 1, "failed": 1},
    }
    st.update(over)
    return st


def test_a_frame_shows_workers_with_their_job_and_time_left_queues_and_decisions():
    view = TopView()
    view.add(status(), 10_000.0)
    out = text_of(view)
    w1 = next(line for line in out.splitlines() if line.startswith("w-node1-11-aaaa"))
    # Slurm job id where the coordinator gives one, else the handle; the time left of each.
    assert "4242" in w1 and "3/4" in w1 and "1 zombie" in w1 and "50m00s" in w1 and " 5 " in w1
    w2 = next(line for line in out.splitlines() if line.startswith("w-node2-12-bbbb"))
    assert "tgw-run-0002" in w2 and "draining" in w2 and "2m00s" in w2 and "judge" in w2
    assert "workers 2 (1 draining, 1 ok, 1 starting)" in out and "cores 3/6 busy" in out
    assert "pending 7" in out and "completed 1,000" in out and "up 1h02m" in out
    sandbox_q = next(line for line in out.splitlines() if line.startswith("sandbox ") and "2G" in line)
    assert " 6 " in sandbox_q and " 4 " in sandbox_q and "1m35s" in sandbox_q
    assert "judge" in next(line for line in out.splitlines() if line.startswith("reward "))
    assert "launch failed" in out and "QOSMaxSubmitJobPerUserLimit" in out and "growing: 7 actions waiting" in out
    assert "launches backing-off: 1 failed start in a row (again at 10:00:40)" in out
    assert "worker jobs 1 failed, 1 pending, 2 running" in out
    assert out.count("QOSMaxSubmitJobPerUserLimit") == 1       # not repeated from recent_launch_failures
    # One reply: percentiles since the start (sandbox: 1 s and 2 s -> p50 in the 1..2.5 s bucket).
    assert "since the start" in out
    row = next(line for line in out.splitlines() if line.startswith("sandbox ") and "990" not in line
               and "1,000" in line)
    assert "1.5s" in row or "1.4s" in row, row


def test_rates_and_percentiles_cover_the_window_between_replies():
    view = TopView(window_s=60.0)
    view.add(status(), 1000.0)
    later = status(completed=1300, failed=13, act={"sandbox": hist(1.0, 2.0, *[30.0] * 4), "function": hist(0.004)},
                   finished_by_kind={"sandbox": {"ok": 1290, "failed": 13}, "function": {"ok": 10}})
    view.add(later, 1030.0)
    assert view.rate("completed") == pytest.approx(10.0) and view.rate("failed") == pytest.approx(0.1)
    win = view.recent("act", "sandbox")
    assert win.count == 4 and 25.0 <= win.quantile(0.5) <= 50.0
    out = text_of(view)
    assert "last 30.0s: 10.0 done/s, 0.1 failed/s" in out and "over the last 30.0s" in out
    assert view.recent("act", "function").count == 0
    # Replies older than the window are dropped, keeping one to take differences against.
    view.add(later, 1100.0)
    view.add(later, 1101.0)
    assert [t for t, _ in view.history] == [1030.0, 1100.0, 1101.0]
    view.add(later, 1161.0)
    assert [t for t, _ in view.history] == [1101.0, 1161.0]
    # A restarted coordinator (another id): no window across the restart.
    view.add(status(coordinator="new"), 1162.0)
    assert view.rate("completed") is None and view.recent("act", "sandbox") is None


def test_a_silent_coordinator_is_shown_over_the_last_answer_and_empty_sections_say_so():
    view = TopView()
    assert "waiting for the coordinator" in text_of(view)
    view.failed("no status within 2s")
    assert "no status within 2s" in text_of(view)
    view.add(status(workers=[], queues=[], act={}, queue_time={}, pool_decisions=[], recent_launch_failures=[],
                    starting_workers=0, zombie_cores=0), 5.0)
    view.failed("no status within 2s")
    out = text_of(view, width=100)
    assert "coordinator not answering: no status within 2s (showing the last answer)" in out
    for empty in ("(no workers registered)", "(nothing waiting)", "(no action finished yet)", "(no decisions yet)"):
        assert empty in out


# -- the real command ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.sandbox
def test_top_in_a_terminal_shows_the_cluster_live_and_q_gives_the_terminal_back(tmp_path):
    with LocalCluster(workers=1, cores=2, run_dir=tmp_path / "run") as cl, cl.client() as c:
        c.map([function("math:sqrt", i) for i in range(50)])
        assert c.submit(sandbox("echo x > f.txt", env="traj-7")).result().ok
        # Two 2-core commands on one 2-core worker: one runs, one waits in its queue.
        slow = [sandbox("sleep 20", cores=(2, 2)) for _ in range(2)]
        c.submit_many(slow)
        proc, master, slave = run_in_pty([sys.executable, "-m", "tangram_hpc.cli", "top", "-c", str(cl.connection_file),
                                        "--interval", "0.5"])
        before = termios.tcgetattr(slave)
        try:
            st = c.status()
            [w] = st["workers"]
            screen = read_screen_until(master, lambda s: "sandbox" in s and "function" in s and w["id"] in s
                                 and "(nothing waiting)" not in s and "2/2" in s, timeout=30)
            row = next(line for line in screen.splitlines() if line.startswith(w["id"]))
            assert w["handle"] in row and " 1 " in row                   # its handle; one environment
            queue = next(line for line in screen.splitlines() if line.startswith("sandbox ") and " 2 " in line)
            assert " 1 " in queue                                         # one action waiting, 2 cores
            act_row = next(line for line in screen.splitlines() if line.startswith("function ") and " 50 " in line)
            assert "ms" in act_row                                        # percentiles of the 50 functions
            assert "launch" in screen and "2 cores" in screen            # the pool's decision
            assert "completed 51" in screen and "running 1" in screen and "pending 1" in screen
            out = press_and_drain(proc, master, b"q", timeout=15)
            assert proc.wait(timeout=1) == 0
            assert b"\x1b[?1049l" in out                                  # left the alternate screen
            assert termios.tcgetattr(slave)[3] == before[3]               # line mode restored
            assert termios.tcgetattr(slave)[3] & termios.ICANON
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            os.close(master)
            os.close(slave)
            c.cancel([s.id for s in slow])


def test_top_once_without_a_terminal_prints_one_frame_or_says_the_coordinator_is_silent(tmp_path, cluster):
    p = subprocess.run([sys.executable, "-m", "tangram_hpc.cli", "top", "-c", str(cluster.connection_file)],
                       capture_output=True, text=True, timeout=60, env=os.environ | {"COLUMNS": "120"})
    assert p.returncode == 0, p.stderr
    assert "workers 2 (2 ok)" in p.stdout and "\x1b[" not in p.stdout     # plain text in a pipe
    assert max(map(len, p.stdout.splitlines())) <= 120                      # as wide as COLUMNS says
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    p = subprocess.run([sys.executable, "-m", "tangram_hpc.cli", "top", "-c", str(cluster.connection_file)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0 and max(map(len, p.stdout.splitlines())) > 80, p.stdout   # else the full frame
    # A connection file whose coordinator is gone: a clear line, exit status 1, no hang.
    from dataclasses import replace

    from tangram_hpc.connection import ConnectionInfo
    stale = tmp_path / "stale.json"
    replace(ConnectionInfo.read(cluster.connection_file), client_address="tcp://127.0.0.1:9").write(stale)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "tangram_hpc.cli", "top", "-c", str(stale), "--once",
                        "--interval", "1"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "no status from the coordinator" in p.stdout, (p.stdout, p.stderr)
    assert time.monotonic() - t0 < 30
    # No connection file: one line saying so.
    p = subprocess.run([sys.executable, "-m", "tangram_hpc.cli", "top", "-c", str(tmp_path / "none.json")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip() == \
        f"tangram-hpc top: no connection file at {tmp_path / 'none.json'}: is the coordinator running?"
