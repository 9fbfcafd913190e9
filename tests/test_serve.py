"""``tangram-hpc serve`` driven by the real ``sandbox-fusion`` client (sync and async), as verl drives it."""
from __future__ import annotations

import asyncio
import base64
import importlib.util
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
import requests
import sandbox_fusion as sf

from tangram_hpc.actions import ActionSpec, Status
from tangram_hpc.launch import LocalCluster
from tangram_hpc.managers.bwrap import probe_bwrap

from runcode_programs import LANGUAGE_PROGRAMS as PROGRAMS, missing_tool
from serve_support import running_serve

pytestmark = [
    pytest.mark.sandbox, pytest.mark.slow,
    pytest.mark.skipif(probe_bwrap(shutil.which("bwrap") or "") is not None,
                       reason="bubblewrap missing or unusable here"),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(workers=2, cores=2, run_dir=tmp_path_factory.mktemp("serve-run")) as cl:
        yield cl


@pytest.fixture(scope="module")
def url(cluster):
    with running_serve(cluster.connection_file) as (_, base):
        yield base


def stats(url: str) -> dict:
    return requests.get(f"{url}/stats", timeout=10).json()


def test_ping_and_health(url, cluster):
    assert requests.get(f"{url}/v1/ping", timeout=10).json() == "pong"
    health = requests.get(f"{url}/health", timeout=10).json()
    assert health["ok"] and health["workers"] == 2 and health["coordinator"] == cluster.info.coordinator_id


def test_sync_client_success_failure_timeout_files(url):
    code = ("import sys\n"
            "data = open('in/data.txt').read()\n"
            "open('out.txt', 'w').write(data[::-1])\n"
            "print(sys.stdin.read().upper(), end='')\n")
    resp = sf.run_code(sf.RunCodeRequest(code=code, language="python", stdin="abc",
                                         files={"in/data.txt": base64.b64encode(b"xyz").decode()},
                                         fetch_files=["out.txt"]), endpoint=url, max_attempts=1)
    assert isinstance(resp, sf.RunCodeResponse) and resp.status == sf.RunStatus.Success
    assert resp.run_result.stdout == "ABC" and resp.run_result.return_code == 0
    assert base64.b64decode(resp.files["out.txt"]) == b"zyx"
    assert resp.executor_pod_name.startswith("w-")  # the worker that ran it

    failed = sf.run_code(sf.RunCodeRequest(code="import sys; sys.exit(3)", language="python"),
                         endpoint=url, max_attempts=1)
    assert failed.status == sf.RunStatus.Failed and failed.run_result.return_code == 3
    slow = sf.run_code(sf.RunCodeRequest(code="import time; time.sleep(20)", language="python",
                                         run_timeout=0.5), endpoint=url, max_attempts=1)
    assert slow.status == sf.RunStatus.Failed
    assert slow.run_result.status == sf.CommandRunStatus.TimeLimitExceeded
    assert sf.summary_run_code_result(slow, sf.SummaryMapping(RunTimeout="tle")) == "tle"


def test_languages_of_the_verl_recipes(url):
    missing = [missing_tool(lang) for lang in PROGRAMS if missing_tool(lang)]
    if missing:
        pytest.skip(f"not installed in /usr: {missing} (scripts/setup-env.sh as root adds them)")
    reqs = [sf.RunCodeRequest(code=code, language=lang, stdin=str(i + 10), compile_timeout=120)
            for i, (lang, code) in enumerate(PROGRAMS.items())]
    results = sf.run_concurrent(sf.run_code, kwargs=[{"request": r, "endpoint": url, "max_attempts": 1}
                                                     for r in reqs], concurrency=len(reqs))
    for (lang, _), i, resp in zip(PROGRAMS.items(), range(len(reqs)), results):
        assert resp.status == sf.RunStatus.Success, (lang, resp)
        assert resp.run_result.stdout.strip() == str((i + 10) * 2), (lang, resp)
        compiled = lang in ("cpp", "java", "go", "rust")
        assert (resp.compile_result is not None) == compiled, lang
    bad = sf.run_code(sf.RunCodeRequest(code="int main( {", language="cpp"), endpoint=url, max_attempts=1)
    assert bad.status == sf.RunStatus.Failed and bad.run_result is None
    assert bad.compile_result.return_code != 0 and "error" in bad.compile_result.stderr


def test_async_client_256_concurrent_requests_all_correct(url):
    """The Done-when of the HTTP service: >= 200 requests in flight, every answer checked."""
    n = 256
    before = stats(url)["run_code_outcomes"].get("Success", 0)

    async def one(i: int):
        code = f"import sys\nx = int(sys.stdin.read())\nprint(x * x + {i})"
        return await sf.run_code_async(sf.RunCodeRequest(code=code, language="python", stdin=str(i)),
                                       endpoint=url, max_attempts=1)

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(n)))

    t0 = time.monotonic()
    results = asyncio.run(all_of_them())
    wall = time.monotonic() - t0
    for i, resp in enumerate(results):
        assert resp.status == sf.RunStatus.Success, (i, resp)
        assert resp.run_result.stdout == f"{i * i + i}\n", (i, resp.run_result)
    st = stats(url)
    assert st["run_code_outcomes"]["Success"] - before == n
    assert st["in_flight"] == 0
    # They really were in flight together (each takes tens of ms in its sandbox).
    assert st["peak_in_flight"] >= 100, st
    print(f"{n} concurrent requests in {wall:.1f}s, peak in flight {st['peak_in_flight']}")


