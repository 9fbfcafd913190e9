"""The connection file: how clients and workers find (and authenticate to) a coordinator.

The coordinator writes it atomically with mode 0600 into its run directory
(or wherever ``--connection-file`` says, e.g. a shared directory that a
training job reads).  It is JSON because it is read once per process, by
people as well as programs.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import ConfigError

#: The variable naming the connection file, for clients, workers and the coordinator alike.
CONNECTION_FILE_ENV = "TANGRAM_CONNECTION_FILE"


@dataclass(slots=True)
class ConnectionInfo:
    client_address: str
    worker_address: str
    coordinator_id: str = ""
    run_dir: str = ""
    created: float = field(default_factory=time.time)
    #: CurveZMQ: the coordinator's public key, and the path of the key file
    #: holding the client/worker key pair it accepts.  Empty when insecure.
    server_public_key: str = ""
    client_key_file: str = ""
    version: int = 1
    #: The Slurm job the coordinator runs in ("" outside one): a launch script asks squeue whether
    #: the coordinator of an existing file still runs before it writes over it.
    slurm_job_id: str = ""

    @property
    def secure(self) -> bool:
        return bool(self.server_public_key)

    def write(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=2)
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: str | os.PathLike) -> "ConnectionInfo":
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"no connection file at {path}: is the coordinator running?") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"connection file {path} is not valid JSON: {e}") from None
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        if "client_address" not in known or "worker_address" not in known:
            raise ConfigError(f"connection file {path} lacks the coordinator addresses")
        return cls(**known)


def wait_for_file(path: str | os.PathLike, timeout: float = 60.0, poll: float = 0.05) -> ConnectionInfo:
    """Wait until a coordinator has written its connection file, then read it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ConnectionInfo.read(path)
        except (FileNotFoundError, ValueError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no coordinator connection file at {path} after {timeout:.0f}s") from None
            time.sleep(poll)


def reread_connection(path: str | os.PathLike | None, current: ConnectionInfo | None, address: str, *,
                      worker: bool = False) -> ConnectionInfo | None:
    """After a silence: the connection file's new contents when the coordinator moved (its client
    address, or with ``worker`` its worker address, is no longer ``address``) or was re-keyed."""
    if not path:
        return None
    try:
        info = ConnectionInfo.read(path)
    except (OSError, ValueError):
        return None
    now_at = info.worker_address if worker else info.client_address
    if now_at == address and info.server_public_key == getattr(current, "server_public_key", ""):
        return None
    return info


def default_connection_file() -> str | None:
    return os.environ.get(CONNECTION_FILE_ENV) or None
