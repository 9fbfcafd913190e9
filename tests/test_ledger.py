"""The action ledger in-process: no sockets, no clock, the real FIFO policy, the outbox read back.

Each test drives the ledger with the events the ZMQ loop would decode (SUBMIT, DONE, a lost
worker, a tick past a deadline, CANCEL) and checks what it wants sent: the exactly-once rules
live here, so they are tested here, case by case.
"""
from __future__ import annotations


import msgpack

from tangram_hpc import protocol as P
from tangram_hpc.actions import ActionSpec, Demand, Status, function
from tangram_hpc.config import CoordinatorSettings
from tangram_hpc.coordinator import ActionLedger
from tangram_hpc.policy.fifo import FifoPolicy
from tangram_hpc.resources import WorkerInfo, WorkerShape

C1, C2 = b"client-1", b"client-2"


def make(**settings) -> ActionLedger:
    return ActionLedger(CoordinatorSettings(**settings), FifoPolicy())


def join(ledger: ActionLedger, wid: str, cores: int = 1, now: float = 0.0) -> None:
    ledger.add_worker(WorkerInfo(id=wid, cores=cores), wid.encode(), now)


def submit(ledger: ActionLedger, client: bytes, *specs: ActionSpec, now: float = 0.0) -> None:
    ledger.submit(client, [s.to_wire() for s in specs], now)


def sleep(seconds: float = 1.0, **kw) -> ActionSpec:
    return ActionSpec(kind="function", payload={"fn": "time:sleep", "args": [seconds]}, **kw)


def take_assign(ledger: ActionLedger, now: float = 0.0) -> dict[str, list[tuple[str, int, int]]]:
    """Run the scheduler and return {worker: [(action id, attempt, cores), ...]} sent this turn."""
    if ledger.dirty:
        ledger.dispatch(now)
    out, ledger.outbox.assign = ledger.outbox.assign, {}
    return {wid: [(wire["i"], attempt, cores) for wire, attempt, cores, *_ in items] for wid, items in out.items()}


def take_results(ledger: ActionLedger) -> dict[bytes, list[list]]:
    out, ledger.outbox.results = ledger.outbox.results, {}
    return out


def take_kills(ledger: ActionLedger) -> dict[str, list]:
    out, ledger.outbox.kill = ledger.outbox.kill, {}
    return out


def done(ledger: ActionLedger, wid: str, aid: str, attempt: int, status: str = "ok", output=None,
         now: float = 1.0) -> int:
    return ledger.done(wid, [[aid, attempt, status, output, None, now - 0.5, now, None]], now)


def running_on_w1(spec: ActionSpec, **settings) -> ActionLedger:
    """A ledger with one 1-core worker ``w1`` running ``spec`` (attempt 1) for client C1."""
    ledger = make(**settings)
    join(ledger, "w1")
    submit(ledger, C1, spec)
    assert take_assign(ledger) == {"w1": [(spec.id, 1, spec.demand.min_cores)]}
    return ledger


def only_result(ledger: ActionLedger, client: bytes) -> list:
    res = take_results(ledger)
    assert list(res) == [client] and len(res[client]) == 1, res
    return res[client][0]


# -- the ordinary path ---------------------------------------------------------

def test_one_action_start_to_result():
    ledger = make()
    join(ledger, "w1", cores=2)
    spec = sleep()
    submit(ledger, C1, spec)
    assert take_assign(ledger) == {"w1": [(spec.id, 1, 1)]}
    assert ledger.workers.get("w1").busy_cores == 1
    assert done(ledger, "w1", spec.id, 1, output=42) == 0
    res = only_result(ledger, C1)
    assert res[:4] == [spec.id, "ok", 42, None] and res[7:] == ["w1", 1, 1, None]
    assert spec.id not in ledger and ledger.workers.get("w1").busy_cores == 0
    c = ledger.counters
    assert (c.submitted, c.completed, c.failed, c.stale_results) == (1, 1, 0, 0)
    assert ledger.action_log[0][0] == spec.id and ledger.action_log[0][8] == "ok"


# -- stale DONEs -------------------------------------------------------------------

