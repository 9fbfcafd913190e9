"""How often a coordinator and its workers heartbeat each other, chosen from the number of workers.

Each heartbeat is a frame each way, and what a frame costs (libzmq's I/O thread, a wake-up,
a decode and an answer) does not shrink with its size: at 2,000 workers and one heartbeat a
second the heartbeats alone were 7-8 % of the coordinator's core.  So the interval grows with
the number of workers past ``heartbeat_s x heartbeats_per_s`` of them, keeping the heartbeats
the workers send, all together, at ``heartbeats_per_s`` a second.  The coordinator's heartbeat
to a worker goes every other interval (``to_worker_s``): it only tells the worker that the
coordinator is there, and a worker waits 5 intervals (``coordinator_timeout_s`` by default)
before it registers again.  Workers learn the interval from WELCOME and from every heartbeat of
the coordinator; both sides wait as many times longer before they declare the other lost, so a
silence of the same number of missed heartbeats means the same thing at any size.

Socket-free and clock-free: the loop hands in the number of workers and the time.
"""
from __future__ import annotations

import math


class HeartbeatPace:
    """The interval the workers are told (``interval``) and the silence after which one is lost.

    ``heartbeat_s``: the interval while there are few workers; ``worker_timeout_s``: the silence
    that loses a worker at that interval; ``per_s``: the bound on the workers' heartbeats per
    second together (0: none).
    """

    #: the interval moves in steps of a quarter of ``heartbeat_s``, so a worker joining or leaving
    #: changes what the others are told only now and then
    STEPS = 4

    def __init__(self, heartbeat_s: float, worker_timeout_s: float, per_s: float):
        self.base = heartbeat_s
        self.timeout = worker_timeout_s
        self.per_s = per_s
        self.interval = heartbeat_s
        # After the interval shrank, workers still heartbeat at the old one until they hear the new
        # one: the old silence limit holds until then (the old interval and when it stops counting).
        self._wider = heartbeat_s
        self._wider_until = 0.0

    def update(self, workers: int, now: float) -> bool:
        """Choose the interval for ``workers`` workers; True when it changed."""
        want = self.base
        if self.per_s > 0 and workers > self.base * self.per_s:
            ratio = workers / (self.base * self.per_s)
            want = round(self.base * math.ceil(ratio * self.STEPS) / self.STEPS, 6)
        if want == self.interval:
            return False
        if want < self.interval:
            # a worker hears the new interval with the coordinator's next heartbeat, at most one old
            # interval away, and sends its next one at most one old interval after its last
            self._wider = self.interval
            self._wider_until = now + self.lost_after(now) + 2 * self.interval
        self.interval = want
        return True

    @property
    def to_worker_s(self) -> float:
        """Seconds between the coordinator's heartbeats to one worker."""
        return 2 * self.interval

    def lost_after(self, now: float) -> float:
        """Seconds of silence after which a worker is lost: ``worker_timeout_s`` scaled as the interval."""
        interval = self.interval
        if now < self._wider_until and self._wider > interval:
            interval = self._wider
        return self.timeout * interval / self.base
