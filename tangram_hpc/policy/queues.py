"""The placement queues: waiting actions by what they need, and which queues may place now.

Waiting actions never get scanned one by one.  They sit in queues, each a heap of
``(key, seq, record)``:

* a *bucket* per placement class ``(kind, min_cores, mem, per-action GPU memory)``
  for actions that may go to any worker serving their kind;
* a *service queue* per ``(kind, service, min_cores, mem)`` for reward calls;
* an *env queue* per worker and demand ``(kind, service, min_cores, mem, per-action GPU memory)``
  for actions whose environment lives there.

All actions of a queue need the same thing (env queues: the same worker too), so when a queue's head
cannot be placed none of it can, and the queue is not looked at again until something it could
use changes (a worker of its kind frees capacity or joins, a replica of its service frees a slot,
an action joins it): such queues are *armed*.  :meth:`PlacementQueues.place` merges the heads of
armed queues in one small heap and places them in key order, so a call costs
``O(A + k log(A + W))`` for ``A`` armed queues, ``W`` workers and ``k`` starts -- independent of
how many actions wait.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from .records import PENDING, ActionRecord, EnvState, PlacementQueue, WorkerRecord

if TYPE_CHECKING:
    from .placement import PlacementPolicy

__all__ = ["PlacementQueues", "waiting_for"]


class PlacementQueues:
    """The queues of one policy (see the module docstring)."""

    def __init__(self, policy: PlacementPolicy):
        self._policy = policy
        self.table: dict[tuple, PlacementQueue] = {}    # the shared queues with live entries, by what they need
        self.armed: dict[int, PlacementQueue] = {}      # queues whose head may be placeable now
        self.shared: dict[str, dict[int, PlacementQueue]] = {}   # kind -> its non-env queues with live entries
        self._heads: list | None = None
        self._qseq = 0

    def route(self, rec: ActionRecord) -> None:
        """Put a pending action in the queue that matches its placement constraint."""
        es = rec.envst
        if es is not None:
            host = es.host
            if host is not None:
                ek = (rec.kind, rec.service, rec.min_cores, rec.mem_mb, rec.gpu_mem_mb)
                q = host.env_queues.get(ek)
                if q is None:
                    self._qseq += 1
                    q = host.env_queues[ek] = PlacementQueue(self._qseq, rec.kind, rec.service, rec.min_cores,
                                                             rec.mem_mb, rec.gpu_mem_mb, host, key=ek)
                self._push(q, rec)
                return
            first = es.first
            if first is not None and first is not rec:
                es.wait.append(rec)
                return
            es.first = rec
        qk: tuple
        if rec.service:
            qk = (rec.kind, rec.service, rec.min_cores, rec.mem_mb)
            gpu = 0
        else:
            qk = (rec.kind, None, rec.min_cores, rec.mem_mb, rec.gpu_mem_mb)
            gpu = rec.gpu_mem_mb
        q = self.table.get(qk)
        if q is None:
            self._qseq += 1
            q = self.table[qk] = PlacementQueue(self._qseq, rec.kind, rec.service, rec.min_cores,
                                                rec.mem_mb, gpu, key=qk)
        self._push(q, rec)

    def _push(self, q: PlacementQueue, rec: ActionRecord) -> None:
        rec.queue = q
        q.live += 1
        q.work += rec.work
        w = q.worker
        if w is not None:
            w.env_live += 1
            w.env_work += rec.work
            w.env_mem += rec.mem_mb
        else:
            if q.live == 1:     # kept apart, so that a worker's every change does not look at idle queues
                shared = self.shared.get(q.kind)
                if shared is None:
                    shared = self.shared[q.kind] = {}
                shared[q.idx] = q
            if not rec.light:
                rec.load.queued += 1
                rec.load.queued_work += rec.work
                rec.load.queued_mem += rec.mem_mb
        heapq.heappush(q.heap, (rec.key, rec.seq, rec))
        self.armed[q.idx] = q
        if self._heads is not None:     # routed during place(): eligible in this same call
            heapq.heappush(self._heads, (rec.key, rec.seq, q.idx, q))

    def unqueue(self, rec: ActionRecord) -> None:
        """Take a record out of its queue's live count (its heap entry goes stale and is skipped)."""
        q = rec.queue
        if q is None:
            return
        q.live -= 1
        q.work -= rec.work
        w = q.worker
        if w is not None:
            w.env_live -= 1
            w.env_work -= rec.work
            w.env_mem -= rec.mem_mb
            if q.live == 0 and w.env_queues.get(q.key) is q:
                del w.env_queues[q.key]     # as a shared one: its stale entries are skipped
        else:
            if q.live == 0:
                # nothing waits in it: forget it, as clients may send any number of distinct
                # demands (its stale heap entries are skipped by whoever still holds it)
                del self.shared[q.kind][q.idx]
                if self.table.get(q.key) is q:
                    del self.table[q.key]
            if not rec.light:
                rec.load.queued -= 1
                rec.load.queued_work -= rec.work
                rec.load.queued_mem -= rec.mem_mb
        rec.queue = None

    def release_first(self, es: EnvState) -> None:
        """``es``'s first action no longer holds the others back (it started, or left): route them."""
        es.first = None
        held, es.wait = es.wait, []
        for r in held:
            self.route(r)

    def withdraw(self, rec: ActionRecord) -> None:
        """A pending action is cancelled: out of its queue, or its environment's hold-back list."""
        self.unqueue(rec)
        es = rec.envst
        if es is not None:
            if rec in es.wait:
                es.wait.remove(rec)
            if es.first is rec:
                self.release_first(es)

    def leave(self, rec: ActionRecord) -> None:
        """A pending action is set aside (it fits no worker now): out of its queue, or its
        environment's hold-back list."""
        es = rec.envst
        if es is not None and es.first is rec:
            self.release_first(es)
        elif es is not None and rec.queue is None and rec in es.wait:
            es.wait.remove(rec)
        self.unqueue(rec)

    def arm(self, w: WorkerRecord) -> None:
        """``w`` gained capacity (or joined): arm its env queue and the shared queues of its kinds."""
        if w.env_live:
            for q in w.env_queues.values():
                self.armed[q.idx] = q
        if w.draining:
            return
        for k in w.kinds:
            shared = self.shared.get(k)
            if shared:
                self.armed.update(shared)

    def strand(self, w: WorkerRecord) -> None:
        """``w`` left: its env queue's actions start over elsewhere (their environment is gone)."""
        stranded = []
        for q in list(w.env_queues.values()):
            self.armed.pop(q.idx, None)
            stranded += [e for e in q.heap if e[2].state is PENDING and e[2].queue is q]
            q.heap.clear()
        stranded.sort(key=lambda e: (e[0], e[1]))
        for _, _, rec in stranded:
            self.unqueue(rec)
            self.route(rec)

    def reroute_env(self, es: EnvState, w: WorkerRecord) -> None:
        """``es`` no longer lives on ``w``: its actions waiting there go back to the shared queues."""
        # (live > busy: some of its actions wait; an ended trajectory's have not, so its worker's
        # queues, where other environments' actions may wait, are not scanned)
        if w.env_live and es.live > es.busy:
            for q in list(w.env_queues.values()):
                for rec in [e[2] for e in q.heap if e[2].queue is q and e[2].envst is es]:
                    self.unqueue(rec)
                    self.route(rec)

    def place(self, now: float, started: list[ActionRecord]) -> None:
        """Place the heads of the armed queues in key order while capacity lasts (the policy's
        :meth:`~PlacementPolicy.place` says whether one starts, and starts it)."""
        policy = self._policy
        moves = policy.moves
        heads = []
        for q in list(self.armed.values()):
            h = q.heap
            while h and h[0][2].queue is not q:
                heapq.heappop(h)
            if not h:
                del self.armed[q.idx]
                continue
            w = q.worker
            if w is not None and w.free_cores < h[0][2].min_cores:
                del self.armed[q.idx]
                moves.consider(h[0][2], w, now)
                continue
            heads.append((h[0][0], h[0][1], q.idx, q))
        if not heads:
            return
        heapq.heapify(heads)
        self._heads = heads
        try:
            self._drain(heads, now, started)
        finally:
            self._heads = None

    def _drain(self, heads: list, now: float, started: list[ActionRecord]) -> None:
        policy = self._policy
        t = policy.tally
        while heads and (t.free_cores > 0 or t.light_pending > 0):
            _, _, _, q = heapq.heappop(heads)
            h = q.heap
            while h and h[0][2].queue is not q:
                heapq.heappop(h)
            if not h:
                self.armed.pop(q.idx, None)
                continue
            rec = h[0][2]
            if not policy.place(rec, q, now, started):
                self.armed.pop(q.idx, None)     # until something it could use changes
                continue
            heapq.heappop(h)
            while h and h[0][2].queue is not q:
                heapq.heappop(h)
            if h:
                heapq.heappush(heads, (h[0][0], h[0][1], q.idx, q))
            else:
                self.armed.pop(q.idx, None)


def waiting_for(rec: ActionRecord, w: WorkerRecord) -> tuple[int, float, int]:
    """Core-binding actions waiting that could use ``w``'s cores, ``rec`` aside, the seconds they
    take to drain, and how many more wait that ``w``'s free memory holds back.

    The kind's shared queues drain over the kind's capacity, ``w``'s own over its cores.  Memory
    is scheduled too: when what waits needs more memory than ``w`` has free, only as many as fit
    (at their mean need) could use its cores now; the rest wait for memory, not for cores.
    """
    kl = rec.load
    q = rec.queue
    mine = q is not None
    n = kl.queued + w.env_live - mine
    work = kl.queued_work + w.env_work - (rec.work if mine else 0.0)
    env_work = w.env_work - (rec.work if q is not None and q.worker is w else 0.0)
    drain = (work - env_work) / max(1, kl.capacity) + env_work / max(1, w.cores)
    mem = kl.queued_mem + w.env_mem - (rec.mem_mb if mine else 0)
    if n > 0 and mem > 0 and mem > w.free_mem:
        fit = int(max(0.0, w.free_mem) * n / mem)
        drain *= fit / n
        return fit, max(0.0, drain), n - fit
    return n, max(0.0, drain), 0
