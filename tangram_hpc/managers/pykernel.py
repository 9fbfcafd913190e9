"""A stateful Python kernel for one environment, and the driver an action runs to reach it.

This file runs INSIDE the sandbox: standard library only, no project imports,
so the worker can write it into an environment as it is (``.run_code/kernel.py``).

``python -I -S kernel.py`` is the driver (one per action): it reads a request on
stdin, runs its cells in the environment's kernel, starting the kernel when
none answers, and prints one JSON response on stdout::

    request:  {"cells": ["a = 1", "a + 1"], "cell_timeout": 0, "total_timeout": 45,
               "output_bytes": 1048576, "output_kill_bytes": 67108864}
    response: {"kernel": {"id", "started", "restarted", "note"},
               "cells": [{"status": "ok"|"error"|"timeout"|"died", "execution_count": 2,
                          "stdout": "", "stderr": "", "display": [{"text/plain": "2"}],
                          "error": [{"ename", "evalue", "traceback": [...]}]}],
               "timed_out": false}

``python kernel.py --serve SOCKET --ready-fd N`` is the kernel: one process
that keeps a ``__main__`` namespace and runs the cells sent on a unix socket
(private to the sandbox: ``$TMPDIR``, mode 0700) one at a time.

Choices, each for a reason:

* A cell's timeout interrupts it (an exception raised in it, as Jupyter's
  interrupt does) and the kernel keeps its state; a cell that does not yield
  to the interrupt (it catches it, or sits in C code) is killed with the whole
  kernel ``KILL_GRACE_S`` later, and the result says the state is lost.
* Outputs are read from the cell's file descriptors 1 and 2 (so ``os.write``
  and child processes are caught too), kept up to ``output_bytes`` each and
  drained past it; beyond ``output_kill_bytes`` the cell is interrupted as
  for a timeout.  The driver then cuts the response to ``output_bytes``.
* A process the cell forks never returns into the kernel's loop: it exits
  where the cell ends.  A cell that ends the kernel (``os._exit``, a signal)
  gets status ``died``; the request's later cells are not run, and the next
  request starts a new kernel.
* The driver records the kernel it started in ``.run_code/kernel.json`` in the
  environment: when a later action finds no kernel answering but that record,
  the environment's processes were not kept (reclaimed, or the environment
  moved to another worker), and its response says ``restarted``.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import stat
import struct
import sys
import time
import zlib

# Only what the driver needs is imported here: it starts once per action (run with ``python -I -S``,
# no site), while the kernel, which starts once, imports the rest where it is used.

#: After a cell's timeout, how long the kernel has to answer before it is killed.
KILL_GRACE_S = 5.0
#: How long a new kernel has to start listening.
START_S = 30.0
#: Where the driver records the kernel it started (relative to the environment).
RECORD = ".run_code/kernel.json"
_MAX_MESSAGE = 256 << 20
_HEADER = struct.Struct("!I")
_THIS_FILE = os.path.abspath(__file__)
_dumps, _loads = json.dumps, json.loads    # a cell may rebind the module's names; the kernel keeps these


# -- framing (both sides) -------------------------------------------------------------------------

def _send(sock: socket.socket, doc: dict) -> None:
    data = _dumps(doc).encode("utf-8", "surrogatepass")
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> dict | None:
    """The next message, or None at end of stream; ValueError for one that is not a message."""
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    (n,) = _HEADER.unpack(head)
    if n > _MAX_MESSAGE:
        raise ValueError(f"message of {n} bytes")
    body = _recv_exact(sock, n)
    if body is None:
        return None
    doc = _loads(body.decode("utf-8", "replace"))
    if not isinstance(doc, dict):
        raise ValueError("message is not an object")
    return doc


def socket_path() -> str:
    """The kernel's socket for the environment in the current directory: in the sandbox's private
    ``$TMPDIR``, named after the directory and the uid (one kernel per environment even where
    ``$TMPDIR`` is shared, as without isolation), short enough for a unix socket address."""
    where = f"{os.getcwd()}\0{os.getuid()}".encode()
    key = f"{zlib.crc32(where):08x}{zlib.adler32(where):08x}"     # hashlib would load OpenSSL: slower
    return os.path.join(os.environ.get("TMPDIR") or "/tmp", f"tangram-kernel-{key}", "sock")


# -- the kernel -----------------------------------------------------------------------------------

class _Interrupt(BaseException):
    """Raised in a running cell by its timeout or its output flood."""


class _Capture:
    """The cell's fds 1 and 2 as pipes, drained by a thread: the first ``keep`` bytes of each are
    kept, the rest counted and dropped; past ``kill`` bytes in all, ``on_flood`` is called once."""

    def __init__(self, keep: int, kill: int, on_flood):
        self.keep, self.kill, self.on_flood = keep, kill, on_flood
        self.kept = {1: bytearray(), 2: bytearray()}
        self.total = 0
        self.truncated = False
        self.marker = b"\0tangram-cell-end-" + os.urandom(16).hex().encode()

    def __enter__(self) -> "_Capture":
        import threading
        self.reads: dict[int, int] = {}
        for fd in (1, 2):
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            self.reads[r] = fd
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        _flush_std()
        for fd in (1, 2):
            try:
                os.write(fd, self.marker)
            except OSError:
                pass          # the cell closed it: its pipe ends when its last writer does
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(null, fd)
        os.close(null)
        # A background process the cell started may hold a pipe open forever: the marker, not the
        # end of the stream, says the cell's output is complete.
        self.thread.join(KILL_GRACE_S)

    def _drain(self) -> None:
        # The last len(marker) - 1 bytes of each pipe are held back until it is known whether they
        # begin the marker, so the marker never reaches the output.
        hold = len(self.marker) - 1
        pending = {r: b"" for r in self.reads}
        open_ = set(self.reads)
        flooded = False
        try:
            while open_:
                ready, _, _ = select.select(list(open_), [], [])
                for r in ready:
                    chunk = os.read(r, 1 << 16)
                    seen = pending[r] + chunk
                    end = seen.find(self.marker)
                    if end >= 0 or not chunk:
                        self._keep(self.reads[r], seen[:end] if end >= 0 else seen)
                        open_.discard(r)
                        continue
                    cut = max(0, len(seen) - hold)
                    self._keep(self.reads[r], seen[:cut])
                    pending[r] = seen[cut:]
                    if self.total > self.kill and not flooded:
                        flooded = True
                        self.on_flood()
        finally:
            for r in self.reads:
                os.close(r)

    def _keep(self, fd: int, chunk: bytes) -> None:
        self.total += len(chunk)
        buf = self.kept[fd]
        room = self.keep - len(buf)
        if len(chunk) > room:
            self.truncated = True
        if room > 0:
            buf += chunk[:room]

    def text(self, fd: int) -> str:
        return bytes(self.kept[fd]).decode("utf-8", "replace")


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _bundle(value) -> dict:
    """Jupyter's MIME bundle of a value: text/plain, and the rich forms the value offers."""
    import base64
    out = {"text/plain": repr(value)}
    for method, mime in (("_repr_html_", "text/html"), ("_repr_markdown_", "text/markdown"),
                         ("_repr_png_", "image/png")):
        fn = getattr(type(value), method, None)
        if fn is None:
            continue
        try:
            rich = fn(value)
        except Exception:
            continue
        if isinstance(rich, bytes):
            rich = base64.b64encode(rich).decode()
        if isinstance(rich, str):
            out[mime] = rich
    return out


