"""``tangram-hpc report``: what a coordinator run held on the cluster and what it did with it.

Joins three records of a run directory:

* ``slurm_jobs.log`` (written by the Slurm backend): the worker jobs submitted,
  looked up in Slurm accounting (sacct) for state, elapsed time, allocated
  CPUs/GPUs (AllocTRES) and CPU time;
* ``actions.log`` (written by the coordinator): every action's cores and times;
* ``workers.log`` (written by the coordinator): worker registrations and exits,
  used for GPU busy time, and for the allocation itself when the run had no
  Slurm jobs (local backend).

and reports allocated vs busy core-seconds (utilisation), actions served, ACT,
and an estimate of what a trajectory-bound allocation would have held for the
same work (see :func:`trajectory_bound`).

An action can have several records: after a coordinator restart the client
resubmits what it has no result for, so an action whose result was logged but
not delivered runs (and is logged) again.  Busy time counts every run (the
cores were really used); actions served, ACT (from the first submission) and
the trajectory-bound estimate count each action once.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from .progress import progress_reporter
from .runlog import ACTION_FIELDS, WORKER_FIELDS, read_records

__all__ = ["add_arguments", "main", "build_report", "load_run", "Report", "JobUsage", "ActionRow",
           "trajectory_bound", "format_table", "write_plots"]

JOB_FIELDS = ("time", "handle", "job_id", "cores", "gpus", "partition")


@dataclass(slots=True)
class ActionRow:
    id: str
    kind: str
    action_class: str
    worker: str | None
    cores: int
    submitted: float
    started: float
    finished: float
    status: str
    attempts: int
    trajectory: str | None

    @property
    def act(self) -> float:
        return max(0.0, self.finished - self.submitted)

    @property
    def busy_core_s(self) -> float:
        return self.cores * max(0.0, self.finished - self.started) if self.started else 0.0


@dataclass(slots=True)
class JobUsage:
    """One worker allocation: a Slurm job (from sacct) or a local worker (from workers.log)."""

    job_id: str
    handle: str
    state: str
    partition: str
    start: float | None
    end: float | None
    elapsed_s: float
    cpus: int
    gpus: int
    cpu_time_s: float

    @property
    def core_hours(self) -> float:
        return self.cpus * self.elapsed_s / 3600.0

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.elapsed_s / 3600.0


@dataclass
class Report:
    run_dir: str | None
    source: str                               # "sacct" or "workers.log"
    window: tuple[float | None, float | None]
    jobs: list[JobUsage]
    actions: list[ActionRow]                  # one per action: its last result, ACT from its first submission
    worker_gpus: dict[str, int] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    runs: list[ActionRow] | None = None       # every logged run (for busy time); None: the same as actions

    @property
    def all_runs(self) -> list[ActionRow]:
        return self.actions if self.runs is None else self.runs


# -- loading -------------------------------------------------------------------

def _actions(run_dir: Path, progress=None) -> list[ActionRow]:
    """Every logged run of every action, in log order."""
    out = []
    for r in read_records(run_dir / "actions.log", progress=progress):
        if len(r) < len(ACTION_FIELDS):
            continue
        out.append(ActionRow(*r[:len(ACTION_FIELDS)]))
    return out


def once_per_action(runs: list[ActionRow]) -> list[ActionRow]:
    """One row per action id: its last logged result, submitted at its first submission, attempts summed.

    A coordinator that restarts logs again an action a client resubmits because its first
    result never arrived.
    """
    by: dict[str, ActionRow] = {}
    for r in runs:
        first = by.get(r.id)
        if first is None:
            by[r.id] = r
            continue
        by[r.id] = ActionRow(r.id, r.kind, r.action_class, r.worker, r.cores, min(first.submitted, r.submitted),
                             r.started, r.finished, r.status, first.attempts + r.attempts, r.trajectory)
    return list(by.values())


def _workers(run_dir: Path) -> list[dict]:
    return [dict(zip(WORKER_FIELDS, r)) for r in read_records(run_dir / "workers.log")
            if len(r) >= len(WORKER_FIELDS)]


def _jobs_from_workers(workers: list[dict], now: float) -> list[JobUsage]:
    """Allocation of a run without Slurm jobs: each worker from register to its exit."""
    open_: dict[str, dict] = {}
    out = []
    for w in sorted(workers, key=lambda w: w["time"]):
        if w["event"] == "register":
            open_[w["worker"]] = w
        elif w["event"] in ("lost", "reclaimed", "stopped", "exit") and w["worker"] in open_:
            s = open_.pop(w["worker"])
            out.append(JobUsage(s["worker"], s["handle"] or "", w["event"], "", s["time"], w["time"],
                                w["time"] - s["time"], int(s["cores"] or 0), int(s["gpus"] or 0), 0.0))
    for s in open_.values():
        out.append(JobUsage(s["worker"], s["handle"] or "", "RUNNING", "", s["time"], None,
                            max(0.0, now - s["time"]), int(s["cores"] or 0), int(s["gpus"] or 0), 0.0))
    return out


def load_run(run_dir: str | os.PathLike | None, *, since: float | None = None, until: float | None = None,
             view: Any = None, now: float | None = None, progress: Any = None) -> Report:
    """Read a run directory (and Slurm accounting for its jobs) into a :class:`Report`.

    Without a run directory, reports every tangram worker job (names ``tgw-*``)
    in the time window from sacct alone.
    """
    now = time.time() if now is None else now
    rd = Path(run_dir) if run_dir else None
    runs = _actions(rd, progress) if rd else []
    workers = _workers(rd) if rd else []
    submitted = {int(r[2]): dict(zip(JOB_FIELDS, r)) for r in read_records(rd / "slurm_jobs.log")} \
        if rd else {}
    jobs: list[JobUsage] = []
    source = "sacct"
    if submitted or rd is None:
        if progress is not None:
            progress("reading Slurm accounting (sacct) ...")
        if view is None:
            from .slurm import cluster_view
            view = cluster_view()
        if rd is None:
            recs = [r for r in view.accounting(since=since, until=until) if r.name.startswith("tgw-")]
        else:
            recs = view.accounting(list(submitted))
        seen = set()
        for r in recs:
            seen.add(r.job_id)
            sub = submitted.get(r.job_id, {})
            end = r.end_time
            elapsed = r.elapsed_s if end or not r.start_time else max(r.elapsed_s, now - r.start_time)
            jobs.append(JobUsage(str(r.job_id), sub.get("handle") or r.name, r.state, r.partition,
                                 r.start_time, end, elapsed, r.alloc_cpus, r.alloc_gpus, r.cpu_time_s))
        for jid, sub in submitted.items():  # submitted but unknown to accounting (yet)
            if jid not in seen:
                jobs.append(JobUsage(str(jid), sub["handle"], "UNKNOWN", sub.get("partition") or "",
                                     None, None, 0.0, 0, 0, 0.0))
    else:
        source = "workers.log" if workers else "none (no worker joined, no job submitted)"
        jobs = _jobs_from_workers(workers, now)
    worker_gpus = {w["worker"]: int(w["gpus"] or 0) for w in workers if w["event"] == "register"}
    actions = once_per_action(runs)
    if since is not None or until is not None:
        lo, hi = since or -math.inf, until or math.inf
        actions = [a for a in actions if lo <= (a.finished or a.submitted) <= hi]
        runs = [a for a in runs if lo <= (a.finished or a.submitted) <= hi]
        jobs = [_clip(j, lo, hi, now) for j in jobs]
        jobs = [j for j in jobs if j is not None]
    rep = Report(str(rd) if rd else None, source, (since, until), jobs, actions, worker_gpus, runs=runs)
    if progress is not None:
        progress(f"summarising {len(actions):,} actions and {len(jobs):,} jobs ...")
    rep.summary = summarise(rep)
    return rep


def _clip(j: JobUsage, lo: float, hi: float, now: float) -> JobUsage | None:
    """The part of a job's allocation inside [lo, hi] (CPU time scaled with it)."""
    if j.start is None:
        return None
    end = j.end if j.end is not None else now
    s, e = max(j.start, lo), min(end, hi)
    if e <= s and not (j.start == end and lo <= s <= hi):
        return None
    frac = (e - s) / (end - j.start) if end > j.start else 1.0
    return JobUsage(j.job_id, j.handle, j.state, j.partition, s, e if j.end is not None or e < end else None,
                    max(0.0, e - s), j.cpus, j.gpus, j.cpu_time_s * frac)


