"""The native build (tangram_hpc.native): opt-in (TANGRAM_NATIVE=1), run only where it matches the
sources and loads, an error otherwise (never the Python sources in its place), refused by the live
commands; the compiled policies and simulator give the same results as the Python sources.

scripts/test.sh runs this file with TANGRAM_NATIVE=1, after building."""
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
        # scripts/test.sh runs this file with TANGRAM_NATIVE=1 after building: there this runs
        pytest.skip(f"this process does not run the build ({native.status()})")


def _run(args: list[str], *, native_on: bool, path: Path = ROOT, timeout: float = 300):
    env = {k: v for k, v in os.environ.items() if k != "TANGRAM_NATIVE"}
    if native_on:
        env["TANGRAM_NATIVE"] = "1"
    env["PYTHONPATH"] = str(path)
    return subprocess.run([sys.executable, *args], cwd=path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _python(code: str, *, native_on: bool, path: Path = ROOT, timeout: float = 300) -> str:
    p = _run(["-c", code], native_on=native_on, path=path, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def _refused(code: str, path: Path) -> str:
    """What TANGRAM_NATIVE=1 says when it cannot run the build: an error, no Python sources."""
    p = _run(["-c", code], native_on=True, path=path)
    assert p.returncode != 0 and "NativeBuildError: TANGRAM_NATIVE=1 but" in p.stderr, (p.stdout, p.stderr[-3000:])
    assert p.stdout == ""
    return p.stderr


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
    """A copy of the package with its build: asked for, the build loads; not asked for, the Python
    sources run; after a compiled source, or a module whose types it compiled in, changes (an
    edit, a checkout), asking for it is an error that says the build is stale."""
    _need_build()
    _copy(tmp_path)
    where, how = _python(_STATUS, native_on=True, path=tmp_path).splitlines()
    assert where.startswith(str(tmp_path / "tangram_hpc" / "_native_builds")) and how.startswith("native")
    off_where, off_how = _python(_STATUS, native_on=False, path=tmp_path).splitlines()
    assert off_where.endswith("placement.py") and "opt-in" in off_how
    with open(tmp_path / "tangram_hpc" / edited, "a") as f:
        f.write("\n# edited\n")
    assert "stale" in _refused(_STATUS, tmp_path)
    said = _python("from tangram_hpc.cli import main; main(['native', 'status'])", native_on=False, path=tmp_path)
    assert "build: stale" in said


def test_a_build_that_does_not_load_is_an_error_not_the_python_sources(tmp_path):
    """A damaged shared library (or one built for another node's C library): asking for the
    build fails at import, saying what the loader said."""
    _need_build()
    _copy(tmp_path)
    build = tmp_path / "tangram_hpc" / "_native_builds" / native.build_dir().name
    [lib] = build.glob(f"{native._LIB}*")
    lib.write_bytes(b"not a shared library")
    assert "does not load here" in _refused(_STATUS, tmp_path)


def test_no_build_is_an_error_when_asked_for_and_the_python_sources_otherwise(tmp_path):
    shutil.copytree(ROOT / "tangram_hpc", tmp_path / "tangram_hpc",
                    ignore=shutil.ignore_patterns("__pycache__", "_native_builds"))
    assert "no build" in _refused(_STATUS, tmp_path)
    where, how = _python(_STATUS, native_on=False, path=tmp_path).splitlines()
    assert where.endswith("placement.py") and how.startswith("pure Python")


@pytest.mark.parametrize("command", sorted(native.LIVE_COMMANDS))
def test_the_live_commands_refuse_to_run_compiled(command, tmp_path):
    """The coordinator, a worker, serve and the demo run the Python sources only."""
    _need_build()
    p = _run(["-m", "tangram_hpc.cli", command, "--help"], native_on=False)
    assert p.returncode == 0, p.stderr[-2000:]
    p = _run(["-m", "tangram_hpc.cli", command], native_on=True)
    assert p.returncode == 2 and "for bench and the simulator only" in p.stderr, p.stderr[-2000:]


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
