"""``SandboxManager``: runs ``sandbox`` actions of a CPU worker in isolated, stateful environments.

Payload of a ``sandbox`` action (all keys optional except ``cmd``)::

    {"cmd": "pytest -x" | ["python", "-c", "..."],   # str: run by /bin/sh -c
     "stdin": str | bytes | None,
     "environ": {"VAR": "value"},                     # added to the small clean environment
     "files": {"rel/path": str | bytes},              # written into the environment first
     "template": "name",                              # used only when the environment is created
     "network": False,                                # True needs allow_network on the manager
     "concurrent": False,                             # True: may run beside other actions of its env
     "limits": {"timeout_s": 30, "memory_mb": 2048, "nproc": 256, "cpu_s": 60,
                "output_bytes": 1048576, "output_kill_bytes": 67108864,
                "file_mb": 4096, "nofile": 4096, "tmp_mb": 512,
                "disk_mb": 10240, "disk_files": 1000000}}

(The environment *id* is the action's ``env``; ``environ`` holds variables.
Dynamic-loader variables such as ``LD_PRELOAD`` are refused.)

Output: ``{"returncode", "stdout", "stderr", "truncated", "wall_s", "cpu_time",
"max_rss_kb", "disk_used_mb", "enforced"}`` (stdout/stderr decoded as UTF-8
with errors replaced; ``cpu_time`` is user+system CPU seconds of the whole
process tree; ``enforced`` says which mechanism applied each limit).  A payload
with ``language`` and ``code`` is a SandboxFusion ``run_code`` request instead
(:mod:`tangram_hpc.managers.sandboxfusion`).

Status: ``ok`` when the command exits 0; ``failed`` when it exits non-zero,
is killed by a limit or floods its output (the output is still attached);
``timeout`` when its wall-clock limit killed it; ``error`` when it could not
be run at all (bad payload, no bubblewrap, environment creation failed).

Who runs what (root worker): bubblewrap (root) -> ``setpriv`` (root, only
CAP_SETUID/SETGID/SETPCAP, fixed environment) drops to the environment's uid
-> ``prlimit`` -> ``env -i`` with the command's variables -> the command.
Nothing a payload says reaches a step that still has root's uid.
"""
from __future__ import annotations

import logging
import os
import re
import resource
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from ..actions import ActionSpec, Status
from ..errors import TangramError
from . import sandboxfusion as sf
from .bwrap import SANDBOX_DIR, BwrapLayout, BwrapStatus, BwrapUnavailable, memfd, probe_bwrap
from . import seccomp
from .cgroups import Cgroups, CgroupScope
from .diskquota import QuotaWatch, held_outside
from . import env_layers
from .env_templates import UnknownTemplate
from .environments import EnvStore, Environment
from .fs_inside import EnvError
from .limits import WRAPPER_ENVIRON, Limits, LimitsError, command_environ, wrapper_argv
from .process import ProcResult, run_bounded
from .live_envs import LiveEnvs
from .sessions import KEPT, Sessions

__all__ = ["SandboxManager", "SandboxOutcome", "PayloadError", "BwrapUnavailable"]

