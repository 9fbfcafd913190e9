import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# Nothing the suite runs writes outside temporary directories: the session, and every process it
# starts, gets a fresh home directory (set before tangram_hpc reads it), and at the end nothing
# may have made ~/.tangram in it (a coordinator run, a Slurm job's folder, left to its default).
HOME = Path(tempfile.mkdtemp(prefix="tangram-test-home-"))
os.environ["HOME"] = str(HOME)

from tangram_hpc.launch import LocalCluster  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def nothing_written_under_home():
    yield
    made = sorted(str(p.relative_to(HOME)) for p in (HOME / ".tangram").glob("*/*"))
    shutil.rmtree(HOME, ignore_errors=True)
    assert not made, f"the tests wrote under the home directory (give them a tmp_path): {made}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A coordinator with two local 2-core workers, shared by a test module."""
    with LocalCluster(workers=2, cores=2, run_dir=tmp_path_factory.mktemp("run"),
                      extra_args=["--worker-timeout", "6"]) as cl:
        yield cl


@pytest.fixture
def hosts(tmp_path):
    """Makes worker-side environment hosts (``hosts("w1")``) over one snapshot directory, closed after the test;
    ``hosts("w1", manager)`` hosts a manager the test made instead."""
    from tangram_hpc.managers import SandboxManager
    from tangram_hpc.managers.env_host import EnvHost
    made = []

    def host(name: str, manager: SandboxManager | None = None) -> EnvHost:
        mgr = manager if manager is not None else SandboxManager(tmp_path / name / "envs", tmp_path / "snapshots")
        h = EnvHost(mgr, lambda: None)
        made.append(h)
        return h
    yield host
    for h in made:
        h.close()
        h.mgr.close()


@pytest.fixture
def client(cluster):
    with cluster.client() as c:
        yield c


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under scripts/test.sh (and so in CI) a skipped test is a failure: its prerequisite is missing."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("TANGRAM_REQUIRE_ALL") and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.longrepr = f"skipped, but scripts/test.sh requires every test to run: {reason}"
