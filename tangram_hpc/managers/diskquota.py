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

Walking costs about 7 us per file, so a large environment is not walked when
it cannot be over its quota: if the filesystem holding it has not grown (one
``statvfs``) by more than the environment's headroom since its last walk,
nothing in it can have.  (Space freed elsewhere on the filesystem at the same
moment can hide growth until the environment grows again.)  The last walk is
kept with the environment (:class:`Measured`), so the next action starts
from it.

The layer of the attempt running (``layer``, :mod:`tangram_hpc.managers.env_layers`)
is walked with the environment.  What an environment holds outside its tree
counts too (``outside``): its journal, and files its commands deleted while
holding them open
(:func:`held_deleted`, found through the environment's own uid in ``/proc``).
A loop filesystem or a project quota per environment would see those by
construction, but needs a prepared filesystem or a mount per environment on
every node; the cgroup's I/O accounting counts bytes written, not bytes held,
and misses the page cache until writeback.

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
from typing import Callable

from . import fs_inside
from .env_layers import DONE, MERGE, WHITEOUT, walk_layer
from .fs_inside import EnvError, TreeMoved, _OpenPath, _walk

__all__ = ["DiskUsage", "Measured", "measure", "QuotaWatch", "MAX_DEPTH", "held_outside", "held_deleted"]

#: Deeper trees (and paths longer than ``MAX_PATH_BYTES``) are not measured further, as they are
#: not saved: such a tree counts as over quota.
MAX_DEPTH = fs_inside.MAX_DEPTH
#: Walks a tree changed under (a directory it was in moved meanwhile) before it counts as unmeasured.
_WALK_TRIES = 3
#: Trees that walk faster than this are walked at every check (exact figures, negligible cost).
_CHEAP_WALK_S = 0.002
_MB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class DiskUsage:
    bytes: int          # allocated blocks (a sparse file counts what it holds), hard links once
    files: int          # directory entries below the root, of any type
    unmeasured: str | None = None   # why the tree was not measured whole (it counts as over quota)

    @property
    def mb(self) -> float:
        return self.bytes / _MB


def measure(root: Path | str) -> DiskUsage:
    """Disk use of the tree under ``root`` (not following symlinks, opening no file)."""
    return _retried(_measure_once, root)


def _measure_once(tally: "_Tally", root: Path | str) -> None:
    try:
        cur = _OpenPath(root)
    except OSError:
        return
    try:
        tally.bytes += os.fstat(cur.fd).st_blocks * 512
        tally.tree(cur)
    finally:
        cur.close()


def _retried(walk_once, *args) -> DiskUsage:
    """``walk_once(tally, *args)``, walked again when a directory it was in moved meanwhile
    (sandboxed code renames as it likes); a tree too deep, or changed under every try, is
    measured as far as the walk went, with why."""
    why = None
    for _ in range(_WALK_TRIES):
        tally = _Tally()
        try:
            walk_once(tally, *args)
            return DiskUsage(tally.bytes, tally.files)
        except TreeMoved as exc:
            why = str(exc)
        except EnvError as exc:
            return DiskUsage(tally.bytes, tally.files, str(exc))
    return DiskUsage(tally.bytes, tally.files, why)


class _Tally:
    """Bytes and entries of walked trees, hard links counted once."""

    def __init__(self) -> None:
        self.bytes = 0
        self.files = 0
        self._seen: set[tuple[int, int]] = set()

    def add(self, st: os.stat_result) -> None:
        self.files += 1
        if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
            key = (st.st_dev, st.st_ino)
            if key in self._seen:
                return
            self._seen.add(key)
        self.bytes += st.st_blocks * 512

    def tree(self, cur: _OpenPath) -> None:
        """Everything below ``cur``'s directory (without recursion, one descriptor; a directory
        the walker may not enter -- sandboxed code's chmod, for a worker that is not root -- counts
        without its entries)."""
        for _, st in _walk(cur, skip_denied=True):
            if st is not None:
                self.add(st)


@dataclass(frozen=True, slots=True)
class Measured:
    """One walk of an environment: what it held, the filesystem's use just before, its cost."""

    usage: DiskUsage
    fs: DiskUsage | None
    walk_s: float


def _fs_used(root: Path) -> DiskUsage | None:
    try:
        st = os.statvfs(root)
    except OSError:
        return None
    return DiskUsage((st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree)


def walk(root: Path, also: Path | None = None) -> Measured:
    """One walk of ``root`` (and of ``also``, the layer of the attempt running in it, summed)."""
    fs = _fs_used(root)
    t0 = time.perf_counter()
    usage = measure(root)
    if also is not None:
        more, hidden = measure(also), _hidden(also, root)
        usage = DiskUsage(usage.bytes + more.bytes - hidden.bytes, usage.files + more.files - hidden.files,
                          usage.unmeasured or more.unmeasured or hidden.unmeasured)
    return Measured(usage, fs, time.perf_counter() - t0)



def _hidden(upper: Path, lower: Path) -> DiskUsage:
    """What of ``lower`` and ``upper`` the merge of the overlay layer ``upper`` takes away: the
    lower entries it removes or replaces, the lower copies of the directories both hold, its
    whiteouts -- so that a layer that deletes files shrinks the environment's use.  Walks what
    the merge walks (:func:`~tangram_hpc.managers.env_layers.walk_layer`)."""
    return _retried(_hidden_once, upper, lower)


def _hidden_once(tally: "_Tally", upper: Path, lower: Path) -> None:
    try:
        up = _OpenPath(upper)
    except OSError:
        return
    try:
        low = _OpenPath(lower)
    except OSError:
        up.close()
        return
    try:
        for name, kind, st, below in walk_layer(up, low):
            if kind == WHITEOUT:
                tally.add(st)
            if below is None or kind == DONE:
                continue
            tally.add(below)
            if kind != MERGE and stat.S_ISDIR(below.st_mode):   # removed or replaced whole
                low.down(name)
                tally.tree(low)
                low.up()
    finally:
        up.close()
        low.close()


class QuotaWatch:
    """Checks one action's environment against ``disk_mb`` / ``disk_files``.

    ``check()`` returns None while within the quota, else why the action
    must stop.  Growth is what is refused: an environment that starts over
    its quota may shrink (or stay) without being stopped.  ``known`` is the
    environment's last :class:`Measured` walk, if any; :attr:`measured` is the
    latest one, to keep for the next action.
    """

    def __init__(self, root: Path, disk_mb: int | None, disk_files: int | None, known: Measured | None = None,
                 outside: Callable[[], int] | None = None, layer: Path | None = None):
        self.root = root
        self.layer = layer
        self.max_bytes = disk_mb * _MB if disk_mb else None
        self.max_files = disk_files
        self.measured = known if known is not None else walk(root, layer) if self.active \
            else Measured(DiskUsage(0, 0), None, 0.0)
        self._outside = outside
        #: bytes the environment holds outside its tree (its journal, files deleted while open)
        self.outside_bytes = outside() if outside is not None and self.max_bytes is not None else 0
        start = self.measured.usage
        self.allowed_bytes = max(self.max_bytes, start.bytes + self.outside_bytes) if self.max_bytes is not None else None
        self.allowed_files = max(self.max_files, start.files) if self.max_files is not None else None

    @property
    def active(self) -> bool:
        return self.max_bytes is not None or self.max_files is not None

    @property
    def last(self) -> DiskUsage:
        """The environment's use at its latest walk."""
        return self.measured.usage

    def interval(self) -> float:
        """Seconds until the next check: a walk may take a tenth of the time at most."""
        return max(0.1, 10 * self.measured.walk_s)

    def check(self) -> str | None:
        if self.measured.walk_s > _CHEAP_WALK_S and self._cannot_be_over():
            return None
        self.measured = m = walk(self.root, self.layer)
        u = m.usage
        if u.unmeasured:
            return f"disk quota: {u.unmeasured}; it counts as over quota"
        if self._outside is not None and self.allowed_bytes is not None:
            self.outside_bytes = self._outside()
        held = u.bytes + self.outside_bytes
        if self.allowed_bytes is not None and held > self.allowed_bytes:
            beside = (f" ({self.outside_bytes / _MB:.1f} MiB of it in its journal and in files deleted "
                      f"but still open)" if self.outside_bytes else "")
            return (f"disk quota exceeded: the environment holds {held / _MB:.1f} MiB{beside}, over its quota "
                    f"of {self.max_bytes // _MB} MiB (limits.disk_mb)")
        if self.allowed_files is not None and u.files > self.allowed_files:
            return (f"disk quota exceeded: the environment holds {u.files} files, over its quota of "
                    f"{self.max_files} (limits.disk_files)")
        return None

    def _cannot_be_over(self) -> bool:
        # The environment grew by no more than its filesystem did since the last walk.
        before, now = self.measured.fs, _fs_used(self.root)
        if before is None or now is None:
            return False
        u = self.measured.usage
        return ((self.allowed_bytes is None
                 or u.bytes + self.outside_bytes + max(0, now.bytes - before.bytes) <= self.allowed_bytes)
                and (self.allowed_files is None or u.files + max(0, now.files - before.files) <= self.allowed_files))


def held_outside(journal_bytes: Callable[[], int], uid: int | None, inside: str,
                 pids: Callable[[], list[str]] | None, deleted_first: int | None = None) -> Callable[[], int]:
    """What counts against an environment's disk quota beside its tree, as a function for
    :class:`QuotaWatch`'s ``outside``: its journal (``journal_bytes()``), and the files its commands
    deleted but hold open (:func:`held_deleted`: by the environment's ``uid``, which only it runs
    as, among ``pids()``, the action's cgroup, or else in all of ``/proc``).  ``deleted_first``: the
    latter already known for the first call (measured while the session's processes were frozen)."""
    known = [deleted_first]

    def held() -> int:
        n = journal_bytes()
        if uid is None:
            return n
        if known[0] is not None:
            n, known[0] = n + known[0], None
            return n
        return n + held_deleted(uid, inside, pids() if pids is not None else None)
    return held


def held_deleted(uid: int, inside: str, pids: list[str] | None = None) -> int:
    """Bytes of files under ``inside`` (a path as the sandbox sees it) that processes of ``uid`` hold
    open after deleting them.

    Such a file is in no directory, so no walk sees it, yet it takes the filesystem's space until
    the last descriptor closes (written under a 64 MiB quota, 420 MiB went unseen that way).  Each
    environment's commands run as its own uid, so its processes are found by that uid, among
    ``pids`` (the action's cgroup: no process leaves it) or else among all of ``/proc``.
    ``/proc/<pid>/fd/<n>`` is only read as a link (the path the file was deleted at) and followed
    by ``stat``: nothing is opened.
    """
    total = 0
    seen: set[tuple[int, int]] = set()
    prefix = inside.rstrip("/") + "/"
    if pids is None:
        try:
            pids = [d for d in os.listdir("/proc") if d.isdigit()]
        except OSError:
            return 0
    for pid in pids:
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue   # ended meanwhile
        for fd in fds:
            link = f"/proc/{pid}/fd/{fd}"
            try:
                if not (target := os.readlink(link)).startswith(prefix) or not target.endswith(" (deleted)"):
                    continue
                st = os.stat(link)
            except OSError:
                continue
            if st.st_nlink == 0 and stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total