# -- analysis ------------------------------------------------------------------

def _peak(intervals: list[tuple[float, float, int]]) -> int:
    """Largest sum of weights of overlapping [start, end) intervals."""
    points = sorted([(s, w) for s, _, w in intervals] + [(e, -w) for _, e, w in intervals],
                    key=lambda p: (p[0], p[1]))
    cur = peak = 0
    for _, w in points:
        cur += w
        peak = max(peak, cur)
    return peak


def _only_waiting(acts: list[ActionRow]) -> float:
    """Seconds in which some action of the group waited in the pool's queue and none of them ran."""
    points = []
    for a in acts:
        start = a.started or a.finished      # never started (cancelled, rejected): it only waited
        points += [(a.submitted, 1, 0), (start, -1, 0)]
        if a.started:
            points += [(a.started, 0, 1), (a.finished, 0, -1)]
    points.sort(key=lambda p: (p[0], -p[2]))   # at a tie the run starts before the wait ends
    waiting = running = 0
    total = 0.0
    last = None
    for t, dq, dr in points:
        if last is not None and waiting > 0 and running == 0:
            total += t - last
        waiting += dq
        running += dr
        last = t
    return total


def trajectory_bound(actions: list[ActionRow]) -> dict[str, Any]:
    """What a trajectory-bound allocation of the same work would have held.

    Estimate: each trajectory (an action without one counts alone) holds,
    from its first action's submit to its last action's finish, as many cores
    as its actions ever used at once (peak concurrent cores, at least its
    largest action), and one GPU over the same span if it made any reward
    call.  That is the allocation of the classic design in which every
    rollout keeps its own sandbox and reward-model slot for its lifetime.
    With resources of its own a trajectory never waits in the pool's queue,
    so the time in which its actions only waited for a worker (the pool's
    own queueing: workers starting, a busy pool) is left out of the span.
    """
    by: dict[str, list[ActionRow]] = {}
    for a in actions:
        if not a.finished:
            continue
        by.setdefault(a.trajectory or f"action:{a.id}", []).append(a)
    core_s = gpu_s = 0.0
    for acts in by.values():
        span = max(a.finished for a in acts) - min(a.submitted for a in acts) - _only_waiting(acts)
        cores = max(_peak([(a.started or a.submitted, a.finished, a.cores) for a in acts]),
                    max(a.cores for a in acts))
        core_s += cores * max(0.0, span)
        if any(a.kind == "reward" for a in acts):
            gpu_s += max(0.0, span)
    return {"trajectories": len(by), "core_seconds": core_s, "gpu_seconds": gpu_s}


