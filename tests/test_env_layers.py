"""Transactional environments: each attempt writes into a layer of its own, committed into the
environment once its outcome is journaled and discarded otherwise (real bubblewrap and overlayfs)."""
from __future__ import annotations

import os
import shutil

import pytest

from tangram_hpc import protocol as P
from tangram_hpc.actions import EnvState, Status
from tangram_hpc.managers import SandboxManager
from tangram_hpc.managers.bwrap import probe_bwrap
from tangram_hpc.managers.env_host import EnvHost
from tangram_hpc.managers.env_layers import overlay_supported
from tangram_hpc.envfiles import env_dirname
from support import act, tree_of

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(probe_bwrap(shutil.which("bwrap") or "") is not None,
                       reason="bubblewrap missing or unusable here"),
    pytest.mark.skipif(overlay_supported() is not None, reason=f"no layered attempts here: {overlay_supported()}"),
]

CPU = [sorted(os.sched_getaffinity(0))[0]]


def run_in(h: EnvHost, spec, grant: list, attempt: int = 1, *, journal: bool = True):
    """What the worker does with an assignment; ``journal=False``: it dies before the record."""
    h.begin(spec.env)
    state, refused = h.prepare(spec, grant)
    if refused is not None:
        h.end(spec.env, spec.id)
        return refused, None
    seen = h.replay(spec.env, spec.id)
    if seen is not None:
        h.end(spec.env, spec.id)
        return (seen[2], seen[3], seen[4]), EnvState.REPLAYED
    o = h.mgr.run(spec, CPU)
    if journal:
        h.record(spec.env, [spec.id, attempt, o.status, o.output, o.error, 0.0, 1.0])
        h.end(spec.env, spec.id)
    return (o.status, o.output, o.error), state


def log_of(h: EnvHost, env: str) -> str:
    return (h.mgr.envs.get(env).path / "log").read_text()


def test_an_attempt_cut_off_before_its_record_leaves_nothing_and_its_retry_runs_once(hosts):
    w1, w2 = hosts("w1"), hosts("w2")
    assert run_in(w1, act("echo base > log", env="e"), [1, P.GRANT_NEW, None])[0][0] == Status.OK
    spec = act("echo once >> log", env="e")
    (st, _, _), _ = run_in(w1, spec, [1, P.GRANT_HELD, None], journal=False)   # the worker dies here
    assert st == Status.OK and log_of(w1, "e") == "base\n"      # its effects are not in the environment
    (st, _, _), state = run_in(w2, spec, [2, P.GRANT_ADOPT, str(w1.mgr.root)], attempt=2)   # the retry
    assert st == Status.OK and state == EnvState.ADOPTED
    assert log_of(w2, "e") == "base\nonce\n"
    assert not os.path.exists(w1.mgr.root / (env_dirname("e") + ".attempt"))


def test_an_attempt_journaled_but_not_merged_is_merged_by_whoever_takes_the_environment(hosts):
    w1, w2 = hosts("w1"), hosts("w2")
    run_in(w1, act("echo base > log", env="e"), [1, P.GRANT_NEW, None])
    spec = act("echo once >> log", env="e")
    (st, out, err), _ = run_in(w1, spec, [1, P.GRANT_HELD, None], journal=False)
    env = w1.mgr.envs.get("e")
    w1.mgr.envs._journal_write(env, [spec.id, 1, st, out, err, 0.0, 1.0])   # dies between record and merge
    (st, _, _), state = run_in(w2, spec, [2, P.GRANT_ADOPT, str(w1.mgr.root)], attempt=2)
    assert state == EnvState.REPLAYED and log_of(w2, "e") == "base\nonce\n"


def test_an_attempt_not_journaled_is_discarded_before_the_next_one_and_never_saved(hosts, tmp_path):
    w1, w2 = hosts("w1"), hosts("w2")
    run_in(w1, act("echo base > log", env="e"), [1, P.GRANT_NEW, None])
    spec = act("echo lost >> log", env="e")
    run_in(w1, spec, [1, P.GRANT_HELD, None], journal=False)
    w1.end("e", spec.id)                  # the worker gave up on it (killed as it left): not journaled
    assert log_of(w1, "e") == "base\n"
    w1.apply([[P.ENV_SAVE, "e", 1]])
    from support import wait_until
    [[op, _, _, path]] = wait_until(w1.take_replies, 30, 0.02, "the save")
    assert op == P.ENV_SAVED
    (_, out, _), state = run_in(w2, act("cat log", env="e"), [2, P.GRANT_RESTORE, path])
    assert state == EnvState.RESTORED and out["stdout"] == "base\n"


