"""How a sandbox manager runs an environment's actions in its live session
(:mod:`tangram_hpc.managers.sessions`): starting the session with the manager's sandbox, mounting
each attempt's layer into it, running the command, and bringing it back between actions (*parked*:
frozen for certain, the layer settled) before anything else touches the environment.

A layer costs a few directories and an overlay mount (~2 ms on the development machine's disk,
most of an action in a session), so it is made *ahead*: when an action's turn is given back, one
long-lived thread takes the turn if no one else has it, parks the session and mounts an empty layer
for the next attempt (owned by no action: discarded if settled so).  The next action claims it by
writing its id into it and runs at once; anything else that touches the environment first
discards it.  Nothing runs in it before it is claimed: the session is frozen for certain first.
A finished layer its action left untouched (:func:`~tangram_hpc.managers.env_layers.untouched`) is
not settled but kept, mounted, for the next attempt the same way.  In a worker (:attr:`LiveEnvs.after_reply`)
that thread also asks for the freeze, once the action's outcome is sent.
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from . import env_layers
from .bwrap import SANDBOX_DIR, memfd
from .diskquota import QuotaWatch, held_deleted
from .environments import Environment
from .fs_inside import EnvError
from .limits import WRAPPER_ENVIRON, Limits, command_environ, wrapper_argv
from .session_mounts import STACK_MAX, MountError
from .sessions import KEPT, STARTED, Session, SessionError, Spawn, server_limits
from .session_pool import SessionPool

if TYPE_CHECKING:
    from .sandbox import SandboxManager

__all__ = ["LiveEnvs"]

log = logging.getLogger(__name__)


class LiveEnvs:
    """The live-session side of one :class:`~tangram_hpc.managers.sandbox.SandboxManager`."""

    def __init__(self, mgr: "SandboxManager"):
        self.m = mgr
        self._ahead: queue.SimpleQueue | None = None
        self._ahead_thread: threading.Thread | None = None
        self._ahead_lock = threading.Lock()
        self._ahead_idle = threading.Condition(self._ahead_lock)
        self._ahead_pending = 0
        #: Set by a worker that calls :meth:`replied` once it has sent an action's outcome: the session
        #: is then frozen, and the next layer made, after the reply (off the action's round trip).
        self.after_reply = False
        self._replied: list[str] = []      # environments waiting for :meth:`replied`
        #: sessions started ahead for new environments (None: none are; see :meth:`prestart`)
        self.pool: SessionPool | None = None

    def prestart(self, size: int) -> None:
        """Keep ``size`` sessions started ahead for new environments (0: none)."""
        if size > 0 and self.m.sessions is not None and self.m.unlayered_reason is None:
            self.pool = SessionPool(self, size)
            self.pool.kick()

    def exec(self, env: Environment, argv: list[str], stdin: bytes | None, extra_env: Mapping[str, str],
             limits: Limits, cpus, cancel_fd: int | None, attempt: Path | None):
        """Run the command in ``env``'s live session (started first if it has none), its attempt's layer
        mounted into it; the session is frozen again when the command exits."""
        from .sandbox import _Ran, _exit_text, _hint
        sessions = self.m.sessions
        session = sessions.get(env.id)
        state = KEPT
        if session is None:
            why = sessions.lost(env.id)
            session = self.start(env, limits, cpus)
            state = STARTED if why is None else f"not kept: {why}"
        session.last_state = state
        try:
            # mounted already: claimed (made ahead), or an earlier step of this attempt (run_code)
            if attempt is not None and session.mount_point is not None and not session.layer_mounted:
                sessions.mounts.mount_layer(session.proc.pid, session.mount_point, env.path, attempt)
                session.depth += 1
                session.layer_mounted = env.live_layer = True
        except MountError as exc:
            self.end(env.id, f"its layer could not be mounted ({exc})")
            raise
        session.thaw(cpus, limits.memory_mb, limits.nproc)
        scope = session.scope
        deleted, session.held_deleted = session.held_deleted, None
        quota = QuotaWatch(env.path, limits.disk_mb, limits.disk_files, env.disk,
                           outside=self.m._held_outside(env, scope, deleted),
                           layer=attempt / "upper" if attempt else None)
        mem_in_cgroup = scope is not None and scope.memory_dir is not None and bool(limits.memory_mb)
        environ = command_environ(SANDBOX_DIR, len(cpus) if cpus else 1, env.path)
        environ.update(extra_env)
        try:
            res = session.run(argv, environ, limits if not mem_in_cgroup else replace(limits, memory_mb=None), cpus, stdin,
                              cancel_fd, quota if quota.active else None)
        finally:
            if not self.after_reply or session.dead is not None:
                session.freeze()
            else:
                self._wait_reply(env.id)
            if session.dead is not None:
                # its processes and its mount namespace are gone: the attempt is settled as usual
                sessions.forget(env.id, session.dead)
                env.live_layer = False
        note = None
        if scope is not None and res.returncode != 0:
            if scope.oom_killed():
                note = f"memory limit exceeded: {limits.memory_mb} MiB (cgroup); killed by the OOM killer"
            elif scope.pids_hit():
                note = f"process limit reached: nproc={limits.nproc} (pids cgroup); {_exit_text(res.returncode)}"
        if quota.active:
            over = quota.check()
            if res.stopped is None:
                res.stopped = over
            env.disk = quota.measured
        if note is None and res.returncode != 0 and not res.timed_out:
            note = _hint(res, limits, mem_in_cgroup)
        enforced = {
            "isolation": self.m.isolation, "session": session.freezer,
            "memory": None if not limits.memory_mb else ("cgroup" if mem_in_cgroup else "rlimit_as"),
            "nproc": None if not limits.nproc else "+".join(
                x for x in ("cgroup" if scope is not None and scope.pids_dir is not None else "",
                            "rlimit" if env.uid is not None else "") if x) or None,
            "cpus": sorted(cpus) if cpus else None,
            "cpuset": scope is not None and scope.cpuset_dir is not None,
            "seccomp": self.m.seccomp_program is not None,
            "disk": "watched" if quota.active else None,
        }
        return _Ran(res, enforced, note, round(quota.last.mb, 3) if quota.active else None, state)

    def start(self, env: Environment, limits: Limits, cpus) -> Session:
        """``env``'s new session: a pre-started one it can claim (:mod:`.session_pool`), else one
        started now."""
        if self.pool is not None:
            session = self.pool.claim(env, limits)
            if session is not None:
                return session
        mount_point = None
        if self.m.unlayered_reason is None:
            mount_point = self.m.envs.root / ".live" / env.path.name
            mount_point.mkdir(parents=True, exist_ok=True)
        return self.launch(env.id, env.uid, env.path, mount_point, limits, cpus)

    def launch(self, name: str, uid: int | None, env_dir: Path, mount_point: Path | None, limits: Limits, cpus,
               register: bool = True) -> Session:
        """Start a session as ``uid`` whose ``/sandbox`` is ``env_dir`` (bound shared at ``mount_point``
        when attempts are layered); ``register``: as the session of environment ``name``."""
        from .sandbox import _join_cgroups
        scope = self.m.cgroups.scope(limits.memory_mb, limits.nproc, cpus, freezer=True) \
            if self.m.cgroups is not None else None
        puid = uid if uid is not None else os.getuid()
        pgid = uid if uid is not None else os.getgid()
        fds = [memfd("passwd", f"sandbox:x:{puid}:{pgid}:sandbox:{SANDBOX_DIR}:/bin/sh\n"
                      "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"),
               memfd("group", f"sandbox:x:{pgid}:\nnogroup:x:65534:\n")]
        if self.m.seccomp_program is not None:
            fds.append(memfd("seccomp", self.m.seccomp_program))
        sandbox = self.m.layout.argv(mount_point or env_dir, network=False, tmp_mb=limits.tmp_mb, passwd_fd=fds[0],
                                     group_fd=fds[1], seccomp_fd=fds[2] if len(fds) > 2 else None)
        sandbox += wrapper_argv(server_limits(limits), uid, uid, dict(WRAPPER_ENVIRON), sys.executable)
        prefix = _join_cgroups(scope) if scope is not None else []

        def close() -> None:
            for fd in fds:
                os.close(fd)
        try:
            return self.m.sessions.start(name, uid, Spawn(env_dir, mount_point, sandbox, prefix, fds,
                                                          list(cpus) if cpus else None, close), scope,
                                         register=register)
        except SessionError:
            if scope is not None:
                self.m.cgroups.release(scope)
            raise

    def park(self, env: Environment, keep_ready: bool = False) -> None:
        """Bring ``env``'s live session (if any) between actions: frozen for certain, the last
        attempt's layer taken away and settled; a layer made ahead is discarded unless
        ``keep_ready`` (the next action will :meth:`claim` it), and with ``keep_ready`` a last layer
        left untouched is kept for it instead of settled.  Called holding the environment's turn."""
        if self.m.sessions is None:
            return
        session = self.m.sessions.get(env.id)
        if session is None:
            if env.live_layer:     # the session died meanwhile: its namespace went with it
                env.live_layer = False
            return
        session.freeze()           # asked for after the reply (after_reply), and this came first
        if session.layer_ready:
            if not keep_ready:     # owned by no action: discarded, left mounted as any settled layer
                session.layer_ready = env.live_layer = False
                self.m.envs.settle(env)
            return
        if not session.layer_mounted:
            return
        if not session.wait_frozen():
            self.end(env.id, "its processes could not be frozen")
        elif env.uid is not None and session.dead is None:
            # Frozen, its processes can neither open, delete nor close a file until the next action's
            # thaw: measured now, off the action's path, it is exactly what they hold at that start.
            session.held_deleted = held_deleted(env.uid, self.m._quota_inside(env),
                                                session.scope.pids() if session.scope is not None else None)
        attempt = self.m.envs.attempt_path(env)
        if keep_ready and session.dead is None and env_layers.untouched(attempt, env.path):
            # Nothing to merge: the layer stays mounted for the next attempt, owned by no action (as one
            # made ahead), which spares a settle, a new layer and its mount.
            env_layers.unclaim(attempt)
            session.layer_mounted, session.layer_ready, session.commit_on_park = False, True, False
            return
        # Settled under the layer still mounted (frozen: nothing uses it; the next attempt's layer
        # goes on top of it): see session_mounts for why it is not unmounted each time.
        session.layer_mounted = env.live_layer = False
        commit, session.commit_on_park = session.commit_on_park, False
        self.m.envs.settle(env, commit=commit)
        if session.dead is None and session.depth >= STACK_MAX:
            try:
                self.m.sessions.mounts.unmount_stack(session.proc.pid)
                session.depth = 0
            except MountError as exc:
                self.end(env.id, f"its layers could not be unmounted ({exc})")

    def claim(self, env: Environment, action_id: str) -> Path | None:
        """The layer made ahead for ``env``'s next attempt, now ``action_id``'s (None: there is none;
        the attempt gets a layer of its own).  Called holding the turn, after ``park(keep_ready=True)``."""
        session = self.m.sessions.get(env.id) if self.m.sessions is not None else None
        if session is None or not session.layer_ready:
            return None
        attempt = self.m.envs.attempt_path(env)
        try:
            env_layers.claim(attempt, action_id)
        except OSError:
            self.park(env)       # discarded: the attempt is prepared as usual
            return None
        session.layer_ready = False
        session.layer_mounted = env.live_layer = True   # the attempt's layer from now on, settled as any
        return attempt

    def ahead(self, env: Environment) -> None:
        """``env``'s turn was just given back: freeze its session if that waits (:attr:`after_reply`) and
        make its next attempt's layer, in the background (with :attr:`after_reply`, once :meth:`replied`)."""
        if self.pool is not None:
            self.pool.kick_if_short()
        if self.m.sessions is None:
            return
        session = self.m.sessions.get(env.id)
        if session is None or (session.frozen and not self._layered(env, session)):
            return
        if self.after_reply:
            self._wait_reply(env.id)
            return
        with self._ahead_lock:
            self._queue(env.id)

    def _wait_reply(self, env_id: str) -> None:
        with self._ahead_lock:
            self._replied.append(env_id)

    def replied(self) -> None:
        """The worker has sent the outcomes of the actions finished so far (:attr:`after_reply`): their
        sessions are frozen and their next layers made now."""
        if not self._replied:
            return
        with self._ahead_lock:
            waiting, self._replied = self._replied, []
            for env_id in dict.fromkeys(waiting):
                self._queue(env_id)

    def _layered(self, env: Environment, session: Session) -> bool:
        """Whether ``env``'s next attempt gets a layer made ahead."""
        return self.m.unlayered_reason is None and not env.throwaway and session.mount_point is not None \
            and not session.layer_ready

    def _queue(self, env_id: str) -> None:
        """Hand ``env_id`` to the thread that parks sessions ahead (holding ``_ahead_lock``)."""
        if self._ahead_thread is None:
            self._ahead = queue.SimpleQueue()
            self._ahead_thread = threading.Thread(target=self._serve_ahead, name="session-ahead", daemon=True)
            self._ahead_thread.start()
        assert self._ahead is not None
        self._ahead_pending += 1
        self._ahead.put(env_id)

    def quiesce(self, timeout: float = 30.0) -> None:
        """Wait until no layer is being made ahead (before a reclaim or a drop, which take no turn)."""
        with self._ahead_idle:
            self._ahead_idle.wait_for(lambda: self._ahead_pending == 0, timeout)

    def _serve_ahead(self) -> None:
        assert self._ahead is not None
        while (env_id := self._ahead.get()) is not None:
            try:
                self._ahead_one(env_id)
            finally:
                with self._ahead_idle:
                    self._ahead_pending -= 1
                    self._ahead_idle.notify_all()

    def _ahead_one(self, env_id: str) -> None:
        try:
            env = self.m.envs.get(env_id)
        except EnvError:
            return
        if not env.turn.acquire(blocking=False):
            return           # an action or a save has it: it parks the session itself
        try:
            self._make_ready(env)
        except Exception:    # the next action makes its layer itself
            log.exception("layer ahead for environment %s", env_id)
        finally:
            self.m.envs.give_turn(env)

    def _make_ready(self, env: Environment) -> None:
        self.park(env, keep_ready=True)
        sessions = self.m.sessions
        session = sessions.get(env.id) if sessions is not None else None
        if session is None or session.dead is not None or not self._layered(env, session) or env.live_layer:
            return
        attempt = self.m.envs.attempt_path(env)
        if os.path.lexists(attempt):
            self.m.envs.settle(env)
            if os.path.lexists(attempt):
                return
        env_layers.prepare(attempt, env.path, "")
        try:
            sessions.mounts.mount_layer(session.proc.pid, session.mount_point, env.path, attempt)
        except MountError as exc:
            self.m.envs.settle(env)
            self.end(env.id, f"its layer could not be mounted ({exc})")
            return
        session.depth += 1
        session.layer_ready = env.live_layer = True

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        with self._ahead_lock:
            thread, self._ahead_thread = self._ahead_thread, None
            if thread is not None and self._ahead is not None:
                self._ahead.put(None)
        if thread is not None:
            thread.join(timeout=30)

    def park_idle(self, env: Environment) -> None:
        """:meth:`park` from outside an action (a save): under the environment's turn, which a layer
        being made ahead holds for a moment (taken anyway after 30 s: the caller has no action running)."""
        if self.m.sessions is None:
            return
        held = self.m.envs.take_turn(env, None, 30.0) is None
        try:
            self.park(env)
        finally:
            if held:
                self.m.envs.give_turn(env)

    def reclaim(self, now: float | None = None) -> None:
        """End the sessions idle past their time, while memory is short, or of an environment idle
        past its TTL (``now``: ``time.monotonic()``); their files stay."""
        sessions = self.m.sessions
        if sessions is None:
            return
        self.quiesce()
        if self.pool is not None:     # the unclaimed first: no one's processes are lost with them
            self.pool.reclaim(now)
        for env_id, why in sessions.to_reclaim(now, busy=self.busy):
            self.end(env_id, why)
        ttl = self.m.envs.ttl
        t = time.monotonic() if now is None else now
        for env_id in list(sessions.live_ids()):
            try:
                env = self.m.envs.get(env_id)
            except EnvError:
                continue
            if ttl is not None and env.busy == 0 and t - env.last_used > ttl:
                self.end(env_id, "its environment expired")

    def end(self, env_id: str, why: str, quiesce: bool = False) -> None:
        """End ``env_id``'s session (``quiesce``: once no layer is being made ahead, for a caller
        without the environment's turn)."""
        if self.m.sessions is None:
            return
        if quiesce:
            if self.m.sessions.get(env_id) is None:
                return      # no layer is made ahead without a session: a new environment waits for no other's
            self.quiesce()
        session = self.m.sessions.get(env_id)
        if session is None:
            return
        self.m.sessions.forget(env_id, why)
        if session.scope is not None:
            self.m.cgroups.release(session.scope)
        self.settle_dead(env_id, session)

    def settle_dead(self, env_id: str, session: Session | None = None) -> None:
        """A session ended outside an action: its layer, if one was mounted, is settled."""
        try:
            env = self.m.envs.get(env_id)
        except EnvError:
            return
        if env.live_layer:
            env.live_layer = False
            commit = session is not None and session.commit_on_park
            if env.turn.acquire(blocking=False):
                try:
                    self.m.envs.settle(env, commit=commit)
                finally:
                    self.m.envs.give_turn(env)

    def busy(self, env_id: str) -> bool:
        try:
            env = self.m.envs.get(env_id)
        except EnvError:
            return False
        return env.busy > 0 or env.turn.locked()
