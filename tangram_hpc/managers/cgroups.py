"""Per-action cgroups, where the worker is allowed to create them.

A cgroup limits a whole process tree at once -- memory over all processes
(RLIMIT_AS is per process and counts address space, not use) and the number
of tasks (``pids.max``) -- and can kill every member even if some escaped the
process group.  Two layouts are handled:

* cgroup v2: the worker's own cgroup must offer the ``memory`` and ``pids``
  controllers.  If the worker is the only process there, it moves itself
  into a ``tangram-worker`` leaf and enables the controllers for its
  siblings (the usual delegation dance); action cgroups are then created
  next to that leaf.
* cgroup v1: the ``memory`` and ``pids`` hierarchies, each where the worker
  may create a child of its own cgroup.

Where the ``cpuset`` controller is offered too (v2: enabled beside memory and
pids; v1: its hierarchy), an action's cgroup holds exactly its granted cores:
the CPU affinity the sandbox starts with is a mask its code may widen again
(``sched_setaffinity``), a cpuset is not.

A live session's cgroup (:mod:`tangram_hpc.managers.sessions`) can also be frozen: cgroup v2's
``cgroup.freeze`` in the same directory, or the v1 ``freezer`` hierarchy where it is mounted and
the worker may create a child of its own cgroup there (:attr:`Cgroups.freezer_kind`).

Where neither works :meth:`Cgroups.detect` returns None and the rlimits
alone apply.  The command joins its cgroups through a ``/bin/sh`` one-liner
before exec'ing bubblewrap, so nothing runs in the threaded worker between
fork and exec.
"""
from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Cgroups", "CgroupScope"]

_counter = itertools.count()


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def _write(p: Path, v: str) -> bool:
    # os-level: a thaw is on each live-session action's path, and a text file object costs more than the write
    try:
        fd = os.open(p, os.O_WRONLY)
    except OSError:
        return False
    try:
        os.write(fd, v.encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _kv(text: str, key: str) -> int:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return 0


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fs type, super options) of cgroup mounts."""
    out = []
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        pre, _, post = line.partition(" - ")
        fields, post_f = pre.split(), post.split()
        if len(post_f) >= 3 and post_f[0] in ("cgroup", "cgroup2"):
            out.append((fields[4].replace("\\040", " "), post_f[0], post_f[2]))
    return out


def _own_paths() -> dict[str, str]:
    """controller ('' for v2) -> this process's cgroup path."""
    out = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        hid, ctrls, path = line.split(":", 2)
        if hid == "0" and ctrls == "":
            out[""] = path
        for c in ctrls.split(","):
            if c:
                out[c] = path
    return out