def test_sync_client_many_threads(url):
    reqs = [{"request": sf.RunCodeRequest(code=f"print('n{i}')", language="python"), "endpoint": url,
             "max_attempts": 1} for i in range(48)]
    results = sf.run_concurrent(sf.run_code, kwargs=reqs, concurrency=24)
    assert [r.run_result.stdout for r in results] == [f"n{i}\n" for i in range(48)]


@pytest.mark.parametrize("field,value,message", [
    ("compile_timeout", "abc", "must be a number of seconds"),
    ("run_timeout", 1e300, "must be a number of seconds in (0, 86400]"),
    ("files", ["a.txt"], "must be a map from file path to base64 content"),
    ("fetch_files", 5, "must be a list of strings"),
    ("memory_limit_MB", "big", "must be a whole number"),
    ("language", "cobol", "unsupported language 'cobol'"),
    ("language", "typescript", "unsupported language 'typescript'"),  # SandboxFusion has it; not here
    ("code", None, "must be a string"),
])
def test_bad_fields_are_422_naming_the_field(url, field, value, message):
    body = {"language": "python", "code": "print(1)", field: value}
    r = requests.post(f"{url}/run_code", json=body, timeout=10)
    assert r.status_code == 422, r.text
    (detail,) = r.json()["detail"]
    assert detail["loc"] == ["body", field] and message in detail["msg"], detail


def test_real_client_sees_the_422_for_a_language_only_sandboxfusion_has(url):
    # The client's own model accepts 'typescript' (SandboxFusion runs it); this service does not.
    with pytest.raises(Exception, match=r"code 422: .*language.*unsupported language 'typescript'"):
        sf.run_code(sf.RunCodeRequest(code="console.log(1)", language="typescript"), endpoint=url,
                    max_attempts=1)


