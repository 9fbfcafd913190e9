"""Scheduler-driven prefetch (issue 36): the policy's decision, the simulator and the coordinator's
ledger agreeing on it, the PREFETCH message at the edge, and a live reward worker loading ahead."""
from __future__ import annotations

import os
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from tangram_hpc import protocol as P
from tangram_hpc.actions import ActionSpec, Demand
from tangram_hpc.policy.elastic import ElasticScheduler
from tangram_hpc.policy.fifo import FifoPolicy
from tangram_hpc.policy.prefetch import Prefetch
from tangram_hpc.resources import ServiceInfo, WorkerInfo

MODELS = Path(__file__).parent / "fixtures" / "models"


def _gpu_worker(wid: str = "g1", gpu_mem_mb: int = 10_000) -> WorkerInfo:
    return WorkerInfo(wid, 1, 0, 1, gpu_mem_mb, kinds=frozenset({"reward"}), services=frozenset("abcx"))


def _call(aid: str, service: str) -> ActionSpec:
    """A reward call that binds the worker's one core, so the calls behind it wait."""
    return ActionSpec("reward", {"inputs": [aid]}, demand=Demand(1, 1, 0, 0, service), id=aid)


def _policy(make=FifoPolicy, sizes: dict[str, int] | None = None, worker_mb: int = 10_000):
    """A policy with one GPU worker and nothing resident on it yet; services declared after the worker
    joined, so that it starts empty."""
    pol = make(prefetch=Prefetch())
    pol.add_worker(_gpu_worker(gpu_mem_mb=worker_mb), 0.0)
    pol.set_services({s: ServiceInfo(mb, load_s=5.0) for s, mb in (sizes or dict.fromkeys("abcx", 4000)).items()})
    return pol


def test_the_service_the_queue_needs_next_is_prefetched_onto_the_busy_worker():
    pol = _policy()
    for aid, svc in (("1", "a"), ("2", "c"), ("3", "b")):
        pol.submit(_call(aid, svc), 0.0)
    [start] = pol.schedule(0.0)
    assert (start.action_id, start.worker_id) == ("1", "g1")     # the core is taken: c and b wait
    assert pol.prefetches(0.0) == [("g1", "c")]                  # c's call was submitted before b's
    assert pol.resident_services("g1") == {"a", "c"}              # counted as loading there
    assert pol.prefetches(1.0) == []         # one prefetch at a time per worker, until it is due
    pol.finished("1", 2.0, run_time=2.0)
    [nxt] = pol.schedule(2.0)
    assert (nxt.action_id, nxt.worker_id) == ("2", "g1")          # c's call goes where c loads
    assert pol.prefetch_counts() == {"issued": 1, "used": 1, "wasted": 0, "open": 0}


def test_the_elastic_scheduler_prefetches_the_same_way():
    pol = _policy(ElasticScheduler)
    pol.submit(_call("1", "a"), 0.0)
    pol.submit(_call("2", "b"), 0.0)
    assert [s.action_id for s in pol.schedule(0.0)] == ["1"]
    assert pol.prefetches(0.0) == [("g1", "b")]


def test_a_service_queued_work_needs_is_never_evicted_for_a_prefetch():
    # a (running) and b (idle, but a call waits for it) fill the worker; c's call came last
    pol = _policy(sizes={"a": 5000, "b": 5000, "c": 5000})
    pol.submit(_call("1", "a"), 0.0)
    pol.schedule(0.0)
    pol.update_worker("g1", services=frozenset({"a", "b"}), now=0.0)    # the worker reports b resident too
    pol.submit(_call("2", "b"), 1.0)
    pol.submit(_call("3", "c"), 1.0)
    assert pol.schedule(1.0) == []
    assert pol.prefetches(1.0) == []
    assert pol.resident_services("g1") == {"a", "b"}
    # once nothing waits for b any more, the idle b is what c's prefetch may evict
    pol.cancel("2")
    assert pol.prefetches(2.0) == [("g1", "c")]
    assert pol.resident_services("g1") == {"a", "c"}


