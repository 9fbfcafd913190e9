"""Helpers shared by the test modules."""
from __future__ import annotations

import sys
import textwrap
import time

from tangram_hpc.actions import ActionSpec


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


def act(cmd, env=None, **payload) -> ActionSpec:
    """A sandbox action: ``cmd`` (a string for /bin/sh -c, or an argv), more payload keys, env id."""
    payload["cmd"] = cmd
    return ActionSpec("sandbox", payload, env=env)


def py(code: str) -> list[str]:
    """argv running ``code`` (dedented) with this interpreter."""
    return [sys.executable, "-c", textwrap.dedent(code)]
