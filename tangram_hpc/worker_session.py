"""A worker's protocol state, with no socket, thread or clock of its own.

:class:`WorkerSession` answers what the coordinator's messages mean for this worker: which
attempts to start (and on which core slots), which to stop, how an outcome travels back (DONE
under the current registration, OUTCOMES for an earlier one, nothing for an attempt the leaving
cut short), and what a heartbeat reports.  The :class:`~tangram_hpc.worker.Worker` around it does
the I/O: the socket, the executor threads, the sandboxes and services, the timers.  Tests drive a
session directly, message by message, in one thread.

An attempt is known by its key ``(action id, attempt, registration generation)``; its core slots
stay taken until its outcome is taken (:meth:`WorkerSession.take`), even after a KILL (a Python
function cannot be interrupted).  An assignment of an action whose earlier attempt still runs
here follows that attempt (it is answered by its outcome) instead of running a second copy.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable, NamedTuple

import msgpack

from . import protocol as P
from .actions import ActionSpec, EnvState, Status, ValidationError

log = logging.getLogger("tangram.worker")

Key = tuple  # (action id, attempt, registration generation)


class Start(NamedTuple):
    """An attempt to start: what the worker hands to an executor thread, a service or runs itself."""
    spec: ActionSpec
    attempt: int
    slots: list[int]
    gen: int
    grant: P.Grant | None


_new_tuple = tuple.__new__
_is_small = P.is_small


class WorkerSession:
    """``cores``: core slots to grant; ``item_limit``: the largest outcome sent, in bytes (asked for each
    outcome: the coordinator's WELCOME may lower it)."""

    def __init__(self, cores: int, item_limit: Callable[[], int]):
        self.free_slots = list(range(cores))
        self.running: dict[Key, list[int]] = {}      # attempt -> core slots, until its outcome is taken
        self.killed: dict[Key, float] = {}           # running attempts the coordinator killed -> since when
        self.by_aid: dict[str, Key] = {}             # action id -> its attempt running here
        self.followers: dict[Key, list[Key]] = {}    # attempt -> later attempts it answers
        self.generation = 0                          # bumps on each registration
        # outcomes, packed, appended by whichever thread ended the attempt (deque appends are atomic)
        self.done: deque = deque()
        self.older: list = []                        # outcomes of earlier registrations to send (as in take)
        self.interrupted: list[list] = []            # [action id, attempt] the leaving cut short
        self.leaving: str | None = None
        self.leave_by_signal = False
        self.leave_killed: set[Key] = set()
        self._item_limit = item_limit

    # -- messages from the coordinator ------------------------------------------------
    def register(self) -> int:
        """A new registration: outcomes of attempts started before it go back as OUTCOMES."""
        self.generation += 1
        return self.generation

    def assign(self, items: list, now: float) -> list[Start]:
        """An ASSIGN body received at ``now``: the attempts to start, their core slots taken.  An item that cannot be
        read ends at once with an ``error`` outcome (so the coordinator frees its cores); one that
        follows an attempt still running here, or comes while leaving, starts nothing."""
        gen = self.generation
        starts = []
        for item in items:
            try:
                spec, attempt, ncores, grant = P.check_assign(item)
            except ValidationError as e:
                ref = P.assigned_attempt(item)
                if ref is not None:
                    why = f"the worker could not read the assignment: {e}"
                    self.complete(ref[0], ref[1], (Status.ERROR, None, why), now, now, [], gen)
                continue
            if self.leaving is not None:   # never started: the coordinator retries it once we have left
                self.interrupted.append([spec.id, attempt])
                continue
            slots = self._take_slots(ncores) if ncores else []   # zero-core (light) actions bind no slot
            key = (spec.id, attempt, gen)
            self.running[key] = slots
            earlier = self.by_aid.get(spec.id)
            if earlier is not None and earlier in self.running:
                # An earlier attempt (of an earlier registration) still runs here: it answers this one.
                self.followers.setdefault(earlier, []).append(key)
                continue
            self.by_aid[spec.id] = key
            starts.append(_new_tuple(Start, (spec, attempt, slots, gen, grant)))   # Start(...), a little faster
        return starts

    def _take_slots(self, n: int) -> list[int]:
        free = self.free_slots
        if len(free) >= n:
            slots = free[-n:]
            del free[len(free) - n:]
        else:                # more granted than free (only after a re-registration): share cores
            slots = free[:] + list(range(n - len(free)))
            free.clear()
        return slots

    def kill(self, items: list, now: float) -> list[Key]:
        """A KILL body: the running attempts to stop (marked killed since ``now``).  An attempt of an
        earlier registration, or one it follows, is found by action id and attempt."""
        keys = []
        for item in items:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], int)):
                continue
            key = (item[0], item[1], self.generation)
            if key not in self.running:
                # an attempt of an earlier registration (the coordinator finalised it while this
                # worker was away), or its follower, or one already ended, whose DONE is on the way
                lead = self.by_aid.get(item[0])
                key = lead if lead is not None and lead[1] == item[1] else next(
                    (k for k in self.followers.get(lead, ()) if k[1] == item[1]), None)
                if key is None or key not in self.running:
                    continue
            self.killed.setdefault(key, now)
            keys.append(key)
        return keys

    def withdrawn(self, key: Key, now: float) -> None:
        """The request of attempt ``key`` was withdrawn before it ran (a reward request still queued):
        no outcome of it will come, so the attempt that submitted it ends here, its followers with it."""
        lead = self.by_aid.get(key[0], key)
        if lead in self.running:
            self.complete(lead[0], lead[1], (Status.CANCELLED, None, "killed while it waited for its service"),
                          now, now, self.running[lead], lead[2])

    def stopped_before_start(self, key: Key) -> bool:
        """Whether attempt ``key`` was killed (or interrupted by the leaving) before it started."""
        return key in self.killed or key in self.leave_killed

    # -- outcomes -------------------------------------------------------------------------
    def complete(self, aid: str, attempt: int, outcome: tuple, started: float, finished: float,
                 slots: list[int], gen: int, env_state: str | None = None) -> None:
        """An attempt ended (any thread): unless it is small (``protocol.is_small``: it is packed with
        its batch), its outcome is packed here, within the size limit, so that the thread that sends
        it never handles a user-sized result."""
        status, output, error = outcome
        fields = [aid, attempt, status, output, error, started, finished, env_state]
        item = fields if _is_small(fields) else P.pack_outcome(fields, self._item_limit())
        self.done.append((aid, attempt, item, slots, gen))

    def take(self) -> list:
        """The outcomes to send as DONE now (small ones as lists, others packed: see
        :func:`protocol.encode_outcomes`), their slots freed and their followers answered; those of
        earlier registrations go to :attr:`older`, those the leaving cut short to :attr:`interrupted`."""
        out: list = []
        done = self.done
        free = self.free_slots
        running = self.running
        killed = self.killed
        by_aid = self.by_aid
        gen = self.generation
        while done:
            aid, attempt, item, slots, g = done.popleft()
            key = (aid, attempt, g)
            if running.pop(key, None) is not None:
                free.extend(slots)
            if killed:
                killed.pop(key, None)
            if by_aid.get(aid) == key:
                del by_aid[aid]
            if g == gen and self.leaving is None:
                out.append(item)           # the common case of _route
            else:
                self._route(out, key, item)
            if self.followers:
                followers = self.followers.pop(key, ())
                if followers:
                    o = _outcome(item)
                    for fkey in followers:
                        fslots = running.pop(fkey, None)
                        if fslots is not None:
                            free.extend(fslots)
                        self.killed.pop(fkey, None)
                        answer = o._replace(attempt=fkey[1], env_state=EnvState.REPLAYED if o.env_state else None)
                        self._route(out, fkey, list(answer) if type(item) is list else msgpack.packb(answer))
        return out

    def _route(self, out: list, key: Key, item: list | bytes) -> None:
        if self.leaving is not None:
            o = _outcome(item)
            if self.is_interrupted(key, o.status):
                log.info("attempt %d of %s interrupted by the leaving (%s: %s)", key[1], key[0], o.status, o.error)
                if key[2] == self.generation:
                    self.interrupted.append([key[0], key[1]])
                return
        if key[2] == self.generation:
            out.append(item)
        else:
            self.older.append(item)

    def is_interrupted(self, key: Key, status: str) -> bool:
        """Whether an attempt that ended while this worker leaves was cut short by the leaving: killed
        by it, or (Slurm signals every process of the job) ended badly after a signal came."""
        if self.leaving is None or status == Status.OK:
            return False
        return key in self.leave_killed or self.leave_by_signal

    # -- leaving ----------------------------------------------------------------------------
    def leave(self, reason: str, by_signal: bool) -> None:
        self.leave_by_signal = by_signal
        self.leaving = reason

    def interrupt_running(self) -> set[Key]:
        """The leaving's grace is over: what still runs is cut short (the coordinator retries it)."""
        self.leave_killed = set(self.running)
        return self.leave_killed

    def interrupted_attempts(self) -> list[list]:
        """The attempts of this registration the leaving cut short or never started, for the last
        heartbeat."""
        gen = self.generation
        return self.interrupted + [[aid, attempt] for aid, attempt, g in self.running if g == gen]

    # -- reports ----------------------------------------------------------------------------
    def heartbeat(self) -> dict[str, Any]:
        gen = self.generation
        return {
            "running": len(self.running),
            "busy_cores": sum(len(slots) for slots in self.running.values()),
            # Killed by the coordinator but still running here (a function cannot be interrupted):
            # their cores stay taken until the DONE for that attempt.
            "killed_running": [[aid, attempt] for aid, attempt, g in self.killed if g == gen],
        }


def _outcome(item: list | bytes) -> P.Outcome:
    return P.Outcome(*(item if type(item) is list else msgpack.unpackb(item, raw=False)))