def test_duplicate_done_is_stale():
    spec = sleep()
    ledger = running_on_w1(spec)
    done(ledger, "w1", spec.id, 1, output="first")
    done(ledger, "w1", spec.id, 1, output="again")
    assert only_result(ledger, C1)[2] == "first"
    assert ledger.counters.stale_results == 1 and ledger.counters.completed == 1


def test_done_for_an_old_attempt_is_stale():
    spec = sleep()
    ledger = running_on_w1(spec)
    ledger.lose_worker("w1", 1.0, "no heartbeat")
    join(ledger, "w2", now=1.0)
    assert take_assign(ledger, 1.0) == {"w2": [(spec.id, 2, 1)]}
    done(ledger, "w2", spec.id, 1, output="attempt 1")     # right worker now, wrong attempt
    assert take_results(ledger) == {} and ledger.counters.stale_results == 1
    done(ledger, "w2", spec.id, 2, output="attempt 2")
    res = only_result(ledger, C1)
    assert res[2] == "attempt 2" and res[9] == 2


def test_done_from_another_worker_is_stale():
    ledger = make()
    join(ledger, "w1")
    join(ledger, "w2")
    spec = sleep()
    submit(ledger, C1, spec)
    [(wid, [(_, attempt, _)])] = take_assign(ledger).items()
    other = "w2" if wid == "w1" else "w1"
    done(ledger, other, spec.id, attempt, output="forged")
    assert take_results(ledger) == {} and ledger.counters.stale_results == 1
    assert ledger.workers.get(wid).busy_cores == 1      # the real attempt still holds its core
    done(ledger, wid, spec.id, attempt, output="real")
    assert only_result(ledger, C1)[2] == "real"


def test_done_from_an_unknown_worker_is_counted_stale():
    ledger = make()
    assert ledger.done("ghost", [["x" * 24, 1, "ok", None, None, 0.0, 1.0]] * 3, 1.0) == 0
    assert ledger.counters.stale_results == 3 and take_results(ledger) == {}


def test_malformed_done_items_are_skipped_alone():
    ledger = make()
    join(ledger, "w1", cores=2)
    a, b = sleep(), sleep()
    submit(ledger, C1, a, b)
    take_assign(ledger)
    bad = ledger.done("w1", [[a.id, 1, "ok", "A", None, 0.0, 1.0, None], ["short"], 7,
                             [b.id, 1, "weird", "B", None, 0.0, 1.0, None]], 1.0)
    assert bad == 2
    res = {r[0]: r for r in take_results(ledger)[C1]}
    assert res[a.id][1] == "ok" and res[b.id][1] == "error" and "unknown status 'weird'" in res[b.id][3]


# -- lost workers --------------------------------------------------------------------

def test_lost_worker_retries_until_max_attempts_then_errors_with_the_reasons():
    ledger = make(max_attempts=3)
    spec = sleep()
    submit(ledger, C1, spec)
    for attempt in (1, 2, 3):
        wid = f"w{attempt}"
        join(ledger, wid, now=attempt)
        assert take_assign(ledger, attempt) == {wid: [(spec.id, attempt, 1)]}
        assert take_results(ledger) == {}
        ledger.lose_worker(wid, attempt + 0.5, f"crash {attempt}")
    res = only_result(ledger, C1)
    assert res[1] == Status.ERROR and res[9] == 3
    assert res[3].startswith("gave up after 3 attempts")
    for attempt in (1, 2, 3):
        assert f"attempt {attempt} on w{attempt}: crash {attempt}" in res[3]
    c = ledger.counters
    assert (c.retried, c.workers_lost, c.failed) == (2, 3, 1)
    assert len(ledger) == 0 and ledger.policy.running_count == 0 and ledger.policy.pending_count == 0


def test_losing_an_unknown_worker_changes_nothing():
    ledger = make()
    assert ledger.lose_worker("nobody", 0.0, "why") is None
    assert ledger.counters.workers_lost == 0


def test_worker_registering_again_loses_its_old_incarnation():
    spec = sleep()
    ledger = running_on_w1(spec)
    join(ledger, "w1", now=2.0)      # the same id, a fresh process
    assert take_assign(ledger, 2.0) == {"w1": [(spec.id, 2, 1)]}
    assert ledger.counters.workers_lost == 1 and ledger.workers.log[-2][1] == "lost"


