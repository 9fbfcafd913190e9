"""An environment's snapshot (a tar with its journal in the pax header; a delta over its
template's base when it has one) and its journal file, for :class:`~tangram_hpc.managers.environments.EnvStore`.

Extraction makes each entry relative to its directory's descriptor (:mod:`tangram_hpc.managers.fs_inside`):
a snapshot's members never reach through a symlink, out of the environment, or into a device.
"""
from __future__ import annotations

import base64
import logging
import os
import re
import shutil
import stat
import tarfile
from pathlib import Path

import msgpack

from ..envfiles import PAX_ENV, PAX_GEN
from .env_bases import Base, BaseRef, unchanged
from .fs_inside import _CHANGED_MEANWHILE, _NOFOLLOW_FILE, MAX_DEPTH, EnvError, _OpenPath, _walk

__all__ = ["JOURNAL_KEEP", "JOURNAL_MAX_BYTES", "JOURNAL_RECORD_BYTES", "bounded_record"]

log = logging.getLogger(__name__)

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
    cur = _OpenPath(root)
    try:
        st = os.fstat(cur.fd)
        tar.addfile(_tarinfo(".", st, tarfile.DIRTYPE))
        links: dict = {}
        for name, entry in _walk(cur):
            if entry is None:
                continue
            try:
                if stat.S_ISDIR(entry.st_mode):         # (the walk is in it)
                    path = "./" + "/".join(cur.names)
                    if not (delta is not None and delta.keeps(path, entry)):
                        tar.addfile(_tarinfo(path, os.fstat(cur.fd), tarfile.DIRTYPE))
                    continue
                path = "./" + "/".join([*cur.names, name])
                if delta is not None and delta.keeps(path, entry):
                    continue
                if stat.S_ISLNK(entry.st_mode):
                    ti = _tarinfo(path, entry, tarfile.SYMTYPE)
                    ti.linkname = os.readlink(name, dir_fd=cur.fd)
                    tar.addfile(ti)
                elif stat.S_ISREG(entry.st_mode):
                    _tar_file(tar, cur.fd, name, path, links)
            except OSError as exc:
                if exc.errno not in _CHANGED_MEANWHILE:
                    raise           # (else removed or replaced while being saved)
        if delta is not None:
            last = _tarinfo(".", st, tarfile.DIRTYPE)
            last.pax_headers = {_PAX_DELETED: base64.b64encode(
                msgpack.packb(delta.deleted(), use_bin_type=True)).decode()}
            tar.addfile(last)
    finally:
        cur.close()


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
    if len(parts) > MAX_DEPTH + 1:
        raise EnvError(f"snapshot member {name[:200]!r}... nests deeper than {MAX_DEPTH} levels")
    return parts


def _unlink_if_there(name: str, dirfd: int) -> None:
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise EnvError(f"snapshot member {name!r} would replace a directory")
    os.unlink(name, dir_fd=dirfd)


def _tarinfo(name: str, st: os.stat_result, kind: bytes) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = stat.S_IMODE(st.st_mode)
    ti.mtime = int(st.st_mtime)
    ti.uid, ti.gid = st.st_uid, st.st_gid
    return ti


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