def _error(exc: BaseException, ename: str | None = None, evalue: str | None = None) -> dict:
    """Jupyter's error entry; the traceback without the kernel's own frames, which say nothing
    about the cell."""
    import traceback
    ename = ename or type(exc).__name__
    if evalue is None:
        try:
            evalue = str(exc)
        except Exception:       # the cell's own exception class: its __str__ may raise too
            evalue = f"<{ename} whose str() raised>"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != _THIS_FILE]
    lines = ["Traceback (most recent call last):", *traceback.format_list(frames)] if frames else []
    last = [f"{ename}: {evalue}" if evalue else ename]
    if not isinstance(exc, _Interrupt):
        try:
            last = traceback.format_exception_only(type(exc), exc)   # a SyntaxError's line and caret
        except Exception:
            pass
    lines += last
    return {"ename": ename, "evalue": evalue, "traceback": [line.rstrip("\n") for line in lines]}


class Kernel:
    def __init__(self) -> None:
        import builtins
        import threading
        import types
        self.id = os.urandom(8).hex()
        self.pid = os.getpid()
        self.main_thread = threading.main_thread().ident
        self.count = 0
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main    # so pickle finds what the cells define
        self.ns = main.__dict__
        self.ns.setdefault("display", self._display)
        self.displayed: list[dict] | None = None
        self.in_cell = False
        self.reason = "timeout"
        #: the environment's directory and the cells' working directory, as paths: in a live session
        #: each action's files are a new mount there, which only a path resolved anew reaches
        self.home = self.cwd = os.getcwd()
        signal.signal(signal.SIGALRM, self._on_alarm)

    def _display(self, *objs) -> None:
        """Jupyter's ``display``: each object's MIME bundle in the cell's ``display`` list."""
        if self.displayed is not None:
            self.displayed.extend(_bundle(o) for o in objs)

    def _on_alarm(self, signum, frame) -> None:
        if self.in_cell:
            raise _Interrupt(self.reason)

    def _flood(self) -> None:
        self.reason = "flood"
        signal.pthread_kill(self.main_thread, signal.SIGALRM)

    def run_cell(self, code: str, timeout: float, keep: int, kill: int) -> dict:
        import linecache
        self.count += 1
        name = f"<cell-{self.count}>"
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        cell: dict = {"status": "ok", "execution_count": self.count, "display": [], "error": []}
        self.displayed = cell["display"]
        self.reason = "timeout"
        cap = _Capture(keep, kill, self._flood)
        try:
            os.chdir(self.cwd)
        except OSError:
            os.chdir(self.home)
        try:
            with cap:
                try:
                    try:
                        self.in_cell = True
                        if timeout > 0:
                            signal.setitimer(signal.ITIMER_REAL, timeout)
                        self._execute(code, name)
                    finally:
                        self.in_cell = False
                        signal.setitimer(signal.ITIMER_REAL, 0)
                except _Interrupt as exc:
                    self.in_cell = False
                    timed_out = exc.args[0] == "timeout"
                    cell["status"] = "timeout" if timed_out else "error"
                    why = (f"the cell ran past its {timeout:g} s timeout" if timed_out
                           else f"the cell wrote more than {kill} bytes of output")
                    cell["error"].append(_error(exc, "TimeoutError" if timed_out else "OutputLimit",
                                                f"{why}; it was interrupted, the kernel's state is kept"))
                except BaseException as exc:  # SystemExit and KeyboardInterrupt too, as in Jupyter
                    self.in_cell = False
                    cell["status"] = "error"
                    cell["error"].append(_error(exc))
                finally:
                    if os.getpid() != self.pid:
                        os._exit(0)       # a process the cell forked: it must not answer for the kernel
                    self.in_cell = False
                    signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            self.displayed = None
            try:
                self.cwd = os.getcwd()       # a cell's os.chdir lasts, as in Jupyter
            except OSError:
                pass
        cell["stdout"], cell["stderr"] = cap.text(1), cap.text(2)
        cell["truncated"] = _cut_strings(cell["display"], keep) | _cut_strings(cell["error"], keep) | cap.truncated
        return cell

    def _execute(self, code: str, name: str) -> None:
        import ast
        tree = ast.parse(code, name, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body[-1].value)
            tree.body.pop()
        exec(compile(tree, name, "exec"), self.ns)
        if last is not None:
            value = eval(compile(last, name, "eval"), self.ns)
            if value is not None:
                self.ns["_"] = value
                self.displayed.append(_bundle(value))

    def hello(self) -> dict:
        return {"id": self.id, "pid": self.pid, "execution_count": self.count}


