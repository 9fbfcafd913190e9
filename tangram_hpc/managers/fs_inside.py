"""Host-side file operations inside an environment, whose contents sandboxed code controls.

The worker may be root: every path inside an environment is walked one component at a time with
``O_NOFOLLOW`` (no symlink leads out), opened with ``O_NONBLOCK`` (a FIFO cannot block the worker),
and only regular files are read or written.  Trees are copied, chowned and removed one level at a
time (their paths may be longer than PATH_MAX).  Used by :mod:`tangram_hpc.managers.environments`
and :mod:`tangram_hpc.managers.env_snapshots`.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Any, Iterable

from ..envfiles import NOFOLLOW_DIR
from ..errors import TangramError

__all__ = ["EnvError", "write_inside", "read_inside", "size_inside", "is_plain_dir", "chown_tree"]

_NOFOLLOW_FILE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
#: Snapshots of deeper trees are refused (the walk holds one descriptor per level).
_MAX_DEPTH = 256
_CHANGED_MEANWHILE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENXIO})


class EnvError(TangramError, RuntimeError):
    """An environment could not be created, found, written, saved or restored."""


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