# -- timeouts, cancels and zombies ----------------------------------------------------

def test_timeout_racing_a_late_done_gives_one_result_and_holds_the_core_until_the_done():
    ledger = make(timeout_grace_s=1.0)
    join(ledger, "w1", cores=1)
    slow = sleep(20, timeout=2.0)
    submit(ledger, C1, slow)
    take_assign(ledger, 0.0)
    ledger.expire(2.9)
    assert take_results(ledger) == {}                        # not yet: deadline is 2 + 1 s grace
    ledger.expire(3.0)
    res = only_result(ledger, C1)
    assert res[1] == Status.TIMEOUT and "no result 2s (+1s grace)" in res[3]
    assert take_kills(ledger) == {"w1": [[slow.id, 1]]}
    w = ledger.workers.get("w1")
    assert (w.busy_cores, w.zombie_cores, w.running) == (1, 1, set())
    # The function is still running on the worker: nothing else may start on its only core.
    quick = sleep(0.2)
    submit(ledger, C1, quick, now=4.0)
    assert take_assign(ledger, 4.0) == {}
    assert ledger.policy.running_count == 1 and ledger.zombie_cores == 1
    # The late DONE of the timed-out attempt: no second result, the core is free again.
    done(ledger, "w1", slow.id, 1, output="too late", now=20.0)
    assert take_results(ledger) == {}
    assert ledger.counters.stale_results == 1 and (w.busy_cores, w.zombie_cores) == (0, 0)
    assert take_assign(ledger, 20.0) == {"w1": [(quick.id, 1, 1)]}


def test_an_action_done_before_its_deadline_never_times_out():
    spec = sleep(timeout=1.0)
    ledger = running_on_w1(spec, timeout_grace_s=0.0)
    done(ledger, "w1", spec.id, 1, now=0.5)
    take_results(ledger)
    ledger.expire(5.0)
    assert take_results(ledger) == {} and take_kills(ledger) == {} and ledger.zombie_cores == 0


def test_zombie_cores_are_freed_when_its_worker_is_lost():
    spec = sleep(timeout=1.0)
    ledger = running_on_w1(spec, timeout_grace_s=0.0)
    ledger.expire(1.0)
    assert ledger.zombie_cores == 1
    ledger.lose_worker("w1", 2.0, "gone")
    assert ledger.zombie_cores == 0 and ledger.policy.running_count == 0
    assert only_result(ledger, C1)[1] == Status.TIMEOUT     # the loss does not retry a finalised action
    assert ledger.counters.retried == 0


def test_cancel_pending_is_immediate():
    ledger = make()
    spec = sleep()
    submit(ledger, C1, spec)            # no worker: it stays pending
    ledger.cancel([spec.id, 17, "unknown-id"], 1.0)
    res = only_result(ledger, C1)
    assert res[1] == Status.CANCELLED and res[3] == "cancelled before it started"
    assert ledger.policy.pending_count == 0 and take_kills(ledger) == {}
    join(ledger, "w1")
    assert take_assign(ledger) == {}


def test_cancel_running_kills_it_answers_at_once_and_keeps_its_cores_until_the_worker_reports():
    spec = sleep(30)
    ledger = running_on_w1(spec)
    ledger.cancel([spec.id], 1.0)
    res = only_result(ledger, C1)
    assert res[1] == Status.CANCELLED and "cancelled while running on w1" in res[3]
    assert take_kills(ledger) == {"w1": [[spec.id, 1]]}
    assert ledger.workers.get("w1").zombie_cores == 1
    # The worker reports the killed attempt (failed, as a killed command does): dropped, core freed.
    done(ledger, "w1", spec.id, 1, status="failed", now=1.2)
    assert take_results(ledger) == {} and ledger.zombie_cores == 0
    assert ledger.workers.get("w1").busy_cores == 0 and ledger.policy.running_count == 0


def test_cancel_after_done_does_nothing():
    spec = sleep()
    ledger = running_on_w1(spec)
    done(ledger, "w1", spec.id, 1, output="x")
    take_results(ledger)
    ledger.cancel([spec.id], 2.0)
    assert take_results(ledger) == {} and take_kills(ledger) == {}
    assert ledger.counters.by_status == {"ok": 1}


