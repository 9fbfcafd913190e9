"""The one interface to what a Slurm cluster holds, and the choice of implementation."""
from __future__ import annotations

import shutil
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Iterable

from ..errors import SlurmCommandError
from .model import AccountingRecord, JobInfo, NodeInfo, PartitionInfo

__all__ = ["ClusterView", "SlurmCommandError", "slurm_version"]


class ClusterView(ABC):
    """Read-only view of a Slurm cluster.

    Each method is one query to Slurm (one command or one API call), so a
    caller polling many jobs asks :meth:`jobs` once for all of them.
    """

    #: "cli" or "pyslurm"
    name: str = "abstract"
    #: why this implementation was chosen (set by :func:`cluster_view`)
    why: str = ""

    @abstractmethod
    def nodes(self) -> list[NodeInfo]: ...

    @abstractmethod
    def partitions(self) -> list[PartitionInfo]:
        """Partitions with their nodes (two queries: nodes and partition settings)."""

    @abstractmethod
    def jobs(self, job_ids: Iterable[int] | None = None, *, name_prefix: str | None = None,
             user: str | None = None) -> list[JobInfo]:
        """Jobs the controller still knows (queued, running, recently ended), filtered.

        Jobs that ended more than Slurm's ``MinJobAge`` ago are gone from
        here; ask :meth:`accounting` for them.
        """

    @abstractmethod
    def accounting(self, job_ids: Iterable[int] | None = None, *, since: float | None = None,
                   until: float | None = None, name: str | None = None,
                   user: str | None = None) -> list[AccountingRecord]:
        """Allocation-level accounting records (sacct) by id, or in a time window."""

    def partition(self, name: str | None) -> PartitionInfo | None:
        """A partition by name, or the default one for ``None``."""
        for p in self.partitions():
            if (name is None and p.default) or p.name == name:
                return p
        return None


def slurm_version() -> str | None:
    """The installed Slurm's version ("22.05.8"), or None when there is no Slurm CLI."""
    exe = shutil.which("sinfo")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    parts = out.split()
    return parts[-1] if parts else None

