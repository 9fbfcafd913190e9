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
import stat
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ..envfiles import NOFOLLOW_DIR
from ..errors import TangramError

__all__ = ["EnvError", "write_inside", "read_inside", "size_inside", "is_plain_dir", "chown_tree", "remove_at",
           "MAX_DEPTH", "MAX_PATH_BYTES"]

_NOFOLLOW_FILE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
#: Deeper trees are not saved, restored, copied or chowned (an error saying so): a snapshot stores
#: each entry's whole path, so a tree's cost grows with the square of its depth; no tree of real
#: use comes near.
MAX_DEPTH = 4096
#: ... nor trees with a path longer than this (bytes, below the environment), for the same reason.
MAX_PATH_BYTES = 64 << 10
_CHANGED_MEANWHILE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENXIO})


class EnvError(TangramError, RuntimeError):
    """An environment could not be created, found, written, saved or restored."""


class TreeMoved(EnvError):
    """A directory of a tree being walked moved meanwhile (the walk stopped there)."""


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
    """One descriptor of a directory of a tree, moved down by name and back up by ``..``: a deep
    tree costs one descriptor, not one per level.  Each step up is checked against the directory
    passed on the way down, so a tree changed meanwhile (a directory moved by a process left in
    it) stops the walk with an error instead of leading it anywhere else."""

    def __init__(self, root: Path | str, bounded: bool = True, dir_fd: int | None = None):
        self.fd = os.open(root, NOFOLLOW_DIR, dir_fd=dir_fd)
        self.names: list[str] = []           # the path from the root, one name per level
        self._ids = [_identity(self.fd)]
        self._bytes = 0
        self._bounded = bounded              # by MAX_DEPTH and MAX_PATH_BYTES (a removal is not)

    def down(self, name: str) -> None:
        """Into the directory ``name`` (never through a symlink); OSError when it is not one."""
        if self._bounded and len(self.names) >= MAX_DEPTH:
            raise EnvError(f"the environment nests directories deeper than {MAX_DEPTH} levels")
        if self._bounded and self._bytes + len(name) + 1 > MAX_PATH_BYTES:
            raise EnvError(f"the environment has paths longer than {MAX_PATH_BYTES} bytes")
        fd = os.open(name, NOFOLLOW_DIR, dir_fd=self.fd)
        os.close(self.fd)
        self.fd = fd
        self.names.append(name)
        self._ids.append(_identity(fd))
        self._bytes += len(name) + 1

    def up(self) -> None:
        fd = os.open("..", NOFOLLOW_DIR, dir_fd=self.fd)
        if _identity(fd) != self._ids[-2]:
            os.close(fd)
            raise TreeMoved(f"directory {'/'.join(self.names)[:200]!r} moved while the environment was walked")
        os.close(self.fd)
        self.fd = fd
        self._bytes -= len(self.names.pop()) + 1
        self._ids.pop()

    def open(self, parts: list[str], what: str) -> int:
        """The directory ``parts`` below the root (never through a symlink)."""
        k = 0
        names = self.names
        while k < len(names) and k < len(parts) and names[k] == parts[k]:
            k += 1
        while len(names) > k:
            self.up()
        for part in parts[k:]:
            try:
                self.down(part)
            except OSError as exc:
                raise EnvError(f"snapshot member {what[:200]!r}: {part[:200]!r} is not a plain directory") from exc
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _walk(cur: _OpenPath, force: bool = False, descend: Callable[[str, os.stat_result], bool] | None = None,
          skip_denied: bool = False) -> Iterator[tuple[str, os.stat_result | None]]:
    """Every entry below ``cur``'s directory, depth first in name order, without recursion.

    Yields ``(name, lstat)``: for a directory once ``cur`` is in it, for anything else with ``cur``
    at the directory holding it; then ``(name, None)`` when a directory's entries are done, ``cur``
    back at its parent.  Entries removed or replaced meanwhile are left out.  ``force``: a directory
    that cannot be opened for want of permission (sandboxed code's chmod) is given it first;
    ``skip_denied``: it is yielded as a file is instead.  ``descend(name, lstat)``: whether to go into a
    directory (called with ``cur`` at its parent); one it declines is yielded as a file is.
    """
    top = len(cur.names)
    pending = [_names(cur.fd)]
    while pending:
        if not pending[-1]:
            pending.pop()
            if len(cur.names) > top:
                name = cur.names[-1]
                cur.up()
                yield name, None
            continue
        name = pending[-1].pop()
        try:
            st = os.stat(name, dir_fd=cur.fd, follow_symlinks=False)
            into = stat.S_ISDIR(st.st_mode) and (descend is None or descend(name, st))
            if into:
                into = _down(cur, name, force, skip_denied)
        except OSError as exc:
            if exc.errno in _CHANGED_MEANWHILE:
                continue
            raise
        if into:
            pending.append(_names(cur.fd))
        yield name, st


