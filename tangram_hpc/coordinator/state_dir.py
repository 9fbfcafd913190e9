"""The coordinator's files that outlive a restart (``[coordinator] state_dir``).

It lives beside the connection file (``NAME.state`` for ``NAME.json``), which a
restarted coordinator keeps, and not in the run directory, which the documented
restart path (``scripts/launch-coordinator.sh``) replaces:

* ``snapshots/``: environment snapshots workers hand back (the WELCOME names it);
* ``environments.log``: where each environment is (the directory's change
  records, msgpack, appended once a second and compacted at start);
* ``attempts.log``: ``[action id, attempts started]`` of unfinished actions with an
  environment, so a resubmitted one continues its attempt count.

This is the I/O half of :class:`~.environments.EnvironmentDirectory` and of the
ledger's attempt log: the ZMQ loop calls :meth:`flush` once a tick.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import msgpack

from ..envfiles import NOFOLLOW_DIR, env_dirname, snapshot_identity
from ..runlog import read_records
from .environments import EnvironmentDirectory

log = logging.getLogger("tangram.coordinator")

#: attempts.log is rewritten from the live actions once it holds this many records
_ATTEMPTS_ROTATE = 200_000
#: environments.log is rewritten whole once it holds this many records more than the live state
_ENVS_ROTATE = 200_000
_SCAN_EVERY_S = 2.0
#: a snapshot being written (``*.partial``) that nobody wrote to for this long was left by a worker
#: killed mid-save: it is deleted (a save in progress writes to it all along)
PARTIAL_STALE_S = 3600.0
_PRUNE_EVERY_S = 600.0


class StateDir:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.snapshots = self.path / "snapshots"
        self.snapshots.mkdir(exist_ok=True)
        self._envs_file = self.path / "environments.log"
        self._attempts_file = self.path / "attempts.log"
        self._env_records = 0
        self._attempt_records = 0
        self._next_scan = 0.0
        self._next_prune = 0.0

    # -- start -------------------------------------------------------------------------
    def load(self, directory: EnvironmentDirectory, now: float) -> dict[str, int]:
        """Fill ``directory`` from the state file and return the attempts of unfinished actions."""
        directory.load(list(read_records(self._envs_file)), now)
        attempts: dict[str, int] = {}
        for rec in read_records(self._attempts_file):
            if len(rec) == 2 and isinstance(rec[0], str) and isinstance(rec[1], int):
                if rec[1] > 0:
                    attempts[rec[0]] = rec[1]
                else:
                    attempts.pop(rec[0], None)
        # Compact both files to what is live now.
        self._rewrite(self._envs_file, directory.changes)
        self._env_records = len(directory.changes)
        directory.changes = []
        self._rewrite(self._attempts_file, [[k, v] for k, v in attempts.items()])
        self._attempt_records = len(attempts)
        if directory.envs:
            log.info("state %s: %d environments (%s), %d unfinished actions with their attempts", self.path,
                     len(directory.envs), ", ".join(f"{n} {s}" for s, n in sorted(directory.counts().items())),
                     len(attempts))
        return attempts

    # -- each tick -------------------------------------------------------------------
    def flush(self, directory: EnvironmentDirectory, attempt_log: list, live_attempts, now: float) -> None:
        """Append what changed; delete snapshots and directories that hold no live state any more;
        look for snapshots of awaited environments.  ``live_attempts()`` gives ``{id: attempts}`` of
        the live actions, to rewrite the attempts file when it grew large."""
        self.write_changes(directory, attempt_log, live_attempts)
        if directory.garbage:
            garbage, directory.garbage = directory.garbage, []
            for path, env in garbage:
                self._delete(path, env)
        if now >= self._next_scan:
            self._next_scan = now + _SCAN_EVERY_S
            self.scan_snapshots(directory)
        if now >= self._next_prune:
            self._next_prune = now + _PRUNE_EVERY_S
            self.prune_partial_snapshots(now)

    def prune_partial_snapshots(self, now: float) -> int:
        """Delete snapshots a killed worker left half written (see :data:`PARTIAL_STALE_S`)."""
        removed = 0
        for folder in (self.snapshots, self.snapshots / "bases"):
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for e in entries:
                try:
                    if (e.name.endswith(".partial") and e.is_file(follow_symlinks=False)
                            and now - e.stat(follow_symlinks=False).st_mtime > PARTIAL_STALE_S):
                        os.unlink(e.path)
                        removed += 1
                except OSError:
                    pass
        if removed:
            log.info("deleted %d snapshots left half written in %s", removed, self.snapshots)
        return removed

    def write_changes(self, directory: EnvironmentDirectory, attempt_log: list, live_attempts) -> None:
        """Append the directory's changes and the attempt log (one write each, to the page cache: a
        killed coordinator loses nothing of it)."""
        if directory.changes:
            self._env_records += len(directory.changes)
            if self._env_records > len(directory.envs) + _ENVS_ROTATE:
                directory.changes = directory.snapshot_records()
                self._rewrite(self._envs_file, directory.changes)
                self._env_records = len(directory.changes)
            else:
                self._append(self._envs_file, directory.changes)
            directory.changes = []
        if attempt_log:
            self._attempt_records += len(attempt_log)
            if self._attempt_records > _ATTEMPTS_ROTATE:
                live = [[k, v] for k, v in live_attempts().items()]
                self._rewrite(self._attempts_file, live)
                self._attempt_records = len(live)
            else:
                self._append(self._attempts_file, attempt_log)
            attempt_log.clear()

    def scan_snapshots(self, directory: EnvironmentDirectory) -> list[str]:
        """Snapshots of awaited environments written while no coordinator heard of them (a worker
        stopping as its coordinator shut down); returns the environments found."""
        awaited = directory.awaited()
        if not awaited:
            return []
        try:
            names = os.listdir(self.snapshots)
        except OSError:
            return []
        found = []
        for rec in awaited:
            pattern = re.compile(re.escape(f"{env_dirname(rec.id)}-g{rec.gen}-") + r"\d+-[0-9a-f]{8}\.tar\.gz$")
            for name in names:
                if pattern.match(name):
                    path = str(self.snapshots / name)
                    if snapshot_identity(path) == (rec.id, rec.gen) and directory.found_snapshot(rec.id, rec.gen, path):
                        found.append(rec.id)
                        break
        return found

    # -- files -------------------------------------------------------------------------
    def _delete(self, path: str | None, env: str | None) -> None:
        if not path:
            return
        try:
            if env is None:
                # only snapshot files, only where snapshots are written
                p = Path(path)
                if p.name.endswith(".tar.gz") and p.parent.resolve() == self.snapshots.resolve():
                    p.unlink(missing_ok=True)
            elif _is_plain_subdir(Path(path), env_dirname(env)):
                shutil.rmtree(Path(path) / env_dirname(env), ignore_errors=True)
                (Path(path) / (env_dirname(env) + ".journal")).unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not delete %s: %s", path, e)

    @staticmethod
    def _append(path: Path, records: list) -> None:
        packer = msgpack.Packer(use_bin_type=True)
        with open(path, "ab") as f:
            f.write(b"".join(packer.pack(r) for r in records))

    @staticmethod
    def _rewrite(path: Path, records: list) -> None:
        packer = msgpack.Packer(use_bin_type=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(packer.pack(r) for r in records))
        os.replace(tmp, path)


def _is_plain_subdir(root: Path, name: str) -> bool:
    """Whether ``root/name`` is a directory reached without symlinks (a worker's environment,
    not a link planted to make the coordinator delete something else)."""
    try:
        fd = os.open(root, NOFOLLOW_DIR)
    except OSError:
        return False
    try:
        os.close(os.open(name, NOFOLLOW_DIR, dir_fd=fd))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
