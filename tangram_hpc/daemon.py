"""Settings for the project's long-running processes (the coordinator and workers)."""
from __future__ import annotations

import gc

#: Collections of the youngest generation run after this many allocations (Python's default: 700).
GC_YOUNG_THRESHOLD = 50_000


def tune_gc(older: tuple[int, int] = (50, 100)) -> None:
    """Collect cyclic garbage rarely: after start-up, and every 50,000 allocations rather than 700.

    The dispatch path allocates a few short-lived objects per action (a record, its wire
    map, a result list), freed by reference counting; almost none form cycles.  At the
    default thresholds the cycle collector runs every few dozen actions and, every few
    thousand, walks the whole result cache: a fifth of the coordinator's CPU at 30k
    actions/s (``benchmarks/dispatch.py``).  What start-up built (modules, the policy,
    the configuration) is frozen out of every later collection.

    ``older``: the thresholds of the two older generations.  A worker passes Python's own
    (10, 10): the code it runs is the user's, whose cyclic garbage must not wait long.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *older)
