"""The exec server of a live sandbox session: runs *inside* the sandbox, as the environment's uid.

Started once per session (``python -I -S -c <this file's text> <fd>``) at the end of the usual
wrapper chain (uid drop, rlimits, clean environment), under the session's seccomp filter; it
imports only the standard library.  It reads requests from the worker on the ``SOCK_SEQPACKET``
socket ``fd`` and forks each command, so a command costs a message and a fork.

Request (from the worker, trusted): ``marshal`` of ``(argv, environ, rlimits, cpus)`` with the
command's stdin, stdout and stderr as ``SCM_RIGHTS`` descriptors.  Replies (read by the worker as
fixed-size ``struct`` records, never unpickled: this process runs hostile code's neighbour):

* ``P`` pid: the command started (its pid in the sandbox's PID namespace);
* ``X`` pid, wait status, user and system CPU seconds, peak RSS in KiB: it exited;
* ``E`` 0, errno: it could not be forked.

The server is the sandbox's child subreaper, so the processes a command leaves running are
reaped here when they exit (never zombies of the namespace's init).  Each command leads a
session of its own, starts in ``/sandbox`` (resolved anew: the current action's layer), with
default signal dispositions, its own rlimits lowered from the server's, and its cores.
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
        for sig in (signal.SIGPIPE, signal.SIGCHLD, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)
            except OSError:
                pass
        for res, value in rlimits:
            hard = resource.getrlimit(res)[1]
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            resource.setrlimit(res, (value, value))
        os.chdir("/sandbox")
        os.execvpe(argv[0], argv, environ)
    except BaseException as exc:   # nothing of the server may run on in the child
        try:
            os.write(2, f"sandbox: cannot run {argv[0]!r}: {exc}\n".encode())
        finally:
            os._exit(127 if isinstance(exc, FileNotFoundError) else 126)


def main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    _subreaper()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    commands: set[int] = set()
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
                    commands.discard(pid)
                    sock.send(REPLY.pack(b"X", pid, status, ru.ru_utime, ru.ru_stime, ru.ru_maxrss))
        if sock.fileno() in ready:
            msg, anc, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fd_size))
            if not msg:
                return       # the worker closed the session
            fds: list[int] = []
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += struct.unpack(f"{len(data) // fd_size}i", data[:len(data) - len(data) % fd_size])
            argv, environ, rlimits, cpus = marshal.loads(msg)
            try:
                pid = os.fork()
            except OSError as exc:
                pid = -1
                sock.send(REPLY.pack(b"E", 0, exc.errno or 0, 0.0, 0.0, 0))
            if pid == 0:
                _child(argv, environ, rlimits, cpus, fds)
            for f in fds:
                os.close(f)
            if pid > 0:
                commands.add(pid)
                sock.send(REPLY.pack(b"P", pid, 0, 0.0, 0.0, 0))


if __name__ == "__main__":
    main(int(sys.argv[1]))
