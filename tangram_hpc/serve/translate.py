"""HTTP bodies to actions and results to HTTP replies: pure functions, no sockets.

``/run_code`` speaks SandboxFusion's shapes (its ``RunCodeRequest`` and
``RunCodeResponse``), so its real client and verl's reward utility work
unchanged.  Errors follow the real server (FastAPI): a field that fails
validation is HTTP 422 with ``{"detail": [{"type", "loc": ["body", field],
"msg", "input"}]}``; an unknown language is one of them.  On top of it:

* back-pressure is HTTP 429 (this service's own in-flight limit) or 503 (the
  coordinator refused the action for load), both with ``Retry-After``; such a
  request was not run, so retrying it is safe;
* an optional ``"tangram"`` object in the body places the action: ``env`` (a
  stateful environment instead of a throw-away one), ``cores`` (N or
  ``[min, max]``), ``priority``, ``trajectory``, ``step``.  The real
  SandboxFusion server ignores fields it does not know, and so does this one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..actions import ActionResult, ActionSpec, Demand, Status, ValidationError, check_sandbox_cores
from ..errors import TangramError
from ..integrations.batching import reward_item
from ..managers.sandboxfusion import (DRIVER_GRACE_S, RUN_CODE_FIELDS, RUN_JUPYTER_FIELDS, RunCodeError,
                                      parse_run_code, parse_run_jupyter, utf8)

__all__ = ["Reply", "run_code_spec", "run_jupyter_spec", "run_code_reply", "RUN_JUPYTER_EMPTY", "invalid_reply", "busy_reply", "openrlhf_items", "FieldError",
           "refused_for_load", "unknown_service", "EXTENSION_KEY"]

#: The body key of tangram's own placement fields.
EXTENSION_KEY = "tangram"
_EXTENSION_FIELDS = frozenset({"env", "cores", "priority", "trajectory", "step"})
#: Seconds an action may run beyond its compile and run timeouts (environment set-up,
#: files, queueing on the worker) before the coordinator gives up on it.
ACTION_GRACE_S = 60.0

# The coordinator's and the client's wording of refusals (tangram_hpc/coordinator.py, client.py).
_LOAD_REFUSAL = "rejected: too many unfinished actions"
_SIZE_REFUSAL = "rejected: the action is"
# The worker's wording of a request it refuses (managers/sandbox.py, managers/environments.py) and
# the placement's for a service no worker hosts (policy/placement.py).
_BAD_PAYLOAD = "bad sandbox payload: "
_UNKNOWN_TEMPLATE = "unknown template "
_NO_SERVICE = ("is hosted by no worker", "no registered worker hosts it")

#: The result fields of a response that has none (``run_code_reply``'s ``empty``).
RUN_CODE_EMPTY: dict[str, Any] = {"compile_result": None, "run_result": None}
RUN_JUPYTER_EMPTY: dict[str, Any] = {"driver": None, "cells": []}


class FieldError(TangramError, ValueError):
    """A bad field of a /reward body (run_code bodies raise :class:`RunCodeError`, alike)."""

    def __init__(self, field_name: str, problem: str, value: Any = None, kind: str = "value_error"):
        self.field, self.problem, self.value, self.kind = field_name, problem, value, kind
        super().__init__(f"{field_name}: {problem}")


@dataclass(frozen=True, slots=True)
class Reply:
    """What to answer: HTTP status, a JSON-ready body, extra headers."""

    status: int
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)


def invalid_reply(err: RunCodeError | FieldError) -> Reply:
    """HTTP 422 in FastAPI's shape, naming the field."""
    loc: list[Any] = ["body", *err.field.split(".", 1)] if err.field else ["body"]
    detail = {"type": err.kind, "loc": loc, "msg": err.problem, "input": _small(err.value)}
    return Reply(422, {"detail": [detail]})


def busy_reply(status: int, why: str, retry_after_s: int) -> Reply:
    return Reply(status, {"detail": why}, {"Retry-After": str(max(1, int(retry_after_s)))})


