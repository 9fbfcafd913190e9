"""The coordinator's metrics: finished actions counted in batches, gauges read when asked.

Socket-free and clock-free like the rest of the core.  Nothing here runs per
action on the dispatch path:

* :meth:`CoordinatorMetrics.observe` takes the action-log records the ledger
  already appends for every final result (one list per action), a batch at a
  time, when the coordinator flushes its logs (each tick, and before a scrape
  or a ``status``); numpy sorts a batch into the histogram buckets;
* queues, workers, cores, services and counters are read from the ledger, the
  registry and the pool driver only when a scrape or a ``status`` asks.

The same numbers feed ``status`` (and so ``tangram-hpc top``) and the
Prometheus endpoint (:meth:`CoordinatorMetrics.families`).
"""
from __future__ import annotations

from collections import Counter
from operator import itemgetter
from typing import Any

import numpy as np

from ..metrics import ACT_BUCKETS_S, Family, Histogram
from .ledger import ActionLedger
from .registry import WorkerState

__all__ = ["CoordinatorMetrics", "queue_classes"]

_KIND, _SUBMITTED, _STARTED, _FINISHED, _STATUS = (itemgetter(i) for i in (1, 5, 6, 7, 8))


class CoordinatorMetrics:
    """Per kind of action: completion time (ACT: submitted to final result) and queue time
    (submitted to started, for actions that started) histograms, and counts per final status."""

    def __init__(self, bounds: tuple[float, ...] = ACT_BUCKETS_S):
        self.bounds = bounds
        self.act: dict[str, Histogram] = {}
        self.queue_time: dict[str, Histogram] = {}
        self.finished: Counter[tuple[str, str]] = Counter()   # (kind, status) -> actions

    def observe(self, records: list[list]) -> None:
        """A batch of action-log records (:data:`tangram_hpc.runlog.ACTION_FIELDS` order)."""
        n = len(records)
        if not n:
            return
        kinds = list(map(_KIND, records))
        self.finished.update(zip(kinds, map(_STATUS, records)))   # Status members: str keys
        submitted = np.fromiter(map(_SUBMITTED, records), float, n)
        started = np.fromiter(map(_STARTED, records), float, n)
        finished = np.fromiter(map(_FINISHED, records), float, n)
        # started/finished come from the worker's clock: a skewed node must not make them negative.
        act = np.maximum(finished - submitted, 0.0)
        ran = started > 0.0        # 0: finalised before it started (cancelled, timed out, failed to place)
        wait = np.maximum(started - submitted, 0.0)
        distinct = set(kinds)
        if len(distinct) == 1:
            groups = [(kinds[0], None)]
        else:
            arr = np.array(kinds, dtype=object)
            groups = [(k, arr == k) for k in distinct]
        for kind, mask in groups:
            h = self.act.get(kind)
            if h is None:
                h = self.act[kind] = Histogram(self.bounds)
                self.queue_time[kind] = Histogram(self.bounds)
            if mask is None:
                h.observe_many(act)
                self.queue_time[kind].observe_many(wait[ran])
            else:
                h.observe_many(act[mask])
                self.queue_time[kind].observe_many(wait[ran & mask])

    # -- views ---------------------------------------------------------------------
    def status(self, ledger: ActionLedger, now: float) -> dict[str, Any]:
        """The keys this adds to the coordinator's ``status`` reply."""
        by_kind: dict[str, dict[str, int]] = {}
        for (kind, status), n in sorted(self.finished.items()):
            by_kind.setdefault(kind, {})[status] = n
        return {
            "queues": queue_classes(ledger, now),
            "act": {k: h.to_wire() for k, h in sorted(self.act.items())},
            "queue_time": {k: h.to_wire() for k, h in sorted(self.queue_time.items())},
            "finished_by_kind": by_kind,
            # services loaded ahead of their calls: issued, used by a call, wasted (None: no prefetch)
            "prefetch": ledger.policy.prefetch_counts(),
        }

    def families(self, ledger: ActionLedger, pool_driver: Any, now: float, *, coordinator: str,
                 uptime_s: float) -> list[Family]:
        """Every metric family of the coordinator, read now."""
        c = ledger.counters
        policy = ledger.policy
        fams: list[Family] = []

        def family(name: str, kind: str, help_: str, *labels: str) -> Family:
            f = Family(name, kind, help_, labels)
            fams.append(f)
            return f

        family("tangram_coordinator_info", "gauge", "this coordinator (value 1)", "coordinator").add(1, coordinator)
        family("tangram_coordinator_uptime_seconds", "gauge", "seconds since the coordinator started").add(uptime_s)

        # -- actions
        family("tangram_actions_submitted_total", "counter", "actions admitted to the scheduler").add(c.submitted)
        fin = family("tangram_actions_finished_total", "counter", "actions with a final result, by kind and status",
                     "kind", "status")
        for (kind, status), n in sorted(self.finished.items()):
            fin.add(n, kind, status)
        family("tangram_actions_rejected_total", "counter",
               "actions refused at submission (invalid, over a limit)").add(c.rejected)
        family("tangram_actions_retried_total", "counter",
               "attempts started again after their worker was lost").add(c.retried)
        family("tangram_stale_results_total", "counter",
               "worker results dropped because their attempt was no longer current").add(c.stale_results)
        family("tangram_bad_frames_total", "counter", "malformed frames answered with an error").add(c.bad_frames)
        family("tangram_actions_pending", "gauge", "actions waiting for a worker").add(policy.pending_count)
        family("tangram_actions_running", "gauge", "actions running on workers").add(policy.running_count)
        pend = family("tangram_queue_pending_actions", "gauge", "waiting actions per placement class",
                      "kind", "service", "min_cores", "mem_mb", "gpu_mem_mb")
        oldest = family("tangram_queue_oldest_wait_seconds", "gauge",
                        "how long the oldest waiting action of a placement class has waited",
                        "kind", "service", "min_cores", "mem_mb", "gpu_mem_mb")
        # Memory demands are the clients' numbers: as labels they are rounded up to a power of two,
        # so that no client can make a new series per action.
        classes: dict[tuple, list] = {}
        for q in queue_classes(ledger, now):
            labels = (q["kind"], q["service"], q["min_cores"], mem_label(q["mem_mb"]), mem_label(q["gpu_mem_mb"]))
            agg = classes.setdefault(labels, [0, 0.0])
            agg[0] += q["pending"]
            agg[1] = max(agg[1], q["oldest_s"])
        for labels, (pending, oldest_s) in classes.items():
            pend.add(pending, *labels)
            oldest.add(oldest_s, *labels)
        act = family("tangram_action_completion_seconds", "histogram",
                     "action completion time (ACT): submitted to final result", "kind")
        for kind, h in sorted(self.act.items()):
            act.add(h, kind)
        qt = family("tangram_action_queue_seconds", "histogram", "submitted to started, for actions that started",
                    "kind")
        for kind, h in sorted(self.queue_time.items()):
            qt.add(h, kind)

        # -- workers and cores
        by_state = Counter(str(w.state) for w in ledger.workers)
        starting = len(pool_driver.starting) if pool_driver is not None else 0
        wf = family("tangram_workers", "gauge", "workers by state (starting: launched, not yet registered)", "state")
        for state in [str(s) for s in WorkerState] + ["starting"]:
            wf.add(starting if state == "starting" else by_state.get(state, 0), state)
        cores = family("tangram_worker_cores", "gauge", "cores of a registered worker", "worker", "handle")
        busy = family("tangram_worker_busy_cores", "gauge",
                      "cores bound on a worker (running actions and zombies)", "worker", "handle")
        zombie = family("tangram_worker_zombie_cores", "gauge",
                        "cores held by timed-out or cancelled attempts a worker has not reported ended",
                        "worker", "handle")
        envs = family("tangram_worker_environments", "gauge", "sandbox environments a worker hosts",
                      "worker", "handle")
        resident = family("tangram_service_resident", "gauge",
                          "1 when a reward-model service is resident on a worker's device", "service", "worker")
        loads = family("tangram_service_loads_total", "counter",
                       "moves of a service onto a worker's device (as the worker reports)", "service", "worker")
        evictions = family("tangram_service_evictions_total", "counter",
                           "evictions of a service from a worker's device (as the worker reports)", "service", "worker")
        queued = family("tangram_service_queued_inputs", "gauge",
                        "inputs queued at a worker's service, not yet in a batch", "service", "worker")
        dev_used = family("tangram_service_device_used_mb", "gauge",
                          "device memory a reward worker's resident services hold", "worker", "device")
        dev_free = family("tangram_service_device_free_mb", "gauge",
                          "device memory free now, as the reward worker last read it", "worker", "device")
        for w in ledger.workers:
            wid, handle = w.info.id, w.info.handle or ""
            cores.add(w.info.cores, wid, handle)
            busy.add(w.busy_cores, wid, handle)
            zombie.add(w.zombie_cores, wid, handle)
            envs.add(len(w.envs), wid, handle)
            for s in sorted(w.services):
                resident.add(1, s, wid)
            for s, (n_loads, n_evictions, n_queued) in sorted(w.service_counts.items()):
                loads.add(n_loads, s, wid)
                evictions.add(n_evictions, s, wid)
                queued.add(n_queued, s, wid)
            for name, used, _budget, free, _resident in w.devices:
                dev_used.add(used, wid, name)
                if free >= 0:
                    dev_free.add(free, wid, name)
        family("tangram_workers_lost_total", "counter",
               "workers lost (silent, exited, job ended) with their running actions retried").add(c.workers_lost)
        family("tangram_env_moves_total", "counter",
               "environments moved to another worker because the scheduler asked").add(c.env_moves)
        family("tangram_worker_launches_total", "counter", "workers the pool asked its backend for").add(c.launches)
        family("tangram_worker_reclaims_total", "counter",
               "drained workers the pool stopped and gave back").add(c.reclaims)
        family("tangram_worker_launch_failures_total", "counter",
               "launches the backend refused or whose worker never joined").add(c.launch_failures)
        return fams


