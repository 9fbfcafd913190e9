"""Discrete-event simulator driving the real policies.

The simulator plays a :class:`~tangram_hpc.sim.workload.Plan` against any
:class:`~tangram_hpc.policy.base.SchedulingPolicy` (and optionally a
:class:`~tangram_hpc.policy.base.PoolPolicy`), calling them exactly as the
live coordinator does -- ``submit``/``finished``/``schedule`` with the
simulated clock as ``now`` -- so the numbers are about the product's code.

The world it simulates:

* RL steps run one after another; a step starts all its trajectories at once
  and ends when the last one finishes (then ``train_s`` of training).
* A trajectory alternates think time (policy generation, not an external
  resource) and one action plus its follow-ups, then runs its final (reward)
  actions, one after another or all at once.  With ``sync_turns`` a turn
  starts only when every trajectory of the step finished the turn before.
* An action's run time is its one-core duration scaled by Amdahl's law at the
  cores it was granted, cut at its timeout.  A reward call on a worker where
  its service is not resident first waits for the load; it takes longer in a
  fuller batch (``batch_slowdown``).  Loading evicts by the rule the live
  service manager applies (:mod:`tangram_hpc.policy.residency`).
* GPU workers load the run's services that fit when they start, as live
  workers preload their configured services; workers up at time 0 have them
  loaded before the run (a reward server started before training).
* Workers appear ``startup_s`` after the pool policy launches them.  Resources
  count as allocated from launch to reclaim (or the end of the run).

Events live in a calendar (:class:`EventCalendar`): finishing events sort before
submissions at the same instant, and all events of an instant are applied before
``schedule``.
Each event type has its handler (``_on_*``); after an instant's events the loop
asks the policy's ``schedule``, and :meth:`Simulation._dispatch` applies its starts.
"""
from __future__ import annotations

import gc
from typing import Any, Callable, Final

import numpy as np

from ..actions import ActionSpec
from ..policy.base import Assignment, Launch, PoolPolicy, PoolView, Reclaim, SchedulingPolicy, Withdraw, WorkerStatus
from ..resources import CPU, GPU, ResourceClass
from .calendar import EventCalendar
from .layout import services_by_demand
from .machines import CPU_KINDS, GPU_KINDS, Launches, Replica, SimWorker, cluster_shapes, service_infos
from .result import ActionClassRow, SimResult, action_specs_for, allocated_seconds, lower_bounds
from .stalled import SimulationStalled
from .workload import Plan, Service

__all__ = ["SimResult", "Simulation", "SimulationStalled", "simulate", "cluster_shapes", "action_specs_for",
           "service_infos", "CPU_KINDS", "GPU_KINDS"]

# event types (Final: constants in the native build, not module look-ups)
_FINISH: Final = 0
_SUBMIT: Final = 1
_UP: Final = 2
_STEP: Final = 3
_TICK: Final = 4
_MOVED: Final = 5
#: Simulated seconds with actions waiting, none running, no worker starting and nothing started,
#: after which a run with a pool counts as stalled (its ticks would go on for ever).
IDLE_STALL_S: Final = 6 * 3600.0

# An action's row: eight floats, one cache line.  The simulator comes back to an action after
# its trajectory's think time or its run, when nothing of it is cached; with an array per fact
# each visit cost a miss per array read.
_ROW: Final = 8
_R_SUBMIT: Final = 0
_R_START: Final = 1
_R_FINISH: Final = 2
_R_D1: Final = 3            # one-core duration
_R_THINK: Final = 4         # think time before it (the first of a group)
_R_HINT: Final = 5          # the duration hint its client passes (0: none)
_R_CORES: Final = 6         # cores granted
_R_META: Final = 7          # class | joined << 12 | turn << 13 | trajectory << 29 (an integer, exact in a float)
_CLS_BITS: Final = 12
_CLS_MASK: Final = (1 << _CLS_BITS) - 1
_JOINED_SHIFT: Final = _CLS_BITS
_TURN_SHIFT: Final = _CLS_BITS + 1
_TURN_BITS: Final = 16
_TURN_MASK: Final = (1 << _TURN_BITS) - 1
_TRAJ_SHIFT: Final = 29
_TRAJ_LIMIT: Final = 1 << 24


