"""Stateful sandbox environments: directories that outlive single actions.

An environment is a directory under the manager's root, created from a
*template* the first time an action names it, kept between the actions of
a trajectory, and removed by :meth:`EnvStore.drop` or when unused for longer
than its TTL.  A background thread keeps ``warm_pool`` ready-made
environments per template so that a new trajectory does not wait for a copy
of a project tree or the creation of a Python env.

When the worker runs as root every environment gets its own unprivileged
uid (the sandboxed command runs as that uid, see
:mod:`tangram_hpc.managers.bwrap`) and its files are owned by it.

Each environment has a *journal* beside its directory (``<dir>.journal``, out of
the sandbox's sight): the outcomes of (at least) the last :data:`JOURNAL_KEEP`
actions that ran in it, as far as :data:`JOURNAL_MAX_BYTES` holds them.  It travels with the environment (inside its snapshot, in the tar's
pax header; with its directory when a worker adopts it), so an action whose
result was lost (its worker declared lost, the coordinator restarted) and that
comes back to the environment is answered from the journal instead of running a
second time on a state that already holds its effects.

Sandboxed code controls what is inside an environment, and the worker may be
root: every host-side operation on a path inside one (payload files, fetched
files, snapshots) walks it one component at a time with ``O_NOFOLLOW`` (no
symlink leads out), opens with ``O_NONBLOCK`` (a FIFO cannot block the
worker) and reads or writes regular files only.
"""
from __future__ import annotations

import base64
import errno
import logging
import os
import random
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol

import msgpack

from ..envfiles import PAX_ENV, PAX_GEN, env_dirname, snapshot_identity  # noqa: F401 (re-exported)
from ..errors import TangramError
from .env_bases import Base, BaseRef, scan_base, settled_now, unchanged
from . import env_layers
from .env_layers import NOFOLLOW_DIR

__all__ = [
    "Template", "EmptyTemplate", "TreeTemplate", "PythonEnvTemplate", "template_from_config",
    "Environment", "EnvStore", "EnvError", "UnknownTemplate", "UID_RANGE", "NOFOLLOW_DIR", "write_inside", "read_inside", "size_inside",
    "is_plain_dir", "JOURNAL_KEEP", "JOURNAL_RECORD_BYTES", "bounded_record", "snapshot_identity", "env_dirname",
]

log = logging.getLogger(__name__)

_NOFOLLOW_FILE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
#: Snapshots of deeper trees are refused (the walk holds one descriptor per level).
_MAX_DEPTH = 256
_CHANGED_MEANWHILE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENXIO})
#: Outcomes kept in an environment's journal at least (it is compacted to this many once it holds twice as many).
JOURNAL_KEEP = 32
#: ... and at most this many bytes of them (the newest two whatever their size): outputs of up to
#: 2 MiB each would otherwise cost a worker hosting many environments gigabytes, in memory, on disk
#: and in every snapshot.
JOURNAL_MAX_BYTES = 8 << 20
#: A record larger than this keeps its outcome without its output (the journal answers a retry that
#: the action ran, and how it ended; a result that large was sent already, or was not sendable).
JOURNAL_RECORD_BYTES = 4 << 20
# pax header keys of a snapshot: the environment id, its generation, its journal (base64 msgpack)
_PAX_ENV, _PAX_GEN, _PAX_JOURNAL = PAX_ENV, PAX_GEN, "TANGRAM.journal"
_PAX_TEMPLATE, _PAX_BASE, _PAX_DELETED = "TANGRAM.template", "TANGRAM.base", "TANGRAM.deleted"
_BASES_DIR = "bases"
_FINGERPRINT = re.compile(r"[0-9a-f]{32}")

#: Uids handed to environments when the worker is root: far above normal
#: user and subordinate-uid ranges.
UID_RANGE = (0x6A000000, 0x6A000000 + (1 << 20))


class EnvError(TangramError, RuntimeError):
    """An environment could not be created, found, written, saved or restored."""


class UnknownTemplate(EnvError):
    """A payload names a template this worker does not have: the request's error, not the environment's."""


class Template(Protocol):
    """How a new environment directory is filled."""

    def populate(self, path: Path) -> None: ...


@dataclass(frozen=True)
class EmptyTemplate:
    """An empty directory."""

    def populate(self, path: Path) -> None:
        pass


@dataclass(frozen=True)
class TreeTemplate:
    """A copy of a project tree (symlinks kept as symlinks)."""

    source: Path
    ignore: tuple[str, ...] = ()

    def populate(self, path: Path) -> None:
        src = Path(self.source)
        if not src.is_dir():
            raise EnvError(f"template source {src} is not a directory")
        shutil.copytree(src, path, symlinks=True, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(*self.ignore) if self.ignore else None)


