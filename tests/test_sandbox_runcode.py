"""SandboxFusion-compatible run_code requests through the sandbox manager."""
from __future__ import annotations

import base64
import os
import shutil

import pytest

from tangram_hpc.actions import ActionSpec, Status
from tangram_hpc.managers import SandboxManager
from tangram_hpc.managers.bwrap import probe_bwrap

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(probe_bwrap(shutil.which("bwrap") or "") is not None,
                       reason="bubblewrap missing or unusable here"),
]

CPU = [sorted(os.sched_getaffinity(0))[0]]
RUN_RESULT_KEYS = {"status", "execution_time", "return_code", "stdout", "stderr"}
RESPONSE_KEYS = {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}


@pytest.fixture
def mgr(tmp_path):
    with SandboxManager(tmp_path / "envs") as m:
        yield m


def run_code(mgr, env=None, **req):
    out = mgr.run(ActionSpec("sandbox", req, env=env), CPU)
    return out


def test_python_success_with_stdin_files_and_fetch(mgr):
    code = ("import sys\n"
            "data = open('data/in.txt').read()\n"
            "open('out.txt', 'w').write(data.upper())\n"
            "print(sys.stdin.read().strip(), data.strip())\n")
    r = run_code(mgr, language="python", code=code, stdin="from-stdin\n",
                 files={"data/in.txt": base64.b64encode(b"payload\n").decode()},
                 fetch_files=["out.txt", "missing.txt"], run_timeout=10)
    assert r.status == Status.OK, r
    resp = r.output
    assert set(resp) == RESPONSE_KEYS and set(resp["run_result"]) == RUN_RESULT_KEYS
    assert resp["status"] == "Success" and resp["message"] == ""
    assert resp["compile_result"] is None
    assert resp["run_result"]["status"] == "Finished" and resp["run_result"]["return_code"] == 0
    assert resp["run_result"]["stdout"] == "from-stdin payload\n"
    assert base64.b64decode(resp["files"]["out.txt"]) == b"PAYLOAD\n"
    assert "missing.txt" not in resp["files"]


def test_python_failure_and_time_limit(mgr):
    r = run_code(mgr, language="python", code="raise SystemExit(5)")
    assert r.status == Status.OK
    assert r.output["status"] == "Failed" and r.output["run_result"]["return_code"] == 5
    r = run_code(mgr, language="python", code="import time; time.sleep(30)", run_timeout=0.5)
    assert r.output["status"] == "Failed"
    assert r.output["run_result"]["status"] == "TimeLimitExceeded"


def test_bash_runs_in_stateful_environment(mgr):
    r1 = run_code(mgr, env="rc", language="bash", code="echo kept > state.txt")
    assert r1.output["status"] == "Success", r1
    r2 = run_code(mgr, env="rc", language="bash", code="cat state.txt")
    assert r2.output["run_result"]["stdout"] == "kept\n"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_cpp_compiles_then_runs(mgr):
    ok = run_code(mgr, language="cpp", code="#include <cstdio>\nint main(){std::puts(\"cpp\");}\n",
                  compile_timeout=60)
    assert ok.output["status"] == "Success", ok.output
    assert ok.output["compile_result"]["status"] == "Finished"
    assert ok.output["run_result"]["stdout"] == "cpp\n"
    bad = run_code(mgr, language="cpp", code="int main( {", compile_timeout=60)
    assert bad.output["status"] == "Failed"
    assert bad.output["compile_result"]["return_code"] != 0 and bad.output["run_result"] is None


def test_unknown_language_is_an_error(mgr):
    r = run_code(mgr, language="cobol", code="x")
    assert r.status == Status.ERROR and "unsupported language" in r.error