def mem_label(mb: int) -> int:
    """A memory demand as a metric label: the next power of two (0 stays 0), at most 41 values."""
    return 0 if mb <= 0 else 1 << (int(mb) - 1).bit_length()


def queue_classes(ledger: ActionLedger, now: float) -> list[dict[str, Any]]:
    """Waiting actions grouped by what they need (kind, service, cores, memory, GPU memory),
    largest group first; ``env_bound`` counts those that must run where their environment is."""
    groups: dict[tuple, list] = {}
    for spec in ledger.policy.pending_actions():
        d = spec.demand
        key = (spec.kind, d.service or "", d.min_cores, d.mem_mb, d.gpu_mem_mb)
        g = groups.get(key)
        if g is None:
            g = groups[key] = [0, 0, now]
        g[0] += 1
        g[1] += spec.env is not None
        t = ledger.submitted_at(spec.id)
        if t is not None and t < g[2]:
            g[2] = t
    out = [{"kind": k[0], "service": k[1], "min_cores": k[2], "mem_mb": k[3], "gpu_mem_mb": k[4],
            "pending": g[0], "env_bound": g[1], "oldest_s": max(0.0, now - g[2])}
           for k, g in groups.items()]
    out.sort(key=lambda q: (-q["pending"], q["kind"], q["service"], q["min_cores"]))
    return out
