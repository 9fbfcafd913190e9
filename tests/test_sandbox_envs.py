"""Environment lifecycle: templates, warm pool, TTL, snapshot/restore across workers."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tangram_hpc.actions import ActionSpec, Status
from tangram_hpc.managers import Limits, PythonEnvTemplate, SandboxManager, TreeTemplate
from tangram_hpc.managers.bwrap import probe_bwrap
from support import act, tree_of

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(probe_bwrap(shutil.which("bwrap") or "") is not None,
                       reason="bubblewrap missing or unusable here"),
]

CPU = [sorted(os.sched_getaffinity(0))[0]]


@pytest.fixture
def project(tmp_path):
    src = tmp_path / "project"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "__init__.py").write_text("VALUE = 41\n")
    (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "run.sh").chmod(0o755)
    (src / "junk.pyc").write_text("x")
    return src


def env_path(mgr: SandboxManager, env_id: str) -> Path:
    return mgr.envs.get(env_id).path


def test_tree_template_copies_project(tmp_path, project):
    with SandboxManager(tmp_path / "envs", templates={"proj": TreeTemplate(project, ignore=("*.pyc",))},
                        default_template="proj") as m:
        r = m.run(act("./run.sh && python -c 'import pkg; print(pkg.VALUE + 1)' && ls", env="t"), CPU)
        assert r.status == Status.OK, r
        assert r.output["stdout"] == "ran\n42\npkg\nrun.sh\n"
        # The template source itself is untouched by the action.
        m.run(act("echo changed > run.sh", env="t"), CPU)
        assert (project / "run.sh").read_text() == "#!/bin/sh\necho ran\n"
        # A payload may pick another template for a new environment.
        r = m.run(act("ls -A", env="e2", template="empty"), CPU)
        assert r.output["stdout"] == ""
        bad = m.run(act("true", env="e3", template="nope"), CPU)
        assert bad.status == Status.ERROR and "unknown template" in bad.error


def test_warm_pool_serves_new_environments(tmp_path, project):
    with SandboxManager(tmp_path / "envs", templates={"proj": TreeTemplate(project)},
                        default_template="proj", warm_pool=2) as m:
        deadline = time.monotonic() + 20
        while m.envs.warm_count("proj") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert m.envs.warm_count("proj") == 2
        r = m.run(act("cat pkg/__init__.py", env="w1"), CPU)
        assert r.status == Status.OK and r.output["stdout"] == "VALUE = 41\n"
        assert m.envs.warm_hits == 1  # taken from the pool ...
        deadline = time.monotonic() + 20
        while m.envs.warm_count("proj") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert m.envs.warm_count("proj") == 2  # ... and refilled in the background
    assert not (tmp_path / "envs" / ".warm").exists()



def test_a_template_failing_in_the_warm_pool_is_logged_and_reported_to_its_actions(tmp_path, project, caplog):
    missing = TreeTemplate(tmp_path / "no-such-dir")
    with caplog.at_level("ERROR", logger="tangram_hpc.managers.env_builds"):
        with SandboxManager(tmp_path / "envs", templates={"proj": TreeTemplate(project), "gone": missing},
                            default_template="proj", warm_pool=1) as m:
            deadline = time.monotonic() + 30
            while "gone" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.02)
            r = m.run(ActionSpec("sandbox", {"cmd": "true", "template": "gone"}, env="g"), CPU)
            assert r.status == Status.ERROR and "no-such-dir" in r.error and "'gone'" in r.error
            while m.envs.warm_count("proj") < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert m.envs.warm_count("proj") == 1   # the other template is still kept warm
    assert "warm pool: template 'gone' failed to build" in caplog.text and "no-such-dir" in caplog.text

def test_ttl_garbage_collection(tmp_path):
    with SandboxManager(tmp_path / "envs", env_ttl=100) as m:
        m.run(act("echo a > a", env="old"), CPU)
        m.run(act("echo b > b", env="new"), CPU)
        old_path = env_path(m, "old")
        m.envs.get("new").last_used += 50
        assert m.gc(time.monotonic() + 60) == []
        assert m.gc(time.monotonic() + 120) == ["old"]
        assert m.environments() == frozenset({"new"}) and not old_path.exists()
        assert m.drop("new") and m.environments() == frozenset()
        assert not m.drop("new")


def test_snapshot_restore_on_another_worker(tmp_path):
    shared = tmp_path / "shared" / "snapshots"
    w1 = SandboxManager(tmp_path / "w1" / "envs", shared)
    w2 = SandboxManager(tmp_path / "w2" / "envs", shared)
    try:
        setup = ("mkdir -p src/deep && printf 'hello\\n' > src/a.txt && "
                 "head -c 70000 /dev/urandom > src/deep/blob.bin && chmod 700 src/deep && "
                 "printf '#!/bin/sh\\necho exe\\n' > tool.sh && chmod 755 tool.sh && "
                 "ln -s src/a.txt link && mkdir empty")
        r = w1.run(act(setup, env="traj"), CPU)
        assert r.status == Status.OK, r
        snap = w1.snapshot("traj")
        assert Path(snap).parent == shared and Path(snap).is_file()
        w2.restore("traj", snap)
        assert "traj" in w2.environments()
        assert tree_of(env_path(w1, "traj")) == tree_of(env_path(w2, "traj"))
        r = w2.run(act("./tool.sh && cat link && echo more >> src/a.txt", env="traj"), CPU)
        assert r.status == Status.OK and r.output["stdout"] == "exe\nhello\n"
        # The copies are independent after the restore.
        assert (env_path(w1, "traj") / "src/a.txt").read_text() == "hello\n"
        # Restoring again replaces the local copy.
        w2.restore("traj", snap)
        assert (env_path(w2, "traj") / "src/a.txt").read_text() == "hello\n"
    finally:
        w1.close()
        w2.close()


# 25 directories of 200-character names: a path of 5,025 bytes, past what the kernel takes in one call
DEEP = "python3 -c \"import os\nfor i in range(25):\n  os.mkdir('d' * 200); os.chdir('d' * 200)\nopen('deep', 'w').write('deep\\n')\""
READ_DEEP = "python3 -c \"import os\nfor i in range(25):\n  os.chdir('d' * 200)\nprint(open('deep').read(), end='')\""


def test_paths_past_path_max_and_every_mode_survive_a_restore_and_an_adoption(tmp_path):
    """Sandboxed code decides how deep and with which modes and times its environment's files lie: a move
    (restore elsewhere) or a dead worker's adoption must give them all back, or the environment is lost."""
    shared = tmp_path / "shared" / "snapshots"
    w1 = SandboxManager(tmp_path / "w1" / "envs", shared)
    w2 = SandboxManager(tmp_path / "w2" / "envs", shared)
    w3 = SandboxManager(tmp_path / "w3" / "envs", shared)
    modes = "stat -c '%n %a' open shared dir tool && stat -c %Y shared"
    try:
        made = w1.run(act(DEEP + " && echo s > open && chmod 777 open && echo t > shared && chmod 666 shared"
                          " && mkdir dir && chmod 2775 dir && echo x > tool && chmod 4755 tool"
                          " && touch -d @1000000000 shared", env="e"), CPU)
        assert made.status == Status.OK, made
        w2.restore("e", w1.snapshot("e"))
        r = w2.run(act(f"{READ_DEEP} && {modes}", env="e"), CPU)
        # what was saved comes back but for the setuid and setgid bits
        assert (r.status, r.output["stdout"]) == (Status.OK, "deep\nopen 777\nshared 666\ndir 775\ntool 755\n1000000000\n"), r
        w3.adopt("e", str(w2.root))
        r = w3.run(act(f"{READ_DEEP} && {modes} && echo more > deep-too", env="e"), CPU)
        assert (r.status, r.output["stdout"]) == (Status.OK, "deep\nopen 777\nshared 666\ndir 775\ntool 755\n1000000000\n"), r
        assert not (w2.root / env_path(w3, "e").name).exists()      # the dead worker's copy is gone
    finally:
        w1.close()
        w2.close()
        w3.close()


