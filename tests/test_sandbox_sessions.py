"""Live sessions: an environment's processes kept, frozen, between its actions (real bubblewrap,
cgroups and overlayfs).  Processes are found through the session's cgroup; CPU use is read from
/proc (ticks), compared before and after a wait, never timed."""
from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from tangram_hpc import protocol as P
from tangram_hpc.actions import ActionSpec, EnvState, Status
from tangram_hpc.managers import Limits, SandboxManager
from tangram_hpc.managers.bwrap import probe_bwrap
from tangram_hpc.managers.env_host import EnvHost
from support import act, py, wait_until

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(probe_bwrap(shutil.which("bwrap") or "") is not None,
                       reason="bubblewrap missing or unusable here"),
]

CPU = [sorted(os.sched_getaffinity(0))[0]]


def _manager(path, **kw) -> SandboxManager:
    m = SandboxManager(path / "envs", path / "snapshots", sessions=True,
                       default_limits=Limits(timeout_s=30, nproc=128), **kw)
    if m.sessions is None:
        m.close()
        pytest.skip(f"no live sessions here: {m.sessionless_reason}")
    return m


@pytest.fixture
def mgr(tmp_path):
    m = _manager(tmp_path)
    yield m
    m.close()


def ok(o):
    assert o.status == Status.OK, o
    return o.output


def session_of(m: SandboxManager, env: str):
    s = m.sessions.get(env)
    assert s is not None, f"environment {env!r} has no live session"
    return s


def ticks(pids) -> int:
    """utime + stime of ``pids`` (clock ticks) as /proc says now."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError):
            pass
    return total


def frozen_session(m: SandboxManager, env: str):
    s = session_of(m, env)
    assert s.wait_frozen(), "the session did not freeze"
    return s


SERVER = r"""
import os, socket, sys
if os.fork():            # the action ends; the server stays
    sys.exit(0)
os.setsid()
state = {"x": 41}
srv = socket.socket(socket.AF_UNIX)
srv.bind("/tmp/kv.sock"); srv.listen()
while True:
    c, _ = srv.accept()
    op = c.recv(100).decode()
    if op == "inc":
        state["x"] += 1
    c.sendall(str(state["x"]).encode()); c.close()
