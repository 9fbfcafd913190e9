"""The worker harness (benchmarks/worker_harness.py) at a small size, against a real coordinator
process, so that the scale benchmark keeps speaking the protocol the coordinator speaks."""
import importlib.util
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def wh():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "worker_harness.py"
    spec = importlib.util.spec_from_file_location("worker_harness", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _status_when(h, pred, what: str, timeout: float = 60.0) -> dict:
    """Status replies (the harness's workers kept running meanwhile) until ``pred`` holds."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        st, _ = h.status()
        if pred(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last status: "
                                 f"{len(st['workers'])} workers, environments {st['environments']}")
        h.idle(0.1)


def test_simulated_workers_register_answer_each_action_once_and_report_environments(wh, tmp_path):
    coord = wh.CoordinatorProcess(tmp_path, "--heartbeat", "0.2")
    h = wh.Harness(coord.info, cores=2, heartbeat_s=0.2, duration=0.002)
    try:
        h.add_workers(5)
        st, _ = h.status()
        assert sorted(w["id"] for w in st["workers"]) == sorted(w.id for w in h.workers)

        h.run(wh.noop, 400, batch=50)
        assert h.answered == 400 and not h.sent and h.duplicates == 0 and not h.failed and not h.errors
        assert sum(w.assigned for w in h.workers) == 400

        h.run(wh.env_action, 30, batch=10)      # each a new environment, kept on its worker
        held = [e for w in h.workers for e in w.envs]
        assert len(held) == len(set(held)) == 30
        st = _status_when(h, lambda st: sum(w["envs"] for w in st["workers"]) == 30,
                          "every environment reported by its worker's heartbeats")
        by_id = {w["id"]: w["envs"] for w in st["workers"]}
        assert by_id == {w.id: len(w.envs) for w in h.workers}
        assert sum(st["environments"].values()) == 30

        # Held actions take every core, the rest queue at the coordinator; released, each is answered once.
        h.hold = True
        h.submit([wh.long_action(i) for i in h._ids(25)])
        st = _status_when(h, lambda st: st["pending"] == 15 and sum(len(w.held) for w in h.workers) == 10,
                          "10 actions on the 10 cores and 15 queued")
        assert h.release() == 10
        h.run(wh.noop, 0)                        # until nothing is unanswered
        assert h.answered == 455 and h.duplicates == 0 and not h.failed and not h.errors
        st, _ = h.status()
        assert st["completed"] == 455 and st["workers_lost"] == 0 and st["bad_frames"] == 0
    finally:
        coord.close(h)
        h.close()
    assert coord.proc.returncode == 0


def test_past_its_heartbeat_bound_the_coordinator_tells_its_workers_a_longer_interval_and_loses_none(wh, tmp_path):
    # 0.2 s heartbeats from 6 workers are 30 a second; a bound of 10 a second asks for 0.6 s
    coord = wh.CoordinatorProcess(tmp_path, "--heartbeat", "0.2", "--heartbeats-per-s", "10")
    h = wh.Harness(coord.info, cores=1, heartbeat_s=0.2)
    try:
        h.add_workers(2)
        assert h.heartbeat_s == 0.2                  # 2 workers: 10 heartbeats a second, within the bound
        h.add_workers(4)
        deadline = time.monotonic() + 60
        while h.heartbeat_s != 0.6:                 # told with the coordinator's next heartbeats
            assert time.monotonic() < deadline, f"the workers were told {h.heartbeat_s} s"
            h.idle(0.1)
        h.run(wh.noop, 100, batch=20)
        st, _ = h.status()
        assert len(st["workers"]) == 6 and st["workers_lost"] == 0 and h.answered == 100 and not h.errors
    finally:
        coord.close(h)
        h.close()
    assert coord.proc.returncode == 0
