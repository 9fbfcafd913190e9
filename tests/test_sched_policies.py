"""Invariants of the action-level policies (elastic and FIFO) under random event sequences."""
from __future__ import annotations

from functools import partial

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tangram_hpc.actions import ActionSpec, Demand
from tangram_hpc.policy.elastic import ElasticScheduler
from tangram_hpc.policy.fifo import FifoPolicy
from tangram_hpc.policy.predict import Predictor
from tangram_hpc.policy.base import light_capacity
from tangram_hpc.resources import ServiceInfo, WorkerInfo, WorkerShape

CPU = frozenset({"sandbox", "function"})
GPU = frozenset({"reward"})
SERVICES = {"judge": 600, "rm": 300, "tiny": 100}

# one event: (op, a, b, c) with small integers interpreted per op
event = st.tuples(st.sampled_from(["submit", "submit", "submit", "finish", "finish", "add", "remove",
                                   "drain", "cancel", "schedule"]),
                  st.integers(0, 30), st.integers(0, 30), st.integers(0, 30))


def _spec(i: int, a: int, b: int, c: int) -> ActionSpec:
    if a % 7 == 1:          # zero-core ("light") action
        return ActionSpec("function", id=f"a{i}", demand=Demand(0, b % 3), priority=c % 3 - 1)
    if a % 5 == 0:
        svc = sorted(SERVICES)[b % 3]
        return ActionSpec("reward", id=f"a{i}", demand=Demand(1 + c % 2, 1 + c % 2, 0, SERVICES[svc], svc),
                          priority=b % 3 - 1)
    lo = 1 + a % 3
    return ActionSpec("sandbox", id=f"a{i}", env=(f"e{b % 6}" if c % 2 else None),
                      demand=Demand(lo, lo + b % 6, mem_mb=(c % 4) * 1000),
                      duration_hint=float(1 + b), priority=c % 3 - 1, label=f"c{a % 4}")


def _replay(policy_cls, events):
    """Drive a policy through ``events``; check invariants after every schedule; return its decisions."""
    p = policy_cls(shapes=[WorkerShape(8, 8000), WorkerShape(4, 0, 1, 1000)])
    workers: dict[str, WorkerInfo] = {}
    running: dict[str, tuple[str, int, ActionSpec]] = {}
    env_host: dict[str, str] = {}
    decisions = []
    now = 0.0
    nsub = 0
    nw = 0
    specs: dict[str, ActionSpec] = {}
    for op, a, b, c in events:
        now += 0.5
        if op == "add" or not workers:
            nw += 1
            if (a + nw) % 3 == 0:
                info = WorkerInfo(f"g{nw}", 4, 0, 1, 1000, kinds=GPU)
            else:
                info = WorkerInfo(f"w{nw}", 4 + a % 5, 8000, kinds=CPU)
            workers[info.id] = info
            p.add_worker(info, now)
            continue
        if op == "submit":
            s = _spec(nsub, a, b, c)
            nsub += 1
            specs[s.id] = s
            p.submit(s, now)
        elif op == "finish" and running:
            aid = sorted(running)[a % len(running)]
            del running[aid]
            p.finished(aid, now, run_time=1.0 + b)
        elif op == "remove" and len(workers) > 1:
            wid = sorted(workers)[a % len(workers)]
            lost = p.remove_worker(wid, now)
            assert sorted(lost) == sorted(k for k, v in running.items() if v[0] == wid)
            for k in lost:
                del running[k]
            del workers[wid]
            for e in [e for e, h in env_host.items() if h == wid]:
                del env_host[e]
        elif op == "drain":
            p.set_draining(sorted(workers)[a % len(workers)], bool(b % 2))
        elif op == "cancel" and nsub:
            aid = f"a{a % nsub}"
            expected = aid not in running and _is_pending(p, aid)
            assert p.cancel(aid) == expected
            assert not _is_pending(p, aid)
        for asg in p.schedule(now):
            spec = specs[asg.action_id]
            assert asg.action_id not in running
            assert asg.worker_id in workers
            info = workers[asg.worker_id]
            assert spec.kind in info.kinds
            d = spec.demand
            assert d.min_cores <= asg.cores <= max(d.min_cores, d.max_cores)
            if d.min_cores == 0:
                assert asg.cores == 0
            running[asg.action_id] = (asg.worker_id, asg.cores, spec)
            if spec.env is not None:
                host = env_host.setdefault(spec.env, asg.worker_id)
                assert host == asg.worker_id, "environment affinity broken"
            decisions.append((now, asg.action_id, asg.worker_id, asg.cores))
        for env in p.env_moves():      # as the drivers do: take its waiting actions back, unpin, resubmit
            assert not any(v[2].env == env for v in running.values()), "moved an environment in use"
            assert env in env_host
            waiting = [s for s in p.pending_actions() if s.env == env]
            assert waiting
            for s in waiting:
                assert p.cancel(s.id)
            p.close_env(env)
            del env_host[env]
            decisions.append((now, "move", env, 0))
            for s in waiting:
                p.submit(s, now)
        # capacity never exceeded
        for wid, info in workers.items():
            on = [v for v in running.values() if v[0] == wid]
            assert sum(v[1] for v in on) <= info.cores
            assert sum(1 for v in on if v[2].demand.min_cores == 0) <= light_capacity(info)
            assert sum(v[2].demand.mem_mb for v in on) <= (info.mem_mb or 10**9)
            svcs = {v[2].demand.service for v in on if v[2].demand.service}
            assert sum(SERVICES[s] for s in svcs) <= info.gpu_mem_mb
        assert p.running_count == len(running)
    return decisions


def _is_pending(p, aid: str) -> bool:
    return any(s.id == aid for s in p.pending_actions())


