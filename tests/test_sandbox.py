"""Isolation and limits of sandbox actions, with real bubblewrap and real processes."""
from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

from tangram_hpc.actions import ActionSpec, Status
from tangram_hpc.managers import Limits, SandboxManager
from tangram_hpc.managers.bwrap import probe_bwrap
from support import act, py

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(probe_bwrap(shutil.which("bwrap") or "") is not None,
                       reason="bubblewrap missing or unusable here"),
]

ALL_CPUS = sorted(os.sched_getaffinity(0))


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    return d


@pytest.fixture
def mgr(run_dir):
    m = SandboxManager(run_dir / "envs", run_dir / "snapshots",
                       default_limits=Limits(timeout_s=20, nproc=128, memory_mb=None))
    yield m
    m.close()


@pytest.fixture(params=["cgroups", "rlimits"])
def limited_mgr(request, run_dir):
    """The same limits enforced with per-action cgroups (where possible) and with rlimits only."""
    use = request.param == "cgroups"
    m = SandboxManager(run_dir / "envs", use_cgroups=use,
                       default_limits=Limits(timeout_s=20, nproc=64, memory_mb=256))
    if use and m.cgroups is None:
        m.close()
        pytest.skip("this worker may not create cgroups")
    yield m
    m.close()


def test_environment_keeps_files_across_actions(mgr):
    r1 = mgr.run(act("echo state-1 > notes.txt && mkdir -p sub && echo deep > sub/f", env="traj-1"), [ALL_CPUS[0]])
    assert r1.status == Status.OK, r1
    r2 = mgr.run(act("cat notes.txt sub/f && pwd", env="traj-1"), [ALL_CPUS[0]])
    assert r2.status == Status.OK, r2
    assert r2.output["stdout"].split() == ["state-1", "deep", "/sandbox"]
    # Another environment does not see them.
    r3 = mgr.run(act("ls -A", env="traj-2"), [ALL_CPUS[0]])
    assert r3.output["stdout"] == ""
    assert mgr.environments() == frozenset({"traj-1", "traj-2"})


def test_throwaway_environment_is_removed(mgr, run_dir):
    before = set(os.listdir(run_dir / "envs"))
    r = mgr.run(act("echo x > f && ls"), [ALL_CPUS[0]])
    assert r.status == Status.OK and r.output["stdout"] == "f\n"
    assert set(os.listdir(run_dir / "envs")) == before
    assert mgr.environments() == frozenset()


@pytest.mark.parametrize("n", [1, 2])
def test_affinity_inside_equals_granted_cpus(mgr, n):
    if len(ALL_CPUS) < n:
        pytest.skip(f"needs {n} cpus")
    cpus = ALL_CPUS[-n:]
    code = """
        import os, json
        print(json.dumps({"aff": sorted(os.sched_getaffinity(0)),
                          "vars": {k: os.environ[k] for k in ("TANGRAM_NCPUS", "OMP_NUM_THREADS",
                                   "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                                   "PYTEST_XDIST_AUTO_NUM_WORKERS", "MAKEFLAGS")}}))
    """
    before = os.sched_getaffinity(0)
    r = mgr.run(act(py(code)), cpus)
    assert r.status == Status.OK, r
    import json
    got = json.loads(r.output["stdout"])
    assert got["aff"] == cpus
    assert set(got["vars"].values()) == {str(n), f"-j{n}"}
    # The calling (executor) thread got its own mask back.
    assert os.sched_getaffinity(0) == before


def test_an_action_cannot_widen_its_cores_where_cgroups_offer_a_cpuset(mgr):
    if len(ALL_CPUS) < 2:
        pytest.skip("needs 2 cpus")
    if mgr.cgroups is None or mgr.cgroups.cpuset_parent is None:
        pytest.skip("no cpuset controller this worker may use")
    r = mgr.run(act(py("""
        import os
        try:
            os.sched_setaffinity(0, range(os.cpu_count()))
        except OSError:
            pass
        print(sorted(os.sched_getaffinity(0)))
    """)), [ALL_CPUS[-1]])
    assert r.status == Status.OK, r
    assert r.output["stdout"] == f"[{ALL_CPUS[-1]}]\n" and r.output["enforced"]["cpuset"] is True, r


