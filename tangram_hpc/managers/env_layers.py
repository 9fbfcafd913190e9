"""Transactional environments: each attempt of an action writes into a layer of its own.

An attempt runs against an overlay (kernel overlayfs) whose lower layer is the environment's
directory and whose upper layer is a fresh directory beside it (``<env>.attempt/upper``, out of
the sandbox's sight).  The overlay is mounted in a mount namespace of the attempt's own
(``unshare --mount`` before bubblewrap), so it ends with the attempt's processes, whatever kills
them, and the host never sees it.  The environment's directory itself does not change while the
attempt runs.

The attempt is *committed* (:func:`merge`: its upper layer moved into the environment) once its
outcome is in the environment's journal, and *discarded* (the upper layer removed) otherwise: an
attempt cut off by any fault (its worker killed, stopped, its job cancelled) leaves nothing for
the retry to find, and an attempt journaled but not yet merged when its worker died is merged by
whoever takes the environment next (the merge can be resumed at any point: every step moves or
removes one entry, and a directory's opaque mark is cleared only once what it hides is gone).
The merge walks both trees without recursion, one descriptor each moved down and up (as a save
does, :mod:`tangram_hpc.managers.fs_inside`), and goes no deeper than a save: a layer that would
take it past that is refused whole before anything moves (:func:`check`, :class:`LayerRefused`) and
discarded, so the environment stays as it was and the action ends with an error saying why.

bubblewrap 0.9 can mount overlays itself (``--overlay``); the 0.8 of common distributions cannot,
hence the namespace of our own, which needs root (a worker that is not root runs attempts directly
on the environment, at least once as before).  Overlay options: no redirects, index, metacopy or
xino, so the upper layer holds whole files, plain whiteouts (0/0 character devices) and opaque
marks (``trusted.overlay.opaque``) only -- nothing sandboxed code can forge: making a device or
a ``trusted.*`` attribute needs capabilities it does not have.
"""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Iterator

from ..envfiles import NOFOLLOW_DIR
from .fs_inside import EnvError, _OpenPath, _walk, remove_at

__all__ = ["ATTEMPT_SUFFIX", "overlay_supported", "mount_argv", "prepare", "claim", "settle", "discard", "check",
           "merge", "LayerRefused", "walk_layer", "layered_root", "is_opaque"]

#: The directory of an environment's pending attempt: ``<env dir><suffix>/{upper,work,action}``.
ATTEMPT_SUFFIX = ".attempt"
_OPAQUE = "trusted.overlay.opaque"
_OPTIONS = "redirect_dir=off,index=off,metacopy=off,xino=off"


def overlay_supported() -> str | None:
    """None when attempts can run in overlays here, else why not."""
    if os.geteuid() != 0:
        return "the worker is not root (mounting an overlay needs it)"
    if shutil.which("unshare") is None:
        return "no unshare(1) (util-linux)"
    try:
        with open("/proc/filesystems") as f:
            if not any(line.split()[-1:] == ["overlay"] for line in f):
                return "the kernel has no overlay filesystem"
    except OSError as e:
        return f"cannot read /proc/filesystems: {e}"
    return None


def mount_argv(env_dir: Path, attempt: Path) -> list[str]:
    """argv prefix that runs the rest in a mount namespace of its own, with ``env_dir`` seen through
    the overlay of ``attempt``'s upper layer (the rest, bubblewrap, binds ``env_dir`` as usual)."""
    opts = f"lowerdir={env_dir},upperdir={attempt / 'upper'},workdir={attempt / 'work'},{_OPTIONS}"
    return ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
            'mount -t overlay -o "$1" overlay "$2" || exit 125; shift 2; exec "$@"', "sh", opts, str(env_dir)]


def prepare(attempt: Path, env_dir: Path, action_id: str) -> None:
    """An empty attempt directory for ``action_id`` over ``env_dir`` (the name is read back by whoever
    settles it).  The overlay's root is the upper layer's: it gets the environment's owner and mode."""
    st = os.stat(env_dir, follow_symlinks=False)
    os.mkdir(attempt, 0o700)
    os.mkdir(attempt / "upper", 0o700)
    os.chown(attempt / "upper", st.st_uid, st.st_gid)
    os.chmod(attempt / "upper", stat.S_IMODE(st.st_mode))
    os.mkdir(attempt / "work", 0o700)
    with open(attempt / "action", "w") as f:
        f.write(action_id)