def _nest(levels: int, name: str = "d") -> str:
    """A command nesting ``levels`` directories ``name`` (one call each: no path grows past PATH_MAX)."""
    return (f"python3 -c \"import os\nfor i in range({levels}):\n  os.mkdir('{name}'); os.chdir('{name}')\n"
            f"open('deep', 'w').write('deep\\n')\"")


def _read_nested(levels: int, name: str = "d") -> str:
    return f"python3 -c \"import os\nfor i in range({levels}):\n  os.chdir('{name}')\nprint(open('deep').read(), end='')\""


NO_DISK_QUOTA = {"disk_mb": None, "disk_files": None}


@pytest.fixture
def deep_tmp(tmp_path):
    """tmp_path, emptied by the code under test: pytest's own removal (shutil.rmtree) recurses per
    level and fails on trees this deep, for every later session sharing its base directory."""
    from tangram_hpc.managers.fs_inside import _rmtree
    yield tmp_path
    for child in tmp_path.iterdir():
        _rmtree(child)


def test_a_tree_thousands_of_levels_deep_is_saved_restored_adopted_and_removed(deep_tmp):
    """Past the interpreter's recursion limit and a descriptor per level: an environment that deep
    (a runaway loop, or a package manager's nesting) still moves when its worker drains or dies."""
    shared = deep_tmp / "shared" / "snapshots"
    w1 = SandboxManager(deep_tmp / "w1" / "envs", shared)
    w2 = SandboxManager(deep_tmp / "w2" / "envs", shared)
    w3 = SandboxManager(deep_tmp / "w3" / "envs", shared)
    try:
        made = w1.run(act(_nest(1500) + " && " + _nest(40, "n" * 200), env="e", limits=NO_DISK_QUOTA), CPU)
        assert made.status == Status.OK, made
        w2.restore("e", w1.snapshot("e"))
        assert w1.drop("e") and not any((deep_tmp / "w1" / "envs").glob("e*"))
        both = _read_nested(1500) + " && " + _read_nested(40, "n" * 200)
        r = w2.run(act(both, env="e", limits=NO_DISK_QUOTA), CPU)
        assert (r.status, r.output["stdout"]) == (Status.OK, "deep\ndeep\n"), r
        w3.adopt("e", str(w2.root))
        r = w3.run(act(both, env="e", limits=NO_DISK_QUOTA), CPU)
        assert (r.status, r.output["stdout"]) == (Status.OK, "deep\ndeep\n"), r
    finally:
        w1.close()
        w2.close()
        w3.close()