@pytest.mark.parametrize("policy_cls", [ElasticScheduler, FifoPolicy, partial(ElasticScheduler, env_move_s=0.5),
                                       partial(ElasticScheduler, barriers=True)],
                         ids=["elastic", "fifo", "elastic-moving-envs", "elastic-barriers"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(event, min_size=5, max_size=120))
def test_capacity_affinity_and_determinism(policy_cls, events):
    first = _replay(policy_cls, events)
    assert _replay(policy_cls, events) == first


def test_env_actions_follow_their_environment():
    p = ElasticScheduler()
    p.add_worker(WorkerInfo("w1", 4, kinds=CPU), 0)
    p.add_worker(WorkerInfo("w2", 4, kinds=CPU), 0)
    p.submit(ActionSpec("sandbox", id="x1", env="E"), 0)
    p.submit(ActionSpec("sandbox", id="x2", env="E"), 0)     # before the env has a host
    a, b = p.schedule(0)
    host = a.worker_id
    assert b.worker_id == host
    # fill the env's host; its next action must wait rather than go elsewhere
    p.submit(ActionSpec("sandbox", id="big", demand=Demand(2, 2)), 0)
    assert [x.worker_id for x in p.schedule(0)] != [host]
    p.submit(ActionSpec("sandbox", id="hog", demand=Demand(2, 2)), 0)
    p.submit(ActionSpec("sandbox", id="x3", env="E"), 0)
    out = {x.action_id: x.worker_id for x in p.schedule(0)}
    assert out.get("hog") == host and "x3" not in out      # host is full, the other worker is not
    p.finished("x1", 1, run_time=1)
    assert {x.action_id: x.worker_id for x in p.schedule(1)} == {"x3": host}
    assert p.env_host("E") == host
    lost = p.remove_worker(host, 2)
    assert p.env_host("E") is None
    assert sorted(lost) == ["hog", "x2", "x3"]


def test_environment_moves_off_a_full_host_when_its_action_would_finish_sooner_elsewhere():
    def setup(move_s):
        p = ElasticScheduler(env_move_s=move_s)
        p.add_worker(WorkerInfo("w1", 1, kinds=CPU), 0)
        p.submit(ActionSpec("sandbox", id="e1", env="E", duration_hint=1.0), 0)
        assert [a.worker_id for a in p.schedule(0)] == ["w1"]
        p.finished("e1", 1, run_time=1.0)
        # w1's only core: a long action of another environment it hosts
        p.submit(ActionSpec("sandbox", id="f1", env="F", duration_hint=100.0), 1)
        assert [a.worker_id for a in p.schedule(1)] == ["w1"]
        p.add_worker(WorkerInfo("w2", 2, kinds=CPU), 1)
        p.submit(ActionSpec("sandbox", id="e2", env="E", duration_hint=1.0), 2)
        return p, p.schedule(2)

    p, starts = setup(None)        # environments stay put: E's action waits for w1
    assert starts == [] and p.env_moves() == [] and p.env_host("E") == "w1"
    p, starts = setup(2.0)
    assert starts == [] and p.env_moves() == ["E"] and p.env_moves() == []      # asked once
    # the driver takes E's action back, unpins E and submits it again once E is saved
    assert p.cancel("e2")
    p.close_env("E")
    p.submit(ActionSpec("sandbox", id="e2", env="E", duration_hint=1.0), 4)
    assert [(a.action_id, a.worker_id) for a in p.schedule(4)] == [("e2", "w2")]
    assert p.env_host("E") == "w2" and p.env_host("F") == "w1"
    p, _ = setup(1000.0)           # a move that costs more than the wait is not asked for
    assert p.env_moves() == []


def test_an_idle_environment_leaves_a_crowded_worker_while_its_agent_thinks():
    """An action ends on a worker whose own queue waits: its environment moves if moves are quick
    against the learned think time and another worker has clearly more free cores."""
    def run(move_s, think_s, big_cores):
        p = ElasticScheduler(env_move_s=move_s)
        p.add_worker(WorkerInfo("w1", 2, kinds=CPU), 0)
        p.submit(ActionSpec("sandbox", id="H0", env="H", duration_hint=1.0), 0)
        p.submit(ActionSpec("sandbox", id="E0", env="E", duration_hint=1.0), 0)
        assert len(p.schedule(0)) == 2
        p.finished("H0", 1, run_time=1.0)
        p.finished("E0", 1, run_time=1.0)
        p.submit(ActionSpec("sandbox", id="F0", env="F", duration_hint=50.0), 1)
        assert [a.action_id for a in p.schedule(1)] == ["F0"]
        t = 1 + think_s                # E's agent thought this long: the policy learns it
        p.submit(ActionSpec("sandbox", id="E1", env="E", duration_hint=1.0), t)
        p.submit(ActionSpec("sandbox", id="H1", env="H", duration_hint=1.0), t)
        started = {a.action_id for a in p.schedule(t)}
        assert started == {"E1"} and p.env_host("H") == "w1"      # w1 is full: H1 waits in its own queue
        assert p.env_moves() == []     # nowhere else to go yet
        p.add_worker(WorkerInfo("w2", big_cores, kinds=CPU), t + 0.5)
        p.finished("E1", t + 1, run_time=1.0)
        return p.env_moves()

    assert run(move_s=1.0, think_s=20.0, big_cores=16) == ["E"]
    assert run(move_s=15.0, think_s=20.0, big_cores=16) == []    # the next action would often come first
    assert run(move_s=1.0, think_s=20.0, big_cores=4) == []      # nowhere clearly better to go


def test_an_environment_leaves_a_worker_that_cannot_give_the_widest_grant_while_its_agent_thinks():
    """No queue on its host, but a wide elastic action there leaves fewer free cores than the
    kind's widest grant: an environment whose action ends moves to a clearly emptier worker."""
    def run(wide_cores):
        p = ElasticScheduler(Predictor(prior_parallel=0.95), env_move_s=1.0)
        p.add_worker(WorkerInfo("w1", 32, kinds=CPU), 0)
        p.submit(ActionSpec("sandbox", id="E0", env="E", duration_hint=1.0), 0)
        assert len(p.schedule(0)) == 1
        p.finished("E0", 1, run_time=1.0)
        p.submit(ActionSpec("sandbox", id="E1", env="E", duration_hint=1.0), 21)    # 20 s of thinking
        p.submit(ActionSpec("sandbox", id="W", env="F", demand=Demand(1, wide_cores), duration_hint=500.0,
                            label="suite"), 21)
        assert {a.action_id for a in p.schedule(21)} == {"E1", "W"}
        p.add_worker(WorkerInfo("w2", 32, kinds=CPU), 21)
        p.finished("E1", 22, run_time=1.0)
        return p.env_moves()

    assert run(wide_cores=24) == ["E"]       # w1 has 8 free cores: a 24-core action would not fit
    assert run(wide_cores=4) == []           # w1 can still give the widest grant: E stays


def test_a_worker_keeps_cores_out_of_elastic_grants_for_its_environments_commands():
    def grant(commands: int, idle_s: float = 0.0, cores: int = 16, at_once: int = 1) -> int:
        p = ElasticScheduler(Predictor(prior_parallel=0.95), min_gain=0.0)    # every core is worth having
        p.add_worker(WorkerInfo("w", cores, kinds=CPU), 0)
        t = 0.0
        for i in range(commands):     # one-core commands of E0.., at_once at a time: that many cores in use
            for k in range(at_once):
                p.submit(ActionSpec("sandbox", id=f"s{i}-{k}", env=f"E{k}", duration_hint=10.0), t)
            assert len(p.schedule(t)) == at_once
            t += 10.0
            for k in range(at_once):
                p.finished(f"s{i}-{k}", t, run_time=10.0)
        t += idle_s
        p.submit(ActionSpec("sandbox", id="wide", env="F", demand=Demand(1, cores), duration_hint=100.0,
                            label="suite"), t)
        [a] = p.schedule(t)
        return a.cores

    assert grant(0) == 16 and grant(0, cores=64) == 64   # nothing of the kind ran on it: everything
    assert grant(12) == 15              # E's next command finds a free core
    assert grant(12, idle_s=300.0) == 16   # the commands stopped long ago: nothing held back
    assert grant(12, cores=4) == 4      # a core of four is too much to hold back
    # 16 commands at a time on 64 cores: their count swings by about 4 (its square root), and
    # so many are held back; the whole average (16) would starve the wide action
    assert grant(30, cores=64, at_once=16) == 60
    assert grant(30, cores=64, at_once=4) == 62
    assert grant(30, cores=16, at_once=16) == 14   # at most an eighth of the worker


def _burst_at_a_barrier(barriers: bool, straggler: str) -> tuple[float, dict[str, int]]:
    """Three long elastic actions of one turn, pinned to a worker where a 4-core command leaves 12
    cores: when does the last end (true parallel fraction 0.95, ``straggler`` 10x the others' run),
    and on how many cores did each run?"""
    p = ElasticScheduler(Predictor(prior_parallel=0.95), barriers=barriers)
    p.add_worker(WorkerInfo("w1", 16, kinds=CPU), 0)
    for e in "ABC":       # each environment's first command pins it to w1
        p.submit(ActionSpec("sandbox", id=f"{e}0", env=e, duration_hint=0.5), 0)
    p.submit(ActionSpec("sandbox", id="X", env="X", demand=Demand(4, 4), duration_hint=2.0), 0)
    assert len(p.schedule(0)) == 4
    p.add_worker(WorkerInfo("w2", 64, kinds=CPU), 0)      # roomy elsewhere: the share is not the limit
    for e in "ABC":
        p.finished(f"{e}0", 1, run_time=1.0)
    one_core = {"A1": 20.0, "B1": 20.0, "C1": 20.0}
    one_core[straggler] = 200.0
    for aid in one_core:
        p.submit(ActionSpec("sandbox", id=aid, env=aid[0], demand=Demand(1, 8), duration_hint=20.0,
                            label="search"), 1)
    ends = {"X": 2.0}
    cores: dict[str, int] = {}
    now = 1.0
    while True:
        for a in p.schedule(now):
            cores[a.action_id] = a.cores
            ends[a.action_id] = now + one_core[a.action_id] * (0.05 + 0.95 / a.cores)
        if not ends:
            return now, cores
        aid = min(ends, key=lambda k: (ends[k], k))
        now = ends.pop(aid)
        p.finished(aid, now, run_time=1.0)


def test_at_a_barrier_each_long_elastic_action_of_a_burst_gets_its_cores():
    """Without barriers the three split the 12 free cores evenly (right for mean ACT among actions
    of one predicted size); with them, each runs on its 8 cores, one now and two as cores free,
    and the turn ends sooner whichever of them turns out long."""
    for straggler in ("A1", "B1", "C1"):
        end_split, split = _burst_at_a_barrier(False, straggler)
        end_held, held = _burst_at_a_barrier(True, straggler)
        assert sorted(split[a] for a in ("A1", "B1", "C1")) == [4, 4, 4]
        assert [held[a] for a in ("A1", "B1", "C1")] == [8, 8, 8]
        assert end_held < 0.75 * end_split


def test_at_a_barrier_an_elastic_action_short_of_cores_promised_in_the_same_call_waits_for_a_later_one():
    """Three 8-core searches whose environments live on an idle 16-core worker: two get 8 each, the
    third does not start on the core left but waits for one of them to end; without barriers
    the three share the worker."""
    def run(barriers: bool) -> tuple[list[int], list[int]]:
        p = ElasticScheduler(Predictor(prior_parallel=0.95), barriers=barriers)
        p.add_worker(WorkerInfo("w1", 16, kinds=CPU), 0)
        for e in "ABC":       # each environment's first command pins it to w1
            p.submit(ActionSpec("sandbox", id=f"{e}0", env=e, duration_hint=0.5), 0)
        assert len(p.schedule(0)) == 3
        p.add_worker(WorkerInfo("w2", 64, kinds=CPU), 0)      # roomy elsewhere: the share is not the limit
        for e in "ABC":
            p.finished(f"{e}0", 1, run_time=1.0)
            p.submit(ActionSpec("sandbox", id=f"{e}1", env=e, demand=Demand(1, 8), duration_hint=20.0,
                                label="search"), 1)
        first = p.schedule(1)
        p.finished(first[0].action_id, 5, run_time=4.0)
        return [a.cores for a in first], [a.cores for a in p.schedule(5)]

    assert run(True) == ([8, 8], [8])
    first, later = run(False)
    assert len(first) == 3 and sum(first) == 16 and later == []


def test_at_a_barrier_actions_of_one_class_keep_their_submission_order():
    """The class estimate falls between two submits: shortest-predicted-first would run the later
    one first; at a barrier the older goes first (their sizes differ only by that drift)."""
    def first_of(barriers: bool) -> str:
        p = ElasticScheduler(barriers=barriers)
        p.add_worker(WorkerInfo("w", 1, kinds=CPU), 0)
        p.submit(ActionSpec("sandbox", id="Y", label="other", duration_hint=10.0), 0)
        assert len(p.schedule(0)) == 1
        p.submit(ActionSpec("sandbox", id="S0", label="cell"), 1)
        for _ in range(5):
            p.predictor.observe(ActionSpec("sandbox", label="cell"), 0.1, 1)
        p.submit(ActionSpec("sandbox", id="S1", label="cell"), 2)
        assert p.schedule(2) == []
        p.finished("Y", 10, run_time=10.0)
        [a] = p.schedule(10)
        return a.action_id

    assert first_of(False) == "S1"
    assert first_of(True) == "S0"


def test_moves_while_the_agent_thinks_follow_the_spread_of_think_times_not_their_mean():
    def moves(gaps: list[float], move_s: float = 10.0) -> list[str]:
        p = ElasticScheduler(Predictor(prior_parallel=0.95), env_move_s=move_s)
        p.add_worker(WorkerInfo("w1", 32, kinds=CPU), 0)
        t = 0.0
        for i, g in enumerate(gaps):        # E's agent: an action, then a think of g seconds
            p.submit(ActionSpec("sandbox", id=f"E{i}", env="E", duration_hint=1.0), t)
            assert len(p.schedule(t)) == 1
            p.finished(f"E{i}", t + 1, run_time=1.0)
            assert p.env_moves() == []      # w1 is roomy so far
            t += 1 + g
        p.submit(ActionSpec("sandbox", id="last", env="E", duration_hint=1.0), t)
        p.submit(ActionSpec("sandbox", id="W", env="F", demand=Demand(1, 24), duration_hint=500.0,
                            label="suite"), t)
        assert {a.action_id for a in p.schedule(t)} == {"last", "W"}
        p.add_worker(WorkerInfo("w2", 32, kinds=CPU), t)
        p.finished("last", t + 1, run_time=1.0)     # w1 can no longer give a 24-core grant
        return p.env_moves()

    assert moves([30.0] * 20) == ["E"]          # steady 30 s thinks: a 10 s move is done in time
    assert moves([3.0, 57.0] * 10) == []        # the same mean, but every other think ends first
    assert moves([3.0, 57.0] * 10, move_s=1.0) == ["E"]


def test_closing_an_environment_sends_its_waiting_actions_to_the_shared_queues():
    """Its host is full: once the environment is unpinned (a hint the scheduler wants elsewhere,
    or a stateful one saved for a move), its waiting actions start on another worker."""
    for policy in (FifoPolicy(), ElasticScheduler()):
        policy.add_worker(WorkerInfo("w1", 1, kinds=CPU), 0)
        policy.submit(ActionSpec("function", id="H0", env="H", duration_hint=1.0), 0)
        policy.submit(ActionSpec("function", id="B0", env="B", duration_hint=50.0), 0)
        assert {a.action_id for a in policy.schedule(0)} == {"H0"}
        policy.finished("H0", 1, run_time=1.0)
        assert {a.action_id for a in policy.schedule(1)} == {"B0"}     # w1's one core is taken
        policy.add_worker(WorkerInfo("w2", 1, kinds=CPU), 1)
        policy.submit(ActionSpec("function", id="H1", env="H", duration_hint=1.0), 2)
        policy.submit(ActionSpec("function", id="H2", env="H", duration_hint=1.0), 2)
        assert policy.schedule(2) == []                                 # pinned to w1
        policy.close_env("H")
        [a] = policy.schedule(2)
        assert (a.action_id, a.worker_id) == ("H1", "w2") and policy.env_host("H") == "w2"
        policy.finished("H1", 3, run_time=1.0)
        assert [(a.action_id, a.worker_id) for a in policy.schedule(3)] == [("H2", "w2")]   # pinned there now


def test_an_environments_record_lives_while_something_refers_to_it_and_no_longer():
    """One record per environment (its host, held actions, idle time): dropped once it has no host,
    no live action and no idle time kept, so a long run does not keep one per trajectory ever
    seen; kept while an action of it waits, so its actions stay together."""
    p = ElasticScheduler(env_move_s=1.0)
    p.add_worker(WorkerInfo("w1", 1, kinds=CPU), 0)
    p.submit(ActionSpec("sandbox", id="a1", env="E", duration_hint=5.0), 0)
    p.submit(ActionSpec("sandbox", id="a2", env="E", duration_hint=5.0), 0)    # held behind a1: no host yet
    assert [a.action_id for a in p.schedule(0)] == ["a1"] and p.env_host("E") == "w1"
    p.finished("a1", 5, run_time=5.0)
    assert [(a.action_id, a.worker_id) for a in p.schedule(5)] == [("a2", "w1")]
    p.finished("a2", 10, run_time=5.0)
    assert p.env_host("E") == "w1" and "E" in p.homes.envs        # still hosted, its idle time kept
    p.close_env("E")                                            # the trajectory ended
    assert p.env_host("E") is None and p.homes.envs == {}
    # a pending action that is cancelled takes its environment's record with it
    p.submit(ActionSpec("sandbox", id="big", demand=Demand(1, 1)), 10)
    assert [a.action_id for a in p.schedule(10)] == ["big"]
    p.submit(ActionSpec("sandbox", id="b1", env="F"), 10)
    p.submit(ActionSpec("sandbox", id="b2", env="F"), 10)
    assert p.schedule(10) == [] and set(p.homes.envs) == {"F"}
    assert p.cancel("b1")                                       # its first action leaves: b2 goes first now
    p.finished("big", 11, run_time=1.0)
    assert [a.action_id for a in p.schedule(11)] == ["b2"] and p.env_host("F") == "w1"
    p.finished("b2", 12, run_time=1.0)
    p.close_env("F")
    assert p.homes.envs == {}
    # and a worker's loss leaves nothing behind for an environment nobody uses any more
    p.submit(ActionSpec("sandbox", id="c1", env="G"), 12)
    assert [a.action_id for a in p.schedule(12)] == ["c1"]
    assert p.remove_worker("w1", 13) == ["c1"] and p.env_host("G") is None
    p.close_env("G")
    assert p.homes.envs == {}


def test_an_environment_with_an_action_running_is_not_moved():
    p = ElasticScheduler(env_move_s=0.0)
    p.add_worker(WorkerInfo("w1", 1, kinds=CPU), 0)
    p.submit(ActionSpec("sandbox", id="e1", env="E", duration_hint=50.0), 0)
    assert [a.worker_id for a in p.schedule(0)] == ["w1"]
    p.add_worker(WorkerInfo("w2", 4, kinds=CPU), 1)
    p.submit(ActionSpec("sandbox", id="e2", env="E", duration_hint=1.0), 1)
    assert p.schedule(1) == [] and p.env_moves() == []


def test_no_starvation_under_a_stream_of_short_high_priority_actions():
    # The queue grows without end, so the aging rate falls to its floor and the bound is size over
    # floor: at the default floor (0.001) the long action waited 250,000 simulated seconds, a million
    # submissions (20 s of the suite); at 0.05 the same regime shows in 50 times fewer.
    p = ElasticScheduler(aging=0.5, aging_floor=0.05, priority_weight=10.0, priority_clamp=4)
    p.add_worker(WorkerInfo("w", 1, kinds=CPU), 0.0)
    p.submit(ActionSpec("sandbox", id="seed", duration_hint=1.0, label="short"), 0.0)
    p.schedule(0.0)
    p.submit(ActionSpec("sandbox", id="long", duration_hint=50.0, label="long", priority=-4), 0.0)
    bound = p.wait_bound(50.0, 8)
    now, i, running, started = 0.0, 0, "seed", None
    while now < 10 * bound:
        # two short high-priority arrivals per second: the core is never idle
        for _ in range(2):
            p.submit(ActionSpec("sandbox", id=f"s{i}", duration_hint=0.5, label="short", priority=4), now)
            i += 1
        now += 0.5
        p.finished(running, now, run_time=0.5)
        [a] = p.schedule(now)
        running = a.action_id
        if running == "long":
            started = now
            break
    assert started is not None, "long action starved"
    # overtaken only by actions submitted before the bound (at most 4 per second, 0.5 s each)
    assert started <= bound + 4 * bound * 0.5 + 1.0


def test_srpt_orders_short_before_long_and_priority_counts():
    p = ElasticScheduler()
    p.add_worker(WorkerInfo("w", 1, kinds=CPU), 0)
    p.submit(ActionSpec("sandbox", id="block", duration_hint=1), 0)
    p.schedule(0)
    p.submit(ActionSpec("sandbox", id="long", duration_hint=100, label="l"), 0)
    p.submit(ActionSpec("sandbox", id="short", duration_hint=1, label="s"), 0.1)
    p.finished("block", 1, run_time=1)
    assert [a.action_id for a in p.schedule(1)] == ["short"]
    f = FifoPolicy()
    f.add_worker(WorkerInfo("w", 1, kinds=CPU), 0)
    for aid, h in (("block", 1), ("long", 100), ("short", 1)):
        f.submit(ActionSpec("sandbox", id=aid, duration_hint=h), 0)
    f.schedule(0)
    f.finished("block", 1, run_time=1)
    assert [a.action_id for a in f.schedule(1)] == ["long"]


def _burst_order(**kw) -> str:
    """Which of A (2 s, submitted at 0) and B (1 s, submitted 4 s later) starts first on one core
    behind a long action, with a queue of fifty 10 s actions."""
    p = ElasticScheduler(**kw)
    p.add_worker(WorkerInfo("w", 1, kinds=CPU), 0)
    p.submit(ActionSpec("sandbox", id="block", duration_hint=100, label="b"), 0)
    p.schedule(0)
    for i in range(50):
        p.submit(ActionSpec("sandbox", id=f"q{i}", duration_hint=10, label="q"), 0)
    p.submit(ActionSpec("sandbox", id="A", duration_hint=2, label="a"), 0)
    p.submit(ActionSpec("sandbox", id="B", duration_hint=1, label="c"), 4)
    p.finished("block", 100, run_time=100)
    [a] = p.schedule(100)
    return a.action_id


def test_aging_follows_the_queue_drain_time():
    # a fixed rate of 0.5: four seconds of waiting outweigh A's extra second, first come first served
    assert _burst_order(aging=0.5, aging_floor=0.5) == "A"
    # behind fifty queued actions on one core the clock runs at 1/50: sizes decide, shortest first
    assert _burst_order() == "B"
    # the wait stays bounded: by the floor's rate
    assert ElasticScheduler(aging=0.05, aging_floor=0.01).wait_bound(1.0, 0) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="aging_floor"):
        ElasticScheduler(aging_floor=0)


