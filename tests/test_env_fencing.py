"""One live copy per environment: the fencing rule of the coordinator's environment directory, and the
ledger driving it, in-process (no sockets, no clock, the real FIFO policy, the outbox read back)."""
from __future__ import annotations

from tangram_hpc import protocol as P
from tangram_hpc.actions import ActionSpec, Status
from tangram_hpc.config import CoordinatorSettings
from tangram_hpc.coordinator import ActionLedger
from tangram_hpc.coordinator.environments import EnvironmentDirectory, EnvStatus
from tangram_hpc.policy.base import Assignment
from tangram_hpc.policy.fifo import FifoPolicy
from tangram_hpc.resources import WorkerInfo

C1 = b"client-1"
ROOT = {"w1": "/shared/run/worker-w1/envs", "w2": "/shared/run/worker-w2/envs",
        "w3": "/shared/run/worker-w3/envs"}


# -- the directory alone: the fencing rule --------------------------------------------------------

def test_a_grant_gives_one_worker_the_environment_and_every_new_grant_a_newer_generation():
    d = EnvironmentDirectory(wait_s=60)
    g1 = d.grant("e", "w1")
    assert g1[1] == P.GRANT_NEW and d.get("e").holder == "w1"
    assert d.grant("e", "w1") == [g1[0], P.GRANT_HELD, None]     # its next action: the copy it holds
    assert d.grant("e", "w2") is None                            # nobody else may use it meanwhile
    d.ended("e"), d.ended("e")
    assert d.worker_draining("w1", ask=True) == (["e"], [("e", g1[0])])
    assert d.grant("e", "w2") is None                            # moving: its actions wait
    assert d.saved("w1", "e", g1[0], "/snap/e-g1.tar.gz")
    g2 = d.grant("e", "w2")
    assert g2 == [g2[0], P.GRANT_RESTORE, "/snap/e-g1.tar.gz"] and g2[0] > g1[0]


def test_a_silent_worker_loses_its_right_and_gets_it_back_only_with_the_copy_it_was_granted():
    d = EnvironmentDirectory(wait_s=60)
    d.worker_registered("w1", ROOT["w1"], "job-1", [], 0.0)
    gen = d.grant("e", "w1")[0]
    d.grant("f", "w1")
    assert d.worker_lost("w1", dead=False, now=10.0) == ["e", "f"]
    assert d.get("e").status is EnvStatus.AWAITED and d.grant("e", "w2") is None
    # It comes back (after SIGCONT) with e at the generation it was granted, and f at an older one.
    keep, drop, regained, lost = d.worker_registered("w1", ROOT["w1"], "job-1", [["e", gen], ["f", gen]], 12.0)
    assert [k[:2] for k in keep] == [[P.ENV_KEEP, "e"]] and keep[0][2] > gen and regained == ["e"]
    assert drop == [[P.ENV_DROP, "f", gen]]       # not the copy it was last granted: fenced off
    assert d.get("e").status is EnvStatus.LIVE and d.get("e").holder == "w1"
    assert d.get("f").status is EnvStatus.LOST and lost == ["f"]   # it came back without f's copy


def test_a_dead_workers_environments_are_adopted_and_its_copies_fenced_when_it_returns():
    d = EnvironmentDirectory(wait_s=60)
    d.worker_registered("w1", ROOT["w1"], "job-1", [], 0.0)
    gen = d.grant("e", "w1")[0]
    assert d.worker_lost("w1", dead=True, now=1.0) == ["e"]
    rec = d.get("e")
    assert rec.status is EnvStatus.ORPHANED and rec.source == ROOT["w1"]
    g2 = d.grant("e", "w2")
    assert g2[1:] == [P.GRANT_ADOPT, ROOT["w1"]] and g2[0] > gen
    # A worker that was only believed dead comes back: its copy and its hand-back are both fenced.
    keep, drop, *_ = d.worker_registered("w1", ROOT["w1"], "job-1", [["e", gen]], 2.0)
    assert keep == [] and drop == [[P.ENV_DROP, "e", gen]]
    assert not d.saved("w1", "e", gen, "/snap/late.tar.gz")
    assert d.garbage == [("/snap/late.tar.gz", None)]        # the stale snapshot is deleted
    assert d.get("e").holder == "w2" and d.get("e").gen == g2[0]


