"""The unified action-level formulation.

Every external call an agentic-RL rollout makes -- a command in a stateful
sandbox, a reward-model call, a plain Python function, or any kind a user
registers -- is one :class:`ActionSpec`: a resource kind, a demand, the
environment it must run in and an opaque payload.  The scheduler only ever
looks at the kind, the demand, the environment and the hints; the payload is
for the worker-side manager that executes the action.

Wire form: specs travel as msgpack maps with short keys and defaults left out,
so a no-op function action costs a few dozen bytes on the dispatch path.
:func:`ActionSpec.from_wire` is the single place a spec from the network is
validated.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

from .errors import ActionFailed, ValidationError

__all__ = [
    "ActionSpec",
    "ActionResult",
    "Demand",
    "Status",
    "EnvState",
    "ValidationError",
    "BUILTIN_KINDS",
    "register_kind",
    "known_kinds",
    "sandbox",
    "function",
    "reward",
]

#: Kinds every worker understands.  ``sandbox``: a shell command in a stateful
#: environment; ``reward``: a call to a named reward-model service;
#: ``function``: an importable Python callable ``"module:qualname"``.
BUILTIN_KINDS = ("sandbox", "reward", "function")
_extra_kinds: set[str] = set()
_KIND_RE = re.compile(r"^[a-z][a-z0-9_.-]{0,31}$")
ID_MAX = 128
#: A MiB figure past this overflows the byte counts the kernel takes (a cgroup limit).
_MEM_MAX_MB = 1 << 40
_LABEL_MAX = 256


def is_kind_name(kind: str) -> bool:
    """Whether ``kind`` may name an action kind (what :func:`register_kind` accepts)."""
    return bool(_KIND_RE.match(kind))


def register_kind(kind: str) -> None:
    """Allow a user-defined action kind (its worker-side handler is registered on the worker)."""
    if not is_kind_name(kind):
        raise ValidationError(f"invalid kind name {kind!r}: lowercase letters, digits, '_', '.', '-'")
    _extra_kinds.add(kind)


def known_kinds() -> tuple[str, ...]:
    return BUILTIN_KINDS + tuple(sorted(_extra_kinds))


def new_action_id() -> str:
    return os.urandom(12).hex()


@dataclass(slots=True, frozen=True)
class Demand:
    """What an action needs to run, and how much more it can use.

    ``min_cores..max_cores`` is the elastic range: the scheduler grants a
    count in it (more when cores are idle and the action speeds up with
    them).  ``gpu_mem_mb`` and ``service`` describe a reward-model call: the
    named service must be resident on a GPU with that much memory.
    """

    min_cores: int = 1
    max_cores: int = 1
    mem_mb: int = 0
    gpu_mem_mb: int = 0
    service: str | None = None

    def __post_init__(self) -> None:
        for name in ("min_cores", "max_cores", "mem_mb", "gpu_mem_mb"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValidationError(f"demand.{name} must be a non-negative integer, got {v!r}")
        if self.max_cores < self.min_cores:
            raise ValidationError(
                f"demand.max_cores ({self.max_cores}) is below min_cores ({self.min_cores})")
        if self.max_cores > 4096:
            raise ValidationError("demand.max_cores above 4096")
        if self.mem_mb > _MEM_MAX_MB or self.gpu_mem_mb > _MEM_MAX_MB:
            raise ValidationError(f"demand.mem_mb and gpu_mem_mb must be at most {_MEM_MAX_MB} MiB (2**40)")
        if self.service is not None and (not isinstance(self.service, str) or not 0 < len(self.service) <= ID_MAX):
            raise ValidationError("demand.service must be a non-empty string of at most 128 characters")


_DEFAULT_DEMAND = Demand()

#: Demands decoded from the wire, by value.  A client sends a handful of distinct demands, so
#: its specs share one checked ``Demand`` each: no validation or allocation per action, and the
#: scheduler's fit memo finds them by identity.  Bounded, as a client may send any number.
WIRE_DEMANDS_KEPT = 1024
_wire_demands: dict[tuple, Demand] = {}


def _demand_from_wire(d: Any) -> Demand:
    if not isinstance(d, (list, tuple)) or len(d) != 5:
        raise ValidationError("demand must be [min_cores, max_cores, mem_mb, gpu_mem_mb, service]")
    lo, hi, mem, gpu, svc = d
    # only exact ints and strings are looked up: True == 1 and 1.0 == 1 as keys, but not as demands
    if not (type(lo) is int and type(hi) is int and type(mem) is int and type(gpu) is int
            and (svc is None or type(svc) is str)):
        return Demand(lo, hi, mem, gpu, svc)        # refuses it, with the reason
    key = (lo, hi, mem, gpu, svc)
    demand = _wire_demands.get(key)
    if demand is None:
        demand = _keep(_wire_demands, key, Demand(lo, hi, mem, gpu, svc), WIRE_DEMANDS_KEPT)
    return demand


def _keep(cache: dict, key: Any, value: Any, kept: int) -> Any:
    """Add ``value`` to one of the caches of values decoded from the wire, shared by the actions that
    carry the same (emptied whole when it holds ``kept``, as a client may send any number)."""
    if len(cache) >= kept:
        cache.clear()
    cache[key] = value
    return value


#: Payload summaries, one per distinct summary.  Bounded, as a client may send any number of programs.
PAYLOAD_SUMMARIES_KEPT = 4096
_payload_summaries: dict[tuple, dict] = {}


def payload_summary(payload: Any) -> dict | None:
    """What a coordinator keeps of an action's payload while it keeps the action itself as it was sent
    (packed, for the worker): the fields its scheduler classes actions by (``feature_key`` in
    ``policy/predict.py``: a command's program and first argument, else a function's target), in one
    dict shared by every action with the same.  ``tests/test_ledger.py`` checks that the classes
    come out the same."""
    if not isinstance(payload, dict):
        return None
    key: tuple = ()
    cmd = payload.get("cmd")
    words = cmd.split(None, 2) if isinstance(cmd, str) else None
    if words:
        key = ("cmd", " ".join(words[:2]))
    else:
        fn = payload.get("fn")
        if isinstance(fn, str):
            key = ("fn", fn)
    summary = _payload_summaries.get(key)
    if summary is None:
        summary = _keep(_payload_summaries, key, dict([key]) if key else {}, PAYLOAD_SUMMARIES_KEPT)
    return summary


@dataclass(slots=True)
class ActionSpec:
    """One external call of an RL rollout.

    Parameters
    ----------
    kind: ``"sandbox"``, ``"reward"``, ``"function"`` or a registered kind.
    payload: what the worker-side manager needs (msgpack-serialisable):
        sandbox ``{"cmd": "pytest -x", "stdin": ..., "environ": {"VAR": "value"}}``;
        function ``{"fn": "pkg.mod:func", "args": [...], "kwargs": {...}}``;
        reward ``{"inputs": [...]}`` (the service is ``demand.service``).
    env: id of the stateful environment (sandbox) the action must run in; all
        actions of one env run on the worker that hosts it.
    demand: cores (elastic range), memory, GPU memory, GPU service.
    duration_hint: the caller's guess of the run time in seconds at
        ``min_cores``, or None; the scheduler learns durations online anyway.
    timeout: seconds the action may run before it is killed (None: worker default).
    priority: higher runs first among waiting actions; waiting time also ages
        actions so nothing starves.
    trajectory, step: the rollout and RL step the action belongs to (for
        accounting and scheduling across a step).
    label: the action's class for duration learning (e.g. ``"pytest"``,
        ``"compile"``); defaults to kind/service.
    idempotency_key: the coordinator returns the first result for a key
        instead of running it again.
    id: unique id, generated by the client when not given.
    """

    kind: str
    payload: Any = None
    env: str | None = None
    demand: Demand = _DEFAULT_DEMAND
    duration_hint: float | None = None
    timeout: float | None = None
    priority: int = 0
    trajectory: str | None = None
    step: int | None = None
    label: str | None = None
    idempotency_key: str | None = None
    id: str = field(default_factory=new_action_id)

    @property
    def action_class(self) -> str:
        """Key under which durations are learned."""
        if self.label:
            return f"{self.kind}:{self.label}"
        if self.demand.service:
            return f"{self.kind}:{self.demand.service}"
        return self.kind

    # -- wire form ---------------------------------------------------------
    def to_wire(self) -> dict:
        w: dict[str, Any] = {"i": self.id, "k": self.kind}
        if self.payload is not None:
            w["p"] = self.payload
        if self.env is not None:
            w["e"] = self.env
        d = self.demand
        if d is not _DEFAULT_DEMAND and d != _DEFAULT_DEMAND:
            w["d"] = [d.min_cores, d.max_cores, d.mem_mb, d.gpu_mem_mb, d.service]
        if self.duration_hint is not None:
            w["h"] = self.duration_hint
        if self.timeout is not None:
            w["t"] = self.timeout
        if self.priority:
            w["r"] = self.priority
        if self.trajectory is not None:
            w["j"] = self.trajectory
        if self.step is not None:
            w["s"] = self.step
        if self.label is not None:
            w["l"] = self.label
        if self.idempotency_key is not None:
            w["x"] = self.idempotency_key
        return w

    @classmethod
    def from_wire(cls, w: Any) -> "ActionSpec":
        """Build a spec from its wire map, rejecting anything off-schema."""
        if not isinstance(w, dict):
            raise ValidationError("action spec must be a map")
        unknown = w.keys() - _WIRE_KEYS
        if unknown:
            raise ValidationError(f"unknown action fields {sorted(map(str, unknown))}")
        aid = w.get("i")
        if not isinstance(aid, str) or not 0 < len(aid) <= ID_MAX:
            raise ValidationError("action id must be a non-empty string of at most 128 characters")
        kind = w.get("k")
        if not isinstance(kind, str) or (kind not in BUILTIN_KINDS and kind not in _extra_kinds):
            raise ValidationError(f"unknown action kind {kind!r}; known: {', '.join(known_kinds())}")
        env = _opt_str(w, "e", "env")
        demand = _DEFAULT_DEMAND
        if "d" in w:
            demand = _demand_from_wire(w["d"])
            if kind == "sandbox":
                check_sandbox_cores(demand.min_cores)
        hint = _opt_num(w, "h", "duration_hint")
        if hint is not None:    # a class's actions share one hint, and a float each is 24 B of a queued action
            hint = _hints.get(hint) or _keep(_hints, hint, hint, WIRE_DEMANDS_KEPT)
        timeout = _opt_num(w, "t", "timeout")
        if timeout is not None and timeout <= 0:
            raise ValidationError("timeout must be positive")
        prio = w.get("r", 0)
        if not isinstance(prio, int) or isinstance(prio, bool) or not -(2**31) <= prio < 2**31:
            raise ValidationError("priority must be a 32-bit integer")
        step = w.get("s")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise ValidationError("step must be an integer")
        return cls(
            kind=kind, payload=w.get("p"), env=env, demand=demand, duration_hint=hint,
            timeout=timeout, priority=prio, trajectory=_opt_str(w, "j", "trajectory"), step=step,
            label=_opt_str(w, "l", "label", _LABEL_MAX), idempotency_key=_opt_str(w, "x", "idempotency_key"),
            id=aid,
        )


_hints: dict[float, float] = {}      # duration hints decoded from the wire, by value (bounded)


def check_sandbox_cores(min_cores: int) -> None:
    """Refuse a zero-core sandbox: a zero-core action is pinned to no core and pipelined by the
    hundred, which for a sandbox would be untrusted code on every core of its worker, beside the
    actions those cores are granted to."""
    if min_cores == 0:
        raise ValidationError("a sandbox action binds at least one core (min_cores >= 1); zero-core (light) "
                              "actions are functions")

# "a": a resubmission's age, seconds since the client first submitted it (the ledger reads it)
_WIRE_KEYS = frozenset("ikpedhtrjslxa")


def _opt_str(w: dict, key: str, name: str, limit: int = ID_MAX) -> str | None:
    v = w.get(key)
    if v is None:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= limit:
        raise ValidationError(f"{name} must be a non-empty string of at most {limit} characters")
    return v


def _opt_num(w: dict, key: str, name: str) -> float | None:
    v = w.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v or v < 0 or v > 1e9:
        raise ValidationError(f"{name} must be a number of seconds from 0 to 1e9 (about 32 years), got {v!r:.40}")
    return float(v)


class Status(str, Enum):
    """Final states of an action.

    A ``str`` enum: members equal their values (``Status.OK == "ok"``), print as them, and go
    over the wire as plain strings; results read back from the wire carry the plain strings.
    """

    OK = "ok"            # ran and returned
    FAILED = "failed"    # ran and raised / exited non-zero
    TIMEOUT = "timeout"  # killed at its timeout
    CANCELLED = "cancelled"
    ERROR = "error"      # could not be run: rejected, retries exhausted, no capable worker
    ENV_LOST = "env_lost"  # its environment's state cannot be reached any more (docs/reliability.md)

    __str__ = str.__str__        # "ok", not "Status.OK", in messages and f-strings
    if TYPE_CHECKING:
        FINAL: ClassVar[frozenset[Status]]
    __format__ = str.__format__  # type: ignore[assignment]


Status.FINAL = frozenset(Status)  # every status is final; kept as a set for membership tests of wire values


class EnvState(str, Enum):
    """What an action's final attempt found in its environment (``ActionResult.env_state``)."""

    CREATED = "created"      # a new, empty environment was made for it
    KEPT = "kept"            # it ran in the live copy where the environment already was
    LIVE = "live"            # ... beside the processes its earlier actions left running there (a live session)
    RESTORED = "restored"    # the environment was restored here from its snapshot first
    ADOPTED = "adopted"      # taken over from the directory of a worker that died
    REPLAYED = "replayed"    # not run again: the environment's journal held its outcome

    __str__ = str.__str__
    if TYPE_CHECKING:
        ALL: ClassVar[frozenset[EnvState]]
    __format__ = str.__format__  # type: ignore[assignment]


