"""An environment that keeps live processes on its worker (a live session) is not moved off it,
unless the policy does not pin or the worker is lost (pure policy, no sockets)."""
from __future__ import annotations

import pytest

from tangram_hpc.actions import ActionSpec
from tangram_hpc.policy.elastic import ElasticScheduler
from tangram_hpc.resources import WorkerInfo

CPU = frozenset({"sandbox", "function"})


def crowded(pin: bool, live: bool) -> ElasticScheduler:
    """E lives on w1, whose only core a long action of F holds; w2 is free: E's next action would
    finish sooner there, the move included."""
    p = ElasticScheduler(env_move_s=2.0)
    p.pin_live_envs = pin
    p.add_worker(WorkerInfo("w1", 1, kinds=CPU), 0)
    p.submit(ActionSpec("sandbox", id="e1", env="E", duration_hint=1.0), 0)
    assert [a.worker_id for a in p.schedule(0)] == ["w1"]
    p.finished("e1", 1, run_time=1.0)
    p.env_processes("E", live)                 # as the ledger does with the result's env_state
    p.submit(ActionSpec("sandbox", id="f1", env="F", duration_hint=100.0), 1)
    assert [a.worker_id for a in p.schedule(1)] == ["w1"]
    p.add_worker(WorkerInfo("w2", 2, kinds=CPU), 1)
    p.submit(ActionSpec("sandbox", id="e2", env="E", duration_hint=1.0), 2)
    assert p.schedule(2) == []
    return p


@pytest.mark.parametrize("pin, live, moved", [(True, True, []), (True, False, ["E"]), (False, True, ["E"])])
def test_an_environment_with_live_processes_stays_on_its_worker(pin, live, moved):
    assert crowded(pin, live).env_moves() == moved


def test_a_lost_worker_unpins_its_environments():
    p = crowded(True, True)
    assert p.env_moves() == []
    p.remove_worker("w1", 3)
    assert not p.homes.envs["E"].pinned          # its processes died with w1: wherever E goes next, it may move
    p.cancel("e2")
    p.submit(ActionSpec("sandbox", id="e2", env="E", duration_hint=1.0), 4)
    assert [(a.action_id, a.worker_id) for a in p.schedule(4)] == [("e2", "w2")]
