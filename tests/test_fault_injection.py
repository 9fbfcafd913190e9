"""Fault injection: every submitted action gets exactly one final result, and none is lost.

Each scenario breaks something real (a stopped worker process, a worker
environment that cannot start, actions that kill their worker, a coordinator
killed while results stream to several clients) and then checks, per action
id, that the client saw exactly one result on the wire (not merely one
resolved future: the client would hide a duplicate) and that the result is
the right one.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import zmq

from tangram_hpc import Client, Status, function, sandbox
from tangram_hpc import protocol as P
from tangram_hpc.connection import ConnectionInfo, wait_for_file
from tangram_hpc.launch import LocalCluster
from tangram_hpc.envfiles import env_dirname
from tangram_hpc.security import CurveKeys

from support import wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
NOOP = "tangram_hpc.handlers:noop"


class _CountingPending(dict):
    """Stands in for the client session's ``pending``: it pops an id once per result it receives for it."""

    def __init__(self, inner: dict):
        super().__init__(inner)
        self.deliveries: Counter = Counter()

    def pop(self, key, *default):
        self.deliveries[key] += 1
        return super().pop(key, *default)


def _track(client: Client) -> Counter:
    """Count the results the coordinator delivers to ``client``, per action id (before de-duplication)."""
    session = client._session
    assert not session.pending, "track a client before it submits"
    session.pending = _CountingPending(session.pending)
    return session.pending.deliveries


def _exactly_once(client: Client, deliveries: Counter, specs, futures, timeout: float = 60.0,
                  duplicates_allowed: bool = False):
    results = Client.gather(futures, timeout=timeout)
    assert [r.id for r in results] == [s.id for s in specs]
    assert client.outstanding == 0
    ids = {s.id for s in specs}
    assert ids <= deliveries.keys(), "an action resolved without a delivered result"
    if not duplicates_allowed:
        extra = {i: n for i, n in deliveries.items() if i in ids and n != 1}
        assert not extra, f"results delivered more than once: {extra}"
    return results


def _wait(predicate, timeout: float, what: str):
    return wait_until(predicate, timeout, 0.05, what)


def _popen(args, log: Path, **kw) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=REPO, **kw)


def _hand_worker(conn: Path, log: Path, cores: int) -> subprocess.Popen:
    return _popen([sys.executable, "-m", "tangram_hpc.worker", "--connection-file", str(conn),
                   "--cores", str(cores)], log)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- a hung worker ------------------------------------------------------------

def test_sigstop_worker_then_resume_delivers_each_result_once(tmp_path):
    """A stopped worker is declared lost; the actions in its environments wait for it (their state is
    there), and when it comes back each of them has run exactly once, there, its result delivered once."""
    with LocalCluster(workers=2, cores=2, run_dir=tmp_path / "run",
                      extra_args=["--worker-timeout", "5", "--heartbeat", "0.5"]) as cl, cl.client() as c:
        deliveries = _track(c)
        # Each run appends its index to a file in its environment (on the host: under the worker's
        # directory) when it finishes: the proof of where, and how often, each one ran.
        specs = [sandbox(f"sleep 1; echo {i} >> marks; echo {i}", env=f"mark-{i}") for i in range(8)]
        futs = c.submit_many(specs)
        victim = _wait(lambda: next((w for w in c.status()["workers"] if w["running"] == 2), None), 10,
                       "a worker running two actions")
        os.kill(victim["pid"], signal.SIGSTOP)
        try:
            _wait(lambda: c.status()["workers_lost"] == 1, 15, "the stopped worker to be declared lost")
        finally:
            os.kill(victim["pid"], signal.SIGCONT)
        results = _exactly_once(c, deliveries, specs, futs)
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        assert [r.output["stdout"] for r in results] == [f"{i}\n" for i in range(8)]
        # The two it was running finished there, and their outcomes answered them (OUTCOMES once it
        # registered again, or its environments' journals if they were assigned to it anew): no second run.
        stopped = [r for r in results if r.worker == victim["id"] and r.attempts <= 2 and
                   r.env_state in ("created", "replayed")]
        assert len(stopped) >= 2
        st = c.status()
        assert st["stale_results"] <= 2 and st["retried"] == 2 and st["workers_lost"] == 1
        # No copy on a worker holds its line twice...
        copies = [(i, f) for i in range(8)
                  for f in (tmp_path / "run").glob(f"worker-*/envs/{env_dirname(f'mark-{i}')}/marks")]
        assert copies and all(f.read_text() == f"{i}\n" for i, f in copies), [(i, f.read_text()) for i, f in copies]
        # ...and each environment, read back through its next action wherever its live copy now is
        # (a worker's directory, or a snapshot if the pool gave back the worker holding it), holds
        # its own line once: its action ran once, in that copy.
        for i, r in enumerate(c.gather(c.submit_many([sandbox("cat marks", env=f"mark-{i}") for i in range(8)]))):
            assert r.ok and r.output["stdout"] == f"{i}\n", (i, r.error, r.output)
        # It rejoins (as a new registration of the same id) and serves again.
        _wait(lambda: victim["id"] in {w["id"] for w in c.status()["workers"]}, 15, "the worker to rejoin")
        time.sleep(0.5)  # any stray third delivery would land now
        assert all(deliveries[s.id] == 1 for s in specs)
        more = [function(NOOP, i) for i in range(20)]
        assert [r.output for r in _exactly_once(c, deliveries, more, c.submit_many(more))] == list(range(20))


