"""``tangram-hpc serve`` on a shared node: a token by default, bounded waits for slow or idle
connections, malformed fields refused with 422, 404 for unknown services, honest ``cpu_time``,
and metric labels no client can multiply."""
from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import sys
from urllib.parse import urlsplit

import pytest
import requests
import sandbox_fusion as sf

from tangram_hpc.actions import ActionSpec, Demand
from tangram_hpc.config import CoordinatorSettings
from tangram_hpc.coordinator import ActionLedger
from tangram_hpc.coordinator.metrics import CoordinatorMetrics, mem_label
from tangram_hpc.launch import LocalCluster
from tangram_hpc.managers.bwrap import probe_bwrap
from tangram_hpc.policy.fifo import FifoPolicy
from tangram_hpc.resources import WorkerInfo
from tangram_hpc.serve.app import authorized

from serve_support import running_serve

_NEEDS_SANDBOX = (pytest.mark.sandbox, pytest.mark.slow,
                  pytest.mark.skipif(probe_bwrap(shutil.which("bwrap") or "") is not None,
                                     reason="bubblewrap missing or unusable here"))


def sandboxed(test):
    """The marks of a test that runs serve in front of a local cluster."""
    for mark in _NEEDS_SANDBOX:
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(workers=1, cores=2, run_dir=tmp_path_factory.mktemp("serve-hardening")) as cl:
        yield cl


@pytest.fixture(scope="module")
def url(cluster):
    with running_serve(cluster.connection_file, "--header-timeout", "1", "--body-timeout", "1") as (_, base):
        yield base


