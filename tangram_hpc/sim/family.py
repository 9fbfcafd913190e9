"""A generated family of workloads: the judge nobody tuned the policy on.

:func:`draw_family` draws ``n`` workloads from one seed across what format 2
can express: turn counts (uniform or lognormal, with caps), duration tails
and timeouts, memory peak against mean, the number, sizes and load times of
GPU services against GPU memory, batch limits and slowdowns, per-turn and
follow-up reward calls, parallel finals, per-turn barriers, cluster size,
and a load from 0.25x to 5x of the cluster's capacity (the trajectories per
step are set from it).  Each is a plain format-2 document, validated by
:func:`~tangram_hpc.sim.workload.parse_workload` like a file, and can be
written out as one (:func:`to_toml`).  The same seed draws the same family.
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from ..resources import GPU_MEMORY_SHARE
from .layout import expected_turns, service_demand
from .workload import Workload, parse_workload

__all__ = ["draw_family", "draw_document", "to_toml", "offered_load"]

#: the most trajectories per step a member has (a family of a hundred must run in minutes)
MAX_TRAJECTORIES = 400
MIN_TRAJECTORIES = 4
#: the most workers of a kind a member's cluster has
MAX_WORKERS = 32
#: load against capacity, drawn log-uniformly between these
LOAD_RANGE = (0.25, 5.0)


def _logu(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _choice(rng: np.random.Generator, options: list) -> Any:
    return options[int(rng.integers(len(options)))]


def _cluster(rng: np.random.Generator, gpu: bool) -> dict[str, Any]:
    cores = _choice(rng, [8, 16, 32, 64])
    c: dict[str, Any] = {"cpu_workers": int(rng.integers(1, 7)), "cpu_cores": cores,
                         "cpu_mem_mb": _choice(rng, [0, 32000, 96000, 256000]),
                         "startup_s": round(rng.uniform(20, 120), 1),
                         "env_move_s": round(_logu(rng, 0.5, 60.0), 2)}
    if gpu:
        gpus = _choice(rng, [1, 2, 4, 8])
        c.update(gpu_workers=int(rng.integers(1, 5)), gpus=gpus, gpu_mem_mb=_choice(rng, [24000, 40000, 81920]),
                 gpu_slots=gpus * _choice(rng, [2, 4, 8]))
    return c


def _services(rng: np.random.Generator, cluster: dict[str, Any]) -> list[dict[str, Any]]:
    budget = int(cluster["gpu_mem_mb"] * GPU_MEMORY_SHARE)
    out = []
    for k in range(int(rng.integers(1, 5))):
        batchable = bool(rng.random() < 0.85)
        s: dict[str, Any] = {"name": f"svc{k}", "gpu_mem_mb": int(budget * rng.uniform(0.05, 0.95)),
                             "load_s": round(_logu(rng, 2.0, 90.0), 1), "batchable": batchable}
        if batchable:
            s["max_batch"] = _choice(rng, [0, 1, 4, 16, 64])
            s["batch_slowdown"] = round(rng.uniform(0.0, 1.5), 2)
        out.append(s)
    return out


def _duration(rng: np.random.Generator, lo: float, hi: float) -> dict[str, float]:
    return {"median": round(_logu(rng, lo, hi), 3), "sigma": round(rng.uniform(0.0, 1.5), 2)}


def _cpu_action(rng: np.random.Generator, k: int, cluster: dict[str, Any]) -> dict[str, Any]:
    kind = "sandbox" if rng.random() < 0.7 else "function"
    mx = min(cluster["cpu_cores"], _choice(rng, [1, 2, 4, 8]))
    mn = min(mx, _choice(rng, [1, 1, 2]))
    dur = _duration(rng, 0.05, 60.0)
    a: dict[str, Any] = {"name": f"act{k}", "kind": kind, "weight": round(rng.uniform(0.1, 1.0), 2),
                         "duration_s": dur, "parallel_fraction": round(rng.uniform(0.0, 0.95), 2),
                         "min_cores": mn, "max_cores": mx}
    cap = cluster["cpu_mem_mb"] or 48000
    peak = int(min(cap, _logu(rng, 250, 48000)))
    if rng.random() < 0.6:
        a["mem_mb"] = {"peak": peak, "mean": int(peak * rng.uniform(0.2, 1.0))}
    if rng.random() < 0.3:       # a long tail cut by a timeout
        a["timeout_s"] = round(dur["median"] * rng.uniform(3.0, 10.0), 2)
    if rng.random() < 0.5:
        a["hint"] = True
        a["hint_sigma"] = round(rng.uniform(0.0, 1.0), 2)
    return a


def _reward_actions(rng: np.random.Generator, services: list[dict[str, Any]], cpu: list[dict[str, Any]],
                    parallel: bool) -> list[dict[str, Any]]:
    out = []
    for k, s in enumerate(services):
        a: dict[str, Any] = {"name": f"call{k}", "kind": "reward", "service": s["name"],
                             "duration_s": _duration(rng, 0.05, 20.0)}
        how = rng.random()
        if how < 0.25:
            a["weight"] = round(rng.uniform(0.05, 0.5), 2)          # a call during the turns
        elif how < 0.45 and cpu:
            parent = _choice(rng, cpu)                               # a follow-up of a CPU action
            parent.setdefault("followups", []).append(
                {"action": a["name"], "probability": round(rng.uniform(0.1, 1.0), 2)})
        else:
            a["final"] = int(rng.integers(1, 3))
        out.append(a)
    if not any(a.get("final") for a in out) and parallel and out:
        out[0]["final"] = 1
    return out


def _turns(rng: np.random.Generator) -> Any:
    if rng.random() < 0.5:
        lo = int(rng.integers(1, 4))
        return {"min": lo, "max": lo + int(rng.integers(0, 16))}
    return {"median": round(rng.uniform(2.0, 15.0), 1), "sigma": round(rng.uniform(0.3, 1.2), 2),
            "min": 1, "max": int(rng.integers(10, 61))}


def offered_load(w: Workload) -> float:
    """Demand against capacity of the busier side (CPU cores, GPU replicas), as a rough closed-loop
    rate: each trajectory asks for its expected work over its expected length."""
    turns = expected_turns(w)
    total_weight = sum(a.weight for a in w.actions) or 1.0
    core_s = sum(a.weight / total_weight * turns * _mean_s(a) * a.min_cores for a in w.actions if not a.service)
    busy = sum(a.weight / total_weight * turns * _mean_s(a) for a in w.actions if not a.service)
    length = turns * w.rollout.think_s.mean + busy + 1e-9
    c = w.cluster
    load = w.rollout.trajectories_per_step * core_s / length / max(1, c.cpu_workers * c.cpu_cores)
    if w.services and c.gpu_workers:
        replica_s = sum(service_demand(w).values())
        load = max(load, w.rollout.trajectories_per_step * replica_s / length / c.gpu_workers)
    return load


def _mean_s(a) -> float:
    m = a.duration_s.mean * ((1 - a.parallel_fraction) + a.parallel_fraction / max(1, a.min_cores))
    return min(m, a.timeout_s) if a.timeout_s else m


def draw_document(rng: np.random.Generator, index: int) -> dict[str, Any]:
    """One member of the family as a format-2 document (see the module docstring)."""
    gpu = bool(rng.random() < 0.6)
    cluster = _cluster(rng, gpu)
    cpu = [_cpu_action(rng, k, cluster) for k in range(int(rng.integers(1, 4)))]
    parallel = bool(rng.random() < 0.5)
    services = _services(rng, cluster) if gpu else []
    actions = cpu + _reward_actions(rng, services, cpu, parallel)
    rollout: dict[str, Any] = {"steps": 1, "trajectories_per_step": 1, "turns": _turns(rng),
                               "think_s": _duration(rng, 0.5, 30.0), "sync_turns": bool(rng.random() < 0.15),
                               "parallel_finals": parallel}
    rollout["think_s"]["sigma"] = min(1.0, rollout["think_s"]["sigma"])
    doc = {"format_version": 2, "name": f"family-{index}", "seed": int(rng.integers(1 << 30)),
           "rollout": rollout, "cluster": cluster, "services": services, "actions": actions}
    target = _logu(rng, *LOAD_RANGE)
    unit = offered_load(parse_workload(doc, f"family-{index}"))      # at one trajectory
    need = target / unit if unit > 0 else MIN_TRAJECTORIES
    if not MIN_TRAJECTORIES <= need <= MAX_TRAJECTORIES:
        # the load is reached with the trajectories a family affords by resizing the cluster
        f = need / MAX_TRAJECTORIES if need > MAX_TRAJECTORIES else need / MIN_TRAJECTORIES
        for k in ("cpu_workers", "gpu_workers"):
            if cluster.get(k):
                cluster[k] = max(1, min(MAX_WORKERS, round(cluster[k] / f)))
        unit = offered_load(parse_workload(doc, f"family-{index}"))
        need = target / unit if unit > 0 else MIN_TRAJECTORIES
    rollout["trajectories_per_step"] = int(max(MIN_TRAJECTORIES, min(MAX_TRAJECTORIES, round(need))))
    doc["description"] = (f"generated: load {offered_load(parse_workload(doc)):.2f}x of capacity "
                          f"(drawn {target:.2f}x)")
    return doc


def draw_family(n: int, seed: int) -> list[tuple[dict[str, Any], Workload]]:
    """``n`` workloads (each with its document) drawn from ``seed``; member ``i`` depends only on
    ``seed`` and ``i``, so a family of 100 starts with the family of 10."""
    out = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        doc = draw_document(rng, i)
        out.append((doc, parse_workload(doc, f"family seed {seed} #{i}")))
    return out


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def to_toml(doc: dict[str, Any]) -> str:
    """A document of :func:`draw_document` as a workload file."""
    lines = [f"{k} = {_value(v)}" for k, v in doc.items() if not isinstance(v, (dict, list))]
    for k, v in doc.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]"] + [f"{kk} = {_value(x)}" for kk, x in v.items()]
        elif isinstance(v, list):
            for item in v:
                lines += ["", f"[[{k}]]"] + [f"{kk} = {_value(x)}" for kk, x in item.items()]
    return "\n".join(lines) + "\n"
