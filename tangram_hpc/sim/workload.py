"""Workload files: a versioned TOML description of an agentic-RL rollout and its cluster.

See ``docs/workloads.md`` for the format with an example.  :func:`load_workload`
reads a file (or a preset name) into :class:`Workload`, validating every field
with an error that names it; :meth:`Workload.sample` turns it into a concrete,
seeded :class:`Plan` (every action's class, one-core duration and the think
time before it), the input of the simulator and of the live replay.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Workload", "ActionClass", "Service", "Cluster", "Rollout", "Dist", "Plan",
           "WorkloadError", "load_workload", "parse_workload", "preset_names", "PRESET_DIR"]

FORMAT_VERSION = 1
PRESET_DIR = Path(__file__).parent / "presets"


class WorkloadError(ValueError):
    """A workload file that does not follow the format."""


def _toml_loads(text: str) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
        return tomllib.loads(text)
    try:
        import tomli  # type: ignore[import-not-found]
    except ImportError:
        raise WorkloadError("reading workload files on Python 3.10 needs the 'tomli' package "
                            "(pip install tomli), or use Python 3.11+") from None
    return tomli.loads(text)


@dataclass(slots=True, frozen=True)
class Dist:
    """A positive random quantity: lognormal (``median``, ``sigma``), or a constant (sigma 0)."""

    median: float
    sigma: float = 0.0

    @property
    def mean(self) -> float:
        return self.median * math.exp(0.5 * self.sigma ** 2)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.sigma == 0:
            return np.full(n, self.median)
        return self.median * np.exp(rng.normal(0.0, self.sigma, n))


@dataclass(slots=True, frozen=True)
class Service:
    name: str
    gpu_mem_mb: int
    load_s: float
    batchable: bool = True


@dataclass(slots=True, frozen=True)
class ActionClass:
    """One kind of external call.

    ``weight``: relative frequency among the per-turn actions (0 for final-only).
    ``final``: how many of it every trajectory runs after its last turn (the reward).
    ``duration_s``: run time at one core; ``parallel_fraction``: Amdahl's p.
    """

    name: str
    kind: str
    duration_s: Dist
    weight: float = 0.0
    final: int = 0
    parallel_fraction: float = 0.0
    min_cores: int = 1
    max_cores: int = 1
    mem_mb: int = 0
    service: str | None = None
    uses_env: bool = False
    hint: bool = False

    @property
    def label(self) -> str:
        return self.name


@dataclass(slots=True, frozen=True)
class Rollout:
    steps: int
    trajectories_per_step: int
    turns_min: int
    turns_max: int
    think_s: Dist
    train_s: float = 0.0


@dataclass(slots=True, frozen=True)
class Cluster:
    cpu_workers: int
    cpu_cores: int
    cpu_mem_mb: int = 0
    gpu_workers: int = 0
    gpus: int = 0
    gpu_mem_mb: int = 0          # per GPU
    gpu_slots: int = 0           # concurrent reward requests a GPU worker serves (its cores)
    startup_s: float = 60.0
    idle_ttl_s: float = 300.0

    @property
    def slots_per_gpu(self) -> int:
        return max(1, self.gpu_slots // max(1, self.gpus))


@dataclass(slots=True, frozen=True)
class Workload:
    name: str
    description: str
    rollout: Rollout
    cluster: Cluster
    actions: tuple[ActionClass, ...]
    services: dict[str, Service]
    seed: int = 0
    source: str = ""

    def scaled(self, *, trajectories: float = 1.0, steps: int | None = None,
               cluster: float = 1.0) -> "Workload":
        """The same workload with ``trajectories`` x trajectories and ``cluster`` x workers."""
        r = self.rollout
        ro = replace(r, trajectories_per_step=max(1, round(r.trajectories_per_step * trajectories)),
                     steps=steps if steps is not None else r.steps)
        c = self.cluster
        cl = replace(c, cpu_workers=max(1, round(c.cpu_workers * cluster)) if c.cpu_workers else 0,
                     gpu_workers=max(1, round(c.gpu_workers * cluster)) if c.gpu_workers else 0)
        return replace(self, rollout=ro, cluster=cl)

    def with_cluster(self, **changes: Any) -> "Workload":
        return replace(self, cluster=replace(self.cluster, **changes))

    def action_cores(self, a: ActionClass) -> tuple[int, int]:
        """(min, max) cores the action asks for; a non-batchable reward call takes a whole GPU's slots."""
        if a.service is not None and not self.services[a.service].batchable:
            s = self.cluster.slots_per_gpu
            return s, s
        return a.min_cores, a.max_cores

    def sample(self, seed: int | None = None) -> "Plan":
        return Plan.sample(self, self.seed if seed is None else seed)