def test_no_network_inside(mgr):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.setblocking(False)
    port = srv.getsockname()[1]
    try:
        code = f"""
            import socket
            s = socket.socket(); s.settimeout(2)
            try:
                s.connect(("127.0.0.1", {port})); print("connected")
            except OSError as e:
                print("blocked", type(e).__name__)
        """
        r = mgr.run(act(py(code)), [ALL_CPUS[0]])
        assert r.status == Status.OK, r
        assert r.output["stdout"].startswith("blocked"), r.output
        with pytest.raises(BlockingIOError):
            srv.accept()
        # The same probe without the sandbox does connect: the test can tell the difference.
        import subprocess
        out = subprocess.run(py(code), capture_output=True, text=True, timeout=10).stdout
        assert out.startswith("connected")
    finally:
        srv.close()


def test_network_request_refused_unless_allowed(mgr):
    r = mgr.run(act("true", network=True), [ALL_CPUS[0]])
    assert r.status == Status.ERROR and "network" in r.error


def test_writes_outside_environment_fail(mgr, run_dir):
    host_marker = Path("/tmp") / f"tangram-host-{os.getpid()}"
    host_marker.write_text("host")
    try:
        code = f"""
            import os
            results = {{}}
            for p in ["/usr/evil", "/etc/evil", "/evil", "/root/evil", "{run_dir}/evil", "/sandbox/../evil"]:
                try:
                    open(p, "w").write("x"); results[p] = "written"
                except OSError as e:
                    results[p] = "denied"
            open("/tmp/private", "w").write("tmp is private and writable")
            print(sorted(set(results.values())), os.path.exists("{host_marker}"))
            open("/sandbox/ok", "w").write("fine")
        """
        r = mgr.run(act(py(code), env="w"), [ALL_CPUS[0]])
        assert r.status == Status.OK, r
        assert r.output["stdout"].strip() == "['denied'] False"
        assert not (run_dir / "evil").exists() and not Path("/evil").exists()
        assert not os.path.exists("/tmp/private") or Path("/tmp/private").read_text() != "tmp is private and writable"
        envdir = next(p for p in (run_dir / "envs").iterdir() if p.name.startswith("w-"))
        assert (envdir / "ok").read_text() == "fine"
    finally:
        host_marker.unlink()


def test_home_and_run_dir_secrets_invisible(mgr, run_dir):
    secret = run_dir / "coordinator.key"
    secret.write_text("s3cret")
    home_secret = Path.home() / f".tangram-test-secret-{os.getpid()}"
    home_secret.write_text("s3cret")
    try:
        code = f"""
            import os
            paths = ["{secret}", "{home_secret}", "{Path.home() / '.ssh'}", "{run_dir}", "{run_dir / 'envs'}"]
            print([p for p in paths if os.path.exists(p)])
            print(os.path.exists("{Path(sys.executable)}"))
        """
        r = mgr.run(act(py(code)), [ALL_CPUS[0]])
        assert r.status == Status.OK, r
        assert r.output["stdout"].split("\n")[:2] == ["[]", "True"]
    finally:
        home_secret.unlink()


