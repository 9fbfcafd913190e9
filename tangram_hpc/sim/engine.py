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
  resource) and one action, then runs its final (reward) actions.
* An action's run time is its one-core duration scaled by Amdahl's law at the
  cores it was granted.  A reward call on a worker where its service is not
  resident first waits for the load (the service is loaded when the call is
  placed; idle services are evicted least recently used first when GPU memory
  runs out -- the same rule the live reward manager follows).
* Workers appear ``startup_s`` after the pool policy launches them.  Resources
  count as allocated from launch to reclaim (or the end of the run).

Events live in one ``heapq``; finishing events sort before submissions at the
same instant, and all events of an instant are applied before ``schedule``.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..actions import ActionSpec, Demand
from ..policy.base import PoolPolicy, PoolView, SchedulingPolicy, WorkerStatus, Launch, Reclaim
from ..resources import WorkerInfo, WorkerShape
from .workload import Plan, Workload

__all__ = ["SimResult", "simulate", "cluster_shapes", "action_specs_for"]

_FINISH, _SUBMIT, _UP, _STEP, _TICK = 0, 1, 2, 3, 4

CPU_KINDS = frozenset({"sandbox", "function"})
GPU_KINDS = frozenset({"reward"})


def cluster_shapes(w: Workload) -> dict[str, WorkerShape]:
    c = w.cluster
    out = {"cpu": WorkerShape(c.cpu_cores, c.cpu_mem_mb)}
    if c.gpu_workers:
        out["gpu"] = WorkerShape(c.gpu_slots, 0, c.gpus, c.gpu_mem_mb)
    return out


def _info(wid: str, shape: WorkerShape) -> WorkerInfo:
    if shape.gpus:
        return WorkerInfo(wid, shape.cores, shape.mem_mb, shape.gpus, shape.gpus * shape.gpu_mem_mb,
                          kinds=GPU_KINDS)
    return WorkerInfo(wid, shape.cores, shape.mem_mb, kinds=CPU_KINDS)


def action_specs_for(w: Workload) -> list[tuple[str, Demand, str | None, bool, float]]:
    """Per action class: (kind, demand, label, uses_env, hint or 0)."""
    out = []
    for a in w.actions:
        lo, hi = w.action_cores(a)
        gmem = w.services[a.service].gpu_mem_mb if a.service else 0
        d = Demand(lo, hi, a.mem_mb, gmem, a.service)
        hint = a.duration_s.median * ((1 - a.parallel_fraction) + a.parallel_fraction / lo) if a.hint else 0.0
        out.append((a.kind, d, a.name, a.uses_env, hint))
    return out


@dataclass
class SimResult:
    name: str
    submit: np.ndarray
    start: np.ndarray
    finish: np.ndarray
    cores: np.ndarray
    lower_bound: np.ndarray
    step_durations: list[float]
    cpu_core_s: float               # allocated CPU core-seconds
    gpu_s: float                    # allocated GPU-seconds
    cpu_busy_core_s: float
    gpu_busy_slot_s: float
    gpu_slot_s: float
    makespan: float
    trace: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    wall_s: float = 0.0
    events: int = 0
    pool_notes: list[str] = field(default_factory=list)

    @property
    def act(self) -> np.ndarray:
        return self.finish - self.submit

    @property
    def mean_step(self) -> float:
        return float(np.mean(self.step_durations)) if self.step_durations else 0.0

    @property
    def cpu_util(self) -> float:
        return self.cpu_busy_core_s / self.cpu_core_s if self.cpu_core_s else 0.0

    @property
    def gpu_util(self) -> float:
        return self.gpu_busy_slot_s / self.gpu_slot_s if self.gpu_slot_s else 0.0


class _SimWorker:
    __slots__ = ("id", "shape", "info", "busy", "running", "idle_since", "envs", "alloc_start",
                 "alloc_end", "services", "gpu_used", "gone")

    def __init__(self, wid: str, shape: WorkerShape, now: float, requested: float):
        self.id = wid
        self.shape = shape
        self.info = _info(wid, shape)
        self.busy = 0
        self.running = 0
        self.idle_since = now
        self.envs = 0
        self.alloc_start = requested
        self.alloc_end: float | None = None
        self.services: dict[str, list] = {}     # name -> [ready_at, running, last_used, mem]
        self.gpu_used = 0
        self.gone = False