@dataclass(slots=True)
class Plan:
    """A concrete, seeded rollout: per step, per trajectory, the sequence of actions.

    Arrays are indexed by a global action number; trajectory ``j`` of step
    ``s`` owns actions ``start[s][j] .. start[s][j] + length[s][j] - 1``.
    """

    workload: Workload
    cls: np.ndarray            # action class index
    d1: np.ndarray             # one-core run time in seconds
    think: np.ndarray          # think time before the action is submitted
    step_traj_start: list[np.ndarray] = field(default_factory=list)
    step_traj_len: list[np.ndarray] = field(default_factory=list)

    @property
    def n_actions(self) -> int:
        return int(self.cls.shape[0])

    @property
    def n_trajectories(self) -> int:
        return int(sum(len(x) for x in self.step_traj_len))

    @classmethod
    def sample(cls, w: Workload, seed: int) -> "Plan":
        rng = np.random.default_rng(seed)
        r = w.rollout
        turn_classes = [i for i, a in enumerate(w.actions) if a.weight > 0]
        weights = np.array([w.actions[i].weight for i in turn_classes], dtype=float)
        if len(turn_classes):
            weights /= weights.sum()
        else:               # reward-only rollouts (turns = 0)
            turn_classes, weights = [0], np.ones(1)
        finals: list[int] = []
        for i, a in enumerate(w.actions):
            finals.extend([i] * a.final)
        F = len(finals)
        sig = np.array([a.duration_s.sigma for a in w.actions])
        all_cls, all_think, starts, lens = [], [], [], []
        base = 0
        for _s in range(r.steps):
            T = r.trajectories_per_step
            turns = rng.integers(r.turns_min, r.turns_max + 1, T)
            L = turns + F
            off = np.concatenate(([0], np.cumsum(L)[:-1]))
            n = int(L.sum())
            traj = np.repeat(np.arange(T), L)
            pos = np.arange(n) - off[traj]
            is_final = pos >= turns[traj]
            c = np.asarray(turn_classes)[rng.choice(len(turn_classes), n, p=weights)]
            if F:
                fidx = np.clip(pos - turns[traj], 0, F - 1)
                c = np.where(is_final, np.asarray(finals)[fidx], c)
            think = r.think_s.sample(rng, n)
            if F:
                # reward calls follow the last turn directly: no generation in between
                think = np.where(is_final & (pos > turns[traj]), 0.0, think)
            all_cls.append(c)
            all_think.append(think)
            starts.append(off + base)
            lens.append(L)
            base += n
        c = np.concatenate(all_cls)
        med = np.array([a.duration_s.median for a in w.actions])
        d1 = med[c] * np.exp(sig[c] * rng.normal(0.0, 1.0, c.shape[0]))
        return cls(w, c.astype(np.int32), d1, np.concatenate(all_think), starts, lens)


# -- parsing ------------------------------------------------------------------

def _get(tbl: dict, key: str, where: str, typ, default=..., *, positive=False, nonneg=False):
    if key not in tbl:
        if default is ...:
            raise WorkloadError(f"{where}: missing required field '{key}'")
        return default
    v = tbl[key]
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, typ) or isinstance(v, bool) and typ is not bool:
        tn = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise WorkloadError(f"{where}.{key}: expected {tn}, got {type(v).__name__} {v!r}")
    if positive and not v > 0:
        raise WorkloadError(f"{where}.{key}: must be positive, got {v!r}")
    if nonneg and v < 0:
        raise WorkloadError(f"{where}.{key}: must not be negative, got {v!r}")
    return v


def _dist(tbl: dict, key: str, where: str) -> Dist:
    v = tbl.get(key)
    if v is None:
        raise WorkloadError(f"{where}: missing required field '{key}'")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if v <= 0:
            raise WorkloadError(f"{where}.{key}: must be positive, got {v!r}")
        return Dist(float(v))
    if not isinstance(v, dict):
        raise WorkloadError(f"{where}.{key}: expected a number or {{ median = ..., sigma = ... }}")
    _check_keys(v, {"median", "sigma"}, f"{where}.{key}")
    med = _get(v, "median", f"{where}.{key}", float, positive=True)
    sig = _get(v, "sigma", f"{where}.{key}", float, 0.0, nonneg=True)
    if sig > 3:
        raise WorkloadError(f"{where}.{key}.sigma: {sig} is implausibly large (at most 3)")
    return Dist(med, sig)


