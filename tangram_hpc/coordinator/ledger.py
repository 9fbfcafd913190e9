"""The action ledger: every live action, and the rules that give each exactly one final result.

Socket-free and clock-free (``now`` is passed in): the ZMQ loop calls one
method per decoded event, and the ledger writes what must be sent into its
:class:`~.outbox.Outbox`.  It is the only caller of the scheduling policy's
event methods, so the policy's view of cores and the ledger's never differ.

The rules:

* every live action has one record with its current attempt number and the
  worker running it; a DONE counts only if it names that attempt on that
  worker, anything else is *stale* and dropped;
* a lost worker's running actions go back to the policy as a new attempt
  until ``max_attempts``, then fail with the reasons;
* a running action that times out or is cancelled is finalised for its
  client at once and sent a KILL, but it stays a *zombie* holding its cores
  (in the policy too) until its worker reports that attempt ended or is
  lost: a Python function cannot be interrupted, and giving its cores away
  would queue new actions behind it on the worker;
* finished results stay in a bounded cache so a resubmission (a reconnected
  client, a repeated idempotency key) gets the first answer again.
"""
from __future__ import annotations

import heapq
import logging
from typing import Any

from .. import protocol as P
from ..config import CoordinatorSettings
from ..actions import ActionSpec, Status, ValidationError
from ..policy.base import SchedulingPolicy
from ..resources import WorkerInfo
from .outbox import Counters, Outbox
from .registry import WorkerRecord, WorkerRegistry, WorkerState


log = logging.getLogger("tangram.coordinator")


class _Action:
    __slots__ = ("spec", "wire", "client", "submitted", "attempt", "worker", "cores", "failures", "waiters")

    def __init__(self, spec: ActionSpec, wire: dict, client: bytes, now: float):
        self.spec = spec
        self.wire = wire
        self.client = client
        self.submitted = now
        self.attempt = 0
        self.worker: str | None = None
        self.cores = 0
        self.failures: list[str] = []
        self.waiters: list[tuple[bytes, str]] | None = None  # (client, action id) sharing an idempotency key


