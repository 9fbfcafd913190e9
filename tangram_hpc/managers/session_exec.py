"""The exec server of a live sandbox session: runs *inside* the sandbox, as the environment's uid.

Started once per session (``python -I -S -c <this file's text> <fd>``) at the end of the usual
wrapper chain (uid drop, rlimits, clean environment), under the session's seccomp filter; it
imports only the standard library.  It reads requests from the worker on the ``SOCK_SEQPACKET``
socket ``fd`` and forks each command, so a command costs a message and a fork.

Request (from the worker, trusted): ``marshal`` of ``(argv, environ, rlimits, cpus)`` with the
command's stdin, stdout and stderr as ``SCM_RIGHTS`` descriptors.  Replies (read by the worker as
fixed-size ``struct`` records, never unpickled: this process runs hostile code's neighbour):

* ``X`` pid, wait status, user and system CPU seconds, peak RSS in KiB: it exited;
* ``E`` 0, errno: it could not be forked.

The server is the sandbox's child subreaper, so the processes a command leaves running are
reaped here when they exit (never zombies of the namespace's init).  Each command leads a
session of its own, starts in ``/sandbox`` (resolved anew: the current action's layer), with
default signal dispositions, its own rlimits lowered from the server's, and its cores.

A command is started with ``posix_spawn`` (a vfork: ~0.5 ms, against ~2 ms for a fork of this
interpreter, its page tables copied and torn down again, then the child's own steps) when the
child needs nothing posix_spawn cannot give it: the server moves to the command's cores and
``/sandbox`` itself first (the child inherits them), and its rlimits already are the command's
(soft and hard: usually so, the server starts under the action's limits less CPU time and
address space).  Otherwise, and to report why a command could not start, it forks as before.
"""
import marshal
import os
import resource
import select
import signal
import socket
import struct
import sys

REPLY = struct.Struct("!cxxxiiddq")
_PR_SET_CHILD_SUBREAPER = 36
_SIGDEF = (signal.SIGPIPE, signal.SIGCHLD, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM)


def _subreaper() -> None:
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except Exception:
        pass


def _child(argv, environ, rlimits, cpus, fds) -> None:
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 65536)
        for sig in _SIGDEF:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)
            except OSError:
                pass
        for res, value in rlimits:
            value = _lowered(res, value)
            resource.setrlimit(res, (value, value))
        os.chdir("/sandbox")
        os.execvpe(argv[0], argv, environ)
    except BaseException as exc:   # nothing of the server may run on in the child
        try:
            os.write(2, f"sandbox: cannot run {argv[0]!r}: {exc}\n".encode())
        finally:
            os._exit(127 if isinstance(exc, FileNotFoundError) else 126)


def _lowered(res, value):
    """The limit a command gets: ``value``, but never above the server's own hard limit."""
    hard = resource.getrlimit(res)[1]
    return value if hard == resource.RLIM_INFINITY else min(value, hard)


def _program(name, environ):
    """Where ``execvpe`` would find ``name`` (None: not found; the fork reports why)."""
    if "/" in name:
        return name
    for d in environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(d or ".", name)
        if os.access(path, os.X_OK) and not os.path.isdir(path):
            return path
    return None


def _spawn(argv, environ, rlimits, cpus, fds):
    """posix_spawn the command when that gives it what :func:`_child` would; else None."""
    for res, value in rlimits:
        value = _lowered(res, value)
        if resource.getrlimit(res) != (value, value):
            return None
    if cpus and os.sched_getaffinity(0) != set(cpus):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            return None
    program = _program(argv[0], environ) if argv else None
    if program is None:
        return None
    try:
        os.chdir("/sandbox")
        return os.posix_spawn(program, argv, environ, setsid=True, setsigdef=_SIGDEF, setsigmask=(),
                              file_actions=[(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(fds)])
    except (OSError, ValueError):
        return None


def main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    # Nothing of the server's may reach a command: posix_spawn closes only close-on-exec descriptors.
    try:
        others = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        others = list(range(3, 1024))
    for other in others:
        if other > 2:
            try:
                os.set_inheritable(other, False)
            except OSError:
                pass
    _subreaper()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # A command's stdout and stderr (the server's copies), closed once its exit is sent: the worker
    # then learns of both at one wake-up instead of waking for the end of its output first.
    commands: dict[int, list[int]] = {}
    fd_size = struct.calcsize("i")
    sock.send(REPLY.pack(b"R", os.getpid(), 0, 0.0, 0.0, 0))
    while True:
        ready, _, _ = select.select([sock.fileno(), wake_r], [], [])
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
            while True:
                try:
                    pid, status, ru = os.wait4(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if pid in commands:
                    outputs = commands.pop(pid)
                    sock.send(REPLY.pack(b"X", pid, status, ru.ru_utime, ru.ru_stime, ru.ru_maxrss))
                    for f in outputs:
                        os.close(f)
        if sock.fileno() in ready:
            msg, anc, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fd_size))
            if not msg:
                return       # the worker closed the session
            fds: list[int] = []
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += struct.unpack(f"{len(data) // fd_size}i", data[:len(data) - len(data) % fd_size])
            for f in fds:
                os.set_inheritable(f, False)     # only their copies at 0, 1, 2 reach the command
            argv, environ, rlimits, cpus = marshal.loads(msg)
            pid = _spawn(argv, environ, rlimits, cpus, fds) if len(fds) == 3 else None
            if pid is None:
                try:
                    pid = os.fork()
                except OSError as exc:
                    pid = -1
                    sock.send(REPLY.pack(b"E", 0, exc.errno or 0, 0.0, 0.0, 0))
                if pid == 0:
                    _child(argv, environ, rlimits, cpus, fds)
            kept = fds[1:] if pid > 0 and len(fds) == 3 else []
            for f in fds:
                if f not in kept:
                    os.close(f)
            if pid > 0:
                commands[pid] = kept


if __name__ == "__main__":
    main(int(sys.argv[1]))
