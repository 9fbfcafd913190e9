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

from ..errors import TangramError
from ..resources import GPU_MEMORY_SHARE

__all__ = ["Workload", "ActionClass", "Service", "Cluster", "Rollout", "Dist", "Turns", "Followup", "Plan",
           "WorkloadError", "load_workload", "parse_workload", "preset_names", "PRESET_DIR"]

FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)     # version 2 only adds optional fields
PRESET_DIR = Path(__file__).parent / "presets"


class WorkloadError(TangramError, ValueError):
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
class Turns:
    """Turns per trajectory: uniform over ``min..max``, or lognormal (``median``, ``sigma``) clipped to it."""

    min: int
    max: int
    median: float = 0.0
    sigma: float = 0.0

    @property
    def lognormal(self) -> bool:
        return self.median > 0

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if not self.lognormal:
            return rng.integers(self.min, self.max + 1, n)
        t = np.rint(self.median * np.exp(rng.normal(0.0, self.sigma, n)))
        return np.clip(t, self.min, self.max).astype(np.int64)


@dataclass(slots=True, frozen=True)
class Service:
    """A GPU reward-model service.

    ``max_batch``: requests one replica serves at once (0: as many as the
    worker's slots); ``batch_slowdown``: how much longer a request takes in
    a full batch than alone (latency grows linearly with the batch, so a
    replica's throughput at a full batch is ``max_batch / (duration * (1 +
    batch_slowdown))``).
    """

    name: str
    gpu_mem_mb: int
    load_s: float
    batchable: bool = True
    max_batch: int = 0
    batch_slowdown: float = 0.0


@dataclass(slots=True, frozen=True)
class Followup:
    """An optional call in the same turn: after its action, with ``probability``, ``action`` runs too."""

    action: str
    probability: float


