"""The native build: the scheduling policies and the simulator compiled to C with mypyc.

The policies and the simulator's event loop are pure Python, and at 100,000 trajectories the
simulator spends minutes in them.  The same sources compiled with mypyc run two to almost three
times faster and give the same results (the suite checks that the simulator's are bit-identical).

The build is opt-in, for the benchmark and the simulator only: ``TANGRAM_NATIVE=1`` asks for it,
and then a process runs it or does not start (an error that says why: none built, stale, does
not load here, imported too late).  Without the variable every process runs the Python sources;
the live commands (coordinator, worker, serve, demo) refuse to run compiled, so which code a
production coordinator runs never depends on the node or the install's history
(docs/architecture.md, "The native build").

A build is kept under ``tangram_hpc/_native_builds/<key>/``, where the key names the Python
version and hashes it with the sources of the compiled modules and of the modules they import
(``DEPENDS``).  Edit one of them and the key changes: the build no longer matches, and asking for
it is an error until the next ``tangram-hpc native build`` (a stale build is never loaded; neither
is one that does not load here).

Compiled classes check the types their fields and arguments are annotated with (an ``int``
field given a float raises TypeError where Python would take it), take no attributes they do not
declare and no monkeypatched methods; the frozen dataclasses pickle through their constructors.

    tangram-hpc native build     # compile (mypy and a C compiler; scripts/setup-env.sh does it)
    tangram-hpc native status    # whether a build matches these sources, and why not
    TANGRAM_NATIVE=1 tangram-hpc bench ...   # the benchmark, compiled
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from .errors import TangramError

__all__ = ["COMPILED", "DEPENDS", "ENV", "LIVE_COMMANDS", "active", "activate", "build", "build_dir", "status",
           "NativeBuildError"]

#: The variable that asks for the build ("1"); anything else, or unset: the Python sources.
ENV = "TANGRAM_NATIVE"
#: Commands that run live (a coordinator, a worker, a server in front of one): always the sources.
LIVE_COMMANDS = frozenset({"coordinator", "worker", "serve", "demo"})

#: The modules compiled.  Every class one of them subclasses is compiled too (a compiled class
#: cannot inherit from a plain one), and none of them defines an exception class (those stay
#: plain Python: ``sim/stalled.py``).
COMPILED = (
    "tangram_hpc.policy.base",
    "tangram_hpc.policy.residency",
    "tangram_hpc.policy.predict",
    "tangram_hpc.policy.records",
    "tangram_hpc.policy.capacity",
    "tangram_hpc.policy.queues",
    "tangram_hpc.policy.homes",
    "tangram_hpc.policy.replicas",
    "tangram_hpc.policy.order",
    "tangram_hpc.policy.grants",
    "tangram_hpc.policy.loading",
    "tangram_hpc.policy.moves",
    "tangram_hpc.policy.prefetch",
    "tangram_hpc.policy.placement",
    "tangram_hpc.policy.elastic",
    "tangram_hpc.policy.fifo",
    "tangram_hpc.policy.static",
    "tangram_hpc.policy.pool",
    "tangram_hpc.sim.calendar",
    "tangram_hpc.sim.machines",
    "tangram_hpc.sim.result",
    "tangram_hpc.sim.engine",
    "tangram_hpc.sim.baselines",
)
#: The other modules of the package the compiled ones import: their types are compiled in too (a
#: compiled function checks the attributes of an ``ActionSpec`` it reads), so they are hashed
#: into the build's key as well.  A test keeps this list equal to the import closure.
DEPENDS = (
    "tangram_hpc.actions",
    "tangram_hpc.errors",
    "tangram_hpc.resources",
    "tangram_hpc.sim.layout",
    "tangram_hpc.sim.stalled",
    "tangram_hpc.sim.workload",
)
#: Builds kept per interpreter: a process started before a rebuild may still import from its own.
KEEP_BUILDS = 3
#: mypyc puts the compiled code of all of them in one shared library of this name.
_GROUP = "tangram_hpc._native"
_LIB = _GROUP + "__mypyc"

_PACKAGE = Path(__file__).resolve().parent
BUILDS = _PACKAGE / "_native_builds"
_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
_PREFIX = sys.implementation.cache_tag + "-"      # a build directory's name: this, then the hash

_state: dict = {"active": False, "why": "not activated"}


class NativeBuildError(TangramError, ImportError):
    """TANGRAM_NATIVE=1 asked for the build and this process cannot run it (the message says why);
    raised while ``import tangram_hpc`` runs."""


def _source(module: str) -> Path:
    return _PACKAGE.parent.joinpath(*module.split(".")).with_suffix(".py")


def _build_files(d: Path) -> dict[str, Path]:
    """Module name -> its file in build directory ``d`` (the compiled modules and their library)."""
    return {m: d / (m + _SUFFIX) for m in (*COMPILED, _LIB)}


def build_key() -> str:
    """The interpreter's tag and a hash of what a build depends on: its ABI and every compiled source."""
    h = hashlib.sha256(f"{sys.implementation.cache_tag} {_SUFFIX}\n".encode())
    for m in (*COMPILED, *DEPENDS):
        h.update(m.encode() + b"\0" + _source(m).read_bytes() + b"\0")
    return _PREFIX + h.hexdigest()[:20]


