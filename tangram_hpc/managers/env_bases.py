"""Template bases: what lets a move carry only what an environment changed.

An environment made from a template (a repository checkout, a venv) is a copy of that
template's *base*: one pristine build per template on each worker, kept out of every
sandbox's sight, with

* its *fingerprint*: a hash of every entry's path, type, mode and content (file bytes,
  link target), so two workers know they hold the same base without comparing trees;
* its *manifest*: path -> (st_mode, size, mtime_ns) of each entry, as the copies have it.

Each copy remembers (:class:`BaseRef`) the base it came from, the time its last write by
the worker ended (``since``) and the paths a restore wrote into it (``dirty``).  An entry
of the copy is *unchanged* when the manifest has it with the same mode, size and mtime,
its ctime is not after ``since`` and no restore wrote it.  Sandboxed code can set an
mtime but not a ctime (the kernel stamps it on every write, chmod, rename or link, and
only a privileged process may set the clock), so a snapshot that leaves out unchanged
entries and lists the base's entries that are gone holds everything needed to rebuild
the copy from the same base.  ``since`` is taken only once the clock that stamps ctimes
has moved past it (:func:`settled_now`), so a write in the same clock tick as the end of
the copy still counts as a change.
"""
from __future__ import annotations

import hashlib
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Base", "BaseRef", "scan_base", "settled_now", "unchanged"]

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Base:
    fingerprint: str
    path: Path                                   # the pristine copy (never handed to a sandbox)
    manifest: dict[str, tuple[int, int, int]]    # "./rel/path" -> (st_mode, size, mtime_ns)


@dataclass(frozen=True)
class BaseRef:
    """Where an environment's copy came from, for a snapshot of what it changed since."""

    fingerprint: str
    since: int                                   # ns; entries with a later ctime changed
    dirty: frozenset[str] = field(default_factory=frozenset)   # written by a restore: never the base's


def scan_base(path: Path) -> Base:
    """Fingerprint and manifest of the tree at ``path`` (the worker's own pristine build)."""
    digest = hashlib.sha256()
    manifest: dict[str, tuple[int, int, int]] = {}
    root = str(path)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = "." + dirpath[len(root):]
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            rel = f"{rel_dir}/{name}"
            st = os.lstat(full)
            manifest[rel] = (st.st_mode, st.st_size, st.st_mtime_ns)
            digest.update(f"{rel}\0{st.st_mode:o}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                digest.update(os.fsencode(os.readlink(full)))
            elif stat.S_ISREG(st.st_mode):
                with open(full, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        digest.update(chunk)
            digest.update(b"\1")
    return Base(digest.hexdigest()[:32], Path(path), manifest)


def settled_now(probe: Path) -> int:
    """A time (ns) that every later change's ctime is after: now, once ctimes are stamped past it.

    The kernel stamps ctimes from a clock that may lag the precise one by a tick; ``probe``
    (a directory of the worker's own, not the copy's entries) is touched until its ctime shows
    that clock past the returned time.
    """
    t = time.time_ns()
    while True:
        os.utime(probe)
        if os.stat(probe).st_ctime_ns > t:
            return t
        time.sleep(0.0005)


def unchanged(st: os.stat_result, seen: tuple[int, int, int], ref: BaseRef, rel: str) -> bool:
    """Whether the entry ``rel`` of a copy, with lstat ``st``, is still the base's (manifest ``seen``)."""
    return (st.st_ctime_ns <= ref.since and st.st_mode == seen[0] and st.st_size == seen[1]
            and st.st_mtime_ns == seen[2] and rel not in ref.dirty)
