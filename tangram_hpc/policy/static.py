"""A pool of fixed size: the local backend's pool, and the warm start of a static cluster."""
from __future__ import annotations

from ..resources import WorkerShape
from .base import Launch, PoolPolicy, PoolView, Reclaim, WorkerStatus

__all__ = ["StaticPool"]


class StaticPool(PoolPolicy):
    """Keep a fixed set of workers: launch them, replace lost ones, give back extras.

    After failed starts it waits before trying again, doubling the wait up to
    ``max_backoff_s``, so a broken worker command does not spawn a process a second.
    """

    def __init__(self, shapes: list[WorkerShape], *, first_backoff_s: float = 1.0, max_backoff_s: float = 60.0):
        self.shapes = list(shapes)
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self._note = ""

    def decide(self, view: PoolView) -> list[Launch | Reclaim]:
        want: dict[WorkerShape, int] = {}
        for s in self.shapes:
            want[s] = want.get(s, 0) + 1
        have: dict[WorkerShape, list[WorkerStatus]] = {}
        for w in view.workers:
            have.setdefault(w.launched_shape, []).append(w)
        starting: dict[WorkerShape, int] = {}
        for shape, _ in view.starting:
            starting[shape] = starting.get(shape, 0) + 1
        out: list[Launch | Reclaim] = []
        # A worker declared lost that comes back (a resumed hang) makes one too many: give back an idle one.
        for shape, ws in have.items():
            extra = len(ws) + starting.get(shape, 0) - want.get(shape, 0)
            for w in [w for w in ws if not w.running and not w.draining][:max(0, extra)]:
                out.append(Reclaim(w.info.id, "more workers than the pool keeps"))
        wait = self._backoff(view)
        self._note = f"backing off {wait:.0f}s after {self._streak(view)} failed starts" if wait else "ok"
        if wait:
            return out
        for shape, n in want.items():
            missing = n - len(have.get(shape, [])) - starting.get(shape, 0)
            if missing > 0:
                out.append(Launch(shape, missing))
        return out

    def _streak(self, view: PoolView) -> int:
        """Failed starts since the last worker registered."""
        last_ok = max((w.started_at for w in view.workers), default=0.0)
        return sum(1 for t, _ in view.failures if t > last_ok)

    def _backoff(self, view: PoolView) -> float:
        n = self._streak(view)
        if not n:
            return 0.0
        last = max(t for t, _ in view.failures)
        delay = min(self.max_backoff_s, self.first_backoff_s * 2 ** (n - 1))
        return max(0.0, last + delay - view.now)

    def explain(self) -> str:
        return self._note
