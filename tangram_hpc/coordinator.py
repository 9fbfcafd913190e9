"""The coordinator: a ZMQ event loop that feeds events to the policies and applies their decisions.

It owns two ROUTER sockets (clients, workers) and no scheduling logic of its
own: placement is a :class:`~tangram_hpc.policy.base.SchedulingPolicy`, pool
size a :class:`~tangram_hpc.policy.base.PoolPolicy`, workers come from a
:class:`~tangram_hpc.backends.base.WorkerBackend`.  What the coordinator does
itself is bookkeeping that guarantees *exactly one final result per action*:

* every live action has one record with its current attempt number; a DONE
  for any other attempt (a worker that was declared lost and came back, a
  result that raced a cancel or a timeout) is dropped;
* a lost worker's running actions are resubmitted to the policy as a new
  attempt until ``max_attempts``, then fail with the reasons;
* finished results are kept in a bounded cache so a client that resubmits
  after a coordinator or network hiccup gets the same result again, and the
  client side de-duplicates by action id.

The loop drains each socket in batches, runs the scheduler once per batch and
sends one frame per destination, so per-action work on the dispatch path is a
decode, a dict insert, a policy call and an encode.
"""
from __future__ import annotations

import heapq
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from . import protocol as P
from .actions import BUILTIN_KINDS, ActionSpec, Status, ValidationError, new_action_id, register_kind
from .backends.base import WorkerBackend, WorkerLaunchSpec
from .connection import ConnectionInfo
from .policy.base import Launch, PoolPolicy, PoolView, Reclaim, SchedulingPolicy, WorkerStatus
from .resources import WorkerInfo, WorkerShape
from .runlog import RunLog

log = logging.getLogger("tangram.coordinator")

_BATCH = 2000          # messages drained from one socket per loop turn
_RESULT_SLICE = 5000   # results per RESULT frame


@dataclass
class CoordinatorConfig:
    run_dir: Path
    connection_file: Path | None = None
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    client_port: int = 0
    worker_port: int = 0
    heartbeat_s: float = 1.0
    worker_timeout_s: float = 5.0
    max_attempts: int = 3
    timeout_grace_s: float = 5.0
    max_frame_bytes: int = P.MAX_FRAME_BYTES
    max_pending_per_client: int = 200_000
    max_pending_total: int = 1_000_000
    result_cache: int = 200_000
    hwm: int = 200_000
    pool_interval_s: float = 1.0
    drain_grace_s: float = 30.0   # a stopped worker's time to snapshot and exit before its job is cancelled
    max_worker_shape: WorkerShape | None = None
    #: extra worker command-line arguments for CPU workers and for service (GPU) workers
    cpu_worker_args: tuple[str, ...] = ()
    service_worker_args: tuple[str, ...] = ()
    #: CurveZMQ keys (see tangram_hpc.security); None means plain TCP.
    curve: Any = None

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        if self.connection_file is None:
            self.connection_file = self.run_dir / "connection.json"
        self.connection_file = Path(self.connection_file)


class _Action:
    __slots__ = ("spec", "wire", "client", "submitted", "attempt", "worker", "cores", "kill_reason",
                 "failures", "waiters")

    def __init__(self, spec: ActionSpec, wire: dict, client: bytes, now: float):
        self.spec = spec
        self.wire = wire
        self.client = client
        self.submitted = now
        self.attempt = 0
        self.worker: str | None = None
        self.cores = 0
        self.kill_reason: str | None = None
        self.failures: list[str] = []
        self.waiters: list[tuple[bytes, str]] | None = None  # (client, action id) sharing an idempotency key


