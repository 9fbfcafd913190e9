"""The worker's protocol state, driven message by message in one thread: no socket, no sleep."""
from __future__ import annotations

from tangram_hpc import protocol as P
from tangram_hpc.actions import EnvState, Status, function
from tangram_hpc.worker_session import WorkerSession

LIMIT = 64 << 10


def session(cores: int = 2) -> WorkerSession:
    s = WorkerSession(cores, lambda: LIMIT)
    assert s.register() == 1      # as a worker the coordinator welcomed
    return s


def outcomes(items: list) -> list[P.Outcome]:
    """What the coordinator reads from the DONE frames built of ``items``."""
    return [P.check_done(item) for frame in P.encode_outcomes(P.DONE, items, P.MAX_FRAME_BYTES)
            for item in P.decode(frame, P.WORKER_TYPES)[1]]


def test_an_assignment_takes_its_slots_until_its_outcome_is_taken():
    s = session(cores=2)
    a, light = function("tangram_hpc.handlers:noop", 1), function("tangram_hpc.handlers:noop", 2, cores=0)
    starts = s.assign([[a.to_wire(), 1, 2], [light.to_wire(), 1, 0]], now=10.0)
    assert [(st.spec.id, st.attempt, len(st.slots), st.grant) for st in starts] == [(a.id, 1, 2, None),
                                                                                  (light.id, 1, 0, None)]
    assert s.free_slots == [] and s.heartbeat() == {"running": 2, "busy_cores": 2, "killed_running": []}
    s.complete(a.id, 1, (Status.OK, 1, None), 10.0, 11.0, starts[0].slots, starts[0].gen)
    assert s.free_slots == []                  # not before the I/O side takes the outcome
    [done] = outcomes(s.take())
    assert (done.id, done.attempt, done.status, done.output, done.started, done.finished) == (a.id, 1, "ok", 1,
                                                                                           10.0, 11.0)
    assert sorted(s.free_slots) == [0, 1] and s.heartbeat()["running"] == 1


def test_an_unreadable_assignment_is_answered_at_once_and_holds_no_core():
    s = session(cores=1)
    good = function("tangram_hpc.handlers:noop", 1)
    bad_kind = dict(function("tangram_hpc.handlers:noop", 2).to_wire(), k="no-such-kind")
    starts = s.assign([[bad_kind, 3, 1], "garbage", [good.to_wire(), 1, 1, [1, "nowhere", None]],
                       [good.to_wire(), 2, 1]], now=5.0)
    assert [(st.spec.id, st.attempt) for st in starts] == [(good.id, 2)]
    refused = outcomes(s.take())
    assert [(o.id, o.attempt, o.status) for o in refused] == [(bad_kind["i"], 3, "error"), (good.id, 1, "error")]
    assert all("could not read the assignment" in o.error and o.started == 5.0 for o in refused)
    assert s.free_slots == [] and list(s.running) == [(good.id, 2, 1)]   # only the readable one holds the core


def test_a_grant_is_typed():
    s = session()
    spec = function("tangram_hpc.handlers:noop", 1)
    [st] = s.assign([[spec.to_wire(), 1, 1, [4, P.GRANT_RESTORE, "/snap/x"]]], now=0.0)
    assert st.grant == P.Grant(4, P.GRANT_RESTORE, "/snap/x") and st.grant.source == "restore"


def test_a_second_assignment_of_a_running_action_follows_it_and_gets_its_outcome():
    s = session(cores=2)
    spec = function("tangram_hpc.handlers:noop", 7)
    [first] = s.assign([[spec.to_wire(), 1, 1]], now=0.0)
    s.register()                                   # the coordinator restarted: a new registration
    assert s.assign([[spec.to_wire(), 2, 1]], now=1.0) == []     # runs no second copy
    assert s.heartbeat()["busy_cores"] == 2
    s.complete(spec.id, 1, (Status.OK, 7, None), 0.0, 2.0, first.slots, first.gen, EnvState.KEPT)
    [answer] = outcomes(s.take())
    assert (answer.attempt, answer.output, answer.env_state) == (2, 7, EnvState.REPLAYED)
    [older] = outcomes(s.older)                    # the first registration's, for OUTCOMES
    assert (older.attempt, older.output) == (1, 7)
    assert sorted(s.free_slots) == [0, 1] and not s.running