@dataclass(frozen=True)
class PythonEnvTemplate:
    """A Python venv at ``.venv`` of the environment, over an optional base template.

    The venv is made from the worker's interpreter (visible read-only in the
    sandbox) with ``--system-site-packages`` by default, and ``packages`` are
    installed into it with pip on the worker at creation time (the sandbox
    itself has no network).  Console scripts are rewritten to
    ``#!/usr/bin/env python`` so they run at the sandbox path too; the
    sandbox puts ``.venv/bin`` first on ``PATH``.
    """

    packages: tuple[str, ...] = ()
    system_site_packages: bool = True
    pip_args: tuple[str, ...] = ()
    base: Any = None

    def populate(self, path: Path) -> None:
        if self.base is not None:
            self.base.populate(path)
        venv = path / ".venv"
        cmd = [sys.executable, "-m", "venv", "--without-pip", str(venv)]
        if self.system_site_packages:
            cmd.insert(4, "--system-site-packages")
        _check(cmd)
        if self.packages:
            _check([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--no-input", *self.pip_args, *self.packages])
            _rewrite_shebangs(venv / "bin")


def _check(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise EnvError(f"{' '.join(cmd[:4])} ... failed: {r.stderr.strip()[-2000:]}")


def _rewrite_shebangs(bindir: Path) -> None:
    for f in bindir.iterdir():
        if f.is_symlink() or not f.is_file():
            continue
        with open(f, "rb") as fh:
            head = fh.read(2)
            if head != b"#!":
                continue
            first = fh.readline()
            rest = fh.read()
        if b"python" in first:
            f.write_bytes(b"#!/usr/bin/env python\n" + rest)


def template_from_config(cfg: Any) -> Template:
    """A template from a config map: ``{"kind": "empty"|"tree"|"python", ...}``."""
    if not isinstance(cfg, Mapping):
        if hasattr(cfg, "populate"):
            return cfg
        raise EnvError(f"template config must be a map, got {cfg!r}")
    kind = cfg.get("kind", "empty")
    if kind == "empty":
        return EmptyTemplate()
    if kind == "tree":
        return TreeTemplate(Path(cfg["source"]), tuple(cfg.get("ignore", ())))
    if kind == "python":
        base = template_from_config(cfg["base"]) if cfg.get("base") else None
        return PythonEnvTemplate(tuple(cfg.get("packages", ())),
                                 bool(cfg.get("system_site_packages", True)),
                                 tuple(cfg.get("pip_args", ())), base)
    raise EnvError(f"unknown template kind {kind!r}: empty, tree or python")


@dataclass
class Environment:
    id: str
    path: Path
    template: str
    uid: int | None
    created: float
    last_used: float
    throwaway: bool = False
    busy: int = 0
    ready: threading.Event = field(default_factory=threading.Event, repr=False)
    turn: threading.Lock = field(default_factory=threading.Lock, repr=False)   # held by the action running in it
    awaiting_journal: str | None = field(default=None, repr=False)   # the action whose journal record its turn waits for
    failure: BaseException | None = field(default=None, repr=False)
    disk: Any = field(default=None, repr=False)   # its last disk-quota walk (diskquota.Measured)
    journal: dict | None = field(default=None, repr=False)  # action id -> outcome record, once read
    journal_appends: int = field(default=0, repr=False)     # records appended since the file was written whole
    base: BaseRef | None = field(default=None, repr=False)  # the template base it is a copy of (delta snapshots)


class EnvStore:
    """Registry of the environments of one manager (thread-safe)."""

    def __init__(self, root: Path, templates: Mapping[str, Any], default_template: str,
                 ttl: float | None, warm_pool: int, drop_privileges: bool):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)  # environment uids must traverse it, not list it
        self.templates: dict[str, Template] = {"empty": EmptyTemplate()}
        for name, t in templates.items():
            self.templates[name] = template_from_config(t)
        if default_template not in self.templates:
            raise EnvError(f"default template {default_template!r} is not configured")
        self.default_template = default_template
        self.ttl = ttl
        self.warm_pool = warm_pool
        self.drop_privileges = drop_privileges
        self._lock = threading.Condition()
        self._envs: dict[str, Environment] = {}
        self._uids: set[int] = set()
        self._warm: dict[str, list[tuple[Path, int | None, BaseRef | None]]] = {t: [] for t in self.templates}
        self._bases: dict[str, Base] = {}            # fingerprint -> pristine base held here
        self._template_base: dict[str, str] = {}     # template -> fingerprint of its base here
        self._base_lock = threading.Lock()           # one pristine build at a time
        self._closed = False
        #: whether the outcomes of actions are journaled (a worker's EnvHost): then an attempt's layer
        #: is committed by its journal record (env_layers), else as soon as its command ended
        self.journaled = False
        self.warm_hits = 0  # environments served from the pool (observability, tests)
        self._warm_dir = self.root / ".warm"
        self._warm_dir.mkdir(exist_ok=True)
        self._thread: threading.Thread | None = None
        if warm_pool > 0:
            self._thread = threading.Thread(target=self._fill_warm, name="sandbox-warm-pool",
                                            daemon=True)
            self._thread.start()

    # -- uids ------------------------------------------------------------------
    def _new_uid(self) -> int | None:
        if not self.drop_privileges:
            return None
        with self._lock:
            while True:
                uid = random.randrange(*UID_RANGE)
                if uid not in self._uids:
                    self._uids.add(uid)
                    return uid

    def _free_uid(self, uid: int | None) -> None:
        if uid is not None:
            with self._lock:
                self._uids.discard(uid)

    # -- creation ----------------------------------------------------------------
    def _base_of(self, template: str) -> Base | None:
        """The pristine base of ``template`` on this worker, built (once) on first use; None for "empty"."""
        if isinstance(self.templates[template], EmptyTemplate):
            return None
        with self._base_lock:
            fp = self._template_base.get(template)
            if fp is not None:
                return self._bases[fp]
            tmp = self._warm_dir / f".base-{os.urandom(6).hex()}"
            try:
                tmp.mkdir(mode=0o755)
                self.templates[template].populate(tmp)
                base = scan_base(tmp)
            except BaseException:
                _rmtree(tmp)
                raise
            with self._lock:
                have = self._bases.get(base.fingerprint)
                if have is None:
                    self._bases[base.fingerprint] = base
                self._template_base[template] = base.fingerprint
            if have is not None:   # the same tree came here from a snapshot's base first
                _rmtree(tmp)
                return have
            return base

    def _build(self, template: str, dest: Path) -> tuple[int | None, BaseRef | None]:
        """Create a populated, owned directory at ``dest`` (which must not exist): a copy of the
        template's base, and what it is a copy of."""
        base = self._base_of(template)
        uid = self._new_uid()
        tmp = self._warm_dir / f".build-{os.urandom(6).hex()}"
        try:
            if base is None:
                tmp.mkdir(mode=0o755)
                self.templates[template].populate(tmp)
            else:
                shutil.copytree(base.path, tmp, symlinks=True)
                os.chmod(tmp, 0o755)
            if uid is not None:
                chown_tree(tmp, uid)
            ref = BaseRef(base.fingerprint, settled_now(self._warm_dir)) if base is not None else None
            os.rename(tmp, dest)
        except BaseException:
            self._free_uid(uid)
            _rmtree(tmp)
            raise
        return uid, ref

    def _take_warm(self, template: str, dest: Path, fingerprint: str | None = None
                   ) -> tuple[int | None, BaseRef | None] | None:
        """A ready-made environment of ``template`` moved to ``dest`` (only a copy of the base
        ``fingerprint``, when given); None if the pool has none."""
        with self._lock:
            pool = self._warm.get(template)
            if not pool or (fingerprint is not None and (pool[-1][2] is None or pool[-1][2].fingerprint != fingerprint)):
                return None
            path, uid, ref = pool.pop()
            self.warm_hits += 1
            self._lock.notify_all()
        os.rename(path, dest)
        return uid, ref

    def _fill_warm(self) -> None:
        while True:
            with self._lock:
                while not self._closed and all(len(p) >= self.warm_pool for p in self._warm.values()):
                    self._lock.wait()
                if self._closed:
                    return
                template = next(t for t, p in self._warm.items() if len(p) < self.warm_pool)
            dest = self._warm_dir / f"{template}-{os.urandom(6).hex()}"
            try:
                uid, ref = self._build(template, dest)
            except Exception as exc:  # a broken template must not kill the pool for the others
                log.error("warm pool: template %r failed to build (%s: %s); it is no longer kept warm and "
                          "each environment made from it is built on demand, reporting its error",
                          template, type(exc).__name__, exc)
                with self._lock:
                    self._warm.pop(template, None)
                continue
            with self._lock:
                if self._closed:
                    self._free_uid(uid)
                    _rmtree(dest)
                    return
                self._warm.setdefault(template, []).append((dest, uid, ref))

    def warm_count(self, template: str) -> int:
        """Ready-made environments of ``template`` waiting in the pool."""
        with self._lock:
            return len(self._warm.get(template, ()))

    def acquire(self, env_id: str | None, template: str | None) -> Environment:
        """The environment ``env_id`` (created from ``template`` if new), marked busy.

        ``env_id`` None gives a throwaway environment, removed on release.
        """
        template = template or self.default_template
        throwaway = env_id is None
        key = env_id if env_id is not None else f"_throwaway-{os.urandom(8).hex()}"
        with self._lock:
            if self._closed:
                raise EnvError("sandbox manager is closed")
            env = self._envs.get(key)
            if env is not None:         # a payload's template matters only to the action that creates it
                env.busy += 1
                creator = False
            else:
                self.check_template(template)
                now = time.monotonic()
                env = Environment(key, self.root / env_dirname(key), template, None, now, now,
                                  throwaway, busy=1)
                self._envs[key] = env
                creator = True
        if creator:
            try:
                if env.path.exists():  # left behind by an earlier manager on this root
                    _rmtree(env.path)
                _rmtree(self.attempt_path(env))
                if not throwaway:
                    self._journal_path(key).unlink(missing_ok=True)
                made = self._take_warm(template, env.path)
                env.uid, env.base = self._build(template, env.path) if made is None else made
            except BaseException as exc:
                env.failure = exc
                with self._lock:
                    self._envs.pop(key, None)
                env.ready.set()
                raise EnvError(f"cannot create environment {key!r} from template {template!r}: {exc}") from exc
            env.ready.set()
        else:
            env.ready.wait()
            if env.failure is not None:
                raise EnvError(f"environment {key!r} failed to be created: {env.failure}")
        return env

    @staticmethod
    def take_turn(env: Environment, cancel_fd: int | None, timeout_s: float | None) -> str | None:
        """Wait until no other action runs in ``env`` and hold it (:meth:`give_turn` lets go); returns
        None once held, else why not (``"cancelled"``, ``"timeout"``).

        Actions of one environment run one at a time: two at once would race each other's files and
        give sandboxed code a window against the host-side path checks between them."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not env.turn.acquire(timeout=0.05):
            if cancel_fd is not None and select.select([cancel_fd], [], [], 0)[0]:
                return "cancelled"
            if deadline is not None and time.monotonic() > deadline:
                return "timeout"
        return None

    @staticmethod
    def give_turn(env: Environment) -> None:
        env.turn.release()

    def check_template(self, template: str | None) -> None:
        """Raise :class:`UnknownTemplate` unless ``template`` (None: the default) is configured here."""
        if (template or self.default_template) not in self.templates:
            raise UnknownTemplate(f"unknown template {template!r}; configured: {sorted(self.templates)}")

    def has(self, env_id: str) -> bool:
        """Whether ``env_id`` is here and ready."""
        return env_id in self.ids()

    def release(self, env: Environment) -> None:
        with self._lock:
            env.busy -= 1
            env.last_used = time.monotonic()
            gone = env.throwaway and env.busy == 0
            if gone:
                self._envs.pop(env.id, None)
        if gone:
            self._remove(env)

    # -- lifetime ----------------------------------------------------------------
    def ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(k for k, e in self._envs.items() if not e.throwaway and e.ready.is_set())

    def get(self, env_id: str) -> Environment:
        with self._lock:
            env = self._envs.get(env_id)
        if env is None or not env.ready.is_set() or env.failure is not None:
            raise EnvError(f"no environment {env_id!r} on this worker")
        return env

    def drop(self, env_id: str) -> bool:
        with self._lock:
            env = self._envs.pop(env_id, None)
        if env is None:
            self._journal_path(env_id).unlink(missing_ok=True)
            return False
        env.ready.wait()
        self._remove(env)
        return True

    def gc(self, now: float | None = None) -> list[str]:
        """Remove idle environments older than the TTL; ``now`` is ``time.monotonic()``."""
        self._empty_trash()
        if self.ttl is None:
            return []
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [e for e in self._envs.values()
                   if e.busy == 0 and e.ready.is_set() and now - e.last_used > self.ttl]
            for e in old:
                del self._envs[e.id]
        for e in old:
            self._remove(e)
        return [e.id for e in old]

    def _remove(self, env: Environment) -> None:
        _rmtree(env.path)
        _rmtree(self.attempt_path(env))
        if not env.throwaway:
            self._journal_path(env.id).unlink(missing_ok=True)
        self._free_uid(env.uid)

    def close(self, keep: Iterable[str] = ()) -> None:
        """Remove every environment but those in ``keep``, which stay on disk with their journals
        (a leaving worker that could not hand them back: another worker may adopt them)."""
        keep = frozenset(keep)
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            envs = [e for e in self._envs.values() if e.id not in keep]
            self._envs.clear()
            warm = [entry[0] for pool in self._warm.values() for entry in pool]
            self._warm = {}
        if self._thread is not None:
            self._thread.join(timeout=60)
        for e in envs:
            self._remove(e)
        for p in warm:
            _rmtree(p)
        _rmtree(self._warm_dir)

    # -- journal -----------------------------------------------------------------
    def _journal_path(self, env_id: str) -> Path:
        return self.root / (env_dirname(env_id) + ".journal")

    def _journal_of(self, env: Environment) -> dict:
        if env.journal is None:
            env.journal = {r[0]: r for r in _read_journal(self._journal_path(env.id))}
        return env.journal

    def journal_get(self, env_id: str, action_id: str) -> list | None:
        """The outcome record ``[id, attempt, status, output, error, started, finished]`` of an action
        that ran in ``env_id`` (among its last :data:`JOURNAL_KEEP`), or None."""
        env = self.get(env_id)
        with self._lock:
            return self._journal_of(env).get(action_id)

    def journal_add(self, env_id: str, record: list) -> None:
        """Record the outcome of an action that ran in ``env_id``, before its result is reported
        (one larger than :data:`JOURNAL_RECORD_BYTES` without its output); then its attempt's layer,
        if it left one, is committed into the environment."""
        env = self.get(env_id)
        self._journal_write(env, record)
        if env.awaiting_journal == record[0]:
            self.finish_attempt(env, record[0])

    def finish_attempt(self, env: Environment, action_id: str) -> None:
        """``action_id``, whose attempt holds ``env``'s turn, is journaled or never will be: its attempt is
        committed if the journal holds it, else discarded, and the next action may run."""
        if env.awaiting_journal != action_id:
            return
        env.awaiting_journal = None
        try:
            self.settle(env)
        finally:
            self.give_turn(env)

    def _journal_write(self, env: Environment, record: list) -> None:
        env_id = env.id
        packed = msgpack.packb(record, use_bin_type=True)
        if len(packed) > JOURNAL_RECORD_BYTES:
            record = bounded_record(record, len(packed))
            packed = msgpack.packb(record, use_bin_type=True)
        with self._lock:
            journal = self._journal_of(env)
            journal.pop(record[0], None)
            journal[record[0]] = record
            env.journal_appends += 1
            path = self._journal_path(env_id)
            if env.journal_appends <= JOURNAL_KEEP:
                with open(path, "ab") as f:
                    f.write(packed)
                    if f.tell() <= JOURNAL_MAX_BYTES:
                        return
            _trim_journal(journal)
            env.journal_appends = 0
            _write_journal(path, list(journal.values()))

    # -- attempts (env_layers) -------------------------------------------------------
    def attempt_path(self, env: Environment) -> Path:
        """Where the layer of ``env``'s pending attempt is (beside it, out of the sandbox's sight)."""
        return self.root / (env_dirname(env.id) + env_layers.ATTEMPT_SUFFIX)

    def begin_attempt(self, env: Environment, action_id: str) -> Path:
        """A fresh layer for an attempt of ``action_id`` in ``env``; an earlier attempt's is settled first."""
        self.settle(env)
        path = self.attempt_path(env)
        env_layers.prepare(path, env.path, action_id)
        return path

    def settle(self, env: Environment, *, commit: bool = False) -> str | None:
        """Commit ``env``'s pending attempt if its action is in the journal (or ``commit``), else
        discard it; returns what became of it (None: there was none)."""
        with self._lock:
            journal = self._journal_of(env)
            done = set(journal)
        return env_layers.settle(self.attempt_path(env), env.path, lambda aid: commit or aid in done,
                                 self._trash_dir())

    def _empty_trash(self) -> None:
        """Remove the settled attempts (moved aside first: a settle may be moving one in meanwhile)."""
        aside = self._warm_dir / f".trash-{os.urandom(6).hex()}"
        try:
            os.rename(self._warm_dir / ".trash", aside)
        except OSError:
            return
        _rmtree(aside)

    def _trash_dir(self) -> Path:
        """Where settled attempts wait for :meth:`gc` (or :meth:`close`) to remove them."""
        trash = self._warm_dir / ".trash"
        trash.mkdir(exist_ok=True)
        return trash

    def journal_bytes(self, env: Environment) -> int:
        """The size of ``env``'s journal file (it counts against the environment's disk quota)."""
        try:
            return os.stat(self._journal_path(env.id)).st_blocks * 512
        except OSError:
            return 0

    def _set_journal(self, env: Environment, records: list) -> None:
        env.journal = {r[0]: r for r in records}
        env.journal_appends = 0
        _write_journal(self._journal_path(env.id), records)

    # -- files -----------------------------------------------------------------
    def write_files(self, env: Environment, files: Mapping[str, str | bytes]) -> None:
        """Write payload files into the environment without following links out of it."""
        for rel, content in files.items():
            data = content.encode() if isinstance(content, str) else bytes(content)
            write_inside(env.path, rel, data, env.uid)

    # -- snapshot / restore -----------------------------------------------------------
    def snapshot(self, env_id: str, snapshot_dir: Path, generation: int = 0) -> str:
        """Save ``env_id`` with its journal to ``<dir>-g<generation>-<time>-<rand>.tar.gz``; returns its path.

        An environment made from a template's base holds only what changed since (a *delta*:
        changed and new entries, and the list of the base's entries that are gone); the base
        itself is saved once per fingerprint as ``<dir>/bases/<fingerprint>.tar.gz``, for a
        worker that does not hold the same base.
        """
        env = self.get(env_id)
        self.settle(env)    # the environment as its journal says: no attempt half in it
        snapshot_dir = Path(snapshot_dir)
        snapshot_dir.mkdir(parents=True, exist_ok=True)
        name = f"{env_dirname(env_id)}-g{generation}-{int(time.time())}-{os.urandom(4).hex()}.tar.gz"
        final = snapshot_dir / name
        with self._lock:
            journal = list(self._journal_of(env).values())[-JOURNAL_KEEP:]
            base = self._bases.get(env.base.fingerprint) if env.base is not None else None
        headers = {_PAX_ENV: env_id, _PAX_GEN: str(generation), _PAX_TEMPLATE: env.template,
                   _PAX_JOURNAL: base64.b64encode(msgpack.packb(journal, use_bin_type=True)).decode()}
        delta = None
        if base is not None:
            _save_base(base, snapshot_dir)
            headers[_PAX_BASE] = base.fingerprint
            delta = _Delta(base.manifest, env.base)
        _write_tar(final, env.path, headers, delta)
        return str(final)

    def restore(self, env_id: str, snapshot: str, template: str | None = None) -> Environment:
        """Recreate ``env_id`` (and its journal) from a snapshot, replacing any local copy."""
        src = Path(snapshot)
        if not src.is_file():
            raise EnvError(f"snapshot {snapshot} not found")
        self.drop(env_id)
        journal: list = []
        saved_template: str | None = None
        fingerprint: str | None = None
        dirty: frozenset[str] = frozenset()
        owned: dict = {}

        def extract(tmp: Path) -> None:
            nonlocal journal, saved_template, fingerprint, dirty
            with tarfile.open(src, "r:*") as tar:
                saved_id = tar.pax_headers.get(_PAX_ENV)
                if saved_id is not None and saved_id != env_id:
                    raise EnvError(f"snapshot {snapshot} holds environment {saved_id!r}, not {env_id!r}")
                journal = _journal_from_header(tar.pax_headers.get(_PAX_JOURNAL))
                saved_template = tar.pax_headers.get(_PAX_TEMPLATE)
                fingerprint = tar.pax_headers.get(_PAX_BASE)
                members = [_safe_member(m) for m in tar.getmembers()]
                if fingerprint is None:
                    tmp.mkdir(mode=0o755)
                    _extract(tar, tmp, members)
                    return
                owned["uid"] = self._copy_base(fingerprint, saved_template, src.parent, tmp)
                names = {m.name for m in members}
                opened = _open_dirs_for_owner(tmp)
                for rel in _deleted_of(members, snapshot) + [m.name for m in members if not m.isdir()]:
                    _remove_inside(tmp, rel)
                _extract(tar, tmp, members)
                for rel, mode in opened:
                    if rel not in names:
                        try:
                            os.chmod(tmp / rel, mode)
                        except FileNotFoundError:
                            pass   # deleted by the delta
                dirty = frozenset(names - {"."})
                owned["unowned"] = dirty

        dest, uid = self._put_in_place(env_id, extract, f"restore {env_id!r} from {snapshot}", owned)
        if template is None and saved_template in self.templates:
            template = saved_template
        ref = BaseRef(fingerprint, settled_now(self._warm_dir), dirty) if fingerprint is not None else None
        return self._install(env_id, dest, uid, template, journal, ref)

    def _copy_base(self, fingerprint: str, template: str | None, snapshot_dir: Path, dest: Path) -> int | None:
        """Put a copy of the base ``fingerprint`` at ``dest``: a ready-made environment of the
        pool, else a copy of the pristine base held here, else of the one saved beside the snapshot.
        Returns the uid the copy is owned by (a ready-made one's), or None."""
        if not _FINGERPRINT.fullmatch(fingerprint):
            raise EnvError(f"snapshot names a malformed base {fingerprint!r}")
        made = self._take_warm(template, dest, fingerprint) if template in self.templates else None
        if made is not None:
            return made[0]
        with self._lock:
            base = self._bases.get(fingerprint)
        if base is None and template in self.templates and template not in self._template_base:
            try:
                base = self._base_of(template)   # built here for the first time: maybe the same tree
            except Exception as exc:   # the saved base serves as well
                log.warning("template %r does not build here (%s); restoring from the saved base", template, exc)
            if base is not None and base.fingerprint != fingerprint:
                base = None
        if base is None:
            base = self._load_base(fingerprint, snapshot_dir)
        shutil.copytree(base.path, dest, symlinks=True)
        return None

    def _load_base(self, fingerprint: str, snapshot_dir: Path) -> Base:
        """The base ``fingerprint`` from ``<snapshot_dir>/bases``, unpacked and kept here."""
        with self._base_lock:
            with self._lock:
                have = self._bases.get(fingerprint)
            if have is not None:
                return have
            src = Path(snapshot_dir) / _BASES_DIR / f"{fingerprint}.tar.gz"
            if not src.is_file():
                raise EnvError(f"the snapshot is a delta over base {fingerprint}, which is neither on this worker "
                               f"nor saved at {src}")
            tmp = self._warm_dir / f".base-{os.urandom(6).hex()}"
            try:
                with tarfile.open(src, "r:*") as tar:
                    if tar.pax_headers.get(_PAX_BASE) != fingerprint:
                        raise EnvError(f"{src} does not hold base {fingerprint}")
                    tmp.mkdir(mode=0o755)
                    _extract(tar, tmp, [_safe_member(m) for m in tar.getmembers()])
                # known by the fingerprint it was saved under; the manifest is of this copy
                base = Base(fingerprint, tmp, scan_base(tmp).manifest)
            except BaseException:
                _rmtree(tmp)
                raise
            with self._lock:
                self._bases[fingerprint] = base
            return base

    def adopt(self, env_id: str, source_root: str | os.PathLike, template: str | None = None) -> Environment:
        """Take ``env_id`` over from the environment root of a worker that died, journal included.

        The directory is copied (symlinks kept), not moved: a worker only believed dead could
        still hold descriptors into it, and must not write into this copy.  The source is removed
        afterwards.  Ownership is set to this environment's uid as for a restore.
        """
        src = Path(source_root) / env_dirname(env_id)
        src_journal = Path(source_root) / (env_dirname(env_id) + ".journal")
        if not is_plain_dir(Path(source_root), env_dirname(env_id)):
            raise EnvError(f"environment {env_id!r} is not in {source_root} (its worker's directory is gone)")
        _kill_leftovers(src)
        journal = _read_journal(src_journal)
        # its last attempt: merged if the dead worker journaled it, dropped if it did not
        done = {r[0] for r in journal}
        env_layers.settle(Path(source_root) / (env_dirname(env_id) + env_layers.ATTEMPT_SUFFIX), src,
                          lambda aid: aid in done)
        self.drop(env_id)
        dest, uid = self._put_in_place(env_id, lambda tmp: _copy_tree(src, tmp),
                                       f"adopt {env_id!r} from {src}")
        env = self._install(env_id, dest, uid, template, journal)
        _rmtree(src)
        src_journal.unlink(missing_ok=True)
        return env

    def _put_in_place(self, env_id: str, fill, what: str, owned: dict | None = None) -> tuple[Path, int | None]:
        """Make a directory with ``fill(path)``, give it a new uid and move it to ``env_id``'s place.

        ``owned``: ``fill`` may put ``uid`` (the uid the tree it made is owned by) and ``unowned``
        (the entries that are not yet) in it; only those are then given to that uid.
        """
        owned = {} if owned is None else owned
        uid = None
        tmp = self._warm_dir / f".incoming-{os.urandom(6).hex()}"
        dest = self.root / env_dirname(env_id)
        try:
            fill(tmp)
            os.chmod(tmp, 0o755)
            uid = owned.get("uid")
            if uid is not None:
                os.chown(tmp, uid, uid, follow_symlinks=False)
                _chown_inside(tmp, owned.get("unowned", ()), uid)
            else:
                uid = self._new_uid()
                if uid is not None:
                    chown_tree(tmp, uid)
            if dest.exists():
                _rmtree(dest)
            # an attempt left over a copy this one replaces must not be merged into it
            _rmtree(self.root / (env_dirname(env_id) + env_layers.ATTEMPT_SUFFIX))
            os.rename(tmp, dest)
        except BaseException as exc:
            self._free_uid(uid if uid is not None else owned.get("uid"))
            _rmtree(tmp)
            if isinstance(exc, (EnvError, KeyboardInterrupt)):
                raise
            raise EnvError(f"cannot {what}: {exc}") from exc
        return dest, uid

    def _install(self, env_id: str, dest: Path, uid: int | None, template: str | None,
                 journal: list, base: BaseRef | None = None) -> Environment:
        now = time.monotonic()
        env = Environment(env_id, dest, template or self.default_template, uid, now, now, base=base)
        self._set_journal(env, journal)
        env.ready.set()
        with self._lock:
            old = self._envs.get(env_id)
            self._envs[env_id] = env
        if old is not None and old.path != dest:
            self._remove(old)
        return env


def _kill_leftovers(env_dir: Path) -> None:
    """Kill what a dead worker's sandbox still runs in ``env_dir`` (on this machine), before the copy.

    As root, a sandboxed command runs under its environment's own uid, and the parent-death signal
    bubblewrap sets is cleared by that uid change (nor may a capability-less bubblewrap signal it),
    so a command outlives a worker killed with SIGKILL and would go on writing into the environment.
    Every process of that uid belongs to this environment's sandbox.
    """
    if os.geteuid() != 0:
        return   # as a user, bubblewrap's --die-with-parent ends the sandbox with its worker
    try:
        uid = os.stat(env_dir, follow_symlinks=False).st_uid
    except OSError:
        return
    if not UID_RANGE[0] <= uid < UID_RANGE[1]:
        return
    for _ in range(20):   # they may fork while being killed; the process limit bounds the rounds
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _uid_of(p) == uid]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _uid_of(pid: str) -> int | None:
    """The real uid of a process (its /proc entry may be root's when it is not dumpable)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def bounded_record(record: list, size: int) -> list:
    """``record`` without its output, saying so in its error (the output of ``size`` bytes packed)."""
    why = f"its output ({size} bytes) was too large to keep in the environment's journal"
    error = record[4] if isinstance(record[4], str) else None
    return [record[0], record[1], record[2], None, f"{error}; {why}" if error else why, *record[5:]]


def _journal_from_header(text: str | None) -> list:
    if not text:
        return []
    try:
        records = msgpack.unpackb(base64.b64decode(text), raw=False)
    except Exception as exc:
        raise EnvError(f"snapshot journal is unreadable: {exc}") from None
    return [r for r in records if isinstance(r, list) and len(r) == 7 and isinstance(r[0], str)] \
        if isinstance(records, list) else []


def _trim_journal(journal: dict) -> None:
    """Drop the oldest records past :data:`JOURNAL_KEEP` or :data:`JOURNAL_MAX_BYTES` (keeping two)."""
    for old in list(journal)[:max(0, len(journal) - JOURNAL_KEEP)]:
        del journal[old]
    total, keep = 0, 0
    for rec in reversed(list(journal.values())):
        total += len(msgpack.packb(rec, use_bin_type=True))
        if total > JOURNAL_MAX_BYTES and keep >= 2:
            break
        keep += 1
    for old in list(journal)[:len(journal) - keep]:
        del journal[old]


def _read_journal(path: Path) -> list:
    """The records of a journal file; a torn last record (a worker killed mid-write) is ignored."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return []
    out = []
    with f:
        records = msgpack.Unpacker(f, raw=False)
        why = None
        try:
            for rec in records:
                if isinstance(rec, list) and len(rec) == 7 and isinstance(rec[0], str):
                    out.append(rec)
        except (ValueError, msgpack.exceptions.UnpackException) as e:
            why = f"{type(e).__name__} {e}".rstrip()
        size = os.fstat(f.fileno()).st_size
        if why is None and records.tell() < size:
            why = f"a torn last record ({size - records.tell()} bytes)"
        if why is not None:
            log.warning("journal %s: %s after %d records; the rest is ignored", path, why, len(out))
    return out[-JOURNAL_KEEP:]