def _cut_strings(doc, limit: int) -> bool:
    """Cut the strings in ``doc`` to ``limit`` characters; whether any was."""
    cut = False
    for k, v in list(doc.items() if isinstance(doc, dict) else enumerate(doc)):
        if isinstance(v, str) and len(v) > limit:
            doc[k] = v[:limit] + "...[cut]"
            cut = True
        elif isinstance(v, (dict, list)):
            cut = _cut_strings(v, limit) or cut
    return cut


def private_dir(path: str) -> None:
    """Make the socket's directory, or check the one there: a directory of this uid that no other
    can enter. Where ``$TMPDIR`` is shared (no sandbox), another uid could have made it first to
    pass its own kernel off as this one; then nothing is started and the driver says why."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077 == 0):
        raise PermissionError(f"{path} is not a private directory of uid {os.getuid()}: "
                              f"refusing to use a kernel socket there")


def serve(path: str, ready_fd: int | None) -> None:
    os.umask(0o077)
    private_dir(os.path.dirname(path))
    try:
        os.unlink(path)                    # a kernel that died left it
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    srv.settimeout(2.0)
    # A cell's os.fork() must not take the kernel's sockets with it: a child left running would hold
    # the driver's connection open, so a kernel that then died (os._exit) went unnoticed until the
    # request's timeout, instead of at its end of file.
    held = [srv]

    def drop_held_in_child() -> None:
        for s in held:
            s.close()
    os.register_at_fork(after_in_child=drop_held_in_child)
    kernel = Kernel()
    sys.path[0] = ""                       # the cells import from the environment, as in Jupyter
    for fd in (0, 1, 2):
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, fd)
        os.close(null)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    if ready_fd is not None:
        os.write(ready_fd, b"1")
        os.close(ready_fd)
    while True:
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            if _orphaned(path, kernel.home):
                return
            continue
        held.append(conn)
        with conn:
            conn.settimeout(None)
            try:
                _send(conn, kernel.hello())
                while (req := _recv(conn)) is not None:
                    _send(conn, kernel.run_cell(str(req.get("code", "")), float(req.get("timeout", 0)),
                                                int(req.get("keep", 1 << 20)), int(req.get("kill", 1 << 26))))
            except (OSError, ValueError):
                pass                       # that driver went away or spoke nonsense: wait for the next
        held.remove(conn)


def _orphaned(path: str, home: str) -> bool:
    """Nothing can reach this kernel any more: its socket or its environment's directory was removed."""
    return not (os.path.exists(path) and os.path.isdir(home))


