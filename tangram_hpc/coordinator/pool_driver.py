"""The pool driver: runs the pool policy against a worker backend, through one launch throttle.

Socket-free (the backend is injected, the clock passed in).  Each tick it
polls the backend's job events (a job that ended loses its worker), feeds the
:class:`~tangram_hpc.policy.base.PoolPolicy` a :class:`PoolView` every
``pool_interval_s`` and carries out what it decides:

* ``Launch``: as many as the :class:`~tangram_hpc.backends.guards.LaunchThrottle`
  allows now (rate, back-off after failed starts, breaker, operator pause),
  for every backend alike;
* ``Withdraw``: cancel launched jobs still waiting in the batch queue, newest first;
* ``Reclaim``: drain the worker, then STOP it, so it snapshots its environments
  and exits by itself; its job is cancelled only if it is still there
  ``drain_grace_s`` later.

It keeps the allocation history (each worker job: state, reason, queued,
started, joined, ended), which ``tangram-hpc status --allocations`` shows, and
logs every launch, withdrawal, drain, reclaim and failed start with its reason.
"""
from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import protocol as P
from ..backends.base import JobState, WorkerBackend, WorkerLaunchSpec
from ..backends.guards import LaunchThrottle, ThrottleState, ThrottleStatus, local_time
from ..policy.base import Launch, PoolPolicy, PoolView, Reclaim, Withdraw, WorkerStatus
from ..resources import WorkerShape
from .ledger import ActionLedger
from .registry import WorkerRecord, WorkerState

if TYPE_CHECKING:     # the settings object is handed in; config itself stays out of the core's imports
    from ..config import CoordinatorSettings

log = logging.getLogger("tangram.coordinator")

#: Allocations kept in the history once their jobs ended (live ones are always kept).
HISTORY = 500
#: A job running this long without its worker joining is reported (it may not reach the coordinator).
NOT_JOINED_WARN_S = 60.0


@dataclass(slots=True)
class Allocation:
    """One worker job (or local worker process) the driver launched, and what became of it."""

    handle: str
    shape: WorkerShape
    submitted: float
    job_id: str | None = None
    state: str = "submitted"        # then a JobState value
    reason: str = ""
    started: float | None = None    # its job began to run
    joined: float | None = None     # its worker registered
    worker: str | None = None
    ended: float | None = None
    withdrawn: str | None = None    # why it was cancelled while queued
    healthy: bool = False           # joined and stayed: a good start
    warned: bool = False
    events: list[tuple[float, str, str]] = field(default_factory=list)

    def note(self, now: float, state: str, reason: str) -> None:
        self.state, self.reason = state, reason
        self.events.append((now, state, reason))
        if len(self.events) > 20:
            del self.events[1:-10]   # the first (submitted) and the latest ones

    def to_status(self) -> dict:
        def t(x: float | None) -> str | None:
            return None if x is None else local_time(x)
        return {"handle": self.handle, "job_id": self.job_id, "cores": self.shape.cores, "gpus": self.shape.gpus,
                "partition": self.shape.partition, "state": self.state, "reason": self.reason,
                "worker": self.worker, "submitted": t(self.submitted), "started": t(self.started),
                "joined": t(self.joined), "ended": t(self.ended),
                "events": [[local_time(at), st, why] for at, st, why in self.events]}


