"""Nothing is lost: worker SIGKILL, a poison action, coordinator restart with clients connected."""
import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from support import wait_until
from tangram_hpc import AsyncClient, Client, Status, function, sandbox
from tangram_hpc.connection import wait_for_file
from tangram_hpc.launch import LocalCluster

pytestmark = pytest.mark.slow


def _exactly_once(futures, specs, timeout=120):
    results = Client.gather(futures, timeout=timeout)
    assert [r.id for r in results] == [s.id for s in specs]
    return results


def test_sigkill_worker_mid_action_loses_nothing(tmp_path):
    # a killed worker is found by its closed connection or its exit; the heartbeat deadline is a
    # fallback, generous so that a loaded machine does not lose the other worker too
    with LocalCluster(workers=2, cores=2, run_dir=tmp_path, extra_args=["--worker-timeout", "10"]) as cl, \
            cl.client() as c:
        specs = [sandbox(f"sleep 1; echo {i}") for i in range(12)]
        futs = c.submit_many(specs)
        victim = wait_until(lambda: next((w for w in c.status()["workers"] if w["running"] > 0), None), 120, 0.05,
                            "a worker running actions")
        os.kill(victim["pid"], signal.SIGKILL)
        results = _exactly_once(futs, specs)
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        assert [r.output["stdout"] for r in results] == [f"{i}\n" for i in range(12)]
        retried = [r for r in results if r.attempts > 1]
        assert retried and all(r.worker != victim["id"] for r in retried)
        st = c.status()
        assert st["workers_lost"] == 1 and st["retried"] == len(retried)
        # the static pool replaces the lost worker
        cl.wait_for_workers(2, timeout=30)


def test_poison_action_fails_after_max_attempts_and_pool_survives(tmp_path):
    with LocalCluster(workers=2, cores=1, run_dir=tmp_path,
                      extra_args=["--worker-timeout", "3", "--max-attempts", "2"]) as cl, cl.client() as c:
        poison = c.submit(function("os:_exit", 9))
        r = poison.result(60)
        assert r.status == Status.ERROR and r.attempts == 2
        assert "gave up after 2 attempts" in r.error and "exit status 9" in r.error
        cl.wait_for_workers(2, timeout=30)
        assert c.submit(function("math:sqrt", 4)).result(30).output == 2.0


def _coordinator(run_dir, *extra):
    return subprocess.Popen([sys.executable, "-m", "tangram_hpc.cli", "coordinator", "--run-dir", str(run_dir),
                             "--backend", "none", "--worker-timeout", "3", *extra],
                            stdout=open(run_dir / "coord.log", "ab"), stderr=subprocess.STDOUT)


def test_coordinator_restart_with_clients_connected(tmp_path):
    conn = tmp_path / "connection.json"
    coord = _coordinator(tmp_path)
    workers = []
    try:
        wait_for_file(conn, 30)
        workers = [subprocess.Popen([sys.executable, "-m", "tangram_hpc.worker", "--connection-file", str(conn),
                                     "--cores", "2"], stdout=open(tmp_path / f"w{i}.log", "ab"),
                                    stderr=subprocess.STDOUT) for i in range(2)]
        with Client(connection_file=str(conn)) as c:
            deadline = time.time() + 30
            while len(c.status()["workers"]) < 2:
                assert time.time() < deadline
                time.sleep(0.1)
            specs = [function("time:sleep", 0.3) for _ in range(30)]
            futs = c.submit_many(specs)
            time.sleep(0.5)
            done_before = sum(f.done() for f in futs)
            coord.kill()
            coord.wait()
            coord = _coordinator(tmp_path)      # same run dir: same connection file and ports
            results = _exactly_once(futs, specs, timeout=120)
            assert all(r.status == Status.OK for r in results), [r.error for r in results if not r.ok]
            assert done_before < len(specs)
            assert c.resubmissions > 0
            st = c.status()
            assert len(st["workers"]) == 2      # workers found the new coordinator by themselves
    finally:
        coord.kill()
        for w in workers:
            w.kill()


