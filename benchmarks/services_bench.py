"""Figures for the reward-model service manager (prints them; asserts nothing).

* the MiniLM reward: cold load time into host RAM, resident memory it adds,
  host<->device move times (CPU stand-in unless a GPU is visible);
* scoring throughput through the manager with dynamic batching, against one
  action per ``score`` call.

Usage: python3 benchmarks/services_bench.py [--actions N] [--no-model]
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import psutil


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tangram_hpc.managers.devices import discover_devices
from tangram_hpc.managers.service_spec import ServiceSpec
from tangram_hpc.managers.services import ServiceManager


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def run(spec: ServiceSpec, n: int, devices) -> tuple[float, dict]:
    done = threading.Semaphore(0)

    def cb(*_):
        done.release()

    with ServiceManager([spec], devices) as mgr:
        mgr.submit("warm", spec.name, [{"response": "warm up", "reference": "warm"}], cb)
        done.acquire()
        t0 = time.perf_counter()
        for i in range(n):
            mgr.submit(str(i), spec.name, [{"response": f"answer number {i} is about cats",
                                            "reference": "the cat sat on the mat"}], cb)
        for _ in range(n):
            done.acquire()
        elapsed = time.perf_counter() - t0
        return elapsed, mgr.stats()[spec.name]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--actions", type=int, default=256)
    ap.add_argument("--no-model", action="store_true", help="skip the MiniLM figures")
    args = ap.parse_args()
    loaders = [("hashing", "tangram_hpc.managers.rewards:hashing_similarity", {"memory_mb": 16})]
    if not args.no_model:
        before = rss_mb()
        t0 = time.perf_counter()
        import torch  # noqa: F401  (its import is part of a first load on a fresh worker)
        t_torch = time.perf_counter() - t0
        from tangram_hpc.managers.rewards import minilm_similarity
        t1 = time.perf_counter()
        model = minilm_similarity()
        t_load = time.perf_counter() - t1
        after = rss_mb()
        print(f"minilm: import torch {t_torch:.2f}s; load (imports sentence-transformers + weights) "
              f"{t_load:.2f}s; weights {model.memory_mb():.1f} MB; process RSS +{after - before:.0f} MB "
              f"(to {after:.0f} MB)")
        t2 = time.perf_counter()
        model.score([{"response": "a", "reference": "b"}])
        print(f"minilm: first score {time.perf_counter() - t2:.3f}s")
        del model
        loaders.append(("minilm", "tangram_hpc.managers.rewards:minilm_similarity", {}))
    devices = discover_devices(cpu_budget_mb=2048)
    print(f"devices: {[(d.name, round(d.memory_mb)) for d in devices]}")

    for name, loader, kwargs in loaders:
        for max_batch in (1, 64):
            spec = ServiceSpec(name, loader, max_batch=max_batch, max_wait_ms=2, kwargs=kwargs)
            elapsed, st = run(spec, args.actions, devices)
            print(f"{name}: max_batch={max_batch:3d}: {args.actions / elapsed:8.1f} actions/s, "
                  f"mean batch {st['mean_batch_size']:.1f}, cold load {st['cold_load_s_mean']:.3f}s, "
                  f"move {st['load_s_mean'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
