"""The lifecycle of stateful environments: one owner for where each live copy is and what its actions do meanwhile.

Socket-free and clock-free (``now`` is passed in), like the ledger that calls it.  The
:class:`~.environments.EnvironmentDirectory` says where an environment's one live copy is
(fenced by generations); :class:`EnvironmentLifecycle` keeps the actions in step with it:

* an action with an environment goes to the scheduling policy only while the environment can
  be used; while it moves or its worker is awaited, its waiting actions are *held back* (taken
  from the policy), and they go back once it can be used again, or fail with ``env_lost``;
* each start takes a grant from the directory; a start the directory refuses (the policy placed
  it away from its environment) is *revoked* (:meth:`~tangram_hpc.policy.base.SchedulingPolicy.revoke`:
  not a failed run), the environment is pinned to its holder again and the action waits its turn;
* a move the policy asks for: the holder saves the environment once nothing runs there, its
  actions wait, and the move's cost (the save, and a restore as long until one was seen) goes
  back to the policy;
* an attempt finalised while its worker was away (cancelled, timed out) may still run there: it is
  killed when the worker comes back with the environment (*kill-on-return*);
* every attempt started in an environment, and every such action's end, goes to the attempt log
  (the state file), so a restarted coordinator knows which attempts may still run.

The policy's view of where an environment lives follows from here alone: it is told
(:meth:`~tangram_hpc.policy.base.SchedulingPolicy.close_env`) only through :meth:`_unpin`.
"""
from __future__ import annotations

import logging
from typing import Callable

from .. import protocol as P
from ..actions import ActionSpec, Status, ValidationError
from ..policy.base import SchedulingPolicy
from .environments import USABLE, EnvironmentDirectory, EnvStatus
from .outbox import Counters, Outbox
from .registry import WorkerRegistry

log = logging.getLogger("tangram.coordinator")


def env_of(spec: ActionSpec) -> str | None:
    """The stateful environment an action runs in: a sandbox action's ``env`` (for other kinds it is
    only a placement hint to the policy)."""
    return spec.env if spec.kind == "sandbox" else None


