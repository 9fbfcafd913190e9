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
