"""The pool driver: runs the pool policy against a worker backend.

Socket-free (the backend is injected, the clock passed in).  Each tick it
polls the backend's job events (a job that ended loses its worker), feeds the
:class:`~tangram_hpc.policy.base.PoolPolicy` a :class:`PoolView` every
``pool_interval_s``, launches and drains what the policy decides, and
reclaims drained workers: STOP first, so the worker snapshots its
environments and exits by itself, and the backend job is cancelled only if
it is still there ``drain_grace_s`` later.
"""
from __future__ import annotations

import logging

from .. import protocol as P
from ..backends.base import JobState, WorkerBackend, WorkerLaunchSpec
from ..config import CoordinatorSettings
from ..policy.base import Launch, PoolPolicy, PoolView, Reclaim, WorkerStatus
from ..resources import WorkerShape
from .ledger import ActionLedger
from .registry import WorkerRecord, WorkerState

log = logging.getLogger("tangram.coordinator")


class PoolDriver:
    def __init__(self, config: CoordinatorSettings, pool: PoolPolicy, backend: WorkerBackend, ledger: ActionLedger,
                 *, connection_file: str, cpu_worker_args: tuple[str, ...] = (),
                 service_worker_args: tuple[str, ...] = ()):
        self.config = config
        self.pool = pool
        self.backend = backend
        self.ledger = ledger
        self.connection_file = connection_file
        self.cpu_worker_args = tuple(cpu_worker_args)
        self.service_worker_args = tuple(service_worker_args)
        self.starting: dict[str, tuple[WorkerShape, float]] = {}   # handle -> (shape, requested at)
        self.failures: list[tuple[float, str]] = []                 # recent failed starts: (time, why)
        self._reclaim_at: dict[str, float] = {}                     # drained handle -> cancel its job then
        self._last_decision = float("-inf")

    # -- events --------------------------------------------------------------------
    def joined(self, w: WorkerRecord) -> None:
        """A worker registered: if this driver launched it, it is no longer starting."""
        handle = w.info.handle
        if handle:
            started = self.starting.pop(handle, None)
            if started is not None:
                w.launched_shape = started[0]

    def tick(self, now: float) -> None:
        self.poll(now)
        if now - self._last_decision >= self.config.pool_interval_s:
            self.decide(now)
        self.finish_drains(now)

    def poll(self, now: float) -> None:
        """Apply the backend's job events: an ended job loses its worker, a job that never joined is a failed start."""
        try:
            events = self.backend.poll()
        except Exception as e:
            log.warning("backend poll failed: %s", e)
            return
        workers = self.ledger.workers
        for ev in events:
            if ev.state.live:
                continue
            self._reclaim_at.pop(ev.handle, None)  # it ended by itself
            if self.starting.pop(ev.handle, None) is not None and ev.state is not JobState.ENDED:
                self._launch_failed(now, f"{ev.handle}: {ev.state} {ev.reason}".strip())
            wid = workers.by_handle.get(ev.handle)
            if wid is not None:
                self.ledger.lose_worker(wid, now, f"backend job {ev.handle} {ev.state} {ev.reason}".strip(), dead=True)
            else:
                self.ledger.job_ended(ev.handle, now)   # a worker lost earlier: its environments can be adopted

    def decide(self, now: float) -> None:
        """One pool decision: launch what the policy asks for, drain what it gives back."""
        self._last_decision = now
        backend = self.backend
        view = PoolView(
            now=now, pending=self.ledger.policy.pending_actions(),
            workers=[WorkerStatus(info=w.info, busy_cores=w.busy_cores, running=len(w.running),
                                  idle_since=w.idle_since, envs=len(w.envs),
                                  draining=w.state is WorkerState.DRAINING,
                                  started_at=w.registered_at,
                                  ends_at=backend.time_limit(w.info.handle) if w.info.handle else None,
                                  shape=w.launched_shape)
                     for w in self.ledger.workers],
            starting=list(self.starting.values()),
            failures=self.failures[-50:], cluster=backend.capacity())
        for d in self.pool.decide(view):
            if isinstance(d, Launch):
                self._launch(d, now)
            elif isinstance(d, Reclaim):
                self.ledger.drain(d.worker_id, d.reason, now)

    def _launch(self, d: Launch, now: float) -> None:
        args = self.service_worker_args if d.shape.gpus or d.shape.gpu_mem_mb else self.cpu_worker_args
        spec = WorkerLaunchSpec(connection_file=self.connection_file, shape=d.shape, extra_args=args)
        try:
            handles = self.backend.launch(spec, d.count)
        except Exception as e:
            self._launch_failed(now, f"launch failed: {e}")
            log.warning("could not launch %d worker(s) of %s: %s", d.count, d.shape, e)
            return
        for h in handles:
            self.starting[h] = (d.shape, now)

    def _launch_failed(self, now: float, why: str) -> None:
        self.ledger.counters.launch_failures += 1
        self.failures.append((now, why))
        if len(self.failures) > 100:  # a crash-looping backend must not grow this forever
            del self.failures[:-50]

    def finish_drains(self, now: float) -> None:
        """Stop drained workers with nothing left running; cancel their jobs after the grace period."""
        for w in self.ledger.workers:
            if w.state is WorkerState.DRAINING and not w.running and not self.ledger.holds_moving_envs(w.info.id):
                # STOP first: the worker snapshots its environments and exits by itself (taking any
                # zombie attempt with it); the job is cancelled only if it is still there after the grace.
                self.ledger.outbox.to_workers.append(
                    (w.ident, P.STOP, {"reason": w.drain_reason or "reclaimed", "reregister": False}))
                self.ledger.retire_worker(w.info.id, now)
                if w.info.handle:
                    self._reclaim_at[w.info.handle] = now + self.config.drain_grace_s
        for handle, at in list(self._reclaim_at.items()):
            if now >= at:
                del self._reclaim_at[handle]
                try:
                    self.backend.reclaim(handle)
                except Exception as e:
                    log.warning("reclaiming %s failed: %s", handle, e)

    def status(self) -> dict:
        return {"launch_failures": self.ledger.counters.launch_failures,
                "recent_launch_failures": [why for _, why in self.failures[-5:]],
                "starting_workers": len(self.starting), "pool": self.pool.explain()}