class _Recent:
    """A bounded map of recent entries in two generations of plain dicts.

    Lookups see both; once the young one holds half the capacity it becomes the old one and
    the old one is dropped whole.  Dropping whole dicts, rather than evicting entry by entry
    from one ordered map, keeps the coordinator's memory flat over millions of actions.
    """

    __slots__ = ("half", "young", "old")

    def __init__(self, capacity: int):
        self.half = max(1, capacity // 2)
        self.young: dict = {}
        self.old: dict = {}

    def get(self, key):
        v = self.young.get(key)
        return v if v is not None else self.old.get(key)

    def put(self, key, value) -> None:
        self.young[key] = value
        if len(self.young) >= self.half:
            self.old, self.young = self.young, {}


class _Worker:
    __slots__ = ("info", "ident", "last_seen", "running", "busy_cores", "draining", "idle_since",
                 "services", "envs", "registered_at", "drain_reason")

    def __init__(self, info: WorkerInfo, ident: bytes, now: float):
        self.info = info
        self.ident = ident
        self.last_seen = now
        self.running: set[str] = set()
        self.busy_cores = 0
        self.draining = False
        self.drain_reason = ""
        self.idle_since: float | None = now
        self.services: frozenset[str] = frozenset()
        self.envs: frozenset[str] = frozenset()
        self.registered_at = now


@dataclass
class Counters:
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    retried: int = 0
    rejected: int = 0
    bad_frames: int = 0
    stale_results: int = 0
    workers_lost: int = 0
    launch_failures: int = 0
    by_status: dict = field(default_factory=dict)


class Coordinator:
    def __init__(self, config: CoordinatorConfig, policy: SchedulingPolicy,
                 pool: PoolPolicy | None = None, backend: WorkerBackend | None = None):
        self.config = config
        self.policy = policy
        self.pool = pool
        self.backend = backend
        self.id = new_action_id()[:12]
        self.counters = Counters()
        self._actions: dict[str, _Action] = {}
        self._workers: dict[str, _Worker] = {}
        self._handles: dict[str, str] = {}                       # backend handle -> worker id
        self._starting: dict[str, tuple[WorkerShape, float]] = {}  # handle -> (shape, requested at)
        self._launched: dict[str, WorkerShape] = {}                # handle -> shape asked for
        self._last_pool = 0.0                                      # when the pool policy last decided
        self._reclaim_at: dict[str, float] = {}                    # drained handle -> cancel its job then
        self._launch_failures: list[tuple[float, str]] = []
        self._recent = _Recent(config.result_cache)               # action id -> result wire
        self._idem = _Recent(config.result_cache)                 # idempotency key -> action id
        self._client_pending: dict[bytes, int] = {}
        self._client_out: dict[bytes, list] = {}
        self._worker_out: dict[str, list] = {}
        self._kill_out: dict[str, list] = {}
        self._deadlines: list[tuple[float, str, int]] = []
        self._dirty = False
        self._stop = False
        self._started = time.time()
        self._ctx: zmq.Context | None = None
        self.info: ConnectionInfo | None = None
        self._bad_frame_logged: set[str] = set()
        run_dir = config.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._action_log = RunLog(run_dir / "actions.log")
        self._worker_log = RunLog(run_dir / "workers.log")

    # -- sockets -----------------------------------------------------------
    def bind(self) -> ConnectionInfo:
        cfg = self.config
        ctx = self._ctx = zmq.Context()
        self.clients = self._router(ctx, mandatory=False)
        self.workers = self._router(ctx, mandatory=True)
        if cfg.curve is not None:
            cfg.curve.apply_server(self.clients, self.workers, ctx)
        cport = self._bind(self.clients, cfg.client_port)
        wport = self._bind(self.workers, cfg.worker_port)
        host = cfg.advertise_host or (cfg.host if cfg.host not in ("0.0.0.0", "*") else socket.getfqdn())
        self.info = ConnectionInfo(
            client_address=f"tcp://{host}:{cport}", worker_address=f"tcp://{host}:{wport}",
            coordinator_id=self.id, run_dir=str(cfg.run_dir),
            server_public_key=cfg.curve.server_public_text if cfg.curve else "",
            client_key_file=str(cfg.curve.client_key_file) if cfg.curve else "")
        self.info.write(cfg.connection_file)
        return self.info

    def _router(self, ctx: zmq.Context, mandatory: bool) -> zmq.Socket:
        s = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, self.config.hwm)
        s.setsockopt(zmq.RCVHWM, self.config.hwm)
        # Frames a little over the limit get an error reply from decode(); far larger ones are cut off
        # by ZMQ before they are buffered whole, which bounds memory under a hostile peer.
        s.setsockopt(zmq.MAXMSGSIZE, 4 * self.config.max_frame_bytes + 1024)
        if mandatory:
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A restarted client or worker reconnects with the same identity.
        s.setsockopt(zmq.ROUTER_HANDOVER, 1)
        return s

    def _bind(self, sock: zmq.Socket, port: int) -> int:
        host = self.config.host
        addr = f"tcp://{'*' if host in ('0.0.0.0', '*') else host}"
        if port:
            sock.bind(f"{addr}:{port}")
            return port
        return sock.bind_to_random_port(addr)

    # -- main loop ---------------------------------------------------------
    def serve(self, stop_after: float | None = None) -> None:
        """Run until :meth:`stop` (or a signal handler setting it) or ``stop_after`` seconds."""
        if self.info is None:
            self.bind()
        poller = zmq.Poller()
        poller.register(self.clients, zmq.POLLIN)
        poller.register(self.workers, zmq.POLLIN)
        next_tick = 0.0
        end = time.monotonic() + stop_after if stop_after else None
        self._launch_initial()
        try:
            while not self._stop:
                now_m = time.monotonic()
                wait = max(0.0, next_tick - now_m)
                events = dict(poller.poll(int(wait * 1000) + (0 if wait == 0 else 1)))
                if self.workers in events:
                    self._drain(self.workers, self._on_worker_frame)
                if self.clients in events:
                    self._drain(self.clients, self._on_client_frame)
                if self._dirty:
                    self._dispatch(time.time())
                self._flush()
                now_m = time.monotonic()
                if now_m >= next_tick:
                    self._tick(time.time())
                    self._flush()
                    next_tick = now_m + min(self.config.heartbeat_s, self.config.pool_interval_s) / 2
                if end is not None and now_m > end:
                    break
        finally:
            self.close()

    def stop(self) -> None:
        self._stop = True

    def close(self) -> None:
        self._action_log.flush()
        self._worker_log.flush()
        if self._ctx is None:
            return
        for w in list(self._workers.values()):
            self._send_worker(w, P.encode(P.STOP, {"reason": "coordinator shutting down", "reregister": False}))
        if self.config.curve is not None:
            self.config.curve.stop()
        if self.backend is not None:
            try:
                self.backend.shutdown()
            except Exception:
                log.exception("backend shutdown failed")
        self._ctx.destroy(linger=0)
        self._ctx = None

    def _drain(self, sock: zmq.Socket, handler) -> None:
        for _ in range(_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._bad_frame(sock, frames[0], P.ProtocolError("malformed", "expected exactly one frame"))
                continue
            try:
                handler(frames[0], frames[1])
            except P.ProtocolError as e:
                self._bad_frame(sock, frames[0], e)
            except (ValidationError, TypeError, ValueError, KeyError) as e:
                self._bad_frame(sock, frames[0], P.ProtocolError("invalid", f"{type(e).__name__}: {e}"))

    def _bad_frame(self, sock: zmq.Socket, ident: bytes, err: P.ProtocolError) -> None:
        self.counters.bad_frames += 1
        if err.code not in self._bad_frame_logged:  # once per kind of fault, not per frame
            self._bad_frame_logged.add(err.code)
            log.warning("rejected a frame (%s): %s", err.code, err)
        try:
            sock.send_multipart([ident, P.error_frame(err.code, str(err))], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # peer gone or queue full: dropped, and counted above

    # -- clients -----------------------------------------------------------
    def _on_client_frame(self, ident: bytes, frame: bytes) -> None:
        mtype, body = P.decode(frame, P.CLIENT_TYPES, self.config.max_frame_bytes)
        if mtype == P.SUBMIT:
            self._on_submit(ident, body)
        elif mtype == P.HEARTBEAT:
            self.clients.send_multipart([ident, P.encode(P.HEARTBEAT, {"coordinator": self.id})], zmq.NOBLOCK)
        elif mtype == P.CANCEL:
            self._on_cancel(body)
        elif mtype == P.STATUS:
            self.clients.send_multipart([ident, P.encode(P.STATUS, self.status())], zmq.NOBLOCK)
        elif mtype == P.HELLO:
            self.clients.send_multipart([ident, P.encode(P.WELCOME, self._welcome())], zmq.NOBLOCK)

    def _welcome(self) -> dict:
        c = self.config
        return {"coordinator": self.id, "limits": {
            "max_frame_bytes": c.max_frame_bytes, "max_pending_per_client": c.max_pending_per_client}}

    def _on_submit(self, ident: bytes, body: list) -> None:
        now = time.time()
        cfg = self.config
        policy = self.policy
        actions = self._actions
        pending = self._client_pending.get(ident, 0)
        for w in body:
            try:
                spec = ActionSpec.from_wire(w)
            except ValidationError as e:
                aid = w.get("i") if isinstance(w, dict) else None
                self._reject(ident, aid if isinstance(aid, str) and len(aid) <= 128 else None, str(e), now)
                continue
            aid = spec.id
            live = actions.get(aid)
            if live is not None:
                live.client = ident  # a resubmission from a reconnected client: answer it there
                continue
            done = self._recent.get(aid)
            if done is not None:
                self._client_out.setdefault(ident, []).append(done)
                continue
            key = spec.idempotency_key
            if key is not None and self._on_idempotent(ident, spec, key, now):
                continue
            if pending >= cfg.max_pending_per_client or len(actions) >= cfg.max_pending_total:
                which = ("this client" if pending >= cfg.max_pending_per_client else "the coordinator")
                limit = cfg.max_pending_per_client if which == "this client" else cfg.max_pending_total
                self._reject(ident, aid, f"too many unfinished actions for {which} (limit {limit}); "
                                         "wait for results before submitting more", now)
                continue
            pending += 1
            actions[aid] = _Action(spec, w, ident, now)
            self.counters.submitted += 1
            policy.submit(spec, now)
        self._client_pending[ident] = pending
        self._dirty = True

    def _on_idempotent(self, ident: bytes, spec: ActionSpec, key: str, now: float) -> bool:
        first = self._idem.get(key)
        if first is None:
            self._idem.put(key, spec.id)
            return False
        live = self._actions.get(first)
        if live is not None:
            if live.waiters is None:
                live.waiters = []
            live.waiters.append((ident, spec.id))
            return True
        done = self._recent.get(first)
        if done is None:
            self._idem.put(key, spec.id)  # original forgotten: run again
            return False
        copy = list(done)
        copy[0] = spec.id
        self._client_out.setdefault(ident, []).append(copy)
        return True

    def _reject(self, ident: bytes, aid: str | None, why: str, now: float) -> None:
        self.counters.rejected += 1
        if aid is None:
            self.clients.send_multipart([ident, P.error_frame("invalid_action", why)], zmq.NOBLOCK)
            return
        self._client_out.setdefault(ident, []).append(
            [aid, Status.ERROR, None, f"rejected: {why}", now, 0.0, now, None, 0, 0])

    def _on_cancel(self, ids: list) -> None:
        now = time.time()
        for aid in ids:
            if not isinstance(aid, str):
                continue
            a = self._actions.get(aid)
            if a is None:
                continue
            if self.policy.cancel(aid):
                self._finalize(a, Status.CANCELLED, None, "cancelled before it started", 0.0, now)
            elif a.worker is not None:
                a.kill_reason = "cancelled"
                self._kill_out.setdefault(a.worker, []).append([aid, a.attempt])

    # -- workers -----------------------------------------------------------
    def _on_worker_frame(self, ident: bytes, frame: bytes) -> None:
        mtype, body = P.decode(frame, P.WORKER_TYPES, self.config.max_frame_bytes)
        wid = ident.decode("utf-8", "replace")
        w = self._workers.get(wid)
        now = time.time()
        if mtype == P.REGISTER:
            self._on_register(ident, body, now)
            return
        if w is None:
            if mtype == P.DONE:
                # Late outcomes of a worker declared lost: their actions were retried elsewhere.
                self.counters.stale_results += len(body)
            # A worker we declared lost (or one from before a restart): it must start over.
            self._send_ident(ident, P.encode(P.STOP, {"reason": "unknown worker: register again",
                                                      "reregister": True}))
            return
        w.last_seen = now
        if mtype == P.DONE:
            self._on_done(w, body, now)
        elif mtype == P.HEARTBEAT:
            if body.get("leaving"):
                self._lose_worker(w, now, f"worker {wid} is leaving: {body.get('leaving')}")
                return
            services = body.get("services")
            envs = body.get("envs")
            changed = False
            if isinstance(services, list) and frozenset(services) != w.services:
                w.services = frozenset(s for s in services if isinstance(s, str))
                changed = True
            if isinstance(envs, list) and frozenset(envs) != w.envs:
                w.envs = frozenset(e for e in envs if isinstance(e, str))
                changed = True
            if changed:
                self.policy.update_worker(wid, services=w.services, envs=w.envs, now=now)
                self._dirty = True

    def _on_register(self, ident: bytes, body: dict, now: float) -> None:
        reg = P.check_register(body)
        wid = ident.decode("utf-8", "replace")
        if reg["id"] != wid:
            raise P.ProtocolError("malformed", "REGISTER id must equal the socket identity")
        if not reg["kinds"]:
            raise P.ProtocolError("malformed", "REGISTER declares no action kinds: such a worker could run nothing")
        for kind in reg["kinds"]:
            if kind not in BUILTIN_KINDS:
                register_kind(kind)  # clients may now submit actions of the worker's own kinds
        old = self._workers.get(wid)
        if old is not None:
            self._lose_worker(old, now, f"worker {wid} registered again")
        info = WorkerInfo(id=wid, cores=reg["cores"], mem_mb=reg["mem_mb"], gpus=reg["gpus"],
                          gpu_mem_mb=reg["gpu_mem_mb"], kinds=frozenset(reg["kinds"]),
                          services=frozenset(reg["services"]), handle=reg["handle"], host=reg["host"] or "",
                          partition=reg["partition"], extra={"pid": reg["pid"]})
        w = _Worker(info, ident, now)
        self._workers[wid] = w
        if info.handle:
            self._handles[info.handle] = wid
            self._starting.pop(info.handle, None)
        self.policy.add_worker(info, now)
        self._worker_log.append([now, "register", wid, info.handle, info.cores, info.gpus])
        self._send_worker(w, P.encode(P.WELCOME, {"coordinator": self.id, "heartbeat_s": self.config.heartbeat_s}))
        self._dirty = True
        log.info("worker %s registered: %d cores, %d GPUs, handle %s", wid, info.cores, info.gpus, info.handle)

    def _on_done(self, w: _Worker, items: list, now: float) -> None:
        policy = self.policy
        actions = self._actions
        bad = 0
        for item in items:
            try:
                aid, attempt, status, output, error, started, finished = P.check_done(item)
            except ValidationError:
                bad += 1  # one broken item must not strand the rest of the batch
                continue
            a = actions.get(aid)
            if a is None or a.attempt != attempt or a.worker != w.info.id:
                self.counters.stale_results += 1
                continue
            if status not in Status.FINAL:
                status, error = Status.ERROR, f"worker reported unknown status {status!r}"
            policy.finished(aid, now, ok=status == Status.OK, run_time=max(0.0, finished - started))
            w.running.discard(aid)
            w.busy_cores -= a.cores
            if not w.running:
                w.idle_since = now
            if a.kill_reason == "cancelled" and status != Status.OK:
                status = Status.CANCELLED
            self._finalize(a, status, output, error, started, finished)
        self._dirty = True
        if bad:
            raise P.ProtocolError("invalid", f"{bad} malformed DONE item(s) from worker {w.info.id} ignored")

    def _lose_worker(self, w: _Worker, now: float, reason: str) -> None:
        wid = w.info.id
        if self._workers.pop(wid, None) is None:
            return
        self.counters.workers_lost += 1
        if w.info.handle:
            self._handles.pop(w.info.handle, None)
            self._launched.pop(w.info.handle, None)
        lost = self.policy.remove_worker(wid, now)
        self._worker_log.append([now, "lost", wid, w.info.handle, w.info.cores, w.info.gpus])
        log.warning("worker %s lost (%s); %d running actions to retry", wid, reason, len(lost))
        for aid in set(lost) | w.running:
            a = self._actions.get(aid)
            if a is None:
                continue
            a.worker = None
            a.failures.append(f"attempt {a.attempt} on {wid}: {reason}")
            if a.kill_reason == "cancelled":
                self._finalize(a, Status.CANCELLED, None, "cancelled (its worker was lost)", 0.0, now)
            elif a.attempt >= self.config.max_attempts:
                self._finalize(a, Status.ERROR, None,
                               f"gave up after {a.attempt} attempts: " + "; ".join(a.failures[-3:]), 0.0, now)
            else:
                self.counters.retried += 1
                self.policy.submit(a.spec, now)
        self._dirty = True

    # -- scheduling --------------------------------------------------------
    def _dispatch(self, now: float) -> None:
        self._dirty = False
        assignments = self.policy.schedule(now)
        if not assignments:
            return
        actions = self._actions
        workers = self._workers
        grace = self.config.timeout_grace_s
        for asg in assignments:
            a = actions.get(asg.action_id)
            w = workers.get(asg.worker_id)
            if a is None or w is None:
                # The policy placed something the coordinator no longer tracks: give its cores back.
                self.policy.finished(asg.action_id, now, ok=False)
                continue
            a.attempt += 1
            a.worker = w.info.id
            a.cores = asg.cores
            w.running.add(a.spec.id)
            w.busy_cores += asg.cores
            w.idle_since = None
            self._worker_out.setdefault(w.info.id, []).append([a.wire, a.attempt, asg.cores])
            if a.spec.timeout is not None:
                heapq.heappush(self._deadlines, (now + a.spec.timeout + grace, a.spec.id, a.attempt))

    def _finalize(self, a: _Action, status: str, output: Any, error: str | None,
                  started: float, finished: float) -> None:
        spec = a.spec
        aid = spec.id
        self._actions.pop(aid, None)
        n = self._client_pending.get(a.client, 1) - 1
        if n > 0:
            self._client_pending[a.client] = n
        else:
            self._client_pending.pop(a.client, None)
        res = [aid, status, output, error, a.submitted, started, finished, a.worker, a.cores, a.attempt]
        self._client_out.setdefault(a.client, []).append(res)
        self._recent.put(aid, res)
        if a.waiters:
            for ident, other in a.waiters:
                copy = list(res)
                copy[0] = other
                self._client_out.setdefault(ident, []).append(copy)
        if status == Status.OK:
            self.counters.completed += 1
        else:
            self.counters.failed += 1
        bs = self.counters.by_status
        bs[status] = bs.get(status, 0) + 1
        self._action_log.append([aid, spec.kind, spec.action_class, a.worker, a.cores, a.submitted, started,
                                 finished, status, a.attempt, spec.trajectory])

    # -- output ------------------------------------------------------------
    def _flush(self) -> None:
        if self._worker_out:
            out, self._worker_out = self._worker_out, {}
            for wid, items in out.items():
                w = self._workers.get(wid)
                if w is not None:
                    self._send_worker(w, P.encode(P.ASSIGN, items))
        if self._kill_out:
            out, self._kill_out = self._kill_out, {}
            for wid, items in out.items():
                w = self._workers.get(wid)
                if w is not None:
                    self._send_worker(w, P.encode(P.KILL, items))
        if self._client_out:
            out, self._client_out = self._client_out, {}
            send = self.clients.send_multipart
            for ident, results in out.items():
                for i in range(0, len(results), _RESULT_SLICE):
                    try:
                        send([ident, P.encode(P.RESULT, results[i:i + _RESULT_SLICE])], zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass  # client gone; it resubmits on reconnect and gets cached results

    def _send_worker(self, w: _Worker, frame: bytes) -> None:
        if not self._send_ident(w.ident, frame) and w.info.id in self._workers:
            now = time.time()
            if self.backend is not None:
                self._poll_backend(now)  # the backend usually knows why (exit status, job state)
            if w.info.id in self._workers:
                self._lose_worker(w, now, "connection closed")

    def _send_ident(self, ident: bytes, frame: bytes) -> bool:
        try:
            self.workers.send_multipart([ident, frame], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    # -- periodic work -------------------------------------------------------
    def _tick(self, now: float) -> None:
        cfg = self.config
        hb = P.encode(P.HEARTBEAT, {"coordinator": self.id})
        for w in list(self._workers.values()):
            if now - w.last_seen > cfg.worker_timeout_s:
                self._lose_worker(w, now, f"no heartbeat for {now - w.last_seen:.1f}s")
            else:
                self._send_worker(w, hb)
        self._expire_deadlines(now)
        if self.backend is not None:
            self._poll_backend(now)
            self._finish_drains(now)
        for aid, why in self.policy.unplaceable(now):
            a = self._actions.get(aid)
            if a is not None and self.policy.cancel(aid):
                self._finalize(a, Status.ERROR, None, f"cannot be placed: {why}", 0.0, now)
        self._action_log.flush()
        self._worker_log.flush()
        self._dirty = True

    def _expire_deadlines(self, now: float) -> None:
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            _, aid, attempt = heapq.heappop(dl)
            a = self._actions.get(aid)
            if a is None or a.attempt != attempt or a.worker is None:
                continue
            w = self._workers.get(a.worker)
            self._kill_out.setdefault(a.worker, []).append([aid, attempt])
            self.policy.finished(aid, now, ok=False)
            if w is not None:
                w.running.discard(aid)
                w.busy_cores -= a.cores
            self._finalize(a, Status.TIMEOUT, None,
                           f"no result {a.spec.timeout:g}s (+{self.config.timeout_grace_s:g}s grace) after it started", 0.0, now)

    # -- pool ------------------------------------------------------------------
    def _launch_initial(self) -> None:
        if self.pool is not None and self.backend is not None:
            self._pool_decide(time.time())

    def _poll_backend(self, now: float) -> None:
        try:
            events = self.backend.poll()
        except Exception as e:
            log.warning("backend poll failed: %s", e)
            return
        for ev in events:
            if ev.state in ("pending", "running"):
                continue
            self._reclaim_at.pop(ev.handle, None)  # it ended by itself
            wid = self._handles.get(ev.handle)
            if ev.handle in self._starting:
                self._starting.pop(ev.handle)
                self._launched.pop(ev.handle, None)
                if ev.state != "ended":
                    self._launch_failed(now, f"{ev.handle}: {ev.state} {ev.reason}".strip())
            if wid is not None and wid in self._workers:
                self._lose_worker(self._workers[wid], now, f"backend job {ev.handle} {ev.state} {ev.reason}".strip())
        if now - self._last_pool >= self.config.pool_interval_s:
            self._last_pool = now
            self._pool_decide(now)

    def _launch_failed(self, now: float, why: str) -> None:
        self.counters.launch_failures += 1
        self._launch_failures.append((now, why))
        if len(self._launch_failures) > 100:  # a crash-looping backend must not grow this forever
            del self._launch_failures[:-50]

    def _pool_decide(self, now: float) -> None:
        if self.pool is None or self.backend is None:
            return
        view = PoolView(
            now=now, pending=self.policy.pending_actions(),
            workers=[WorkerStatus(info=w.info, busy_cores=w.busy_cores, running=len(w.running),
                                  idle_since=w.idle_since, envs=len(w.envs), draining=w.draining,
                                  started_at=w.registered_at,
                                  ends_at=self.backend.time_limit(w.info.handle) if w.info.handle else None,
                                  shape=self._launched.get(w.info.handle or ""))
                     for w in self._workers.values()],
            starting=list(self._starting.values()),
            failures=self._launch_failures[-50:], cluster=self.backend.capacity())
        for d in self.pool.decide(view):
            if isinstance(d, Launch):
                cfg = self.config
                args = cfg.service_worker_args if d.shape.gpus or d.shape.gpu_mem_mb else cfg.cpu_worker_args
                spec = WorkerLaunchSpec(connection_file=str(cfg.connection_file), shape=d.shape, extra_args=args)
                try:
                    handles = self.backend.launch(spec, d.count)
                except Exception as e:
                    self._launch_failed(now, f"launch failed: {e}")
                    log.warning("could not launch %d worker(s) of %s: %s", d.count, d.shape, e)
                    continue
                for h in handles:
                    self._starting[h] = (d.shape, now)
                    self._launched[h] = d.shape
            elif isinstance(d, Reclaim):
                w = self._workers.get(d.worker_id)
                if w is not None and not w.draining:
                    self.drain(w.info.id, d.reason)

    def drain(self, worker_id: str, reason: str) -> None:
        """Stop giving a worker actions; it is reclaimed once its running actions end."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        w.draining = True
        w.drain_reason = reason
        self.policy.set_draining(worker_id, True)
        self._worker_log.append([time.time(), "drain", worker_id, w.info.handle, w.info.cores, w.info.gpus])

    def _finish_drains(self, now: float) -> None:
        for w in list(self._workers.values()):
            if w.draining and not w.running:
                # STOP first: the worker snapshots its environments and exits by itself; the
                # backend job is cancelled only if it is still there after the grace period.
                self._send_worker(w, P.encode(P.STOP, {"reason": w.drain_reason or "reclaimed", "reregister": False}))
                self._workers.pop(w.info.id, None)
                self.policy.remove_worker(w.info.id, now)
                self._worker_log.append([now, "reclaimed", w.info.id, w.info.handle, w.info.cores, w.info.gpus])
                if w.info.handle:
                    self._handles.pop(w.info.handle, None)
                    self._launched.pop(w.info.handle, None)
                    self._reclaim_at[w.info.handle] = now + self.config.drain_grace_s
        for handle, at in list(self._reclaim_at.items()):
            if now >= at:
                del self._reclaim_at[handle]
                try:
                    self.backend.reclaim(handle)
                except Exception as e:
                    log.warning("reclaiming %s failed: %s", handle, e)

    # -- introspection -------------------------------------------------------
    def status(self) -> dict:
        now = time.time()
        c = self.counters
        return {
            "coordinator": self.id, "uptime_s": now - self._started, "pid": os.getpid(),
            "pending": self.policy.pending_count, "running": self.policy.running_count,
            "submitted": c.submitted, "completed": c.completed, "failed": c.failed, "retried": c.retried,
            "rejected": c.rejected, "bad_frames": c.bad_frames, "stale_results": c.stale_results,
            "workers_lost": c.workers_lost, "launch_failures": c.launch_failures,
            "recent_launch_failures": [why for _, why in self._launch_failures[-5:]],
            "by_status": dict(c.by_status),
            "starting_workers": len(self._starting),
            "pool": self.pool.explain() if self.pool is not None else "",
            "workers": [
                {"id": w.info.id, "host": w.info.host, "pid": w.info.extra.get("pid"), "handle": w.info.handle, "cores": w.info.cores,
                 "busy_cores": w.busy_cores, "running": len(w.running), "gpus": w.info.gpus,
                 "services": sorted(w.services), "envs": len(w.envs), "draining": w.draining,
                 "last_seen_s": round(now - w.last_seen, 2)}
                for w in self._workers.values()],
        }
