"""What clients are answered besides their live actions' results: results again, shared keys, kept outcomes.

Socket-free, like the ledger that owns it: answers go into the :class:`~.outbox.Outbox`.

* finished results stay in a bounded cache, so a resubmission (a reconnected client, a
  repeated idempotency key) gets the first answer again;
* an idempotency key names the first action submitted with it; later ones share its result;
* outcomes a worker kept from before it registered again, of actions this coordinator does not
  know (yet), wait for a resubmission, which they answer instead of running it again;
* a rejected action is answered at once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .. import protocol as P
from ..actions import ActionSpec, Status
from .outbox import Counters, Outbox

if TYPE_CHECKING:     # the settings object is handed in; config itself stays out of the core's imports
    from ..config import CoordinatorSettings


class RecentMap:
    """A bounded map of recent entries in two generations of plain dicts.

    Lookups see both; once the young one holds half the capacity it becomes the old one and
    the old one is dropped whole.  Dropping whole dicts, rather than evicting entry by entry
    from one ordered map, keeps the coordinator's memory flat over millions of actions.
    """

    __slots__ = ("half", "half_bytes", "young", "old", "young_bytes")

    def __init__(self, capacity: int, max_bytes: int | None = None):
        self.half = max(1, capacity // 2)
        # what the values weigh (large outputs), when the caller says: a generation is full at
        # half the entries or half the bytes
        self.half_bytes = max(1, max_bytes // 2) if max_bytes else float("inf")
        self.young: dict = {}
        self.old: dict = {}
        self.young_bytes = 0

    def get(self, key):
        v = self.young.get(key)
        return v if v is not None else self.old.get(key)

    def put(self, key, value, nbytes: int = 0) -> None:
        self.young[key] = value
        if nbytes:
            self.young_bytes += nbytes
        if len(self.young) >= self.half or self.young_bytes >= self.half_bytes:
            self.old, self.young = self.young, {}
            self.young_bytes = 0

    def pop(self, key) -> None:
        self.young.pop(key, None)
        self.old.pop(key, None)

    def __bool__(self) -> bool:
        return bool(self.young or self.old)


class ClientAnswers:
    """The results, idempotency keys and kept outcomes of one coordinator."""

    __slots__ = ("outbox", "counters", "recent", "keys", "orphans")

    def __init__(self, config: CoordinatorSettings, outbox: Outbox, counters: Counters):
        self.outbox = outbox
        self.counters = counters
        self.recent = RecentMap(config.result_cache, config.result_cache_mb << 20)   # action id -> result wire
        self.keys = RecentMap(config.result_cache)                     # idempotency key -> action id
        self.orphans = RecentMap(min(config.result_cache, 100_000))    # action id -> outcome of an earlier registration

    def send(self, client: bytes, res: list) -> None:
        results = self.outbox.results
        mine = results.get(client)
        if mine is None:
            results[client] = [res]
        else:
            mine.append(res)

    def final(self, client: bytes, res: list, waiters: list[tuple[bytes, str]] | None, nbytes: int) -> None:
        """An action's final result: to its client, to those sharing it (under their own ids), and kept."""
        results = self.outbox.results      # (send, inline: once per action on the dispatch path)
        mine = results.get(client)
        if mine is None:
            results[client] = [res]
        else:
            mine.append(res)
        self.recent.put(res[0], res, nbytes)
        if waiters:
            for ident, other in waiters:
                copy = list(res)
                copy[0] = other
                self.send(ident, copy)

    def again(self, client: bytes, aid: str) -> bool:
        """Answer a resubmission of a finished action with its first result (True when known)."""
        done = self.recent.get(aid)
        if done is None:
            return False
        self.send(client, done)
        return True

    def reject(self, client: bytes, aid: str | None, why: str, now: float, status: str = Status.ERROR) -> None:
        self.counters.rejected += 1
        if aid is None:
            self.outbox.to_clients.append((client, P.ERROR, {"code": "invalid_action", "message": why[:500]}))
            return
        self.send(client, [aid, status, None, f"rejected: {why}", now, 0.0, now, None, 0, 0, None])

    def first_with_key(self, spec: ActionSpec, key: str) -> str | None:
        """The action id that holds idempotency key ``key``, or None when ``spec`` takes it now."""
        first = self.keys.get(key)
        if first is None:
            self.keys.put(key, spec.id)
        return first

    def shared(self, client: bytes, spec: ActionSpec, first: str) -> bool:
        """``spec`` shares the key of finished action ``first``: answered with its result (True), or,
        that result forgotten, it takes the key and runs (False)."""
        done = self.recent.get(first)
        if done is None:
            self.keys.put(spec.idempotency_key, spec.id)
            return False
        copy = list(done)
        copy[0] = spec.id
        self.send(client, copy)
        return True

    def keep_orphan(self, aid: str, outcome: list) -> None:
        """An outcome of an action this coordinator does not know: kept for its resubmission."""
        if self.recent.get(aid) is None:
            self.orphans.put(aid, outcome)

    def kept_outcome(self, aid: str) -> list | None:
        return self.orphans.get(aid) if self.orphans else None

    def from_orphan(self, client: bytes, spec: ActionSpec, kept: list, now: float) -> None:
        """A resubmitted action whose attempt under an earlier registration of a worker did finish."""
        attempt, status, output, error, started, finished, env_state, worker = kept
        res = [spec.id, status, output, error, now, started, finished, worker, 0, attempt, env_state]
        self.send(client, res)
        self.recent.put(spec.id, res)
        self.orphans.pop(spec.id)
        self.counters.replayed += 1
