"""Starting ``tangram-hpc serve`` as a child process for tests (and reading its URL)."""
from __future__ import annotations

import ctypes
import os
import selectors
import signal
import subprocess
import sys
import time
from contextlib import contextmanager


@contextmanager
def running_serve(connection_file, *extra: str, timeout: float = 30.0):
    """``tangram-hpc serve --port 0`` beside a coordinator; yields ``(process, base_url)``, the URL
    carrying the service's token (unless ``--no-auth`` is among ``extra``)."""
    cmd = [sys.executable, "-m", "tangram_hpc.cli", "serve", "--connection-file", str(connection_file),
           "--port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=os.path.join(os.path.dirname(__file__), ".."), preexec_fn=_die_with_parent)
    try:
        yield proc, _read_url(proc, timeout)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _die_with_parent() -> None:
    # A test run that is killed must not leave a serve process behind.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _read_url(proc: subprocess.Popen, timeout: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=0.2):
            line = proc.stdout.readline()
            if " at http://" in line:
                url = line.split(" at ", 1)[1].split()[0]
                source = line.rsplit("token: ", 1)[-1].rstrip(")\n") if "token: " in line else "none"
                if source.startswith("none"):
                    return url
                token = os.environ["TANGRAM_SERVE_TOKEN"] if source == "$TANGRAM_SERVE_TOKEN" else \
                    open(source).read().strip()
                # the token as the URL's password: requests, aiohttp and the sandbox-fusion SDK send it
                return url.replace("http://", f"http://tangram:{token}@", 1)
            if not line and proc.poll() is not None:
                break
    proc.kill()
    raise RuntimeError(f"serve did not start: {proc.stderr.read()}")