def test_elastic_grows_when_idle_and_shares_under_a_queue():
    p = ElasticScheduler(Predictor(prior_parallel=0.95))
    p.add_worker(WorkerInfo("w", 16, kinds=CPU), 0)
    p.submit(ActionSpec("sandbox", id="alone", demand=Demand(1, 16), duration_hint=10, label="t"), 0)
    [a] = p.schedule(0)
    assert a.cores == 16                     # alone: everything it can use
    # with a serial part, cores beyond the Amdahl knee are not taken
    k = ElasticScheduler(Predictor(prior_parallel=0.5))
    k.add_worker(WorkerInfo("w", 16, kinds=CPU), 0)
    k.submit(ActionSpec("sandbox", id="alone", demand=Demand(1, 16), duration_hint=10, label="t"), 0)
    assert 1 < k.schedule(0)[0].cores < 16
    q = ElasticScheduler()
    q.add_worker(WorkerInfo("w", 16, kinds=CPU), 0)
    for i in range(8):
        q.submit(ActionSpec("sandbox", id=f"t{i}", demand=Demand(1, 16), duration_hint=10, label="t"), 0)
    out = q.schedule(0)
    assert len(out) == 8 and all(x.cores == 2 for x in out)   # a fair share each, nobody hogs
    f = FifoPolicy()
    f.add_worker(WorkerInfo("w", 16, kinds=CPU), 0)
    f.submit(ActionSpec("sandbox", id="alone", demand=Demand(1, 16)), 0)
    assert f.schedule(0)[0].cores == 1


