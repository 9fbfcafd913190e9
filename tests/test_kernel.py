"""The stateful Python kernel (managers/pykernel.py): its driver against a plain process, then
run_jupyter payloads through the sandbox manager, hostile cells included."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import msgpack
import pytest

from tangram_hpc.actions import EnvState, Status, run_cells
from tangram_hpc.managers import SandboxManager
from tangram_hpc.managers import pykernel
from tangram_hpc.managers import sandboxfusion as sf
from tangram_hpc.managers.bwrap import probe_bwrap
from support import kept_state

CPU = [sorted(os.sched_getaffinity(0))[0]]
HAVE_BWRAP = probe_bwrap(shutil.which("bwrap") or "") is None


# -- the kernel and its driver, as plain processes in a directory ----------------------------------

@pytest.fixture
def envdir(tmp_path, monkeypatch):
    """An environment directory for the driver, its kernel's socket under the test's own TMPDIR;
    whatever kernel it started is killed at the end."""
    d = tmp_path / "env"
    d.mkdir()
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.chdir(d)
    yield d
    for path in (tmp_path / "tmp").glob("tangram-kernel-*/sock"):
        pid = _kernel_pid(str(path))
        if pid is not None:
            os.killpg(pid, signal.SIGKILL)


def _kernel_pid(path: str | None = None) -> int | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    try:
        sock.connect(path or pykernel.socket_path())
        hello = pykernel._recv(sock)
    except OSError:
        return None
    finally:
        sock.close()
    return hello["pid"] if hello else None


def drive(*cells: str, output_bytes: int = 1 << 20, **req) -> dict:
    """One action's worth of cells through the driver (a child process, as the sandbox runs it)."""
    body = json.dumps({"cells": list(cells), "output_bytes": output_bytes, **req})
    proc = subprocess.run([sys.executable, "-I", "-S", pykernel.__file__], input=body, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.encode()) <= output_bytes
    return json.loads(proc.stdout)


def test_a_variable_set_in_one_action_is_read_in_the_next(envdir):
    first = drive("a = 41", "def inc(x):\n    return x + 1")
    assert first["kernel"]["started"] and not first["kernel"]["restarted"]
    assert [c["status"] for c in first["cells"]] == ["ok", "ok"]
    second = drive("inc(a)")
    assert not second["kernel"]["started"] and second["kernel"]["id"] == first["kernel"]["id"]
    cell = second["cells"][0]
    assert cell["display"] == [{"text/plain": "42"}] and cell["execution_count"] == 3


def test_each_cell_runs_in_the_directory_as_it_is_now(envdir):
    # In a live session each action's files are a new mount on the environment's directory: the
    # kernel must reach them by path, not through the directory it started in.
    first = drive("import os\nos.makedirs('sub', exist_ok=True)\nos.chdir('sub')", "a = 2")
    assert [c["status"] for c in first["cells"]] == ["ok", "ok"]
    fresh = envdir.with_name("fresh")
    (fresh / "sub").mkdir(parents=True)
    (fresh / "sub" / "new.txt").write_text("new layer")
    envdir.rename(envdir.with_name("old"))
    fresh.rename(envdir)
    os.chdir(envdir)       # the driver of the next action starts there, as a sandbox's command does
    later = drive("open('new.txt').read(), a")
    assert not later["kernel"]["started"]
    assert later["cells"][0]["display"] == [{"text/plain": "('new layer', 2)"}]


def test_outputs_display_and_errors_as_jupyter_reports_them(envdir):
    out = drive("print('out'); import sys; print('err', file=sys.stderr); import os; os.write(1, b'fd\\n')",
                "1 + 1", "x = 1", "display(3, 'four')",
                "def f():\n    raise ValueError('bad')\nf()", "raise SystemExit(3)", "x")
    c = out["cells"]
    assert c[0]["stdout"] == "out\nfd\n" and c[0]["stderr"] == "err\n"
    assert c[1]["display"] == [{"text/plain": "2"}] and c[2]["display"] == []
    assert c[3]["display"] == [{"text/plain": "3"}, {"text/plain": "'four'"}]
    err = c[4]["error"][0]
    assert c[4]["status"] == "error" and err["ename"] == "ValueError" and err["evalue"] == "bad"
    assert err["traceback"][-1] == "ValueError: bad" and any("<cell-5>" in line for line in err["traceback"])
    assert not any(pykernel.__file__ in line for line in err["traceback"])  # no frames of the kernel's own
    assert c[5]["error"][0]["ename"] == "SystemExit"                    # the kernel stays, as in Jupyter
    assert c[6]["display"] == [{"text/plain": "1"}]
    odd = drive("class Odd(Exception):\n    def __str__(self):\n        raise RuntimeError\nraise Odd()", "1")["cells"]
    assert odd[0]["error"][0]["ename"] == "Odd" and odd[1]["display"] == [{"text/plain": "1"}]
    nul = drive("import os; os.write(1, b'a\\0'); os.write(2, b'\\0')")["cells"][0]
    assert nul["stdout"] == "a\0" and nul["stderr"] == "\0"        # output that looks like the cell's end
    syntax = drive("def (")["cells"][0]
    assert syntax["status"] == "error" and syntax["error"][0]["ename"] == "SyntaxError"
    assert any("^" in line for line in syntax["error"][0]["traceback"])