class _BuildFinder(importlib.abc.MetaPathFinder):
    """Finds the compiled modules (and their shared library) in one build directory."""

    def __init__(self, files: dict[str, str]):
        self.files = files

    def find_spec(self, fullname, path=None, target=None):
        f = self.files.get(fullname)
        if f is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, f, loader=importlib.machinery.ExtensionFileLoader(fullname, f))


def activate() -> bool:
    """Run the build if ``TANGRAM_NATIVE=1`` asks for it (called once, on ``import tangram_hpc``).

    Asked for and not usable: :class:`NativeBuildError`, never the Python sources in its place."""
    if _state["active"]:
        return True
    if os.environ.get(ENV, "") != "1":
        _state["why"] = f"the build is opt-in ({ENV}=1, for bench and the simulator)"
        return False
    finder = _finder()
    if isinstance(finder, str):
        _state["why"] = finder
        raise NativeBuildError(f"{ENV}=1 but {finder}; build it without {ENV}=1 set, or unset it")
    sys.meta_path.insert(0, finder)
    d = Path(next(iter(finder.files.values()))).parent
    try:
        # load the shared library now: one that cannot load here (a truncated file, a node with
        # another C library) fails at once, not at the first policy import
        importlib.import_module(_LIB)
    except Exception as e:          # noqa: BLE001 -- whatever the loader says, it is the reason
        sys.meta_path.remove(finder)
        sys.modules.pop(_LIB, None)
        _state["why"] = f"the build in {d} does not load here ({e})"
        raise NativeBuildError(f"{ENV}=1 but {_state['why']}") from e
    _state.update(active=True, why=str(d), dir=d)
    return True


def _finder() -> _BuildFinder | str:
    """A finder for the build matching the sources, or why there is none usable."""
    if not BUILDS.is_dir():
        return "no build (tangram-hpc native build)"
    try:
        key = build_key()
    except OSError as e:        # a source missing: an odd install
        return f"sources unreadable ({e})"
    files = {m: str(f) for m, f in _build_files(BUILDS / key).items()}
    if not all(os.access(f, os.R_OK) for f in files.values()):
        return _why_no_build(key)
    if any(m in sys.modules for m in COMPILED):
        return "too late: the Python modules were imported first"
    return _BuildFinder(files)


def refuse_live(command: str) -> str | None:
    """Why ``command`` may not run in this process (a live one, compiled), or None."""
    if command in LIVE_COMMANDS and active():
        return (f"the native build is for bench and the simulator only; run {command} without {ENV}=1 "
                "(live processes run the Python sources)")
    return None


def _why_no_build(key: str) -> str:
    if (BUILDS / key).exists():
        return f"the build {BUILDS / key} is incomplete or not readable by this user"
    if any(p.name.startswith(_PREFIX) for p in BUILDS.iterdir()):
        return ("stale: the compiled sources (or the modules they import) changed since the last build "
                "(tangram-hpc native build)")
    return f"no build for this interpreter ({_PREFIX[:-1]}; tangram-hpc native build)"


def active() -> bool:
    """Whether this process runs the compiled modules (checks the loaded module, not only the finder)."""
    mod = sys.modules.get("tangram_hpc.policy.placement")
    if mod is None:
        return bool(_state["active"])
    return not str(getattr(mod, "__file__", "")).endswith(".py")


def build_dir() -> Path | None:
    """The directory of the build this process runs, or None."""
    d = _state.get("dir")
    return d if isinstance(d, Path) and active() else None


def status() -> str:
    """Which code this process runs, and why."""
    return ("native (compiled with mypyc): " if active() else "pure Python: ") + str(_state["why"])


