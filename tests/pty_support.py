"""Running commands in a pseudo-terminal for tests, and reading what the terminal would show."""
from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time

#: escape sequences (colours, cursor moves, screen switches) stripped to read a screen as text
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]")


def open_pty(rows: int = 50, cols: int = 150) -> tuple[int, int]:
    """(master, slave) of a new pseudo-terminal of that size."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    return master, slave


def run_in_pty(cmd: list[str], rows: int = 50, cols: int = 150) -> tuple[subprocess.Popen, int, int]:
    """Start ``cmd`` with the slave as its terminal (stdin, stdout, stderr); returns (process, master, slave)."""
    master, slave = open_pty(rows, cols)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")} | {"TERM": "xterm-256color"}
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, start_new_session=True, env=env,
                            cwd=os.path.join(os.path.dirname(__file__), ".."))
    return proc, master, slave


def read_for(master: int, seconds: float, until_exit: subprocess.Popen | None = None) -> bytes:
    """What the terminal receives for ``seconds`` (or until ``until_exit`` ends and its output is read)."""
    out = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not select.select([master], [], [], 0.1)[0]:
            if until_exit is not None and until_exit.poll() is not None:
                break
            continue
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    return out


def read_until(master: int, pred, timeout: float = 60.0) -> bytes:
    """What the terminal receives until ``pred`` accepts it all so far, as text without escapes."""
    out = b""
    deadline = time.monotonic() + timeout
    while not pred(ANSI.sub("", out.decode("utf-8", "replace"))):
        if time.monotonic() > deadline:
            raise AssertionError(f"the terminal never showed what was expected; it got:\n"
                                 f"{ANSI.sub('', out.decode('utf-8', 'replace'))[-3000:]}")
        if select.select([master], [], [], 0.1)[0]:
            out += os.read(master, 65536)
    return out


def read_screen_until(master: int, pred, timeout: float) -> str:
    """The latest complete frame of a full-screen program, as text, once ``pred`` accepts it.  A
    frame starts with a cursor-home; the one being written is complete when the next begins."""
    buf = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([master], [], [], 0.2)[0]:
            try:
                buf += os.read(master, 65536)
            except OSError:
                break
            frames = buf.decode("utf-8", "replace").split("\x1b[H")[1:-1]
            screen = ANSI.sub("", frames[-1]) if frames else ""
            if screen and pred(screen):
                return screen
    raise AssertionError(f"the screen never showed what was expected; last output:\n"
                         f"{ANSI.sub('', buf.decode('utf-8', 'replace'))[-3000:]}")


def press_and_drain(proc: subprocess.Popen, master: int, key: bytes, timeout: float) -> bytes:
    """Press ``key``, then read the terminal until the process exits (a full pty would block its writes)."""
    os.write(master, key)
    return read_for(master, timeout, until_exit=proc)