log = logging.getLogger(__name__)

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Variables that make the dynamic loader or libc load code or read files they name (glibc's
#: "unsecure" list); refused in payloads.  A command may still export them for its own children.
_LOADER_VARS = frozenset({"GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN",
                          "LOCPATH", "MALLOC_TRACE", "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF",
                          "RES_OPTIONS"})
_PAYLOAD_KEYS = ("cmd", "stdin", "environ", "files", "template", "network", "limits", "concurrent")
#: The largest result a worker sends unless told otherwise (the coordinator's default ``max_output_bytes``).
RESULT_BYTES = 8 << 20
_unsafe_warned = False


class PayloadError(TangramError, ValueError):
    """A sandbox payload that does not follow the schema."""


@dataclass(slots=True)
class SandboxOutcome:
    status: str
    output: Any = None
    error: str | None = None


class _Ran(NamedTuple):
    res: ProcResult
    enforced: dict
    note: str | None
    disk_used_mb: float | None
    processes: str | None = None   # live sessions: "kept", "started", or why they were not kept


@dataclass(slots=True)
class _Request:
    argv: list[str]
    stdin: bytes | None
    environ: dict[str, str]
    files: dict[str, bytes | str]
    template: str | None
    network: bool
    limits: Mapping[str, Any] | None
    concurrent: bool = False


def parse_payload(p: Any) -> _Request:
    if not isinstance(p, Mapping):
        raise PayloadError("sandbox payload must be a map with a 'cmd'")
    if "env" in p:
        raise PayloadError("sandbox payload key 'env' is not accepted: environment variables go in "
                           "'environ' (the environment id is the action's env)")
    unknown = set(p) - set(_PAYLOAD_KEYS)
    if unknown:
        raise PayloadError(f"unknown sandbox payload keys {sorted(map(str, unknown))}; known: {list(_PAYLOAD_KEYS)}")
    cmd = p.get("cmd")
    if isinstance(cmd, str) and cmd:
        argv = ["/bin/sh", "-c", cmd]
    elif isinstance(cmd, (list, tuple)) and cmd and all(isinstance(a, str) for a in cmd):
        argv = list(cmd)
        if "=" in argv[0]:  # env(1) would read it as a variable assignment
            raise PayloadError(f"payload cmd[0] {argv[0]!r} must be a program, not contain '='")
    else:
        raise PayloadError("payload cmd must be a non-empty string or list of strings")
    if any("\0" in a for a in argv):
        raise PayloadError("payload cmd may not contain NUL bytes (no program can receive one)")
    stdin = p.get("stdin")
    if isinstance(stdin, str):
        stdin = stdin.encode()
    elif stdin is not None and not isinstance(stdin, (bytes, bytearray)):
        raise PayloadError("payload stdin must be str, bytes or None")
    environ = p.get("environ") or {}
    if not isinstance(environ, Mapping) or not all(
            isinstance(k, str) and _ENV_NAME.match(k) and isinstance(v, str) and "\0" not in v
            for k, v in environ.items()):
        raise PayloadError("payload environ must map variable names to strings")
    refused = sorted(k for k in environ if _is_loader_var(k))
    if refused:
        raise PayloadError(f"payload environ may not set {', '.join(refused)}: dynamic-loader variables "
                           f"(LD_*, {', '.join(sorted(_LOADER_VARS))}) are refused; a command may "
                           f"export them itself")
    files = p.get("files") or {}
    if not isinstance(files, Mapping) or not all(
            isinstance(k, str) and isinstance(v, (str, bytes, bytearray)) for k, v in files.items()):
        raise PayloadError("payload files must map relative paths to str or bytes")
    dirs = sorted(k for k in files if k.endswith("/") or "\0" in k)
    if dirs:
        raise PayloadError(f"payload files must name files, not directories or paths with NUL bytes: {dirs[:5]}")
    template = p.get("template")
    if template is not None and not isinstance(template, str):
        raise PayloadError("payload template must be a string")
    network = p.get("network", False)
    if not isinstance(network, bool):
        raise PayloadError("payload network must be a bool")
    concurrent = p.get("concurrent", False)
    if not isinstance(concurrent, bool):
        raise PayloadError("payload concurrent must be a bool")
    return _Request(argv, bytes(stdin) if stdin else None, dict(environ), dict(files), template,
                    network, p.get("limits"), concurrent)


def _is_loader_var(name: str) -> bool:
    return name.startswith("LD_") or name in _LOADER_VARS


class SandboxManager:
    """Runs sandbox actions of one CPU worker; safe to call from several executor threads.

    Parameters
    ----------
    root: directory holding this worker's environments (created; removed entries on close).
    snapshot_dir: where :meth:`snapshot` writes (a shared filesystem on a cluster).
    unsafe: run commands as plain subprocesses when bubblewrap is unusable
        (limits still apply; no filesystem, network or PID isolation).
    templates: name -> template (:mod:`tangram_hpc.managers.env_templates`) or config map
        ``{"kind": "tree", "source": "/path"}``; ``"empty"`` always exists.
    default_template: template of environments whose first action names none.
    env_ttl: seconds an idle environment is kept before :meth:`gc` removes it (None: forever).
    warm_pool: ready-made environments kept per template (0: none, no thread).
    default_limits: limits of an action whose payload does not override them.
    bwrap: path or name of the bubblewrap binary.
    allow_network: whether payloads may ask for ``network: True``.
    use_cgroups: create per-action cgroups where the worker may.
    extra_ro_binds: more host directories made visible read-only at the same path.
    seccomp: load the seccomp filter of :mod:`tangram_hpc.managers.seccomp` (no nested
        user namespaces, keyrings, bpf, io_uring, fallocate) into every sandbox.
    result_bytes: the largest result the worker can send (its ``max_output_bytes``): the
        output kept of each stream is at most an eighth of it, and ``fetch_files`` are
        checked against what is left of it from their sizes before any is read.
    transactional: run each attempt of an action in an environment against a layer of its
        own, committed once its outcome is journaled (:mod:`tangram_hpc.managers.env_layers`;
        needs root and overlayfs, else attempts run directly in the environment).
    sessions: give each environment a live session whose processes are kept, frozen, between
        its actions (:mod:`tangram_hpc.managers.sessions`; needs bubblewrap and a way to freeze:
        a freezer cgroup, else root for SIGSTOP).  Concurrent and network actions, ``run_code``
        and environment-less actions still get a sandbox of their own.
    session_idle_s: seconds an idle session is kept (None: until its environment goes).
    session_min_free_mb: below this much available memory, idle sessions are ended.
    session_prestart: sessions kept started ahead for new environments (:mod:`.session_pool`; 0: none).
    """

    def __init__(self, root: Path | str, snapshot_dir: Path | str | None = None, *,
                 unsafe: bool = False, templates: Mapping[str, Any] | None = None,
                 default_template: str = "empty", env_ttl: float | None = 3600.0,
                 warm_pool: int = 0, default_limits: Limits | None = None,
                 bwrap: str = "bwrap", allow_network: bool = False, use_cgroups: bool = True,
                 extra_ro_binds: tuple[str, ...] = (), seccomp: bool = True,
                 result_bytes: int = RESULT_BYTES, transactional: bool = True, sessions: bool = False,
                 session_idle_s: float | None = 600.0, session_min_free_mb: int = 1024, session_prestart: int = 0):
        self.root = Path(root)
        self.result_bytes = result_bytes
        self.snapshot_dir = Path(snapshot_dir) if snapshot_dir is not None else None
        self.default_limits = default_limits or Limits()
        self.allow_network = allow_network
        self.root_mode = os.geteuid() == 0
        path = bwrap if os.sep in bwrap else (shutil.which(bwrap) or bwrap)
        self.unavailable_reason = probe_bwrap(path)
        self.unsafe = unsafe and self.unavailable_reason is not None
        if self.unavailable_reason is not None:
            if unsafe:
                _warn_unsafe(self.unavailable_reason)
            self.layout = None
        else:
            self.layout = BwrapLayout(path, root_mode=self.root_mode, extra_ro=tuple(extra_ro_binds))
        self.cgroups = Cgroups.detect() if use_cgroups else None
        self.seccomp_program = _seccomp_program() if seccomp and self.layout is not None else None
        # As root, commands run as a per-environment uid so RLIMIT_NPROC binds.  Without bwrap
        # that uid must be able to reach the environment directory on the host.
        self.root.mkdir(parents=True, exist_ok=True)
        drop = self.root_mode and (self.layout is not None or _traversable(self.root))
        self.envs = EnvStore(self.root, templates or {}, default_template, env_ttl, warm_pool, drop)
        #: why attempts are not layered here (None: they are)
        self.unlayered_reason = ("turned off" if not transactional else "no bubblewrap" if self.layout is None
                                 else env_layers.overlay_supported())
        self.sessions: Sessions | None = None
        self.live = LiveEnvs(self)
        #: why environments get no live session here (None: they do)
        self.sessionless_reason = "turned off" if not sessions else "no bubblewrap" if self.layout is None else None
        if self.sessionless_reason is None:
            live = Sessions(self.cgroups, idle_s=session_idle_s, min_free_mb=session_min_free_mb,
                            layered=self.unlayered_reason is None)
            if live.available:
                self.sessions = live
            else:
                self.sessionless_reason = "no way to freeze a session here (no freezer cgroup, not root)"
        self.live.prestart(session_prestart)
        self._closed = False

    # -- public API ---------------------------------------------------------------
    @property
    def available(self) -> bool:
        """Whether sandbox actions can run (isolated, or unsafe by explicit choice)."""
        return self.layout is not None or self.unsafe

    @property
    def isolation(self) -> str:
        return "bwrap" if self.layout is not None else ("unsafe" if self.unsafe else "none")

    def session_status(self) -> dict:
        """Live sessions here, how they are frozen, or why there are none (for status)."""
        if self.sessions is None:
            return {"sessions": 0, "freezer": None, "off": self.sessionless_reason}
        return {**self.sessions.status(), "prestarted": self.live.pool.count() if self.live.pool is not None else 0}

    def processes_kept(self, env_id: str) -> bool:
        """Whether the last action of ``env_id`` ran beside processes its earlier actions left."""
        s = self.sessions.get(env_id) if self.sessions is not None else None
        return s is not None and s.last_state == KEPT

    def check(self) -> None:
        """Raise :class:`BwrapUnavailable` (with the fix) if actions cannot run."""
        if not self.available:
            raise BwrapUnavailable(self._refusal())

    def run(self, spec: ActionSpec, cpus: list[int] | tuple[int, ...] | None,
            cancel_fd: int | None = None) -> SandboxOutcome:
        """Run one sandbox action on exactly ``cpus``; never raises for the action's behaviour.

        Writing to ``cancel_fd`` (the read end is passed) kills the command's process tree.
        """
        if not self.available:
            return SandboxOutcome(Status.ERROR, None, self._refusal())
        try:
            if sf.is_run_code(spec.payload):
                return self._run_code(spec, cpus, cancel_fd)
            if sf.is_run_jupyter(spec.payload):
                return self._run_jupyter(spec, cpus, cancel_fd)
            req = parse_payload(spec.payload)
            limits = self._limits(spec, req.limits)
        except (PayloadError, LimitsError, sf.RunCodeError) as exc:
            return SandboxOutcome(Status.ERROR, None, f"bad sandbox payload: {exc}")
        if req.network and not self.allow_network:
            return SandboxOutcome(Status.ERROR, None,
                                  "payload asks for network but this worker does not allow it")
        try:
            env = self.envs.acquire(spec.env, req.template)
        except EnvError as exc:
            return SandboxOutcome(Status.ERROR, None, str(exc))
        live = (self.sessions is not None and not req.concurrent and not req.network and not env.throwaway)
        try:
            waited, attempt = self._begin(env, spec, cancel_fd, limits.timeout_s, req.concurrent, live)
        except (EnvError, OSError) as exc:
            self.envs.release(env)
            return SandboxOutcome(Status.ERROR, None, _unsettled(spec.env, exc))
        try:
            if waited is not None:
                return _not_its_turn(waited, limits)
            self.envs.write_files(env, req.files)
            if live:
                ran = self.live.exec(env, req.argv, req.stdin, req.environ, limits, cpus, cancel_fd, attempt)
            else:
                ran = self._exec(env, req.argv, req.stdin, req.environ, limits, cpus, req.network, cancel_fd,
                                 attempt)
        except (EnvError, OSError) as exc:
            return SandboxOutcome(Status.ERROR, None, f"sandbox could not run the command: {exc}")
        finally:
            refused = self._end(env, waited is None and not req.concurrent, attempt, spec.id)
            self.envs.release(env)
        res = ran.res
        out = {
            "returncode": res.returncode, "stdout": res.text("stdout"), "stderr": res.text("stderr"),
            "truncated": res.truncated, "wall_s": round(res.wall_s, 6),
            "cpu_time": None if res.cpu_time is None else round(res.cpu_time, 6),
            "max_rss_kb": res.max_rss_kb, "disk_used_mb": ran.disk_used_mb, "enforced": ran.enforced,
        }
        if ran.processes is not None:
            out["processes"] = ran.processes
        if refused is not None:
            return SandboxOutcome(Status.FAILED, out, refused)
        if res.cancelled:
            return SandboxOutcome(Status.CANCELLED, out, "cancelled while running; process tree killed")
        if res.timed_out:
            return SandboxOutcome(Status.TIMEOUT, out,
                                  f"timed out after {limits.timeout_s:g}s; process tree killed")
        if res.flooded:
            return SandboxOutcome(Status.FAILED, out, f"output flood: more than "
                                  f"{limits.output_kill_bytes} bytes of output; process tree killed")
        if res.stopped:
            return SandboxOutcome(Status.FAILED, out, res.stopped)
        if res.returncode != 0:
            return SandboxOutcome(Status.FAILED, out, ran.note or _exit_text(res.returncode))
        return SandboxOutcome(Status.OK, out, None)

    def finish_attempt(self, env_id: str, action_id: str) -> None:
        """The worker has journaled the outcome of ``action_id`` in ``env_id``, or never will: its
        attempt is committed if the journal holds it, else discarded, and the environment's next
        action may run."""
        try:
            env = self.envs.get(env_id)
        except EnvError:
            return
        self.envs.finish_attempt(env, action_id)
        self.live.ahead(env)

    def snapshot(self, env_id: str, generation: int = 0) -> str:
        """Save ``env_id`` and its journal to a tar.gz in ``snapshot_dir``; returns its path.

        Take it while no action runs in the environment (the coordinator waits for that).
        """
        if self.snapshot_dir is None:
            raise EnvError("this sandbox manager has no snapshot_dir")
        self.live.park_idle(self.envs.get(env_id))
        return self.envs.snapshot(env_id, self.snapshot_dir, generation)

    def restore(self, env_id: str, snapshot: str) -> None:
        """Recreate ``env_id`` here from a :meth:`snapshot` (of this or another worker)."""
        self.envs.restore(env_id, snapshot)

    def adopt(self, env_id: str, source_root: str) -> None:
        """Take ``env_id`` over from the environment root of a worker that died."""
        self.envs.adopt(env_id, source_root)

    def drop(self, env_id: str) -> bool:
        self.live.end(env_id, "its environment was dropped here", quiesce=True)
        return self.envs.drop(env_id)

    def environments(self) -> frozenset[str]:
        return self.envs.ids()

    def gc(self, now: float | None = None) -> list[str]:
        """Remove environments idle past the TTL (``now``: ``time.monotonic()``), and end the live
        sessions idle past theirs or while memory is short (their files stay)."""
        self.live.reclaim(now)
        return self.envs.gc(now)

    def close(self, keep: tuple[str, ...] | frozenset[str] = ()) -> None:
        """Remove the environments (those in ``keep`` stay on disk for another worker to adopt)."""
        if not self._closed:
            self._closed = True
            if self.sessions is not None:
                self.live.close()
                for env_id in list(self.sessions.live_ids()):
                    self.live.end(env_id, "the worker closed")
                self.sessions.close()
            self.envs.close(keep)
            if self.cgroups is not None:
                self.cgroups.sweep()

    def __enter__(self) -> "SandboxManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------
    def _refusal(self) -> str:
        return (f"sandbox actions refused: {self.unavailable_reason}. Install bubblewrap "
                f"(Debian/Ubuntu: apt-get install bubblewrap) and allow unprivileged user "
                f"namespaces, or run the worker with --unsafe-sandbox (SandboxManager(unsafe=True)) "
                f"to run commands without isolation")

    def _limits(self, spec: ActionSpec, overrides: Mapping[str, Any] | None) -> Limits:
        lim = self.default_limits
        if spec.demand.mem_mb:  # what the scheduler reserved for it; else the default cap
            lim = lim.merged({"memory_mb": spec.demand.mem_mb})
        if spec.timeout is not None:
            lim = lim.merged({"timeout_s": spec.timeout})
        lim = lim.merged(overrides)
        # Outputs are cut where they are read (two streams, two steps of a run_code): kept past
        # this, they would only make a result the worker cannot send.
        keep = max(1, self.result_bytes // 8)
        return lim if lim.output_bytes <= keep else lim.merged({"output_bytes": keep})

    def _begin(self, env: Environment, spec: ActionSpec, cancel_fd: int | None, timeout_s: float | None,
               concurrent: bool, live: bool = False) -> tuple[str | None, Path | None]:
        """Take ``env``'s turn (not for a concurrent action) and open the attempt's layer where attempts
        are layered (``live``: the action runs in the session, which may have it ready); returns (why
        the turn was not had, the attempt's directory)."""
        if concurrent:
            return None, None
        waited = self.envs.take_turn(env, cancel_fd, timeout_s)
        if waited is None:
            try:
                self.live.park(env, keep_ready=live)
            except BaseException as exc:    # its view may hold a layer not (all) in the environment
                self.live.end(env.id, f"it could not be brought between actions ({exc})")
                self.envs.give_turn(env)
                raise
        if waited is not None or self.unlayered_reason is not None or env.throwaway:
            return waited, None
        try:
            claimed = self.live.claim(env, spec.id) if live else None
            return None, claimed or self.envs.begin_attempt(env, spec.id)
        except BaseException:
            self.envs.give_turn(env)
            raise

    def _end(self, env: Environment, held: bool, attempt: Path | None, action_id: str) -> str | None:
        """After the command: a journaled attempt keeps the turn until its record or :meth:`finish_attempt`;
        any other is committed at once (nothing will journal it) and the turn given back.  One whose layer
        cannot be merged is discarded (its session, which has it mounted, ended first); returns why."""
        if not held:
            return None
        why = env_layers.check(attempt / "upper", env.path) if attempt is not None else None
        live = self.sessions.get(env.id) if env.live_layer and self.sessions is not None else None
        if why is None and live is not None and not self.envs.journaled:
            live.commit_on_park = True    # nothing will journal it: committed once the session is parked
            self.envs.give_turn(env)
            self.live.ahead(env)
            return None
        if why is None and attempt is not None and self.envs.journaled:
            env.awaiting_journal = action_id
            return None
        try:
            if why is not None:
                self.live.end(env.id, f"its attempt's changes were discarded ({why})")
                env_layers.discard(self.envs.attempt_path(env))
            elif attempt is not None:
                self.envs.settle(env, commit=True)
        finally:
            self.envs.give_turn(env)
        return None if why is None else f"{why}; they were discarded"

    def _exec(self, env: Environment, argv: list[str], stdin: bytes | None,
              extra_env: Mapping[str, str], limits: Limits, cpus, network: bool,
              cancel_fd: int | None = None, attempt: Path | None = None) -> _Ran:
        ncpus = len(cpus) if cpus else 1
        inside = self._quota_inside(env)
        environ = command_environ(inside, ncpus, env.path)
        environ.update(extra_env)
        uid = env.uid
        scope: CgroupScope | None = None
        if self.cgroups is not None:
            scope = self.cgroups.scope(limits.memory_mb, limits.nproc, cpus)
        quota = QuotaWatch(env.path, limits.disk_mb, limits.disk_files, env.disk,
                           outside=self._held_outside(env, scope), layer=attempt / "upper" if attempt else None)
        mem_in_cgroup = scope is not None and scope.memory_dir is not None and bool(limits.memory_mb)
        rl = limits if not mem_in_cgroup else _without_as(limits)
        cmd = wrapper_argv(rl, uid, uid, environ, sys.executable) + argv
        fds: list[int] = []
        status: BwrapStatus | None = None
        try:
            if self.layout is not None:
                puid = uid if uid is not None else os.getuid()
                pgid = uid if uid is not None else os.getgid()
                fds = [memfd("passwd", f"sandbox:x:{puid}:{pgid}:sandbox:{SANDBOX_DIR}:/bin/sh\n"
                              "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"),
                       memfd("group", f"sandbox:x:{pgid}:\nnogroup:x:65534:\n")]
                if self.seccomp_program is not None:
                    fds.append(memfd("seccomp", self.seccomp_program))
                seccomp_fd = fds[2] if len(fds) > 2 else None
                status = BwrapStatus()
                fds.append(status.write_fd)
                full = self.layout.argv(env.path, network=network, tmp_mb=limits.tmp_mb, passwd_fd=fds[0],
                                        group_fd=fds[1], seccomp_fd=seccomp_fd, status_fd=status.write_fd) + cmd
                popen_env, cwd = None, None
            else:
                full, popen_env, cwd = cmd, dict(WRAPPER_ENVIRON), str(env.path)
            if attempt is not None:
                full = env_layers.mount_argv(env.path, attempt) + full
            if scope is not None:
                full = _join_cgroups(scope) + full
            res = run_bounded(full, cpus=cpus, stdin=stdin, timeout=limits.timeout_s,
                              keep_bytes=limits.output_bytes, kill_bytes=limits.output_kill_bytes,
                              cwd=cwd, env=popen_env, pass_fds=fds,
                              on_kill=scope.kill if scope is not None else None, cancel_fd=cancel_fd,
                              watch=quota if quota.active else None,
                              on_exit=status.bwrap_exited if status is not None else None)
            if status is not None and res.returncode is not None and res.returncode < 0 \
                    and status.exit_code is not None:
                res.returncode = status.exit_code     # the command ended; bubblewrap was signalled after
            note = None
            peak = cpu = None
            if scope is not None:
                peak = scope.memory_peak_kb()
                cpu = scope.cpu_seconds()
                if res.returncode != 0 and scope.oom_killed():
                    note = (f"memory limit exceeded: {limits.memory_mb} MiB (cgroup); "
                            f"killed by the OOM killer")
                elif res.returncode != 0 and scope.pids_hit():
                    note = (f"process limit reached: nproc={limits.nproc} (pids cgroup); "
                            f"{_exit_text(res.returncode)}")
        finally:
            if scope is not None:
                self.cgroups.release(scope)
            for fd in fds:
                os.close(fd)
            if status is not None:
                status.close()
        if quota.active:
            # What it left behind, however fast it wrote it; walked also after a stop, so the next
            # action starts from what is there (one that cleans up must not be measured as growth).
            over = quota.check()
            if res.stopped is None:
                res.stopped = over
            env.disk = quota.measured
        # wait4's peak RSS cannot be told from the worker's own size at fork time
        # (the child starts as a copy of it); the cgroup's peak covers the whole tree.
        if peak is not None:
            res.max_rss_kb = peak
        elif res.max_rss_kb <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss:
            res.max_rss_kb = None
        if note is None and res.returncode != 0 and not res.timed_out:
            note = _hint(res, limits, mem_in_cgroup)
        # wait4 counts a descendant only once its parent reaped it: a tree killed at a limit is
        # not reaped inside the sandbox, and wait4 then reports bubblewrap's own few milliseconds.
        if cpu is not None:
            res.cpu_time = cpu
        elif res.timed_out or res.flooded or res.cancelled:
            res.cpu_time = None
        enforced = {
            "isolation": self.isolation,
            "memory": None if not limits.memory_mb else ("cgroup" if mem_in_cgroup else "rlimit_as"),
            "nproc": None if not limits.nproc else "+".join(
                x for x in ("cgroup" if scope is not None and scope.pids_dir is not None else "",
                            "rlimit" if uid is not None or not self.root_mode else "") if x) or None,
            "cpus": sorted(cpus) if cpus else None,
            "cpuset": scope is not None and scope.cpuset_dir is not None,
            "seccomp": self.seccomp_program is not None,
            "disk": "watched" if quota.active else None,
        }
        disk_mb = round(quota.last.mb, 3) if quota.active else None
        return _Ran(res, enforced, note, disk_mb)

    def _held_outside(self, env: Environment, scope: CgroupScope | None, deleted_first: int | None = None):
        """What counts against ``env``'s disk quota beside its tree (:func:`diskquota.held_outside`)."""
        return held_outside(lambda: self.envs.journal_bytes(env), env.uid, self._quota_inside(env),
                            scope.pids if scope is not None else None, deleted_first)

    def _quota_inside(self, env: Environment) -> str:
        """``env``'s directory as its commands see it (the paths of files they deleted start with it)."""
        return SANDBOX_DIR if self.layout is not None else str(env.path)

    def _run_jupyter(self, spec: ActionSpec, cpus, cancel_fd: int | None = None) -> SandboxOutcome:
        """Cells in the environment's kernel: its driver runs as the step of a run_code (:mod:`.pykernel`)."""
        req = sf.parse_run_jupyter(spec.payload)
        lim = self._limits(spec, None)
        out = self._run_code(spec, cpus, cancel_fd, req.driver(lim.output_bytes, lim.output_kill_bytes),
                             live=self.sessions is not None)   # the kernel lives on in the session
        return SandboxOutcome(out.status, req.response(out.output, out.error), out.error)

    def _run_code(self, spec: ActionSpec, cpus, cancel_fd: int | None = None,
                  req: sf.RunCodeRequest | None = None, live: bool = False) -> SandboxOutcome:
        req = req or sf.parse_run_code(spec.payload)
        base = self._limits(spec, {"memory_mb": req.memory_mb} if req.memory_mb else None)
        try:
            env = self.envs.acquire(spec.env, req.template)
        except UnknownTemplate as exc:
            raise sf.RunCodeError("template", str(exc), req.template) from None  # the request's mistake
        except EnvError as exc:
            return SandboxOutcome(Status.ERROR, sf.response(None, None, {}, str(exc)), str(exc))
        compile_result = run_result = None
        fetched: dict[str, bytes] = {}
        try:
            waited, attempt = self._begin(env, spec, cancel_fd, base.timeout_s, False)
        except (EnvError, OSError) as exc:
            self.envs.release(env)
            return SandboxOutcome(Status.ERROR, sf.response(None, None, {}, _unsettled(spec.env, exc)),
                                  _unsettled(spec.env, exc))
        try:
            if waited is not None:
                out = _not_its_turn(waited, base)
                return SandboxOutcome(out.status, sf.response(None, None, {}, out.error), out.error)
            files = dict(req.files)
            files[req.source_path()] = req.code.encode()
            self.envs.write_files(env, files)
            compile_argv, run_argv = req.argvs()

            def step(argv, stdin, timeout_s):
                lim = base.merged({"timeout_s": timeout_s})
                if live and not env.throwaway:
                    res = self.live.exec(env, argv, stdin, {}, lim, cpus, cancel_fd, attempt).res
                else:
                    res = self._exec(env, argv, stdin, {}, lim, cpus, False, cancel_fd, attempt).res
                return res, sf.command_result(res)

            ok = True
            if compile_argv is not None:
                res, compile_result = step(compile_argv, None, req.compile_timeout)
                if res.cancelled:
                    return SandboxOutcome(Status.CANCELLED, None, "cancelled while compiling")
                if res.stopped:
                    return _stopped(res.stopped, compile_result, None)
                ok = not res.timed_out and res.returncode == 0
            if ok:
                res, run_result = step(run_argv, req.stdin, req.run_timeout)
                if res.cancelled:
                    return SandboxOutcome(Status.CANCELLED, None, "cancelled while running")
                if res.stopped:
                    return _stopped(res.stopped, compile_result, run_result)
            fetched = sf.fetch_files(env.path, attempt, req.fetch_files, sf.response(compile_result, run_result, {}),
                                     self.result_bytes)
        except sf.FetchTooLarge as exc:
            return SandboxOutcome(Status.FAILED, sf.response(compile_result, run_result, {}, str(exc)), str(exc))
        except (EnvError, OSError) as exc:
            return SandboxOutcome(Status.ERROR, sf.response(compile_result, run_result, {}, str(exc)),
                                  str(exc))
        finally:
            refused = self._end(env, waited is None, attempt, spec.id)
            self.envs.release(env)
        return (SandboxOutcome(Status.OK, sf.response(compile_result, run_result, fetched)) if refused is None
                else SandboxOutcome(Status.FAILED, sf.response(compile_result, run_result, {}, refused), refused))


def _unsettled(env_id: str | None, exc: BaseException) -> str:
    return f"environment {env_id!r}: the attempt before this one could not be settled: {exc}"


def _not_its_turn(why: str, limits: Limits) -> SandboxOutcome:
    if why == "cancelled":
        return SandboxOutcome(Status.CANCELLED, None, "cancelled while waiting for the action before it "
                              "in its environment")
    return SandboxOutcome(Status.TIMEOUT, None, f"timed out after {limits.timeout_s:g}s waiting for the "
                          f"action before it in its environment (actions of one environment run one at "
                          f"a time unless their payload says concurrent)")


def _stopped(reason: str, compile_result: dict | None, run_result: dict | None) -> SandboxOutcome:
    # A limit the response has no field for (the disk quota): its message says which.
    return SandboxOutcome(Status.FAILED, sf.response(compile_result, run_result, {}, reason), reason)


def _without_as(limits: Limits) -> Limits:
    # The cgroup bounds memory use of the whole tree; RLIMIT_AS would also count
    # reserved-but-unused address space and break runtimes that reserve a lot.
    from dataclasses import replace
    return replace(limits, memory_mb=None)


def _join_cgroups(scope: CgroupScope) -> list[str]:
    """argv prefix that moves itself into ``scope``'s cgroups, then execs the rest (nothing runs in
    the threaded worker between fork and exec)."""
    return ["/bin/sh", "-c", 'for f in ' + " ".join(f"'{p}'" for p in scope.procs_files)
            + '; do echo $$ > "$f" || exit 126; done; exec "$@"', "sh"]


def _seccomp_program() -> bytes | None:
    prog = seccomp.program()
    if prog is None:
        log.warning("no seccomp filter for this CPU architecture: sandboxes may create nested user namespaces")
    return prog


def _traversable(path: Path) -> bool:
    p = path.resolve()
    for d in [p, *p.parents]:
        if not os.stat(d).st_mode & 0o001:
            return False
    return True


def _exit_text(rc: int | None) -> str:
    if rc is None:
        return "no exit status"
    if rc < 0:
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    if rc > 128 and rc - 128 < 65:
        try:
            return f"exit code {rc} (signal {signal.Signals(rc - 128).name})"
        except ValueError:
            pass
    return f"exit code {rc}"


def _hint(res: ProcResult, limits: Limits, mem_in_cgroup: bool) -> str:
    text = _exit_text(res.returncode)
    tail = res.stderr[-4096:] + b"\n" + res.stdout[-4096:]
    if limits.memory_mb and not mem_in_cgroup and any(
            s in tail for s in (b"MemoryError", b"Cannot allocate memory", b"bad_alloc", b"out of memory")):
        return f"{text}; memory limit of {limits.memory_mb} MiB (RLIMIT_AS) hit"
    if limits.nproc and any(s in tail for s in (b"Resource temporarily unavailable", b"fork: retry",
                                                   b"can't start new thread", b"BlockingIOError")):
        return f"{text}; process limit nproc={limits.nproc} hit"
    # The kernel enforces RLIMIT_CPU on its own tick-based clock, and the rusage we get back
    # reads 10-20% lower, so a kill at well over half the limit counts as the limit.
    if limits.cpu_s and res.returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU, -9, 137) \
            and res.cpu_time is not None and res.cpu_time >= limits.cpu_s * 0.5:
        return f"{text}; CPU time limit of {limits.cpu_s}s hit"
    return text


def _warn_unsafe(reason: str) -> None:
    global _unsafe_warned
    if not _unsafe_warned:
        _unsafe_warned = True
        msg = (f"UNSAFE SANDBOX MODE: {reason}. Sandbox commands will run as plain subprocesses "
               f"with NO filesystem, network or process isolation (limits still apply). Never "
               f"run untrusted model-written code like this.")
        log.warning(msg)
        print(f"WARNING: {msg}", file=sys.stderr)
