"""The worker's side of environment grants: preparing the granted copy, the journal that answers an
action run before, hand-back by snapshot, and what a dead worker's sandbox may not do (real bubblewrap)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tangram_hpc import protocol as P
from tangram_hpc.actions import ActionSpec, EnvState, Status
from tangram_hpc.managers.bwrap import probe_bwrap
from tangram_hpc.managers.env_host import EnvHost
from tangram_hpc.envfiles import env_dirname, snapshot_identity
from tangram_hpc.managers.env_snapshots import JOURNAL_KEEP
from support import act, sleeping, unique_sleep, wait_until

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(probe_bwrap(shutil.which("bwrap") or "") is not None,
                       reason="bubblewrap missing or unusable here"),
]

CPU = [sorted(os.sched_getaffinity(0))[0]]
REPO = Path(__file__).resolve().parents[1]


def run_in(h: EnvHost, spec: ActionSpec, grant: list, attempt: int = 1):
    """What the worker does with an assignment: prepare, answer from the journal or run and journal."""
    h.begin(spec.env)
    try:
        state, refused = h.prepare(spec, grant)
        if refused is not None:
            return refused, None
        seen = h.replay(spec.env, spec.id)
        if seen is not None:
            return (seen[2], seen[3], seen[4]), EnvState.REPLAYED
        o = h.mgr.run(spec, CPU)
        h.record(spec.env, [spec.id, attempt, o.status, o.output, o.error, 0.0, 1.0])
        return (o.status, o.output, o.error), state
    finally:
        h.end(spec.env, spec.id)


def test_a_grant_makes_the_local_copy_the_granted_one(hosts):
    h = hosts("w1")
    (st, out, _), state = run_in(h, act("echo 1 >> log", env="e"), [5, P.GRANT_NEW, None])
    assert st == Status.OK and state == EnvState.CREATED
    (st, out, _), state = run_in(h, act("cat log", env="e"), [5, P.GRANT_HELD, None])
    assert state == EnvState.KEPT and out["stdout"] == "1\n"
    # An older grant is fenced; a "held" grant for a copy this worker does not have is env_lost.
    (st, _, err), _ = run_in(h, act("true", env="e"), [4, P.GRANT_HELD, None])
    assert st == Status.ERROR and "fenced" in err
    (st, _, err), _ = run_in(h, act("true", env="other"), [6, P.GRANT_HELD, None])
    assert st == Status.ENV_LOST and "not on this worker" in err
    # A new grant of the same id means a new environment: the stale copy goes.
    (st, out, _), state = run_in(h, act("cat log || echo empty", env="e"), [9, P.GRANT_NEW, None])
    assert state == EnvState.CREATED and out["stdout"] == "empty\n"


def test_the_journal_answers_an_action_that_ran_and_travels_with_the_snapshot(hosts):
    w1, w2 = hosts("w1"), hosts("w2")
    spec = act("echo once >> log; echo ran", env="e")
    (st, out, _), _ = run_in(w1, spec, [1, P.GRANT_NEW, None])
    assert st == Status.OK
    w1.apply([[P.ENV_SAVE, "e", 1]])
    [[op, env, gen, path]] = wait_until(w1.take_replies, 30, 0.02, "the save")
    assert (op, env, gen) == (P.ENV_SAVED, "e", 1) and snapshot_identity(path) == ("e", 1)
    assert "e" not in w1.mgr.environments()            # handed back: no second live copy
    # The retry of the same action on w2 (its result was lost) is answered, not run again.
    (st, out, _), state = run_in(w2, spec, [2, P.GRANT_RESTORE, path], attempt=2)
    assert state == EnvState.REPLAYED and out["stdout"] == "ran\n"
    assert not os.path.exists(path)                     # consumed by the restore
    (_, out, _), state = run_in(w2, act("cat log", env="e"), [2, P.GRANT_HELD, None])
    assert out["stdout"] == "once\n" and state == EnvState.KEPT


def test_the_journal_keeps_the_last_outcomes_and_stays_small(hosts):
    h = hosts("w1")
    run_in(h, act("true", env="e"), [1, P.GRANT_NEW, None])
    n = 3 * JOURNAL_KEEP
    for i in range(n):
        h.record("e", [f"a{i}", 1, "ok", i, None, 0.0, 1.0])
    assert h.replay("e", "a0") is None
    assert all(h.replay("e", f"a{i}")[3] == i for i in range(n - JOURNAL_KEEP, n))
    journal = h.mgr.envs.root / (env_dirname("e") + ".journal")
    assert journal.stat().st_size < 2 * JOURNAL_KEEP * 40


def test_the_journal_keeps_large_outputs_within_its_byte_bound(hosts):
    """32 outcomes of 2 MiB each cost 64 MiB per environment (worker memory, disk, every snapshot)."""
    from tangram_hpc.managers.env_snapshots import JOURNAL_MAX_BYTES
    h = hosts("w1")
    run_in(h, act("true", env="e"), [1, P.GRANT_NEW, None])
    big = "x" * (1 << 20)
    for i in range(20):
        h.record("e", [f"b{i}", 1, "ok", {"stdout": big, "n": i}, None, 0.0, 1.0])
    journal = h.mgr.envs.root / (env_dirname("e") + ".journal")
    assert journal.stat().st_size <= JOURNAL_MAX_BYTES + (2 << 20)
    kept = [i for i in range(20) if h.replay("e", f"b{i}") is not None]
    assert kept == list(range(20 - len(kept), 20)) and 2 <= len(kept) <= 9, kept    # the newest, in order
    assert h.replay("e", "b19")[3]["n"] == 19
    h.record("e", ["huge", 1, "ok", "y" * (3 * JOURNAL_MAX_BYTES), None, 0.0, 1.0])
    h.record("e", ["after", 1, "ok", 1, None, 0.0, 1.0])
    assert h.replay("e", "huge") is not None and h.replay("e", "after")[3] == 1    # the newest two stay


def test_a_record_too_large_for_the_journal_keeps_its_outcome_without_its_output(hosts):
    from tangram_hpc.managers.env_snapshots import JOURNAL_RECORD_BYTES
    h = hosts("w1")
    run_in(h, act("true", env="e"), [1, P.GRANT_NEW, None])
    h.record("e", ["big", 1, "failed", {"stdout": "y" * (24 << 20)}, "exit code 1", 0.0, 1.0])
    journal = h.mgr.envs.root / (env_dirname("e") + ".journal")
    assert journal.stat().st_size < 4096
    rec = h.replay("e", "big")
    assert rec[:4] == ["big", 1, "failed", None] and rec[4].startswith("exit code 1; its output (")
    assert "too large to keep" in rec[4]
    h.record("e", ["fits", 1, "ok", {"stdout": "z" * (JOURNAL_RECORD_BYTES // 2)}, None, 0.0, 1.0])
    assert h.replay("e", "fits")[3]["stdout"] == "z" * (JOURNAL_RECORD_BYTES // 2)


def test_a_copy_being_made_when_the_worker_registers_again_counts_as_held(hosts):
    """Stopped between its ASSIGN and the copy (SIGSTOP, a stall), the worker registers again while
    the copy is still being made: it reports it, and the coordinator's renumbering sticks."""
    h = hosts("w1")
    real, go, inside = h.mgr.envs.acquire, threading.Event(), threading.Event()

    def slow_acquire(*args):
        inside.set()
        assert go.wait(10)
        return real(*args)
    h.mgr.envs.acquire = slow_acquire
    done = []
    t = threading.Thread(target=lambda: done.append(h.prepare(act("true", env="e"), [5, P.GRANT_NEW, None])))
    t.start()
    assert inside.wait(10)
    assert h.held() == [["e", 5]]                     # what REGISTER carries now
    h.apply([[P.ENV_KEEP, "e", 8]])                   # the coordinator regained it under a new number
    go.set()
    t.join(10)
    assert done == [(EnvState.CREATED, None)]
    assert h.held() == [["e", 8]] and h.generation("e") == 8
    (st, _, _), state = run_in(h, act("true", env="e"), [8, P.GRANT_HELD, None])
    assert st == Status.OK and state == EnvState.KEPT