def _names(fd: int) -> list[str]:
    return sorted(os.listdir(fd), reverse=True)     # popped from the end: in name order


def _down(cur: _OpenPath, name: str, force: bool, skip_denied: bool = False) -> bool:
    """Into the directory ``name`` (see :func:`_walk` for ``force`` and ``skip_denied``); whether it went."""
    try:
        cur.down(name)
        return True
    except PermissionError:
        if skip_denied:
            return False
        if not force:
            raise
        # a directory (lstat above) of a tree being removed, which no sandboxed process runs in
        # any more; only a worker that is not root gets here, and it cannot chmod what is not its own
        os.chmod(name, 0o700, dir_fd=cur.fd)
        cur.down(name)
        return True


def _copy_tree(src: Path, dest: Path) -> None:
    """Copy the tree ``src`` to the new directory ``dest`` (symlinks as symlinks, modes and times
    kept, devices and fifos left out); its paths may be longer than PATH_MAX."""
    os.mkdir(dest, 0o700)
    cur, out = _OpenPath(src), _OpenPath(dest)
    try:
        for name, st in _walk(cur):
            try:
                if st is None:          # its entries are copied: its mode and time now
                    out.up()
                    _copy_meta(os.stat(name, dir_fd=cur.fd, follow_symlinks=False), out.fd, name)
                elif stat.S_ISDIR(st.st_mode):
                    os.mkdir(name, 0o700, dir_fd=out.fd)
                    out.down(name)
                elif stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(name, dir_fd=cur.fd), name, dir_fd=out.fd)
                    os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=out.fd, follow_symlinks=False)
                elif stat.S_ISREG(st.st_mode):
                    _copy_file(cur.fd, out.fd, name)
            except OSError as exc:
                if exc.errno not in _CHANGED_MEANWHILE:
                    raise
        _copy_meta(os.fstat(cur.fd), out.fd)
    finally:
        cur.close()
        out.close()


def _copy_meta(st: os.stat_result, fd: int, name: str | None = None) -> None:
    """Mode and times of ``st`` onto ``fd`` (or its directory ``name``)."""
    if name is not None:
        fd = os.open(name, NOFOLLOW_DIR, dir_fd=fd)
        try:
            _copy_meta(st, fd)
        finally:
            os.close(fd)
        return
    os.chmod(fd, stat.S_IMODE(st.st_mode))
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


def _copy_file(src: int, dst: int, name: str) -> None:
    fin = os.open(name, os.O_RDONLY | _NOFOLLOW_FILE, dir_fd=src)
    try:
        st = os.fstat(fin)
        if not stat.S_ISREG(st.st_mode):
            return                  # replaced by something else since it was listed
        fout = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW_FILE, 0o600, dir_fd=dst)
        try:
            while os.sendfile(fout, fin, None, 1 << 24):
                pass
            _copy_meta(st, fout)
        finally:
            os.close(fout)
    finally:
        os.close(fin)


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
    """Give ``uid`` the tree ``path``; its paths may be longer than PATH_MAX."""
    cur = _OpenPath(path)
    try:
        os.fchown(cur.fd, uid, uid)
        for name, st in _walk(cur):
            if st is None:
                continue
            if stat.S_ISDIR(st.st_mode):
                os.fchown(cur.fd, uid, uid)     # (the walk is in it)
            else:
                os.chown(name, uid, uid, dir_fd=cur.fd, follow_symlinks=False)
    finally:
        cur.close()


def _rmtree(path: Path) -> None:
    """Remove the tree ``path`` if it is there, whatever permissions sandboxed code left in it."""
    remove_at(None, path)


def remove_at(dir_fd: int | None, name: str | Path) -> None:
    """Remove the entry ``name`` of the directory ``dir_fd`` (None: ``name`` is a path) if it is there,
    a tree too, never through a symlink, whatever permissions sandboxed code left in it."""
    try:
        cur = _OpenPath(name, bounded=False, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError:                 # not a directory
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        return
    writable = os.geteuid() == 0    # root needs no write permission on a directory to empty it
    try:
        if not writable:
            os.fchmod(cur.fd, 0o700)
        for entry, st in _walk(cur, force=not writable):
            try:
                if st is None:
                    os.rmdir(entry, dir_fd=cur.fd)
                elif not stat.S_ISDIR(st.st_mode):
                    os.unlink(entry, dir_fd=cur.fd)
                elif not writable:
                    os.fchmod(cur.fd, 0o700)    # (the walk is in it)
            except FileNotFoundError:
                pass
    finally:
        cur.close()
    os.rmdir(name, dir_fd=dir_fd)
