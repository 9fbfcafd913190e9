"""The environments one worker holds, under the coordinator's grants.

The coordinator's :class:`~tangram_hpc.coordinator.environments.EnvironmentDirectory`
decides where each environment's one live copy is; an ASSIGN of an action in
an environment carries its *grant* ``[generation, source, path]``.  Before
the action runs, :meth:`EnvHost.prepare` makes the local copy match it:

* ``new``: a fresh environment (a stale local copy is dropped first);
* ``held``: the copy this worker holds at that generation; if it has not got it,
  the action fails with ``env_lost`` (never silently on an empty one);
* ``restore``: restored from the snapshot at ``path`` (which is then consumed);
* ``adopt``: copied from the environment root ``path`` of a worker that died.

A grant older than the copy held is refused (fenced).  After the action the
worker records its outcome in the environment's journal (:meth:`record`); a
later attempt of the same action finds it there (:meth:`replay`) and is
answered without running again.

ENV messages: ``keep`` and the bookkeeping of ``drop`` apply at once (on the
I/O thread: the ASSIGN after them relies on them); the slow parts (deleting,
``save``: snapshot, drop, reply) run on one thread of their own, and the
replies wait in :meth:`take_replies` for the I/O thread.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from typing import Any, Callable

from .. import protocol as P
from ..actions import ActionSpec, EnvState, Status
from .env_templates import UnknownTemplate
from .fs_inside import EnvError

log = logging.getLogger("tangram.worker")

#: How long a save waits for the actions still running in the environment.
_SAVE_WAIT_S = 60.0
#: What a grant does to the environment, for messages.
_GRANT_VERB = {P.GRANT_NEW: "created", P.GRANT_RESTORE: "restored", P.GRANT_ADOPT: "adopted"}


class EnvHost:
    def __init__(self, mgr: Any, wake: Callable[[], None]):
        self.mgr = mgr                      # a SandboxManager
        mgr.envs.journaled = True           # attempts are committed by their journal records
        self._wake = wake
        self._gen: dict[str, int] = {}      # environment -> generation held
        self._lock = threading.Lock()
        self._prep: dict[str, threading.Lock] = {}
        self._in_use: dict[str, int] = {}   # environment -> its actions between prepare and journal
        self._making: dict[str, int] = {}   # environment -> generation of the grant whose copy is being made
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._replies: deque = deque()
        # replies the coordinator must have before the outcome of the action that caused them
        self._before_done: deque = deque()
        self._thread = threading.Thread(target=self._serve_ops, name="env-ops", daemon=True)
        self._thread.start()

    # -- what this worker holds ------------------------------------------------------
    def held(self) -> list[list]:
        """``[[environment, generation], ...]`` of the copies here (for REGISTER), and of those being
        made for a grant: a worker stopped (SIGSTOP, a stall) between its ASSIGN and the copy registers
        again while the copy is still being made, and the copy is this worker's all the same."""
        present = self.mgr.environments()
        with self._lock:
            held = {e: g for e, g in self._gen.items() if e in present}
            for e, g in self._making.items():
                held[e] = max(g, held.get(e, g))
            return [[e, g] for e, g in held.items()]

    def generation(self, env: str) -> int | None:
        with self._lock:
            return self._gen.get(env)

    # -- before and after an action ------------------------------------------------------
    def run(self, spec: ActionSpec, attempt: int, grant: Any, started: float, execute: Callable[[], tuple], *,
            cancelled: Callable[[], bool], keep: Callable[[tuple], bool]) -> tuple[tuple, float, float, str | None]:
        """One attempt of an action in its environment, from the grant to the journal: make the local
        copy the granted one (:meth:`prepare`), answer from the journal if the action ran there
        already (:meth:`replay`), else ``execute()`` it and journal its outcome if ``keep(outcome)``
        (:meth:`record`), no save of the environment meanwhile (:meth:`begin`, :meth:`end`).
        ``cancelled()``: whether the attempt was stopped while its environment was made ready.
        Returns ``(outcome, started, finished, env_state)``."""
        env = spec.env
        self.begin(env)
        try:
            env_state, refused = self.prepare(spec, grant)
            if refused is not None:
                return refused, started, time.time(), None
            if cancelled():
                return (Status.CANCELLED, None, "killed before it started"), started, time.time(), env_state
            seen = self.replay(env, spec.id)
            if seen is not None:   # [id, attempt, status, output, error, started, finished]
                return (seen[2], seen[3], seen[4]), seen[5], seen[6], EnvState.REPLAYED
            if env_state is not EnvState.KEPT:
                # The command's own time starts now: a restore (or a creation) is what the move or the
                # new environment costs, which the coordinator learns apart from the command's run time.
                started = time.time()
            outcome = execute()
            finished = time.time()
            if env_state is EnvState.KEPT and self.mgr.processes_kept(env):
                env_state = EnvState.LIVE
            if keep(outcome):
                # Journaled before the DONE leaves: a later attempt of this action finds it.
                self.record(env, [spec.id, attempt, outcome[0], outcome[1], outcome[2], started, finished])
            return outcome, started, finished, env_state
        finally:
            self.end(env, spec.id)

    def begin(self, env: str) -> None:
        """An action of ``env`` starts here: no save of ``env`` until its :meth:`end`.

        The sandbox frees the environment when its command exits, but the action's outcome
        reaches the journal a moment later; a snapshot taken in between would hold the
        command's effects without the record that stops a retry from running it again."""
        with self._lock:
            self._in_use[env] = self._in_use.get(env, 0) + 1

    def end(self, env: str, action_id: str | None = None) -> None:
        """``action_id``'s outcome is journaled, or will never be: its attempt is committed or
        discarded (a record committed it already), and the environment's next action may run."""
        with self._lock:
            left = self._in_use.get(env, 0) - 1
            if left > 0:
                self._in_use[env] = left
            else:
                self._in_use.pop(env, None)
        if action_id is not None:
            self.mgr.finish_attempt(env, action_id)

    def _used(self, env: str) -> bool:
        with self._lock:
            if env in self._in_use:
                return True
        return bool(self.mgr.envs.get(env).busy)

    def prepare(self, spec: ActionSpec, grant: list) -> tuple[str | None, tuple | None]:
        """Make the local copy of ``spec.env`` the one ``grant`` names.

        Returns (env_state, None) when the action may run, or (None, outcome) when it must not.
        """
        env = spec.env
        try:
            gen, source, path = grant
        except (TypeError, ValueError):
            return None, (Status.ERROR, None, f"malformed environment grant {grant!r}")
        with self._lock:
            lock = self._prep.get(env)
            if lock is None:
                lock = self._prep[env] = threading.Lock()
        with lock:   # two first actions of one environment prepare it once
            have = self.generation(env)
            if have is not None and gen < have:
                return None, (Status.ERROR, None, f"environment {env!r}: grant of generation {gen} is older than "
                              f"the copy held here ({have}); it was fenced off")
            if have == gen and self.mgr.envs.has(env):
                return EnvState.KEPT, None
            if source == P.GRANT_HELD:
                return None, (Status.ENV_LOST, None, f"environment {env!r} (generation {gen}) is not on this "
                              "worker any more; close it (close_env) to start it again empty")
            with self._lock:
                self._making[env] = gen
            try:
                if source == P.GRANT_NEW:
                    self.mgr.drop(env)
                    template = spec.payload.get("template") if isinstance(spec.payload, dict) else None
                    made = self.mgr.envs.acquire(env, template if isinstance(template, str) else None)
                    self.mgr.envs.release(made)
                    state = EnvState.CREATED
                elif source == P.GRANT_RESTORE and isinstance(path, str):
                    self.mgr.restore(env, path)
                    try:
                        os.unlink(path)   # consumed: the environment lives here now
                    except OSError:
                        pass
                    state = EnvState.RESTORED
                elif source == P.GRANT_ADOPT and isinstance(path, str):
                    self.mgr.adopt(env, path)
                    state = EnvState.ADOPTED
                else:
                    return None, (Status.ERROR, None, f"unknown environment grant {grant!r}")
            except UnknownTemplate as e:
                # the request's mistake, and nothing was made: the coordinator forgets the environment,
                # so that its next action creates it (not a copy lost before it existed). Before the
                # action's outcome: the client's next action may follow the result at once.
                self._before_done.append([P.ENV_GONE, env, gen, str(e)])
                self._wake()
                return None, (Status.ERROR, None, f"environment {env!r} was not created: {e}")
            except (EnvError, OSError) as e:
                return None, (Status.ENV_LOST, None, f"environment {env!r} could not be {_GRANT_VERB[source]} here: {e}")
            finally:
                with self._lock:
                    self._making.pop(env, None)
            with self._lock:
                # a KEEP that answered a REGISTER sent meanwhile may have renumbered the copy already
                self._gen[env] = max(gen, self._gen.get(env, gen))
            return state, None

    def replay(self, env: str, action_id: str) -> list | None:
        """The journal's record of ``action_id`` in ``env``: it ran there already."""
        try:
            return self.mgr.envs.journal_get(env, action_id)
        except EnvError:
            return None

    def record(self, env: str, record: list) -> None:
        try:
            self.mgr.envs.journal_add(env, record)
        except (EnvError, OSError) as e:
            log.warning("could not journal %s in environment %s: %s", record[0], env, e)

    # -- ENV messages ------------------------------------------------------------------
    def apply(self, items: list) -> None:
        """ENV items from the coordinator (called on the I/O thread)."""
        for item in items:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                    and isinstance(item[1], str) and isinstance(item[2], int)):
                continue
            op, env, gen = item
            if op == P.ENV_KEEP:
                with self._lock:
                    self._gen[env] = gen
            elif op == P.ENV_DROP:
                with self._lock:
                    if self._gen.get(env, gen) > gen:
                        continue   # a newer copy than the one it means
                    self._gen.pop(env, None)
                self._ops.put(("drop", env, gen))
            elif op == P.ENV_SAVE:
                self._ops.put(("save", env, gen))

    def hand_back_all(self) -> threading.Event:
        """Save every environment held (a leaving worker); the event is set once all are handled."""
        done = threading.Event()
        with self._lock:
            held = list(self._gen.items())
        for env, gen in held:
            self._ops.put(("save", env, gen))
        self._ops.put(("mark", done, None))
        return done

    def unsaved(self) -> frozenset[str]:
        """Environments still here (their save failed): left on disk for another worker to adopt."""
        return self.mgr.environments()

    def gone(self, env_ids: list[str], why: str) -> None:
        """Environments this worker removed itself (TTL): the coordinator forgets them."""
        for env in env_ids:
            with self._lock:
                gen = self._gen.pop(env, None)
            if gen is not None:
                self._reply([P.ENV_GONE, env, gen, why])

    def take_replies(self, *, before_done: bool = False) -> list:
        """ENV items to send; ``before_done``: those that must go before the DONE frames queued now."""
        q = self._before_done if before_done else self._replies
        out = []
        while q:
            out.append(q.popleft())
        return out

    def close(self) -> None:
        self._ops.put(None)
        self._thread.join(timeout=_SAVE_WAIT_S + 10)

    def _reply(self, item: list) -> None:
        self._replies.append(item)
        self._wake()

    def _serve_ops(self) -> None:
        while True:
            op = self._ops.get()
            if op is None:
                return
            kind, env, gen = op
            try:
                if kind == "mark":
                    env.set()
                elif kind == "drop":
                    if self.generation(env) is None:
                        self.mgr.drop(env)
                elif kind == "save":
                    self._save(env, gen)
            except Exception:   # the thread must keep serving the next op
                log.exception("environment operation %s on %s failed", kind, env)

    def _save(self, env: str, gen: int) -> None:
        have = self.generation(env)
        if have != gen or not self.mgr.envs.has(env):
            self._reply([P.ENV_UNSAVED, env, gen, f"not held here at generation {gen} (held: {have})"])
            return
        deadline = time.monotonic() + _SAVE_WAIT_S
        while self._used(env) and time.monotonic() < deadline:
            time.sleep(0.05)   # an attempt killed a moment ago is still ending, or journaling
        try:
            path = self.mgr.snapshot(env, gen)
        except Exception as e:
            log.error("could not save environment %s: %s", env, e)
            self._reply([P.ENV_UNSAVED, env, gen, f"{type(e).__name__}: {e}"[:500]])
            return
        with self._lock:
            if self._gen.get(env) == gen:
                del self._gen[env]
        self.mgr.drop(env)
        self._reply([P.ENV_SAVED, env, gen, path])