def test_a_tree_past_the_depth_bound_fails_to_save_with_a_clear_error_and_stays_usable(deep_tmp):
    """Deeper than MAX_DEPTH, a save stops at the bound with an error saying why (the worker answers
    the drain at once, the environment stays where it is), and the tree can still be removed."""
    from tangram_hpc.managers.fs_inside import MAX_DEPTH, EnvError
    with SandboxManager(deep_tmp / "envs", deep_tmp / "snapshots") as m:
        made = m.run(act(_nest(MAX_DEPTH + 10), env="e", limits=NO_DISK_QUOTA), CPU)
        assert made.status == Status.OK, made
        with pytest.raises(EnvError, match=f"deeper than {MAX_DEPTH} levels"):
            m.snapshot("e")
        assert not any((deep_tmp / "snapshots").rglob("*.partial"))
        r = m.run(act(_read_nested(MAX_DEPTH + 10), env="e", limits=NO_DISK_QUOTA), CPU)
        assert (r.status, r.output["stdout"]) == (Status.OK, "deep\n"), r
        assert m.drop("e") and not any((deep_tmp / "envs").glob("e*"))


def _in_nested(levels: int, then: str, name: str = "d") -> str:
    """A command going ``levels`` directories down and running the Python statements ``then`` there."""
    return f"python3 -c \"import os\nfor i in range({levels}):\n  os.chdir('{name}')\n{then}\""


def _deep_manager(path: Path, sessions: bool) -> SandboxManager:
    m = SandboxManager(path / "envs", path / "snapshots", sessions=sessions)
    if sessions and m.sessions is None:
        m.close()
        pytest.skip(f"no live sessions here: {m.sessionless_reason}")
    return m


