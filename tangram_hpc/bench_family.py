"""``tangram-hpc bench --family N``: tangram against every baseline on a generated workload family.

Each member of :func:`~tangram_hpc.sim.family.draw_family` runs the bench
(:func:`~tangram_hpc.bench.run_bench`, without the savings search) once per
sampling seed; the table says, per baseline, in how many runs it beat
tangram by more than 1 % and by more than 5 % on mean ACT or on step time,
and how its mean ACT and per-trajectory time compare; then the median of
tangram's advantage over the best baseline of each run.  The runs where a
baseline beat tangram by most are written out as workload files, to be
rerun one by one with ``bench --workload FILE``.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import numpy as np

from .bench import BASELINES, _in_processes, run_bench
from .sim.family import draw_family, to_toml
from .sim.stalled import SimulationStalled
from .sim.workload import parse_workload

__all__ = ["run_family", "family_summary", "format_family", "write_worst", "BEAT_MARGINS"]

#: a baseline "beats" tangram in a run when its figure is lower by more than these shares
BEAT_MARGINS = (0.01, 0.05)
_FIGURES = ("mean_act", "mean_traj_s", "step_s")


def _member_run(doc: dict[str, Any], index: int, seed: int | None) -> dict[str, Any]:
    w = parse_workload(doc, doc["name"])
    if seed is not None:
        w = replace(w, seed=seed)
    try:
        fig, _ = run_bench(w, search=False)
    except SimulationStalled as e:      # tangram could not finish: a loss, kept apart from the figures
        return {"member": index, "workload": doc["name"], "seed": w.seed, "tangram_stalled": e.reason,
                "policies": {}}
    return {"member": index, "workload": doc["name"], "seed": w.seed, "trajectories": fig["trajectories"],
            "actions": fig["actions"], "load": doc.get("description", ""),
            "policies": {k: {f: p[f] for f in _FIGURES} for k, p in fig["policies"].items()},
            "bound_ratio": fig["tangram_bound_ratio"], "infeasible": fig["infeasible"]}


def run_family(n: int, family_seed: int, seeds: list[int] | None = None, *, jobs: int = 1,
               progress=None) -> dict[str, Any]:
    """The bench on each of ``n`` members of the family of ``family_seed``, at each of ``seeds``
    (None: each member's own seed); ``jobs`` runs at once, each in a process of its own."""
    family = draw_family(n, family_seed)
    at: list[int | None] = list(seeds) if seeds else [None]
    calls = [(doc, i, s) for i, (doc, _) in enumerate(family) for s in at]
    if jobs > 1 and len(calls) > 1:
        runs = _in_processes(_member_run, calls, jobs, f"family of {n}: {len(calls)} runs", progress)
    else:
        runs = []
        for k, call in enumerate(calls, 1):
            if progress:
                progress(f"family of {n}: run {k}/{len(calls)} ({call[0]['name']}, "
                         f"{call[0]['rollout']['trajectories_per_step']} trajectories)")
            runs.append(_member_run(*call))
    return {"family": n, "family_seed": family_seed, "seeds": seeds, "runs": runs,
            "summary": family_summary(runs), "documents": [doc for doc, _ in family]}


def _beat(b: dict[str, float], t: dict[str, float], margin: float) -> bool:
    return b["mean_act"] < t["mean_act"] * (1 - margin) or b["step_s"] < t["step_s"] * (1 - margin)


def family_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per baseline: runs it could run, how often it beat tangram (:data:`BEAT_MARGINS`), and the
    median and least of its figures over tangram's; tangram's median advantage over each run's best.
    Runs where tangram stalled are counted apart (``tangram_stalled``)."""
    stalled = [r for r in runs if "tangram_stalled" in r]
    runs = [r for r in runs if "tangram_stalled" not in r]
    per: dict[str, Any] = {}
    for k in BASELINES:
        pairs = [(r["policies"][k], r["policies"]["tangram"]) for r in runs if k in r["policies"]]
        if not pairs:
            per[k] = {"runs": 0}
            continue
        ent: dict[str, Any] = {"runs": len(pairs)}
        for m in BEAT_MARGINS:
            ent[f"beats_{m:g}"] = sum(_beat(b, t, m) for b, t in pairs)
        for f in _FIGURES:
            ratios = [b[f] / t[f] for b, t in pairs if t[f] > 0]
            ent[f"{f}_ratio"] = {"median": float(np.median(ratios)), "min": float(min(ratios))} if ratios else None
        per[k] = ent
    best = []
    for r in runs:
        others = [p["mean_act"] for k, p in r["policies"].items() if k != "tangram"]
        if others and r["policies"]["tangram"]["mean_act"] > 0:
            best.append(min(others) / r["policies"]["tangram"]["mean_act"])
    bounds = [r["bound_ratio"] for r in runs]
    return {"runs": len(runs), "tangram_stalled": len(stalled), "baselines": per,
            "advantage_over_best": ({"median": float(np.median(best)), "min": float(min(best))} if best else None),
            "bound_ratio": {"median": float(np.median(bounds)), "max": float(max(bounds))} if bounds else None}


def worst_runs(runs: list[dict[str, Any]], count: int) -> list[tuple[float, str, dict[str, Any]]]:
    """The ``count`` runs where a baseline beat tangram by most: (its lead, the baseline, the run)."""
    scored: list[tuple[float, str, dict[str, Any]]] = []
    for r in runs:
        if "tangram_stalled" in r:
            scored.append((float("inf"), "every baseline (tangram stalled)", r))
            continue
        t = r["policies"]["tangram"]
        lead, who = 0.0, ""
        for k, b in r["policies"].items():
            if k == "tangram":
                continue
            x = max(1 - b["mean_act"] / t["mean_act"] if t["mean_act"] else 0.0,
                    1 - b["step_s"] / t["step_s"] if t["step_s"] else 0.0)
            if x > lead:
                lead, who = x, k
        if lead > 0:
            scored.append((lead, who, r))
    scored.sort(key=lambda e: (-e[0], e[2]["member"], e[2]["seed"]))
    return scored[:count]


def write_worst(res: dict[str, Any], out_dir: str, count: int) -> list[str]:
    """The workload files of :func:`worst_runs` (each with the seed it ran at) in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for lead, who, r in worst_runs(res["runs"], count):
        doc = dict(res["documents"][r["member"]])
        doc["seed"] = r["seed"]
        doc["description"] = (f"{doc.get('description', '')}; tangram stalled: {r['tangram_stalled']}"
                              if "tangram_stalled" in r else
                              f"{doc.get('description', '')}; {who} beat tangram by {lead:.1%}")
        p = os.path.join(out_dir, f"family-{res['family_seed']}-{r['member']}-seed{r['seed']}.toml")
        with open(p, "w") as f:
            f.write(_header(res) + to_toml(doc))
        paths.append(p)
    return paths


def _header(res: dict[str, Any]) -> str:
    return f"# drawn by: tangram-hpc bench --family {res['family']} --family-seed {res['family_seed']}\n"


def format_family(res: dict[str, Any]) -> str:
    sm = res["summary"]
    n = sm["runs"]
    pct = [f"beat by >{m:.0%}" for m in BEAT_MARGINS]
    lines = [(f"{'baseline':20s} {'runs':>5s} {pct[0]:>12s} {pct[1]:>12s} {'ACT / tangram':>18s} "
              f"{'traj / tangram':>18s} {'step / tangram':>18s}"),
             f"{'':20s} {'':5s} {'':12s} {'':12s}" + f" {'median (least)':>18s}" * 3]
    lines.append("-" * len(lines[0]))

    def rat(x):
        return f"{x['median']:.3f} ({x['min']:.3f})" if x else "-"
    for k, e in sm["baselines"].items():
        if not e["runs"]:
            lines.append(f"{k:20s} cannot run any of the {n} runs")
            continue
        lines.append(f"{k:20s} {e['runs']:5d} {e[f'beats_{BEAT_MARGINS[0]:g}']:12d} "
                     f"{e[f'beats_{BEAT_MARGINS[1]:g}']:12d} {rat(e['mean_act_ratio']):>18s} "
                     f"{rat(e['mean_traj_s_ratio']):>18s} {rat(e['step_s_ratio']):>18s}")
    lines.append("")
    if sm["tangram_stalled"]:
        lines.append(f"tangram stalled (could not finish) in {sm['tangram_stalled']} more runs: "
                     + ", ".join(f"{r['workload']} seed {r['seed']}" for r in res["runs"] if "tangram_stalled" in r))
    adv = sm["advantage_over_best"]
    if adv:
        lines.append(f"tangram's mean-ACT advantage over the best baseline of each run: median {adv['median']:.3f}x, "
                     f"least {adv['min']:.3f}x ({n} runs)")
    if sm["bound_ratio"]:
        lines.append(f"tangram / capacity-aware bound: median {sm['bound_ratio']['median']:.2f}x, "
                     f"most {sm['bound_ratio']['max']:.2f}x")
    return "\n".join(lines)
