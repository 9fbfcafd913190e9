"""Moves of environments made from a template carry what changed; the state after the move is the state before."""
from __future__ import annotations

import os
import shutil
import tarfile

import pytest

from tangram_hpc.actions import Status
from tangram_hpc.managers import SandboxManager, TreeTemplate
from tangram_hpc.managers.bwrap import probe_bwrap
from tangram_hpc.managers.environments import EnvStore
from tangram_hpc.managers.fs_inside import EnvError
from support import act, tree_of

CPU = [sorted(os.sched_getaffinity(0))[0]]


@pytest.fixture
def repo(tmp_path):
    """A small repository checkout: packages, a symlink, a read-only directory, a tree to delete."""
    src = tmp_path / "repo"
    (src / "pkg" / "sub").mkdir(parents=True)
    for i in range(40):
        (src / "pkg" / f"m{i}.py").write_text(f"VALUE = {i:03d}\n" * 20)
    (src / "pkg" / "sub" / "data.txt").write_text("data\n")
    (src / "docs").mkdir()
    (src / "docs" / "a.md").write_text("# a\n")
    (src / "locked").mkdir()
    (src / "locked" / "keep.txt").write_text("keep\n")
    os.chmod(src / "locked", 0o555)
    os.symlink("pkg/m1.py", src / "link")
    (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
    os.chmod(src / "run.sh", 0o755)
    return src


def members(snapshot: str) -> list[str]:
    with tarfile.open(snapshot) as tar:
        return [m.name for m in tar.getmembers()]


# What an agent does to a checkout between two actions: every kind of change a delta must carry.
CHANGES = " && ".join([
    "echo edited > pkg/m3.py",
    # same size, and the old modification time put back: only the change time tells
    "cp -p pkg/m4.py /tmp/m4 && sed -i 's/VALUE = 004/VALUE = 444/' pkg/m4.py && touch -r /tmp/m4 pkg/m4.py",
    "rm pkg/m5.py", "rm -r docs", "rm link && echo 'a file now' > link",
    "ln pkg/m6.py hard", "chmod 600 pkg/m7.py", "mv pkg/m8.py pkg/m8.moved",
    "mkdir -p new/deep && echo new > new/deep/file.txt", "mkfifo pipe",
    "mv pkg/sub sub2 && mkdir pkg/sub && echo other > pkg/sub/data.txt",
])


@pytest.mark.sandbox
@pytest.mark.skipif(probe_bwrap(shutil.which("bwrap") or "") is not None,
                    reason="bubblewrap missing or unusable here")
def test_a_move_carries_only_what_changed_and_the_state_is_the_same_after_it(tmp_path, repo):
    shared = tmp_path / "shared"
    templates = {"repo": TreeTemplate(repo)}
    w1 = SandboxManager(tmp_path / "w1", shared, templates=templates, default_template="repo", warm_pool=1)
    w2 = SandboxManager(tmp_path / "w2", shared, templates=templates, default_template="repo", warm_pool=1)
    try:
        r = w1.run(act(CHANGES, env="traj"), CPU)
        assert r.status == Status.OK, r
        before = tree_of(w1.envs.get("traj").path)
        assert before["pkg/m4.py"][2].startswith(b"VALUE = 444") and "pipe" in before
        snap = w1.snapshot("traj")
        names = set(members(snap))
        # the 34 untouched modules, the untouched directories and files of the base are not in it
        assert "./pkg/m0.py" not in names and "./run.sh" not in names and "./locked/keep.txt" not in names
        assert {"./pkg/m3.py", "./pkg/m4.py", "./link", "./hard", "./pkg/m6.py", "./pkg/m7.py",
                "./pkg/m8.moved", "./new/deep/file.txt", "./pkg/sub/data.txt", "./sub2/data.txt"} <= names
        assert sum(n.startswith("./pkg/m") for n in names) == 5     # m3, m4, m6, m7, m8.moved
        # the base went beside the snapshots, once
        assert len(os.listdir(shared / "bases")) == 1
        w2.restore("traj", snap)
        moved = w2.envs.get("traj")
        assert w2.envs.warm_hits == 1                  # it started from a ready-made copy of the checkout
        if moved.uid is not None:   # as root each environment has its own uid, which owns every entry
            assert {os.lstat(p).st_uid for p in [moved.path, *moved.path.rglob("*")]} == {moved.uid}
        after = tree_of(moved.path)
        before.pop("pipe")          # FIFOs are never saved
        assert after == before
        # the restored copy is the one that runs next, and moves again: back to w1, through a second delta
        r = w2.run(act("cat pkg/m4.py | head -1 && cat link && echo again >> new/deep/file.txt && "
                       "chmod 700 locked && echo added > locked/added.txt", env="traj"), CPU)
        assert r.status == Status.OK and r.output["stdout"] == "VALUE = 444\na file now\n", r
        before = tree_of(w2.envs.get("traj").path)
        back = w2.snapshot("traj", 2)
        w1.restore("traj", back)
        assert tree_of(w1.envs.get("traj").path) == before
        r = w1.run(act("cat new/deep/file.txt locked/added.txt pkg/m3.py && ls pkg | wc -l", env="traj"), CPU)
        assert r.output["stdout"] == "new\nagain\nadded\nedited\n40\n", r
    finally:
        w1.close()
        w2.close()


def test_a_change_in_the_same_clock_tick_as_the_copy_is_saved(tmp_path, repo):
    """Written (same size, modification time put back) right after the copy was made: still in the delta."""
    a = EnvStore(tmp_path / "a", {"repo": {"kind": "tree", "source": str(repo)}}, "repo", None, 0, False)
    b = EnvStore(tmp_path / "b", {"repo": {"kind": "tree", "source": str(repo)}}, "repo", None, 0, False)
    try:
        for k in range(20):
            env = a.acquire(f"e{k}", None)
            target = env.path / "pkg" / "m2.py"
            st = os.lstat(target)
            target.write_text(f"VALUE = {k:03d}\n" * 20)       # at once: the same tick as the end of the copy
            os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
            a.release(env)
            snap = a.snapshot(f"e{k}", tmp_path / "snaps")
            assert "./pkg/m2.py" in members(snap)
            assert (b.restore(f"e{k}", snap).path / "pkg" / "m2.py").read_text() == f"VALUE = {k:03d}\n" * 20
    finally:
        a.close()
        b.close()


def test_a_worker_built_from_another_tree_restores_over_the_saved_base(tmp_path, repo):
    other = tmp_path / "other"
    shutil.copytree(repo, other, symlinks=True)
    os.chmod(other / "locked", 0o755)
    (other / "pkg" / "m1.py").write_text("not the same checkout\n")
    a = EnvStore(tmp_path / "a", {"repo": {"kind": "tree", "source": str(repo)}}, "repo", None, 1, False)
    b = EnvStore(tmp_path / "b", {"repo": {"kind": "tree", "source": str(other)}}, "repo", None, 1, False)
    try:
        env = a.acquire("t", None)
        (env.path / "pkg" / "m9.py").write_text("mine\n")
        a.release(env)
        before = tree_of(env.path)
        snap = a.snapshot("t", tmp_path / "snaps")
        assert len(members(snap)) < 10
        got = b.restore("t", snap)
        assert tree_of(got.path) == before          # the other checkout's m1.py is not in it
        assert got.template == "repo"
        # with the saved base gone, a worker that does not hold it refuses, saying what is missing
        snap = b.snapshot("t", tmp_path / "snaps")
        shutil.rmtree(tmp_path / "snaps" / "bases")
        c = EnvStore(tmp_path / "c", {"repo": {"kind": "tree", "source": str(other)}}, "repo", None, 0, False)
        try:
            with pytest.raises(EnvError, match="delta over base .* neither on this worker nor saved"):
                c.restore("t", snap)
            assert not c.has("t")
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_an_environment_made_empty_is_saved_whole(tmp_path):
    a = EnvStore(tmp_path / "a", {}, "empty", None, 0, False)
    try:
        env = a.acquire("e", None)
        (env.path / "f").write_text("x")
        a.release(env)
        snap = a.snapshot("e", tmp_path / "snaps")
        assert members(snap) == [".", "./f"] and not (tmp_path / "snaps" / "bases").exists()
    finally:
        a.close()
