import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tangram_hpc.launch import LocalCluster  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A coordinator with two local 2-core workers, shared by a test module."""
    with LocalCluster(workers=2, cores=2, run_dir=tmp_path_factory.mktemp("run"),
                      extra_args=["--worker-timeout", "3"]) as cl:
        yield cl


@pytest.fixture
def client(cluster):
    with cluster.client() as c:
        yield c
