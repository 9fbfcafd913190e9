"""Pre-started live sessions: a new environment's first action claims a session already running.

Starting a session (:mod:`tangram_hpc.managers.sessions`) costs bubblewrap, its namespaces, the
seccomp filter, the cgroups, the uid drop and an interpreter for the exec server: most of a new
environment's first action.  So a worker keeps a few sessions started for *no* environment: their
``/sandbox`` is an empty directory of their own (``<root>/.live/.pre-<hex>``, bound shared in the
session's mount namespace as an environment's directory would be), nothing has run in them and
nothing will until they are claimed.  A new environment's first action claims one and gets its
files the way every attempt in a session gets them: the mount helper
(:mod:`tangram_hpc.managers.session_mounts`) mounts the attempt's overlay, whose lower layer is
the environment's directory, on that mount point, and it appears at ``/sandbox`` inside.  The
cgroup limits and cores are the action's (set at the thaw, as for every action of a session).

**Uids.**  As root each environment runs as a uid of its own, and a process cannot change its uid
once it has dropped privileges, so a session is started per uid: the pool reserves a uid, starts a
session as it, then *offers* the uid (:meth:`EnvBuilds.offer_uid`): the next environment made on
this worker gets it (and its files are owned by it), so its first action finds a session running
as its own uid.  A session is claimed only by an environment of its uid, and only if its own
rlimits and ``/tmp`` size (set when it started, from the worker's default limits) are the
action's; otherwise the environment starts a session of its own as before.  An unclaimed session
has run nothing and has seen no environment's files, so which environment of that uid claims it
makes no difference to anyone.

**Cost to others.**  A replacement is started on this module's own thread, never on an action's
path, and only while no sandbox action runs on the worker (so it takes no cores an action was
granted; the worker's function actions are not seen here).  None is started while memory is short
(``min_free_mb``), and under memory pressure the unclaimed ones go first.  A session offered but
never claimed (its environment ran no action in a session, or went) is ended by the next reclaim
once its uid is no environment's, or ``idle_s`` after it started.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from .environments import Environment
from .limits import Limits
from .sessions import Session, SessionError, _available_mb

if TYPE_CHECKING:
    from .live_envs import LiveEnvs

__all__ = ["SessionPool"]

log = logging.getLogger(__name__)

_RETRY_S = 5.0      # after a failed start
_BUSY_S = 0.5       # a deficit looked at again while sandbox actions run (each one ending kicks too)


def _key(limits: Limits) -> tuple:
    """What a session fixes when it starts and an action may not change: the exec server's rlimits
    (descriptors, processes, file size) and the size of its ``/tmp``."""
    file_mb = min((x for x in (limits.file_mb, limits.disk_mb) if x), default=None)
    return limits.nofile, limits.nproc, file_mb, limits.tmp_mb


class SessionPool:
    """The pre-started sessions of one :class:`~tangram_hpc.managers.live_envs.LiveEnvs` (thread-safe)."""

    def __init__(self, live: "LiveEnvs", size: int):
        self.live = live
        self.size = size
        self._ready: list[tuple[Session, tuple]] = []     # started, unclaimed, with their key
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._retry_at = 0.0
        self.claimed = 0       # sessions claimed by environments (observability, tests)
        self.started = 0       # sessions pre-started

    def count(self) -> int:
        with self._cond:
            return len(self._ready)

    def unclaimed(self) -> list[Session]:
        with self._cond:
            return [s for s, _ in self._ready]

    def kick(self) -> None:
        """Top the pool up in the background (if it lacks any)."""
        with self._cond:
            if self._closed or self.size <= 0:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="session-prestart", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def kick_if_short(self) -> None:
        """:meth:`kick` if the pool lacks a session (called when an action's turn is given back: in
        the steady state of existing environments nothing is woken)."""
        with self._cond:
            short = not self._closed and self._spare() < self.size
        if short:
            self.kick()

    def wait_full(self, timeout: float) -> bool:
        """Wait until the pool holds ``size`` sessions no environment has been offered (tests)."""
        self.kick()
        with self._cond:
            return self._cond.wait_for(lambda: self._spare() >= self.size or self._closed, timeout)

    def claim(self, env: Environment, limits: Limits) -> Session | None:
        """A pre-started session running as ``env``'s uid and started under ``limits``' fixed part,
        now ``env``'s; None if there is none."""
        key = _key(limits)
        with self._cond:
            found = next((i for i, (s, k) in enumerate(self._ready) if s.uid == env.uid and k == key), None)
            session = self._ready.pop(found)[0] if found is not None else None
        if session is not None and (session.dead is not None or session.proc.poll() is not None):
            self._discard(session, session.dead or "its exec server exited before it was claimed")
            session = None
        if session is not None:
            self.live.m.sessions.adopt(env.id, session)
            self.claimed += 1
        return session     # replaced once the action is over (kick_if_short), not on its path

    # -- keeping it full -------------------------------------------------------------------
    def _spare(self) -> int:
        """Unclaimed sessions whose uid is not yet any environment's (under the lock)."""
        builds = self.live.m.envs.builds
        return sum(1 for s, _ in self._ready if s.uid is None or builds.spare(s.uid))

    def _wait_s(self) -> float | None:
        """How long to wait before starting one more session (0: now; None: until a kick), under the lock."""
        if self._spare() >= self.size or len(self._ready) >= 2 * self.size:
            return None
        now = time.monotonic()
        if now < self._retry_at:
            return self._retry_at - now
        if _available_mb() < self.live.m.sessions.min_free_mb:
            return _RETRY_S
        if self.live.m.envs.active:     # sandbox actions run: their cores are theirs
            return _BUSY_S
        return 0

    def _serve(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    wait = self._wait_s()
                    if wait == 0:
                        break
                    self._cond.wait(wait)
            try:
                self._start_one()
            except Exception as exc:    # the pool is an optimisation: new environments start their own meanwhile
                log.warning("could not pre-start a live session (%s); retrying in %.0fs", exc, _RETRY_S)
                with self._cond:
                    self._retry_at = time.monotonic() + _RETRY_S

    def _start_one(self) -> None:
        m = self.live.m
        builds = m.envs.builds
        uid = builds.reserve_uid()
        mount_point = m.envs.root / ".live" / f".pre-{os.urandom(6).hex()}"
        session: Session | None = None
        try:
            mount_point.mkdir(parents=True)
            # the worker's cores for now (so the session has a cpuset); the action's at the claim
            session = self.live.launch(mount_point.name, uid, mount_point, mount_point, m.default_limits,
                                       sorted(os.sched_getaffinity(0)), register=False)
            # one command first, in the empty /sandbox: the server's first one took 3.2 ms against
            # 1.4 ms for later ones (its code paths run once, the namespace's first exec)
            lim = m.default_limits
            if session.scope is not None and session.scope.memory_dir is not None:
                lim = replace(lim, memory_mb=None)     # as an action's: its memory is the cgroup's
            warm = session.run(["true"], {"PATH": "/usr/bin:/bin"}, lim, None, None, None)
            if warm.returncode != 0:
                raise SessionError(f"a pre-started session could not run true: {warm.stderr[-200:]!r}")
            session.actions = 0
        except BaseException:
            if session is not None:
                self._discard(session, "it could not be made ready")
            builds.free_uid(uid)
            try:
                mount_point.rmdir()
            except OSError:
                pass
            raise
        with self._cond:
            closed = self._closed
            if not closed:
                self._ready.append((session, _key(m.default_limits)))
                if uid is not None:
                    builds.offer_uid(uid)
                self.started += 1
                self._cond.notify_all()
        if closed:
            self._discard(session, "the worker closed")
            builds.free_uid(uid)

    # -- ending them -------------------------------------------------------------------------
    def _discard(self, session: Session, why: str) -> None:
        self.live.m.sessions.end(session, why)
        if session.scope is not None and self.live.m.cgroups is not None:
            self.live.m.cgroups.release(session.scope)

    def reclaim(self, now: float | None = None) -> None:
        """End the unclaimed sessions no environment will claim (their uid is no one's, or idle past
        the sessions' ``idle_s``), and all of them while memory is short."""
        m = self.live.m
        sessions = m.sessions
        builds = m.envs.builds
        now = time.monotonic() if now is None else now
        short = _available_mb() < sessions.min_free_mb
        with self._cond:
            # offered to an environment (its uid no longer spare) that has not claimed it in idle_s
            gone = [(s, k) for s, k in self._ready
                    if short or s.dead is not None or (s.uid is not None and not builds.uid_held(s.uid))
                    or (s.uid is not None and not builds.spare(s.uid) and sessions.idle_s is not None
                        and now - s.last_used > sessions.idle_s)]
            for entry in gone:
                self._ready.remove(entry)
        for s, _ in gone:
            builds.withdraw_uid(s.uid)
            self._discard(s, "reclaimed under memory pressure" if short else "reclaimed unclaimed")
        if not short:
            self.kick()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            ready, self._ready = self._ready, []
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout=60)
        for s, _ in ready:
            self.live.m.envs.builds.withdraw_uid(s.uid)
            self._discard(s, "the worker closed")