def test_a_zombie_id_cannot_be_submitted_again_once_its_result_is_forgotten():
    spec = sleep(timeout=1.0)
    ledger = running_on_w1(spec, result_cache=2, timeout_grace_s=0.0)
    ledger.expire(1.0)
    take_results(ledger)
    others = [sleep() for _ in range(3)]            # push the timed-out result out of the small cache
    join(ledger, "w2", cores=3)
    submit(ledger, C1, *others)
    for wid, items in take_assign(ledger).items():
        for aid, attempt, _ in items:
            done(ledger, wid, aid, attempt)
    take_results(ledger)
    submit(ledger, C2, spec, now=3.0)
    res = only_result(ledger, C2)
    assert res[1] == Status.ERROR and "still ending on its worker" in res[3]


# -- idempotency and resubmission ----------------------------------------------------

def test_idempotency_key_shared_by_a_live_and_a_finished_action_runs_once():
    ledger = make()
    join(ledger, "w1", cores=4)
    first = sleep(idempotency_key="traj-1/step-3")
    twin = sleep(idempotency_key="traj-1/step-3")
    submit(ledger, C1, first)
    submit(ledger, C2, twin)                    # while the first is live
    assert take_assign(ledger) == {"w1": [(first.id, 1, 1)]}
    done(ledger, "w1", first.id, 1, output="once")
    res = take_results(ledger)
    assert [r[:3] for r in res[C1]] == [[first.id, "ok", "once"]]
    assert [r[:3] for r in res[C2]] == [[twin.id, "ok", "once"]]
    late = sleep(idempotency_key="traj-1/step-3")
    submit(ledger, C2, late, now=2.0)          # after it finished: the cached answer at once
    assert only_result(ledger, C2)[:3] == [late.id, "ok", "once"]
    assert take_assign(ledger) == {} and ledger.counters.submitted == 1


def test_an_id_resubmitted_under_another_identity_is_answered_there_and_at_the_first():
    ledger = make()
    join(ledger, "w1")
    live, finished = sleep(), sleep()
    submit(ledger, C1, finished)
    take_assign(ledger)
    done(ledger, "w1", finished.id, 1, output="cached")
    take_results(ledger)
    submit(ledger, C1, live)
    take_assign(ledger)
    submit(ledger, C2, live, finished, now=2.0)   # the same client back under a new identity, or another
    submit(ledger, C2, live, now=2.5)             # asked twice there: answered once
    assert only_result(ledger, C2)[:3] == [finished.id, "ok", "cached"]
    assert take_assign(ledger) == {} and ledger.counters.submitted == 2
    done(ledger, "w1", live.id, 1, output="live")
    res = take_results(ledger)
    assert {c: [r[:3] for r in rs] for c, rs in res.items()} == {C1: [[live.id, "ok", "live"]],
                                                               C2: [[live.id, "ok", "live"]]}


def test_a_resubmission_to_a_new_incarnation_counts_its_act_from_the_first_submission():
    ledger = make()
    join(ledger, "w1")
    first, junk = sleep(), sleep()
    wires = [first.to_wire() | {"a": 20.0}, junk.to_wire() | {"a": float("nan")}]
    ledger.submit(C1, wires, 100.0)
    for spec in (first, junk):
        take_assign(ledger, 100.0)
        done(ledger, "w1", spec.id, 1, now=101.0)
    res = {r[0]: r for r in take_results(ledger)[C1]}
    assert res[first.id][4] == 80.0 and res[junk.id][4] == 100.0      # submitted: 20 s before; a NaN age is none
    assert [row[5] for row in ledger.action_log if row[0] == first.id] == [80.0]


# -- admission -----------------------------------------------------------------------

def test_pending_limits_reject_with_a_clear_result_and_admit_again_after_results():
    ledger = make(max_pending_per_client=2, max_pending_total=3)
    a, b, c = sleep(), sleep(), sleep()
    submit(ledger, C1, a, b, c)
    res = only_result(ledger, C1)
    assert res[0] == c.id and res[1] == Status.ERROR and "too many unfinished actions for this client (limit 2)" in res[3]
    d, e = sleep(), sleep()
    submit(ledger, C2, d, e)
    res = only_result(ledger, C2)
    assert res[0] == e.id and "too many unfinished actions for the coordinator (limit 3)" in res[3]
    assert ledger.counters.rejected == 2 and len(ledger) == 3
    join(ledger, "w1")
    [(wid, [(aid, attempt, _)])] = take_assign(ledger).items()
    done(ledger, wid, aid, attempt)
    take_results(ledger)
    f = sleep()
    submit(ledger, C2, f)
    assert take_results(ledger) == {} and f.id in ledger


