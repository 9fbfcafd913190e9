"""Disk use of an environment directory, measured from the host while sandboxed code changes it.

There is no portable kernel quota for one directory (project quotas need a
prepared filesystem, loop mounts need root), so the quota is enforced by
measuring: while a command runs, a :class:`QuotaWatch` walks the environment
every so often (more rarely for big trees, so a walk costs at most a tenth of
the time) and the command is killed once it has grown the environment past
its quota; the walk at the end decides whether the action failed.  Together
with ``RLIMIT_FSIZE`` capped at the quota and ``fallocate`` refused by the
seccomp filter, an action can overshoot by at most what it writes in one
interval.  An environment already over its quota (after such an overshoot,
or from a large template) may still run actions that shrink it.

The walk runs as root on a tree that hostile code may be changing: every
directory is opened relative to its parent with ``O_NOFOLLOW | O_DIRECTORY |
O_NONBLOCK`` and nothing else is opened, so a symlink cannot lead it out of
the environment and a FIFO cannot block it.
"""
from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from .environments import NOFOLLOW_DIR

__all__ = ["DiskUsage", "measure", "QuotaWatch", "MAX_DEPTH"]

#: Deeper trees are not measured further (each level holds one descriptor while walked);
#: such a tree counts as over quota.
MAX_DEPTH = 256
_MB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class DiskUsage:
    bytes: int          # allocated blocks (a sparse file counts what it holds), hard links once
    files: int          # directory entries below the root, of any type
    too_deep: bool = False

    @property
    def mb(self) -> float:
        return self.bytes / _MB


def measure(root: Path | str) -> DiskUsage:
    """Disk use of the tree under ``root`` (not following symlinks, opening no file)."""
    try:
        top = os.open(root, NOFOLLOW_DIR)
    except OSError:
        return DiskUsage(0, 0)
    walk = _Walk()
    try:
        walk.bytes = os.fstat(top).st_blocks * 512
        walk.dir(top, 1)
    finally:
        os.close(top)
    return DiskUsage(walk.bytes, walk.files, walk.too_deep)


class _Walk:
    def __init__(self) -> None:
        self.bytes = 0
        self.files = 0
        self.too_deep = False
        self._seen: set[tuple[int, int]] = set()

    def dir(self, fd: int, depth: int) -> None:
        # Depth-first, holding one descriptor per level (never one per pending sibling).
        subdirs: list[str] = []
        with os.scandir(fd) as it:
            for entry in it:
                self.files += 1
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                    key = (st.st_dev, st.st_ino)
                    if key in self._seen:
                        continue
                    self._seen.add(key)
                self.bytes += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    subdirs.append(entry.name)
        if subdirs and depth >= MAX_DEPTH:
            self.too_deep = True
            return
        for name in subdirs:
            try:
                child = os.open(name, NOFOLLOW_DIR, dir_fd=fd)
            except OSError:
                continue  # replaced by a non-directory, or removed, meanwhile
            try:
                self.dir(child, depth + 1)
            finally:
                os.close(child)


class QuotaWatch:
    """Checks one action's environment against ``disk_mb`` / ``disk_files``.

    ``check()`` returns None while within the quota, else why the action
    must stop.  Growth is what is refused: an environment that starts over
    its quota may shrink (or stay) without being stopped.
    """

    def __init__(self, root: Path, disk_mb: int | None, disk_files: int | None):
        self.root = root
        self.max_bytes = disk_mb * _MB if disk_mb else None
        self.max_files = disk_files
        self.start = measure(root)
        self.last = self.start
        self.walk_s = 0.0

    @property
    def active(self) -> bool:
        return self.max_bytes is not None or self.max_files is not None

    def interval(self) -> float:
        """Seconds until the next check: a walk may take a tenth of the time at most."""
        return max(0.1, 10 * self.walk_s)

    def check(self) -> str | None:
        t0 = time.perf_counter()
        self.last = u = measure(self.root)
        self.walk_s = time.perf_counter() - t0
        if u.too_deep:
            return f"disk quota: the environment nests directories deeper than {MAX_DEPTH} levels"
        if self.max_bytes is not None and u.bytes > max(self.max_bytes, self.start.bytes):
            return (f"disk quota exceeded: the environment holds {u.mb:.1f} MiB, over its quota of "
                    f"{self.max_bytes // _MB} MiB (limits.disk_mb)")
        if self.max_files is not None and u.files > max(self.max_files, self.start.files):
            return (f"disk quota exceeded: the environment holds {u.files} files, over its quota of "
                    f"{self.max_files} (limits.disk_files)")
        return None