def test_a_drop_removes_the_copy_and_a_keep_grants_it_again(hosts):
    h = hosts("w1")
    run_in(h, act("echo x > f", env="e"), [3, P.GRANT_NEW, None])
    h.apply([[P.ENV_KEEP, "e", 7]])                    # re-granted after this worker came back
    (_, out, _), state = run_in(h, act("cat f", env="e"), [7, P.GRANT_HELD, None])
    assert state == EnvState.KEPT and out["stdout"] == "x\n"
    h.apply([[P.ENV_DROP, "e", 7]])
    wait_until(lambda: "e" not in h.mgr.environments(), 10, 0.02, "the drop")
    assert h.held() == []


def test_a_save_waits_for_the_action_still_ending_in_the_environment(hosts):
    h = hosts("w1")
    run_in(h, act("true", env="e"), [1, P.GRANT_NEW, None])
    slow = threading.Thread(target=run_in, args=(h, act("sleep 1; echo late > f", env="e"), [1, P.GRANT_HELD, None]))
    slow.start()
    wait_until(lambda: h.mgr.envs.get("e").busy, 10, 0.01, "the action to take the environment")
    h.apply([[P.ENV_SAVE, "e", 1]])
    [[op, _, _, path]] = wait_until(h.take_replies, 30, 0.02, "the save")
    slow.join()
    other = hosts("w2")
    run_in(other, act("true", env="e"), [2, P.GRANT_RESTORE, path])
    (_, out, _), _ = run_in(other, act("cat f", env="e"), [2, P.GRANT_HELD, None])
    assert out["stdout"] == "late\n"