def test_a_cell_past_its_timeout_is_interrupted_and_the_state_kept(envdir):
    out = drive("n = 7", "import time\nwhile True:\n    time.sleep(0.01)", "n * 6", cell_timeout=0.5)
    assert [c["status"] for c in out["cells"]] == ["ok", "timeout", "ok"]
    assert out["cells"][1]["error"][0]["ename"] == "TimeoutError"
    assert out["cells"][2]["display"] == [{"text/plain": "42"}] and not out["timed_out"]


def test_the_total_timeout_stops_the_request(envdir):
    out = drive("import time\ntime.sleep(60)", "never = 1", total_timeout=0.5)
    assert out["timed_out"] and len(out["cells"]) == 1 and out["cells"][0]["status"] == "timeout"
    assert drive("'never' in dir()")["cells"][0]["display"] == [{"text/plain": "False"}]


def test_a_cell_that_ignores_its_interrupt_is_killed_with_the_kernel(envdir):
    out = drive("s = 1", "while True:\n    try:\n        __import__('time').sleep(1)\n    except BaseException:\n"
                "        pass", "s", cell_timeout=0.5)
    assert [c["status"] for c in out["cells"]] == ["ok", "died"]      # the third was not run
    assert "killed" in out["cells"][1]["error"][0]["evalue"]
    after = drive("s")
    assert after["kernel"]["restarted"] and "none answers" in after["kernel"]["note"]
    assert after["cells"][0]["error"][0]["ename"] == "NameError"


def test_os_exit_ends_the_kernel_and_the_next_request_says_it_restarted(envdir):
    out = drive("v = 1", "import os; os._exit(3)", "v")
    assert [c["status"] for c in out["cells"]] == ["ok", "died"]
    after = drive("v")
    assert after["kernel"]["started"] and after["kernel"]["restarted"]
    assert after["cells"][0]["error"][0]["ename"] == "NameError"


def test_a_forked_child_never_answers_for_the_kernel(envdir):
    out = drive("import os\npid = os.fork()\nw = 'child' if pid == 0 else 'parent'",
                "import os\nos.waitpid(pid, 0)[1], w, os.getpid() == __import__('os').getpid()")
    assert [c["status"] for c in out["cells"]] == ["ok", "ok"]
    assert out["cells"][1]["display"] == [{"text/plain": "(0, 'parent', True)"}]


def test_huge_output_is_bounded_and_the_kernel_survives(envdir):
    out = drive("keep = 5", "print('y' * 50_000_000)", "import sys\nwhile True:\n    sys.stdout.write('z' * 65536)",
                "keep", output_bytes=64 << 10, output_kill_bytes=4 << 20, cell_timeout=60)
    c = out["cells"]
    assert c[1]["truncated"] and c[1]["stdout"].startswith("yyy") and len(c[1]["stdout"]) < 64 << 10
    assert c[2]["status"] == "error" and c[2]["error"][0]["ename"] == "OutputLimit"
    assert c[3]["display"] == [{"text/plain": "5"}]
    big_repr = drive("'x' * 10_000_000", output_bytes=16 << 10)["cells"][0]
    assert big_repr["display"][0]["text/plain"].startswith("'xxx") and big_repr["truncated"]


