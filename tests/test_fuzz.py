"""Protocol fuzzing: random and mutated frames, offline and against a live coordinator.

Offline, every frame goes through what the coordinator (and the client and
worker) do with a frame from the network -- decode, then validate each spec,
registration, outcome or result -- and nothing but ProtocolError or
ValidationError may come out.  Live, the same frames go to both of a running
coordinator's sockets through raw DEALER sockets (random identities on the
worker socket, and a fake worker that registers and then sends mutated
DONE and HEARTBEAT frames), while a well-behaved client keeps submitting and
must keep getting exactly the right results.
"""
from __future__ import annotations

import os

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tangram_hpc import Client, function, sandbox
from tangram_hpc import protocol as P
from tangram_hpc.actions import BUILTIN_KINDS, ActionResult, ActionSpec, Demand, ValidationError
from tangram_hpc.connection import ConnectionInfo
from tangram_hpc.launch import LocalCluster
from tangram_hpc.security import CurveKeys

NOOP = "tangram_hpc.handlers:noop"
#: TANGRAM_FUZZ_SCALE=20 fuzzes twenty times longer (CI runs the default, 1).
SCALE = max(1, int(os.environ.get("TANGRAM_FUZZ_SCALE", "1")))
ALL_TYPES = frozenset(P.NAMES)

# -- seeds: valid frames of every message the coordinator accepts ------------------

_SPECS = [
    function(NOOP, 1).to_wire(),
    function(NOOP, {"a": [1, 2.5, None, True]}).to_wire(),
    sandbox("true").to_wire(),
    ActionSpec(kind="sandbox", payload={"cmd": ["true"], "environ": {"X": "1"}}, env="e1", demand=Demand(1, 2, 64),
               duration_hint=0.5, timeout=10.0, priority=-3, trajectory="t", step=4, label="l",
               idempotency_key="k").to_wire(),
]


def _seed_bodies(worker_id: str = "w-fuzz") -> list[tuple[int, object]]:
    return [
        (P.HELLO, {"name": "fuzz"}),
        (P.SUBMIT, _SPECS),
        (P.SUBMIT, _SPECS[:1]),
        (P.CANCEL, ["0" * 24, "x"]),
        (P.STATUS, {}),
        (P.HEARTBEAT, {}),
        (P.REGISTER, {"id": worker_id, "pid": 1, "cores": 1, "mem_mb": 0, "gpus": 0, "gpu_mem_mb": 0,
                      "kinds": ["fuzz-nothing"], "services": [], "handle": None, "host": "h",
                      "partition": None, "envs": []}),
        (P.HEARTBEAT, {"running": 1, "services": ["s"], "envs_v": 1, "envs": ["e1"]}),
        (P.HEARTBEAT, {"leaving": "bye"}),
        (P.DONE, [["0" * 24, 1, "ok", {"x": 1}, None, 1.0, 2.0, None], ["y", 2, "failed", None, "boom", 0, 0, "kept"]]),
        (P.CLOSE_ENV, ["e1", "fuzz-env"]),
        (P.ENV, [["saved", "e1", 1, "/nonexistent/e1.tar.gz"], ["unsaved", "e1", 2, "why"], ["gone", "e2", 3, None]]),
        (P.OUTCOMES, [["0" * 24, 1, "ok", None, None, 1.0, 2.0, "replayed"]]),
        (P.HEARTBEAT, {"left": "bye", "interrupted": [["0" * 24, 1]]}),
    ]


SEEDS = [P.encode(t, b) for t, b in _seed_bodies()]

# -- mutations -------------------------------------------------------------------------

_leaf = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.floats(allow_nan=True)
         | st.text(max_size=12) | st.binary(max_size=12))
msgpack_values = st.recursive(
    _leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=12)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))


def _replace(obj, path, value):
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, list):
        out = list(obj)
        out[head] = _replace(obj[head], rest, value)
        return out
    out = dict(obj)
    out[head] = _replace(obj[head], rest, value)
    return out


@st.composite
def structural_mutant(draw, seeds=None):
    """A seed message with one node swapped for another msgpack value, or a list shortened."""
    mtype, body = draw(st.sampled_from(seeds or _seed_bodies()))
    msg = [P.PROTOCOL_VERSION, mtype, body]
    path = draw(st.sampled_from(list(_paths(msg))))
    how = draw(st.sampled_from(["swap", "swap", "drop", "dup"]))
    node = msg
    for p in path:
        node = node[p]
    if how == "drop" and isinstance(node, (list, dict)) and node:
        key = draw(st.sampled_from(list(range(len(node))) if isinstance(node, list) else list(node)))
        node = [v for i, v in enumerate(node) if i != key] if isinstance(node, list) else \
            {k: v for k, v in node.items() if k != key}
        msg = _replace(msg, path, node)
    elif how == "dup" and isinstance(node, list) and node:
        msg = _replace(msg, path, node + node[:1])
    else:
        msg = _replace(msg, path, draw(msgpack_values))
    return msgpack.packb(msg, use_bin_type=True)


