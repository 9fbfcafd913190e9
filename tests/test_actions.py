import pytest

from tangram_hpc.actions import (ActionResult, ActionSpec, Demand, Status, ValidationError, function,
                                 register_kind, reward, sandbox)


def test_spec_round_trip_keeps_every_field():
    spec = ActionSpec(kind="sandbox", payload={"cmd": "make -j"}, env="traj-7", demand=Demand(1, 8, 512, 0),
                      duration_hint=2.5, timeout=30, priority=3, trajectory="t7", step=4, label="build",
                      idempotency_key="k1")
    back = ActionSpec.from_wire(spec.to_wire())
    assert back == spec
    assert back.action_class == "sandbox:build"


def test_default_spec_is_compact():
    spec = function("tangram_hpc.handlers:noop", 1)
    assert set(spec.to_wire()) == {"i", "k", "p"}


def test_constructors():
    s = sandbox("pytest -x", env="e", cores=(2, 8))
    assert s.demand.min_cores == 2 and s.demand.max_cores == 8 and s.payload == {"cmd": "pytest -x"}
    r = reward("rm", [{"response": "a"}], gpu_mem_mb=1000)
    assert r.demand.service == "rm" and r.demand.gpu_mem_mb == 1000 and r.action_class == "reward:rm"
    f = function(len, [1, 2])
    assert f.payload["fn"] == "builtins:len"


@pytest.mark.parametrize("wire, message", [
    ("not a map", "must be a map"),
    ({"i": "", "k": "sandbox"}, "action id"),
    ({"i": "x" * 200, "k": "sandbox"}, "action id"),
    ({"i": "a", "k": "teleport"}, "unknown action kind"),
    ({"i": "a", "k": "sandbox", "d": [1]}, "demand must be"),
    ({"i": "a", "k": "sandbox", "d": [4, 2, 0, 0, None]}, "below min_cores"),
    ({"i": "a", "k": "sandbox", "d": [-1, 2, 0, 0, None]}, "non-negative"),
    ({"i": "a", "k": "sandbox", "d": [0, 4, 0, 0, None]}, "sandbox action binds at least one core"),
    ({"i": "a", "k": "sandbox", "d": [1, 1, 2**44, 0, None]}, "at most 1099511627776 MiB"),
    ({"i": "a", "k": "sandbox", "t": -1}, "seconds from 0 to 1e9"),
    ({"i": "a", "k": "sandbox", "t": 0}, "positive"),
    ({"i": "a", "k": "sandbox", "h": "soon"}, "duration_hint"),
    ({"i": "a", "k": "sandbox", "r": 2**40}, "priority"),
    ({"i": "a", "k": "sandbox", "e": 5}, "env"),
    ({"i": "a", "k": "sandbox", "zz": 1}, "unknown action fields"),
    ({"i": "a", "k": "sandbox", "s": "one"}, "step"),
])
def test_invalid_specs_are_rejected_with_a_reason(wire, message):
    with pytest.raises(ValidationError, match=message):
        ActionSpec.from_wire(wire)


def test_demands_from_the_wire_are_shared_by_value_and_still_checked():
    a = ActionSpec.from_wire({"i": "a", "k": "function", "d": [0, 0, 0, 0, None]})
    b = ActionSpec.from_wire({"i": "b", "k": "function", "d": (0, 0, 0, 0, None)})
    c = ActionSpec.from_wire({"i": "c", "k": "reward", "d": [1, 1, 0, 1000, "judge"]})
    assert a.demand is b.demand and a.demand == Demand(0, 0) and c.demand == Demand(1, 1, 0, 1000, "judge")
    assert ActionSpec.from_wire({"i": "d", "k": "reward", "d": [1, 1, 0, 1000, "judge"]}).demand is c.demand
    # equal as Python values, refused as demands: a shared valid one must not stand in for them
    ActionSpec.from_wire({"i": "e", "k": "function", "d": [1, 1, 0, 0, None]})
    for bad in ([True, 1, 0, 0, None], [1.0, 1, 0, 0, None], [1, 1, 0, 0, {"svc": 1}], [1, 1, 0, 0, ["x"]]):
        with pytest.raises(ValidationError):
            ActionSpec.from_wire({"i": "f", "k": "function", "d": bad})
    # a client sending ever new demands does not grow the table without bound
    from tangram_hpc import actions
    for i in range(3 * actions.WIRE_DEMANDS_KEPT):
        assert ActionSpec.from_wire({"i": "g", "k": "function", "d": [1, 1, i, 0, None]}).demand.mem_mb == i
    assert 0 < len(actions._wire_demands) <= actions.WIRE_DEMANDS_KEPT


def test_a_sandbox_cannot_be_a_zero_core_action():
    with pytest.raises(ValidationError, match="at least one core"):
        sandbox("true", cores=0)
    with pytest.raises(ValidationError, match="at least one core"):
        sandbox("true", cores=(0, 2))
    assert ActionSpec.from_wire(function("math:floor", 1.5, cores=0).to_wire()).demand.min_cores == 0


def test_registered_kind_is_accepted():
    with pytest.raises(ValidationError):
        ActionSpec.from_wire({"i": "a", "k": "browser"})
    register_kind("browser")
    assert ActionSpec.from_wire({"i": "a", "k": "browser"}).kind == "browser"
    with pytest.raises(ValidationError):
        register_kind("Bad Kind")


def test_result_round_trip_and_act():
    r = ActionResult("a", Status.OK, {"x": 1}, None, 10.0, 10.5, 12.0, "w1", 4, 1)
    back = ActionResult.from_wire(r.to_wire())
    assert back == r
    assert back.act == pytest.approx(2.0) and back.queued == pytest.approx(0.5)
    with pytest.raises(ValidationError):
        ActionResult.from_wire(["a", "weird", None, None, 0, 0, 0, None, 0, 0, None])
