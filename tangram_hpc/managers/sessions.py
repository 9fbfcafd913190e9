"""Live sandbox sessions: an environment's processes kept, frozen, between its actions.

On its first action an environment gets a long-lived sandbox -- the same bubblewrap isolation,
seccomp filter, uid, rlimits and cgroup limits as a per-action sandbox, no network -- whose
command is a small exec server (:mod:`tangram_hpc.managers.session_exec`).  Each later action is a
message to that server, which forks the command: a message and a fork instead of a new sandbox.
What a command leaves running (a shell, a kernel, a server) is there for the next action.

Between actions the session's cgroup is **frozen**: its processes hold their memory but get no
CPU and can write nothing.  The freeze is asked for when the command exits (in a worker: once its
outcome is sent, see :attr:`~tangram_hpc.managers.live_envs.LiveEnvs.after_reply`) and waited for
when the environment is next touched (the next action, a save, a reclaim), so no action waits for it;
until then its processes may still run for a few milliseconds, inside the finished attempt's
layer.  The next action thaws it with the cores it was granted (cpuset, affinity), its memory
and process limits.  How the freeze is done (:attr:`Sessions.freezer`): cgroup v2
``cgroup.freeze``; else the v1 ``freezer`` hierarchy; else SIGSTOP of every process of the
session (found by its cgroup, else by the environment's uid), repeated until all are stopped;
``"none"`` where none of that is possible (sessions are then off).

Files: each attempt still runs against a layer of its own (:mod:`tangram_hpc.managers.env_layers`,
exactly once): the session runs in a mount namespace where the environment's directory is a
shared mount, and the mount helper (:mod:`tangram_hpc.managers.session_mounts`) mounts the
attempt's overlay on it -- it appears at ``/sandbox`` inside -- and takes it away once the session
is frozen again.  The layer is merged only then (never while mounted); until then it is the
environment's pending attempt, committed by its journal record as before, by whoever takes the
environment over if this worker dies.  Commands start in ``/sandbox`` resolved anew, so in the
current layer; a process kept from an earlier action keeps the working directory and open files
of the layer it started in (paths it resolves anew under ``/sandbox`` reach the current one).

A session ends when its environment is dropped, saved or removed, when it is idle past
``idle_s``, under memory pressure (idle ones first), when an action of it is killed by a limit,
a timeout or a cancel (the tree is killed whole), or when its server dies.  The environment's
files stay; the next action starts a new session and its result says the processes were not
kept, and why.
"""
from __future__ import annotations

import array
import logging
import marshal
import os
import queue
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import TangramError
from typing import Callable

from .cgroups import Cgroups, CgroupScope
from .limits import Limits
from .process import ProcResult, _Sink
from .session_exec import REPLY
from .session_mounts import MountHelper

__all__ = ["Session", "Sessions", "SessionError", "KEPT", "STARTED"]

log = logging.getLogger(__name__)

KEPT = "kept"          # the command ran beside the processes earlier actions left
STARTED = "started"    # a new session: nothing was running in the environment here
_SERVER_SRC = Path(__file__).with_name("session_exec.py").read_text()
_SERVER_SRC = _SERVER_SRC[_SERVER_SRC.index("import "):]    # without its docstring (it shows in ps)
_START_WAIT_S = 30.0
_FREEZE_WAIT_S = 10.0
_MB = 1 << 20


class SessionError(TangramError, OSError):
    """A session could not be started or used."""


@dataclass(slots=True)
class Spawn:
    """What the sandbox manager hands over to start a session's process tree."""

    env_dir: Path
    mount_point: Path | None          # where the layers are mounted (bound at /sandbox); None: unlayered
    sandbox: list[str]                # bubblewrap ... -- wrapper chain (the server follows)
    prefix: list[str]                 # what runs before it (joining the session's cgroups)
    pass_fds: list[int]
    cpus: list[int] | None
    close: Callable[[], None]         # closes the descriptors once the sandbox has them


