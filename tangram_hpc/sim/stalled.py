"""The error a simulation raises when it cannot go on (kept apart from the engine, which is compiled
where a native build exists: an exception class stays a plain Python class)."""
from __future__ import annotations

from ..errors import TangramError


class SimulationStalled(TangramError, RuntimeError):
    """Actions wait and nothing runs or will come: the setup cannot run the workload (an action
    that fits no worker, or sandboxes that every trajectory of a turn needs at once)."""

    def __init__(self, name: str, at: float, waiting: int, running: int, why: str | None = None):
        super().__init__(f"{name}: simulation stalled at t={at:.0f} with {waiting} waiting and {running} "
                         f"running actions ({why or 'an action that fits no worker?'})")
        self.name = name
        self.at = at
        self.waiting = waiting
        self.running = running
        self.why = why
        #: the same without the run's name and the guess, for a report that gives its own cause
        self.reason = f"stuck at t={at:.0f} s with {waiting} actions waiting and {running or 'none'} running"
        if why:
            self.reason += f": {why}"

    def __reduce__(self):       # rebuilt from its fields in another process (a bench job), not from its message
        return SimulationStalled, (self.name, self.at, self.waiting, self.running, self.why)
