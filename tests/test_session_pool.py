"""Pre-started live sessions (managers/session_pool.py): a new environment's first action claims a
session started ahead for no environment, which sees only that environment's files, runs as its uid
under its limits, and is replaced; unclaimed ones are reclaimed (real bubblewrap, cgroups, overlayfs)."""
from __future__ import annotations

import os
import shutil

import pytest

from tangram_hpc.actions import Status
from tangram_hpc.managers import Limits, SandboxManager
from tangram_hpc.managers import session_pool
from tangram_hpc.managers.bwrap import probe_bwrap
from support import act

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(probe_bwrap(shutil.which("bwrap") or "") is not None,
                       reason="bubblewrap missing or unusable here"),
]

CPU = [sorted(os.sched_getaffinity(0))[0]]
WAIT_S = 60.0
NPROC = "awk '/^Max processes/ {print $3}' /proc/self/limits"     # the soft RLIMIT_NPROC


def _manager(path, prestart: int = 2) -> SandboxManager:
    m = SandboxManager(path / "envs", path / "snapshots", sessions=True, session_prestart=prestart,
                       default_limits=Limits(timeout_s=30, nproc=128))
    if m.sessions is None or m.live.pool is None and prestart:
        why = m.sessionless_reason or m.unlayered_reason
        m.close()
        pytest.skip(f"no pre-started sessions here: {why}")
    return m


@pytest.fixture
def mgr(tmp_path):
    m = _manager(tmp_path)
    assert m.live.pool.wait_full(WAIT_S), "the pool did not fill"
    yield m
    m.close()


def ok(o):
    assert o.status == Status.OK, o
    return o.output


def gone(proc) -> bool:
    return proc.poll() is not None


def test_a_new_environment_claims_a_pre_started_session_which_is_replaced(mgr):
    pool = mgr.live.pool
    ready = {s.proc.pid: s for s in pool.unclaimed()}
    assert len(ready) == 2 and mgr.session_status()["prestarted"] == 2
    out = ok(mgr.run(act("echo hi > f; cat f", env="a"), CPU))
    assert out["stdout"] == "hi\n" and out["processes"] == "started"
    session = mgr.sessions.get("a")
    assert session.proc.pid in ready and pool.claimed == 1
    assert session.uid == mgr.envs.get("a").uid
    # the claimed session is the environment's from now on: its next action runs beside what it left
    assert ok(mgr.run(act("cat f", env="a"), CPU))["processes"] == "kept"
    assert pool.wait_full(WAIT_S), "the claimed session was not replaced"
    assert session not in pool.unclaimed() and len(pool.unclaimed()) == 2
    mgr.live.park_idle(mgr.envs.get("a"))
    assert (mgr.envs.get("a").path / "f").read_text() == "hi\n"


def test_a_pre_started_session_sees_only_the_environment_that_claimed_it(mgr):
    # Before a claim its /sandbox is an empty directory of its own.
    for s in mgr.live.pool.unclaimed():
        assert s.mount_point is not None and os.listdir(s.mount_point) == []
    ok(mgr.run(act("echo a > a-secret", env="a"), CPU))
    b = ok(mgr.run(act('echo "[$(ls -A /sandbox)]"; cat /sandbox/a-secret 2>&1 || true; echo b > b-file',
                       env="b"), CPU))
    assert mgr.live.pool.claimed == 2
    assert b["stdout"].startswith("[]\n") and "No such file" in b["stdout"], b
    assert "b-file" not in ok(mgr.run(act("ls -A", env="a"), CPU))["stdout"]
    assert mgr.sessions.get("a").proc.pid != mgr.sessions.get("b").proc.pid
    assert set(mgr.sessions.get("a").pids()).isdisjoint(mgr.sessions.get("b").pids())


