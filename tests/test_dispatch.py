"""The client -> coordinator -> worker -> client path with several clients and workers."""
import asyncio
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import as_completed

import pytest

from support import sleeping, unique_sleep, wait_until
from tangram_hpc import ActionSpec, AsyncClient, Demand, Status, function, reward, sandbox
from tangram_hpc.client import CoordinatorError


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


def test_results_larger_than_a_frame_in_total_all_arrive(client):
    """Results that fit one by one but not together: the worker's DONE and the coordinator's RESULT
    were one frame each, refused whole past the 16 MiB limit, and those futures never settled."""
    light = client.map([function("operator:mul", "x", 6_000_000, cores=0) for _ in range(6)], timeout=120)
    assert [len(r.output) for r in light] == [6_000_000] * 6, [r.error for r in light]
    many = client.map([function("operator:mul", "y", 100_000) for _ in range(400)], timeout=120)
    assert all(r.ok and len(r.output) == 100_000 for r in many)
    assert client.status()["bad_frames"] == 0 and not client.errors
    too_big = client.submit(function("operator:mul", "z", 9_000_000)).result(60)
    assert too_big.status == "failed" and "exceeds the limit of 8388608" in too_big.error


def test_timeout_kills_the_action(client):
    r = client.submit(ActionSpec(kind="sandbox", payload={"cmd": "sleep 30"}, timeout=0.5)).result(20)
    assert r.status == Status.TIMEOUT


def test_cancel_pending_and_running(client):
    blockers = client.submit_many([sandbox("sleep 5", cores=2) for _ in range(2)])
    # the blockers hold every core (a known-short command would otherwise go first)
    wait_until(lambda: client.status()["running"] == 2, 10, 0.05, "the blockers to run")
    spec = sandbox("echo never")
    victim = client.submit(spec)
    wait_until(lambda: client.status()["pending"] >= 1, 10, 0.05, "the victim to be queued")
    client.cancel(spec.id)
    r = victim.result(10)
    assert r.status == Status.CANCELLED and r.output is None
    assert all(f.result(10).ok for f in blockers)


def test_cancel_kills_a_running_command(client):
    nap = unique_sleep()        # found by its argument: whether it was killed is a state, not a time
    spec = sandbox(f"sleep {nap}")
    fut = client.submit(spec)
    wait_until(lambda: sleeping(nap), 60, 0.05, "the command to run")
    client.cancel(spec.id)
    r = fut.result(10)
    assert r.status == Status.CANCELLED and "cancelled while running" in r.error
    # Its core stays bound until the worker reports the killed command ended, which it does only
    # once the process tree was killed (the sleep would hold it for 15 minutes).
    wait_until(lambda: client.status()["zombie_cores"] == 0, 60, 0.05, "the killed command's core to be free")
    assert not sleeping(nap)


def _wait_until_nothing_runs(client, nap: str) -> None:
    """Nothing runs and no core is held, and the ``sleep nap`` command is gone: killed, since it
    would run for 15 minutes."""
    wait_until(lambda: not sleeping(nap), 60, 0.05, "the command to be killed")

    def idle() -> bool:
        st = client.status()
        return st["running"] == 0 and st["zombie_cores"] == 0
    wait_until(idle, 60, 0.05, "nothing to run and no core held")


def test_cancelling_a_future_cancels_its_action(client):
    nap = unique_sleep()
    fut = client.submit(sandbox(f"sleep {nap}"))
    wait_until(lambda: sleeping(nap), 60, 0.05, "the command to run")
    assert fut.cancel() and fut.cancelled() and fut.action_id
    _wait_until_nothing_runs(client, nap)       # killed, not left to run
    assert client.submit(function("math:sqrt", 4)).result(10).output == 2.0   # the client goes on


def test_an_asyncio_future_cancelled_by_its_caller_cancels_its_action(cluster, client):
    nap = unique_sleep()

    async def go():
        async with AsyncClient(connection_file=str(cluster.connection_file)) as c:
            fut = c.submit_nowait(sandbox(f"sleep {nap}"))
            deadline = time.monotonic() + 60
            while not sleeping(nap):
                assert time.monotonic() < deadline, "timed out waiting for the command to run"
                await asyncio.sleep(0.05)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(fut, 0.2)        # cancels the future on its timeout
    asyncio.run(go())
    _wait_until_nothing_runs(client, nap)