def test_service_residency_preferred_and_load_accounted():
    p = ElasticScheduler()
    p.add_worker(WorkerInfo("g1", 8, 0, 1, 1000, kinds=GPU), 0)
    p.add_worker(WorkerInfo("g2", 8, 0, 1, 1000, kinds=GPU), 0)
    p.submit(ActionSpec("reward", id="r1", demand=Demand(1, 1, 0, 600, "judge")), 0)
    [a] = p.schedule(0)
    p.submit(ActionSpec("reward", id="r2", demand=Demand(1, 1, 0, 600, "judge")), 1)
    [b] = p.schedule(1)
    assert b.worker_id == a.worker_id               # resident there (still loading) beats a new load
    assert p.resident_services(a.worker_id) == frozenset({"judge"})
    # a service that does not fit next to a busy one goes to the other worker
    p.submit(ActionSpec("reward", id="r3", demand=Demand(1, 1, 0, 600, "rm")), 1)
    [c] = p.schedule(1)
    assert c.worker_id != a.worker_id
    # once idle, a resident service is evicted for a new one when memory runs out
    p.finished("r1", 40, run_time=39)
    p.finished("r2", 41, run_time=10)
    p.submit(ActionSpec("reward", id="r4", demand=Demand(1, 1, 0, 600, "other")), 42)
    [d] = p.schedule(42)
    assert d.worker_id == a.worker_id and "judge" not in p.resident_services(a.worker_id)
    # the cold run taught the load time
    assert p.predictor.load_time("judge") != p.predictor.default_load_time


