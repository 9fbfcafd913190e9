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
from .devices import HOST, Device, DeviceOps, discover_devices
from .service_spec import ServiceSpec, ServiceSpecError
from .service_state import (DoneCallback, Job, Request, Service, Slot, call_score, deliver,
                            describe)
from .weights import HostCopy, PinnedBudget, torch_weights

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

        The prefetch hook: told what comes next (calls queued elsewhere, a burst
        of final calls predicted), the loading thread starts the copy before
        the calls arrive.  A preload evicts only services with nothing queued,
        and never waits for or stops a batch being scored.
        """
        with self._cv:
            for name in (self._services if names is None else names):
                if name not in self._services:
                    raise KeyError(f"unknown service {name!r}")
                self._services[name].preload = True
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
                    self._host_load(job.service)
                elif job.kind == "place":
                    self._place(slot, job)
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
            else:
                rank = svc.rank()
                movable = [s for s in on_slot if not s.queue or s.queue[0].submitted > rank]
                if svc.spec.whole_device:
                    names = [s.spec.name for s in movable] if len(movable) == len(on_slot) else None
                else:
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

    def _host_load(self, svc: Service) -> None:
        """Load a service whose size is not declared, to learn its size."""
        error = None
        try:
            self._cold_load(svc)
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

    def _cold_load(self, svc: Service) -> None:
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

    def _place(self, slot: Slot, job: Job) -> None:
        """Evict the victims, make the service resident; after an out-of-memory error, evict by the
        shared rule what the card's free memory says is missing and try once more."""
        svc = job.service
        t0 = time.perf_counter()
        for victim in job.victims:
            self._evict(slot, victim)
        error = None
        try:
            if svc.model is None:
                self._cold_load(svc)
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
