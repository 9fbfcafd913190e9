"""A worker: registers its resources with the coordinator and runs the actions it is assigned.

One thread does all ZMQ I/O.  A fixed pool of executor threads, one per
core, runs CPU actions: each pins itself to the CPU ids granted for the
action before running it (a subprocess forked from that thread inherits the
mask), and hands its outcome back through a deque plus a wake-up pipe that is
written only when the I/O thread might be asleep.  Reward-model actions go to
the :class:`~tangram_hpc.managers.services.ServiceManager` instead, which
batches them on its own device threads.
"""
from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import zmq

from . import protocol as P
from .actions import BUILTIN_KINDS, ActionSpec, Status, ValidationError
from .config import ConfigError, Settings, WorkerSettings
from .connection import ConnectionInfo
from .handlers import FunctionHandler, Handler, resolve

log = logging.getLogger("tangram.worker")

_DEFAULT = WorkerSettings()


@dataclass
class WorkerConfig:
    """A worker's runtime configuration (see :func:`config_from_settings`; defaults from [worker])."""

    connection: ConnectionInfo
    cores: int = _DEFAULT.cores                  # 0: every CPU this process may use
    mem_mb: int = _DEFAULT.mem_mb
    gpus: int = _DEFAULT.gpus
    gpu_mem_mb: int = _DEFAULT.gpu_mem_mb
    handle: str | None = None
    run_dir: str | None = None
    heartbeat_s: float = _DEFAULT.heartbeat_s
    coordinator_timeout_s: float = _DEFAULT.coordinator_timeout_s  # silence after which it registers again
    orphan_exit_s: float = _DEFAULT.orphan_exit_s                  # silence after which it exits
    kinds: tuple[str, ...] = BUILTIN_KINDS
    handlers: dict[str, Handler] = field(default_factory=dict)
    services: Any = None                # a ServiceManager, or None
    max_output_bytes: int = _DEFAULT.max_output_bytes
    worker_id: str | None = None
    unsafe_sandbox: bool = False        # run sandbox commands without bubblewrap (explicit opt-in)
    sandbox_options: dict = field(default_factory=dict)   # more SandboxManager keyword arguments
    snapshot_dir: str | None = None     # shared directory for environment snapshots