@dataclass(slots=True, frozen=True)
class ActionClass:
    """One kind of external call.

    ``weight``: relative frequency among the per-turn actions (0 for final-only).
    ``final``: how many of it every trajectory runs after its last turn (the reward).
    ``duration_s``: run time at one core; ``parallel_fraction``: Amdahl's p.
    ``timeout_s``: the action is stopped after this long (its run time is truncated).
    ``mem_mb``: peak memory, what the scheduler reserves; ``mem_mean_mb``: what it
    uses on average (for the memory utilisation figures).
    ``hint``: the client passes a ``duration_hint``: the class median, or with
    ``hint_sigma`` > 0 a per-action guess (the true time times a lognormal error).
    ``followups``: optional calls in the same turn, right after this one.
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
    hint_sigma: float = 0.0
    timeout_s: float | None = None
    mem_mean_mb: int = 0
    followups: tuple[Followup, ...] = ()

    @property
    def label(self) -> str:
        return self.name


@dataclass(slots=True, frozen=True)
class Rollout:
    """``sync_turns``: turn ``k + 1`` of any trajectory starts only after every
    trajectory of the step finished turn ``k`` (synchronous, batched generation);
    ``parallel_finals``: a trajectory's final calls run at the same time."""

    steps: int
    trajectories_per_step: int
    turns: Turns
    think_s: Dist
    train_s: float = 0.0
    sync_turns: bool = False
    parallel_finals: bool = False


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
    env_move_s: float = 10.0     # to move an environment between workers (save, transfer, restore)

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
    ``s`` owns actions ``start[s][j] .. start[s][j] + length[s][j] - 1``.  An
    action with ``joined`` set is submitted together with the one before it
    (parallel final calls); the trajectory moves on when all of a group ended.
    ``turn`` is the action's turn in its trajectory (final calls: the number of
    turns), for per-turn barriers; ``hint`` the client's duration hint at
    ``min_cores`` (0: none).
    """

    workload: Workload
    cls: np.ndarray            # action class index
    d1: np.ndarray             # one-core run time in seconds
    think: np.ndarray          # think time before the action is submitted
    step_traj_start: list[np.ndarray] = field(default_factory=list)
    step_traj_len: list[np.ndarray] = field(default_factory=list)
    joined: np.ndarray | None = None
    turn: np.ndarray | None = None
    hint: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = self.cls.shape[0]
        if self.joined is None:
            self.joined = np.zeros(n, dtype=bool)
        if self.turn is None:
            self.turn = np.zeros(n, dtype=np.int32)
        if self.hint is None:
            self.hint = np.zeros(n)

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
        index = {a.name: i for i, a in enumerate(w.actions)}
        follow = [(i, index[f.action], f.probability) for i, a in enumerate(w.actions) for f in a.followups]
        finals: list[int] = []
        for i, a in enumerate(w.actions):
            finals.extend([i] * a.final)
        F = len(finals)
        tc = np.asarray(turn_classes)
        all_cls, all_think, all_joined, all_turn, starts, lens = [], [], [], [], [], []
        base = 0
        for _s in range(r.steps):
            T = r.trajectories_per_step
            turns = r.turns.sample(rng, T).astype(np.int64)
            nturn = int(turns.sum())
            traj_of_turn = np.repeat(np.arange(T), turns)
            first_turn = np.cumsum(turns) - turns
            turn_no = np.arange(nturn) - first_turn[traj_of_turn]
            prim = tc[rng.choice(len(tc), nturn, p=weights)]
            per_turn = np.ones(nturn, dtype=np.int64)
            extra = []
            for pc, fc, prob in follow:
                m = (prim == pc) & (rng.random(nturn) < prob)
                extra.append((fc, m))
                per_turn += m
            turn_actions = np.bincount(traj_of_turn, weights=per_turn, minlength=T).astype(np.int64)
            L = turn_actions + F
            toff = np.cumsum(L) - L
            n = int(L.sum())
            c = np.empty(n, dtype=np.int32)
            think = np.zeros(n)
            joined = np.zeros(n, dtype=bool)
            turn = np.empty(n, dtype=np.int32)
            cc = np.concatenate(([0], np.cumsum(per_turn)))     # actions before each turn (and after the last)
            ppos = toff[traj_of_turn] + cc[:-1] - cc[first_turn][traj_of_turn]
            c[ppos] = prim
            think[ppos] = r.think_s.sample(rng, nturn)
            turn[ppos] = turn_no
            used = np.zeros(nturn, dtype=np.int64)
            for fc, m in extra:            # follow-ups right after their turn's action, no think between
                pos = ppos[m] + 1 + used[m]
                c[pos] = fc
                turn[pos] = turn_no[m]
                used += m
            if F:
                fpos = (toff + turn_actions)[:, None] + np.arange(F)[None, :]
                c[fpos] = np.asarray(finals, dtype=np.int32)[None, :]
                turn[fpos] = turns[:, None]
                # the final answer is generated once, then the reward calls follow directly
                think[fpos[:, 0]] = r.think_s.sample(rng, T)
                if r.parallel_finals and F > 1:
                    joined[fpos[:, 1:]] = True
            all_cls.append(c)
            all_think.append(think)
            all_joined.append(joined)
            all_turn.append(turn)
            starts.append(toff + base)
            lens.append(L)
            base += n
        c = np.concatenate(all_cls)
        med = np.array([a.duration_s.median for a in w.actions])
        sig = np.array([a.duration_s.sigma for a in w.actions])
        d1 = med[c] * np.exp(sig[c] * rng.normal(0.0, 1.0, c.shape[0]))
        hint = np.zeros(c.shape[0])
        for i, a in enumerate(w.actions):
            if not a.hint:
                continue
            m = c == i
            lo, _ = w.action_cores(a)
            at_min = (1 - a.parallel_fraction) + a.parallel_fraction / max(1, lo)
            h1 = d1[m] * np.exp(a.hint_sigma * rng.normal(0.0, 1.0, int(m.sum()))) if a.hint_sigma \
                else np.full(int(m.sum()), a.duration_s.median)
            hint[m] = h1 * at_min
        return cls(w, c, d1, np.concatenate(all_think), starts, lens, np.concatenate(all_joined),
                   np.concatenate(all_turn), hint)


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
    if typ is float and not math.isfinite(v):
        raise WorkloadError(f"{where}.{key}: must be a finite number, got {v!r}")
    if positive and not v > 0:
        raise WorkloadError(f"{where}.{key}: must be positive, got {v!r}")
    if nonneg and v < 0:
        raise WorkloadError(f"{where}.{key}: must not be negative, got {v!r}")
    return v


#: the largest median duration a workload may give (a simulation must end)
_MEDIAN_MAX_S = 1e6


def _dist(tbl: dict, key: str, where: str) -> Dist:
    v = tbl.get(key)
    if v is None:
        raise WorkloadError(f"{where}: missing required field '{key}'")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if not 0 < v <= _MEDIAN_MAX_S:
            raise WorkloadError(f"{where}.{key}: must be positive and at most {_MEDIAN_MAX_S:g} s, got {v!r}")
        return Dist(float(v))
    if not isinstance(v, dict):
        raise WorkloadError(f"{where}.{key}: expected a number or {{ median = ..., sigma = ... }}")
    _check_keys(v, {"median", "sigma"}, f"{where}.{key}")
    med = _get(v, "median", f"{where}.{key}", float, positive=True)
    sig = _get(v, "sigma", f"{where}.{key}", float, 0.0, nonneg=True)
    if sig > 3:
        raise WorkloadError(f"{where}.{key}.sigma: {sig} is implausibly large (at most 3)")
    if med > _MEDIAN_MAX_S:
        raise WorkloadError(f"{where}.{key}.median: {med:g} s is implausibly large (at most {_MEDIAN_MAX_S:g} s, "
                            f"about {_MEDIAN_MAX_S / 86400:.0f} days)")
    return Dist(med, sig)


def _turns(v: Any) -> Turns:
    where = "rollout.turns"
    if isinstance(v, int) and not isinstance(v, bool):
        if v < 0:
            raise WorkloadError(f"{where}: must not be negative, got {v}")
        return Turns(v, v)
    if not isinstance(v, dict):
        raise WorkloadError(f"{where}: expected an integer, {{ min = ..., max = ... }} or "
                            f"{{ median = ..., sigma = ..., max = ... }}")
    if "median" in v:
        _check_keys(v, {"median", "sigma", "min", "max"}, where)
        med = _get(v, "median", where, float, positive=True)
        sig = _get(v, "sigma", where, float, 0.0, nonneg=True)
        if sig > 3:
            raise WorkloadError(f"{where}.sigma: {sig} is implausibly large (at most 3)")
        lo = _get(v, "min", where, int, 1, nonneg=True)
        if "max" not in v:
            raise WorkloadError(f"{where}: a lognormal turn count needs a cap 'max'")
        hi = _get(v, "max", where, int, positive=True)
    else:
        _check_keys(v, {"min", "max"}, where)
        lo = _get(v, "min", where, int, nonneg=True)
        hi = _get(v, "max", where, int, nonneg=True)
        med = sig = 0.0
    if hi < lo:
        raise WorkloadError(f"{where}: max ({hi}) is below min ({lo})")
    return Turns(lo, hi, med, sig)


def _memory(a: dict, where: str) -> tuple[int, int]:
    """``mem_mb``: a number (peak and mean alike) or ``{ peak = ..., mean = ... }``."""
    v = a.get("mem_mb", 0)
    if isinstance(v, dict):
        _check_keys(v, {"peak", "mean"}, f"{where}.mem_mb")
        peak = _get(v, "peak", f"{where}.mem_mb", int, nonneg=True)
        mean = _get(v, "mean", f"{where}.mem_mb", int, peak, nonneg=True)
        if mean > peak:
            raise WorkloadError(f"{where}.mem_mb: mean ({mean}) is above peak ({peak})")
        return peak, mean
    peak = _get(a, "mem_mb", where, int, 0, nonneg=True)
    return peak, peak


def _followups(v: Any, where: str) -> tuple[Followup, ...]:
    if not isinstance(v, list):
        raise WorkloadError(f"{where}.followups: expected a list of {{ action = ..., probability = ... }}")
    out = []
    for k, f in enumerate(v):
        w = f"{where}.followups[{k}]"
        if not isinstance(f, dict):
            raise WorkloadError(f"{w}: expected {{ action = ..., probability = ... }}")
        _check_keys(f, {"action", "probability"}, w)
        prob = _get(f, "probability", w, float, positive=True)
        if prob > 1:
            raise WorkloadError(f"{w}.probability: must be within 0..1, got {prob}")
        out.append(Followup(_get(f, "action", w, str), prob))
    return tuple(out)


def _check_followups(actions: list[ActionClass]) -> None:
    names = {a.name for a in actions}
    for i, a in enumerate(actions):
        where = f"actions[{i}] ({a.name}).followups"
        for f in a.followups:
            if f.action not in names:
                raise WorkloadError(f"{where}: unknown action {f.action!r}")
            if f.action == a.name:
                raise WorkloadError(f"{where}: an action cannot follow itself")
            if any(g.followups for g in actions if g.name == f.action):
                raise WorkloadError(f"{where}: {f.action!r} has follow-ups of its own (one level only)")


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
    if ver not in _READABLE_VERSIONS:
        raise WorkloadError(f"{source}: format_version {ver!r} is not supported (this reader knows "
                            f"{', '.join(map(str, _READABLE_VERSIONS))})")
    name = _get(data, "name", source, str)
    desc = _get(data, "description", source, str, "")
    seed = _get(data, "seed", source, int, 0, nonneg=True)

    ro = data.get("rollout")
    if not isinstance(ro, dict):
        raise WorkloadError(f"{source}: missing [rollout] table")
    _check_keys(ro, {"steps", "trajectories_per_step", "turns", "think_s", "train_s", "sync_turns",
                     "parallel_finals"}, "rollout")
    rollout = Rollout(
        steps=_get(ro, "steps", "rollout", int, positive=True),
        trajectories_per_step=_get(ro, "trajectories_per_step", "rollout", int, positive=True),
        turns=_turns(ro.get("turns")), think_s=_dist(ro, "think_s", "rollout"),
        train_s=_get(ro, "train_s", "rollout", float, 0.0, nonneg=True),
        sync_turns=_get(ro, "sync_turns", "rollout", bool, False),
        parallel_finals=_get(ro, "parallel_finals", "rollout", bool, False))

    cl = data.get("cluster")
    if not isinstance(cl, dict):
        raise WorkloadError(f"{source}: missing [cluster] table")
    _check_keys(cl, {"cpu_workers", "cpu_cores", "cpu_mem_mb", "gpu_workers", "gpus", "gpu_mem_mb",
                     "gpu_slots", "startup_s", "idle_ttl_s", "env_move_s"}, "cluster")
    cluster = Cluster(
        cpu_workers=_get(cl, "cpu_workers", "cluster", int, nonneg=True),
        cpu_cores=_get(cl, "cpu_cores", "cluster", int, positive=True),
        cpu_mem_mb=_get(cl, "cpu_mem_mb", "cluster", int, 0, nonneg=True),
        gpu_workers=_get(cl, "gpu_workers", "cluster", int, 0, nonneg=True),
        gpus=_get(cl, "gpus", "cluster", int, 0, nonneg=True),
        gpu_mem_mb=_get(cl, "gpu_mem_mb", "cluster", int, 0, nonneg=True),
        gpu_slots=_get(cl, "gpu_slots", "cluster", int, 0, nonneg=True),
        startup_s=_get(cl, "startup_s", "cluster", float, 60.0, nonneg=True),
        idle_ttl_s=_get(cl, "idle_ttl_s", "cluster", float, 300.0, nonneg=True),
        env_move_s=_get(cl, "env_move_s", "cluster", float, 10.0, nonneg=True))
    if cluster.gpu_workers and not (cluster.gpus and cluster.gpu_mem_mb and cluster.gpu_slots):
        raise WorkloadError("cluster: gpu_workers > 0 needs gpus, gpu_mem_mb and gpu_slots")

    services: dict[str, Service] = {}
    for i, s in enumerate(data.get("services", [])):
        where = f"services[{i}]"
        if not isinstance(s, dict):
            raise WorkloadError(f"{where}: expected a table")
        _check_keys(s, {"name", "gpu_mem_mb", "load_s", "batchable", "max_batch", "batch_slowdown"}, where)
        svc = Service(_get(s, "name", where, str), _get(s, "gpu_mem_mb", where, int, positive=True),
                      _get(s, "load_s", where, float, nonneg=True), _get(s, "batchable", where, bool, True),
                      _get(s, "max_batch", where, int, 0, nonneg=True),
                      _get(s, "batch_slowdown", where, float, 0.0, nonneg=True))
        if not svc.batchable and svc.max_batch > 1:
            raise WorkloadError(f"{where}: a service that is not batchable cannot have max_batch {svc.max_batch}")
        if svc.name in services:
            raise WorkloadError(f"{where}: duplicate service name {svc.name!r}")
        budget = int(cluster.gpu_mem_mb * GPU_MEMORY_SHARE)
        if cluster.gpu_workers and svc.gpu_mem_mb > budget:
            # a replica lives on one GPU, within the share of it the live service manager uses
            raise WorkloadError(f"{where}: {svc.name} needs {svc.gpu_mem_mb} MB, more than one GPU's budget "
                                f"({GPU_MEMORY_SHARE:.0%} of {cluster.gpu_mem_mb} MB = {budget} MB)")
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
                        "max_cores", "mem_mb", "service", "uses_env", "hint", "hint_sigma", "timeout_s",
                        "followups"}, where)
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
        if kind != "reward" and svc is not None:
            raise WorkloadError(f"{where}.service: only reward actions call a service (this one is {kind})")
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
        peak, mean = _memory(a, where)
        if not svc and cluster.cpu_mem_mb and peak > cluster.cpu_mem_mb:
            raise WorkloadError(f"{where}: mem_mb {peak} exceeds a CPU worker's {cluster.cpu_mem_mb} MB")
        hint_sigma = _get(a, "hint_sigma", where, float, 0.0, nonneg=True)
        if hint_sigma > 3:
            raise WorkloadError(f"{where}.hint_sigma: {hint_sigma} is implausibly large (at most 3)")
        timeout = _get(a, "timeout_s", where, float, None, positive=True)
        ac = ActionClass(
            name=nm, kind=kind, duration_s=_dist(a, "duration_s", where),
            weight=_get(a, "weight", where, float, 0.0, nonneg=True),
            final=_get(a, "final", where, int, 0, nonneg=True), parallel_fraction=pf,
            min_cores=mn, max_cores=min(mx, limit), mem_mb=peak, mem_mean_mb=mean,
            service=svc, uses_env=_get(a, "uses_env", where, bool, kind == "sandbox"),
            hint=_get(a, "hint", where, bool, hint_sigma > 0), hint_sigma=hint_sigma, timeout_s=timeout,
            followups=_followups(a.get("followups", []), where))
        actions.append(ac)
    _check_followups(actions)
    for i, ac in enumerate(actions):
        referenced = any(f.action == ac.name for b in actions for f in b.followups)
        if ac.weight == 0 and ac.final == 0 and not referenced:
            raise WorkloadError(f"actions[{i}] ({ac.name}): neither a per-turn weight, a final count nor a "
                                f"follow-up of another action: it would never run")
    if rollout.turns.min == 0 and not any(a.final for a in actions):
        raise WorkloadError("rollout.turns may be 0 and no action is a final one: a trajectory would have no "
                            "action (give turns a min of 1, or a final action)")
    if rollout.turns.max > 0 and not any(a.weight > 0 for a in actions):
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
