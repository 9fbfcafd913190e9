"""The worker under long, killed and misbehaving calls: its I/O thread keeps heartbeating, killed
calls keep their cores until they return and are reported, and no outcome is dropped in silence.

Most tests drive a real :class:`Worker` (in a thread of the test process) from a real ROUTER
socket playing the coordinator, so every frame the worker sends can be inspected."""
from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq

from tangram_hpc import protocol as P
from tangram_hpc.actions import ActionSpec, function, register_kind
from tangram_hpc.connection import ConnectionInfo
from tangram_hpc.worker import Worker, WorkerConfig

HB = 0.1


class FakeCoordinator:
    """A ROUTER socket speaking the worker protocol, recording what the worker sends."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.ident: bytes | None = None
        self.heartbeats: list[tuple[float, dict]] = []
        self.done: list[P.Outcome] = []

    def pump(self, seconds: float) -> None:
        """Receive (and answer REGISTER) for ``seconds``."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                continue
            ident, frame = self.sock.recv_multipart()
            mtype, body = P.decode(frame, P.WORKER_TYPES)
            if mtype == P.REGISTER:
                self.ident = ident
                self.send(P.WELCOME, {"coordinator": "fake", "heartbeat_s": HB})
            elif mtype == P.HEARTBEAT:
                self.heartbeats.append((time.monotonic(), body))
                self.send(P.HEARTBEAT, {"coordinator": "fake"})
            elif mtype == P.DONE:
                self.done.extend(P.check_done(item) for item in body)

    def until(self, cond, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out waiting for the worker"
            self.pump(0.02)

    def send(self, mtype: int, body) -> None:
        self.sock.send_multipart([self.ident, P.encode(mtype, body)])

    def assign(self, *items: tuple[ActionSpec, int, int]) -> None:
        self.send(P.ASSIGN, [[spec.to_wire(), attempt, cores] for spec, attempt, cores in items])

    def result(self, spec: ActionSpec) -> P.Outcome | None:
        return next((d for d in self.done if d.id == spec.id), None)

    def close(self) -> None:
        self.ctx.destroy(0)


@pytest.fixture
def coord_and_worker(tmp_path):
    coord = FakeCoordinator()
    cfg = WorkerConfig(connection=ConnectionInfo(client_address="", worker_address=coord.address),
                       cores=1, kinds=("function",), heartbeat_s=HB, run_dir=str(tmp_path), worker_id="w-hard")
    worker = Worker(cfg)
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    coord.until(lambda: coord.ident is not None)
    yield coord, worker
    worker._stop = True
    t.join(10)
    coord.close()


def learn_fast(coord: FakeCoordinator, worker: Worker, target: str, *args, cores: int = 1) -> None:
    """Run ``target(*args)`` one at a time (at least 50 times) until the worker counts it as fast."""
    for i in range(400):
        spec = function(target, *args, cores=cores)
        coord.assign((spec, 1, cores))
        coord.until(lambda: coord.result(spec) is not None)
        if i >= 49 and worker.executors.fast.get(target, 1.0) < 200e-6:
            return
    pytest.fail(f"{target} never ran in under 200 us on this machine")


#: Calls that hold their thread until the test lets them go (``held``), instead of sleeping for a
#: time a loaded machine may overrun: a test waits on their state, never on the clock.
GATE = threading.Event()
HELD: list[str] = []           # targets of the calls now held


def held(block: bool) -> None:
    """Return at once, or (``block``) once the test sets :data:`GATE`."""
    if block:
        HELD.append("held")
        assert GATE.wait(120)


def held_too(block: bool) -> None:
    """:func:`held` under another target name (the worker times each target apart)."""
    if block:
        HELD.append("held_too")
        assert GATE.wait(120)


HELD_FN, HELD_TOO_FN = "test_worker_hardening:held", "test_worker_hardening:held_too"


@pytest.fixture
def gate():
    GATE.clear()
    HELD.clear()
    yield
    GATE.set()          # nothing stays held past its test


def test_fast_function_that_runs_long_does_not_stop_heartbeats(coord_and_worker, gate):
    coord, worker = coord_and_worker
    learn_fast(coord, worker, HELD_FN, False)   # one at a time, like a sequential client
    slow = function(HELD_FN, True)
    coord.assign((slow, 1, 1))
    coord.until(lambda: HELD)                   # it runs on the I/O thread (a fast target), and is held
    # While it is held: the same fast target and a light no-op still complete.
    again, noop = function(HELD_FN, False), function("tangram_hpc.handlers:noop", 7, cores=0)
    coord.assign((again, 1, 0), (noop, 1, 0))
    coord.until(lambda: coord.result(again) is not None and coord.result(noop) is not None)
    assert (coord.result(noop).status, coord.result(noop).output) == ("ok", 7)
    n = len(coord.heartbeats)
    coord.until(lambda: len(coord.heartbeats) >= n + 5)     # heartbeats go on while the call is held
    assert coord.result(slow) is None                       # nothing waited for it
    GATE.set()
    coord.until(lambda: coord.result(slow) is not None)
    assert coord.result(slow).status == "ok"
    assert worker.executors.fast[HELD_FN] >= 200e-6          # no longer counted as fast


def test_two_different_fast_functions_overrunning_at_once_still_leave_a_thread_for_io(coord_and_worker, gate):
    coord, worker = coord_and_worker
    learn_fast(coord, worker, HELD_FN, False, cores=0)
    learn_fast(coord, worker, HELD_TOO_FN, False, cores=0)
    first, second = function(HELD_FN, True, cores=0), function(HELD_TOO_FN, True, cores=0)
    coord.assign((first, 1, 0))
    coord.until(lambda: len(HELD) == 1)
    coord.assign((second, 1, 0))        # read once the standby has taken the I/O role: it runs this one itself
    coord.until(lambda: len(HELD) == 2)
    noop = function("tangram_hpc.handlers:noop", 1, cores=0)
    coord.assign((noop, 1, 0))
    coord.until(lambda: coord.result(noop) is not None)
    n = len(coord.heartbeats)
    coord.until(lambda: len(coord.heartbeats) >= n + 5)     # a third thread serves the I/O
    assert coord.result(first) is None and coord.result(second) is None    # it did not wait for them
    GATE.set()
    coord.until(lambda: coord.result(first) is not None and coord.result(second) is not None)
    coord.until(lambda: worker._standbys >= 1)     # someone stands by again ...
    assert worker._standbys <= 2                   # ... and no more threads than needed

def test_killed_function_keeps_its_core_and_is_reported_until_it_returns(coord_and_worker):
    coord, worker = coord_and_worker
    slow = function("time:sleep", 5)       # long enough that the KILL lands while it runs
    coord.assign((slow, 3, 1))
    coord.until(lambda: any(hb.get("busy_cores") == 1 for _, hb in coord.heartbeats))
    coord.send(P.KILL, [[slow.id, 3], [slow.id, 2], ["unknown", 1]])
    coord.until(lambda: any(hb.get("killed_running") for _, hb in coord.heartbeats))
    reported = [hb for _, hb in coord.heartbeats if hb.get("killed_running")]
    assert all(hb["killed_running"] == [[slow.id, 3]] and hb["busy_cores"] == 1 for hb in reported)
    assert worker.session.free_slots == []          # the slot stays taken while the call runs
    coord.until(lambda: coord.result(slow) is not None, timeout=10)
    assert coord.result(slow)[:3] == (slow.id, 3, "ok")   # the DONE that ends the attempt is sent
    n = len(coord.heartbeats)
    coord.until(lambda: len(coord.heartbeats) > n + 1)
    last = coord.heartbeats[-1][1]
    assert last["killed_running"] == [] and last["busy_cores"] == 0 and last["running"] == 0
    assert worker.session.free_slots == [0]


def test_a_killed_action_still_waiting_for_a_thread_does_not_run(coord_and_worker, gate):
    coord, worker = coord_and_worker
    first, queued = function(HELD_FN, True), function("tangram_hpc.handlers:noop", 5)
    coord.assign((first, 1, 1), (queued, 1, 1))   # one executor thread: the second one waits
    coord.until(lambda: HELD)                     # the first holds the thread
    coord.send(P.KILL, [[queued.id, 1]])
    coord.until(lambda: any([queued.id, 1] in hb.get("killed_running", ()) for _, hb in coord.heartbeats))
    GATE.set()                                    # the thread is free: the killed one is taken next
    coord.until(lambda: coord.result(queued) is not None and coord.result(first) is not None)
    assert coord.result(queued)[2:5] == ("cancelled", None, "killed before it started")   # it did not run
    assert coord.result(first).status == "ok"

def test_sys_exit_and_bad_handler_outcomes_are_results_not_dead_threads(coord_and_worker):
    coord, worker = coord_and_worker
    register_kind("bad_outcome")
    worker.handlers["bad_outcome"] = lambda spec, cpus: "not a tuple"
    exits = [function("sys:exit", 3) for _ in range(3)]   # more than the one executor thread
    bad = ActionSpec("bad_outcome", {})
    coord.assign(*[(s, 1, 1) for s in exits], (bad, 1, 1))
    coord.until(lambda: all(coord.result(s) for s in exits + [bad]))
    for s in exits:
        assert coord.result(s).status == "failed" and "SystemExit" in coord.result(s).error
    assert coord.result(bad).status == "error" and "not (status, output, error)" in coord.result(bad).error
    after = function("tangram_hpc.handlers:noop", 1)
    coord.assign((after, 1, 1))
    coord.until(lambda: coord.result(after) is not None)


def test_results_the_send_queue_cannot_take_are_kept_and_sent_later(coord_and_worker, caplog):
    coord, worker = coord_and_worker
    real = worker.sock
    refusals = []

    class FullQueue:   # the worker's socket while the coordinator takes nothing (HWM reached)
        def send(self, frame, flags=0):
            if len(refusals) < 3:
                refusals.append(frame)
                raise zmq.Again()
            worker.sock = real
            return real.send(frame, flags)

        def __getattr__(self, name):
            return getattr(real, name)

    worker.sock = FullQueue()
    specs = [function("tangram_hpc.handlers:noop", i) for i in range(5)]
    with caplog.at_level(logging.INFO, logger="tangram.worker"):
        coord.assign(*[(s, 1, 1) for s in specs])
        coord.until(lambda: all(coord.result(s) for s in specs))
    assert [coord.result(s).output for s in specs] == list(range(5))
    assert len(refusals) == 3
    text = caplog.text
    assert "kept and sent again" in text and "will be retried" not in text and "dropped" not in text


def test_an_assignment_the_worker_cannot_read_ends_at_once_with_an_error(coord_and_worker):
    coord, worker = coord_and_worker
    unknown_kind = dict(function("tangram_hpc.handlers:noop", 1).to_wire(), k="no-such-kind")
    bad_cores = function("tangram_hpc.handlers:noop", 2)
    bad_grant = function("tangram_hpc.handlers:noop", 3)
    good = function("tangram_hpc.handlers:noop", 4)
    coord.send(P.ASSIGN, [[unknown_kind, 1, 1], [bad_cores.to_wire(), 1, -1], [bad_grant.to_wire(), 2, 1, "x"],
                          42, [good.to_wire(), 1, 1]])
    ids = [unknown_kind["i"], bad_cores.id, bad_grant.id, good.id]
    coord.until(lambda: all(any(d.id == i for d in coord.done) for i in ids))
    by_id = {d.id: d for d in coord.done}
    for aid, attempt in zip(ids[:3], (1, 1, 2)):      # each answered, for the attempt it was given
        d = by_id[aid]
        assert (d.attempt, d.status) == (attempt, "error") and "could not read the assignment" in d.error
    assert by_id[good.id].output == 4
    coord.pump(3 * HB)
    assert len(coord.done) == 4 and worker.session.free_slots == [0] and not worker.session.running   # no core held


PACKED_ON: list[str] = []      # threads that packed a _SlowToPack result
UNPACK_GATE = threading.Event()


class _SlowToPack(dict):
    """A result whose packing blocks until the test lets it go (msgpack asks a dict subclass for its
    items), recording which thread packs it."""

    def items(self):
        PACKED_ON.append(threading.current_thread().name)
        assert UNPACK_GATE.wait(60)
        return super().items()


def slow_to_pack(size: int = 1) -> dict:
    return _SlowToPack({str(i): "x" * 1000 for i in range(size)})


def test_a_result_is_packed_off_the_io_thread_and_heartbeats_never_wait_for_it(coord_and_worker):
    coord, worker = coord_and_worker
    PACKED_ON.clear()
    UNPACK_GATE.clear()
    try:
        held = function("test_worker_hardening:slow_to_pack")
        coord.assign((held, 1, 1))
        coord.until(lambda: PACKED_ON)              # its packing has begun, and waits
        n = len(coord.heartbeats)
        noop = function("tangram_hpc.handlers:noop", 5, cores=0)
        coord.assign((noop, 1, 0))
        coord.until(lambda: coord.result(noop) is not None and len(coord.heartbeats) >= n + 3)
        assert coord.result(held) is None and all(name.startswith("exec-") for name in PACKED_ON)
    finally:
        UNPACK_GATE.set()
    coord.until(lambda: coord.result(held) is not None)
    assert coord.result(held).status == "ok" and coord.result(held).output == {"0": "x" * 1000}


def test_a_result_over_max_output_bytes_fails_once_with_the_reason_and_is_never_packed(tmp_path):
    coord = FakeCoordinator()
    cfg = WorkerConfig(connection=ConnectionInfo(client_address="", worker_address=coord.address), cores=2,
                       kinds=("function",), heartbeat_s=HB, run_dir=str(tmp_path), worker_id="w-big",
                       max_output_bytes=64 << 10)
    worker = Worker(cfg)
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    PACKED_ON.clear()
    UNPACK_GATE.set()
    try:
        coord.until(lambda: coord.ident is not None)
        big = function("test_worker_hardening:slow_to_pack", 200)       # about 200 KB packed
        huge = function("builtins:bytes", 256 << 20)                    # 256 MiB of zeros
        fits = function("test_worker_hardening:slow_to_pack", 50)       # about 50 KB: within the limit
        others = [function("tangram_hpc.handlers:noop", i) for i in range(3)]
        coord.assign((big, 1, 1), (huge, 1, 1), (fits, 1, 1), *[(o, 1, 0) for o in others])
        coord.until(lambda: all(coord.result(s) is not None for s in [big, huge, fits, *others]), timeout=60)
        for s in (big, huge):
            r = coord.result(s)
            assert (r.status, r.output) == ("failed", None) and "exceeds the limit of 65536 bytes (max_output_bytes)" in r.error
        assert coord.result(fits).status == "ok" and len(coord.result(fits).output) == 50
        assert [coord.result(o).output for o in others] == [0, 1, 2]
        assert PACKED_ON == ["exec-0"] or PACKED_ON == ["exec-1"]       # only the one that fits was packed
        coord.pump(3 * HB)
        assert sorted(d.id for d in coord.done) == sorted(s.id for s in [big, huge, fits, *others])   # once each
    finally:
        worker._stop = True
        t.join(10)
        coord.close()


@pytest.mark.slow
def test_long_fast_function_keeps_the_worker_alive_end_to_end(cluster, client):
    """time:sleep(0) x50, then time:sleep(12) on workers declared lost after 6 s of silence."""
    before = {w["id"] for w in client.status()["workers"]}
    for _ in range(50):
        assert client.submit(function("time:sleep", 0)).result(30).ok
    fut = client.submit(function("time:sleep", 12))
    time.sleep(1)
    quick = client.submit(function("tangram_hpc.handlers:noop", 5, cores=0)).result(10)
    assert quick.output == 5 and not fut.done()      # it did not wait for the long call
    res = fut.result(60)
    assert res.ok and res.attempts == 1, res
    status = client.status()
    assert {w["id"] for w in status["workers"]} == before   # nobody was declared lost


def test_a_killed_reward_request_still_queued_ends_at_once_and_is_no_stuck_call(tmp_path):
    from tangram_hpc.actions import reward
    from tangram_hpc.managers.devices import Device
    from tangram_hpc.managers.service_spec import ServiceSpec
    from tangram_hpc.managers.services import ServiceManager

    gate, scoring = threading.Event(), threading.Event()

    class Slow:
        def score(self, inputs):
            scoring.set()
            gate.wait(120)
            return [1.0 for _ in inputs]

    coord = FakeCoordinator()
    mgr = ServiceManager([ServiceSpec("j", Slow, memory_mb=1, max_batch=1, max_wait_ms=1)], [Device("cpu", 64)])
    cfg = WorkerConfig(connection=ConnectionInfo(client_address="", worker_address=coord.address), cores=0,
                       kinds=("reward",), services=mgr, heartbeat_s=HB, run_dir=str(tmp_path), worker_id="w-rw",
                       stuck_leave_s=0.5)
    worker = Worker(cfg)
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    try:
        coord.until(lambda: coord.ident is not None)
        held, queued = reward("j", ["x"]), reward("j", ["y"])
        coord.send(P.ASSIGN, [[held.to_wire(), 1, 0], [queued.to_wire(), 1, 0]])
        coord.until(scoring.is_set)                # the first is scored (and held): the other is queued
        coord.send(P.KILL, [[queued.id, 1]])       # its timeout, or its caller's cancel
        coord.until(lambda: coord.result(queued) is not None)
        assert coord.result(queued).status == "cancelled" and coord.result(held) is None
        # the same once it follows an attempt of an earlier registration (the worker came back)
        again = reward("j", ["z"])
        coord.send(P.ASSIGN, [[again.to_wire(), 1, 0]])
        coord.pump(0.3)
        g1 = worker.session.generation
        coord.send(P.STOP, {"reregister": True})
        coord.until(lambda: worker.session.generation > g1 and worker._registered)
        coord.send(P.ASSIGN, [[again.to_wire(), 2, 0]])     # follows attempt 1, still queued
        coord.pump(0.3)
        coord.send(P.KILL, [[again.id, 2]])
        coord.until(lambda: sum(d.id == again.id for d in coord.done) == 1)
        gate.set()                                  # held ends (reported as an earlier registration's)
        coord.until(lambda: not worker.session.running)
        coord.pump(1.5)                             # well past stuck_leave_s
        assert worker.session.leaving is None and not worker.session.killed
        assert not worker.session.running, worker.session.running   # the attempt it followed ended too
    finally:
        gate.set()
        worker._stop = True
        t.join(10)
        coord.close()


def test_the_worker_heartbeats_at_the_interval_its_coordinator_tells_it_never_shorter_than_its_own(
        coord_and_worker):
    coord, worker = coord_and_worker
    timeout = worker.cfg.coordinator_timeout_s

    def told(interval) -> None:
        coord.send(P.HEARTBEAT, {"coordinator": "fake", "heartbeat_s": interval})

    told(4 * HB)    # a coordinator with many workers: a longer interval, and a longer silence before it is lost
    coord.until(lambda: worker._hb_s == 4 * HB)
    assert worker._silence_s == pytest.approx(4 * timeout)
    for bad in (float("nan"), -1.0, 0, "1", P.MAX_HEARTBEAT_S * 10):   # refused at the edge: nothing changes
        told(bad)
    told(2 * HB)    # frames are handled in order: once this one is, so were those before it
    coord.until(lambda: worker._hb_s == 2 * HB)
    assert worker._silence_s == pytest.approx(2 * timeout)
    told(HB / 4)    # shorter than the worker's own: its own
    coord.until(lambda: worker._hb_s == HB)
    assert worker._silence_s == pytest.approx(timeout) and worker._registered
    n = len(coord.heartbeats)
    coord.until(lambda: len(coord.heartbeats) >= n + 3)      # it goes on heartbeating


def test_outcomes_sent_just_before_a_long_outage_are_sent_again_once_welcomed(tmp_path):
    coord = FakeCoordinator()
    cfg = WorkerConfig(connection=ConnectionInfo(client_address="", worker_address=coord.address), cores=1,
                       kinds=("function",), heartbeat_s=HB, coordinator_timeout_s=0.3, run_dir=str(tmp_path),
                       worker_id="w-out")
    worker = Worker(cfg)
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    try:
        coord.until(lambda: coord.ident is not None)
        f = function("tangram_hpc.handlers:noop", 1)
        coord.assign((f, 1, 1))
        coord.until(lambda: coord.result(f) is not None)
        registers, outcomes = 0, []

        def listen_until(cond, timeout: float = 60.0) -> None:
            """Read what the worker sends, answering nothing, until ``cond()``."""
            nonlocal registers
            deadline = time.monotonic() + timeout
            while not cond():
                assert time.monotonic() < deadline, "timed out waiting for the worker"
                if coord.sock.poll(50):
                    _, frame = coord.sock.recv_multipart()
                    mtype, body = P.decode(frame, P.WORKER_TYPES)
                    registers += mtype == P.REGISTER
                    if mtype == P.OUTCOMES:
                        outcomes.extend(body)

        # a coordinator that reads but answers nothing (a restart): the worker registers again, and again
        listen_until(lambda: registers > 1)
        coord.send(P.WELCOME, {"coordinator": "new", "heartbeat_s": HB})
        listen_until(lambda: any(o[0] == f.id for o in outcomes))
    finally:
        worker._stop = True
        t.join(10)
        coord.close()


def test_a_sandbox_worker_lists_its_environments_once_then_only_when_asked(tmp_path):
    coord = FakeCoordinator()
    cfg = WorkerConfig(connection=ConnectionInfo(client_address="", worker_address=coord.address), cores=1,
                       kinds=("sandbox",), heartbeat_s=HB, run_dir=str(tmp_path), worker_id="w-envs",
                       unsafe_sandbox=True)
    worker = Worker(cfg)
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    try:
        coord.until(lambda: len(coord.heartbeats) >= 3)
        first, *later = [body for _, body in coord.heartbeats]
        assert first["envs"] == [] and all("envs" not in b and b["envs_v"] == first["envs_v"] for b in later)
        coord.send(P.HEARTBEAT, {"coordinator": "fake", "send_envs": first["envs_v"]})
        n = len(coord.heartbeats)
        coord.until(lambda: any("envs" in b for _, b in coord.heartbeats[n:]))
        listed = next(b for _, b in coord.heartbeats[n:] if "envs" in b)
        assert listed["envs"] == [] and listed["envs_v"] > first["envs_v"]
    finally:
        worker._stop = True
        t.join(10)
        coord.close()