def test_a_kill_marks_the_attempt_and_its_slots_stay_taken_until_it_returns():
    s = session(cores=1)
    spec = function("time:sleep", 5)
    [st] = s.assign([[spec.to_wire(), 3, 1]], now=0.0)
    assert s.kill([[spec.id, 3], [spec.id, 2], ["unknown", 1], "junk"], now=100.0) == [(spec.id, 3, 1)]
    assert s.heartbeat() == {"running": 1, "busy_cores": 1, "killed_running": [[spec.id, 3]]}
    assert s.stopped_before_start((spec.id, 3, 1)) and s.free_slots == []
    s.complete(spec.id, 3, (Status.OK, None, None), 0.0, 5.0, st.slots, st.gen)
    [done] = outcomes(s.take())
    assert done.status == "ok" and s.free_slots == [0] and s.heartbeat()["killed_running"] == []


def test_a_withdrawn_request_ends_its_attempt_and_the_attempts_that_follow_it():
    s = session(cores=0)
    spec = function("tangram_hpc.handlers:noop", 1, cores=0)
    s.assign([[spec.to_wire(), 1, 0]], now=0.0)
    s.register()
    s.assign([[spec.to_wire(), 2, 0]], now=1.0)
    [key] = s.kill([[spec.id, 2]], now=2.0)
    s.withdrawn(key, now=3.0)
    [answer] = outcomes(s.take())
    assert (answer.attempt, answer.status, answer.error) == (2, "cancelled", "killed while it waited for its service")
    assert not s.running and len(s.older) == 1


def test_an_output_over_the_limit_fails_once_with_the_reason_and_a_small_one_goes_through():
    s = session()
    big, small = function("tangram_hpc.handlers:noop", 1), function("tangram_hpc.handlers:noop", 2)
    starts = s.assign([[big.to_wire(), 1, 1], [small.to_wire(), 1, 1]], now=0.0)
    s.complete(big.id, 1, (Status.OK, ["x" * 1000] * 100, None), 0.0, 1.0, starts[0].slots, 1)
    s.complete(small.id, 1, (Status.OK, ["x" * 1000] * 10, None), 0.0, 1.0, starts[1].slots, 1)
    items = s.take()
    assert type(items[0]) is bytes and len(items[0]) <= LIMIT      # packed, bounded, on the thread that made it
    too_big, fits = outcomes(items)
    assert (too_big.status, too_big.output) == ("failed", None)
    assert too_big.error == f"action output exceeds the limit of {LIMIT} bytes (max_output_bytes); nothing of it is kept"
    assert fits.status == "ok" and len(fits.output) == 10


def test_while_leaving_new_assignments_and_cut_short_attempts_are_reported_interrupted():
    s = session(cores=2)
    done_ok, cut = function("tangram_hpc.handlers:noop", 1), function("time:sleep", 9)
    starts = s.assign([[done_ok.to_wire(), 1, 1], [cut.to_wire(), 1, 1]], now=0.0)
    s.leave("SIGTERM", by_signal=True)
    late = function("tangram_hpc.handlers:noop", 3)
    assert s.assign([[late.to_wire(), 1, 1]], now=1.0) == []
    assert s.interrupt_running() == {(done_ok.id, 1, 1), (cut.id, 1, 1)}
    s.complete(done_ok.id, 1, (Status.OK, 1, None), 0.0, 1.0, starts[0].slots, 1)       # ok: it counts
    s.complete(cut.id, 1, (Status.FAILED, {"returncode": -15}, None), 0.0, 1.0, starts[1].slots, 1)
    assert [o.id for o in outcomes(s.take())] == [done_ok.id]
    assert s.interrupted_attempts() == [[late.id, 1], [cut.id, 1]]
