"""The bubblewrap command line of one sandboxed action.

What the command sees (everything else of the host is absent, not merely
read-only): ``/usr`` and the ``/bin``, ``/sbin``, ``/lib*`` links or
directories, a short list of ``/etc`` files programs need (dynamic linker
cache, certificates, time zone, alternatives), a generated ``/etc/passwd``
and ``/etc/group`` naming only the sandbox user, the Python installation the
worker runs on (read-only, at its own path so venvs keep working), a new
``/proc`` of its own PID namespace, a minimal ``/dev``, private tmpfs ``/tmp``
and ``/dev/shm``, and its environment directory read-write at
:data:`SANDBOX_DIR`, which is also the working directory and ``$HOME``.

Two modes, chosen by who runs the worker:

* worker is an ordinary user: bwrap creates a user namespace (``--unshare-all``)
  and the command runs as that user inside it.
* worker is root: bwrap runs without a user namespace (so that it may set up
  mounts from paths only root can read, e.g. ``/root/.pyenv``) and the exec
  wrapper drops the command to the environment's own unprivileged uid before it
  starts; bwrap sets ``no_new_privs`` so no setuid binary can climb back.
  Running as a non-root uid is what makes ``RLIMIT_NPROC`` bind: the kernel
  exempts uid 0 from it, which would let a fork bomb through.  The wrapper
  step before that drop keeps only the capabilities it needs to drop
  (CAP_SETUID, CAP_SETGID, CAP_SETPCAP) and the fixed environment of
  :data:`~tangram_hpc.managers.limits.WRAPPER_ENVIRON`.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BwrapUnavailable
from .limits import WRAPPER_ENVIRON

__all__ = ["SANDBOX_DIR", "BwrapUnavailable", "BwrapLayout", "BwrapStatus", "memfd", "probe_bwrap", "python_prefixes"]

#: Where the environment directory appears inside the sandbox.
SANDBOX_DIR = "/sandbox"

_SYSTEM_TOP = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl", "ca-certificates",
    "ca-certificates.conf", "pki", "localtime", "timezone", "zoneinfo", "nsswitch.conf",
    "host.conf", "hosts", "gai.conf", "protocols", "services", "mime.types", "magic",
    "magic.mime", "os-release", "debian_version", "lsb-release", "locale.alias", "locale.conf",
    "inputrc", "bash.bashrc", "profile", "environment", "fonts", "python3", "gitconfig",
)
_NET_ETC_FILES = ("resolv.conf",)
# As root, what the wrapper keeps until it drops to the environment's uid: enough to change
# uid, gid and groups and to clear the bounding set; no CAP_SYS_ADMIN, DAC override or mknod.
_ROOT_CAPS = ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
              "--cap-add", "CAP_SETPCAP"]


def probe_bwrap(bwrap: str) -> str | None:
    """Try a trivial sandbox; return None when it works, else why it does not."""
    if not bwrap or not os.path.isfile(bwrap) or not os.access(bwrap, os.X_OK):
        return f"bubblewrap not found at {bwrap!r}"
    # --json-status-fd (bubblewrap 0.3.0, 2018) is how the sandbox learns its command's own status
    argv = [bwrap, "--json-status-fd", "1", "--die-with-parent", "--ro-bind", "/usr", "/usr"]
    for top in _SYSTEM_TOP:
        argv += _top_level_bind(top)
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += _unshare_args(root_mode=os.geteuid() == 0, network=False)
    argv += ["--", "/usr/bin/env", "true"]
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap at {bwrap!r} could not run: {exc}"
    if r.returncode != 0:
        msg = r.stderr.decode(errors="replace").strip() or f"exit code {r.returncode}"
        return f"bubblewrap at {bwrap!r} cannot create a sandbox here: {msg}"
    return None


def _top_level_bind(top: str) -> list[str]:
    if os.path.islink(top):
        return ["--symlink", os.readlink(top), top]
    if os.path.isdir(top):
        return ["--ro-bind", top, top]
    return []


def _unshare_args(root_mode: bool, network: bool) -> list[str]:
    if root_mode:
        # No user namespace: see the module docstring for why.
        args = ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
        if not network:
            args.append("--unshare-net")
        return args
    args = ["--unshare-all"]
    if network:
        args.append("--share-net")
    return args


def python_prefixes() -> list[str]:
    """Directories that make ``sys.executable`` work, outside ``/usr``.

    The venv (``sys.prefix``) and the installation it was made from
    (``sys.base_prefix``), each at its real path and, when reached through a
    symlink, at the linked path too.  Only those directories are exposed:
    a venv inside a project tree does not expose the project.
    """
    seen: list[str] = []
    for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
              os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))):
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if q in seen or q == "/" or _under(q, "/usr"):
                continue
            seen.append(q)
    # A prefix inside another one is already visible.
    return [p for p in seen if not any(p != o and _under(p, o) for o in seen)]


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


@dataclass
class BwrapLayout:
    """Builds the bwrap argv; the static part is computed once per manager."""

    bwrap: str
    root_mode: bool = field(default_factory=lambda: os.geteuid() == 0)
    extra_ro: tuple[str, ...] = ()
    _static: list[str] = field(default_factory=list, init=False)
    _static_net: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        binds: list[tuple[str, str]] = [("/usr", "/usr")]
        args: list[str] = []
        for top in _SYSTEM_TOP:
            args += _top_level_bind(top)
        args += ["--perms", "0755", "--dir", "/etc"]
        for name in _ETC_FILES:
            src = os.path.join("/etc", name)
            if os.path.exists(src):
                binds.append((src, src))
        # The JDK reads its configuration (java.security) from /etc/java-<version>-openjdk.
        binds += [(src, src) for src in sorted(glob.glob("/etc/java-*"))]
        for p in python_prefixes() + [os.path.abspath(p) for p in self.extra_ro]:
            binds.append((p, p))
        made = {"/", "/usr", "/etc", SANDBOX_DIR, "/tmp", "/proc", "/dev"} | set(_SYSTEM_TOP)
        for src, dest in binds:
            # Parents bwrap would otherwise create 0700 when run as root.
            for anc in _ancestors(dest):
                if anc not in made:
                    args += ["--perms", "0755", "--dir", anc]
                    made.add(anc)
            args += ["--ro-bind", src, dest]
            made.add(dest)
        args += ["--proc", "/proc", "--dev", "/dev"]
        self._static = args
        self._static_net = [a for name in _NET_ETC_FILES if os.path.exists(f"/etc/{name}")
                            for a in ("--ro-bind", f"/etc/{name}", f"/etc/{name}")]

    def argv(self, env_dir: Path, *, network: bool, tmp_mb: int, passwd_fd: int, group_fd: int,
             seccomp_fd: int | None = None, status_fd: int | None = None) -> list[str]:
        """bwrap argv up to (and including) the ``--`` before the command's wrapper.

        ``status_fd``: where bubblewrap reports its child's pid and exit code (JSON lines).

        The wrapper gets :data:`WRAPPER_ENVIRON` only; the command's own variables
        are set after the privilege drop (:func:`~tangram_hpc.managers.limits.wrapper_argv`).
        """
        argv = [self.bwrap, "--die-with-parent", "--new-session", "--as-pid-1", "--hostname", "sandbox"]  # pid 1: _INIT
        argv += _unshare_args(self.root_mode, network)
        if self.root_mode:
            argv += _ROOT_CAPS
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
        if status_fd is not None:
            argv += ["--json-status-fd", str(status_fd)]
        size = str(tmp_mb * 1024 * 1024)
        # The private /tmp comes first: a Python prefix under /tmp (a venv in a checkout there)
        # is then bound on top of it instead of being hidden by it.
        argv += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
        argv += self._static
        if network:
            argv += self._static_net
        argv += ["--perms", "1777", "--size", size, "--tmpfs", "/dev/shm",
                 "--perms", "0644", "--ro-bind-data", str(passwd_fd), "/etc/passwd",
                 "--perms", "0644", "--ro-bind-data", str(group_fd), "/etc/group",
                 "--bind", str(env_dir), SANDBOX_DIR, "--chdir", SANDBOX_DIR, "--clearenv"]
        for k, v in WRAPPER_ENVIRON.items():
            argv += ["--setenv", k, v]
        argv += ["--", *_INIT]
        return argv


#: pid 1 of the sandbox's PID namespace: a shell that runs the wrapper chain as its child, waits and
#: exits with its status.  bubblewrap's --die-with-parent gives it the parent-death signal, which it
#: keeps (it has bubblewrap's uid; the command's uid is dropped later, which clears the signal, and a
#: capability-less bubblewrap may not signal another uid): when the worker dies, even by SIGKILL,
#: it dies and the kernel kills everything in the namespace, so no command outlives its worker to
#: write into an environment another worker has taken over.  The command is not pid 1 either, so
#: signals it sends itself work as usual.  Arguments reach it as "$@", never as shell text.
_INIT = ["/bin/sh", "-c", '"$@"; exit $?', "tangram-init"]


def _ancestors(path: str) -> list[str]:
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


class BwrapStatus:
    """What bubblewrap writes to its ``--json-status-fd``: its child's pid, then its exit code.

    Slurm signals every process of a job.  A bubblewrap that gets SIGTERM while it sets the
    sandbox up can die of it without taking its child along (seen with delays of 1-30 ms after
    the start; presumably before the child's parent-death signal is armed), and that child then
    runs on unsupervised, holding the output pipes, writing into the environment after the
    action was reported failed.  Once bubblewrap has exited, a child whose exit it did not
    report is killed (it is the PID namespace's init: everything in the sandbox goes with it);
    a child that did exit gives the command's own status.
    """

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.child: int | None = None
        self.exit_code: int | None = None
        self._buf = b""

    def _read(self) -> None:
        os.set_blocking(self.read_fd, False)
        try:
            while chunk := os.read(self.read_fd, 65536):
                self._buf += chunk
        except BlockingIOError:
            pass
        for line in self._buf.splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                if isinstance(doc.get("child-pid"), int):
                    self.child = doc["child-pid"]
                if isinstance(doc.get("exit-code"), int):
                    self.exit_code = doc["exit-code"]

    def bwrap_exited(self) -> None:
        """bubblewrap has exited: kill its child if it did not see it exit."""
        self._read()
        if self.child is not None and self.exit_code is None:
            try:
                os.kill(self.child, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def close(self) -> None:
        os.close(self.read_fd)


def memfd(name: str, data: str | bytes) -> int:
    """A memory file holding ``data``, read from its start (what ``--ro-bind-data``, ``--seccomp`` read)."""
    fd = os.memfd_create(name, 0)
    os.write(fd, data.encode() if isinstance(data, str) else data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
