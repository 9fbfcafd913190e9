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
  client, a repeated idempotency key) gets the first answer again;
* an action with an environment runs only where the
  :class:`~.environments.EnvironmentDirectory` says the one live copy is: while the
  environment is moving or its worker is awaited, its actions are held back from
  the policy; each ASSIGN carries the environment's grant (its generation, and
  where to restore or adopt it from); a lost environment fails its actions with
  ``env_lost``;
* outcomes a worker kept from before it registered again (OUTCOMES) answer the
  actions still waiting for them instead of running them again.
"""
from __future__ import annotations

import heapq
import logging
from typing import Any

from .. import protocol as P
from ..config import CoordinatorSettings
from ..actions import ID_MAX, ActionSpec, EnvState, Status, ValidationError
from ..policy.base import SchedulingPolicy
from ..resources import WorkerInfo
from .environments import USABLE, EnvironmentDirectory, EnvStatus
from .outbox import Counters, Outbox
from .registry import WorkerRecord, WorkerRegistry, WorkerState


log = logging.getLogger("tangram.coordinator")


def _age(wire: dict) -> float:
    """Seconds since the client first submitted an action it submits again (to a restarted coordinator),
    so that its ACT counts from then; 0 for a first submission or an age that is no age."""
    age = wire.get("a")
    if age is None or type(age) not in (int, float) or not 0.0 <= age <= _MAX_AGE_S:
        return 0.0
    return float(age)


#: A resubmission older than this is taken as new (a week: no action waits that long for a coordinator).
_MAX_AGE_S = 7 * 86400.0


def _env_of(spec: ActionSpec) -> str | None:
    """The stateful environment an action runs in: a sandbox action's ``env`` (for other kinds it is
    only a placement hint to the policy)."""
    return spec.env if spec.kind == "sandbox" else None


class _Action:
    __slots__ = ("spec", "wire", "client", "submitted", "attempt", "worker", "cores", "failures", "waiters",
                 "held", "in_env", "misplaced", "assigned", "prepare", "away")

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
        self.held = False       # kept from the policy until its environment can be used
        self.in_env = False     # its running attempt is counted in its environment's record
        self.misplaced = 0      # times the policy started it away from its environment
        self.assigned = 0.0     # when its current attempt was assigned (actions with an environment)
        self.prepare = 0.0      # seconds its current attempt may take to create or restore its environment
        self.away = 0           # its attempt that may still run on a worker gone silent (0: none)


class RecentMap:
    """A bounded map of recent entries in two generations of plain dicts.

    Lookups see both; once the young one holds half the capacity it becomes the old one and
    the old one is dropped whole.  Dropping whole dicts, rather than evicting entry by entry
    from one ordered map, keeps the coordinator's memory flat over millions of actions.
    """

    __slots__ = ("half", "half_bytes", "young", "old", "young_bytes")

    def __init__(self, capacity: int, max_bytes: int | None = None):
        self.half = max(1, capacity // 2)
        # what the values weigh (large outputs), when the caller says: a generation is full at
        # half the entries or half the bytes
        self.half_bytes = max(1, max_bytes // 2) if max_bytes else float("inf")
        self.young: dict = {}
        self.old: dict = {}
        self.young_bytes = 0

    def get(self, key):
        v = self.young.get(key)
        return v if v is not None else self.old.get(key)

    def put(self, key, value, nbytes: int = 0) -> None:
        self.young[key] = value
        if nbytes:
            self.young_bytes += nbytes
        if len(self.young) >= self.half or self.young_bytes >= self.half_bytes:
            self.old, self.young = self.young, {}
            self.young_bytes = 0

    def pop(self, key) -> None:
        self.young.pop(key, None)
        self.old.pop(key, None)

    def __bool__(self) -> bool:
        return bool(self.young or self.old)


class ActionLedger:
    """The live actions of one coordinator; ``action_log`` gets one record per final result
    (a :class:`~tangram_hpc.runlog.RunLog`, or any list)."""

    def __init__(self, config: CoordinatorSettings, policy: SchedulingPolicy, workers: WorkerRegistry | None = None,
                 *, outbox: Outbox | None = None, action_log=None, envs: EnvironmentDirectory | None = None,
                 prior_attempts: dict[str, int] | None = None):
        self.config = config
        self.policy = policy
        self.workers = workers if workers is not None else WorkerRegistry()
        self.outbox = outbox if outbox is not None else Outbox()
        self.counters = Counters()
        self.action_log = action_log if action_log is not None else []
        self.dirty = False                 # something changed that may let the policy start actions
        self._actions: dict[str, _Action] = {}
        self._recent = RecentMap(config.result_cache, config.result_cache_mb << 20)   # action id -> result wire
        self._idem = RecentMap(config.result_cache)       # idempotency key -> action id
        self._client_pending: dict[bytes, int] = {}
        self._deadlines: list[tuple[float, str, int]] = []
        self._zombies: dict[str, str] = {}                # zombie action id -> worker id
        self.envs = envs if envs is not None else EnvironmentDirectory(config.env_wait_s)
        self._env_live: dict[str, list[_Action]] = {}     # environment -> its live actions, oldest first
        self._env_closing: dict[str, set[str]] = {}       # environment -> live actions it closes after
        self._moving_since: dict[str, float] = {}         # environment the policy moves -> when it asked
        self._unmovable: set[str] = set()                 # environments whose holder could not save them
        self.restore_s: float | None = None               # seconds a restore takes (moving average), once seen
        self._orphans = RecentMap(min(config.result_cache, 100_000))  # action id -> outcome of an earlier registration
        #: attempts started under a previous coordinator (from its state file), by action id
        self._prior_attempts = dict(prior_attempts or {})
        #: environment -> [[action id, attempt], ...]: attempts finalised while their worker was away
        #: (cancelled, timed out) that may still run there; killed when it comes back with the environment
        self._kill_on_return: dict[str, list[list]] = {}
        #: [action id, attempts started] for actions with an environment; [id, 0] once final (the state file)
        self.attempt_log: list[list] = []

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
    def live_env_attempts(self) -> dict[str, int]:
        """Attempts started of the live actions that have an environment (the state file keeps them)."""
        return {a.spec.id: a.attempt for live in self._env_live.values() for a in live if a.attempt}

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
                self._reject(client, aid if isinstance(aid, str) and len(aid) <= ID_MAX else None, str(e), now)
                continue
            aid = spec.id
            live = actions.get(aid)
            if live is not None:
                # the same id from another identity (the client back under a new one, or a second
                # client using the id): answer it there too, and the first one still
                if client != live.client and (live.waiters is None or (client, aid) not in live.waiters):
                    if live.waiters is None:
                        live.waiters = []
                    live.waiters.append((client, aid))
                continue
            done = self._recent.get(aid)
            if done is not None:
                self.outbox.results.setdefault(client, []).append(done)
                continue
            if self._orphans:
                kept = self._orphans.get(aid)
                if kept is not None and self._answer_from_orphan(client, spec, kept, now):
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
            env = _env_of(spec)
            if env is not None:
                rec = self.envs.get(env)
                if rec is not None and rec.status is EnvStatus.LOST:
                    self._reject(client, aid, f"environment {env!r} is lost: {rec.why}; close it (close_env) "
                                              "to start it again empty", now, Status.ENV_LOST)
                    continue
            pending += 1
            a = actions[aid] = _Action(spec, w, client, now - _age(w) if "a" in w else now)
            self.counters.submitted += 1
            if env is None:
                policy.submit(spec, now)
            else:
                self._admit_env(a, env, now)
        if pending:
            self._client_pending[client] = pending
        self.dirty = True

    def _admit_env(self, a: _Action, env: str, now: float) -> None:
        live = self._env_live.get(env)
        if live is None:
            self._env_live[env] = [a]
        else:
            live.append(a)
        if self._prior_attempts:
            n = self._prior_attempts.pop(a.spec.id, 0)
            if n:
                a.attempt = a.away = n      # started under the previous coordinator: it may still run
                a.failures.append(f"attempt {n} started under the previous coordinator and did not report")
        rec = self.envs.get(env)
        if env in self._env_closing or (rec is not None and rec.status not in USABLE):
            a.held = True
        else:
            self.policy.submit(a.spec, now)

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

    def _reject(self, client: bytes, aid: str | None, why: str, now: float, status: str = Status.ERROR) -> None:
        self.counters.rejected += 1
        if aid is None:
            self.outbox.to_clients.append((client, P.ERROR, {"code": "invalid_action", "message": why[:500]}))
            return
        self.outbox.results.setdefault(client, []).append(
            [aid, status, None, f"rejected: {why}", now, 0.0, now, None, 0, 0, None])

    def _answer_from_orphan(self, client: bytes, spec: ActionSpec, kept: list, now: float) -> bool:
        """A resubmitted action whose attempt under an earlier registration of a worker did finish."""
        attempt, status, output, error, started, finished, env_state, worker = kept
        if _env_of(spec) is not None:
            rec = self.envs.get(spec.env)
            if rec is None or rec.holder != worker:
                return False   # the environment is not the copy it ran in: its journal decides
        res = [spec.id, status, output, error, now, started, finished, worker, 0, attempt, env_state]
        self.outbox.results.setdefault(client, []).append(res)
        self._recent.put(spec.id, res)
        self._orphans.pop(spec.id)
        self.counters.replayed += 1
        return True

    def cancel(self, ids: list, now: float) -> None:
        """Pending: cancelled at once.  Running: KILL sent and cancelled at once; its cores stay bound."""
        for aid in ids:
            if not isinstance(aid, str):
                continue
            a = self._actions.get(aid)
            if a is None:
                continue
            if a.held or self.policy.cancel(aid):
                if a.away and a.away == a.attempt and a.worker is None:
                    # an attempt under an earlier coordinator, or on a worker that went silent, may
                    # still run in the environment: it is stopped there
                    self._kill_when_back(a)
                    why = f"cancelled; attempt {a.attempt}, which may still run where its environment is, is stopped"
                else:
                    why = "cancelled before it started"
                a.held = False
                self._finalize(a, Status.CANCELLED, None, why, 0.0, now)
            elif a.worker is not None:
                self._kill(a, now)
                self._finalize(a, Status.CANCELLED, None,
                               f"cancelled while running on {a.worker} (attempt {a.attempt}); it was told to stop",
                               0.0, now)

    # -- workers -----------------------------------------------------------------
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
        keep, drop, regained, lost = self.envs.worker_registered(
            info.id, info.extra.get("env_root"), info.handle, reported, now)
        if keep or drop:
            self.outbox.env.setdefault(info.id, []).extend(keep + drop)
        if self._kill_on_return:    # (those of environments it came back without go in _env_changed)
            for env in regained:
                stale = self._kill_on_return.pop(env, None)
                if stale:
                    self.outbox.kill.setdefault(info.id, []).extend(stale)
        if regained:
            self.policy.update_worker(info.id, envs=self.envs.held_by(info.id), now=now)
        for env in regained + lost:
            self._env_changed(env, now)
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
        if self.workers.report(w, body, now):
            self.policy.update_worker(worker_id, services=w.services, now=now)
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
        self._move_envs_off(worker_id, ask=True, now=now)

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
        self._move_envs_off(worker_id, ask=False, now=now)

    def _move_envs_off(self, worker_id: str, *, ask: bool, now: float) -> None:
        moving, save_now = self.envs.worker_draining(worker_id, ask=ask)
        for env in moving:
            self._hold_back(env)
            self.policy.close_env(env)
        if save_now:
            self.outbox.env.setdefault(worker_id, []).extend([P.ENV_SAVE, env, gen] for env, gen in save_now)
        if moving:
            self.dirty = True

    def _move_envs(self, envs: list[str], now: float) -> None:
        """The policy wants these environments on another worker: their holders save them, their
        waiting actions wait for that and go to the policy again, unpinned, once they are saved."""
        for env in envs:
            if env in self._unmovable:
                continue
            move = self.envs.move(env)
            if move is None:
                if self.envs.get(env) is None and env not in self._env_live:
                    # not a sandbox's environment, only a hint to place actions together: there is
                    # nothing to save, so its waiting actions may simply go elsewhere
                    self.policy.close_env(env)
                    self.dirty = True
                continue
            holder, gen, ask_now = move
            self._hold_back(env)
            self.policy.close_env(env)
            self._moving_since[env] = now
            self.counters.env_moves += 1
            if ask_now:
                self.outbox.env.setdefault(holder, []).append([P.ENV_SAVE, env, gen])
            self.dirty = True

    def holds_moving_envs(self, worker_id: str) -> bool:
        """Whether environments are still being saved off ``worker_id`` (a drained worker waits for that)."""
        return self.envs.moving_from(worker_id)

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
            # Environments it could not save stay on its disk; they are adopted once it has exited.
            for env in self.envs.worker_lost(worker_id, dead=False, now=now):
                self._env_changed(env, now)
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
                self.worker_dead(worker_id, now)
            return None
        lost = self._forget(w, now)
        if event == "lost":
            self.counters.workers_lost += 1
            log.warning("worker %s lost (%s); %d running actions to retry", worker_id, reason, len(w.running))
        else:
            log.info("worker %s %s (%s); %d actions it ran are left to their clients' resubmission",
                     worker_id, event, reason, len(w.running))
        affected = self.envs.worker_lost(worker_id, dead=dead, now=now)
        for env in affected:
            self._hold_back(env)
        max_attempts = self.config.max_attempts
        for aid in set(lost) | w.running:
            a = self._actions.get(aid)
            if a is None:
                continue  # a zombie, finalised already
            a.worker = None
            a.in_env = False
            if not dead and _env_of(a.spec) in affected:
                a.away = a.attempt      # its environment waits for that worker, where it may still run
            a.failures.append(f"attempt {a.attempt} on {worker_id}: {reason}")
            if a.attempt >= max_attempts:
                if a.away == a.attempt:
                    self._kill_when_back(a)     # given up on, but it may still run on the silent worker
                self._finalize(a, Status.ERROR, None,
                               f"gave up after {a.attempt} attempts: " + "; ".join(a.failures[-3:]), 0.0, now)
            else:
                self.counters.retried += 1
                self._resubmit(a, now)
        for env in affected:
            self._env_changed(env, now)
        self.dirty = True
        return w

    def worker_dead(self, worker_id: str, now: float) -> None:
        """A worker lost earlier (silent) is now known to have exited: adopt what it held."""
        for env in self.envs.worker_dead(worker_id):
            self._env_changed(env, now)

    def job_ended(self, handle: str, now: float) -> None:
        """The backend saw the job ``handle`` end; if its worker was lost earlier, it is dead now."""
        wid = self.envs.worker_of_handle(handle)
        if wid is not None and wid not in self.workers.by_id:
            self.worker_dead(wid, now)

    def _forget(self, w: WorkerRecord, now: float) -> list[str]:
        for aid, z in w.zombies.items():
            self._zombies.pop(aid, None)
        w.zombies.clear()
        self.dirty = True
        return self.policy.remove_worker(w.info.id, now)

    # -- environments --------------------------------------------------------------
    def _resubmit(self, a: _Action, now: float) -> None:
        env = _env_of(a.spec)
        if env is not None:
            rec = self.envs.get(env)
            if env in self._env_closing and a.spec.id not in self._env_closing[env] or (
                    rec is not None and rec.status not in USABLE):
                a.held = True
                return
        self.policy.submit(a.spec, now)

    def _hold_back(self, env: str) -> None:
        """Take the environment's waiting actions back from the policy until it can be used again."""
        policy = self.policy
        for a in self._env_live.get(env, ()):
            if a.worker is None and not a.held and policy.cancel(a.spec.id):
                a.held = True

    def _env_changed(self, env: str, now: float) -> None:
        """The environment's status changed: release its held actions if it can be used, fail them if lost."""
        rec = self.envs.get(env)
        if rec is None or rec.status is not EnvStatus.MOVING:
            self._moving_since.pop(env, None)
        if self._kill_on_return and (rec is None or rec.status is not EnvStatus.AWAITED):
            self._kill_on_return.pop(env, None)    # no longer waiting for the copy those attempts run in
        live = self._env_live.get(env)
        if not live:
            return
        if rec is not None and rec.status is EnvStatus.LOST:
            why = f"environment {env!r} is lost: {rec.why}"
            for a in list(live):
                if a.worker is None and (a.held or self.policy.cancel(a.spec.id)):
                    a.held = False
                    self._finalize(a, Status.ENV_LOST, None, why, 0.0, now)
            return
        if rec is not None and rec.status not in USABLE:
            return
        if rec is not None and rec.status is not EnvStatus.LIVE:
            self.policy.close_env(env)   # no worker holds it: the next one to start an action there takes it
        closing = self._env_closing.get(env)
        for a in live:
            if a.held and (closing is None or a.spec.id in closing):
                a.held = False
                self.policy.submit(a.spec, now)
        self.dirty = True

    def env_report(self, worker_id: str, items: list, now: float) -> int:
        """A worker's ENV message (saved, unsaved, gone); returns how many items were malformed."""
        bad = 0
        for item in items:
            try:
                op, env, gen, detail = P.check_env_item(item)
            except ValidationError:
                bad += 1
                continue
            if op == P.ENV_SAVED:
                if detail and self.envs.saved(worker_id, env, gen, detail):
                    asked = self._moving_since.pop(env, None)
                    if asked is not None:
                        # a move costs the save and the restore; until a restore was seen, count
                        # it as long as the save
                        save = now - asked
                        self.policy.observe_env_move(save + (save if self.restore_s is None else self.restore_s))
                    self._env_changed(env, now)
            elif op == P.ENV_UNSAVED:
                if self._moving_since.pop(env, None) is not None:
                    self._unmovable.add(env)    # asking again would only fail again
                if self.envs.unsaved(worker_id, env, gen):
                    log.warning("worker %s could not save environment %s (%s); it stays there", worker_id, env,
                                detail)
                    self.policy.update_worker(worker_id, envs=self.envs.held_by(worker_id), now=now)
                    self._env_changed(env, now)
            elif op == P.ENV_GONE:
                if self.envs.gone(worker_id, env, gen):
                    self.policy.close_env(env)
                    self._env_changed(env, now)
        return bad

    def close_env(self, envs: list, now: float) -> None:
        """CLOSE_ENV: end each environment once the actions already submitted in it have finished."""
        for env in envs:
            if not isinstance(env, str):
                continue
            live = self._env_live.get(env)
            if live:
                self._env_closing[env] = {a.spec.id for a in live}
            else:
                self._close_env_now(env, now)

    def _close_env_now(self, env: str, now: float) -> None:
        self._env_closing.pop(env, None)
        self._unmovable.discard(env)
        dropped = self.envs.close(env)
        if dropped is not None:
            holder, item = dropped
            self.outbox.env.setdefault(holder, []).append(item)
            self.policy.update_worker(holder, envs=self.envs.held_by(holder), now=now)
        self.policy.close_env(env)
        self.counters.envs_closed += 1
        self._env_changed(env, now)   # actions submitted after close_env start it afresh

    def outcomes(self, worker_id: str, items: list, now: float) -> int:
        """OUTCOMES: attempts that ended under an earlier registration of the worker.  One whose action
        still waits (held back or pending, not running elsewhere) is its result; one of an action this
        coordinator does not know is kept for a resubmission.  Returns the malformed items."""
        bad = 0
        policy = self.policy
        for item in items:
            try:
                aid, attempt, status, output, error, started, finished, env_state = P.check_done(item)
            except ValidationError:
                bad += 1
                continue
            if status not in Status.FINAL:
                continue
            a = self._actions.get(aid)
            if a is None:
                if self._recent.get(aid) is None:
                    self._orphans.put(aid, [attempt, status, output, error, started, finished, env_state, worker_id])
                continue
            if a.worker is not None:
                continue   # a newer attempt runs: its result counts
            env = _env_of(a.spec)
            if env is not None:
                rec = self.envs.get(env)
                if rec is None or rec.holder != worker_id:
                    continue   # the environment's live copy is not the one it ran in
            if not (a.held or policy.cancel(aid)):
                continue
            a.held = False
            self.counters.replayed += 1
            a.worker = worker_id
            self._finalize(a, status, output, error, started, finished, env_state)
        self.dirty = True
        return bad

    # -- scheduling ----------------------------------------------------------------
    def dispatch(self, now: float) -> None:
        """Ask the policy for starts and queue one ASSIGN item per start."""
        self.dirty = False
        assignments = self.policy.schedule(now)
        if assignments:
            self._assign(assignments, now)
        moves = self.policy.env_moves()
        if moves:       # after the starts: one the policy made in an environment it moves runs first
            self._move_envs(moves, now)

    def _assign(self, assignments: list, now: float) -> None:
        actions = self._actions
        workers = self.workers.by_id
        assign = self.outbox.assign
        grace = self.config.timeout_grace_s
        prepare = self.config.env_prepare_s
        for asg in assignments:
            a = actions.get(asg.action_id)
            w = workers.get(asg.worker_id)
            if a is None or w is None:
                # The policy placed something the ledger no longer tracks: give its cores back.
                self.policy.finished(asg.action_id, now, ok=False)
                continue
            env = _env_of(a.spec)
            if env is None:
                a.attempt += 1
                item = [a.wire, a.attempt, asg.cores]
            else:
                grant = self.envs.grant(env, asg.worker_id)
                if grant is None:
                    self._misplaced(a, asg, now)
                    continue
                a.attempt += 1
                a.in_env = True
                a.assigned = now
                # the worker times the command from when its environment is there, not from the ASSIGN
                a.prepare = 0.0 if grant[1] == P.GRANT_HELD else prepare
                item = [a.wire, a.attempt, asg.cores, grant]
                self.attempt_log.append([a.spec.id, a.attempt])
            a.worker = w.info.id
            a.cores = asg.cores
            w.running.add(a.spec.id)
            w.busy_cores += asg.cores
            w.idle_since = None
            items = assign.get(a.worker)
            if items is None:
                assign[a.worker] = [item]
            else:
                items.append(item)
            if a.spec.timeout is not None:
                heapq.heappush(self._deadlines, (now + a.spec.timeout + grace + a.prepare, a.spec.id, a.attempt))

    def _misplaced(self, a: _Action, asg, now: float) -> None:
        """The policy started an action away from the worker its environment is on (it should not):
        give the cores back, pin the environment again and let the action wait its turn."""
        self.policy.finished(asg.action_id, now, ok=False)
        a.misplaced += 1
        rec = self.envs.get(a.spec.env)
        log.warning("policy placed %s on %s but environment %s is %s on %s", a.spec.id, asg.worker_id, a.spec.env,
                    rec.status if rec else "unknown", rec.holder if rec else None)
        if rec is not None and rec.status is EnvStatus.LIVE and rec.holder in self.workers.by_id:
            self.policy.update_worker(rec.holder, envs=self.envs.held_by(rec.holder), now=now)
        if a.misplaced < 3 and (rec is None or rec.status in USABLE):
            self.policy.submit(a.spec, now)
        else:
            a.held = True   # released with the environment's next change

    def done(self, worker_id: str, items: list, now: float, nbytes: int = 0) -> int:
        """A worker's DONE batch (``nbytes``: its frame's size); returns how many items were malformed
        (each is skipped alone)."""
        w = self.workers.by_id.get(worker_id)
        if w is None:
            # Late outcomes of a worker declared lost: their actions were retried elsewhere.
            self.counters.stale_results += len(items)
            return 0
        policy = self.policy
        actions = self._actions
        share = nbytes // len(items) if items else 0     # what each result weighs in the result cache
        bad = 0
        for item in items:
            try:
                aid, attempt, status, output, error, started, finished, env_state = P.check_done(item)
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
            if a.in_env:
                a.in_env = False
                self._env_attempt_ended(a.spec.env, now)
            if env_state == EnvState.RESTORED:
                self._observe_restore(now - a.assigned - (finished - started))
            self._finalize(a, status, output, error, started, finished, env_state, nbytes=share)
        self.dirty = True
        return bad

    def _observe_restore(self, seconds: float) -> None:
        """A restore took ``seconds``: the attempt's time from ASSIGN to DONE less its command's
        run time (the worker starts that clock once the environment is there)."""
        if seconds >= 0.0:
            old = self.restore_s
            self.restore_s = seconds if old is None else 0.8 * old + 0.2 * seconds

    def expire(self, now: float) -> None:
        """Time out running actions past ``timeout + timeout_grace_s``; give up environments awaited
        past ``env_wait_s``."""
        for env in self.envs.expire(now):
            self._env_changed(env, now)
        dl = self._deadlines
        if len(dl) > 2 * len(self._actions) + 4096:
            # an entry stays until its deadline though its action ended long before (a one-hour
            # timeout at thousands of actions a second): keep only the live ones, now and then
            actions = self._actions
            dl[:] = [e for e in dl if (a := actions.get(e[1])) is not None and a.attempt == e[2]]
            heapq.heapify(dl)
        grace = self.config.timeout_grace_s
        while dl and dl[0][0] <= now:
            _, aid, attempt = heapq.heappop(dl)
            a = self._actions.get(aid)
            if a is None or a.attempt != attempt or (a.worker is None and not (a.held and a.away == attempt)):
                continue
            if a.prepare:
                why = (f"no result {a.spec.timeout:g}s (+{grace:g}s grace, +{a.prepare:g}s to create or restore "
                       f"its environment) after it was assigned")
            else:
                why = f"no result {a.spec.timeout:g}s (+{grace:g}s grace) after it started"
            if a.worker is None:
                # Its worker went silent while it ran and its environment waits for that worker: the
                # attempt may still be running there, so it is not run again past its time.
                a.held = False
                self._kill_when_back(a)
                why += f"; its worker stopped answering meanwhile ({'; '.join(a.failures[-1:])})"
            else:
                self._kill(a, now)
            self._finalize(a, Status.TIMEOUT, None, why, 0.0, now)

    def _kill_when_back(self, a: _Action) -> None:
        """Stop attempt ``a.attempt`` where its environment is: now if its holder is here, else
        when the holder comes back with it."""
        env = _env_of(a.spec)
        if env is None:
            return
        rec = self.envs.get(env)
        if rec is not None and rec.status is EnvStatus.LIVE and rec.holder in self.workers.by_id:
            self.outbox.kill.setdefault(rec.holder, []).append([a.spec.id, a.attempt])
        else:
            self._kill_on_return.setdefault(env, []).append([a.spec.id, a.attempt])

    def fail_unplaceable(self, now: float) -> None:
        """Fail pending actions no worker shape could ever run, with the policy's reason."""
        for aid, why in self.policy.unplaceable(now):
            a = self._actions.get(aid)
            if a is not None and self.policy.cancel(aid):
                self._finalize(a, Status.ERROR, None, f"cannot be placed: {why}", 0.0, now)

    def abort(self, ids: list, why: str, now: float, *, client: bytes | None = None,
              ended_on: str | None = None) -> None:
        """End with an error the actions of a call that failed half way (a bug in this ledger or the
        policy), which may be left in any state, so that no client waits on them for ever.

        ``client``: they are that client's submissions, and the ones it got no answer for yet are
        answered even if they were never admitted; ``ended_on``: their attempts ended on that worker
        (its DONE), so their cores are free.  Releasing resources is best effort: a policy that
        failed once may fail again, and the result still goes out."""
        answered = {r[0] for r in self.outbox.results.get(client, ())} if client is not None else set()
        for aid in ids:
            a = self._actions.get(aid) if isinstance(aid, str) else None
            if a is None or (client is not None and a.client != client):
                if client is not None and a is None and aid not in answered and self._recent.get(aid) is None:
                    self._reject(client, aid, why, now)
                continue
            try:
                self._release(a, now, ended_on)
            except Exception:
                log.exception("could not release what action %s held after an internal error", aid)
            self._finalize(a, Status.ERROR, None, why, 0.0, now)
        self.dirty = True

    def _release(self, a: _Action, now: float, ended_on: str | None) -> None:
        aid = a.spec.id
        if a.held:
            a.held = False
        elif a.worker is None:
            self.policy.cancel(aid)
        elif a.worker == ended_on:
            w = self.workers.by_id.get(ended_on)
            if w is not None and aid in w.running:
                w.running.discard(aid)
                w.busy_cores -= a.cores
            if a.in_env:
                a.in_env = False
                self._env_attempt_ended(a.spec.env, now)
            self.policy.finished(aid, now, ok=False)
        else:
            self._kill(a, now)

    def _kill(self, a: _Action, now: float) -> None:
        """Send KILL for a running attempt and keep it as a zombie holding its cores."""
        wid = a.worker
        self.outbox.kill.setdefault(wid, []).append([a.spec.id, a.attempt])
        w = self.workers.by_id.get(wid)
        if w is None:
            self.policy.finished(a.spec.id, now, ok=False)
            return
        w.running.discard(a.spec.id)
        # A killed attempt may still be ending in its environment: it counts there until it has.
        w.zombies[a.spec.id] = (a.attempt, a.cores, a.spec.env if a.in_env else None)
        a.in_env = False
        self._zombies[a.spec.id] = wid
        if not w.running:
            w.idle_since = now

    def _bury(self, w: WorkerRecord, aid: str, now: float) -> None:
        """The worker reported a zombie's attempt ended: its cores are free now."""
        _, cores, env = w.zombies.pop(aid)
        self._zombies.pop(aid, None)
        w.busy_cores -= cores
        self.policy.finished(aid, now, ok=False)
        if env is not None:
            self._env_attempt_ended(env, now)

    def _env_attempt_ended(self, env: str, now: float) -> None:
        ask = self.envs.ended(env)
        if ask is not None:
            holder, gen = ask
            self.outbox.env.setdefault(holder, []).append([P.ENV_SAVE, env, gen])
            if env in self._moving_since:
                self._moving_since[env] = now       # a move's cost counts from the save

    def _finalize(self, a: _Action, status: str, output: Any, error: str | None,
                  started: float, finished: float, env_state: str | None = None, *, nbytes: int = 0) -> None:
        spec = a.spec
        aid = spec.id
        del self._actions[aid]
        n = self._client_pending.get(a.client, 1) - 1
        if n > 0:
            self._client_pending[a.client] = n
        else:
            self._client_pending.pop(a.client, None)
        res = [aid, status, output, error, a.submitted, started, finished, a.worker, a.cores, a.attempt, env_state]
        results = self.outbox.results
        mine = results.get(a.client)
        if mine is None:
            results[a.client] = [res]
        else:
            mine.append(res)
        self._recent.put(aid, res, nbytes)
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
        if spec.env is not None and spec.kind == "sandbox":
            self._env_action_final(a, spec.env, max(finished, a.submitted))

    def _env_action_final(self, a: _Action, env: str, now: float) -> None:
        if a.in_env:   # finalised while its attempt runs (lost attempts were reset): counted until it ends
            a.in_env = False
            self._env_attempt_ended(env, now)
        live = self._env_live.get(env)
        if live is not None:
            try:
                live.remove(a)
            except ValueError:
                pass
            if not live:
                del self._env_live[env]
        if a.attempt:
            self.attempt_log.append([a.spec.id, 0])
        closing = self._env_closing.get(env)
        if closing is not None:
            closing.discard(a.spec.id)
            if not closing:
                self._close_env_now(env, now)