def _coordinator(run_dir: Path, *extra: str) -> subprocess.Popen:
    return _popen([sys.executable, "-m", "tangram_hpc.cli", "coordinator", "--run-dir", str(run_dir),
                   "--backend", "none", "--worker-timeout", "3", *extra], run_dir / "coord.log")


class _RawWorker:
    """A worker speaking the protocol by hand: the test decides when it falls silent and what it reports."""

    def __init__(self, ctx: zmq.Context, conn: ConnectionInfo, wid: str):
        self.id = wid
        self.sock = ctx.socket(zmq.DEALER)
        CurveKeys.apply_client(self.sock, conn)   # it holds the key: the protocol is under test here
        self.sock.setsockopt(zmq.IDENTITY, wid.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 10_000)
        self.sock.connect(conn.worker_address)

    def send(self, mtype: int, body) -> None:
        self.sock.send(P.encode(mtype, body))

    def register(self) -> None:
        self.send(P.REGISTER, {"id": self.id, "pid": os.getpid(), "cores": 1, "kinds": ["function"]})
        self.expect(P.WELCOME)

    def expect(self, mtype: int):
        while True:
            got, body = P.decode(self.sock.recv(), frozenset(P.NAMES))
            if got == mtype:
                return body


def test_a_worker_that_registers_while_the_coordinator_stops_is_told_to_stop(tmp_path):
    """A worker job launched just before the coordinator's stop registers during its wait for the
    others to leave: it is told to stop too, instead of holding its allocation until its time limit."""
    conn = tmp_path / "connection.json"
    coord = _coordinator(tmp_path, "--drain-grace", "20")
    ctx = zmq.Context()
    try:
        info = wait_for_file(conn, 30)
        slow = _RawWorker(ctx, info, "raw-slow")
        slow.register()
        coord.send_signal(signal.SIGTERM)
        assert slow.expect(P.STOP)["reregister"] is False
        # "slow" never says it left, so the coordinator still waits for it
        late = _RawWorker(ctx, info, "raw-late")
        late.register()
        assert late.expect(P.STOP) == {"reason": "coordinator shutting down", "reregister": False}
        assert coord.poll() is None
    finally:
        coord.kill()
        coord.wait()
        ctx.destroy(linger=0)


def test_late_result_of_a_lost_worker_is_stale(tmp_path):
    """Both ways a late outcome reaches the coordinator are dropped and counted, never delivered."""
    conn = tmp_path / "connection.json"
    coord = _coordinator(tmp_path, "--worker-timeout", "3")
    ctx = zmq.Context()
    try:
        info = wait_for_file(conn, 30)
        slow, spare = _RawWorker(ctx, info, "raw-slow"), _RawWorker(ctx, info, "raw-spare")
        slow.register()
        with Client(connection_file=str(conn)) as c:
            deliveries = _track(c)
            spec = function(NOOP, "right")
            fut = c.submit(spec)
            [[wire, attempt, _]] = slow.expect(P.ASSIGN)
            assert wire["i"] == spec.id and attempt == 1
            spare.register()
            # "slow" falls silent; "spare" keeps heartbeating and gets the retry
            deadline = time.monotonic() + 15
            while c.status()["workers_lost"] == 0:
                assert time.monotonic() < deadline, "the silent worker was never declared lost"
                spare.send(P.HEARTBEAT, {"running": 0})
                time.sleep(0.2)
            # "spare" goes on heartbeating between the steps below: a loaded machine must not get
            # it declared lost too (its DONE would then be stale as well)
            [[wire, attempt, _]] = spare.expect(P.ASSIGN)
            assert wire["i"] == spec.id and attempt == 2
            spare.send(P.HEARTBEAT, {"running": 1})
            late = [[spec.id, 1, "ok", "late", None, time.time(), time.time(), None]]
            slow.send(P.DONE, late)           # from a worker the coordinator no longer knows
            assert slow.expect(P.STOP)["reregister"] is True
            spare.send(P.HEARTBEAT, {"running": 1})
            slow.register()
            slow.send(P.DONE, late)           # from the same worker, registered again: an old attempt
            spare.send(P.HEARTBEAT, {"running": 1})
            spare.send(P.DONE, [[spec.id, 2, "ok", "right", None, time.time(), time.time(), None]])
            r = fut.result(10)
            assert r.output == "right" and r.attempts == 2 and r.worker == "raw-spare"
            st = c.status()
            assert st["stale_results"] == 2 and st["retried"] == 1 and st["completed"] == 1
            time.sleep(0.3)
            assert deliveries[spec.id] == 1
    finally:
        ctx.destroy(0)
        coord.kill()
        coord.wait()


