"""A worker's executor threads: a fixed pool, one per core, each pinning itself to the CPU ids
granted for the action before running it (a subprocess forked from that thread inherits the mask),
and a few unpinned *light* threads for zero-core actions (I/O-bound calls, cheap functions not yet
known to be fast), so they never wait behind commands holding cores.  An outcome goes to the
worker's :class:`~tangram_hpc.worker_session.WorkerSession` (packed on the thread that made it)
and the I/O thread is woken.  Reward-model actions go to the
:class:`~tangram_hpc.managers.services.ServiceManager` instead (:meth:`Executors.submit_reward`)."""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable

from .actions import ActionSpec, Status
from .handlers import Handler
from .worker_session import WorkerSession

__all__ = ["Executors", "target"]

#: Threads for zero-core actions.
LIGHT_THREADS = 4


class Executors:
    """``handlers``: kind -> handler; ``boxes``: the worker's sandbox side (None: no sandbox kind)."""

    def __init__(self, cores: int, cpus: list[int], handlers: dict[str, Handler], session: WorkerSession,
                 boxes: Any, wake: Callable[[], None]):
        self.cpus = cpus
        self.handlers = handlers
        self.session = session
        self.boxes = boxes
        self._wake = wake
        self.fast: dict[str, float] = {}   # function target -> recent run time (s)
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._light: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._executor, args=(self._tasks,), name=f"exec-{i}", daemon=True)
                         for i in range(max(1, cores))]
        self._threads += [threading.Thread(target=self._executor, args=(self._light,), name=f"light-{i}", daemon=True)
                          for i in range(LIGHT_THREADS)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        for t in self._threads:
            (self._light if t.name.startswith("light-") else self._tasks).put(None)

    def put(self, task: tuple) -> None:
        """Queue an assigned action (a Start) for a thread: pinned when it has core slots (``task[2]``)."""
        (self._tasks if task[2] else self._light).put(task)

    def _executor(self, tasks: queue.SimpleQueue) -> None:
        pinned: tuple[int, ...] | None = None
        allowed = self.cpus
        while True:
            item = tasks.get()
            if item is None:
                return
            slots = item[2]
            cpus = sorted({allowed[s % len(allowed)] for s in slots}) or allowed
            key = tuple(cpus)
            if key != pinned and slots:
                try:
                    os.sched_setaffinity(0, cpus)
                    pinned = key
                except OSError:
                    pinned = None
            self.execute(item, cpus)

    def execute(self, item: tuple, cpus: list[int]) -> None:
        """Run one assigned action on the calling thread and hand its outcome to the I/O thread."""
        spec, attempt, slots, gen, grant = item
        started = time.time()
        t0 = time.perf_counter()
        handler = self.handlers.get(spec.kind)
        session = self.session
        if (session.killed or session.leave_killed) and session.stopped_before_start((spec.id, attempt, gen)):
            # killed while it waited for a thread
            self.complete(spec.id, attempt, (Status.CANCELLED, None, "killed before it started"),
                          started, started, slots, gen)
            return
        if grant is not None and spec.env is not None and self.boxes is not None and spec.kind == "sandbox":
            self._execute_in_env(spec, attempt, cpus, slots, gen, grant, started)
            return
        outcome: tuple[Any, ...]
        if handler is None:
            outcome = (Status.ERROR, None, f"this worker has no handler for kind {spec.kind!r}")
        else:
            try:
                outcome = handler(spec, cpus)
            except BaseException as e:  # a handler bug (or sys.exit) must not kill the thread or lose the outcome
                outcome = (Status.ERROR, None, f"handler crashed: {type(e).__name__}: {e}")
            if not (isinstance(outcome, (tuple, list)) and len(outcome) == 3 and isinstance(outcome[0], str)):
                outcome = (Status.ERROR, None, f"handler for kind {spec.kind!r} returned {type(outcome).__name__}, "
                           f"not (status, output, error)")
        fn = target(spec)
        if fn is not None:
            self._learn(fn, time.perf_counter() - t0)
        self.complete(spec.id, attempt, tuple(outcome), started, time.time(), slots, gen)

    def _execute_in_env(self, spec: ActionSpec, attempt: int, cpus: list[int], slots: list[int], gen: int,
                        grant: Any, started: float) -> None:
        """A sandbox action in an environment: its environment's host takes it from the grant to the
        journal (EnvHost.run)."""
        key = (spec.id, attempt, gen)
        session = self.session
        outcome, started, finished, env_state = self.boxes.run_in_env(
            spec, attempt, cpus, grant, started, cancelled=lambda: session.stopped_before_start(key),
            interrupted=lambda status: session.is_interrupted(key, status))
        self.complete(spec.id, attempt, outcome, started, finished, slots, gen, env_state)

    def complete(self, aid: str, attempt: int, outcome, started: float, finished: float,
                 slots: list[int], gen: int, env_state: str | None = None) -> None:
        """Hand an outcome to the I/O thread (packed on this thread: see WorkerSession.complete)."""
        self.session.complete(aid, attempt, outcome, started, finished, slots, gen, env_state)
        self._wake()

    def _learn(self, fn: str, seconds: float) -> None:
        old = self.fast.get(fn)
        # Slow runs demote at once; fast ones promote gradually.
        self.fast[fn] = seconds if old is None or seconds > old else 0.8 * old + 0.2 * seconds

    def submit_reward(self, services: Any, spec: ActionSpec, attempt: int, slots: list[int], gen: int) -> None:
        started = time.time()
        payload = spec.payload if isinstance(spec.payload, dict) else {}

        def done(_aid, status, output, error, _stats=None):
            self.complete(spec.id, attempt, (status, output, error), started, time.time(), slots, gen)

        services.submit(spec.id, spec.demand.service, payload.get("inputs"), done)


def target(spec: ActionSpec) -> str | None:
    """The function a ``function`` action calls (None: another kind, or not a string).  The payload
    comes from a client: a target that is not a string (a list is unhashable) is the handler's error
    to report, never a reason for the I/O loop to fail."""
    fn = spec.payload.get("fn") if spec.kind == "function" and isinstance(spec.payload, dict) else None
    return fn if isinstance(fn, str) else None