def run_code_spec(body: Any) -> ActionSpec:
    """The sandbox action for one ``/run_code`` body; raises :class:`RunCodeError`."""
    if not isinstance(body, Mapping):
        raise RunCodeError("", "the body must be a JSON object", kind="model_attributes_type")
    payload = {k: v for k, v in body.items() if k in RUN_CODE_FIELDS}
    req = parse_run_code(payload, check_tools=False)
    place = _extension(body.get(EXTENSION_KEY))
    lo, hi = place.get("cores", (1, 1))
    try:
        demand = Demand(lo, hi, req.memory_mb or 0)
        check_sandbox_cores(lo)
    except ValidationError as e:
        raise RunCodeError(f"{EXTENSION_KEY}.cores", str(e), [lo, hi]) from None
    return ActionSpec(
        kind="sandbox", payload=payload, env=place.get("env"), demand=demand,
        timeout=req.compile_timeout + req.run_timeout + ACTION_GRACE_S,
        priority=place.get("priority", 0), trajectory=place.get("trajectory"), step=place.get("step"),
        # Durations are learned per language: a Java build is not a Python one-liner.
        label=f"run_code:{req.language}",
    )


def run_jupyter_spec(body: Any) -> ActionSpec:
    """The sandbox action for one ``/run_jupyter`` body: its cells in the kernel of the environment
    (``tangram.env``: one kept across requests; without it a throw-away one, so a new kernel per
    request, as SandboxFusion does); raises :class:`RunCodeError`."""
    if not isinstance(body, Mapping):
        raise RunCodeError("", "the body must be a JSON object", kind="model_attributes_type")
    payload = {k: v for k, v in body.items() if k in RUN_JUPYTER_FIELDS}
    if "cells" not in payload:
        raise RunCodeError("cells", "field required", kind="missing")
    req = parse_run_jupyter(payload)
    place = _extension(body.get(EXTENSION_KEY))
    lo, hi = place.get("cores", (1, 1))
    try:
        demand = Demand(lo, hi, 0)
        check_sandbox_cores(lo)
    except ValidationError as e:
        raise RunCodeError(f"{EXTENSION_KEY}.cores", str(e), [lo, hi]) from None
    return ActionSpec(
        kind="sandbox", payload=payload, env=place.get("env"), demand=demand,
        timeout=req.total_timeout + DRIVER_GRACE_S + ACTION_GRACE_S,
        priority=place.get("priority", 0), trajectory=place.get("trajectory"), step=place.get("step"),
        label="run_jupyter",
    )


def _extension(ext: Any) -> dict[str, Any]:
    if ext is None:
        return {}
    if not isinstance(ext, Mapping):
        raise RunCodeError(EXTENSION_KEY, "must be an object", ext)
    unknown = sorted(map(str, set(ext) - _EXTENSION_FIELDS))
    if unknown:
        raise RunCodeError(f"{EXTENSION_KEY}.{unknown[0]}",
                           f"unknown field; known: {', '.join(sorted(_EXTENSION_FIELDS))}", kind="extra_forbidden")
    out: dict[str, Any] = {}
    for name in ("env", "trajectory"):
        v = ext.get(name)
        if v is not None:
            if not isinstance(v, str) or not 0 < len(v) <= 128:
                raise RunCodeError(f"{EXTENSION_KEY}.{name}", "must be a string of 1 to 128 characters", v)
            utf8(f"{EXTENSION_KEY}.{name}", v)
            out[name] = v
    for name in ("priority", "step"):
        v = ext.get(name)
        if v is not None:
            if not _int(v) or not -(2**31) <= v < 2**31:
                raise RunCodeError(f"{EXTENSION_KEY}.{name}", "must be a 32-bit integer", v)
            out[name] = v
    cores = ext.get("cores")
    if cores is not None:
        if _int(cores):
            cores = [cores, cores]
        if not (isinstance(cores, list) and len(cores) == 2 and all(_int(c) for c in cores)):
            raise RunCodeError(f"{EXTENSION_KEY}.cores", "must be an integer or [min, max]", cores)
        out["cores"] = tuple(cores)
    return out