@dataclass
class CgroupScope:
    """The cgroup directories of one running action."""

    version: int
    memory_dir: Path | None
    pids_dir: Path | None
    cpuset_dir: Path | None = None
    freezer_dir: Path | None = None

    @property
    def dirs(self) -> list[Path]:
        return sorted({d for d in (self.memory_dir, self.pids_dir, self.cpuset_dir, self.freezer_dir)
                       if d is not None})

    # -- freezing (live sessions) --------------------------------------------------------
    def freeze(self, wait: bool = True) -> bool:
        """Freeze every process of the scope; with ``wait``, until they all are (see :meth:`frozen`)."""
        if self.freezer_dir is None:
            return False
        if self.version == 2:
            ok = _write(self.freezer_dir / "cgroup.freeze", "1")
        else:
            ok = _write(self.freezer_dir / "freezer.state", "FROZEN")
        return ok and (not wait or self.frozen(10.0))

    def frozen(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the freeze asked for is complete."""
        if self.freezer_dir is None:
            return False
        deadline = time.monotonic() + timeout
        delay = 0.0002
        while True:
            if self.version == 2:
                done = _kv(_read(self.freezer_dir / "cgroup.events"), "frozen") == 1
            else:
                done = _read(self.freezer_dir / "freezer.state").strip() == "FROZEN"
            if done or time.monotonic() >= deadline:
                return done
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def thaw(self) -> None:
        if self.freezer_dir is None:
            return
        if self.version == 2:
            _write(self.freezer_dir / "cgroup.freeze", "0")
        else:
            _write(self.freezer_dir / "freezer.state", "THAWED")

    def retarget(self, memory_mb: int | None, nproc: int | None, cpus) -> None:
        """The limits of the scope's next action: memory, processes, cores (each where the scope
        has the controller; a memory limit below what the scope holds now is left as it was)."""
        if self.memory_dir is not None and memory_mb:
            b = str(memory_mb * 1024 * 1024)
            if self.version == 2:
                _write(self.memory_dir / "memory.max", b)
            elif _write(self.memory_dir / "memory.memsw.limit_in_bytes", b):
                _write(self.memory_dir / "memory.limit_in_bytes", b)
            else:       # memsw must stay >= the limit: lowering takes the other order
                _write(self.memory_dir / "memory.limit_in_bytes", b)
                _write(self.memory_dir / "memory.memsw.limit_in_bytes", b)
        if self.pids_dir is not None and nproc:
            _write(self.pids_dir / "pids.max", str(nproc))
        if self.cpuset_dir is not None and cpus:
            _write(self.cpuset_dir / "cpuset.cpus", ",".join(str(c) for c in sorted(cpus)))

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> list[str]:
        """The processes in the action's cgroup (every one of its tree: none can leave it)."""
        return _read(self.dirs[0] / "cgroup.procs").split()

    def oom_killed(self) -> bool:
        if self.memory_dir is None:
            return False
        if self.version == 2:
            return _kv(_read(self.memory_dir / "memory.events"), "oom_kill") > 0
        text = _read(self.memory_dir / "memory.oom_control")
        return _kv(text, "oom_kill") > 0 or int(_read(self.memory_dir / "memory.failcnt") or 0) > 0

    def memory_peak_kb(self) -> int | None:
        """Peak memory charged to the whole tree (None where the kernel does not say)."""
        if self.memory_dir is None:
            return None
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        text = _read(self.memory_dir / name).strip()
        return int(text) // 1024 if text.isdigit() else None

    def cpu_seconds(self) -> float | None:
        """User+system CPU seconds of every process that ran in the scope (cgroup v2's
        ``cpu.stat``, present whatever the controllers; None under v1, which has it only
        in a cpuacct hierarchy not used here)."""
        if self.version != 2:
            return None
        for d in (self.memory_dir, self.pids_dir):
            if d is not None:
                usec = _kv(_read(d / "cpu.stat"), "usage_usec")
                return usec / 1e6 if usec > 0 else None
        return None

    def pids_hit(self) -> bool:
        if self.pids_dir is None:
            return False
        return _kv(_read(self.pids_dir / "pids.events"), "max") > 0

    def kill(self) -> None:
        for d in self.dirs:
            if self.version == 2 and _write(d / "cgroup.kill", "1"):
                continue
            for _ in range(50):  # members may fork while we kill; pids.max bounds the rounds
                pids = [int(x) for x in _read(d / "cgroup.procs").split()]
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

    def close(self) -> list[Path]:
        """Kill what is left and remove the directories; returns those still busy."""
        self.kill()
        busy = []
        for d in self.dirs:
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # members still exiting
                    time.sleep(0.01)
            else:
                busy.append(d)
        return busy