def test_missing_code_malformed_json_and_non_object(url):
    r = requests.post(f"{url}/run_code", json={"language": "python"}, timeout=10)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "code"]
    assert r.json()["detail"][0]["type"] == "missing"
    r = requests.post(f"{url}/run_code", data=b"{not json", timeout=10,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"
    r = requests.post(f"{url}/run_code", json=[1, 2], timeout=10)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body"]
    r = requests.post(f"{url}/run_code", data=b"\xff\xfe", timeout=10)
    assert r.status_code == 422
    for path in ("/run_code", "/reward/judge"):        # nested past the parser's recursion limit
        r = requests.post(f"{url}{path}", data=b"[" * 5000 + b"]" * 5000, timeout=10)
        assert r.status_code == 422 and "nested too deeply" in r.json()["detail"][0]["msg"], (path, r.text)
    assert requests.get(f"{url}/v1/ping", timeout=10).ok  # and the service is still up


def test_a_body_over_the_limit_is_a_json_413_and_counted_so(cluster):
    with running_serve(cluster.connection_file, "--max-body-mb", "1") as (_, base):
        r = requests.post(f"{base}/run_code", data=b"x" * (2 << 20), timeout=30)
        assert r.status_code == 413 and "--max-body-mb" in r.json()["detail"], r.text
        counted = {(q["route"], q["status"]): q["count"] for q in stats(base)["requests"]}
        assert counted == {("/run_code", 413): 1}, counted


def test_a_caller_that_hangs_up_cancels_its_action(url, cluster):
    async def hang_up():
        async with aiohttp.ClientSession() as s:
            try:
                await s.post(f"{url}/run_code", json={"language": "bash", "code": "sleep 30", "run_timeout": 60},
                             timeout=aiohttp.ClientTimeout(total=2))
            except asyncio.TimeoutError:
                pass        # the connection closes: the handler is cancelled, and so is its action
    with cluster.client() as c:
        asyncio.run(hang_up())
        deadline = time.time() + 8       # well before the command would end by itself
        while c.status()["running"] and time.time() < deadline:
            time.sleep(0.1)
        assert c.status()["running"] == 0 and time.time() < deadline


def test_run_jupyter_with_the_real_client(url):
    # SandboxFusion's own example request: the cells share one kernel.
    cells = ['a = 123', 'a', 'print(a)', 'import sys; sys.stderr.write("stderr message")',
             'raise RuntimeError("error message")', 'open("out.txt", "w").write(open("in.txt").read() * 2)']
    resp = sf.run_jupyter(sf.RunJupyterRequest(cells=cells, files={"in.txt": base64.b64encode(b"ab").decode()},
                                               fetch_files=["out.txt"]), endpoint=url, max_attempts=1)
    assert resp.status == sf.RunStatus.Success and resp.driver.status == sf.CommandRunStatus.Finished
    c = resp.cells
    assert len(c) == 6 and c[1].display == [{"text/plain": "123"}] and c[2].stdout == "123\n"
    assert c[3].stderr == "stderr message" and c[3].display == [{"text/plain": "14"}]
    assert c[4].error[0]["ename"] == "RuntimeError" and c[4].error[0]["evalue"] == "error message"
    assert c[4].error[0]["traceback"][-1] == "RuntimeError: error message"
    assert base64.b64decode(resp.files["out.txt"]) == b"abab"
    assert resp.executor_pod_name and resp.executor_pod_name.startswith("w-")
    # The total timeout: the driver's TimeLimitExceeded makes the response Failed, as in SandboxFusion.
    slow = sf.run_jupyter(sf.RunJupyterRequest(cells=["import time; time.sleep(60)", "1"], total_timeout=1),
                          endpoint=url, max_attempts=1)
    assert slow.status == sf.RunStatus.Failed and slow.driver.status == sf.CommandRunStatus.TimeLimitExceeded
    assert [cell.error[0]["ename"] for cell in slow.cells] == ["TimeoutError"]


def test_run_jupyter_in_a_named_environment_says_whether_the_kernel_was_kept(url):
    ext = {"env": f"kernel-{os.getpid()}"}
    first = requests.post(f"{url}/run_jupyter", timeout=60, json={"cells": ["k = 5"], "tangram": ext}).json()
    assert first["status"] == "Success" and first["kernel"]["started"] and not first["kernel"]["restarted"]
    second = requests.post(f"{url}/run_jupyter", timeout=60, json={"cells": ["k"], "tangram": ext}).json()
    assert second["executor_pod_name"] == first["executor_pod_name"]
    # Each action ends its processes until environments keep a live session: the kernel says so.
    assert second["kernel"]["restarted"] and second["cells"][0]["error"][0]["ename"] == "NameError"
    for body, where in [({"cells": "k"}, ["body", "cells"]), ({"cells": [], "kernel": "R"}, ["body", "kernel"]),
                        ({"cells": [], "total_timeout": -1}, ["body", "total_timeout"]), ({}, ["body", "cells"])]:
        r = requests.post(f"{url}/run_jupyter", json=body, timeout=10)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == where, r.text


def test_unknown_fields_are_ignored_as_sandboxfusion_does(url):
    r = requests.post(f"{url}/run_code", json={"language": "python", "code": "print(5)", "colour": "red"},
                      timeout=30)
    assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "5\n"


def test_tangram_extension_places_the_action_in_a_named_environment(url):
    ext = {"env": f"traj-{os.getpid()}", "cores": [1, 2], "priority": 3, "trajectory": "t1", "step": 7}
    first = requests.post(f"{url}/run_code", timeout=30, json={
        "language": "bash", "code": "echo kept > state.txt; echo $TANGRAM_NCPUS", "tangram": ext}).json()
    assert first["status"] == "Success", first
    assert first["run_result"]["stdout"].strip() in ("1", "2")
    second = requests.post(f"{url}/run_code", timeout=30, json={
        "language": "bash", "code": "cat state.txt", "tangram": ext}).json()
    assert second["run_result"]["stdout"] == "kept\n"
    assert second["executor_pod_name"] == first["executor_pod_name"]  # the environment's home
    throwaway = requests.post(f"{url}/run_code", timeout=30,
                              json={"language": "bash", "code": "cat state.txt"}).json()
    assert throwaway["status"] == "Failed"  # a request without env gets a fresh environment
    for bad, where in [({"env": ""}, "env"), ({"cores": [2, 1]}, "cores"), ({"cores": "many"}, "cores"),
                       ({"cores": 0}, "cores"),
                       ({"priority": 1.5}, "priority"), ({"colour": 1}, "colour")]:
        r = requests.post(f"{url}/run_code", timeout=10,
                          json={"language": "bash", "code": "true", "tangram": bad})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "tangram", where], r.text


