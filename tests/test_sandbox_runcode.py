"""SandboxFusion-compatible run_code requests through the sandbox manager."""
from __future__ import annotations

import base64
import os
import shutil

import pytest

from tangram_hpc.actions import ActionSpec, Status
from tangram_hpc.managers import SandboxManager
from tangram_hpc.managers.bwrap import probe_bwrap

from runcode_programs import LANGUAGE_PROGRAMS, missing_tool

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(probe_bwrap(shutil.which("bwrap") or "") is not None,
                       reason="bubblewrap missing or unusable here"),
]

CPU = [sorted(os.sched_getaffinity(0))[0]]
RUN_RESULT_KEYS = {"status", "execution_time", "cpu_time", "return_code", "stdout", "stderr"}
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
    assert r.status == Status.ERROR and "language: unsupported language 'cobol'" in r.error


# Each malformed field comes back as a clear error naming it (issue 10, item 4), never a crash.
MALFORMED = [
    ({"compile_timeout": "abc"}, "compile_timeout: must be a number of seconds"),
    ({"run_timeout": 1e300}, "run_timeout: must be a number of seconds in (0, 86400]"),
    ({"run_timeout": float("nan")}, "run_timeout: must be a number"),
    ({"run_timeout": -1}, "run_timeout: must be a number"),
    ({"run_timeout": True}, "run_timeout: must be a number"),
    ({"files": ["a.txt"]}, "files: must be a map from file path to base64 content, got list"),
    ({"files": {"a.txt": "%%%"}}, "files.a.txt: is not base64"),
    ({"files": {"a.txt": 5}}, "files.a.txt: must be base64 text, got int"),
    ({"fetch_files": 5}, "fetch_files: must be a list of strings, got int"),
    ({"fetch_files": ["ok", 3]}, "fetch_files: must be a list of strings"),
    ({"memory_limit_MB": "lots"}, "memory_limit_MB: must be a whole number"),
    ({"memory_limit_MB": 1.5}, "memory_limit_MB: must be a whole number"),
    ({"stdin": 7}, "stdin: must be a string or null, got int"),
    ({"args": "x"}, "args: must be a list of strings, got str"),
    ({"code": None}, "code: must be a string, got null"),
    ({"language": 3}, "language: unsupported language 3"),
    ({"colour": "red"}, "colour: unknown run_code field"),
]


@pytest.mark.parametrize("bad,message", MALFORMED, ids=[m.split(":")[0] + "-" + str(i) for i, (_, m) in
                                                        enumerate(MALFORMED)])
def test_malformed_fields_are_named(mgr, bad, message):
    req = {"language": "python", "code": "print(1)"} | bad
    r = mgr.run(ActionSpec("sandbox", req), CPU)
    assert r.status == Status.ERROR, r
    assert r.error.startswith("bad sandbox payload: ") and message in r.error, r.error
    assert "crashed" not in r.error and "ValueError" not in r.error


def test_valid_edge_values_are_accepted(mgr):
    r = run_code(mgr, language="python", code="print(2)", run_timeout=3, compile_timeout=1.5,
                 memory_limit_MB=-1, files={"skipped.txt": None}, fetch_files=None, stdin=None)
    assert r.status == Status.OK and r.output["status"] == "Success", r
    assert r.output["run_result"]["stdout"] == "2\n"


def test_cpu_time_is_the_cpu_seconds_of_the_step(mgr):
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    plain = mgr.run(ActionSpec("sandbox", {"cmd": ["python3", "-c", burn]}), CPU)
    assert plain.output["cpu_time"] >= 0.25
    r = run_code(mgr, language="python", code=burn)
    assert r.output["status"] == "Success", r.output
    cpu = r.output["run_result"]["cpu_time"]
    assert isinstance(cpu, float) and 0.25 <= cpu <= r.output["run_result"]["execution_time"] + 0.1


@pytest.mark.slow
@pytest.mark.parametrize("language", sorted(LANGUAGE_PROGRAMS))
def test_languages_of_the_verl_recipes_run_in_the_sandbox(mgr, language):
    if missing_tool(language):
        pytest.skip(f"{missing_tool(language)} is not installed in /usr (scripts/setup-env.sh as root adds it)")
    r = run_code(mgr, language=language, code=LANGUAGE_PROGRAMS[language], stdin="21\n",
                 compile_timeout=120, run_timeout=30)
    assert r.status == Status.OK, r
    assert r.output["status"] == "Success", r.output
    assert r.output["run_result"]["stdout"].strip() == "42"


def test_fetched_files_are_bounded_by_their_sizes_before_any_is_read(tmp_path):
    """Sparse files hold no disk blocks but read as their size: twelve of 1 MiB make a result of
    12 MiB (16 base64-encoded) that no worker can send; one bigger than the whole result neither."""
    code = ("import os\n"
            "for i in range(12):\n"
            "    with open(f'sparse{i}', 'wb') as f: f.truncate(1 << 20)\n"
            "with open('huge', 'wb') as f: f.truncate(1 << 30)\n"
            "open('small', 'w').write('hi')\n")
    with SandboxManager(tmp_path / "envs", result_bytes=8 << 20) as mgr:
        made = run_code(mgr, env="e", language="python", code=code)
        assert made.status == Status.OK and made.output["status"] == "Success", made
        many = run_code(mgr, env="e", language="bash", code="true", fetch_files=[f"sparse{i}" for i in range(12)])
        assert many.status == Status.FAILED and many.output["status"] == "SandboxError", many
        assert "12 files hold 12582912 bytes together" in many.error and many.output["files"] == {}
        one = run_code(mgr, env="e", language="bash", code="true", fetch_files=["small", "huge"])
        assert one.status == Status.FAILED and "'huge' holds 1073741824 bytes" in one.error, one
        fits = run_code(mgr, env="e", language="bash", code="true",
                        fetch_files=["small", "small"] + [f"sparse{i}" for i in range(4)])
        assert fits.status == Status.OK and len(fits.output["files"]) == 5, fits
        assert base64.b64decode(fits.output["files"]["small"]) == b"hi"
        assert base64.b64decode(fits.output["files"]["sparse3"]) == bytes(1 << 20)
