"""Moving a reward-model service's weights: loading it into host RAM, making it resident on a
device (evicting others, retrying once after an out-of-memory error), and evicting it.

:class:`ServiceMoves` is the part of :class:`~tangram_hpc.managers.services.ServiceManager` that its
loading threads run outside the manager's lock: the manager picks a job under the lock (what to
load, where, what to evict) and hands it here; these methods take the lock only to record what they
did.  They share the manager's records (services, device slots), its condition variable, its device
calls and its pinned-memory budget.
"""
from __future__ import annotations

import logging
import threading
import time

from ..actions import Status
from ..policy.residency import choose_victims
from .devices import HOST, DeviceOps
from .service_spec import ServiceSpecError
from .service_state import Job, Service, Slot, deliver, describe
from .weights import HostCopy, PinnedBudget, torch_weights

__all__ = ["ServiceMoves"]

_log = logging.getLogger("tangram_hpc.managers.services")


class ServiceMoves:
    """Host loads, placements and evictions of one manager's services (see the module docstring)."""

    def __init__(self, services: dict[str, Service], slots: list[Slot], cv: threading.Condition, ops: DeviceOps,
                 pinned: PinnedBudget) -> None:
        self._services = services
        self._slots = slots
        self._cv = cv
        self._ops = ops
        self._pinned = pinned

    def host_load(self, svc: Service) -> None:
        """Load a service into host RAM only: one whose size is not declared, to learn its size, or one
        a worker's start preloads that does not fit on a device beside the others."""
        error = None
        try:
            self.cold_load(svc)
        except Exception as e:
            error = f"service {svc.spec.name} failed to load: {describe(e)}"
            _log.warning("%s (the next request for it tries again)", error)
        with self._cv:
            svc.busy = False
            if error:
                svc.preload = False     # tried once: a request retries it, not this thread in a loop
            failed = svc.take_queue() if error else []
            self._cv.notify_all()
        for r in failed:
            deliver(r, Status.ERROR, None, error, {"service": svc.spec.name})

    def cold_load(self, svc: Service) -> None:
        """Call the loader, then keep a torch model's weights as a host copy (pinned when allowed)."""
        t0 = time.perf_counter()
        model = svc.spec.load()
        memory = svc.memory_mb
        if memory is None:
            reported = getattr(model, "memory_mb", None)
            memory = float(reported()) if callable(reported) else None
            if memory is None or memory != memory or memory < 0:
                raise ServiceSpecError(
                    f"service {svc.spec.name}: declare memory_mb (its model has no memory_mb())")
        module = torch_weights(model)
        # Asked now, not at start: torch may have been imported by this very loader.
        pin = module is not None and any(s.device.is_gpu for s in self._slots) and self._ops.can_pin()
        host = None if module is None else HostCopy(module, self._ops, self._pinned, pin=pin)
        if host is not None and host.note and pin:
            _log.warning("service %s: its host copy is %s", svc.spec.name, host.note)
        dt = time.perf_counter() - t0
        with self._cv:
            svc.model = model
            svc.host = host
            svc.host_note = host.note if host is not None else None
            svc.memory_mb = memory
            svc.counters.cold_loads += 1
            svc.counters.cold_load_s += dt

    def place(self, slot: Slot, job: Job) -> None:
        """Evict the victims, make the service resident; after an out-of-memory error, evict by the
        shared rule what the card's free memory says is missing and try once more."""
        svc = job.service
        t0 = time.perf_counter()
        for victim in job.victims:
            self._evict(slot, victim)
        error = None
        try:
            if svc.model is None:
                self.cold_load(svc)
            oom = False
            try:
                self._move(slot, svc)
            except Exception as e:
                if not self._ops.is_out_of_memory(e):
                    raise
                oom = True
            # Retried outside the handler: its traceback would keep the partial copy's tensors alive.
            if oom:
                self._evict_after_oom(slot, svc)
                self._move(slot, svc)
        except Exception as e:
            error = f"service {svc.spec.name} could not be made resident on {slot.device.name}: {describe(e)}"
            _log.warning("%s (the next request for it tries again)", error)
        load_s = time.perf_counter() - t0
        with self._cv:
            svc.busy = False
            if error is not None:
                slot.used_mb -= svc.held_mb
                svc.held_mb = 0.0
                svc.slot = None
                svc.preload = False
                failed = svc.take_queue()
            else:
                svc.resident = True
                svc.preload = False
                svc.last_used = time.monotonic()
                svc.last_load_s = load_s if svc.queue else 0.0   # a preload made no call wait
                failed = []
            self._cv.notify_all()
        for r in failed:
            deliver(r, Status.ERROR, None, error, {"service": svc.spec.name})

    def _evict_after_oom(self, slot: Slot, svc: Service) -> None:
        """Free what the failed load of ``svc`` lacked, by the card's free memory read again."""
        self._ops.release_cache(slot.device)
        with self._cv:
            svc.counters.oom_retries += 1
            free = self._ops.free_mb(slot.device)
            if free is None:
                free = slot.free_mb + svc.held_mb
            idle = [s for s in self._services.values()
                    if s.resident and s.slot is slot and not s.busy and not s.doomed]
            names = choose_victims([s.as_resident(time.monotonic()) for s in idle], svc.held_mb, free)
            if names is None:   # even all of them would not do: evict them all for the one retry
                names = [s.spec.name for s in idle]
            victims = [self._services[n] for n in names]
            for v in victims:
                v.busy = True
                slot.used_mb -= v.held_mb
        for v in victims:
            self._evict(slot, v)
        _log.warning("service %s: out of memory on %s; evicted %s and tried once more", svc.spec.name,
                     slot.device.name, ", ".join(names) or "nothing")

    def _move(self, slot: Slot, svc: Service) -> None:
        device = slot.device
        before = self._ops.allocated_mb(device)
        t0 = time.perf_counter()
        if svc.host is not None:
            svc.host.load(device)
            nbytes = svc.host.nbytes
        else:
            to = getattr(svc.model, "to", None)
            if callable(to):
                moved = to(device.name)
                # torch modules return themselves; a wrapper may return a new object.
                if moved is not None and callable(getattr(moved, "score", None)):
                    svc.model = moved
            nbytes = int((svc.memory_mb or 0.0) * 2**20)
        dt = time.perf_counter() - t0
        after = self._ops.allocated_mb(device)
        with self._cv:
            c = svc.counters
            c.loads += 1
            c.load_s += dt
            c.load_bytes += nbytes
            slot.load_bytes += nbytes
            slot.load_s += dt
            if before is not None and after is not None:
                c.device_mb_measured = after - before

    def _evict(self, slot: Slot, victim: Service) -> None:
        """Take ``victim`` off ``slot``: drop its device tensors (a host copy keeps its weights), or
        move a model without one back with ``to("cpu")``."""
        t0 = time.perf_counter()
        broken = False
        try:
            if victim.host is not None:
                victim.host.drop(copy_back=getattr(victim.model, "mutable_state", False) is True)
            else:
                to = getattr(victim.model, "to", None)
                if callable(to):
                    moved = to(HOST)
                    if moved is not None and callable(getattr(moved, "score", None)):
                        victim.model = moved
                self._ops.release_cache(slot.device)
        except Exception:
            # Its weights are in an unknown state: forget them, the next use reloads.
            _log.exception("service %s: eviction from %s failed; it will be loaded again",
                           victim.spec.name, slot.device.name)
            broken = True
        finally:
            dt = time.perf_counter() - t0
            with self._cv:
                if broken:
                    if victim.host is not None:
                        victim.host.release()
                    victim.model = None
                    victim.host = None
                victim.resident = False
                victim.slot = None
                victim.held_mb = 0.0
                victim.busy = False
                victim.doomed = False
                victim.counters.evictions += 1
                victim.counters.evict_s += dt
                self._cv.notify_all()
