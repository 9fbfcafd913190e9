"""Per-action resource limits of a sandboxed command.

Limits are applied *inside* the child, never in the worker: the command is
started through a tiny exec chain (util-linux ``setpriv`` and ``prlimit``,
or a few lines of Python where those are missing) that drops to the
environment's uid when the worker is root, lowers its own rlimits and, last,
``env -i`` sets the command's environment and execs it.  The wrapper steps
run with a fixed environment: nothing from a payload reaches a process that
still has root's uid or capabilities.  Cgroup limits, when the worker may
create cgroups, are added on top by :mod:`tangram_hpc.managers.cgroups`; the
disk quota is watched by :mod:`tangram_hpc.managers.diskquota`.
"""
from __future__ import annotations

import os
import resource
import shutil
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping

from ..errors import TangramError
from .fs_inside import is_plain_dir

__all__ = ["Limits", "LimitsError", "wrapper_argv", "WRAPPER_ENVIRON"]

#: The whole environment of the wrapper steps (and, as root, of bubblewrap's child before the
#: privilege drop); the command's own variables are set by ``env -i`` after it.
WRAPPER_ENVIRON = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
_ENV = shutil.which("env", path=WRAPPER_ENVIRON["PATH"]) or "/usr/bin/env"

_MB = 1024 * 1024
#: The largest value any limit takes: 2**40 MiB is 2**60 bytes, within every kernel interface.
_LIMIT_MAX = 1 << 40


