"""First-come first-served action-level scheduling without elasticity.

Every action gets exactly ``min_cores``; waiting actions start in submission
order among those that fit somewhere now (a head that fits nowhere does not
block other placement classes, which would only idle the pool).  A reward
call goes to a worker where its service is resident with a free slot, or
loads the service on another worker at once.  Same constraints as the
elastic scheduler (env affinity, memory, GPU memory, draining).  Priorities
are ignored: this is the plain action-level baseline.
"""
from __future__ import annotations

from .base import mypyc_attr
from .placement import ActionRecord, PlacementPolicy, PlacementQueue

__all__ = ["FifoPolicy"]


@mypyc_attr(allow_interpreted_subclasses=True)
class FifoPolicy(PlacementPolicy):
    def _key(self, rec: ActionRecord) -> float:
        return float(rec.seq)

    def _should_load(self, rec: ActionRecord, q: PlacementQueue, now: float) -> bool:
        return True
