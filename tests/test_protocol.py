"""The wire protocol, offline and against a live coordinator through raw ZMQ sockets."""
import os
import time

import msgpack
import pytest
import zmq

from tangram_hpc import protocol as P
from tangram_hpc.actions import Status, ValidationError, function
from tangram_hpc.connection import ConnectionInfo
from tangram_hpc.launch import LocalCluster
from tangram_hpc.security import CurveKeys


def test_round_trip_every_type():
    for mtype in P.NAMES:
        body = [] if P._BODY_SHAPE[mtype] is list else {}
        assert P.decode(P.encode(mtype, body), frozenset({mtype})) == (mtype, body)


MALFORMED = {
    "not_msgpack": (b"\xc1\xc1\xc1", "malformed"),
    "truncated": (P.encode(P.SUBMIT, [{"i": "a", "k": "function"}])[:-3], "malformed"),
    "not_a_list": (msgpack.packb({"v": 1}), "malformed"),
    "short_list": (msgpack.packb([1, 3]), "malformed"),
    "wrong_version": (msgpack.packb([99, P.SUBMIT, []]), "version"),
    "unknown_type": (msgpack.packb([P.PROTOCOL_VERSION, 77, {}]), "unknown_type"),
    "worker_type_on_client_socket": (P.encode(P.DONE, []), "unknown_type"),
    "wrong_body_shape": (msgpack.packb([P.PROTOCOL_VERSION, P.SUBMIT, {"a": 1}]), "malformed"),
    "int_map_keys": (msgpack.packb([P.PROTOCOL_VERSION, P.HELLO, {1: 2}]), "malformed"),
    "empty": (b"", "malformed"),
    "true_for_the_version": (msgpack.packb([True, P.HELLO, {}]), "version"),
    "true_for_the_type": (msgpack.packb([P.PROTOCOL_VERSION, True, {}]), "unknown_type"),
    "cancel_of_non_ids": (msgpack.packb([P.PROTOCOL_VERSION, P.CANCEL, [1, [], {}, None]]), "malformed"),
    "close_env_of_non_ids": (msgpack.packb([P.PROTOCOL_VERSION, P.CLOSE_ENV, ["x" * 200]]), "malformed"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_frames_raise_protocol_error(name):
    frame, code = MALFORMED[name]
    with pytest.raises(P.ProtocolError) as e:
        mtype, body = P.decode(frame, P.CLIENT_TYPES)
        if mtype in (P.CANCEL, P.CLOSE_ENV):    # what the coordinator checks next
            P.check_ids(mtype, body)
    assert e.value.code == code


def test_oversized_frame_is_rejected():
    frame = P.encode(P.SUBMIT, [{"i": "a", "k": "function", "p": "x" * 5000}])
    with pytest.raises(P.ProtocolError) as e:
        P.decode(frame, P.CLIENT_TYPES, max_bytes=1000)
    assert e.value.code == "too_large"


def test_register_validation():
    ok = P.check_register({"id": "w1", "cores": 4, "kinds": ["sandbox"]})
    assert ok["cores"] == 4 and ok["gpus"] == 0 and ok["handle"] is None
    for bad in ({"cores": 4}, {"id": "w", "cores": 0}, {"id": "w", "cores": -1}, {"id": "w", "cores": 2, "kinds": [1]},
                {"id": "w", "cores": True}):
        with pytest.raises(P.ProtocolError):
            P.check_register(bad)


@pytest.fixture(scope="module")
def small_frames(tmp_path_factory):
    with LocalCluster(workers=1, cores=1, run_dir=tmp_path_factory.mktemp("run"),
                      extra_args=["--max-frame-bytes", "4096", "--max-pending-per-client", "50"]) as cl:
        yield cl


def _raw(ctx, address, identity=None, conn=None):
    """A raw DEALER holding the client key (the protocol checks, not the authentication)."""
    s = ctx.socket(zmq.DEALER)
    if conn is not None:
        CurveKeys.apply_client(s, conn)
    if identity:
        s.setsockopt(zmq.IDENTITY, identity)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10_000)     # the first reply includes the CURVE handshake
    s.connect(address)
    return s


@pytest.mark.parametrize("name", sorted(MALFORMED) + ["oversized", "two_frames", "bad_action"])
def test_coordinator_answers_bad_client_frames_and_keeps_serving(small_frames, name):
    info = ConnectionInfo.read(small_frames.connection_file)
    ctx = zmq.Context()
    try:
        s = _raw(ctx, info.client_address, conn=info)
        if name == "oversized":
            s.send(P.encode(P.SUBMIT, [{"i": "a", "k": "function", "p": "x" * 5000}]))
        elif name == "two_frames":
            s.send_multipart([b"a", b"b"])
        elif name == "bad_action":
            s.send(P.encode(P.SUBMIT, [{"k": "function"}]))
        else:
            s.send(MALFORMED[name][0])
        mtype, body = P.decode(s.recv(), frozenset({P.ERROR}))
        assert body["code"] and body["message"]
        with small_frames.client() as c:   # a well-behaved client is still served
            assert c.submit(function("tangram_hpc.handlers:noop", 7)).result(10).output == 7
    finally:
        ctx.destroy(0)


def test_invalid_action_in_a_batch_fails_alone(small_frames):
    info = ConnectionInfo.read(small_frames.connection_file)
    ctx = zmq.Context()
    try:
        s = _raw(ctx, info.client_address, conn=info)
        good = function("tangram_hpc.handlers:noop", 1).to_wire()
        s.send(P.encode(P.SUBMIT, [{"i": "bad-1", "k": "function", "d": [3, 1, 0, 0, None]}, good]))
        seen = {}
        deadline = time.time() + 10
        while len(seen) < 2 and time.time() < deadline:
            mtype, body = P.decode(s.recv(), frozenset({P.RESULT}))
            for r in body:
                seen[r[0]] = r
        assert seen["bad-1"][1] == "error" and "max_cores" in seen["bad-1"][3]
        assert seen[good["i"]][1] == "ok" and seen[good["i"]][2] == 1
    finally:
        ctx.destroy(0)


def test_coordinator_survives_garbage_on_worker_socket(small_frames):
    info = ConnectionInfo.read(small_frames.connection_file)
    ctx = zmq.Context()
    try:
        s = _raw(ctx, info.worker_address, identity=b"intruder", conn=info)
        for frame in [v[0] for v in MALFORMED.values()] + [os.urandom(300),
                      P.encode(P.REGISTER, {"id": "someone-else", "cores": 2}),
                      P.encode(P.DONE, [["x", 1, "ok", None, None, 0.0, 0.0, None]])]:
            s.send(frame)
        replies = []
        s.setsockopt(zmq.RCVTIMEO, 2000)      # after the first reply: until two seconds of silence
        while True:
            try:
                replies.append(P.decode(s.recv() if replies else _first_reply(s), frozenset({P.ERROR, P.STOP}))[0])
            except zmq.Again:
                break
        assert P.ERROR in replies
        # DONE from an unregistered worker is answered with STOP(reregister), never applied
        assert P.STOP in replies
        with small_frames.client() as c:
            assert c.submit(function("tangram_hpc.handlers:noop", 3)).result(10).output == 3
            assert c.status()["bad_frames"] >= len(MALFORMED)
    finally:
        ctx.destroy(0)


def _first_reply(s: zmq.Socket) -> bytes:
    if not s.poll(10_000):
        raise zmq.Again()
    return s.recv()


def test_pending_limit_per_client_gives_clear_error(small_frames):
    with small_frames.client() as c:
        # The 60 go in two frames; an action that ends before the second is read frees a slot,
        # so up to 10 are refused (10 when none ended: they run one at a time, 0.1 s each).
        futs = c.submit_many([function("time:sleep", 0.1) for _ in range(60)])
        res = c.gather(futs, timeout=60)
    rejected = [r for r in res if r.status == "error"]
    assert 1 <= len(rejected) <= 10
    assert all("too many unfinished actions for this client (limit 50)" in r.error for r in rejected)
    assert sum(r.ok for r in res) == len(res) - len(rejected)


@pytest.mark.parametrize("bad", [[["x"]], {"a": 1}, 3, "nonsense"])
def test_an_env_state_of_any_other_shape_is_a_validation_error(bad):
    """Found by the fuzzer: a list there was unhashable and escaped as TypeError."""
    with pytest.raises(ValidationError):
        P.check_done(["a", 1, "ok", None, None, 0.0, 1.0, bad])
    with pytest.raises(ValidationError):
        P.check_env_item([bad, "e", 1, None])
    from tangram_hpc.actions import ActionResult
    with pytest.raises(ValidationError):
        ActionResult.from_wire(["a", "ok", None, None, 0, 0, 0, None, 0, 1, bad])


@pytest.mark.parametrize("started, finished", [(float("nan"), 1.0), (0.0, float("inf")), (float("-inf"), 1.0)])
def test_a_done_item_with_a_time_that_is_no_time_is_refused(started, finished):
    """A NaN from a worker would make every ACT sum of its kind NaN in the status and the metrics."""
    with pytest.raises(ValidationError, match="bad times"):
        P.check_done(["a", 1, "ok", None, None, started, finished, None])


def test_a_batch_is_cut_into_frames_within_the_limit():
    items = [["a%d" % i, "x" * (1000 + 37 * i)] for i in range(300)]
    frames = P.encode_within(P.RESULT, items, 20_000)
    assert len(frames) > 1 and all(len(f) <= 20_000 for f in frames)
    assert [it for f in frames for it in P.decode(f, frozenset({P.RESULT}))[1]] == items   # all, in order
    assert P.encode_within(P.RESULT, items[:3], 20_000) == [P.encode(P.RESULT, items[:3])]  # one when it fits
    [big] = P.encode_within(P.RESULT, [["b", "y" * 50_000]], 20_000)      # one item alone stays whole
    assert len(big) > 20_000


@pytest.fixture
def in_process(tmp_path):
    """A coordinator (backend none) and one function worker, both in threads of this process."""
    import threading

    from tangram_hpc.config import CoordinatorSettings
    from tangram_hpc.coordinator.server import Coordinator
    from tangram_hpc.launch import make_policy
    from tangram_hpc.worker import Worker, WorkerConfig

    cfg = CoordinatorSettings(run_dir=tmp_path / "run", state_dir=tmp_path / "state", insecure=True, backend="none",
                              heartbeat_s=0.2, drain_grace_s=2.0)
    coord = Coordinator(cfg, make_policy("elastic"))
    info = coord.bind()
    serving = threading.Thread(target=coord.serve, daemon=True)
    serving.start()
    worker = Worker(WorkerConfig(connection=info, cores=2, kinds=("function",), heartbeat_s=0.2,
                                 run_dir=str(tmp_path / "worker"), worker_id="w-inproc"))
    working = threading.Thread(target=worker.run, daemon=True)
    working.start()
    from tangram_hpc import Client
    with Client(info.client_address) as c:
        deadline = time.monotonic() + 30
        while not c.status()["workers"]:
            assert time.monotonic() < deadline, "the worker never registered"
            time.sleep(0.05)
        yield coord, c
    worker.leave("test over", by_signal=False)
    coord.stop()
    working.join(30)
    serving.join(30)


def _boom(*args, **kwargs):
    raise RuntimeError("injected policy bug")


def test_a_policy_bug_fails_loudly_its_action_ends_with_an_error_and_the_coordinator_goes_on(in_process,
                                                                                           monkeypatch, caplog):
    coord, c = in_process
    submit = coord.policy.submit
    poisoned = function("tangram_hpc.handlers:noop", "poisoned")
    monkeypatch.setattr(coord.policy, "submit",
                        lambda spec, now: _boom() if spec.id == poisoned.id else submit(spec, now))
    before = function("tangram_hpc.handlers:noop", 1)
    after = function("tangram_hpc.handlers:noop", 2)
    with caplog.at_level("ERROR", logger="tangram.coordinator"):
        results = c.map([before, poisoned, after], timeout=60)
    # the frame's call failed half way: each of its actions ends once, with the error, none is stranded
    assert [r.id for r in results] == [before.id, poisoned.id, after.id]
    assert all(r.status == Status.ERROR and "internal error" in r.error and "injected policy bug" in r.error
               for r in results), results
    failures = [r for r in caplog.records if "SUBMIT frame failed" in r.getMessage()]
    assert failures and failures[0].exc_info is not None
    st = c.status()
    assert st["internal_errors"] == 1 and st["bad_frames"] == 0
    assert c.submit(function("tangram_hpc.handlers:noop", 1)).result(60).output == 1   # it goes on

    # a bug on the DONE path: the action ends with an error once, the worker stays, the next one runs
    monkeypatch.setattr(coord.policy, "submit", submit)
    finished = coord.policy.finished
    broken = function("tangram_hpc.handlers:noop", "broken")
    monkeypatch.setattr(coord.policy, "finished",
                        lambda aid, now, **kw: _boom() if aid == broken.id else finished(aid, now, **kw))
    r = c.submit(broken).result(60)
    assert r.status == Status.ERROR and "while handling DONE" in r.error
    monkeypatch.setattr(coord.policy, "finished", finished)
    assert c.submit(function("tangram_hpc.handlers:noop", 3)).result(60).output == 3
    st = c.status()
    assert st["internal_errors"] == 2 and st["workers_lost"] == 0 and st["workers"][0]["busy_cores"] == 0


def test_a_heartbeat_with_unhashable_services_is_a_bad_frame_not_an_internal_error(in_process):
    coord, c = in_process
    ctx = zmq.Context()
    try:
        s = _raw(ctx, coord.info.worker_address, identity=b"w-raw")
        s.setsockopt(zmq.RCVTIMEO, 30_000)
        s.send(P.encode(P.REGISTER, {"id": "w-raw", "cores": 1, "kinds": ["raw-only"]}))
        assert P.decode(s.recv(), frozenset({P.WELCOME}))[0] == P.WELCOME
        s.send(P.encode(P.HEARTBEAT, {"running": 0, "services": [["not", "hashable"]], "envs": []}))
        while (reply := P.decode(s.recv(), frozenset({P.ERROR, P.HEARTBEAT})))[0] != P.ERROR:
            pass    # the coordinator's own heartbeats
        assert reply[1]["code"] == "malformed"
    finally:
        ctx.destroy(0)
    st = c.status()
    assert st["bad_frames"] == 1 and st["internal_errors"] == 0


def test_a_worker_lists_its_environments_only_when_they_change_and_again_when_asked(in_process):
    coord, c = in_process
    ctx = zmq.Context()
    probe = 10**6     # a list number the coordinator never received: always asked for

    def asked_for(body: dict) -> list[int]:
        """The list numbers the coordinator asks for after heartbeat ``body``: sent before a probe, it
        is handled and answered before the probe (one worker's frames are, in order)."""
        s.send(P.encode(P.HEARTBEAT, {"running": 0, **body}))
        s.send(P.encode(P.HEARTBEAT, {"running": 0, "envs_v": probe}))
        asked: list[int] = []
        while probe not in asked:
            reply = P.decode(s.recv(), frozenset({P.HEARTBEAT}))[1]
            if "send_envs" in reply:    # else one of the coordinator's own heartbeats
                asked.append(reply["send_envs"])
        return asked[:-1]

    def envs_of(wid: str) -> int:
        return next(w["envs"] for w in c.status()["workers"] if w["id"] == wid)

    try:
        s = _raw(ctx, coord.info.worker_address, identity=b"w-envs")
        s.send(P.encode(P.REGISTER, {"id": "w-envs", "cores": 1, "kinds": ["raw-only"]}))
        assert P.decode(s.recv(), frozenset({P.WELCOME}))[0] == P.WELCOME
        assert asked_for({"envs_v": 1, "envs": ["e1", "e2"]}) == []
        assert envs_of("w-envs") == 2
        assert asked_for({"envs_v": 1}) == []                 # the same list: not sent again, still known
        assert envs_of("w-envs") == 2
        assert asked_for({"envs_v": 2}) == [2]                # a list the coordinator never got: asked for
        assert asked_for({"envs_v": 3, "envs": ["e1"]}) == []
        assert envs_of("w-envs") == 1
        assert asked_for({"envs": ["e1", "e2", "e3"]}) == []  # no number: the list each time
        assert envs_of("w-envs") == 3
        s.send(P.encode(P.HEARTBEAT, {"running": 0, "envs_v": -1}))
        while (reply := P.decode(s.recv(), frozenset({P.ERROR, P.HEARTBEAT})))[0] != P.ERROR:
            pass
        assert reply[1]["code"] == "malformed"
    finally:
        ctx.destroy(0)
    assert c.status()["internal_errors"] == 0


def test_a_coordinators_heartbeat_interval_is_read_only_when_it_is_a_usable_number_of_seconds():
    assert P.heartbeat_interval({"heartbeat_s": 2}) == 2.0
    assert P.heartbeat_interval({"heartbeat_s": 0.25}) == 0.25
    for bad in (None, 0, -1.0, float("nan"), float("inf"), P.MAX_HEARTBEAT_S * 2, True, "2", [2]):
        assert P.heartbeat_interval({"heartbeat_s": bad}) is None, bad
    assert P.heartbeat_interval({}) is None


def test_the_heartbeat_interval_grows_with_the_workers_and_the_silence_that_loses_one_with_it():
    from tangram_hpc.coordinator.heartbeats import HeartbeatPace
    pace = HeartbeatPace(heartbeat_s=1.0, worker_timeout_s=5.0, per_s=1000)
    assert not pace.update(1000, now=0.0)                 # up to 1,000 workers: the configured interval
    assert (pace.interval, pace.lost_after(0.0)) == (1.0, 5.0)
    assert pace.update(2000, now=1.0)                     # 2,000 workers: 1,000 heartbeats a second still
    assert (pace.interval, pace.lost_after(1.0)) == (2.0, 10.0)
    assert pace.update(2100, now=2.0) and pace.interval == 2.25   # in quarter steps
    assert not pace.update(2050, now=3.0)
    # fewer workers: a shorter interval at once, but workers not yet told it are not lost for that
    assert pace.update(500, now=4.0) and pace.interval == 1.0
    assert pace.lost_after(5.0) == 5.0 * 2.25
    assert pace.lost_after(4.0 + 5.0 * 2.25 + 2 * 2.25 + 0.1) == 5.0
    unbounded = HeartbeatPace(heartbeat_s=1.0, worker_timeout_s=5.0, per_s=0)
    assert not unbounded.update(100_000, now=0.0) and unbounded.interval == 1.0


def test_a_submit_keeps_each_action_as_packed_and_its_assign_carries_those_bytes_unchanged():
    specs = [function("tangram_hpc.handlers:noop", i, cores=1 + i % 2).to_wire() for i in range(5)]
    specs[1]["e"], specs[1]["k"], specs[1]["p"] = "env-1", "sandbox", {"cmd": "echo é", "stdin": b"\x00\xff"}
    frame = P.encode(P.SUBMIT, specs)
    mtype, body = P.decode(frame, P.CLIENT_TYPES)
    body = P.with_packed_items(frame, body)
    assert body == specs and [msgpack.unpackb(b, raw=False) for b in body.packed] == specs
    grant = [3, P.GRANT_HELD, None]
    for items in ([[b, 1, 1] for b in body.packed],                          # the one-byte path
                  [[body.packed[0], 200, 1], [body.packed[1], 1, 1000, grant]],   # the general one
                  [[specs[2], 1, 1], [body.packed[2], 2, 2]]):              # a map (in-process) beside bytes
        as_maps = [[msgpack.unpackb(it[0], raw=False) if type(it[0]) is bytes else it[0], *it[1:]] for it in items]
        assert P.encode_assign(items) == P.encode(P.ASSIGN, as_maps)
