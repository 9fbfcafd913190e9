"""The STATUS reply: what ``tangram-hpc status``, ``top`` and a client's ``status()`` read.

Read from the live state when asked, never kept up to date per event: its cost is one pass over
the workers (and the environment directory's counts), paid by whoever asks, not by the dispatch
path or the heartbeats.
"""
from __future__ import annotations

import os

from .ledger import ActionLedger
from .metrics import CoordinatorMetrics


def status_reply(ledger: ActionLedger, metrics: CoordinatorMetrics, pool_driver, now: float, *,
                 coordinator: str, uptime_s: float, metrics_url: str | None, allocations: bool = False) -> dict:
    """The status map (``pool_driver``: the :class:`~.pool_driver.PoolDriver`, or None without a backend;
    ``allocations``: add its allocation history)."""
    c = ledger.counters
    policy = ledger.policy
    envlife = ledger.envlife
    workers = _workers(ledger, now)
    out = {
        "coordinator": coordinator, "uptime_s": uptime_s, "pid": os.getpid(),
        "pending": policy.pending_count, "running": policy.running_count,
        "zombie_cores": sum(w["zombie_cores"] for w in workers),
        "submitted": c.submitted, "completed": c.completed, "failed": c.failed, "retried": c.retried,
        "rejected": c.rejected, "bad_frames": c.bad_frames, "internal_errors": c.internal_errors,
        "stale_results": c.stale_results,
        "workers_lost": c.workers_lost, "launch_failures": c.launch_failures,
        "launches": c.launches, "reclaims": c.reclaims,
        "recent_launch_failures": [], "starting_workers": 0, "pool": "", "pool_decisions": [],
        "metrics_url": metrics_url,
        "by_status": dict(c.by_status), "replayed": c.replayed, "envs_closed": c.envs_closed,
        "env_moves": c.env_moves,
        # what the scheduler counts a move as costing, and the restores measured so far (None: none yet)
        "env_move_s": getattr(policy, "env_move_s", None), "env_restore_s": envlife.restore_s,
        "environments": envlife.directory.counts(),
        "workers": workers,
    }
    if pool_driver is not None:
        out.update(pool_driver.status(now, allocations=allocations))
        pool_driver.describe_workers(out["workers"], now)
    out.update(metrics.status(ledger, now))
    return out


def _workers(ledger: ActionLedger, now: float) -> list[dict]:
    """A map per worker: one pass, nothing computed twice (2,000 workers cost milliseconds here)."""
    sorted_kinds: dict[frozenset, list[str]] = {}   # workers of one pool share their kinds
    out = []
    for w in ledger.workers:
        info = w.info
        kinds = sorted_kinds.get(info.kinds)
        if kinds is None:
            kinds = sorted_kinds[info.kinds] = sorted(info.kinds)
        out.append({
            "id": info.id, "host": info.host, "pid": info.extra.get("pid"), "handle": info.handle,
            "kinds": kinds, "cores": info.cores, "busy_cores": w.busy_cores,
            "zombie_cores": w.zombie_cores if w.zombies else 0,
            "running": len(w.running), "gpus": info.gpus, "services": sorted(w.services) if w.services else [],
            "devices": [{"device": d[0], "used_mb": d[1], "budget_mb": d[2],
                         "free_mb": None if d[3] < 0 else d[3], "resident": d[4]} for d in w.devices],
            "service_moves": {s: {"loads": n[0], "evictions": n[1],
                                  "load_s": w.service_costs[s][0] if s in w.service_costs else None}
                              for s, n in w.service_counts.items()} if w.service_counts else {},
            "envs": len(w.envs), "state": w.state, "last_seen_s": round(now - w.last_seen, 2)})
    return out
