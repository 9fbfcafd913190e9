"""The simulator's event calendar: pending events in time order, at a constant cost per event.

Compiled with the engine (:mod:`tangram_hpc.native`): the engine pushes and pops every event
through it.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Final

__all__ = ["EventCalendar"]

_NEAR: Final = 1 << 16          # buckets of the calendar's ring (a power of two)
_NEAR_MASK: Final = _NEAR - 1


class EventCalendar:
    """Pending events in ``(time, type, seq)`` order.

    An event is a tuple ``(time, type, seq, ...)``: its handler's arguments
    follow inline (a nested tuple would be one more allocation per event), and
    ``seq``, drawn from :attr:`seq`, keeps events of one time and type in the
    order they were pushed.  ``cur`` stays the same list object for the
    calendar's life, so the simulation loop may pop it directly; ``later``
    counts the events not in it.

    A single heap of every pending event costs ``log2`` of a few hundred
    thousand comparisons per pop at 100,000 trajectories.  Events here sit in
    buckets of ``width`` simulated seconds; later buckets are plain lists until
    their turn comes, and the current one is sorted latest first, so the next
    event is ``cur[-1]`` and a pop takes it off the end.  (``list.sort``
    compares tuples whose first items are floats by those floats directly: a
    bucket of a thousand events is ordered in about half the time that a heap's
    build and pops took.  An event pushed into the current bucket, about one in
    a hundred, is inserted in order.)  The buckets of the next ``_NEAR`` widths
    are a ring indexed by bucket number (almost every event lands there: a
    look-up in a map of bucket numbers cost as much as the rest of a push); a
    bucket further out waits in a map until its turn.  A bucket's events may
    thus sit partly in the map (pushed while it was far) and partly in the ring:
    they are merged when its turn comes, and the sort orders them the same
    either way.
    """

    __slots__ = ("width", "ring", "near", "far", "far_keys", "cur", "cur_key", "later", "seq")

    def __init__(self, width: float = 0.25):
        self.width = width
        self.ring: list[list | None] = [None] * _NEAR        # bucket k at k % _NEAR, for cur_key < k <= cur_key + _NEAR
        self.near = 0                    # events in the ring
        self.far: dict[int, list] = {}   # bucket number -> its events pushed while it was beyond the ring
        self.far_keys: list[int] = []    # heap of the far map's bucket numbers
        self.cur: list = []              # the current bucket's events, latest first
        self.cur_key = -1
        self.later = 0                   # events not in cur
        self.seq = itertools.count(1).__next__

    def push(self, e: tuple) -> None:
        """Add event ``e``, a tuple ``(time, type, self.seq(), ...)``."""
        t: float = e[0]
        k = int(t / self.width)
        d = k - self.cur_key
        if d <= 0:
            # into the current bucket, behind every later event
            cur = self.cur
            lo = 0
            hi = len(cur)
            while lo < hi:
                mid = (lo + hi) >> 1
                x = cur[mid]
                xt: float = x[0]
                if xt > t or (xt == t and x > e):
                    lo = mid + 1
                else:
                    hi = mid
            cur.insert(lo, e)
            return
        self.later += 1
        if d <= _NEAR:
            ring = self.ring
            i = k & _NEAR_MASK
            b = ring[i]
            if b is None:
                ring[i] = [e]
            else:
                b.append(e)
            self.near += 1
            return
        b = self.far.get(k)
        if b is None:
            self.far[k] = [e]
            heapq.heappush(self.far_keys, k)
        else:
            b.append(e)

    def pop(self) -> tuple:
        cur = self.cur
        if not cur:
            self._next_bucket()
        return cur.pop()

    def _next_bucket(self) -> None:
        """Make the next non-empty bucket the current one (``cur`` is empty, ``later`` is not)."""
        far_k = self.far_keys[0] if self.far_keys else -1
        k = self.cur_key + 1
        if self.near:
            # the ring's next bucket, unless the far map's comes first
            ring = self.ring
            end = far_k if far_k >= 0 else k + _NEAR
            while k < end and ring[k & _NEAR_MASK] is None:
                k += 1
        else:
            k = far_k
        cur = self.cur
        b = self.ring[k & _NEAR_MASK]
        if b is not None:
            self.ring[k & _NEAR_MASK] = None
            self.near -= len(b)
            cur.extend(b)
        if k == far_k:
            heapq.heappop(self.far_keys)
            cur.extend(self.far.pop(k))
        self.later -= len(cur)
        cur.sort(reverse=True)
        self.cur_key = k

    def __bool__(self) -> bool:
        return bool(self.cur) or self.later > 0
