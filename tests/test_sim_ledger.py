"""The fast simulator and the live coordinator's ledger, played the same plans, agree exactly.

:func:`~tangram_hpc.sim.engine.simulate` calls the scheduling policy directly and keeps its own
model of environments; :func:`~tangram_hpc.sim.ledger_driver.simulate_through_ledger` puts the real
:class:`~tangram_hpc.coordinator.ledger.ActionLedger` (and so its
:class:`~tangram_hpc.coordinator.lifecycle.EnvironmentLifecycle`) between the same simulated
clients and workers.  Both see one world (run times by Amdahl's law, a move costing ``env_move_s``
from hold-back to release, free restores), so on the same seed and policy every action must be
submitted, started and finished at the same simulated instant on the same cores, and the same
environments must move: the tolerance is zero.  A difference means one of the two drives the
policy differently (an extra or missing call, another order, a held action released at another
time), which is exactly what this test is for.
"""
from __future__ import annotations

import numpy as np
import pytest

from tangram_hpc.actions import Status
from tangram_hpc.policy.elastic import ElasticScheduler
from tangram_hpc.policy.fifo import FifoPolicy
from tangram_hpc.policy.predict import Predictor
from tangram_hpc.sim.engine import cluster_shapes, simulate
from tangram_hpc.sim.ledger_driver import simulate_through_ledger
from tangram_hpc.sim.workload import load_workload, parse_workload


def _turns_in_lockstep():
    """Sandbox environments with synchronous turns, follow-ups, parallel finals, hints and a
    timeout: every path of the drivers' trajectories, on three 4-core workers."""
    return parse_workload({
        "format_version": 2, "name": "lockstep", "seed": 11,
        "rollout": {"steps": 2, "trajectories_per_step": 10, "turns": {"min": 2, "max": 5},
                    "think_s": {"median": 1.0, "sigma": 0.5}, "train_s": 3.0, "sync_turns": True,
                    "parallel_finals": True},
        "cluster": {"cpu_workers": 3, "cpu_cores": 4, "env_move_s": 0.5},
        "actions": [
            {"name": "edit", "kind": "sandbox", "weight": 0.6, "duration_s": {"median": 0.5, "sigma": 0.6},
             "followups": [{"action": "lint", "probability": 0.5}]},
            {"name": "lint", "kind": "sandbox", "duration_s": 0.3, "hint": True},
            {"name": "test", "kind": "sandbox", "weight": 0.4, "duration_s": {"median": 3.0, "sigma": 0.8},
             "parallel_fraction": 0.8, "max_cores": 4, "timeout_s": 6.0},
            {"name": "check", "kind": "sandbox", "final": 2, "duration_s": {"median": 0.8, "sigma": 0.3}},
        ],
    })


def _policies(w):
    shapes = list(cluster_shapes(w).values())
    return {"fifo": FifoPolicy,
            "elastic": lambda: ElasticScheduler(Predictor(), shapes=shapes, env_move_s=w.cluster.env_move_s)}


@pytest.mark.parametrize("workload", ["mini-env", "mini-env x3", "lockstep"])
def test_the_engine_and_the_ledger_agree_on_every_action(workload):
    if workload == "lockstep":
        w = _turns_in_lockstep()
    else:
        w = load_workload("mini-env")
        if workload.endswith("x3"):
            w = w.scaled(trajectories=3)    # 24 trajectories on two 2-core workers: environments move
    moves = 0
    for seed in (1, 2, 3):
        plan = w.sample(seed)
        for name, make in _policies(w).items():
            fast = simulate(plan, make())
            live = simulate_through_ledger(plan, make())
            where = f"{workload} seed {seed} {name}"
            assert live.statuses == {Status.OK: plan.n_actions}, where
            np.testing.assert_array_equal(live.submit, fast.submit, err_msg=where)
            np.testing.assert_array_equal(live.start, fast.start, err_msg=where)
            np.testing.assert_array_equal(live.finish, fast.finish, err_msg=where)
            np.testing.assert_array_equal(live.cores, fast.cores, err_msg=where)
            assert live.step_durations == fast.step_durations, where
            assert live.env_moves == fast.env_moves, where
            moves += live.env_moves
    if workload != "mini-env":
        assert moves > 0        # the moves' path was taken (else the agreement says nothing about it)


def test_the_ledger_driver_refuses_services_it_does_not_model():
    w = load_workload("judge")      # services that slow down in a fuller batch
    with pytest.raises(ValueError, match="without batch slowdown"):
        simulate_through_ledger(w.scaled(trajectories=0.01, steps=1).sample(1), FifoPolicy())
