"""The sandbox side of a worker: its :class:`~tangram_hpc.managers.sandbox.SandboxManager`, the
:class:`~tangram_hpc.managers.env_host.EnvHost` over it, and the cancel pipes of the commands
running now.

The :class:`~tangram_hpc.worker.Worker` calls it from its executor threads (:meth:`run_in_env`,
:meth:`run`), from its I/O thread (:meth:`cancel`, :meth:`heartbeat`, :meth:`register_fields`,
:meth:`welcomed`) and when it ends (:meth:`close`).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from . import protocol as P
from .actions import ActionSpec, Status

log = logging.getLogger("tangram.worker")

#: How long an outcome of a command killed by a job's signal waits to learn whether the worker leaves.
JOB_SIGNAL_WAIT_S = 0.5
_JOB_SIGNALS = frozenset({signal.SIGTERM, signal.SIGKILL, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP})
#: How long a worker ending without a coordinator waits for its environments to be saved.
_SAVE_ALL_WAIT_S = 120.0
#: How often expired environments are removed (on a thread of its own: deleting trees takes a while).
_GC_EVERY_S = 30.0


class WorkerSandboxes:
    """See the module docstring.  ``leaving()``: whether the worker is leaving; ``leave_signalled``:
    set once it learns it is; ``item_limit()``: the largest outcome it may send."""

    def __init__(self, cfg: Any, run_dir: str, wake: Callable[[], None], leaving: Callable[[], bool],
                 leave_signalled: threading.Event, item_limit: Callable[[], int]):
        from .managers.env_host import EnvHost
        from .managers.sandbox import SandboxManager
        self.cfg = cfg
        # Until the coordinator names its snapshot directory (WELCOME), a fallback under its run directory.
        snapshots = cfg.snapshot_dir or os.path.join(cfg.connection.run_dir or run_dir, "snapshots")
        self.mgr = SandboxManager(os.path.join(run_dir, "envs"), snapshots, unsafe=cfg.unsafe_sandbox,
                                  result_bytes=cfg.max_output_bytes, **cfg.sandbox_options)
        self.mgr.check()  # no bubblewrap and no explicit --unsafe-sandbox: refuse to start, saying why
        self.envs = EnvHost(self.mgr, wake)
        self.mgr.live.after_reply = True     # sessions frozen and layers made once DONE is sent: replied()
        live = self.mgr.session_status()
        log.info("sandbox sessions: %s", f"on, frozen by {live['freezer']}" if live.get("off") is None
                 else f"off ({live['off']})")
        self._leaving = leaving
        self._leave_signalled = leave_signalled
        self._item_limit = item_limit
        # running sandbox action -> write ends of its cancel pipes (two attempts may overlap)
        self._cancel_fds: dict[str, set[int]] = {}
        self._last_gc = time.monotonic()
        # The environment list as last sent and its number: a heartbeat carries the list only when it
        # changed or the coordinator asked (at 25,000 environments it is most of a heartbeat's cost).
        self._envs_sent: list[str] | None = None
        self._envs_v = 0

    # -- executor threads -------------------------------------------------------------
    def run(self, spec: ActionSpec, cpus: list[int]) -> tuple:
        """A sandbox command's ``(status, output, error)``; killed through :meth:`cancel`."""
        r, w = os.pipe()
        self._cancel_fds.setdefault(spec.id, set()).add(w)
        try:
            o = self.mgr.run(spec, cpus, cancel_fd=r)
        finally:
            fds = self._cancel_fds.get(spec.id)
            if fds is not None:
                fds.discard(w)
                if not fds:
                    self._cancel_fds.pop(spec.id, None)
            os.close(r)
            os.close(w)
        if not self._leaving() and ended_by_job_signal((o.status, o.output)):
            # Slurm signals every process of a job that ends (scancel, time limit) at once: the
            # command may die of it a moment before this worker learns it is leaving.
            self._leave_signalled.wait(JOB_SIGNAL_WAIT_S)
        return o.status, o.output, o.error

    def run_in_env(self, spec: ActionSpec, attempt: int, cpus: list[int], grant: P.Grant, started: float,
                   cancelled: Callable[[], bool], interrupted: Callable[[str], bool]) -> tuple:
        """A sandbox action in an environment, from its grant to the journal (EnvHost.run); returns
        ``(outcome, started, finished, env_state)``.  ``interrupted(status)``: the worker interrupted it."""
        return self.envs.run(
            spec, attempt, grant, started, lambda: self._run_bounded(spec, cpus), cancelled=cancelled,
            # Not journaled: a command a job's signal killed half way (under load the worker may learn
            # only later that it is leaving, and a retry must run it again, not replay its death).
            keep=lambda o: not interrupted(o[0]) and not ended_by_job_signal(o))

    def _run_bounded(self, spec: ActionSpec, cpus: list[int]) -> tuple:
        """A sandbox command's outcome, its output within the size limit (journaled as it is reported:
        a replay answers the same, never larger than a DONE may be)."""
        try:
            outcome = self.run(spec, cpus)
        except BaseException as e:
            outcome = (Status.ERROR, None, f"handler crashed: {type(e).__name__}: {e}")
        packed, too_large = P.pack_output(outcome[1], self._item_limit())
        return outcome if packed is not None else (Status.FAILED, None, too_large)

    # -- I/O thread ----------------------------------------------------------------------
    def cancel(self, aid: str) -> None:
        """Kill ``aid``'s running command through its cancel pipe."""
        for fd in list(self._cancel_fds.get(aid, ())):
            try:
                os.write(fd, b"\0")
            except OSError:
                pass  # it just finished

    def replied(self) -> None:
        """The outcomes finished so far have been sent: what waited for that runs now (off their round
        trips): their sessions are frozen and their next attempts' layers made."""
        self.mgr.live.replied()

    def register_fields(self) -> dict:
        self._envs_sent = None     # a coordinator just (re)met gets the list with the first heartbeat
        return {"envs": self.envs.held(), "env_root": os.path.abspath(self.mgr.root)}

    def welcomed(self, result_bytes: int, snapshot_dir: Any) -> None:
        self.mgr.result_bytes = result_bytes    # a result is bounded where it is made, before it is packed
        if not self.cfg.snapshot_dir and isinstance(snapshot_dir, str) and snapshot_dir:
            self.mgr.snapshot_dir = Path(snapshot_dir)

    def send_envs(self) -> None:
        """The coordinator has not the list this worker's heartbeats name: the next one carries it."""
        self._envs_sent = None

    def heartbeat(self, body: dict) -> None:
        envs = sorted(self.mgr.environments())
        if envs != self._envs_sent:
            self._envs_sent = envs
            self._envs_v += 1
            body["envs"] = envs
        body["envs_v"] = self._envs_v
        now = time.monotonic()
        if now - self._last_gc > _GC_EVERY_S:
            self._last_gc = now
            # Deleting expired environment trees can take a while: never on the I/O thread.
            threading.Thread(target=self._gc, args=(now,), name="env-gc", daemon=True).start()

    def _gc(self, now: float) -> None:
        gone = self.mgr.gc(now)
        if gone:
            self.envs.gone(gone, "idle for longer than its TTL (env_ttl_s)")

    # -- the end ---------------------------------------------------------------------------
    def close(self, handed_back: bool) -> None:
        """Close the environments; ``handed_back``: the worker left and handed them back already."""
        if not handed_back:
            # Ended without leaving (no coordinator for orphan_exit_s, an error): save them all for a
            # restarted coordinator, which finds the snapshots in its state directory.
            self.envs.hand_back_all().wait(_SAVE_ALL_WAIT_S)
        self.envs.close()
        keep = self.envs.unsaved()
        if keep:
            log.error("%d environments could not be saved; left in %s for another worker to adopt",
                      len(keep), self.mgr.root)
        self.mgr.close(keep=keep)


def ended_by_job_signal(outcome: tuple) -> bool:
    """A sandbox command that failed by a signal a batch system sends to every process of a job
    it ends (TERM, KILL, USR2 before the time limit, INT, HUP), not by one of this worker's kills."""
    out = outcome[1]
    if outcome[0] != Status.FAILED or not isinstance(out, dict):
        return False
    rc = out.get("returncode")
    return isinstance(rc, int) and (-rc in _JOB_SIGNALS or rc - 128 in _JOB_SIGNALS)