def simulate(plan: Plan, policy: SchedulingPolicy, *, pool: PoolPolicy | None = None,
             name: str = "", workers: dict[str, int] | None = None, pool_interval_s: float = 5.0,
             trace_dt: float | None = None, progress: Callable[[str], None] | None = None,
             start_failures: int = 0) -> SimResult:
    """Run ``plan`` with ``policy`` (and ``pool``) and measure it.

    ``workers``: how many CPU/GPU workers are up at time 0 (default: the
    workload's cluster); with a pool policy they are its warm start, and the
    policy launches and reclaims from there.  ``start_failures``: the first
    that many launches fail (to exercise a pool policy's circuit breaker).
    """
    t_wall = time.perf_counter()
    w = plan.workload
    shapes = cluster_shapes(w)
    if workers is None:
        workers = {"cpu": w.cluster.cpu_workers, "gpu": w.cluster.gpu_workers}
    classes = action_specs_for(w)
    pf = [a.parallel_fraction for a in w.actions]
    svc_of = [a.service for a in w.actions]
    svc_def = w.services
    n = plan.n_actions
    cls = plan.cls.tolist()
    d1 = plan.d1.tolist()
    think = plan.think.tolist()
    is_last = np.zeros(n, dtype=bool)
    step_of = np.zeros(n, dtype=np.int32)
    traj_of = np.zeros(n, dtype=np.int32)
    for s, (st, ln) in enumerate(zip(plan.step_traj_start, plan.step_traj_len)):
        is_last[st + ln - 1] = True
        lo_i, hi_i = int(st[0]), int(st[-1] + ln[-1])
        step_of[lo_i:hi_i] = s
        traj_of[lo_i:hi_i] = np.repeat(np.arange(len(st)), ln)
    is_last_l = is_last.tolist()
    step_l = step_of.tolist()
    traj_l = traj_of.tolist()

    submit_t = [0.0] * n
    start_t = [0.0] * n
    finish_t = [0.0] * n
    cores_of = [0] * n
    where = [None] * n          # worker of a running action
    attempt = [0] * n
    env_worker: dict[str, _SimWorker] = {}

    wk: dict[str, _SimWorker] = {}
    counters = {"cpu": 0, "gpu": 0}
    starting: list[tuple[WorkerShape, float]] = []
    failures: list[tuple[float, str]] = []
    heap: list = []
    seq = 0
    fail_left = start_failures
    busy = {"cpu": 0, "gpu": 0}
    alloc_units = {"cpu": 0, "gpu": 0}
    cpu_busy_cs = 0.0
    gpu_busy_ss = 0.0
    trace: list[tuple[float, int, int, int, int]] = []
    close_env = getattr(policy, "close_env", None)
    traj_done = getattr(policy, "trajectory_done", None)
    resident = getattr(policy, "resident_services", None)
    notes: list[str] = []
    retired: list[_SimWorker] = []

    def add_worker(kind: str, now: float, requested: float) -> None:
        counters[kind] += 1
        wid = f"{kind}{counters[kind]}"
        sw = _SimWorker(wid, shapes[kind], now, requested)
        wk[wid] = sw
        alloc_units[kind] += sw.shape.cores
        policy.add_worker(sw.info, now)
        if resident is not None:
            for sname in resident(wid):      # services a static policy preloads
                mem = svc_def[sname].gpu_mem_mb if sname in svc_def else 0
                sw.services[sname] = [now, 0, now, mem]
                sw.gpu_used += mem

    for kind in ("cpu", "gpu"):
        for _ in range(workers.get(kind, 0)):
            if kind in shapes:
                add_worker(kind, 0.0, 0.0)

    steps = w.rollout.steps
    step_started = 0.0
    step_left = 0
    step_durations: list[float] = []
    heapq.heappush(heap, (0.0, _STEP, seq, 0))
    seq += 1
    if pool is not None:
        heapq.heappush(heap, (0.0, _TICK, seq, 0))
        seq += 1
    trace_dt = trace_dt or max(1.0, w.rollout.think_s.median)
    next_trace = 0.0
    events = 0
    done = False
    now = 0.0
    next_report = time.perf_counter() + 2.0

    def run_time(i: int, c: int) -> float:
        p = pf[cls[i]]
        return d1[i] * ((1.0 - p) + p / c)

    while heap and not done:
        now, typ, _, arg = heapq.heappop(heap)
        events += 1
        if typ == _FINISH:
            i, att = arg
            if att != attempt[i]:
                continue
            sw = where[i]
            where[i] = None
            finish_t[i] = now
            c = cores_of[i]
            sw.busy -= c
            sw.running -= 1
            if sw.running == 0:
                sw.idle_since = now
            kind = sw.shape.kind
            busy[kind] -= c
            sv = svc_of[cls[i]]
            if sv is not None:
                ent = sw.services[sv]
                ent[1] -= 1
                ent[2] = now
                gpu_busy_ss += c * (now - start_t[i])
            else:
                cpu_busy_cs += c * (now - start_t[i])
            policy.finished(str(i), now, run_time=now - start_t[i])
            if not is_last_l[i]:
                j = i + 1
                heapq.heappush(heap, (now + think[j], _SUBMIT, seq, j))
                seq += 1
            else:
                tid = f"s{step_l[i]}t{traj_l[i]}"
                ew = env_worker.pop(tid, None)
                if ew is not None:
                    ew.envs -= 1
                if close_env is not None:
                    close_env(tid)
                if traj_done is not None:
                    traj_done(tid, now)
                step_left -= 1
                if step_left == 0:
                    step_durations.append(now - step_started)
                    if len(step_durations) == steps:
                        done = True
                    else:
                        heapq.heappush(heap, (now + w.rollout.train_s, _STEP, seq, len(step_durations)))
                        seq += 1
        elif typ == _SUBMIT:
            i = arg
            kind_, demand, label, uses_env, hint = classes[cls[i]]
            tid = f"s{step_l[i]}t{traj_l[i]}"
            spec = ActionSpec(kind_, None, tid if uses_env else None, demand, hint or None, None, 0,
                              tid, step_l[i], label, None, str(i))
            submit_t[i] = now
            policy.submit(spec, now)
        elif typ == _STEP:
            s = arg
            step_started = now
            st = plan.step_traj_start[s].tolist()
            step_left = len(st)
            for i in st:
                heapq.heappush(heap, (now + think[i], _SUBMIT, seq, i))
                seq += 1
        elif typ == _UP:
            kind, requested = arg
            starting.remove((shapes[kind], requested))
            add_worker(kind, now, requested)
        elif typ == _TICK:
            ws = []
            for sw in wk.values():
                ws.append(WorkerStatus(sw.info, sw.busy, sw.running,
                                       sw.idle_since if sw.running == 0 else None, sw.envs, False,
                                       sw.alloc_start))
            view = PoolView(now, policy.pending_actions(), ws, list(starting), list(failures))
            for dec in pool.decide(view):
                if isinstance(dec, Launch):
                    kind = dec.shape.kind
                    for _ in range(dec.count):
                        if fail_left > 0:
                            fail_left -= 1
                            failures.append((now, "simulated start failure"))
                            continue
                        starting.append((shapes[kind], now))
                        heapq.heappush(heap, (now + w.cluster.startup_s, _UP, seq, (kind, now)))
                        seq += 1
                elif isinstance(dec, Reclaim):
                    sw = wk.pop(dec.worker_id, None)
                    if sw is None:
                        continue
                    lost = policy.remove_worker(sw.id, now)
                    sw.alloc_end = now
                    sw.gone = True
                    alloc_units[sw.shape.kind] -= sw.shape.cores
                    retired.append(sw)
                    for aid in lost:     # the pool should never reclaim a busy worker; resubmit
                        i = int(aid)
                        attempt[i] += 1
                        busy[sw.shape.kind] -= cores_of[i]
                        where[i] = None
                        heapq.heappush(heap, (now, _SUBMIT, seq, i))
                        seq += 1
                        notes.append(f"action {aid} lost on reclaimed worker {sw.id}")
            ex = pool.explain()
            if ex and ex != "ok" and (not notes or notes[-1] != ex):
                notes.append(f"t={now:.0f}: {ex}")
            heapq.heappush(heap, (now + pool_interval_s, _TICK, seq, 0))
            seq += 1

        if heap and heap[0][0] == now:
            continue
        if now >= next_trace:
            trace.append((now, busy["cpu"], alloc_units["cpu"], busy["gpu"], alloc_units["gpu"]))
            next_trace = now + trace_dt
        for a in policy.schedule(now):
            i = int(a.action_id)
            sw = wk[a.worker_id]
            c = a.cores
            start = now
            sv = svc_of[cls[i]]
            if sv is not None:
                ent = sw.services.get(sv)
                if ent is None:
                    ent = _sim_load(sw, sv, svc_def[sv], now)
                    policy.update_worker(sw.id, services=frozenset(sw.services), now=now)
                start = max(now, ent[0])
                ent[1] += 1
                ent[2] = now
            env = classes[cls[i]][3]
            if env:
                tid = f"s{step_l[i]}t{traj_l[i]}"
                if tid not in env_worker:
                    env_worker[tid] = sw
                    sw.envs += 1
            start_t[i] = now
            cores_of[i] = c
            where[i] = sw
            sw.busy += c
            sw.running += 1
            busy[sw.shape.kind] += c
            heapq.heappush(heap, (start + run_time(i, max(1, c)), _FINISH, seq, (i, attempt[i])))
            seq += 1
        if progress is not None and events & 0x3FFF == 0 and time.perf_counter() > next_report:
            next_report = time.perf_counter() + 2.0
            progress(f"{name}: t={now:,.0f}s step {len(step_durations) + 1}/{steps}, "
                     f"{events:,} events, {policy.pending_count} waiting, {policy.running_count} running")
    if not done:
        raise RuntimeError(f"{name}: simulation stalled at t={now:.0f} with {policy.pending_count} "
                           f"waiting and {policy.running_count} running actions "
                           f"(an action that fits no worker?)")
    end = now
    cpu_cs = gpu_s = gpu_ss = 0.0
    for sw in list(wk.values()) + retired:
        life = (sw.alloc_end if sw.alloc_end is not None else end) - sw.alloc_start
        if sw.shape.gpus:
            gpu_s += life * sw.shape.gpus
            gpu_ss += life * sw.shape.cores
        else:
            cpu_cs += life * sw.shape.cores
    for shape, at in starting:
        if shape.gpus:
            gpu_s += (end - at) * shape.gpus
            gpu_ss += (end - at) * shape.cores
        else:
            cpu_cs += (end - at) * shape.cores
    pfa = np.array(pf)[plan.cls]
    maxc = np.array([cl[1].max_cores for cl in classes])[plan.cls]
    lb = plan.d1 * ((1.0 - pfa) + pfa / np.maximum(1, maxc))
    return SimResult(name=name, submit=np.array(submit_t), start=np.array(start_t),
                     finish=np.array(finish_t), cores=np.array(cores_of), lower_bound=lb,
                     step_durations=step_durations, cpu_core_s=cpu_cs, gpu_s=gpu_s,
                     cpu_busy_core_s=cpu_busy_cs, gpu_busy_slot_s=gpu_busy_ss, gpu_slot_s=gpu_ss,
                     makespan=end, trace=trace, wall_s=time.perf_counter() - t_wall, events=events,
                     pool_notes=notes)


def _sim_load(sw: _SimWorker, name: str, svc, now: float) -> list:
    """Load a service on a simulated worker, evicting idle ones least recently used first."""
    cap = sw.info.gpu_mem_mb
    if sw.gpu_used + svc.gpu_mem_mb > cap:
        idle = sorted((ent[2], s) for s, ent in sw.services.items() if ent[1] == 0)
        for _, s in idle:
            sw.gpu_used -= sw.services.pop(s)[3]
            if sw.gpu_used + svc.gpu_mem_mb <= cap:
                break
    ent = [now + svc.load_s, 0, now, svc.gpu_mem_mb]
    sw.services[name] = ent
    sw.gpu_used += svc.gpu_mem_mb
    return ent
