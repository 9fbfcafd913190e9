"""Assembling and starting a coordinator: from the command line, or embedded in Python.

:func:`build_coordinator` turns the configuration (:mod:`tangram_hpc.config`)
into a coordinator with its policy, pool policy and backend.  :class:`LocalCluster` runs one in a child process
with local workers, for notebooks, tests and the demo::

    with LocalCluster(workers=2, cores=2) as cluster, cluster.client() as c:
        print(c.map([function("math:factorial", 10)]))
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from .backends.guards import LaunchThrottle
from .config import ConfigError, CoordinatorSettings, Settings, SlurmSettings, default_run_dir
from .config_cli import add_arguments, settings_from_args, worker_flags
from .connection import ConnectionInfo, wait_for_file
from . import native
from .daemon import tune_gc
from .coordinator import Coordinator
from .policy.base import PoolPolicy
from .policy.pool import PoolConfig, PoolController
from .policy.static import StaticPool
from .resources import ServiceInfo, WorkerShape
from .security import CurveKeys, is_loopback

if TYPE_CHECKING:
    from .backends.base import WorkerBackend
    from .policy.placement import PlacementPolicy

log = logging.getLogger("tangram.launch")


def make_policy(name: str, pipeline_below_s: float | None = None, env_move_s: float | None = None,
                barriers: bool = False, prefetch: bool = False) -> PlacementPolicy:
    """The named placement policy; ``env_move_s`` (the first guess of a move's cost) None: environments never move;
    ``barriers``: the rollouts have per-turn barriers (the elastic policy's barrier mode; FIFO has none);
    ``prefetch``: services are loaded ahead of their waiting calls (:mod:`tangram_hpc.policy.prefetch`)."""
    from .policy.prefetch import Prefetch
    ahead = Prefetch() if prefetch else None
    if name == "fifo":
        from .policy.fifo import FifoPolicy
        return FifoPolicy(pipeline_below_s=pipeline_below_s, env_move_s=env_move_s, prefetch=ahead)
    if name == "elastic":
        from .policy.elastic import ElasticScheduler
        return ElasticScheduler(pipeline_below_s=pipeline_below_s, env_move_s=env_move_s, barriers=barriers,
                                prefetch=ahead)
    raise ConfigError(f"unknown policy {name!r} (choose elastic or fifo)")


def add_coordinator_arguments(p: argparse.ArgumentParser) -> None:
    add_arguments(p, "coordinator")


def build_coordinator(settings: Settings, *, reuse_ports: bool = True) -> Coordinator:
    """A coordinator with its policy, pool policy and backend, as ``settings`` say.

    With ``reuse_ports`` and no ports configured, it takes those of an existing connection file.
    """
    cfg = settings.coordinator.resolved()
    curve = None
    if cfg.insecure:
        if not is_loopback(cfg.host):
            raise ConfigError(f"insecure is only allowed on a loopback address, not {cfg.host}: anyone on the "
                              "network could submit code to run under your account")
    else:
        curve = CurveKeys.load_or_create(cfg.run_dir / "keys")
    if reuse_ports:
        cfg = _reuse_ports(cfg)
    # Workers it launches read the same file, and reward workers get the services set here.
    common = ["--config", str(settings.file)] if settings.file else []
    service_args = common + worker_flags(settings, "services") + ["--kinds", "reward"]
    backend: WorkerBackend | None = None
    pool: PoolPolicy | None = None
    policy = make_policy(cfg.policy, cfg.pipeline_below_s, cfg.env_move_s if cfg.env_moves else None, cfg.barriers,
                         cfg.prefetch)
    policy.pin_live_envs = cfg.pin_live_envs
    if cfg.backend == "local":
        from .backends.local import LocalBackend
        backend = LocalBackend(cfg.run_dir / "workers")
        ps = settings.pool
        shape = WorkerShape(cores=ps.worker_cores or len(os.sched_getaffinity(0)), mem_mb=ps.worker_mem_mb)
        reward = WorkerShape(cores=1, gpu_mem_mb=int(settings.services.budget_mb))
        pool = StaticPool([shape] * ps.workers + [reward] * ps.reward_workers)
    elif cfg.backend == "slurm":
        from .backends.slurm import backend_from_settings
        backend = backend_from_settings(settings.slurm, run_dir=cfg.run_dir)
        # The pool sizes itself with the durations the scheduler learns.
        pool = pool_from_settings(settings.slurm, getattr(policy, "predictor", None))
    specs = _service_specs(settings)
    services = {s.name: ServiceInfo(int(s.memory_mb)) for s in specs if s.memory_mb}
    if services:
        policy.set_services(services)   # so the scheduler knows sizes and batch limits before any call
    if pool is not None:
        # An action larger than every shape the pool can provide, or calling a service none of its
        # service workers hosts, fails at once with the reason instead of waiting forever (with
        # backend none any worker may still join).
        policy.set_shapes(pool.shapes, hosted=[s.name for s in specs])
    return Coordinator(cfg, policy, pool=pool, backend=backend, curve=curve, cpu_worker_args=tuple(common),
                       service_worker_args=tuple(service_args), throttle=LaunchThrottle(settings.launch))


def pool_from_settings(s: SlurmSettings, predictor=None) -> PoolController:
    """The pool controller for the coordinator's Slurm workers (``predictor``: the scheduler's).

    Built here, where the policies are chosen, not by the Slurm backend: a backend submits
    what it is asked to and builds no policy."""
    from .backends.slurm import slurm_shapes
    max_workers = {"cpu": s.max_workers, "gpu": s.gpu_workers}
    cfg = PoolConfig(slurm_shapes(s), max_workers=max_workers, min_workers={"cpu": s.min_workers},
                     startup_s=s.startup_s, idle_ttl_s=s.idle_s,
                     env_idle_ttl_s=s.env_idle_s if s.env_idle_s is not None else 2 * s.idle_s,
                     time_limit_margin_s=s.replace_before_s, target_util=s.target_util,
                     hold_steps=s.hold_steps, hold_idle_s=s.hold_idle_s)
    return PoolController(cfg, predictor)


def _service_specs(settings: Settings) -> list:
    """The reward services of [services]: what every service worker the coordinator starts hosts.

    The scheduler gets their names and the sizes of those whose size is known; only the size: a
    spec's ``max_batch`` counts inputs per model call, the scheduler's requests.
    """
    sv = settings.services
    if not (sv.file or sv.service):
        return []
    from .managers.service_spec import specs_from_cli
    return list(specs_from_cli(sv.file, sv.service))


def _reuse_ports(cfg: CoordinatorSettings) -> CoordinatorSettings:
    """A restarted coordinator takes the ports of the connection file it finds."""
    if cfg.client_port or cfg.worker_port or not cfg.connection_file.exists():
        return cfg
    try:
        old = ConnectionInfo.read(cfg.connection_file)
        ports = int(old.client_address.rsplit(":", 1)[1]), int(old.worker_address.rsplit(":", 1)[1])
    except (ValueError, OSError, IndexError):
        return cfg
    log.info("reusing ports %d/%d of %s", *ports, cfg.connection_file)
    return dataclasses.replace(cfg, client_port=ports[0], worker_port=ports[1])


def coordinator_main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    coord = build_coordinator(settings)
    try:
        info = coord.bind()
    except zmq.ZMQError as e:
        if coord.config.client_port == settings.coordinator.client_port:
            raise  # the ports were asked for, not taken from an old connection file
        log.warning("cannot bind the old ports (%s); taking new ones", e)
        coord.close()
        coord = build_coordinator(settings, reuse_ports=False)
        info = coord.bind()
    signal.signal(signal.SIGTERM, lambda *_: coord.stop())
    signal.signal(signal.SIGINT, lambda *_: coord.stop())
    print(f"coordinator {info.coordinator_id} listening: clients {info.client_address}, "
          f"workers {info.worker_address}; connection file {coord.config.connection_file}", flush=True)
    log.info("policies: %s", native.status())     # which code runs, once (cli refuses the build here)
    tune_gc()
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
               "--connection-file", str(self.connection_file), "--workers", str(workers),
               "--worker-cores", str(cores)]
        if policy:
            cmd += ["--policy", policy]
        if reward_workers:
            cmd += ["--reward-workers", str(reward_workers)]
            for opt in services or []:
                cmd += ["--service", opt]
        cmd += list(extra_args or [])
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.run_dir / "coordinator.log", "ab")
        # a live coordinator runs the Python sources, even beside a compiled simulator (fidelity)
        env = {k: v for k, v in os.environ.items() if k != native.ENV}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env)
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