def test_a_hand_back_that_arrives_after_its_worker_was_declared_dead_still_counts_until_adopted():
    """A leaving worker's last frames (its hand-backs) may be read after its closed connection made it
    'dead': its snapshot is then the state, not the directory it removed."""
    d = EnvironmentDirectory(wait_s=60)
    d.worker_registered("w1", ROOT["w1"], None, [], 0.0)
    ge, gf = d.grant("e", "w1")[0], d.grant("f", "w1")[0]
    d.worker_lost("w1", dead=True, now=1.0)
    assert d.saved("w1", "e", ge, "/snap/e.tar.gz")
    assert d.grant("e", "w2")[1:] == [P.GRANT_RESTORE, "/snap/e.tar.gz"]
    d.grant("f", "w2")                                   # f was adopted first: its late hand-back is stale
    assert not d.saved("w1", "f", gf, "/snap/f.tar.gz") and d.garbage == [("/snap/f.tar.gz", None)]
    assert not d.saved("w3", "e", ge, "/snap/x.tar.gz")  # and never from another worker


def test_an_awaited_environment_is_adopted_after_wait_s_or_lost_when_nobody_knows_where_it_is():
    d = EnvironmentDirectory(wait_s=30)
    d.worker_registered("w1", ROOT["w1"], "job-1", [], 0.0)
    d.grant("e", "w1")
    d.grant("x", "w9")                                   # w9 never said where its environments are
    d.worker_lost("w1", dead=False, now=0.0)
    d.worker_lost("w9", dead=False, now=0.0)
    assert d.expire(29.0) == []
    assert d.expire(30.0) == ["e", "x"]
    assert d.get("e").status is EnvStatus.ORPHANED
    assert d.get("x").status is EnvStatus.LOST and "silent for 30s" in d.get("x").why
    assert d.grant("x", "w2") is None


def test_a_lost_worker_whose_job_then_ends_has_its_environments_adopted_at_once():
    d = EnvironmentDirectory(wait_s=600)
    d.worker_registered("w1", ROOT["w1"], "job-1", [], 0.0)
    d.grant("e", "w1")
    d.worker_lost("w1", dead=False, now=0.0)
    assert d.worker_of_handle("job-1") == "w1"
    assert d.worker_dead("w1") == ["e"] and d.get("e").status is EnvStatus.ORPHANED


def test_a_closed_environment_is_dropped_and_a_stale_copy_cannot_bring_it_back():
    d = EnvironmentDirectory(wait_s=60)
    gen = d.grant("e", "w1")[0]
    d.ended("e")
    assert d.close("e") == ["w1", [P.ENV_DROP, "e", gen]]
    assert d.get("e") is None
    keep, drop, *_ = d.worker_registered("w1", ROOT["w1"], None, [["e", gen]], 1.0)
    assert keep == [] and drop == [[P.ENV_DROP, "e", gen]]
    assert d.grant("e", "w2")[1] == P.GRANT_NEW          # the id names a new, empty environment now


def test_the_state_file_records_bring_held_environments_back_as_awaited():
    d = EnvironmentDirectory(wait_s=60)
    d.worker_registered("w1", ROOT["w1"], None, [], 0.0)
    g_e = d.grant("e", "w1")[0]
    d.grant("s", "w1")
    d.ended("s")
    d.worker_draining("w1", ask=True)
    d.saved("w1", "s", d.get("s").gen, "/snap/s.tar.gz")
    d.grant("gone", "w1")
    d.ended("gone")
    d.close("gone")
    records = list(d.changes)
    again = EnvironmentDirectory(wait_s=60)
    again.load(records, 100.0)
    assert again.get("e").status is EnvStatus.AWAITED and again.get("e").holder == "w1"
    assert again.get("s").status is EnvStatus.SAVED and again.get("s").source == "/snap/s.tar.gz"
    assert again.get("gone") is None and again.counter == d.counter
    assert again.roots == {"w1": ROOT["w1"]}
    # The worker re-registers with its copy: it keeps it, at a generation above every earlier one.
    keep, *_ = again.worker_registered("w1", ROOT["w1"], None, [["e", g_e]], 101.0)
    assert keep[0][:2] == [P.ENV_KEEP, "e"] and keep[0][2] > d.counter
    assert again.found_snapshot("s", 1, "/x") is False


# -- the ledger: actions follow their environment ------------------------------------------

class RecordingFifo(FifoPolicy):
    """The FIFO policy, noting the close_env calls it gets (the simulator makes the same ones)."""

    def __init__(self):
        super().__init__()
        self.closed: list[str] = []

    def close_env(self, env: str) -> None:
        self.closed.append(env)
        super().close_env(env)


