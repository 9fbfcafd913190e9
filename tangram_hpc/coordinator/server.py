"""The coordinator's ZMQ loop: two ROUTER sockets, frames in, the outbox out.

All decisions live elsewhere: the :class:`~.ledger.ActionLedger` keeps the
actions and workers, the :class:`~.pool_driver.PoolDriver` sizes the pool.
This loop decodes each frame into one call on them, flushes their
:class:`~.outbox.Outbox` once per turn and runs the periodic tick.  It drains
each socket in batches, runs the scheduler once per batch and sends one
frame per destination, so the per-action work on the dispatch path is a
decode, a dict insert, a policy call and an encode.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq

from .. import protocol as P
from ..actions import new_action_id
from ..backends.base import WorkerBackend
from ..backends.guards import LaunchThrottle
from ..config import CoordinatorSettings, LaunchSettings
from ..connection import ConnectionInfo
from ..netaddr import advertised_host
from ..policy.base import PoolPolicy, SchedulingPolicy
from ..runlog import RunLog
from ..security import CurveKeys
from .environments import EnvironmentDirectory
from .faults import FrameFaults
from .heartbeats import HeartbeatPace
from .ledger import ActionLedger
from .metrics import CoordinatorMetrics
from .outbox import Outbox
from .pool_driver import PoolDriver
from .registry import WorkerRecord, WorkerRegistry
from .state_dir import StateDir
from .status import status_reply

log = logging.getLogger("tangram.coordinator")

_BATCH = 2000          # messages drained from one socket per loop turn
# While no action is live, workers send only heartbeats (and environment reports, registrations):
# reading them this often rather than each as it comes wakes the loop once for many (2,000 workers
# are 2,000 heartbeats a second, each a wake-up of about 40 us of CPU when read alone).
_IDLE_WORKERS_READ_S = 0.02
_BYE = P.encode(P.STOP, {"reason": "coordinator shutting down", "reregister": False})
_RESULT_SLICE = 5000   # results per RESULT frame
_MORE, _NOW = int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)


class Coordinator:
    """``config`` is the [coordinator] section; ``curve`` the CurveZMQ keys (None: plain TCP);
    the worker arguments go to every CPU / service worker the pool launches, through ``throttle``."""

    def __init__(self, config: CoordinatorSettings, policy: SchedulingPolicy,
                 pool: PoolPolicy | None = None, backend: WorkerBackend | None = None, *,
                 curve: CurveKeys | None = None, cpu_worker_args: tuple[str, ...] = (),
                 service_worker_args: tuple[str, ...] = (), throttle: LaunchThrottle | None = None):
        self.config = config = config.resolved()
        self.curve = curve
        self.policy = policy
        self.backend = backend
        self.id = new_action_id()[:12]
        run_dir = config.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._action_log = RunLog(run_dir / "actions.log")
        self._worker_log = RunLog(run_dir / "workers.log")
        self.outbox = Outbox()
        # Environments and the attempts of unfinished actions outlive a restart (state_dir).
        self.state = StateDir(config.state_dir)
        envs = EnvironmentDirectory(config.env_wait_s)
        attempts = self.state.load(envs, time.time())
        self.ledger = ActionLedger(config, policy, WorkerRegistry(self._worker_log), outbox=self.outbox,
                                   action_log=self._action_log, envs=envs, prior_attempts=attempts)
        self.workers = self.ledger.workers
        self.counters = self.ledger.counters
        self.metrics = CoordinatorMetrics()
        self._metrics_server: Any = None   # the Prometheus endpoint (exporter.MetricsServer), when metrics_port is set
        self.pool_driver = None
        if pool is not None and backend is not None:
            self.pool_driver = PoolDriver(config, pool, backend, self.ledger,
                                          connection_file=str(config.connection_file),
                                          cpu_worker_args=cpu_worker_args,
                                          service_worker_args=service_worker_args,
                                          throttle=throttle or LaunchThrottle(LaunchSettings()))
        self._stop = False
        self._closing = False       # STOP sent to every worker: one registering now is told to stop too
        self._started = time.time()
        self._ctx: zmq.Context | None = None
        self.info: ConnectionInfo | None = None
        self.faults = FrameFaults(self.ledger)
        self._unreachable: set[str] = set()     # workers a send failed to: lost after their last frames
        self._next_heartbeat = 0.0              # time.time() of the next heartbeat to the workers
        self.pace = HeartbeatPace(config.heartbeat_s, config.worker_timeout_s, config.heartbeats_per_s)
        self._heard_until = time.time()         # every frame workers sent before then has been read

    # -- sockets -----------------------------------------------------------
    def bind(self) -> ConnectionInfo:
        cfg = self.config
        if cfg.metrics_port is not None and self._metrics_server is None:
            from .exporter import start_metrics
            self._metrics_server = start_metrics(cfg, self._families, self.id)
        ctx = self._ctx = zmq.Context()
        self.clients = self._router(ctx, mandatory=False)
        self.worker_socket = self._router(ctx, mandatory=True)
        curve = self.curve
        if curve is not None:
            curve.apply_server(self.clients, self.worker_socket, ctx)
        cport = self._bind(self.clients, cfg.client_port)
        wport = self._bind(self.worker_socket, cfg.worker_port)
        host, why = advertised_host(cfg.host, cfg.advertise_host)
        log.info("bound to %s; workers and clients are told %s (%s)", cfg.host, host, why)
        self.info = ConnectionInfo(
            client_address=f"tcp://{host}:{cport}", worker_address=f"tcp://{host}:{wport}",
            coordinator_id=self.id, run_dir=str(cfg.run_dir),
            server_public_key=curve.server_public_text if curve else "",
            client_key_file=str(curve.client_key_file) if curve else "",
            slurm_job_id=os.environ.get("SLURM_JOB_ID", ""))
        self.info.write(cfg.connection_file)
        return self.info

    @property
    def metrics_url(self) -> str | None:
        return self._metrics_server.url if self._metrics_server is not None else None

    def _families(self) -> list:
        """Every metric family, read now (run by the loop for a scrape)."""
        now = time.time()
        self._flush_logs()
        return self.metrics.families(self.ledger, self.pool_driver, now, coordinator=self.id,
                                     uptime_s=now - self._started)

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
        quiet = zmq.Poller()           # the same without the workers' socket
        quiet.register(self.clients, zmq.POLLIN)
        poller.register(self.worker_socket, zmq.POLLIN)
        exporter = self._metrics_server
        if exporter is not None:
            poller.register(exporter.fd, zmq.POLLIN)
            quiet.register(exporter.fd, zmq.POLLIN)
        workers_read_at = 0.0          # monotonic time the workers' frames are next read while idle
        ledger = self.ledger
        next_tick = 0.0
        end = time.monotonic() + stop_after if stop_after else None
        if self.pool_driver is not None:
            self.pool_driver.decide(time.time())
        try:
            while not self._stop:
                now_m = time.monotonic()
                wait = 0.0 if ledger.dirty else max(0.0, next_tick - now_m)
                read_workers = len(ledger) > 0 or now_m >= workers_read_at
                if not read_workers:
                    wait = min(wait, workers_read_at - now_m)
                polled = time.time()
                events = dict((poller if read_workers else quiet).poll(int(wait * 1000) + (0 if wait == 0 else 1)))
                if read_workers:
                    if self.worker_socket not in events or \
                            self._drain(self.worker_socket, self._decode_worker, self._on_worker_frame):
                        self._heard_until = polled   # every frame a worker sent before then has been read
                    if self.worker_socket in events and not len(ledger):
                        workers_read_at = now_m + _IDLE_WORKERS_READ_S
                if self.clients in events:
                    self._drain(self.clients, self._decode_client, self._on_client_frame)
                if exporter is not None and exporter.fd in events:
                    exporter.answer()   # a scrape waits: build the figures now, between two turns
                if self._unreachable:
                    self._lose_unreachable()
                if ledger.dirty:
                    ledger.dispatch(time.time())
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
        if self._ctx is not None:
            self._closing = True
            if self.pool_driver is not None:
                self.pool_driver.cancel_starting(time.time())
            for w in self.workers:
                self._send_worker(w, _BYE)     # one gone already is not waited for
            self._await_workers_leaving()
        self._flush_logs()
        self._flush_state(time.time())
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        if self._ctx is None:
            return
        if self.curve is not None:
            self.curve.stop()
        if self.backend is not None:
            try:
                self.backend.shutdown()
            except Exception:
                log.exception("backend shutdown failed")
        self._ctx.destroy(linger=0)
        self._ctx = None

    def _await_workers_leaving(self) -> None:
        """After STOP: hear the workers out (last results, environments they save) until each has left
        or ``drain_grace_s`` passes, so a restarted coordinator finds their environments."""
        deadline = time.monotonic() + min(self.config.drain_grace_s, 30.0)
        poller = zmq.Poller()
        poller.register(self.worker_socket, zmq.POLLIN)
        while len(self.workers) and time.monotonic() < deadline:
            if poller.poll(100):
                self._drain(self.worker_socket, self._decode_worker, self._on_worker_frame)
            if self._unreachable:
                self._lose_unreachable()
            elif self.pool_driver is not None:
                self.pool_driver.poll(time.time())   # a worker whose process ended has left too
            self.outbox.assign.clear()               # nothing new starts now
            self._flush()

    def _flush_state(self, now: float) -> None:
        try:
            envlife = self.ledger.envlife
            self.state.flush(envlife.directory, envlife.attempt_log, envlife.live_attempts, now)
        except OSError as e:
            log.warning("could not write the state directory %s: %s", self.state.path, e)

    def _drain(self, sock: zmq.Socket, decode, apply) -> bool:
        """Up to a batch of frames from ``sock``: each is decoded and checked by ``decode`` (a frame
        it refuses is answered ERROR), then handled by ``apply`` (a failure there is a bug: see
        :meth:`.FrameFaults.failed`).  True when ``sock`` had no more."""
        for _ in range(_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return True
            ident = frames[0]
            try:
                if len(frames) != 2:
                    raise P.ProtocolError("malformed", "expected exactly one frame")
                mtype, body = decode(ident, frames[1])
            except P.ProtocolError as e:
                self.faults.refused(sock, ident, e)
                continue
            try:
                apply(ident, mtype, body, len(frames[1]))
            except Exception as e:
                self.faults.failed(sock, ident, mtype, body, e, answer=sock is self.clients)
        return False

    # -- frames in ---------------------------------------------------------------
    def _decode_client(self, ident: bytes, frame: bytes) -> tuple[P.MsgType, object]:
        mtype, body = P.decode(frame, P.CLIENT_TYPES, self.config.max_frame_bytes)
        if mtype == P.SUBMIT:   # each action kept packed as it came until it is assigned (ActionLedger.submit)
            return mtype, P.with_packed_items(frame, body)
        if mtype == P.CANCEL or mtype == P.CLOSE_ENV:
            P.check_ids(mtype, body)
        return mtype, body

    def _on_client_frame(self, ident: bytes, mtype: P.MsgType, body, size: int) -> None:
        if mtype == P.SUBMIT:
            self.ledger.submit(ident, body, time.time())
        elif mtype == P.HEARTBEAT:
            self.clients.send_multipart([ident, P.encode(P.HEARTBEAT, {"coordinator": self.id})], zmq.NOBLOCK)
        elif mtype == P.CANCEL:
            self.ledger.cancel(body, time.time())
        elif mtype == P.STATUS:
            st = self.status(allocations=body.get("allocations") is True)
            self.clients.send_multipart([ident, P.encode(P.STATUS, st)], zmq.NOBLOCK)
        elif mtype == P.POOL:
            # Answered with a status either way, so the asking client is never left waiting.
            reply: dict = {"pool_op": None, "pool_error": None}
            if self.pool_driver is None:
                reply["pool_error"] = "this coordinator launches no workers (backend none)"
            else:
                try:
                    reply["pool_op"] = self.pool_driver.control(body.get("op"), time.time())
                except ValueError as e:
                    reply["pool_error"] = str(e)
            self.clients.send_multipart([ident, P.encode(P.STATUS, self.status() | reply)], zmq.NOBLOCK)
        elif mtype == P.HELLO:
            self.clients.send_multipart([ident, P.encode(P.WELCOME, self._welcome())], zmq.NOBLOCK)
        elif mtype == P.CLOSE_ENV:
            self.ledger.close_env(body, time.time())

    def _welcome(self) -> dict:
        c = self.config
        return {"coordinator": self.id, "limits": {
            "max_frame_bytes": c.max_frame_bytes, "max_pending_per_client": c.max_pending_per_client}}

    def _decode_worker(self, ident: bytes, frame: bytes) -> tuple[P.MsgType, object]:
        mtype, body = P.decode(frame, P.WORKER_TYPES, self.config.max_frame_bytes)
        if mtype == P.REGISTER:
            return mtype, self.workers.check(ident, body)     # a WorkerInfo
        if mtype == P.HEARTBEAT:
            P.check_worker_heartbeat(body)
        return mtype, body

    def _on_worker_frame(self, ident: bytes, mtype: P.MsgType, body, size: int) -> None:
        wid = ident.decode("utf-8", "replace")
        now = time.time()
        ledger = self.ledger
        if mtype == P.REGISTER:
            info = body
            w = ledger.add_worker(info, ident, now)
            if self.pool_driver is not None:
                self.pool_driver.joined(w)
            self.pace.update(len(self.workers), now)     # the others hear a new interval at the next tick
            self._send_ident(ident, P.encode(P.WELCOME, {
                "coordinator": self.id, "heartbeat_s": self.pace.interval, "snapshot_dir": str(self.state.snapshots),
                "max_frame_bytes": self.config.max_frame_bytes}))
            log.info("worker %s registered: %d cores, %d GPUs, handle %s", wid, info.cores, info.gpus, info.handle)
            if self._closing:
                # its job started while this coordinator stops (a launch just before the stop):
                # left running, it would hold its allocation until its time limit
                self._send_ident(ident, _BYE)
            return
        if mtype == P.ENV:
            # Fenced by generation and holder, so a worker declared lost may still hand an environment back.
            self._bad_items(ident, "ENV", ledger.env_report(wid, body, now))
            return
        w = self.workers.get(wid)
        if w is None:
            if mtype == P.DONE:
                ledger.done(wid, body, now)  # counted as stale: their actions were retried elsewhere
            if mtype == P.HEARTBEAT and (body.get("left") or body.get("leaving")):
                return   # on its way out (after a drain): nothing to say to it
            # A worker we declared lost (or one from before a restart): it must start over.
            self._send_ident(ident, P.encode(P.STOP, {"reason": "unknown worker: register again",
                                                      "reregister": True}))
            return
        w.last_seen = now
        if mtype == P.DONE:
            self._bad_items(ident, "DONE", ledger.done(wid, body, now, size))
        elif mtype == P.HEARTBEAT:
            if body.get("left"):
                ledger.worker_left(wid, now, str(body.get("left"))[:200], stopped=self._closing)
            elif body.get("leaving"):
                ledger.worker_leaving(wid, str(body.get("leaving"))[:200], now)
            else:
                ledger.worker_report(wid, body, now)
                if self.workers.envs_unknown(w, body):
                    self._send_ident(ident, P.encode(P.HEARTBEAT, {"coordinator": self.id,
                                                                   "send_envs": body["envs_v"]}))
        elif mtype == P.OUTCOMES:
            self._bad_items(ident, "OUTCOMES", ledger.outcomes(wid, body, now))

    def _bad_items(self, ident: bytes, what: str, bad: int) -> None:
        """Items of a worker's list body that failed their check (each skipped alone, the rest handled)."""
        if bad:
            self.faults.refused(self.worker_socket, ident, P.ProtocolError(
                "invalid", f"{bad} malformed {what} item(s) from worker {ident.decode('utf-8', 'replace')} ignored"))

    # -- frames out --------------------------------------------------------------
    def _flush(self) -> None:
        ob = self.outbox
        ledger = self.ledger
        envlife = ledger.envlife
        if envlife.directory.changes or envlife.attempt_log:
            # Before the ASSIGNs that carry them: a coordinator killed after sending a grant must still
            # know the environment when it restarts, or it could grant the same id anew elsewhere.
            self.state.write_changes(envlife.directory, envlife.attempt_log, envlife.live_attempts)
        if ob.to_workers:
            msgs, ob.to_workers = ob.to_workers, []
            for ident, mtype, body in msgs:
                self._send_ident(ident, P.encode(mtype, body))
        if ob.env:   # before the ASSIGNs: an assignment may rely on a keep or a drop of this turn
            out, ob.env = ob.env, {}
            self._send_workers(P.ENV, out)
        if ob.assign:
            out, ob.assign = ob.assign, {}
            self._send_workers(P.ASSIGN, out)
        if ob.kill:
            out, ob.kill = ob.kill, {}
            self._send_workers(P.KILL, out)
        # Clients last: a worker lost while sending above may have finalised actions.
        if ob.results:
            replies, ob.results = ob.results, {}
            send = self.clients.send_multipart
            limit = self.config.max_frame_bytes
            for ident, results in replies.items():
                for i in range(0, len(results), _RESULT_SLICE):
                    # within the frame limit (the client's too): large outputs go in more frames
                    for frame in P.encode_within(P.RESULT, results[i:i + _RESULT_SLICE], limit):
                        try:
                            send([ident, frame], zmq.NOBLOCK)
                        except zmq.ZMQError:
                            pass  # client gone; it resubmits on reconnect and gets cached results
        if ob.to_clients:
            msgs, ob.to_clients = ob.to_clients, []
            for ident, mtype, body in msgs:
                try:
                    self.clients.send_multipart([ident, P.encode(mtype, body)], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def _send_workers(self, mtype: int, out: dict[str, list]) -> None:
        workers = self.workers.by_id
        for wid, items in out.items():
            w = workers.get(wid)
            if w is not None:  # lost since: its actions went back to the policy
                self._send_worker(w, P.encode_assign(items) if mtype == P.ASSIGN else P.encode(mtype, items))

    def _send_worker(self, w: WorkerRecord, frame: bytes) -> None:
        if not self._send_ident(w.ident, frame) and w.info.id in self.workers.by_id:
            # Lost once what it sent before its connection closed has been read (next turn): a worker
            # that leaves hands its environments back in its last frames.
            self._unreachable.add(w.info.id)

    def _lose_unreachable(self) -> None:
        gone, self._unreachable = self._unreachable, set()
        now = time.time()
        if self.pool_driver is not None:
            self.pool_driver.poll(now)  # the backend usually knows why (exit status, job state)
        for wid in gone:
            if wid in self.workers.by_id:
                self.ledger.lose_worker(wid, now, "connection closed", dead=True)

    def _send_ident(self, ident: bytes, frame: bytes) -> bool:
        try:
            # two sends with plain int flags: send_multipart's flag arithmetic on enums costs more than the send
            send = self.worker_socket.send
            send(ident, _MORE)
            send(frame, _NOW)
            return True
        except zmq.ZMQError:     # unreachable: ROUTER_MANDATORY refuses the identity, nothing was queued
            return False

    # -- periodic work -------------------------------------------------------
    def _tick(self, now: float) -> None:
        # Ticks come twice per heartbeat_s; each worker hears from us every other interval, which grows
        # with the number of workers (coordinator/heartbeats.py), and so does the silence that loses one.
        pace = self.pace
        if pace.update(len(self.workers), now):
            self._next_heartbeat = 0.0          # a new interval: told now
        timeout = pace.lost_after(now)
        hb = None
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + pace.to_worker_s * 0.95
            hb = P.encode(P.HEARTBEAT, {"coordinator": self.id, "heartbeat_s": pace.interval})
        # Silence counts until the last instant all workers' frames were read: after a long turn
        # (a large batch dispatched, a status at 2,000 workers) their heartbeats wait unread.
        heard = min(now, self._heard_until)
        for w in self.workers:
            if w.info.id not in self.workers.by_id:
                continue  # lost while this loop ran
            if heard - w.last_seen > timeout:
                self.ledger.lose_worker(w.info.id, now, f"no heartbeat for {now - w.last_seen:.1f}s")
            elif hb is not None:
                self._send_worker(w, hb)
        self.ledger.expire(now)
        if self.pool_driver is not None:
            self.pool_driver.tick(now)
        self.ledger.fail_unplaceable(now)
        self._flush_logs()
        self._flush_state(now)
        self.ledger.dirty = True

    def _flush_logs(self) -> None:
        """Count the finished actions in the metrics, a batch at a time, then write the logs."""
        self.metrics.observe(self._action_log.pending)
        self._action_log.flush()
        self._worker_log.flush()

    # -- introspection -------------------------------------------------------
    def status(self, allocations: bool = False) -> dict:
        now = time.time()
        self._flush_logs()
        return status_reply(self.ledger, self.metrics, self.pool_driver, now, coordinator=self.id,
                            uptime_s=now - self._started, metrics_url=self.metrics_url, allocations=allocations)
