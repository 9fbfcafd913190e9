"""One error hierarchy, and state enums that travel as plain strings."""
from __future__ import annotations

import importlib
import inspect
import json
import pkgutil

import msgpack
import pytest

import tangram_hpc
from tangram_hpc import errors
from tangram_hpc import protocol as P
from tangram_hpc.actions import ActionResult, ActionSpec, Status
from tangram_hpc.backends.base import BackendEvent, JobState
from tangram_hpc.coordinator import WorkerState


@pytest.mark.parametrize("name, builtin", [
    ("ValidationError", ValueError), ("ProtocolError", ValueError), ("ConfigError", ValueError),
    ("ActionFailed", RuntimeError), ("CoordinatorError", RuntimeError), ("LaunchRefused", RuntimeError),
    ("BwrapUnavailable", RuntimeError), ("SlurmCommandError", RuntimeError),
])
def test_every_error_is_a_tangram_error_and_keeps_its_builtin_base(name, builtin):
    cls = getattr(errors, name)
    assert issubclass(cls, errors.TangramError) and issubclass(cls, builtin)
    assert tangram_hpc.TangramError is errors.TangramError


def _public_exception_classes() -> list[type]:
    """Every public exception class the package defines, found by importing each of its modules."""
    found = []
    for m in pkgutil.walk_packages(tangram_hpc.__path__, "tangram_hpc."):
        if m.name.rsplit(".", 1)[-1] == "__main__":
            continue        # runs the command line when imported
        mod = importlib.import_module(m.name)
        found += [c for n, c in vars(mod).items() if inspect.isclass(c) and issubclass(c, BaseException)
                  and c.__module__ == mod.__name__ and not n.startswith("_")]
    return found


def test_every_public_exception_class_in_the_package_is_a_tangram_error():
    found = _public_exception_classes()
    names = {c.__name__ for c in found}
    # the walk reaches the modules outside errors.py (or this test would pass by finding nothing)
    assert {"ValidationError", "WorkloadError", "SimulationStalled", "EnvError", "LimitsError", "PayloadError",
            "RunCodeError", "RewardError", "FieldError"} <= names
    assert [f"{c.__module__}.{c.__qualname__}" for c in found if not issubclass(c, errors.TangramError)] == []


@pytest.mark.parametrize("where, name, builtin", [
    ("sim.workload", "WorkloadError", ValueError), ("sim.stalled", "SimulationStalled", RuntimeError),
    ("managers.fs_inside", "EnvError", RuntimeError), ("managers.limits", "LimitsError", ValueError),
    ("managers.sandbox", "PayloadError", ValueError), ("managers.sandboxfusion", "RunCodeError", ValueError),
    ("integrations.batching", "RewardError", RuntimeError), ("serve.translate", "FieldError", ValueError),
])
def test_errors_defined_beside_their_code_keep_their_builtin_base(where, name, builtin):
    cls = getattr(importlib.import_module(f"tangram_hpc.{where}"), name)
    assert issubclass(cls, errors.TangramError) and issubclass(cls, builtin)


def test_errors_are_defined_once_and_re_exported_where_they_were():
    from tangram_hpc import actions, client, config, protocol
    from tangram_hpc.backends import guards, slurm as slurm_backend
    from tangram_hpc.managers import bwrap, sandbox
    from tangram_hpc.slurm import view
    assert actions.ValidationError is protocol.ValidationError is errors.ValidationError
    assert actions.ActionFailed is tangram_hpc.ActionFailed is errors.ActionFailed
    assert protocol.ProtocolError is errors.ProtocolError and client.CoordinatorError is errors.CoordinatorError
    assert guards.LaunchRefused is slurm_backend.LaunchRefused is errors.LaunchRefused
    assert bwrap.BwrapUnavailable is sandbox.BwrapUnavailable is errors.BwrapUnavailable
    assert view.SlurmCommandError is errors.SlurmCommandError and config.ConfigError is errors.ConfigError


def test_one_except_catches_any_of_them():
    res = ActionResult("a", Status.FAILED, error="boom")
    with pytest.raises(errors.TangramError, match="action a failed: boom"):
        res.raise_for_status()
    with pytest.raises(errors.TangramError):
        ActionSpec.from_wire({"i": "x", "k": "nope"})
    with pytest.raises(errors.TangramError) as e:
        P.decode(b"\x93\x09\x01\x80", P.CLIENT_TYPES)
    assert e.value.code == "version"


def test_status_is_an_enum_that_travels_as_a_plain_string():
    assert Status.OK == "ok" and f"{Status.TIMEOUT}" == "timeout" and str(Status.ERROR) == "error"
    assert "cancelled" in Status.FINAL and Status.FINAL == frozenset(Status)
    _, body = P.decode(P.encode(P.DONE, [["a", 1, Status.OK, None, None, 0.0, 1.0, None]]), P.WORKER_TYPES)
    assert type(body[0][2]) is str and body[0][2] == "ok"
    assert msgpack.unpackb(msgpack.packb(Status.CANCELLED)) == "cancelled"
    assert json.loads(json.dumps({"state": WorkerState.DRAINING, "status": Status.OK})) == \
        {"state": "draining", "status": "ok"}


def test_backend_events_carry_a_job_state():
    ev = BackendEvent("h", "failed", "exit status 3")
    assert ev.state is JobState.FAILED and not ev.state.live and BackendEvent("h", JobState.PENDING).state.live
    with pytest.raises(ValueError):
        BackendEvent("h", "exploded")
