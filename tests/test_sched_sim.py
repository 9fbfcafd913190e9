"""The simulator against hand-computed cases, the workload format, and the bench command."""
from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
from dataclasses import replace

import numpy as np
import pytest

from tangram_hpc import bench
from tangram_hpc.policy.elastic import ElasticScheduler
from tangram_hpc.policy.fifo import FifoPolicy
from tangram_hpc.policy.predict import Predictor
from tangram_hpc.sim.baselines import PooledPolicy, TrajectoryBoundPolicy
from tangram_hpc.sim.engine import Simulation, SimulationStalled, service_infos, simulate
from tangram_hpc.sim.workload import WorkloadError, load_workload, parse_workload, preset_names


def _doc(**over):
    d = {
        "format_version": 1, "name": "t",
        "rollout": {"steps": 1, "trajectories_per_step": 2, "turns": 1, "think_s": 1.0},
        "cluster": {"cpu_workers": 1, "cpu_cores": 1},
        "actions": [{"name": "job", "kind": "sandbox", "weight": 1.0, "duration_s": 10.0}],
    }
    for k, v in over.items():
        d[k] = v
    return d


def test_two_actions_on_one_core():
    # both submitted at t=1 (after 1 s think): one runs 1..11, the other 11..21
    plan = parse_workload(_doc()).sample()
    for pol in (FifoPolicy(), ElasticScheduler()):
        r = simulate(plan, pol)
        assert sorted(r.act.tolist()) == [10.0, 20.0]
        assert r.step_durations == [21.0]
        assert r.cpu_core_s == 21.0 and r.cpu_busy_core_s == 20.0
        assert r.lower_bound.tolist() == [10.0, 10.0]


def test_elastic_cores_follow_amdahl_and_two_steps_are_sequential():
    d = _doc(cluster={"cpu_workers": 1, "cpu_cores": 4},
             rollout={"steps": 2, "trajectories_per_step": 1, "turns": 2, "think_s": 2.0, "train_s": 5.0},
             actions=[{"name": "job", "kind": "sandbox", "weight": 1.0, "duration_s": 12.0,
                       "parallel_fraction": 1.0, "max_cores": 4}])
    plan = parse_workload(d).sample()
    r = simulate(plan, ElasticScheduler(Predictor(prior_parallel=1.0)))
    # alone on the worker: 4 cores, 12 / 4 = 3 s per action; a step is 2 + 3 + 2 + 3
    assert r.act.tolist() == [3.0] * 4
    assert r.step_durations == [10.0, 10.0]
    assert r.makespan == 25.0                                 # 10 + 5 training + 10
    f = simulate(plan, FifoPolicy())
    assert f.act.tolist() == [12.0] * 4                       # min_cores, no elasticity


def test_services_preloaded_at_start_and_load_time_paid_once():
    d = _doc(cluster={"cpu_workers": 1, "cpu_cores": 1, "gpu_workers": 1, "gpus": 1, "gpu_mem_mb": 1000,
                      "gpu_slots": 4},
             rollout={"steps": 1, "trajectories_per_step": 1, "turns": 0, "think_s": 1.0},
             services=[{"name": "rm", "gpu_mem_mb": 500, "load_s": 5.0},
                       {"name": "big", "gpu_mem_mb": 800, "load_s": 5.0}],
             actions=[{"name": "score", "kind": "reward", "service": "rm", "final": 1, "duration_s": 2.0},
                      {"name": "judge", "kind": "reward", "service": "big", "final": 2, "duration_s": 2.0}])
    plan = parse_workload(d).sample()
    r = simulate(plan, ElasticScheduler(services=service_infos(plan.workload)))
    # the worker was up before the run with the most demanded service that fits (big: two calls),
    # whatever the file's order: rm evicts it (idle) and loads for 5 s under its call, big comes
    # back for 5 s under the first judge call; the second is warm
    assert r.act.tolist() == [7.0, 7.0, 2.0]
    assert r.step_durations == [17.0]
    d["services"].reverse()
    swapped = parse_workload(d).sample()
    assert simulate(swapped, ElasticScheduler(services=service_infos(swapped.workload))).act.tolist() == \
        r.act.tolist()
    # trajectory-bound preloads statically, one service per worker when they do not fit together
    t = simulate(plan, TrajectoryBoundPolicy(1, {"rm": 500, "big": 800}), workers={"cpu": 1, "gpu": 2})
    assert t.act.tolist() == [2.0, 2.0, 2.0]