def make(policy: FifoPolicy | None = None, **settings) -> ActionLedger:
    return ActionLedger(CoordinatorSettings(**settings), policy or RecordingFifo())


def join(ledger: ActionLedger, wid: str, cores: int = 1, now: float = 0.0, envs=()) -> None:
    ledger.add_worker(WorkerInfo(id=wid, cores=cores, handle=f"job-{wid}",
                                 extra={"env_root": ROOT[wid], "envs": [list(e) for e in envs]}),
                      wid.encode(), now)


def act(env: str, n: int = 0) -> ActionSpec:
    return ActionSpec("sandbox", {"cmd": f"echo {n} >> log"}, env=env)


def submit(ledger: ActionLedger, *specs: ActionSpec, now: float = 0.0) -> None:
    ledger.submit(C1, [s.to_wire() for s in specs], now)


def assigned(ledger: ActionLedger, now: float = 0.0) -> dict[str, list]:
    """{worker: [(action id, attempt, grant), ...]} sent this turn."""
    if ledger.dirty:
        ledger.dispatch(now)
    out, ledger.outbox.assign = ledger.outbox.assign, {}
    return {w: [(i[0]["i"], i[1], i[3] if len(i) > 3 else None) for i in items] for w, items in out.items()}


def env_msgs(ledger: ActionLedger) -> dict[str, list]:
    out, ledger.outbox.env = ledger.outbox.env, {}
    return out


def results(ledger: ActionLedger) -> dict[str, list]:
    out, ledger.outbox.results = ledger.outbox.results, {}
    return {r[0]: r for r in out.get(C1, [])}


def running_in_e_on_w1(policy: FifoPolicy | None = None, **settings) -> tuple[ActionLedger, ActionSpec, int]:
    """Workers w1 and w2; an action in environment e runs on w1 (attempt 1).  Returns e's generation."""
    ledger = make(policy, **settings)
    join(ledger, "w1")
    join(ledger, "w2")
    a = act("e")
    submit(ledger, a)
    [(_, _, grant)] = assigned(ledger)["w1"]
    assert grant[1] == P.GRANT_NEW
    return ledger, a, grant[0]


def done(ledger, wid, aid, attempt, env_state="kept", now=1.0, status="ok"):
    assert ledger.done(wid, [[aid, attempt, status, "out", None, now - 0.5, now, env_state]], now) == 0


def test_actions_of_a_silent_workers_environment_wait_for_it_and_never_run_elsewhere():
    ledger = make()
    join(ledger, "w1")
    join(ledger, "w2")
    a = act("e", 1)
    submit(ledger, a)
    [(aid, _, grant)] = assigned(ledger)["w1"]
    gen = grant[0]
    b = act("e", 2)
    submit(ledger, b)                                 # queued behind a on w1
    ledger.lose_worker("w1", 5.0, "no heartbeat for 5.0s")
    assert assigned(ledger, 5.0) == {}                # not a's retry, not b: e's state is on w1
    assert ledger.counters.retried == 1
    # w1 comes back (SIGCONT) with the copy it was granted: it gets e again, and both actions.
    join(ledger, "w1", now=8.0, envs=[("e", gen)])
    keep = env_msgs(ledger)["w1"]
    assert keep[0][:2] == [P.ENV_KEEP, "e"] and keep[0][2] > gen
    starts = assigned(ledger, 8.0)
    assert list(starts) == ["w1"] and starts["w1"][0][:2] == (a.id, 2)
    assert starts["w1"][0][2] == [keep[0][2], P.GRANT_HELD, None]


def test_an_action_whose_worker_went_silent_times_out_on_time_and_is_not_run_again():
    ledger = make(timeout_grace_s=1.0, env_prepare_s=2.0, env_wait_s=100)
    join(ledger, "w1")
    join(ledger, "w2")
    a = ActionSpec("sandbox", {"cmd": "echo a >> log; sleep 6"}, env="e", timeout=3.0)
    submit(ledger, a)
    [(_, _, grant)] = assigned(ledger)["w1"]
    ledger.lose_worker("w1", 2.0, "no heartbeat for 5.0s")   # SIGSTOPped while the command runs
    ledger.expire(5.9)
    assert results(ledger) == {}
    ledger.expire(6.0)                                       # timeout + grace + prepare after its start
    r = results(ledger)[a.id]
    assert r[1] == Status.TIMEOUT and "stopped answering" in r[3] and "no heartbeat" in r[3]
    # the worker comes back with the environment: the finalised action does not run a second time,
    # and its attempt, which may still run there, is stopped
    join(ledger, "w1", now=8.0, envs=[("e", grant[0])])
    env_msgs(ledger)
    assert assigned(ledger, 8.0) == {} and a.id not in ledger
    assert ledger.outbox.kill == {"w1": [[a.id, 1]]}