def test_an_invalid_spec_fails_alone():
    ledger = make()
    good = sleep()
    bad_kind = {"i": "bad-kind", "k": "no-such-kind"}
    ledger.submit(C1, [bad_kind, {"k": "function"}, "not a map", good.to_wire()], 0.0)
    res = take_results(ledger)[C1]
    assert [(r[0], r[1]) for r in res] == [("bad-kind", "error")] and "unknown action kind" in res[0][3]
    errors = ledger.outbox.to_clients
    assert len(errors) == 2 and all(e[0] == C1 and e[1] == P.ERROR for e in errors)
    assert good.id in ledger and ledger.counters.rejected == 3


def test_an_action_no_worker_shape_can_hold_fails_at_once():
    ledger = make()
    ledger.policy.set_shapes([WorkerShape(cores=2)])
    big = ActionSpec(kind="function", payload={"fn": "math:sqrt", "args": [4]}, demand=Demand(8, 8))
    submit(ledger, C1, big, function("math:sqrt", 9))
    ledger.fail_unplaceable(1.0)
    res = only_result(ledger, C1)
    assert res[0] == big.id and res[1] == Status.ERROR and "cannot be placed" in res[3]
    assert len(ledger) == 1


# -- draining ------------------------------------------------------------------------

def test_draining_worker_gets_nothing_new_and_leaves_when_idle():
    ledger = make()
    join(ledger, "w1", cores=2)
    a = sleep()
    submit(ledger, C1, a)
    take_assign(ledger)
    ledger.drain("w1", "idle", 1.0)
    b = sleep()
    submit(ledger, C1, b)
    assert take_assign(ledger) == {}
    done(ledger, "w1", a.id, 1)
    assert ledger.workers.get("w1").running == set()
    assert ledger.retire_worker("w1", 2.0) is not None
    assert ledger.workers.get("w1") is None and b.id in ledger and ledger.counters.workers_lost == 0
    assert [r[1] for r in ledger.workers.log] == ["register", "drain", "reclaimed"]


def test_finished_actions_do_not_keep_their_deadlines_until_due():
    """Each action with a timeout put an entry on the deadline heap that stayed until its deadline
    (an hour's worth at thousands of actions a second); ended ones are dropped now and then."""
    ledger = make(max_pending_per_client=100_000)
    join(ledger, "w1", cores=8)
    for i in range(5000):
        spec = sleep(0.01, timeout=3600)
        submit(ledger, C1, spec, now=float(i))
        [(aid, attempt, _)] = take_assign(ledger, now=float(i))["w1"]
        done(ledger, "w1", aid, attempt, now=i + 0.5)
    live = sleep(0.01, timeout=3600)
    submit(ledger, C1, live, now=5000.0)
    take_assign(ledger, now=5000.0)
    ledger.expire(5001.0)
    assert len(ledger._deadlines) <= 1 + 4096 and any(e[1] == live.id for e in ledger._deadlines)
    ledger.expire(5000.0 + 3600 + 60)      # the live one still times out at its deadline
    [res] = [r for rs in take_results(ledger).values() for r in rs if r[0] == live.id]
    assert res[1] == Status.TIMEOUT


