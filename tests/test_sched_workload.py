"""Workload format 2: what each new field means, checked on hand-computed simulations."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from tangram_hpc.policy.elastic import ElasticScheduler
from tangram_hpc.policy.fifo import FifoPolicy
from tangram_hpc.sim.baselines import TrajectoryBoundPolicy
from tangram_hpc.sim.engine import service_infos, simulate
from tangram_hpc.sim.workload import WorkloadError, load_workload, parse_workload
from test_sched_sim import _doc as _doc_v1


def _doc(**over):
    """The one-job document of test_sched_sim, in format 2 with one trajectory."""
    return _doc_v1(**{"format_version": 2,
                      "rollout": {"steps": 1, "trajectories_per_step": 1, "turns": 1, "think_s": 1.0}, **over})


def _gpu_cluster(slots=4, mem=1000):
    return {"cpu_workers": 1, "cpu_cores": 1, "gpu_workers": 1, "gpus": 1, "gpu_mem_mb": mem, "gpu_slots": slots}


def test_lognormal_turns_are_capped():
    d = _doc(rollout={"steps": 1, "trajectories_per_step": 4000, "think_s": 1.0,
                      "turns": {"median": 6, "sigma": 1.0, "min": 2, "max": 20}})
    w = parse_workload(d)
    t = w.rollout.turns.sample(np.random.default_rng(0), 20000)
    assert t.min() == 2 and t.max() == 20
    assert 5 <= np.median(t) <= 7
    assert (t == 20).mean() > 0.01           # the tail piles up at the cap
    plan = w.sample()
    lens = plan.step_traj_len[0]
    assert lens.min() >= 2 and lens.max() <= 20
    with pytest.raises(WorkloadError, match="needs a cap"):
        parse_workload(_doc(rollout={"steps": 1, "trajectories_per_step": 1, "think_s": 1.0,
                                     "turns": {"median": 6, "sigma": 1.0}}))


def test_timeout_truncates_the_run():
    d = _doc(actions=[{"name": "job", "kind": "sandbox", "weight": 1.0, "duration_s": 10.0, "timeout_s": 4.0}])
    r = simulate(parse_workload(d).sample(), FifoPolicy())
    assert r.act.tolist() == [4.0]
    assert r.lower_bound.tolist() == [4.0]
    assert r.step_durations == [5.0]


def test_memory_peak_is_reserved_and_mean_is_what_counts_as_used():
    d = _doc(rollout={"steps": 1, "trajectories_per_step": 2, "turns": 1, "think_s": 1.0},
             cluster={"cpu_workers": 1, "cpu_cores": 2, "cpu_mem_mb": 1000},
             actions=[{"name": "job", "kind": "sandbox", "weight": 1.0, "duration_s": 10.0,
                       "mem_mb": {"peak": 600, "mean": 150}}])
    r = simulate(parse_workload(d).sample(), FifoPolicy())
    # two cores free, but two peaks do not fit in 1000 MB: the second waits for the first
    assert sorted(r.act.tolist()) == [10.0, 20.0]
    assert r.mem_used_mb_s / r.mem_reserved_mb_s == pytest.approx(0.25)
    with pytest.raises(WorkloadError, match="above peak"):
        parse_workload(_doc(actions=[{"name": "job", "kind": "sandbox", "weight": 1.0, "duration_s": 1.0,
                                      "mem_mb": {"peak": 100, "mean": 200}}]))


def test_followups_run_in_the_same_turn_without_thinking():
    d = _doc(rollout={"steps": 1, "trajectories_per_step": 1, "turns": 2, "think_s": 1.0},
             cluster={"cpu_workers": 1, "cpu_cores": 2},
             actions=[{"name": "exec", "kind": "sandbox", "weight": 1.0, "duration_s": 3.0,
                       "followups": [{"action": "check", "probability": 1.0}]},
                      {"name": "check", "kind": "function", "duration_s": 2.0}])
    plan = parse_workload(d).sample()
    names = [plan.workload.actions[c].name for c in plan.cls]
    assert names == ["exec", "check", "exec", "check"]
    assert plan.turn.tolist() == [0, 0, 1, 1]
    r = simulate(plan, FifoPolicy())
    # think 1, exec 1-4, check 4-6, think, exec 7-10, check 10-12
    assert r.submit.tolist() == [1.0, 4.0, 7.0, 10.0]
    assert r.step_durations == [12.0]
    # with a probability, about that share of turns get one
    d["rollout"] = {"steps": 1, "trajectories_per_step": 400, "turns": 10, "think_s": 1.0}
    d["actions"][0]["followups"] = [{"action": "check", "probability": 0.3}]
    plan = parse_workload(d).sample()
    share = (plan.cls == 1).sum() / 4000
    assert 0.27 < share < 0.33
    bad = copy.deepcopy(d)
    bad["actions"][0]["followups"] = [{"action": "nope", "probability": 0.3}]
    with pytest.raises(WorkloadError, match="unknown action 'nope'"):
        parse_workload(bad)
    bad["actions"][0]["followups"] = [{"action": "check", "probability": 1.5}]
    with pytest.raises(WorkloadError, match="within 0..1"):
        parse_workload(bad)


def test_parallel_finals_go_out_together():
    d = _doc(rollout={"steps": 1, "trajectories_per_step": 1, "turns": 0, "think_s": 1.0,
                      "parallel_finals": True},
             cluster=_gpu_cluster(),
             services=[{"name": "rm", "gpu_mem_mb": 500, "load_s": 5.0}],
             actions=[{"name": "a", "kind": "reward", "service": "rm", "final": 1, "duration_s": 2.0},
                      {"name": "b", "kind": "reward", "service": "rm", "final": 2, "duration_s": 3.0}])
    plan = parse_workload(d).sample()
    assert plan.joined.tolist() == [False, True, True]
    r = simulate(plan, ElasticScheduler())
    assert r.submit.tolist() == [1.0, 1.0, 1.0]
    assert r.step_durations == [4.0]            # the longest of the group
    d["rollout"]["parallel_finals"] = False
    r = simulate(parse_workload(d).sample(), ElasticScheduler())
    assert r.step_durations == [9.0]             # 1 + 2 + 3 + 3, one after another


def test_parallel_sandbox_finals_share_a_trajectory_sandbox_cores():
    d = _doc(rollout={"steps": 1, "trajectories_per_step": 1, "turns": 0, "think_s": 1.0,
                      "parallel_finals": True},
             cluster={"cpu_workers": 1, "cpu_cores": 4},
             actions=[{"name": "test", "kind": "sandbox", "final": 4, "duration_s": 40.0,
                       "parallel_fraction": 1.0, "max_cores": 4}])
    plan = parse_workload(d).sample()
    r = simulate(plan, TrajectoryBoundPolicy(4, {}))
    # four at once in a 4-core sandbox: one core each (they used to get four each, 16 on 4 cores)
    assert r.cores.tolist() == [1, 1, 1, 1] and r.act.tolist() == [40.0] * 4
    assert r.cpu_busy_core_s <= r.cpu_core_s


def test_the_trajectory_baselines_reward_server_keeps_a_queue_per_model():
    d = _doc(rollout={"steps": 1, "trajectories_per_step": 4, "turns": 0, "think_s": 1.0, "parallel_finals": True},
             cluster=_gpu_cluster(slots=64, mem=80000),
             services=[{"name": "slow", "gpu_mem_mb": 10000, "load_s": 10.0, "max_batch": 1},
                       {"name": "fast", "gpu_mem_mb": 10000, "load_s": 10.0, "max_batch": 64}],
             actions=[{"name": "a", "kind": "reward", "service": "slow", "final": 1, "duration_s": 30.0},
                      {"name": "b", "kind": "reward", "service": "fast", "final": 1, "duration_s": 0.1}])
    plan = parse_workload(d).sample()
    r = simulate(plan, TrajectoryBoundPolicy(1, {"slow": 10000, "fast": 10000}, {"slow": 1, "fast": 64}))
    fast = plan.cls == 1
    # the fast model's calls do not wait behind the slow one's full replica
    assert r.act[fast].tolist() == pytest.approx([0.1] * 4)
    assert sorted(r.act[~fast].tolist()) == pytest.approx([30.0, 60.0, 90.0, 120.0])


def test_sync_turns_hold_every_trajectory_at_the_turn_boundary():
    d = _doc(rollout={"steps": 1, "trajectories_per_step": 2, "turns": 2, "think_s": 1.0, "sync_turns": True},
             cluster={"cpu_workers": 1, "cpu_cores": 2},
             actions=[{"name": "job", "kind": "sandbox", "weight": 1.0, "duration_s": {"median": 4.0, "sigma": 0.5}}])
    plan = parse_workload(d).sample()
    d1 = plan.d1.reshape(2, 2)           # [trajectory, turn]
    r = simulate(plan, FifoPolicy())
    sub = r.submit.reshape(2, 2)
    # turn 1 of both starts after the slower turn 0 ended, plus the think time
    turn0_end = 1.0 + max(d1[0, 0], d1[1, 0])
    assert sub[0, 1] == pytest.approx(turn0_end + 1.0) and sub[1, 1] == pytest.approx(turn0_end + 1.0)
    assert r.step_durations[0] == pytest.approx(turn0_end + 1.0 + max(d1[0, 1], d1[1, 1]))
    d["rollout"]["sync_turns"] = False
    free = simulate(parse_workload(d).sample(), FifoPolicy())
    assert free.mean_step <= r.mean_step


def test_service_batch_limit_and_slowdown():
    d = _doc(rollout={"steps": 1, "trajectories_per_step": 3, "turns": 0, "think_s": 1.0},
             cluster=_gpu_cluster(slots=8),
             services=[{"name": "rm", "gpu_mem_mb": 500, "load_s": 5.0, "max_batch": 2, "batch_slowdown": 1.0}],
             actions=[{"name": "score", "kind": "reward", "service": "rm", "final": 1, "duration_s": 2.0}])
    w = parse_workload(d)
    r = simulate(w.sample(), ElasticScheduler(services=service_infos(w)))
    # a replica batches at most two: the first alone (2 s), the second in a full batch (2 x 2 s),
    # the third waits for a slot (the first ends at 3) and then runs with one other (4 s)
    assert sorted(r.act.tolist()) == [2.0, 4.0, 6.0]
    with pytest.raises(WorkloadError, match="not batchable"):
        parse_workload(_doc(cluster=_gpu_cluster(), services=[{"name": "rm", "gpu_mem_mb": 500, "load_s": 1,
                                                               "batchable": False, "max_batch": 4}],
                            actions=[{"name": "s", "kind": "reward", "service": "rm", "final": 1,
                                      "duration_s": 1.0}]))


def test_presets_use_the_new_features():
    swe, _math, judge = load_workload("swe"), load_workload("math"), load_workload("judge")
    assert swe.rollout.turns.lognormal and any(a.timeout_s for a in swe.actions)
    assert any(a.mem_mean_mb < a.mem_mb for a in swe.actions)
    assert load_workload("tir").rollout.sync_turns
    assert judge.rollout.parallel_finals and any(a.followups for a in judge.actions)
    assert any(s.max_batch and s.batch_slowdown for s in judge.services.values())
    assert any(a.hint_sigma for a in swe.actions)


# -- the static GPU layout, memory-bound sandboxes, the generated family --------------------------

def _two_services(judge_calls: int, rm_calls: int) -> dict:
    return _doc(cluster={"cpu_workers": 1, "cpu_cores": 1, "gpu_workers": 3, "gpus": 1, "gpu_mem_mb": 1000,
                         "gpu_slots": 4},
                rollout={"steps": 1, "trajectories_per_step": 1, "turns": 0, "think_s": 1.0},
                services=[{"name": "rm", "gpu_mem_mb": 300, "load_s": 5.0},
                          {"name": "judge", "gpu_mem_mb": 600, "load_s": 5.0}],
                actions=[{"name": "score", "kind": "reward", "service": "rm", "final": rm_calls, "duration_s": 2.0},
                         {"name": "grade", "kind": "reward", "service": "judge", "final": judge_calls,
                          "duration_s": 2.0}])


def test_the_static_layout_follows_demand_not_file_order():
    from tangram_hpc.sim.layout import service_demand, workload_layout
    heavy_judge = parse_workload(_two_services(judge_calls=4, rm_calls=1))
    d = service_demand(heavy_judge)
    assert d["judge"] == pytest.approx(4 * d["rm"])
    layout = workload_layout(heavy_judge)
    # every service has a replica; the more demanded one has more; nothing fits beside a judge but an rm
    assert sum("judge" in h for h in layout) == 3 and sum("rm" in h for h in layout) == 3
    doc = _two_services(judge_calls=4, rm_calls=1)
    doc["services"].reverse()
    assert workload_layout(parse_workload(doc)) == layout
    # four GPU workers of 600 MB: one service each, three for the judge
    small = heavy_judge.with_cluster(gpu_workers=4, gpu_mem_mb=600)
    assert sorted(map(tuple, workload_layout(small))) == [("judge",)] * 3 + [("rm",)]
    heavy_rm = parse_workload(_two_services(judge_calls=1, rm_calls=4)).with_cluster(gpu_workers=4, gpu_mem_mb=600)
    assert sorted(map(tuple, workload_layout(heavy_rm))) == [("judge",)] + [("rm",)] * 3


def test_a_static_policy_that_would_load_a_service_fails_loudly():
    from tangram_hpc.sim.baselines import PooledPolicy
    plan = parse_workload(_two_services(judge_calls=1, rm_calls=1)).with_cluster(gpu_workers=1).sample()
    infos = service_infos(plan.workload)

    class Lying(PooledPolicy):          # believes both loaded, keeps only rm
        def preloaded_services(self, worker_id, info):
            return ["rm"]
    with pytest.raises(RuntimeError, match="static policy sent a judge call"):
        simulate(plan, Lying("fifo", "min", infos, layout=[["rm", "judge"]]))
    # as the bench builds it, the policy believes exactly what is loaded, and never loads
    r = simulate(plan, PooledPolicy("fifo", "min", infos, layout=[["judge", "rm"]]))
    assert r.act.tolist() == [2.0, 2.0]


def test_trajectory_sandboxes_reserve_their_largest_actions_memory():
    from tangram_hpc.sim.baselines import sandbox_mem_mb
    d = _doc(cluster={"cpu_workers": 1, "cpu_cores": 4, "cpu_mem_mb": 1000},
             rollout={"steps": 1, "trajectories_per_step": 2, "turns": 1, "think_s": 1.0},
             actions=[{"name": "job", "kind": "sandbox", "weight": 1.0, "duration_s": 10.0, "mem_mb": 600}])
    plan = parse_workload(d).sample()
    assert sandbox_mem_mb(plan.workload) == 600
    # four free cores, but one sandbox's memory: the second trajectory waits for the first
    r = simulate(plan, TrajectoryBoundPolicy(1, {}, sandbox_mem_mb=600))
    assert sorted(r.act.tolist()) == [10.0, 20.0]
    r = simulate(plan, TrajectoryBoundPolicy(1, {}))
    assert r.act.tolist() == [10.0, 10.0]


def test_the_family_is_drawn_from_its_seed_and_each_member_is_a_workload_file():
    from tangram_hpc.sim.family import LOAD_RANGE, draw_family, offered_load, to_toml
    from tangram_hpc.sim.workload import _toml_loads
    fam = draw_family(40, 3)
    assert [d for d, _ in draw_family(10, 3)] == [d for d, _ in fam[:10]]     # a prefix of the larger family
    assert [d for d, _ in draw_family(10, 4)] != [d for d, _ in fam[:10]]
    for doc, w in fam:
        back = parse_workload(_toml_loads(to_toml(doc)))
        assert (back.rollout, back.cluster, back.actions, back.services) == (w.rollout, w.cluster, w.actions,
                                                                              w.services)
    loads = [offered_load(w) for _, w in fam]
    inside = sum(LOAD_RANGE[0] * 0.8 <= x <= LOAD_RANGE[1] * 1.2 for x in loads)
    assert inside >= 0.85 * len(fam) and max(loads) > 2 and min(loads) < 0.5
    # the space is covered: GPU services and none, barriers, parallel finals, lognormal turns, timeouts
    assert any(w.services for _, w in fam) and any(not w.services for _, w in fam)
    assert any(w.rollout.sync_turns for _, w in fam) and any(w.rollout.parallel_finals for _, w in fam)
    assert any(w.rollout.turns.lognormal for _, w in fam)
    assert any(a.timeout_s for _, w in fam for a in w.actions)
    assert any(a.followups for _, w in fam for a in w.actions)