def test_an_action_cancelled_while_its_worker_is_away_is_stopped_when_it_comes_back():
    ledger, a, gen = running_in_e_on_w1()
    ledger.lose_worker("w1", 2.0, "no heartbeat")
    ledger.cancel([a.id], 3.0)
    r = results(ledger)[a.id]
    assert r[1] == Status.CANCELLED and "attempt 1, which may still run where its environment is" in r[3]
    join(ledger, "w1", now=8.0, envs=[("e", gen)])
    assert ledger.outbox.kill == {"w1": [[a.id, 1]]} and assigned(ledger, 8.0) == {}


def test_an_action_given_up_on_while_its_worker_is_silent_is_stopped_when_it_comes_back():
    ledger, a, gen = running_in_e_on_w1(max_attempts=1)
    ledger.lose_worker("w1", 2.0, "no heartbeat")
    assert results(ledger)[a.id][1] == Status.ERROR
    join(ledger, "w1", now=8.0, envs=[("e", gen)])
    assert ledger.outbox.kill == {"w1": [[a.id, 1]]}


def test_an_action_cancelled_after_its_worker_came_back_stops_the_attempt_that_may_still_run_there():
    ledger, a, gen = running_in_e_on_w1()
    ledger.lose_worker("w1", 2.0, "no heartbeat")
    join(ledger, "w1", now=8.0, envs=[("e", gen)])       # back with e; a waits for its retry
    env_msgs(ledger)
    ledger.cancel([a.id], 8.5)
    assert results(ledger)[a.id][1] == Status.CANCELLED
    assert ledger.outbox.kill == {"w1": [[a.id, 1]]} and assigned(ledger, 8.5) == {}


def test_outcomes_kept_by_a_returning_worker_answer_the_actions_still_waiting():
    ledger, a, gen = running_in_e_on_w1()
    ledger.lose_worker("w1", 5.0, "no heartbeat")
    join(ledger, "w1", now=8.0, envs=[("e", gen)])
    env_msgs(ledger)
    # Before its retry is dispatched, the worker sends the outcome of attempt 1, which did finish.
    assert ledger.outcomes("w1", [[a.id, 1, "ok", "ran once", None, 4.0, 6.0, "created"]], 8.0) == 0
    r = results(ledger)[a.id]
    assert r[1] == "ok" and r[2] == "ran once" and r[10] == "created"
    assert assigned(ledger, 8.0) == {} and a.id not in ledger and ledger.counters.replayed == 1


def test_a_dead_workers_environment_is_adopted_by_the_next_worker_to_run_its_action():
    ledger, a, gen = running_in_e_on_w1()
    ledger.lose_worker("w1", 2.0, "backend job job-w1 failed", dead=True)
    [(aid, attempt, grant)] = assigned(ledger, 2.0)["w2"]
    assert (aid, attempt) == (a.id, 2) and grant[1:] == [P.GRANT_ADOPT, ROOT["w1"]] and grant[0] > gen
    done(ledger, "w2", a.id, 2, env_state="adopted", now=3.0)
    r = results(ledger)[a.id]
    assert r[1] == "ok" and r[9] == 2 and r[10] == "adopted"


def test_drain_moves_environments_off_between_actions_and_the_worker_waits_for_the_saves():
    ledger = make()
    join(ledger, "w1")
    join(ledger, "w2")
    a = act("e", 1)
    submit(ledger, a)
    gen = assigned(ledger)["w1"][0][2][0]
    ledger.drain("w1", "time limit", 1.0)
    assert env_msgs(ledger) == {}                     # a still runs in e: the save waits for it
    assert ledger.holds_moving_envs("w1")
    b = act("e", 2)
    submit(ledger, b, now=1.5)
    assert assigned(ledger, 1.5) == {}                # e is moving: b waits
    done(ledger, "w1", a.id, 1, env_state="created", now=2.0)
    assert env_msgs(ledger) == {"w1": [[P.ENV_SAVE, "e", gen]]}
    assert ledger.env_report("w1", [[P.ENV_SAVED, "e", gen, "/snap/e.tar.gz"]], 3.0) == 0
    assert not ledger.holds_moving_envs("w1")        # the pool driver may stop it now
    [(aid, attempt, grant)] = assigned(ledger, 3.0)["w2"]
    assert aid == b.id and grant[1:] == [P.GRANT_RESTORE, "/snap/e.tar.gz"]
    assert "e" in ledger.policy.closed                # its pin to w1 went with it