def _action_rows(plan: Plan, traj_of: np.ndarray) -> np.ndarray:
    """The plan's per-action facts as rows of :data:`_ROW` floats, each row on one 64-byte line."""
    n = plan.n_actions
    turn, joined = plan.turn, plan.joined
    assert turn is not None and joined is not None      # (the plan fills them in)
    if n and (int(plan.cls.max()) >= 1 << _CLS_BITS or int(turn.max()) >= 1 << _TURN_BITS):
        raise ValueError(f"the simulator takes at most {1 << _CLS_BITS} action classes and {1 << _TURN_BITS} turns")
    if len(traj_of) and int(traj_of.max()) >= _TRAJ_LIMIT:
        raise ValueError(f"the simulator takes at most {_TRAJ_LIMIT:,} trajectories per run (steps x trajectories)")
    buf = np.zeros(n * _ROW + _ROW)
    off = (-buf.ctypes.data % 64) // 8
    rows = buf[off:off + n * _ROW].reshape(n, _ROW)
    rows[:, _R_D1] = plan.d1
    rows[:, _R_THINK] = plan.think
    rows[:, _R_HINT] = plan.hint
    rows[:, _R_META] = (plan.cls.astype(np.int64) | joined.astype(np.int64) << _JOINED_SHIFT
                        | turn.astype(np.int64) << _TURN_SHIFT | traj_of << _TRAJ_SHIFT)
    return rows


class _Trajectory:
    """One trajectory's progress: the group of actions it has out, and what comes after it.

    One record per trajectory rather than an array per fact: the simulator
    comes back to a trajectory after its agent thought, when nothing of it is
    in the CPU's caches any more, and each separate array cost a miss."""

    __slots__ = ("name", "step", "end", "group", "next", "left", "worker", "held", "think_next", "barrier_next")

    def __init__(self, name: str, step: int, end: int):
        self.name = name
        self.step = step
        self.end = end                  # one past its last action
        self.group = 0                  # the first action of its current group
        self.next = 0                   # the first action of its next group
        self.left = 0                   # actions of the current group still running
        self.worker: SimWorker | None = None    # the worker its environment lives on
        self.held: list[int] | None = None      # its actions held back while its environment moves
        self.think_next = 0.0           # the think time before its next group, and whether that group
        self.barrier_next = False       # starts a turn (read when this one is submitted, from warm memory)

    def take_back(self, rows: Any, policy: SchedulingPolicy) -> bool:
        """Its environment is to move: take its waiting actions back from the policy (held until it
        has moved) and release it from its worker.  False, and nothing done, when it is not live on
        a worker or one of its actions runs there (the policy does not ask for that)."""
        ew = self.worker
        if ew is None or self.held is not None:
            return False
        first, last = self.group, self.next
        if any(rows[i * _ROW + _R_START] > 0.0 and rows[i * _ROW + _R_FINISH] == 0.0 for i in range(first, last)):
            return False
        self.held = [i for i in range(first, last) if policy.cancel(str(i))]
        self.worker = None
        ew.status.envs -= 1
        return True


def _table_and_trajectories(plan: Plan) -> tuple[np.ndarray, list[_Trajectory]]:
    """The plan's action rows (:func:`_action_rows`) and one record per trajectory, in plan order."""
    starts = np.concatenate(plan.step_traj_start) if plan.step_traj_start else np.zeros(0, np.int64)
    lens = np.concatenate(plan.step_traj_len) if plan.step_traj_len else np.zeros(0, np.int64)
    table = _action_rows(plan, np.repeat(np.arange(len(starts), dtype=np.int64), lens))
    ends = (starts + lens).tolist()
    trajs: list[_Trajectory] = []
    for s, st in enumerate(plan.step_traj_start):
        base = len(trajs)
        trajs.extend(_Trajectory(f"s{s}t{j}", s, ends[base + j]) for j in range(len(st)))
    return table, trajs