def test_draining_worker_gets_only_its_environments():
    p = ElasticScheduler()
    p.add_worker(WorkerInfo("w1", 4, kinds=CPU), 0)
    p.submit(ActionSpec("sandbox", id="e1", env="E"), 0)
    p.schedule(0)
    p.set_draining("w1", True)
    p.finished("e1", 1, run_time=1)
    p.submit(ActionSpec("sandbox", id="e2", env="E"), 1)
    p.submit(ActionSpec("sandbox", id="free"), 1)
    assert [a.action_id for a in p.schedule(1)] == ["e2"]
    p.set_draining("w1", False)
    assert [a.action_id for a in p.schedule(2)] == ["free"]


def test_unplaceable_actions_are_reported_with_reason():
    p = ElasticScheduler(shapes=[WorkerShape(8, 16000), WorkerShape(4, 0, 1, 1000)])
    p.submit(ActionSpec("sandbox", id="huge", demand=Demand(32, 32)), 0)
    p.submit(ActionSpec("reward", id="fat", demand=Demand(1, 1, 0, 5000, "big")), 0)
    p.submit(ActionSpec("sandbox", id="ok", demand=Demand(8, 8)), 0)
    bad = dict(p.unplaceable(0))
    assert set(bad) == {"huge", "fat"} and "min_cores=32" in bad["huge"]
    # they stay pending (never placed) until the driver fails them with cancel()
    p.add_worker(WorkerInfo("w", 64, kinds=CPU), 0)
    assert [a.action_id for a in p.schedule(0)] == ["ok"]
    assert p.pending_count == 2
    assert p.cancel("huge") and p.cancel("fat")
    assert p.pending_count == 0 and p.unplaceable(0) == []
    # shapes shrink: a waiting action becomes unplaceable; they grow back: it is placeable again
    p.remove_worker("w", 1)
    p.submit(ActionSpec("sandbox", id="mid", demand=Demand(8, 8)), 1)
    p.set_shapes([WorkerShape(4)])
    assert [x for x, _ in p.unplaceable(1)] == ["mid"]
    p.set_shapes([WorkerShape(16)])
    assert p.unplaceable(1) == []
    p.add_worker(WorkerInfo("w2", 16, kinds=CPU), 1)
    assert [a.action_id for a in p.schedule(1)] == ["mid"]
    # a registered worker larger than every shape makes an action placeable
    p.submit(ActionSpec("sandbox", id="wide", demand=Demand(12, 12)), 2)
    p.set_shapes([WorkerShape(4)])
    assert p.unplaceable(2) == []


@pytest.mark.parametrize("policy", [ElasticScheduler, FifoPolicy])
def test_a_service_call_no_worker_could_ever_host_is_unplaceable(policy):
    p = policy()
    p.set_shapes([WorkerShape(8)])                  # CPU workers only: no service runs anywhere
    p.submit(ActionSpec("reward", id="judge", demand=Demand(service="judge")), 0)
    assert [(x, "starts no service workers" in why) for x, why in p.unplaceable(0)] == [("judge", True)]
    # service workers that host the run's services: those calls wait for them, others cannot
    p.set_shapes([WorkerShape(8), WorkerShape(1, gpu_mem_mb=2000)], hosted=["judge"])
    p.submit(ActionSpec("reward", id="other", demand=Demand(service="other")), 1)
    bad = dict(p.unplaceable(1))
    assert list(bad) == ["other"] and "hosted by no worker (the run's services: judge)" in bad["other"]
    # a registered worker that hosts it (or declares no list: any) makes it placeable
    p.add_worker(WorkerInfo("g", 1, gpu_mem_mb=2000, kinds=GPU, services=frozenset({"other"})), 2)
    p.set_shapes([WorkerShape(8), WorkerShape(1, gpu_mem_mb=2000)], hosted=["judge"])
    assert p.unplaceable(2) == []


@pytest.mark.parametrize("policy", [ElasticScheduler, FifoPolicy])
def test_refused_calls_of_services_named_by_clients_leave_nothing_behind(policy):
    """Every refused name once kept a size, a step, a pending count and a rate: clients may name any."""
    p = policy()
    p.set_shapes([WorkerShape(8), WorkerShape(1, gpu_mem_mb=2000)], hosted=["judge"])
    p.submit(ActionSpec("reward", id="j", demand=Demand(service="judge")), 0)

    def per_service_state():
        tables = [p.replicas.info, p.replicas.last_step, p.tally.service_pending, getattr(p.loading, "_rates", {})]
        return sorted(set().union(*map(set, tables)))

    for i in range(2000):
        p.submit(ActionSpec("reward", id=f"x{i}", demand=Demand(service=f"made-up-{i}")), 1)
        assert [x for x, _ in p.unplaceable(1)] == [f"x{i}"]
        assert p.cancel(f"x{i}")
    assert per_service_state() == ["judge"]
    # a call refused until the pool's shapes change is placed then, and its service known as any other
    p.submit(ActionSpec("reward", id="late", demand=Demand(service="late")), 2)
    p.set_shapes([WorkerShape(8), WorkerShape(1, gpu_mem_mb=2000)], hosted=["judge", "late"])
    assert p.unplaceable(2) == [] and "late" in per_service_state()
    p.add_worker(WorkerInfo("g", 1, gpu_mem_mb=2000, kinds=GPU, services=frozenset({"late"})), 3)
    assert [a.action_id for a in p.schedule(3)] == ["late"]
    p.finished("late", 4)
    p.cancel("j")
    assert per_service_state() == ["judge", "late"] and p.tally.service_pending == {}


