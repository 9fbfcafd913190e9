"""Run one child process with bounded output, a wall-clock deadline and exact CPUs.

The calling thread pins itself to the granted CPUs just for the fork, so the
child inherits exactly that mask with no window where it runs elsewhere; the
thread's own mask is restored at once.  Output is read incrementally: at
most ``keep_bytes`` per stream stay in memory, the rest is counted and
dropped, and past ``kill_bytes`` of total output the child is killed as a
flood.  The child leads its own session, so killing its process group (plus
the PID namespace that bubblewrap tears down when its leader dies) ends the
whole tree.  An optional *watch* (the disk quota) is consulted every
``watch.interval()`` seconds and may stop the child with a reason.
"""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

__all__ = ["ProcResult", "run_bounded", "TRUNCATION_MARKER"]

#: Appended to a stream whose output was cut; ``{n}`` is the dropped byte count.
TRUNCATION_MARKER = "\n[... output truncated: {n} more bytes dropped ...]\n"

_READ = 1 << 16
_EXIT_GRACE_S = 1.0


class Watch(Protocol):
    def interval(self) -> float: ...

    def check(self) -> str | None: ...


@dataclass(slots=True)
class ProcResult:
    returncode: int | None
    stdout: bytes
    stderr: bytes
    stdout_dropped: int
    stderr_dropped: int
    wall_s: float
    cpu_time: float | None  # user + system seconds of the child and every descendant it reaped (None: unknown)
    max_rss_kb: int
    timed_out: bool = False
    flooded: bool = False
    cancelled: bool = False
    stopped: str | None = None   # why the watch stopped it

    @property
    def truncated(self) -> bool:
        return bool(self.stdout_dropped or self.stderr_dropped)

    def text(self, which: str) -> str:
        data, dropped = ((self.stdout, self.stdout_dropped) if which == "stdout"
                         else (self.stderr, self.stderr_dropped))
        s = data.decode("utf-8", errors="replace")
        return s + TRUNCATION_MARKER.format(n=dropped) if dropped else s


class _Sink:
    __slots__ = ("buf", "keep", "dropped")

    def __init__(self, keep: int):
        self.buf = bytearray()
        self.keep = keep
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.keep - len(self.buf)
        if room > 0:
            self.buf += chunk[:room]
        if len(chunk) > room:
            self.dropped += len(chunk) - max(room, 0)


def run_bounded(argv: Sequence[str], *, cpus: Iterable[int] | None, stdin: bytes | None,
                timeout: float | None, keep_bytes: int, kill_bytes: int | None,
                cwd: str | None = None, env: dict[str, str] | None = None,
                pass_fds: Sequence[int] = (), on_kill: Callable[[], None] | None = None,
                cancel_fd: int | None = None, watch: Watch | None = None,
                on_exit: Callable[[], None] | None = None) -> ProcResult:
    """Run ``argv`` to completion or until a limit; never raises for the child's behaviour.

    ``on_kill`` is called after the process group is killed (e.g. to kill a
    cgroup too); ``on_exit`` once the child has exited (before its pipes are
    drained: to stop what it may have left running outside its group).  When
    ``cancel_fd`` becomes readable the child is killed and the result says
    ``cancelled``; when ``watch.check()`` returns a reason it
    is killed and the result's ``stopped`` holds it.  Raises OSError only when
    the child cannot be started.
    """
    saved = None
    if cpus is not None:
        saved = os.sched_getaffinity(0)
        os.sched_setaffinity(0, list(cpus))
    try:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env,
            pass_fds=tuple(pass_fds), close_fds=True, start_new_session=True)
    finally:
        if saved is not None:
            os.sched_setaffinity(0, saved)

    out, err = _Sink(keep_bytes), _Sink(keep_bytes)
    timed_out = flooded = killed = cancelled = False
    stopped: str | None = None

    def kill() -> None:
        nonlocal killed
        if killed:
            return
        killed = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if on_kill is not None:
            on_kill()

    sel = selectors.DefaultSelector()
    sinks = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ)
    pidfd = _pidfd(proc.pid)
    if pidfd is not None:
        sel.register(pidfd, selectors.EVENT_READ)
    if cancel_fd is not None:
        sel.register(cancel_fd, selectors.EVENT_READ)
    pending = memoryview(stdin) if stdin else None
    if pending is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)

    deadline = t0 + timeout if timeout else None
    exited_at: float | None = None
    next_watch = t0 + watch.interval() if watch is not None else None
    try:
        while sinks:
            now = time.monotonic()
            if next_watch is not None and now >= next_watch and exited_at is None:
                stopped = watch.check()
                if stopped is not None:
                    kill()
                    exited_at = time.monotonic()
                    next_watch = None
                else:
                    now = time.monotonic()
                    next_watch = now + watch.interval()
            limits = [t for t in (deadline, exited_at and exited_at + _EXIT_GRACE_S,
                                  next_watch if exited_at is None else None) if t]
            wait = max(0.0, min(limits) - now) if limits else None
            events = sel.select(wait)
            if not events:
                if exited_at is not None and now >= exited_at + _EXIT_GRACE_S:
                    # The command exited but something it left behind holds the pipes.
                    kill()
                    break
                if deadline is not None and now >= deadline:
                    timed_out = True
                    kill()
                    deadline = None
                    exited_at = exited_at or time.monotonic()
                continue
            for key, _ in events:
                fd = key.fd
                if fd == pidfd:
                    sel.unregister(fd)
                    exited_at = time.monotonic()
                    if on_exit is not None:
                        on_exit()
                        on_exit = None
                    continue
                if fd == cancel_fd:
                    sel.unregister(fd)
                    cancelled = True
                    kill()
                    exited_at = exited_at or time.monotonic()
                    continue
                if pending is not None and fd == proc.stdin.fileno():
                    try:
                        n = os.write(fd, pending[:_READ])
                        pending = pending[n:]
                    except (BrokenPipeError, OSError):
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
                        pending = None
                    continue
                try:
                    chunk = os.read(fd, _READ)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    del sinks[fd]
                    continue
                sinks[fd].add(chunk)
                if kill_bytes is not None and not flooded and (
                        len(out.buf) + out.dropped + len(err.buf) + err.dropped > kill_bytes):
                    flooded = True
                    kill()
    finally:
        sel.close()
        if on_exit is not None:      # no pidfd here: the child has exited (or is about to be killed)
            on_exit()
        if pending is not None:
            proc.stdin.close()
        # Whatever the command left behind in its group goes with it; the
        # leader is not reaped yet, so its pid (the group id) cannot be reused.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _, status, ru = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - t0
        if pidfd is not None:
            os.close(pidfd)
        proc.stdout.close()
        proc.stderr.close()
    return ProcResult(proc.returncode, bytes(out.buf), bytes(err.buf), out.dropped, err.dropped,
                      wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss, timed_out, flooded, cancelled, stopped)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
