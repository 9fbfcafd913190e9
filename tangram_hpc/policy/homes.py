"""Where each environment lives as placement sees it, and what changes that.

:class:`EnvHomes` keeps one :class:`~.records.EnvState` per environment that has a host, a live
action, or a known idle time (the think time :mod:`.moves` learns from), and forgets it once it
has none: clients may name any number of environments.  Where an environment lives changes with
the workers (a heartbeat lists what a worker holds; a worker leaves), with the coordinator (an
environment is closed, or keeps live processes), and with an action's transitions in
:class:`~.placement.PlacementPolicy` (its first action to start decides its host).
"""
from __future__ import annotations

from .queues import PlacementQueues
from .records import EnvState, WorkerRecord

__all__ = ["EnvHomes"]


class EnvHomes:
    """The environments placement tracks, by name (see the module docstring)."""

    def __init__(self, queues: PlacementQueues):
        self.envs: dict[str, EnvState] = {}
        self._queues = queues

    def state(self, env: str) -> EnvState:
        """``env``'s record, made at its first use."""
        es = self.envs.get(env)
        if es is None:
            es = self.envs[env] = EnvState(env)
        return es

    def forget(self, es: EnvState) -> None:
        """Drop ``es`` once nothing refers to it: no host, no action of it live, no idle time kept."""
        if es.live == 0 and es.host is None and es.idle < 0 and self.envs.get(es.name) is es:
            del self.envs[es.name]

    def host(self, env: str) -> WorkerRecord | None:
        es = self.envs.get(env)
        return es.host if es is not None else None

    def pin(self, env: str, pinned: bool) -> None:
        """``env`` keeps live processes on its host (``pinned``), or no longer does."""
        es = self.envs.get(env)
        if es is not None:
            es.pinned = pinned

    def settle(self, es: EnvState, w: WorkerRecord) -> None:
        """``es``'s first action started on ``w``: it lives there now, and its held actions follow."""
        es.host = w
        w.envs.add(es.name)
        self._queues.release_first(es)

    def reported(self, w: WorkerRecord, envs: frozenset[str]) -> None:
        """``w`` holds ``envs`` (its report): each lives there now, and none of the others it held."""
        for env in envs:
            if env not in w.envs:
                es = self.state(env)
                if es.host is not None:
                    es.host.envs.discard(env)
                es.host = w
                w.envs.add(env)
        for env in [e for e in w.envs if e not in envs]:
            w.envs.discard(env)
            gone = self.envs.get(env)
            if gone is not None and gone.host is w:
                gone.host = None
                self.forget(gone)

    def lost(self, w: WorkerRecord) -> None:
        """``w`` left: its environments live nowhere now."""
        for env in w.envs:
            es = self.envs.get(env)
            if es is not None and es.host is w:
                es.host = None
                es.pinned = False     # its processes died with the worker
                self.forget(es)
        w.envs.clear()

    def close(self, env: str) -> None:
        """``env`` lives nowhere now (see :meth:`~.placement.PlacementPolicy.close_env`); its actions
        still waiting on its worker go back to the shared queues."""
        es = self.envs.get(env)
        if es is None:
            return
        w = es.host
        es.host = None
        es.idle = -1.0
        self.forget(es)
        if w is None:
            return
        w.envs.discard(env)
        self._queues.reroute_env(es, w)