EnvState.ALL = frozenset(EnvState)


@dataclass(slots=True)
class ActionResult:
    """The one final outcome of an action.

    Times are coordinator wall-clock seconds (``time.time()``): ``submitted``
    when the coordinator accepted it, ``started``/``finished`` as reported by
    the worker that ran the final attempt (``started``: when its command
    began, after its environment was created or restored).  ``act`` is the
    action completion time the scheduler minimises.
    """

    id: str
    status: str
    output: Any = None
    error: str | None = None
    submitted: float = 0.0
    started: float = 0.0
    finished: float = 0.0
    worker: str | None = None
    cores: int = 0
    attempts: int = 0
    env_state: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    @property
    def act(self) -> float:
        """Action completion time: finish minus submit."""
        return max(0.0, self.finished - self.submitted)

    @property
    def queued(self) -> float:
        """Submit to the command's start: the wait for cores, then for its environment to be
        created or restored."""
        return max(0.0, self.started - self.submitted) if self.started else self.act

    def to_wire(self) -> list:
        return [self.id, self.status, self.output, self.error, self.submitted, self.started,
                self.finished, self.worker, self.cores, self.attempts, self.env_state]

    @classmethod
    def from_wire(cls, w: Any) -> "ActionResult":
        if not isinstance(w, (list, tuple)) or len(w) != 11:
            raise ValidationError("result must be a list of 11 fields")
        if not isinstance(w[0], str) or not isinstance(w[1], str) or w[1] not in Status.FINAL:
            raise ValidationError("result has a bad id or status")
        if w[10] is not None and (not isinstance(w[10], str) or w[10] not in EnvState.ALL):
            raise ValidationError(f"result has an unknown env_state {w[10]!r}")
        return cls(*w)

    def raise_for_status(self) -> Any:
        """Return the output, or raise :class:`ActionFailed` with the error."""
        if self.status != Status.OK:
            raise ActionFailed(self)
        return self.output