class LimitsError(TangramError, ValueError):
    """A ``limits`` map in a payload that does not follow the schema."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What one action may use.  ``None`` means unlimited.

    timeout_s: wall-clock seconds before the whole process tree is killed.
    cpu_s: CPU seconds per process (RLIMIT_CPU; SIGXCPU then SIGKILL).
    memory_mb: memory of the action: a cgroup memory limit over the whole
        tree where the worker may create cgroups, else RLIMIT_AS per process.
        Applies when the action declares no ``mem_mb`` (which then sets it).
    nproc: processes/threads the action may have at once (a pids cgroup
        and RLIMIT_NPROC, which applies because the command never runs as
        root: see :mod:`tangram_hpc.managers.bwrap`).
    output_bytes: bytes of stdout and of stderr kept; the rest is dropped
        and the kept text ends with a truncation marker.
    output_kill_bytes: total bytes of output after which the action is
        killed as an output flood (None: drain and drop forever).
    file_mb: largest file the action may write (RLIMIT_FSIZE; never more
        than ``disk_mb``).
    nofile: open file descriptors (RLIMIT_NOFILE).
    tmp_mb: size of the private tmpfs on /tmp and /dev/shm.
    disk_mb: disk space of the environment directory (all its files, not
        only this action's); the action is killed when it grows the
        environment past it.
    disk_files: files and directories the environment may hold (inodes).
    """

    timeout_s: float | None = 600.0
    cpu_s: int | None = None
    memory_mb: int | None = 4096
    nproc: int | None = 512
    output_bytes: int = 1 * _MB
    output_kill_bytes: int | None = 64 * _MB
    file_mb: int | None = 4096
    nofile: int | None = 4096
    tmp_mb: int = 512
    disk_mb: int | None = 10240
    disk_files: int | None = 1_000_000

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None and f.name not in ("output_bytes", "tmp_mb"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v <= 0:
                raise LimitsError(f"limits.{f.name} must be a positive number, got {v!r}")
            if v > _LIMIT_MAX:      # past it, bytes of a MiB figure overflow what the kernel takes
                raise LimitsError(f"limits.{f.name} must be at most {_LIMIT_MAX} (2**40), got {v!r}; "
                                  f"None for no limit")
            if f.name != "timeout_s" and not float(v).is_integer():
                raise LimitsError(f"limits.{f.name} must be an integer, got {v!r}")

    def merged(self, overrides: Mapping[str, Any] | None) -> "Limits":
        """These limits with the keys of a payload's ``limits`` map replaced."""
        if not overrides:
            return self
        if not isinstance(overrides, Mapping):
            raise LimitsError("payload limits must be a map")
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise LimitsError(f"unknown limits {sorted(map(str, unknown))}; known: {sorted(known)}")
        clean = {k: (int(v) if k != "timeout_s" and isinstance(v, float) and v.is_integer() else v)
                 for k, v in overrides.items()}
        return replace(self, **clean)


def _python_wrapper_code() -> str:
    # Runs inside the sandbox: argv = [nofile, nproc, as, cpu, fsize, uid, gid, "--", cmd...].
    # "-" means leave alone.  Kept in one line-free string so it can go through -c.
    return (
        "import os,resource as r,sys\n"
        "a=sys.argv[1:];i=a.index('--');v=a[:i];c=a[i+1:]\n"
        "if v[5]!='-':\n"
        " g=int(v[6]);os.setgroups([]);os.setresgid(g,g,g);u=int(v[5]);os.setresuid(u,u,u)\n"
        "for n,x in zip((r.RLIMIT_NOFILE,r.RLIMIT_NPROC,r.RLIMIT_AS,r.RLIMIT_CPU,r.RLIMIT_FSIZE),v[:5]):\n"
        " x!='-' and r.setrlimit(n,(int(x),int(x)))\n"
        "os.execv(c[0],c)\n"
    )


_RLIMITS = {"nofile": resource.RLIMIT_NOFILE, "nproc": resource.RLIMIT_NPROC, "as": resource.RLIMIT_AS,
            "cpu": resource.RLIMIT_CPU, "fsize": resource.RLIMIT_FSIZE}


def _within_hard_limit(name: str, value: int | None) -> int | None:
    # The wrapper lowers limits after dropping privileges, so it cannot raise one above the
    # worker's own hard limit: ask for at most that.
    if not value:
        return None
    hard = resource.getrlimit(_RLIMITS[name])[1]
    return value if hard == resource.RLIM_INFINITY else min(value, hard)


def wrapper_argv(limits: Limits, uid: int | None, gid: int | None, environ: Mapping[str, str],
                 python: str = sys.executable) -> list[str]:
    """argv prefix that drops to ``uid``, applies ``limits``, sets ``environ`` and execs the command.

    Prefers ``setpriv``/``prlimit`` (tiny C programs, ~1 ms) and falls back to
    ``python -I -S -c`` (~15 ms) where util-linux lacks them.  ``environ`` is the
    command's complete environment; it is applied by ``env -i`` as the last step,
    after the drop, so the steps before it never see a caller's variables.
    """
    file_mb = min((x for x in (limits.file_mb, limits.disk_mb) if x), default=None)
    rl = {
        "nofile": _within_hard_limit("nofile", limits.nofile),
        "nproc": _within_hard_limit("nproc", limits.nproc),
        "as": _within_hard_limit("as", limits.memory_mb * _MB if limits.memory_mb else None),
        "cpu": _within_hard_limit("cpu", limits.cpu_s),
        "fsize": _within_hard_limit("fsize", file_mb * _MB if file_mb else None),
    }
    tail = [_ENV, "-i", *(f"{k}={v}" for k, v in environ.items())]
    prlimit = shutil.which("prlimit")
    setpriv = shutil.which("setpriv") if uid is not None else None
    if prlimit and (uid is None or setpriv):
        argv: list[str] = []
        if uid is not None:
            argv += [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                     "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        argv += [prlimit] + [f"--{k}={int(v)}" for k, v in rl.items() if v] + ["--"]
        return argv + tail
    vals = [str(int(v)) if v else "-" for v in rl.values()]
    vals += [str(uid) if uid is not None else "-", str(gid) if gid is not None else "-"]
    return [python, "-I", "-S", "-c", _python_wrapper_code(), *vals, "--"] + tail


_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                "PYTEST_XDIST_AUTO_NUM_WORKERS", "TANGRAM_NCPUS")


def command_environ(inside: str, ncpus: int, env_path: Path) -> dict[str, str]:
    """The variables a command starts with in the environment at ``env_path`` (``inside`` as it sees
    it), before the action's own: a fixed set, PATH with the environment's venv if it has one, and
    thread counts and make's jobs from its ``ncpus`` cores."""
    pybin = os.path.dirname(sys.executable)
    path = f"{pybin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    environ = {"HOME": inside, "USER": "sandbox", "LOGNAME": "sandbox", "SHELL": "/bin/sh",
               "LANG": "C.UTF-8", "TMPDIR": "/tmp", "TANGRAM_SANDBOX": "1"}
    if is_plain_dir(env_path, ".venv/bin"):
        environ["VIRTUAL_ENV"] = f"{inside}/.venv"
        path = f"{inside}/.venv/bin:{path}"
    environ["PATH"] = path
    for var in _THREAD_VARS:
        environ[var] = str(ncpus)
    environ["MAKEFLAGS"] = f"-j{ncpus}"
    return environ