@st.composite
def byte_mutant(draw, seeds=None):
    """A valid frame with bits flipped, bytes inserted or deleted, or its tail cut off."""
    frame = bytearray(draw(st.sampled_from(seeds or SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "flip", "insert", "delete", "truncate"]))
        if not frame:
            break
        i = draw(st.integers(0, len(frame) - 1))
        if op == "flip":
            frame[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            frame[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete":
            del frame[i]
        else:
            del frame[i:]
    return bytes(frame)


any_frame = st.binary(max_size=300) | byte_mutant() | structural_mutant()

# -- offline ---------------------------------------------------------------------------


def _consume(frame: bytes, allowed: frozenset) -> None:
    """What a peer does with a frame from the network, up to the point where it acts on it."""
    try:
        mtype, body = P.decode(frame, allowed)
    except P.ProtocolError as e:
        assert e.code in {"malformed", "version", "unknown_type", "too_large"}
        return
    items = body if isinstance(body, list) else []
    for item in items:
        try:
            if mtype == P.SUBMIT:
                ActionSpec.from_wire(item)
            elif mtype == P.ASSIGN:
                try:
                    P.check_assign(item)
                except ValidationError:
                    P.assigned_attempt(item)    # what a worker answers a refused assignment with
            elif mtype in (P.DONE, P.OUTCOMES):
                P.check_done(item)
            elif mtype == P.ENV:
                P.check_env_item(item)
            elif mtype == P.RESULT:
                ActionResult.from_wire(item)
        except ValidationError:
            pass
    if mtype == P.REGISTER:
        try:
            P.check_register(body)
        except P.ProtocolError:
            pass
    if mtype == P.HEARTBEAT:
        try:
            P.check_worker_heartbeat(body)
        except P.ProtocolError:
            pass
    if mtype in (P.CLOSE_ENV, P.CANCEL):
        try:
            P.check_ids(mtype, body)
        except P.ProtocolError:
            pass


_offline = settings(max_examples=400 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_offline
@given(st.binary(max_size=2000))
def test_random_bytes_only_raise_protocol_errors(frame):
    _consume(frame, ALL_TYPES)


@_offline
@given(byte_mutant())
def test_bit_flipped_frames_only_raise_protocol_errors(frame):
    _consume(frame, ALL_TYPES)


@_offline
@given(structural_mutant())
def test_type_swapped_frames_only_raise_protocol_errors(frame):
    _consume(frame, ALL_TYPES)


@_offline
@given(msgpack_values)
def test_any_value_as_a_spec_result_or_outcome(value):
    for check, errors in ((ActionSpec.from_wire, ValidationError), (ActionResult.from_wire, ValidationError),
                          (P.check_done, ValidationError)):
        try:
            check(value)
        except errors:
            pass
    if isinstance(value, dict):
        try:
            P.check_register(value)
        except P.ProtocolError:
            pass


@pytest.mark.parametrize("kind", [[], {}, ["function"], 1.5, None, b"function"])
def test_spec_with_an_unhashable_or_odd_kind_is_a_validation_error(kind):
    with pytest.raises(ValidationError):
        ActionSpec.from_wire({"i": "a", "k": kind})


@pytest.mark.parametrize("status", [[], {}, None, 3])
def test_result_with_an_odd_status_is_a_validation_error(status):
    with pytest.raises(ValidationError):
        ActionResult.from_wire(["a", status, None, None, 0.0, 0.0, 0.0, None, 0, 1])


# -- live ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with LocalCluster(workers=1, cores=2, run_dir=tmp_path_factory.mktemp("fuzz"),
                      extra_args=["--worker-timeout", "3"]) as cl, cl.client() as c:
        cl.real_workers = {w["id"] for w in c.status()["workers"]}
        real = cl.real_workers
        yield cl, c, ConnectionInfo.read(cl.connection_file)
        assert cl.proc.poll() is None, "the coordinator died during fuzzing"
        assert real <= {w["id"] for w in c.status()["workers"]}, "a real worker died during fuzzing"


_PROBE_TYPE = 12345  # an unknown type: always answered with an ERROR naming it, after all earlier frames


def _send_and_sync(ctx: zmq.Context, info: ConnectionInfo, address: str, frames: list[bytes],
                   identity: bytes | None = None) -> None:
    """Send frames on a fresh DEALER (holding the client key), then wait until the coordinator handled them."""
    s = ctx.socket(zmq.DEALER)
    CurveKeys.apply_client(s, info)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    if identity is not None:
        s.setsockopt(zmq.IDENTITY, identity)
    s.connect(address)
    try:
        for f in frames:
            s.send(f)
        s.send(msgpack.packb([P.PROTOCOL_VERSION, _PROBE_TYPE, {}]))
        while True:
            reply = s.recv()  # zmq.Again here: the coordinator stopped answering
            try:
                mtype, body = P.decode(reply, ALL_TYPES)
            except P.ProtocolError:
                continue
            if mtype == P.ERROR and str(_PROBE_TYPE) in body.get("message", ""):
                return
    finally:
        s.close(0)


class _Valid:
    """A well-behaved client whose actions are in flight while the fuzz frames arrive."""

    def __init__(self, client: Client):
        self.client = client
        self.n = 0
        self.inflight: list = []

    def submit(self) -> list[str]:
        specs = [function(NOOP, ["valid", self.n + i]) for i in range(4)] + [sandbox(f"echo v{self.n}")]
        self.inflight.append((self.n, specs, self.client.submit_many(specs)))
        self.n += 4
        return [s.id for s in specs]

    def check(self) -> None:
        for n, specs, futs in self.inflight:
            res = Client.gather(futs, timeout=30)
            assert [r.id for r in res] == [s.id for s in specs]
            assert [r.output for r in res[:4]] == [["valid", n + i] for i in range(4)], [r.error for r in res]
            assert res[4].ok and res[4].output["stdout"] == f"v{n}\n"
        self.inflight.clear()


def _alive(cl: LocalCluster, client: Client) -> None:
    assert cl.proc.poll() is None, "the coordinator died"
    workers = {w["id"] for w in client.status()["workers"]}
    assert cl.real_workers <= workers, "a real worker was lost (crashed, or dropped by the coordinator)"


_live = settings(max_examples=120 * SCALE, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])


@pytest.mark.slow
@_live
@given(frames=st.lists(any_frame, min_size=1, max_size=6))
def test_live_client_socket_fuzz(live, frames):
    cl, client, info = live
    # Keep fuzzed demands runnable on this cluster: an unplaceable action fails on its own
    # (test_unplaceable_action_fails_and_blocks_nothing checks that separately).
    assume(all(_runnable(f) for f in frames))
    valid = _Valid(client)
    valid.submit()
    ctx = zmq.Context.instance()
    _send_and_sync(ctx, info, info.client_address, frames)
    valid.submit()
    valid.check()
    _alive(cl, client)


def _runnable(frame: bytes) -> bool:
    try:
        mtype, body = P.decode(frame, P.CLIENT_TYPES)
    except P.ProtocolError:
        return True
    if mtype != P.SUBMIT:
        return True
    for w in body:
        try:
            spec = ActionSpec.from_wire(w)
        except ValidationError:
            continue
        d = spec.demand
        if d.min_cores > 2 or d.gpu_mem_mb or d.service or spec.kind not in ("function", "sandbox"):
            return False
    return True


_identity = st.binary(min_size=1, max_size=24).filter(lambda b: b[0] != 0)


@pytest.mark.slow
@_live
@given(identity=_identity, register=st.booleans(), data=st.data())
def test_live_worker_socket_fuzz(live, identity, register, data):
    cl, client, info = live
    valid = _Valid(client)
    real_ids = valid.submit()
    wid = identity.decode("utf-8", "replace")
    seeds = _seed_bodies(wid)
    worker_seeds = [(t, b) for t, b in seeds if t in (P.REGISTER, P.HEARTBEAT, P.DONE, P.ENV, P.OUTCOMES)]
    # DONE frames naming the valid client's in-flight actions: a worker must not be able to finish
    # an action it was not given.
    worker_seeds.append((P.DONE, [[aid, a, "ok", "forged", None, 0.0, 0.0, None] for aid in real_ids for a in (1, 2)]))
    frames = data.draw(st.lists(st.binary(max_size=300) | byte_mutant([P.encode(t, b) for t, b in worker_seeds])
                                | structural_mutant(worker_seeds) | st.sampled_from([P.encode(*s) for s in worker_seeds]),
                                min_size=1, max_size=6))
    if register:  # a registered fake worker, so that DONE and HEARTBEAT reach the code that acts on them
        frames.insert(0, P.encode(*seeds[6]))
    # A registered worker is trusted with the actions it is given (keys are the gate to registering):
    # the fuzzer must not register one that real actions would be sent to.
    assume(not any(_serves_real_actions(f) for f in frames))
    ctx = zmq.Context.instance()
    _send_and_sync(ctx, info, info.worker_address, frames, identity=identity)
    valid.submit()
    valid.check()
    _alive(cl, client)


@pytest.mark.parametrize("kinds", [["fuzz-notHing"], ["ok-kind", "Bad Kind"], ["x" * 40]])
def test_a_register_naming_an_invalid_kind_is_refused_and_registers_nothing(live, kinds):
    cl, client, info = live
    wid = "w-bad-kinds"
    body = dict(_seed_bodies(wid)[6][1], kinds=kinds)
    s = zmq.Context.instance().socket(zmq.DEALER)
    CurveKeys.apply_client(s, info)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    s.setsockopt(zmq.IDENTITY, wid.encode())
    s.connect(info.worker_address)
    try:
        s.send(P.encode(P.REGISTER, body))
        mtype, reply = P.decode(s.recv(), ALL_TYPES)
    finally:
        s.close(0)
    assert mtype == P.ERROR and "invalid kind names" in reply["message"]
    assert wid not in {w["id"] for w in client.status()["workers"]}
    _alive(cl, client)


def _serves_real_actions(frame: bytes) -> bool:
    try:
        mtype, body = P.decode(frame, P.WORKER_TYPES)
        if mtype != P.REGISTER:
            return False
        reg = P.check_register(body)
    except P.ProtocolError:
        return False
    return not reg["kinds"] or any(k in BUILTIN_KINDS for k in reg["kinds"])


@pytest.mark.slow
def test_coordinator_counted_the_fuzz_and_still_serves(live):
    cl, client, _ = live
    st_ = client.status()
    assert st_["bad_frames"] > 0 and cl.proc.poll() is None
    # hostile frames are refused at the edge: none of them reached the ledger or the policy as a failure
    assert st_["internal_errors"] == 0
    assert [r.output for r in client.map([function(NOOP, i) for i in range(100)], timeout=30)] == list(range(100))


@pytest.mark.slow
def test_bad_item_in_a_submit_batch_fails_alone(live):
    """One malformed spec in a SUBMIT frame gets an error result; the specs after it still run."""
    _, _, info = live
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    CurveKeys.apply_client(s, info)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    s.connect(info.client_address)
    try:
        before, after = function(NOOP, "before").to_wire(), function(NOOP, "after").to_wire()
        s.send(P.encode(P.SUBMIT, [before, {"i": "bad-kind", "k": []}, after]))
        seen = {}
        while len(seen) < 3:
            mtype, body = P.decode(s.recv(), frozenset({P.RESULT, P.ERROR}))
            assert mtype == P.RESULT, body
            seen.update((r[0], r) for r in body)
        assert seen[before["i"]][2] == "before" and seen[after["i"]][2] == "after"
        assert seen["bad-kind"][1] == "error" and "unknown action kind" in seen["bad-kind"][3]
    finally:
        s.close(0)


@pytest.mark.slow
@pytest.mark.parametrize("fn", [["os:getpid"], {"x": 1}, 7, None])
def test_function_action_with_an_odd_target_fails_alone(live, fn):
    """An action whose target is not a string gets an error result and costs no worker."""
    cl, client, _ = live
    # The real worker's process, not the loss counter: fake workers the socket fuzz registered are
    # dropped as silent up to --worker-timeout later, and each drop counts as a loss.
    before = _real_worker_processes(cl, client)
    odd = ActionSpec(kind="function", payload={"fn": fn})
    good = [function(NOOP, i) for i in range(10)]
    res = client.map([odd] + good, timeout=30)
    assert res[0].status == "error" and res[0].attempts == 1 and "function payload must be" in res[0].error
    assert [r.output for r in res[1:]] == list(range(10))
    assert _real_worker_processes(cl, client) == before


def _real_worker_processes(cl: LocalCluster, client: Client) -> set[tuple[str, int]]:
    return {(w["id"], w["pid"]) for w in client.status()["workers"] if w["id"] in cl.real_workers}


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fifo", "elastic"])
def test_unplaceable_action_fails_and_blocks_nothing(tmp_path, policy):
    with LocalCluster(workers=1, cores=1, run_dir=tmp_path, extra_args=["--policy", policy]) as cl, \
            cl.client() as c:
        stuck = c.submit(function(NOOP, "needs 8 cores", cores=8))
        assert c.submit(function(NOOP, "fits")).result(30).output == "fits"
        r = stuck.result(10)
        assert r.status == "error" and "cannot be placed" in r.error and "8" in r.error