class EnvironmentLifecycle:
    """The environments of one coordinator's live actions.

    The actions are the ledger's records: they carry ``spec``, ``attempt``, ``worker`` and the
    fields this class keeps on them (``held``, ``in_env``, ``away``, ``misplaced``, ``assigned``,
    ``prepare``).  ``fail(action, status, why, now)`` finalises an action that cannot run.
    """

    def __init__(self, policy: SchedulingPolicy, directory: EnvironmentDirectory, workers: WorkerRegistry,
                 outbox: Outbox, counters: Counters, fail: Callable, *, prepare_s: float = 0.0,
                 prior_attempts: dict[str, int] | None = None):
        self.policy = policy
        self.directory = directory
        self.workers = workers
        self.outbox = outbox
        self.counters = counters
        self._fail = fail
        self.prepare_s = prepare_s
        self.dirty = False                                # something changed that may let the policy start actions
        self._live: dict[str, list] = {}                  # environment -> its live actions, oldest first
        self._closing: dict[str, set[str]] = {}           # environment -> live actions it closes after
        self._moving_since: dict[str, float] = {}         # environment the policy moves -> when it asked
        self._unmovable: set[str] = set()                 # environments whose holder could not save them
        self.restore_s: float | None = None               # seconds a restore takes (moving average), once seen
        #: attempts started under a previous coordinator (from its state file), by action id
        self._prior_attempts = dict(prior_attempts or {})
        #: environment -> [[action id, attempt], ...]: attempts finalised while their worker was away
        #: (cancelled, timed out) that may still run there; killed when it comes back with the environment
        self._kill_on_return: dict[str, list[list]] = {}
        #: [action id, attempts started] for actions with an environment; [id, 0] once final (the state file)
        self.attempt_log: list[list] = []

    # -- views -----------------------------------------------------------------------
    def live_attempts(self) -> dict[str, int]:
        """Attempts started of the live actions that have an environment (the state file keeps them)."""
        return {a.spec.id: a.attempt for live in self._live.values() for a in live if a.attempt}

    def holder(self, env: str) -> str | None:
        """The worker the environment's copy is on, if any (live, moving or awaited)."""
        rec = self.directory.get(env)
        return None if rec is None else rec.holder

    def refusal(self, env: str) -> str | None:
        """Why a new action in ``env`` is refused (it is lost), or None."""
        rec = self.directory.get(env)
        if rec is not None and rec.status is EnvStatus.LOST:
            return f"environment {env!r} is lost: {rec.why}; close it (close_env) to start it again empty"
        return None

    def moving_from(self, worker_id: str) -> bool:
        return self.directory.moving_from(worker_id)

    # -- actions ----------------------------------------------------------------------
    def admit(self, a, env: str, now: float) -> None:
        """A new action in ``env``: to the policy now, or held until the environment can be used."""
        live = self._live.get(env)
        if live is None:
            self._live[env] = [a]
        else:
            live.append(a)
        if self._prior_attempts:
            n = self._prior_attempts.pop(a.spec.id, 0)
            if n:
                a.attempt = a.away = n      # started under the previous coordinator: it may still run
                a.attempt_failed(f"attempt {n} started under the previous coordinator and did not report")
        rec = self.directory.get(env)
        if env in self._closing or (rec is not None and rec.status not in USABLE):
            a.held = True
        else:
            self.policy.submit(a.spec, now)

    def resubmit(self, a, env: str, now: float) -> None:
        """An action whose attempt was lost goes back to the policy, or waits for its environment."""
        rec = self.directory.get(env)
        closing = self._closing.get(env)
        if closing is not None and a.spec.id not in closing or (rec is not None and rec.status not in USABLE):
            a.held = True
            return
        self.policy.submit(a.spec, now)

    def grant(self, a, env: str, worker_id: str, cores: int, now: float) -> list | None:
        """The policy started ``a`` on ``worker_id``: the grant its ASSIGN carries, or None when the
        environment is not that worker's to use (the start is then revoked and ``a`` waits)."""
        grant = self.directory.grant(env, worker_id)
        if grant is None:
            self._misplaced(a, env, worker_id, now)
        return grant

    def started(self, a, grant: list, now: float) -> None:
        """Attempt ``a.attempt`` was assigned with ``grant``: it counts in its environment until it ends."""
        a.in_env = True
        a.assigned = now
        # the worker times the command from when its environment is there, not from the ASSIGN
        a.prepare = 0.0 if grant[1] == P.GRANT_HELD else self.prepare_s
        self.attempt_log.append([a.spec.id, a.attempt])

    def _misplaced(self, a, env: str, worker_id: str, now: float) -> None:
        """The policy started an action away from the worker its environment is on (it should not):
        take the start back, pin the environment again and let the action wait its turn."""
        self.policy.revoke(a.spec.id, now)
        a.misplaced += 1
        rec = self.directory.get(env)
        log.warning("policy placed %s on %s but environment %s is %s on %s", a.spec.id, worker_id, env,
                    rec.status if rec else "unknown", rec.holder if rec else None)
        if rec is not None and rec.status is EnvStatus.LIVE and rec.holder in self.workers.by_id:
            self._pin(rec.holder, now)
        if a.misplaced < 3 and (rec is None or rec.status in USABLE):
            self.policy.submit(a.spec, now)
            self.dirty = True
        else:
            a.held = True   # released with the environment's next change

    def attempt_ended(self, a, now: float) -> None:
        """The attempt ``a`` runs in its environment ended (a DONE, a buried zombie, or finalised
        while it runs): the environment's holder may now be asked to save it."""
        if not a.in_env:
            return
        a.in_env = False
        self.zombie_ended(a.spec.env, now)

    def zombie_ended(self, env: str, now: float) -> None:
        """An attempt counted in ``env`` ended (a killed one, reported after its action was final)."""
        ask = self.directory.ended(env)
        if ask is not None:
            holder, gen = ask
            self.outbox.env.setdefault(holder, []).append([P.ENV_SAVE, env, gen])
            if env in self._moving_since:
                self._moving_since[env] = now       # a move's cost counts from the save

    def observe_restore(self, a, now: float, run_s: float) -> None:
        """Attempt ``a`` restored its environment: the time from ASSIGN to DONE less its command's
        run time (the worker starts that clock once the environment is there)."""
        seconds = now - a.assigned - run_s
        if seconds >= 0.0:
            old = self.restore_s
            self.restore_s = seconds if old is None else 0.8 * old + 0.2 * seconds

    def kill_when_back(self, a) -> None:
        """Stop attempt ``a.attempt`` where its environment is: now if its holder is here, else
        when the holder comes back with it."""
        env = a.spec.env
        if env is None or a.spec.kind != "sandbox":
            return
        rec = self.directory.get(env)
        if rec is not None and rec.status is EnvStatus.LIVE and rec.holder in self.workers.by_id:
            self.outbox.kill.setdefault(rec.holder, []).append([a.spec.id, a.attempt])
        else:
            self._kill_on_return.setdefault(env, []).append([a.spec.id, a.attempt])

    def action_final(self, a, env: str, now: float) -> None:
        """``a`` has its final result: it leaves its environment, which closes if it was the last awaited."""
        self.attempt_ended(a, now)   # finalised while its attempt runs (lost attempts were reset)
        live = self._live.get(env)
        if live is not None:
            try:
                live.remove(a)
            except ValueError:
                pass
            if not live:
                del self._live[env]
        if a.attempt:
            self.attempt_log.append([a.spec.id, 0])
        closing = self._closing.get(env)
        if closing is not None:
            closing.discard(a.spec.id)
            if not closing:
                self._close_now(env, now)

    # -- the policy's view -----------------------------------------------------------------
    def _pin(self, worker_id: str, now: float) -> None:
        """Tell the policy which environments are live on ``worker_id``."""
        self.policy.update_worker(worker_id, envs=self.directory.held_by(worker_id), now=now)

    def _unpin(self, env: str) -> None:
        """Tell the policy ``env`` is on no worker now (moving, saved, closed, gone)."""
        self.policy.close_env(env)

    def _hold_back(self, env: str) -> None:
        """Take the environment's waiting actions back from the policy until it can be used again."""
        policy = self.policy
        for a in self._live.get(env, ()):
            if a.worker is None and not a.held and policy.cancel(a.spec.id):
                a.held = True

    def _changed(self, env: str, now: float) -> None:
        """The environment's status changed: release its held actions if it can be used, fail them if lost."""
        rec = self.directory.get(env)
        if rec is None or rec.status is not EnvStatus.MOVING:
            self._moving_since.pop(env, None)
        if self._kill_on_return and (rec is None or rec.status is not EnvStatus.AWAITED):
            self._kill_on_return.pop(env, None)    # no longer waiting for the copy those attempts run in
        live = self._live.get(env)
        if not live:
            return
        if rec is not None and rec.status is EnvStatus.LOST:
            why = f"environment {env!r} is lost: {rec.why}"
            for a in list(live):
                if a.worker is None and (a.held or self.policy.cancel(a.spec.id)):
                    a.held = False
                    self._fail(a, Status.ENV_LOST, why, now)
            return
        if rec is not None and rec.status not in USABLE:
            return
        if rec is not None and rec.status is not EnvStatus.LIVE:
            self._unpin(env)   # no worker holds it: the next one to start an action there takes it
        closing = self._closing.get(env)
        for a in live:
            if a.held and (closing is None or a.spec.id in closing):
                a.held = False
                self.policy.submit(a.spec, now)
        self.dirty = True

    def changed(self, envs, now: float) -> None:
        for env in envs:
            self._changed(env, now)

    # -- moves -------------------------------------------------------------------------------
    def move_off(self, worker_id: str, *, ask: bool) -> None:
        """``worker_id`` gives its environments up: drained (``ask``: it is asked to save each once
        nothing runs there) or leaving (it saves them on its own)."""
        moving, save_now = self.directory.worker_draining(worker_id, ask=ask)
        for env in moving:
            self._hold_back(env)
            self._unpin(env)
        if save_now:
            self.outbox.env.setdefault(worker_id, []).extend([P.ENV_SAVE, env, gen] for env, gen in save_now)
        if moving:
            self.dirty = True

    def move(self, envs: list[str], now: float) -> None:
        """The policy wants these environments on another worker: their holders save them, their
        waiting actions wait for that and go to the policy again, unpinned, once they are saved."""
        for env in envs:
            if env in self._unmovable:
                continue
            move = self.directory.move(env)
            if move is None:
                if self.directory.get(env) is None and env not in self._live:
                    # not a sandbox's environment, only a hint to place actions together: there is
                    # nothing to save, so its waiting actions may simply go elsewhere
                    self._unpin(env)
                    self.dirty = True
                continue
            holder, gen, ask_now = move
            self._hold_back(env)
            self._unpin(env)
            self._moving_since[env] = now
            self.counters.env_moves += 1
            if ask_now:
                self.outbox.env.setdefault(holder, []).append([P.ENV_SAVE, env, gen])
            self.dirty = True

    def report(self, worker_id: str, items: list, now: float) -> int:
        """A worker's ENV message (saved, unsaved, gone); returns how many items were malformed."""
        bad = 0
        for item in items:
            try:
                op, env, gen, detail = P.check_env_item(item)
            except ValidationError:
                bad += 1
                continue
            self._reported(worker_id, op, env, gen, detail, now)
        return bad

    def _reported(self, worker_id: str, op: str, env: str, gen: int, detail, now: float) -> None:
        directory = self.directory
        if op == P.ENV_SAVED:
            if detail and directory.saved(worker_id, env, gen, detail):
                asked = self._moving_since.pop(env, None)
                if asked is not None:
                    # a move costs the save and the restore; until a restore was seen, count
                    # it as long as the save
                    save = now - asked
                    self.policy.observe_env_move(save + (save if self.restore_s is None else self.restore_s))
                self._changed(env, now)
        elif op == P.ENV_UNSAVED:
            if self._moving_since.pop(env, None) is not None:
                self._unmovable.add(env)    # asking again would only fail again
            if directory.unsaved(worker_id, env, gen):
                log.warning("worker %s could not save environment %s (%s); it stays there", worker_id, env, detail)
                self._pin(worker_id, now)
                self._changed(env, now)
        elif op == P.ENV_GONE:
            if directory.gone(worker_id, env, gen):
                self._unpin(env)
                self._changed(env, now)

    # -- ending --------------------------------------------------------------------------------
    def close(self, env: str, now: float) -> None:
        """CLOSE_ENV: end ``env`` once the actions already submitted in it have finished."""
        live = self._live.get(env)
        if live:
            self._closing[env] = {a.spec.id for a in live}
        else:
            self._close_now(env, now)

    def _close_now(self, env: str, now: float) -> None:
        self._closing.pop(env, None)
        self._unmovable.discard(env)
        dropped = self.directory.close(env)
        if dropped is not None:
            holder, item = dropped
            self.outbox.env.setdefault(holder, []).append(item)
            self._pin(holder, now)
        self._unpin(env)
        self.counters.envs_closed += 1
        self._changed(env, now)   # actions submitted after close_env start it afresh

    # -- workers -------------------------------------------------------------------------------
    def worker_registered(self, worker_id: str, root: str | None, handle: str | None, reported: list,
                          now: float) -> None:
        """A worker registered with the environments it has on disk: those that are the copy it was
        last granted are kept (and attempts to kill there sent), the others dropped."""
        keep, drop, regained, lost = self.directory.worker_registered(worker_id, root, handle, reported, now)
        if keep or drop:
            self.outbox.env.setdefault(worker_id, []).extend(keep + drop)
        if self._kill_on_return:    # (those of environments it came back without go in _changed)
            for env in regained:
                stale = self._kill_on_return.pop(env, None)
                if stale:
                    self.outbox.kill.setdefault(worker_id, []).extend(stale)
        if regained:
            self._pin(worker_id, now)
        self.changed(regained + lost, now)

    def worker_lost(self, worker_id: str, *, dead: bool, now: float) -> list[str]:
        """``worker_id`` is gone: its environments are awaited (``dead``: adopted or lost) and their
        waiting actions held back.  The caller resets the lost attempts, then calls :meth:`changed`."""
        affected = self.directory.worker_lost(worker_id, dead=dead, now=now)
        for env in affected:
            self._hold_back(env)
        return affected

    def worker_retired(self, worker_id: str, now: float) -> None:
        """A drained worker left: environments it could not save stay on its disk, adopted once it has exited."""
        self.changed(self.directory.worker_lost(worker_id, dead=False, now=now), now)

    def worker_dead(self, worker_id: str, now: float) -> None:
        """A worker lost earlier (silent) is now known to have exited: adopt what it held."""
        self.changed(self.directory.worker_dead(worker_id), now)

    def job_ended(self, handle: str, now: float) -> None:
        """The backend saw the job ``handle`` end: if its worker was lost earlier, it is dead now."""
        wid = self.directory.worker_of_handle(handle)
        if wid is not None and wid not in self.workers.by_id:
            self.worker_dead(wid, now)

    def expire(self, now: float) -> None:
        """Give up environments awaited past the directory's ``wait_s``."""
        self.changed(self.directory.expire(now), now)
