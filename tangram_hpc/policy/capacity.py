"""Free capacity: which worker has the most free cores for an action, and when cores free up.

The index is a max-heap of workers by free cores per set of kinds served, with lazy invalidation
(an entry is valid while its count is the worker's free cores): capacity that rises is pushed at
once unless the worker has an entry at that count already, capacity that falls is refreshed when
the entry is read, so the index always overstates and a search may stop at the first entry too
small.  A worker whose free cores go up and down between a few counts (an action ends, the next
starts) so pushes nothing most of the time.
"""
from __future__ import annotations

import heapq
from typing import Final

from .records import INF, Need, WorkerRecord

__all__ = ["CapacityIndex", "fits", "wait_for_cores", "running_ends"]

_SEQ_BITS: Final = 32
_SEQ_MASK: Final = (1 << _SEQ_BITS) - 1


def _index_entry(free: int, seq: int) -> int:
    """A free-capacity index entry: most free cores first, then the older worker.  One int, not a
    tuple: the heap compares ints, and an int is no object the cyclic collector tracks.  Read back
    as ``-(e >> _SEQ_BITS)`` (free cores) and ``e & _SEQ_MASK`` (the worker's seq)."""
    return -(free << _SEQ_BITS) | seq


class CapacityIndex:
    """Per set of kinds served, a heap of the workers' free-core entries (:func:`_index_entry`)."""

    def __init__(self, workers: dict[str, WorkerRecord]):
        self.workers = workers                               # the policy's registered workers (shared)
        self.heaps: dict[frozenset[str], list[int]] = {}
        self.kind_heaps: dict[str, list[list[int]]] = {}     # kind -> the heaps of the workers serving it
        self.by_seq: dict[int, WorkerRecord] = {}            # the registered workers by seq

    def index(self, w: WorkerRecord) -> None:
        """Index the worker's current free cores under the kinds it serves (unless an entry has them)."""
        free = w.free_cores
        if free in w.listed:
            return
        heap = self.heaps.get(w.kinds)
        if heap is None:
            heap = self.heaps[w.kinds] = []
            for k in w.kinds:
                self.kind_heaps.setdefault(k, []).append(heap)
        if len(heap) > 4 * len(self.workers) + 64:      # mostly stale entries: rebuild
            heap.clear()
            for o in self.workers.values():
                if o.kinds == w.kinds:
                    o.listed.clear()
                    if not o.draining and o is not w:
                        heap.append(_index_entry(o.free_cores, o.seq))
                        o.listed.add(o.free_cores)
            heapq.heapify(heap)
        heapq.heappush(heap, _index_entry(free, w.seq))
        w.listed.add(free)

    def best(self, kind: str, d: Need) -> WorkerRecord | None:
        """The non-draining worker serving ``kind`` with the most free cores that fits ``d``."""
        heaps = self.kind_heaps.get(kind)
        if not heaps:
            return None
        if len(heaps) == 1:
            return self._top_fit(heaps[0], d)
        best = None
        for heap in heaps:
            w = self._top_fit(heap, d)
            if w is not None and (best is None or (-w.free_cores, w.seq) < (-best.free_cores, best.seq)):
                best = w
        return best

    def _top_fit(self, heap: list[int], d: Need) -> WorkerRecord | None:
        skipped: list[int] = []
        found: WorkerRecord | None = None
        by_seq = self.by_seq
        while heap:
            e = heap[0]
            listed = -(e >> _SEQ_BITS)
            w = by_seq.get(e & _SEQ_MASK)
            if w is None or w.draining:
                heapq.heappop(heap)
                if w is not None:
                    w.listed.discard(listed)
                continue
            free = w.free_cores
            if listed != free:
                heapq.heappop(heap)
                w.listed.discard(listed)
                if free not in w.listed:
                    heapq.heappush(heap, _index_entry(free, w.seq))   # refresh a fallen one
                    w.listed.add(free)
                continue
            if d.min_cores and listed < d.min_cores:
                break            # nothing below has the cores either
            if fits(w, d):
                found = w
                break
            skipped.append(heapq.heappop(heap))
        for e in skipped:
            heapq.heappush(heap, e)
        return found


def fits(w: WorkerRecord, d: Need) -> bool:
    """``w`` has the cores (or a light slot), memory and GPU memory ``d`` needs free now."""
    return ((w.free_cores >= d.min_cores if d.min_cores else w.light < w.light_cap)
            and w.free_mem >= d.mem_mb
            and (d.service is not None or w.gpu_mem - w.gpu_used >= d.gpu_mem_mb))


def wait_for_cores(w: WorkerRecord, need: int, now: float) -> float:
    """Expected seconds until ``need`` more cores are free on ``w`` (from its actions' predicted ends)."""
    if need <= 0:
        return 0.0
    if w.cores - w.free_cores < need:
        return INF             # not even when all of its actions have ended
    got = 0
    for left, cores in running_ends(w, now):
        got += cores
        if got >= need:
            return left
    return INF


def running_ends(w: WorkerRecord, now: float) -> list[tuple[float, int]]:
    """(seconds until it ends, cores) of each core-binding action running on ``w``, soonest first.

    Kept until the worker's running actions (or their grants) change or the clock moves: a
    placement asks it for several core counts (the move rule, then the wait for cores).
    """
    memo = w.ends
    if memo is not None and memo[0] == now:
        return memo[1]
    ends = []
    for r in w.running.values():
        c = r.cores
        if c:
            left = r.ends_at - now
            soonest = 0.25 * r.expect
            ends.append((left if left > soonest else soonest, c))
    ends.sort()
    w.ends = (now, ends)
    return ends