class Worker:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.cpus = sorted(os.sched_getaffinity(0))
        self.cores = cfg.cores or len(self.cpus)
        self.id = cfg.worker_id or f"w-{socket.gethostname()}-{os.getpid()}-{os.urandom(2).hex()}"
        run_dir = cfg.run_dir or os.path.join(cfg.connection.run_dir or ".", "worker-" + self.id)
        self.handlers: dict[str, Handler] = {"function": FunctionHandler()}
        self.sandboxes = None
        if "sandbox" in cfg.kinds:
            self.sandboxes = self._sandbox_manager(run_dir)
            self.handlers["sandbox"] = self._run_sandbox
        self.handlers.update(cfg.handlers)
        self.services = cfg.services
        self._free_slots = list(range(self.cores))
        self._running: dict[tuple[str, int], list[int]] = {}   # (action id, attempt) -> core slots
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._done: deque = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._wake_sent = False
        self._stop = False
        self._generation = 0        # bumps on re-registration: older outcomes are not reported
        self._coordinator: str | None = None
        self._registered = False
        self._leaving: str | None = None
        self._exit_code = 0
        self._fast: dict[str, float] = {}   # function target -> recent run time (s)
        self._last_gc = time.monotonic()
        self._cancel_fds: dict[str, int] = {}   # running sandbox action -> write end of its cancel pipe
        self._light: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._executor, args=(self._tasks,), name=f"exec-{i}", daemon=True)
                         for i in range(max(1, self.cores))]
        # Zero-core actions (I/O-bound calls, cheap functions not yet known to be fast) run here,
        # unpinned, so they never wait behind commands holding cores.
        self._threads += [threading.Thread(target=self._executor, args=(self._light,), name=f"light-{i}", daemon=True)
                          for i in range(_LIGHT_THREADS)]

    def _sandbox_manager(self, run_dir: str):
        from .managers.sandbox import SandboxManager
        cfg = self.cfg
        snapshots = cfg.snapshot_dir or os.path.join(cfg.connection.run_dir or run_dir, "snapshots")
        mgr = SandboxManager(os.path.join(run_dir, "envs"), snapshots, unsafe=cfg.unsafe_sandbox,
                             **cfg.sandbox_options)
        mgr.check()  # no bubblewrap and no explicit --unsafe-sandbox: refuse to start, saying why
        return mgr

    def _run_sandbox(self, spec: ActionSpec, cpus: list[int]):
        mgr = self.sandboxes
        if spec.env:
            try:
                mgr.ensure(spec.env)
            except Exception as e:
                return Status.ERROR, None, f"could not restore environment {spec.env} from its snapshot: {e}"
        r, w = os.pipe()
        self._cancel_fds[spec.id] = w
        try:
            o = mgr.run(spec, cpus, cancel_fd=r)
        finally:
            self._cancel_fds.pop(spec.id, None)
            os.close(r)
            os.close(w)
        return o.status, o.output, o.error

    # -- executor threads ---------------------------------------------------
    def _executor(self, tasks: queue.SimpleQueue) -> None:
        pinned: tuple[int, ...] | None = None
        allowed = self.cpus
        handlers = self.handlers
        while True:
            item = tasks.get()
            if item is None:
                return
            spec, attempt, slots, gen = item
            cpus = sorted({allowed[s % len(allowed)] for s in slots}) or allowed
            key = tuple(cpus)
            if key != pinned and slots:
                try:
                    os.sched_setaffinity(0, cpus)
                    pinned = key
                except OSError:
                    pinned = None
            started = time.time()
            t0 = time.perf_counter()
            handler = handlers.get(spec.kind)
            if handler is None:
                outcome = (Status.ERROR, None, f"this worker has no handler for kind {spec.kind!r}")
            else:
                try:
                    outcome = handler(spec, cpus)
                except Exception as e:  # a handler bug must not kill the executor thread
                    outcome = (Status.ERROR, None, f"handler crashed: {type(e).__name__}: {e}")
            target = _target(spec)
            if target is not None:
                self._learn(target, time.perf_counter() - t0)
            self._complete(spec.id, attempt, outcome, started, time.time(), slots, gen)

    def _complete(self, aid: str, attempt: int, outcome, started: float, finished: float,
                  slots: list[int], gen: int) -> None:
        self._done.append((aid, attempt, outcome, started, finished, slots, gen))
        if not self._wake_sent:
            self._wake_sent = True
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass

    # -- I/O loop -----------------------------------------------------------
    def run(self) -> int:
        ctx = zmq.Context()
        self.sock = s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, self.id.encode())
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 200_000)
        s.setsockopt(zmq.RCVHWM, 200_000)
        conn = self.cfg.connection
        if conn.secure:
            from .security import CurveKeys
            CurveKeys.apply_client(s, conn)
        s.connect(conn.worker_address)
        for t in self._threads:
            t.start()
        poller = zmq.Poller()
        poller.register(s, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        hb = self.cfg.heartbeat_s
        last_heard = time.monotonic()
        last_register = 0.0
        next_hb = 0.0
        try:
            while not self._stop:
                now = time.monotonic()
                if not self._registered and now - last_register > hb:
                    self._register()
                    last_register = now
                if now >= next_hb:
                    if self._registered:
                        self._heartbeat()
                    next_hb = now + hb
                    silent = now - last_heard
                    if silent > self.cfg.orphan_exit_s:
                        log.error("no coordinator for %.0fs: exiting", silent)
                        return 3
                    if self._registered and silent > self.cfg.coordinator_timeout_s:
                        log.warning("coordinator silent for %.1fs: registering again", silent)
                        self._registered = False
                events = dict(poller.poll(int(max(0.0, next_hb - now) * 1000) + 1))
                if s in events:
                    if self._drain_socket():
                        last_heard = time.monotonic()
                if self._done:
                    self._send_done()
                if self._leaving:
                    if self._registered:
                        self._send(P.HEARTBEAT, {"leaving": self._leaving})
                    return 0
            return self._exit_code
        finally:
            for t in self._threads:
                (self._light if t.name.startswith("light") else self._tasks).put(None)
            if self.services is not None:
                self.services.close()
            if self.sandboxes is not None:
                self._close_sandboxes()
            ctx.destroy(linger=200)

    def _close_sandboxes(self) -> None:
        # Drained (or leaving): leave every environment where another worker can restore it.
        try:
            paths = self.sandboxes.snapshot_all()
            if paths:
                log.info("snapshotted %d environments for other workers", len(paths))
        except Exception as e:
            log.error("could not snapshot environments: %s", e)
        self.sandboxes.close()

    def _send(self, mtype: int, body: Any) -> None:
        try:
            self.sock.send(P.encode(mtype, body), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("send queue to the coordinator is full; message dropped")

    def _register(self) -> None:
        self._generation += 1
        c = self.cfg
        self._send(P.REGISTER, {
            "id": self.id, "pid": os.getpid(), "cores": self.cores, "mem_mb": c.mem_mb, "gpus": c.gpus,
            "gpu_mem_mb": c.gpu_mem_mb, "kinds": list(c.kinds),
            "services": sorted(self.services.service_names) if self.services is not None else [],
            "handle": c.handle, "host": socket.gethostname(), "partition": os.environ.get("SLURM_JOB_PARTITION")})

    def _heartbeat(self) -> None:
        body: dict[str, Any] = {"running": len(self._running)}
        if self.services is not None:
            body["services"] = sorted(self.services.resident())
        if self.sandboxes is not None:
            body["envs"] = sorted(self.sandboxes.environments())
            now = time.monotonic()
            if now - self._last_gc > 30:
                self._last_gc = now
                # Deleting expired environment trees can take a while: never on the I/O thread.
                threading.Thread(target=self.sandboxes.gc, args=(now,), name="env-gc", daemon=True).start()
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
                if mtype == P.WELCOME:
                    self._registered = True
                    self._coordinator = cid
                elif cid != self._coordinator:
                    self._registered = False  # a new coordinator: join it afresh
            elif mtype == P.KILL:
                self._on_kill(body)
            elif mtype == P.STOP:
                if body.get("reregister"):
                    self._registered = False
                else:
                    log.info("stopping: %s", body.get("reason"))
                    self._stop = True
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

    def _on_assign(self, items: list) -> None:
        gen = self._generation
        for item in items:
            try:
                wire, attempt, ncores = item
                spec = ActionSpec.from_wire(wire)
            except (ValueError, TypeError, ValidationError) as e:
                log.warning("bad assignment: %s", e)
                continue
            n = ncores  # zero-core (light) actions bind no core slot
            free = self._free_slots
            if len(free) >= n:
                slots = free[-n:] if n else []
                del free[len(free) - n:]
            else:  # more granted than free (only after a re-registration): share cores
                slots = free[:] + list(range(n - len(free)))
                free.clear()
            self._running[(spec.id, attempt)] = slots
            if spec.kind == "reward" and self.services is not None:
                self._submit_reward(spec, attempt, slots, gen)
            elif self._fast.get(_target(spec), 1.0) < _INLINE_S:
                self._run_inline(spec, attempt, slots, gen)
            elif ncores == 0:
                self._light.put((spec, attempt, slots, gen))
            else:
                self._tasks.put((spec, attempt, slots, gen))

    def _run_inline(self, spec: ActionSpec, attempt: int, slots: list[int], gen: int) -> None:
        # A function seen to finish in microseconds costs less to run here than the hand-off
        # to an executor thread (a futex wake-up and a GIL switch each way, about 100 us).
        t0 = time.perf_counter()
        started = time.time()
        outcome = self.handlers["function"](spec, [])
        self._learn(spec.payload["fn"], time.perf_counter() - t0)
        self._complete(spec.id, attempt, outcome, started, time.time(), slots, gen)

    def _learn(self, target: str, seconds: float) -> None:
        old = self._fast.get(target)
        # Slow runs demote at once (never hold the I/O thread twice); fast ones promote gradually.
        self._fast[target] = seconds if old is None or seconds > old else 0.8 * old + 0.2 * seconds

    def _submit_reward(self, spec: ActionSpec, attempt: int, slots: list[int], gen: int) -> None:
        started = time.time()
        payload = spec.payload if isinstance(spec.payload, dict) else {}

        def done(_aid, status, output, error, _stats=None):
            self._complete(spec.id, attempt, (status, output, error), started, time.time(), slots, gen)

        self.services.submit(spec.id, spec.demand.service, payload.get("inputs"), done)

    def _on_kill(self, items: list) -> None:
        # A running sandbox command is killed through its cancel pipe and a queued reward request
        # withdrawn; a running Python function cannot be interrupted, and its late result is
        # dropped by the coordinator.
        for item in items:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                continue
            fd = self._cancel_fds.get(item[0])
            if fd is not None:
                try:
                    os.write(fd, b"\0")
                except OSError:
                    pass  # it just finished
            elif self.services is not None:
                self.services.cancel(item[0])

    def _send_done(self) -> None:
        self._wake_sent = False
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        out = []
        done = self._done
        gen = self._generation
        free = self._free_slots
        while done:
            aid, attempt, (status, output, error), started, finished, slots, g = done.popleft()
            if self._running.pop((aid, attempt), None) is not None:
                free.extend(slots)
            if g == gen:
                out.append([aid, attempt, status, output, error, started, finished])
        if out:
            try:
                frame = P.encode(P.DONE, out)
            except Exception:
                frame = P.encode(P.DONE, [self._packable(o) for o in out])
            if len(frame) > self.cfg.max_output_bytes:
                frame = P.encode(P.DONE, [self._packable(o) for o in out])
            try:
                self.sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                log.error("coordinator queue full: %d results dropped (they will be retried)", len(out))

    def _packable(self, item: list) -> list:
        try:
            n = len(msgpack.packb(item, use_bin_type=True))
        except Exception as e:
            return item[:2] + [Status.FAILED, None, f"action output cannot be serialised: {e}"] + item[5:]
        if n > self.cfg.max_output_bytes:
            return item[:2] + [Status.FAILED, None, f"action output of {n} bytes exceeds the limit of "
                               f"{self.cfg.max_output_bytes}"] + item[5:]
        return item

    def leave(self, reason: str) -> None:
        """Tell the coordinator this worker is going away (SIGTERM, preemption) and stop."""
        self._leaving = reason
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass


def _target(spec: ActionSpec) -> str | None:
    # The payload comes from a client: a target that is not a string (a list is unhashable) is the
    # handler's error to report, never a reason for this loop to fail.
    fn = spec.payload.get("fn") if spec.kind == "function" and isinstance(spec.payload, dict) else None
    return fn if isinstance(fn, str) else None


#: Functions whose recent run time is below this run inline on the I/O thread.
_INLINE_S = 200e-6
#: Threads for zero-core actions.
_LIGHT_THREADS = 4

_FROM_COORDINATOR = frozenset({P.WELCOME, P.ASSIGN, P.KILL, P.STOP, P.HEARTBEAT, P.ERROR})


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .config_cli import add_arguments as add_config_arguments
    add_config_arguments(p, "worker")


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    from .config_cli import settings_from_args
    return config_from_settings(settings_from_args(args))


def config_from_settings(settings: Settings) -> WorkerConfig:
    """The runtime configuration of a worker: its [worker], [sandbox] and [services] sections."""
    from .actions import register_kind
    ws, ss, sv = settings.worker, settings.sandbox, settings.services
    if not ws.connection_file:
        raise ConfigError("a worker needs its coordinator's connection file: --connection-file, "
                          "$TANGRAM_CONNECTION_FILE or [worker] connection_file")
    handlers: dict[str, Callable] = {}
    kinds = list(dict.fromkeys(ws.kinds))
    for h in ws.handler:
        kind, _, target = h.partition("=")
        register_kind(kind)
        handlers[kind] = resolve(target)
        if kind not in kinds:
            kinds.append(kind)
    services = None
    gpus, gpu_mem = ws.gpus, ws.gpu_mem_mb
    if sv.file or sv.service:
        from .managers.devices import discover_devices
        from .managers.service_spec import specs_from_cli
        from .managers.services import ServiceManager
        services = ServiceManager(specs_from_cli(sv.file, sv.service), discover_devices(cpu_budget_mb=sv.budget_mb))
        if sv.preload:
            services.preload()
        gpus = gpus or sum(d.name != "cpu" for d in services.devices)
        gpu_mem = gpu_mem or int(services.capacity_mb())
    elif "reward" in kinds:
        kinds.remove("reward")  # nothing to score with
    return WorkerConfig(connection=ConnectionInfo.read(ws.connection_file), cores=ws.cores, mem_mb=ws.mem_mb,
                        gpus=gpus, gpu_mem_mb=gpu_mem, handle=ws.handle,
                        run_dir=str(ws.run_dir) if ws.run_dir else None, heartbeat_s=ws.heartbeat_s,
                        coordinator_timeout_s=ws.coordinator_timeout_s, orphan_exit_s=ws.orphan_exit_s,
                        kinds=tuple(kinds), handlers=handlers, services=services,
                        max_output_bytes=ws.max_output_bytes, unsafe_sandbox=ss.unsafe,
                        snapshot_dir=str(ss.snapshot_dir) if ss.snapshot_dir else None,
                        sandbox_options={"allow_network": ss.allow_network, "warm_pool": ss.warm_pool,
                                         "env_ttl": ss.env_ttl_s})


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