class PoolDriver:
    def __init__(self, config: CoordinatorSettings, pool: PoolPolicy, backend: WorkerBackend, ledger: ActionLedger,
                 *, connection_file: str, cpu_worker_args: tuple[str, ...] = (),
                 service_worker_args: tuple[str, ...] = (), throttle: LaunchThrottle):
        self.config = config
        self.pool = pool
        self.backend = backend
        self.ledger = ledger
        self.throttle = throttle
        self.connection_file = connection_file
        self.cpu_worker_args = tuple(cpu_worker_args)
        self.service_worker_args = tuple(service_worker_args)
        self.starting: dict[str, tuple[WorkerShape, float]] = {}   # handle -> (shape, requested at)
        self.failures: list[tuple[float, str]] = []                 # recent failed starts: (time, why)
        self.allocations: OrderedDict[str, Allocation] = OrderedDict()
        self._unproven: dict[str, Allocation] = {}                  # joined, not yet a good start
        self._reclaim_at: dict[str, float] = {}                     # drained handle -> cancel its job then
        self._last_decision = float("-inf")
        self._throttle_logged: tuple[ThrottleState, str] = (ThrottleState.OK, "")
        self.decisions: deque[tuple[float, str, str]] = deque(maxlen=50)  # (time, what, detail), for status

    # -- events --------------------------------------------------------------------
    def joined(self, w: WorkerRecord, now: float | None = None) -> None:
        """A worker registered: if this driver launched it, it is no longer starting."""
        handle = w.info.handle
        if not handle:
            return
        started = self.starting.pop(handle, None)
        if started is not None:
            w.launched_shape, w.launched_at = started
        rec = self.allocations.get(handle)
        if rec is not None:
            at = w.registered_at if now is None else now
            rec.joined, rec.worker = at, w.info.id
            if rec.started is None:
                rec.started = at   # it joined before the backend's next poll saw its job run
            if rec.state != JobState.RUNNING:
                rec.note(at, JobState.RUNNING, f"worker {w.info.id} joined")
            self._unproven[handle] = rec

    def tick(self, now: float) -> None:
        self.poll(now)
        if now - self._last_decision >= self.config.pool_interval_s:
            self.decide(now)
        self.finish_drains(now)
        self._check_starts(now)

    def poll(self, now: float) -> None:
        """Apply the backend's job events: an ended job loses its worker, a job that never joined is a failed start."""
        try:
            events = self.backend.poll()
        except Exception as e:
            log.warning("backend poll failed: %s", e)
            return
        workers = self.ledger.workers
        for ev in events:
            rec = self.allocations.get(ev.handle)
            if rec is not None:
                self._apply(rec, ev.state, ev.reason, now)
            if ev.state.live:
                continue
            self._reclaim_at.pop(ev.handle, None)  # it ended by itself
            self._unproven.pop(ev.handle, None)
            job = f" (job {rec.job_id})" if rec is not None and rec.job_id else ""
            what = f"{ev.state} {ev.reason}".strip()
            if self.starting.pop(ev.handle, None) is not None and ev.state is not JobState.ENDED:
                self._launch_failed(now, f"{ev.handle}{job}: {what}")
            elif (rec is not None and rec.joined is not None and not rec.healthy and ev.state is JobState.FAILED):
                self._launch_failed(now, f"{ev.handle}{job}: {what} {now - rec.joined:.0f} s after its worker joined")
            wid = workers.by_handle.get(ev.handle)
            if wid is not None:
                self.ledger.lose_worker(wid, now, f"backend job {ev.handle}{job} {what}", dead=True)
            else:
                self.ledger.job_ended(ev.handle, now)   # a worker lost earlier: its environments can be adopted

    def _apply(self, rec: Allocation, state: JobState, reason: str, now: float) -> None:
        if rec.job_id is None:
            rec.job_id = self.backend.job_id(rec.handle)
        if state is JobState.RUNNING and rec.started is None:
            rec.started = now
        if not state.live:
            rec.ended = now
            if rec.withdrawn and state is JobState.ENDED and rec.joined is None:
                reason = f"cancelled while queued: {rec.withdrawn}"
        if state != rec.state or reason != rec.reason:
            if state is JobState.RUNNING and rec.joined is not None:
                return   # it joined before the backend saw it run: "worker joined" says more
            rec.note(now, state, reason)

    def decide(self, now: float) -> None:
        """One pool decision: launch what the policy asks for (as the throttle allows), withdraw, drain."""
        self._last_decision = now
        backend = self.backend
        view = PoolView(
            now=now, pending=self.ledger.policy.pending_actions(),
            workers=[WorkerStatus(info=w.info, busy_cores=w.busy_cores, running=len(w.running),
                                  idle_since=w.idle_since, envs=len(w.envs),
                                  draining=w.state is WorkerState.DRAINING,
                                  started_at=w.registered_at,
                                  ends_at=backend.time_limit(w.info.handle) if w.info.handle else None,
                                  shape=w.launched_shape, launched_at=w.launched_at)
                     for w in self.ledger.workers],
            starting=list(self.starting.values()),
            failures=self.failures[-50:], cluster=backend.capacity(),
            step=self.ledger.policy.current_step, offered_load=self.ledger.policy.offered_load(now))
        for d in self.pool.decide(view):
            if isinstance(d, Launch):
                self._launch(d, now, view)
            elif isinstance(d, Withdraw):
                self._withdraw(d, now)
            elif isinstance(d, Reclaim):
                w = self.ledger.workers.get(d.worker_id)
                if w is not None and w.state is not WorkerState.DRAINING:
                    log.info("draining worker %s%s: %s", d.worker_id, self._job_of(w.info.handle), d.reason)
                    self.decisions.append((now, "drain", f"{d.worker_id}{self._job_of(w.info.handle)}: {d.reason}"))
                self.ledger.drain(d.worker_id, d.reason, now)
        self._log_throttle(now)

    def _launch(self, d: Launch, now: float, view: PoolView) -> None:
        n = min(d.count, self.throttle.allowed(now))
        if n <= 0:
            self.throttle.launched(now, 0, wanted=d.count)
            return
        args = self.service_worker_args if d.shape.gpus or d.shape.gpu_mem_mb else self.cpu_worker_args
        spec = WorkerLaunchSpec(connection_file=self.connection_file, shape=d.shape, extra_args=args)
        why = (f"{d.reason + ': ' if d.reason else ''}{len(view.pending)} actions waiting, {len(view.workers)} "
               f"workers, {len(view.starting)} starting"
               + (f"; {d.count - n} more held back by the launch throttle" if n < d.count else ""))
        try:
            handles = self.backend.launch(spec, n)
        except Exception as e:
            self.throttle.launched(now, 1, wanted=d.count)
            self._launch_failed(now, f"launch failed: {e}")
            return
        self.throttle.launched(now, len(handles), wanted=d.count)
        for h in handles:
            self.starting[h] = (d.shape, now)
            self._record(Allocation(h, d.shape, now, job_id=self.backend.job_id(h)))
        jobs = [self.backend.job_id(h) or h for h in handles]
        log.info("launched %d worker(s) of %d cores%s%s (%s): %s", len(handles), d.shape.cores,
                 f", {d.shape.gpus} GPUs" if d.shape.gpus else "",
                 f" on partition {d.shape.partition}" if d.shape.partition else "", ", ".join(jobs), why)
        if handles:
            self.ledger.counters.launches += len(handles)
            self.decisions.append((now, "launch",
                                   f"{len(handles)} x {_shape_text(d.shape)} ({', '.join(jobs)}): {why}"))

    def _withdraw(self, d: Withdraw, now: float) -> None:
        """Cancel up to ``d.count`` launched jobs of ``d.shape`` still waiting in the batch queue, newest first."""
        queued = [h for h, (shape, _) in self.starting.items()
                  if shape == d.shape and (rec := self.allocations.get(h)) is not None and rec.state == JobState.PENDING]
        queued.sort(key=lambda h: -self.starting[h][1])
        for h in queued[:d.count]:
            del self.starting[h]
            rec = self.allocations[h]
            rec.withdrawn = d.reason
            rec.note(now, JobState.PENDING, f"cancelling while queued: {d.reason}")
            log.info("cancelling queued worker job %s%s: %s", h, self._job_of(h), d.reason)
            self.decisions.append((now, "withdraw", f"{h}{self._job_of(h)} still queued: {d.reason}"))
            try:
                self.backend.reclaim(h)
            except Exception as e:
                log.warning("cancelling %s failed: %s", h, e)

    def cancel_starting(self, now: float) -> None:
        """The coordinator stops: cancel the worker jobs that have not registered yet (queued or
        still starting; they hold no environment), before it waits for the registered ones to
        leave.  Otherwise one that starts during that wait outlives it should the batch system
        kill the coordinator's job before the backend's shutdown cancels the rest."""
        for h in list(self.starting):
            del self.starting[h]
            rec = self.allocations.get(h)
            if rec is not None:
                rec.note(now, rec.state, "cancelled before it joined: the coordinator stops")
            try:
                self.backend.reclaim(h)
            except Exception as e:
                log.warning("cancelling %s failed: %s", h, e)

    def _launch_failed(self, now: float, why: str) -> None:
        self.ledger.counters.launch_failures += 1
        self.failures.append((now, why))
        self.decisions.append((now, "launch failed", why))
        if len(self.failures) > 100:  # a crash-looping backend must not grow this forever
            del self.failures[:-50]
        self.throttle.failed(now, why)
        log.warning("worker start failed: %s", why)

    def _check_starts(self, now: float) -> None:
        """Joined workers that stayed count as good starts; jobs running long without joining are reported."""
        healthy_after = self.throttle.settings.healthy_after_s
        for handle, rec in list(self._unproven.items()):
            if now - rec.joined >= healthy_after:
                rec.healthy = True
                del self._unproven[handle]
                self.throttle.succeeded(now)
        for handle in self.starting:
            rec = self.allocations.get(handle)
            if (rec is not None and not rec.warned and rec.started is not None
                    and now - rec.started >= NOT_JOINED_WARN_S):
                rec.warned = True
                log.warning("worker job %s%s has run %.0f s without its worker joining: can its node reach the "
                            "address in %s? (see the job's output)", handle, self._job_of(handle),
                            now - rec.started, self.connection_file)

    def _log_throttle(self, now: float) -> None:
        st = self.throttle.status(now)
        key = (st.state, st.reason)
        if key != self._throttle_logged and st.state is not ThrottleState.RATE_LIMITED:
            self._throttle_logged = key
            when = f"; retry at {local_time(st.retry_at)}" if st.retry_at and st.retry_at > now else ""
            (log.info if st.state is ThrottleState.OK else log.warning)("launches %s%s%s", st.state,
                                                                          f": {st.reason}" if st.reason else "", when)

    def _record(self, rec: Allocation) -> None:
        self.allocations[rec.handle] = rec
        if len(self.allocations) > HISTORY:
            for h in [h for h, r in self.allocations.items() if r.ended is not None][:len(self.allocations) - HISTORY]:
                del self.allocations[h]

    def _job_of(self, handle: str | None) -> str:
        job = self.backend.job_id(handle) if handle else None
        return f" (job {job})" if job else ""

    def finish_drains(self, now: float) -> None:
        """Stop drained workers with nothing left running; cancel their jobs after the grace period."""
        for w in self.ledger.workers:
            if w.state is WorkerState.DRAINING and not w.running and not self.ledger.holds_moving_envs(w.info.id):
                # STOP first: the worker snapshots its environments and exits by itself (taking any
                # zombie attempt with it); the job is cancelled only if it is still there after the grace.
                self.ledger.outbox.to_workers.append(
                    (w.ident, P.STOP, {"reason": w.drain_reason or "reclaimed", "reregister": False}))
                self.ledger.retire_worker(w.info.id, now)
                log.info("stopping drained worker %s%s (%s)", w.info.id, self._job_of(w.info.handle),
                         w.drain_reason or "reclaimed")
                self.ledger.counters.reclaims += 1
                self.decisions.append((now, "reclaim", f"{w.info.id}{self._job_of(w.info.handle)}: "
                                                       f"{w.drain_reason or 'reclaimed'}"))
                if w.info.handle:
                    self._reclaim_at[w.info.handle] = now + self.config.drain_grace_s
        for handle, at in list(self._reclaim_at.items()):
            if now >= at:
                del self._reclaim_at[handle]
                log.info("cancelling worker job %s%s: still there %.0f s after it was told to stop", handle,
                         self._job_of(handle), self.config.drain_grace_s)
                try:
                    self.backend.reclaim(handle)
                except Exception as e:
                    log.warning("reclaiming %s failed: %s", handle, e)

    # -- introspection -------------------------------------------------------------
    def status(self, now: float, allocations: bool = False) -> dict:
        st = self.throttle.status(now)
        counts: dict[str, int] = {}
        for rec in self.allocations.values():
            counts[rec.state] = counts.get(rec.state, 0) + 1
        out = {"launch_failures": self.ledger.counters.launch_failures,
               "recent_launch_failures": [why for _, why in self.failures[-5:]],
               "starting_workers": len(self.starting), "pool": self._explain(st),
               "launch": {"state": st.state, "reason": st.reason,
                          "retry_at": local_time(st.retry_at) if st.retry_at is not None else None,
                          "retry_in_s": round(max(0.0, st.retry_at - now), 1) if st.retry_at is not None else None},
               "allocation_states": counts,
               "pool_decisions": [list(d) for d in list(self.decisions)[-20:]]}
        if allocations:
            out["allocations"] = [rec.to_status() for rec in self.allocations.values()]
        return out

    def _explain(self, launch: ThrottleStatus) -> str:
        """The pool's own account, and whether launches are held back (it read 'ok' while paused)."""
        text = self.pool.explain()
        if launch.state != ThrottleState.OK:
            text += f"; launches {launch.state}"
        return text

    def describe_workers(self, workers: list[dict], now: float) -> None:
        """Add each worker's job id and time left (from the backend) to its ``status`` entry."""
        for w in workers:
            handle = w.get("handle")
            ends = self.backend.time_limit(handle) if handle else None
            w["job_id"] = self.backend.job_id(handle) if handle else None
            w["time_left_s"] = round(ends - now, 1) if ends is not None else None

    def control(self, op: str, now: float) -> str:
        """An operator's command (``pause`` or ``resume`` launches); returns what was done."""
        if op == "resume":
            self.throttle.resume(now)
            log.info("launches resumed by an operator")
            return "launches resumed"
        if op == "pause":
            self.throttle.pause(now, "paused by an operator ('tangram-hpc pool pause')")
            log.warning("launches paused by an operator")
            return "launches paused"
        raise ValueError(f"unknown pool operation {op!r}: pause or resume")


def _shape_text(s: WorkerShape) -> str:
    parts = [f"{s.cores} cores"]
    if s.mem_mb:
        parts.append(f"{s.mem_mb} MiB")
    if s.gpus:
        parts.append(f"{s.gpus} GPU")
    elif s.gpu_mem_mb:
        parts.append(f"{s.gpu_mem_mb} MiB device")
    if s.partition:
        parts.append(f"partition {s.partition}")
    return ", ".join(parts)
