"""The pool driver in-process: the real LocalBackend starting real worker processes, no coordinator.

The clock the driver sees is passed in (so back-off and grace periods are exact); the backend's
processes are real, and what the driver wants sent to workers is read from the outbox.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from tangram_hpc import protocol as P
from tangram_hpc.actions import function
from tangram_hpc.backends.base import JobState
from tangram_hpc.backends.local import LocalBackend
from tangram_hpc.config import CoordinatorSettings
from tangram_hpc.connection import ConnectionInfo
from tangram_hpc.coordinator import ActionLedger, PoolDriver, WorkerState
from tangram_hpc.policy.static import StaticPool
from tangram_hpc.policy.fifo import FifoPolicy
from tangram_hpc.resources import WorkerInfo, WorkerShape

ONE_CORE = WorkerShape(cores=1)


@pytest.fixture
def backend(tmp_path):
    be = LocalBackend(tmp_path / "workers")
    yield be
    be.shutdown()


def driver_for(tmp_path: Path, backend: LocalBackend, connection_file: Path, **settings) -> PoolDriver:
    ledger = ActionLedger(CoordinatorSettings(**settings), FifoPolicy())
    return PoolDriver(ledger.config, StaticPool([ONE_CORE], first_backoff_s=2.0), backend, ledger,
                      connection_file=str(connection_file))


def poll_until(driver: PoolDriver, now: float, pred, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
        driver.poll(now)


def test_failed_starts_are_counted_and_the_static_pool_backs_off(tmp_path, backend):
    driver = driver_for(tmp_path, backend, tmp_path / "no-such-connection.json")
    driver.decide(100.0)
    assert list(driver.starting.values()) == [(ONE_CORE, 100.0)]
    # The worker exits at once (no connection file): a failed start, with the exit status.
    poll_until(driver, 100.5, lambda: driver.ledger.counters.launch_failures == 1, "the failed start")
    assert not driver.starting and "failed exit status 2" in driver.failures[-1][1]
    assert "no connection file" in next((tmp_path / "workers").glob("*.log")).read_text()
    driver.decide(101.0)                       # within the 2 s back-off: nothing launched
    assert not driver.starting and "backing off" in driver.status()["pool"]
    driver.decide(102.6)                       # past it: tried again
    assert len(driver.starting) == 1


def test_a_job_that_ends_loses_its_worker_and_retries_its_actions(tmp_path, backend):
    driver = driver_for(tmp_path, backend, tmp_path / "no-such-connection.json")
    ledger = driver.ledger
    driver.decide(0.0)
    [handle] = driver.starting
    # As if its worker had registered before the process died.
    w = ledger.add_worker(WorkerInfo(id="w1", cores=1, handle=handle), b"w1", 0.5)
    driver.joined(w)
    assert w.launched_shape == ONE_CORE and not driver.starting
    spec = function("time:sleep", 1)
    ledger.submit(b"c", [spec.to_wire()], 0.5)
    ledger.dispatch(0.5)
    poll_until(driver, 1.0, lambda: ledger.workers.get("w1") is None, "the worker to be lost")
    assert ledger.counters.workers_lost == 1 and ledger.counters.retried == 1
    assert ledger.counters.launch_failures == 0            # it had started: not a failed start
    assert ledger.policy.pending_count == 1 and ledger.attempt_of(spec.id) == (1, None)
    lost = [r for r in ledger.workers.log if r[1] == "lost"]
    assert lost and lost[0][2:4] == ["w1", handle]


def test_reclaiming_an_extra_worker_drains_stops_then_cancels_its_job_after_the_grace(tmp_path, backend):
    # A connection file whose coordinator never answers: the worker runs, registering in vain.
    conn = tmp_path / "connection.json"
    ConnectionInfo("tcp://127.0.0.1:9", "tcp://127.0.0.1:9", run_dir=str(tmp_path)).write(conn)
    driver = driver_for(tmp_path, backend, conn, drain_grace_s=5.0)
    ledger = driver.ledger
    driver.decide(0.0)
    [handle] = driver.starting
    busy = ledger.add_worker(WorkerInfo(id="busy", cores=1), b"busy", 0.0)
    spec = function("time:sleep", 1)
    ledger.submit(b"c", [spec.to_wire()], 0.0)
    ledger.dispatch(0.0)
    assert busy.running == {spec.id}
    extra = ledger.add_worker(WorkerInfo(id="extra", cores=1, handle=handle), b"extra", 0.1)
    driver.joined(extra)
    # Two workers of the one shape the pool keeps: the idle one goes, the busy one stays.
    driver.tick(10.0)
    assert extra.state is WorkerState.DRAINING and ledger.workers.get("extra") is None
    assert busy.state is WorkerState.OK
    assert [(ident, mtype, body["reregister"]) for ident, mtype, body in ledger.outbox.to_workers] == \
        [(b"extra", P.STOP, False)]
    assert [r[1] for r in ledger.workers.log if r[2] == "extra"] == ["register", "drain", "reclaimed"]
    driver.tick(14.9)                       # it had 5 s to snapshot and exit by itself
    assert not [e for e in backend.poll() if e.handle == handle]
    driver.finish_drains(15.0)              # it did not (nothing told it to stop): its job is cancelled
    deadline = time.monotonic() + 20
    events = []
    while not events:
        assert time.monotonic() < deadline, "the reclaimed worker process did not end"
        time.sleep(0.05)
        events = [e for e in backend.poll() if e.handle == handle]
    # SIGTERM: a worker that got as far as its handler leaves cleanly; one still starting dies of it.
    assert events[0].state is JobState.ENDED or events[0].reason == "killed by signal 15", events
