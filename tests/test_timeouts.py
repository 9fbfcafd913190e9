"""A timed-out action whose worker cannot stop it keeps its cores until the worker says it ended."""
from __future__ import annotations

import pytest

from tangram_hpc import ActionSpec, Status, function
from tangram_hpc.launch import LocalCluster

from support import wait_until

pytestmark = pytest.mark.slow


def test_timed_out_function_keeps_its_core_until_it_really_ends(tmp_path):
    with LocalCluster(workers=2, cores=1, run_dir=tmp_path, policy="fifo",
                      extra_args=["--timeout-grace", "0.2"]) as cl, cl.client() as c:
        # A Python function cannot be interrupted: it runs on for its 10 s after it timed out.
        slow = c.submit(ActionSpec(kind="function", payload={"fn": "time:sleep", "args": [10]}, timeout=0.5)).result(10)
        assert slow.status == Status.TIMEOUT and slow.act < 8
        stuck = next(w for w in c.status()["workers"] if w["id"] == slow.worker)
        assert (stuck["busy_cores"], stuck["zombie_cores"], stuck["running"]) == (1, 1, 0)
        assert c.status()["zombie_cores"] == 1
        # New actions go to the free worker instead of queueing behind it on the stuck one.
        quick = c.map([function("time:sleep", 0.2) for _ in range(3)], timeout=30)
        assert all(r.ok for r in quick), [r.error for r in quick]
        assert {r.worker for r in quick} == {w["id"] for w in c.status()["workers"]} - {slow.worker}
        assert c.status()["zombie_cores"] == 1        # they ran while the stuck core was still taken
        # Once the function returns, the worker reports the attempt and its core serves again.
        wait_until(lambda: c.status()["zombie_cores"] == 0, 30, 0.1, "the timed-out function to end")
        after = c.map([function("time:sleep", 0.5) for _ in range(2)], timeout=30)
        assert {r.worker for r in after} == {w["id"] for w in c.status()["workers"]}
        assert c.status()["completed"] == 5 and c.status()["stale_results"] == 1
