"""Assembling and starting a coordinator: from the command line, or embedded in Python.

:func:`build_coordinator` turns options into a coordinator with its policy,
pool policy and backend.  :class:`LocalCluster` runs one in a child process
with local workers, for notebooks, tests and the demo::

    with LocalCluster(workers=2, cores=2) as cluster, cluster.client() as c:
        print(c.map([function("math:factorial", 10)]))
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .connection import ConnectionInfo, wait_for_file
from .coordinator import Coordinator, CoordinatorConfig
from .policy.base import SchedulingPolicy
from .policy.static import StaticPool
from .resources import WorkerShape
from .security import CurveKeys, is_loopback

log = logging.getLogger("tangram.launch")


def default_run_dir() -> Path:
    base = os.environ.get("TANGRAM_RUN_DIR") or os.path.join(os.path.expanduser("~"), ".tangram", "runs")
    return Path(base) / time.strftime(f"%Y%m%d-%H%M%S-{os.getpid()}")


def make_policy(name: str) -> SchedulingPolicy:
    if name == "fifo":
        from .policy.fifo import FifoPolicy
        return FifoPolicy()
    if name == "elastic":
        from .policy.elastic import ElasticScheduler
        return ElasticScheduler()
    raise ValueError(f"unknown policy {name!r} (choose elastic or fifo)")


def add_coordinator_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where")
    g.add_argument("--run-dir", type=Path, help="directory for logs, keys and environments "
                   "(default $TANGRAM_RUN_DIR/<time> or ~/.tangram/runs/<time>)")
    g.add_argument("--connection-file", type=Path,
                   help="where to write the connection file (default RUN_DIR/connection.json); an existing "
                        "one is reused, ports included, so clients and workers find a restarted coordinator")
    g.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1 with the local backend, "
                   "all interfaces with Slurm)")
    g.add_argument("--insecure", action="store_true",
                   help="plain TCP without CurveZMQ keys; only allowed when binding to loopback (tests)")
    g.add_argument("--client-port", type=int, default=0)
    g.add_argument("--worker-port", type=int, default=0)
    g = p.add_argument_group("workers")
    g.add_argument("--backend", choices=("local", "slurm", "none"), default="local",
                   help="who starts workers: processes on this machine (default), Slurm jobs, or nobody "
                        "(workers started by hand with 'tangram-hpc worker')")
    g.add_argument("--workers", type=int, default=2, help="CPU workers to keep (local backend; default 2)")
    g.add_argument("--worker-cores", type=int, default=0, help="cores per CPU worker (default: all CPUs)")
    g.add_argument("--worker-mem-mb", type=int, default=0)
    g.add_argument("--reward-workers", type=int, default=0,
                   help="reward-model service workers to keep (local backend; default 0)")
    g.add_argument("--services", metavar="FILE", help="services TOML for the reward workers")
    g.add_argument("--service", action="append", default=[], metavar="NAME=MODULE:LOADER[,KEY=VALUE...]",
                   help="declare one service for the reward workers (repeatable)")
    g.add_argument("--service-budget-mb", type=int, default=4096,
                   help="device memory of a reward worker, or its host-RAM stand-in without GPUs (default 4096)")
    g = p.add_argument_group("scheduling")
    g.add_argument("--policy", choices=("elastic", "fifo"), default=os.environ.get("TANGRAM_POLICY", "elastic"),
                   help="placement policy")
    g.add_argument("--max-attempts", type=int, default=3, help="attempts per action across worker losses")
    g.add_argument("--worker-timeout", type=float, default=5.0, help="seconds of silence before a worker is lost")
    g.add_argument("--heartbeat", type=float, default=1.0)
    g = p.add_argument_group("limits")
    g.add_argument("--max-pending-per-client", type=int, default=200_000,
                   help="unfinished actions one client may have (default 200,000)")
    g.add_argument("--max-pending", type=int, default=1_000_000, help="unfinished actions in all (default 1,000,000)")
    g.add_argument("--max-frame-bytes", type=int, default=16 << 20, help="largest frame accepted (default 16 MiB)")
    from .backends.slurm import add_slurm_arguments
    add_slurm_arguments(p)


def build_coordinator(args: argparse.Namespace) -> Coordinator:
    run_dir = args.run_dir or default_run_dir()
    host = args.host or ("0.0.0.0" if args.backend == "slurm" else "127.0.0.1")
    cfg = CoordinatorConfig(run_dir=run_dir, connection_file=args.connection_file, host=host,
                            client_port=args.client_port, worker_port=args.worker_port,
                            heartbeat_s=args.heartbeat, worker_timeout_s=args.worker_timeout,
                            max_attempts=args.max_attempts, max_pending_per_client=args.max_pending_per_client,
                            max_pending_total=args.max_pending, max_frame_bytes=args.max_frame_bytes)
    if args.insecure:
        if not is_loopback(host):
            raise SystemExit(f"--insecure is only allowed on a loopback address, not {host}: anyone on the "
                             "network could submit code to run under your account")
    else:
        cfg.curve = CurveKeys.load_or_create(Path(cfg.run_dir) / "keys")
    _reuse_ports(cfg)
    svc: list[str] = ["--services", str(Path(args.services).resolve())] if args.services else []
    for opt in args.service:
        svc += ["--service", opt]
    cfg.service_worker_args = tuple(svc + ["--kinds", "reward", "--service-budget-mb", str(args.service_budget_mb)])
    backend = pool = None
    policy = make_policy(args.policy)
    if args.backend == "local":
        from .backends.local import LocalBackend
        backend = LocalBackend(Path(cfg.run_dir) / "workers")
        shape = WorkerShape(cores=args.worker_cores or len(os.sched_getaffinity(0)), mem_mb=args.worker_mem_mb)
        reward = WorkerShape(cores=1, gpu_mem_mb=args.service_budget_mb)
        pool = StaticPool([shape] * args.workers + [reward] * args.reward_workers)
    elif args.backend == "slurm":
        backend, pool = _slurm(args, cfg, policy)
    if pool is not None:
        # An action larger than every shape the pool can provide fails at once with the reason
        # instead of waiting forever (with --backend none any size of worker may still join).
        policy.set_shapes(pool.shapes)
    return Coordinator(cfg, policy, pool=pool, backend=backend)


def _slurm(args: argparse.Namespace, cfg: CoordinatorConfig, policy: SchedulingPolicy):
    from .backends.slurm import backend_from_args, pool_from_args
    backend = backend_from_args(args, run_dir=cfg.run_dir)
    # The pool sizes itself with the durations the scheduler learns.
    return backend, pool_from_args(args, getattr(policy, "predictor", None))


def _reuse_ports(cfg: CoordinatorConfig) -> None:
    """A restarted coordinator takes the ports of the connection file it finds."""
    if cfg.client_port or cfg.worker_port or not cfg.connection_file.exists():
        return
    try:
        old = ConnectionInfo.read(cfg.connection_file)
        cfg.client_port = int(old.client_address.rsplit(":", 1)[1])
        cfg.worker_port = int(old.worker_address.rsplit(":", 1)[1])
    except (ValueError, OSError, IndexError):
        return
    log.info("reusing ports %d/%d of %s", cfg.client_port, cfg.worker_port, cfg.connection_file)


def coordinator_main(args: argparse.Namespace) -> int:
    coord = build_coordinator(args)
    try:
        info = coord.bind()
    except Exception as e:
        if coord.config.client_port:  # stale ports from an old connection file: take fresh ones
            log.warning("cannot bind the old ports (%s); taking new ones", e)
            coord.config.client_port = coord.config.worker_port = 0
            coord.close()
            coord = build_coordinator(args)
            coord.config.client_port = coord.config.worker_port = 0
            info = coord.bind()
        else:
            raise
    signal.signal(signal.SIGTERM, lambda *_: coord.stop())
    signal.signal(signal.SIGINT, lambda *_: coord.stop())
    print(f"coordinator {info.coordinator_id} listening: clients {info.client_address}, "
          f"workers {info.worker_address}; connection file {coord.config.connection_file}", flush=True)
    coord.serve()
    return 0


class LocalCluster:
    """A coordinator in a child process with ``workers`` local workers of ``cores`` cores."""

    def __init__(self, workers: int = 2, cores: int = 0, *, run_dir: str | os.PathLike | None = None,
                 policy: str | None = None, reward_workers: int = 0, services: list[str] | None = None,
                 extra_args: list[str] | None = None, wait_workers: bool = True, timeout: float = 60.0):
        self.run_dir = Path(run_dir) if run_dir else default_run_dir()
        self.connection_file = self.run_dir / "connection.json"
        cmd = [sys.executable, "-m", "tangram_hpc.cli", "coordinator", "--run-dir", str(self.run_dir),
               "--workers", str(workers), "--worker-cores", str(cores)]
        if policy:
            cmd += ["--policy", policy]
        if reward_workers:
            cmd += ["--reward-workers", str(reward_workers)]
            for opt in services or []:
                cmd += ["--service", opt]
        cmd += list(extra_args or [])
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.run_dir / "coordinator.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.workers = workers + reward_workers
        try:
            deadline = time.monotonic() + timeout
            while not self.connection_file.exists():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"coordinator exited with status {self.proc.returncode}; "
                                       f"see {self.run_dir / 'coordinator.log'}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"coordinator wrote no connection file in {timeout:g}s")
                time.sleep(0.02)
            self.info = wait_for_file(self.connection_file, timeout=5)
            if wait_workers and self.workers:
                self.wait_for_workers(self.workers, timeout)
        except BaseException:
            self.close()
            raise

    def client(self, **kw):
        from .client import Client
        return Client(connection_file=str(self.connection_file), **kw)

    def wait_for_workers(self, n: int, timeout: float = 60.0) -> dict:
        from .client import Client
        deadline = time.monotonic() + timeout
        with Client(connection_file=str(self.connection_file)) as c:
            while True:
                st = c.status(timeout=max(1.0, deadline - time.monotonic()))
                if len(st["workers"]) >= n:
                    return st
                if self.proc.poll() is not None:
                    raise RuntimeError(f"coordinator exited with {self.proc.returncode}; see {self._log.name}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {len(st['workers'])} of {n} workers joined in {timeout:g}s; "
                                       f"see {self.run_dir}/workers/*.log")
                time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
