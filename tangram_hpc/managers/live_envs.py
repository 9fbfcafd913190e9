"""How a sandbox manager runs an environment's actions in its live session
(:mod:`tangram_hpc.managers.sessions`): starting the session with the manager's sandbox, mounting
each attempt's layer into it, running the command, and bringing it back between actions (*parked*:
frozen for certain, the layer settled) before anything else touches the environment.
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from .bwrap import SANDBOX_DIR, memfd
from .diskquota import QuotaWatch
from .environments import Environment
from .fs_inside import EnvError
from .limits import WRAPPER_ENVIRON, Limits, wrapper_argv
from .session_mounts import STACK_MAX, MountError
from .sessions import KEPT, STARTED, Session, SessionError, Spawn, server_limits

if TYPE_CHECKING:
    from .sandbox import SandboxManager

__all__ = ["LiveEnvs"]


class LiveEnvs:
    """The live-session side of one :class:`~tangram_hpc.managers.sandbox.SandboxManager`."""

    def __init__(self, mgr: "SandboxManager"):
        self.m = mgr

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
            if attempt is not None and session.mount_point is not None:
                sessions.mounts.mount_layer(session.proc.pid, session.mount_point, env.path, attempt)
                session.depth += 1
                session.layer_mounted = env.live_layer = True
        except MountError as exc:
            self.end(env.id, f"its layer could not be mounted ({exc})")
            raise
        session.thaw(cpus, limits.memory_mb, limits.nproc)
        scope = session.scope
        quota = QuotaWatch(env.path, limits.disk_mb, limits.disk_files, env.disk,
                           outside=self.m._held_outside(env, scope), layer=attempt / "upper" if attempt else None)
        mem_in_cgroup = scope is not None and scope.memory_dir is not None and bool(limits.memory_mb)
        environ = self.m._environ(SANDBOX_DIR, len(cpus) if cpus else 1, env)
        environ.update(extra_env)
        try:
            res = session.run(argv, environ, limits if not mem_in_cgroup else replace(limits, memory_mb=None), cpus, stdin,
                              cancel_fd, quota if quota.active else None)
        finally:
            session.freeze()
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
        from .sandbox import _join_cgroups
        scope = self.m.cgroups.scope(limits.memory_mb, limits.nproc, cpus, freezer=True) \
            if self.m.cgroups is not None else None
        uid = env.uid
        puid = uid if uid is not None else os.getuid()
        pgid = uid if uid is not None else os.getgid()
        fds = [memfd("passwd", f"sandbox:x:{puid}:{pgid}:sandbox:{SANDBOX_DIR}:/bin/sh\n"
                      "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"),
               memfd("group", f"sandbox:x:{pgid}:\nnogroup:x:65534:\n")]
        if self.m.seccomp_program is not None:
            fds.append(memfd("seccomp", self.m.seccomp_program))
        mount_point = None
        if self.m.unlayered_reason is None:
            mount_point = self.m.envs.root / ".live" / env.path.name
            mount_point.mkdir(parents=True, exist_ok=True)
        sandbox = self.m.layout.argv(mount_point or env.path, network=False, tmp_mb=limits.tmp_mb, passwd_fd=fds[0],
                                   group_fd=fds[1], seccomp_fd=fds[2] if len(fds) > 2 else None)
        sandbox += wrapper_argv(server_limits(limits), uid, uid, dict(WRAPPER_ENVIRON), sys.executable)
        prefix = _join_cgroups(scope) if scope is not None else []

        def close() -> None:
            for fd in fds:
                os.close(fd)
        try:
            return self.m.sessions.start(env.id, uid, Spawn(env.path, mount_point, sandbox, prefix, fds,
                                                          list(cpus) if cpus else None, close), scope)
        except SessionError:
            if scope is not None:
                self.m.cgroups.release(scope)
            raise

    def park(self, env: Environment) -> None:
        """Bring ``env``'s live session (if any) between actions: frozen for certain, the last
        attempt's layer taken away and settled.  Called holding the environment's turn."""
        if self.m.sessions is None:
            return
        session = self.m.sessions.get(env.id)
        if session is None:
            if env.live_layer:     # the session died meanwhile: its namespace went with it
                env.live_layer = False
            return
        if not session.layer_mounted:
            return
        if not session.wait_frozen():
            self.end(env.id, "its processes could not be frozen")
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

    def end(self, env_id: str, why: str) -> None:
        if self.m.sessions is None:
            return
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
