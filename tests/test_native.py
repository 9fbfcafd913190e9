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


def test_a_build_runs_only_the_sources_it_was_built_from(tmp_path):
    """A copy of the package with its build: the build loads; after one compiled source changes
    (an edit, a checkout), the Python sources run, and status says why."""
    _need_build()
    shutil.copytree(ROOT / "tangram_hpc", tmp_path / "tangram_hpc", ignore=shutil.ignore_patterns("__pycache__"))
    where, how = _python(_STATUS, native_on=True, path=tmp_path).splitlines()
    assert where.startswith(str(tmp_path / "tangram_hpc" / "_native_builds")) and how.startswith("native")
    off_where, off_how = _python(_STATUS, native_on=False, path=tmp_path).splitlines()
    assert off_where.endswith("placement.py") and "TANGRAM_NATIVE=0" in off_how
    with open(tmp_path / "tangram_hpc" / "policy" / "pool.py", "a") as f:
        f.write("\n# edited\n")
    stale_where, stale_how = _python(_STATUS, native_on=True, path=tmp_path).splitlines()
    assert stale_where == str(tmp_path / "tangram_hpc" / "policy" / "placement.py")
    assert stale_how.startswith("pure Python: stale")


def test_a_policy_of_ones_own_subclasses_the_compiled_classes():
    """Users and tests extend the policies in Python (allow_interpreted_subclasses)."""
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


# every field of bench --json but the machine's time to compute it
_TIMING = ("wall", "cpu_s", "elapsed")


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if not any(t in k for t in _TIMING)}
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
        _python("from tangram_hpc.cli import main; raise SystemExit(main(["
                f"'bench', '--workload', '{preset}', '--scale', '0.1', '--steps', '2', '--quiet', "
                f"'--json', '{path}']))", native_on=on)
        out[on] = _strip(json.loads(path.read_text()))
    assert json.dumps(out[True], sort_keys=True) == json.dumps(out[False], sort_keys=True)


def test_a_build_that_cannot_be_made_says_why(monkeypatch, capsys):
    import argparse
    monkeypatch.setattr(native, "can_build", lambda: "no C compiler (cc)")
    assert native.main(argparse.Namespace(what="build")) == 1
    assert "cannot build: no C compiler (cc)" in capsys.readouterr().err