class MovingFifo(RecordingFifo):
    """FIFO that asks for the moves a test scripts, and notes the move times it is told."""

    def __init__(self):
        super().__init__()
        self.want: list[str] = []
        self.observed: list[float] = []

    def env_moves(self) -> list[str]:
        out, self.want = self.want, []
        return out

    def observe_env_move(self, seconds: float) -> None:
        self.observed.append(seconds)


def test_a_move_the_policy_asks_for_saves_the_environment_and_its_next_action_restores_it_elsewhere():
    ledger, a, gen = running_in_e_on_w1(MovingFifo())
    # asked while a runs in e: the save waits for it, and the next action waits for the save
    ledger.policy.want = ["e"]
    ledger.dirty = True
    assert assigned(ledger, 0.5) == {} and env_msgs(ledger) == {}
    b = act("e", 2)
    submit(ledger, b, now=0.6)
    assert assigned(ledger, 0.6) == {}
    done(ledger, "w1", a.id, 1, env_state="created", now=1.0)
    busy = ActionSpec("sandbox", {"cmd": "sleep 9"}, env="other")
    submit(ledger, busy, now=1.0)
    assert [x[0] for x in assigned(ledger, 1.0)["w1"]] == [busy.id]     # w1's core is taken again
    assert env_msgs(ledger) == {"w1": [[P.ENV_SAVE, "e", gen]]}
    assert ledger.env_report("w1", [[P.ENV_SAVED, "e", gen, "/snap/e.tar.gz"]], 3.0) == 0
    [(aid, attempt, grant)] = assigned(ledger, 3.0)["w2"]
    assert (aid, attempt) == (b.id, 1) and grant[1:] == [P.GRANT_RESTORE, "/snap/e.tar.gz"] and grant[0] > gen
    assert "e" in ledger.policy.closed and ledger.policy.observed == [4.0]   # 2 x the save: from 1.0, when it was asked, to 3.0
    assert ledger.counters.env_moves == 1
    # moved again while b runs in it (its save waits for b); one that no worker holds is left alone
    ledger.policy.want = ["e", "never-seen"]
    ledger.dirty = True
    assert assigned(ledger, 3.5) == {} and env_msgs(ledger) == {}
    assert ledger.envlife.directory.get("e").status is EnvStatus.MOVING and ledger.envlife.directory.get("never-seen") is None
    assert ledger.counters.env_moves == 2
    done(ledger, "w2", b.id, 1, env_state="restored", now=4.0)
    assert env_msgs(ledger) == {"w2": [[P.ENV_SAVE, "e", grant[0]]]}
    # b's restore: assigned at 3.0, its DONE at 4.0, its command ran 0.5 s: 0.5 s
    assert ledger.envlife.restore_s == 0.5
    # the second move's cost is its save (from 4.0, when the save was sent, to 5.0) and that restore
    assert ledger.env_report("w2", [[P.ENV_SAVED, "e", grant[0], "/snap/e2.tar.gz"]], 5.0) == 0
    assert ledger.policy.observed == [4.0, 1.5]


def test_a_move_of_an_environment_that_is_only_a_placement_hint_unpins_its_waiting_actions():
    """For kinds other than sandbox ``env`` only places actions together: nothing to save, so the
    scheduler's move lets the waiting action start on the other worker at once."""
    ledger = make(MovingFifo())
    join(ledger, "w1")
    first = ActionSpec("function", {"fn": "json:dumps", "args": [1]}, env="h")
    busy = ActionSpec("function", {"fn": "time:sleep", "args": [9]}, env="other")
    submit(ledger, first, busy)
    assert [x[0] for x in assigned(ledger, 0.0)["w1"]] == [first.id]
    ledger.done("w1", [[first.id, 1, "ok", "1", None, 0.1, 0.2, None]], 0.5)
    assert [x[0] for x in assigned(ledger, 0.5)["w1"]] == [busy.id]
    join(ledger, "w2", now=0.6)
    nxt = ActionSpec("function", {"fn": "json:dumps", "args": [2]}, env="h")
    submit(ledger, nxt, now=0.7)
    assert assigned(ledger, 0.7) == {}                   # pinned to w1, whose core is taken
    ledger.policy.want = ["h"]
    ledger.dirty = True
    assigned(ledger, 0.8)                                # the move is carried out after the starts
    assert "h" in ledger.policy.closed and env_msgs(ledger) == {}
    assert [x[0] for x in assigned(ledger, 0.9)["w2"]] == [nxt.id]
    assert ledger.counters.env_moves == 0 and ledger.policy.observed == []


