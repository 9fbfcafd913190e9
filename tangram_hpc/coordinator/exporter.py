"""The coordinator's Prometheus endpoint: an HTTP thread that asks the ZMQ loop for its figures.

The coordinator's state belongs to the thread running its loop.  A scrape
arrives on ``prometheus_client``'s HTTP server thread, so it goes through a
:class:`LoopHandoff`: the loop builds the metric families between two of its
turns (when its state is consistent) and hands them over.  Nothing runs on
the loop unless a scrape asks.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError
from ..metrics import Family, prometheus_collector
from ..netaddr import advertised_host

__all__ = ["LoopHandoff", "MetricsServer", "start_metrics"]

log = logging.getLogger("tangram.coordinator")


class MetricsServer:
    """``prometheus_client``'s HTTP server on a thread of its own.  Each scrape has the loop run
    ``build`` (the loop polls :attr:`fd` and calls :meth:`answer`); a loop that does not answer
    within ``timeout_s`` gets its last figures served, with ``tangram_metrics_age_seconds``
    saying how old they are."""

    def __init__(self, host: str, port: int, build: Callable[[], list[Family]], *,
                 advertise_host: str | None = None, timeout_s: float = 5.0):
        from prometheus_client import start_http_server   # after the check in prometheus_collector

        registry = prometheus_collector(self._scrape)
        self.build = build
        self.timeout_s = timeout_s
        self.handoff = LoopHandoff()     # before the server: a scrape may come at once
        addr = "0.0.0.0" if host in ("*", "") else host
        try:
            self._httpd, self._thread = start_http_server(port, addr=addr, registry=registry)
        except BaseException:
            self.handoff.close()
            raise
        self.port = self._httpd.server_port
        # what the connection file tells workers, by the same rule: a loopback host name (a common
        # /etc/hosts default) would be a target no Prometheus on another node can reach
        self.host = advertised_host("0.0.0.0" if addr == "::" else addr, advertise_host)[0]

    @property
    def fd(self) -> int:
        """Readable when a scrape waits for the loop."""
        return self.handoff.fd

    def answer(self) -> None:
        self.handoff.answer()

    def _scrape(self) -> list[Family]:
        families, age = self.handoff.ask(self.build, self.timeout_s)
        age_f = Family("tangram_metrics_age_seconds", "gauge",
                       f"age of these figures: above 0 when the coordinator loop did not answer within "
                       f"{self.timeout_s:g} s")
        return list(families or []) + [age_f.add(age if age is not None else float("inf"))]

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self.handoff.close()
        self._thread.join(timeout=5)
        if self.target_file is not None:
            self.target_file.unlink(missing_ok=True)

    target_file: Path | None = None     # the scrape target written for Prometheus (write_target)

    def write_target(self, path: Path, labels: dict[str, str]) -> None:
        """The endpoint in Prometheus's file_sd format, so that a Prometheus watching the targets
        directory finds a coordinator whose port was picked at start (metrics_port 0); removed on close."""
        target = [{"targets": [f"{self.host}:{self.port}"], "labels": labels}]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")   # file_sd ignores it; the rename is atomic
        tmp.write_text(json.dumps(target) + "\n")
        os.replace(tmp, path)
        self.target_file = path


def start_metrics(config, build: Callable[[], list[Family]], coordinator_id: str) -> MetricsServer:
    """The endpoint a coordinator's [coordinator] ``config`` asks for (``metrics_port`` set), with its
    scrape target written to ``metrics_targets_dir`` (default: the run directory); a port that cannot
    be served or a missing ``prometheus_client`` is a :class:`ConfigError`."""
    host, port = config.metrics_host or config.host, config.metrics_port
    try:
        server = MetricsServer(host, port, build, advertise_host=config.advertise_host)
    except ImportError as e:
        raise ConfigError(f"metrics_port is set, but {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot serve metrics on {host}:{port} (metrics_host, metrics_port): "
                          f"{e.strerror or e}") from None
    log.info("Prometheus metrics at %s", server.url)
    run = config.run_dir.name
    server.write_target(Path(config.metrics_targets_dir or config.run_dir) / f"tangram-{run}.json",
                        {"coordinator": coordinator_id, "run": run})
    return server


class LoopHandoff:
    """Runs a function on a single-threaded event loop for another thread, and waits for it.

    The coordinator's state belongs to its ZMQ loop; a scrape arrives on the
    HTTP server's thread.  :meth:`ask` wakes the loop through a pipe (the loop
    polls :attr:`fd` beside its sockets) and waits for :meth:`answer`, which
    the loop calls between two turns, when its state is consistent.  Nothing
    runs on the loop unless someone asks, and a loop that does not answer in
    time gets the last answer (with its age) instead of a hung scrape.
    """

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._lock = threading.Lock()        # one question at a time
        self._done = threading.Event()
        self._fn: Callable[[], Any] | None = None
        self._answer: Any = None
        self._answered_at: float | None = None   # time.monotonic() of the last answer
        self._closed = False

    @property
    def fd(self) -> int:
        return self._r

    def ask(self, fn: Callable[[], Any], timeout: float) -> tuple[Any, float | None]:
        """``fn()`` as run by the loop, and the age in seconds of that answer (about 0 when
        fresh; the last answer and its age when the loop did not answer within ``timeout``;
        None and None before any answer)."""
        with self._lock:
            if not self._closed:
                self._done.clear()
                self._fn = fn
                try:
                    os.write(self._w, b"?")
                except BlockingIOError:
                    pass   # the pipe already holds a wake-up
                if not self._done.wait(timeout):
                    self._fn = None
            at = self._answered_at
            return self._answer, (time.monotonic() - at) if at is not None else None

    def answer(self) -> None:
        """Called by the loop when :attr:`fd` is readable."""
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass
        fn = self._fn
        if fn is None:
            return
        self._fn = None
        try:
            self._answer = fn()
            self._answered_at = time.monotonic()
        except Exception:
            log.exception("building metrics failed")   # the asker gets the last answer and its age
        self._done.set()

    def close(self) -> None:
        """Release a waiting asker and close the pipe (askers after this get the last answer)."""
        self._closed = True
        self._done.set()
        with self._lock:      # no asker is between its check of _closed and its write now
            for fd in (self._r, self._w):
                try:
                    os.close(fd)
                except OSError:
                    pass