def _write_journal(path: Path, records: list) -> None:
    if not records:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(path.name + f".{os.urandom(4).hex()}.tmp")
    with open(tmp, "wb") as f:
        for r in records:
            f.write(msgpack.packb(r, use_bin_type=True))
    os.replace(tmp, path)


def _safe_member(m: tarfile.TarInfo) -> tarfile.TarInfo:
    name = m.name
    parts = Path(name).parts
    if name.startswith("/") or ".." in parts:
        raise EnvError(f"snapshot member {name!r} escapes the environment")
    if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
        raise EnvError(f"snapshot member {name!r} is a device or fifo")
    if m.islnk() and (m.linkname.startswith("/") or ".." in Path(m.linkname).parts):
        raise EnvError(f"snapshot hard link {name!r} points outside the environment")
    m.mode &= 0o777 if not m.isdir() else 0o1777
    return m


def _parts(rel: Any) -> list[str]:
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\0" in rel:
        raise EnvError(f"file path {rel!r} must be a relative path")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise EnvError(f"file path {rel!r} must stay inside the environment")
    return parts


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


def _open_parent(root: Path, rel: str, parts: list[str], uid: int | None, create: bool) -> int:
    """A descriptor of the directory holding ``parts[-1]``, reached without following symlinks."""
    dirfd = os.open(root, NOFOLLOW_DIR)
    try:
        for part in parts[:-1]:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=dirfd)
                    if uid is not None:
                        os.chown(part, uid, uid, dir_fd=dirfd, follow_symlinks=False)
                except FileExistsError:
                    pass
            try:
                nxt = os.open(part, NOFOLLOW_DIR, dir_fd=dirfd)
            except OSError as exc:
                raise EnvError(f"file path {rel!r}: {part!r} is not a plain directory") from exc
            os.close(dirfd)
            dirfd = nxt
    except BaseException:
        os.close(dirfd)
        raise
    return dirfd


