"""Rate limiter and circuit breaker (pure; the clock is passed in)."""
from tangram_hpc.backends.guards import CircuitBreaker, SubmitRateLimiter


def test_rate_limiter_burst_then_refill():
    rl = SubmitRateLimiter(per_minute=6, burst=3)
    assert rl.take(0.0, 5) == 3
    assert rl.take(0.0, 1) == 0
    assert rl.next_free(0.0) == 10.0
    assert rl.take(9.0, 1) == 0
    assert rl.take(10.0, 2) == 1
    assert rl.take(1000.0, 10) == 3   # never more than the burst


def test_breaker_opens_after_k_failures_in_window():
    br = CircuitBreaker(failures=3, window_s=60, cooldown_s=100)
    br.record_failure(0, "a")
    br.record_failure(10, "b")
    br.record_failure(80, "c")            # "a" and "b" fell out of the window
    br.record_failure(81, "d")
    assert br.state(81) == "closed" and br.allow(81) is None
    br.record_failure(85, "e")
    assert br.state(85) == "open" and br.allow(85) == 0
    assert "last failure: e" in br.explain(85) and "open" in br.explain(85)


def test_breaker_half_open_trial():
    br = CircuitBreaker(failures=1, window_s=60, cooldown_s=30)
    br.record_failure(0, "boom")
    assert br.allow(29) == 0
    assert br.allow(30) == 1 and br.state(30) == "half-open"
    br.started_trial()
    assert br.allow(31) == 0               # only one trial at a time
    br.record_failure(40, "again")
    assert br.state(40) == "open" and br.allow(69) == 0 and br.allow(70) == 1
    br.started_trial()
    br.record_success(75)
    assert br.state(75) == "closed" and br.allow(75) is None


def test_success_resets_consecutive_count():
    br = CircuitBreaker(failures=2, window_s=60, cooldown_s=30)
    br.record_failure(0, "x")
    br.record_success(1)
    br.record_failure(2, "y")
    assert br.state(2) == "closed"
