"""The tangram-hpc command line, run as a user would run it."""
import json
import os
import subprocess
import sys

import pytest

from tangram_hpc.cli import COMMANDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, timeout=120, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "tangram_hpc.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def test_top_level_help_lists_every_command():
    r = cli("--help")
    assert r.returncode == 0
    for name in COMMANDS:
        assert name in r.stdout


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_useful_help(name):
    r = cli(name, "--help")
    assert r.returncode == 0, r.stderr
    assert "--" in r.stdout and len(r.stdout.splitlines()) > 3


def test_python_dash_m_runs_the_command_line():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "tangram_hpc", "submit", "--help"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: tangram-hpc submit")


@pytest.mark.parametrize("option", [["--steps", "0"], ["--scale", "-1"], ["--cluster-scale", "nan"]])
def test_bench_refuses_scales_and_steps_below_one_in_a_line(option):
    r = cli("bench", "--workload", "tir", *option)
    assert r.returncode == 2 and "must be positive" in r.stderr and "Traceback" not in r.stderr


def test_no_command_prints_help_and_fails():
    r = cli()
    assert r.returncode == 2 and "COMMAND" in r.stdout


def test_submit_and_status_against_a_running_coordinator(cluster):
    conn = str(cluster.connection_file)
    r = cli("submit", "-c", conn, "echo from-cli")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "from-cli\n" and "[ok]" in r.stderr
    r = cli("submit", "-c", conn, "--kind", "function", "--fn", "math:hypot", "--args", "[3, 4]", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["output"] == 5.0
    r = cli("submit", "-c", conn, "exit 4")
    assert r.returncode == 4 and "[failed]" in r.stderr
    r = cli("status", "-c", conn)
    assert r.returncode == 0 and r.stdout.count("ok") >= 2 and "completed" in r.stdout
    st = json.loads(cli("status", "-c", conn, "--json").stdout)
    assert len(st["workers"]) == 2


def test_output_cut_short_by_its_reader_is_no_traceback():
    """``tangram-hpc bench ... | head -1``: the reader leaves after one line; the command stops quietly."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "tangram_hpc.cli", "bench", "--workload", "judge", "--scale", "0.1",
                          "--steps", "1", "--no-search", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env)
    p.stdout.close()                    # as head does after its line; here before the first
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_client_commands_without_a_coordinator_say_so_in_one_line(tmp_path):
    for command in (["submit", "true"], ["status"], ["pool", "pause"]):
        r = cli(command[0], "-c", str(tmp_path / "nope.json"), *command[1:])
        assert r.returncode == 1 and "no connection file" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_status_from_a_stale_connection_file_says_so_in_one_line(tmp_path, monkeypatch):
    """A file left by a coordinator that is gone: nobody answers at its address.  Run in this
    process with the status wait cut from 10 s to 0.5 s (the command's own wait is all this costs)."""
    from tangram_hpc import cli as tangram_cli
    from tangram_hpc.client import Client
    from tangram_hpc.connection import ConnectionInfo
    stale = tmp_path / "stale.json"
    ConnectionInfo("tcp://127.0.0.1:9", "tcp://127.0.0.1:9", "gone", str(tmp_path)).write(stale)
    ask = Client.status
    monkeypatch.setattr(Client, "status", lambda self, timeout=10.0, **kw: ask(self, min(timeout, 0.5), **kw))
    with pytest.raises(SystemExit) as exit_:
        tangram_cli.main(["status", "-c", str(stale)])
    said = exit_.value.code     # a message: Python prints it alone on stderr and exits 1, no traceback
    assert isinstance(said, str) and "no status from the coordinator" in said and "stale" in said, said


@pytest.mark.slow
def test_demo_runs_a_step_and_prints_act_statistics(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, TANGRAM_RUNS_ROOT=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "tangram_hpc.cli", "demo", "--trajectories", "4", "--turns", "2",
                        "--think-ms", "20"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "RL step: 4 trajectories" in r.stdout
    for row in ("sandbox:edit", "sandbox:test", "function:reward", "mean ACT"):
        assert row in r.stdout
    # In a pipe (a batch job's log) no progress frames: no carriage returns, one line per message.
    assert "\r" not in r.stderr and "reward model ready" in r.stderr


def test_one_variable_names_the_connection_file(cluster, monkeypatch, tmp_path):
    from tangram_hpc import Client, function
    monkeypatch.delenv("TANGRAM_CONNECTION_FILE", raising=False)
    monkeypatch.setenv("TANGRAM_CONNECTION", str(cluster.connection_file))   # an old spelling: not read
    with pytest.raises(ValueError, match=r"\$TANGRAM_CONNECTION_FILE"):
        Client()
    monkeypatch.setenv("TANGRAM_CONNECTION_FILE", str(cluster.connection_file))
    with Client() as c:
        assert c.submit(function("math:sqrt", 9)).result(10).output == 3.0
    r = cli("submit", "--kind", "function", "--fn", "math:sqrt", "--args", "[16]")   # the CLI reads it too
    assert r.returncode == 0 and r.stdout == "4.0\n", r.stderr


@pytest.mark.parametrize("argv,verbose", [(["status"], False), (["status", "-v"], True), (["-v", "status"], True),
                                          (["report", "--since", "-1h", "--verbose"], True)])
def test_global_options_work_after_the_command_too(argv, verbose):
    from tangram_hpc.cli import _attach_relative_times, build_parser
    argv = _attach_relative_times(argv)
    assert build_parser(argv).parse_args(argv).verbose is verbose


def test_status_shows_launches_and_allocations_and_pool_control(cluster):
    conn = str(cluster.connection_file)
    r = cli("status", "-c", conn, "--allocations", "-v")
    assert r.returncode == 0, r.stderr
    assert "launches ok" in r.stdout and "allocations: 2 (2 running)" in r.stdout
    r = cli("pool", "pause", "-c", conn)
    assert r.returncode == 0 and r.stdout.startswith("launches paused; now: launches paused"), r.stdout + r.stderr
    st = json.loads(cli("status", "-c", conn, "--json").stdout)
    assert st["launch"]["state"] == "paused" and st["launch"]["retry_at"] is None
    r = cli("pool", "resume", "-c", conn)
    assert r.returncode == 0 and "now: launches ok" in r.stdout
    r = cli("pool", "reboot", "-c", conn)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_submit_wait_timeout_is_a_message_not_a_traceback(cluster):
    r = cli("submit", "-c", str(cluster.connection_file), "--wait", "0.5", "sleep 30")
    assert r.returncode == 124 and "no result within 0.5 s (--wait)" in r.stderr and "cancelled" in r.stderr
    assert "Traceback" not in r.stderr and "The coordinator has 2 workers" in r.stderr


def test_submit_refuses_bad_arguments_with_a_message_and_says_how_a_command_ended(cluster):
    conn = str(cluster.connection_file)
    for args, says in [(["--kind", "function", "--fn", "math:sqrt", "--args", "notjson"], "not JSON"),
                       (["--kind", "function", "--fn", "math:sqrt", "--args", "{}"], "must be a JSON list"),
                       (["--cores", "4-2", "true"], "MIN <= MAX"),
                       (["--mem-mb", str(2 ** 44), "true"], "at most 1099511627776 MiB")]:
        r = cli("submit", "-c", conn, *args)
        assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    r = cli("submit", "-c", conn, "--timeout", "0.5", "sleep 30")
    assert r.returncode == 137 and "[timeout]" in r.stderr, (r.returncode, r.stderr)     # SIGKILL: 128 + 9


def test_text_status_shows_environments_and_faults(cluster):
    from tangram_hpc import sandbox
    conn = str(cluster.connection_file)
    with cluster.client() as c:
        for e in ("st-a", "st-b"):
            assert c.submit(sandbox("echo hi > f", env=e)).result(60).ok
        c.close_env("st-b")
        assert c.status()["envs_closed"] >= 1   # same socket: answered after the CLOSE_ENV
    r = cli("status", "-c", conn)
    assert r.returncode == 0, r.stderr
    st = json.loads(cli("status", "-c", conn, "--json").stdout)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("environments: "))
    for state, n in st["environments"].items():
        assert f"{n} {state}" in line
    assert st["environments"].get("live", 0) >= 1 and "closed" in line