def test_environments_move_off_busy_workers_when_moving_is_cheap():
    base = load_workload("swe").scaled(trajectories=0.25, cluster=0.25, steps=1)
    runs = {}
    for move_s in (None, 1.0, 1000.0):
        w = base.with_cluster(env_move_s=move_s or 1.0)
        sim = Simulation(w.sample(), ElasticScheduler(env_move_s=move_s))
        r = sim.run()
        # every action ran once, in its trajectory's order, after its submit
        assert (r.finish > 0).all() and (r.start >= r.submit).all() and (r.finish >= r.start).all()
        assert r.env_moves == sim.moves         # reported with the result (the bench prints it)
        runs[move_s] = (sim.moves, float(r.act.mean()))
    assert runs[None][0] == 0 and runs[1000.0][0] == 0
    assert runs[1.0][0] > 10
    assert runs[1.0][1] < 0.95 * runs[None][1]          # its actions no longer wait on a full worker
    assert runs[1000.0][1] == runs[None][1]               # a move dearer than any wait is never made


def test_trajectory_bound_holds_the_sandbox_between_actions():
    # two trajectories, one 1-core sandbox: the second trajectory waits for the whole first one
    d = _doc(rollout={"steps": 1, "trajectories_per_step": 2, "turns": 2, "think_s": 1.0})
    plan = parse_workload(d).sample()
    r = simulate(plan, TrajectoryBoundPolicy(1, {}))
    # traj A: submit 1, run 1-11, think, submit 12, run 12-22; traj B's first action waits 1..22
    assert sorted(r.act.tolist()) == [10.0, 10.0, 10.0, 31.0]
    assert r.step_durations == [43.0]
    e = simulate(plan, FifoPolicy())
    assert e.step_durations[0] < 43.0


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: d.pop("format_version"), "format_version"),
    (lambda d: d.__setitem__("format_version", 3), "not supported"),
    (lambda d: d["rollout"].__setitem__("steps", 0), "rollout.steps: must be positive"),
    (lambda d: d["rollout"].__setitem__("turns", {"min": 5, "max": 2}), "below min"),
    (lambda d: d["cluster"].__setitem__("cpu_cores", "many"), "cluster.cpu_cores: expected int"),
    (lambda d: d["actions"][0].__setitem__("colour", "red"), "unknown field(s) colour"),
    (lambda d: d["actions"][0].__setitem__("service", "nope"), "unknown service 'nope'"),
    (lambda d: d["actions"][0].__setitem__("parallel_fraction", 1.5), "within 0..1"),
    (lambda d: d["actions"][0].__setitem__("max_cores", 0), "must be positive"),
    (lambda d: d["actions"][0].__setitem__("min_cores", 64), "exceeds a worker"),
    (lambda d: d["actions"][0].__setitem__("weight", 0.0), "never run"),
    (lambda d: d["actions"][0].__setitem__("duration_s", {"median": 1, "sigma": 9}), "implausibly"),
    (lambda d: d.__setitem__("actions", []), "at least one"),
    (lambda d: d["actions"][0].__setitem__("duration_s", 1e300), "at most 1e+06 s"),
    (lambda d: d["rollout"].__setitem__("think_s", {"median": float("inf")}), "must be a finite number"),
    (lambda d: d["rollout"].__setitem__("turns", {"median": 3, "sigma": 50, "max": 9}), "implausibly"),
    (lambda d: (d["cluster"].__setitem__("cpu_mem_mb", 8000), d["actions"][0].__setitem__("mem_mb", 16000)),
     "mem_mb 16000 exceeds a CPU worker's 8000 MB"),
    (lambda d: d["rollout"].__setitem__("turns", {"min": 0, "max": 2}), "a trajectory would have no action"),
    (lambda d: (d["cluster"].update(gpu_workers=1, gpus=1, gpu_mem_mb=1000, gpu_slots=4),
                d.__setitem__("services", [{"name": "rm", "gpu_mem_mb": 100, "load_s": 1.0}]),
                d["actions"][0].__setitem__("service", "rm")), "only reward actions call a service"),
])
def test_workload_validation_errors_name_the_field(mutate, needle):
    d = copy.deepcopy(_doc())
    mutate(d)
    with pytest.raises(WorkloadError, match=None) as ei:
        parse_workload(d)
    assert needle in str(ei.value)


def test_a_simulation_with_an_action_nothing_can_place_stops_with_the_reason():
    # past the loader (which refuses this file): the run must stop, not tick its pool for ever
    w = parse_workload(_doc(cluster={"cpu_workers": 1, "cpu_cores": 1, "cpu_mem_mb": 8000}))
    big = replace(w.actions[0], mem_mb=16000, mem_mean_mb=16000)
    plan = replace(w, actions=(big,)).sample()
    with pytest.raises(SimulationStalled, match="cannot be placed") as ei:
        bench.tangram_run(plan)
    assert "exceeds every worker shape" in ei.value.reason


def test_the_documented_workload_example_loads_and_runs(tmp_path):
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "docs" / "workloads.md").read_text()
    example = text.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "w.toml").write_text(example)
    w = load_workload(tmp_path / "w.toml").scaled(trajectories=0.02, steps=1)
    r = bench.tangram_run(w.sample())
    assert r.act.size and len(r.step_durations) == 1


