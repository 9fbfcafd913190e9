"""What a worker's new environments are made from: templates, their bases, the warm pool, uids.

An :class:`~.environments.EnvStore` asks :class:`EnvBuilds` for a populated directory (a copy of
the template's pristine base, or the template filled in place when it has none), for a copy of
a base a snapshot names (from the warm pool, the base held here, or the one saved beside the
snapshot), and for the uid each environment's files are owned by when the worker runs as root.
A background thread keeps ``warm_pool`` ready-made copies per template, so that a new
trajectory does not wait for a copy of a project tree or the creation of a Python env.
"""
from __future__ import annotations

import logging
import os
import random
import shutil
import tarfile
import threading
from pathlib import Path
from typing import Any, Mapping

from .env_bases import Base, BaseRef, scan_base, settled_now
from .env_snapshots import _BASES_DIR, _FINGERPRINT, _PAX_BASE, _extract, _safe_member
from .env_templates import EmptyTemplate, Template, UnknownTemplate, template_from_config
from .fs_inside import EnvError, _rmtree, chown_tree

__all__ = ["EnvBuilds", "UID_RANGE"]

log = logging.getLogger(__name__)

#: Uids handed to environments when the worker is root: far above normal
#: user and subordinate-uid ranges.
UID_RANGE = (0x6A000000, 0x6A000000 + (1 << 20))


