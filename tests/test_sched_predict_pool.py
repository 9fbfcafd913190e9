"""Duration/speedup learning and the pool controller's decisions."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tangram_hpc.actions import ActionSpec, Demand
from tangram_hpc.policy.base import Launch, PoolView, Reclaim, Withdraw, WorkerStatus
from tangram_hpc.policy.pool import ClusterCapacity, PartitionFree, PoolConfig, PoolController
from tangram_hpc.policy.predict import Predictor, amdahl_time, feature_key
from tangram_hpc.resources import CPU, GPU, WorkerInfo, WorkerShape

CPU_SHAPE = WorkerShape(16, 32000)
GPU_SHAPE = WorkerShape(8, 0, 1, 40000)


def test_predictor_prior_then_learns_duration():
    p = Predictor(default_duration=1.0)
    s = ActionSpec("sandbox", label="pytest")
    assert p.predict(s) == 1.0
    assert p.predict(ActionSpec("sandbox", label="pytest", duration_hint=7.0)) == 7.0
    rng = np.random.default_rng(0)
    for d in 20.0 * np.exp(rng.normal(0, 0.5, 300)):
        p.observe(s, float(d), 1)
    assert 14.0 < p.predict(s) < 28.0          # the median, not thrown off by the tail
    assert p.stats(s.action_class).mean() > p.stats(s.action_class).median()
    # classes do not mix
    assert p.predict(ActionSpec("sandbox", label="ls")) == 1.0


def test_predictor_learns_parallel_fraction_from_different_core_counts():
    p = Predictor(prior_parallel=0.3)
    s = ActionSpec("sandbox", label="build", demand=Demand(1, 16))
    rng = np.random.default_rng(1)
    for i in range(400):
        c = [1, 2, 4, 8, 16][i % 5]
        p.observe(s, amdahl_time(60.0, 0.9, c) * math.exp(rng.normal(0, 0.3)), c)
    assert abs(p.parallel_fraction(s) - 0.9) < 0.08
    assert abs(p.predict(s, 8) / amdahl_time(60.0, 0.9, 8) - 1) < 0.25
    # a rigid action never speeds up
    assert p.parallel_fraction(ActionSpec("sandbox", label="ls")) == 0.0


def test_predictor_learns_service_load_time():
    p = Predictor(default_load_time=30.0)
    assert p.load_time("judge") == 30.0
    p.observe_load("judge", 80.0)
    assert p.load_time("judge") == 80.0


def _ws(wid, shape=CPU_SHAPE, busy=0, running=0, idle_since=None, envs=0, draining=False):
    info = WorkerInfo(wid, shape.cores, shape.mem_mb, shape.gpus, shape.gpus * shape.gpu_mem_mb)
    return WorkerStatus(info, busy, running, idle_since, envs, draining)


def _backlog(n, secs=60.0, **kw):
    return [ActionSpec("sandbox", label="t", duration_hint=secs, **kw) for _ in range(n)]


def test_scale_up_on_backlog_respects_max_and_counts_starting_workers():
    pc = PoolController(PoolConfig([CPU_SHAPE, GPU_SHAPE], max_workers={"cpu": 5, "gpu": 2}, startup_s=60))
    view = PoolView(0.0, _backlog(200), [_ws("w1", busy=16, running=16)])
    out = pc.decide(view)
    assert out == [Launch(CPU_SHAPE, 4)]                    # capped by the maximum of 5
    # the same backlog with those 4 still starting: no second wave
    view = PoolView(1.0, _backlog(200), [_ws("w1", busy=16, running=16)], starting=[(CPU_SHAPE, 0.0)] * 4)
    assert pc.decide(view) == []
    assert "maximum" in pc.explain()
    # a small backlog the free capacity clears before a new worker starts: nothing
    pc2 = PoolController(PoolConfig([CPU_SHAPE], startup_s=60))
    assert pc2.decide(PoolView(0.0, _backlog(2, 1.0), [_ws("w1", busy=4, running=4)])) == []
    # GPU work asks for the GPU shape
    gpu = [ActionSpec("reward", demand=Demand(1, 1, 0, 1000, "judge"))]
    assert pc2.decide(PoolView(0.0, gpu, [])) == [] and "no gpu shape" in pc2.explain()
    pc3 = PoolController(PoolConfig([CPU_SHAPE, GPU_SHAPE]))
    assert pc3.decide(PoolView(0.0, gpu, [])) == [Launch(GPU_SHAPE, 1)]


def test_reclaims_only_idle_workers_after_ttl_and_environment_hosts_later():
    pc = PoolController(PoolConfig([CPU_SHAPE], idle_ttl_s=100, env_idle_ttl_s=300))
    workers = [
        _ws("busy", busy=4, running=1),
        _ws("envs", idle_since=0.0, envs=2),                  # idle but hosts sandboxes: waits longer
        _ws("young", idle_since=150.0),                        # idle, not for long
        _ws("old", idle_since=0.0),
        _ws("drained", idle_since=190.0, draining=True),
    ]
    out = pc.decide(PoolView(200.0, [], workers))
    assert sorted(r.worker_id for r in out if isinstance(r, Reclaim)) == ["drained", "old"]
    out = pc.decide(PoolView(400.0, [], [_ws("envs", idle_since=0.0, envs=2), _ws("busy", busy=4, running=1)]))
    assert [r.worker_id for r in out if isinstance(r, Reclaim)] == ["envs"]
    # never while work of that kind waits
    out = pc.decide(PoolView(200.0, _backlog(1, 0.1), [_ws("old", idle_since=0.0)]))
    assert not any(isinstance(r, Reclaim) for r in out)
    # min_workers keeps one
    pc2 = PoolController(PoolConfig([CPU_SHAPE], idle_ttl_s=100, min_workers={"cpu": 1}))
    out = pc2.decide(PoolView(200.0, [], [_ws("a", idle_since=0.0), _ws("b", idle_since=0.0)]))
    assert len([r for r in out if isinstance(r, Reclaim)]) == 1


def test_cluster_capacity_picks_partition_that_fits_and_is_idlest():
    a = WorkerShape(16, 32000, partition="cpu-a")
    b = WorkerShape(16, 32000, partition="cpu-b")
    pc = PoolController(PoolConfig([a, b], startup_s=60))
    pc.update_cluster(ClusterCapacity({"cpu-a": PartitionFree(cores=20), "cpu-b": PartitionFree(cores=64)}))
    out = pc.decide(PoolView(0.0, _backlog(400), []))
    assert out[0] == Launch(b, 4) and out[1] == Launch(a, 1)
    # both busy: the workers queue in the partition that is least busy rather than never start
    pc.update_cluster(ClusterCapacity({"cpu-a": PartitionFree(cores=0, max_node_cores=32),
                                       "cpu-b": PartitionFree(cores=8, max_node_cores=32)}))
    out = pc.decide(PoolView(100.0, _backlog(400), []))
    assert out == [Launch(b, 25)]     # 400 x 60 core-s over a 60 s start-up, 16 cores each (the driver throttles)
    # no node of either partition is big enough, ever: nothing is asked for, and it says why
    pc = PoolController(PoolConfig([a, b], startup_s=60))
    pc.update_cluster(ClusterCapacity({"cpu-a": PartitionFree(cores=64, max_node_cores=8),
                                       "cpu-b": PartitionFree(cores=64, max_node_cores=8)}))
    assert pc.decide(PoolView(0.0, _backlog(400), [])) == []
    assert "cannot hold" in pc.explain()


def test_drains_workers_near_their_time_limit_and_replaces_them():
    pc = PoolController(PoolConfig([CPU_SHAPE], startup_s=60, time_limit_margin_s=120))
    old = _ws("old", busy=16, running=16)
    old.ends_at = 1100.0
    other = _ws("other", busy=16, running=16)
    out = pc.decide(PoolView(1000.0, _backlog(50), [old, other]))
    assert Reclaim("old", "time limit") in out
    assert any(isinstance(d, Launch) and d.shape == CPU_SHAPE for d in out)
    # the last worker accepting work that waits is replaced first, drained once the replacement joined
    out = pc.decide(PoolView(1000.0, _backlog(50), [old]))
    assert not any(isinstance(d, Reclaim) for d in out)
    assert any(isinstance(d, Launch) and d.shape == CPU_SHAPE for d in out)
    assert Reclaim("old", "time limit") in pc.decide(PoolView(1000.0, [], [old]))
    # once draining it is not reclaimed twice, and far from its limit a worker is left alone
    old.draining = True
    assert Reclaim("old", "time limit") not in pc.decide(PoolView(1001.0, [], [old]))
    young = _ws("young", busy=16, running=16)
    young.ends_at = 5000.0
    assert not any(isinstance(d, Reclaim) for d in pc.decide(PoolView(1000.0, [], [young])))


def test_static_pool_replaces_and_gives_back_extras():
    from tangram_hpc.policy.static import StaticPool
    shape = WorkerShape(2)
    pool = StaticPool([shape, shape])
    assert pool.decide(PoolView(0.0, [], [])) == [Launch(shape, 2)]
    one = _ws("a", shape, idle_since=0.0)
    one.started_at = 1.0
    assert pool.decide(PoolView(5.0, [], [one], starting=[(shape, 4.0)])) == []
    # failed starts do not hold it back (the driver's launch throttle does): it asks again
    failures = [(10.0, "exit status 1"), (11.0, "exit status 1"), (13.0, "exit status 1")]
    assert pool.decide(PoolView(14.0, [], [one], failures=failures)) == [Launch(shape, 1)]
    # a lost worker came back: three where two are kept, and the idle extra is given back
    b, c = _ws("b", shape, idle_since=20.0), _ws("c", shape, busy=2, running=1)
    b.started_at = c.started_at = 20.0
    out = pool.decide(PoolView(30.0, [], [one, b, c], failures=failures))
    assert [d.worker_id for d in out if isinstance(d, Reclaim)] == ["a"]
    assert not any(isinstance(d, Launch) for d in out)


def test_a_returning_worker_and_its_replacement_are_not_both_given_back():
    from tangram_hpc.policy.static import StaticPool
    shape = WorkerShape(2)
    pool = StaticPool([shape])
    back = _ws("back", shape, idle_since=10.0)
    # the lost worker came back while its replacement starts: the launch is withdrawn, not the worker
    out = pool.decide(PoolView(11.0, [], [back], starting=[(shape, 5.0)]))
    assert out == [Withdraw(shape, 1, "more workers than the pool keeps")]
    # the replacement joined anyway: one of the two is given back, and only one
    new = _ws("new", shape, idle_since=12.0)
    out = pool.decide(PoolView(12.0, [], [back, new]))
    assert [d.worker_id for d in out if isinstance(d, Reclaim)] == ["back"]
    # while that one drains, the other is the pool: kept, and nothing launched
    back.draining = True
    assert pool.decide(PoolView(13.0, [], [back, new])) == []
    # a draining worker is no capacity: alone, it is replaced
    assert pool.decide(PoolView(14.0, [], [back])) == [Launch(shape, 1)]


def test_parallel_fraction_stays_at_the_prior_until_the_evidence_is_strong():
    rng = np.random.default_rng(3)
    s = ActionSpec("sandbox", label="t", demand=Demand(1, 16))
    # 7 and 8 cores only, run times spread 2.7x: they say next to nothing about p
    weak = Predictor(prior_parallel=0.7)
    for i in range(2000):
        c = 7 + i % 2
        weak.observe(s, amdahl_time(60.0, 0.9, c) * math.exp(rng.normal(0, 1.0)), c)
    assert abs(weak.parallel_fraction(s) - 0.7) < 0.12
    # a handful of runs at two counts do not move it either
    few = Predictor(prior_parallel=0.7)
    for c in (1, 16) * 5:
        few.observe(s, amdahl_time(60.0, 0.1, c), c)
    assert few.parallel_fraction(s) == 0.7
    # many runs at 1 and 16 cores do
    strong = Predictor(prior_parallel=0.7)
    for i in range(400):
        c = (1, 16)[i % 2]
        strong.observe(s, amdahl_time(60.0, 0.9, c) * math.exp(rng.normal(0, 0.3)), c)
    assert abs(strong.parallel_fraction(s) - 0.9) < 0.06


def test_speedup_evidence_counts_in_start_order_not_completion_order():
    # runs at 8 cores start first; at 1 core later.  The 1-core runs that end early are the short
    # ones; counted as they end they would make one core look as fast as eight.
    rng = np.random.default_rng(5)
    s = ActionSpec("sandbox", label="t", demand=Demand(1, 8))
    p = Predictor(prior_parallel=0.5, prior_parallel_sd=0.3, min_fit_runs=20)
    runs = []
    for i in range(300):
        c = 8 if i < 150 else 1
        d1 = 30.0 * math.exp(rng.normal(0, 1.0))
        start = i * 0.1
        spec = ActionSpec("sandbox", label="t", demand=Demand(1, 8), id=f"a{i}")
        p.started(spec, c, start)
        runs.append((start + amdahl_time(d1, 0.8, c), spec, c, start))
    for end, spec, c, start in sorted(runs, key=lambda r: r[0])[:200]:     # stop while long ones still run
        p.observe(spec, end - start, c, end)
    # what has been counted is a complete prefix by start time: no short-only 1-core sample
    st = p.stats(s.action_class)
    assert st.p is None or st.p > 0.5
    for end, spec, c, start in sorted(runs, key=lambda r: r[0])[200:]:
        p.observe(spec, end - start, c, end)
    assert abs(p.parallel_fraction(s) - 0.8) < 0.1


def test_speedup_is_learned_relative_to_hints_when_grants_follow_them():
    # the long runs (large hints) got 16 cores, the short ones 2: counted in seconds, the 16-core
    # runs look slow and the cores seem to buy little; relative to their hints they do not
    rng = np.random.default_rng(11)
    p = Predictor(prior_parallel=0.7)
    for i in range(600):
        hint = 120.0 * math.exp(rng.normal(0, 1.0))
        c = 16 if hint > 120.0 else 2
        truth = hint * math.exp(rng.normal(0, 0.2))
        spec = ActionSpec("sandbox", label="suite", demand=Demand(1, 16), duration_hint=hint, id=f"r{i}")
        p.started(spec, c, float(i))
        p.observe(spec, amdahl_time(truth, 0.9, c), c, float(i) + 1.0)
    assert abs(p.parallel_fraction(ActionSpec("sandbox", label="suite", demand=Demand(1, 16))) - 0.9) < 0.05


def test_young_classes_count_their_running_actions():
    # 100 runs of a class start together; 30 s later only the short ones have ended
    rng = np.random.default_rng(7)
    d = 100.0 * np.exp(rng.normal(0, 1.0, 100))
    p = Predictor()
    specs = [ActionSpec("sandbox", label="long", id=f"x{i}") for i in range(100)]
    for spec in specs:
        p.started(spec, 1, 0.0)
    for di, i in sorted((float(di), i) for i, di in enumerate(d) if di < 30):
        p.observe(specs[i], di, 1, di)
    naive = float(np.exp(np.mean(np.log(d[d < 30]))))
    assert p.predict(specs[0]) > 2.5 * naive             # the running 70 % pull it up
    assert p.predict(specs[0]) < 200


def test_hints_are_calibrated_per_class_and_rank_inside_it():
    p = Predictor()
    rng = np.random.default_rng(2)
    for i in range(50):          # this client's hints are twice the truth
        true = float(np.exp(rng.normal(2, 1)))
        p.observe(ActionSpec("sandbox", label="t", duration_hint=2 * true), true, 1)
    assert p.predict(ActionSpec("sandbox", label="t", duration_hint=40.0)) == pytest.approx(20.0, rel=0.25)
    assert p.predict(ActionSpec("sandbox", label="t", duration_hint=4.0)) < \
        p.predict(ActionSpec("sandbox", label="t", duration_hint=40.0))


def test_unlabelled_commands_are_learned_per_program():
    assert feature_key(ActionSpec("sandbox", {"cmd": "pytest -x tests/a.py"})) == "sandbox:pytest"
    assert feature_key(ActionSpec("sandbox", {"cmd": "/usr/bin/python3 setup.py build"})) == \
        "sandbox:python3 setup.py"
    assert feature_key(ActionSpec("sandbox", {"cmd": "ls"}, label="x")) == "sandbox:x"
    assert feature_key(ActionSpec("function", {"fn": "m:f"})) == "function:m:f"
    p = Predictor()
    for _ in range(5):
        p.observe(ActionSpec("sandbox", {"cmd": "pytest -q"}), 30.0, 1)
        p.observe(ActionSpec("sandbox", {"cmd": "ls -l"}), 0.1, 1)
    assert p.predict(ActionSpec("sandbox", {"cmd": "pytest tests/b.py"})) == pytest.approx(30.0)
    assert p.predict(ActionSpec("sandbox", {"cmd": "ls"})) == pytest.approx(0.1)


def test_classes_from_clients_are_bounded_and_the_overflow_learns_under_its_kind():
    p = Predictor(max_classes=4)
    for label in ("a", "b", "c"):
        p.observe(ActionSpec("sandbox", label=label), 10.0, 1)
    p.observe(ActionSpec("sandbox", {"cmd": "make all"}), 20.0, 1)       # the fourth: full now
    for i in range(500):      # a client sending ever new labels, programs and services
        p.observe(ActionSpec("sandbox", label=f"new{i}"), 2.0, 1)
        p.observe(ActionSpec("sandbox", {"cmd": f"prog{i} -x"}), 2.0, 1)
        p.observe(ActionSpec("reward", demand=Demand(1, 1, 0, 10, f"svc{i}")), 3.0, 1)
        p.observe(ActionSpec("reward", label="same", demand=Demand(1, 1, 0, 10, f"svc{i}")), 3.0, 1)
    # the classes seen first keep learning as their own; each kind adds one class for the rest
    assert set(p._classes) == {"sandbox:a", "sandbox:b", "sandbox:c", "sandbox:make", "sandbox", "reward"}
    assert len(p._by_ck) <= 2 * p.max_classes
    assert p.predict(ActionSpec("sandbox", label="a")) == pytest.approx(10.0)
    assert p.predict(ActionSpec("sandbox", {"cmd": "make -j8"})) == pytest.approx(20.0)
    assert p.predict(ActionSpec("sandbox", label="never-seen")) == pytest.approx(2.0)     # its kind's figure
    assert p.predict(ActionSpec("reward", demand=Demand(1, 1, 0, 10, "other"))) == pytest.approx(3.0)
    st = p.class_stats(ActionSpec("sandbox", label="zzz"))
    assert st is p.stats("sandbox") and st.n == 1000


def test_class_stats_kept_by_the_caller_learn_the_same_as_looked_up_each_time():
    # a labelled multi-core class, an unlabelled one keyed by its program, and a service's calls,
    # young (running ones counted) and then fitted: passing the kept stats changes nothing
    rng = np.random.default_rng(3)
    looked_up, kept = Predictor(min_fit_runs=5), Predictor(min_fit_runs=5)
    specs = []
    for i in range(240):
        kind = i % 3
        if kind == 0:
            spec = ActionSpec("sandbox", label="build", demand=Demand(1, 8), id=f"b{i}",
                              duration_hint=None if i % 2 else 20.0)
        elif kind == 1:
            spec = ActionSpec("sandbox", {"cmd": f"pytest -x t{i}.py"}, id=f"p{i}")
        else:
            spec = ActionSpec("reward", demand=Demand(1, 1, 0, 1000, "judge"), id=f"j{i}")
        specs.append(spec)
    running = []
    for i, spec in enumerate(specs):
        now = float(i)
        st = kept.class_stats(spec)
        assert kept.class_stats(spec) is st and kept.stats(feature_key(spec)) is st
        assert kept.estimate(spec, st) == looked_up.estimate(spec)
        cores = 1 + i % 8 if spec.demand.max_cores > 1 else 1
        looked_up.started(spec, cores, now)
        kept.started(spec, cores, now, st)
        running.append((now + 5.0 * math.exp(rng.normal(0, 1.0)), spec, cores, now, st))
        running.sort(key=lambda r: r[0])
        while running and running[0][0] <= now:
            end, s, c, t0, sst = running.pop(0)
            ok = int(end * 10) % 7 != 0
            looked_up.observe(s, end - t0 if ok else None, c, end)
            kept.observe(s, end - t0 if ok else None, c, end, sst)
    for key in ("sandbox:build", "sandbox:pytest", "reward:judge"):
        a, b = looked_up.stats(key), kept.stats(key)
        assert (a.n, a.mu, a.var, a.p, a.mu_adj, a.hint_n, a.fed) == (b.n, b.mu, b.var, b.p, b.mu_adj, b.hint_n, b.fed)
    assert looked_up.stats("sandbox:build").p is not None       # the fit ran, on both
    for spec in specs[:3]:
        assert kept.estimate(spec) == looked_up.estimate(spec) == kept.estimate(spec, kept.class_stats(spec))


def _cpu(n, busy=0, idle_since=None):
    return [_ws(f"w{i}", busy=busy, running=1 if busy else 0, idle_since=idle_since) for i in range(n)]


def test_pool_grows_in_proportion_to_demand_in_one_wave():
    pc = PoolController(PoolConfig([CPU_SHAPE], startup_s=60, target_util=0.8))
    # 2 workers of 16 cores, 1000 cores' worth of work arriving per second
    view = PoolView(0.0, [], _cpu(2, busy=16), offered_load={"cpu": 1000.0})
    [launch] = pc.decide(view)
    assert launch.count == math.ceil((1000 / 0.8 - 32) / 16)
    # starting workers count: no second wave
    view = PoolView(5.0, [], _cpu(2, busy=16), starting=[(CPU_SHAPE, 0.0)] * launch.count,
                    offered_load={"cpu": 1000.0})
    assert pc.decide(view) == []


def test_pool_holds_the_step_peak_across_the_boundary_and_prescales():
    cfg = PoolConfig([CPU_SHAPE], startup_s=60, idle_ttl_s=100)
    pc = PoolController(cfg)
    # step 0 at its peak: 10 workers busy, demand for 150 cores
    pc.decide(PoolView(0.0, [], _cpu(10, busy=16), step=0, offered_load={"cpu": 150 * 0.75}))
    # its tail: one worker busy, nine idle long past the TTL: all are kept for the next step
    tail = [_ws("w0", busy=4, running=1)] + [_ws(f"w{i}", idle_since=10.0) for i in range(1, 10)]
    out = pc.decide(PoolView(400.0, [], tail, step=0, offered_load={"cpu": 4.0}))
    assert not any(isinstance(d, Reclaim) for d in out)
    assert pc.held("cpu", 400.0) >= 150
    # a new step that finds less capacity (workers lost meanwhile) pre-scales to the last peak at once
    out = pc.decide(PoolView(410.0, [], [_ws("w0", idle_since=405.0)], step=1, offered_load={"cpu": 0.0}))
    assert sum(d.count for d in out if isinstance(d, Launch)) == math.ceil(150 / 16) - 1
    # and says so (the coordinator's log would otherwise give the few actions waiting as the reason)
    assert all(d.reason.startswith("the step peak of 1") and "held for the next step" in d.reason
               for d in out if isinstance(d, Launch))
    # the run goes quiet (no action ran or waited for longer than the hold): capacity is let go
    quiet = [_ws(f"w{i}", idle_since=410.0) for i in range(10)]
    assert pc.held("cpu", 410.0 + 101) == 0
    out = pc.decide(PoolView(410.0 + 101 + 100, [], quiet, step=1, offered_load={"cpu": 0.0}))
    assert len([d for d in out if isinstance(d, Reclaim)]) == 10


def test_reward_workers_scale_from_zero():
    pc = PoolController(PoolConfig([CPU_SHAPE, WorkerShape(1, 0, 0, 4096)], startup_s=30))
    reward = [ActionSpec("reward", demand=Demand(1, 1, 0, 2000, "judge"))]
    out = pc.decide(PoolView(0.0, reward, [_ws("c", idle_since=0.0)]))
    assert out == [Launch(WorkerShape(1, 0, 0, 4096), 1)]


def test_startup_time_is_learned_from_the_workers_that_joined():
    cfg = PoolConfig([CPU_SHAPE], startup_s=120, max_workers={"cpu": 100})
    pc = PoolController(cfg)
    backlog = _backlog(64, secs=30.0)        # 64 x 30 core-seconds waiting
    joined = [WorkerStatus(WorkerInfo("w0", 16), busy_cores=16, running=16, started_at=12.0, launched_at=10.0,
                           shape=CPU_SHAPE)]
    assert pc.startup_s(PoolView(0.0, [], [_ws("w1")])) == 120       # nothing seen yet: the guess
    assert pc.startup_s(PoolView(20.0, [], joined)) == 2.0
    # 1920 core-seconds to clear in a 2 s start-up rather than 120 s: many more workers at once
    def launched(controller, workers):
        view = PoolView(20.0, backlog, workers, offered_load={"cpu": 0.0})
        return sum(d.count for d in controller.decide(view) if isinstance(d, Launch))
    guessed = [WorkerStatus(WorkerInfo("w0", 16), busy_cores=16, running=16, shape=CPU_SHAPE)]
    assert launched(pc, joined) >= 1920 / 2 / 16 - 1 > launched(PoolController(cfg), guessed)


def test_a_decaying_offered_load_does_not_keep_an_idle_pool():
    cfg = PoolConfig([CPU_SHAPE], idle_ttl_s=4)
    pc = PoolController(cfg)
    pc.decide(PoolView(0.0, [], [_ws("w0", busy=2, running=2)], offered_load={"cpu": 2.0}))
    # the burst ended at t=1; the policy's estimate of the offered load decays but never reaches 0
    idle = [_ws("w0", idle_since=1.0)]
    assert pc.decide(PoolView(3.0, [], idle, offered_load={"cpu": 1.5})) == []          # within the TTL
    assert pc.decide(PoolView(30.0, [], idle, offered_load={"cpu": 0.9})) == [Reclaim("w0", "idle")]


def test_a_huge_backlog_is_summed_from_a_sample_that_sees_every_action_in_turn():
    # Each waiting action's predicted core-seconds costs a predictor call in the coordinator's loop:
    # past BACKLOG_SAMPLE of a class, a decision sums every k-th (another offset each time) and scales.
    cap = PoolController.BACKLOG_SAMPLE
    n = 3 * cap + 7
    cpu = [ActionSpec("sandbox", label="t", duration_hint=float(1 + i % 50), id=f"c{i}") for i in range(n)]
    cpu[n // 2] = ActionSpec("sandbox", label="t", demand=Demand(12, 12), duration_hint=1.0, id="big")
    gpu = [ActionSpec("reward", demand=Demand(1, 1, 0, 1000, "judge"), id=f"g{i}") for i in range(3)]
    pred = Predictor()
    exact = {"cpu": sum(pred.mean_core_seconds(s) for s in cpu), "gpu": sum(pred.mean_core_seconds(s) for s in gpu)}
    asked: list[str] = []

    class Counting(Predictor):
        def mean_core_seconds(self, spec):
            asked.append(spec.id)
            return super().mean_core_seconds(spec)
    pc = PoolController(PoolConfig([CPU_SHAPE, GPU_SHAPE]), Counting())
    seen: set[str] = set()
    for turn in range(4):
        asked.clear()
        demand = pc._tally(PoolView(float(turn), cpu + gpu, []))
        assert sum(a.startswith("c") or a == "big" for a in asked) <= cap and sum(a.startswith("g") for a in asked) == 3
        assert (demand[CPU].waiting, demand[GPU].waiting) == (n, 3)
        assert demand[CPU].biggest == 12                    # the one large action, whether sampled or not
        assert demand[CPU].backlog == pytest.approx(exact["cpu"], rel=0.02)
        assert demand[GPU].backlog == pytest.approx(exact["gpu"])     # a small class is summed whole
        seen.update(asked)
    assert seen >= {s.id for s in cpu}                      # every action counted within a few decisions
    small = PoolController(PoolConfig([CPU_SHAPE]), Predictor())
    d = small._tally(PoolView(0.0, cpu[:cap], []))[CPU]
    assert d.backlog == sum(pred.mean_core_seconds(s) for s in cpu[:cap])   # at the limit: exact, in order


def test_gpu_workers_are_held_while_the_run_acts_though_their_calls_come_minutes_apart():
    """A GPU worker's worth is its resident models: idle past the TTL while the trajectories still
    act on the CPU side, it is kept (their next call would wait a start-up and a load); once the
    whole run has gone quiet it is let go."""
    pc = PoolController(PoolConfig([CPU_SHAPE, GPU_SHAPE], startup_s=60, idle_ttl_s=100))
    pc.decide(PoolView(0.0, [], [_ws("c", busy=16, running=4), _ws("g", GPU_SHAPE, busy=1, running=1)],
                       step=0, offered_load={"cpu": 16.0, "gpu": 1.0}))
    acting = [_ws("c", busy=16, running=4), _ws("g", GPU_SHAPE, idle_since=10.0)]
    out = pc.decide(PoolView(400.0, [], acting, step=0, offered_load={"cpu": 16.0, "gpu": 0.0}))
    assert not any(isinstance(d, Reclaim) for d in out) and pc.held("gpu", 400.0) >= GPU_SHAPE.cores
    quiet = [_ws("c", idle_since=405.0), _ws("g", GPU_SHAPE, idle_since=10.0)]
    out = pc.decide(PoolView(400.0 + 101 + 100, [], quiet, step=0, offered_load={"cpu": 0.0, "gpu": 0.0}))
    assert sorted(d.worker_id for d in out if isinstance(d, Reclaim)) == ["c", "g"]