def test_ids_the_client_cannot_use_fail_alone_and_at_once(client):
    spec = sandbox("sleep 0.5")
    first = client.submit(spec)
    again = client.submit(spec)                                 # the same id while it is pending
    long = client.submit(ActionSpec(kind="function", payload={"fn": "math:sqrt", "args": [1]}, id="x" * 200))
    assert again.result(0).status == Status.ERROR and "already pending in this client" in again.result(0).error
    assert long.result(0).status == Status.ERROR and "at most 128 characters" in long.result(0).error
    assert first.result(10).ok and client.outstanding == 0


def test_an_id_two_clients_submit_is_answered_to_both(cluster):
    spec = sandbox("sleep 0.5; echo once")
    with cluster.client() as c1, cluster.client() as c2:
        a = c1.submit(spec)
        time.sleep(0.1)
        b = c2.submit(spec)
        ra, rb = a.result(10), b.result(10)
    assert ra.ok and rb.ok and ra.output["stdout"] == rb.output["stdout"] == "once\n" and ra.attempts == 1


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


def test_a_reward_call_with_no_service_worker_to_run_it_fails_with_the_reason(client):
    r = client.submit(reward("judge", [{"response": "a", "reference": "a"}])).result(10)
    assert r.status == Status.ERROR and "cannot be placed" in r.error and "no service workers" in r.error, r


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


def test_many_threads_waiting_at_once_each_get_their_own_results(client):
    # Threads take turns driving the socket; each must wake for its own result, never hang.
    errors: list = []

    def loop(t: int) -> None:
        try:
            for i in range(150):
                r = client.submit(function("tangram_hpc.handlers:noop", (t, i))).result(30)
                assert r.ok and r.output == [t, i], r
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(t,)) for t in range(12)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads) and not errors, errors


def test_results_reach_callbacks_and_as_completed_with_no_thread_waiting(client):
    specs = [function("tangram_hpc.handlers:noop", i) for i in range(200)]
    seen: list = []
    futs = client.submit_many(specs)
    for f in futs:
        f.add_done_callback(lambda f: seen.append(f.result(0).output))
    done = [f.result(0).output for f in as_completed(futs, timeout=30)]
    assert sorted(done) == list(range(200))
    wait_until(lambda: len(seen) == 200, 10, what="every callback")
    assert sorted(seen) == list(range(200))


def test_a_waiting_thread_times_out_and_the_client_still_works(client):
    slow = client.submit(function("time:sleep", 1.0))
    with pytest.raises(FutureTimeout):
        slow.result(0.05)
    assert client.submit(function("math:sqrt", 9)).result(10).output == 3.0
    assert slow.result(10).ok


def test_closing_fails_unresolved_futures_and_wakes_waiting_threads(cluster):
    c = cluster.client()
    fut = c.submit(function("time:sleep", 3))
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(_outcome(fut)))
    waiter.start()
    wait_until(lambda: c.outstanding == 1, 30, 0.01, "the action submitted")
    c.close()
    waiter.join(60)
    # woken by the close, not by the result (the call sleeps on): the close's error, not a result
    assert not waiter.is_alive()
    assert isinstance(got[0], CoordinatorError) and "closed" in str(got[0])
    with pytest.raises(CoordinatorError, match="closed"):
        c.submit(function("math:sqrt", 4))


def _outcome(fut):
    try:
        return fut.result(20)
    except Exception as e:
        return e


def test_an_async_client_left_open_after_its_loop_ended_does_not_hang_the_process(cluster):
    # Garbage collection of a client whose loop is gone must not block (a context waiting for its socket).
    script = (
        "import asyncio, gc, sys\n"
        "from tangram_hpc import AsyncClient, function\n"
        "async def main():\n"
        f"    c = AsyncClient(connection_file={str(cluster.connection_file)!r})\n"
        "    r = await c.submit(function('math:sqrt', 16))\n"
        "    assert r.output == 4.0\n"
        "asyncio.run(main())\n"
        "gc.collect()\n"
        "print('exited cleanly')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "exited cleanly" in proc.stdout, proc.stderr
