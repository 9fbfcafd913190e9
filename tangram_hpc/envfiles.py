"""What a worker writes about an environment and the coordinator reads: the environment's
directory name under a worker's root and the identity in a snapshot's header; and the flags
that open a directory without following a symlink, which both sides use.

Core, shared by ``managers/environments.py`` and ``managers/env_snapshots.py`` (which write them)
and ``coordinator/state_dir.py`` (which finds snapshots and removes a lost worker's environments),
so that the coordinator does not import the sandbox manager.
"""
from __future__ import annotations

import hashlib
import os
import re
import tarfile

# pax header keys of a snapshot naming the environment and its generation
PAX_ENV, PAX_GEN = "TANGRAM.env", "TANGRAM.generation"
#: Flags that open a directory: never through a symlink, never blocking.
NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def env_dirname(env_id: str) -> str:
    """The directory name of an environment under a worker's root (readable, and unique by its hash)."""
    return f"{_SAFE.sub('_', env_id)[:48]}-{hashlib.sha1(env_id.encode()).hexdigest()[:12]}"


def snapshot_identity(path: str | os.PathLike) -> tuple[str, int] | None:
    """(environment id, generation) a snapshot was saved as, from its pax header; None if unreadable."""
    try:
        with tarfile.open(path, "r:*") as tar:
            env_id = tar.pax_headers.get(PAX_ENV)
            gen = int(tar.pax_headers.get(PAX_GEN, "0"))
    except (OSError, tarfile.TarError, ValueError, EOFError):
        return None
    return (env_id, gen) if env_id else None