def summarise(rep: Report) -> dict[str, Any]:
    alloc_core_s = sum(j.cpus * j.elapsed_s for j in rep.jobs)
    alloc_gpu_s = sum(j.gpus * j.elapsed_s for j in rep.jobs)
    busy_core_s = sum(a.busy_core_s for a in rep.all_runs)
    busy_gpu_s = _busy_gpu_seconds(rep)
    done = [a for a in rep.actions if a.finished]
    acts = sorted(a.act for a in done)
    status: dict[str, int] = {}
    for a in rep.actions:
        status[a.status] = status.get(a.status, 0) + 1
    tb = trajectory_bound(rep.actions)
    states: dict[str, int] = {}
    for j in rep.jobs:
        states[j.state] = states.get(j.state, 0) + 1
    return {
        "source": rep.source,
        "worker_jobs": len(rep.jobs),
        "job_states": states,
        "allocated_core_hours": alloc_core_s / 3600,
        "allocated_gpu_hours": alloc_gpu_s / 3600,
        "cpu_time_hours": sum(j.cpu_time_s for j in rep.jobs) / 3600,
        "busy_core_hours": busy_core_s / 3600,
        "busy_gpu_hours": busy_gpu_s / 3600,
        "core_utilisation": busy_core_s / alloc_core_s if alloc_core_s else None,
        "gpu_utilisation": busy_gpu_s / alloc_gpu_s if alloc_gpu_s else None,
        "actions": len(rep.actions),
        "actions_by_status": status,
        "retried_actions": sum(1 for a in rep.actions if a.attempts > 1),
        "mean_act_s": sum(acts) / len(acts) if acts else None,
        "p50_act_s": _pct(acts, 0.5),
        "p95_act_s": _pct(acts, 0.95),
        "trajectories": tb["trajectories"],
        "trajectory_bound_core_hours": tb["core_seconds"] / 3600,
        "trajectory_bound_gpu_hours": tb["gpu_seconds"] / 3600,
        "core_hours_saved": (tb["core_seconds"] - alloc_core_s) / 3600,
        # no action ran to its end on a core (every attempt lost with its worker, or only reward
        # calls, which bind no core): nothing to compare
        "core_savings": 1 - alloc_core_s / tb["core_seconds"] if tb["core_seconds"] and busy_core_s else None,
        "gpu_hours_saved": (tb["gpu_seconds"] - alloc_gpu_s) / 3600,
        "gpu_savings": 1 - alloc_gpu_s / tb["gpu_seconds"] if tb["gpu_seconds"] and busy_gpu_s else None,
    }


