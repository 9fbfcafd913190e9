"""Helpers shared by the test modules."""
from __future__ import annotations

import time


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