def test_an_environment_its_holder_could_not_save_stays_and_is_not_asked_to_move_again():
    ledger, a, gen = running_in_e_on_w1(MovingFifo())
    done(ledger, "w1", a.id, 1, env_state="created", now=1.0)
    ledger.policy.want = ["e"]
    b = act("e", 2)
    submit(ledger, b, now=1.0)
    assert assigned(ledger, 1.0) == {"w1": [(b.id, 1, [gen, P.GRANT_HELD, None])]}   # started before the move
    done(ledger, "w1", b.id, 1, now=2.0)
    assert env_msgs(ledger) == {"w1": [[P.ENV_SAVE, "e", gen]]}
    ledger.env_report("w1", [[P.ENV_UNSAVED, "e", gen, "OSError: disk full"]], 2.5)
    c = act("e", 3)
    submit(ledger, c, now=3.0)
    assert assigned(ledger, 3.0) == {"w1": [(c.id, 1, [gen, P.GRANT_HELD, None])]}   # it stayed on w1
    ledger.policy.want = ["e"]
    ledger.dirty = True
    assigned(ledger, 3.5)
    assert ledger.envlife.directory.get("e").status is EnvStatus.LIVE and ledger.counters.env_moves == 1
    assert ledger.policy.observed == []


def test_a_leaving_worker_hands_back_on_its_own_and_its_interrupted_attempts_are_retried():
    ledger = make()
    join(ledger, "w1", cores=2)
    join(ledger, "w2")
    a, b = act("e", 1), act("f", 2)
    submit(ledger, a, b)
    grants = {aid: g for aid, _, g in assigned(ledger)["w1"]}
    ledger.worker_leaving("w1", "SIGTERM", 1.0)
    assert env_msgs(ledger) == {}                     # it saves them itself
    done(ledger, "w1", a.id, 1, now=1.5)              # a finished in its grace
    ledger.env_report("w1", [[P.ENV_SAVED, "e", grants[a.id][0], "/s/e"],
                             [P.ENV_SAVED, "f", grants[b.id][0], "/s/f"]], 2.0)
    ledger.worker_left("w1", 2.0, "SIGTERM")          # b was interrupted: no DONE
    [(aid, attempt, grant)] = assigned(ledger, 2.0)["w2"]
    assert (aid, attempt) == (b.id, 2) and grant[1:] == [P.GRANT_RESTORE, "/s/f"]
    assert results(ledger)[a.id][1] == "ok"


def test_a_lost_environment_fails_its_actions_with_env_lost_until_the_client_closes_it():
    ledger = make(env_wait_s=10)
    join(ledger, "w1")
    join(ledger, "w2")
    ledger.envlife.directory.roots.clear()                          # nobody knows where w1 keeps its environments
    a = act("e", 1)
    submit(ledger, a)
    assigned(ledger)
    ledger.lose_worker("w1", 1.0, "no heartbeat")
    ledger.envlife.directory.roots.pop("w1", None)
    b = act("e", 2)
    submit(ledger, b, now=2.0)
    ledger.expire(11.0)
    res = results(ledger)
    assert {res[a.id][1], res[b.id][1]} == {Status.ENV_LOST}
    assert "silent for 10s" in res[b.id][3]
    c = act("e", 3)
    submit(ledger, c, now=12.0)
    r = results(ledger)[c.id]
    assert r[1] == Status.ENV_LOST and "close it" in r[3]
    ledger.close_env(["e"], 13.0)
    d = act("e", 4)
    submit(ledger, d, now=14.0)
    [(aid, _, grant)] = assigned(ledger, 14.0)["w2"]
    assert aid == d.id and grant[1] == P.GRANT_NEW