def _pct(sorted_vals: list[float], q: float) -> float | None:
    if not sorted_vals:
        return None
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


def _busy_gpu_intervals(rep: Report) -> list[tuple[float, float, int]]:
    """A GPU worker's GPUs count as busy while it runs at least one action."""
    per_worker: dict[str, list[tuple[float, float]]] = {}
    for a in rep.all_runs:
        if a.started and a.finished and rep.worker_gpus.get(a.worker or ""):
            per_worker.setdefault(a.worker, []).append((a.started, a.finished))
    out = []
    for w, spans in per_worker.items():
        spans.sort()
        cur_s, cur_e = spans[0]
        for s, e in spans[1:]:
            if s <= cur_e:
                cur_e = max(cur_e, e)
            else:
                out.append((cur_s, cur_e, rep.worker_gpus[w]))
                cur_s, cur_e = s, e
        out.append((cur_s, cur_e, rep.worker_gpus[w]))
    return out


def _busy_gpu_seconds(rep: Report) -> float:
    return sum((e - s) * g for s, e, g in _busy_gpu_intervals(rep))


def build_report(run_dir: str | os.PathLike | None, **kw: Any) -> Report:
    return load_run(run_dir, **kw)


# -- output --------------------------------------------------------------------

_JOB_COLUMNS = ("job_id", "handle", "state", "partition", "elapsed_s", "cpus", "gpus", "cpu_time_s",
                "core_hours", "gpu_hours", "start", "end")


def _job_row(j: JobUsage) -> dict[str, Any]:
    return {"job_id": j.job_id, "handle": j.handle, "state": j.state, "partition": j.partition,
            "elapsed_s": round(j.elapsed_s, 3), "cpus": j.cpus, "gpus": j.gpus,
            "cpu_time_s": round(j.cpu_time_s, 3), "core_hours": round(j.core_hours, 6),
            "gpu_hours": round(j.gpu_hours, 6), "start": j.start, "end": j.end}


def _fmt_time(t: float | None) -> str:
    return datetime.fromtimestamp(t).strftime("%m-%d %H:%M:%S") if t else "-"


