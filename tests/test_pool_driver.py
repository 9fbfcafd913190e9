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
from tangram_hpc.backends.guards import LaunchThrottle, local_time
from tangram_hpc.backends.local import LocalBackend
from tangram_hpc.config import CoordinatorSettings, LaunchSettings
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


def driver_for(tmp_path: Path, backend: LocalBackend, connection_file: Path, launch: LaunchSettings | None = None,
               **settings) -> PoolDriver:
    ledger = ActionLedger(CoordinatorSettings(**settings), FifoPolicy())
    return PoolDriver(ledger.config, StaticPool([ONE_CORE]), backend, ledger, connection_file=str(connection_file),
                      throttle=LaunchThrottle(launch or LaunchSettings(backoff_s=2.0)))


def poll_until(driver: PoolDriver, now: float, pred, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
        driver.poll(now)


def test_failed_starts_are_counted_and_the_launch_throttle_backs_off(tmp_path, backend):
    driver = driver_for(tmp_path, backend, tmp_path / "no-such-connection.json")
    driver.decide(100.0)
    assert list(driver.starting.values()) == [(ONE_CORE, 100.0)]
    # The worker exits at once (no connection file): a failed start, with the exit status.
    poll_until(driver, 100.5, lambda: driver.ledger.counters.launch_failures == 1, "the failed start")
    assert not driver.starting and "failed exit status 2" in driver.failures[-1][1]
    log = next((tmp_path / "workers").glob("*.log"))
    assert "no connection file" in log.read_text()
    # the reason says why in the worker's own words, and where its log is
    assert "no connection file" in driver.failures[-1][1] and f"its log: {log}" in driver.failures[-1][1]
    driver.decide(101.0)                       # within the 2 s back-off: nothing launched
    launch = driver.status(101.0)["launch"]
    assert not driver.starting and launch["state"] == "backing-off" and launch["retry_in_s"] == 1.5
    assert launch["retry_at"] == local_time(102.5) and "failed exit status 2" in launch["reason"]
    driver.decide(102.6)                       # past it: tried again
    assert len(driver.starting) == 1
    [first, second] = driver.status(102.6, allocations=True)["allocations"]
    assert first["state"] == "failed" and "exit status 2" in first["reason"] and first["ended"]
    assert second["state"] == "submitted" and second["job_id"] is None


def test_the_breaker_stops_local_launches_too_until_resumed(tmp_path, backend):
    driver = driver_for(tmp_path, backend, tmp_path / "no-such-connection.json",
                        LaunchSettings(backoff_s=0, breaker=2, breaker_cooldown_s=600))
    for now in (0.0, 1.0):
        driver.decide(now)
        poll_until(driver, now + 0.5, lambda: not driver.starting, "the failed start")
    driver.decide(2.0)
    st = driver.status(2.0)["launch"]
    assert not driver.starting and st["state"] == "stopped" and st["retry_at"] == local_time(601.0)
    assert driver.control("resume", 3.0) == "launches resumed"
    driver.decide(3.0)
    assert len(driver.starting) == 1
    driver.control("pause", 4.0)
    poll_until(driver, 4.5, lambda: not driver.starting, "the failed start")
    driver.decide(1000.0)
    st = driver.status(1000.0)
    assert not driver.starting and st["launch"]["state"] == "paused"
    assert st["pool"].endswith("; launches paused"), st["pool"]     # not a bare 'ok' while held back
    with pytest.raises(ValueError, match="pause or resume"):
        driver.control("reboot", 1000.0)


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
    assert ledger.policy.pending_count == 1 and ledger.attempt_of(spec.id) == (1, None)
    lost = [r for r in ledger.workers.log if r[1] == "lost"]
    assert lost and lost[0][2:4] == ["w1", handle]
    # It died 0.5 s after joining, well within healthy_after_s: for the launch throttle a failed start.
    assert ledger.counters.launch_failures == 1 and "after its worker joined" in driver.failures[-1][1]


def test_a_worker_that_stayed_is_a_good_start(tmp_path, backend):
    # A connection file whose coordinator never answers: the worker process runs, registering in vain.
    conn = tmp_path / "connection.json"
    ConnectionInfo("tcp://127.0.0.1:9", "tcp://127.0.0.1:9", run_dir=str(tmp_path)).write(conn)
    driver = driver_for(tmp_path, backend, conn, LaunchSettings(backoff_s=60, healthy_after_s=5))
    driver.throttle.failed(0.0, "an earlier failure")
    assert driver.status(0.0)["launch"]["state"] == "backing-off"
    driver.throttle.resume(0.0)
    driver.decide(0.0)
    [handle] = driver.starting
    driver.throttle.failed(0.1, "an earlier failure")      # backing off again ...
    w = driver.ledger.add_worker(WorkerInfo(id="w1", cores=1, handle=handle), b"w1", 0.5)
    driver.joined(w)
    driver.tick(5.4)
    assert driver.status(5.4)["launch"]["state"] == "backing-off"
    driver.tick(5.5)                                         # ... until the worker has stayed 5 s
    assert driver.status(5.5)["launch"]["state"] == "ok"
    [rec] = driver.status(5.5, allocations=True)["allocations"]
    assert rec["worker"] == "w1" and rec["state"] == "running" and rec["joined"] == local_time(0.5)
    backend.reclaim(handle)
    poll_until(driver, 6.0, lambda: driver.ledger.workers.get("w1") is None, "the worker to go")
    assert driver.ledger.counters.launch_failures == 0       # it had served: not a failed start


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


def test_a_stopping_coordinator_cancels_the_jobs_that_have_not_joined(tmp_path, backend):
    """Before it waits for its registered workers to leave, a stopping coordinator cancels the
    launches still starting: none may come up after it and hold its allocation."""
    conn = tmp_path / "connection.json"
    ConnectionInfo("tcp://127.0.0.1:9", "tcp://127.0.0.1:9", run_dir=str(tmp_path)).write(conn)
    driver = driver_for(tmp_path, backend, conn)
    driver.decide(0.0)
    [handle] = driver.starting
    proc = backend._procs[handle]
    assert proc.poll() is None                    # running, registering in vain
    driver.cancel_starting(1.0)
    assert not driver.starting
    proc.wait(20)                                 # ended (TimeoutExpired otherwise)
    assert proc.returncode is not None
    [rec] = driver.status(1.0, allocations=True)["allocations"]
    assert "cancelled before it joined" in rec["reason"]
