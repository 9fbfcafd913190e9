"""Cluster view through the Slurm CLI's JSON output (``sinfo/squeue/sacct --json``).

Written against the shapes of Slurm 22.05 (Debian 12); later releases keep
most keys, and every field is read defensively so a missing key gives a
default rather than a crash.  ``squeue --json`` on 22.05 ignores its
filters, so filtering happens here (still one query per call).
"""
from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from .model import ACTIVE_STATES, AccountingRecord, JobInfo, NodeInfo, PartitionInfo
from .view import ClusterView, SlurmCommandError

__all__ = ["CliClusterView", "parse_sinfo_json", "parse_squeue_json", "parse_sacct_json",
           "parse_scontrol_partitions", "parse_duration", "gres_gpu_count", "tres_counts"]

# Slurm reports an unlimited job's end as start + one year (or later).
_UNLIMITED_AFTER_S = 300 * 86400


class CliClusterView(ClusterView):
    name = "cli"

    def __init__(self, *, timeout: float = 30.0, env: dict[str, str] | None = None):
        self.timeout = timeout
        self.env = env

    def _run(self, argv: list[str]) -> str:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout, env=self.env)
        except FileNotFoundError as e:
            raise SlurmCommandError(f"{argv[0]} not found: is the Slurm client installed?") from e
        except subprocess.TimeoutExpired as e:
            raise SlurmCommandError(f"{' '.join(argv)} timed out after {self.timeout:.0f}s") from e
        if proc.returncode != 0:
            raise SlurmCommandError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()[:500]}")
        return proc.stdout

    def _json(self, argv: list[str]) -> dict:
        out = self._run(argv)
        try:
            return json.loads(out)
        except json.JSONDecodeError as e:
            raise SlurmCommandError(f"{' '.join(argv)} printed no JSON: {out[:200]!r}") from e

    def nodes(self) -> list[NodeInfo]:
        return parse_sinfo_json(self._json(["sinfo", "--json"]))

    def partitions(self) -> list[PartitionInfo]:
        nodes = self.nodes()
        return parse_scontrol_partitions(self._run(["scontrol", "show", "partition", "-o"]), nodes)

    def jobs(self, job_ids: Iterable[int] | None = None, *, name_prefix: str | None = None,
             user: str | None = None) -> list[JobInfo]:
        jobs = parse_squeue_json(self._json(["squeue", "--json"]))
        return filter_jobs(jobs, job_ids, name_prefix, user)

    def accounting(self, job_ids: Iterable[int] | None = None, *, since: float | None = None,
                   until: float | None = None, name: str | None = None,
                   user: str | None = None) -> list[AccountingRecord]:
        # Not -X: the JSON keeps one entry per job either way, and only with its steps does it
        # carry the CPU time used (the job-level total is 0 for batch jobs on 22.05).
        argv = ["sacct", "--json"]
        ids = sorted(set(int(i) for i in job_ids)) if job_ids is not None else None
        if ids is not None:
            if not ids:
                return []
            argv += ["-j", ",".join(map(str, ids))]
        if since is not None:
            argv += ["-S", _sacct_time(since)]
        elif ids is None:
            argv += ["-S", "1970-01-02T00:00:00"]  # default would be today only
        if until is not None:
            argv += ["-E", _sacct_time(until)]
        if name is not None:
            argv += ["--name", name]
        if user is not None:
            argv += ["-u", user]
        else:
            argv += ["-a"]
        records = parse_sacct_json(self._json(argv))
        if ids is not None:
            wanted = set(ids)
            records = [r for r in records if r.job_id in wanted]
        return records


def filter_jobs(jobs: list[JobInfo], job_ids: Iterable[int] | None, name_prefix: str | None,
                user: str | None) -> list[JobInfo]:
    wanted = set(int(i) for i in job_ids) if job_ids is not None else None
    return [j for j in jobs
            if (wanted is None or j.job_id in wanted)
            and (name_prefix is None or j.name.startswith(name_prefix))
            and (user is None or j.user == user)]