def _uid_procs(uid: int, settle_s: float = 5.0) -> int:
    """Processes owned by ``uid``, waiting up to ``settle_s`` for killed ones to be reaped."""
    import time
    deadline = time.monotonic() + settle_s
    while True:
        n = _count_uid(uid)
        if n == 0 or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def _count_uid(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += 1
            except FileNotFoundError:
                pass
    return n


FORK_LOOP = """
    import os, time
    n = 0
    try:
        while n < 5000:
            if os.fork() == 0:
                time.sleep(60); os._exit(0)
            n += 1
    except OSError as e:
        print("fork refused after", n, e, flush=True)
        raise SystemExit(3)
    print("forked", n)
"""


def test_fork_bomb_is_contained(limited_mgr):
    r = limited_mgr.run(act(py(FORK_LOOP), env="bomb"), [ALL_CPUS[0]])
    assert r.status == Status.FAILED, r
    assert "fork refused after" in r.output["stdout"]
    n = int(r.output["stdout"].split()[3])
    assert n < 64
    assert "process limit" in r.error
    env = limited_mgr.envs.get("bomb")
    if env.uid is not None:  # all its sleeping children died with the action
        assert _uid_procs(env.uid) == 0
    ok = limited_mgr.run(act("echo alive", env="bomb"), [ALL_CPUS[0]])
    assert ok.status == Status.OK and ok.output["stdout"] == "alive\n"


@pytest.mark.slow
def test_shell_fork_bomb_killed_at_timeout(limited_mgr):
    r = limited_mgr.run(act("b() { b | b & }; b; sleep 60", limits={"timeout_s": 2}), [ALL_CPUS[0]])
    assert r.status == Status.TIMEOUT, r
    ok = limited_mgr.run(act("echo alive"), [ALL_CPUS[0]])
    assert ok.status == Status.OK and ok.output["stdout"] == "alive\n"


def test_memory_bomb_is_contained(limited_mgr):
    code = """
        chunks = []
        for i in range(64):               # up to 2 GiB, far over the 256 MiB limit
            chunks.append(bytearray(32 * 1024 * 1024))
        print("allocated all")
    """
    r = limited_mgr.run(act(py(code)), [ALL_CPUS[0]])
    assert r.status == Status.FAILED, r
    assert "allocated all" not in r.output["stdout"]
    assert "memory limit" in r.error
    assert r.output["enforced"]["memory"] == ("cgroup" if limited_mgr.cgroups else "rlimit_as")
    ok = limited_mgr.run(act(py("print(len(bytearray(64 * 1024 * 1024)))")), [ALL_CPUS[0]])
    assert ok.status == Status.OK and ok.output["stdout"] == f"{64 * 1024 * 1024}\n"


def test_infinite_loop_times_out_and_tree_is_killed(mgr):
    r = mgr.run(act("sleep 300 & while :; do :; done", env="loop", limits={"timeout_s": 1}),
                [ALL_CPUS[0]])
    assert r.status == Status.TIMEOUT, r
    assert "timed out after 1s" in r.error
    assert 0.9 < r.output["wall_s"] < 15
    env = mgr.envs.get("loop")
    if env.uid is not None:
        assert _uid_procs(env.uid) == 0
    ok = mgr.run(act("echo alive", env="loop"), [ALL_CPUS[0]])
    assert ok.status == Status.OK


def test_cpu_time_limit(mgr):
    r = mgr.run(act("while :; do :; done", limits={"cpu_s": 1, "timeout_s": 15}), [ALL_CPUS[0]])
    assert r.status == Status.FAILED, r
    assert "CPU time limit" in r.error


def test_output_flood_is_killed_and_truncated(mgr):
    r = mgr.run(act("yes flood", limits={"output_bytes": 10_000, "output_kill_bytes": 2_000_000}),
                [ALL_CPUS[0]])
    assert r.status == Status.FAILED, r
    assert "output flood" in r.error
    out = r.output["stdout"]
    assert r.output["truncated"] is True
    assert out.startswith("flood\nflood\n") and "output truncated" in out
    assert len(out) < 10_000 + 200
    ok = mgr.run(act("echo alive"), [ALL_CPUS[0]])
    assert ok.status == Status.OK


def test_large_output_truncated_with_marker_without_kill(mgr):
    r = mgr.run(act(py("import sys; sys.stdout.write('a' * 300000); sys.stderr.write('e' * 10)"),
                    limits={"output_bytes": 1000, "output_kill_bytes": None}), [ALL_CPUS[0]])
    assert r.status == Status.OK, r
    assert r.output["stdout"].startswith("a" * 1000)
    assert "299000 more bytes dropped" in r.output["stdout"]
    assert r.output["stderr"] == "e" * 10
    assert r.output["truncated"] is True


def test_stdin_env_and_exit_code(mgr):
    r = mgr.run(act("cat; echo \"$GREETING\"; exit 7", stdin="from stdin\n", env=None), [ALL_CPUS[0]])
    assert r.status == Status.FAILED
    spec = ActionSpec("sandbox", {"cmd": "cat; echo \"$GREETING\"", "stdin": b"in\n",
                                  "environ": {"GREETING": "hello"}})
    r = mgr.run(spec, [ALL_CPUS[0]])
    assert r.status == Status.OK and r.output["stdout"] == "in\nhello\n"
    assert r.output["returncode"] == 0
    bad = mgr.run(act("x", env=None).__class__("sandbox", {"cmd": "x", "bogus": 1}), [ALL_CPUS[0]])
    assert bad.status == Status.ERROR and "bogus" in bad.error


def test_payload_files_cannot_escape_through_symlinks(mgr, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    r = mgr.run(act(f"ln -s {outside} link", env="sym"), [ALL_CPUS[0]])
    assert r.status == Status.OK, r
    bad = mgr.run(act("true", env="sym", files={"link/pwned": "x"}), [ALL_CPUS[0]])
    assert bad.status == Status.ERROR
    assert not (outside / "pwned").exists()
    good = mgr.run(act("cat a/b.txt", env="sym", files={"a/b.txt": b"bytes\n"}), [ALL_CPUS[0]])
    assert good.status == Status.OK and good.output["stdout"] == "bytes\n"


def test_payload_values_no_command_could_take_are_the_requests_error(mgr):
    """Refused before anything runs, with what is wrong, not an internal crash or a wrong kill."""
    cpu = [ALL_CPUS[0]]
    for payload, why in [({"cmd": "echo a\0b"}, "NUL"), ({"cmd": ["echo", "a\0b"]}, "NUL"),
                         ({"cmd": "true", "files": {"dir/": "x"}}, "not directories"),
                         ({"cmd": "true", "limits": {"memory_mb": 2 ** 44}}, "at most 1099511627776"),
                         ({"cmd": "true", "limits": {"cpu_s": 2 ** 62}}, "at most 1099511627776")]:
        r = mgr.run(ActionSpec("sandbox", payload, env="vals"), cpu)
        assert r.status == Status.ERROR and r.error.startswith("bad sandbox payload") and why in r.error, (payload, r)
    # the largest value taken works as a limit
    r = mgr.run(ActionSpec("sandbox", {"cmd": "echo ran", "limits": {"cpu_s": 2 ** 40, "memory_mb": 2 ** 40}}), cpu)
    assert (r.status, r.output["stdout"]) == (Status.OK, "ran\n"), r
    assert mgr.run(ActionSpec("sandbox", {"cmd": "ls -A"}, env="vals"), cpu).output["stdout"] == ""


def test_missing_bwrap_refuses_with_fix(run_dir):
    m = SandboxManager(run_dir / "envs", bwrap="/nonexistent/bwrap")
    try:
        assert not m.available
        r = m.run(act("echo hi"), [ALL_CPUS[0]])
        assert r.status == Status.ERROR
        assert "bubblewrap" in r.error and "--unsafe-sandbox" in r.error
        with pytest.raises(RuntimeError, match="apt-get install bubblewrap"):
            m.check()
    finally:
        m.close()


def test_unsafe_mode_runs_with_limits(run_dir, capsys):
    m = SandboxManager(run_dir / "envs", bwrap="/nonexistent/bwrap", unsafe=True,
                       default_limits=Limits(timeout_s=10))
    try:
        assert m.available and m.isolation == "unsafe"
        r = m.run(act(py("import os; print(sorted(os.sched_getaffinity(0)), os.environ['TANGRAM_NCPUS'])"),
                      env="u"), [ALL_CPUS[0]])
        assert r.status == Status.OK, r
        assert r.output["stdout"] == f"[{ALL_CPUS[0]}] 1\n"
        t = m.run(act("sleep 100", limits={"timeout_s": 0.5}), [ALL_CPUS[0]])
        assert t.status == Status.TIMEOUT
    finally:
        m.close()


def test_python_limit_wrapper_when_util_linux_lacks_prlimit(run_dir, monkeypatch):
    import tangram_hpc.managers.limits as limits_mod
    real_which = shutil.which
    monkeypatch.setattr(limits_mod.shutil, "which",
                        lambda name: None if name in ("prlimit", "setpriv") else real_which(name))
    with SandboxManager(run_dir / "envs", use_cgroups=False,
                        default_limits=Limits(timeout_s=20, nproc=32)) as m:
        r = m.run(act(py(FORK_LOOP)), [ALL_CPUS[0]])
        assert r.status == Status.FAILED, r
        assert int(r.output["stdout"].split()[3]) < 32
        ok = m.run(act(py("import os; print(os.getuid() != 0)")), [ALL_CPUS[0]])
        assert ok.output["stdout"] == "True\n"


def test_concurrent_actions_from_executor_threads(mgr):
    from concurrent.futures import ThreadPoolExecutor
    code = "import os, time; time.sleep(0.3); print(sorted(os.sched_getaffinity(0)))"
    grants = [[c] for c in ALL_CPUS[:2]] * 2
    with ThreadPoolExecutor(len(grants)) as pool:
        outs = list(pool.map(lambda g: mgr.run(act(py(code), env=f"c{g[0]}"), g), grants))
    for g, r in zip(grants, outs):
        assert r.status == Status.OK, r
        assert r.output["stdout"] == f"{g}\n"


def test_actions_of_one_environment_run_one_at_a_time_unless_they_say_concurrent(mgr):
    from concurrent.futures import ThreadPoolExecutor
    from support import wait_until
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(mgr.run, act("touch in-first; sleep 1; touch first-done", env="one"), [ALL_CPUS[0]])
        wait_until(lambda: mgr.envs.has("one") and (mgr.envs.get("one").path / "in-first").exists(), 30, 0.02)
        second = pool.submit(mgr.run, act("test -e first-done && echo after || echo beside", env="one"),
                             [ALL_CPUS[-1]])
        assert first.result(60).status == Status.OK
        assert second.result(60).output["stdout"] == "after\n", second.result()
        # one that says concurrent runs beside: it ends while the first (cancelled after) still runs
        r, w = os.pipe()
        try:
            first = pool.submit(mgr.run, act("sleep 60", env="one"), [ALL_CPUS[0]], cancel_fd=r)
            wait_until(lambda: mgr.envs.get("one").turn.locked(), 30, 0.02)
            beside = mgr.run(ActionSpec("sandbox", {"cmd": "echo beside", "concurrent": True}, env="one"),
                             [ALL_CPUS[-1]])
            assert beside.status == Status.OK and beside.output["stdout"] == "beside\n" and not first.done()
            os.write(w, b"x")
            assert first.result(60).status == Status.CANCELLED
        finally:
            os.close(r)
            os.close(w)
    # a cancel reaches an action still waiting for its turn
    r, w = os.pipe()
    try:
        mgr.envs.take_turn(mgr.envs.get("one"), None, None)
        os.write(w, b"x")
        out = mgr.run(act("true", env="one"), [ALL_CPUS[0]], cancel_fd=r)
        assert out.status == Status.CANCELLED and "waiting for the action before it" in out.error
    finally:
        mgr.envs.give_turn(mgr.envs.get("one"))
        os.close(r)
        os.close(w)


def test_read_only_dirs_under_tmp_stay_visible_over_the_private_tmp(run_dir, tmp_path):
    # A checkout (and its .venv) may live under /tmp: its interpreter must still be reachable.
    shared = tmp_path / "tool"
    shared.mkdir()
    (shared / "version.txt").write_text("tool 1.2\n")
    assert str(shared).startswith("/tmp/")
    with SandboxManager(run_dir / "envs2", extra_ro_binds=(str(shared),)) as m:
        out = m.run(ActionSpec("sandbox", {"cmd": f"cat {shared}/version.txt; ls /tmp | wc -l; touch {shared}/x"}), [0])
    assert out.output["stdout"].startswith("tool 1.2\n"), out
    assert out.status == "failed" and "Read-only" in out.output["stderr"]