CHANGES = """
set -e
echo kept > kept; echo gone > gone; echo old > changed; mkdir -p d/sub e f; echo x > d/sub/x; echo y > e/y
ln -s kept link; echo h > hard1; ln hard1 hard2; echo z > f/z; chmod 700 f
"""
CHANGES2 = """
set -e
rm gone; echo new >> changed; rm -r d; mkdir d; echo fresh > d/fresh; rm -r e; echo now-a-file > e
rm link; ln -s changed link; echo n > new1; ln new1 new2; mkdir -p n/m/o; echo deep > n/m/o/p; chmod 750 f; rm f/z
mkfifo pipe; touch f/empty
"""


def test_a_committed_attempt_leaves_the_environment_as_running_in_it_directly(tmp_path):
    """Removals, directories made anew over removed ones, files that became directories and back,
    links, hard links and modes: the merged layer gives what the commands would have left.  (Not
    a write or a new link to a file that has hard links already: overlayfs copies it up alone,
    docs/sandbox.md.)"""
    trees = []
    for layered in (True, False):
        with SandboxManager(tmp_path / f"layered-{layered}", transactional=layered) as m:
            assert (m.unlayered_reason is None) == layered
            for cmd in (CHANGES, CHANGES2):
                r = m.run(act(cmd, env="e"), CPU)
                assert r.status == Status.OK, r
            trees.append(tree_of(m.envs.get("e").path))
            assert not os.path.exists(m.root / (env_dirname("e") + ".attempt"))
            m.gc()                                      # settled attempts wait for it
            assert not os.path.exists(m.root / ".warm" / ".trash")
    assert trees[0] == trees[1]
    assert trees[0]["d/fresh"][2] == b"fresh\n" and "d/sub" not in trees[0] and trees[0]["e"][0] == "file"


def test_run_code_fetches_what_its_attempt_wrote_before_the_commit(hosts):
    from tangram_hpc.actions import ActionSpec
    w1 = hosts("w1")
    run_in(w1, act("echo old > out.txt; echo keep > other.txt", env="e"), [1, P.GRANT_NEW, None])
    spec = ActionSpec("sandbox", {"language": "bash", "code": "echo new > out.txt; rm other.txt",
                                  "fetch_files": ["out.txt", "other.txt"]}, env="e")
    (st, out, _), _ = run_in(w1, spec, [1, P.GRANT_HELD, None])
    import base64
    assert st == Status.OK and base64.b64decode(out["files"]["out.txt"]) == b"new\n"
    assert "other.txt" not in out["files"]
    assert (w1.mgr.envs.get("e").path / "out.txt").read_text() == "new\n"


def test_the_merge_follows_no_link_the_sandbox_made(tmp_path):
    """The merge runs as root over trees sandboxed code wrote: a directory it replaced with a link
    out of the environment is replaced, never entered."""
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "keep").write_text("host file\n")
    with SandboxManager(tmp_path / "envs") as m:
        assert m.run(act("mkdir -p x/y && echo f > x/y/f && mkdir z", env="e"), CPU).status == Status.OK
        r = m.run(act(f"rm -r x && ln -s {outside} x && rmdir z && ln -s {outside} z", env="e"), CPU)
        assert r.status == Status.OK, r
        env = m.envs.get("e").path
        assert os.readlink(env / "x") == str(outside) and os.readlink(env / "z") == str(outside)
        assert r.output["enforced"]["isolation"] == "bwrap"
        assert m.run(act("rm x z && mkdir x && echo again > x/keep", env="e"), CPU).status == Status.OK
    assert sorted(os.listdir(outside)) == ["keep"] and (outside / "keep").read_text() == "host file\n"