def test_a_claimed_session_runs_as_its_environment_uid_under_the_actions_limits(mgr):
    pool = mgr.live.pool
    out = ok(mgr.run(act(f"id -u; {NPROC}; grep -E '^(Seccomp|NoNewPrivs|CapEff):' /proc/self/status",
                         env="e", limits={"memory_mb": 300}), CPU))
    assert pool.claimed == 1 and out["processes"] == "started"
    lines = out["stdout"].split("\n")
    uid = mgr.envs.get("e").uid
    if uid is not None:
        assert lines[0] == str(uid)
        assert os.stat(mgr.envs.get("e").path).st_uid == uid
    assert lines[1] == "128"
    status = dict(line.split(":\t") for line in lines[2:] if line)
    assert status["NoNewPrivs"] == "1" and int(status["CapEff"], 16) == 0
    if mgr.seccomp_program is not None:
        assert status["Seccomp"] == "2"
    scope = mgr.sessions.get("e").scope
    if scope is not None and scope.memory_dir is not None:
        name = "memory.max" if scope.version == 2 else "memory.limit_in_bytes"
        assert int((scope.memory_dir / name).read_text()) == 300 << 20
    if scope is not None and scope.cpuset_dir is not None:
        assert (scope.cpuset_dir / "cpuset.cpus").read_text().strip() == str(CPU[0])
    assert out["enforced"]["cpus"] == CPU


def test_an_action_whose_session_limits_differ_starts_a_session_of_its_own(mgr):
    out = ok(mgr.run(act(NPROC, env="e", limits={"nproc": 64}), CPU))
    assert out["stdout"] == "64\n" and out["processes"] == "started"
    assert mgr.live.pool.claimed == 0
    assert mgr.sessions.get("e").proc.pid not in {s.proc.pid for s in mgr.live.pool.unclaimed()}


def test_unclaimed_sessions_are_reclaimed_when_no_one_will_claim_them_and_under_memory_pressure(mgr, monkeypatch):
    pool = mgr.live.pool
    # An environment made without a session (a concurrent action) has a pre-started session's uid;
    # once it is dropped, no one can claim that session: the next reclaim ends it.
    ok(mgr.run(act("true", env="c", concurrent=True), CPU))
    uid = mgr.envs.get("c").uid
    if uid is not None:
        offered = next(s for s in pool.unclaimed() if s.uid == uid)
        mgr.drop("c")
        mgr.gc()
        assert offered not in pool.unclaimed() and gone(offered.proc)
    assert pool.wait_full(WAIT_S)
    # Short of memory: every unclaimed one goes, and none is started until memory is back.
    procs = [s.proc for s in pool.unclaimed()]
    monkeypatch.setattr(session_pool, "_available_mb", lambda: 0.0)
    mgr.gc()
    assert pool.unclaimed() == [] and all(gone(p) for p in procs)
    with pool._cond:
        assert pool._wait_s() == session_pool._RETRY_S
    assert not [p for p in (mgr.envs.root / ".live").iterdir() if p.name.startswith(".pre-")]
    monkeypatch.undo()
    assert pool.wait_full(WAIT_S)


def test_a_session_offered_but_not_claimed_is_reclaimed_after_the_idle_time_and_the_pool_kept(mgr):
    pool = mgr.live.pool
    ok(mgr.run(act("true", env="c", concurrent=True), CPU))   # an environment made without a session
    uid = mgr.envs.get("c").uid
    if uid is None:
        pytest.skip("environments have no uid of their own here (not root)")
    offered = next(s for s in pool.unclaimed() if s.uid == uid)
    assert pool.wait_full(WAIT_S)
    spare = [s for s in pool.unclaimed() if s is not offered]
    mgr.gc(now=offered.last_used + mgr.sessions.idle_s + 1)
    assert offered not in pool.unclaimed() and gone(offered.proc)
    assert all(s in pool.unclaimed() for s in spare)          # the pool itself is not reclaimed for idling
    assert mgr.envs.has("c")


def test_closing_the_manager_ends_the_unclaimed_sessions(tmp_path):
    m = _manager(tmp_path)
    assert m.live.pool.wait_full(WAIT_S)
    procs = [s.proc for s in m.live.pool.unclaimed()]
    m.close()
    assert procs and all(gone(p) for p in procs)


def test_none_are_pre_started_with_the_setting_at_zero(tmp_path):
    m = _manager(tmp_path, prestart=0)
    try:
        assert m.live.pool is None
        assert ok(m.run(act("true", env="e"), CPU))["processes"] == "started"
    finally:
        m.close()