def test_workload_file_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("format_version = 1\nname = [\n")
    with pytest.raises(WorkloadError, match="not valid TOML"):
        load_workload(bad)
    with pytest.raises(WorkloadError, match="no preset"):
        load_workload("no-such-preset")


def test_presets_load_and_sample_deterministically():
    assert {"swe", "math", "judge"} <= set(preset_names())
    for name in preset_names():
        w = load_workload(name)
        a, b = w.sample(), w.sample()
        assert a.n_actions == b.n_actions and (a.d1 == b.d1).all()
        assert a.n_trajectories == w.rollout.steps * w.rollout.trajectories_per_step


def test_bench_command_writes_json_and_plots(tmp_path, capsys):
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    out = tmp_path / "fig.json"
    args = ap.parse_args(["--workload", "judge", "--scale", "0.1", "--steps", "1", "--quiet",
                          "--json", str(out), "--plot", str(tmp_path / "plots")])
    assert bench.main(args) == 0
    fig = json.loads(out.read_text())
    assert set(fig["policies"]) == set(bench.BASELINES) | {"tangram"}
    for name, p in fig["policies"].items():
        # the capacity-aware bound is a bound: never above what the policy reached, never below per action
        assert p["per_action_bound"] - 1e-9 <= p["capacity_bound"] <= p["mean_act"] + 1e-9, name
    assert fig["trajectory_best_size"] in {int(k) for k in fig["trajectory_sizes"]}
    best = min(v["mean_act"] for v in fig["trajectory_sizes"].values())
    assert fig["policies"]["trajectory-best"]["mean_act"] == pytest.approx(best)
    sv = fig["savings"]["trajectory-max"]
    assert sv["baseline"]["step_s"] <= sv["step_s"] * (1 + bench.STEP_TOLERANCE)
    assert sv["baseline"]["cpu_workers"] <= fig["cluster"]["cpu_workers"]
    assert 0 <= sv["cpu_saving"] < 1 and sv["gpu_saving"] is not None
    text = capsys.readouterr().out
    assert "capacity-aware" in text and "trajectory-best" in text
    assert "PASS" not in text and "MISS" not in text     # no verdicts against external figures
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["judge-act-cdf.png", "judge-utilisation.png"]
    bad = ap.parse_args(["--workload", "nope", "--quiet"])
    assert bench.main(bad) == 2


@pytest.mark.slow
@pytest.mark.parametrize("preset,time_scale", [("mini", 0.25), ("mini-env", 1.0), ("mini-gpu", 1.0)])
def test_fidelity_live_and_simulated_act_agree_within_15_percent(preset, time_scale, tmp_path):
    """mini: function actions on one worker; mini-env: real sandboxes in per-trajectory
    environments on two workers, where environments pin actions to a worker and may move;
    mini-gpu: those and reward calls to three services of which two fit on the reward worker's
    CPU stand-in device, each load sleeping a second, simulated with the load times measured live."""
    from tangram_hpc.fidelity import fidelity
    w = load_workload(preset)
    res = fidelity(w, time_scale=time_scale, run_dir=str(tmp_path / "run"))
    assert res["live_failed"] == 0
    assert res["actions"] == w.sample().n_actions
    assert len(res["live_step_s"]) == 2 and res["live_mean_act"] > 0
    assert abs(res["act_error"]) <= 0.15, res
    if preset != "mini":
        assert 0 < res["sandbox_cost_s"] < 0.5, res     # measured, and taken off each command
    if preset == "mini-gpu":
        # the run really loaded and evicted services, and moved environments: counted by the
        # reward worker and the coordinator, and seen in which workers ran each trajectory's commands
        assert res["live_service_loads"] >= 3 and res["live_service_evictions"] >= 3, res
        assert res["live_env_moves"] >= 1 and res["live_moved_trajectories"] >= 1, res
        assert set(res["service_load_s"]) == {"judge-a", "judge-b", "judge-c"}, res
        assert all(s >= 0.99 for s in res["service_load_s"].values()), res     # each load sleeps a second


def test_replayed_sandbox_command_sleeps_the_amdahl_time_less_the_sandbox_cost():
    import subprocess

    from tangram_hpc.sim.replay import sleep_command
    cmd = sleep_command(2.0, 0.75, less_s=0.1).replace("sleep ", "echo ", 1)
    for ncpus, want in (("1", 1.9), ("3", 0.9), ("", 1.9)):
        out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True,
                             env={"PATH": os.environ["PATH"], "TANGRAM_NCPUS": ncpus} if ncpus else {"PATH": os.environ["PATH"]})
        assert float(out.stdout) == pytest.approx(want), (ncpus, out.stdout)
    assert float(subprocess.run(["sh", "-c", sleep_command(0.05, 0.0, less_s=0.1).replace("sleep ", "echo ", 1)],
                                capture_output=True, text=True, check=True).stdout) == 0.0