def refused_for_load(res: ActionResult | None) -> bool:
    """Whether the coordinator refused the action because too many are unfinished (retry later)."""
    return res is not None and res.status == Status.ERROR and (res.error or "").startswith(_LOAD_REFUSAL)


def unknown_service(res: ActionResult | None) -> bool:
    """Whether the action named a reward service that no worker of the run hosts."""
    return res is not None and res.status == Status.ERROR and any(p in (res.error or "") for p in _NO_SERVICE)


def run_code_reply(res: ActionResult, retry_after_s: int = 1, empty: Mapping[str, Any] = RUN_CODE_EMPTY) -> Reply:
    """The HTTP reply for a finished run_code (or run_jupyter: ``empty=RUN_JUPYTER_EMPTY``) action.

    Success and Failed are HTTP 200 with the response the worker built; a
    request only the worker can judge (its toolchains, its templates) and
    that it refused is HTTP 422 as if serve had; anything else the sandbox
    could not do is HTTP 200 with ``SandboxError`` and the reason, as
    SandboxFusion answers its own internal errors.
    """
    out = res.output
    if res.status == Status.OK and isinstance(out, dict) and "status" in out:
        return Reply(200, out | {"executor_pod_name": res.worker})
    error = res.error or ""
    if refused_for_load(res):
        return busy_reply(503, error, retry_after_s)
    if res.status == Status.ERROR and error.startswith(_BAD_PAYLOAD):
        name, _, problem = error[len(_BAD_PAYLOAD):].partition(": ")
        return invalid_reply(RunCodeError(name, problem or name))
    if res.status == Status.ERROR and _UNKNOWN_TEMPLATE in error:
        return invalid_reply(RunCodeError("template", error[error.index(_UNKNOWN_TEMPLATE):]))
    if res.status == Status.ERROR and error.startswith(_SIZE_REFUSAL):
        return Reply(413, {"detail": error})
    if isinstance(out, dict) and out.get("status") == "SandboxError":
        return Reply(200, out | {"executor_pod_name": res.worker})
    message = f"action {res.status}: {error}" if error else f"action {res.status}"
    return Reply(200, {"status": "SandboxError", "message": message, **empty, "executor_pod_name": res.worker,
                       "files": {}})


def openrlhf_items(body: Any) -> list[dict]:
    """Reward inputs of an OpenRLHF remote-RM request ``{"query": [...], "prompts": [...], "labels": [...]}``.

    A query is the prompt followed by the response (OpenRLHF decodes both
    together); the response alone is what the service scores against the label.
    """
    if not isinstance(body, Mapping):
        raise FieldError("", "the body must be a JSON object", kind="model_attributes_type")
    queries = body.get("query")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise FieldError("query", "must be a list of strings", _small(queries))
    n = len(queries)
    lists = {}
    for name in ("prompts", "labels"):
        v = body.get(name)
        if v is None:
            v = [""] * n
        if not isinstance(v, list) or len(v) != n:
            raise FieldError(name, f"must be a list as long as query ({n})", _small(v))
        lists[name] = v
    items = []
    for q, p, label in zip(queries, lists["prompts"], lists["labels"]):
        response = q[len(p):] if isinstance(p, str) and p and q.startswith(p) else q
        items.append(reward_item(response, label if label is not None else "", prompt=p if isinstance(p, str) else ""))
    return items


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _small(v: Any) -> Any:
    """The offending input, echoed as FastAPI does, but never a large blob."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, (str, bytes)) and len(v) > 200:
        return f"{v[:200]!r}..."
    if isinstance(v, (list, dict)) and len(repr(v)) > 200:
        return f"{type(v).__name__} of {len(v)} items"
    return v if isinstance(v, (int, float, str, bool, list, dict)) or v is None else repr(v)
