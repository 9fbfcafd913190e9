"""Host copies, pinned memory, free-memory budgets, out-of-memory retry and several devices.

torch models on the CPU exercise the real host-copy path (chunked copies,
eviction without copying back); a fake device object stands in for CUDA where
the logic needs one (pinning, free memory read from the card, out-of-memory
errors, several GPUs), so all of it runs without a GPU.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref

import pytest

torch = pytest.importorskip("torch")

from tangram_hpc.actions import Status  # noqa: E402
from tangram_hpc.managers import weights  # noqa: E402
from tangram_hpc.managers.devices import Device, DeviceOps  # noqa: E402
from tangram_hpc.managers.service_spec import ServiceSpec  # noqa: E402
from tangram_hpc.managers.services import ServiceManager  # noqa: E402

from test_services import WAIT_S, Results  # noqa: E402

MB = 2**20
#: The device the tests with real torch models use: ``cuda`` where scripts/gpu-check.sh runs them.
ON_CUDA = os.environ.get("TANGRAM_TEST_DEVICE", "cpu") == "cuda"


def real_device(budget_mb: float) -> Device:
    return Device("cuda:0", budget_mb, "0") if ON_CUDA else Device("cpu", budget_mb)


class Linear(torch.nn.Module):
    """A scorer with real weights: ``size_mb`` of float32, score = a fixed projection of the input."""

    def __init__(self, size_mb: float = 1.0, seed: int = 0, mutable: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        n = int(size_mb * MB) // 4
        self.w = torch.nn.Parameter(torch.randn(n, generator=g), requires_grad=False)
        self.register_buffer("calls", torch.zeros(1))
        self.mutable_state = mutable
        self.entered = threading.Event()
        self.release: threading.Event | None = None

    def score(self, inputs):
        self.entered.set()
        if self.release is not None:
            assert self.release.wait(WAIT_S)
        self.calls += 1     # device state the model changes (kept only when it says so)
        return [float(self.w[int(x) % self.w.numel()]) for x in inputs]


class FakeOOM(RuntimeError):
    pass


class FakeGPU(DeviceOps):
    """CUDA as the manager sees it, on the CPU: ``cuda:i`` devices of ``total_mb`` each, memory that
    other processes hold (``others_mb``), tensors counted until they are freed, scripted failures."""

    def __init__(self, total_mb: float = 100.0, others_mb: float = 0.0, pin_fails: bool = False) -> None:
        self.total_mb = total_mb
        self.others_mb = others_mb
        self.pin_fails = pin_fails
        self.allocated = {}
        self.oom_next = 0           # fail this many allocations with an out-of-memory error
        self.grab_mb = 0.0          # another process takes this much at the next allocation
        self.pinned: list[int] = []
        self.gate: threading.Event | None = None   # holds every load while set to an unset event
        self.loading = threading.Event()
        self._lock = threading.Lock()

    def bind_thread(self, device):
        pass

    def can_pin(self):
        return True

    def pin(self, tensor):
        if self.pin_fails:
            raise RuntimeError("cudaHostRegister failed with CUDA error 2")
        self.pinned.append(tensor.numel() * tensor.element_size())
        return tensor

    def unpin(self, tensor):
        self.pinned.remove(tensor.numel() * tensor.element_size())

    def empty_like(self, tensor, device):
        self.loading.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self.others_mb += self.grab_mb
            self.grab_mb = 0.0
            if self.oom_next:
                self.oom_next -= 1
                raise FakeOOM("CUDA out of memory. Tried to allocate 4.00 MiB")
            if self._used(device.name) + nbytes / MB > self.total_mb - self.others_mb:
                raise FakeOOM(f"CUDA out of memory. Tried to allocate {nbytes / MB:.2f} MiB")
            self.allocated[device.name] = self.allocated.get(device.name, 0) + nbytes
        t = torch.empty_like(tensor)
        weakref.finalize(t, self._free, device.name, nbytes)
        return t

    def _free(self, name, nbytes):
        with self._lock:
            self.allocated[name] -= nbytes

    def _used(self, name):
        return self.allocated.get(name, 0) / MB

    def load_stream(self, device):
        return None

    def free_mb(self, device):
        with self._lock:
            return self.total_mb - self.others_mb - self._used(device.name)

    def allocated_mb(self, device):
        with self._lock:
            return self._used(device.name)

    def release_cache(self, device):
        pass

    def is_out_of_memory(self, exc):
        return isinstance(exc, FakeOOM)


def gpus(n: int = 1, budget_mb: float = 90.0, headroom_mb: float = 10.0) -> list[Device]:
    return [Device(f"cuda:{i}", budget_mb, str(i), headroom_mb) for i in range(n)]


def spec(name: str, size_mb: float, seed: int = 0, mutable: bool = False, **kw) -> ServiceSpec:
    return ServiceSpec(name, lambda: Linear(size_mb, seed, mutable), memory_mb=size_mb,
                       max_batch=8, max_wait_ms=1, **kw)


def wait_until(predicate) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, "the state waited for never came"
        time.sleep(0.005)


def score(mgr: ServiceManager, results: Results, aid: str, service: str, inputs=(1, 2, 3)) -> tuple:
    mgr.submit(aid, service, list(inputs), results)
    results.wait(len(results.by_id) + 1)
    return results.by_id[aid]


def test_eviction_drops_the_device_copy_and_a_restore_copies_the_kept_host_copy(monkeypatch):
    # Chunked copies: make a 3 MB tensor take several chunks.
    monkeypatch.setattr(weights, "CHUNK_BYTES", 256 * 1024)
    results = Results()
    expected = Linear(3, seed=1).score([1, 2, 3])
    with ServiceManager([spec("a", 3, seed=1), spec("b", 3, seed=2)], [real_device(4)]) as mgr:
        first = score(mgr, results, "a1", "a")
        model = mgr._services["a"].model
        host_ptr = mgr._services["a"].host.host[0].data_ptr()
        assert model.w.data_ptr() != host_ptr              # resident: a copy of its own
        score(mgr, results, "b1", "b")                     # evicts a (4 MB budget)
        assert mgr.resident() == {"b"}
        assert model.w.data_ptr() == host_ptr              # back on the kept host copy, not a new one
        again = score(mgr, results, "a2", "a")
        stats = mgr.stats()["a"]
    assert first[:3] == again[:3] == (Status.OK, expected, None)
    assert stats["loads"] == 2 and stats["evictions"] == 1 and stats["cold_loads"] == 1
    assert stats["load_bytes"] == 2 * 3 * MB + 2 * 4          # the weights and the 1-float buffer, twice
    if ON_CUDA:
        assert stats["host_memory"] == "pinned" and model.w.is_cuda
        assert stats["device_mb_measured"] == pytest.approx(3, abs=0.01)
    else:
        assert stats["host_memory"] == "pageable" and "no CUDA" in stats["host_note"]
    # The device state it changed (a call counter) was not copied back: it declared none.
    assert float(model.calls) == 1


def test_a_service_with_mutable_device_state_is_copied_back_at_eviction():
    results = Results()
    with ServiceManager([spec("m", 3, mutable=True), spec("b", 3)], [real_device(4)]) as mgr:
        score(mgr, results, "m1", "m")
        score(mgr, results, "b1", "b")
        score(mgr, results, "m2", "m")
        model = mgr._services["m"].model
        assert mgr.stats()["m"]["evictions"] == 1
    assert float(model.calls) == 2


def test_pinned_memory_is_capped_per_worker_and_beyond_it_services_stay_pageable(caplog):
    ops = FakeGPU()
    caplog.set_level(logging.WARNING, "tangram_hpc.managers.services")
    results = Results()
    with ServiceManager([spec("a", 3), spec("b", 3)], gpus(), pinned_mb=4, ops=ops) as mgr:
        assert score(mgr, results, "a", "a")[0] == Status.OK
        assert score(mgr, results, "b", "b")[0] == Status.OK
        stats = mgr.stats()
        assert mgr.pinned_mb() == pytest.approx(3, abs=0.01)
        assert sum(ops.pinned) == pytest.approx(3 * MB, abs=8)
    assert stats["a"]["host_memory"] == "pinned" and stats["a"]["host_note"] is None
    assert stats["b"]["host_memory"] == "pageable"
    assert "pinned cap of 4 MB" in stats["b"]["host_note"]
    assert "service b: its host copy is pageable" in caplog.text
    # Closing the manager unpins what it pinned.
    assert mgr.pinned_mb() == 0 and ops.pinned == []


def test_a_failed_pin_falls_back_to_pageable_and_says_so():
    results = Results()
    with ServiceManager([spec("a", 3)], gpus(), pinned_mb=64, ops=FakeGPU(pin_fails=True)) as mgr:
        assert score(mgr, results, "a", "a")[0] == Status.OK
        stats = mgr.stats()["a"]
        assert mgr.pinned_mb() == 0
    assert stats["host_memory"] == "pageable" and "pinning failed" in stats["host_note"]


def test_the_budget_is_what_the_card_has_free_and_memory_of_others_is_never_assumed():
    # A 100 MB card, 10 MB headroom, 45 MB held by another process: 45 MB for the services.
    ops = FakeGPU(total_mb=100, others_mb=45)
    results = Results()
    specs = [spec("a", 20), spec("b", 20), spec("c", 20), spec("huge", 60)]
    with ServiceManager(specs, gpus(budget_mb=90, headroom_mb=10), ops=ops) as mgr:
        for name in "abc":
            assert score(mgr, results, name, name)[0] == Status.OK
        # c could not fit beside a and b in what is free: one was evicted first, no OOM.
        assert len(mgr.resident()) == 2
        assert sum(s["evictions"] for s in mgr.stats().values()) == 1
        status, _, error = score(mgr, results, "h", "huge")[:3]
        assert status == Status.ERROR
        assert "held by other processes" in error and "needs 60 MB on cuda:0" in error
        # The other process ends: the same call succeeds.
        ops.others_mb = 0
        assert score(mgr, results, "h2", "huge")[0] == Status.OK
        assert mgr.stats()["huge"]["oom_retries"] == 0


def test_an_out_of_memory_load_evicts_by_the_shared_rule_and_retries_once():
    ops = FakeGPU(total_mb=100)
    results = Results()
    with ServiceManager([spec("a", 30), spec("b", 30)], gpus(), ops=ops) as mgr:
        assert score(mgr, results, "a", "a")[0] == Status.OK
        ops.grab_mb = 45        # taken by another process after the budget was read
        assert score(mgr, results, "b", "b")[0] == Status.OK
        stats = mgr.stats()
        assert stats["b"]["oom_retries"] == 1
        assert mgr.resident() == {"b"} and stats["a"]["evictions"] == 1
        ops.oom_next = 2        # fails again after the retry: the call fails, the worker serves on
        status, _, error = score(mgr, results, "a2", "a")[:3]
        assert status == Status.ERROR and "out of memory" in error
        assert score(mgr, results, "b2", "b")[0] == Status.OK


def test_services_go_to_the_gpu_with_room_and_report_per_gpu():
    ops = FakeGPU(total_mb=100)
    results = Results()
    specs = [spec("a", 50), spec("b", 50), spec("w", 10, whole_device=True)]
    with ServiceManager(specs, gpus(2), ops=ops) as mgr:
        assert score(mgr, results, "a", "a")[0] == Status.OK
        assert score(mgr, results, "b", "b")[0] == Status.OK
        by_device = {d["device"]: d for d in mgr.device_stats()}
        assert by_device["cuda:0"]["resident"] != by_device["cuda:1"]["resident"]
        assert {d["used_mb"] for d in by_device.values()} == {50}
        assert by_device["cuda:0"]["free_mb"] == pytest.approx(50, abs=0.01)
        # A whole-device service takes a GPU alone: what was there is evicted.
        status, _, _, stats = score(mgr, results, "w", "w")
        assert status == Status.OK
        alone = [d for d in mgr.device_stats() if d["resident"] == ["w"]]
        assert len(alone) == 1 and alone[0]["used_mb"] == 90
        assert len(mgr.resident()) == 2


def test_resident_services_keep_scoring_while_another_loads():
    ops = FakeGPU(total_mb=100)
    results = Results()
    with ServiceManager([spec("a", 10), spec("b", 10)], gpus(), ops=ops) as mgr:
        assert score(mgr, results, "a1", "a")[0] == Status.OK
        ops.gate = threading.Event()
        ops.loading.clear()
        mgr.submit("b1", "b", [1], results)
        assert ops.loading.wait(WAIT_S)        # b's load is under way and held
        assert score(mgr, results, "a2", "a")[0] == Status.OK
        assert "b1" not in results.by_id
        ops.gate.set()
        results.wait(3)
        assert results.by_id["b1"][0] == Status.OK


def test_an_eviction_waits_for_the_running_batch_of_its_victim():
    results = Results()
    models: dict[str, Linear] = {}

    def loader(name):
        def load():
            models[name] = Linear(3, seed=len(models))
            return models[name]
        return load

    specs = [ServiceSpec(n, loader(n), memory_mb=3, max_batch=8, max_wait_ms=1) for n in "ab"]
    with ServiceManager(specs, [real_device(4)]) as mgr:
        assert score(mgr, results, "a1", "a")[0] == Status.OK
        models["a"].release = threading.Event()
        models["a"].entered.clear()
        mgr.submit("a2", "a", [5], results)
        assert models["a"].entered.wait(WAIT_S)     # a's batch is running
        mgr.submit("b1", "b", [1], results)
        # b needs a's room; a's running batch is not stopped: b waits for it.
        wait_until(lambda: mgr._services["a"].doomed)
        assert mgr.resident() == {"a"} and "a2" not in results.by_id
        models["a"].release.set()
        results.wait(3)
        assert results.by_id["a2"][0] == Status.OK and results.by_id["b1"][0] == Status.OK
        assert mgr.resident() == {"b"}


def test_preload_starts_a_load_before_any_call_and_evicts_only_services_without_demand():
    ops = FakeGPU(total_mb=100)
    results = Results()
    with ServiceManager([spec("a", 50), spec("b", 50)], gpus(), ops=ops) as mgr:
        assert score(mgr, results, "a1", "a")[0] == Status.OK
        mgr.preload(["b"])
        wait_until(lambda: "b" in mgr.resident())
        assert mgr.resident() == {"b"}          # a had nothing queued: it made room
        stats = mgr.stats()
        assert stats["b"]["loads"] == 1 and stats["b"]["batches"] == 0
        status, _, _, batch = score(mgr, results, "b1", "b")
        assert status == Status.OK and batch["load_s"] == 0.0


class OneCardHeld(FakeGPU):
    """Two cards, the first nearly all held by another process, the second a little."""

    def free_mb(self, device):
        return super().free_mb(device) - (80 if device.name == "cuda:0" else 15)


def test_a_service_that_fits_on_no_card_beside_others_fails_clearly_and_one_that_fits_elsewhere_waits():
    ops = OneCardHeld(total_mb=100)
    results = Results()
    specs = [spec("a", 40), spec("b", 40), spec("c", 40), spec("huge", 85)]
    with ServiceManager(specs, gpus(2), ops=ops) as mgr:
        # cuda:0 has 10 MB for services, cuda:1 75 MB: everything goes to cuda:1, one at a time;
        # huge is within the budget (90 MB) but fits beside the other process on neither card.
        for name in "abc":
            status, _, error, stats = score(mgr, results, name, name)
            assert status == Status.OK, error
            assert stats["device"] == "cuda:1"
        status, _, error, _ = score(mgr, results, "h", "huge")
        assert status == Status.ERROR and "held by other processes" in error


def test_a_start_preload_fills_free_memory_in_order_and_keeps_the_rest_in_host_ram():
    ops = FakeGPU(total_mb=100)
    with ServiceManager([spec("a", 40), spec("b", 40), spec("c", 40)], gpus(), ops=ops) as mgr:
        mgr.preload()
        wait_until(lambda: mgr.stats()["c"]["in_host_ram"] and mgr.resident() == {"a", "b"})
        stats = mgr.stats()
        # what the scheduler counts a new worker as starting with: the declared order, while it fits
        assert sum(s["evictions"] for s in stats.values()) == 0 and not stats["c"]["resident"]


def test_a_prefetch_evicts_an_idle_resident_rather_than_wait_for_a_busy_ones_batch():
    results = Results()
    models: dict[str, Linear] = {}

    def loader(name):
        def load():
            models[name] = Linear(3, seed=len(models))
            return models[name]
        return load

    specs = [ServiceSpec(n, loader(n), memory_mb=3, max_batch=8, max_wait_ms=1) for n in "abc"]
    with ServiceManager(specs, [real_device(7)]) as mgr:
        for n in "ab":
            assert score(mgr, results, f"{n}1", n)[0] == Status.OK
        with mgr._cv:               # a costly to reload: by the eviction value alone, b (busy) would go
            mgr._services["a"].counters.load_s = 1e3
        models["b"].release = threading.Event()
        models["b"].entered.clear()
        mgr.submit("b2", "b", [5], results)
        assert models["b"].entered.wait(WAIT_S)     # b's batch is running; a is idle
        mgr.preload(["c"])
        wait_until(lambda: "c" in mgr.resident())
        assert mgr.resident() == {"b", "c"} and "b2" not in results.by_id
        models["b"].release.set()
        results.wait(3)
        assert results.by_id["b2"][0] == Status.OK