def test_no_prefetch_when_memory_is_short():
    pol = _policy(sizes={"a": 6000, "b": 6000, "x": 12_000})
    pol.submit(_call("1", "a"), 0.0)
    pol.schedule(0.0)
    pol.submit(_call("2", "b"), 0.0)
    pol.submit(_call("3", "x"), 0.0)
    # b does not fit beside the running a, and x fits the worker not at all
    assert pol.prefetches(0.0) == []
    assert pol.prefetch_counts()["issued"] == 0


def test_a_prefetch_lost_with_its_worker_counts_as_wasted():
    pol = _policy()
    pol.submit(_call("1", "a"), 0.0)
    pol.submit(_call("2", "b"), 0.0)
    pol.schedule(0.0)
    assert pol.prefetches(0.0) == [("g1", "b")]
    pol.remove_worker("g1", 1.0)
    assert pol.prefetch_counts() == {"issued": 1, "used": 0, "wasted": 1, "open": 0}


def test_a_policy_without_prefetch_asks_for_none():
    pol = FifoPolicy()
    pol.add_worker(_gpu_worker(), 0.0)
    pol.set_services({"a": ServiceInfo(4000), "b": ServiceInfo(4000)})
    pol.submit(_call("1", "a"), 0.0)
    pol.submit(_call("2", "b"), 0.0)
    pol.schedule(0.0)
    assert pol.prefetches(0.0) == [] and pol.prefetch_counts() is None


# -- the simulator and the coordinator's ledger issue the same prefetches ---------------------

_SCRIPT = """
format_version = 2
name = "three-services"
description = "one GPU worker with one slot, three services that do not all fit, called in turn"
seed = 3
[rollout]
steps = 1
trajectories_per_step = 6
turns = { min = 1, max = 1 }
think_s = { median = 1.0, sigma = 0.5 }
[cluster]
cpu_workers = 1
cpu_cores = 4
gpu_workers = 1
gpus = 1
gpu_mem_mb = 10000
gpu_slots = 1
startup_s = 0
[[services]]
name = "a"
gpu_mem_mb = 4000
load_s = 5
[[services]]
name = "b"
gpu_mem_mb = 4000
load_s = 5
[[services]]
name = "c"
gpu_mem_mb = 4000
load_s = 5
[[actions]]
name = "tool"
kind = "function"
weight = 1.0
duration_s = { median = 1.0, sigma = 0.2 }
[[actions]]
name = "ra"
kind = "reward"
service = "a"
final = 1
duration_s = { median = 4.0, sigma = 0.2 }
[[actions]]
name = "rb"
kind = "reward"
service = "b"
final = 1
duration_s = { median = 4.0, sigma = 0.2 }
[[actions]]
name = "rc"
kind = "reward"
service = "c"
final = 1
duration_s = { median = 4.0, sigma = 0.2 }
"""


@pytest.mark.parametrize("make", [FifoPolicy, ElasticScheduler])
@pytest.mark.parametrize("seed", [1, 3])
def test_the_simulator_and_the_ledger_issue_the_same_prefetches(make, seed):
    from tangram_hpc.sim.engine import service_infos, simulate
    from tangram_hpc.sim.ledger_driver import simulate_through_ledger
    from tangram_hpc.sim.workload import Plan, _toml_loads, parse_workload

    w = parse_workload(_toml_loads(_SCRIPT))
    plan = Plan.sample(w, seed=seed)
    fast = simulate(plan, make(services=service_infos(w), prefetch=Prefetch()))
    live = simulate_through_ledger(plan, make(services=service_infos(w), prefetch=Prefetch()))
    assert fast.prefetched, "the script is meant to make the policy prefetch"
    assert live.prefetched == fast.prefetched
    assert np.allclose(live.finish, fast.finish)
    # and a prefetch is worth its load: the same plan without it ends no sooner
    without = simulate(plan, make(services=service_infos(w)))
    assert without.prefetched == [] and fast.makespan <= without.makespan


# -- PREFETCH at the edge -------------------------------------------------------------------

@pytest.mark.parametrize("body", [[1], [""], ["x" * 1000], [None], [["a"]], ["a"] * (P.MAX_PREFETCH + 1)])
def test_a_malformed_prefetch_body_is_refused(body):
    with pytest.raises(P.ProtocolError):
        P.check_prefetch(body)


