"""The one throttle on worker launches, whatever the backend.

A pool policy only says which workers it *wants*; :class:`LaunchThrottle`
says how many may be launched now.  The pool driver asks it before every
launch and tells it how each launch ended, for every backend alike, so a
runaway policy, a broken worker image or a batch system that refuses jobs is
held the same way for Slurm jobs and local processes.  It is pure: the clock
is passed in.

* **Rate**: a token bucket, at most ``burst`` launches at once, refilled at
  ``rate`` a minute.
* **Back-off**: after a failed start the next launch waits ``backoff_s``,
  doubled after each further failure in a row, up to ``max_backoff_s``.
* **Breaker**: ``breaker`` failed starts within ``breaker_window_s`` stop all
  launches for ``breaker_cooldown_s``; then one trial launch goes out, and
  the first good start (a worker that joined and stayed ``healthy_after_s``)
  clears everything, while a failed trial stops launches again.
* **Pause / resume**: an operator can stop launches (``tangram-hpc pool
  pause``) and resume them at once, which also forgets the failures that
  tripped the breaker (``tangram-hpc pool resume``, like ``hq alloc resume``).

:meth:`LaunchThrottle.status` says which of these holds launches back, why,
and when launching goes on by itself.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import TYPE_CHECKING

from ..errors import LaunchRefused

if TYPE_CHECKING:     # handed in: the pool driver, which uses a throttle, stays clear of config's imports
    from ..config import LaunchSettings

__all__ = ["LaunchThrottle", "ThrottleState", "ThrottleStatus", "LaunchRefused", "local_time"]


class ThrottleState(str, Enum):
    """What holds launches back (a ``str`` enum: ``status`` shows the value)."""

    OK = "ok"                        # launching as the policy asks
    RATE_LIMITED = "rate-limited"    # the last launch wanted more than the rate allows
    BACKING_OFF = "backing-off"      # waiting after failed starts in a row
    STOPPED = "stopped"              # the breaker tripped: no launch until the cool-down ends
    TRIAL = "trial"                  # after the cool-down: one trial launch
    PAUSED = "paused"                # an operator paused launches

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]


@dataclass(slots=True, frozen=True)
class ThrottleStatus:
    state: ThrottleState
    reason: str = ""
    retry_at: float | None = None    # when launching goes on by itself; None: now, or only on resume


def local_time(t: float) -> str:
    """A wall-clock time as people read it (local, ISO 8601 to the second)."""
    return datetime.fromtimestamp(t).isoformat(timespec="seconds")


class LaunchThrottle:
    def __init__(self, settings: LaunchSettings):
        self.settings = s = settings
        self._tokens = float(s.burst)
        self._refilled: float | None = None
        self._short_at: float | None = None           # last time fewer launches were allowed than wanted
        self._failures: deque[tuple[float, str]] = deque()   # failed starts within the breaker window
        self._streak = 0                                # failed starts since the last good one
        self._last_failure: tuple[float, str] | None = None
        self._stopped_until: float | None = None
        self._stop_reason = ""
        self._trial_out = False                         # the trial launch is under way
        self._paused: str | None = None

    # -- what the driver asks ------------------------------------------------------
    def allowed(self, now: float) -> int:
        """How many workers may be launched now."""
        if self._paused is not None:
            return 0
        if self._stopped_until is not None:
            if now < self._stopped_until or self._trial_out:
                return 0
            return min(1, self._bucket(now))
        if self._backoff_until() > now:
            return 0
        return self._bucket(now)

    def launched(self, now: float, n: int, wanted: int | None = None) -> None:
        """``n`` workers were launched now (``wanted``: how many the policy asked for)."""
        self._bucket(now)
        self._tokens = max(0.0, self._tokens - n)
        if wanted is not None and n < wanted:
            self._short_at = now
        if n and self._stopped_until is not None and now >= self._stopped_until:
            self._trial_out = True

    def failed(self, now: float, why: str) -> None:
        """A launch failed, or a launched worker died before it counted as a good start."""
        s = self.settings
        self._streak += 1
        self._last_failure = (now, why)
        self._failures.append((now, why))
        while self._failures and self._failures[0][0] < now - s.breaker_window_s:
            self._failures.popleft()
        if self._trial_out or len(self._failures) >= s.breaker:
            was_trial = self._trial_out
            self._stopped_until = now + s.breaker_cooldown_s
            self._trial_out = False
            self._stop_reason = (f"the trial launch failed ({why})" if was_trial else
                                 f"{len(self._failures)} worker starts failed within {s.breaker_window_s:g} s "
                                 f"(last: {why})")

    def succeeded(self, now: float) -> None:
        """A launched worker joined and stayed: the backend and the worker image work."""
        self._failures.clear()
        self._streak = 0
        self._last_failure = None
        self._stopped_until = None
        self._trial_out = False

    def pause(self, now: float, why: str = "paused by an operator") -> None:
        self._paused = why

    def resume(self, now: float) -> None:
        """Launch again at once: unpause, and forget the failures that stopped or slowed launches."""
        self._paused = None
        self.succeeded(now)

    # -- what status shows -----------------------------------------------------------
    def status(self, now: float) -> ThrottleStatus:
        s = self.settings
        if self._paused is not None:
            return ThrottleStatus(ThrottleState.PAUSED, f"{self._paused}; 'tangram-hpc pool resume' launches again")
        if self._stopped_until is not None:
            if now < self._stopped_until:
                return ThrottleStatus(ThrottleState.STOPPED, self._stop_reason,
                                      self._stopped_until)
            if self._trial_out:
                return ThrottleStatus(ThrottleState.TRIAL, f"one trial launch under way after: {self._stop_reason}")
            return ThrottleStatus(ThrottleState.TRIAL, f"one trial launch allowed after: {self._stop_reason}", now)
        until = self._backoff_until()
        if until > now and self._last_failure is not None:
            return ThrottleStatus(ThrottleState.BACKING_OFF,
                                  f"waiting after {self._streak} failed start(s) in a row (last: "
                                  f"{self._last_failure[1]})", until)
        if self._short_at is not None and self._bucket(now) < 1:
            return ThrottleStatus(ThrottleState.RATE_LIMITED,
                                  f"at most {s.rate:g} launches a minute, {s.burst} at once",
                                  now + (1 - self._tokens) * 60.0 / s.rate)
        recent = sum(1 for t, _ in self._failures if t >= now - s.breaker_window_s)
        return ThrottleStatus(ThrottleState.OK, f"{recent}/{s.breaker} failed starts within "
                                                f"{s.breaker_window_s:g} s" if recent else "")

    # -- internals -------------------------------------------------------------------
    def _bucket(self, now: float) -> int:
        s = self.settings
        if self._refilled is not None and now > self._refilled:
            self._tokens = min(float(s.burst), self._tokens + (now - self._refilled) * s.rate / 60.0)
        self._refilled = now if self._refilled is None else max(self._refilled, now)
        return math.floor(self._tokens + 1e-9)

    def _backoff_until(self) -> float:
        if not self._streak or self._last_failure is None:
            return -math.inf
        s = self.settings
        return self._last_failure[0] + min(s.max_backoff_s, s.backoff_s * 2 ** (self._streak - 1))