def write_inside(root: Path, rel: str, data: bytes, uid: int | None) -> None:
    """Create or replace the regular file ``root/rel`` with ``data``.

    Refuses paths that leave ``root`` or pass a symlink, and an existing entry
    that is not a regular file (a FIFO would block the worker forever; a
    symlink could redirect a root-owned write to a host file).
    """
    parts = _parts(rel)
    dirfd = _open_parent(root, rel, parts, uid, create=True)
    try:
        try:
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | _NOFOLLOW_FILE, 0o644, dir_fd=dirfd)
        except OSError as exc:
            try:
                what = _kind(os.stat(parts[-1], dir_fd=dirfd, follow_symlinks=False).st_mode)
            except OSError:
                what = None
            if what is not None:
                raise EnvError(f"file path {rel!r} exists and is {what}, not a regular file; "
                               f"it is not written") from exc
            raise EnvError(f"file path {rel!r} cannot be written: {exc}") from exc
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise EnvError(f"file path {rel!r} exists and is {_kind(mode)}, not a regular file; "
                               f"it is not written")
            os.ftruncate(fd, 0)
            if uid is not None:
                os.fchown(fd, uid, uid)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    finally:
        os.close(dirfd)


def _open_file_inside(root: Path, rel: str) -> int | None:
    """A read descriptor of ``root/rel`` if it is a regular file reached without symlinks, else None."""
    try:
        parts = _parts(rel)
        dirfd = _open_parent(root, rel, parts, None, create=False)
    except (EnvError, OSError):
        return None
    try:
        fd = os.open(parts[-1], os.O_RDONLY | _NOFOLLOW_FILE, dir_fd=dirfd)
    except OSError:
        return None
    finally:
        os.close(dirfd)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def size_inside(root: Path, rel: str) -> int | None:
    """The size of ``root/rel`` (what reading it gives: a sparse file counts its holes) if it is a
    regular file reached without symlinks, else None."""
    fd = _open_file_inside(root, rel)
    if fd is None:
        return None
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def read_inside(root: Path, rel: str, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of ``root/rel`` if it is a regular file reached without symlinks."""
    fd = _open_file_inside(root, rel)
    if fd is None:
        return None
    try:
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def is_plain_dir(root: Path, rel: str) -> bool:
    """Whether ``root/rel`` is a directory reached without symlinks."""
    try:
        parts = _parts(rel)
        dirfd = _open_parent(root, rel, parts + ["."], None, create=False)
    except (EnvError, OSError):
        return False
    os.close(dirfd)
    return True


class _Delta:
    """What a delta snapshot leaves out: the entries still as in the base."""

    __slots__ = ("manifest", "ref", "seen")

    def __init__(self, manifest: dict, ref: BaseRef):
        self.manifest = manifest
        self.ref = ref
        self.seen: set[str] = set()   # the base's entries still there with their type

    def keeps(self, path: str, st: os.stat_result) -> bool:
        """Whether ``path`` (lstat ``st``) may be left out: the base has it, unchanged."""
        was = self.manifest.get(path)
        if was is None or stat.S_IFMT(was[0]) != stat.S_IFMT(st.st_mode):
            return False
        self.seen.add(path)
        return unchanged(st, was, self.ref, path)

    def deleted(self) -> list[str]:
        return [p for p in self.manifest if p not in self.seen]


def _tar_tree(tar: tarfile.TarFile, root: Path, delta: _Delta | None = None) -> None:
    """Add the environment at ``root`` as ``.``: directories, symlinks and regular files only;
    with ``delta``, only what differs from the base, then ``.`` again with the base's entries
    that are gone (pax header ``TANGRAM.deleted``).

    FIFOs, sockets and devices are left out (:meth:`EnvStore.restore` refuses them).
    """
    fd = os.open(root, NOFOLLOW_DIR)
    try:
        st = os.fstat(fd)
        tar.addfile(_tarinfo(".", st, tarfile.DIRTYPE))
        _tar_dir(tar, fd, ".", {}, 1, delta)
        if delta is not None:
            last = _tarinfo(".", st, tarfile.DIRTYPE)
            last.pax_headers = {_PAX_DELETED: base64.b64encode(
                msgpack.packb(delta.deleted(), use_bin_type=True)).decode()}
            tar.addfile(last)
    finally:
        os.close(fd)


def _write_tar(out: Path, root: Path, headers: dict[str, str], delta: _Delta | None = None) -> None:
    """Write the tree at ``root`` (:func:`_tar_tree`) to ``out``, which appears whole or not at all."""
    part = out.with_name(f"{out.name}.{os.urandom(4).hex()}.partial")
    try:
        with tarfile.open(part, "w:gz", compresslevel=1, format=tarfile.PAX_FORMAT, pax_headers=headers) as tar:
            _tar_tree(tar, root, delta)
        os.replace(part, out)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def _save_base(base: Base, snapshot_dir: Path) -> None:
    """Save ``base`` as ``<snapshot_dir>/bases/<fingerprint>.tar.gz`` unless it is there."""
    out = snapshot_dir / _BASES_DIR / f"{base.fingerprint}.tar.gz"
    if out.is_file():
        return
    out.parent.mkdir(exist_ok=True)
    _write_tar(out, base.path, {_PAX_BASE: base.fingerprint})


def _deleted_of(members: list[tarfile.TarInfo], snapshot: str) -> list[str]:
    """The base's entries a delta snapshot says are gone (its last member's header)."""
    text = members[-1].pax_headers.get(_PAX_DELETED) if members and members[-1].name in (".", "./") else None
    if text is None:
        raise EnvError(f"snapshot {snapshot} is a delta without its list of deleted entries")
    try:
        deleted = msgpack.unpackb(base64.b64decode(text), raw=False)
    except Exception as exc:
        raise EnvError(f"snapshot {snapshot}: its list of deleted entries is unreadable: {exc}") from None
    if not isinstance(deleted, list) or not all(isinstance(p, str) for p in deleted):
        raise EnvError(f"snapshot {snapshot}: malformed list of deleted entries")
    return deleted


def _remove_inside(root: Path, rel: str) -> None:
    """Remove ``root/rel`` (a tree too) if it is there, never through a symlink."""
    parts = _parts(rel)
    try:
        dirfd = _open_parent(root, rel, parts, None, create=False)
    except (EnvError, OSError):
        return   # a directory above it is gone or not a directory: so is it
    try:
        try:
            st = os.stat(parts[-1], dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            _rmtree(root.joinpath(*parts))   # the path has no symlink (checked above), and the tree is ours
        else:
            os.unlink(parts[-1], dir_fd=dirfd)
    finally:
        os.close(dirfd)


def _open_dirs_for_owner(root: Path) -> list[tuple[str, int]]:
    """Give the owner write and search permission on every directory under ``root`` that lacks
    them (a base's read-only directory would stop a delta's entries); returns their modes."""
    if os.geteuid() == 0:
        return []   # root writes anyway
    opened = []
    for dirpath, dirnames, _ in os.walk(root):
        for name in dirnames:
            full = os.path.join(dirpath, name)
            mode = stat.S_IMODE(os.lstat(full).st_mode)
            if mode & 0o300 != 0o300:
                os.chmod(full, mode | 0o700)
                opened.append(("./" + os.path.relpath(full, root), mode))
    return opened


def _extract(tar: tarfile.TarFile, dest: Path, members: list[tarfile.TarInfo]) -> None:
    """Unpack ``members`` (checked by :func:`_safe_member`) under ``dest``, modes as saved.

    Each entry is made relative to its directory's descriptor, reached one level at a time
    without following symlinks: sandboxed code can make paths longer than the kernel takes in
    one call (PATH_MAX), and no member may reach through a symlink an earlier one made. A
    directory gets its mode and time after its contents (a read-only one would refuse them).
    """
    at = _OpenPath(dest)
    sources = _OpenPath(dest)        # hard links' targets, apart: the member's own directory stays open
    dirs: list[tuple[list[str], tarfile.TarInfo]] = []
    try:
        for m in members:
            parts = _member_parts(m.name)
            if not parts:
                dirs.append((parts, m))
                continue
            parent, name = at.open(parts[:-1], m.name), parts[-1]
            if m.isdir():
                try:
                    os.mkdir(name, 0o700, dir_fd=parent)
                except FileExistsError:
                    if not stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                        os.unlink(name, dir_fd=parent)
                        os.mkdir(name, 0o700, dir_fd=parent)
                dirs.append((parts, m))
                continue
            _unlink_if_there(name, parent)
            if m.issym():
                os.symlink(m.linkname, name, dir_fd=parent)
                os.utime(name, (m.mtime, m.mtime), dir_fd=parent, follow_symlinks=False)
            elif m.islnk():
                target = _member_parts(m.linkname)
                os.link(target[-1], name, src_dir_fd=sources.open(target[:-1], m.linkname), dst_dir_fd=parent,
                        follow_symlinks=False)
            else:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW_FILE, 0o600, dir_fd=parent)
                with os.fdopen(fd, "wb") as out:
                    data = tar.extractfile(m)
                    if data is not None:
                        shutil.copyfileobj(data, out, 1 << 20)
                    out.flush()             # before the time is set: a later write would move it
                    os.chmod(fd, m.mode)
                    os.utime(fd, (m.mtime, m.mtime))
        for parts, m in reversed(dirs):         # the deepest first: their parents are still searchable
            fd = at.open(parts, m.name)
            os.chmod(fd, m.mode)
            os.utime(fd, (m.mtime, m.mtime))
    finally:
        at.close()
        sources.close()


def _member_parts(name: str) -> list[str]:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if len(parts) > _MAX_DEPTH + 1:
        raise EnvError(f"snapshot member {name[:200]!r}... nests deeper than {_MAX_DEPTH} levels")
    return parts


def _unlink_if_there(name: str, dirfd: int) -> None:
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise EnvError(f"snapshot member {name!r} would replace a directory")
    os.unlink(name, dir_fd=dirfd)


class _OpenPath:
    """Descriptors of the directories from a root down to the one last asked for, kept open so
    that the entries of one directory (together in a snapshot) do not walk down again."""

    def __init__(self, root: Path):
        self.fds = [os.open(root, NOFOLLOW_DIR)]
        self.names: list[str] = []

    def open(self, parts: list[str], what: str) -> int:
        """The directory ``parts`` below the root (never through a symlink)."""
        k = 0
        names = self.names
        while k < len(names) and k < len(parts) and names[k] == parts[k]:
            k += 1
        while len(names) > k:
            names.pop()
            os.close(self.fds.pop())
        for part in parts[k:]:
            try:
                fd = os.open(part, NOFOLLOW_DIR, dir_fd=self.fds[-1])
            except OSError as exc:
                raise EnvError(f"snapshot member {what[:200]!r}: {part[:200]!r} is not a plain directory") from exc
            names.append(part)
            self.fds.append(fd)
        return self.fds[-1]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _copy_tree(src: Path, dest: Path) -> None:
    """Copy the tree ``src`` to the new directory ``dest`` (symlinks as symlinks, modes and times
    kept, devices and fifos left out), one level at a time: its paths may be longer than PATH_MAX."""
    top = os.open(src, NOFOLLOW_DIR)
    try:
        os.mkdir(dest, 0o700)
        out = os.open(dest, NOFOLLOW_DIR)
        try:
            _copy_dir(top, out, 1)
            _copy_meta(os.fstat(top), out)
        finally:
            os.close(out)
    finally:
        os.close(top)


def _copy_meta(st: os.stat_result, fd: int) -> None:
    os.chmod(fd, stat.S_IMODE(st.st_mode))
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


def _copy_dir(src: int, dst: int, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise EnvError(f"environment nests directories deeper than {_MAX_DEPTH} levels: not copied")
    with os.scandir(src) as it:
        names = [e.name for e in it]
    for name in names:
        try:
            st = os.stat(name, dir_fd=src, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(name, NOFOLLOW_DIR, dir_fd=src)
                try:
                    os.mkdir(name, 0o700, dir_fd=dst)
                    out = os.open(name, NOFOLLOW_DIR, dir_fd=dst)
                    try:
                        _copy_dir(sub, out, depth + 1)
                        _copy_meta(os.fstat(sub), out)
                    finally:
                        os.close(out)
                finally:
                    os.close(sub)
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dst)
                os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dst, follow_symlinks=False)
            elif stat.S_ISREG(st.st_mode):
                fin = os.open(name, os.O_RDONLY | _NOFOLLOW_FILE, dir_fd=src)
                try:
                    st = os.fstat(fin)
                    if not stat.S_ISREG(st.st_mode):
                        continue            # replaced by something else since it was listed
                    fout = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW_FILE, 0o600, dir_fd=dst)
                    try:
                        while os.sendfile(fout, fin, None, 1 << 24):
                            pass
                        _copy_meta(st, fout)
                    finally:
                        os.close(fout)
                finally:
                    os.close(fin)
        except OSError as exc:
            if exc.errno not in _CHANGED_MEANWHILE:
                raise


def _tarinfo(name: str, st: os.stat_result, kind: bytes) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = stat.S_IMODE(st.st_mode)
    ti.mtime = int(st.st_mtime)
    ti.uid, ti.gid = st.st_uid, st.st_gid
    return ti


def _tar_dir(tar: tarfile.TarFile, dirfd: int, arc: str, links: dict, depth: int,
             delta: _Delta | None = None) -> None:
    if depth > _MAX_DEPTH:
        raise EnvError(f"environment nests directories deeper than {_MAX_DEPTH} levels: not saved")
    with os.scandir(dirfd) as it:
        names = sorted(e.name for e in it)
    for name in names:
        path = f"{arc}/{name}"
        try:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            kept = delta is not None and delta.keeps(path, st)
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(name, NOFOLLOW_DIR, dir_fd=dirfd)
                try:
                    if not kept:
                        tar.addfile(_tarinfo(path, os.fstat(sub), tarfile.DIRTYPE))
                    _tar_dir(tar, sub, path, links, depth + 1, delta)
                finally:
                    os.close(sub)
            elif kept:
                continue
            elif stat.S_ISLNK(st.st_mode):
                ti = _tarinfo(path, st, tarfile.SYMTYPE)
                ti.linkname = os.readlink(name, dir_fd=dirfd)
                tar.addfile(ti)
            elif stat.S_ISREG(st.st_mode):
                _tar_file(tar, dirfd, name, path, links)
        except OSError as exc:
            if exc.errno not in _CHANGED_MEANWHILE:
                raise
            continue  # removed or replaced while being saved


def _tar_file(tar: tarfile.TarFile, dirfd: int, name: str, path: str, links: dict) -> None:
    fd = os.open(name, os.O_RDONLY | _NOFOLLOW_FILE, dir_fd=dirfd)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return
        if st.st_nlink > 1:
            first = links.setdefault((st.st_dev, st.st_ino), path)
            if first != path:
                ti = _tarinfo(path, st, tarfile.LNKTYPE)
                ti.linkname = first[2:]  # tar stores hard-link targets without the leading "./"
                tar.addfile(ti)
                return
        ti = _tarinfo(path, st, tarfile.REGTYPE)
        ti.size = st.st_size
        tar.addfile(ti, fh)


def _chown_inside(root: Path, rels: Iterable[str], uid: int) -> None:
    """Give ``uid`` the entries ``rels`` of ``root`` and the directories above them, never through a symlink."""
    todo: set[str] = set()
    for rel in rels:
        parts = _parts(rel)
        for k in range(1, len(parts) + 1):
            todo.add("/".join(parts[:k]))
    for rel in sorted(todo):
        parts = rel.split("/")
        try:
            dirfd = _open_parent(root, rel, parts, None, create=False)
        except (EnvError, OSError):
            continue   # not there (a hard link's second name is the same entry)
        try:
            os.chown(parts[-1], uid, uid, dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            pass
        finally:
            os.close(dirfd)


def chown_tree(path: Path, uid: int) -> None:
    """Give ``uid`` the tree ``path``, one level at a time (paths may be longer than PATH_MAX)."""
    top = os.open(path, NOFOLLOW_DIR)
    try:
        os.chown(top, uid, uid)
        _chown_dir(top, uid, 1)
    finally:
        os.close(top)


def _chown_dir(dirfd: int, uid: int, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise EnvError(f"environment nests directories deeper than {_MAX_DEPTH} levels")
    with os.scandir(dirfd) as it:
        entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    for name, is_dir in entries:
        os.chown(name, uid, uid, dir_fd=dirfd, follow_symlinks=False)
        if is_dir:
            sub = os.open(name, NOFOLLOW_DIR, dir_fd=dirfd)
            try:
                _chown_dir(sub, uid, depth + 1)
            finally:
                os.close(sub)


def _rmtree(path: Path) -> None:
    def onerror(func, p, exc_info):  # sandboxed code may have removed write permission
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700, follow_symlinks=False) if not os.path.islink(p) else None
            func(p)
        except OSError:
            pass
    if os.path.lexists(path):
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=onerror)
        else:
            shutil.rmtree(path, onerror=onerror)
