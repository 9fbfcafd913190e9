"""Stateful sandbox environments: directories that outlive single actions.

An environment is a directory under the manager's root, created from a
*template* the first time an action names it, kept between the actions of
a trajectory, and removed by :meth:`EnvStore.drop` or when unused for longer
than its TTL.  What a new one is made from (templates, their bases, the warm
pool of ready-made copies, the uids) is :class:`~.env_builds.EnvBuilds`'s.

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
import logging
import os
import select
import signal
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import msgpack

from ..envfiles import env_dirname
from .env_bases import BaseRef, settled_now
from .env_builds import UID_RANGE, EnvBuilds
from . import env_layers
from .env_snapshots import (_PAX_BASE, _PAX_ENV, _PAX_GEN, _PAX_JOURNAL, _PAX_TEMPLATE,
                            JOURNAL_KEEP, JOURNAL_MAX_BYTES, JOURNAL_RECORD_BYTES, _Delta, _deleted_of, _extract,
                            _journal_from_header, _read_journal, _safe_member, _save_base, _trim_journal,
                            _write_journal, _write_tar, bounded_record)
from .fs_inside import (EnvError, _chown_inside, _copy_tree, _open_dirs_for_owner, _remove_inside, _rmtree,
                        chown_tree, is_plain_dir, write_inside)

__all__ = ["Environment", "EnvStore", "UID_RANGE"]

log = logging.getLogger(__name__)


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
    live_layer: bool = field(default=False, repr=False)  # its attempt's layer is mounted in a live session


class EnvStore:
    """Registry of the environments of one manager (thread-safe)."""

    def __init__(self, root: Path, templates: Mapping[str, Any], default_template: str,
                 ttl: float | None, warm_pool: int, drop_privileges: bool):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)  # environment uids must traverse it, not list it
        self.ttl = ttl
        self._lock = threading.RLock()
        self._envs: dict[str, Environment] = {}
        self._closed = False
        #: actions holding an environment now (acquired, not yet released)
        self.active = 0
        #: whether the outcomes of actions are journaled (a worker's EnvHost): then an attempt's layer
        #: is committed by its journal record (env_layers), else as soon as its command ended
        self.journaled = False
        self._warm_dir = self.root / ".warm"
        self._warm_dir.mkdir(exist_ok=True)
        #: what new environments are made from: templates, bases, the warm pool, uids
        self.builds = EnvBuilds(self._warm_dir, templates, default_template, warm_pool, drop_privileges)

    @property
    def warm_hits(self) -> int:
        """Environments served from the warm pool (observability, tests)."""
        return self.builds.warm_hits

    def warm_count(self, template: str) -> int:
        """Ready-made environments of ``template`` waiting in the pool."""
        return self.builds.warm_count(template)

    def acquire(self, env_id: str | None, template: str | None) -> Environment:
        """The environment ``env_id`` (created from ``template`` if new), marked busy.

        ``env_id`` None gives a throwaway environment, removed on release.
        """
        template = template or self.builds.default_template
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
                self.builds.check_template(template)
                now = time.monotonic()
                env = Environment(key, self.root / env_dirname(key), template, None, now, now,
                                  throwaway, busy=1)
                self._envs[key] = env
                creator = True
            self.active += 1
        if creator:
            try:
                if env.path.exists():  # left behind by an earlier manager on this root
                    _rmtree(env.path)
                _rmtree(self.attempt_path(env))
                if not throwaway:
                    self._journal_path(key).unlink(missing_ok=True)
                made = self.builds.take_warm(template, env.path)
                env.uid, env.base = self.builds.build(template, env.path) if made is None else made
            except BaseException as exc:
                env.failure = exc
                with self._lock:
                    self._envs.pop(key, None)
                    self.active -= 1
                env.ready.set()
                raise EnvError(f"cannot create environment {key!r} from template {template!r}: {exc}") from exc
            env.ready.set()
        else:
            env.ready.wait()
            if env.failure is not None:
                with self._lock:
                    self.active -= 1
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

    def has(self, env_id: str) -> bool:
        """Whether ``env_id`` is here and ready."""
        return env_id in self.ids()

    def release(self, env: Environment) -> None:
        with self._lock:
            env.busy -= 1
            self.active -= 1
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
        self.builds.free_uid(env.uid)

    def close(self, keep: Iterable[str] = ()) -> None:
        """Remove every environment but those in ``keep``, which stay on disk with their journals
        (a leaving worker that could not hand them back: another worker may adopt them)."""
        keep = frozenset(keep)
        with self._lock:
            self._closed = True
            envs = [e for e in self._envs.values() if e.id not in keep]
            self._envs.clear()
        self.builds.close()
        for e in envs:
            self._remove(e)
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
        if env.live_layer:
            return None   # mounted in the environment's live session: settled once it is taken away
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
        base = self.builds.base(env.base.fingerprint) if env.base is not None else None
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
                owned["uid"] = self.builds.copy_base(fingerprint, saved_template, src.parent, tmp)
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
        if template is None and saved_template in self.builds.templates:
            template = saved_template
        ref = BaseRef(fingerprint, settled_now(self._warm_dir), dirty) if fingerprint is not None else None
        return self._install(env_id, dest, uid, template, journal, ref)

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
                uid = self.builds.new_uid()
                if uid is not None:
                    chown_tree(tmp, uid)
            if dest.exists():
                _rmtree(dest)
            # an attempt left over a copy this one replaces must not be merged into it
            _rmtree(self.root / (env_dirname(env_id) + env_layers.ATTEMPT_SUFFIX))
            os.rename(tmp, dest)
        except BaseException as exc:
            self.builds.free_uid(uid if uid is not None else owned.get("uid"))
            _rmtree(tmp)
            if isinstance(exc, (EnvError, KeyboardInterrupt)):
                raise
            raise EnvError(f"cannot {what}: {exc}") from exc
        return dest, uid

    def _install(self, env_id: str, dest: Path, uid: int | None, template: str | None,
                 journal: list, base: BaseRef | None = None) -> Environment:
        now = time.monotonic()
        env = Environment(env_id, dest, template or self.builds.default_template, uid, now, now, base=base)
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