# -- the driver -----------------------------------------------------------------------------------

class _Driver:
    def __init__(self, req: dict):
        self.cells = [str(c) for c in req.get("cells", [])]
        self.cell_timeout = float(req.get("cell_timeout") or 0)
        self.total = float(req.get("total_timeout") or 45)
        self.keep = max(1024, int(req.get("output_bytes", 1 << 20)))
        self.kill = int(req.get("output_kill_bytes", 1 << 26))
        self.path = socket_path()
        self.kernel: dict = {"id": None, "started": False, "restarted": False, "note": None}
        self.pid: int | None = None

    def connect(self) -> socket.socket:
        private_dir(os.path.dirname(self.path))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
            sock.settimeout(START_S)
            hello = _recv(sock)
            if hello is None:
                raise ConnectionRefusedError("the kernel closed the connection")
        except (OSError, ValueError):
            sock.close()
            return self._start()
        self._hello(hello)
        return sock

    def _start(self) -> socket.socket:
        import subprocess
        record = _read_record()
        r, w = os.pipe()
        proc = subprocess.Popen([sys.executable, _THIS_FILE, "--serve", self.path, "--ready-fd", str(w)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                pass_fds=(w,), start_new_session=True)
        os.close(w)
        ready, _, _ = select.select([r], [], [], START_S)
        ok = bool(ready) and os.read(r, 1) == b"1"
        os.close(r)
        if not ok:
            proc.kill()
            raise RuntimeError(f"the kernel did not start within {START_S:g} s (exit {proc.poll()})")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(START_S)
        sock.connect(self.path)
        hello = _recv(sock)
        if hello is None:
            raise RuntimeError("the new kernel closed its connection")
        self._hello(hello)
        self.kernel["started"] = True
        if record is not None:
            self.kernel["restarted"] = True
            self.kernel["note"] = ("an earlier action started a kernel in this environment and none answers (it "
                                   "exited, its processes were not kept, or the environment moved to another "
                                   "worker): a new kernel was started, the variables of earlier cells are gone")
        _write_record({"id": self.kernel["id"], "starts": int((record or {}).get("starts", 0)) + 1})
        return sock

    def _hello(self, hello: dict) -> None:
        self.kernel["id"] = hello.get("id")
        self.pid = hello.get("pid") if isinstance(hello.get("pid"), int) else None

    def run(self) -> dict:
        t_end = time.monotonic() + self.total
        out: dict = {"kernel": self.kernel, "cells": [], "timed_out": False}
        if not self.cells:
            return out
        sock = self.connect()
        with sock:
            for code in self.cells:
                left = t_end - time.monotonic()
                if left <= 0:
                    out["timed_out"] = True
                    break
                timeout = min(self.cell_timeout, left) if self.cell_timeout > 0 else left
                sock.settimeout(timeout + KILL_GRACE_S)
                try:
                    _send(sock, {"code": code, "timeout": timeout, "keep": self.keep, "kill": self.kill})
                    cell = _recv(sock)
                except socket.timeout:
                    self._kill()
                    out["cells"].append(_died(f"the cell did not stop within {KILL_GRACE_S:g} s of its "
                                              f"{timeout:g} s timeout: the kernel was killed, its state is lost"))
                    out["timed_out"] = timeout >= left
                    break
                except (OSError, ValueError):
                    cell = None
                if cell is None:
                    out["cells"].append(_died("the kernel exited while running this cell (os._exit, a signal, "
                                              "or its memory limit): its state is lost; the next request "
                                              "starts a new kernel"))
                    break
                out["cells"].append(cell)
                if cell.get("status") == "timeout" and timeout >= left:
                    out["timed_out"] = True
                    break
        return out

    def _kill(self) -> None:
        if self.pid is None:
            return
        for kill in (os.killpg, os.kill):
            try:
                kill(self.pid, signal.SIGKILL)
            except OSError:
                pass


def _died(why: str) -> dict:
    return {"status": "died", "execution_count": None, "stdout": "", "stderr": "", "display": [],
            "error": [{"ename": "KernelDied", "evalue": why, "traceback": []}], "truncated": False}


def _read_record() -> dict | None:
    try:
        with open(RECORD, encoding="utf-8") as f:
            doc = _loads(f.read())
        return doc if isinstance(doc, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def _write_record(doc: dict) -> None:
    os.makedirs(os.path.dirname(RECORD), exist_ok=True)
    with open(RECORD, "w", encoding="utf-8") as f:
        f.write(_dumps(doc))


def fit(out: dict, limit: int) -> dict:
    """``out`` with its longest strings halved until its JSON fits ``limit`` bytes, and no lone
    surrogates (an exception's text may hold them; the worker's result could not carry them)."""
    _clean(out)
    while len(_dumps(out).encode("utf-8", "surrogatepass")) > limit:
        holder, key, longest = None, None, -1
        stack: list = [out]
        while stack:
            doc = stack.pop()
            for k, v in (doc.items() if isinstance(doc, dict) else enumerate(doc)):
                if isinstance(v, str) and len(v) > longest:
                    holder, key, longest = doc, k, len(v)
                elif isinstance(v, (dict, list)):
                    stack.append(v)
        if holder is None or longest < 64:
            break
        holder[key] = holder[key][:longest // 2] + "...[cut]"
        if isinstance(holder, dict) and "truncated" in holder:
            holder["truncated"] = True
    return out


def _clean(doc) -> None:
    for k, v in list(doc.items() if isinstance(doc, dict) else enumerate(doc)):
        if isinstance(v, str):
            doc[k] = v.encode("utf-8", "replace").decode("utf-8")
        elif isinstance(v, (dict, list)):
            _clean(v)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        ready = int(argv[3]) if argv[2:3] == ["--ready-fd"] else None
        serve(argv[1], ready)
        return 0
    req = _loads(sys.stdin.read() or "{}")
    driver = _Driver(req)
    try:
        out = driver.run()
    except (OSError, RuntimeError) as exc:
        print(f"kernel driver: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(_dumps(fit(out, driver.keep)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