def test_the_replay_service_sleeps_on_every_load_and_not_on_evictions(monkeypatch):
    """The replay's reward model on the CPU stand-in device, where a load and an eviction are both
    to("cpu"): two services with room for one, called in turn, load (and sleep) each time."""
    import threading

    from tangram_hpc.managers.devices import Device
    from tangram_hpc.managers.service_spec import ServiceSpec
    from tangram_hpc.managers.services import ServiceManager
    from tangram_hpc.sim import replay
    from tangram_hpc.sim.replay import SLEEP_SERVICE

    slept = []
    monkeypatch.setattr(replay.time, "sleep", slept.append)    # in this process: the manager's threads
    done = threading.Semaphore(0)
    outputs = []

    def callback(aid, status, output, error, stats):
        outputs.append((status, output))
        done.release()

    specs = [ServiceSpec(n, SLEEP_SERVICE, memory_mb=10, max_wait_ms=0, kwargs={"load_s": 0.05}) for n in "ab"]
    with ServiceManager(specs, [Device("cpu", 15)]) as mgr:
        for k, name in enumerate("abab"):
            mgr.submit(str(k), name, [0.01], callback)
            assert done.acquire(timeout=30)
        stats = mgr.stats()
    assert outputs == [("ok", [1.0])] * 4
    assert [stats[n]["loads"] for n in "ab"] == [2, 2] and stats["a"]["evictions"] == 2
    # a load's sleep before each call's, and none for the three evictions
    assert slept == [0.05, 0.01] * 4


def test_replay_refuses_what_it_cannot_play_live():
    from tangram_hpc.sim.replay import check_replayable
    w = load_workload("mini")
    odd = replace(w, actions=(replace(w.actions[0], uses_env=True),) + w.actions[1:])
    with pytest.raises(WorkloadError, match="only sandbox actions run in an environment"):
        check_replayable(odd.sample())
    with pytest.raises(WorkloadError, match="one GPU worker"):
        check_replayable(load_workload("judge").sample())


def test_policies_and_simulator_import_no_live_code():
    """policy/ imports only the action model, resources and itself; sim/ adds nothing live (no launch),
    but for the ledger driver, which plays a plan through the coordinator's socket-free ledger."""
    import ast
    from pathlib import Path

    import tangram_hpc
    root = Path(tangram_hpc.__file__).parent

    def imports(path: Path) -> set[str]:
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                out.add((node.module or "").split(".")[0] if node.level == 1 else f"..{node.module}")
        return out

    for f in (root / "policy").glob("*.py"):
        assert imports(f) <= {"", "base", "records", "capacity", "queues", "homes", "replicas", "order", "grants",
                              "loading", "moves", "placement", "predict", "prefetch", "residency", "..actions",
                              "..resources"}, f
    ledger_core = {"..coordinator.ledger", "..protocol", "..config"}
    for f in (root / "sim").glob("*.py"):
        allowed = {"..actions", "..resources", "..errors"} | (ledger_core if f.name == "ledger_driver.py" else set())
        assert not {m for m in imports(f) if m.startswith("..") and m not in allowed
                    and not m.startswith("..policy")}, f


def test_capacity_bound_is_shortest_remaining_work_on_one_machine():
    from tangram_hpc.sim.bounds import srpt_flow_sum
    # speed 2: a (4 units at t=0) alone until t=1, then b (1 unit) preempts and ends at 1.5, a at 2.5
    assert srpt_flow_sum(np.array([0.0, 1.0]), np.array([4.0, 1.0]), 2.0) == pytest.approx(2.5 + 0.5)
    # idle gaps: jobs far apart each take work / speed
    assert srpt_flow_sum(np.array([0.0, 100.0]), np.array([2.0, 2.0]), 1.0) == pytest.approx(4.0)
    # on an overloaded cluster the bound is above the per-action one, and the policies respect it
    d = _doc(rollout={"steps": 1, "trajectories_per_step": 20, "turns": 1, "think_s": 1.0},
             cluster={"cpu_workers": 1, "cpu_cores": 2})
    plan = parse_workload(d).sample()
    from tangram_hpc.sim.bounds import capacity_bound
    for pol in (FifoPolicy(), ElasticScheduler()):
        r = simulate(plan, pol)
        cap = capacity_bound(r, plan, 2, 0)
        assert r.lower_bound.mean() < cap <= r.act.mean() + 1e-9
        # two cores, twenty 10 s actions at once: SRPT on a 2x machine ends them at 5, 10, ..., 100
        assert cap == pytest.approx(sum(5.0 * k for k in range(1, 21)) / 20)