def test_a_save_waits_until_the_ended_action_is_journaled(hosts):
    """Between the command's exit and its journal record the environment holds the command's
    effects but not the record: a snapshot then would let the retry run it a second time."""
    h = hosts("w1")
    run_in(h, act("true", env="e"), [1, P.GRANT_NEW, None])
    spec = act("echo once >> log", env="e")
    h.begin("e")
    o = h.mgr.run(spec, CPU)              # exited: the sandbox no longer holds the environment
    h.apply([[P.ENV_SAVE, "e", 1]])
    time.sleep(0.5)
    assert h.take_replies() == []         # the save waits for the record
    h.record("e", [spec.id, 1, o.status, o.output, o.error, 0.0, 1.0])
    h.end("e", spec.id)
    [[op, _, _, path]] = wait_until(h.take_replies, 30, 0.02, "the save")
    assert op == P.ENV_SAVED
    other = hosts("w2")
    (status, _, _), state = run_in(other, spec, [2, P.GRANT_RESTORE, path])    # the retry
    assert status == Status.OK and state == EnvState.REPLAYED
    (_, out, _), _ = run_in(other, act("cat log", env="e"), [2, P.GRANT_HELD, None])
    assert out["stdout"] == "once\n"


_VICTIM = """
import sys, threading
sys.path.insert(0, {repo!r})
from tangram_hpc.managers import SandboxManager
from tangram_hpc.actions import ActionSpec
m = SandboxManager({root!r})
m.run(ActionSpec("sandbox", {{"cmd": "echo before >> log"}}, env="e"), [{cpu}])
print("ready", flush=True)
m.run(ActionSpec("sandbox", {{"cmd": "sleep {nap}; echo after-death >> log"}}, env="e"), [{cpu}])
"""


def test_a_sandbox_dies_with_its_worker_and_cannot_write_into_an_adopted_copy(tmp_path, hosts):
    """SIGKILL of a worker mid-action: its command must not go on writing into the environment."""
    root = tmp_path / "dead" / "envs"
    nap = unique_sleep()        # found by its argument: whether it died is a state, not a race
    victim = subprocess.Popen([sys.executable, "-c", _VICTIM.format(repo=str(REPO), root=str(root), cpu=CPU[0],
                                                                    nap=nap)],
                              stdout=subprocess.PIPE, text=True)
    assert victim.stdout.readline().strip() == "ready"
    wait_until(lambda: sleeping(nap), 120, 0.05, "the command inside its sleep")
    victim.kill()
    victim.wait()
    wait_until(lambda: not sleeping(nap), 120, 0.05, "the command dead with its worker")
    assert (root / env_dirname("e") / "log").read_text() == "before\n"
    h = hosts("w2")
    (st, out, _), state = run_in(h, act("cat log", env="e"), [3, P.GRANT_ADOPT, str(root)])
    assert state == EnvState.ADOPTED and out["stdout"] == "before\n"
    assert not (root / env_dirname("e")).exists()       # taken over: the dead worker's copy is gone