def _sacct_time(t: float) -> str:
    t = max(t, 86400.0)  # sacct reads the epoch itself as "no time given"
    return datetime.fromtimestamp(t).strftime("%Y-%m-%dT%H:%M:%S")


# -- parsing -----------------------------------------------------------------

def _int(v: Any, default: int = 0) -> int:
    if isinstance(v, dict):  # later Slurm releases wrap numbers as {"set":..,"number":..}
        if not v.get("set", True) or v.get("infinite"):
            return default
        v = v.get("number")
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _seconds(v: Any) -> float:
    """A sacct ``{"seconds": s, "microseconds": us}`` duration."""
    return _int(v.get("seconds")) + _int(v.get("microseconds")) / 1e6 if isinstance(v, dict) else 0.0


def _time(v: Any) -> float | None:
    t = _int(v, 0)
    return float(t) if t > 0 else None


def _limit_s(minutes: Any) -> float | None:
    if isinstance(minutes, dict) and (minutes.get("infinite") or not minutes.get("set", True)):
        return None
    m = _int(minutes, -1)
    return float(m) * 60.0 if m >= 0 else None


def _mem_mb(s: str) -> int:
    m = re.fullmatch(r"([\d.]+)([KMGTP]?)", s.strip())
    if not m:
        return 0
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 ** 2, "P": 1024 ** 3}[m.group(2)]
    return int(float(m.group(1)) * scale)


def tres_counts(tres: str | None) -> dict[str, int]:
    """``"cpu=4,mem=1000M,gres/gpu=2"`` -> ``{"cpu": 4, "mem": 1000, "gres/gpu": 2}`` (mem in MB)."""
    out: dict[str, int] = {}
    for item in (tres or "").split(","):
        key, _, val = item.partition("=")
        if not val:
            continue
        out[key] = _mem_mb(val) if key == "mem" else _int(val, 0)
    return out


