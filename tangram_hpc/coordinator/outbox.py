"""What the coordinator's state machines want sent, and what they have counted.

The ledger and the pool driver never touch a socket: they append to an
:class:`Outbox`, and the ZMQ loop flushes it once per turn, one frame per
destination.  A test reads the outbox instead of a socket.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Outbox:
    """Messages waiting to be sent, grouped by destination.

    ``assign`` and ``kill`` are keyed by worker id and are sent only to a
    worker still registered at flush time (a worker lost in the same turn
    must not run actions already handed to another attempt).  ``to_workers``
    and ``to_clients`` are single messages sent as they are.
    """

    assign: dict[str, list] = field(default_factory=dict)    # worker id -> [[action wire, attempt, cores], ...]
    kill: dict[str, list] = field(default_factory=dict)      # worker id -> [[action id, attempt], ...]
    env: dict[str, list] = field(default_factory=dict)       # worker id -> [[op, environment id, generation], ...]
    results: dict[bytes, list] = field(default_factory=dict)  # client identity -> [result wire, ...]
    to_workers: list[tuple[bytes, int, Any]] = field(default_factory=list)  # (identity, type, body)
    to_clients: list[tuple[bytes, int, Any]] = field(default_factory=list)  # (identity, type, body)

    def __bool__(self) -> bool:
        return bool(self.assign or self.kill or self.env or self.results or self.to_workers or self.to_clients)


@dataclass
class Counters:
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    retried: int = 0
    rejected: int = 0
    bad_frames: int = 0
    stale_results: int = 0
    workers_lost: int = 0
    launch_failures: int = 0
    launches: int = 0
    reclaims: int = 0
    envs_closed: int = 0
    replayed: int = 0          # resubmitted actions answered by an outcome a worker kept, not run again
    env_moves: int = 0         # environments moved to another worker because the policy asked
    internal_errors: int = 0   # valid frames whose handling failed (a bug in the ledger, the policy or the loop)
    by_status: dict = field(default_factory=dict)