class RecentMap:
    """A bounded map of recent entries in two generations of plain dicts.

    Lookups see both; once the young one holds half the capacity it becomes the old one and
    the old one is dropped whole.  Dropping whole dicts, rather than evicting entry by entry
    from one ordered map, keeps the coordinator's memory flat over millions of actions.
    """

    __slots__ = ("half", "young", "old")

    def __init__(self, capacity: int):
        self.half = max(1, capacity // 2)
        self.young: dict = {}
        self.old: dict = {}

    def get(self, key):
        v = self.young.get(key)
        return v if v is not None else self.old.get(key)

    def put(self, key, value) -> None:
        self.young[key] = value
        if len(self.young) >= self.half:
            self.old, self.young = self.young, {}


class ActionLedger:
    """The live actions of one coordinator; ``action_log`` gets one record per final result
    (a :class:`~tangram_hpc.runlog.RunLog`, or any list)."""

    def __init__(self, config: CoordinatorSettings, policy: SchedulingPolicy, workers: WorkerRegistry | None = None,
                 *, outbox: Outbox | None = None, action_log=None):
        self.config = config
        self.policy = policy
        self.workers = workers if workers is not None else WorkerRegistry()
        self.outbox = outbox if outbox is not None else Outbox()
        self.counters = Counters()
        self.action_log = action_log if action_log is not None else []
        self.dirty = False                 # something changed that may let the policy start actions
        self._actions: dict[str, _Action] = {}
        self._recent = RecentMap(config.result_cache)     # action id -> result wire
        self._idem = RecentMap(config.result_cache)       # idempotency key -> action id
        self._client_pending: dict[bytes, int] = {}
        self._deadlines: list[tuple[float, str, int]] = []
        self._zombies: dict[str, str] = {}                # zombie action id -> worker id

    # -- views -----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._actions)

    def __contains__(self, action_id: str) -> bool:
        return action_id in self._actions

    def attempt_of(self, action_id: str) -> tuple[int, str | None] | None:
        """(current attempt, worker running it) of a live action, or None."""
        a = self._actions.get(action_id)
        return None if a is None else (a.attempt, a.worker)

    def submitted_at(self, action_id: str) -> float | None:
        """When a live action was first submitted, or None."""
        a = self._actions.get(action_id)
        return None if a is None else a.submitted

    @property
    def zombie_cores(self) -> int:
        return sum(w.zombie_cores for w in self.workers.by_id.values())

    # -- clients -----------------------------------------------------------------
    def submit(self, client: bytes, wires: list, now: float) -> None:
        """A SUBMIT body: validate each spec alone, answer duplicates, admit the rest to the policy."""
        cfg = self.config
        policy = self.policy
        actions = self._actions
        zombies = self._zombies
        pending = self._client_pending.get(client, 0)
        for w in wires:
            try:
                spec = ActionSpec.from_wire(w)
            except ValidationError as e:
                aid = w.get("i") if isinstance(w, dict) else None
                self._reject(client, aid if isinstance(aid, str) and len(aid) <= 128 else None, str(e), now)
                continue
            aid = spec.id
            live = actions.get(aid)
            if live is not None:
                live.client = client  # a resubmission from a reconnected client: answer it there
                continue
            done = self._recent.get(aid)
            if done is not None:
                self.outbox.results.setdefault(client, []).append(done)
                continue
            if zombies and aid in zombies:
                self._reject(client, aid, "an attempt of this action id is still ending on its worker", now)
                continue
            key = spec.idempotency_key
            if key is not None and self._join_idempotent(client, spec, key):
                continue
            if pending >= cfg.max_pending_per_client or len(actions) >= cfg.max_pending_total:
                which = ("this client" if pending >= cfg.max_pending_per_client else "the coordinator")
                limit = cfg.max_pending_per_client if which == "this client" else cfg.max_pending_total
                self._reject(client, aid, f"too many unfinished actions for {which} (limit {limit}); "
                                          "wait for results before submitting more", now)
                continue
            pending += 1
            actions[aid] = _Action(spec, w, client, now)
            self.counters.submitted += 1
            policy.submit(spec, now)
        if pending:
            self._client_pending[client] = pending
        self.dirty = True

    def _join_idempotent(self, client: bytes, spec: ActionSpec, key: str) -> bool:
        """True when ``spec`` is answered by an earlier action with the same key."""
        first = self._idem.get(key)
        if first is None:
            self._idem.put(key, spec.id)
            return False
        live = self._actions.get(first)
        if live is not None:
            if live.waiters is None:
                live.waiters = []
            live.waiters.append((client, spec.id))
            return True
        done = self._recent.get(first)
        if done is None:
            self._idem.put(key, spec.id)  # original forgotten: run again
            return False
        copy = list(done)
        copy[0] = spec.id
        self.outbox.results.setdefault(client, []).append(copy)
        return True

    def _reject(self, client: bytes, aid: str | None, why: str, now: float) -> None:
        self.counters.rejected += 1
        if aid is None:
            self.outbox.to_clients.append((client, P.ERROR, {"code": "invalid_action", "message": why[:500]}))
            return
        self.outbox.results.setdefault(client, []).append(
            [aid, Status.ERROR, None, f"rejected: {why}", now, 0.0, now, None, 0, 0])

    def cancel(self, ids: list, now: float) -> None:
        """Pending: cancelled at once.  Running: KILL sent and cancelled at once; its cores stay bound."""
        for aid in ids:
            if not isinstance(aid, str):
                continue
            a = self._actions.get(aid)
            if a is None:
                continue
            if self.policy.cancel(aid):
                self._finalize(a, Status.CANCELLED, None, "cancelled before it started", 0.0, now)
            elif a.worker is not None:
                self._kill(a, now)
                self._finalize(a, Status.CANCELLED, None,
                               f"cancelled while running on {a.worker} (attempt {a.attempt}); it was told to stop",
                               0.0, now)

    # -- workers -----------------------------------------------------------------
    def add_worker(self, info: WorkerInfo, ident: bytes, now: float) -> WorkerRecord:
        """A worker registered; one already registered under its id is lost first (its actions retried)."""
        if info.id in self.workers.by_id:
            self.lose_worker(info.id, now, f"worker {info.id} registered again")
        w = self.workers.add(info, ident, now)
        self.policy.add_worker(info, now)
        self.dirty = True
        return w

    def worker_report(self, worker_id: str, body: dict, now: float) -> None:
        """A worker's HEARTBEAT: services resident on its GPUs and environments it hosts."""
        w = self.workers.by_id.get(worker_id)
        if w is not None and self.workers.report(w, body, now):
            self.policy.update_worker(worker_id, services=w.services, envs=w.envs, now=now)
            self.dirty = True

    def drain(self, worker_id: str, reason: str, now: float) -> None:
        """Give a worker no new actions; the pool driver reclaims it once its running ones end."""
        w = self.workers.by_id.get(worker_id)
        if w is None or w.state is WorkerState.DRAINING:
            return
        self.workers.mark_draining(w, reason, now)
        self.policy.set_draining(worker_id, True)

    def retire_worker(self, worker_id: str, now: float) -> WorkerRecord | None:
        """A drained worker with nothing running leaves (zombies die with it)."""
        w = self.workers.remove(worker_id, now, "reclaimed")
        if w is not None:
            self._forget(w, now)
        return w

    def lose_worker(self, worker_id: str, now: float, reason: str) -> WorkerRecord | None:
        """A worker is gone: retry its running actions, or fail those out of attempts."""
        w = self.workers.remove(worker_id, now, "lost")
        if w is None:
            return None
        self.counters.workers_lost += 1
        lost = self._forget(w, now)
        log.warning("worker %s lost (%s); %d running actions to retry", worker_id, reason, len(w.running))
        max_attempts = self.config.max_attempts
        for aid in set(lost) | w.running:
            a = self._actions.get(aid)
            if a is None:
                continue  # a zombie, finalised already
            a.worker = None
            a.failures.append(f"attempt {a.attempt} on {worker_id}: {reason}")
            if a.attempt >= max_attempts:
                self._finalize(a, Status.ERROR, None,
                               f"gave up after {a.attempt} attempts: " + "; ".join(a.failures[-3:]), 0.0, now)
            else:
                self.counters.retried += 1
                self.policy.submit(a.spec, now)
        self.dirty = True
        return w

    def _forget(self, w: WorkerRecord, now: float) -> list[str]:
        for aid in w.zombies:
            self._zombies.pop(aid, None)
        w.zombies.clear()
        self.dirty = True
        return self.policy.remove_worker(w.info.id, now)

    # -- scheduling ----------------------------------------------------------------
    def dispatch(self, now: float) -> None:
        """Ask the policy for starts and queue one ASSIGN item per start."""
        self.dirty = False
        assignments = self.policy.schedule(now)
        if not assignments:
            return
        actions = self._actions
        workers = self.workers.by_id
        assign = self.outbox.assign
        grace = self.config.timeout_grace_s
        for asg in assignments:
            a = actions.get(asg.action_id)
            w = workers.get(asg.worker_id)
            if a is None or w is None:
                # The policy placed something the ledger no longer tracks: give its cores back.
                self.policy.finished(asg.action_id, now, ok=False)
                continue
            a.attempt += 1
            a.worker = w.info.id
            a.cores = asg.cores
            w.running.add(a.spec.id)
            w.busy_cores += asg.cores
            w.idle_since = None
            item = [a.wire, a.attempt, asg.cores]
            items = assign.get(a.worker)
            if items is None:
                assign[a.worker] = [item]
            else:
                items.append(item)
            if a.spec.timeout is not None:
                heapq.heappush(self._deadlines, (now + a.spec.timeout + grace, a.spec.id, a.attempt))

    def done(self, worker_id: str, items: list, now: float) -> int:
        """A worker's DONE batch; returns how many items were malformed (each is skipped alone)."""
        w = self.workers.by_id.get(worker_id)
        if w is None:
            # Late outcomes of a worker declared lost: their actions were retried elsewhere.
            self.counters.stale_results += len(items)
            return 0
        policy = self.policy
        actions = self._actions
        bad = 0
        for item in items:
            try:
                aid, attempt, status, output, error, started, finished = P.check_done(item)
            except ValidationError:
                bad += 1  # one broken item must not strand the rest of the batch
                continue
            a = actions.get(aid)
            if a is None or a.attempt != attempt or a.worker != worker_id:
                self.counters.stale_results += 1
                z = w.zombies.get(aid)
                if z is not None and z[0] == attempt:
                    self._bury(w, aid, now)
                continue
            if status not in Status.FINAL:
                status, error = Status.ERROR, f"worker reported unknown status {status!r}"
            policy.finished(aid, now, ok=status == Status.OK, run_time=max(0.0, finished - started))
            w.running.discard(aid)
            w.busy_cores -= a.cores
            if not w.running:
                w.idle_since = now
            self._finalize(a, status, output, error, started, finished)
        self.dirty = True
        return bad

    def expire(self, now: float) -> None:
        """Time out running actions past ``timeout + timeout_grace_s``."""
        dl = self._deadlines
        grace = self.config.timeout_grace_s
        while dl and dl[0][0] <= now:
            _, aid, attempt = heapq.heappop(dl)
            a = self._actions.get(aid)
            if a is None or a.attempt != attempt or a.worker is None:
                continue
            self._kill(a, now)
            self._finalize(a, Status.TIMEOUT, None,
                           f"no result {a.spec.timeout:g}s (+{grace:g}s grace) after it started", 0.0, now)

    def fail_unplaceable(self, now: float) -> None:
        """Fail pending actions no worker shape could ever run, with the policy's reason."""
        for aid, why in self.policy.unplaceable(now):
            a = self._actions.get(aid)
            if a is not None and self.policy.cancel(aid):
                self._finalize(a, Status.ERROR, None, f"cannot be placed: {why}", 0.0, now)

    def _kill(self, a: _Action, now: float) -> None:
        """Send KILL for a running attempt and keep it as a zombie holding its cores."""
        wid = a.worker
        self.outbox.kill.setdefault(wid, []).append([a.spec.id, a.attempt])
        w = self.workers.by_id.get(wid)
        if w is None:
            self.policy.finished(a.spec.id, now, ok=False)
            return
        w.running.discard(a.spec.id)
        w.zombies[a.spec.id] = (a.attempt, a.cores)
        self._zombies[a.spec.id] = wid
        if not w.running:
            w.idle_since = now

    def _bury(self, w: WorkerRecord, aid: str, now: float) -> None:
        """The worker reported a zombie's attempt ended: its cores are free now."""
        _, cores = w.zombies.pop(aid)
        self._zombies.pop(aid, None)
        w.busy_cores -= cores
        self.policy.finished(aid, now, ok=False)

    def _finalize(self, a: _Action, status: str, output: Any, error: str | None,
                  started: float, finished: float) -> None:
        spec = a.spec
        aid = spec.id
        del self._actions[aid]
        n = self._client_pending.get(a.client, 1) - 1
        if n > 0:
            self._client_pending[a.client] = n
        else:
            self._client_pending.pop(a.client, None)
        res = [aid, status, output, error, a.submitted, started, finished, a.worker, a.cores, a.attempt]
        results = self.outbox.results
        mine = results.get(a.client)
        if mine is None:
            results[a.client] = [res]
        else:
            mine.append(res)
        self._recent.put(aid, res)
        if a.waiters:
            for ident, other in a.waiters:
                copy = list(res)
                copy[0] = other
                results.setdefault(ident, []).append(copy)
        c = self.counters
        if status == Status.OK:
            c.completed += 1
        else:
            c.failed += 1
        bs = c.by_status
        bs[status] = bs.get(status, 0) + 1
        self.action_log.append([aid, spec.kind, spec.action_class, a.worker, a.cores, a.submitted, started,
                                finished, status, a.attempt, spec.trajectory])
