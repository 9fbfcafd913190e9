"""A pool of fixed size: the local backend's pool, and the warm start of a static cluster."""
from __future__ import annotations

from ..resources import CPU, WorkerShape
from .base import Launch, PoolPolicy, PoolView, Reclaim, Withdraw, WorkerStatus

__all__ = ["StaticPool"]


class StaticPool(PoolPolicy):
    """Keep a fixed set of workers: launch them, replace lost ones, give back extras.

    A worker command that keeps failing is held back by the driver's launch throttle
    (back-off, then the breaker), not here.
    """

    def __init__(self, shapes: list[WorkerShape]):
        self.shapes = list(shapes)

    def explain(self) -> str:
        cpu = sum(1 for s in self.shapes if s.resource is CPU)
        return f"static: keeps {cpu} CPU and {len(self.shapes) - cpu} service workers"

    def decide(self, view: PoolView) -> list[Launch | Reclaim | Withdraw]:
        want: dict[WorkerShape, int] = {}
        for s in self.shapes:
            want[s] = want.get(s, 0) + 1
        # Draining workers take no new work: they are not the pool, and never the reason to give
        # another one back (a worker declared lost that came back and its replacement were once
        # both drained that way, leaving none to accept work for minutes).
        have: dict[WorkerShape, list[WorkerStatus]] = {}
        for w in view.workers:
            if not w.draining:
                have.setdefault(w.launched_shape, []).append(w)
        starting: dict[WorkerShape, int] = {}
        for shape, _ in view.starting:
            starting[shape] = starting.get(shape, 0) + 1
        out: list[Launch | Reclaim | Withdraw] = []
        for shape in dict.fromkeys([*want, *have, *starting]):
            accepting = have.get(shape, [])
            # A worker declared lost that comes back (a resumed hang) makes one too many.  A joined
            # worker is never given back for one still starting: the launch is withdrawn instead
            # (a job still queued is cancelled; one about to join is left to this rule next time).
            extra = len(accepting) - want.get(shape, 0)
            for w in [w for w in accepting if not w.running and not w.busy_cores][:max(0, extra)]:
                out.append(Reclaim(w.info.id, "more workers than the pool keeps"))
            surplus = min(starting.get(shape, 0), len(accepting) + starting.get(shape, 0) - want.get(shape, 0))
            if surplus > 0:
                out.append(Withdraw(shape, surplus, "more workers than the pool keeps"))
            missing = want.get(shape, 0) - len(accepting) - starting.get(shape, 0)
            if missing > 0:
                out.append(Launch(shape, missing))
        return out
