"""Environments survive a coordinator restart: killed (SIGKILL) and restarted on the same run directory
with its workers still up, and stopped (SIGTERM) and restarted on a new run directory with the same
connection file, as scripts/launch-coordinator.sh does.  Every action appends its id to its
environment's log; each log must end up holding each ok action's id exactly once."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tangram_hpc import Client, sandbox
from tangram_hpc.connection import ConnectionInfo
from tangram_hpc.managers.bwrap import probe_bwrap
from support import sleeping, unique_sleep, wait_until

pytestmark = [
    pytest.mark.slow, pytest.mark.sandbox,
    pytest.mark.skipif(probe_bwrap(shutil.which("bwrap") or "") is not None, reason="bubblewrap missing"),
]

REPO = Path(__file__).resolve().parents[1]


def _popen(args, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)


def _coordinator(run_dir: Path, conn: Path, *extra: str) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    return _popen([sys.executable, "-m", "tangram_hpc.cli", "coordinator", "--run-dir", str(run_dir),
                   "--connection-file", str(conn), "--worker-timeout", "3", *extra], run_dir / "coord.log")


def _wait_coordinator(conn: Path, old_id: str | None = None) -> None:
    def fresh():
        try:
            return ConnectionInfo.read(conn).coordinator_id != old_id
        except (OSError, ValueError):
            return False
    wait_until(fresh, 30, 0.05, "the coordinator's connection file")


def _append(env: str, seconds: float = 0.3):
    spec = sandbox(f"sleep {seconds} && echo $ACTION >> log.txt", env=env)
    spec.payload["environ"] = {"ACTION": spec.id}
    return spec


def _check_logs(c: Client, results_by_env: dict[str, list]) -> None:
    for env, results in results_by_env.items():
        r = c.submit(sandbox("cat log.txt", env=env)).result(60)
        assert r.ok, (env, r.error)
        lines = Counter(r.output["stdout"].split())
        for res in results:
            assert res.ok, (env, res.status, res.error)
            assert lines[res.id] == 1, (env, res.id, lines[res.id], res.attempts, res.env_state)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_coordinator_killed_and_restarted_on_the_same_run_dir_keeps_environments(tmp_path):
    run, conn = tmp_path / "run", tmp_path / "run" / "connection.json"
    coord = _coordinator(run, conn, "--backend", "none")
    procs = [coord]
    try:
        _wait_coordinator(conn)
        for i in range(2):
            procs.append(_popen([sys.executable, "-m", "tangram_hpc.worker", "--connection-file", str(conn),
                                 "--cores", "2"], tmp_path / f"w{i}.log"))
        envs = [f"e{i}" for i in range(6)]
        with Client(connection_file=str(conn)) as c:
            wait_until(lambda: len(c.status()["workers"]) == 2, 30, 0.1, "two workers")
            # Submitted together, so the environments spread over both workers.
            first = dict(zip(envs, ([r] for r in Client.gather(c.submit_many([_append(e, 0.3) for e in envs]), 60))))
            assert len({r[0].worker for r in first.values()}) == 2
            # Slow actions in flight when the coordinator dies: they finish on their workers meanwhile.
            flight = {e: c.submit(_append(e, 1.5)) for e in envs}
            wait_until(lambda: c.status()["running"] >= 3, 30, 0.05, "actions running")
            old = ConnectionInfo.read(conn).coordinator_id
            coord.send_signal(signal.SIGKILL)
            coord.wait()
            time.sleep(2.0)                                  # they finish with nobody to tell
            coord = _coordinator(run, conn, "--backend", "none")
            procs.append(coord)
            _wait_coordinator(conn, old)
            results = {e: first[e] + [flight[e].result(90)] for e in envs}
            st = c.status()
            assert st["environments"].get("live", 0) == len(envs)     # every copy kept where it was
            states = Counter(r.env_state for e in envs for r in results[e][1:])
            # Their outcomes came back with the workers (OUTCOMES), or from the environments' journals.
            assert set(states) <= {"created", "kept", "replayed"}, [(r.env_state, r.error) for e in envs
                                                                    for r in results[e][1:]]
            assert all(r.attempts <= 2 for e in envs for r in results[e])
            _check_logs(c, results)
    finally:
        _stop(*procs)


def test_coordinator_stopped_and_restarted_on_a_new_run_dir_keeps_environments(tmp_path):
    conn = tmp_path / "shared" / "coordinator.json"
    conn.parent.mkdir()
    coord = _coordinator(tmp_path / "runs" / "1", conn, "--workers", "1", "--worker-cores", "2")
    try:
        _wait_coordinator(conn)
        envs = [f"e{i}" for i in range(4)]
        with Client(connection_file=str(conn), reconnect_after_s=1.0) as c:
            wait_until(lambda: len(c.status()["workers"]) == 1, 30, 0.1, "the worker")
            results = {e: [c.submit(_append(e, 0.05)).result(60)] for e in envs}
            flight = {e: c.submit(_append(e, 0.5)) for e in envs}
            wait_until(lambda: c.status()["running"] >= 1, 30, 0.05, "actions running")
            old = ConnectionInfo.read(conn).coordinator_id
            coord.send_signal(signal.SIGTERM)   # as the job's trap does: the workers save what they hold
            assert coord.wait(60) == 0
            state = conn.with_name("coordinator.state")
            assert sorted(p.name.split("-g")[0][:2] for p in (state / "snapshots").iterdir()) == envs
            coord = _coordinator(tmp_path / "runs" / "2", conn, "--workers", "1", "--worker-cores", "2")
            _wait_coordinator(conn, old)
            for e in envs:
                results[e].append(flight[e].result(90))
            after = {e: c.submit(_append(e, 0.05)).result(60) for e in envs}
            for e in envs:
                # The first action of each environment under the new coordinator restored it: a slow
                # one resubmitted after the restart, or the one after it.
                assert [results[e][1].env_state, after[e].env_state] in (
                    ["kept", "restored"], ["restored", "kept"]), (e, results[e][1], after[e])
                results[e].append(after[e])
            _check_logs(c, results)
            assert not any((state / "snapshots").iterdir())   # consumed by the restores
    finally:
        _stop(coord)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_ids(c: Client) -> list[str] | None:
    try:
        return [w["id"] for w in c.status(timeout=2)["workers"]]
    except TimeoutError:    # a request the killed coordinator took with it
        return None


def test_a_worker_started_by_hand_follows_its_coordinator_to_new_ports(tmp_path):
    """A coordinator killed and started again elsewhere (here: other ports, a new run directory, the
    same connection file and so the same state directory): the worker started by hand reads the new
    address from the connection file and joins it, environments and all."""
    conn = tmp_path / "shared" / "coordinator.json"
    conn.parent.mkdir()
    coord = _coordinator(tmp_path / "runs" / "1", conn, "--backend", "none")
    worker = None
    try:
        _wait_coordinator(conn)     # a worker started before the file exists exits at once
        worker = _popen([sys.executable, "-m", "tangram_hpc.worker", "--connection-file", str(conn),
                         "--cores", "2"], tmp_path / "w.log")
        with Client(connection_file=str(conn), reconnect_after_s=1.0) as c:
            wait_until(lambda: len(c.status()["workers"]) == 1, 30, 0.1, "the worker")
            wid = c.status()["workers"][0]["id"]
            first = c.submit(_append("e0", 0.05)).result(60)
            assert first.ok and first.worker == wid
            old = ConnectionInfo.read(conn)
            coord.send_signal(signal.SIGKILL)
            coord.wait()
            coord = _coordinator(tmp_path / "runs" / "2", conn, "--backend", "none",
                                 "--client-port", str(_free_port()), "--worker-port", str(_free_port()))
            _wait_coordinator(conn, old.coordinator_id)
            assert ConnectionInfo.read(conn).worker_address != old.worker_address
            wait_until(lambda: _worker_ids(c) == [wid], 60, 0.2, "the worker at the new address")
            after = c.submit(_append("e0", 0.05)).result(60)
            assert after.ok and after.worker == wid and after.env_state == "kept", after
            _check_logs(c, {"e0": [first, after]})
        assert worker.poll() is None
    finally:
        _stop(*(p for p in (coord, worker) if p is not None))


@pytest.mark.parametrize("how", ["future", "id"])
def test_an_action_cancelled_while_the_coordinator_is_down_does_not_take_effect(tmp_path, how):
    """Running in its environment when the coordinator is SIGKILLed, cancelled while it is down: the
    cancel reaches the restarted coordinator, which stops the attempt still running on the worker.

    The command sleeps far longer than the test may take (a sleep of its own, found by its
    argument), so whether it is stopped is a state to wait for, not a race with the restart."""
    nap = unique_sleep()
    run, conn = tmp_path / "run", tmp_path / "run" / "connection.json"
    coord = _coordinator(run, conn, "--backend", "none")
    worker = None
    try:
        _wait_coordinator(conn)
        worker = _popen([sys.executable, "-m", "tangram_hpc.worker", "--connection-file", str(conn),
                         "--cores", "1"], tmp_path / "w.log")
        with Client(connection_file=str(conn), reconnect_after_s=1.0) as c:
            wait_until(lambda: len(c.status()["workers"]) == 1, 30, 0.1, "the worker")
            assert c.submit(sandbox("echo first >> log.txt", env="e")).result(60).ok
            fut = c.submit(sandbox(f"sleep {nap} && echo CANCELLED-RAN >> log.txt", env="e"))
            wait_until(lambda: sleeping(nap), 120, 0.05, "the action's command running")
            old = ConnectionInfo.read(conn).coordinator_id
            coord.send_signal(signal.SIGKILL)
            coord.wait()
            if how == "future":
                assert fut.cancel()
            else:
                c.cancel(fut.action_id)
            coord = _coordinator(run, conn, "--backend", "none")
            _wait_coordinator(conn, old)
            if how == "id":
                assert fut.result(120).status == "cancelled"
            wait_until(lambda: not sleeping(nap), 120, 0.1, "the cancelled command stopped")
            log = c.submit(sandbox("cat log.txt", env="e")).result(120)
            assert log.ok and log.output["stdout"] == "first\n", log.output
    finally:
        _stop(*(p for p in (coord, worker) if p is not None))