def test_coordinator_restart_with_an_async_client_connected(tmp_path):
    conn = tmp_path / "connection.json"
    coord = _coordinator(tmp_path)
    worker = None
    try:
        wait_for_file(conn, 30)
        worker = subprocess.Popen([sys.executable, "-m", "tangram_hpc.worker", "--connection-file", str(conn),
                                   "--cores", "2"], stdout=open(tmp_path / "w.log", "ab"), stderr=subprocess.STDOUT)

        async def scenario():
            nonlocal coord
            async with AsyncClient(connection_file=str(conn)) as c:
                deadline = time.time() + 30
                while len((await c.status())["workers"]) < 1:
                    assert time.time() < deadline
                    await asyncio.sleep(0.1)
                specs = [function("time:sleep", 0.3) for _ in range(12)]
                futs = [c.submit_nowait(s) for s in specs]
                await asyncio.sleep(0.5)
                coord.kill()
                coord.wait()
                coord = _coordinator(tmp_path)   # same ports and keys: the client follows by itself
                results = await asyncio.wait_for(asyncio.gather(*futs), 120)
                assert [r.id for r in results] == [s.id for s in specs]
                assert all(r.ok for r in results), [r.error for r in results if not r.ok]
                assert c.resubmissions > 0 and c.outstanding == 0

        asyncio.run(scenario())
    finally:
        coord.kill()
        if worker is not None:
            worker.kill()


@pytest.mark.slow
def test_a_reward_model_whose_score_never_returns_makes_its_worker_leave_for_a_fresh_one(tmp_path, monkeypatch):
    from tangram_hpc import reward
    models = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "models")
    monkeypatch.setenv("PYTHONPATH", models + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = tmp_path / "tangram.toml"
    # short graces: the stuck call's timeout and the worker's leaving are what this shows, not their waits
    cfg.write_text("[coordinator]\ntimeout_grace_s = 0.5\n[worker]\nstuck_leave_s = 2\nleave_grace_s = 0.5\n")
    with LocalCluster(workers=0, reward_workers=1, services=["judge=stuck_models:hangs,memory_mb=1,max_wait_ms=1"],
                      run_dir=tmp_path / "run", extra_args=["--config", str(cfg)]) as cl, cl.client() as c:
        first = c.status()["workers"][0]["id"]
        stuck = c.submit(reward("judge", ["hang"], timeout=1.0)).result(60)
        assert stuck.status == "timeout"
        # the device's only scoring thread is held for good: the worker leaves and a fresh one serves
        later = c.submit(reward("judge", ["fine"], timeout=60)).result(90)
        assert later.ok and later.output == [4.0] and later.worker != first, later
        st = c.status()
        assert first not in [w["id"] for w in st["workers"]]


class _StuckOnDevice:
    """A reward model that scores, but once placed cannot be moved again."""

    placed = False

    def score(self, inputs):
        return [0.5 for _ in inputs]

    def to(self, device):
        if self.placed:
            raise RuntimeError("device busy")
        self.placed = True


def test_a_failed_eviction_is_logged_and_the_model_reloaded_when_next_used(caplog):
    import threading

    from tangram_hpc.managers.devices import Device
    from tangram_hpc.managers.service_spec import ServiceSpec
    from tangram_hpc.managers.services import ServiceManager
    done: dict = {}
    cv = threading.Condition()

    def record(aid, status, output, error, _stats=None):
        with cv:
            done[aid] = status
            cv.notify_all()

    specs = [ServiceSpec(n, _StuckOnDevice, memory_mb=3, max_batch=1, max_wait_ms=1) for n in ("a", "b")]
    with caplog.at_level("ERROR", logger="tangram_hpc.managers.services"), \
            ServiceManager(specs, [Device("cpu", 4.0)]) as mgr:     # room for one of the two
        for i, name in enumerate("aba"):
            mgr.submit(f"{name}{i}", name, [{"response": "x"}], record)
            with cv:
                assert cv.wait_for(lambda: f"{name}{i}" in done, 60)
        stats = mgr.stats()
    assert set(done.values()) == {Status.OK}
    assert any("service a: eviction from cpu failed" in r.getMessage() and r.exc_info for r in caplog.records)
    assert stats["a"]["cold_loads"] == 2      # its weights were dropped, so the loader ran again


def test_a_torn_journal_tail_is_logged_and_the_records_before_it_kept(tmp_path, caplog):
    import msgpack

    from tangram_hpc.managers.env_snapshots import _read_journal
    rec = ["a", 1, Status.OK, None, None, 0.0, 1.0]
    path = tmp_path / "journal"
    path.write_bytes(msgpack.packb(rec) + msgpack.packb(rec)[:-3])
    with caplog.at_level("WARNING", logger="tangram_hpc.managers.env_snapshots"):
        assert _read_journal(path) == [rec]
    assert [r.getMessage() for r in caplog.records if "torn last record" in r.getMessage()]
    path.write_bytes(msgpack.packb(rec) * 2)
    caplog.clear()
    assert _read_journal(path) == [rec, rec] and not caplog.records