def _check_keys(tbl: dict, allowed: set[str], where: str) -> None:
    extra = set(tbl) - allowed
    if extra:
        raise WorkloadError(f"{where}: unknown field(s) {', '.join(sorted(extra))}; "
                            f"allowed: {', '.join(sorted(allowed))}")


def parse_workload(data: dict, source: str = "<memory>") -> Workload:
    """Validate a parsed TOML document and build the :class:`Workload`."""
    _check_keys(data, {"format_version", "name", "description", "seed", "rollout", "cluster",
                       "actions", "services"}, source)
    ver = data.get("format_version")
    if ver is None:
        raise WorkloadError(f"{source}: missing 'format_version' (this reader knows version {FORMAT_VERSION})")
    if ver != FORMAT_VERSION:
        raise WorkloadError(f"{source}: format_version {ver!r} is not supported (this reader knows {FORMAT_VERSION})")
    name = _get(data, "name", source, str)
    desc = _get(data, "description", source, str, "")
    seed = _get(data, "seed", source, int, 0, nonneg=True)

    ro = data.get("rollout")
    if not isinstance(ro, dict):
        raise WorkloadError(f"{source}: missing [rollout] table")
    _check_keys(ro, {"steps", "trajectories_per_step", "turns", "think_s", "train_s"}, "rollout")
    turns = ro.get("turns")
    if isinstance(turns, int) and not isinstance(turns, bool):
        tmin = tmax = turns
    elif isinstance(turns, dict):
        _check_keys(turns, {"min", "max"}, "rollout.turns")
        tmin = _get(turns, "min", "rollout.turns", int, nonneg=True)
        tmax = _get(turns, "max", "rollout.turns", int, nonneg=True)
    else:
        raise WorkloadError("rollout.turns: expected an integer or { min = ..., max = ... }")
    if tmax < tmin:
        raise WorkloadError(f"rollout.turns: max ({tmax}) is below min ({tmin})")
    rollout = Rollout(
        steps=_get(ro, "steps", "rollout", int, positive=True),
        trajectories_per_step=_get(ro, "trajectories_per_step", "rollout", int, positive=True),
        turns_min=tmin, turns_max=tmax, think_s=_dist(ro, "think_s", "rollout"),
        train_s=_get(ro, "train_s", "rollout", float, 0.0, nonneg=True))

    cl = data.get("cluster")
    if not isinstance(cl, dict):
        raise WorkloadError(f"{source}: missing [cluster] table")
    _check_keys(cl, {"cpu_workers", "cpu_cores", "cpu_mem_mb", "gpu_workers", "gpus", "gpu_mem_mb",
                     "gpu_slots", "startup_s", "idle_ttl_s"}, "cluster")
    cluster = Cluster(
        cpu_workers=_get(cl, "cpu_workers", "cluster", int, nonneg=True),
        cpu_cores=_get(cl, "cpu_cores", "cluster", int, positive=True),
        cpu_mem_mb=_get(cl, "cpu_mem_mb", "cluster", int, 0, nonneg=True),
        gpu_workers=_get(cl, "gpu_workers", "cluster", int, 0, nonneg=True),
        gpus=_get(cl, "gpus", "cluster", int, 0, nonneg=True),
        gpu_mem_mb=_get(cl, "gpu_mem_mb", "cluster", int, 0, nonneg=True),
        gpu_slots=_get(cl, "gpu_slots", "cluster", int, 0, nonneg=True),
        startup_s=_get(cl, "startup_s", "cluster", float, 60.0, nonneg=True),
        idle_ttl_s=_get(cl, "idle_ttl_s", "cluster", float, 300.0, nonneg=True))
    if cluster.gpu_workers and not (cluster.gpus and cluster.gpu_mem_mb and cluster.gpu_slots):
        raise WorkloadError("cluster: gpu_workers > 0 needs gpus, gpu_mem_mb and gpu_slots")

    services: dict[str, Service] = {}
    for i, s in enumerate(data.get("services", [])):
        where = f"services[{i}]"
        if not isinstance(s, dict):
            raise WorkloadError(f"{where}: expected a table")
        _check_keys(s, {"name", "gpu_mem_mb", "load_s", "batchable"}, where)
        svc = Service(_get(s, "name", where, str), _get(s, "gpu_mem_mb", where, int, positive=True),
                      _get(s, "load_s", where, float, nonneg=True), _get(s, "batchable", where, bool, True))
        if svc.name in services:
            raise WorkloadError(f"{where}: duplicate service name {svc.name!r}")
        if cluster.gpu_workers and svc.gpu_mem_mb > cluster.gpus * cluster.gpu_mem_mb:
            raise WorkloadError(f"{where}: {svc.name} needs {svc.gpu_mem_mb} MB, more than a GPU worker has "
                                f"({cluster.gpus} x {cluster.gpu_mem_mb} MB)")
        services[svc.name] = svc

    acts = data.get("actions")
    if not isinstance(acts, list) or not acts:
        raise WorkloadError(f"{source}: needs at least one [[actions]] entry")
    actions = []
    names = set()
    for i, a in enumerate(acts):
        where = f"actions[{i}]"
        if not isinstance(a, dict):
            raise WorkloadError(f"{where}: expected a table")
        _check_keys(a, {"name", "kind", "weight", "final", "duration_s", "parallel_fraction", "min_cores",
                        "max_cores", "mem_mb", "service", "uses_env", "hint"}, where)
        nm = _get(a, "name", where, str)
        where = f"actions[{i}] ({nm})"
        if nm in names:
            raise WorkloadError(f"{where}: duplicate action name")
        names.add(nm)
        kind = _get(a, "kind", where, str)
        if kind not in ("sandbox", "reward", "function"):
            raise WorkloadError(f"{where}.kind: {kind!r} is not one of sandbox, reward, function")
        svc = _get(a, "service", where, str, None)
        if kind == "reward" and svc is None:
            raise WorkloadError(f"{where}: a reward action needs a service")
        if svc is not None and svc not in services:
            raise WorkloadError(f"{where}.service: unknown service {svc!r}; define it under [[services]]")
        if svc is not None and not cluster.gpu_workers:
            raise WorkloadError(f"{where}: uses GPU service {svc!r} but the cluster has no gpu_workers")
        pf = _get(a, "parallel_fraction", where, float, 0.0, nonneg=True)
        if pf > 1:
            raise WorkloadError(f"{where}.parallel_fraction: must be within 0..1, got {pf}")
        mn = _get(a, "min_cores", where, int, 1, positive=True)
        mx = _get(a, "max_cores", where, int, mn, positive=True)
        if mx < mn:
            raise WorkloadError(f"{where}: max_cores ({mx}) is below min_cores ({mn})")
        limit = cluster.gpu_slots if svc else cluster.cpu_cores
        if mn > limit:
            raise WorkloadError(f"{where}: min_cores {mn} exceeds a worker's {limit} cores")
        ac = ActionClass(
            name=nm, kind=kind, duration_s=_dist(a, "duration_s", where),
            weight=_get(a, "weight", where, float, 0.0, nonneg=True),
            final=_get(a, "final", where, int, 0, nonneg=True), parallel_fraction=pf,
            min_cores=mn, max_cores=min(mx, limit), mem_mb=_get(a, "mem_mb", where, int, 0, nonneg=True),
            service=svc, uses_env=_get(a, "uses_env", where, bool, kind == "sandbox"),
            hint=_get(a, "hint", where, bool, False))
        if ac.weight == 0 and ac.final == 0:
            raise WorkloadError(f"{where}: neither a per-turn weight nor a final count: it would never run")
        actions.append(ac)
    if rollout.turns_max > 0 and not any(a.weight > 0 for a in actions):
        raise WorkloadError("rollout.turns > 0 but no action has a per-turn weight")
    return Workload(name, desc, rollout, cluster, tuple(actions), services, seed, source)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def load_workload(path_or_preset: str | Path) -> Workload:
    """Read a workload file, or a shipped preset by name (``swe``, ``math``, ``judge``)."""
    p = Path(path_or_preset)
    if not p.exists():
        cand = PRESET_DIR / f"{path_or_preset}.toml"
        if cand.exists():
            p = cand
        else:
            raise WorkloadError(f"no workload file {str(path_or_preset)!r} and no preset of that name "
                                f"(presets: {', '.join(preset_names())})")
    try:
        data = _toml_loads(p.read_text())
    except WorkloadError:
        raise
    except Exception as e:   # tomllib.TOMLDecodeError and friends
        raise WorkloadError(f"{p}: not valid TOML: {e}") from None
    return parse_workload(data, str(p))