def _fmt_dur(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append("  ".join(c.rjust(w) if c[:1].isdigit() else c.ljust(w) for c, w in zip(r, widths)))
    return "\n".join(out)


def format_table(rep: Report) -> str:
    s = rep.summary
    lines = [f"run: {rep.run_dir or '(all tangram worker jobs)'}   allocation source: {rep.source}"]
    if rep.window != (None, None):
        lines.append(f"window: {_fmt_time(rep.window[0])} .. {_fmt_time(rep.window[1])}")
    lines.append("")
    rows = [[j.job_id, j.handle, j.state, j.partition or "-", _fmt_dur(j.elapsed_s), str(j.cpus), str(j.gpus),
             _fmt_dur(j.cpu_time_s), f"{j.core_hours:.4f}", f"{j.gpu_hours:.4f}", _fmt_time(j.start),
             _fmt_time(j.end)] for j in sorted(rep.jobs, key=lambda j: (j.start or 0, j.job_id))]
    lines.append(_table(["job", "handle", "state", "partition", "elapsed", "cpus", "gpus", "cpu time",
                         "core-h", "gpu-h", "start", "end"], rows))
    lines.append("")

    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    util = s["core_utilisation"]
    kv = [
        ("worker jobs", f"{s['worker_jobs']}  ({', '.join(f'{n} {k}' for k, n in sorted(s['job_states'].items())) or 'none'})"),
        ("allocated", f"{s['allocated_core_hours']:.4f} core-h, {s['allocated_gpu_hours']:.4f} GPU-h "
                      f"(CPU time used {s['cpu_time_hours']:.4f} h)"),
        ("busy (actions)", f"{s['busy_core_hours']:.4f} core-h, {s['busy_gpu_hours']:.4f} GPU-h"),
        ("utilisation", f"cores {num(None if util is None else 100 * util, '.1f')}%, GPUs "
                        f"{num(None if s['gpu_utilisation'] is None else 100 * s['gpu_utilisation'], '.1f')}%"),
        ("actions served", f"{s['actions']}  ({', '.join(f'{n} {k}' for k, n in sorted(s['actions_by_status'].items())) or 'none'}; "
                           f"{s['retried_actions']} retried)"),
        ("ACT", f"mean {num(s['mean_act_s'], '.3f')} s, p50 {num(s['p50_act_s'], '.3f')} s, "
                f"p95 {num(s['p95_act_s'], '.3f')} s"),
        ("trajectory-bound", f"{s['trajectory_bound_core_hours']:.4f} core-h, "
                             f"{s['trajectory_bound_gpu_hours']:.4f} GPU-h over {s['trajectories']} trajectories"),
        ("saved vs trajectory-bound", _savings_text(s)),
    ]
    w = max(len(k) for k, _ in kv)
    lines += [f"{k.ljust(w)}  {v}" for k, v in kv]
    return "\n".join(lines)


def _savings_text(s: dict[str, Any]) -> str:
    """Cores and GPUs apart (a core-hour and a GPU-hour are not the same resource)."""
    if s["core_savings"] is None and s["gpu_savings"] is None:
        return "n/a (no action ran to its end)"
    parts = []
    if s["core_savings"] is not None:
        parts.append(f"{s['core_hours_saved']:.4f} core-h ({100 * s['core_savings']:.1f}%)")
    elif s["allocated_core_hours"]:
        parts.append("cores n/a (no action ran to its end on a core)")
    if s["gpu_savings"] is not None:
        parts.append(f"{s['gpu_hours_saved']:.4f} GPU-h ({100 * s['gpu_savings']:.1f}%)")
    elif s["allocated_gpu_hours"]:
        parts.append("GPUs n/a (no reward call ran to its end)")
    return ", ".join(parts)


def format_json(rep: Report) -> str:
    return json.dumps({"run_dir": rep.run_dir, "window": list(rep.window), "summary": rep.summary,
                       "jobs": [_job_row(j) for j in rep.jobs]}, indent=2)


def format_csv(rep: Report) -> str:
    """One row per job, then a ``total`` row (job_id ``total``, handle the job count)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=_JOB_COLUMNS)
    w.writeheader()
    for j in rep.jobs:
        w.writerow(_job_row(j))
    starts = [j.start for j in rep.jobs if j.start is not None]
    ends = [j.end for j in rep.jobs if j.end is not None]
    states = rep.summary.get("job_states", {})
    w.writerow({"job_id": "total", "handle": f"{len(rep.jobs)} jobs",
                "state": " ".join(f"{n} {k}" for k, n in sorted(states.items())), "partition": "",
                "elapsed_s": round(sum(j.elapsed_s for j in rep.jobs), 3), "cpus": sum(j.cpus for j in rep.jobs),
                "gpus": sum(j.gpus for j in rep.jobs), "cpu_time_s": round(sum(j.cpu_time_s for j in rep.jobs), 3),
                "core_hours": round(sum(j.core_hours for j in rep.jobs), 6),
                "gpu_hours": round(sum(j.gpu_hours for j in rep.jobs), 6),
                "start": min(starts) if starts else None, "end": max(ends) if ends else None})
    return buf.getvalue()


def _step(intervals: list[tuple[float, float, int]]) -> tuple[list[float], list[int]]:
    points = sorted([(s, w) for s, _, w in intervals] + [(e, -w) for _, e, w in intervals])
    xs, ys, cur = [], [], 0
    for t, w in points:
        cur += w
        xs.append(t)
        ys.append(cur)
    return xs, ys


def write_plots(rep: Report, out_dir: str | os.PathLike, now: float | None = None) -> list[Path]:
    """PNG files: allocated vs busy cores and GPUs over time, and the ACT CDF."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    now = time.time() if now is None else now
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    alloc_c = [(j.start, j.end or now, j.cpus) for j in rep.jobs if j.start is not None]
    alloc_g = [(j.start, j.end or now, j.gpus) for j in rep.jobs if j.start is not None and j.gpus]
    busy_c = [(a.started, a.finished, a.cores) for a in rep.all_runs if a.started and a.finished]
    busy_g = _busy_gpu_intervals(rep)
    t0 = min([s for s, _, _ in alloc_c + busy_c] or [now])
    panels = [(alloc_c, busy_c, "cores")] + ([(alloc_g, busy_g, "GPUs")] if alloc_g or busy_g else [])
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3 + 3 * len(panels)), sharex=True, squeeze=False)
    axes = axes[:, 0]
    for ax, (alloc, busy, unit) in zip(axes, panels):
        for data, label, style in ((alloc, f"allocated {unit}", "-"), (busy, f"busy {unit}", "--")):
            xs, ys = _step(data)
            ax.step([x - t0 for x in xs], ys, style, where="post", label=label)
        ax.set_ylabel(unit)
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds since run start")
    axes[0].set_title("tangram-hpc: allocated vs busy")
    fig.tight_layout()
    p1 = out / "allocation.png"
    fig.savefig(p1, dpi=100)
    plt.close(fig)

    acts = sorted(a.act for a in rep.actions if a.finished)
    fig, ax = plt.subplots(figsize=(6, 4))
    if acts:
        ax.step(acts, [(i + 1) / len(acts) for i in range(len(acts))], where="post")
    ax.set_xlabel("action completion time (s)")
    ax.set_ylabel("fraction of actions")
    ax.set_title(f"ACT CDF ({len(acts)} actions)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p2 = out / "act_cdf.png"
    fig.savefig(p2, dpi=100)
    plt.close(fig)
    return [p1, p2]


# -- CLI -----------------------------------------------------------------------

def parse_time(text: str) -> float:
    """Unix seconds, ISO 8601 (local time), or ``-2h``/``-30m``/``-90s``/``-1d`` before now."""
    text = text.strip()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text.startswith("-") and text[-1:] in units:
        return time.time() - float(text[1:-1]) * units[text[-1]]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (unix seconds, ISO 8601 or -2h)") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", type=Path, help="coordinator run directory (without it: every tangram "
                   "worker job in --since/--until, from sacct alone)")
    p.add_argument("--since", type=parse_time, help="start of the window (unix s, ISO 8601, or -2h)")
    p.add_argument("--until", type=parse_time, help="end of the window")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="summary and per-job rows as JSON")
    fmt.add_argument("--csv", action="store_true", help="per-job rows as CSV")
    p.add_argument("--plot", type=Path, metavar="DIR", help="write allocation.png and act_cdf.png here")
    p.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (there is none when stderr is not a terminal)")


