"""The client's protocol state with no sockets: batching, de-duplication, restart resubmission."""
from __future__ import annotations

from concurrent.futures import Future

import pytest

from tangram_hpc import function
from tangram_hpc import protocol as P
from tangram_hpc.client_session import SUBMIT_BATCH, ClientSession, CoordinatorError


def _decode(frame: bytes):
    return P.decode(frame, frozenset(P.NAMES))


def _result(aid: str, output=None) -> list:
    return [aid, "ok", output, None, 1.0, 1.5, 2.0, "w1", 1, 1, None]


def _session_with(n: int):
    s = ClientSession("test")
    specs = [function("math:sqrt", i) for i in range(n)]
    futs = [Future() for _ in specs]
    for spec, fut in zip(specs, futs):
        s.add(spec, fut)
    return s, specs, futs


def test_submissions_are_batched_and_control_messages_keep_their_place():
    s, specs, _ = _session_with(SUBMIT_BATCH + 5)
    s.cancel(["x"])
    s.add(function("math:sqrt", 1), Future())
    frames = [_decode(f) for f in s.frames()]
    assert [(t, len(b)) for t, b in frames] == [(P.SUBMIT, SUBMIT_BATCH), (P.SUBMIT, 5), (P.CANCEL, 1), (P.SUBMIT, 1)]
    assert [w["i"] for w in frames[0][1]] == [sp.id for sp in specs[:SUBMIT_BATCH]]
    assert not s.outq and list(s.frames()) == []


def test_batches_split_to_the_coordinators_frame_limit_and_an_oversized_action_fails_alone():
    s = ClientSession("test")
    s.max_frame = 600
    small = [function("math:sqrt", i) for i in range(20)]
    big = function("builtins:len", "x" * 2000)
    futs = {}
    for spec in small + [big]:
        futs[spec.id] = Future()
        s.add(spec, futs[spec.id])
    frames = list(s.frames())
    assert all(len(f) <= 600 for f in frames)
    sent = [w["i"] for f in frames for w in _decode(f)[1]]
    assert sent == [sp.id for sp in small]
    res = futs[big.id].result(0)
    assert res.status == "error" and "frame limit of 600" in res.error
    assert big.id not in s.pending


def test_an_action_msgpack_cannot_carry_fails_alone_and_the_rest_of_its_batch_goes_out():
    s = ClientSession("test")
    good = [function("math:sqrt", i) for i in range(9)]
    bad = [function("math:sqrt", 2 ** 64), function("builtins:len", {1, 2})]
    futs = {}
    for spec in good[:4] + [bad[0]] + good[4:] + [bad[1]]:
        futs[spec.id] = Future()
        s.add(spec, futs[spec.id])
    sent = [w["i"] for f in s.frames() for w in _decode(f)[1]]
    assert sent == [sp.id for sp in good]
    for spec in bad:
        res = futs[spec.id].result(0)
        assert res.status == "error" and res.error.startswith("rejected: the action cannot be sent"), res
        assert spec.id not in s.pending
    assert all(not futs[sp.id].done() for sp in good)


def test_a_result_resolves_its_future_once_and_duplicates_are_ignored():
    s, specs, futs = _session_with(3)
    list(s.frames())
    frame = P.encode(P.RESULT, [_result(specs[0].id, 1.0), _result(specs[0].id, 99.0), ["junk"], 5])
    assert s.on_frame(frame) == 1
    assert futs[0].result(0).output == 1.0
    assert s.on_frame(P.encode(P.RESULT, [_result(specs[0].id, 2.0)])) == 0
    assert futs[0].result(0).output == 1.0 and len(s.pending) == 2


def test_an_unreadable_result_fails_its_future_with_a_clear_error():
    s, specs, futs = _session_with(1)
    s.on_frame(P.encode(P.RESULT, [[specs[0].id, "no-such-status"]]))
    with pytest.raises(CoordinatorError, match="bad result"):
        futs[0].result(0)