def test_close_env_waits_for_the_actions_already_submitted_then_drops_the_copy():
    ledger = make()
    join(ledger, "w1")
    a = act("e", 1)
    submit(ledger, a)
    gen = assigned(ledger)["w1"][0][2][0]
    ledger.close_env(["e"], 0.5)
    later = act("e", 2)
    submit(ledger, later, now=0.6)                    # after close_env: for a new environment
    assert env_msgs(ledger) == {} and assigned(ledger, 0.6) == {}
    done(ledger, "w1", a.id, 1, now=1.0)
    assert env_msgs(ledger) == {"w1": [[P.ENV_DROP, "e", gen]]}
    assert ledger.policy.closed == ["e"] and ledger.counters.envs_closed == 1
    [(aid, _, grant)] = assigned(ledger, 1.0)["w1"]
    assert aid == later.id and grant[1] == P.GRANT_NEW and grant[0] > gen


def test_a_late_hand_back_of_a_fenced_copy_changes_nothing():
    ledger, a, gen = running_in_e_on_w1()
    ledger.lose_worker("w1", 1.0, "connection closed", dead=True)
    new = assigned(ledger, 1.0)["w2"][0][2][0]
    ledger.env_report("w1", [[P.ENV_SAVED, "e", gen, "/snap/old.tar.gz"]], 2.0)
    rec = ledger.envlife.directory.get("e")
    assert rec.status is EnvStatus.LIVE and rec.holder == "w2" and rec.gen == new
    assert ledger.envlife.directory.garbage == [("/snap/old.tar.gz", None)]


def test_attempts_started_under_a_previous_coordinator_continue_their_count():
    a = act("e")
    ledger = ActionLedger(CoordinatorSettings(), RecordingFifo(), prior_attempts={a.id: 1})
    join(ledger, "w1")
    submit(ledger, a)
    [(aid, attempt, _)] = assigned(ledger)["w1"]
    assert attempt == 2
    assert ledger.envlife.attempt_log == [[a.id, 2]]
    done(ledger, "w1", a.id, 2)
    assert ledger.envlife.attempt_log[-1] == [a.id, 0]


def test_the_simulator_and_the_coordinator_end_environments_through_the_same_policy_call():
    """A trajectory's end in the simulator and close_env from a client in the coordinator both reach
    the scheduling policy as close_env(env), so a simulated run pins and frees environments as a
    live one does."""
    from tangram_hpc.sim.engine import simulate
    from tangram_hpc.sim.workload import parse_workload
    doc = {"format_version": 1, "name": "t",
           "rollout": {"steps": 1, "trajectories_per_step": 3, "turns": 2, "think_s": 1.0},
           "cluster": {"cpu_workers": 2, "cpu_cores": 1},
           "actions": [{"name": "job", "kind": "sandbox", "weight": 1.0, "duration_s": 2.0}]}
    simulated = RecordingFifo()
    simulate(parse_workload(doc).sample(), simulated)
    assert sorted(simulated.closed) == ["s0t0", "s0t1", "s0t2"]
    assert all(simulated.env_host(e) is None for e in simulated.closed)
    live = make()
    join(live, "w1")
    a = act("s0t0")
    submit(live, a)
    assigned(live)
    assert live.policy.env_host("s0t0") == "w1"
    done(live, "w1", a.id, 1)
    live.close_env(["s0t0"], 2.0)
    assert live.policy.closed == ["s0t0"] and live.policy.env_host("s0t0") is None


class MisplacingFifo(RecordingFifo):
    """The FIFO policy, starting the actions named in ``misplace`` on another worker than it chose,
    and noting the ends it is told of."""

    def __init__(self):
        super().__init__()
        self.misplace: dict[str, str] = {}
        self.ended: list[str] = []

    def schedule(self, now: float) -> list:
        return [Assignment(s.action_id, self.misplace.pop(s.action_id, s.worker_id), s.cores)
                for s in super().schedule(now)]

    def finished(self, action_id: str, now: float, *, ok: bool = True, run_time: float | None = None) -> None:
        self.ended.append(action_id)
        super().finished(action_id, now, ok=ok, run_time=run_time)


def test_a_start_away_from_the_environment_is_revoked_not_ended_and_runs_where_the_environment_is():
    policy = MisplacingFifo()
    ledger, a, gen = running_in_e_on_w1(policy)
    done(ledger, "w1", a.id, 1)
    b = act("e", 2)
    policy.misplace[b.id] = "w2"
    submit(ledger, b, now=2.0)
    ledger.dispatch(2.0)
    assert ledger.outbox.assign == {}                 # refused by the directory: e is on w1
    assert policy.ended == [a.id]                      # the refused start is no run that ended
    assert policy.running_count == 0 and ledger.dirty  # its core is free again, and it waits its turn
    assert assigned(ledger, 2.0) == {"w1": [(b.id, 1, [gen, P.GRANT_HELD, None])]}
    assert policy.running_count == 1