class Session:
    """The live sandbox of one environment (used under the environment's turn)."""

    def __init__(self, env_id: str, uid: int | None, proc: subprocess.Popen, sock: socket.socket,
                 scope: CgroupScope | None, mount_point: Path | None, freezer: str):
        self.env_id = env_id
        self.uid = uid
        self.proc = proc
        self.sock = sock
        self.scope = scope
        self.mount_point = mount_point  # where attempts' layers are mounted (None: it binds the environment)
        self.freezer = freezer if scope is not None and scope.freezer_dir is not None else "sigstop"
        self.layer_mounted = False      # the last attempt's layer is not settled yet
        self.layer_ready = False        # an empty layer for the next attempt is mounted on top, unclaimed
        self.depth = 0                  # layers stacked on the mount point
        self._grant: tuple | None = None  # the cores and limits its cgroup was last given
        self.frozen = False
        self.dead: str | None = None    # why it ended
        self.last_used = time.monotonic()
        self.actions = 0
        self.last_state = STARTED       # what its last action found: KEPT, STARTED, or why not kept
        self.commit_on_park = False     # its mounted layer is committed without a journal record
        #: bytes of deleted files its processes held open, measured once all were frozen (None: not
        #: since the last thaw); the next action's disk quota starts from it (LiveEnvs.park)
        self.held_deleted: int | None = None

    # -- freezing --------------------------------------------------------------------
    def freeze(self) -> None:
        """Ask for the freeze (not waited for: see :meth:`settled`)."""
        if self.dead is not None or self.frozen:
            return
        self.frozen = True
        if self.freezer == "sigstop":
            self._signal_all(signal.SIGSTOP)
        elif self.scope is not None:
            self.scope.freeze(wait=False)

    def wait_frozen(self) -> bool:
        """Wait until every process of the session is frozen; False if that did not happen."""
        if self.dead is not None:
            return True
        self.freeze()           # not asked for yet when it waits for the action's reply (LiveEnvs.after_reply)
        if self.freezer == "sigstop":
            return self._stop_all(time.monotonic() + _FREEZE_WAIT_S)
        return self.scope is None or self.scope.frozen(_FREEZE_WAIT_S)

    def thaw(self, cpus, memory_mb: int | None, nproc: int | None) -> None:
        grant = (tuple(sorted(cpus)) if cpus else None, memory_mb, nproc)
        if self.scope is not None and grant != self._grant:   # most actions of an environment repeat it
            self.scope.retarget(memory_mb, nproc, cpus)
            self._grant = grant
            self.held_deleted = None    # a lower memory.max may OOM-kill a holder before the thaw
        if not self.frozen:
            return
        self.frozen = False
        if self.freezer == "sigstop":
            self._signal_all(signal.SIGCONT)
        elif self.scope is not None:
            self.scope.thaw()

    def pids(self) -> list[int]:
        if self.scope is not None:
            return [int(p) for p in self.scope.pids()]
        if self.uid is None:
            return []
        return _pids_of_uid(self.uid)

    def _signal_all(self, sig: int) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _stop_all(self, deadline: float) -> bool:
        # A process not yet stopped may SIGCONT one already stopped: again until none runs.
        while time.monotonic() < deadline:
            running = [p for p in self.pids() if _state(p) not in ("T", "t", "Z", "X", None)]
            if not running:
                return True
            for pid in running:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.001)
        return False

    # -- running a command ---------------------------------------------------------------
    def run(self, argv: list[str], environ: dict[str, str], limits: Limits, cpus, stdin: bytes | None,
            cancel_fd: int | None, watch=None) -> ProcResult:
        """Run one command in the (thawed) session; a limit, timeout or cancel kills the whole
        session.  Raises :class:`SessionError` when the server is gone before the command started."""
        t0 = time.monotonic()
        self.last_used = t0
        self.actions += 1
        rlimits = _rlimits(limits)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_w = None
        if stdin:
            in_r, in_w = os.pipe()
        else:
            in_r = os.open(os.devnull, os.O_RDONLY)
        try:
            msg = marshal.dumps((argv, environ, rlimits, sorted(cpus) if cpus else None))
            self.sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [in_r, out_w, err_w]))])
        except OSError as exc:
            for fd in (out_r, err_r) + ((in_w,) if in_w is not None else ()):
                os.close(fd)
            self.end(f"its exec server is gone ({exc})")
            raise SessionError(f"the environment's session ended: {exc}") from None
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        return self._collect(t0, out_r, err_r, in_w, stdin, limits, cancel_fd, watch)

    def _collect(self, t0, out_r, err_r, in_w, stdin, limits: Limits, cancel_fd, watch) -> ProcResult:
        out, err = _Sink(limits.output_bytes), _Sink(limits.output_bytes)
        sinks = {out_r: out, err_r: err}
        sel = selectors.DefaultSelector()
        for fd in sinks:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        sel.register(self.sock, selectors.EVENT_READ)
        if cancel_fd is not None:
            sel.register(cancel_fd, selectors.EVENT_READ)
        pending = memoryview(stdin) if stdin else None
        if in_w is not None:
            os.set_blocking(in_w, False)
            sel.register(in_w, selectors.EVENT_WRITE)
        deadline = t0 + limits.timeout_s if limits.timeout_s else None
        next_watch = t0 + watch.interval() if watch is not None else None
        status: int | None = None
        cpu = 0.0
        rss = 0
        timed_out = flooded = cancelled = False
        stopped: str | None = None
        try:
            while status is None and self.dead is None:
                now = time.monotonic()
                if next_watch is not None and now >= next_watch:
                    stopped = watch.check()
                    if stopped is not None:
                        self.end(f"stopped: {stopped}")
                        break
                    next_watch = time.monotonic() + watch.interval()
                wait = [t - now for t in (deadline, next_watch) if t is not None]
                events = sel.select(max(0.0, min(wait)) if wait else None)
                if not events and deadline is not None and time.monotonic() >= deadline:
                    timed_out = True
                    self.end(f"its action timed out after {limits.timeout_s:g}s")
                    break
                for key, _ in events:
                    fd = key.fd
                    if fd == cancel_fd:
                        cancelled = True
                        self.end("its action was cancelled")
                        break
                    if key.fileobj is self.sock:
                        try:
                            reply = self.sock.recv(REPLY.size * 4)
                        except OSError:
                            reply = b""
                        if len(reply) != REPLY.size:
                            self.end("its exec server exited")
                            break
                        kind, _pid, st, utime, stime, maxrss = REPLY.unpack(reply)
                        if kind == b"X":
                            status, cpu, rss = st, utime + stime, maxrss
                        elif kind == b"E":
                            status = 126 << 8
                        continue
                    if fd == in_w:
                        try:
                            n = os.write(fd, pending[:1 << 16])
                            pending = pending[n:]
                        except OSError:
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(fd)
                            os.close(fd)
                            in_w = None
                        continue
                    if self._read(fd, sinks, sel) and limits.output_kill_bytes is not None and \
                            out.dropped + len(out.buf) + err.dropped + len(err.buf) > limits.output_kill_bytes:
                        flooded = True
                        self.end("its action flooded its output")
                        break
                if cancelled or flooded:
                    break
            # The command has exited: what it wrote is in the pipes; what it left running may hold
            # them open, and is not waited for.
            for fd in list(sinks):
                while self._read(fd, sinks, sel):
                    pass
        finally:
            sel.close()
            for fd in (out_r, err_r) + ((in_w,) if in_w is not None else ()):
                os.close(fd)
        rc = os.waitstatus_to_exitcode(status) if status is not None else None
        if status is None and not (timed_out or cancelled or flooded or stopped):
            rc = -signal.SIGKILL
        return ProcResult(rc, bytes(out.buf), bytes(err.buf), out.dropped, err.dropped,
                          time.monotonic() - t0, cpu if status is not None else None, rss,
                          timed_out, flooded, cancelled, stopped)

    @staticmethod
    def _read(fd: int, sinks: dict, sel) -> bool:
        """Read once from ``fd``; False when nothing more is there now."""
        if fd not in sinks:
            return False
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if not chunk:
            sel.unregister(fd)
            del sinks[fd]
            return False
        sinks[fd].add(chunk)
        return True

    # -- the end ----------------------------------------------------------------------
    def end(self, why: str) -> None:
        """Kill every process of the session (its files stay)."""
        if self.dead is not None:
            return
        self.dead = why
        try:
            self.sock.close()
        except OSError:
            pass
        if self.scope is not None:
            self._signal_all(signal.SIGKILL)   # a frozen task dies once thawed (v1)
            self.scope.thaw()
            self.scope.kill()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.freezer == "sigstop" and self.uid is not None:
            self._signal_all(signal.SIGKILL)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.warning("session of environment %s did not end", self.env_id)
        self.layer_mounted = self.layer_ready = False