def claim(attempt: Path, action_id: str) -> None:
    """Give the attempt directory prepared ahead for no action (its ``action`` file empty or absent:
    discarded if settled so) to ``action_id``, before it runs: a crash before the write completes leaves it
    discarded, which is right, since nothing ran in it yet."""
    data = action_id.encode()
    # Not O_TRUNC: the file is empty or absent here, and truncating costs ext4 a flush (~0.05-2 ms).
    fd = os.open(attempt / "action", os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        os.write(fd, data)
        if os.fstat(fd).st_size > len(data):
            os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def unclaim(attempt: Path) -> None:
    """Make the attempt directory owned by no action again (no ``action`` file: discarded if settled
    so), for a layer that changed nothing and is kept for the next attempt (:func:`untouched`)."""
    try:
        os.unlink(attempt / "action")
    except FileNotFoundError:
        pass


def untouched(attempt: Path, env_dir: Path) -> bool:
    """Whether the attempt at ``attempt`` changed nothing: its upper layer is empty (no entry, no
    whiteout) and its root has ``env_dir``'s owner and mode, all a merge would carry over.  Settling
    it then is a no-op either way, and the layer, still mounted, can serve the next attempt."""
    try:
        up = os.stat(attempt / "upper", follow_symlinks=False)
        low = os.stat(env_dir, follow_symlinks=False)
        with os.scandir(attempt / "upper") as entries:
            if next(entries, None) is not None:
                return False
    except OSError:
        return False
    return (up.st_uid, up.st_gid, up.st_mode) == (low.st_uid, low.st_gid, low.st_mode)


def action_of(attempt: Path) -> str | None:
    try:
        with open(attempt / "action") as f:
            return f.read()
    except OSError:
        return None


def settle(attempt: Path, env_dir: Path, journaled, trash: Path | None = None) -> str | None:
    """Commit the attempt left at ``attempt`` into ``env_dir`` if ``journaled(action_id)``, else
    discard it; returns ``"committed"``, ``"discarded"`` or None (no attempt there).

    A layer that cannot be merged (:func:`check`) is discarded instead, and :class:`LayerRefused`
    raised: the environment stays as it was before the attempt.

    ``trash``: a directory on the same filesystem the emptied attempt is moved into, for its
    removal later (removing a directory just emptied costs milliseconds on some disks: the merge
    leaves the layer's directories for it)."""
    if not os.path.lexists(attempt):
        return None
    aid = action_of(attempt)
    refused = None
    if aid is not None and journaled(aid):
        try:
            merge(attempt / "upper", env_dir)
            verdict = "committed"
        except LayerRefused as exc:
            refused = exc
    else:
        verdict = "discarded"
    discard(attempt, trash)
    if refused is not None:
        raise LayerRefused(f"{refused}; they were discarded") from None
    return verdict


def discard(attempt: Path, trash: Path | None = None) -> None:
    """Remove the attempt at ``attempt`` (moved into ``trash`` first where it can be)."""
    try:
        if trash is None:
            raise OSError("no trash")
        os.rename(attempt, trash / f"{attempt.name}-{os.urandom(6).hex()}")
    except OSError:
        remove_at(None, attempt)


class LayerRefused(EnvError):
    """An attempt's layer cannot be merged into its environment (nothing of it was)."""


def check(upper: Path, lower: Path) -> str | None:
    """Why the layer ``upper`` cannot be merged into ``lower`` (None: it can): where both hold a
    directory the merge goes in, and it goes no deeper than a save does (``MAX_DEPTH`` levels,
    ``MAX_PATH_BYTES`` of path).  Walks what the merge would, moving nothing."""
    try:
        up = _OpenPath(upper)
    except OSError as exc:
        return f"the action's layer cannot be read: {exc}"
    try:
        low = _OpenPath(lower)
    except OSError as exc:
        up.close()
        return f"the action's environment cannot be read: {exc}"
    try:
        for _ in walk_layer(up, low):
            pass
    except (EnvError, OSError) as exc:
        return f"the action's changes cannot be merged into its environment: {exc}"
    finally:
        up.close()
        low.close()
    return None


def merge(upper: Path, lower: Path) -> int:
    """Move the upper layer ``upper`` into ``lower`` (the environment); returns the entries moved.
    :func:`check` first: a layer it refuses is left as it is (:class:`LayerRefused` says why).

    Both are host paths of trees sandboxed code wrote: every directory is opened relative to its
    parent without following symlinks (one descriptor per tree, moved down and up), and entries
    are renamed or removed, never opened.
    """
    why = check(upper, lower)
    if why is not None:
        raise LayerRefused(why)
    up, low = _OpenPath(upper), _OpenPath(lower)
    try:
        moved = 0
        for name, kind, st, below in walk_layer(up, low):
            if kind == DONE:               # its entries are in: its time now
                os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=low.fd, follow_symlinks=False)
                continue
            moved += 1                      # (an emptied directory stays in the layer: merged again, it is a no-op)
            if kind == MERGE:              # (both are in it)
                os.fchown(low.fd, st.st_uid, st.st_gid)
                os.fchmod(low.fd, stat.S_IMODE(st.st_mode))
            elif kind == WHITEOUT:         # the entry was removed
                remove_at(low.fd, name)
                os.unlink(name, dir_fd=up.fd)
            else:                           # replaced whole: a file, link, FIFO, socket, or a new directory
                if below is not None and (stat.S_ISDIR(st.st_mode) or stat.S_ISDIR(below.st_mode)):
                    remove_at(low.fd, name)
                if stat.S_ISDIR(st.st_mode):
                    _clear_opaque(up.fd, name)  # only now: what it hid is gone
                os.rename(name, name, src_dir_fd=up.fd, dst_dir_fd=low.fd)
        st = os.fstat(up.fd)            # the overlay's root was the upper layer's: a chmod of it
        os.fchown(low.fd, st.st_uid, st.st_gid)
        os.fchmod(low.fd, stat.S_IMODE(st.st_mode))
        return moved
    finally:
        up.close()
        low.close()


