"""Worker-side handlers that run one action of a kind on the cores it was given.

A handler is called in one of the worker's executor threads as
``handler(spec, cpus) -> (status, output, error)``.  The executor thread is
already pinned to ``cpus``, and a child process forked from it inherits that
mask, so every handler gets CPU affinity for free.
"""
from __future__ import annotations

import importlib
import traceback
from typing import Any, Callable

from .actions import ActionSpec, Status

Outcome = tuple[str, Any, "str | None"]
Handler = Callable[[ActionSpec, list[int]], Outcome]


def resolve(target: str) -> Callable:
    """Import ``"package.module:qualified.name"``."""
    mod_name, sep, qual = target.partition(":")
    if not sep or not mod_name or not qual:
        raise ValueError(f"function target {target!r} must look like 'package.module:function'")
    obj: Any = importlib.import_module(mod_name)
    for part in qual.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{target} is not callable")
    return obj


class FunctionHandler:
    """Runs ``payload = {"fn": "mod:func", "args": [...], "kwargs": {...}}``."""

    def __init__(self) -> None:
        self._cache: dict[str, Callable] = {}

    def __call__(self, spec: ActionSpec, cpus: list[int]) -> Outcome:
        p = spec.payload
        if not isinstance(p, dict) or not isinstance(p.get("fn"), str):
            return Status.ERROR, None, "function payload must be {'fn': 'module:function', 'args': [...], 'kwargs': {...}}"
        target = p["fn"]
        fn = self._cache.get(target)
        if fn is None:
            try:
                fn = self._cache[target] = resolve(target)
            except Exception as e:
                return Status.ERROR, None, f"cannot load {target}: {type(e).__name__}: {e}"
        args = p.get("args") or ()
        kwargs = p.get("kwargs") or {}
        if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
            return Status.ERROR, None, "function args must be a list and kwargs a map"
        try:
            return Status.OK, fn(*args, **kwargs), None
        except BaseException as e:  # sys.exit() in user code is a failed call, not a dead thread
            tb = traceback.format_exc(limit=-3)
            return Status.FAILED, None, f"{type(e).__name__}: {e}\n{tb[-2000:]}"


def noop(*args: Any, **kwargs: Any) -> Any:
    """Returns its first argument: a no-op action target for benchmarks and tests."""
    return args[0] if args else None

