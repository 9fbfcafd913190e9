"""The service manager's records (requests, services, devices) and how outcomes reach callers.

Everything here is guarded by the manager's lock; the manager
(:mod:`tangram_hpc.managers.services`) is the only writer.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..actions import Status
from ..policy.residency import Resident
from .devices import Device
from .service_spec import ServiceSpec
from .weights import HostCopy

_log = logging.getLogger("tangram_hpc.managers.services")

#: ``done_callback(action_id, status, output, error, stats)``; ``output`` is
#: the list of scores for the action's inputs (status ok), ``error`` a message
#: otherwise; ``stats`` a small dict about the batch that scored it.
DoneCallback = Callable[[str, str, Any, "str | None", dict], None]


@dataclass(slots=True)
class Request:
    action_id: str
    inputs: list
    callback: DoneCallback
    submitted: float


@dataclass(slots=True)
class Counters:
    cold_loads: int = 0
    cold_load_s: float = 0.0
    loads: int = 0
    load_s: float = 0.0
    load_bytes: int = 0
    evictions: int = 0
    evict_s: float = 0.0
    oom_retries: int = 0
    batches: int = 0
    items: int = 0
    actions: int = 0
    failed_batches: int = 0
    failed_actions: int = 0
    device_mb_measured: float | None = None


@dataclass(slots=True, eq=False)
class Slot:
    """A device and the bookkeeping of what occupies it."""

    device: Device
    used_mb: float = 0.0
    error: str | None = None
    #: host-to-device bytes/s measured over this device's loads (estimates loads never measured)
    load_bytes: int = 0
    load_s: float = 0.0

    @property
    def free_mb(self) -> float:
        return self.device.memory_mb - self.used_mb

    def bandwidth(self) -> float | None:
        return self.load_bytes / self.load_s if self.load_s > 0 and self.load_bytes else None

    def report(self, free_mb: float | None, resident: list[str]) -> dict:
        bw = self.bandwidth()
        return {"device": self.device.name, "physical_id": self.device.physical_id,
                "budget_mb": self.device.memory_mb, "used_mb": self.used_mb, "free_mb": free_mb,
                "headroom_mb": self.device.headroom_mb, "load_gbps": bw / 1e9 if bw else None,
                "error": self.error, "resident": resident}


@dataclass(slots=True, eq=False)
class Service:
    spec: ServiceSpec
    model: Any = None
    memory_mb: float | None = None
    host: HostCopy | None = None    # the kept host copy of a torch service's weights
    host_note: str | None = None     # why its host copy is not pinned
    slot: Slot | None = None         # device reserved for / holding the service
    held_mb: float = 0.0             # what it counts against ``slot`` (the whole budget for whole_device)
    resident: bool = False           # weights are on ``slot`` now
    busy: bool = False               # a thread is loading, moving or scoring it
    doomed: bool = False             # chosen for eviction: no new batch starts until it is evicted
    preload: bool = False
    fill: bool = False               # the preload of a worker's start: resident only where it fits as is
    queue: deque = field(default_factory=deque)
    queued_items: int = 0
    last_used: float = 0.0
    last_load_s: float = 0.0         # reported with the first batch scored after a load
    counters: Counters = field(default_factory=Counters)

    def move_estimate_s(self, slot: Slot | None = None) -> float | None:
        """Seconds a host-to-device move takes: measured, else its bytes over the device's bandwidth."""
        c = self.counters
        if c.loads:
            return c.load_s / c.loads
        bw = slot.bandwidth() if slot is not None else None
        if bw and self.memory_mb is not None:
            return self.memory_mb * 2**20 / bw
        return None

    def load_estimate_s(self, slot: Slot | None = None) -> float | None:
        """Expected seconds to make the service resident now (None: nothing to go by)."""
        c = self.counters
        if self.resident:
            return 0.0
        move = self.move_estimate_s(slot or self.slot)
        if self.model is not None:
            return move
        cold = c.cold_load_s / c.cold_loads if c.cold_loads else None
        if cold is None:
            return None
        return cold + (move or 0.0)

    def evict_estimate_s(self) -> float:
        c = self.counters
        return c.evict_s / c.evictions if c.evictions else 0.0

    def as_resident(self, now: float) -> Resident:
        """How the shared eviction rule sees it."""
        return Resident(self.spec.name, self.held_mb, self.queued_items, now - self.last_used,
                        self.move_estimate_s() or 0.0, self.evict_estimate_s())

    def rank(self) -> float:
        """When its queue should be served: a service that must be loaded first ranks as if its
        requests came later by its load time, so its queue grows meanwhile, each swap serves a
        larger batch and two services that cannot share a device do not trade places on every
        request.  A preload without requests ranks after every request."""
        if not self.queue:
            return math.inf
        penalty = 0.0 if self.resident else (self.load_estimate_s() or 0.0)
        return self.queue[0].submitted + penalty

    def report(self, slot: Slot) -> dict:
        """Its figures for ``stats()`` (``slot``: where a load estimate takes the bandwidth from)."""
        c = self.counters
        return {
            "resident": self.resident,
            "device": self.slot.device.name if self.resident and self.slot else None,
            "in_host_ram": self.model is not None,
            "memory_mb": self.memory_mb,
            "device_mb_measured": c.device_mb_measured,
            "cold_loads": c.cold_loads,
            "cold_load_s_mean": c.cold_load_s / c.cold_loads if c.cold_loads else None,
            "loads": c.loads,
            "load_s_mean": c.load_s / c.loads if c.loads else None,
            "evictions": c.evictions,
            "evict_s_mean": c.evict_s / c.evictions if c.evictions else None,
            "load_estimate_s": self.load_estimate_s(slot),
            "load_bytes": c.load_bytes,
            "load_gbps": c.load_bytes / c.load_s / 1e9 if c.load_s > 0 else None,
            "oom_retries": c.oom_retries,
            "host_memory": None if self.host is None else ("pinned" if self.host.pinned else "pageable"),
            "host_note": self.host_note,
            "whole_device": self.spec.whole_device,
            "batches": c.batches,
            "actions": c.actions,
            "items": c.items,
            "mean_batch_size": c.items / c.batches if c.batches else None,
            "mean_batch_actions": c.actions / c.batches if c.batches else None,
            "failed_batches": c.failed_batches,
            "failed_actions": c.failed_actions,
            "pending": self.queued_items,
        }

    def take_queue(self) -> list[Request]:
        failed = list(self.queue)
        self.queue.clear()
        self.queued_items = 0
        return failed

    def claim_batch(self) -> list[Request]:
        batch: list[Request] = []
        items = 0
        while self.queue and (not batch or items + len(self.queue[0].inputs) <= self.spec.max_batch):
            req = self.queue.popleft()
            batch.append(req)
            items += len(req.inputs)
        self.queued_items -= items
        self.busy = True
        return batch


