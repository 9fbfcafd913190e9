"""Guards against runaway job submission, usable by any backend.

A brief outage can make a naive pool controller ask for dozens of jobs at
once, and a broken worker image makes every job fail seconds after it
starts; either can get an account banned.  Two small pure objects (the clock
is passed in) stop that:

* :class:`SubmitRateLimiter`: a token bucket; at most ``burst`` submissions at
  once, refilled at ``per_minute``.
* :class:`CircuitBreaker`: after ``failures`` failed starts within
  ``window_s`` it opens and refuses launches for ``cooldown_s``; then it lets
  one trial launch through (half-open) and closes again on the first healthy
  start, or re-opens on the next failure.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..errors import LaunchRefused

__all__ = ["SubmitRateLimiter", "CircuitBreaker", "LaunchRefused"]


@dataclass
class SubmitRateLimiter:
    per_minute: float = 30.0
    burst: int = 8
    _tokens: float = field(default=-1.0, repr=False)
    _last: float | None = field(default=None, repr=False)

    def _refill(self, now: float) -> None:
        if self._tokens < 0:
            self._tokens = float(self.burst)
        if self._last is not None and now > self._last:
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.per_minute / 60.0)
        self._last = now if self._last is None else max(self._last, now)

    def allowed(self, now: float) -> int:
        """How many submissions may go out now."""
        self._refill(now)
        return int(self._tokens + 1e-9)

    def take(self, now: float, n: int = 1) -> int:
        """Take up to ``n`` submissions; return how many were granted."""
        k = min(n, self.allowed(now))
        self._tokens -= k
        return k

    def next_free(self, now: float) -> float:
        """When the next submission will be allowed."""
        self._refill(now)
        if self._tokens >= 1:
            return now
        return now + (1 - self._tokens) * 60.0 / self.per_minute


@dataclass
class CircuitBreaker:
    failures: int = 5
    window_s: float = 300.0
    cooldown_s: float = 120.0
    _recent: deque = field(default_factory=deque, repr=False)   # (time, reason) of failed starts
    _open_until: float | None = field(default=None, repr=False)
    _trial: bool = field(default=False, repr=False)              # half-open: one launch in flight

    def record_failure(self, now: float, reason: str) -> None:
        self._recent.append((now, reason))
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        if self._trial or len(self._recent) >= self.failures:
            self._open_until = now + self.cooldown_s
            self._trial = False

    def record_success(self, now: float) -> None:
        self._recent.clear()
        self._open_until = None
        self._trial = False

    def state(self, now: float) -> str:
        """``closed`` (launching), ``open`` (refusing) or ``half-open`` (one trial allowed)."""
        if self._open_until is None:
            return "closed"
        return "open" if now < self._open_until or self._trial else "half-open"

    def allow(self, now: float) -> int | None:
        """How many launches may go out: None for no limit, 0 when open, 1 when half-open."""
        st = self.state(now)
        if st == "closed":
            return None
        if st == "half-open":
            return 1
        return 0

    def started_trial(self) -> None:
        if self._open_until is not None:
            self._trial = True

    def explain(self, now: float) -> str:
        st = self.state(now)
        if st == "closed":
            n = sum(1 for t, _ in self._recent if t >= now - self.window_s)
            return f"circuit closed ({n}/{self.failures} failed starts in {self.window_s:.0f}s)"
        last = self._recent[-1][1] if self._recent else "unknown"
        if st == "half-open":
            return f"circuit half-open: one trial launch allowed; last failure: {last}"
        if self._trial:
            return f"circuit open: waiting for the trial launch; last failure: {last}"
        return (f"circuit open for {self._open_until - now:.0f}s more after {len(self._recent)} failed starts "
                f"in {self.window_s:.0f}s; last failure: {last}")