def test_capacity_bound_holds_when_sub_millisecond_actions_run_on_no_core():
    from tangram_hpc.sim.bounds import capacity_bound
    d = _doc(format_version=2, seed=1,
             rollout={"steps": 1, "trajectories_per_step": 500, "turns": 40, "think_s": {"median": 1.0, "sigma": 0.3}},
             cluster={"cpu_workers": 1, "cpu_cores": 1},
             actions=[{"name": "tiny", "kind": "function", "weight": 0.998, "duration_s": 0.0009},
                      {"name": "long", "kind": "function", "weight": 0.002, "duration_s": 0.5}])
    plan = parse_workload(d).sample()
    r = simulate(plan, ElasticScheduler())
    assert (r.cores == 0).sum() > plan.n_actions // 2        # the tiny ones were pipelined
    assert capacity_bound(r, plan, 1, 0) <= r.act.mean() + 1e-12


def _reward_doc(gpu_workers=1):
    return _doc(cluster={"cpu_workers": 1, "cpu_cores": 4, "gpu_workers": gpu_workers, "gpus": 1,
                         "gpu_mem_mb": 1000, "gpu_slots": 4, "startup_s": 30.0, "idle_ttl_s": 60.0},
                rollout={"steps": 2, "trajectories_per_step": 4, "turns": 1, "think_s": 5.0},
                services=[{"name": "rm", "gpu_mem_mb": 500, "load_s": 10.0}],
                actions=[{"name": "job", "kind": "sandbox", "weight": 1.0, "duration_s": 2.0},
                         {"name": "score", "kind": "reward", "service": "rm", "final": 1, "duration_s": 1.0}])


def test_reward_workers_scale_from_zero_in_the_simulator():
    plan = parse_workload(_reward_doc()).sample()
    r = bench.tangram_run(plan, gpu_workers=1, name="zero")
    assert r.step_durations and len(r.step_durations) == 2
    # no GPU worker at first: the first reward calls wait for a launch (30 s) and the load (10 s)
    plan0 = parse_workload(_reward_doc()).sample()
    from tangram_hpc.policy.pool import PoolConfig, PoolController
    from tangram_hpc.sim.engine import cluster_shapes, service_infos
    w = plan0.workload
    shapes = cluster_shapes(w)
    pred = Predictor()
    pool = PoolController(PoolConfig(list(shapes.values()), max_workers={"cpu": 1, "gpu": 1}, startup_s=30.0,
                                     idle_ttl_s=60.0), pred)
    sched = ElasticScheduler(pred, shapes=list(shapes.values()), services=service_infos(w))
    z = simulate(plan0, sched, pool=pool, workers={"cpu": 1, "gpu": 0}, pool_interval_s=1.0)
    scores = z.act[plan0.cls == 1]
    assert len(scores) == 8 and np.isfinite(scores).all()
    first = scores[:4]
    assert first.min() >= 30.0 + 10.0 - 1.0 and first.max() <= 30.0 + 10.0 + 1.0 + 2.0
    assert z.gpu_s > 0


def test_the_bench_runs_tangram_in_barrier_mode_exactly_when_the_rollouts_have_per_turn_barriers(monkeypatch):
    made = []

    class Recording(ElasticScheduler):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self.barriers)

    monkeypatch.setattr(bench, "ElasticScheduler", Recording)
    for sync in (False, True):
        d = _doc(rollout={"steps": 1, "trajectories_per_step": 2, "turns": 2, "think_s": 1.0,
                          "sync_turns": sync})
        bench.tangram_run(parse_workload(d).sample())
    assert made == [False, True]


def test_step_aware_pool_keeps_the_capacity_of_a_step_for_the_next():
    # one long straggler keeps step 1 going while every other worker idles past the TTL
    d = _doc(rollout={"steps": 2, "trajectories_per_step": 16, "turns": 1, "think_s": 1.0},
             cluster={"cpu_workers": 4, "cpu_cores": 4, "startup_s": 60.0, "idle_ttl_s": 30.0},
             actions=[{"name": "job", "kind": "sandbox", "weight": 1.0,
                       "duration_s": {"median": 10.0, "sigma": 1.5}}])
    plan = parse_workload(d).sample()
    r = bench.tangram_run(plan)
    at_step2 = [a for t, _, a, _, _ in r.trace if t >= r.step_durations[0]]
    assert at_step2 and at_step2[0] == 16        # all four workers still there when step 2 begins
    assert r.cpu_cores_max == 16