# -- the backend cannot start workers -----------------------------------------

_BROKEN_PYTHON = """#!/bin/bash
# The interpreter the local backend starts workers with: while {flag} exists, starting a worker
# fails the way a broken environment on a node does (the coordinator itself runs fine).
if [ -e {flag} ] && [[ " $* " == *" tangram_hpc.worker "* ]]; then
    echo "ImportError: the worker environment is broken" >&2
    exit 1
fi
exec -a "$0" {python} "$@"
"""


def _broken_python(tmp_path: Path, flag: Path) -> Path:
    """A wrapper interpreter that the coordinator keeps as its ``sys.executable``.

    ``exec -a`` leaves the wrapper's path in argv[0], so Python looks for its environment beside the
    wrapper: when the tests run in a venv, mirror its pyvenv.cfg and lib/ there, or the wrapper would
    start a bare interpreter without the project's packages.
    """
    root = tmp_path / "pyenv"
    (root / "bin").mkdir(parents=True)
    if sys.prefix != sys.base_prefix:
        shutil.copy(Path(sys.prefix) / "pyvenv.cfg", root / "pyvenv.cfg")
        (root / "lib").symlink_to(Path(sys.prefix) / "lib")
    python = root / "bin" / "python3"
    python.write_text(_BROKEN_PYTHON.format(flag=flag, python=sys.executable))
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


def test_backend_failing_to_start_workers_keeps_actions_pending(tmp_path):
    flag = tmp_path / "environment-broken"
    flag.touch()
    python = _broken_python(tmp_path, flag)
    run = tmp_path / "run"
    conn = run / "connection.json"
    # The local backend starts workers with the coordinator's own interpreter path (sys.executable).
    coord = _popen([str(python), "-m", "tangram_hpc.cli", "coordinator", "--run-dir", str(run),
                    "--workers", "1", "--worker-cores", "1", "--worker-timeout", "3"], tmp_path / "coord.log")
    hand = None
    try:
        wait_for_file(conn, 30)
        with Client(connection_file=str(conn)) as c:
            deliveries = _track(c)
            specs = [function(NOOP, i) if i % 3 else sandbox(f"echo {i}") for i in range(15)]
            futs = c.submit_many(specs)
            st = _wait(lambda: (s := c.status())["launch_failures"] >= 3 and s, 20, "three failed launches")
            assert not any(f.done() for f in futs), "an action was answered without a worker"
            assert st["workers"] == [] and st["pending"] == len(specs) and st["submitted"] == len(specs)
            assert all("failed exit status 1" in why for why in st["recent_launch_failures"])

            # A worker started by hand (2 cores: not the pool's shape, so the pool keeps trying) serves them.
            hand = _hand_worker(conn, tmp_path / "hand.log", cores=2)
            results = _exactly_once(c, deliveries, specs, futs)
            assert all(r.ok and r.attempts == 1 for r in results), [r.error for r in results if not r.ok]
            assert [r.output if i % 3 else r.output["stdout"] for i, r in enumerate(results)] == \
                   [i if i % 3 else f"{i}\n" for i in range(15)]

            # Once the environment is repaired the backend's next launch succeeds.
            flag.unlink()
            c.pool("resume")    # past the launch breaker, should the failures have tripped it
            _wait(lambda: any(w["handle"] for w in c.status()["workers"]), 60, "the pool worker to join")
            more = [sandbox(f"echo {i}", cores=1) for i in range(6)]
            assert all(r.ok for r in _exactly_once(c, deliveries, more, c.submit_many(more)))
    finally:
        _stop(coord)
        if hand is not None:
            _stop(hand)


# -- poison actions -------------------------------------------------------------

