"""Only holders of the coordinator's client key get in; files holding secrets are private."""
import os
import stat
import subprocess
import sys

import pytest
import zmq
import zmq.auth

from tangram_hpc import protocol as P
from tangram_hpc.actions import function
from tangram_hpc.connection import ConnectionInfo
from tangram_hpc.security import CurveKeys


def _silent(sock, timeout_ms=1500):
    return not sock.poll(timeout_ms, zmq.POLLIN)


@pytest.fixture(scope="module")
def info(cluster):
    return ConnectionInfo.read(cluster.connection_file)


def test_connection_and_key_files_are_private(cluster, info):
    assert info.secure and info.server_public_key
    assert stat.S_IMODE(os.stat(cluster.connection_file).st_mode) == 0o600
    key_dir = os.path.dirname(info.client_key_file)
    assert stat.S_IMODE(os.stat(key_dir).st_mode) == 0o700
    for f in os.listdir(key_dir):
        assert stat.S_IMODE(os.stat(os.path.join(key_dir, f)).st_mode) == 0o600


@pytest.mark.parametrize("keys", ["none", "wrong_client_key", "wrong_server_key"])
@pytest.mark.parametrize("socket_name", ["client", "worker"])
def test_peer_without_the_key_cannot_submit_register_or_read(cluster, info, client, keys, socket_name, tmp_path):
    before = client.status()
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, b"intruder-" + os.urandom(3).hex().encode())
        if keys != "none":
            pub, sec = zmq.curve_keypair()
            s.curve_publickey, s.curve_secretkey = pub, sec
            s.curve_serverkey = info.server_public_key.encode() if keys == "wrong_client_key" else zmq.curve_keypair()[0]
        s.connect(info.client_address if socket_name == "client" else info.worker_address)
        spec = function("tangram_hpc.handlers:noop", 1)
        if socket_name == "client":
            s.send(P.encode(P.SUBMIT, [spec.to_wire()]))
            s.send(P.encode(P.STATUS, {}))
        else:
            s.send(P.encode(P.REGISTER, {"id": s.getsockopt(zmq.IDENTITY).decode(), "cores": 64}))
        assert _silent(s), "an unauthenticated peer got an answer"
    finally:
        ctx.destroy(0)
    after = client.status()
    assert after["submitted"] == before["submitted"]
    assert len(after["workers"]) == len(before["workers"])
    assert after["bad_frames"] == before["bad_frames"]   # never even reached the protocol layer


def test_raw_socket_with_the_key_is_served(info):
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        CurveKeys.apply_client(s, info)
        s.connect(info.client_address)
        s.send(P.encode(P.STATUS, {}))
        assert s.poll(10_000, zmq.POLLIN)
        mtype, body = P.decode(s.recv(), frozenset({P.STATUS}))
        assert body["coordinator"] == info.coordinator_id
    finally:
        ctx.destroy(0)


def test_insecure_mode_is_refused_off_loopback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tangram_hpc.cli", "coordinator", "--run-dir", str(tmp_path),
                        "--backend", "none", "--insecure", "--host", "0.0.0.0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "only allowed on a loopback address" in r.stderr
    assert not (tmp_path / "connection.json").exists()


def test_keys_survive_a_restart(tmp_path):
    a = CurveKeys.load_or_create(tmp_path / "keys")
    b = CurveKeys.load_or_create(tmp_path / "keys")
    assert a.server_public == b.server_public and a.client_public == b.client_public
    pub, sec = zmq.auth.load_certificate(str(a.client_key_file))
    assert pub == a.client_public and sec
