"""The native build (tangram_hpc.native): used where it matches the sources, never when stale,
and the compiled policies and simulator give the same results as the Python sources."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tangram_hpc import native

ROOT = Path(__file__).resolve().parents[1]


def _need_build() -> None:
    if not native.active():
        # scripts/test.sh builds it (scripts/setup-env.sh); there a missing build fails the suite
        pytest.skip(f"no native build in this process ({native.status()})")


def _python(code: str, *, native_on: bool, path: Path = ROOT, timeout: float = 300) -> str:
    env = dict(os.environ, TANGRAM_NATIVE="1" if native_on else "0", PYTHONPATH=str(path))
    p = subprocess.run([sys.executable, "-c", code], cwd=path, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_this_process_runs_the_compiled_policies():
    _need_build()
    from tangram_hpc.policy import elastic, placement, pool, predict
    from tangram_hpc.sim import engine
    for mod in (placement, elastic, predict, pool, engine):
        assert mod.__file__.endswith(native._SUFFIX), mod.__file__
    assert native.status().startswith("native")


_STATUS = "import tangram_hpc.policy.placement as p, tangram_hpc.native as n; print(p.__file__); print(n.status())"


def _copy(dest: Path) -> Path:
    shutil.copytree(ROOT / "tangram_hpc", dest / "tangram_hpc", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


@pytest.mark.parametrize("edited", ["policy/pool.py", "resources.py"])
def test_a_build_runs_only_the_sources_it_was_built_from(tmp_path, edited):
    """A copy of the package with its build: the build loads; after a compiled source, or a module
    whose types it compiled in, changes (an edit, a checkout), the Python sources run, and status
    says why."""
    _need_build()
    _copy(tmp_path)
    where, how = _python(_STATUS, native_on=True, path=tmp_path).splitlines()
    assert where.startswith(str(tmp_path / "tangram_hpc" / "_native_builds")) and how.startswith("native")
    off_where, off_how = _python(_STATUS, native_on=False, path=tmp_path).splitlines()
    assert off_where.endswith("placement.py") and "TANGRAM_NATIVE=0" in off_how
    with open(tmp_path / "tangram_hpc" / edited, "a") as f:
        f.write("\n# edited\n")
    stale_where, stale_how = _python(_STATUS, native_on=True, path=tmp_path).splitlines()
    assert stale_where == str(tmp_path / "tangram_hpc" / "policy" / "placement.py")
    assert stale_how.startswith("pure Python: stale")


def test_a_build_that_does_not_load_leaves_the_python_sources_running(tmp_path):
    """A damaged shared library (or one built for another node's C library): every import still
    works, on the Python sources, and status says what the loader said."""
    _need_build()
    _copy(tmp_path)
    build = tmp_path / "tangram_hpc" / "_native_builds" / native.build_dir().name
    [lib] = build.glob(f"{native._LIB}*")
    lib.write_bytes(b"not a shared library")
    where, how = _python(_STATUS, native_on=True, path=tmp_path).splitlines()
    assert where.endswith("placement.py") and "does not load here" in how


def test_a_rebuild_keeps_the_build_a_running_process_imports_from(tmp_path):
    """A process that loaded a build before a rebuild can still import the rest of it after."""
    _need_build()
    _copy(tmp_path)
    builds = tmp_path / "tangram_hpc" / "_native_builds"
    old = builds / native.build_dir().name
    for p in builds.iterdir():          # this checkout's other builds, if any: only the fakes below
        if p != old:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    for n in range(native.KEEP_BUILDS + 2):    # builds of earlier sources: only the newest are kept
        fake = builds / f"{native._PREFIX}{n:020d}"
        shutil.copytree(old, fake)
        os.utime(fake, (n, n))
    other = builds / "cpython-399-00000000000000000000"     # another interpreter's
    other.mkdir()
    # the current build exists: a build only prunes, keeping it and the newest others
    _python("import tangram_hpc.native as n; n.build(lambda *a: None)", native_on=True, path=tmp_path)
    left = sorted(p.name for p in builds.iterdir() if not p.name.startswith("."))
    assert old.name in left and other.name in left
    mine = [x for x in left if x.startswith(native._PREFIX)]
    assert f"{native._PREFIX}{0:020d}" not in mine and f"{native._PREFIX}{native.KEEP_BUILDS + 1:020d}" in mine
    assert len([x for x in mine if x.startswith(f"{native._PREFIX}0000")]) == native.KEEP_BUILDS - 1


def test_a_policy_of_ones_own_subclasses_the_compiled_classes():
    """Users and tests extend the policies in Python (allow_interpreted_subclasses)."""
    _need_build()
    from tangram_hpc.actions import ActionSpec
    from tangram_hpc.policy.elastic import ElasticScheduler
    from tangram_hpc.policy.predict import Predictor
    from tangram_hpc.resources import WorkerInfo

    class Noting(ElasticScheduler):
        def __init__(self):
            super().__init__(Predictor())
            self.seen: list[str] = []

        def submit(self, action, now):
            self.seen.append(action.id)
            super().submit(action, now)

    s = Noting()
    s.add_worker(WorkerInfo(id="w", cores=4), 0.0)
    s.submit(ActionSpec("sandbox", id="a"), 0.0)
    assert s.seen == ["a"]
    assert [(a.action_id, a.worker_id) for a in s.schedule(0.0)] == [("a", "w")]


# every field of bench --json but how this machine computed it (its time, and whether compiled)
_TIMING = {"bench_wall_s", "sim_wall_s", "bench_native"}


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in _TIMING}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


@pytest.mark.parametrize("preset", ["swe", "math", "judge", "tir"])
def test_compiled_and_python_benchmarks_are_identical(preset, tmp_path):
    """Tangram and every baseline, simulated by the compiled modules and by the Python sources:
    every figure of bench --json is the same (bit for bit: the JSON text)."""
    _need_build()
    out = {}
    for on in (True, False):
        path = tmp_path / f"{preset}-{on}.json"
        said = _python("from tangram_hpc.cli import main; from tangram_hpc import native; "
                       f"rc = main(['bench', '--workload', '{preset}', '--scale', '0.1', '--steps', '2', "
                       f"'--quiet', '--json', '{path}']); print(native.status()); raise SystemExit(rc)",
                       native_on=on)
        assert said.splitlines()[-1].startswith("native" if on else "pure Python"), said
        raw = json.loads(path.read_text())
        assert raw["bench_native"] is on
        out[on] = _strip(raw)
    assert "cpu_saving" in json.dumps(out[True]) and "mean_act" in json.dumps(out[True])
    assert json.dumps(out[True], sort_keys=True) == json.dumps(out[False], sort_keys=True)


def test_the_policy_tests_pass_on_the_python_sources_too():
    """The rest of the suite runs the build; the policies' own tests also run as Python."""
    env = {k: v for k, v in os.environ.items() if k != "TANGRAM_REQUIRE_ALL"}
    env["TANGRAM_NATIVE"] = "0"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_sched_policies.py",
                        "tests/test_sched_predict_pool.py", "tests/test_ledger.py", "tests/test_env_fencing.py"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:]
    assert " passed" in p.stdout and " skipped" not in p.stdout and " failed" not in p.stdout


