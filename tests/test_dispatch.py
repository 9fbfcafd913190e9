"""The client -> coordinator -> worker -> client path with several clients and workers."""
import asyncio
import os
import threading
import time

import pytest

from tangram_hpc import ActionSpec, AsyncClient, Client, Demand, Status, function, sandbox


def test_function_and_sandbox_actions(client):
    r = client.submit(function("math:factorial", 10)).result(10)
    assert r.ok and r.output == 3628800 and r.attempts == 1 and r.worker
    assert r.submitted <= r.started <= r.finished
    r = client.submit(sandbox("echo hello; exit 3")).result(10)
    assert r.status == Status.FAILED and r.output["stdout"] == "hello\n" and r.output["returncode"] == 3


def test_ten_thousand_noops_from_four_clients(cluster):
    results = {}

    def run(k):
        with cluster.client() as c:
            specs = [function("tangram_hpc.handlers:noop", k * 100_000 + i) for i in range(2500)]
            results[k] = (specs, c.map(specs, timeout=300))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    workers = set()
    for k, (specs, res) in results.items():
        assert [r.id for r in res] == [s.id for s in specs]
        assert [r.output for r in res] == [k * 100_000 + i for i in range(2500)]
        assert all(r.ok and r.attempts == 1 for r in res)
        workers |= {r.worker for r in res}
    assert len(workers) == 2  # both workers served


def test_exception_in_function_is_a_failed_result(client):
    r = client.submit(function("json:loads", "{not json")).result(10)
    assert r.status == Status.FAILED and "JSONDecodeError" in r.error


def test_unknown_function_is_a_clear_error(client):
    r = client.submit(function("no_such_module_xyz:f")).result(10)
    assert r.status == Status.ERROR and "cannot load no_such_module_xyz:f" in r.error


def test_environment_keeps_files_between_actions(client):
    env = "env-" + os.urandom(4).hex()
    assert client.submit(sandbox("echo state > f.txt", env=env)).result(10).ok
    r = client.submit(sandbox("cat f.txt", env=env)).result(10)
    assert r.ok and r.output["stdout"] == "state\n"
    other = client.submit(sandbox("cat f.txt", env=env + "-other")).result(10)
    assert other.status == Status.FAILED


def test_action_gets_the_cores_it_was_granted(client):
    code = "import os; print(len(os.sched_getaffinity(0)), os.environ['TANGRAM_NCPUS'])"
    r = client.submit(sandbox(["python3", "-c", code], cores=2)).result(10)
    assert r.ok and r.cores == 2
    assert r.output["stdout"].split() == [str(min(2, os.cpu_count())), "2"]


def test_timeout_kills_the_action(client):
    r = client.submit(ActionSpec(kind="sandbox", payload={"cmd": "sleep 30"}, timeout=0.5)).result(20)
    assert r.status == Status.TIMEOUT


def test_cancel_pending_and_running(client):
    blockers = client.submit_many([sandbox("sleep 1.5", cores=2) for _ in range(2)])
    time.sleep(0.3)   # the blockers hold every core (a known-short command would otherwise go first)
    spec = sandbox("echo never")
    victim = client.submit(spec)
    time.sleep(0.3)
    client.cancel(spec.id)
    r = victim.result(10)
    assert r.status == Status.CANCELLED and r.output is None
    assert all(f.result(10).ok for f in blockers)


def test_cancel_kills_a_running_command(client):
    spec = sandbox("sleep 30")
    fut = client.submit(spec)
    deadline = time.time() + 10
    while client.status()["running"] == 0 and time.time() < deadline:
        time.sleep(0.05)
    t0 = time.time()
    client.cancel(spec.id)
    r = fut.result(10)
    assert r.status == Status.CANCELLED and "process tree killed" in r.error
    assert time.time() - t0 < 5


def test_idempotency_key_runs_once(client):
    key = "idem-" + os.urandom(4).hex()
    a = client.submit(ActionSpec(kind="function", payload={"fn": "os:urandom", "args": [8]}, idempotency_key=key))
    b = client.submit(ActionSpec(kind="function", payload={"fn": "os:urandom", "args": [8]}, idempotency_key=key))
    ra, rb = a.result(10), b.result(10)
    assert ra.ok and rb.ok and ra.id != rb.id and ra.output == rb.output


def test_resubmitting_a_finished_action_returns_the_same_result(cluster):
    spec = function("os:urandom", 8)
    with cluster.client() as c1:
        first = c1.submit(spec).result(10)
    with cluster.client() as c2:
        again = c2.submit(spec).result(10)
    assert again.output == first.output and again.worker == first.worker


def test_demand_no_worker_shape_can_hold_fails_with_the_reason(client):
    r = client.submit(ActionSpec(kind="sandbox", payload={"cmd": "true"}, demand=Demand(64, 64))).result(10)
    assert r.status == Status.ERROR and "cannot be placed" in r.error


def test_async_client(cluster):
    async def go():
        async with AsyncClient(connection_file=str(cluster.connection_file)) as c:
            one = await c.submit(function("math:sqrt", 16))
            many = await c.map([function("math:sqrt", x * x) for x in range(50)])
            return one, many
    one, many = asyncio.run(go())
    assert one.output == 4.0
    assert [r.output for r in many] == [float(x) for x in range(50)]


def test_status_lists_workers(client):
    st = client.status()
    assert len(st["workers"]) == 2 and all(w["cores"] == 2 for w in st["workers"])
    assert st["completed"] > 0
