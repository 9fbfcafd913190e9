"""Helpers shared by the test modules."""
from __future__ import annotations

import os
import random
import stat
import sys
import textwrap
import time
from pathlib import Path

from tangram_hpc.actions import ActionSpec, EnvState


def wait_until(pred, timeout: float = 30.0, interval: float = 0.2, what: str = "condition"):
    """Poll ``pred`` until it returns something true (returned), or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def unique_sleep() -> str:
    """An argument for ``sleep`` no other process on the machine uses: far longer than any test
    waits, so a command that should be stopped is found stopped or the wait fails."""
    return f"900.{random.randrange(10**9):09d}"


def sleeping(arg: str) -> bool:
    """Whether a ``sleep ARG`` process runs on this machine (see :func:`unique_sleep`)."""
    import psutil
    for p in psutil.process_iter(["cmdline"]):
        if p.info["cmdline"] == ["sleep", arg]:
            return True
    return False


def tree_of(root: Path) -> dict[str, tuple]:
    """Every entry below ``root``: its type, mode, content or link target, and hard-link count."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = os.lstat(p)
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            elif stat.S_ISFIFO(st.st_mode):
                out[rel] = ("fifo",)
            else:
                out[rel] = ("file", stat.S_IMODE(st.st_mode), p.read_bytes(), st.st_nlink)
    return out


def act(cmd, env=None, **payload) -> ActionSpec:
    """A sandbox action: ``cmd`` (a string for /bin/sh -c, or an argv), more payload keys, env id."""
    payload["cmd"] = cmd
    return ActionSpec("sandbox", payload, env=env)


def py(code: str) -> list[str]:
    """argv running ``code`` (dedented) with this interpreter."""
    return [sys.executable, "-c", textwrap.dedent(code)]


def kept_state() -> str:
    """The ``env_state`` of an action that ran where its environment already was, after an earlier
    one: ``live`` where the workers keep each environment's processes (``TANGRAM_SANDBOX_SESSIONS``
    on, as a run of the suite with sessions sets it), else ``kept``."""
    on = os.environ.get("TANGRAM_SANDBOX_SESSIONS", "").strip().lower() in ("1", "true", "yes", "on")
    return EnvState.LIVE if on else EnvState.KEPT