def test_malformed_run_code_through_the_client_is_a_clear_error(cluster):
    with cluster.client() as c:
        for field, value in [("compile_timeout", "abc"), ("files", ["x"]), ("fetch_files", 5),
                             ("run_timeout", 1e300)]:
            res = c.submit(ActionSpec("sandbox", {"language": "python", "code": "print(1)", field: value})).result(60)
            assert res.status == Status.ERROR, res
            assert res.error.startswith(f"bad sandbox payload: {field}: "), res.error
            assert "crashed" not in res.error


async def _raw_burst(url: str, n: int, code: str) -> list[tuple[int, dict, dict]]:
    async with aiohttp.ClientSession() as s:
        async def one(i):
            async with s.post(f"{url}/run_code", json={"language": "python", "code": code.format(i=i)}) as r:
                return r.status, await r.json(), dict(r.headers)
        return await asyncio.gather(*(one(i) for i in range(n)))


def test_back_pressure_429_with_retry_after_and_nothing_lost(cluster):
    with running_serve(cluster.connection_file, "--max-inflight", "4", "--retry-after", "2") as (_, url):
        replies = asyncio.run(_raw_burst(url, 40, "import time; time.sleep(0.3); print({i})"))
        ok = [(i, body) for i, (code, body, _) in enumerate(replies) if code == 200]
        busy = [(code, body, h) for code, body, h in replies if code != 200]
        assert ok and busy, [r[0] for r in replies]
        assert all(body["run_result"]["stdout"] == f"{i}\n" for i, body in ok)
        assert all(code == 429 and h["Retry-After"] == "2" and "max-inflight" in body["detail"]
                   for code, body, h in busy)
        st = stats(url)
        assert st["peak_in_flight"] <= 4 and st["run_code_outcomes"]["Success"] == len(ok)
        # The real client retries refused requests; with backoff every one gets through.
        reqs = [{"request": sf.RunCodeRequest(code=f"import time; time.sleep(0.2); print({i})",
                                              language="python"), "endpoint": url, "max_attempts": 10}
                for i in range(12)]
        results = sf.run_concurrent(sf.run_code, kwargs=reqs, concurrency=12)
        assert [r.run_result.stdout for r in results] == [f"{i}\n" for i in range(12)]