def build_status() -> str:
    """Whether a build matching these sources exists here (what ``TANGRAM_NATIVE=1`` would run)."""
    if active():
        return f"built, and running in this process: {_state['why']}"
    if not BUILDS.is_dir():
        return "not built (tangram-hpc native build)"
    try:
        key = build_key()
    except OSError as e:
        return f"sources unreadable ({e})"
    if all(f.exists() for f in _build_files(BUILDS / key).values()):
        return f"built for these sources: {BUILDS / key} ({ENV}=1 runs it)"
    return _why_no_build(key)


def can_build() -> str | None:
    """Why a build cannot be made here, or None."""
    try:
        import mypyc.build  # noqa: F401
    except ImportError:
        return "mypy is not installed (pip install 'tangram-hpc[native]')"
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        return f"no Python headers in {sysconfig.get_paths()['include']} (Debian: apt-get install python3-dev)"
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return f"no C compiler ({cc})"
    return None


_SETUP = """
import sys
from setuptools import setup
from mypyc.build import mypycify
paths = sys.argv[1:]
sys.argv[1:] = ["build_ext", "--inplace"]
setup(name="tangram-hpc-native", ext_modules=mypycify(["--ignore-missing-imports", "--follow-imports=silent", *paths], group_name=%r))
"""


def build(log=print) -> Path:
    """Compile the modules into a build directory for the current sources; drop older builds.

    Raises RuntimeError (with the compiler's last lines) when the build fails.
    """
    why = can_build()
    if why:
        raise RuntimeError(f"cannot build: {why}")
    BUILDS.mkdir(exist_ok=True)
    with open(BUILDS / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)        # one build at a time; a second finds it made
        return _build_locked(log)


def _build_locked(log) -> Path:
    key = build_key()
    dest = BUILDS / key
    if all(f.exists() for f in _build_files(dest).values()):
        log(f"native build {key} is up to date")
        _prune(dest)
        return dest
    with tempfile.TemporaryDirectory(prefix="tangram-native-") as tmp:
        # compile a copy: mypyc writes its C sources and objects next to what it compiles
        shutil.copytree(_PACKAGE, Path(tmp, "tangram_hpc"),
                        ignore=shutil.ignore_patterns("__pycache__", "_native_builds", "*.so"))
        paths = [str(Path(*m.split(".")).with_suffix(".py")) for m in COMPILED]
        log(f"compiling {len(COMPILED)} modules with mypyc (a minute or two) ...")
        out = Path(tmp, "build.log")
        with open(out, "w") as f:
            rc = subprocess.call([sys.executable, "-c", _SETUP % _GROUP, *paths], cwd=tmp,
                                 stdout=f, stderr=subprocess.STDOUT)
        if rc != 0:
            tail = out.read_text(errors="replace").splitlines()[-25:]
            raise RuntimeError("mypyc build failed:\n" + "\n".join(tail))
        staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=BUILDS))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)   # mkdtemp's 0700 would hide it from other users of the install
        for m, built in _build_files(staging).items():
            shutil.copy2(Path(tmp, *m.split(".")).with_suffix(_SUFFIX), built)
        if dest.exists():                   # an incomplete one (a file removed by hand)
            shutil.rmtree(dest)
        os.rename(staging, dest)            # whole or not at all: a process never sees half a build
    _prune(dest)
    log(f"native build {key} in {dest}")
    return dest


def _prune(dest: Path) -> None:
    """Drop this interpreter's oldest builds but ``dest``, keeping a few (a process started before
    a rebuild may still import from its own; another interpreter's builds are its own business)."""
    mine = sorted((p for p in BUILDS.iterdir() if p.name.startswith(_PREFIX) and p != dest),
                  key=lambda p: p.stat().st_mtime)
    for old in mine[:max(0, len(mine) - (KEEP_BUILDS - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in BUILDS.glob("." + _PREFIX + "*"):  # staging left by a build that was killed
        shutil.rmtree(stale, ignore_errors=True)


def add_arguments(p) -> None:
    p.add_argument("what", choices=["build", "status"],
                   help="build: compile the policies and the simulator for these sources; "
                        f"status: which code this process runs, and whether a build matches the sources "
                        f"({ENV}=1 runs it)")


def main(args) -> int:
    if args.what == "status":
        import tangram_hpc.policy.placement  # noqa: F401  (what any process loads)
        print(status())
        print("build: " + build_status())
        return 0
    try:
        build()
    except (RuntimeError, OSError) as e:      # OSError: e.g. an install the user cannot write to
        print(f"tangram-hpc native: {e}", file=sys.stderr)
        return 1
    return 0