@pytest.mark.parametrize("sessions", [False, True], ids=["sessions-off", "sessions-on"])
@pytest.mark.parametrize("quota", [None, NO_DISK_QUOTA], ids=["quota", "no-quota"])
def test_actions_write_replace_and_remove_inside_a_tree_past_the_recursion_limit(deep_tmp, quota, sessions):
    """Each action's layer is merged into the environment, and its size measured by the quota, to
    the depth a save goes: writing into, replacing and removing parts of a tree 1,100 levels deep
    (once "nests directories deeper than 256 levels" escaping the manager, or over quota)."""
    levels = 1100
    with _deep_manager(deep_tmp, sessions) as m:
        def ok(cmd):
            r = m.run(act(cmd, env="e", limits=quota), CPU)
            assert r.status == Status.OK, r
            return r.output["stdout"]

        ok(_nest(levels))
        ok(_in_nested(levels, "open('deep', 'a').write('more\\n'); os.mkdir('new'); open('new/f', 'w').write('f\\n')"))
        assert ok(_read_nested(levels)) == "deep\nmore\n"
        ok(_in_nested(levels // 2, "import shutil; shutil.rmtree('d'); open('d', 'w').write('file now\\n')"))
        assert ok(_in_nested(levels // 2, "print(open('d').read(), end='')")) == "file now\n"
        ok("rm -r d")
        assert ok("ls -A") == ""     # (with sessions an attempt is merged when the next action begins)
        ok(_nest(levels))            # made again over the removed tree, in one action
        assert ok(_read_nested(levels)) == "deep\n"


@pytest.mark.parametrize("sessions", [False, True], ids=["sessions-off", "sessions-on"])
def test_an_action_writing_past_the_depth_bound_fails_and_leaves_the_environment_as_it_was(deep_tmp, sessions):
    """Past MAX_DEPTH where the environment already has the directories, an action's layer is not
    merged: the action fails saying why, none of its changes land, and the environment goes on."""
    from tangram_hpc.managers.fs_inside import MAX_DEPTH
    levels = MAX_DEPTH + 10
    with _deep_manager(deep_tmp, sessions) as m:
        made = m.run(act(_nest(levels), env="e", limits=NO_DISK_QUOTA), CPU)
        assert made.status == Status.OK, made           # a new tree is moved whole, however deep
        r = m.run(act("echo top > top && " + _in_nested(levels, "open('deep', 'a').write('more\\n')"),
                      env="e", limits=NO_DISK_QUOTA), CPU)
        assert r.status == Status.FAILED and f"deeper than {MAX_DEPTH} levels" in r.error, r
        assert "discarded" in r.error and r.output["returncode"] == 0, r
        assert not (env_path(m, "e") / "top").exists()
        r = m.run(act("echo next > next && " + _read_nested(levels), env="e", limits=NO_DISK_QUOTA), CPU)
        assert (r.status, r.output["stdout"]) == (Status.OK, "deep\n"), r
        r = m.run(act("ls", env="e", limits=NO_DISK_QUOTA), CPU)
        assert (r.status, r.output["stdout"]) == (Status.OK, "d\nnext\n"), r
        assert m.drop("e") and not any((deep_tmp / "envs").glob("e*"))


def test_the_disk_quota_measures_a_tree_to_the_depth_bound_and_counts_a_deeper_one_as_over(deep_tmp):
    from tangram_hpc.managers.diskquota import measure
    from tangram_hpc.managers.fs_inside import MAX_DEPTH
    root = deep_tmp / "tree"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for depth in range(1, MAX_DEPTH + 2):
            os.mkdir("d", dir_fd=fd)
            sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
            if depth == MAX_DEPTH:
                with os.fdopen(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "wb") as f:
                    f.write(b"x" * 100_000)
                u = measure(root)
                assert u.unmeasured is None and u.files == MAX_DEPTH + 1 and u.bytes >= 100_000, u
    finally:
        os.close(fd)
    u = measure(root)
    assert u.unmeasured is not None and f"deeper than {MAX_DEPTH} levels" in u.unmeasured, u


def test_a_quota_walk_a_directory_moved_under_is_walked_again_then_counted_as_unmeasured():
    """Sandboxed code renames while the quota walks: the one-descriptor walk stops there
    (TreeMoved) and is walked again; a tree that moves under every try counts as over quota."""
    from tangram_hpc.managers import diskquota
    from tangram_hpc.managers.fs_inside import TreeMoved
    tries = []

    def moved_once(tally, n):
        tries.append(n)
        tally.files += n
        if len(tries) == 1:
            raise TreeMoved("directory 'a' moved while the environment was walked")

    assert diskquota._retried(moved_once, 5) == diskquota.DiskUsage(0, 5) and len(tries) == 2

    def always_moved(tally):
        tries.append(0)
        raise TreeMoved("directory 'a' moved while the environment was walked")

    tries.clear()
    u = diskquota._retried(always_moved)
    assert len(tries) == diskquota._WALK_TRIES and u.unmeasured is not None and "moved" in u.unmeasured


def test_restore_rejects_escaping_snapshot(tmp_path):
    import io
    import tarfile
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with SandboxManager(tmp_path / "envs") as m:
        with pytest.raises(RuntimeError, match="escapes"):
            m.restore("e", str(bad))
    assert not (tmp_path / "escape.txt").exists()


@pytest.mark.slow
def test_python_env_template(tmp_path):
    with SandboxManager(tmp_path / "envs", templates={"py": PythonEnvTemplate()},
                        default_template="py", default_limits=Limits(timeout_s=30)) as m:
        r = m.run(act("python -c 'import sys; print(sys.prefix)'; echo $VIRTUAL_ENV", env="p"), CPU)
        assert r.status == Status.OK, r
        assert r.output["stdout"].split() == ["/sandbox/.venv", "/sandbox/.venv"]
