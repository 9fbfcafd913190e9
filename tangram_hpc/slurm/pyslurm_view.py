"""Cluster view through pyslurm, for sites whose Slurm matches a pyslurm release.

PyPI carries pyslurm only for a few Slurm releases (17.11, 18.08, 25.11 at the
time of writing) and each refuses any other Slurm, so this view is chosen
only when pyslurm imports and its major.minor equals the running Slurm's.
It reads the object API of pyslurm >= 23 (``pyslurm.Nodes``, ``pyslurm.Jobs``,
``pyslurm.Partitions``, ``pyslurm.db.Jobs``); attributes are read with
defaults so a renamed field degrades to zero rather than crashing.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .cli_view import filter_jobs, gres_gpu_count, tres_counts
from .model import AccountingRecord, JobInfo, NodeInfo, PartitionInfo
from .view import ClusterView

__all__ = ["PyslurmClusterView", "pyslurm_mismatch"]


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def pyslurm_mismatch(slurm_version: str | None) -> str | None:
    """Why pyslurm cannot serve this Slurm, or None when it can."""
    try:
        import pyslurm  # noqa: F401
    except Exception as e:  # ImportError, or a pyslurm built against a missing libslurm
        return f"pyslurm not importable: {type(e).__name__}"
    if slurm_version is None:
        return "no Slurm client found to compare pyslurm against"
    have = getattr(pyslurm, "__version__", "") or ""
    if not hasattr(pyslurm, "Jobs") or not hasattr(pyslurm, "db"):
        return f"pyslurm {have} lacks the object API (pyslurm >= 23 needed)"
    if _major_minor(have) != _major_minor(slurm_version):
        return f"pyslurm {have} does not match Slurm {slurm_version}"
    return None


def _g(obj: Any, name: str, default: Any = None) -> Any:
    v = getattr(obj, name, default)
    return default if v is None else v


def _gpus(gres: Any) -> int:
    if isinstance(gres, dict):  # pyslurm: {"gpu": 4} or {"gpu:a100": 4}
        return sum(int(v) for k, v in gres.items() if str(k).split(":")[0] == "gpu")
    return gres_gpu_count(str(gres or ""))


class PyslurmClusterView(ClusterView):
    name = "pyslurm"

    def __init__(self) -> None:
        import pyslurm
        self._ps = pyslurm

    def nodes(self) -> list[NodeInfo]:
        out = []
        for n in self._ps.Nodes.load().values():
            words = str(_g(n, "state", "UNKNOWN")).upper().replace("+", " ").split()
            out.append(NodeInfo(
                name=_g(n, "name", ""), state=words[0] if words else "UNKNOWN", flags=tuple(words[1:]),
                partitions=tuple(_g(n, "partitions", ()) or ()),
                cpus=int(_g(n, "total_cpus", 0)), alloc_cpus=int(_g(n, "allocated_cpus", 0)),
                gpus=_gpus(_g(n, "configured_gres", {})), alloc_gpus=_gpus(_g(n, "allocated_gres", {})),
                mem_mb=int(_g(n, "real_memory", 0)), alloc_mem_mb=int(_g(n, "allocated_memory", 0)),
                reason=str(_g(n, "reason", "")),
            ))
        return out

    def partitions(self) -> list[PartitionInfo]:
        nodes = self.nodes()
        out = []
        for p in self._ps.Partitions.load().values():
            name = _g(p, "name", "")
            max_time = _g(p, "max_time", None)  # minutes, None/"UNLIMITED" for no limit
            out.append(PartitionInfo(
                name=name, default=bool(_g(p, "is_default", False)),
                up=str(_g(p, "state", "UP")).upper() == "UP",
                max_time_s=float(max_time) * 60 if isinstance(max_time, (int, float)) else None,
                nodes=tuple(n for n in nodes if name in n.partitions)))
        return out

    def jobs(self, job_ids: Iterable[int] | None = None, *, name_prefix: str | None = None,
             user: str | None = None) -> list[JobInfo]:
        out = []
        for j in self._ps.Jobs.load().values():
            state = str(_g(j, "state", "")).upper()
            reason = str(_g(j, "state_reason", ""))
            limit = _g(j, "time_limit", None)
            out.append(JobInfo(
                job_id=int(_g(j, "id", 0)), name=str(_g(j, "name", "")), state=state,
                reason="" if reason == "None" else reason, partition=str(_g(j, "partition", "")),
                user=str(_g(j, "user_name", "")), cpus=int(_g(j, "cpus", 0)),
                gpus=tres_counts(str(_g(j, "tres_alloc_str", "") or "")).get("gres/gpu", 0),
                submit_time=_g(j, "submit_time", None) or None,
                start_time=(_g(j, "start_time", None) or None) if state != "PENDING" else None,
                end_time=(_g(j, "end_time", None) or None) if isinstance(limit, (int, float)) else None,
                time_limit_s=float(limit) * 60 if isinstance(limit, (int, float)) else None,
                nodes=str(_g(j, "nodes", "") or "")))
        return filter_jobs(out, job_ids, name_prefix, user)

    def accounting(self, job_ids: Iterable[int] | None = None, *, since: float | None = None,
                   until: float | None = None, name: str | None = None,
                   user: str | None = None) -> list[AccountingRecord]:
        db = self._ps.db
        kw: dict[str, Any] = {}
        if job_ids is not None:
            kw["ids"] = [int(i) for i in job_ids]
            if not kw["ids"]:
                return []
        if since is not None:
            kw["start_time"] = int(since)
        if until is not None:
            kw["end_time"] = int(until)
        if name is not None:
            kw["names"] = [name]
        if user is not None:
            kw["users"] = [user]
        out = []
        for j in db.Jobs.load(db_filter=db.JobFilter(**kw)).values():
            tres = tres_counts(str(_g(j, "allocated_tres", "") or _g(j, "tres_alloc_str", "") or ""))
            limit = _g(j, "time_limit", None)
            out.append(AccountingRecord(
                job_id=int(_g(j, "id", 0)), name=str(_g(j, "name", "")), state=str(_g(j, "state", "")).upper(),
                partition=str(_g(j, "partition", "")), user=str(_g(j, "user_name", "")),
                account=str(_g(j, "account", "")), exit_code=int(_g(j, "exit_code", 0) or 0),
                submit_time=_g(j, "submit_time", None) or None, start_time=_g(j, "start_time", None) or None,
                end_time=_g(j, "end_time", None) or None, elapsed_s=float(_g(j, "elapsed_time", 0)),
                alloc_cpus=int(_g(j, "cpus", 0)) or tres.get("cpu", 0), alloc_gpus=tres.get("gres/gpu", 0),
                alloc_mem_mb=tres.get("mem", 0), cpu_time_s=float(_g(j, "total_cpu_time", 0)),
                time_limit_s=float(limit) * 60 if isinstance(limit, (int, float)) else None))
        return out