def test_the_hashed_modules_are_the_compiled_ones_and_all_they_import():
    """A build is used only while every module whose types it compiled in is unchanged."""
    import ast

    def path(m: str) -> Path | None:
        p = ROOT.joinpath(*m.split("."))
        return p.with_suffix(".py") if p.with_suffix(".py").exists() else None

    seen: set[str] = set()
    todo = list(native.COMPILED)
    while todo:
        m = todo.pop()
        p = path(m)
        if m in seen or p is None:
            continue
        seen.add(m)
        pkg = m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                todo += [mod] + [f"{mod}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
    imported = {m for m in seen if m.startswith("tangram_hpc.")} - set(native.COMPILED)
    assert imported == set(native.DEPENDS)


def test_compiled_decisions_pickle_and_copy():
    """Frozen dataclasses of the build pickle through their constructors, as they do in Python."""
    import copy
    import pickle

    from tangram_hpc.policy.base import Assignment, Launch, Reclaim, Withdraw
    from tangram_hpc.policy.placement import ShapeLimit
    from tangram_hpc.policy.residency import Resident
    from tangram_hpc.resources import WorkerShape
    shape = WorkerShape(4)
    for x in (Assignment("a", "w", 2), Launch(shape, 3, "why"), Reclaim("w", "idle"), Withdraw(shape, 2),
              ShapeLimit(4, 100, None, True), Resident("judge", 1000.0, 3, 1.5, 2.0, 0.5)):
        assert pickle.loads(pickle.dumps(x)) == x and copy.copy(x) == x and copy.deepcopy(x) == x


def test_a_build_that_cannot_be_made_says_why(monkeypatch, capsys):
    import argparse
    monkeypatch.setattr(native, "can_build", lambda: "no C compiler (cc)")
    assert native.main(argparse.Namespace(what="build")) == 1
    assert "cannot build: no C compiler (cc)" in capsys.readouterr().err


def test_a_pool_policy_of_ones_own_sets_its_shapes():
    """PoolPolicy's contract is unchanged by the build: a subclass sets ``shapes`` in __init__."""
    _need_build()
    from tangram_hpc.policy.base import PoolPolicy
    from tangram_hpc.resources import WorkerShape

    class Mine(PoolPolicy):
        def __init__(self, shapes):
            self.shapes = list(shapes)

        def decide(self, view):
            return []
    assert Mine([WorkerShape(2)]).shapes == [WorkerShape(2)]