def test_a_new_coordinator_incarnation_gets_every_unfinished_action_once():
    s, specs, futs = _session_with(4)
    list(s.frames())                               # all four sent to the first incarnation
    s.on_frame(P.encode(P.WELCOME, {"coordinator": "A", "limits": {"max_frame_bytes": 1 << 20}}))
    s.on_frame(P.encode(P.RESULT, [_result(specs[0].id)]))
    late = function("math:sqrt", 9)
    s.add(late, Future())                          # queued, not yet sent
    s.ask_status(Future())
    s.on_frame(P.encode(P.HEARTBEAT, {"coordinator": "B"}))
    frames = [_decode(f) for f in s.frames()]
    resent = [w["i"] for t, b in frames if t == P.SUBMIT for w in b]
    assert sorted(resent) == sorted([sp.id for sp in specs[1:]] + [late.id])   # no duplicate of the queued one
    assert [t for t, _ in frames].count(P.STATUS) == 1
    assert s.resubmissions == 4 and s.max_frame == 1 << 20 and s.coordinator == "B"
    # each says how long ago it was first submitted, so that the new incarnation counts its ACT from then
    ages = [w["a"] for t, b in frames if t == P.SUBMIT for w in b]
    assert len(ages) == 4 and all(0 <= a < 5 for a in ages)


def test_a_cancel_the_old_incarnation_may_have_lost_reaches_the_new_one():
    s, specs, futs = _session_with(4)
    list(s.frames())
    s.on_frame(P.encode(P.WELCOME, {"coordinator": "A"}))
    futs[0].cancel()                               # the caller's cancel (ActionFuture.cancel sends a CANCEL too)
    s.cancel([specs[0].id])
    s.cancel([specs[1].id])                        # by id: the future waits for the final word
    s.cancel([specs[2].id])
    s.on_frame(P.encode(P.RESULT, [_result(specs[2].id)]))      # answered before the restart
    list(s.frames())                               # the CANCELs went to A, which died with them
    s.on_frame(P.encode(P.HEARTBEAT, {"coordinator": "B"}))
    frames = [_decode(f) for f in s.frames()]
    assert [t for t, _ in frames] == [P.SUBMIT, P.CANCEL]
    # sent again (one may still run on its worker) and cancelled again right after
    assert sorted(w["i"] for w in frames[0][1]) == sorted([specs[0].id, specs[1].id, specs[3].id])
    assert frames[1][1] == sorted([specs[0].id, specs[1].id])
    assert not futs[1].done()


def test_a_submit_from_another_thread_during_the_resubmission_is_neither_lost_nor_sent_twice():
    from collections import deque
    s, specs, _ = _session_with(2)
    list(s.frames())
    s.on_frame(P.encode(P.WELCOME, {"coordinator": "A"}))
    s.add(specs[0].__class__(kind="function", payload={"fn": "math:sqrt", "args": [4]}, id="queued"), Future())
    late = function("math:sqrt", 9)

    class Racing(deque):        # another thread's submit lands while the queue is taken apart
        fired = False

        def popleft(self):
            if not Racing.fired:
                Racing.fired = True
                s.add(late, Future())
            return super().popleft()

    s.outq = Racing(s.outq)
    s.on_frame(P.encode(P.HEARTBEAT, {"coordinator": "B"}))
    sent = [w["i"] for t, b in (_decode(f) for f in s.frames()) if t == P.SUBMIT for w in b]
    assert sorted(sent) == sorted([specs[0].id, specs[1].id, "queued", late.id])


def test_status_replies_go_to_waiters_in_order_and_errors_are_kept():
    s = ClientSession("test")
    first, second = Future(), Future()
    s.ask_status(first)
    s.ask_status(second)
    s.on_frame(P.encode(P.STATUS, {"n": 1}))
    s.on_frame(P.encode(P.STATUS, {"n": 2}))
    assert first.result(0) == {"n": 1} and second.result(0) == {"n": 2}
    s.on_frame(P.encode(P.ERROR, {"code": "too_large", "message": "frame too big"}))
    s.on_frame(b"\xc1garbage")
    assert s.errors[0] == "too_large: frame too big" and "msgpack" in s.errors[1]


def test_a_future_cancelled_by_the_caller_does_not_break_result_handling():
    s, specs, futs = _session_with(2)
    assert futs[0].cancel()
    s.on_frame(P.encode(P.RESULT, [_result(specs[0].id), _result(specs[1].id, 7)]))
    assert futs[0].cancelled() and futs[1].result(0).output == 7


def test_a_status_answer_goes_to_a_caller_still_waiting_not_to_one_that_gave_up():
    """A request lost with a coordinator that moved left its waiter first in line: every later
    answer went to it, and each new caller timed out (serve's /health answered 503 for ever)."""
    s = ClientSession("test")
    gave_up, waiting = Future(), Future()
    s.ask_status(gave_up)
    gave_up.cancel()                         # its caller timed out
    s.ask_status(waiting)
    assert s.on_frame(P.encode(P.STATUS, {"n": 2})) == 1
    assert waiting.result(0) == {"n": 2} and not s.status_waiters