"""
ASK = "import socket, sys; c = socket.socket(socket.AF_UNIX); c.connect('/tmp/kv.sock'); " \
      "c.sendall(sys.argv[1].encode()); print(c.recv(100).decode())"


def test_a_server_started_in_one_action_answers_in_the_next_with_its_state(mgr):
    first = ok(mgr.run(act(py(SERVER) + [], env="e"), CPU))
    assert first["processes"] == "started"
    wait_until(lambda: ok(mgr.run(act(py(ASK) + ["get"], env="e"), CPU))["stdout"] == "41\n", 30, 0.05,
               "the server to answer")
    out = ok(mgr.run(act(py(ASK) + ["inc"], env="e"), CPU))
    assert out["stdout"] == "42\n" and out["processes"] == "kept"
    assert ok(mgr.run(act(py(ASK) + ["get"], env="e"), CPU))["stdout"] == "42\n"


def test_a_shell_variable_lives_in_a_kept_shell(mgr):
    # A shell reading commands from a FIFO: a variable set in one action is read in the next.
    ok(mgr.run(act("mkfifo /tmp/in; (sh < /tmp/in > /tmp/out 2>&1 &) ; exec 3>/tmp/in; "
                   "echo 'X=hello' >&3; sleep 30 >&3 & echo started", env="e"), CPU))
    ok(mgr.run(act("echo 'echo \"X is $X\"' > /tmp/in", env="e"), CPU))
    wait_until(lambda: ok(mgr.run(act("cat /tmp/out", env="e"), CPU))["stdout"] == "X is hello\n", 30, 0.05,
               "the kept shell to answer")


def test_files_of_a_session_action_land_in_the_environment(mgr):
    ok(mgr.run(act("echo one > f", env="e"), CPU))
    ok(mgr.run(act("echo two >> f; rm -f nothing", env="e"), CPU))
    assert ok(mgr.run(act("cat f", env="e"), CPU))["stdout"] == "one\ntwo\n"
    mgr.live.park_idle(mgr.envs.get("e"))
    assert (mgr.envs.get("e").path / "f").read_text() == "one\ntwo\n"


@pytest.mark.parametrize("start", [
    "(while :; do :; done) & echo started",
    "setsid sh -c '(while :; do :; done) &' & sleep 0.1; echo started",   # escaped its session and group
    "nohup sh -c 'while :; do :; done' >/dev/null 2>&1 & echo started",
])
def test_a_busy_loop_left_running_gets_no_cpu_while_frozen_and_runs_again_when_thawed(mgr, start):
    ok(mgr.run(act(start, env="e"), CPU))
    s = frozen_session(mgr, "e")
    pids = s.pids()
    assert len(pids) >= 2                                   # the exec server and the loop at least
    before = ticks(pids)
    time.sleep(1.0)                                         # a wait, not a measurement: no CPU may pass
    assert ticks(pids) - before <= 1, "a frozen session used CPU"
    # The loop is still there: thawed for the next action, it runs again.
    thawed_before = ticks(pids)
    ok(mgr.run(act("sleep 1", env="e"), CPU))
    assert ticks(pids) > thawed_before, "the loop did not run while its environment had an action"


def test_a_process_cannot_write_between_actions(mgr):
    ok(mgr.run(act("(while :; do date +%s%N >> ticks; sleep 0.01; done) & sleep 0.2", env="e"), CPU))
    frozen_session(mgr, "e")
    env = mgr.envs.get("e")
    mgr.live.park_idle(env)                                       # layer settled: ticks is in the environment
    log = env.path / "ticks"
    size = log.stat().st_size
    time.sleep(0.5)
    assert log.stat().st_size == size, "a kept process wrote while its environment had no action"
    ok(mgr.run(act("sleep 0.3", env="e"), CPU))
    assert "\n" in ok(mgr.run(act("cat ticks", env="e"), CPU))["stdout"]


def test_sessions_of_two_environments_cannot_reach_each_other(mgr):
    ok(mgr.run(act(py(SERVER), env="a"), CPU))
    wait_until(lambda: ok(mgr.run(act(py(ASK) + ["get"], env="a"), CPU))["stdout"] == "41\n", 30, 0.05,
               "the server to answer")
    ok(mgr.run(act(py("""
        import os, socket, sys
        s = socket.socket(socket.AF_UNIX); s.bind('\\0tangram-a'); s.listen()
        if os.fork(): sys.exit(0)
        os.setsid(); s.accept()
    """), env="a"), CPU))
    a_pids = session_of(mgr, "a").pids()
    b = ok(mgr.run(act(py("""
        import os, socket
        for target in ('/tmp/kv.sock', '\\0tangram-a'):
            c = socket.socket(socket.AF_UNIX)
            try:
                c.connect(target); print('reached', repr(target))
            except OSError:
                pass
        print('pids', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
    """), env="b"), CPU))
    assert "reached" not in b["stdout"], b
    seen = [int(x) for x in b["stdout"].split("pids")[1].strip(" []\n").split(",") if x.strip()]
    assert len(seen) < 8                                       # its own PID namespace: a handful of its own
    assert "kv.sock" not in ok(mgr.run(act("ls /tmp", env="b"), CPU))["stdout"]
    assert set(session_of(mgr, "b").pids()).isdisjoint(a_pids)


def test_a_kept_process_runs_as_the_environment_uid_under_the_filter(mgr):
    out = ok(mgr.run(act("id -u; grep -E '^(Seccomp|NoNewPrivs|CapEff):' /proc/self/status", env="e"), CPU))
    uid = mgr.envs.get("e").uid
    lines = out["stdout"].split("\n")
    if uid is not None:
        assert lines[0] == str(uid)
    status = dict(line.split(":\t") for line in lines[1:] if line)
    assert status["NoNewPrivs"] == "1" and int(status["CapEff"], 16) == 0
    if mgr.seccomp_program is not None:
        assert status["Seccomp"] == "2"
    # Nested user namespaces stay refused inside a session too.
    r = mgr.run(act("unshare --user --map-root-user true", env="e"), CPU)
    assert r.status == Status.FAILED


def test_a_timeout_ends_the_session_and_the_next_action_says_the_processes_were_not_kept(mgr):
    ok(mgr.run(act("sleep 1000 & echo up > up", env="e"), CPU))
    r = mgr.run(ActionSpec("sandbox", {"cmd": "sleep 60"}, env="e", timeout=0.5), CPU)
    assert r.status == Status.TIMEOUT
    out = ok(mgr.run(act("cat up", env="e"), CPU))
    assert out["stdout"] == "up\n"                             # files stay
    assert out["processes"].startswith("not kept:") and "timed out" in out["processes"]


def test_idle_sessions_are_reclaimed_and_the_next_action_says_so(tmp_path):
    m = _manager(tmp_path, session_idle_s=0.01)
    try:
        ok(m.run(act("echo x > f; sleep 1000 &", env="e"), CPU))
        pids = session_of(m, "e").pids()
        assert m.gc(now=time.monotonic() + 60) == []          # the environment stays
        assert m.sessions.get("e") is None
        assert all(not os.path.exists(f"/proc/{p}") or _zombie(p) for p in pids)
        out = ok(m.run(act("cat f", env="e"), CPU))
        assert out["stdout"] == "x\n" and "reclaimed" in out["processes"]
    finally:
        m.close()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except OSError:
        return True


# -- exactly once, with a live session ---------------------------------------------------------

@pytest.fixture
def session_hosts(tmp_path, hosts):
    return lambda name: hosts(name, _manager(tmp_path / name))


def run_in(h: EnvHost, spec, grant: list, *, journal: bool = True):
    h.begin(spec.env)
    state, refused = h.prepare(spec, grant)
    assert refused is None, refused
    seen = h.replay(spec.env, spec.id)
    if seen is not None:
        h.end(spec.env, spec.id)
        return seen[2], EnvState.REPLAYED
    o = h.mgr.run(spec, CPU)
    if journal:
        h.record(spec.env, [spec.id, 1, o.status, o.output, o.error, 0.0, 1.0])
        h.end(spec.env, spec.id)
    return o.status, state


def test_a_session_attempt_cut_off_before_its_record_leaves_nothing_and_its_retry_runs_once(session_hosts):
    if session_hosts("probe").mgr.unlayered_reason is not None:
        pytest.skip("attempts are not layered here")
    w1, w2 = session_hosts("w1"), session_hosts("w2")
    assert run_in(w1, act("echo base > log", env="e"), [1, P.GRANT_NEW, None])[0] == Status.OK
    spec = act("echo once >> log", env="e")
    assert run_in(w1, spec, [1, P.GRANT_HELD, None], journal=False)[0] == Status.OK   # the worker dies here
    st, state = run_in(w2, spec, [2, P.GRANT_ADOPT, str(w1.mgr.root)])                  # the retry
    assert st == Status.OK and state == EnvState.ADOPTED
    read = act("cat log", env="e")
    assert w2.mgr.run(read, CPU).output["stdout"] == "base\nonce\n"
    w2.end("e", read.id)    # its attempt held the turn for a journal record (the save below waited 30 s for it)
    env = w2.mgr.envs.get("e")
    w2.mgr.live.park_idle(env)       # the layer is merged once the session is between actions
    assert (env.path / "log").read_text() == "base\nonce\n"


def test_a_session_attempt_not_journaled_is_discarded_and_a_journaled_one_kept(session_hosts):
    if session_hosts("probe").mgr.unlayered_reason is not None:
        pytest.skip("attempts are not layered here")
    w = session_hosts("w1")
    run_in(w, act("echo base > log", env="e"), [1, P.GRANT_NEW, None])
    spec = act("echo lost >> log", env="e")
    run_in(w, spec, [1, P.GRANT_HELD, None], journal=False)
    w.end("e", spec.id)                       # given up on: never journaled
    run_in(w, act("echo kept >> log", env="e"), [1, P.GRANT_HELD, None])
    out = w.mgr.run(act("cat log", env="e"), CPU)
    assert out.output["stdout"] == "base\nkept\n"


def test_the_result_says_live_when_the_processes_of_earlier_actions_were_there(session_hosts):
    h = session_hosts("w1")

    def through_host(cmd: str, grant: list):
        spec = act(cmd, env="e")

        def execute():
            o = h.mgr.run(spec, CPU)
            return o.status, o.output, o.error
        outcome, _, _, state = h.run(spec, 1, grant, 0.0, execute, cancelled=lambda: False, keep=lambda o: True)
        assert outcome[0] == Status.OK, outcome
        return state
    assert through_host("sleep 1000 &", [1, P.GRANT_NEW, None]) == EnvState.CREATED
    assert through_host("true", [1, P.GRANT_HELD, None]) == EnvState.LIVE
    h.mgr.drop("e")                         # its processes end with it
    assert through_host("true", [2, P.GRANT_NEW, None]) == EnvState.CREATED


def test_through_a_client_a_server_started_in_one_action_answers_in_the_next(tmp_path, monkeypatch):
    from tangram_hpc.launch import LocalCluster
    _manager(tmp_path / "probe").close()     # skips the test where sessions are not possible
    monkeypatch.setenv("TANGRAM_SANDBOX_SESSIONS", "1")
    with LocalCluster(workers=1, cores=1, run_dir=tmp_path / "run") as cl, cl.client() as c:
        with c.env("agent") as e:
            first = e.run(py(SERVER), wait=60)
            assert first.ok and first.env_state == EnvState.CREATED, first
            asked = wait_until(lambda: (r := e.run(py(ASK) + ["inc"], wait=60)).ok and r, 30, 0.05,
                               "the server to answer")
            assert asked.output["stdout"] == "42\n" and asked.env_state == EnvState.LIVE, asked


def test_the_next_attempts_layer_is_made_ahead_and_only_a_claim_gives_it_an_action(mgr):
    mounted_by = []
    mount = mgr.sessions.mounts.mount_layer

    def recording(*a, **kw):
        mounted_by.append(threading.current_thread().name)
        return mount(*a, **kw)
    mgr.sessions.mounts.mount_layer = recording
    ok(mgr.run(act("echo 1 > n", env="e"), CPU))
    s = session_of(mgr, "e")
    wait_until(lambda: s.layer_ready, what="the next layer made ahead")
    attempt = mgr.envs.attempt_path(mgr.envs.get("e"))
    assert (attempt / "action").read_text() == ""             # owned by no action yet
    assert (mgr.envs.get("e").path / "n").read_text() == "1\n"  # the first attempt is settled
    out = ok(mgr.run(act("echo 2 >> n; cat n", env="e"), CPU))
    assert out["stdout"] == "1\n2\n" and out["processes"] == "kept"
    # the second action ran in the layer made ahead: nothing was mounted on the action's own thread
    assert mounted_by[0] != "session-ahead" and set(mounted_by[1:]) == {"session-ahead"}, mounted_by
    wait_until(lambda: s.layer_ready, what="the next layer made ahead")
    # A save parks the session: the unclaimed layer is discarded, the environment is what its actions made.
    snap = mgr.snapshot("e")
    assert not attempt.exists() and not s.layer_ready and os.path.exists(snap)
    assert (mgr.envs.get("e").path / "n").read_text() == "1\n2\n"
    assert ok(mgr.run(act("cat n", env="e"), CPU))["stdout"] == "1\n2\n"


def test_an_action_that_does_not_run_in_the_session_discards_the_layer_made_ahead(mgr):
    ok(mgr.run(act("echo a > f", env="e"), CPU))
    s = session_of(mgr, "e")
    wait_until(lambda: s.layer_ready, what="the next layer made ahead")
    r = mgr.run(ActionSpec("sandbox", {"code": "print(open('f').read(), end='')", "language": "python"},
                           env="e"), CPU)                    # run_code: a sandbox of its own
    assert r.status == Status.OK, r
    assert r.output["run_result"]["stdout"] == "a\n", r.output
    wait_until(lambda: s.dead is not None or s.layer_ready or not mgr.envs.get("e").live_layer,
               what="the environment to settle")
    assert ok(mgr.run(act("cat f", env="e"), CPU))["stdout"] == "a\n"


def test_a_layer_the_action_left_untouched_serves_the_next_attempt_and_one_it_changed_is_settled(mgr):
    mounted = []
    mount = mgr.sessions.mounts.mount_layer

    def recording(*a, **kw):
        mounted.append(a)
        return mount(*a, **kw)
    mgr.sessions.mounts.mount_layer = recording
    ok(mgr.run(act("echo 1 > n", env="e"), CPU))
    s = session_of(mgr, "e")
    wait_until(lambda: s.layer_ready, what="the next layer made ahead")
    env = mgr.envs.get("e")
    attempt = mgr.envs.attempt_path(env)
    before = len(mounted), s.depth
    assert ok(mgr.run(act("cat n", env="e"), CPU))["stdout"] == "1\n"        # writes nothing
    wait_until(lambda: s.layer_ready, what="the layer kept for the next attempt")
    assert (len(mounted), s.depth) == before                    # the same layer: nothing mounted
    assert not (attempt / "action").exists()                    # owned by no action: discarded if settled so
    out = ok(mgr.run(act("echo 2 >> n; cat n", env="e"), CPU))
    assert out["stdout"] == "1\n2\n" and out["processes"] == "kept"
    # A chmod of the environment's root changes only the layer's root: it is merged, not kept.
    ok(mgr.run(act("chmod 700 .", env="e"), CPU))
    wait_until(lambda: s.layer_ready, what="the next layer made ahead")
    assert len(mounted) > before[0] and (env.path.stat().st_mode & 0o777) == 0o700
    assert (env.path / "n").read_text() == "1\n2\n"


def test_with_after_reply_the_session_is_frozen_once_the_reply_is_sent(mgr):
    mgr.live.after_reply = True        # as in a worker, which calls replied() once its DONE is sent
    ok(mgr.run(act("(while :; do :; done) & echo started", env="e"), CPU))
    s = session_of(mgr, "e")
    assert not s.frozen                # not before the reply: the action's round trip does not wait for it
    mgr.live.replied()
    wait_until(lambda: s.layer_ready, what="the session parked after the reply")
    pids = s.pids()
    before = ticks(pids)
    time.sleep(1.0)                                         # a wait, not a measurement: no CPU may pass
    assert ticks(pids) - before <= 1, "a frozen session used CPU"
    assert ok(mgr.run(act("echo ok", env="e"), CPU))["processes"] == "kept"


@pytest.mark.skipif(os.geteuid() != 0, reason="an environment's processes are found by its own uid, given as root")
def test_deleted_files_a_kept_process_holds_are_measured_while_frozen_and_count_from_the_next_start(mgr):
    # A kept process holds an 8 MiB file it deleted: measured once its session is frozen, that figure
    # is the next action's start, so an action that adds nothing passes a 4 MiB quota and one that grows
    # the environment past it is stopped.
    hold = ("head -c 8388608 /dev/zero > big; exec 3<big; sleep 1000 >/dev/null 2>&1 & "
            "exec 3<&-; rm big; echo held")
    assert ok(mgr.run(act(hold, env="e", limits={"disk_mb": 64}), CPU))["stdout"] == "held\n"
    s = session_of(mgr, "e")
    wait_until(lambda: s.layer_ready, what="the session parked")
    assert s.held_deleted is not None and s.held_deleted >= 8 << 20
    assert ok(mgr.run(act("true", env="e", limits={"disk_mb": 4}), CPU))["processes"] == "kept"
    r = mgr.run(act("head -c 2097152 /dev/zero > more", env="e", limits={"disk_mb": 4}), CPU)
    assert r.status == Status.FAILED and "deleted but still open" in r.error, r