class Sessions:
    """The live sessions of one sandbox manager."""

    def __init__(self, cgroups: Cgroups | None, *, idle_s: float | None = 600.0, min_free_mb: int = 1024,
                 layered: bool = True):
        self.cgroups = cgroups
        self.idle_s = idle_s
        self.min_free_mb = min_free_mb
        self.layered = layered
        self.freezer = _freezer_kind(cgroups)
        self.mounts = MountHelper() if layered else None
        self._live: dict[str, Session] = {}
        self._lost: dict[str, str] = {}     # environment -> why its last session ended
        self._lock = threading.Lock()
        self._starts: queue.SimpleQueue | None = None
        self._starter: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self.freezer != "none"

    def status(self) -> dict:
        with self._lock:
            live = list(self._live.values())
        return {"sessions": len(live), "frozen": sum(1 for s in live if s.frozen), "freezer": self.freezer}

    def live_ids(self) -> list[str]:
        with self._lock:
            return list(self._live)

    def get(self, env_id: str) -> Session | None:
        with self._lock:
            s = self._live.get(env_id)
        if s is not None and s.dead is not None:
            self.forget(env_id, s.dead)
            return None
        return s

    def lost(self, env_id: str) -> str | None:
        """Why the processes of ``env_id``'s last session here are gone (None: none ended)."""
        with self._lock:
            return self._lost.pop(env_id, None)

    def forget(self, env_id: str, why: str) -> None:
        with self._lock:
            s = self._live.pop(env_id, None)
            if s is not None:
                self._lost[env_id] = why
        if s is not None:
            self.end(s, why)

    def end(self, s: Session, why: str) -> None:
        """End ``s`` (its processes killed) and take its mount point away; its cgroups stay the caller's."""
        s.end(why)
        if s.mount_point is not None:
            try:
                if self.mounts is not None and s.depth:
                    self.mounts.forget(s.proc.pid)
                s.mount_point.rmdir()
            except OSError:
                pass

    # -- starting ----------------------------------------------------------------------
    def start(self, env_id: str, uid: int | None, spawn: Spawn, scope: CgroupScope | None,
              register: bool = True) -> Session:
        """Start the session of ``env_id`` from ``spawn`` (``register``: as that environment's; else
        it is :meth:`adopt`-ed later, see :mod:`.session_pool`; its process tree is started by one
        long-lived thread: the parent-death signal the sandbox holds fires when the *thread* that
        started it ends, and an executor thread may end before the environment does)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = spawn.sandbox + [sys.executable, "-I", "-S", "-c", _SERVER_SRC, str(theirs.fileno())]
            if spawn.mount_point is not None:
                argv = ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                        'mount --bind --make-shared "$1" "$2" || exit 125; shift 2; exec "$@"', "sh",
                        str(spawn.env_dir), str(spawn.mount_point)] + argv
            argv = spawn.prefix + argv
            proc = self._spawn(argv, spawn.pass_fds + [theirs.fileno()], spawn.cpus)
        finally:
            theirs.close()
            spawn.close()
        session = Session(env_id, uid, proc, ours, scope, spawn.mount_point, self.freezer)
        ours.settimeout(_START_WAIT_S)
        try:
            ready = ours.recv(REPLY.size)
        except OSError:
            ready = b""
        ours.settimeout(None)
        if len(ready) != REPLY.size or ready[:1] != b"R":
            err = b""
            try:
                proc.wait(timeout=5)
                err = proc.stderr.read(4096) if proc.stderr else b""
            except (subprocess.TimeoutExpired, OSError, ValueError):
                pass
            session.end("it did not start")
            raise SessionError(f"the environment's session did not start: "
                               f"{err.decode(errors='replace').strip() or f'exit code {proc.returncode}'}")
        if proc.stderr is not None:
            proc.stderr.close()
        if register:
            self.adopt(env_id, session)
        return session

    def adopt(self, env_id: str, session: Session) -> None:
        """Make ``session`` (started for no environment, never used) ``env_id``'s."""
        session.env_id = env_id
        session.last_used = time.monotonic()
        with self._lock:
            self._live[env_id] = session

    def _spawn(self, argv: list[str], pass_fds: list[int], cpus) -> subprocess.Popen:
        with self._lock:
            if self._starter is None:
                self._starts = queue.SimpleQueue()
                self._starter = threading.Thread(target=self._serve_starts, name="session-starter", daemon=True)
                self._starter.start()
        answer: queue.SimpleQueue = queue.SimpleQueue()
        self._starts.put((argv, pass_fds, cpus, answer))
        ok, value = answer.get()
        if not ok:
            raise SessionError(f"the environment's session could not be started: {value}")
        return value

    def _serve_starts(self) -> None:
        while True:
            item = self._starts.get()
            if item is None:
                return
            argv, pass_fds, cpus, answer = item
            saved = None
            try:
                if cpus:
                    saved = os.sched_getaffinity(0)
                    os.sched_setaffinity(0, cpus)
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, pass_fds=tuple(pass_fds), close_fds=True,
                                        start_new_session=True)
                answer.put((True, proc))
            except OSError as exc:
                answer.put((False, exc))
            finally:
                if saved is not None:
                    os.sched_setaffinity(0, saved)

    # -- reclaiming ----------------------------------------------------------------------
    def to_reclaim(self, now: float | None = None, busy: Callable[[str], bool] = lambda _: False
                   ) -> list[tuple[str, str]]:
        """The sessions to end, with why: those idle past ``idle_s``, and idle ones (longest idle
        first) while the machine has less than ``min_free_mb`` of memory available.  ``busy(env)``:
        whether an action holds the environment now (never reclaimed then)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = sorted((s for s in self._live.values() if not busy(s.env_id)), key=lambda s: s.last_used)
        ended = []
        short = _available_mb() < self.min_free_mb
        for s in idle:
            if self.idle_s is not None and now - s.last_used > self.idle_s:
                ended.append((s.env_id, f"reclaimed after {now - s.last_used:.0f}s idle (idle_s={self.idle_s:g})"))
            elif short:
                ended.append((s.env_id, f"reclaimed under memory pressure (less than {self.min_free_mb} MiB "
                                        f"available)"))
                short = False       # one per call, the idlest: the next call sees what that freed
        return ended

    def close(self) -> None:
        with self._lock:
            live = list(self._live)
        for env_id in live:
            self.forget(env_id, "the worker closed")
        if self._starts is not None:
            self._starts.put(None)
        if self.mounts is not None:
            self.mounts.close()


def _rlimits(limits: Limits) -> list[tuple[int, int]]:
    out = []
    file_mb = min((x for x in (limits.file_mb, limits.disk_mb) if x), default=None)
    for res, v in ((resource.RLIMIT_NOFILE, limits.nofile), (resource.RLIMIT_CPU, limits.cpu_s),
                   (resource.RLIMIT_FSIZE, file_mb * _MB if file_mb else None),
                   (resource.RLIMIT_AS, limits.memory_mb * _MB if limits.memory_mb else None)):
        if v:
            out.append((res, int(v)))
    return out


def server_limits(limits: Limits) -> Limits:
    """The limits the exec server itself starts under: the process limit (per uid: the whole
    session's), files and descriptors; no CPU-time or address-space limit (each command gets its
    own rlimits, the session's memory is its cgroup's)."""
    return replace(limits, cpu_s=None, memory_mb=None)


def _freezer_kind(cgroups: Cgroups | None) -> str:
    if cgroups is not None and cgroups.freezer_kind is not None:
        return cgroups.freezer_kind
    return "sigstop" if os.geteuid() == 0 or cgroups is not None else "none"


def _available_mb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return float("inf")


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def _pids_of_uid(uid: int) -> list[int]:
    """Processes whose real uid is ``uid`` (as root only this environment's sandbox runs as it)."""
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/status", "rb") as f:
                    for line in f:
                        if line.startswith(b"Uid:"):
                            if int(line.split()[1]) == uid:
                                pids.append(int(p))
                            break
            except (OSError, ValueError, IndexError):
                pass
    return pids