class EnvBuilds:
    """The templates of one store, their pristine bases, its warm pool and its uids (thread-safe).

    ``warm_dir``: where bases, copies in the making and ready-made copies live (the store's,
    beside its environments and out of every sandbox's sight)."""

    def __init__(self, warm_dir: Path, templates: Mapping[str, Any], default_template: str, warm_pool: int,
                 drop_privileges: bool):
        self.templates: dict[str, Template] = {"empty": EmptyTemplate()}
        for name, t in templates.items():
            self.templates[name] = template_from_config(t)
        if default_template not in self.templates:
            raise EnvError(f"default template {default_template!r} is not configured")
        self.default_template = default_template
        self.warm_pool = warm_pool
        self.drop_privileges = drop_privileges
        self.warm_dir = warm_dir
        self._lock = threading.Condition()
        self._uids: set[int] = set()
        self._spare_uids: list[int] = []    # reserved, run as by pre-started sessions, for new environments
        self._warm: dict[str, list[tuple[Path, int | None, BaseRef | None]]] = {t: [] for t in self.templates}
        self._bases: dict[str, Base] = {}            # fingerprint -> pristine base held here
        self._template_base: dict[str, str] = {}     # template -> fingerprint of its base here
        self._base_lock = threading.Lock()           # one pristine build at a time
        self._closed = False
        self.warm_hits = 0  # environments served from the pool (observability, tests)
        self._thread: threading.Thread | None = None
        if warm_pool > 0:
            self._thread = threading.Thread(target=self._fill_warm, name="sandbox-warm-pool",
                                            daemon=True)
            self._thread.start()

    def check_template(self, template: str | None) -> None:
        """Raise :class:`UnknownTemplate` unless ``template`` (None: the default) is configured here."""
        if (template or self.default_template) not in self.templates:
            raise UnknownTemplate(f"unknown template {template!r}; configured: {sorted(self.templates)}")

    # -- uids ------------------------------------------------------------------
    def new_uid(self) -> int | None:
        """A uid for a new environment: one a pre-started session runs as, if one is offered
        (:meth:`offer_uid`), so that the environment's first action can claim that session."""
        if not self.drop_privileges:
            return None
        with self._lock:
            if self._spare_uids:
                return self._spare_uids.pop()
        return self.reserve_uid()

    def reserve_uid(self) -> int | None:
        """A uid no environment has (held until :meth:`free_uid`)."""
        if not self.drop_privileges:
            return None
        with self._lock:
            while True:
                uid = random.randrange(*UID_RANGE)
                if uid not in self._uids:
                    self._uids.add(uid)
                    return uid

    def offer_uid(self, uid: int) -> None:
        """Give the reserved ``uid`` to the next new environment (a pre-started session runs as it)."""
        with self._lock:
            self._spare_uids.append(uid)

    def spare(self, uid: int | None) -> bool:
        """Whether ``uid`` is offered and not yet given to an environment."""
        with self._lock:
            return uid in self._spare_uids

    def withdraw_uid(self, uid: int | None) -> None:
        """``uid`` is no longer offered; freed unless an environment has it already."""
        with self._lock:
            if uid in self._spare_uids:
                self._spare_uids.remove(uid)
                self._uids.discard(uid)

    def free_uid(self, uid: int | None) -> None:
        if uid is not None:
            with self._lock:
                self._uids.discard(uid)

    def uid_held(self, uid: int | None) -> bool:
        """Whether ``uid`` is reserved or an environment's."""
        with self._lock:
            return uid in self._uids

    # -- bases -------------------------------------------------------------------
    def base(self, fingerprint: str) -> Base | None:
        """The pristine base ``fingerprint`` if it is held here."""
        with self._lock:
            return self._bases.get(fingerprint)

    def base_of(self, template: str) -> Base | None:
        """The pristine base of ``template`` on this worker, built (once) on first use; None for "empty"."""
        if isinstance(self.templates[template], EmptyTemplate):
            return None
        with self._base_lock:
            fp = self._template_base.get(template)
            if fp is not None:
                return self._bases[fp]
            tmp = self.warm_dir / f".base-{os.urandom(6).hex()}"
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

    def copy_base(self, fingerprint: str, template: str | None, snapshot_dir: Path, dest: Path) -> int | None:
        """Put a copy of the base ``fingerprint`` at ``dest``: a ready-made environment of the
        pool, else a copy of the pristine base held here, else of the one saved beside the snapshot.
        Returns the uid the copy is owned by (a ready-made one's), or None."""
        if not _FINGERPRINT.fullmatch(fingerprint):
            raise EnvError(f"snapshot names a malformed base {fingerprint!r}")
        made = self.take_warm(template, dest, fingerprint) if template in self.templates else None
        if made is not None:
            return made[0]
        base = self.base(fingerprint)
        if base is None and template in self.templates and template not in self._template_base:
            try:
                base = self.base_of(template)   # built here for the first time: maybe the same tree
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
            have = self.base(fingerprint)
            if have is not None:
                return have
            src = Path(snapshot_dir) / _BASES_DIR / f"{fingerprint}.tar.gz"
            if not src.is_file():
                raise EnvError(f"the snapshot is a delta over base {fingerprint}, which is neither on this worker "
                               f"nor saved at {src}")
            tmp = self.warm_dir / f".base-{os.urandom(6).hex()}"
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

    # -- new copies ----------------------------------------------------------------
    def build(self, template: str, dest: Path) -> tuple[int | None, BaseRef | None]:
        """Create a populated, owned directory at ``dest`` (which must not exist): a copy of the
        template's base, and what it is a copy of."""
        base = self.base_of(template)
        uid = self.new_uid()
        tmp = self.warm_dir / f".build-{os.urandom(6).hex()}"
        try:
            if base is None:
                tmp.mkdir(mode=0o755)
                self.templates[template].populate(tmp)
            else:
                shutil.copytree(base.path, tmp, symlinks=True)
                os.chmod(tmp, 0o755)
            if uid is not None:
                chown_tree(tmp, uid)
            ref = BaseRef(base.fingerprint, settled_now(self.warm_dir)) if base is not None else None
            os.rename(tmp, dest)
        except BaseException:
            self.free_uid(uid)
            _rmtree(tmp)
            raise
        return uid, ref

    def take_warm(self, template: str, dest: Path, fingerprint: str | None = None
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
            dest = self.warm_dir / f"{template}-{os.urandom(6).hex()}"
            try:
                uid, ref = self.build(template, dest)
            except Exception as exc:  # a broken template must not kill the pool for the others
                log.error("warm pool: template %r failed to build (%s: %s); it is no longer kept warm and "
                          "each environment made from it is built on demand, reporting its error",
                          template, type(exc).__name__, exc)
                with self._lock:
                    self._warm.pop(template, None)
                continue
            with self._lock:
                if self._closed:
                    self.free_uid(uid)
                    _rmtree(dest)
                    return
                self._warm.setdefault(template, []).append((dest, uid, ref))

    def warm_count(self, template: str) -> int:
        """Ready-made environments of ``template`` waiting in the pool."""
        with self._lock:
            return len(self._warm.get(template, ()))

    def close(self) -> None:
        """Stop the pool's thread and remove the ready-made copies."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            warm = [entry[0] for pool in self._warm.values() for entry in pool]
            self._warm = {}
        if self._thread is not None:
            self._thread.join(timeout=60)
        for p in warm:
            _rmtree(p)
