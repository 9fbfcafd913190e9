"""Mounting each attempt's layer into a live session: one small root helper per worker.

A live session (:mod:`tangram_hpc.managers.sessions`) outlives its actions, but each attempt
still needs a layer of its own (:mod:`tangram_hpc.managers.env_layers`).  The session is started
in a mount namespace of its own (``unshare --mount``) where the environment's directory is a
*shared* bind mount of itself, which bubblewrap then binds at ``/sandbox`` as a slave of it.  An
overlay mounted on the environment's directory in that namespace therefore appears at
``/sandbox`` inside the sandbox, and unmounting it there takes it away again.

Unmounting is slow (the kernel waits for an RCU grace period: 3-45 ms measured on a loaded
2-core machine, against 0.3 ms for a mount), so a layer is not unmounted when its attempt is
settled: the next attempt's overlay is mounted *on top of it* (its lower layer is the
environment's directory, never covered in the session's namespace: bubblewrap binds the shared
mount point beside it, ``<env>.attempt``'s sibling ``<env>.live``).  The stack is taken away in
one detach of its bottom layer, held open by the helper, every :data:`STACK_MAX` layers and when
the session ends.

Mounting needs root and a single-threaded process (``setns`` refuses a multi-threaded one), so
the worker keeps one helper process (``python -I -S -c``) for it: it reads a request line from
its stdin, enters the mount namespace of the session's ``unshare`` process, mounts or unmounts,
and answers ``ok`` or the error.  Only the worker writes to it: no sandbox can reach it.  When the
worker dies its stdin ends and the helper exits.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from ..errors import TangramError

__all__ = ["MountHelper", "MountError"]

#: Overlay options as :mod:`env_layers` (no redirects, index, metacopy or xino).
OPTIONS = "redirect_dir=off,index=off,metacopy=off,xino=off"

#: Layers stacked in a session before the stack is taken away (one slow unmount per this many actions).
STACK_MAX = 64

_HELPER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, MNT_DETACH = 0x20000, 2
bottoms = {}      # session namespace pid -> O_PATH descriptor of its stack's bottom layer
def err(what):
    e = ctypes.get_errno()
    return f"{what}: {os.strerror(e)}"
def lines():
    buf = b""
    while chunk := os.read(0, 65536):
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode()
def answer(text):
    os.write(1, (text + "\n").encode())
for line in lines():
    parts = line.split("\0")
    if parts[0] == "C":          # the session ended: its namespace went with it
        fd = bottoms.pop(parts[1], None)
        if fd is not None:
            os.close(fd)
        answer("ok"); continue
    try:
        ns = os.open(f"/proc/{int(parts[1])}/ns/mnt", os.O_RDONLY)
    except (OSError, ValueError, IndexError) as exc:
        answer(f"error: no session namespace: {exc}"); continue
    try:
        if libc.setns(ns, CLONE_NEWNS) != 0:
            reply = err("setns")
        elif parts[0] == "M":
            target, opts = parts[2], parts[3]
            if libc.mount(b"overlay", target.encode(), b"overlay", 0, opts.encode()) != 0:
                reply = err("mount overlay")
            else:
                reply = "ok"
                if parts[1] not in bottoms:
                    bottoms[parts[1]] = os.open(target, os.O_PATH | os.O_DIRECTORY)
        elif parts[0] == "R":        # the whole stack, in one detach of its bottom layer
            fd = bottoms.pop(parts[1], None)
            if fd is None:
                reply = "ok"
            else:
                reply = "ok" if libc.umount2(f"/proc/self/fd/{fd}".encode(), MNT_DETACH) == 0 else err("umount")
                os.close(fd)
        else:
            reply = "error: unknown request"
    finally:
        os.close(ns)
    answer("ok" if reply == "ok" else f"error: {reply}")
"""


class MountError(TangramError, OSError):
    """The helper could not mount or unmount a layer."""


class MountHelper:
    """The worker's side of the mount helper; one request at a time (thread-safe)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _ensure(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _HELPER], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, close_fds=True, bufsize=0,
                                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"})
        return self._proc

    def _ask(self, *parts: str) -> None:
        if any("\0" in p or "\n" in p for p in parts):
            raise MountError(f"bad mount request {parts!r}")
        with self._lock:
            proc = self._ensure()
            try:
                os.write(proc.stdin.fileno(), ("\0".join(parts) + "\n").encode())
                reply = b""
                while not reply.endswith(b"\n"):
                    chunk = os.read(proc.stdout.fileno(), 4096)
                    if not chunk:
                        break
                    reply += chunk
                answer = reply.decode(errors="replace").strip()
            except OSError as exc:
                raise MountError(f"mount helper: {exc}") from None
        if answer != "ok":
            raise MountError(answer or "the mount helper exited")

    def mount_layer(self, ns_pid: int, mount_point: Path, env_dir: Path, attempt: Path) -> None:
        """Mount ``attempt``'s layer over ``env_dir`` on ``mount_point`` (seen at ``/sandbox``) in
        ``ns_pid``'s namespace, on top of the layers there."""
        opts = f"lowerdir={env_dir},upperdir={attempt / 'upper'},workdir={attempt / 'work'},{OPTIONS}"
        self._ask("M", str(ns_pid), str(mount_point), opts)

    def unmount_stack(self, ns_pid: int) -> None:
        """Take every layer mounted in ``ns_pid``'s namespace away (lazily: a kept process may still
        hold one); slow, see the module docstring."""
        self._ask("R", str(ns_pid))

    def forget(self, ns_pid: int) -> None:
        """The session of ``ns_pid`` ended."""
        self._ask("C", str(ns_pid))

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