@pytest.mark.parametrize("policy", [ElasticScheduler, FifoPolicy])
def test_services_named_freely_where_the_pool_declares_none_stay_bounded(policy):
    """With no list of hosted services every name is taken as loadable; the idle ones past
    MAX_UNDECLARED_SERVICES are forgotten, never one in use, a resident one or a declared one."""
    p = policy(services={"judge": ServiceInfo(500, load_s=5.0)})
    p.set_shapes([WorkerShape(8), WorkerShape(1, gpu_mem_mb=2000)])
    p.add_worker(WorkerInfo("g", 1, gpu_mem_mb=2000, kinds=GPU), 0)      # hosts any service
    p.update_worker("g", services=frozenset({"resident"}), now=0)
    p.submit(ActionSpec("reward", id="w", demand=Demand(service="waiting", gpu_mem_mb=300)), 0)

    def per_service_state():
        tables = [p.replicas.info, p.replicas.last_step, p.tally.service_pending, getattr(p.loading, "_rates", {}),
                  p.replicas.where, p.predictor._load]
        return set().union(*map(set, tables))

    p.predictor.observe_load("made-up-0", 3.0)     # a load time learned for a name later forgotten
    p.predictor.observe_load("judge", 4.0)
    judge_load = p.predictor.load_time("judge")
    cap = p.replicas.MAX_UNDECLARED_SERVICES
    for i in range(3 * cap):
        p.submit(ActionSpec("reward", id=f"x{i}", demand=Demand(service=f"made-up-{i}")), 1)
        assert p.cancel(f"x{i}")
        assert len(per_service_state()) <= cap + 3
    kept = per_service_state()
    assert {"judge", "resident", "waiting"} <= kept and "made-up-0" not in kept
    assert p.replicas.info["waiting"].gpu_mem_mb == 300          # its learned size too
    assert p.predictor.load_time("made-up-0") == p.predictor.default_load_time
    assert p.predictor.load_time("judge") == judge_load != p.predictor.default_load_time
    # a forgotten name is a service like any other when it is called again
    p.submit(ActionSpec("reward", id="again", demand=Demand(service="made-up-0")), 2)
    assert p.cancel("w")
    assert [a.action_id for a in p.schedule(2)] == ["again"]
    assert "made-up-0" in per_service_state()


@pytest.mark.parametrize("policy", [ElasticScheduler, FifoPolicy])
def test_a_queue_nothing_waits_in_is_dropped(policy):
    """Clients may send any number of distinct demands: each had a queue kept for good."""
    p = policy()
    p.set_shapes([WorkerShape(2, 64000)])
    p.add_worker(WorkerInfo("w", 2, 64000, kinds=CPU), 0)
    t = 0.0
    for i in range(500):
        p.submit(ActionSpec("sandbox", id=f"a{i}", demand=Demand(1, 1, 100 + i)), t)
        assert [a.action_id for a in p.schedule(t)] == [f"a{i}"]
        p.finished(f"a{i}", t + 0.1, run_time=0.1)
        t += 0.2
    assert len(p.queues.table) == 0
    # a queue emptied by a cancel while its (stale) entry is still in its heap, then asked for again
    p.submit(ActionSpec("sandbox", id="big", demand=Demand(2, 2)), t)
    assert [a.action_id for a in p.schedule(t)] == ["big"]
    p.submit(ActionSpec("sandbox", id="c1", demand=Demand(1, 1, 7)), t)
    assert p.schedule(t) == [] and p.cancel("c1") and len(p.queues.table) == 0
    p.submit(ActionSpec("sandbox", id="c2", demand=Demand(1, 1, 7)), t)
    p.submit(ActionSpec("sandbox", id="c3", demand=Demand(1, 1, 7)), t)
    assert len(p.queues.table) == 1 and p.schedule(t) == []
    p.finished("big", t + 1, run_time=1.0)
    assert sorted(a.action_id for a in p.schedule(t + 1)) == ["c2", "c3"]
    assert p.pending_count == 0 and len(p.queues.table) == 0


@pytest.mark.parametrize("policy", [ElasticScheduler, FifoPolicy])
def test_a_service_larger_than_every_service_worker_is_unplaceable(policy):
    p = policy(services={"huge": ServiceInfo(100_000), "small": ServiceInfo(100)})
    p.set_shapes([WorkerShape(1, gpu_mem_mb=2000)], hosted=["huge", "small"])
    p.submit(ActionSpec("reward", id="h", demand=Demand(service="huge")), 0)
    p.submit(ActionSpec("reward", id="s", demand=Demand(service="small")), 0)
    bad = dict(p.unplaceable(0))
    assert list(bad) == ["h"] and "'huge' needs 100000 MB" in bad["h"] and "has 2000 MB" in bad["h"]
    # a call that claims more than its service's size is refused alone: it does not make the service bigger
    p.submit(ActionSpec("reward", id="claims", demand=Demand(gpu_mem_mb=100_000, service="small")), 1)
    p.add_worker(WorkerInfo("g", 1, gpu_mem_mb=2000, kinds=GPU, services=frozenset({"small"})), 1)
    p.submit(ActionSpec("reward", id="s2", demand=Demand(service="small")), 2)
    assert sorted(dict(p.unplaceable(2))) == ["claims", "h"]
    # ... nor does it when the service is not loaded yet: later calls are placed, not left waiting
    p2 = policy(services={"small": ServiceInfo(100)})
    p2.set_shapes([WorkerShape(1, gpu_mem_mb=2000)], hosted=["small"])
    p2.add_worker(WorkerInfo("g", 1, gpu_mem_mb=2000, kinds=GPU, services=frozenset()), 0)
    p2.submit(ActionSpec("reward", id="claims", demand=Demand(gpu_mem_mb=100_000, service="small")), 1)
    p2.submit(ActionSpec("reward", id="s2", demand=Demand(service="small")), 2)
    assert [x for x, _ in p2.unplaceable(2)] == ["claims"]
    assert [a.action_id for a in p2.schedule(3)] == ["s2"]


def test_cancel_and_counts():
    p = FifoPolicy()
    p.submit(ActionSpec("sandbox", id="a"), 0)
    p.submit(ActionSpec("sandbox", id="b"), 0)
    assert p.pending_count == 2
    assert p.cancel("a") and not p.cancel("a") and not p.cancel("zzz")
    p.add_worker(WorkerInfo("w", 2, kinds=CPU), 0)
    assert [x.action_id for x in p.schedule(0)] == ["b"]
    assert not p.cancel("b")
    assert (p.pending_count, p.running_count) == (0, 1)
    assert p.remove_worker("w", 1) == ["b"] and p.running_count == 0


@pytest.mark.parametrize("policy_cls", [ElasticScheduler, FifoPolicy])
def test_zero_core_actions_run_beside_busy_cores_up_to_the_light_capacity(policy_cls):
    p = policy_cls()
    info = WorkerInfo("w", 1, kinds=CPU)
    p.add_worker(info, 0)
    p.submit(ActionSpec("sandbox", id="busy", demand=Demand(1, 1)), 0)
    p.schedule(0)
    cap = light_capacity(info)
    for i in range(cap + 5):
        p.submit(ActionSpec("function", id=f"l{i}", demand=Demand(0, 0)), 0)
    out = p.schedule(0)
    assert len(out) == cap and all(a.cores == 0 for a in out)
    assert p.pending_count == 5
    p.finished("l0", 1, run_time=0.001)
    assert [a.action_id for a in p.schedule(1)] == ["l%d" % cap]


def test_reward_actions_with_gpu_memory_are_placeable_while_reward_workers_are_scaled_to_zero():
    # the local reward shape stands in a memory budget for a GPU (gpus=0); a Slurm GPU shape asks
    # for whole GPUs without saying their memory: neither makes a GPU-memory demand unplaceable
    local = ElasticScheduler(shapes=[WorkerShape(8, 16000), WorkerShape(1, 0, 0, 4096)])
    slurm = ElasticScheduler(shapes=[WorkerShape(8, 16000), WorkerShape(8, 0, 2, 0)])
    cpu_only = ElasticScheduler(shapes=[WorkerShape(8, 16000)])
    for p in (local, slurm, cpu_only):
        p.submit(ActionSpec("reward", id="r", demand=Demand(1, 1, 0, 2000, "judge")), 0)
    assert local.unplaceable(0) == [] and slurm.unplaceable(0) == []
    assert [a for a, _ in cpu_only.unplaceable(0)] == ["r"]
    assert local.pending_count == 1 and local.schedule(0) == []
    # a budget too small for the service still says so
    small = ElasticScheduler(shapes=[WorkerShape(1, 0, 0, 1000)])
    small.submit(ActionSpec("reward", id="r", demand=Demand(1, 1, 0, 2000, "judge")), 0)
    assert "gpu_mem_mb=2000" in dict(small.unplaceable(0))["r"]
    # the worker arrives (scale from zero): the waiting call runs there
    local.add_worker(WorkerInfo("g1", 1, 0, 0, 4096, kinds=GPU), 30)
    assert [(a.action_id, a.worker_id) for a in local.schedule(30)] == [("r", "g1")]


