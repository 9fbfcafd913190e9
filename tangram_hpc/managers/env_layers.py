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

from ..envfiles import NOFOLLOW_DIR

__all__ = ["ATTEMPT_SUFFIX", "overlay_supported", "mount_argv", "prepare", "claim", "settle", "merge",
           "layered_root", "is_opaque"]

#: The directory of an environment's pending attempt: ``<env dir><suffix>/{upper,work,action}``.
ATTEMPT_SUFFIX = ".attempt"
_OPAQUE = "trusted.overlay.opaque"
_OPTIONS = "redirect_dir=off,index=off,metacopy=off,xino=off"
#: Deeper upper layers are merged no further (one descriptor per level).
_MAX_DEPTH = 256


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
    """Give the attempt directory prepared ahead for no action (``""``: discarded if settled so)
    to ``action_id``, before it runs: a crash before the write completes leaves it
    discarded, which is right, since nothing ran in it yet."""
    with open(attempt / "action", "w") as f:
        f.write(action_id)


def action_of(attempt: Path) -> str | None:
    try:
        with open(attempt / "action") as f:
            return f.read()
    except OSError:
        return None


def settle(attempt: Path, env_dir: Path, journaled, trash: Path | None = None) -> str | None:
    """Commit the attempt left at ``attempt`` into ``env_dir`` if ``journaled(action_id)``, else
    discard it; returns ``"committed"``, ``"discarded"`` or None (no attempt there).

    ``trash``: a directory on the same filesystem the emptied attempt is moved into, for its
    removal later (removing a directory just emptied costs milliseconds on some disks: the merge
    leaves the layer's directories for it)."""
    if not os.path.lexists(attempt):
        return None
    aid = action_of(attempt)
    if aid is not None and journaled(aid):
        merge(attempt / "upper", env_dir)
        verdict = "committed"
    else:
        verdict = "discarded"
    try:
        if trash is None:
            raise OSError("no trash")
        os.rename(attempt, trash / f"{attempt.name}-{os.urandom(6).hex()}")
    except OSError:
        _remove_tree(attempt)
    return verdict


def _remove_tree(path: Path) -> None:
    parent = os.open(path.parent, NOFOLLOW_DIR)
    try:
        _remove(parent, path.name)
    finally:
        os.close(parent)


def merge(upper: Path, lower: Path) -> int:
    """Move the upper layer ``upper`` into ``lower`` (the environment); returns the entries moved.

    Both are host paths of trees sandboxed code wrote: every directory is opened relative to its
    parent without following symlinks, and entries are renamed or removed, never opened.
    """
    up = os.open(upper, NOFOLLOW_DIR)
    try:
        low = os.open(lower, NOFOLLOW_DIR)
        try:
            moved = _merge_dir(up, low, 0)
            st = os.fstat(up)            # the overlay's root was the upper layer's: a chmod of it
            os.fchown(low, st.st_uid, st.st_gid)
            os.fchmod(low, stat.S_IMODE(st.st_mode))
            return moved
        finally:
            os.close(low)
    finally:
        os.close(up)


def _merge_dir(up: int, low: int, depth: int) -> int:
    moved = 0
    for entry in os.scandir(up):
        name = entry.name
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:        # a whiteout: the entry was removed
            _remove(low, name)
            os.unlink(name, dir_fd=up)
            moved += 1
            continue
        if not stat.S_ISDIR(st.st_mode):                          # a file, link, FIFO, socket: replaced whole
            try:
                lst = os.stat(name, dir_fd=low, follow_symlinks=False)
                if stat.S_ISDIR(lst.st_mode):
                    _remove(low, name)
            except FileNotFoundError:
                pass
            os.rename(name, name, src_dir_fd=up, dst_dir_fd=low)
            moved += 1
            continue
        sub = os.open(name, NOFOLLOW_DIR, dir_fd=up)
        try:
            opaque = is_opaque(sub)
            if opaque:             # made anew over a removed one: nothing of the old shows through
                _remove(low, name)
                os.removexattr(sub, _OPAQUE)
            try:
                lst = os.stat(name, dir_fd=low, follow_symlinks=False)
            except FileNotFoundError:
                lst = None
            if lst is not None and not stat.S_ISDIR(lst.st_mode):
                _remove(low, name)
                lst = None
            if lst is not None:    # in both: merged entry by entry
                if depth >= _MAX_DEPTH:
                    raise OSError(f"the attempt's layer nests directories deeper than {_MAX_DEPTH} levels")
                dst = os.open(name, NOFOLLOW_DIR, dir_fd=low)
                try:
                    os.fchown(dst, st.st_uid, st.st_gid)
                    os.fchmod(dst, stat.S_IMODE(st.st_mode))
                    moved += _merge_dir(sub, dst, depth + 1)
                    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
                finally:
                    os.close(dst)
        finally:
            os.close(sub)
        if lst is None:            # only the layer has it: moved whole, however deep
            os.rename(name, name, src_dir_fd=up, dst_dir_fd=low)
        moved += 1                 # (an emptied directory stays in the layer: merged again, it is a no-op)
    return moved


def is_opaque(fd: int) -> bool:
    """Whether the upper-layer directory ``fd`` hides the lower layer's (made anew over a removed one)."""
    try:
        return os.getxattr(fd, _OPAQUE) == b"y"
    except OSError:
        return False


def _remove(dirfd: int, name: str) -> None:
    """Remove ``name`` (a tree too) under ``dirfd`` without following symlinks; gone already is fine."""
    try:
        _remove_entry(dirfd, name)
    except RecursionError:
        raise OSError(f"{name!r} nests directories too deep to remove") from None


def _remove_entry(dirfd: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dirfd)
        return
    sub = os.open(name, NOFOLLOW_DIR, dir_fd=dirfd)
    try:
        os.fchmod(sub, 0o700)     # sandboxed code may have taken write permission away
        for entry in os.scandir(sub):
            _remove_entry(sub, entry.name)
    finally:
        os.close(sub)
    os.rmdir(name, dir_fd=dirfd)


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