# What the merge does with an entry of the upper layer (:func:`walk_layer`).
WHITEOUT, REPLACE, MERGE, DONE = "whiteout", "replace", "merge", "done"


def walk_layer(up: _OpenPath, low: _OpenPath) -> Iterator[tuple[str, str, os.stat_result, os.stat_result | None]]:
    """The upper layer ``up`` against the lower ``low``, depth first without recursion: yields
    ``(name, kind, lstat, lower lstat or None)`` for each entry of the upper layer, ``kind`` one of

    * ``WHITEOUT``: a removal, both at the directory holding it;
    * ``REPLACE``: a file, link, FIFO, socket, or a directory the lower one does not show through
      (made anew over a removed one, or over a non-directory), both at the directory holding it;
    * ``MERGE``: a directory both hold, merged entry by entry: both in it; then, once its entries
      are, ``(name, DONE, its lstat as at MERGE, None)`` with both back at its parent.

    Both descriptors go down together, bounded as a save is (:class:`EnvError` past that).
    """
    below_dir: list[os.stat_result | None] = [None]   # the lower entry of the directory last offered
    merged: list[os.stat_result] = []                  # the directories gone into, as the layer had them

    def descend(name: str, st: os.stat_result) -> bool:
        below_dir[0] = below = _lstat_at(low.fd, name)
        return below is not None and stat.S_ISDIR(below.st_mode) and not _opaque_at(up.fd, name)

    for name, st in _walk(up, descend=descend):
        if st is None:
            low.up()
            yield name, DONE, merged.pop(), None
        elif len(up.names) > len(low.names):     # a directory the walk went into: the lower one follows
            low.down(name)
            merged.append(st)
            yield name, MERGE, st, below_dir[0]
        elif stat.S_ISDIR(st.st_mode):
            yield name, REPLACE, st, below_dir[0]
        elif stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            yield name, WHITEOUT, st, _lstat_at(low.fd, name)
        else:
            yield name, REPLACE, st, _lstat_at(low.fd, name)


def _lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _opaque_at(dir_fd: int, name: str) -> bool:
    fd = os.open(name, NOFOLLOW_DIR, dir_fd=dir_fd)
    try:
        return is_opaque(fd)
    finally:
        os.close(fd)


def _clear_opaque(dir_fd: int, name: str) -> None:
    fd = os.open(name, NOFOLLOW_DIR, dir_fd=dir_fd)
    try:
        if is_opaque(fd):
            os.removexattr(fd, _OPAQUE)
    finally:
        os.close(fd)


def is_opaque(fd: int) -> bool:
    """Whether the upper-layer directory ``fd`` hides the lower layer's (made anew over a removed one)."""
    try:
        return os.getxattr(fd, _OPAQUE) == b"y"
    except OSError:
        return False


def layered_root(upper: Path, lower: Path, rel: str) -> Path | None:
    """Which layer holds ``rel`` as the attempt saw it: ``upper``, ``lower``, or None (removed).

    Walks the upper layer without following symlinks: a whiteout removes the path, an opaque
    directory hides the lower layer below it, a name the upper layer does not have is the lower
    layer's (if it was not hidden above).
    """
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    try:
        fd = os.open(upper, NOFOLLOW_DIR)
    except OSError:
        return lower
    try:
        for i, part in enumerate(parts):
            try:
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return lower
            except OSError:
                return None
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                return None
            if i == len(parts) - 1 or not stat.S_ISDIR(st.st_mode):
                return upper
            try:
                sub = os.open(part, NOFOLLOW_DIR, dir_fd=fd)
            except OSError:
                return None
            os.close(fd)
            fd = sub
            if is_opaque(fd):
                return upper
        return upper
    finally:
        os.close(fd)
