"""The simulator's world played through the live coordinator's :class:`~tangram_hpc.coordinator.ledger.ActionLedger`.

The fast engine (:mod:`.engine`) calls the scheduling policy directly and keeps its own
model of environments.  :class:`LedgerSimulation` plays the same plan against the real
ledger instead: a simulated clock, simulated clients that SUBMIT each trajectory's actions
and CLOSE_ENV its environment when it ends, and simulated workers that REGISTER, answer
each ASSIGN with a DONE after the action's run time and each ENV save request with ENV
saved after the workload's ``env_move_s``.  Everything between (attempts, grants, held
actions, moves, the policy's calls) is the coordinator's own code, read through its outbox.

Its world is the engine's, so that the two can be compared on the same seeds
(``tests/test_sim_ledger.py``): run times by Amdahl's law at the granted cores, cut at the
class's timeout; moving an environment costs ``env_move_s`` between the hold-back and the
release of its actions, and a restore costs nothing (the ledger is told so up front, as
it would learn from the first restore).  GPU workers load services as the engine's do
(:meth:`~.machines.SimWorker.load`, warm at time 0, each load reported in a heartbeat), including those
the coordinator's PREFETCH asks for, so the prefetches the ledger sends can be compared with the
engine's (``prefetched``).  It is a check, not a benchmark: a fixed set of workers (no pool
policy), services without batch slowdown, and it is slower.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..protocol import ENV_SAVE, ENV_SAVED, GRANT_ADOPT, GRANT_HELD, GRANT_NEW, GRANT_RESTORE, PREFETCH
from ..actions import ActionSpec, EnvState, Status
from ..config import CoordinatorSettings
from ..coordinator.ledger import ActionLedger
from ..policy.base import SchedulingPolicy
from ..resources import CPU, GPU, WorkerInfo
from .machines import CPU_KINDS, SimWorker, cluster_shapes
from .result import action_specs_for
from .layout import services_by_demand
from .stalled import SimulationStalled
from .workload import Plan

__all__ = ["LedgerRun", "LedgerSimulation", "simulate_through_ledger"]

# event types, in the engine's order at one instant: finishes before submissions, moves last
_FINISH = 0
_SUBMIT = 1
_STEP = 3
_SAVED = 5

_CLIENT = b"sim-client"
#: what a worker's DONE says it found in its environment, by the grant its ASSIGN carried
_FOUND = {GRANT_NEW: EnvState.CREATED, GRANT_HELD: EnvState.KEPT, GRANT_RESTORE: EnvState.RESTORED,
          GRANT_ADOPT: EnvState.ADOPTED}


@dataclass
class LedgerRun:
    """Per action (indexed as the plan's): when it was submitted, assigned and finished, on how many
    cores; the steps' durations and the environments moved (as :class:`~.engine.SimResult` has them)."""
    submit: np.ndarray
    start: np.ndarray
    finish: np.ndarray
    cores: np.ndarray
    step_durations: list[float]
    makespan: float
    env_moves: int
    counters: Any = None
    statuses: dict[str, int] = field(default_factory=dict)
    prefetched: list[tuple[float, str, str]] = field(default_factory=list)  # (time, worker, service) sent

    @property
    def act(self) -> np.ndarray:
        return self.finish - self.submit


class _Trajectory:
    __slots__ = ("name", "step", "end", "next", "left", "think_next", "barrier_next")

    def __init__(self, name: str, step: int, end: int):
        self.name = name
        self.step = step
        self.end = end
        self.next = 0                   # the first action of its next group
        self.left = 0                   # actions of the current group not finished
        self.think_next = 0.0
        self.barrier_next = False


class LedgerSimulation:
    """One run of ``plan`` through an :class:`ActionLedger` driving ``policy``."""

    def __init__(self, plan: Plan, policy: SchedulingPolicy, *, config: CoordinatorSettings | None = None):
        w = self.w = plan.workload
        if any(svc.batch_slowdown for svc in w.services.values()):
            raise ValueError("the ledger driver simulates services without batch slowdown")
        self.plan = plan
        self.policy = policy
        self.ledger = ActionLedger(config if config is not None else CoordinatorSettings(), policy)
        self.ledger.envlife.restore_s = 0.0     # simulated restores are instant
        self.classes = action_specs_for(w)
        self.shape = cluster_shapes(w)[CPU]
        n = plan.n_actions
        self.submit = np.zeros(n)
        self.start = np.zeros(n)
        self.finish = np.zeros(n)
        self.cores = np.zeros(n, np.int32)
        self.trajs: list[_Trajectory] = []
        self.traj_of = np.zeros(n, np.int64)
        for s, (firsts, lens) in enumerate(zip(plan.step_traj_start, plan.step_traj_len)):
            for j, (first, ln) in enumerate(zip(firsts.tolist(), lens.tolist())):
                self.traj_of[first:first + ln] = len(self.trajs)
                self.trajs.append(_Trajectory(f"s{s}t{j}", s, first + ln))
        self.events: list[tuple] = []
        self.seq = itertools.count(1).__next__
        self.step_started = 0.0
        self.step_active = 0
        self.barrier: list[_Trajectory] = []
        self.step_durations: list[float] = []
        self.done = False
        self.statuses: dict[str, int] = {}
        self.gpu: dict[str, SimWorker] = {}
        self.prefetched: list[tuple[float, str, str]] = []

    def _push(self, t: float, typ: int, *args) -> None:
        heapq.heappush(self.events, (t, typ, self.seq(), *args))

    # -- the run -----------------------------------------------------------------------
    def run(self) -> LedgerRun:
        ledger = self.ledger
        for k in range(self.w.cluster.cpu_workers):
            wid = f"{CPU.value}{k + 1}"
            info = WorkerInfo(wid, self.shape.cores, self.shape.mem_mb, kinds=CPU_KINDS)
            ledger.add_worker(info, wid.encode(), 0.0)
        if self.w.services:
            self._add_gpu_workers()
        self._push(0.0, _STEP, 0)
        events = self.events
        now = 0.0
        while events and not self.done:
            e = heapq.heappop(events)
            now = e[0]
            typ = e[1]
            if typ == _FINISH:
                self._on_finish(e, now)
            elif typ == _SUBMIT:
                self._on_submit(e[3], e[4], now)
            elif typ == _STEP:
                self._on_step(e[3], now)
            else:
                ledger.env_report(e[3], [[ENV_SAVED, e[4], e[5], f"sim://{e[4]}@{e[5]}"]], now)
            if events and events[0][0] == now:
                continue                # all events of an instant are applied before the policy is asked
            ledger.dispatch(now)
            self._flush(now)
        if not self.done:
            raise SimulationStalled("ledger", now, self.policy.pending_count, self.policy.running_count)
        return LedgerRun(self.submit, self.start, self.finish, self.cores, self.step_durations, now,
                         ledger.counters.env_moves, ledger.counters, self.statuses, self.prefetched)

    def _add_gpu_workers(self) -> None:
        """The workload's GPU workers, up at time 0 with the most demanded services that fit loaded (as
        the engine starts them), which they report resident."""
        shape = cluster_shapes(self.w)[GPU]
        for k in range(self.w.cluster.gpu_workers):
            sw = SimWorker(f"{GPU.value}{k + 1}", shape, frozenset(self.w.services), 0.0, 0.0)
            self.gpu[sw.id] = sw
            self.ledger.add_worker(sw.status.info, sw.id.encode(), 0.0)
            for name in services_by_demand(self.w):
                if sw.gpu_used + self.w.services[name].gpu_mem_mb <= shape.gpu_mem_mb * shape.gpus:
                    sw.load(name, self.w.services, -self.w.services[name].load_s)   # ready at 0
            self._report(sw, 0.0)

    def _report(self, sw: SimWorker, now: float) -> None:
        """The worker's heartbeat: the services ready on it now."""
        ready = sorted(k for k, r in sw.services.items() if r.ready_at <= now)
        self.ledger.worker_report(sw.id, {"services": ready}, now)

    def _load(self, sw: SimWorker, name: str, now: float):
        rep, _over = sw.load(name, self.w.services, now)
        self._report(sw, now)
        return rep

    def _flush(self, now: float) -> None:
        """Carry out what the ledger wants sent: the workers start what they are assigned and save
        what they are asked to; results reach the client."""
        out = self.ledger.outbox
        for wid, items in out.assign.items():
            for wire, attempt, cores, *grant in items:
                self._start(wid, wire, attempt, cores, grant[0] if grant else None, now)
        out.assign.clear()
        move_s = self.w.cluster.env_move_s
        for wid, items in out.env.items():
            for op, env, gen in items:
                if op == ENV_SAVE:
                    self._push(now + move_s, _SAVED, wid, env, gen)
        out.env.clear()
        for res in itertools.chain.from_iterable(out.results.values()):
            self.statuses[res[1]] = self.statuses.get(res[1], 0) + 1
        out.results.clear()
        out.kill.clear()
        out.to_clients.clear()
        for ident, mtype, body in out.to_workers:
            if mtype == PREFETCH:
                sw = self.gpu[ident.decode()]
                for name in body:
                    self.prefetched.append((now, sw.id, name))
                    if name not in sw.services:
                        self._load(sw, name, now)
        out.to_workers.clear()

    def _start(self, wid: str, wire: dict, attempt: int, cores: int, grant: list | None, now: float) -> None:
        i = int(wire["i"])
        row = self.classes[int(self.plan.cls[i])]
        self.start[i] = now
        self.cores[i] = cores
        p = row.parallel_fraction
        one_core = float(self.plan.d1[i])
        run = one_core * ((1.0 - p) + p / (cores if cores > 1 else 1)) * 1.0   # as the engine computes it
        if run > row.timeout_s:
            run = row.timeout_s
        found = _FOUND[grant[1]] if grant is not None else None
        begin = now
        if row.service is not None:     # it waits for its service's load, as on the engine's workers
            sw = self.gpu[wid]
            rep = sw.services.get(row.service)
            if rep is None:
                rep = self._load(sw, row.service, now)
            begin = max(now, rep.ready_at)
            rep.running += 1
            rep.last_used = now
        self._push(begin + run, _FINISH, i, wid, attempt, now, found)

    # -- the clients -----------------------------------------------------------------------
    def _on_step(self, s: int, now: float) -> None:
        self.step_started = now
        firsts = self.plan.step_traj_start[s].tolist()
        self.step_active = len(firsts)
        self.barrier = []
        for i in firsts:
            self._push(now + float(self.plan.think[i]), _SUBMIT, i, self.trajs[int(self.traj_of[i])])

    def _on_submit(self, i: int, t: _Trajectory, now: float) -> None:
        """Submit a group: an action and the ones joined to it, in one SUBMIT."""
        plan = self.plan
        turn = int(plan.turn[i])
        k = i + 1
        while k < t.end and plan.joined[k]:
            k += 1
        if k < t.end:
            t.think_next = float(plan.think[k])
            t.barrier_next = bool(self.w.rollout.sync_turns and int(plan.turn[k]) != turn)
        t.next = k
        t.left = k - i
        self.submit[i:k] = now
        self.ledger.submit(_CLIENT, [self._spec(j, t).to_wire() for j in range(i, k)], now)

    def _spec(self, i: int, t: _Trajectory) -> ActionSpec:
        row = self.classes[int(self.plan.cls[i])]
        hint = float(self.plan.hint[i])
        return ActionSpec(row.kind, None, t.name if row.uses_env else None, row.demand, hint or None, None, 0,
                          t.name, t.step, row.label, None, str(i))

    def _on_finish(self, e: tuple, now: float) -> None:
        _, _, _, i, wid, attempt, started, found = e
        sw = self.gpu.get(wid)
        if sw is not None:
            rep = sw.services.get(self.classes[int(self.plan.cls[i])].service or "")
            if rep is not None:
                rep.running -= 1
                rep.last_used = now
        self.ledger.done(wid, [[str(i), attempt, Status.OK, None, None, started, now, found]], now)
        self.finish[i] = now
        t = self.trajs[int(self.traj_of[i])]
        t.left -= 1
        if t.left:
            return
        if t.next < t.end:
            if t.barrier_next:
                self.barrier.append(t)
                if len(self.barrier) >= self.step_active:
                    self._release_barrier(now)
            else:
                self._push(now + t.think_next, _SUBMIT, t.next, t)
            return
        self.ledger.close_env([t.name], now)
        self.step_active -= 1
        if self.barrier and len(self.barrier) >= self.step_active:
            self._release_barrier(now)
        if self.step_active == 0:
            self.step_durations.append(now - self.step_started)
            if len(self.step_durations) == self.w.rollout.steps:
                self.done = True
            else:
                self._push(now + self.w.rollout.train_s, _STEP, len(self.step_durations))

    def _release_barrier(self, now: float) -> None:
        waiting, self.barrier = self.barrier, []
        for t in waiting:
            self._push(now + t.think_next, _SUBMIT, t.next, t)


def simulate_through_ledger(plan: Plan, policy: SchedulingPolicy, **kw) -> LedgerRun:
    """Run ``plan`` with ``policy`` behind the live coordinator's ledger (see :class:`LedgerSimulation`)."""
    return LedgerSimulation(plan, policy, **kw).run()
