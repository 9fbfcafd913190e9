"""Reward-model services on a GPU worker: host-RAM cache, device residency, dynamic batching.

The worker's event loop calls :meth:`ServiceManager.submit` (never blocks)
and gets each action's outcome through its ``done_callback``, called from a
scoring thread.  There is one scoring thread per device; it picks the next
batch, makes its service resident (evicting others when the device is full),
scores the batch in one ``score`` call and hands each action its own slice.

Lifecycle of a service:  not loaded -> (loader) host RAM -> (``to(device)``)
resident on one device -> (``to("cpu")``, under memory pressure) host RAM ->
resident again when next needed.  Loaded weights are never dropped from host
RAM, so a restore costs one host-to-device copy, not a reload from disk.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..actions import Status
from .devices import HOST, Device, bind_thread, discover_devices, release_device_cache
from ..policy.residency import Resident, choose_victims
from .service_spec import ServiceSpec, ServiceSpecError

__all__ = ["ServiceManager", "DoneCallback"]

_log = logging.getLogger(__name__)

#: ``done_callback(action_id, status, output, error, stats)``; ``output`` is
#: the list of scores for the action's inputs (status ok), ``error`` a message
#: otherwise; ``stats`` a small dict about the batch that scored it.
DoneCallback = Callable[[str, str, Any, "str | None", dict], None]


@dataclass(slots=True)
class _Request:
    action_id: str
    inputs: list
    callback: DoneCallback
    submitted: float


@dataclass(slots=True)
class _Counters:
    cold_loads: int = 0
    cold_load_s: float = 0.0
    loads: int = 0
    load_s: float = 0.0
    evictions: int = 0
    evict_s: float = 0.0
    batches: int = 0
    items: int = 0
    actions: int = 0
    failed_batches: int = 0
    failed_actions: int = 0
    device_mb_measured: float | None = None


@dataclass(slots=True, eq=False)
class _Slot:
    """A device and the bookkeeping of what occupies it (guarded by the manager lock)."""

    device: Device
    used_mb: float = 0.0
    idle: bool = False
    error: str | None = None

    @property
    def free_mb(self) -> float:
        return self.device.memory_mb - self.used_mb


@dataclass(slots=True, eq=False)
class _Service:
    spec: ServiceSpec
    model: Any = None
    memory_mb: float | None = None
    slot: _Slot | None = None      # device reserved for / holding the service
    resident: bool = False         # weights are on ``slot`` now
    busy: bool = False             # a scoring thread is loading, moving or scoring it
    preload: bool = False
    queue: deque = field(default_factory=deque)
    queued_items: int = 0
    last_used: float = 0.0
    counters: _Counters = field(default_factory=_Counters)

    def load_estimate_s(self) -> float | None:
        """Expected seconds to make the service resident now (None: never measured)."""
        c = self.counters
        if self.resident:
            return 0.0
        move = c.load_s / c.loads if c.loads else None
        if self.model is not None:
            return move
        cold = c.cold_load_s / c.cold_loads if c.cold_loads else None
        if cold is None:
            return None
        return cold + (move or 0.0)

    def evict_estimate_s(self) -> float:
        c = self.counters
        return c.evict_s / c.evictions if c.evictions else 0.0


@dataclass(slots=True)
class _Job:
    kind: str                      # "host_load" | "place" | "score"
    service: _Service
    victims: list[_Service] = field(default_factory=list)
    batch: list[_Request] = field(default_factory=list)


class ServiceManager:
    """Hosts named reward-model services on the worker's devices.

    ``devices``: from :func:`discover_devices` (default: discovered now).
    ``memory_budget_mb``: caps every device's budget (e.g. to share a GPU).
    ``max_batch`` / ``max_wait_s``: override every spec's batching settings
    when given.
    """

    def __init__(self, specs: Iterable[ServiceSpec], devices: list[Device] | None = None, *,
                 memory_budget_mb: float | None = None, max_batch: int | None = None,
                 max_wait_s: float | None = None) -> None:
        self._services: dict[str, _Service] = {}
        for spec in specs:
            if spec.name in self._services:
                raise ServiceSpecError(f"service {spec.name!r} declared twice")
            if max_batch is not None or max_wait_s is not None:
                spec = ServiceSpec(spec.name, spec.loader, spec.memory_mb,
                                   max_batch if max_batch is not None else spec.max_batch,
                                   max_wait_s * 1e3 if max_wait_s is not None else spec.max_wait_ms,
                                   spec.kwargs)
            self._services[spec.name] = _Service(spec, memory_mb=spec.memory_mb)
        devices = list(devices) if devices is not None else discover_devices()
        if not devices:
            raise ValueError("ServiceManager needs at least one device")
        if memory_budget_mb is not None:
            devices = [d.with_budget(min(d.memory_mb, memory_budget_mb)) for d in devices]
        self._slots = [_Slot(d) for d in devices]
        self._cv = threading.Condition(threading.Lock())
        self._closing = False
        self._threads = [threading.Thread(target=self._run_slot, args=(slot,), daemon=True,
                                          name=f"tangram-service-{slot.device.name}")
                         for slot in self._slots]
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
        req = _Request(action_id, list(inputs) if error is None else [], done_callback, time.monotonic())
        if error is None and not inputs:
            _deliver(req, Status.OK, [], None, {"service": service_name, "batch_items": 0})
            return
        if error is None:
            with self._cv:
                if self._closing:
                    error = "service manager is closed"
                else:
                    svc.queue.append(req)
                    svc.queued_items += len(inputs)
                    self._cv.notify_all()
                    return
        _deliver(req, Status.ERROR, None, error, {"service": service_name})

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
        """Ask for services to be loaded and made resident in the background (never blocks)."""
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
        """Per service: loads, evictions, mean load/evict seconds, batches, mean batch size."""
        with self._cv:
            out = {}
            for name, s in self._services.items():
                c = s.counters
                out[name] = {
                    "resident": s.resident,
                    "device": s.slot.device.name if s.resident and s.slot else None,
                    "in_host_ram": s.model is not None,
                    "memory_mb": s.memory_mb,
                    "device_mb_measured": c.device_mb_measured,
                    "cold_loads": c.cold_loads,
                    "cold_load_s_mean": c.cold_load_s / c.cold_loads if c.cold_loads else None,
                    "loads": c.loads,
                    "load_s_mean": c.load_s / c.loads if c.loads else None,
                    "evictions": c.evictions,
                    "evict_s_mean": c.evict_s / c.evictions if c.evictions else None,
                    "load_estimate_s": s.load_estimate_s(),
                    "batches": c.batches,
                    "actions": c.actions,
                    "items": c.items,
                    "mean_batch_size": c.items / c.batches if c.batches else None,
                    "mean_batch_actions": c.actions / c.batches if c.batches else None,
                    "failed_batches": c.failed_batches,
                    "failed_actions": c.failed_actions,
                    "pending": s.queued_items,
                }
            return out

    def device_stats(self) -> list[dict]:
        with self._cv:
            return [{"device": s.device.name, "physical_id": s.device.physical_id,
                     "budget_mb": s.device.memory_mb, "used_mb": s.used_mb, "error": s.error,
                     "resident": sorted(n for n, v in self._services.items() if v.resident and v.slot is s)}
                    for s in self._slots]

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the scoring threads (a batch being scored finishes); queued actions are cancelled."""
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
        for r in dropped:
            _deliver(r, Status.CANCELLED, None, "service manager closed", {})

    def __enter__(self) -> "ServiceManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- scoring threads ------------------------------------------------------
    def _run_slot(self, slot: _Slot) -> None:
        try:
            bind_thread(slot.device)
        except Exception as e:  # the device is unusable: serve nothing from it
            with self._cv:
                slot.device = slot.device.with_budget(0.0)
                slot.error = f"cannot use {slot.device.name}: {_describe(e)}"
                self._cv.notify_all()
            return
        while True:
            with self._cv:
                while True:
                    if self._closing:
                        return
                    job, wait_s, rejected = self._pick(slot)
                    if job is not None:
                        slot.idle = False
                        break
                    if rejected:
                        break
                    slot.idle = True
                    self._cv.wait(wait_s)
            for req, msg in rejected:
                _deliver(req, Status.ERROR, None, msg, {"service": None})
            if job is None:
                continue
            try:
                if job.kind == "host_load":
                    self._host_load(job.service)
                else:
                    self._place_and_score(slot, job)
            except Exception as e:  # a bug here must not leave callers waiting forever
                self._recover(job, e)

    def _recover(self, job: _Job, exc: Exception) -> None:
        _log.exception("service manager: unexpected error on %s", job.service.spec.name)
        with self._cv:
            for svc in (job.service, *job.victims):
                svc.busy = False
            self._cv.notify_all()
        msg = f"service {job.service.spec.name}: internal error: {_describe(exc)}"
        for r in job.batch:
            _deliver(r, Status.ERROR, None, msg, {"service": job.service.spec.name})

    def _pick(self, slot: _Slot) -> tuple[_Job | None, float | None, list]:
        """Choose this device's next job (lock held).  Returns (job, seconds to wait, rejected)."""
        now = time.monotonic()
        wait_s: float | None = None
        ready: list[tuple[float, _Service]] = []
        for svc in self._services.values():
            if svc.busy or (svc.slot is not None and svc.slot is not slot):
                continue
            if not svc.queue:
                if svc.preload and not svc.resident:
                    ready.append((float("-inf"), svc))
                continue
            head = svc.queue[0].submitted
            due = head + svc.spec.max_wait_ms / 1e3
            if svc.queued_items >= svc.spec.max_batch or now >= due:
                # A service that must be loaded first ranks as if its requests
                # came later by its load time: its queue grows meanwhile, so
                # each swap serves a larger batch and two services that cannot
                # share a device do not trade places on every request.
                penalty = 0.0 if svc.resident else (svc.load_estimate_s() or 0.0)
                ready.append((head + penalty, svc))
            else:
                wait_s = due - now if wait_s is None else min(wait_s, due - now)
        ready.sort(key=lambda t: t[0])
        rejected: list[tuple[_Request, str]] = []
        largest = max(s.device.memory_mb for s in self._slots)
        for _, svc in ready:
            if svc.resident:
                return self._claim_batch(svc), wait_s, rejected
            if svc.model is None and svc.memory_mb is None:
                svc.busy = True
                return _Job("host_load", svc), wait_s, rejected
            need = svc.memory_mb or 0.0
            if need > largest:
                msg = (f"service {svc.spec.name} needs {need:.0f} MB but the largest device budget "
                       f"is {largest:.0f} MB")
                rejected.extend((r, msg) for r in svc.queue)
                svc.queue.clear()
                svc.queued_items = 0
                svc.preload = False
                continue
            if need > slot.device.memory_mb:
                continue
            if slot.free_mb >= need:
                victims: list[str] | None = []
            elif any(o is not slot and o.idle and o.free_mb >= need for o in self._slots):
                continue  # an idle device has room without evicting anything
            else:
                victims = choose_victims(self._evictable(slot, now), need, slot.free_mb)
                if victims is None:
                    continue  # residents in use hold the memory; retry when they finish
            evicted = [self._services[n] for n in victims]
            for v in evicted:
                v.busy = True
                slot.used_mb -= v.memory_mb or 0.0
            slot.used_mb += need
            svc.slot = slot
            svc.busy = True
            return _Job("place", svc, victims=evicted), wait_s, rejected
        return None, wait_s, rejected

    def _evictable(self, slot: _Slot, now: float) -> list[Resident]:
        return [Resident(s.spec.name, s.memory_mb or 0.0, s.queued_items, now - s.last_used,
                         _move_estimate(s), s.evict_estimate_s())
                for s in self._services.values() if s.resident and s.slot is slot and not s.busy]

    def _claim_batch(self, svc: _Service) -> _Job:
        batch: list[_Request] = []
        items = 0
        while svc.queue and (not batch or items + len(svc.queue[0].inputs) <= svc.spec.max_batch):
            req = svc.queue.popleft()
            batch.append(req)
            items += len(req.inputs)
        svc.queued_items -= items
        svc.busy = True
        return _Job("score", svc, batch=batch)

    def _host_load(self, svc: _Service) -> None:
        """Load a service whose size is not declared, to learn its size."""
        error = None
        try:
            self._cold_load(svc)
        except Exception as e:
            error = f"service {svc.spec.name} failed to load: {_describe(e)}"
            _log.warning("%s (the next request for it tries again)", error)
        with self._cv:
            svc.busy = False
            if error:
                svc.preload = False     # tried once: a request retries it, not this thread in a loop
            failed = self._fail_queue(svc) if error else []
            self._cv.notify_all()
        for r in failed:
            _deliver(r, Status.ERROR, None, error, {"service": svc.spec.name})

    def _cold_load(self, svc: _Service) -> None:
        t0 = time.perf_counter()
        model = svc.spec.load()
        dt = time.perf_counter() - t0
        memory = svc.memory_mb
        if memory is None:
            reported = getattr(model, "memory_mb", None)
            memory = float(reported()) if callable(reported) else None
            if memory is None or memory != memory or memory < 0:
                raise ServiceSpecError(
                    f"service {svc.spec.name}: declare memory_mb (its model has no memory_mb())")
        with self._cv:
            svc.model = model
            svc.memory_mb = memory
            svc.counters.cold_loads += 1
            svc.counters.cold_load_s += dt

    def _place_and_score(self, slot: _Slot, job: _Job) -> None:
        svc = job.service
        load_s = 0.0
        if job.kind == "place":
            t0 = time.perf_counter()
            for victim in job.victims:
                self._evict(slot, victim)
            error = None
            try:
                if svc.model is None:
                    self._cold_load(svc)
                self._move(slot, svc)
            except Exception as e:
                error = f"service {svc.spec.name} could not be made resident on {slot.device.name}: {_describe(e)}"
                _log.warning("%s (the next request for it tries again)", error)
            load_s = time.perf_counter() - t0
            with self._cv:
                if error is not None:
                    slot.used_mb -= svc.memory_mb or 0.0
                    svc.slot = None
                    svc.busy = False
                    svc.preload = False
                    failed = self._fail_queue(svc)
                    self._cv.notify_all()
                else:
                    svc.resident = True
                    svc.preload = False
                    svc.last_used = time.monotonic()
                    if not svc.queue:
                        svc.busy = False
                        self._cv.notify_all()
                        return
                    job = self._claim_batch(svc)
            if error is not None:
                for r in failed:
                    _deliver(r, Status.ERROR, None, error, {"service": svc.spec.name})
                return
        self._score(slot, svc, job.batch, load_s)

    def _move(self, slot: _Slot, svc: _Service) -> None:
        to = getattr(svc.model, "to", None)
        before = _allocated_mb(slot.device)
        t0 = time.perf_counter()
        if callable(to):
            moved = to(slot.device.name)
            # torch modules return themselves; a wrapper may return a new object.
            if moved is not None and callable(getattr(moved, "score", None)):
                svc.model = moved
        dt = time.perf_counter() - t0
        after = _allocated_mb(slot.device)
        with self._cv:
            svc.counters.loads += 1
            svc.counters.load_s += dt
            if before is not None and after is not None:
                svc.counters.device_mb_measured = after - before

    def _evict(self, slot: _Slot, victim: _Service) -> None:
        t0 = time.perf_counter()
        to = getattr(victim.model, "to", None)
        broken = False
        try:
            if callable(to):
                moved = to(HOST)
                if moved is not None and callable(getattr(moved, "score", None)):
                    victim.model = moved
            release_device_cache(slot.device)
        except Exception:
            # Its weights are in an unknown state: forget them, the next use reloads.
            broken = True
        finally:
            dt = time.perf_counter() - t0
            with self._cv:
                if broken:
                    victim.model = None
                victim.resident = False
                victim.slot = None
                victim.busy = False
                victim.counters.evictions += 1
                victim.counters.evict_s += dt
                self._cv.notify_all()

    def _score(self, slot: _Slot, svc: _Service, batch: list[_Request], load_s: float) -> None:
        inputs = [x for r in batch for x in r.inputs]
        started = time.monotonic()
        outputs, error = _call_score(svc, inputs)
        alone = None
        if error is not None and len(batch) > 1:
            # One caller's malformed input must not fail the others: each action is scored alone.
            alone = [_call_score(svc, r.inputs) for r in batch]
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
                    _deliver(r, Status.OK, out, None, stats)
                else:
                    _deliver(r, Status.FAILED, None, f"service {svc.spec.name}: score failed on this action's {n} "
                             f"inputs, scored alone after its batch of {len(inputs)} failed: {err}", stats)
            elif error:
                _deliver(r, Status.FAILED, None,
                         f"service {svc.spec.name}: score failed on a batch of {len(inputs)}: {error}", stats)
            else:
                _deliver(r, Status.OK, outputs[pos:pos + n], None, stats)
            pos += n

    def _fail_queue(self, svc: _Service) -> list[_Request]:
        failed = list(svc.queue)
        svc.queue.clear()
        svc.queued_items = 0
        return failed


