"""A worker: registers its resources with the coordinator and runs the actions it is assigned.

One thread at a time holds the *I/O role*: it does all ZMQ I/O.  A fixed
pool of executor threads, one per core, runs CPU actions: each pins itself to
the CPU ids granted for the action before running it (a subprocess forked from
that thread inherits the mask), and hands its outcome back through a deque
plus a wake-up pipe that is written only when the I/O thread might be asleep.
A function seen to return in microseconds runs on the I/O thread itself (a
hand-off would cost more than the call); a *standby* thread takes the I/O role
over when such a call overruns (:data:`_OVERRUN_S`), so heartbeats and other
actions never wait on user code, and the thread stuck in the call stands by
once it returns.  Reward-model actions go to the
:class:`~tangram_hpc.managers.services.ServiceManager` instead, which batches
them on its own device threads.

What the coordinator's messages mean here (attempts, their core slots, generations, where each
outcome goes) is the socket-free :class:`~tangram_hpc.worker_session.WorkerSession`'s; a killed
call keeps its cores until it returns, listed in each heartbeat (``killed_running``).

Environments follow the coordinator's grants (:class:`~tangram_hpc.managers.env_host.EnvHost`,
whose ``run`` takes an attempt from the grant to the journal, before its DONE is sent).
Outcomes of attempts that ended under an earlier registration (the coordinator restarted, or
declared this worker lost while it hung) are sent again as OUTCOMES once it welcomes us back.  Leaving (SIGTERM, Slurm's time-limit signal, STOP)
means: no new actions, ``leave_grace_s`` for the running ones, interrupt the
rest (the coordinator retries them), hand every environment back by snapshot,
say it has left.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from typing import Any

import zmq

from . import protocol as P
from .config import ConfigError
from .connection import ConnectionInfo, reread_connection
from .daemon import tune_gc
from .handlers import FunctionHandler, Handler
# the configuration lives in worker_config; named here too, where callers have imported it from
from .worker_config import (WorkerConfig, add_arguments, config_from_args, config_from_settings,  # noqa: F401
                            sandbox_limits, sandbox_templates)
from .worker_exec import Executors, target as _target
from .worker_frames import DoneFrames
from .worker_sandboxes import WorkerSandboxes
from .worker_session import Start, WorkerSession

log = logging.getLogger("tangram.worker")


class Worker:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.cpus = sorted(os.sched_getaffinity(0))
        self.cores = cfg.cores or len(self.cpus)
        self.id = cfg.worker_id or f"w-{socket.gethostname()}-{os.getpid()}-{os.urandom(2).hex()}"
        run_dir = cfg.run_dir or os.path.join(cfg.connection.run_dir or ".", "worker-" + self.id)
        #: kind -> handler (the executors run them; shared, so a handler added later is used)
        self.handlers: dict[str, Handler] = {"function": FunctionHandler()}
        handlers = self.handlers
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._wake_sent = False
        # what the coordinator's messages mean here: attempts, their slots, generations, outcomes' routes
        self.session = WorkerSession(self.cores, self._item_limit)
        self._leave_signalled = threading.Event()
        #: the sandbox side (its manager and environments), on a worker of the sandbox kind
        self.boxes: WorkerSandboxes | None = None
        self.sandboxes = self.envs = None
        if "sandbox" in cfg.kinds:
            self.boxes = WorkerSandboxes(cfg, run_dir, self._wake, lambda: self.session.leaving is not None,
                                         self._leave_signalled, self._item_limit)
            self.sandboxes, self.envs = self.boxes.mgr, self.boxes.envs
            handlers["sandbox"] = self.boxes.run
        handlers.update(cfg.handlers)
        self.services = cfg.services
        self._stop = False
        self._coordinator: str | None = None
        self._registered = False
        self._exit_code = 0
        self.frames = DoneFrames()
        self.executors = Executors(self.cores, self.cpus, handlers, self.session, self.boxes, self._wake)
        # The I/O role (see the module docstring): who holds it, whether it is in a user call, since when.
        self._io_lock = threading.Lock()
        self._io_owner: int | None = None
        self._call_since: float | None = None
        self._call_target: str | None = None
        self._standbys = 0
        self._main_thread: int | None = None
        self._handoff: deque = deque()   # attempts to start that a thread left when it lost the role
        self._finished = threading.Event()
        self._max_frame = P.MAX_FRAME_BYTES           # the coordinator's frame limit (its WELCOME says)
        # The heartbeat interval and the coordinator's silence limit: this worker's own, or longer where the
        # coordinator says so (it lengthens the interval with the number of workers; the limit follows).
        self._hb_s = cfg.heartbeat_s
        self._silence_s = cfg.coordinator_timeout_s
        self._last_heard_wall = time.time()
        self._leave_deadline: float | None = None   # leaving: when its next step is due
        self._handed_back: threading.Event | None = None

    def _wake(self) -> None:
        if not self._wake_sent:
            self._wake_sent = True
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass

    # -- I/O loop -----------------------------------------------------------
    def run(self) -> int:
        self._ctx = ctx = zmq.Context()
        self.sock = s = self._dealer(self.cfg.connection)
        self.executors.start()
        self._poller = zmq.Poller()
        self._poller.register(s, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._last_heard = time.monotonic()
        self._last_register = 0.0
        self._next_hb = 0.0
        self._main_thread = self._io_owner = threading.get_ident()
        self._start_standby()
        try:
            return self._serve()
        finally:
            self._finished.set()
            self.executors.stop()
            if self.services is not None:
                self.services.close()
            if self.boxes is not None:
                self.boxes.close(self._handed_back is not None)
            ctx.destroy(linger=200)

    def _dealer(self, conn: ConnectionInfo) -> zmq.Socket:
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, self.id.encode())
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 200_000)
        s.setsockopt(zmq.RCVHWM, 200_000)
        if conn.secure:
            from .security import CurveKeys
            CurveKeys.apply_client(s, conn)
        s.connect(conn.worker_address)
        return s

    def _leave_if_stuck(self, now: float) -> None:
        """Leave when an attempt the coordinator killed still runs ``stuck_leave_s`` later.

        A Python function or a reward model's ``score()`` cannot be interrupted: one that never
        returns holds its thread (for a service, the device's only scoring thread, so every call
        behind it waits) for the life of the process.  Leaving hands the environments back and lets
        the coordinator retry the other actions elsewhere; a backend starts a fresh worker.
        """
        key, since = min(self.session.killed.items(), key=lambda kv: kv[1])
        if now - since <= self.cfg.stuck_leave_s:
            return
        why = (f"action {key[0]} (attempt {key[1]}) still runs {now - since:.0f}s after it was killed: a call that "
               f"does not return holds its thread")
        log.error("%s; leaving so that a fresh worker takes over", why)
        self.leave(why, by_signal=False)

    def _follow_moved_coordinator(self) -> bool:
        """After a silence: connect to where the connection file now says the coordinator is.

        A coordinator restarted elsewhere (another node, new ports, new keys: a requeued Slurm
        job) writes a new connection file; a worker started by hand would otherwise knock at the
        old address until ``orphan_exit_s``.  Workers a backend launched stay with the coordinator
        that launched them: a new one does not know their jobs and launches its own.
        """
        c = self.cfg
        if not c.connection_file or c.handle:
            return False
        info = reread_connection(c.connection_file, c.connection, c.connection.worker_address, worker=True)
        if info is None:
            return False
        log.warning("the connection file %s names another coordinator (%s): connecting there",
                    c.connection_file, info.worker_address)
        self._poller.unregister(self.sock)
        self.sock.close(0)
        c.connection = info
        self.sock = self._dealer(info)
        self._poller.register(self.sock, zmq.POLLIN)
        self._registered = False
        self._last_register = 0.0
        self._last_heard = time.monotonic()
        return True

    def _serve(self) -> int | None:
        """Hold the I/O role, or stand by to take it over, until the loop ends; returns its exit code.

        A spare standby thread returns None when another one already stands by.
        """
        me = threading.get_ident()
        while True:
            if self._io_owner == me:
                try:
                    code = self._io_loop()
                except BaseException:   # a bug: end the worker (as before) rather than leave it deaf
                    log.exception("the worker's I/O loop failed")
                    self._exit_code = 1
                    self._finished.set()
                    raise
                if code is not None:
                    self._exit_code = code
                    self._finished.set()
                    return code
                with self._io_lock:   # lost the role during a call that overran: stand by
                    if self._standbys and me != self._main_thread:
                        return None
                    self._standbys += 1
            elif self._finished.wait(_STANDBY_CHECK_S):
                return self._exit_code
            else:
                self._take_over_if_overrun(me)

    def _take_over_if_overrun(self, me: int) -> None:
        with self._io_lock:
            since = self._call_since
            if since is None or time.perf_counter() - since < _OVERRUN_S:
                return
            self._io_owner = me
            self._call_since = None
            self._standbys -= 1
            spare_needed = self._standbys == 0
            target = self._call_target
        if target is not None:   # no longer fast: its next calls go to executor threads
            self.executors.fast[target] = max(self.executors.fast.get(target, 0.0), _FAST_S)
        if spare_needed:
            self._start_standby()

    def _start_standby(self) -> None:
        with self._io_lock:
            self._standbys += 1
        threading.Thread(target=self._serve, name="io-standby", daemon=True).start()

    def _io_loop(self) -> int | None:
        """The I/O loop; returns the worker's exit code, or None when the I/O role was taken over."""
        s = self.sock
        try:
            while not self._stop:
                while self._handoff:
                    starts = self._handoff.popleft()
                    if starts[0].gen == self.session.generation:
                        self._start(starts)
                now = time.monotonic()
                hb = self._hb_s
                if not self._registered and now - self._last_register > hb and self.session.leaving is None:
                    self._register()
                    self._last_register = now
                if now >= self._next_hb:
                    if self._registered:
                        self._heartbeat()
                    self._next_hb = now + hb
                    silent = now - self._last_heard
                    if silent > self.cfg.orphan_exit_s:
                        log.error("no coordinator for %.0fs: exiting", silent)
                        return 3
                    if self.session.killed and self.session.leaving is None and self.cfg.stuck_leave_s:
                        self._leave_if_stuck(now)
                    if silent > self._silence_s and self._follow_moved_coordinator():
                        s = self.sock
                    elif self._registered and silent > self._silence_s:
                        log.warning("coordinator silent for %.1fs: registering again", silent)
                        self._registered = False
                wait_s = self._next_hb - now
                if self.frames.unsent:
                    wait_s = min(wait_s, _RESEND_S)
                if self.session.leaving is not None:
                    wait_s = min(wait_s, _LEAVE_STEP_S)
                events = dict(self._poller.poll(int(max(0.0, wait_s) * 1000) + 1))
                if s in events:
                    if self._drain_socket():
                        self._last_heard = time.monotonic()
                        self._last_heard_wall = time.time()
                if self.envs is not None:
                    early = self.envs.take_replies(before_done=True)
                    if early:
                        self._send(P.ENV, early)
                if self.session.done or self.frames.unsent:
                    self._send_done()
                if self.envs is not None:
                    replies = self.envs.take_replies()
                    if replies:
                        self._send(P.ENV, replies)
                if self.session.leaving is not None:
                    code = self._leave_step()
                    if code is not None:
                        return code
            return self._exit_code
        except _IORoleLost:
            return None

    def _leave_step(self) -> int | None:
        """One step of leaving (see the module docstring); the exit code once this worker has left."""
        now = time.monotonic()
        session = self.session
        if self._leave_deadline is None:
            self._leave_deadline = now + self.cfg.leave_grace_s
            log.info("leaving (%s): %d running actions get %.0fs to finish", session.leaving, len(session.running),
                     self.cfg.leave_grace_s)
            if self._registered:
                self._send(P.HEARTBEAT, {"leaving": session.leaving})
        if session.running:
            if now < self._leave_deadline:
                return None
            if not session.leave_killed:   # interrupt what still runs; the coordinator retries it
                self._leave_deadline = now + _LEAVE_KILL_WAIT_S
                for aid, _, _ in session.interrupt_running():
                    self._cancel(aid)
                return None
            if now < self._leave_deadline:
                return None   # a Python function cannot be interrupted: it is reported interrupted below
        if self._handed_back is None:
            if self.envs is None:
                self._handed_back = threading.Event()
                self._handed_back.set()
            else:
                self._handed_back = self.envs.hand_back_all()
            return None
        if not self._handed_back.is_set():
            return None
        if self.envs is not None:
            replies = self.envs.take_replies()
            if replies:
                self._send(P.ENV, replies)
        interrupted = session.interrupted_attempts()
        if self._registered:
            self._send(P.HEARTBEAT, {"left": session.leaving, "interrupted": interrupted})
        log.info("left (%s); %d attempts interrupted", session.leaving, len(interrupted))
        return 0

    def _send(self, mtype: int, body: Any) -> None:
        self._send_frame(P.encode(mtype, body))

    def _send_frame(self, frame: bytes) -> None:
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("send queue to the coordinator is full; message dropped")

    def _register(self) -> None:
        self.session.register()
        self.frames.registering(self._last_heard_wall)
        c = self.cfg
        self._send(P.REGISTER, {
            "id": self.id, "pid": os.getpid(), "cores": self.cores, "mem_mb": c.mem_mb, "gpus": c.gpus,
            "gpu_mem_mb": c.gpu_mem_mb, "kinds": list(c.kinds),
            "services": sorted(self.services.service_names) if self.services is not None else [],
            "handle": c.handle, "host": socket.gethostname(), "partition": os.environ.get("SLURM_JOB_PARTITION"),
            **(self.boxes.register_fields() if self.boxes is not None else {"envs": [], "env_root": None})})

    def _welcomed(self, body: dict) -> None:
        self._registered = True
        self._coordinator = body.get("coordinator")
        limit = body.get("max_frame_bytes")
        if type(limit) is int and limit > 0:
            self._max_frame = limit
        if self.boxes is not None:
            self.boxes.welcomed(self._item_limit(), body.get("snapshot_dir"))
        self.session.older.extend(self.frames.take_older())
        self._send_older()

    def _send_older(self) -> None:
        """Outcomes of earlier registrations, for the coordinator to match with actions still waiting."""
        session = self.session
        if session.older and self._registered:
            older, session.older = session.older, []
            for i in range(0, len(older), 500):     # items, each within the limit
                for frame in P.encode_outcomes(P.OUTCOMES, older[i:i + 500], self._max_frame):
                    self._send_frame(frame)

    def _heartbeat(self) -> None:
        body = self.session.heartbeat()
        if self.services is not None:
            body["services"] = sorted(self.services.resident())
            queued = self.services.pending()
            stats = self.services.stats()
            body["service_counts"] = {name: [s["loads"], s["evictions"], queued.get(name, 0)]
                                      for name, s in stats.items()}
            # Measured seconds to load and evict each service, for the scheduler's load decisions.
            body["service_costs"] = {name: [s["load_s_mean"], s["evict_s_mean"] or 0.0]
                                     for name, s in stats.items() if s["load_s_mean"] is not None}
            # Per device: memory the services hold, the budget, what is really free (-1: not known).
            body["devices"] = [[d["device"], d["used_mb"], d["budget_mb"],
                                -1.0 if d["free_mb"] is None else d["free_mb"], d["resident"]]
                               for d in self.services.device_stats()]
        if self.boxes is not None:
            self.boxes.heartbeat(body)
        self._send(P.HEARTBEAT, body)

    def _drain_socket(self) -> bool:
        heard = False
        for _ in range(1000):
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            heard = True
            try:
                mtype, body = P.decode(frame, _FROM_COORDINATOR)
            except P.ProtocolError as e:
                log.warning("bad frame from the coordinator: %s", e)
                continue
            if mtype == P.ASSIGN:
                self._on_assign(body)
            elif mtype == P.HEARTBEAT or mtype == P.WELCOME:
                cid = body.get("coordinator")
                if "heartbeat_s" in body:
                    self._paced(body)
                if mtype == P.WELCOME:
                    self._welcomed(body)
                elif cid != self._coordinator:
                    self._registered = False  # a new coordinator: join it afresh
                elif "send_envs" in body and self.boxes is not None:
                    self.boxes.send_envs()
            elif mtype == P.KILL:
                self._on_kill(body)
            elif mtype == P.ENV:
                if self.envs is not None:
                    self.envs.apply(body)
            elif mtype == P.PREFETCH:
                self._on_prefetch(body)
            elif mtype == P.STOP:
                if body.get("reregister"):
                    if self.session.leaving is None:
                        self._registered = False
                elif self.session.leaving is None:
                    log.info("stopping: %s", body.get("reason"))
                    self.leave(str(body.get("reason") or "stopped"), by_signal=False)
            elif mtype == P.ERROR:
                if not self._registered:
                    # Our REGISTER was refused: retrying would be refused forever, so exit and let
                    # the backend report a failed start.
                    log.error("the coordinator refused this worker: %s", body.get("message"))
                    self._stop = True
                    self._exit_code = 2
                else:
                    log.warning("coordinator error: %s", body.get("message"))
        return heard

    def _paced(self, body: dict) -> None:
        """The interval the coordinator wants (it grows with the number of workers): never shorter than this
        worker's own, and the coordinator's silence limit as many times longer."""
        told = P.heartbeat_interval(body)
        if told is None:
            log.warning("ignored a heartbeat interval from the coordinator: %.40r", body.get("heartbeat_s"))
            return
        cfg = self.cfg
        hb = max(cfg.heartbeat_s, told)
        if hb != self._hb_s:
            self._next_hb = min(self._next_hb, time.monotonic() + hb)
            self._hb_s = hb
            self._silence_s = cfg.coordinator_timeout_s * hb / cfg.heartbeat_s

    def _on_prefetch(self, body: list) -> None:
        """The scheduler's prefetch: load these services now (a hint; names this worker does not host
        are ignored, a malformed body is logged and dropped)."""
        try:
            names = P.check_prefetch(body)
        except P.ProtocolError as e:
            log.warning("bad PREFETCH from the coordinator: %s", e)
            return
        if self.services is not None:
            hosted = self.services.service_names
            self.services.preload([n for n in names if n in hosted])

    def _on_assign(self, items: list) -> None:
        self._start(self.session.assign(items, time.time()))

    def _start(self, starts: list[Start]) -> None:
        fast = self.executors.fast
        for i, task in enumerate(starts):
            spec = task[0]     # Start.spec
            if spec.kind == "reward" and self.services is not None:
                self.executors.submit_reward(self.services, spec, task.attempt, task.slots, task.gen)
            elif fast.get(_target(spec), 1.0) < _FAST_S:
                try:
                    self._run_inline(task)
                except _IORoleLost:   # the standby holds the I/O role now: it starts the rest
                    if i + 1 < len(starts):
                        self._handoff.append(starts[i + 1:])
                    self._wake()
                    raise
            else:
                self.executors.put(task)

    def _run_inline(self, task: tuple) -> None:
        # A function seen to finish in microseconds costs less to run here than the hand-off to
        # an executor thread (a wake-up and a GIL switch each way).  If it overruns, the standby
        # thread takes the I/O role over meanwhile, and this thread must then let go of it.
        self._call_target = _target(task[0])
        self._call_since = time.perf_counter()
        try:
            self.executors.execute(task, [])
        finally:
            with self._io_lock:
                self._call_since = None
                kept = self._io_owner == threading.get_ident()
        if not kept:
            raise _IORoleLost

    def _on_kill(self, items: list) -> None:
        # A running sandbox command is killed through its cancel pipe and a queued reward request
        # withdrawn; a running Python function cannot be interrupted: it keeps its cores, is
        # listed in heartbeats as killed but running, and its DONE tells the coordinator it ended.
        for key in self.session.kill(items, time.monotonic()):
            if self._cancel(key[0]):
                self.session.withdrawn(key, time.time())
                self._wake()

    def _cancel(self, aid: str) -> bool:
        """Kill a running sandbox command through its cancel pipe; withdraw a queued reward request
        (True: withdrawn, and no outcome of it will come)."""
        if self.boxes is not None:
            self.boxes.cancel(aid)
        return self.services is not None and self.services.cancel(aid)

    def _send_done(self) -> None:
        self._wake_sent = False
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        out = self.session.take()
        if out:
            for frame in P.encode_outcomes(P.DONE, out, self._max_frame):
                self.frames.queue(frame, self.session.generation)
        if self.session.older:
            self._send_older()
        self.frames.flush(self.sock)
        if self.boxes is not None:
            self.boxes.replied()

    def _item_limit(self) -> int:
        """The largest outcome sent: ``max_output_bytes``, and within the coordinator's frame limit."""
        return min(self.cfg.max_output_bytes, self._max_frame - min(1024, self._max_frame // 4))

    def leave(self, reason: str, *, by_signal: bool = True) -> None:
        """Leave: no new actions, the running ones get ``leave_grace_s``, the environments are handed
        back, then the worker exits.  ``by_signal``: the job is being killed (SIGTERM, Slurm's time-limit
        signal), so an action that fails meanwhile was likely killed by it too and is retried."""
        self.session.leave(reason, by_signal)
        self._leave_signalled.set()
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass


#: Functions whose recent run time is below this run on the I/O thread.
_FAST_S = 200e-6
#: A call on the I/O thread running longer than this has overrun: the standby takes the I/O role.
_OVERRUN_S = 0.02
#: How often the standby thread looks for an overrun (more often costs the round trip measurably).
_STANDBY_CHECK_S = 0.05
#: How often the I/O loop tries again while DONE frames wait for room in the send queue.
_RESEND_S = 0.01
#: How often a leaving worker looks whether it may go on to the next step.
_LEAVE_STEP_S = 0.05
#: How long a leaving worker waits for the attempts it interrupted to end.
_LEAVE_KILL_WAIT_S = 5.0


class _IORoleLost(Exception):
    """Raised on a thread whose user call overran while the standby took the I/O role over."""

_FROM_COORDINATOR = frozenset({P.WELCOME, P.ASSIGN, P.KILL, P.STOP, P.HEARTBEAT, P.ERROR, P.ENV, P.PREFETCH})


def run_worker(cfg: WorkerConfig) -> int:
    from .managers.bwrap import BwrapUnavailable
    try:
        w = Worker(cfg)
    except BwrapUnavailable as e:
        print(f"tangram-hpc worker: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: w.leave("SIGTERM"))
    signal.signal(signal.SIGINT, lambda *_: w.leave("SIGINT"))
    # Slurm sends SIGUSR2 (submitit asks for it) shortly before the time limit.
    signal.signal(signal.SIGUSR2, lambda *_: w.leave("time limit"))
    tune_gc(older=(10, 10))
    return w.run()


def worker_main(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except (ConfigError, OSError) as e:   # a bad setting, or no connection file (yet)
        print(f"tangram-hpc worker: error: {e}", file=sys.stderr)
        return 2
    return run_worker(cfg)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tangram-hpc worker", description="Run a tangram-hpc worker.")
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return worker_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
