"""Reward-model services on a GPU worker: host copies, device residency, dynamic batching.

The worker's event loop calls :meth:`ServiceManager.submit` (never blocks)
and gets each action's outcome through its ``done_callback``, called from a
scoring thread.  Each device has two threads: a *scoring* thread that picks
the next batch of a resident service and scores it in one ``score`` call, and
a *loading* thread that makes services resident (evicting others when the
device is full), so that resident services keep scoring while another loads.

Lifecycle of a service:  not loaded -> (loader) host RAM, where a torch
service's weights become a :class:`~tangram_hpc.managers.weights.HostCopy`,
pinned where the worker's pinned cap allows -> (chunked copies on the
device's load stream) resident on one device -> (eviction: the device tensors
are dropped; nothing is copied back) host RAM -> resident again when next
needed.  Loaded weights are never dropped from host RAM, so a restore costs
one host-to-device copy, not a reload from disk.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Iterable

from ..actions import Status
from ..policy.residency import choose_victims
from .devices import Device, DeviceOps, discover_devices
from .service_moves import ServiceMoves
from .service_spec import ServiceSpec, ServiceSpecError
from .service_state import DoneCallback, Job, Request, Service, Slot, call_score, deliver, describe
from .weights import PinnedBudget

__all__ = ["ServiceManager", "DoneCallback"]

_log = logging.getLogger(__name__)

#: Seconds after which a loading thread looks again at a service it left to another device.
_RECHECK_S = 0.05


class ServiceManager:
    """Hosts named reward-model services on the worker's devices.

    ``devices``: from :func:`discover_devices` (default: discovered now).
    ``memory_budget_mb``: caps every device's budget (e.g. to share a GPU).
    ``max_batch`` / ``max_wait_s``: override every spec's batching settings
    when given.  ``pinned_mb``: most pinned host memory the services' host
    copies may take (None: no cap); those beyond stay pageable.  ``ops``: the
    device memory calls (a fake in tests).
    """

    def __init__(self, specs: Iterable[ServiceSpec], devices: list[Device] | None = None, *,
                 memory_budget_mb: float | None = None, max_batch: int | None = None,
                 max_wait_s: float | None = None, pinned_mb: float | None = None,
                 ops: DeviceOps | None = None) -> None:
        self._services: dict[str, Service] = {}
        for spec in specs:
            if spec.name in self._services:
                raise ServiceSpecError(f"service {spec.name!r} declared twice")
            if max_batch is not None or max_wait_s is not None:
                spec = dataclasses.replace(
                    spec, max_batch=max_batch if max_batch is not None else spec.max_batch,
                    max_wait_ms=max_wait_s * 1e3 if max_wait_s is not None else spec.max_wait_ms)
            self._services[spec.name] = Service(spec, memory_mb=spec.memory_mb)
        devices = list(devices) if devices is not None else discover_devices()
        if not devices:
            raise ValueError("ServiceManager needs at least one device")
        if memory_budget_mb is not None:
            devices = [d.with_budget(min(d.memory_mb, memory_budget_mb)) for d in devices]
        self._ops = ops if ops is not None else DeviceOps()
        self._pinned = PinnedBudget(pinned_mb)
        self._slots = [Slot(d) for d in devices]
        self._cv = threading.Condition(threading.Lock())
        self._moves = ServiceMoves(self._services, self._slots, self._cv, self._ops, self._pinned)
        self._closing = False
        self._threads = [threading.Thread(target=self._run_slot, args=(slot, loading), daemon=True,
                                          name=f"tangram-{'loader' if loading else 'service'}-{slot.device.name}")
                         for slot in self._slots for loading in (False, True)]
        for t in self._threads:
            t.start()

    # -- API for the worker loop --------------------------------------------
    @property
    def service_names(self) -> frozenset[str]:
        return frozenset(self._services)

    @property
    def devices(self) -> list[Device]:
        return [s.device for s in self._slots]

    @property
    def closed(self) -> bool:
        return self._closing

    def capacity_mb(self) -> float:
        """Total memory budget over the devices (the worker's ``gpu_mem_mb``)."""
        return sum(s.device.memory_mb for s in self._slots)

    def submit(self, action_id: str, service_name: str, inputs: list, done_callback: DoneCallback) -> None:
        """Queue an action's inputs for scoring; never blocks.

        Rejections (unknown service, inputs not a list, manager closed) are
        reported at once through ``done_callback`` with status ``error``.
        """
        svc = self._services.get(service_name)
        error = None
        if svc is None:
            error = f"unknown service {service_name!r}; this worker serves {sorted(self._services) or 'none'}"
        elif not isinstance(inputs, (list, tuple)):
            error = f"service {service_name}: inputs must be a list, got {type(inputs).__name__}"
        req = Request(action_id, list(inputs) if error is None else [], done_callback, time.monotonic())
        if error is None and not inputs:
            deliver(req, Status.OK, [], None, {"service": service_name, "batch_items": 0})
            return
        if svc is not None and error is None:
            with self._cv:
                if self._closing:
                    error = "service manager is closed"
                else:
                    svc.queue.append(req)
                    svc.queued_items += len(inputs)
                    self._cv.notify_all()
                    return
        deliver(req, Status.ERROR, None, error, {"service": service_name})

    def cancel(self, action_id: str) -> bool:
        """Drop a queued action (no callback follows); False when it is being scored or unknown."""
        with self._cv:
            for svc in self._services.values():
                for req in svc.queue:
                    if req.action_id == action_id:
                        svc.queue.remove(req)
                        svc.queued_items -= len(req.inputs)
                        return True
        return False

    def preload(self, names: Iterable[str] | None = None) -> None:
        """Ask for services to be loaded and made resident in the background (never blocks).

        ``names``: the prefetch hook (the scheduler's PREFETCH): told what comes next, the loading
        thread starts the copy before the calls arrive, evicting only services with nothing queued
        (idle ones first: it never stops a batch being scored).  None (a worker's start): every
        service into host RAM, and resident in the order declared while they fit, evicting
        nothing -- the services the scheduler counts a new worker as starting with.
        """
        with self._cv:
            for name in (self._services if names is None else names):
                if name not in self._services:
                    raise KeyError(f"unknown service {name!r}")
                svc = self._services[name]
                svc.preload = True
                svc.fill = names is None
            self._cv.notify_all()

    def resident(self) -> frozenset[str]:
        """Services whose weights are on a device now."""
        with self._cv:
            return frozenset(n for n, s in self._services.items() if s.resident)

    def pending(self) -> dict[str, int]:
        """Queued inputs per service (not counting batches being scored)."""
        with self._cv:
            return {n: s.queued_items for n, s in self._services.items() if s.queued_items}

    def stats(self) -> dict[str, dict]:
        """Per service: loads, evictions, mean load/evict seconds, batches, mean batch size (docs/services.md)."""
        with self._cv:
            return {name: s.report(s.slot or self._slots[0]) for name, s in self._services.items()}

    def device_stats(self) -> list[dict]:
        """Per device: budget, memory the services hold, memory really free now, resident services."""
        with self._cv:
            return [s.report(self._ops.free_mb(s.device),
                             sorted(n for n, v in self._services.items() if v.resident and v.slot is s))
                    for s in self._slots]

    def pinned_mb(self) -> float:
        """Pinned host memory the services' host copies hold."""
        return self._pinned.used_bytes / 2**20

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the threads (a batch being scored finishes); queued actions are cancelled."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout)
        with self._cv:
            dropped = [r for s in self._services.values() for r in s.queue]
            for s in self._services.values():
                s.queue.clear()
                s.queued_items = 0
                if s.host is not None and not s.busy:
                    s.host.release()    # page-locked memory goes back to the node with the manager
        for r in dropped:
            deliver(r, Status.CANCELLED, None, "service manager closed", {})

    def __enter__(self) -> "ServiceManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- scoring and loading threads -----------------------------------------
    def _run_slot(self, slot: Slot, loading: bool) -> None:
        try:
            self._ops.bind_thread(slot.device)
        except Exception as e:  # the device is unusable: serve nothing from it
            with self._cv:
                slot.device = slot.device.with_budget(0.0)
                slot.error = f"cannot use {slot.device.name}: {describe(e)}"
                self._cv.notify_all()
            return
        pick = self._pick_load if loading else self._pick_score
        while True:
            with self._cv:
                while True:
                    if self._closing:
                        return
                    job, wait_s, rejected = pick(slot)
                    if job is not None or rejected:
                        break
                    self._cv.wait(wait_s)
            for req, msg in rejected:
                deliver(req, Status.ERROR, None, msg, {"service": None})
            if job is None:
                continue
            try:
                if job.kind == "host_load":
                    self._moves.host_load(job.service)
                elif job.kind == "place":
                    self._moves.place(slot, job)
                else:
                    self._score(slot, job)
            except Exception as e:  # a bug here must not leave callers waiting forever
                self._recover(job, e)

    def _recover(self, job: Job, exc: Exception) -> None:
        _log.exception("service manager: unexpected error on %s", job.service.spec.name)
        with self._cv:
            for svc in (job.service, *job.victims):
                svc.busy = False
            self._cv.notify_all()
        msg = f"service {job.service.spec.name}: internal error: {describe(exc)}"
        for r in job.batch:
            deliver(r, Status.ERROR, None, msg, {"service": job.service.spec.name})

    def _pick_score(self, slot: Slot) -> tuple[Job | None, float | None, list]:
        """The scoring thread's next batch (lock held): the resident service whose oldest request is oldest."""
        now = time.monotonic()
        wait_s: float | None = None
        best: Service | None = None
        for svc in self._services.values():
            if not svc.resident or svc.slot is not slot or svc.busy or svc.doomed or not svc.queue:
                continue
            head = svc.queue[0].submitted
            due = head + svc.spec.max_wait_ms / 1e3
            if svc.queued_items >= svc.spec.max_batch or now >= due:
                if best is None or head < best.queue[0].submitted:
                    best = svc
            else:
                wait_s = due - now if wait_s is None else min(wait_s, due - now)
        if best is None:
            return None, wait_s, []
        load_s, best.last_load_s = best.last_load_s, 0.0
        return Job("score", best, batch=best.claim_batch(), load_s=load_s), wait_s, []

    def _pick_load(self, slot: Slot) -> tuple[Job | None, float | None, list]:
        """The loading thread's next load (lock held): a service with requests or a preload, not resident.

        Placed on a device where it fits without eviction; only where none has
        room, on this device by evicting the least valuable residents (the
        shared rule, :func:`~tangram_hpc.policy.residency.choose_victims`).
        A resident is evicted only once its running batch has ended, and only
        if its own oldest request came after the newcomer's (rank).
        """
        now = time.monotonic()
        for svc in self._services.values():
            if svc.slot is slot:
                svc.doomed = False          # chosen afresh on every pass
        waiting = sorted((s for s in self._services.values()
                          if not s.busy and not s.resident and s.slot is None and (s.queue or s.preload)),
                         key=Service.rank)
        rejected: list[tuple[Request, str]] = []
        deferred: float | None = None
        largest = max(s.device.memory_mb for s in self._slots)
        for svc in waiting:
            if svc.model is None and svc.memory_mb is None:
                svc.busy = True
                return Job("host_load", svc), None, rejected
            need = svc.memory_mb or 0.0
            if need > largest:
                self._reject(svc, rejected, f"service {svc.spec.name} needs {need:.0f} MB but the largest "
                                            f"device budget is {largest:.0f} MB")
                continue
            if svc.spec.whole_device:
                need = slot.device.memory_mb
            if need > slot.device.memory_mb:
                continue
            room = self._room(slot)
            on_slot = [s for s in self._services.values() if s.resident and s.slot is slot]
            if room >= need and not (svc.spec.whole_device and on_slot):
                victims: list[Service] = []
            elif not svc.spec.whole_device and any(
                    o is not slot and self._room(o) >= need for o in self._slots):
                # Another device has room without evicting anything: its loading thread takes it.  Looked
                # at again soon all the same: free memory read from a card moves without notice.
                deferred = _RECHECK_S
                continue
            elif svc.fill and not svc.queue:
                svc.preload = svc.fill = False   # a start's preload evicts nothing: host RAM only
                if svc.model is None:
                    svc.busy = True
                    return Job("host_load", svc), None, rejected
                continue
            else:
                rank = svc.rank()
                movable = [s for s in on_slot if not s.queue or s.queue[0].submitted > rank]
                if svc.spec.whole_device:
                    names = [s.spec.name for s in movable] if len(movable) == len(on_slot) else None
                else:
                    # idle residents first: a busy one is evicted only after its batch
                    names = choose_victims([s.as_resident(now) for s in movable if not s.busy], need, room)
                    if names is None:
                        names = choose_victims([s.as_resident(now) for s in movable], need, room)
                if names is None:
                    held = sum(s.held_mb for s in on_slot)
                    if room + held < need and not self._could_fit(svc):
                        self._reject(svc, rejected, self._no_room(svc, slot, need, room, held))
                    continue  # residents in demand hold the memory; retry when that changes
                victims = [self._services[n] for n in names]
                if any(v.busy for v in victims):
                    for v in victims:
                        v.doomed = True     # no new batch for them: evicted once the running one ends
                    return None, None, rejected
            for v in victims:
                v.busy = True
                slot.used_mb -= v.held_mb
            svc.held_mb = need
            slot.used_mb += need
            svc.slot = slot
            svc.busy = True
            return Job("place", svc, victims=victims), None, rejected
        return None, deferred, rejected

    def _room(self, slot: Slot) -> float:
        """Memory a load may take on ``slot`` now without evicting: the budget left, and no more than
        the card has free beside its headroom (other processes' memory is re-read, never assumed)."""
        free = self._ops.free_mb(slot.device)
        if free is None:
            return slot.free_mb
        return min(slot.free_mb, free - slot.device.headroom_mb)

    def _could_fit(self, svc: Service) -> bool:
        """Whether some device could take ``svc`` by evicting all of this worker's services there."""
        for o in self._slots:
            need = o.device.memory_mb if svc.spec.whole_device else (svc.memory_mb or 0.0)
            held = sum(s.held_mb for s in self._services.values() if s.resident and s.slot is o)
            if need <= o.device.memory_mb and self._room(o) + held >= need:
                return True
        return False

    def _no_room(self, svc: Service, slot: Slot, need: float, room: float, held: float) -> str:
        free = self._ops.free_mb(slot.device)
        others = "" if free is None else (f"; the card has {free:.0f} MB free beside {held:.0f} MB held by this "
                                          f"worker's services and {slot.device.headroom_mb:.0f} MB of headroom, "
                                          f"the rest is held by other processes")
        return (f"service {svc.spec.name} needs {need:.0f} MB on {slot.device.name} but at most "
                f"{max(0.0, room + held):.0f} MB can be made free there{others}")

    def _reject(self, svc: Service, rejected: list, msg: str) -> None:
        rejected.extend((r, msg) for r in svc.take_queue())
        if svc.preload:
            _log.warning("%s (preload given up)", msg)
        svc.preload = False

    def _score(self, slot: Slot, job: Job) -> None:
        svc, batch, load_s = job.service, job.batch, job.load_s
        inputs = [x for r in batch for x in r.inputs]
        started = time.monotonic()
        outputs, error = call_score(svc, inputs)
        alone = None
        if error is not None and len(batch) > 1:
            # One caller's malformed input must not fail the others: each action is scored alone.
            alone = [call_score(svc, r.inputs) for r in batch]
        finished = time.monotonic()
        if alone is None:
            failed_actions = len(batch) if error else 0
        else:
            failed_actions = sum(e is not None for _, e in alone)
        with self._cv:
            svc.busy = False
            svc.last_used = finished
            c = svc.counters
            c.batches += 1 + len(alone or ())
            c.items += len(inputs)
            c.actions += len(batch)
            # score() calls that failed: the batch's, and the lone calls of the actions that failed again
            c.failed_batches += (error is not None) + (failed_actions if alone is not None else 0)
            c.failed_actions += failed_actions
            self._cv.notify_all()
        base = {"service": svc.spec.name, "device": slot.device.name, "batch_items": len(inputs),
                "batch_actions": len(batch), "score_s": finished - started, "load_s": load_s}
        pos = 0
        for k, r in enumerate(batch):
            n = len(r.inputs)
            stats = dict(base, wait_s=started - r.submitted)
            if alone is not None:
                out, err = alone[k]
                if err is None:
                    deliver(r, Status.OK, out, None, stats)
                else:
                    deliver(r, Status.FAILED, None, f"service {svc.spec.name}: score failed on this action's {n} "
                             f"inputs, scored alone after its batch of {len(inputs)} failed: {err}", stats)
            elif error:
                deliver(r, Status.FAILED, None,
                         f"service {svc.spec.name}: score failed on a batch of {len(inputs)}: {error}", stats)
            else:
                deliver(r, Status.OK, outputs[pos:pos + n], None, stats)
            pos += n