def gres_gpu_count(gres: str | None) -> int:
    """GPUs in a gres string such as ``"gpu:4"``, ``"gpu:a100:2(IDX:0-1),tmpdisk:10"``."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres or ""):
        item = item.split("(", 1)[0].strip()
        parts = item.split(":")
        if parts[0] == "gpu" and len(parts) >= 2:
            total += _int(parts[-1], 0)
    return total


def parse_duration(s: str) -> float | None:
    """Slurm time ``[days-]hours:minutes:seconds`` / ``minutes`` / ``UNLIMITED`` -> seconds."""
    s = s.strip()
    if not s or s.upper() in ("UNLIMITED", "INFINITE", "NONE", "N/A"):
        return None
    days = 0
    if "-" in s:
        d, s = s.split("-", 1)
        days = int(d)
    parts = [float(p) for p in s.split(":")]
    if len(parts) == 1:          # minutes
        secs = parts[0] * 60
    elif len(parts) == 2:        # minutes:seconds
        secs = parts[0] * 60 + parts[1]
    else:
        secs = parts[0] * 3600 + parts[1] * 60 + parts[2]
    return days * 86400 + secs


def parse_sinfo_json(doc: dict) -> list[NodeInfo]:
    out = []
    for n in doc.get("nodes", []):
        state = n.get("state", "")
        if isinstance(state, list):  # later releases: list of state words
            words = [str(w).upper() for w in state]
            base, flags = (words[0] if words else "UNKNOWN"), tuple(words[1:])
        else:
            base, flags = str(state).upper(), tuple(str(f).upper() for f in n.get("state_flags", []) or [])
        out.append(NodeInfo(
            name=n.get("name", ""), state=base, flags=flags,
            partitions=tuple(n.get("partitions", []) or []),
            cpus=_int(n.get("cpus")), alloc_cpus=_int(n.get("alloc_cpus")),
            gpus=gres_gpu_count(n.get("gres")), alloc_gpus=gres_gpu_count(n.get("gres_used")),
            mem_mb=_int(n.get("real_memory")), alloc_mem_mb=_int(n.get("alloc_memory")),
            reason=n.get("reason", "") or "",
        ))
    return out


def parse_scontrol_partitions(text: str, nodes: list[NodeInfo]) -> list[PartitionInfo]:
    """``scontrol show partition -o`` lines joined with the nodes from sinfo."""
    out = []
    for line in text.splitlines():
        fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        name = fields.get("PartitionName")
        if not name:
            continue
        out.append(PartitionInfo(
            name=name, default=fields.get("Default", "NO") == "YES", up=fields.get("State", "UP") == "UP",
            max_time_s=parse_duration(fields.get("MaxTime", "UNLIMITED")),
            nodes=tuple(n for n in nodes if name in n.partitions)))
    return out


def parse_squeue_json(doc: dict) -> list[JobInfo]:
    out = []
    for j in doc.get("jobs", []):
        state = j.get("job_state", "")
        state = str(state[0] if isinstance(state, list) and state else state).upper()
        reason = j.get("state_reason", "") or ""
        limit = _limit_s(j.get("time_limit"))
        start = _time(j.get("start_time")) if state != "PENDING" else None
        end = _time(j.get("end_time")) if state != "PENDING" else None
        if state in ACTIVE_STATES and (limit is None or (start and end and end - start > _UNLIMITED_AFTER_S)):
            end = None  # no limit: Slurm's placeholder end is a year away
        tres = tres_counts(j.get("tres_alloc_str") or j.get("tres_req_str"))
        out.append(JobInfo(
            job_id=_int(j.get("job_id")), name=j.get("name", "") or "", state=state,
            reason="" if reason == "None" else reason, partition=j.get("partition", "") or "",
            user=j.get("user_name", "") or "", cpus=_int(j.get("cpus")) or tres.get("cpu", 0),
            gpus=tres.get("gres/gpu", 0), submit_time=_time(j.get("submit_time")),
            start_time=start, end_time=end, time_limit_s=limit, nodes=j.get("nodes", "") or ""))
    return out


def parse_sacct_json(doc: dict) -> list[AccountingRecord]:
    out = []
    for j in doc.get("jobs", []):
        st = j.get("state", {})
        state = st.get("current", "") if isinstance(st, dict) else st
        state = str(state[0] if isinstance(state, list) and state else state).upper()
        t = j.get("time", {}) or {}
        alloc = {}
        for tr in (j.get("tres", {}) or {}).get("allocated", []) or []:
            key = tr.get("type", "") if not tr.get("name") else f"{tr.get('type')}/{tr.get('name')}"
            alloc[key] = _int(tr.get("count"))
        steps = sum(_seconds((s.get("time") or {}).get("total")) for s in j.get("steps") or [])
        cpu_time = max(_seconds(t.get("total")), steps)
        ec = j.get("exit_code", {}) or {}
        acct = j.get("account") or (j.get("association") or {}).get("account") or ""
        start = _time(t.get("start"))
        end = _time(t.get("end"))
        elapsed = float(_int(t.get("elapsed")))
        out.append(AccountingRecord(
            job_id=_int(j.get("job_id")), name=j.get("name", "") or "", state=state,
            partition=j.get("partition", "") or "", user=j.get("user", "") or "", account=acct,
            exit_code=_int(ec.get("return_code")) if isinstance(ec, dict) else 0,
            submit_time=_time(t.get("submission")), start_time=start, end_time=end,
            elapsed_s=elapsed, alloc_cpus=alloc.get("cpu", 0), alloc_gpus=alloc.get("gres/gpu", 0),
            alloc_mem_mb=alloc.get("mem", 0), cpu_time_s=float(cpu_time),
            time_limit_s=_limit_s(t.get("limit"))))
    return out