def test_poison_actions_among_good_ones_fail_alone(tmp_path):
    """Actions that kill their worker fail after max attempts; the others, submitted with them, all finish."""
    with LocalCluster(workers=2, cores=1, run_dir=tmp_path / "run",
                      extra_args=["--worker-timeout", "10", "--max-attempts", "2"]) as cl, cl.client() as c:
        deliveries = _track(c)
        specs = []
        for i in range(30):
            if i == 3:
                specs.append(function("os:_exit", 3))
            elif i == 11:
                specs.append(function("signal:raise_signal", int(signal.SIGKILL)))
            elif i % 4 == 0:
                specs.append(sandbox(f"echo {i}"))
            else:
                specs.append(function(NOOP, i))
        futs = c.submit_many(specs)
        results = _exactly_once(c, deliveries, specs, futs, timeout=300)
        by_index = dict(enumerate(results))
        for i, reason in ((3, "exit status 3"), (11, "killed by signal 9")):
            r = by_index.pop(i)
            assert r.status == Status.ERROR and r.attempts == 2, (r.status, r.attempts, r.error)
            assert r.error.startswith("gave up after 2 attempts: "), r.error
            failures = re.split(r"; (?=attempt \d on )", r.error.split(": ", 1)[1])
            assert [f.split(" on ")[0] for f in failures] == ["attempt 1", "attempt 2"], r.error
            # each attempt lost its worker, as whichever true observation came first: the backend's
            # exit status, the closed connection or the missing heartbeats (a loaded machine decides)
            assert all(any(why in f for why in (reason, "connection closed", "no heartbeat for"))
                       for f in failures), r.error
        for i, r in by_index.items():
            # one-core workers: a good action never shares a worker with a poison one, so never reruns
            assert r.ok and r.attempts == 1, (i, r.status, r.error)
            assert (r.output["stdout"] if i % 4 == 0 else r.output) == (f"{i}\n" if i % 4 == 0 else i)
        st = cl.wait_for_workers(2, timeout=120)
        assert st["workers_lost"] == 4 and st["failed"] == 2
        assert c.submit(function(NOOP, "after")).result(120).output == "after"


# -- the coordinator dies while results stream ----------------------------------

def test_coordinator_killed_while_streaming_to_many_clients(tmp_path):
    conn = tmp_path / "connection.json"
    coord = _coordinator(tmp_path)
    workers: list[subprocess.Popen] = []
    clients: list[Client] = []
    try:
        # deadlines, not expectations: generous, so a loaded machine only makes this slower
        wait_for_file(conn, 120)
        workers = [_hand_worker(conn, tmp_path / f"w{i}.log", cores=2) for i in range(2)]
        clients = [Client(connection_file=str(conn), name=f"trainer{k}") for k in range(4)]
        _wait(lambda: len(clients[0].status()["workers"]) == 2, 120, "two workers")
        work = []
        for k, c in enumerate(clients):
            deliveries = _track(c)
            specs = [sandbox(f"sleep 0.05; echo {k}-{i}") if i % 2 else function(NOOP, [k, i])
                     for i in range(50)]
            work.append((c, deliveries, specs, c.submit_many(specs)))
        total = sum(len(s) for _, _, s, _ in work)
        _wait(lambda: sum(f.done() for *_, fs in work for f in fs) >= total // 5, 240, "results to stream")
        coord.kill()
        coord.wait()
        done_before = sum(f.done() for *_, fs in work for f in fs)
        assert done_before < total, "the coordinator died after the stream had ended"
        coord = _coordinator(tmp_path)  # same run dir: same connection file and ports
        for k, (c, deliveries, specs, futs) in enumerate(work):
            results = _exactly_once(c, deliveries, specs, futs, timeout=300, duplicates_allowed=True)
            assert all(r.ok for r in results), [r.error for r in results if not r.ok]
            assert [r.output["stdout"] if i % 2 else r.output for i, r in enumerate(results)] == \
                   [f"{k}-{i}\n" if i % 2 else [k, i] for i in range(50)]
        resubmitted = sum(c.resubmissions for c in clients)
        # results already on their way when it died may still resolve futures after done_before was read
        assert 0 < resubmitted <= total - done_before
        st = clients[0].status()
        assert len(st["workers"]) == 2  # the workers found the new coordinator by themselves
        # The new incarnation admitted nothing but what was unfinished; what it did not admit was
        # answered with the outcome its worker reported again (OUTCOMES: an attempt that ended while
        # no coordinator listened), which may also answer an admitted action that still waited.
        assert st["submitted"] <= resubmitted <= st["submitted"] + st["replayed"], st
    finally:
        for c in clients:
            c.close()
        coord.kill()
        coord.wait()
        for w in workers:
            _stop(w)
