"""CurveZMQ authentication and encryption for the coordinator's two sockets.

Threat model (see the README): on a shared cluster anyone on the network can
connect to an open port.  The coordinator therefore generates, at its first
start, a server key pair and one client key pair, kept in ``RUN_DIR/keys``
(directory 0700, secret files 0600).  Both sockets are CURVE servers, and a
ZAP handler admits only peers that present the client public key -- i.e.
processes that can read the client secret file, which the connection file
points to.  Without it a peer cannot complete the handshake, so it can
neither submit, register, nor read anything; the traffic of those that can
is encrypted.  Sandboxed code never sees the key directory (see
docs/sandbox.md).

Keys are stored in ZMQ's certificate format (``zmq.auth``), so standard
tools can read them.  A restarted coordinator reuses the keys of its run
directory, so its clients and workers reconnect without new files.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from .connection import ConnectionInfo


@dataclass
class CurveKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_key_file: Path
    _auth: ThreadAuthenticator | None = None

    @classmethod
    def load_or_create(cls, key_dir: str | os.PathLike) -> "CurveKeys":
        key_dir = Path(key_dir)
        old = os.umask(0o077)  # secrets are never readable by others, not even for a moment
        try:
            key_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(key_dir, 0o700)
            if not (key_dir / "server.key_secret").exists():
                zmq.auth.create_certificates(str(key_dir), "server")
            if not (key_dir / "client.key_secret").exists():
                zmq.auth.create_certificates(str(key_dir), "client")
        finally:
            os.umask(old)
        for f in key_dir.iterdir():
            os.chmod(f, 0o600)
        spub, ssec = zmq.auth.load_certificate(str(key_dir / "server.key_secret"))
        cpub, _ = zmq.auth.load_certificate(str(key_dir / "client.key_secret"))
        return cls(spub, ssec, cpub, key_dir / "client.key_secret")

    @property
    def server_public_text(self) -> str:
        return self.server_public.decode("ascii")

    def apply_server(self, clients: zmq.Socket, workers: zmq.Socket, ctx: zmq.Context) -> None:
        """Make both sockets CURVE servers that admit only holders of the client key."""
        allowed = self.client_public

        class _OnlyOurClientKey:
            def callback(self, domain: str, key: bytes) -> bool:
                return key == allowed

        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=_OnlyOurClientKey())
        for s in (clients, workers):
            s.curve_secretkey = self.server_secret
            s.curve_publickey = self.server_public
            s.curve_server = True

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    @staticmethod
    def apply_client(sock: zmq.Socket, conn: ConnectionInfo) -> None:
        """Give a client or worker socket the key pair the connection file points to."""
        try:
            public, secret = zmq.auth.load_certificate(conn.client_key_file)
        except (OSError, ValueError) as e:
            raise PermissionError(f"cannot read the coordinator's client key {conn.client_key_file}: {e}") from None
        if secret is None:
            raise PermissionError(f"{conn.client_key_file} holds no secret key")
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = conn.server_public_key.encode("ascii")


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
