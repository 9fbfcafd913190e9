"""One :class:`~tangram_hpc.client.Client` per process and connection file, for the integrations.

A framework builds many environments, reward functions or tools, often from many threads; they
all share one client (its own I/O thread resolves every future).  A forked or Ray worker process
gets its own, since a client does not survive a fork.
"""
from __future__ import annotations

import os
import threading

from tangram_hpc.client import Client
from tangram_hpc.connection import CONNECTION_FILE_ENV, default_connection_file
from tangram_hpc.errors import ConfigError

__all__ = ["shared_client"]

_lock = threading.Lock()
_clients: dict[tuple[int, str], Client] = {}


def shared_client(connection_file: str | None, name: str) -> Client:
    """The process's client of ``connection_file`` (default ``$TANGRAM_CONNECTION_FILE``)."""
    path = connection_file or default_connection_file()
    if not path:
        raise ConfigError(f"{name}: give the coordinator's connection file or set ${CONNECTION_FILE_ENV}")
    key = (os.getpid(), str(path))
    with _lock:
        c = _clients.get(key)
        if c is None:
            c = _clients[key] = Client(connection_file=key[1], name=f"{name}-{os.getpid()}")
        return c