def test_a_prefetch_frame_of_the_wrong_shape_is_refused_at_decoding():
    frame = msgpack.packb([P.PROTOCOL_VERSION, P.PREFETCH, {"a": 1}])
    with pytest.raises(P.ProtocolError):
        P.decode(frame, frozenset({P.PREFETCH}))


def test_the_worker_drops_a_malformed_prefetch_and_the_names_it_does_not_host(caplog):
    from types import SimpleNamespace

    from tangram_hpc.worker import Worker
    asked: list = []
    worker = SimpleNamespace(services=SimpleNamespace(service_names=frozenset({"a", "b"}), preload=asked.append))
    Worker._on_prefetch(worker, [{"x": 1}])
    Worker._on_prefetch(worker, ["a", "not-hosted", "b"])
    assert asked == [["a", "b"]]
    assert "bad PREFETCH" in caplog.text


# -- a live reward worker loads ahead ------------------------------------------------------

def _wait_for(what, fn, deadline_s: float = 60.0):
    deadline = time.monotonic() + deadline_s
    while True:
        v = fn()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_prefetch_makes_the_next_call_find_its_service_resident(tmp_path, monkeypatch):
    from tangram_hpc import LocalCluster

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(MODELS), os.environ.get("PYTHONPATH")])))
    gate = tmp_path / "gate"
    opt = f"gate_models:gated,memory_mb=40,gate={gate},max_wait_ms=1"
    services = [f"{n}={opt}" for n in ("a", "b", "c")]
    # room for two of the three: the worker starts with two resident and the third on the host
    with LocalCluster(workers=0, reward_workers=1, services=services, run_dir=tmp_path / "run",
                      extra_args=["--service-budget-mb", "100"]) as cl, cl.client() as c:
        def worker():
            return c.status()["workers"][0]

        def resident() -> list[str]:
            return [s for d in worker()["devices"] for s in d["resident"]]

        _wait_for("two services resident", lambda: len(resident()) == 2 and worker())
        busy = resident()[0]
        [cold] = sorted(set("abc") - set(resident()))
        held = c.submit(ActionSpec("reward", {"inputs": ["wait"]}, demand=Demand(1, 1, 0, 0, busy)))
        _wait_for("the held call running", lambda: c.status()["running"] == 1)
        nxt = c.submit(ActionSpec("reward", {"inputs": ["go"]}, demand=Demand(1, 1, 0, 0, cold)))
        # the worker's one core is taken: the call waits, and its service is loaded meanwhile
        _wait_for("the prefetched service resident", lambda: cold in resident())
        st = c.status()
        assert st["pending"] == 1 and st["prefetch"]["issued"] == 1 and st["prefetch"]["used"] == 0
        assert busy in resident()                   # the running call's service was not evicted
        gate.touch()
        assert held.result(60).ok
        r = nxt.result(60)
        assert r.ok and r.output == [1.0]
        st = c.status()
        assert st["prefetch"] == {"issued": 1, "used": 1, "wasted": 0, "open": 0}
        assert cold in resident()
        # PREFETCH goes from the coordinator to workers only: sent to it, it is refused, and it serves on
        for address in (cl_info(cl).worker_address, cl_info(cl).client_address):
            _refused(address, cl_info(cl), P.encode(P.PREFETCH, [cold]))
        assert c.submit(ActionSpec("reward", {"inputs": ["again"]}, demand=Demand(1, 1, 0, 0, cold))).result(60).ok
        assert worker()["id"] == st["workers"][0]["id"]


def cl_info(cl):
    from tangram_hpc.connection import ConnectionInfo
    return ConnectionInfo.read(cl.connection_file)


def _refused(address: str, info, frame: bytes) -> None:
    import zmq

    from tangram_hpc.security import CurveKeys
    s = zmq.Context.instance().socket(zmq.DEALER)
    CurveKeys.apply_client(s, info)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    try:
        s.send(frame)
        assert s.poll(30_000), "no answer to a frame of the wrong direction"
        mtype, body = P.decode(s.recv(), frozenset({P.ERROR}))
        assert mtype == P.ERROR and body["code"] == "unknown_type", body
    finally:
        s.close(0)