class Cgroups:
    """Where this worker creates action cgroups (see the module docstring)."""

    def __init__(self, version: int, memory_parent: Path | None, pids_parent: Path | None,
                 cpuset_parent: Path | None = None, freezer_parent: Path | None = None):
        self.version = version
        self.memory_parent = memory_parent
        self.pids_parent = pids_parent
        self.cpuset_parent = cpuset_parent
        self.freezer_parent = freezer_parent
        self._prefix = f"tangram-{os.getpid()}"
        self._lock = threading.Lock()
        self._stale: list[Path] = []  # action cgroups whose members took long to exit

    def release(self, scope: CgroupScope) -> None:
        """Remove an action's cgroups (retrying older leftovers too)."""
        busy = scope.close()
        with self._lock:
            self._stale.extend(busy)
        self.sweep()

    def sweep(self) -> None:
        with self._lock:
            stale, self._stale = self._stale, []
        keep = []
        for d in stale:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                keep.append(d)
        with self._lock:
            self._stale.extend(keep)

    @property
    def freezer_kind(self) -> str | None:
        """How a session's cgroup is frozen here: ``"cgroup-v2"``, ``"cgroup-v1"`` or None."""
        if self.freezer_parent is None:
            return None
        return "cgroup-v2" if self.version == 2 else "cgroup-v1"

    def __repr__(self) -> str:
        return (f"Cgroups(v{self.version}, memory={self.memory_parent}, pids={self.pids_parent}, "
                f"cpuset={self.cpuset_parent}, freezer={self.freezer_parent})")

    @classmethod
    def detect(cls) -> "Cgroups | None":
        try:
            return cls._detect_v2() or cls._detect_v1()
        except (OSError, ValueError):
            return None

    @classmethod
    def _detect_v2(cls) -> "Cgroups | None":
        own = _own_paths().get("")
        mnt = next((m for m, t, _ in _mounts() if t == "cgroup2"), None)
        if own is None or mnt is None:
            return None
        base = Path(mnt) / own.lstrip("/")
        avail = set(_read(base / "cgroup.controllers").split())
        if not {"memory", "pids"} <= avail:
            return None
        enabled = set(_read(base / "cgroup.subtree_control").split())
        if not {"memory", "pids"} <= enabled:
            leaf = base / "tangram-worker"
            try:
                leaf.mkdir(exist_ok=True)
            except OSError:
                return None
            if not _write(leaf / "cgroup.procs", str(os.getpid())):
                _try_rmdir(leaf)
                return None
            if not _write(base / "cgroup.subtree_control", "+memory +pids"):
                _write(base / "cgroup.procs", str(os.getpid()))
                _try_rmdir(leaf)
                return None
        probe = base / f"tangram-probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError:
            return None
        cpuset = "cpuset" in avail and ("cpuset" in set(_read(base / "cgroup.subtree_control").split())
                                         or _write(base / "cgroup.subtree_control", "+cpuset"))
        # cgroup.freeze exists in every non-root v2 cgroup (kernel 5.2)
        return cls(2, base, base, base if cpuset else None, base if (base / "cgroup.procs").exists() else None)

    @classmethod
    def _detect_v1(cls) -> "Cgroups | None":
        own = _own_paths()
        parents: dict[str, Path] = {}
        for mnt, fstype, opts in _mounts():
            if fstype != "cgroup":
                continue
            for ctrl in ("memory", "pids", "cpuset", "freezer"):
                if ctrl in opts.split(",") and ctrl in own and ctrl not in parents:
                    base = Path(mnt) / own[ctrl].lstrip("/")
                    probe = base / f"tangram-probe-{os.getpid()}"
                    try:
                        probe.mkdir()
                        probe.rmdir()
                    except OSError:
                        continue
                    parents[ctrl] = base
        if not parents.keys() & {"memory", "pids"}:
            return None
        return cls(1, parents.get("memory"), parents.get("pids"), parents.get("cpuset"), parents.get("freezer"))

    def scope(self, memory_mb: int | None, nproc: int | None,
              cpus: list[int] | tuple[int, ...] | None = None, freezer: bool = False) -> CgroupScope | None:
        """Create the cgroups of one action (None if creating them failed); with ``cpus``, a cpuset
        of exactly those cores where the controller is offered (without one where it is not); with
        ``freezer``, one it can be frozen by where the worker has one (a live session's)."""
        name = f"{self._prefix}-{next(_counter)}"
        mem_dir = pids_dir = None
        try:
            if self.memory_parent is not None:
                # Created even without a limit: its peak is the tree's memory use.
                mem_dir = self.memory_parent / name
                mem_dir.mkdir()
                b = str((memory_mb or 0) * 1024 * 1024)
                ok = True
                if not memory_mb:
                    pass
                elif self.version == 2:
                    ok = _write(mem_dir / "memory.max", b)
                    _write(mem_dir / "memory.swap.max", "0")
                else:
                    ok = _write(mem_dir / "memory.limit_in_bytes", b)
                    _write(mem_dir / "memory.memsw.limit_in_bytes", b)
                if memory_mb and not ok:
                    raise OSError("memory limit not writable")
            if self.pids_parent is not None and nproc:
                pids_dir = self.pids_parent / name if self.version == 1 or mem_dir is None else mem_dir
                pids_dir.mkdir(exist_ok=True)
                if not _write(pids_dir / "pids.max", str(nproc)):
                    raise OSError("pids.max not writable")
        except OSError:
            CgroupScope(self.version, mem_dir, pids_dir).close()
            return None
        if mem_dir is None and pids_dir is None:
            return None
        scope = CgroupScope(self.version, mem_dir, pids_dir, self._cpuset(name, cpus, mem_dir or pids_dir))
        if freezer and self.freezer_parent is not None:
            if self.version == 2:
                scope.freezer_dir = mem_dir or pids_dir
            else:
                d = self.freezer_parent / name
                try:
                    d.mkdir()
                    scope.freezer_dir = d
                except OSError:
                    pass
        return scope

    def _cpuset(self, name: str, cpus, v2_dir: Path | None) -> Path | None:
        """The cpuset directory of an action on ``cpus`` (None where it cannot have one)."""
        if not cpus or self.cpuset_parent is None:
            return None
        mask = ",".join(str(c) for c in sorted(cpus))
        if self.version == 2:
            return v2_dir if v2_dir is not None and _write(v2_dir / "cpuset.cpus", mask) else None
        d = self.cpuset_parent / name
        try:
            d.mkdir()
        except OSError:
            return None
        # a v1 cpuset starts empty: memory nodes as the parent's, then the cores
        mems = _read(self.cpuset_parent / "cpuset.effective_mems").strip() \
            or _read(self.cpuset_parent / "cpuset.mems").strip()
        if _write(d / "cpuset.mems", mems) and _write(d / "cpuset.cpus", mask):
            return d
        _try_rmdir(d)
        return None


def _try_rmdir(p: Path) -> None:
    try:
        p.rmdir()
    except OSError:
        pass
