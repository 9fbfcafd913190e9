"""The workers a coordinator knows: what each registered, what it last reported, what it runs.

Socket-free: the ZMQ loop hands it decoded REGISTER and HEARTBEAT bodies, the
ledger keeps each record's running actions and bound cores up to date, and
every change of membership is one record in the run's worker log.
"""
from __future__ import annotations

from enum import Enum
from typing import Iterator

from .. import protocol as P
from ..actions import BUILTIN_KINDS, is_kind_name, register_kind
from ..resources import WorkerInfo, WorkerShape


class WorkerState(str, Enum):
    """A registered worker's state (a ``str`` enum: ``status`` shows the value)."""

    OK = "ok"                  # takes new actions
    DRAINING = "draining"      # takes none; reclaimed once its running actions end

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]


class WorkerRecord:
    """One registered worker, as the coordinator sees it.

    ``busy_cores`` counts every core the scheduling policy holds for the
    worker: those of its running actions and those of *zombies*, attempts
    already finalised for their client (timed out or cancelled) that the
    worker has not yet reported ended.  ``zombies`` maps such an action id to
    ``(attempt, cores, environment or None)``.
    """

    __slots__ = ("info", "ident", "last_seen", "running", "busy_cores", "zombies", "state", "drain_reason",
                 "idle_since", "services", "envs", "registered_at", "launched_shape", "launched_at",
                 "service_counts", "service_costs", "devices", "leaving", "envs_v")

    def __init__(self, info: WorkerInfo, ident: bytes, now: float):
        self.info = info
        self.ident = ident
        self.last_seen = now
        self.running: set[str] = set()
        self.busy_cores = 0
        self.zombies: dict[str, tuple[int, int, str | None]] = {}
        self.state = WorkerState.OK
        self.drain_reason = ""
        self.idle_since: float | None = now
        self.services: frozenset[str] = frozenset()
        self.envs: frozenset[str] = frozenset()
        self.envs_v: int | None = None   # the number of the worker's list ``envs`` was made from
        self.registered_at = now
        self.launched_shape: WorkerShape | None = None   # set by the pool driver for workers it launched
        self.launched_at: float | None = None            # ... and when it asked the backend for it
        # service -> (loads onto the device, evictions, queued inputs), as the worker last reported
        self.service_counts: dict[str, tuple[int, int, int]] = {}
        # service -> (mean seconds to load it onto the device, to evict it), as the worker measured
        self.service_costs: dict[str, tuple[float, float]] = {}
        # per device of a reward worker: (name, used MB, budget MB, free MB or -1, resident services)
        self.devices: list[tuple[str, float, float, float, list[str]]] = []
        self.leaving = ""                                # why, once it said it is leaving

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def zombie_cores(self) -> int:
        return sum(z[1] for z in self.zombies.values())