def _call_score(svc: _Service, inputs: list) -> tuple[list, str | None]:
    """``score(inputs)`` as a list of one plain result per input, or why it is not one."""
    try:
        outputs = _as_list(svc.model.score(inputs))
        if len(outputs) != len(inputs):
            raise ValueError(f"score() returned {len(outputs)} results for {len(inputs)} inputs")
        return outputs, None
    except Exception as e:
        return [], _describe(e)


def _move_estimate(svc: _Service) -> float:
    c = svc.counters
    return c.load_s / c.loads if c.loads else 0.0


def _as_list(out: Any) -> list:
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


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _deliver(req: _Request, status: str, output: Any, error: str | None, stats: dict) -> None:
    # A broken callback must not kill the scoring thread serving everyone else, nor lose the
    # outcome in silence: it is logged, and the caller gets an error outcome in its place.
    try:
        req.callback(req.action_id, status, output, error, stats)
        return
    except Exception as e:
        _log.exception("service manager: the result callback of action %s raised on its %s outcome",
                       req.action_id, status)
        why = f"the result callback raised {_describe(e)} on the {status} outcome"
    try:
        req.callback(req.action_id, Status.ERROR, None, why, stats)
    except Exception:
        _log.exception("service manager: the result callback of action %s raised again; its outcome is lost",
                       req.action_id)


def _allocated_mb(device: Device) -> float | None:
    if not device.is_gpu:
        return None
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return torch.cuda.memory_allocated(device.index) / 2**20