def _bare(url: str) -> str:
    """The URL without its token."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port}"


def _token(url: str) -> str:
    return urlsplit(url).password


# -- the token ---------------------------------------------------------------------------------

def test_the_authorization_header_is_checked_exactly():
    token = "s3cret-token-of-32-characters-xx"
    assert authorized(f"Bearer {token}", token)
    assert authorized(f"bearer   {token} ", token)
    assert authorized("Basic " + base64.b64encode(f"tangram:{token}".encode()).decode(), token)
    assert authorized("Basic " + base64.b64encode(f":{token}".encode()).decode(), token)
    for bad in (None, "", token, f"Bearer {token}x", f"Bearer {token[:-1]}", "Bearer", f"Token {token}",
                "Basic " + base64.b64encode(token.encode()).decode(), "Basic !!!", "Basic " + "gA==",
                f"Bearer {token}\u00e9", f"Bearer {token}\udcff", f"Bearer \udcff{token[1:]}"):
        assert not authorized(bad, token), bad


@sandboxed
def test_every_route_but_ping_needs_the_token(url):
    bare = _bare(url)
    assert requests.get(f"{bare}/v1/ping", timeout=10).json() == "pong"
    body = {"language": "python", "code": "print(1)"}
    for method, path in [("post", "/run_code"), ("post", "/reward/judge"), ("get", "/health"), ("get", "/stats"),
                         ("get", "/metrics"), ("post", "/run_jupyter")]:
        for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token"}):
            r = requests.request(method, f"{bare}{path}", json=body, headers=headers, timeout=10)
            assert r.status_code == 401, (path, r.status_code, r.text)
            assert "token" in r.json()["detail"] and r.headers["WWW-Authenticate"].startswith("Bearer")
    r = requests.post(f"{bare}/run_code", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {_token(url)}"})
    assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "1\n"
    # The sandbox-fusion SDK sends no headers of its own: the token travels as the URL's password.
    resp = sf.run_code(sf.RunCodeRequest(code="print(6 * 7)", language="python"), endpoint=url, max_attempts=1)
    assert resp.status == sf.RunStatus.Success and resp.run_result.stdout == "42\n"
    with pytest.raises(Exception, match="401"):
        sf.run_code(sf.RunCodeRequest(code="print(1)", language="python"), endpoint=bare, max_attempts=1)
    s = _connect(url)      # header bytes that are not UTF-8: refused like any wrong token
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n")
        assert _read_until_closed(s).startswith(b"HTTP/1.1 401")
    finally:
        s.close()


@sandboxed
def test_the_token_file_is_made_private_and_kept(cluster, tmp_path):
    token_file = cluster.connection_file.parent / "serve.token"
    with running_serve(cluster.connection_file) as (_, first):
        pass
    assert token_file.stat().st_mode & 0o777 == 0o600
    with running_serve(cluster.connection_file) as (_, again):
        assert _token(again) == _token(first) == token_file.read_text().strip()
    given = tmp_path / "tok"
    given.write_text("x" * 40 + "\n")
    with running_serve(cluster.connection_file, "--token-file", str(given)) as (_, url):
        assert _token(url) == "x" * 40
        assert requests.get(f"{url}/health", timeout=10).ok


@sandboxed
def test_no_auth_only_on_loopback(cluster, tmp_path):
    with running_serve(cluster.connection_file, "--no-auth") as (_, url):
        assert _token(url) is None
        r = requests.post(f"{url}/run_code", json={"language": "python", "code": "print(2)"}, timeout=30)
        assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "2\n"
    r = subprocess.run([sys.executable, "-m", "tangram_hpc.cli", "serve", "-c", str(cluster.connection_file),
                        "--host", "0.0.0.0", "--allow-remote", "--no-auth", "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--no-auth is for a loopback address only" in r.stderr
    weak = tmp_path / "weak"
    weak.write_text("short\n")
    r = subprocess.run([sys.executable, "-m", "tangram_hpc.cli", "serve", "-c", str(cluster.connection_file),
                        "--token-file", str(weak), "--port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "at least 16 printable characters" in r.stderr


# -- slow and idle connections -------------------------------------------------------------------

def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=60)


def _read_until_closed(s: socket.socket) -> bytes:
    data = b""
    while True:
        chunk = s.recv(65536)    # the socket's 60 s timeout is the deadline
        if not chunk:
            return data
        data += chunk


@sandboxed
def test_half_sent_headers_and_idle_connections_are_closed(url):
    idle = [_connect(url) for _ in range(20)]
    half = [_connect(url) for _ in range(20)]
    for s in half:
        s.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
    try:
        # they hold nothing: a full request is answered while they wait
        r = requests.post(f"{url}/run_code", json={"language": "python", "code": "print(3)"}, timeout=30)
        assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "3\n"
        for s in idle + half:
            assert _read_until_closed(s) == b""   # closed by serve (--header-timeout 1), unanswered
    finally:
        for s in idle + half:
            s.close()


@sandboxed
def test_a_body_that_stalls_is_408_and_the_connection_closed(url):
    s = _connect(url)
    try:
        auth = requests.Request("POST", url).prepare().headers["Authorization"]
        s.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: " + auth.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"language\": ")
        reply = _read_until_closed(s)
    finally:
        s.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"--body-timeout" in reply


# -- malformed fields: 422 naming the field ---------------------------------------------------------

@sandboxed
@pytest.mark.parametrize("field,value,loc,message", [
    ("stdin", "a\ud800b", ["stdin"], "must be valid Unicode text"),
    ("code", "print('\udfff')", ["code"], "must be valid Unicode text"),
    ("files", {"../escape.txt": "eA=="}, ["files"], "must stay inside the environment"),
    ("files", {"/etc/escape.txt": "eA=="}, ["files"], "must be a relative path"),
    ("files", {"a/../../b": "eA=="}, ["files"], "must stay inside the environment"),
    ("fetch_files", ["../../etc/passwd"], ["fetch_files"], "must stay inside the environment"),
    ("args", ["\ud800"], ["args"], "must be valid Unicode text"),
    ("template", "no-such-template", ["template"], "unknown template 'no-such-template'"),
    ("tangram", {"env": "e\ud800"}, ["tangram", "env"], "must be valid Unicode text"),
])
def test_malformed_fields_are_422_naming_the_field(url, field, value, loc, message):
    body = json.dumps({"language": "python", "code": "print(1)", field: value})  # \ud800 escapes kept as such
    r = requests.post(f"{url}/run_code", data=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 422, r.text
    (detail,) = r.json()["detail"]
    assert detail["loc"] == ["body", *loc] and message in detail["msg"], detail


@sandboxed
def test_a_named_environment_with_an_unknown_template_is_422(url):
    r = requests.post(f"{url}/run_code", timeout=30, json={
        "language": "python", "code": "print(1)", "template": "nope", "tangram": {"env": "tmpl-env"}})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "template"], r.text
    ok = requests.post(f"{url}/run_code", timeout=30, json={
        "language": "python", "code": "print(1)", "tangram": {"env": "tmpl-env"}})
    assert ok.status_code == 200 and ok.json()["status"] == "Success", ok.text


@sandboxed
def test_a_language_whose_toolchain_is_missing_is_422_saying_how_to_install_it(url):
    if shutil.which("julia", path="/usr/local/bin:/usr/bin:/bin"):
        pytest.skip("julia is installed here")
    r = requests.post(f"{url}/run_code", json={"language": "julia", "code": "println(1)"}, timeout=30)
    assert r.status_code == 422, r.text
    (detail,) = r.json()["detail"]
    assert detail["loc"] == ["body", "language"]
    assert "needs 'julia'" in detail["msg"] and "setup-env.sh --languages" in detail["msg"]


@sandboxed
def test_an_unknown_reward_service_is_404_and_leaves_nothing_behind(url):
    for _ in range(3):
        r = requests.post(f"{url}/reward/no-such-service", json={"query": ["a"]}, timeout=60)
        assert r.status_code == 404, r.text
        assert "no-such-service" in r.json()["detail"]


# -- cpu_time ------------------------------------------------------------------------------------------

@sandboxed
def test_cpu_time_of_a_step_killed_at_its_timeout_is_measured_or_null(url):
    r = requests.post(f"{url}/run_code", timeout=60, json={
        "language": "python", "code": "while True: pass", "run_timeout": 1.5})
    run = r.json()["run_result"]
    assert run["status"] == "TimeLimitExceeded", r.text
    # the loop burned about a second and a half of CPU; bubblewrap's own few ms are not that
    assert run["cpu_time"] is None or run["cpu_time"] >= 0.5, run


# -- metric labels ---------------------------------------------------------------------------------

def test_memory_labels_are_powers_of_two():
    assert [mem_label(m) for m in (0, -1, 1, 2, 3, 1000, 1024, 1025, 10**9)] == \
        [0, 0, 1, 2, 4, 1024, 1024, 2048, 1 << 30]


def test_client_chosen_memory_demands_make_few_queue_series():
    ledger = ActionLedger(CoordinatorSettings(), FifoPolicy())
    ledger.add_worker(WorkerInfo(id="w1", cores=1), b"w1", 0.0)
    # 300 waiting actions, each with its own memory demand, that no worker can run yet
    specs = [ActionSpec(kind="sandbox", payload={"cmd": "true"}, demand=Demand(4, 4, 1000 + i)) for i in range(300)]
    ledger.submit(b"c", [s.to_wire() for s in specs], 1.0)
    ledger.dispatch(1.0)
    fams = {f.name: f for f in CoordinatorMetrics().families(ledger, None, 5.0, coordinator="c", uptime_s=5)}
    pending = fams["tangram_queue_pending_actions"].samples
    assert sorted(pending) == [(("sandbox", "", "4", "1024", "0"), 25), (("sandbox", "", "4", "2048", "0"), 275)]
    assert fams["tangram_queue_oldest_wait_seconds"].value("sandbox", "", "4", "2048", "0") == pytest.approx(4.0)