class WorkerRegistry:
    def __init__(self, worker_log=None):
        self.by_id: dict[str, WorkerRecord] = {}
        self.by_handle: dict[str, str] = {}   # backend handle -> worker id
        self.log = worker_log if worker_log is not None else []

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Iterator[WorkerRecord]:
        return iter(list(self.by_id.values()))

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self.by_id.get(worker_id)

    @staticmethod
    def check(ident: bytes, body: dict) -> WorkerInfo:
        """Validate a REGISTER body from the peer at ``ident``; the kinds it declares become submittable."""
        reg = P.check_register(body)
        wid = ident.decode("utf-8", "replace")
        if reg["id"] != wid:
            raise P.ProtocolError("malformed", "REGISTER id must equal the socket identity")
        if not reg["kinds"]:
            raise P.ProtocolError("malformed", "REGISTER declares no action kinds: such a worker could run nothing")
        extra = [kind for kind in reg["kinds"] if kind not in BUILTIN_KINDS]
        bad = [kind for kind in extra if not is_kind_name(kind)]
        if bad:   # refused whole, before any of its kinds becomes submittable
            raise P.ProtocolError("malformed", f"REGISTER declares invalid kind names {bad[:4]!r}: "
                                               "lowercase letters, digits, '_', '.', '-' (at most 32)")
        for kind in extra:
            register_kind(kind)  # clients may now submit actions of the worker's own kinds
        return WorkerInfo(id=wid, cores=reg["cores"], mem_mb=reg["mem_mb"], gpus=reg["gpus"],
                          gpu_mem_mb=reg["gpu_mem_mb"], kinds=frozenset(reg["kinds"]),
                          services=frozenset(reg["services"]), handle=reg["handle"], host=reg["host"] or "",
                          partition=reg["partition"],
                          extra={"pid": reg["pid"], "env_root": reg["env_root"], "envs": reg["envs"]})

    def add(self, info: WorkerInfo, ident: bytes, now: float) -> WorkerRecord:
        w = WorkerRecord(info, ident, now)
        self.by_id[info.id] = w
        if info.handle:
            self.by_handle[info.handle] = info.id
        self._record(now, "register", w)
        return w

    def remove(self, worker_id: str, now: float, event: str) -> WorkerRecord | None:
        """Forget a worker (``event``: lost or reclaimed); None if it was not registered."""
        w = self.by_id.pop(worker_id, None)
        if w is None:
            return None
        if w.info.handle and self.by_handle.get(w.info.handle) == worker_id:
            del self.by_handle[w.info.handle]
        self._record(now, event, w)
        return w

    def report(self, w: WorkerRecord, body: dict, now: float) -> bool:
        """Apply a HEARTBEAT's resident services and hosted environments; True when either changed."""
        w.last_seen = now
        changed = False
        services = body.get("services")
        if isinstance(services, list) and frozenset(services) != w.services:
            w.services = frozenset(s for s in services if isinstance(s, str))
            changed = True
        envs = body.get("envs")
        # A worker lists its environments (25,000 each at 100k environments on 4 workers) only when
        # they changed, numbered; a heartbeat without them says which list it still holds.
        if isinstance(envs, list):
            w.envs_v = body.get("envs_v")
            held = frozenset(envs)
            if held != w.envs:
                w.envs = held
                changed = True
        counts = body.get("service_counts")
        if isinstance(counts, dict):
            w.service_counts = _service_counts(counts, w.info.services)
        costs = body.get("service_costs")
        if isinstance(costs, dict):
            w.service_costs = _service_costs(costs, w.info.services)
        devices = body.get("devices")
        if isinstance(devices, list):
            w.devices = _devices(devices, w.info.services)
        return changed

    @staticmethod
    def envs_unknown(w: WorkerRecord, body: dict) -> bool:
        """Whether a heartbeat names an environment list (``envs_v``) this coordinator has not
        received (a list lost with a coordinator that restarted, a registration): ask for it."""
        v = body.get("envs_v")
        return v is not None and v != w.envs_v

    def mark_draining(self, w: WorkerRecord, reason: str, now: float) -> None:
        w.state = WorkerState.DRAINING
        w.drain_reason = reason
        self._record(now, "drain", w)

    def _record(self, now: float, event: str, w: WorkerRecord) -> None:
        self.log.append([now, event, w.info.id, w.info.handle, w.info.cores, w.info.gpus])


def _service_counts(counts: dict, hosted: frozenset[str]) -> dict[str, tuple[int, int, int]]:
    """A heartbeat's ``service_counts`` ({service: [loads, evictions, queued inputs]}), keeping only
    well-formed entries of services the worker registered (so a peer cannot grow this without bound)."""
    out = {}
    for name, v in counts.items():
        if name in hosted and isinstance(v, (list, tuple)) and len(v) == 3 and \
                all(type(x) is int and x >= 0 for x in v):
            out[name] = (v[0], v[1], v[2])
    return out


def _service_costs(costs: dict, hosted: frozenset[str]) -> dict[str, tuple[float, float]]:
    """A heartbeat's ``service_costs`` ({service: [load seconds, evict seconds]}), keeping only
    well-formed, finite, non-negative entries of services the worker registered."""
    out = {}
    for name, v in costs.items():
        if name in hosted and isinstance(v, (list, tuple)) and len(v) == 2 and \
                all(type(x) in (int, float) and 0 <= x < float("inf") for x in v):
            out[name] = (float(v[0]), float(v[1]))
    return out


def _devices(devices: list, hosted: frozenset[str]) -> list[tuple[str, float, float, float, list[str]]]:
    """A heartbeat's ``devices`` ([[name, used MB, budget MB, free MB or -1, [service, ...]], ...]), keeping
    well-formed entries only, at most 64 devices, and of the residents only services the worker registered."""
    out = []
    for d in devices[:64]:
        if isinstance(d, (list, tuple)) and len(d) == 5 and isinstance(d[0], str) and len(d[0]) <= 32 and \
                all(type(x) in (int, float) and x == x and abs(x) < 1e12 for x in d[1:4]) and isinstance(d[4], list):
            out.append((d[0], float(d[1]), float(d[2]), float(d[3]), sorted(s for s in d[4] if s in hosted)))
    return out