# -- constructors for the common kinds ---------------------------------------

def _cores(cores: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(cores, tuple):
        return cores
    return cores, cores


def sandbox(cmd: str | list[str], *, env: str | None = None, cores: int | tuple[int, int] = 1,
            mem_mb: int = 0, stdin: str | None = None, files: dict[str, str] | None = None,
            environ: dict[str, str] | None = None, template: str | None = None, limits: dict | None = None,
            **kw: Any) -> ActionSpec:
    """A command in a (stateful, if ``env`` is given) sandbox; ``cores=(1, 8)`` lets it grow to 8.

    ``environ``: variables for the command; ``template``: what a new environment is made from;
    ``limits``: :class:`~tangram_hpc.managers.limits.Limits` fields to override (docs/sandbox.md).
    """
    lo, hi = _cores(cores)
    check_sandbox_cores(lo)
    payload: dict[str, Any] = {"cmd": cmd}
    if stdin is not None:
        payload["stdin"] = stdin
    if files:
        payload["files"] = files
    if environ:
        payload["environ"] = environ
    if template is not None:
        payload["template"] = template
    if limits:
        payload["limits"] = limits
    return ActionSpec(kind="sandbox", payload=payload, env=env, demand=Demand(lo, hi, mem_mb), **kw)


def run_cells(cells: str | list[str], *, env: str | None = None, cell_timeout: float = 0,
              total_timeout: float = 45, files: dict[str, str] | None = None, fetch_files: list[str] | None = None,
              template: str | None = None, cores: int | tuple[int, int] = 1, **kw: Any) -> ActionSpec:
    """Python cells in the stateful kernel of environment ``env`` (SandboxFusion's run_jupyter shape).

    Variables set by one action's cells are there for the next action's where the environment's
    processes are kept; the output's ``kernel.restarted`` says when they were not (docs/sandbox.md,
    "Kernel mode").  ``cell_timeout`` (0: none) interrupts a cell and keeps the kernel;
    ``total_timeout`` bounds all of them; ``files`` are base64, as in run_code.
    """
    lo, hi = _cores(cores)
    check_sandbox_cores(lo)
    payload: dict[str, Any] = {"cells": [cells] if isinstance(cells, str) else list(cells),
                               "cell_timeout": cell_timeout, "total_timeout": total_timeout}
    if files:
        payload["files"] = files
    if fetch_files:
        payload["fetch_files"] = fetch_files
    if template is not None:
        payload["template"] = template
    kw.setdefault("label", "run_jupyter")
    # beyond the cells: starting the kernel, killing a cell that ignores its interrupt, the environment
    kw.setdefault("timeout", total_timeout + 75.0)
    return ActionSpec(kind="sandbox", payload=payload, env=env, demand=Demand(lo, hi), **kw)


def function(fn: Any, *args: Any, cores: int | tuple[int, int] = 1, **kwargs: Any) -> ActionSpec:
    """Call an importable function on a worker: ``function("pkg.mod:score", x)`` or ``function(score, x)``.

    Keyword arguments go to the function; pass ActionSpec fields (``timeout``,
    ``label``, ...) through ``ActionSpec`` directly when they are needed.
    """
    if callable(fn):
        fn = f"{fn.__module__}:{fn.__qualname__}"
    lo, hi = _cores(cores)
    payload: dict[str, Any] = {"fn": fn}
    if args:
        payload["args"] = list(args)
    if kwargs:
        payload["kwargs"] = kwargs
    return ActionSpec(kind="function", payload=payload, demand=Demand(lo, hi))


def reward(service: str, inputs: list, *, gpu_mem_mb: int = 0, **kw: Any) -> ActionSpec:
    """Score ``inputs`` with the named reward-model service."""
    return ActionSpec(kind="reward", payload={"inputs": inputs},
                      demand=Demand(0, 0, 0, gpu_mem_mb, service), **kw)
