"""Pool sizing: how many workers of which shape to ask for, and which to give back.

:class:`PoolController` is pure (the clock comes in the :class:`PoolView`);
it keeps no history of its own.  It states the workers it *wants*: the pool
driver's one launch throttle (rate, back-off, breaker) holds launches back,
for every backend alike.

Scale up.  Waiting work is split by the shape kind it needs (``gpu`` for
actions with a GPU service or GPU memory, ``cpu`` otherwise) and turned into
core-seconds with the predictor (mean, not median: capacity must cover the
tail).  A new worker only helps with work still waiting when it arrives, so
the controller asks for enough cores to clear the backlog within the start-up
time of a worker:

    wanted cores = backlog core-seconds / startup_s
    missing      = wanted - free cores now - cores of workers already starting

and launches ``ceil(missing / shape.cores)`` workers, at least one when work
waits and no worker of the kind exists or is starting.  Elastic actions
shrink instead of waiting when the pool is busy, so a backlog alone would
under-provision: the controller also launches when busy cores exceed
``target_util`` of the capacity (and does not reclaim below it).  Workers already
starting count as capacity, so a backlog does not trigger a second wave of
launches while the first is still queued in the batch system.  Launches are
capped by the per-kind and total maxima.

Cluster view.  With a :class:`ClusterCapacity` (free cores/GPUs per
partition, from the batch system) the controller only asks for shapes whose
partition can hold them now and prefers the partition with the most idle
resources; with several shapes of a kind in the config, that is how it picks.

Time limits.  A worker whose batch job ends within ``time_limit_margin_s``
is drained (its running actions finish, its environments are snapshotted)
and no longer counts as capacity, so a replacement is launched in time.

Scale down.  A worker idle (no running action) for ``idle_ttl_s`` is
reclaimed, down to ``min_workers`` of its kind, never while work of its kind
waits; one that hosts sandbox environments waits ``env_idle_ttl_s`` instead
(reclaiming drains it, and a stopping worker snapshots its environments for
the next worker to restore).  A worker that runs actions is never reclaimed;
a draining worker is reclaimed once it is empty.

Withdrawing.  Once nothing of a kind waits, launches still starting that the
busy cores do not need (beyond ``min_workers``) are withdrawn, newest first:
the driver cancels the jobs still queued in the batch system, as
dask-jobqueue's adapt and Parsl's scale-in do, instead of letting them start
after the work is done.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..actions import ActionSpec
from ..resources import ClusterCapacity, PartitionFree, WorkerShape
from .base import Launch, PoolPolicy, PoolView, Reclaim, Withdraw
from .predict import Predictor

__all__ = ["PoolController", "PoolConfig", "ClusterCapacity", "PartitionFree", "shape_kind_for"]


@dataclass(slots=True)
class PoolConfig:
    """Limits and timings of the pool.

    shapes: the worker shapes to use, e.g. one CPU shape and one GPU shape
        (several of a kind: alternative partitions).
    max_workers: per kind (``cpu``/``gpu``); missing kinds are unbounded
        except by ``max_total``.
    """

    shapes: list[WorkerShape]
    max_workers: dict[str, int] = field(default_factory=dict)
    min_workers: dict[str, int] = field(default_factory=dict)
    max_total: int = 1 << 30
    startup_s: float = 60.0
    idle_ttl_s: float = 300.0
    env_idle_ttl_s: float = 600.0   # idle time before a worker hosting environments is drained
    time_limit_margin_s: float = 120.0
    target_util: float = 0.75

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError("PoolConfig needs at least one worker shape")
        for name in ("startup_s", "idle_ttl_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")


def shape_kind_for(spec: ActionSpec) -> str:
    """The shape kind an action needs."""
    d = spec.demand
    return "gpu" if (d.service or d.gpu_mem_mb) else "cpu"


class PoolController(PoolPolicy):
    def __init__(self, config: PoolConfig, predictor: Predictor | None = None):
        self.config = config
        self.predictor = predictor if predictor is not None else Predictor()
        self.cluster: ClusterCapacity | None = None
        self._last = ""

    @property
    def shapes(self) -> list[WorkerShape]:
        return list(self.config.shapes)

    def update_cluster(self, capacity: ClusterCapacity | None) -> None:
        """The batch system's current free resources (the Slurm backend polls them)."""
        self.cluster = capacity

    def explain(self) -> str:
        return self._last

    # -- decision ------------------------------------------------------------
    def decide(self, view: PoolView) -> list[Launch | Reclaim | Withdraw]:
        cfg = self.config
        now = view.now
        cluster = view.cluster or self.cluster
        out: list[Launch | Reclaim | Withdraw] = []

        # backlog per kind, in core-seconds and in actions
        backlog: dict[str, float] = {}
        waiting: dict[str, int] = {}
        biggest: dict[str, int] = {}
        for spec in view.pending:
            k = shape_kind_for(spec)
            backlog[k] = backlog.get(k, 0.0) + self.predictor.mean_core_seconds(spec)
            waiting[k] = waiting.get(k, 0) + 1
            biggest[k] = max(biggest.get(k, 0), spec.demand.min_cores)

        count: dict[str, int] = {}
        free: dict[str, int] = {}
        busy: dict[str, int] = {}
        cap: dict[str, int] = {}
        for ws in view.workers:
            k = ws.info.shape.kind
            count[k] = count.get(k, 0) + 1
            busy[k] = busy.get(k, 0) + ws.busy_cores
            if not ws.draining and not self._expiring(ws, now):
                free[k] = free.get(k, 0) + max(0, ws.info.cores - ws.busy_cores)
                cap[k] = cap.get(k, 0) + ws.info.cores
        starting: dict[str, int] = {}
        starting_cores: dict[str, int] = {}
        for shape, _at in view.starting:
            starting[shape.kind] = starting.get(shape.kind, 0) + 1
            starting_cores[shape.kind] = starting_cores.get(shape.kind, 0) + shape.cores
        total = len(view.workers) + len(view.starting)

        # -- scale down first (frees room under max_total for the other kind)
        kept = dict(count)
        for ws in sorted(view.workers, key=lambda s: (s.idle_since if s.idle_since is not None else now, s.info.id)):
            k = ws.info.shape.kind
            if self._expiring(ws, now) and not ws.draining:
                out.append(Reclaim(ws.info.id, "time limit"))  # drained; its replacement is launched below
                kept[k] -= 1
                continue
            if ws.running or ws.busy_cores:
                continue                      # busy: never
            if ws.draining:
                out.append(Reclaim(ws.info.id, "drained"))
                kept[k] -= 1
                continue
            if waiting.get(k):
                continue
            if busy.get(k, 0) > cfg.target_util * (cap.get(k, 0) - ws.info.cores):
                continue                      # the rest would run too hot without it
            # Reclaiming drains: a worker snapshots its environments when it stops, and they are
            # restored where their trajectory acts next, so environments only make it wait longer.
            ttl = cfg.env_idle_ttl_s if ws.envs else cfg.idle_ttl_s
            if ws.idle_since is None or now - ws.idle_since < ttl:
                continue
            if kept[k] - 1 < cfg.min_workers.get(k, 0):
                continue
            out.append(Reclaim(ws.info.id, "idle"))
            kept[k] -= 1
        total -= len(out)
        withdrawn = self._withdrawals(view, waiting, busy, cap, kept)
        out += withdrawn
        total -= sum(w.count for w in withdrawn)

        # -- scale up
        reasons = []
        kinds = sorted(set(waiting) | set(cfg.min_workers) | set(busy))
        for k in kinds:
            shapes = [s for s in cfg.shapes if s.kind == k and s.cores >= biggest.get(k, 0)]
            if not shapes:
                if waiting.get(k):
                    reasons.append(f"no {k} shape large enough for waiting actions")
                continue
            have = kept.get(k, 0) + starting.get(k, 0)
            room = min(cfg.max_workers.get(k, 1 << 30) - have, cfg.max_total - total)
            need = 0
            if waiting.get(k):
                shape0 = shapes[0]
                wanted = backlog[k] / max(cfg.startup_s, 1.0)
                missing = wanted - free.get(k, 0) - starting_cores.get(k, 0)
                need = math.ceil(missing / shape0.cores) if missing > 0 else 0
                if have == 0:
                    need = max(need, 1)
            # keep utilisation under the target: elastic actions get fewer cores
            # (and run longer) when the pool runs hot even if nothing waits
            hot = busy.get(k, 0) / cfg.target_util - cap.get(k, 0) - starting_cores.get(k, 0)
            if hot > 0:
                need = max(need, math.ceil(hot / shapes[0].cores))
            need = max(need, cfg.min_workers.get(k, 0) - have)
            if need <= 0:
                continue
            if room <= 0:
                reasons.append(f"{k} pool at its maximum ({have} workers)")
                continue
            n = min(need, room)
            for shape, m in self._split(shapes, n, cluster):
                out.append(Launch(shape, m))
                total += m
                n -= m
            if n > 0:
                reasons.append(f"partitions cannot hold {n} more {k} workers now")
        self._last = "; ".join(reasons) if reasons else "ok"
        return out

    def _withdrawals(self, view: PoolView, waiting: dict[str, int], busy: dict[str, int], cap: dict[str, int],
                     kept: dict[str, int]) -> list[Withdraw]:
        """Launches still starting that nothing needs any more: none of their kind waits, and the
        workers there are (and ``min_workers``) are enough for the busy cores at ``target_util``."""
        cfg = self.config
        out = []
        by_kind: dict[str, list] = {}
        for shape, at in view.starting:
            by_kind.setdefault(shape.kind, []).append((at, shape))
        for k, starting in by_kind.items():
            if waiting.get(k):
                continue
            surplus = cap.get(k, 0) + sum(s.cores for _, s in starting) - busy.get(k, 0) / cfg.target_util
            keep_at_least = cfg.min_workers.get(k, 0) - kept.get(k, 0)
            count: dict[WorkerShape, int] = {}
            left = len(starting)
            for _, shape in sorted(starting, key=lambda p: -p[0]):   # newest first
                if left <= keep_at_least or surplus < shape.cores:
                    break
                count[shape] = count.get(shape, 0) + 1
                surplus -= shape.cores
                left -= 1
            out += [Withdraw(shape, n, f"no {k} work waiting") for shape, n in count.items()]
        return out

    def _expiring(self, ws, now: float) -> bool:
        return ws.ends_at is not None and ws.ends_at - now < self.config.time_limit_margin_s

    def _split(self, shapes: list[WorkerShape], n: int, cluster: ClusterCapacity | None
               ) -> list[tuple[WorkerShape, int]]:
        """Spread ``n`` launches over the shapes whose partitions can hold them, idlest first.

        When no partition can start one now, they go to the idlest partition that can hold them
        at all (the jobs queue there), so a busy cluster delays workers instead of never asking.
        """
        if cluster is None:
            return [(shapes[0], n)]
        ranked = sorted((s for s in shapes if cluster.holds(s)), key=lambda s: -cluster.idle_score(s))
        out: dict[WorkerShape, int] = {}
        for s in ranked:
            m = min(n, cluster.fits(s))
            if m > 0:
                out[s] = m
                n -= m
            if n == 0:
                break
        if not out and ranked:
            out[ranked[0]] = n
        return list(out.items())
