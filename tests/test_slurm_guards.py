"""The one launch throttle (pure; the clock is passed in): rate, back-off, breaker, pause and resume."""
from datetime import datetime

import pytest

from tangram_hpc.backends.guards import LaunchThrottle, ThrottleState, local_time
from tangram_hpc.config import LaunchSettings


def throttle(**kw) -> LaunchThrottle:
    return LaunchThrottle(LaunchSettings(**kw))


def test_rate_burst_then_refill_and_status_says_when():
    t = throttle(rate=6, burst=3)
    assert t.allowed(0.0) == 3
    t.launched(0.0, 3, wanted=5)
    assert t.allowed(0.0) == 0
    st = t.status(0.0)
    assert st.state is ThrottleState.RATE_LIMITED and st.retry_at == pytest.approx(10.0)
    assert "6 launches a minute, 3 at once" in st.reason
    assert t.allowed(9.9) == 0 and t.allowed(10.0) == 1
    assert t.allowed(1000.0) == 3             # never more than the burst
    assert t.status(1000.0).state is ThrottleState.OK


def test_failed_starts_back_off_doubling_and_a_good_start_clears_it():
    t = throttle(backoff_s=2, max_backoff_s=5, breaker=10)
    t.failed(100.0, "exit status 1")
    assert t.allowed(101.9) == 0 and t.allowed(102.0) > 0
    st = t.status(101.0)
    assert st.state is ThrottleState.BACKING_OFF and st.retry_at == 102.0 and "exit status 1" in st.reason
    t.failed(102.0, "exit status 1")          # 4 s
    assert t.allowed(105.9) == 0 and t.allowed(106.0) > 0
    t.failed(106.0, "exit status 1")          # 8 s, capped at 5
    assert t.allowed(110.9) == 0 and t.allowed(111.0) > 0
    t.succeeded(112.0)
    t.failed(113.0, "again")                  # the streak starts over
    assert t.allowed(115.0) > 0


def test_breaker_stops_for_the_cooldown_then_allows_one_trial():
    t = throttle(breaker=3, breaker_window_s=60, breaker_cooldown_s=100, backoff_s=0)
    t.failed(0.0, "a")
    t.failed(10.0, "b")
    t.failed(80.0, "c")                       # "a" and "b" fell out of the window
    t.failed(81.0, "d")
    assert t.allowed(81.0) > 0
    t.failed(85.0, "sbatch: error: invalid account")
    st = t.status(85.0)
    assert st.state is ThrottleState.STOPPED and st.retry_at == 185.0
    assert "3 worker starts failed within 60 s" in st.reason and "invalid account" in st.reason
    assert t.allowed(184.9) == 0
    assert t.allowed(185.0) == 1 and t.status(185.0).state is ThrottleState.TRIAL
    t.launched(185.0, 1)
    assert t.allowed(186.0) == 0 and "under way" in t.status(186.0).reason   # one trial at a time
    t.failed(190.0, "still broken")           # the trial failed: stopped again
    assert t.status(190.0).state is ThrottleState.STOPPED and t.allowed(289.0) == 0
    assert "trial launch failed" in t.status(190.0).reason
    assert t.allowed(290.0) == 1
    t.launched(290.0, 1)
    t.succeeded(300.0)                        # the trial worker joined and stayed
    assert t.status(300.0).state is ThrottleState.OK and t.allowed(300.0) >= 1


def test_pause_and_resume_which_forgets_the_failures():
    t = throttle(breaker=2, breaker_cooldown_s=900)
    t.failed(0.0, "x")
    t.failed(1.0, "y")
    assert t.status(2.0).state is ThrottleState.STOPPED and t.allowed(2.0) == 0
    t.resume(2.0)
    assert t.status(2.0).state is ThrottleState.OK and t.allowed(2.0) > 0
    t.pause(3.0)
    st = t.status(3.0)
    assert st.state is ThrottleState.PAUSED and st.retry_at is None and "pool resume" in st.reason
    assert t.allowed(10_000.0) == 0
    t.resume(10_000.0)
    assert t.allowed(10_000.0) > 0


def test_local_time_is_a_wall_clock_time():
    t = 1796090801.0
    assert datetime.fromisoformat(local_time(t)).timestamp() == t
