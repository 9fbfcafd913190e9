"""Measured service load costs for the simulator.

``benchmarks/gpu_services.py --costs PATH`` writes what it measured through the live
:class:`~tangram_hpc.managers.services.ServiceManager` on a device::

    {"device": "cuda:0", "load_mb_per_s": 52000.0,
     "services": {"r0": {"gpu_mem_mb": 8192, "load_s": 0.16}, ...}}

:func:`with_measured_costs` gives a workload those load times: a service measured under its own
name takes its measured seconds, any other its size over the measured bandwidth (the total
megabytes loaded over the total seconds).  ``tangram-hpc bench --service-costs PATH`` runs the
simulator with them.  The file may also be the benchmark's whole report (``--json``), whose
per-size loads and rotation give the same figures.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .workload import Workload, WorkloadError

__all__ = ["MeasuredCosts", "read_costs", "costs_from_report", "with_measured_costs"]


@dataclass(frozen=True)
class MeasuredCosts:
    """Load seconds per measured service, and the bandwidth that sizes any other (MB per second)."""

    load_s: dict[str, float]
    load_mb_per_s: float | None
    device: str | None = None

    def load_time(self, name: str, gpu_mem_mb: int) -> float | None:
        """Seconds to load ``name`` of ``gpu_mem_mb``: measured, else by the bandwidth (None: neither)."""
        if name in self.load_s:
            return self.load_s[name]
        if self.load_mb_per_s:
            return gpu_mem_mb / self.load_mb_per_s
        return None

    def to_json(self, sizes: dict[str, float]) -> dict[str, Any]:
        return {"device": self.device, "load_mb_per_s": self.load_mb_per_s,
                "services": {n: {"gpu_mem_mb": round(sizes.get(n, 0.0)), "load_s": s} for n, s in self.load_s.items()}}


def costs_from_report(report: dict[str, Any]) -> MeasuredCosts:
    """The costs in a ``benchmarks/gpu_services.py`` report: its rotation's services (by name) and the
    bandwidth of every load it timed (the per-size loads and the rotation's)."""
    load_s: dict[str, float] = {}
    mb = seconds = 0.0
    for row in (report.get("rotation") or {}).get("sim_services") or []:
        if isinstance(row, dict) and isinstance(row.get("load_s"), (int, float)) and row["load_s"] > 0:
            load_s[str(row["name"])] = float(row["load_s"])
            mb += float(row.get("gpu_mem_mb") or 0)
            seconds += float(row["load_s"])
    for row in report.get("load_evict") or []:
        if isinstance(row, dict) and isinstance(row.get("load_s"), (int, float)) and row["load_s"] > 0:
            mb += float(row["size_gb"]) * 1e9 / 2**20
            seconds += float(row["load_s"])
    return MeasuredCosts(load_s, mb / seconds if mb > 0 and seconds > 0 else None, report.get("device"))


def read_costs(path: str | Path) -> MeasuredCosts:
    """Measured costs from a costs file, or from a benchmark report (see the module docstring)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise WorkloadError(f"measured service costs {path}: {e}") from None
    if not isinstance(data, dict):
        raise WorkloadError(f"measured service costs {path}: not a JSON object")
    if "rotation" in data or "load_evict" in data:
        costs = costs_from_report(data)
    else:
        services = data.get("services")
        bw = data.get("load_mb_per_s")
        if not isinstance(services, dict) or not (bw is None or isinstance(bw, (int, float)) and bw > 0):
            raise WorkloadError(f"measured service costs {path}: expected services (a table of name -> "
                                f"{{gpu_mem_mb, load_s}}) and load_mb_per_s")
        load_s = {}
        for name, row in services.items():
            s = row.get("load_s") if isinstance(row, dict) else None
            if not isinstance(s, (int, float)) or not s >= 0:
                raise WorkloadError(f"measured service costs {path}: services.{name}.load_s must be seconds")
            load_s[name] = float(s)
        costs = MeasuredCosts(load_s, float(bw) if bw else None, data.get("device"))
    if not costs.load_s and not costs.load_mb_per_s:
        raise WorkloadError(f"measured service costs {path}: no load was measured in it")
    return costs


def with_measured_costs(w: Workload, costs: MeasuredCosts) -> Workload:
    """``w`` with its services' load times as measured (see the module docstring)."""
    services = {}
    for name, svc in w.services.items():
        t = costs.load_time(name, svc.gpu_mem_mb)
        services[name] = svc if t is None else replace(svc, load_s=t)
    return replace(w, services=services)
