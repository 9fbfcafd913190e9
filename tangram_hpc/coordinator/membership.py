"""The ledger's worker membership: a worker registers, reports, drains, leaves or is lost.

Socket-free and clock-free, like the :class:`~.ledger.ActionLedger` that owns it and hands it
its parts: the live actions (``actions``, read; their attempts reset when their worker is
lost), the zombie attempts by action id (``zombies``), and ``finalize(action, status, output,
error, started, finished)``, which gives an action its one final result.  The ledger's methods
of the same names call these.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from ..actions import Status
from ..policy.base import SchedulingPolicy
from ..resources import WorkerInfo
from .lifecycle import EnvironmentLifecycle, env_of
from .outbox import Counters
from .registry import WorkerRecord, WorkerRegistry, WorkerState

if TYPE_CHECKING:     # the settings object is handed in; config itself stays out of the core's imports
    from ..config import CoordinatorSettings

log = logging.getLogger("tangram.coordinator")


class WorkerMembership:
    """Workers coming and going, and what that does to the actions they ran."""

    def __init__(self, config: CoordinatorSettings, policy: SchedulingPolicy, workers: WorkerRegistry, envlife: EnvironmentLifecycle,
                 counters: Counters, actions: dict, zombies: dict[str, str], finalize: Callable):
        self.config = config
        self.policy = policy
        self.workers = workers
        self.envlife = envlife
        self.counters = counters
        self._actions = actions
        self._zombies = zombies
        self._finalize = finalize
        self.dirty = False                 # something changed that may let the policy start actions

    def add_worker(self, info: WorkerInfo, ident: bytes, now: float) -> WorkerRecord:
        """A worker registered; one already registered under its id is lost first (its actions retried).

        The environments it reports having (``info.extra["envs"]``) are kept where they are the
        copy it was last granted, and dropped otherwise (ENV keep / drop items for it).
        """
        if info.id in self.workers.by_id:
            self.lose_worker(info.id, now, f"worker {info.id} registered again")
        reported = info.extra.pop("envs", None) or []
        w = self.workers.add(info, ident, now)
        self.policy.add_worker(info, now)
        self.envlife.worker_registered(info.id, info.extra.get("env_root"), info.handle, reported, now)
        self.dirty = True
        return w

    def worker_report(self, worker_id: str, body: dict, now: float) -> None:
        """A worker's HEARTBEAT: services resident on its GPUs and environments it hosts.

        Where environments are is the directory's to say (a worker's list may hold a copy that
        was fenced off), so only the services reach the policy.
        """
        w = self.workers.by_id.get(worker_id)
        if w is None:
            return
        loads_before = {name: c[0] for name, c in w.service_counts.items()}
        changed = self.workers.report(w, body, now)
        if changed or "services" in body:
            # every report of a service worker, changed or not: a load the policy counted on that is
            # due and not reported is not there (a prefetch's victim, a load that failed)
            self.policy.update_worker(worker_id, services=w.services, now=now)
        if changed:
            self.dirty = True
        predictor = getattr(self.policy, "predictor", None)
        for name, (load_s, _evict_s) in w.service_costs.items():
            # A load the worker measured itself (no queueing in it) teaches the policy's load time.
            if predictor is not None and w.service_counts.get(name, (0,))[0] > loads_before.get(name, 0):
                predictor.observe_load(name, load_s)

    def drain(self, worker_id: str, reason: str, now: float) -> None:
        """Give a worker no new actions and move its environments off; the pool driver reclaims it once
        its running actions have ended and its environments are saved."""
        w = self.workers.by_id.get(worker_id)
        if w is None or w.state is WorkerState.DRAINING:
            return
        self.workers.mark_draining(w, reason, now)
        self.policy.set_draining(worker_id, True)
        self.envlife.move_off(worker_id, ask=True)

    def worker_leaving(self, worker_id: str, reason: str, now: float) -> None:
        """The worker said it is leaving (SIGTERM, time limit): it finishes what it can, saves its
        environments and says when it has left.  Meanwhile it gets nothing new."""
        w = self.workers.by_id.get(worker_id)
        if w is None or w.leaving:
            return
        w.leaving = reason
        if w.state is not WorkerState.DRAINING:
            self.workers.mark_draining(w, f"leaving: {reason}", now)
            self.policy.set_draining(worker_id, True)
        self.envlife.move_off(worker_id, ask=False)

    def holds_moving_envs(self, worker_id: str) -> bool:
        """Whether environments are still being saved off ``worker_id`` (a drained worker waits for that)."""
        return self.envlife.moving_from(worker_id)

    def worker_left(self, worker_id: str, now: float, reason: str, *, stopped: bool = False) -> None:
        """The worker's last word: it has left.  What it still ran (attempts it interrupted) is retried.

        ``stopped``: it left because the coordinator is stopping and told it to: no fault.
        """
        self.lose_worker(worker_id, now, f"worker {worker_id} left ({reason})", dead=True,
                         event="stopped" if stopped else "lost")

    def retire_worker(self, worker_id: str, now: float) -> WorkerRecord | None:
        """A drained worker with nothing running leaves (zombies die with it)."""
        w = self.workers.remove(worker_id, now, "reclaimed")
        if w is not None:
            self._forget(w, now)
            self.envlife.worker_retired(worker_id, now)
        return w

    def lose_worker(self, worker_id: str, now: float, reason: str, *, dead: bool = False,
                    event: str = "lost") -> WorkerRecord | None:
        """A worker is gone: retry its running actions, or fail those out of attempts.

        ``dead``: it is known to have exited (its job or process ended, its connection closed), so
        the environments it held are adopted from its directory at once; otherwise (silence) they
        are awaited: it may come back with them (:class:`~.environments.EnvironmentDirectory`).
        ``event``: ``stopped`` for a worker that left as the stopping coordinator told it to (not
        counted or logged as a loss).
        """
        w = self.workers.remove(worker_id, now, event)
        if w is None:
            if dead:
                self.envlife.worker_dead(worker_id, now)   # lost earlier (silent): adopt what it held
            return None
        lost = self._forget(w, now)
        if event == "lost":
            self.counters.workers_lost += 1
            log.warning("worker %s lost (%s); %d running actions to retry", worker_id, reason, len(w.running))
        else:
            log.info("worker %s %s (%s); %d actions it ran are left to their clients' resubmission",
                     worker_id, event, reason, len(w.running))
        affected = self.envlife.worker_lost(worker_id, dead=dead, now=now)
        max_attempts = self.config.max_attempts
        for aid in set(lost) | w.running:
            a = self._actions.get(aid)
            if a is None:
                continue  # a zombie, finalised already
            a.worker = None
            a.in_env = False
            env = env_of(a.spec)
            if not dead and env in affected:
                a.away = a.attempt      # its environment waits for that worker, where it may still run
            a.attempt_failed(f"attempt {a.attempt} on {worker_id}: {reason}")
            if a.attempt >= max_attempts:
                if a.away == a.attempt:
                    self.envlife.kill_when_back(a)     # given up on, but it may still run on the silent worker
                self._finalize(a, Status.ERROR, None,
                               f"gave up after {a.attempt} attempts: " + "; ".join(a.last_failures(3)), 0.0, now)
            else:
                self.counters.retried += 1
                if env is None:
                    self.policy.submit(a.spec, now)
                else:
                    self.envlife.resubmit(a, env, now)
        self.envlife.changed(affected, now)
        self.dirty = True
        return w

    def job_ended(self, handle: str, now: float) -> None:
        """The backend saw the job ``handle`` end; if its worker was lost earlier, it is dead now."""
        self.envlife.job_ended(handle, now)

    def _forget(self, w: WorkerRecord, now: float) -> list[str]:
        for aid, z in w.zombies.items():
            self._zombies.pop(aid, None)
        w.zombies.clear()
        self.dirty = True
        return self.policy.remove_worker(w.info.id, now)