def test_bench_seeds_are_named_as_lists_and_ranges():
    assert bench.parse_seeds("7") == [7]
    assert bench.parse_seeds("100-102") == [100, 101, 102]
    assert bench.parse_seeds("1,5, 9-11,5") == [1, 5, 9, 10, 11]
    for bad in ("a", "5-3", "-1", "1-", f"0-{bench.MAX_SEEDS}"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_seeds(bad)


def _fig(tangram: tuple[float, float], base: tuple[float, float] | None, size: int = 2) -> dict:
    pol = {"tangram": {"mean_act": tangram[0], "mean_traj_s": 10 * tangram[0], "step_s": tangram[1]}}
    vs = {}
    if base is not None:
        pol["pooled-sjf-max"] = {"mean_act": base[0], "mean_traj_s": 10 * base[0], "step_s": base[1]}
        vs["pooled-sjf-max"] = {"act_ratio_ceiling": base[0] / 1.5}     # a per-action bound of 1.5 s
    return {"policies": pol, "tangram_vs": vs, "tangram_bound_ratio": 1.0, "trajectory_best_size": size}


def test_the_spread_over_seeds_counts_where_tangram_was_no_worse():
    figs = [_fig((2.0, 100.0 * (1 + 1e-12)), (3.0, 100.0)),     # better ACT; a tie in step within rounding
            _fig((2.0, 110.0), (1.9, 100.0)),                    # worse on both
            dict(_fig((4.0, 90.0), None), infeasible={"pooled-sjf-max": "stalls"}),   # it could not run here
            _fig((3.0, 95.0), (3.0, 96.0))]                      # equal ACT counts as no worse
    sp = bench.seed_spread(figs)
    assert sp["seeds"] == 4 and sp["policies"]["tangram"]["mean_act"] == {"median": 2.5, "min": 2.0, "max": 4.0}
    b = sp["tangram_vs"]["pooled-sjf-max"]
    assert b["seeds"] == 3 and sp["policies"]["pooled-sjf-max"]["seeds"] == 3
    assert sp["infeasible"] == {"pooled-sjf-max": {"seeds": 1, "why": "stalls"}}
    assert (b["no_worse_act"], b["no_worse_step"]) == (2, 2)
    assert b["act_ratio"]["min"] == pytest.approx(0.95) and b["act_ratio"]["max"] == pytest.approx(1.5)
    assert b["act_ratio"]["median"] == pytest.approx(1.0)
    assert b["act_ratio_ceiling"] == {"median": pytest.approx(2.0), "min": pytest.approx(1.2667, abs=1e-4),
                                      "max": pytest.approx(2.0)}


def test_the_ceiling_is_the_baselines_act_over_the_per_action_bound(capsys):
    w = load_workload("judge").scaled(trajectories=0.1, steps=1)
    fig, runs = bench.run_bench(w, search=False)
    bound = runs["tangram"].lower_bound.mean()
    for k, v in fig["tangram_vs"].items():
        assert v["act_ratio_ceiling"] == pytest.approx(runs[k].act.mean() / bound)
        # nothing reaches it but a run with no queueing at all: tangram's own ratio stays below
        assert v["act_ratio"] <= v["act_ratio_ceiling"]
    assert "any scheduler at most" in bench._fmt_table(fig)


def _figures(fig: dict) -> str:
    """A bench figure without the wall times its simulations took."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("sim_wall_s", "bench_wall_s")}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return json.dumps(strip(fig), sort_keys=True)


def test_bench_on_several_seeds_runs_each_seed_and_writes_the_spread(tmp_path, capsys):
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    out = tmp_path / "seeds.json"
    args = ap.parse_args(["--workload", "judge", "--scale", "0.1", "--steps", "1", "--quiet", "--seed", "3-4",
                          "--json", str(out)])
    assert bench.main(args) == 0
    res = json.loads(out.read_text())
    assert res["seeds"] == [3, 4] and [r["seed"] for r in res["runs"]] == [3, 4]
    w = load_workload("judge").scaled(trajectories=0.1, steps=1)
    alone, _ = bench.run_bench(replace(w, seed=4), search=False)
    assert res["runs"][1]["policies"]["tangram"]["mean_act"] == alone["policies"]["tangram"]["mean_act"]
    assert res["runs"][0]["policies"]["tangram"]["mean_act"] != alone["policies"]["tangram"]["mean_act"]
    acts = [r["policies"]["tangram"]["mean_act"] for r in res["runs"]]
    assert res["spread"]["policies"]["tangram"]["mean_act"]["median"] == pytest.approx(sum(acts) / 2)
    assert all(r["savings"] == {} for r in res["runs"])
    text = capsys.readouterr().out
    assert "2 seeds (3, 4)" in text and "tangram no worse" in text
    plot = ap.parse_args(["--workload", "judge", "--quiet", "--seed", "1,2", "--plot", str(tmp_path / "p")])
    assert bench.main(plot) == 2
    # two at once, each in its own process: the same figures, in the order of the seeds
    both = bench.run_seeds(w, [4, 3], jobs=2)
    assert [r["seed"] for r in both["runs"]] == [4, 3]
    assert ([_figures(r["policies"]) for r in both["runs"]]
            == [_figures(r["policies"]) for r in reversed(res["runs"])])


def test_one_seed_with_jobs_gives_the_same_figures_as_one_at_a_time():
    # tir: a baseline that stalls at every size it needs, and the savings searches
    w = load_workload("tir").scaled(trajectories=0.2, steps=1)
    alone, _ = bench.run_bench(w, search=True)
    both, runs = bench.run_bench(w, search=True, jobs=2)
    assert "trajectory-max" in both["infeasible"] and both["savings"]
    assert _figures(both) == _figures(alone)
    assert set(runs) == set(both["policies"])


def test_a_stall_crosses_a_process_boundary_with_its_facts():
    e = pickle.loads(pickle.dumps(SimulationStalled("run", 41.0, 19, 0)))
    assert isinstance(e, SimulationStalled) and (e.at, e.waiting, e.running) == (41.0, 19, 0)
    assert e.reason == "stuck at t=41 s with 19 actions waiting and none running"


def test_a_setup_that_stalls_is_infeasible_and_a_bug_is_not(monkeypatch):
    w = load_workload("tir").scaled(trajectories=0.2, steps=1)
    fig, _ = bench.run_bench(w, search=False)
    why = fig["infeasible"]["trajectory-max"]
    assert "8-core sandboxes for 51 trajectories, all needed at once at a per-turn barrier: stuck at t=" in why
    assert "trajectory-max" not in fig["policies"] and "tangram" in fig["policies"]

    class Broken(PooledPolicy):
        def schedule(self, now):
            raise RuntimeError("a bug in a baseline")
    monkeypatch.setattr(bench, "PooledPolicy", Broken)
    with pytest.raises(RuntimeError, match="a bug in a baseline"):      # not reported as "cannot run here"
        bench.run_bench(w, search=False)


@pytest.mark.parametrize("width", [0.25, 1e-4])
def test_event_calendar_pops_in_order_near_and_far(width):
    """Each pop is the least pending event in (time, type, seq) order, as from one heap, whether its
    bucket sat in the calendar's ring, in its map of far buckets, or partly in each (pushed while far,
    then again once near)."""
    import heapq

    from tangram_hpc.sim.calendar import EventCalendar
    rng = np.random.default_rng(7)
    q = EventCalendar(width)
    ref: list = []
    popped, pushed = [], []
    now = 0.0

    def push(t, typ):
        e = (t, typ, q.seq(), len(pushed))
        pushed.append(e)
        q.push(e)
        heapq.heappush(ref, e)

    for _ in range(300):           # some far ahead (beyond the ring at the small width), some at once
        push(float(rng.choice([rng.exponential(2.0), rng.uniform(0, 50), 30.0])), int(rng.integers(0, 3)))
    for x in range(51):            # whole seconds: pushed again below once they are 5 s away
        push(float(x), 1)
    while q:
        e = q.pop()
        assert e == heapq.heappop(ref)
        assert e[0] >= now
        now = e[0]
        popped.append(e)
        if len(pushed) < 3000:     # pushes while popping: at this instant, soon, and far
            for t in (now, now + float(rng.exponential(0.5)), now + float(rng.uniform(0, 40)), round(now) + 5.0):
                if rng.random() < 0.45:
                    push(t, int(rng.integers(0, 3)))
    assert len(popped) == len(pushed) >= 3000
    assert not ref and not q and q.later == 0 and q.near == 0 and not q.far


def test_per_trajectory_time_runs_from_first_submit_to_last_end():
    # two trajectories of two 10 s actions on one core, trajectory-bound: the second waits for the whole first
    d = _doc(rollout={"steps": 1, "trajectories_per_step": 2, "turns": 2, "think_s": 1.0})
    plan = parse_workload(d).sample()
    r = simulate(plan, TrajectoryBoundPolicy(1, {}))
    # A: submit 1, ends 22; B: submit 1, waits until 22, runs 22-32, thinks, 33-43
    assert sorted(bench.trajectory_times(r, plan).tolist()) == [21.0, 42.0]


def test_replica_throughput_is_the_best_batch_under_its_limits():
    from tangram_hpc.sim.bounds import replica_throughput
    assert replica_throughput(0, 0.0, 8, 1) == 8.0               # no limit, no slowdown: every slot
    assert replica_throughput(4, 1.0, 8, 1) == pytest.approx(2.0)   # a full batch of 4 at half speed
    assert replica_throughput(4, 0.0, 8, 4) == 2.0               # four-slot requests: two fit
    assert replica_throughput(1, 0.0, 8, 1) == 1.0
    assert replica_throughput(4, 10.0, 8, 1) == 1.0              # batching slows more than it serves


def test_the_savings_search_survives_a_cluster_too_small_for_the_services(tmp_path, capsys):
    # two services that each fill a GPU worker: on one worker a static layout cannot host both
    d = _doc(format_version=2,
             cluster={"cpu_workers": 1, "cpu_cores": 2, "gpu_workers": 2, "gpus": 1, "gpu_mem_mb": 1000,
                      "gpu_slots": 4},
             rollout={"steps": 1, "trajectories_per_step": 4, "turns": 1, "think_s": 1.0},
             services=[{"name": "a", "gpu_mem_mb": 800, "load_s": 5.0}, {"name": "b", "gpu_mem_mb": 800, "load_s": 5.0}],
             actions=[{"name": "job", "kind": "sandbox", "weight": 1.0, "duration_s": 1.0},
                      {"name": "ra", "kind": "reward", "service": "a", "final": 1, "duration_s": 1.0},
                      {"name": "rb", "kind": "reward", "service": "b", "final": 1, "duration_s": 1.0}])
    path = tmp_path / "two.toml"
    from tangram_hpc.sim.family import to_toml
    path.write_text(to_toml(d))
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    out = tmp_path / "fig.json"
    assert bench.main(ap.parse_args(["--workload", str(path), "--quiet", "--json", str(out)])) == 0
    fig = json.loads(out.read_text())
    for name, sv in fig["savings"].items():     # no cut keeps one GPU worker: both services need their own
        assert sv["baseline"] is None or sv["baseline"]["gpu_workers"] == 2, name


def test_the_family_bench_counts_where_baselines_beat_tangram_and_writes_the_worst(tmp_path, capsys):
    """The fixed small family CI runs: every run measured, the table printed, the worst runs written
    as workload files that load and name the baseline that led."""
    from tangram_hpc import bench_family
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    out = tmp_path / "family.json"
    args = ap.parse_args(["--family", "4", "--family-seed", "11", "--quiet", "--family-out", str(tmp_path / "worst"),
                          "--family-worst", "2", "--json", str(out)])
    assert bench.main(args) == 0
    res = json.loads(out.read_text())
    assert res["summary"]["runs"] == 4 and len(res["runs"]) == 4
    text = capsys.readouterr().out
    assert "beat by >1%" in text and "pooled-sjf-elastic" in text and "advantage over the best baseline" in text
    for r in res["runs"]:
        assert "tangram" in r["policies"] and set(r["policies"]) <= set(bench.BASELINES) | {"tangram"}
    for e in res["summary"]["baselines"].values():
        if e["runs"]:
            assert e["beats_0.05"] <= e["beats_0.01"] <= e["runs"]
    worst = bench_family.worst_runs(res["runs"], 2)
    files = sorted((tmp_path / "worst").glob("*.toml")) if (tmp_path / "worst").exists() else []
    assert len(files) == len(worst)
    for f in files:
        w = load_workload(str(f))
        assert "beat tangram by" in w.description
    # a hand-made run where one baseline leads by 10 % on step counts as beating by >1 % and >5 %
    t = {"mean_act": 1.0, "mean_traj_s": 1.0, "step_s": 100.0}
    runs = [{"member": 0, "seed": 1, "policies": {"tangram": t, "pooled-fifo-min": {**t, "step_s": 90.0}},
             "bound_ratio": 1.0}]
    sm = bench_family.family_summary(runs)
    assert sm["baselines"]["pooled-fifo-min"]["beats_0.01"] == 1 == sm["baselines"]["pooled-fifo-min"]["beats_0.05"]
    assert bench_family.worst_runs(runs, 3)[0][:2] == (pytest.approx(0.1), "pooled-fifo-min")


def test_a_run_with_a_pool_where_nothing_ever_starts_stalls_instead_of_ticking_for_ever(monkeypatch):
    from tangram_hpc.sim.engine import IDLE_STALL_S
    plan = parse_workload(_doc()).sample()

    class NeverStarts(ElasticScheduler):      # a subclass, not a patched method: the compiled build
        def schedule(self, now):               # calls its own methods directly
            return []

    monkeypatch.setattr(bench, "ElasticScheduler", NeverStarts)
    with pytest.raises(SimulationStalled, match="nothing started for") as e:
        bench.tangram_run(plan)
    assert IDLE_STALL_S < e.value.at <= IDLE_STALL_S + 60 and e.value.waiting == 2


def test_a_load_done_is_reported_to_the_policy_as_a_heartbeat_would():
    """Member 25 of family seed 7: four services on one 40 GB GPU; calls that found the worker's
    memory held by a replica still loading are looked at again once that load is done (the
    simulator reports it at the next pool tick, as a live worker's heartbeat does). Before, they
    waited for ever and the run stalled."""
    from tangram_hpc.sim.family import draw_family
    _, w = draw_family(26, 7)[25]
    assert w.cluster.gpu_workers == 1 and sum(s.gpu_mem_mb for s in w.services.values()) > 2 * 40000
    plan = w.sample()
    r = bench.tangram_run(plan)
    assert (r.finish > r.submit).all() and len(r.step_durations) == 1