def test_grants_shrink_under_a_standing_queue_but_not_for_a_moment():
    # 64 cores; a long parallel action starts while 2 short rigid ones wait elsewhere: it still grows
    p = ElasticScheduler(Predictor(prior_parallel=0.9))
    p.add_worker(WorkerInfo("w", 64, kinds=CPU), 0)
    p.add_worker(WorkerInfo("full", 1, kinds=CPU), 0)
    p.submit(ActionSpec("sandbox", id="long", demand=Demand(1, 16), duration_hint=100, label="t"), 0)
    assert p.schedule(0)[0].cores == 16
    # a standing queue of many: each new elastic start keeps (close to) its minimum
    q = ElasticScheduler(Predictor(prior_parallel=0.9))
    q.add_worker(WorkerInfo("w", 16, kinds=CPU), 0)
    for i in range(16):
        q.submit(ActionSpec("sandbox", id=f"r{i}", duration_hint=5, label="rigid"), 0)
    q.schedule(0)
    for i in range(300):        # waiting rigid work that cannot start anywhere now
        q.submit(ActionSpec("sandbox", id=f"wait{i}", duration_hint=5, label="rigid"), 0)
    q.finished("r0", 1, run_time=1)
    q.finished("r1", 1, run_time=1)
    q.submit(ActionSpec("sandbox", id="el", demand=Demand(1, 16), duration_hint=1, label="t", priority=16), 1)
    out = {a.action_id: a.cores for a in q.schedule(1)}
    assert out.get("el") == 1


def test_free_cores_go_to_the_start_they_help_most():
    p = ElasticScheduler(Predictor(prior_parallel=0.9), min_gain=0.0)
    p.add_worker(WorkerInfo("w", 64, kinds=CPU), 0)
    p.add_worker(WorkerInfo("other", 64, kinds=CPU), 0)
    for i in range(54):       # fixed-size work leaves 10 cores free on w
        p.submit(ActionSpec("sandbox", id=f"busy{i}", env="E", duration_hint=1, label="busy"), 0)
    assert {a.worker_id for a in p.schedule(0)} == {"w"}
    p.update_worker("w", envs=frozenset({"E", "S", "L"}))     # both trajectories live on w
    p.submit(ActionSpec("sandbox", id="short", env="S", demand=Demand(1, 8), duration_hint=1, label="s"), 0)
    p.submit(ActionSpec("sandbox", id="long", env="L", demand=Demand(1, 8), duration_hint=100, label="l"), 0)
    out = {a.action_id: a.cores for a in p.schedule(0)}
    # both start (shortest first), but the long one, which each core helps far more, gets the cores
    assert out == {"short": 2, "long": 8}


def test_a_long_elastic_action_waits_for_cores_instead_of_starting_on_crumbs():
    p = ElasticScheduler(Predictor(prior_parallel=0.9))
    p.add_worker(WorkerInfo("w", 16, kinds=CPU), 0)
    for i in range(15):
        p.submit(ActionSpec("sandbox", id=f"s{i}", duration_hint=2, label="short"), 0)
    assert len(p.schedule(0)) == 15
    p.submit(ActionSpec("sandbox", id="long", demand=Demand(1, 16), duration_hint=1000, label="long"), 0)
    assert p.schedule(0) == []               # 1 core now, or 16 in about 2 s: it waits
    assert p.pending_count == 1
    for i in range(15):
        p.finished(f"s{i}", 2, run_time=2)
    [a] = p.schedule(2)
    assert a.action_id == "long" and a.cores == 16
    # a short elastic action does not wait: the wait would cost more than the cores save
    q = ElasticScheduler(Predictor(prior_parallel=0.9))
    q.add_worker(WorkerInfo("w", 16, kinds=CPU), 0)
    for i in range(14):
        q.submit(ActionSpec("sandbox", id=f"s{i}", duration_hint=50, label="slow"), 0)
    q.schedule(0)
    q.submit(ActionSpec("sandbox", id="quick", demand=Demand(1, 16), duration_hint=1, label="quick"), 0)
    assert [(a.action_id, a.cores) for a in q.schedule(0)] == [("quick", 2)]


def _stream(gap: float, until: float) -> ElasticScheduler:
    """Requests for a 4-slot service arriving every ``gap`` seconds, each predicted and taking 8 s."""
    p = ElasticScheduler(services={"rm": ServiceInfo(500, max_batch=4, load_s=60.0)})
    p.add_worker(WorkerInfo("g1", 8, 0, 1, 1000, kinds=GPU), 0)
    p.add_worker(WorkerInfo("g2", 8, 0, 1, 1000, kinds=GPU), 0)
    running: list[tuple[float, str]] = []
    t, i = 0.0, 0
    while t < until:
        for end, aid in [x for x in running if x[0] <= t]:
            p.finished(aid, end, run_time=8.0)
            running.remove((end, aid))
        p.submit(ActionSpec("reward", id=f"r{i}", demand=Demand(1, 1, 0, 500, "rm"), duration_hint=8.0), t)
        i += 1
        for a in p.schedule(t):
            running.append((t + 8.0, a.action_id))
        t += gap
    return p


def test_throughput_rule_loads_another_replica_before_the_queue_outgrows_the_load_time():
    # one per second x 8 s = 8 busy slots on average against 4 per replica: a second replica,
    # although never more than a few wait (8 s each) -- far below a 60 s load worth of waiting
    busy = _stream(1.0, 40.0)
    assert "rm" in busy.resident_services("g1") and "rm" in busy.resident_services("g2")
    # one every 4 s needs two slots: one replica
    calm = _stream(4.0, 80.0)
    assert ["rm" in calm.resident_services(w) for w in ("g1", "g2")].count(True) == 1


@pytest.mark.parametrize("policy_cls", [ElasticScheduler, FifoPolicy])
def test_core_bound_actions_known_to_take_microseconds_are_pipelined(policy_cls):
    p = policy_cls(shapes=[WorkerShape(2)])
    p.add_worker(WorkerInfo("w", 2, kinds=CPU), 0.0)
    t = 0.0

    def run(n: int, seconds: float, **kw) -> list:
        nonlocal t
        specs = [ActionSpec("function", label="noop", demand=Demand(1, 1), **kw) for _ in range(n)]
        for s in specs:
            p.submit(s, t)
        started = p.schedule(t)
        for a in started:
            t += seconds
            p.finished(a.action_id, t, run_time=seconds)
        return started

    # unknown at first: each binds its core, so only the worker's two cores' worth start at once
    first = run(40, 50e-6)
    assert len(first) == 2 and all(a.cores == 1 for a in first)
    while p.pending_count:
        run(0, 50e-6)
    for _ in range(10):                       # 20 runs seen: the class is known to take microseconds
        run(2, 50e-6)
    burst = run(100, 50e-6)
    assert len(burst) == 100 and all(a.cores == 0 for a in burst)
    # a hint at or above the limit keeps an action core-bound whatever its class did
    [hinted] = run(1, 50e-6, duration_hint=1.0)
    assert hinted.cores == 1
    # slow runs bring the class over the limit: its actions bind cores again
    for _ in range(10):
        run(1, 0.05)
    again = run(5, 50e-6)
    assert len(again) == 2 and all(a.cores == 1 for a in again)