def test_the_result_cache_holds_large_outputs_by_their_bytes():
    from tangram_hpc.coordinator.answers import RecentMap
    m = RecentMap(1000, max_bytes=10_000)
    for i in range(20):
        m.put(i, "x", nbytes=1000)       # a generation is full at 5,000 bytes, not 500 entries
    assert m.get(19) is not None and m.get(15) is not None and m.get(14) is None
    small = RecentMap(1000, max_bytes=10_000)
    for i in range(400):
        small.put(i, i)                  # no size said: by count only
    assert small.get(0) == 0
    # the coordinator weighs each result by its share of the DONE frame it came in
    ledger = make(result_cache=1000, result_cache_mb=1)
    join(ledger, "w1", cores=4)
    specs = [sleep(0.01) for _ in range(4)]
    submit(ledger, C1, *specs)
    items = [[aid, attempt, "ok", "y", None, 0.5, 1.0, None] for aid, attempt, _ in take_assign(ledger)["w1"]]
    ledger.done("w1", items, 1.0, nbytes=4 << 20)      # 1 MiB each: a generation is full at 0.5 MiB
    kept = [s.id for s in specs if ledger.answers.recent.get(s.id) is not None]
    assert kept == [specs[-1].id], kept                 # 1 MiB kept of 4, not all four


def test_a_reward_call_that_found_the_gpu_held_by_loads_starts_once_they_are_due_without_a_report():
    """The policy places a GPU worker's services loading when it joins; a call for another service
    that needs their memory waits for them to be evictable.  Once the loads are due, the next
    dispatch (the loop's tick) places it, though the worker's heartbeats never changed its list."""
    from tangram_hpc.policy.elastic import ElasticScheduler
    from tangram_hpc.resources import ServiceInfo

    services = {n: ServiceInfo(1000, load_s=10.0) for n in ("a", "b", "c")}
    ledger = ActionLedger(CoordinatorSettings(), ElasticScheduler(services=services))
    ledger.add_worker(WorkerInfo(id="g", cores=4, gpus=1, gpu_mem_mb=2000, kinds=frozenset({"reward"}),
                                 services=frozenset(services)), b"g", 0.0)
    call = ActionSpec(kind="reward", id="c1", demand=Demand(1, 1, 0, 1000, "c"))
    submit(ledger, C1, call, now=1.0)
    assert take_assign(ledger, now=1.0) == {}       # a and b hold the memory, loading until t=10
    ledger.worker_report("g", {"services": []}, 5.0)
    assert not ledger.dirty                          # the same list as before: nothing reaches the policy
    ledger.worker_report("g", {"services": []}, 11.0)
    ledger.dirty = True                              # the loop's tick
    assert take_assign(ledger, now=11.0) == {"g": [("c1", 1, 1)]}


def test_a_packed_submit_is_kept_packed_sent_as_it_came_and_classed_as_its_payload_says():
    from tangram_hpc.actions import payload_summary
    from tangram_hpc.policy.predict import feature_key
    specs = [sleep(0.1, label=None), ActionSpec(kind="sandbox", payload={"cmd": "python3 -m pytest -x tests/a.py"},
                                                demand=Demand(1, 1)),
             ActionSpec(kind="sandbox", payload={"cmd": "   ", "fn": "odd"}, demand=Demand(1, 1)),
             ActionSpec(kind="sandbox", payload={"cmd": "/usr/bin/bash run.sh --fast"}, demand=Demand(1, 1)),
             ActionSpec(kind="function", payload=["not", "a", "map"]), ActionSpec(kind="function", payload=None)]
    for s in specs:     # the scheduler classes an action by its payload's summary as by the payload
        summary = ActionSpec(kind=s.kind, payload=payload_summary(s.payload), demand=s.demand, id=s.id)
        assert feature_key(summary) == feature_key(s), s.payload
    ledger = make()
    join(ledger, "w1", cores=8)
    frame = P.encode(P.SUBMIT, [s.to_wire() for s in specs[:4]])
    _, body = P.decode(frame, P.CLIENT_TYPES)
    ledger.submit(C1, P.with_packed_items(frame, body), 0.0)
    ledger.dispatch(0.0)
    items = ledger.outbox.assign["w1"]
    assert sorted(msgpack.unpackb(it[0], raw=False)["i"] for it in items) == sorted(s.id for s in specs[:4])
    sent = msgpack.unpackb(P.encode_assign(items), raw=False)[2]
    assert {w["i"]: w for w, *_ in sent} == {s.id: s.to_wire() for s in specs[:4]}
    for wire, attempt, *_ in sent:
        assert done(ledger, "w1", wire["i"], attempt) == 0
    assert sorted(r[0] for r in take_results(ledger)[C1]) == sorted(s.id for s in specs[:4])