_RUN_LOGS = ("actions.log", "workers.log", "slurm_jobs.log")


def main(args: argparse.Namespace) -> int:
    if args.run_dir is None and args.since is None:
        print("report: give --run-dir or --since", file=sys.stderr)
        return 2
    if args.run_dir is not None and not args.run_dir.is_dir():
        print(f"report: no run directory {args.run_dir}", file=sys.stderr)
        return 2
    logs = [args.run_dir / n for n in _RUN_LOGS] if args.run_dir is not None else []
    if logs and not any(p.exists() for p in logs):
        # an accounting report of a directory that is not a run's would say the run used nothing
        inside = sorted(str(p.parent) for p in args.run_dir.glob(f"*/{_RUN_LOGS[0]}"))
        hint = f"; run directories in it: {', '.join(inside[:5])}{' ...' if len(inside) > 5 else ''}" \
            if inside else ""
        print(f"report: {args.run_dir} is not a coordinator run directory (none of {', '.join(_RUN_LOGS)})"
              f"{hint}", file=sys.stderr)
        return 2
    from .slurm import SlurmCommandError
    try:
        with progress_reporter(args.quiet) as progress:
            rep = load_run(args.run_dir, since=args.since, until=args.until, progress=progress)
    except SlurmCommandError as e:
        print(f"report: Slurm accounting unavailable: {e}", file=sys.stderr)
        return 1
    for path in logs:
        if path.is_file() and path.stat().st_size and next(read_records(path), None) is None:
            print(f"report: warning: {path} holds no readable record (not a tangram-hpc log?)", file=sys.stderr)
    if args.json:
        print(format_json(rep))
    elif args.csv:
        sys.stdout.write(format_csv(rep))
    else:
        print(format_table(rep))
    if args.plot:
        for p in write_plots(rep, args.plot):
            print(f"wrote {p}", file=sys.stderr)
    return 0
