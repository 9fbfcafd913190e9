"""Progress of long commands: drawn on a terminal's stderr, absent in a pipe or with --quiet."""
from __future__ import annotations

import io
import os
import select
import subprocess
import sys

import msgpack
import pytest

from tangram_hpc.progress import Progress, progress_reporter
from tangram_hpc.runlog import read_records

from pty_support import ANSI, read_for, read_until

BENCH = [sys.executable, "-m", "tangram_hpc.cli", "bench", "--workload", "math", "--scale", "0.1", "--steps", "2",
         "--no-search"]
ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_nothing_is_drawn_in_a_pipe_or_when_quiet():
    sink = io.StringIO()
    with progress_reporter(stream=sink) as p:
        assert not p.enabled
        p("simulating ...")
        p.task("steps", 10).advance(3)
        f = io.BytesIO(b"abc")
        assert p.reading(f, 3, "x") is f
    assert sink.getvalue() == ""
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty, progress_reporter(quiet=True, stream=tty) as p:
            assert not p.enabled
            p("simulating ...")
        assert not select.select([master], [], [], 0.2)[0]
    finally:
        os.close(master)
        os.close(slave)


def test_a_terminal_gets_the_status_line_and_bars_and_they_are_cleared_at_the_end():
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            with progress_reporter(stream=tty) as p:
                assert p.enabled
                p("simulating fifo ...")
                t = p.task("replaying steps", 4)
                t.advance(2)
                # rich redraws on its own thread: wait for each state to be drawn, not for a time
                raw = read_until(master, lambda text: "simulating fifo" in text and "replaying steps" in text
                                 and "50%" in text)
                p("simulating tangram ...")
                raw += read_until(master, lambda text: "simulating tangram" in text)
            raw += read_for(master, 0.5)        # what it wrote as it ended (already written)
        assert "\x1b[2K" in raw.decode("utf-8", "replace")   # transient: the lines are erased when the work ends
    finally:
        os.close(master)
        os.close(slave)


def test_reading_a_log_through_a_bar_gives_the_same_records(tmp_path):
    path = tmp_path / "actions.log"
    recs = [[f"a{i}", "sandbox", "sandbox", "w1", 1, 1.0, 2.0, 3.0, "ok", 1, None] for i in range(5000)]
    path.write_bytes(b"".join(msgpack.packb(r) for r in recs) + b"\x93\x01")   # and a torn last record
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty, progress_reporter(stream=tty) as p:
            got = list(read_records(path, progress=p))
        assert got == recs == list(read_records(path)) == list(read_records(path, progress=Progress()))
        assert "reading actions.log" in ANSI.sub("", read_for(master, 0.5).decode("utf-8", "replace"))
    finally:
        os.close(master)
        os.close(slave)


@pytest.mark.parametrize("quiet", [False, True])
def test_bench_draws_progress_on_a_terminal_stderr_and_its_results_stay_on_stdout(quiet):
    master, slave = os.openpty()
    try:
        p = subprocess.Popen(BENCH + (["--quiet"] if quiet else []), stdout=subprocess.PIPE, stderr=slave,
                             stdin=subprocess.DEVNULL, cwd=ROOT, env=os.environ | {"TERM": "xterm-256color"})
        stdout, _ = p.communicate(timeout=120)
        err = ANSI.sub("", read_for(master, 0.5).decode("utf-8", "replace"))
    finally:
        os.close(master)
        os.close(slave)
    assert p.returncode == 0
    assert "tangram  " in stdout.decode() and "\x1b[" not in stdout.decode()
    if quiet:
        assert err.strip() == ""
    else:
        assert "simulating" in err and "math" in err


def test_bench_in_a_pipe_prints_no_progress_and_the_same_results():
    piped = subprocess.run(BENCH, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert piped.returncode == 0 and piped.stderr == ""
    quiet = subprocess.run(BENCH + ["--quiet"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    first = [line for line in piped.stdout.splitlines() if line.startswith(("workload", "tangram "))]
    assert first and first == [line for line in quiet.stdout.splitlines() if line.startswith(("workload", "tangram "))]