def test_a_socket_directory_others_can_enter_is_refused(envdir):
    # Where $TMPDIR is shared (no sandbox), another uid could make the directory first.
    where = os.path.dirname(pykernel.socket_path())
    os.mkdir(where, 0o700)
    os.chmod(where, 0o777)
    body = json.dumps({"cells": ["1"]})
    proc = subprocess.run([sys.executable, "-I", "-S", pykernel.__file__], input=body, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "not a private directory" in proc.stderr and proc.stdout == ""
    assert sf.RunJupyterRequest.response(sf.response(None, {"status": "Finished", "return_code": 1, "stdout": "",
                                                            "stderr": proc.stderr, "execution_time": 0.1,
                                                            "cpu_time": None}, {}))["status"] == "SandboxError"


def test_the_kernel_exits_when_its_socket_is_removed(envdir):
    drive("a = 1")
    pid = _kernel_pid()
    os.unlink(pykernel.socket_path())
    proc_gone = _wait_gone(pid)
    assert proc_gone, f"kernel {pid} still running"


def _wait_gone(pid: int) -> bool:
    import time
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            os.waitpid(pid, os.WNOHANG)   # not our child (the driver started it): only a zombie guard
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


# -- run_jupyter payloads: validation and the response -------------------------------------------

@pytest.mark.parametrize("payload,field", [
    ({"cells": "x"}, "cells"), ({"cells": [1]}, "cells"), ({"cells": [], "kernel": "julia"}, "kernel"),
    ({"cells": [], "cell_timeout": -1}, "cell_timeout"), ({"cells": [], "total_timeout": 0}, "total_timeout"),
    ({"cells": [], "files": {"../x": ""}}, "files"), ({"cells": [], "colour": 1}, "colour"),
])
def test_bad_run_jupyter_fields_are_named(payload, field):
    with pytest.raises(sf.RunCodeError) as e:
        sf.parse_run_jupyter(payload)
    assert e.value.field == field


def test_run_cells_builds_a_run_jupyter_payload():
    spec = run_cells(["a = 1", "a"], env="e", cell_timeout=2)
    assert sf.is_run_jupyter(spec.payload) and not sf.is_run_code(spec.payload)
    assert sf.parse_run_jupyter(spec.payload).cells == ["a = 1", "a"] and spec.env == "e"
    assert spec.timeout > spec.payload["total_timeout"]


# -- through the sandbox manager (bubblewrap) --------------------------------------------------------

sandboxed = pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap missing or unusable here")


@pytest.fixture
def mgr(tmp_path):
    with SandboxManager(tmp_path / "envs", result_bytes=1 << 20) as m:
        yield m


@sandboxed
def test_cells_of_one_action_share_the_kernel_in_the_sandbox(mgr):
    r = mgr.run(run_cells(["import os\na = 41", "a + 1", "os.getcwd()", "print(open('f.txt').read())"],
                          env="k1", files={"f.txt": "ZmlsZQ=="}, fetch_files=[".run_code/kernel.json"]), CPU)
    assert r.status == Status.OK, r
    out = r.output
    assert out["status"] == "Success" and out["driver"]["status"] == "Finished" and out["driver"]["stdout"] == ""
    assert [c["display"] for c in out["cells"][1:3]] == [[{"text/plain": "42"}], [{"text/plain": "'/sandbox'"}]]
    assert out["cells"][3]["stdout"] == "file\n"
    assert out["kernel"]["started"] and not out["kernel"]["restarted"]
    assert ".run_code/kernel.json" in out["files"]


@sandboxed
def test_where_processes_are_not_kept_the_next_action_says_the_kernel_restarted(mgr):
    # Without live sessions each sandbox action ends its processes: the kernel is gone, and the
    # response must say so rather than fail on a missing variable silently.
    first = mgr.run(run_cells("a = 1", env="k2"), CPU).output
    second = mgr.run(run_cells("a", env="k2"), CPU).output
    assert first["kernel"]["started"] and not first["kernel"]["restarted"]
    assert second["kernel"]["restarted"] and second["kernel"]["id"] != first["kernel"]["id"]
    assert second["cells"][0]["error"][0]["ename"] == "NameError"


@sandboxed
def test_cells_through_the_coordinator_and_a_worker(tmp_path):
    from tangram_hpc.launch import LocalCluster
    with LocalCluster(workers=1, cores=1, run_dir=tmp_path / "run") as cl, cl.client() as c:
        with c.env("cells") as e:
            first = e.run_cells(["a = 6", "a * 7"], wait=120)
            second = e.run_cells("a", wait=120)
    assert first.status == Status.OK and first.output["cells"][1]["display"] == [{"text/plain": "42"}]
    assert second.worker == first.worker
    if kept_state() == EnvState.LIVE:     # the workers keep live sessions: the kernel lives on
        assert not second.output["kernel"]["restarted"], second.output
        assert second.output["cells"][0]["display"] == [{"text/plain": "6"}], second.output
    else:   # each action ends its processes: the kernel is gone, and says so
        assert second.output["kernel"]["restarted"] and second.output["cells"][0]["error"][0]["ename"] == "NameError"


@sandboxed
def test_hostile_cells_in_the_sandbox(mgr):
    r = mgr.run(run_cells(["import os\nif os.fork() == 0:\n    import time; time.sleep(3600)\nz = 3",
                           "z", "print('q' * 10_000_000)", "import os; os._exit(9)", "z"], env="k3"), CPU)
    assert r.status == Status.OK, r
    out = r.output
    assert [c["status"] for c in out["cells"]] == ["ok", "ok", "ok", "died"]
    # seen at the kernel's exit, though the forked child still runs: not at the request's timeout
    assert "the kernel exited" in out["cells"][3]["error"][0]["evalue"], out["cells"][3]
    assert out["cells"][1]["display"] == [{"text/plain": "3"}]
    assert out["cells"][2]["truncated"]
    assert len(msgpack.packb(out)) <= mgr.result_bytes          # the result the worker can send
    after = mgr.run(run_cells("1", env="k3"), CPU).output
    assert after["kernel"]["restarted"] and after["cells"][0]["display"] == [{"text/plain": "1"}]


@sandboxed
def test_the_total_timeout_in_the_sandbox_is_a_failed_response(mgr):
    out = mgr.run(run_cells("import time\ntime.sleep(600)", total_timeout=1), CPU)
    assert out.output["status"] == "Failed" and out.output["driver"]["status"] == "TimeLimitExceeded"


# -- in a live session: the kernel is kept, frozen, between actions --------------------------------

@pytest.fixture
def live_mgr(tmp_path):
    m = SandboxManager(tmp_path / "envs", tmp_path / "snapshots", sessions=True, result_bytes=1 << 20)
    if m.sessions is None:
        m.close()
        pytest.skip(f"no live sessions here: {m.sessionless_reason}")
    yield m
    m.close()


@sandboxed
def test_in_a_live_session_a_variable_set_in_one_action_is_read_in_the_next(live_mgr):
    first = live_mgr.run(run_cells(["import os\na = 41", "os.getpid()"], env="s1"), CPU).output
    assert first["status"] == "Success" and first["kernel"]["started"]
    second = live_mgr.run(run_cells(["a + 1", "os.getpid()", "open('later.txt', 'w').write('x')"], env="s1",
                                    fetch_files=["later.txt"]), CPU).output
    assert not second["kernel"]["started"] and second["kernel"]["id"] == first["kernel"]["id"]
    assert second["cells"][0]["display"] == [{"text/plain": "42"}]
    assert second["cells"][1]["display"] == first["cells"][1]["display"]      # the same process
    assert "later.txt" in second["files"]           # written by the kept kernel into this action's layer
    third = live_mgr.run(run_cells("open('later.txt').read()", env="s1"), CPU).output
    assert third["cells"][0]["display"] == [{"text/plain": "'x'"}]


@sandboxed
def test_in_a_live_session_a_reclaimed_kernel_says_it_restarted(tmp_path):
    m = SandboxManager(tmp_path / "envs", sessions=True, session_idle_s=0.01)
    try:
        if m.sessions is None:
            pytest.skip(f"no live sessions here: {m.sessionless_reason}")
        assert m.run(run_cells("b = 1", env="s2"), CPU).output["kernel"]["started"]
        m.gc(now=time.monotonic() + 60)                       # idle past its time: reclaimed
        assert m.sessions.get("s2") is None
        after = m.run(run_cells("b", env="s2"), CPU).output
        assert after["kernel"]["restarted"] and after["cells"][0]["error"][0]["ename"] == "NameError"
    finally:
        m.close()


@sandboxed
def test_in_a_live_session_os_exit_ends_only_the_kernel(live_mgr):
    out = live_mgr.run(run_cells(["c = 1", "import os; os._exit(3)"], env="s3"), CPU).output
    assert [cell["status"] for cell in out["cells"]] == ["ok", "died"]
    after = live_mgr.run(run_cells("c", env="s3"), CPU).output
    assert after["kernel"]["restarted"] and after["cells"][0]["error"][0]["ename"] == "NameError"


@sandboxed
def test_in_a_live_session_through_a_client_the_next_action_reads_the_variable(tmp_path, monkeypatch):
    from tangram_hpc.launch import LocalCluster
    probe = SandboxManager(tmp_path / "probe", sessions=True)
    why = probe.sessionless_reason
    probe.close()
    if why is not None:
        pytest.skip(f"no live sessions here: {why}")
    monkeypatch.setenv("TANGRAM_SANDBOX_SESSIONS", "1")
    with LocalCluster(workers=1, cores=1, run_dir=tmp_path / "run") as cl, cl.client() as c:
        with c.env("cells") as e:
            first = e.run_cells(["a = 6"], wait=120)
            second = e.run_cells("a * 7", wait=120)
    assert first.status == Status.OK and first.output["kernel"]["started"]
    assert not second.output["kernel"]["started"] and second.output["cells"][0]["display"] == [{"text/plain": "42"}]
