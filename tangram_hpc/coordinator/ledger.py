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
  client, a repeated idempotency key) gets the first answer again
  (:class:`~.answers.ClientAnswers`);
* an action with an environment runs only where the
  :class:`~.environments.EnvironmentDirectory` says the one live copy is: while the
  environment is moving or its worker is awaited, its actions are held back from
  the policy; each ASSIGN carries the environment's grant (its generation, and
  where to restore or adopt it from); a lost environment fails its actions with
  ``env_lost``.  :class:`~.lifecycle.EnvironmentLifecycle` keeps these rules: the
  ledger calls it for every event that touches an environment;
* outcomes a worker kept from before it registered again (OUTCOMES) answer the
  actions still waiting for them instead of running them again.

Workers registering, draining, leaving and lost are :class:`~.membership.WorkerMembership`'s
(the ledger's methods of those names call it), over the same actions and zombies.
"""
from __future__ import annotations

import heapq
import sys
import logging
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from ..actions import ID_MAX, ActionSpec, EnvState, Status, ValidationError, payload_summary
from ..policy.base import SchedulingPolicy
from ..resources import WorkerInfo
from .environments import EnvironmentDirectory
from .answers import ClientAnswers
from .lifecycle import EnvironmentLifecycle, env_of
from .membership import WorkerMembership
from .outbox import Counters, Outbox
from .registry import WorkerRecord, WorkerRegistry

if TYPE_CHECKING:     # the settings object is handed in; config itself stays out of the core's imports
    from ..config import CoordinatorSettings


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


class _Rare:
    """What few actions need: failed attempts, shared answers, their environment's attempt (see
    :class:`_Action`, whose properties of these names read them)."""

    __slots__ = ("failures", "waiters", "held", "in_env", "misplaced", "assigned", "prepare", "away")

    def __init__(self) -> None:
        self.failures: list[str] | None = None   # why its attempts failed
        self.held = False       # kept from the policy until its environment can be used
        self.in_env = False     # its running attempt is counted in its environment's record
        self.waiters: list[tuple[bytes, str]] | None = None  # (client, action id) sharing an idempotency key
        self.misplaced = 0      # times the policy started it away from its environment
        self.assigned = 0.0     # when its current attempt was assigned (actions with an environment)
        self.prepare = 0.0      # seconds its current attempt may take to create or restore its environment
        self.away = 0           # its attempt that may still run on a worker gone silent (0: none)


_COMMON = _Rare()   # the values of an action that has none of its own (read, never written)


class _Action:
    """A live action.  Its rarer fields live in a :class:`_Rare` made when one is first set: a queued
    action holds eight slots, not fifteen (56 B of the ~1 KB a queued action costs)."""

    __slots__ = ("spec", "wire", "client", "submitted", "attempt", "worker", "cores", "rare")

    def __init__(self, spec: ActionSpec, wire: dict | bytes, client: bytes, now: float):
        self.spec = spec
        self.wire = wire        # the map to send in ASSIGN: as it came, packed where the loop kept it so
        self.client = client
        self.submitted = now
        self.attempt = 0
        self.worker: str | None = None
        self.cores = 0
        self.rare = _COMMON

    def _own(self) -> _Rare:
        rare = self.rare
        if rare is _COMMON:
            rare = self.rare = _Rare()
        return rare

    @property
    def waiters(self) -> list[tuple[bytes, str]] | None:
        return self.rare.waiters

    @property
    def held(self) -> bool:
        return self.rare.held

    @held.setter
    def held(self, held: bool) -> None:
        if held or self.rare is not _COMMON:
            self._own().held = held

    @property
    def in_env(self) -> bool:
        return self.rare.in_env

    @in_env.setter
    def in_env(self, counted: bool) -> None:
        if counted or self.rare is not _COMMON:
            self._own().in_env = counted

    @property
    def misplaced(self) -> int:
        return self.rare.misplaced

    @misplaced.setter
    def misplaced(self, n: int) -> None:
        self._own().misplaced = n

    @property
    def assigned(self) -> float:
        return self.rare.assigned

    @assigned.setter
    def assigned(self, t: float) -> None:
        self._own().assigned = t

    @property
    def prepare(self) -> float:
        return self.rare.prepare

    @prepare.setter
    def prepare(self, s: float) -> None:
        if s or self.rare is not _COMMON:
            self._own().prepare = s

    @property
    def away(self) -> int:
        return self.rare.away

    @away.setter
    def away(self, attempt: int) -> None:
        if attempt or self.rare is not _COMMON:
            self._own().away = attempt

    def attempt_failed(self, why: str) -> None:
        rare = self._own()
        if rare.failures is None:
            rare.failures = []
        rare.failures.append(why)

    def last_failures(self, n: int) -> list[str]:
        failures = self.rare.failures
        return failures[-n:] if failures else []

    def share(self, client: bytes, aid: str) -> None:
        """Answer ``client`` too, under ``aid``, when this action has its result."""
        rare = self._own()
        if rare.waiters is None:
            rare.waiters = []
        if (client, aid) not in rare.waiters:
            rare.waiters.append((client, aid))


def _due(deadlines: list[tuple[float, str, int]], actions: dict[str, _Action], now: float):
    """The actions whose attempt's deadline (on the heap ``deadlines``) passed by ``now``: running,
    or held while the silent worker that runs it is awaited."""
    if len(deadlines) > 2 * len(actions) + 4096:
        # an entry stays until its deadline though its action ended long before (a one-hour
        # timeout at thousands of actions a second): keep only the live ones, now and then
        deadlines[:] = [e for e in deadlines if (a := actions.get(e[1])) is not None and a.attempt == e[2]]
        heapq.heapify(deadlines)
    while deadlines and deadlines[0][0] <= now:
        _, aid, attempt = heapq.heappop(deadlines)
        a = actions.get(aid)
        if a is None or a.attempt != attempt or (a.worker is None and not (a.held and a.away == attempt)):
            continue
        yield a


def _timeout_reason(a: _Action, grace: float) -> str:
    if a.prepare:
        return (f"no result {a.spec.timeout:g}s (+{grace:g}s grace, +{a.prepare:g}s to create or restore "
                f"its environment) after it was assigned")
    return f"no result {a.spec.timeout:g}s (+{grace:g}s grace) after it started"


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
        self._dirty = False                # something changed that may let the policy start actions
        self._actions: dict[str, _Action] = {}
        self.answers = ClientAnswers(config, self.outbox, self.counters)
        self._client_pending: dict[bytes, int] = {}
        self._deadlines: list[tuple[float, str, int]] = []
        self._zombies: dict[str, str] = {}                # zombie action id -> worker id
        #: the environments of the live actions: where each one's copy is, and what its actions do meanwhile
        self.envlife = EnvironmentLifecycle(
            policy, envs if envs is not None else EnvironmentDirectory(config.env_wait_s), self.workers,
            self.outbox, self.counters, self._fail, prepare_s=config.env_prepare_s, prior_attempts=prior_attempts)
        #: workers registering, reporting, draining, leaving, lost
        self.membership = WorkerMembership(config, policy, self.workers, self.envlife, self.counters,
                                           self._actions, self._zombies, self._finalize)

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
    def dirty(self) -> bool:
        """Something changed that may let the policy start actions."""
        return self._dirty or self.envlife.dirty or self.membership.dirty

    @dirty.setter
    def dirty(self, value: bool) -> None:
        self._dirty = self.envlife.dirty = self.membership.dirty = value

    @property
    def zombie_cores(self) -> int:
        return sum(w.zombie_cores for w in self.workers.by_id.values())

    # -- clients -----------------------------------------------------------------
    def submit(self, client: bytes, wires: list, now: float) -> None:
        """A SUBMIT body: validate each spec alone, answer duplicates, admit the rest to the policy.

        ``wires`` may come with each map as it was packed (a :class:`~tangram_hpc.protocol.PackedList`,
        as the loop decodes a SUBMIT): an action is then kept as those bytes, spliced into its ASSIGN,
        and its spec keeps of its payload only what the scheduler reads (:func:`payload_summary`), so
        a waiting action holds no decoded map: 1.4 KB -> 0.9 KB a queued no-op (``tracemalloc``)."""
        packed = wires.packed if type(wires) is P.PackedList else None
        cfg = self.config
        policy = self.policy
        actions = self._actions
        zombies = self._zombies
        answers = self.answers
        pending = self._client_pending.get(client, 0)
        for j, w in enumerate(wires):
            try:
                spec = ActionSpec.from_wire(w)
                # one string per kind, not one each
                if packed is None:
                    w["k"] = spec.kind = sys.intern(spec.kind)
                else:
                    spec.kind = sys.intern(spec.kind)
                    spec.payload = payload_summary(spec.payload)
            except ValidationError as e:
                aid = w.get("i") if isinstance(w, dict) else None
                answers.reject(client, aid if isinstance(aid, str) and len(aid) <= ID_MAX else None, str(e), now)
                continue
            aid = spec.id
            live = actions.get(aid)
            if live is not None:
                # the same id from another identity (the client back under a new one, or a second
                # client using the id): answer it there too, and the first one still
                if client != live.client:
                    live.share(client, aid)
                continue
            if answers.again(client, aid):
                continue
            kept = answers.kept_outcome(aid)
            if kept is not None and self._answer_from_orphan(client, spec, kept, now):
                continue
            if zombies and aid in zombies:
                answers.reject(client, aid, "an attempt of this action id is still ending on its worker", now)
                continue
            key = spec.idempotency_key
            if key is not None and self._join_idempotent(client, spec, key):
                continue
            if pending >= cfg.max_pending_per_client or len(actions) >= cfg.max_pending_total:
                which = ("this client" if pending >= cfg.max_pending_per_client else "the coordinator")
                limit = cfg.max_pending_per_client if which == "this client" else cfg.max_pending_total
                answers.reject(client, aid, f"too many unfinished actions for {which} (limit {limit}); "
                                          "wait for results before submitting more", now)
                continue
            env = env_of(spec)
            if env is not None:
                why = self.envlife.refusal(env)
                if why is not None:
                    answers.reject(client, aid, why, now, Status.ENV_LOST)
                    continue
            pending += 1
            a = actions[aid] = _Action(spec, w if packed is None else packed[j], client,
                                       now - _age(w) if "a" in w else now)
            self.counters.submitted += 1
            if env is None:
                policy.submit(spec, now)
            else:
                self.envlife.admit(a, env, now)
        if pending:
            self._client_pending[client] = pending
        self.dirty = True

    def _join_idempotent(self, client: bytes, spec: ActionSpec, key: str) -> bool:
        """True when ``spec`` is answered by an earlier action with the same key."""
        first = self.answers.first_with_key(spec, key)
        if first is None:
            return False
        live = self._actions.get(first)
        if live is None:
            return self.answers.shared(client, spec, first)
        live.share(client, spec.id)
        return True

    def _answer_from_orphan(self, client: bytes, spec: ActionSpec, kept: list, now: float) -> bool:
        """A resubmitted action whose attempt under an earlier registration of a worker did finish."""
        env = env_of(spec)
        if env is not None and self.envlife.holder(env) != kept[-1]:
            return False   # the environment is not the copy it ran in: its journal decides
        self.answers.from_orphan(client, spec, kept, now)
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
                    self.envlife.kill_when_back(a)
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

    # -- workers (WorkerMembership) -----------------------------------------------------
    def add_worker(self, info: WorkerInfo, ident: bytes, now: float) -> WorkerRecord:
        return self.membership.add_worker(info, ident, now)

    def worker_report(self, worker_id: str, body: dict, now: float) -> None:
        self.membership.worker_report(worker_id, body, now)

    def drain(self, worker_id: str, reason: str, now: float) -> None:
        self.membership.drain(worker_id, reason, now)

    def worker_leaving(self, worker_id: str, reason: str, now: float) -> None:
        self.membership.worker_leaving(worker_id, reason, now)

    def holds_moving_envs(self, worker_id: str) -> bool:
        return self.membership.holds_moving_envs(worker_id)

    def worker_left(self, worker_id: str, now: float, reason: str, *, stopped: bool = False) -> None:
        self.membership.worker_left(worker_id, now, reason, stopped=stopped)

    def retire_worker(self, worker_id: str, now: float) -> WorkerRecord | None:
        return self.membership.retire_worker(worker_id, now)

    def lose_worker(self, worker_id: str, now: float, reason: str, *, dead: bool = False,
                    event: str = "lost") -> WorkerRecord | None:
        return self.membership.lose_worker(worker_id, now, reason, dead=dead, event=event)

    def job_ended(self, handle: str, now: float) -> None:
        self.membership.job_ended(handle, now)

    # -- environments --------------------------------------------------------------
    def env_report(self, worker_id: str, items: list, now: float) -> int:
        """A worker's ENV message (saved, unsaved, gone); returns how many items were malformed."""
        return self.envlife.report(worker_id, items, now)

    def close_env(self, envs: list, now: float) -> None:
        """CLOSE_ENV: end each environment once the actions already submitted in it have finished."""
        for env in envs:
            if isinstance(env, str):
                self.envlife.close(env, now)

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
                self.answers.keep_orphan(aid, [attempt, status, output, error, started, finished, env_state, worker_id])
                continue
            if a.worker is not None:
                continue   # a newer attempt runs: its result counts
            env = env_of(a.spec)
            if env is not None and self.envlife.holder(env) != worker_id:
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
        prefetches = self.policy.prefetches(now)
        if prefetches:
            self._prefetch(prefetches)
        moves = self.policy.env_moves()
        if moves:       # after the starts: one the policy made in an environment it moves runs first
            self.envlife.move(moves, now)

    def _prefetch(self, prefetches: list[tuple[str, str]]) -> None:
        """One PREFETCH per worker the policy wants to load services ahead of their calls (sent
        before this turn's ASSIGNs, which the loads then overlap)."""
        by_worker: dict[str, list[str]] = {}
        for wid, svc in prefetches:
            by_worker.setdefault(wid, []).append(svc)
        for wid, names in by_worker.items():
            w = self.workers.by_id.get(wid)
            if w is not None:
                self.outbox.to_workers.append((w.ident, P.PREFETCH, names))

    def _assign(self, assignments: list, now: float) -> None:
        actions = self._actions
        workers = self.workers.by_id
        assign = self.outbox.assign
        grace = self.config.timeout_grace_s
        envlife = self.envlife
        for asg in assignments:
            a = actions.get(asg.action_id)
            w = workers.get(asg.worker_id)
            if a is None or w is None:
                # The policy placed something the ledger no longer tracks: take the start back.
                self.policy.revoke(asg.action_id, now)
                continue
            env = env_of(a.spec)
            if env is None:
                a.attempt += 1
                item = [a.wire, a.attempt, asg.cores]
            else:
                grant = envlife.grant(a, env, asg.worker_id, asg.cores, now)
                if grant is None:
                    continue    # revoked: it waits its turn where its environment is
                a.attempt += 1
                envlife.started(a, grant, now)
                item = [a.wire, a.attempt, asg.cores, grant]
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
                self.envlife.attempt_ended(a, now)
                if env_state is not None:
                    policy.env_processes(a.spec.env, env_state == EnvState.LIVE)
            if env_state == EnvState.RESTORED:
                self.envlife.observe_restore(a, now, finished - started)
            self._finalize(a, status, output, error, started, finished, env_state, nbytes=share)
        self.dirty = True
        return bad

    def expire(self, now: float) -> None:
        """Time out running actions past ``timeout + timeout_grace_s``; give up environments awaited
        past ``env_wait_s``."""
        self.envlife.expire(now)
        for a in _due(self._deadlines, self._actions, now):
            why = _timeout_reason(a, self.config.timeout_grace_s)
            if a.worker is None:
                # Its worker went silent while it ran and its environment waits for that worker: the
                # attempt may still be running there, so it is not run again past its time.
                a.held = False
                self.envlife.kill_when_back(a)
                why += f"; its worker stopped answering meanwhile ({'; '.join(a.last_failures(1))})"
            else:
                self._kill(a, now)
            self._finalize(a, Status.TIMEOUT, None, why, 0.0, now)

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
                if client is not None and a is None and aid not in answered and self.answers.recent.get(aid) is None:
                    self.answers.reject(client, aid, why, now)
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
            self.envlife.attempt_ended(a, now)
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
            self.envlife.zombie_ended(env, now)

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
        self.answers.final(a.client, [aid, status, output, error, a.submitted, started, finished, a.worker, a.cores,
                                      a.attempt, env_state], a.waiters, nbytes)
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
            self.envlife.action_final(a, spec.env, max(finished, a.submitted))

    def _fail(self, a: _Action, status: str, why: str, now: float) -> None:
        """Finalise an action that will not run (its environment is lost)."""
        self._finalize(a, status, None, why, 0.0, now)