@dataclass(slots=True)
class Job:
    kind: str                      # "host_load" | "place" | "score"
    service: Service
    victims: list[Service] = field(default_factory=list)
    batch: list[Request] = field(default_factory=list)
    load_s: float = 0.0            # the load that made the service resident, for the first batch after it


def call_score(svc: Service, inputs: list) -> tuple[list, str | None]:
    """``score(inputs)`` as a list of one plain result per input, or why it is not one."""
    try:
        outputs = as_list(svc.model.score(inputs))
        if len(outputs) != len(inputs):
            raise ValueError(f"score() returned {len(outputs)} results for {len(inputs)} inputs")
        return outputs, None
    except Exception as e:
        return [], describe(e)


def as_list(out: Any) -> list:
    """Scores as plain Python values (msgpack-ready): numpy/torch arrays become lists.

    Raises ValueError for what is not one result per input: a string, bytes, a map or a set
    (``list()`` would split a string into letters and a map into its keys), or a NaN or
    infinite score, which would poison a training step without a word.
    """
    if hasattr(out, "tolist") and not isinstance(out, list):
        out = out.tolist()
    if isinstance(out, (str, bytes, dict, set, frozenset)) or not hasattr(out, "__iter__"):
        raise ValueError(f"score() must return a list of one result per input, not {type(out).__name__}")
    out = [x.item() if hasattr(x, "item") and not isinstance(x, (str, bytes, dict, list)) else x for x in out]
    for i, x in enumerate(out):
        if isinstance(x, float) and not math.isfinite(x):
            raise ValueError(f"score() returned {x} for input {i}")
    return out


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def deliver(req: Request, status: str, output: Any, error: str | None, stats: dict) -> None:
    # A broken callback must not kill the scoring thread serving everyone else, nor lose the
    # outcome in silence: it is logged, and the caller gets an error outcome in its place.
    try:
        req.callback(req.action_id, status, output, error, stats)
        return
    except Exception as e:
        _log.exception("service manager: the result callback of action %s raised on its %s outcome",
                       req.action_id, status)
        why = f"the result callback raised {describe(e)} on the {status} outcome"
    try:
        req.callback(req.action_id, Status.ERROR, None, why, stats)
    except Exception:
        _log.exception("service manager: the result callback of action %s raised again; its outcome is lost",
                       req.action_id)
