"""Append-only msgpack logs of a coordinator run (read by ``tangram-hpc report``).

``actions.log`` records, one per final action result::

    [action_id, kind, action_class, worker_id, cores, submitted, started, finished, status, attempts, trajectory]

``workers.log`` records, one per worker event::

    [time, event, worker_id, handle, cores, gpus]     event: register | lost | drain | reclaimed | stopped

Records are buffered in memory and written at each tick of the coordinator
(twice a second), so logging costs the dispatch path one list append per action.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import msgpack

ACTION_FIELDS = ("id", "kind", "action_class", "worker", "cores", "submitted", "started", "finished",
                 "status", "attempts", "trajectory")
WORKER_FIELDS = ("time", "event", "worker", "handle", "cores", "gpus")


class RunLog:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._buf: list[list] = []

    def append(self, record: list) -> None:
        self._buf.append(record)

    @property
    def pending(self) -> list[list]:
        """The records not written yet (the coordinator's metrics read them before each flush)."""
        return self._buf

    def flush(self) -> None:
        if not self._buf:
            return
        packer = msgpack.Packer(use_bin_type=True)
        data = b"".join(packer.pack(r) for r in self._buf)
        self._buf.clear()
        with open(self.path, "ab") as f:
            f.write(data)


def read_records(path: str | os.PathLike, *, progress=None) -> Iterator[list]:
    """Yield records; a torn last record (coordinator killed mid-write) is ignored.  With a
    :class:`~tangram_hpc.progress.Progress`, reading shows a bar by bytes."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    if progress is not None:
        f = progress.reading(f, os.fstat(f.fileno()).st_size, f"reading {Path(path).name}")
    with f:
        unpacker = msgpack.Unpacker(f, raw=False)
        try:
            for rec in unpacker:
                if isinstance(rec, (list, tuple)):
                    yield list(rec)
        except (ValueError, msgpack.exceptions.UnpackException):
            return