def test_coordinator_refusal_is_503_with_retry_after(tmp_path):
    with LocalCluster(workers=1, cores=1, run_dir=tmp_path / "run",
                      extra_args=["--max-pending-per-client", "3"]) as cl, \
            running_serve(cl.connection_file) as (_, url):
        replies = asyncio.run(_raw_burst(url, 12, "import time; time.sleep(0.3); print({i})"))
        codes = sorted(code for code, _, _ in replies)
        assert 200 in codes and 503 in codes, codes
        for i, (code, body, headers) in enumerate(replies):
            if code == 200:
                assert body["run_result"]["stdout"] == f"{i}\n"
            else:
                assert code == 503 and headers["Retry-After"] == "1"
                assert "too many unfinished actions" in body["detail"]


def test_sigterm_lets_requests_in_flight_finish(cluster):
    with running_serve(cluster.connection_file) as (proc, url):
        async def burst_then_stop():
            task = asyncio.ensure_future(_raw_burst(url, 6, "import time; time.sleep(1.5); print({i})"))
            deadline = time.monotonic() + 20
            while stats(url)["in_flight"] < 6:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            return await task

        replies = asyncio.run(burst_then_stop())
        assert [(code, body["run_result"]["stdout"]) for code, body, _ in replies] == \
            [(200, f"{i}\n") for i in range(6)]
        assert proc.wait(timeout=30) == 0
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{url}/v1/ping", timeout=5)


SOLUTION = "```python\nn = int(input())\nprint(n * (n + 1) // 2)\n```"
WRONG = "```python\nn = int(input())\nprint(n * n)\n```"
TESTS = {"inputs": ["1\n", "3\n", "10\n"], "outputs": ["1\n", "6\n", "55\n"]}


@pytest.mark.verl
@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="needs verl (WITH_MODEL=1 scripts/setup-env.sh)")
def test_verl_sandbox_fusion_reward_utility_scores_through_serve(url):
    """verl's own code path for ``reward.sandbox_fusion.url``: default_compute_score -> SandboxFusion /run_code."""
    from verl.utils.reward_score import default_compute_score

    sem = threading.Semaphore(64)  # verl passes a multiprocessing Manager semaphore of max_concurrent

    def score(completion, tests=TESTS):
        return default_compute_score("codecontests", completion, tests, sandbox_fusion_url=f"{url}/run_code",
                                     concurrent_semaphore=sem, memory_limit_mb=1024)

    good = score(SOLUTION)
    assert good == 1.0 or (isinstance(good, dict) and good["score"] == 1.0), good
    bad = score(WRONG)
    assert (bad["score"] if isinstance(bad, dict) else bad) < 1.0, bad
    # The function-call mode of verl's wrapper (fn_name): arguments as JSON lines on stdin.
    fn_tests = {"fn_name": "add", "inputs": ["1\n2", "5\n7"], "outputs": ["3", "12"]}
    fn = score("```python\ndef add(a, b):\n    return a + b\n```", fn_tests)
    assert (fn["score"] if isinstance(fn, dict) else fn) == 1.0, fn
    # verl's reward workers score a step's samples from many threads at once.
    completions = [SOLUTION if i % 3 else WRONG for i in range(30)]
    with ThreadPoolExecutor(16) as pool:
        scores = list(pool.map(score, completions))
    plain = [s["score"] if isinstance(s, dict) else s for s in scores]
    assert plain == [1.0 if i % 3 else plain[0] for i in range(30)] and plain[0] < 1.0


def test_listening_beyond_loopback_needs_allow_remote(cluster):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "tangram_hpc.cli", "serve", "-c", str(cluster.connection_file),
                        "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--allow-remote" in r.stderr and "not a loopback address" in r.stderr
    r = subprocess.run([sys.executable, "-m", "tangram_hpc.cli", "serve"], capture_output=True, text=True,
                       timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("TANGRAM_CONN")})
    assert r.returncode == 2 and "--connection-file" in r.stderr