def test_pipelining_can_be_turned_off():
    p = ElasticScheduler(pipeline_below_s=0)
    p.add_worker(WorkerInfo("w", 1, kinds=CPU), 0.0)
    for i in range(30):
        s = ActionSpec("function", label="noop")
        p.submit(s, float(i))
        [a] = p.schedule(float(i))
        p.finished(a.action_id, float(i), run_time=1e-5)
        assert a.cores == 1


def test_the_fit_check_is_remembered_for_equal_demands_and_for_one_shared_demand():
    """A client's actions each bring their own (equal) Demand; the simulator's share one per class.
    Either way the check against the worker shapes runs once per distinct demand."""
    from tangram_hpc.policy.replicas import FitCheck

    class Counting(FitCheck):
        checks = 0

        def _too_big_now(self, spec):
            Counting.checks += 1
            return super()._too_big_now(spec)

    p = ElasticScheduler()
    p.fit = Counting(p)
    p.set_shapes([WorkerShape(4)])
    shared = Demand(1, 4)
    for i in range(3):
        p.submit(ActionSpec("sandbox", id=f"w{i}", demand=Demand(1, 4)), 0)     # equal, not the same object
        p.submit(ActionSpec("sandbox", id=f"s{i}", demand=shared), 0)
    assert Counting.checks == 1
    p.submit(ActionSpec("sandbox", id="big", demand=Demand(8, 8)), 0)
    assert Counting.checks == 2 and [aid for aid, _ in p.unplaceable(0)] == ["big"]


def test_assignment_is_a_value():
    """Policies' starts compare and hash by their fields (drivers and tests put them in sets and lists)."""
    from tangram_hpc.policy.base import Assignment
    a = Assignment("a1", "w1", 2)
    assert a == Assignment("a1", "w1", 2) and hash(a) == hash(Assignment("a1", "w1", 2))
    assert a != Assignment("a1", "w1", 3) and a != Assignment("a2", "w1", 2) and a != ("a1", "w1", 2)
    assert len({a, Assignment("a1", "w1", 2), Assignment("a1", "w2", 2)}) == 2
    assert repr(a) == "Assignment(action_id='a1', worker_id='w1', cores=2)"
    assert (a.action_id, a.worker_id, a.cores) == ("a1", "w1", 2)


def test_a_finish_for_a_waiting_action_leaves_it_waiting():
    """A stray finish (an attempt that no longer runs) must not drop the waiting action: it still starts,
    and its own finish then gives its cores back."""
    p = ElasticScheduler()
    p.add_worker(WorkerInfo("w1", 2, kinds=CPU), 0)
    p.submit(ActionSpec("sandbox", id="busy", demand=Demand(2, 2)), 0)
    assert [a.action_id for a in p.schedule(0)] == ["busy"]
    p.submit(ActionSpec("sandbox", id="waits", demand=Demand(1, 1)), 0)
    assert p.schedule(0) == []
    p.finished("waits", 0.5, ok=False)                # not running: nothing to end
    assert p.pending_count == 1 and p.running_count == 1
    p.finished("busy", 1, run_time=1)
    assert [(a.action_id, a.cores) for a in p.schedule(1)] == [("waits", 1)]
    p.finished("waits", 2, run_time=1)
    assert p.pending_count == 0 and p.running_count == 0
    p.submit(ActionSpec("sandbox", id="wide", demand=Demand(2, 2)), 2)
    assert [(a.action_id, a.cores) for a in p.schedule(2)] == [("wide", 2)]     # both cores free again


@pytest.mark.parametrize("policy", [ElasticScheduler, FifoPolicy])
def test_an_environment_action_waiting_for_memory_holds_back_only_what_needs_as_much(policy):
    """An environment's actions wait on its worker in one queue per demand: one that waits for
    memory (ahead in the order) does not hold back a command that needs none."""
    p = policy()
    p.add_worker(WorkerInfo("w", 4, 10_000, kinds=CPU), 0)
    p.submit(ActionSpec("sandbox", id="big1", env="e", demand=Demand(1, 1, 8000), duration_hint=5.0), 0)
    assert [a.action_id for a in p.schedule(0)] == ["big1"]
    p.submit(ActionSpec("sandbox", id="big2", env="e", demand=Demand(1, 1, 8000), duration_hint=1.0), 1)
    p.submit(ActionSpec("sandbox", id="cmd", env="e", demand=Demand(1, 1), duration_hint=2.0), 2)
    assert [a.action_id for a in p.schedule(2)] == ["cmd"]
    p.finished("big1", 5, run_time=5.0)
    assert [a.action_id for a in p.schedule(5)] == ["big2"]


def test_cores_that_memory_leaves_idle_go_to_the_actions_that_fit():
    """Six parallel actions of 9 GB on an 8-core worker with 20 GB: two fit at a time, so each gets
    all the cores it can use instead of a sixth of the worker (the other four wait for memory,
    not for cores)."""
    p = ElasticScheduler()
    p.add_worker(WorkerInfo("w", 8, 20_000, kinds=CPU), 0)
    for i in range(6):
        p.submit(ActionSpec("sandbox", id=f"m{i}", demand=Demand(1, 4, 9000), duration_hint=10.0), 0)
    started = p.schedule(0)
    assert len(started) == 2 and [a.cores for a in started] == [4, 4]
    # the same actions without memory to wait for share the cores
    q = ElasticScheduler()
    q.add_worker(WorkerInfo("w", 8, 200_000, kinds=CPU), 0)
    for i in range(6):
        q.submit(ActionSpec("sandbox", id=f"m{i}", demand=Demand(1, 4, 9000), duration_hint=10.0), 0)
    assert [a.cores for a in q.schedule(0)] == [1] * 6


def _busy_rm_beside_judge(judge_called: bool) -> ElasticScheduler:
    """g1 holds "rm", g2 "judge"; a second "rm" fits g2 only by evicting "judge".  Requests for rm
    then come every second, 8 s each, against 4 slots: the throughput rule wants a second replica."""
    rm, judge = Demand(1, 1, 0, 500, "rm"), Demand(1, 1, 0, 600, "judge")
    p = ElasticScheduler(services={"rm": ServiceInfo(500, max_batch=4, load_s=60.0),
                                   "judge": ServiceInfo(600, max_batch=4, load_s=60.0)},
                         gpu_layout=[["rm"], ["judge"]])
    p.add_worker(WorkerInfo("g1", 8, 0, 1, 1000, kinds=GPU), 0)
    p.add_worker(WorkerInfo("g2", 8, 0, 1, 1000, kinds=GPU), 0)
    p.schedule(60.0)            # both loaded at start
    if judge_called:
        p.submit(ActionSpec("reward", id="j", demand=judge, duration_hint=1.0), 60.0)
        [a] = p.schedule(60.0)
        p.finished(a.action_id, 61.0, run_time=1.0)
    running: list[tuple[float, str]] = []
    for i in range(40):
        t = 62.0 + i
        for end, aid in [x for x in running if x[0] <= t]:
            p.finished(aid, end, run_time=8.0)
            running.remove((end, aid))
        p.submit(ActionSpec("reward", id=f"r{i}", demand=rm, duration_hint=8.0), t)
        running += [(t + 8.0, a.action_id) for a in p.schedule(t)]
    return p


def test_a_further_replica_does_not_evict_the_only_replica_of_a_service_in_use():
    # judge was called this step: its only replica stays, rm queues on its one replica
    kept = _busy_rm_beside_judge(judge_called=True)
    assert kept.resident_services("g2") == {"judge"}
    # judge unused: the throughput rule loads rm over it
    swapped = _busy_rm_beside_judge(judge_called=False)
    assert "rm" in swapped.resident_services("g2")
