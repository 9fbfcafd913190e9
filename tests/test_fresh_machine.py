"""The suite proves the fresh-machine case: nothing may depend on packages outside .venv.

scripts/test.sh (and so CI) puts a bare system interpreter first on PATH as ``python3``; these tests
check that it is in force, so a template or script that falls back to ``python3`` cannot pass by
luck on a machine whose system python happens to have the packages.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _bare() -> str:
    bare = os.environ.get("TANGRAM_BARE_PYTHON")
    if not bare:
        pytest.skip("not run through scripts/test.sh (no bare python3 on PATH)")
    return bare


def test_python3_on_path_has_none_of_the_packages():
    bare = _bare()
    assert shutil.which("python3") == bare
    for module in ("zmq", "msgpack", "tangram_hpc", "submitit", "numpy"):
        proc = subprocess.run(["python3", "-c", f"import {module}"], capture_output=True, text=True,
                              cwd="/", env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        assert proc.returncode != 0, f"python3 on PATH imports {module}: the suite would not catch a fresh-machine failure"


def test_the_suite_runs_in_the_checkouts_venv():
    _bare()
    assert Path(sys.prefix).resolve() == (REPO / ".venv").resolve()


# What only scripts/test.sh installs (the test, native, serve, metrics, top, verl and agents extras).
_NOT_FOR_THE_DEMO = ("aiohttp", "pytest", "hypothesis", "matplotlib", "psutil", "requests", "sandbox_fusion",
                     "prometheus_client", "rich", "mypy", "setuptools", "verl", "minisweagent", "skyrl_gym")


@pytest.mark.sandbox
@pytest.mark.slow
def test_the_demo_runs_with_only_what_demo_sh_installs(tmp_path):
    """scripts/demo.sh installs the project and its reward extra only: the demo, its coordinator and
    its workers must not import anything else (each process refuses those imports here)."""
    if shutil.which("bwrap") is None:
        pytest.skip("needs bubblewrap")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"_REFUSED = {_NOT_FOR_THE_DEMO!r}\n"
        "class _Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in _REFUSED:\n"
        "            raise ImportError(f'{name} is not installed by scripts/demo.sh')\n"
        "sys.meta_path.insert(0, _Refuse())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "HOME": str(tmp_path),
           "TANGRAM_NATIVE": "0"}
    proc = subprocess.run([sys.executable, "-m", "tangram_hpc.cli", "demo", "--trajectories", "2", "--turns", "1",
                           "--workers", "1", "--cores", "1", "--model", "hashing", "--quiet"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RL step: 2 trajectories" in proc.stdout and "mean ACT" in proc.stdout, proc.stdout
    assert "not installed by scripts/demo.sh" not in proc.stderr, proc.stderr[-3000:]