def test_env_of_another_kind_is_only_a_placement_hint():
    """Environments are sandbox state: a function action naming an env gets no grant and no hold."""
    ledger = make()
    join(ledger, "w1")
    f = ActionSpec("function", {"fn": "math:sqrt", "args": [4]}, env="e")
    submit(ledger, f)
    [(aid, _, grant)] = assigned(ledger)["w1"]
    assert aid == f.id and grant is None and ledger.envlife.directory.get("e") is None


def test_the_coordinators_deadline_allows_for_creating_or_restoring_the_environment_not_for_a_held_one():
    ledger = make(MovingFifo(), timeout_grace_s=1.0, env_prepare_s=30.0)
    join(ledger, "w1")
    join(ledger, "w2")
    # created on w1: a 20 s creation and a 4.9 s command are within the timeout the worker keeps
    a = ActionSpec("sandbox", {"cmd": "sleep 4.9"}, env="e", timeout=5.0)
    submit(ledger, a)
    [(_, _, grant)] = assigned(ledger)["w1"]
    assert grant[1] == P.GRANT_NEW
    ledger.expire(5.0 + 1.0 + 30.0 - 0.01)
    assert results(ledger) == {}
    done(ledger, "w1", a.id, 1, env_state="created", now=25.0)
    assert results(ledger)[a.id][1] == Status.OK
    # held there: the timeout counts from the ASSIGN, as for any action
    b = ActionSpec("sandbox", {"cmd": "sleep 9"}, env="e", timeout=5.0)
    submit(ledger, b, now=26.0)
    [(_, _, grant)] = assigned(ledger, 26.0)["w1"]
    assert grant[1] == P.GRANT_HELD
    ledger.expire(26.0 + 5.0 + 1.0 - 0.01)
    assert results(ledger) == {}
    ledger.expire(26.0 + 5.0 + 1.0)
    assert results(ledger)[b.id][1:4:2] == [Status.TIMEOUT, "no result 5s (+1s grace) after it started"]
    done(ledger, "w1", b.id, 1, now=33.0, status="killed")     # the killed attempt ends; its core is free
    # moved to w2: the restore gets the allowance, and the timeout message says so
    ledger.policy.want = ["e"]
    ledger.dirty = True
    assigned(ledger, 34.0)
    [[_, _, gen]] = env_msgs(ledger)["w1"]
    assert ledger.env_report("w1", [[P.ENV_SAVED, "e", gen, "/snap/e.tar.gz"]], 35.0) == 0
    c = ActionSpec("sandbox", {"cmd": "sleep 9"}, env="e", timeout=5.0)
    submit(ledger, c, now=36.0)
    [(_, _, grant)] = next(iter(assigned(ledger, 36.0).values()))
    assert grant[1] == P.GRANT_RESTORE
    ledger.expire(36.0 + 5.0 + 1.0 + 30.0 - 0.01)
    assert results(ledger) == {}
    ledger.expire(36.0 + 5.0 + 1.0 + 30.0)
    res = results(ledger)[c.id]
    assert res[1] == Status.TIMEOUT and "(+1s grace, +30s to create or restore its environment)" in res[3]


def test_snapshots_a_killed_worker_left_half_written_are_deleted_once_stale(tmp_path):
    import os

    from tangram_hpc.coordinator.state_dir import PARTIAL_STALE_S, StateDir
    state = StateDir(tmp_path / "state")
    stale = state.snapshots / "e-g3-1-0123abcd.tar.gz.c7de2b2c.partial"
    fresh = state.snapshots / "f-g1-1-89abcdef.tar.gz.0badf00d.partial"
    done = state.snapshots / "g-g1-1-89abcdef.tar.gz"
    for p in (stale, fresh, done):
        p.write_bytes(b"x")
    now = stale.stat().st_mtime + PARTIAL_STALE_S + 1
    os.utime(fresh, (now - 10, now - 10))           # still being written
    os.utime(done, (0, 0))                           # a whole snapshot is never pruned here
    assert state.prune_partial_snapshots(now) == 1
    assert not stale.exists() and fresh.exists() and done.exists()