def _stalled(name: str, policy: SchedulingPolicy, now: float, last_start: float,
             starting: list) -> SimulationStalled | None:
    """Why a run with a pool would tick for ever (an action nothing can place, or nothing started
    for :data:`IDLE_STALL_S` with actions waiting and no worker starting), or None."""
    stuck = policy.unplaceable(now)
    if stuck:
        aid, why = stuck[0]
        return SimulationStalled(name, now, policy.pending_count, policy.running_count,
                                 f"action {aid} cannot be placed: {why}")
    if now - last_start > IDLE_STALL_S and policy.pending_count and not policy.running_count and not starting:
        return SimulationStalled(name, now, policy.pending_count, 0,
                                 f"nothing started for {now - last_start:.0f} s with actions waiting "
                                 f"(each waits for something another holds?)")
    return None


class Simulation:
    """One run of a plan under a policy; :meth:`run` returns the :class:`SimResult`.

    ``workers``: how many CPU/GPU workers are up at time 0 (default: the
    workload's cluster); with a pool policy they are its warm start, and the
    policy launches and reclaims from there.  ``start_failures``: the first
    that many launches fail (to exercise a pool policy's circuit breaker).
    """

    def __init__(self, plan: Plan, policy: SchedulingPolicy, *, pool: PoolPolicy | None = None,
                 name: str = "", workers: dict[str, int] | None = None, pool_interval_s: float = 5.0,
                 trace_dt: float | None = None, progress: Callable[[str], None] | None = None,
                 start_failures: int = 0, clock: Callable[[], float] | None = None):
        self.plan = plan
        # the wall clock, handed in (the engine imports none): what the run took, and when to
        # report progress; without one, no wall time and a report every million events
        self.clock = clock
        self.policy = policy
        self.pool = pool
        self.name = name
        self.progress = progress
        self.pool_interval_s = pool_interval_s
        w = self.w = plan.workload
        self.shapes = cluster_shapes(w)
        self.warm = dict(workers) if workers is not None else {CPU: w.cluster.cpu_workers,
                                                              GPU: w.cluster.gpu_workers}
        self.classes = action_specs_for(w)
        self.svc_defs: dict[str, Service] = w.services
        self.svc_names = frozenset(w.services)
        # per action (a 100,000-trajectory plan has millions of actions): its row, read and
        # written through a flat memoryview (typed Any: its items are floats); per trajectory, its record
        self.table, self.trajs = _table_and_trajectories(plan)
        self.rows: Any = self.table.reshape(-1).data
        self.traj_index: dict[str, _Trajectory] | None = None    # environment (trajectory) name -> it, on first move
        self.moves = 0
        self.attempt: dict[int, int] = {}       # actions resubmitted after their worker was reclaimed
        # workers
        self.workers: dict[str, SimWorker] = {}
        self.statuses: list[WorkerStatus] = []
        self.retired: list[SimWorker] = []
        self.counters = {CPU: 0, GPU: 0}
        self.launches = Launches(start_failures)
        self.last_start = 0.0          # when the policy last started something (see _on_pool_tick)
        self.last_tick = 0.0
        # accounting
        self.busy = {CPU: 0, GPU: 0}
        self.alloc_units = {CPU: 0, GPU: 0}
        self.alloc_max = {CPU: 0, GPU: 0}
        self.cpu_busy_cs = 0.0
        self.gpu_busy_ss = 0.0
        self.mem_reserved = 0.0
        self.mem_used = 0.0
        self.trace: list[tuple[float, int, int, int, int]] = []
        self.trace_dt = trace_dt or max(1.0, w.rollout.think_s.median)
        self.next_trace = 0.0
        self.notes: list[str] = []
        # steps
        self.step = 0
        self.step_started = 0.0
        self.step_active = 0
        self.step_trajs = (0, 0)                # the current step's trajectories: [first, last)
        self.barrier: list[_Trajectory] = []    # trajectories waiting for the others to finish the turn
        self.step_durations: list[float] = []
        self.sync_turns = w.rollout.sync_turns
        self.done = False
        self.now = 0.0
        # Buckets of about ten events at any scale: events come at a rate that grows with the
        # trajectories in flight, and a pop costs log2 of its bucket's size (comparisons of tuples
        # scattered over memory: 5 % of the run at 100,000 trajectories with quarter-second buckets).
        self.events_q = EventCalendar(0.25 * min(1.0, 1000 / max(1, w.rollout.trajectories_per_step)))
        self.events = 0
        # optional policy hooks
        self._close_env = getattr(policy, "close_env", None)
        self._traj_done = getattr(policy, "trajectory_done", None)
        self._preloaded = getattr(policy, "preloaded_services", None)
        self._planned = getattr(policy, "planned_services", None)
        self._offered = getattr(policy, "offered_load", None)
        self._env_moves = getattr(policy, "env_moves", None)
        # the policy's prefetch, as the coordinator sends it (None: a policy that does not prefetch)
        self._prefetches = policy.prefetches if policy.prefetch_counts() is not None else None
        self.prefetched: list[tuple[float, str, str]] = []

    # -- events ------------------------------------------------------------------
    def _push(self, t: float, typ: int, arg) -> None:
        """Push an event of a rare type: its handler gets ``arg`` as ``e[3]``."""
        q = self.events_q
        q.push((t, typ, q.seq(), arg))

    def run(self) -> SimResult:
        # Millions of short-lived objects and no cycles worth collecting on the way: the cyclic
        # collector's passes over a live set that grows with the plan only cost time (10-20 %).
        gc_on = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if gc_on:
                gc.enable()

    def _run(self) -> SimResult:
        clock = self.clock or _no_clock
        timed = self.clock is not None
        t_wall = clock()
        for res in (CPU, GPU):
            for _ in range(self.warm.get(res, 0)):
                if res in self.shapes:
                    self._add_worker(res, 0.0, 0.0, warm=True)
        self._push(0.0, _STEP, 0)
        if self.pool is not None:
            self._push(0.0, _TICK, 0)
        handlers = (self._on_finish, self._on_submit, self._on_worker_up, self._on_step, self._on_pool_tick,
                    self._on_moved)
        q = self.events_q
        cur = q.cur
        policy = self.policy
        env_moves = self._env_moves
        progress = self.progress
        next_trace = self.next_trace
        next_report = clock() + 2.0
        events = 0
        now = 0.0
        e: tuple
        typ: int
        while (cur or q.later) and not self.done:
            # the calendar's current bucket, popped in place (the common case), else the calendar refills it
            e = cur.pop() if cur else q.pop()
            now = e[0]
            self.now = now
            events += 1
            typ = e[1]
            if typ == _FINISH:          # the common two called directly (a native call when compiled)
                self._on_finish(e)
            elif typ == _SUBMIT:
                self._on_submit(e)
            else:
                handlers[typ](e)
            if cur and cur[-1][0] == now:
                continue                # all events of an instant are applied before schedule
            if now >= next_trace:
                self.trace.append((now, self.busy[CPU], self.alloc_units[CPU], self.busy[GPU],
                                   self.alloc_units[GPU]))
                next_trace = self.next_trace = now + self.trace_dt
            starts = policy.schedule(now)
            if env_moves is not None:
                envs = env_moves()
                if envs:
                    self._move_envs(envs, now)
            if starts:
                self._dispatch(starts, now)
            if self._prefetches is not None:
                ahead = self._prefetches(now)
                if ahead:
                    self._prefetch(ahead, now)
            if progress is not None and events & 0x3FFF == 0 and (clock() > next_report if timed else events & 0xFFFFF == 0):
                next_report = clock() + 2.0
                progress(f"{self.name}: t={now:,.0f}s step {len(self.step_durations) + 1}/"
                         f"{self.w.rollout.steps}, {events:,} events, {policy.pending_count} waiting, "
                         f"{policy.running_count} running")
        self.events = events
        if not self.done:
            raise SimulationStalled(self.name, now, policy.pending_count, policy.running_count)
        return self._result(now, clock() - t_wall)

    def _on_step(self, e: tuple) -> None:
        s = e[3]
        now = self.now
        self.step = s
        self.step_started = now
        st = self.plan.step_traj_start[s]
        base = sum(len(x) for x in self.plan.step_traj_start[:s])
        self.step_active = len(st)
        self.step_trajs = (base, base + len(st))
        self.barrier = []
        rows = self.rows
        q = self.events_q
        trajs = self.trajs
        for j, i in enumerate(st.tolist()):
            q.push((now + rows[i * _ROW + _R_THINK], _SUBMIT, q.seq(), i, trajs[base + j], False))

    def _on_submit(self, e: tuple) -> None:
        """Submit a group: an action and the ones joined to it (``again``: one lost action, alone)."""
        i: int
        t: _Trajectory
        _, _, _, i, t, again = e
        now = self.now
        if again:
            self._submit_one(i, t, now)
            return
        end = t.end
        rows = self.rows
        turn = int(rows[i * _ROW + _R_META]) >> _TURN_SHIFT & _TURN_MASK
        k = i
        t.group = i
        self._submit_one(k, t, now)
        k += 1
        # the group's actions, and what comes after it: the next row is read once, here
        while k < end:
            m = int(rows[k * _ROW + _R_META])
            if not m >> _JOINED_SHIFT & 1:      # not joined: the next group
                t.think_next = rows[k * _ROW + _R_THINK]
                t.barrier_next = self.sync_turns and m >> _TURN_SHIFT & _TURN_MASK != turn
                break
            self._submit_one(k, t, now)
            k += 1
        t.next = k
        t.left = k - i

    def _submit_one(self, i: int, t: _Trajectory, now: float, *, first: bool = True) -> None:
        rows = self.rows
        b = i * _ROW
        row = self.classes[int(rows[b + _R_META]) & _CLS_MASK]
        tid = t.name
        hint = rows[b + _R_HINT]
        spec = ActionSpec(row.kind, None, tid if row.uses_env else None, row.demand, hint or None, None, 0,
                          tid, t.step, row.label, None, str(i))
        if first:
            rows[b + _R_SUBMIT] = now
        held = t.held
        if held is not None:
            held.append(i)              # its environment is on its way to another worker
            return
        self.policy.submit(spec, now)

    # -- moving environments ---------------------------------------------------------
    def _move_envs(self, envs: list[str], now: float) -> None:
        """Carry out the policy's moves as the coordinator does: take the environment's waiting
        actions back, release it from its worker, and submit them again once it has moved."""
        if self.traj_index is None:
            self.traj_index = {t.name: t for t in self.trajs}
        move_s = self.w.cluster.env_move_s
        for env in envs:
            t = self.traj_index.get(env)
            if t is None or not t.take_back(self.rows, self.policy):
                continue
            if self._close_env is not None:
                self._close_env(env)
            self.moves += 1
            self._push(now + move_s, _MOVED, t)

    def _on_moved(self, e: tuple) -> None:
        t: _Trajectory = e[3]
        self.policy.observe_env_move(self.w.cluster.env_move_s)
        held = t.held
        assert held is not None
        t.held = None
        for i in held:
            self._submit_one(i, t, self.now, first=False)

    def _on_finish(self, e: tuple) -> None:
        # the start's facts ride in the event: the per-action arrays are cold by now
        i: int
        sw: SimWorker
        c: int
        started: float
        row: ActionClassRow
        t: _Trajectory
        _, _, _, i, att, sw, aid, c, started, row, t = e
        if self.attempt and att != self.attempt.get(i, 0):
            return                      # an attempt lost with its worker
        now = self.now
        self.rows[i * _ROW + _R_FINISH] = now
        st = sw.status
        st.busy_cores -= c
        st.running -= 1
        if st.running == 0:
            st.idle_since = now
        self.busy[sw.resource] -= c
        ran = now - started
        if row.service is not None:
            rep = sw.services.get(row.service)
            if rep is not None:
                rep.running -= 1
                rep.last_used = now
            self.gpu_busy_ss += c * ran
        else:
            self.cpu_busy_cs += c * ran
            self.mem_reserved += row.demand.mem_mb * ran
            self.mem_used += row.mem_mean_mb * ran
        self.policy.finished(aid, now, run_time=ran)
        left = t.left - 1
        t.left = left
        if left:
            return                      # others of its group still run
        nxt = t.next
        if nxt < t.end:
            if t.barrier_next:
                self.barrier.append(t)
                if len(self.barrier) >= self.step_active:
                    self._release_barrier()
            else:
                q = self.events_q
                q.push((now + t.think_next, _SUBMIT, q.seq(), nxt, t, False))
            return
        self._trajectory_done(t, now)

    def _release_barrier(self) -> None:
        now = self.now
        waiting, self.barrier = self.barrier, []
        q = self.events_q
        for t in waiting:
            q.push((now + t.think_next, _SUBMIT, q.seq(), t.next, t, False))

    def _trajectory_done(self, t: _Trajectory, now: float) -> None:
        tid = t.name
        ew = t.worker
        t.worker = None
        if ew is not None:
            ew.status.envs -= 1
        if self._close_env is not None:
            self._close_env(tid)
        if self._traj_done is not None:
            self._traj_done(tid, now)
        self.step_active -= 1
        if self.barrier and len(self.barrier) >= self.step_active:
            self._release_barrier()
        if self.step_active == 0:
            self.step_durations.append(now - self.step_started)
            if len(self.step_durations) == self.w.rollout.steps:
                self.done = True
            else:
                self._push(now + self.w.rollout.train_s, _STEP, len(self.step_durations))

    def _on_worker_up(self, e: tuple) -> None:
        res, requested = e[3]
        if self.launches.up(self.shapes[res], requested):     # (withdrawn while starting: it never comes up)
            self._add_worker(res, self.now, requested)

    def _on_pool_tick(self, _e: tuple) -> None:
        now = self.now
        stalled = _stalled(self.name, self.policy, now, self.last_start, self.launches.starting)
        if stalled is not None:
            raise stalled
        # loads done since the last tick are reported, as a live worker's heartbeat does: a queue
        # that found every replica busy loading is looked at again
        for sw in self.workers.values():
            if sw.services and any(self.last_tick < r.ready_at <= now for r in sw.services.values()):
                self.policy.update_worker(sw.id, services=sw.ready_services(now), now=now)
        self.last_tick = now
        offered = self._offered(now) if self._offered is not None else None
        view = PoolView(now, self.policy.pending_actions(), list(self.statuses), list(self.launches.starting),
                        list(self.launches.failures), step=self.step, offered_load=offered)
        assert self.pool is not None        # ticks are pushed only with a pool
        for dec in self.pool.decide(view):
            if isinstance(dec, Launch):
                self._launch(dec, now)
            elif isinstance(dec, Reclaim):
                self._reclaim(dec, now)
            elif isinstance(dec, Withdraw):
                self.launches.withdraw(dec.shape, dec.count)
        ex = self.pool.explain()
        if ex and ex != "ok" and (not self.notes or self.notes[-1].split(": ", 1)[-1] != ex):
            self.notes.append(f"t={now:.0f}: {ex}")
        self._push(now + self.pool_interval_s, _TICK, 0)

    # -- workers -----------------------------------------------------------------
    def _add_worker(self, res: ResourceClass, now: float, requested: float, warm: bool = False) -> None:
        self.counters[res] += 1
        wid = f"{res.value}{self.counters[res]}"
        sw = SimWorker(wid, self.shapes[res], self.svc_names if res is GPU else frozenset(), now, requested)
        self.workers[wid] = sw
        self.statuses.append(sw.status)
        self.alloc_units[res] += sw.shape.cores
        self.alloc_max[res] = max(self.alloc_max[res], self.alloc_units[res])
        self.policy.add_worker(sw.status.info, now)
        if res is GPU:
            self._preload(sw, now, warm)
            if warm:     # the worker reports them resident, as a live one does in its heartbeats
                self.policy.update_worker(wid, services=frozenset(sw.services), now=now)

    def _preload(self, sw: SimWorker, now: float, warm: bool) -> None:
        """Services the worker loads at start: a static policy's layout, else the most demanded that fit
        (the order :func:`service_infos` tells the policy, which believes the same)."""
        if self._preloaded is not None:
            names = list(self._preloaded(sw.id, sw.status.info))
            warm = True                  # a static layout is loaded before the run
        else:
            planned = self._planned(sw.id) if self._planned is not None else None
            names = services_by_demand(self.w) if planned is None else planned
        sw.preload(names, self.svc_defs, now, warm)

    def _launch(self, dec: Launch, now: float) -> None:
        res = dec.shape.resource
        for _ in range(dec.count):
            if self.launches.launch(self.shapes[res], now):
                self._push(now + self.w.cluster.startup_s, _UP, (res, now))

    def _reclaim(self, dec: Reclaim, now: float) -> None:
        sw = self.workers.pop(dec.worker_id, None)
        if sw is None:
            return
        self.statuses.remove(sw.status)
        lost = self.policy.remove_worker(sw.id, now)
        sw.alloc_end = now
        self.alloc_units[sw.resource] -= sw.shape.cores
        self.retired.append(sw)
        trajs = self.trajs
        for g in range(*self.step_trajs):       # only the current step's trajectories are live
            if trajs[g].worker is sw:
                trajs[g].worker = None
        for aid in lost:     # the pool should never reclaim a busy worker; resubmit
            i = int(aid)
            self.attempt[i] = self.attempt.get(i, 0) + 1
            b = i * _ROW
            self.busy[sw.resource] -= int(self.rows[b + _R_CORES])
            q = self.events_q
            q.push((now, _SUBMIT, q.seq(), i, self.trajs[int(self.rows[b + _R_META]) >> _TRAJ_SHIFT], True))
            self.notes.append(f"action {aid} lost on reclaimed worker {sw.id}")

    # -- starts ------------------------------------------------------------------
    def _dispatch(self, starts: list[Assignment], now: float) -> None:
        """Start what the policy placed (``schedule`` was asked after the instant's events)."""
        self.last_start = now
        workers = self.workers
        classes = self.classes
        rows = self.rows
        busy = self.busy
        attempt = self.attempt
        trajs = self.trajs
        q = self.events_q
        seq = q.seq
        for a in starts:
            aid = a.action_id
            i = int(aid)
            sw = workers[a.worker_id]
            c = a.cores
            b = i * _ROW
            m = int(rows[b + _R_META])
            row = classes[m & _CLS_MASK]
            t = trajs[m >> _TRAJ_SHIFT]
            start = now
            factor = 1.0
            if row.service is not None:
                rep = sw.services.get(row.service)
                if rep is None:
                    if self._preloaded is not None:      # a static layout never loads: the policy is wrong
                        raise RuntimeError(f"{self.name}: a static policy sent a {row.service} call to {sw.id}, "
                                           f"which does not host it")
                    rep = self._sim_load(sw, row.service, now)
                    self.policy.update_worker(sw.id, services=sw.ready_services(now), now=now)
                start = rep.ready_at if rep.ready_at > now else now
                rep.running += 1
                rep.last_used = now
                factor = sw.batch_factor(self.svc_defs[row.service], rep.running)
            elif row.uses_env and t.worker is None:
                t.worker = sw
                sw.status.envs += 1
            rows[b + _R_START] = now
            rows[b + _R_CORES] = c
            st = sw.status
            st.busy_cores += c
            st.running += 1
            st.idle_since = None
            busy[sw.resource] += c
            p = row.parallel_fraction
            one_core: float = rows[b + _R_D1]
            run = one_core * ((1.0 - p) + p / (c if c > 1 else 1)) * factor
            if run > row.timeout_s:
                run = row.timeout_s
            q.push((start + run, _FINISH, seq(), i, attempt.get(i, 0) if attempt else 0, sw, aid, c, now, row, t))

    def _prefetch(self, ahead: list[tuple[str, str]], now: float) -> None:
        """Start the loads the policy asked for ahead of their calls, as a worker told PREFETCH does."""
        for wid, name in ahead:
            sw = self.workers.get(wid)
            self.prefetched.append((now, wid, name))
            if sw is not None and name not in sw.services:
                self._sim_load(sw, name, now)
                self.policy.update_worker(sw.id, services=sw.ready_services(now), now=now)

    def _sim_load(self, sw: SimWorker, name: str, now: float) -> Replica:
        rep, over = sw.load(name, self.svc_defs, now)
        if over:                     # residents in use hold the memory: the policy should not ask
            self.notes.append(f"t={now:.0f}: {sw.id} loads {name} over its GPU memory")
        return rep

    # -- result ------------------------------------------------------------------
    def _result(self, end: float, wall: float) -> SimResult:
        cpu_cs, gpu_s, gpu_ss = allocated_seconds(list(self.workers.values()) + self.retired,
                                                  self.launches.starting, end)
        lb, is_gpu = lower_bounds(self.plan, self.classes)
        return SimResult(
            # views of the rows, not copies: at 100,000 trajectories a copy is 70 MB more at the peak
            name=self.name, submit=self.table[:, _R_SUBMIT], start=self.table[:, _R_START],
            finish=self.table[:, _R_FINISH], cores=self.table[:, _R_CORES].astype(np.int32), lower_bound=lb,
            step_durations=self.step_durations, cpu_core_s=cpu_cs, gpu_s=gpu_s,
            cpu_busy_core_s=self.cpu_busy_cs, gpu_busy_slot_s=self.gpu_busy_ss, gpu_slot_s=gpu_ss,
            makespan=end, cpu_cores_max=self.alloc_max[CPU], gpu_slots_max=self.alloc_max[GPU],
            mem_reserved_mb_s=self.mem_reserved, mem_used_mb_s=self.mem_used, trace=self.trace,
            wall_s=wall, events=self.events, pool_notes=self.notes, is_gpu=is_gpu, env_moves=self.moves,
            prefetched=self.prefetched)


def _no_clock() -> float:
    return 0.0


def simulate(plan: Plan, policy: SchedulingPolicy, *, pool: PoolPolicy | None = None, name: str = "",
             workers: dict[str, int] | None = None, pool_interval_s: float = 5.0,
             trace_dt: float | None = None, progress: Callable[[str], None] | None = None,
             start_failures: int = 0, clock: Callable[[], float] | None = None) -> SimResult:
    """Run ``plan`` with ``policy`` (and ``pool``) and measure it (see :class:`Simulation`)."""
    return Simulation(plan, policy, pool=pool, name=name, workers=workers, pool_interval_s=pool_interval_s,
                      trace_dt=trace_dt, progress=progress, start_failures=start_failures,
                      clock=clock).run()
