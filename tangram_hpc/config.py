"""One configuration: every setting declared once, with its type, default, help and variable.

A *section* is a dataclass below; a *key* is one field of it, declared with
:func:`key`.  Everything else is derived from these declarations:

* the command-line flags of ``tangram-hpc coordinator`` and ``tangram-hpc
  worker`` (:mod:`tangram_hpc.config_cli`; the sections each command reads
  are in :data:`COMMAND_SECTIONS`);
* the TOML file (``--config FILE`` or ``$TANGRAM_CONFIG``), one table per
  section;
* environment overrides, for the keys that name a variable;
* ``tangram-hpc config show`` (also in ``config_cli``), which prints the
  effective values and where each came from.

Precedence: default < file < environment < command line.  An unknown section
or key, or a value of the wrong type, is a :class:`ConfigError` that lists the
valid names (and suggests the closest one).

Adding a setting is one line in its section::

    max_idle_envs: int = key(16, "environments kept per worker", minimum=0)

The flag is ``--max-idle-envs`` when the section is the command's own
(``coordinator`` for the coordinator, ``worker`` for the worker) and
``--SECTION-max-idle-envs`` otherwise, unless ``flag=`` names another; a
boolean that defaults to true gets a ``--no-...`` flag.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .actions import BUILTIN_KINDS
from .connection import CONNECTION_FILE_ENV
from .errors import ConfigError
from .protocol import MAX_FRAME_BYTES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["CONFIG_ENV", "COMMAND_SECTIONS", "ConfigError", "CoordinatorSettings", "LaunchSettings", "PoolSettings",
           "SandboxSettings", "ServicesSettings", "Settings", "SlurmSettings", "WorkerSettings", "default_run_dir",
           "key", "load"]

#: The configuration file when ``--config`` is not given.
CONFIG_ENV = "TANGRAM_CONFIG"


@dataclass(frozen=True, slots=True)
class Key:
    """How one setting is read: its help, and optionally its variable, flag and bounds."""

    help: str
    env: str | None = None
    flag: str | None = None
    choices: tuple | None = None
    minimum: float | None = None
    split: str | None = None      # a list given as one command-line value split on this (else: repeat the flag)
    metavar: str | None = None


def key(default: Any, help: str, *, env: str | None = None, flag: str | None = None, choices: tuple | None = None,
        minimum: float | None = None, split: str | None = None, metavar: str | None = None) -> Any:
    """Declare one setting (a dataclass field carrying its :class:`Key`)."""
    meta = {"key": Key(help, env, flag, choices, minimum, split, metavar)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


# Defaults and variable names of the objects the callers build from these settings.  config is
# core and imports no policy, manager or backend (docs/architecture.md, "Layers"), so they are
# written here as plain values; tests/test_config.py checks each equals its owner's.
_LIMITS_DEFAULTS = {"timeout_s": 600.0, "memory_mb": 4096, "disk_mb": 10240, "disk_files": 1_000_000}  # managers.limits.Limits
_POOL_DEFAULTS = {"target_util": 0.75, "hold_steps": True, "hold_idle_s": None}     # policy.pool.PoolConfig
PIPELINE_BELOW_S = 0.001                          # policy.placement.PlacementPolicy.PIPELINE_BELOW_S
DEFAULT_CPU_BUDGET_MB = 4096                      # managers.devices.DEFAULT_CPU_BUDGET_MB
CPU_BUDGET_ENV = "TANGRAM_SERVICE_CPU_BUDGET_MB"  # managers.devices.CPU_BUDGET_ENV
HANDLE_ENV = "TANGRAM_WORKER_HANDLE"              # backends.base.HANDLE_ENV


# -- the sections ----------------------------------------------------------------

@dataclass
class CoordinatorSettings:
    """[coordinator] where it listens, how it treats actions and workers, its limits"""

    run_dir: Path | None = key(None, "directory for logs, keys and environments; reusing one restarts the run "
                               "(default: a new directory under runs_root)", env="TANGRAM_RUN_DIR")
    runs_root: Path = key(Path.home() / ".tangram" / "runs", "where a new run directory is made when run_dir is not given",
                          env="TANGRAM_RUNS_ROOT")
    connection_file: Path | None = key(None, "where to write the connection file (default RUN_DIR/connection.json); "
                                       "an existing one is reused, ports included, so clients and workers find "
                                       "a restarted coordinator", env=CONNECTION_FILE_ENV)
    host: str | None = key(None, "address or network interface (e.g. ib0) to bind (default 127.0.0.1 with the local "
                           "backend, all interfaces with Slurm)")
    advertise_host: str | None = key(None, "host name, address or network interface (e.g. ib0: its address) written "
                                     "into the connection file for workers and clients (default: the bound address; "
                                     "bound to all, this host's name, or the routed interface's address when the "
                                     "name is a loopback one)")
    insecure: bool = key(False, "plain TCP without CurveZMQ keys; only allowed when binding to loopback (tests)")
    client_port: int = key(0, "port for clients (0: any free port)", minimum=0)
    worker_port: int = key(0, "port for workers (0: any free port)", minimum=0)
    backend: str = key("local", "who starts workers: processes on this machine, Slurm jobs, or nobody (workers "
                       "started by hand with 'tangram-hpc worker')", choices=("local", "slurm", "none"))
    policy: str = key("elastic", "placement policy", env="TANGRAM_POLICY", choices=("elastic", "fifo"))
    pipeline_below_s: float = key(PIPELINE_BELOW_S, "core-bound actions whose class is learned to "
                                  "take less than this run pipelined, binding no core (0: never)", minimum=0)
    env_moves: bool = key(True, "let the scheduler move a stateful environment to another worker when its "
                          "waiting action would finish sooner there, or off a crowded worker while its agent "
                          "thinks (off: an environment stays on the worker it started on)", flag="--no-env-moves")
    env_move_s: float = key(10.0, "first guess of the seconds it takes to move a stateful environment to another "
                            "worker (its holder saves it, the next one restores it); the scheduler learns the "
                            "real cost from each move (to keep environments where they start: env_moves = false)",
                            minimum=0.01)
    pin_live_envs: bool = key(True, "never move an environment that keeps live processes on its worker (a "
                              "live session, [sandbox] sessions) unless that worker is lost: a move would end "
                              "them")
    barriers: bool = key(False, "the training loop rolls out synchronously: a turn starts only when every "
                         "trajectory finished the one before (per-turn barriers), so a turn ends with its "
                         "slowest action; the elastic policy then gives a burst's wide actions the cores they "
                         "are worth rather than share a worker's leftovers (docs/scheduler.md, 'Barriers')")
    prefetch: bool = key(True, "tell reward workers which services their waiting calls need next, so the load "
                         "overlaps with the calls running now (docs/services.md, 'Prefetch')", flag="--no-prefetch")
    max_attempts: int = key(3, "attempts per action across worker losses", minimum=1)
    worker_timeout_s: float = key(5.0, "seconds of silence before a worker is lost", flag="--worker-timeout",
                                  minimum=0.1)
    heartbeat_s: float = key(1.0, "seconds between heartbeats to workers", flag="--heartbeat", minimum=0.01)
    heartbeats_per_s: float = key(1000.0, "the most heartbeats per second the workers send together: past "
                                  "heartbeat_s x this many workers the coordinator tells them a longer "
                                  "interval and waits as much longer before it loses one (0: no bound)",
                                  flag="--heartbeats-per-s", minimum=0)
    timeout_grace_s: float = key(5.0, "seconds past an action's timeout before the coordinator times it out "
                                 "itself (the worker kills it at its timeout)", flag="--timeout-grace", minimum=0)
    env_prepare_s: float = key(120.0, "seconds the coordinator allows for creating or restoring an action's "
                               "environment on its worker, on top of its timeout (the worker starts the action's "
                               "clock once its environment is there)", flag="--env-prepare", minimum=0)
    max_pending_per_client: int = key(200_000, "unfinished actions one client may have", minimum=1)
    max_pending_total: int = key(1_000_000, "unfinished actions in all", flag="--max-pending", minimum=1)
    max_frame_bytes: int = key(MAX_FRAME_BYTES, "largest frame accepted", minimum=1024)
    result_cache: int = key(200_000, "finished results kept to answer resubmissions", minimum=2)
    result_cache_mb: int = key(512, "most megabytes of action outputs the result cache holds (large outputs: "
                               "fewer results kept)", minimum=1)
    hwm: int = key(200_000, "messages queued per peer before ZMQ drops or blocks", minimum=1)
    pool_interval_s: float = key(1.0, "seconds between pool decisions", flag="--pool-interval", minimum=0.01)
    drain_grace_s: float = key(30.0, "seconds a stopped worker has to snapshot and exit before its job is "
                               "cancelled", flag="--drain-grace", minimum=0)
    metrics_port: int | None = key(None, "serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port; "
                                   "unset: no endpoint; needs the metrics extra)", env="TANGRAM_METRICS_PORT",
                                   minimum=0)
    metrics_host: str | None = key(None, "interface of the metrics endpoint (default: the coordinator's host)")
    metrics_targets_dir: Path | None = key(None, "directory where the coordinator writes its Prometheus file_sd "
                                           "target (tangram-RUN.json), shared by runs so that one file_sd glob finds "
                                           "them all (default: the run directory)")
    env_wait_s: float = key(120.0, "seconds the actions of an environment wait for its worker after that worker "
                            "fell silent (it may come back with it); then the environment is adopted from the "
                            "worker's directory, or lost", flag="--env-wait", minimum=0)
    state_dir: Path | None = key(None, "directory that outlives restarts of this coordinator: environment snapshots, "
                                 "where each environment is, attempts of unfinished actions (default: beside the "
                                 "connection file, NAME.state for NAME.json)")

    def resolved(self) -> "CoordinatorSettings":
        """A copy with the run directory, connection file and host filled in."""
        from .netaddr import resolve_host
        run_dir = Path(self.run_dir).expanduser() if self.run_dir else default_run_dir(self.runs_root)
        host = resolve_host(self.host) if self.host else ("0.0.0.0" if self.backend == "slurm" else "127.0.0.1")
        connection_file = Path(self.connection_file or run_dir / "connection.json")
        # Beside the connection file, which a restarted coordinator keeps (clients find it there),
        # not in the run directory, which the documented restart path replaces.
        state_dir = Path(self.state_dir) if self.state_dir else connection_file.with_name(connection_file.stem + ".state")
        return dataclasses.replace(self, run_dir=run_dir, host=host, connection_file=connection_file,
                                   state_dir=state_dir)


@dataclass
class PoolSettings:
    """[pool] the fixed set of workers the local backend keeps"""

    workers: int = key(2, "CPU workers to keep", flag="--workers", minimum=0)
    worker_cores: int = key(0, "cores per CPU worker (0: all CPUs)", flag="--worker-cores", minimum=0)
    worker_mem_mb: int = key(0, "memory per CPU worker in MiB (0: not enforced)", flag="--worker-mem-mb", minimum=0)
    reward_workers: int = key(0, "reward-model service workers to keep", flag="--reward-workers", minimum=0)


@dataclass
class ServicesSettings:
    """[services] reward-model services hosted by reward (GPU) workers"""

    file: Path | None = key(None, "TOML file declaring the services", flag="--services", metavar="FILE")
    service: list[str] = key([], "declare one service (repeatable)", flag="--service",
                             metavar="NAME=MODULE:LOADER[,KEY=VALUE...]")
    budget_mb: float = key(DEFAULT_CPU_BUDGET_MB, "device memory of a reward worker, or the host-RAM budget standing "
                           "in for it when services run on the CPU", flag="--service-budget-mb", env=CPU_BUDGET_ENV,
                           minimum=0)
    preload: bool = key(True, "load services into host RAM at start (off: on first use)", flag="--no-preload")
    gpu_budget_mb: float = key(0.0, "memory services may take on each GPU (0: 90% of it)",
                               flag="--service-gpu-budget-mb", minimum=0)
    pinned_mb: float = key(0.0, "pinned host memory the services' kept host copies may take on a worker "
                           "(0: no cap); services beyond it stay in pageable memory", flag="--service-pinned-mb",
                           minimum=0)


@dataclass
class WorkerSettings:
    """[worker] what a worker offers and how it talks to the coordinator"""

    connection_file: Path | None = key(None, "coordinator connection file", env=CONNECTION_FILE_ENV)
    cores: int = key(0, "cores this worker offers (0: all CPUs it may use)", minimum=0)
    mem_mb: int = key(0, "memory it offers in MiB (0: not enforced by the scheduler)", minimum=0)
    gpus: int = key(0, "GPUs it offers", minimum=0)
    gpu_mem_mb: int = key(0, "total GPU memory in MiB (or the host-RAM budget standing in for it when services "
                          "run on the CPU; 0: from the services' devices)", minimum=0)
    handle: str | None = key(None, "backend handle of the job running it", env=HANDLE_ENV)
    run_dir: Path | None = key(None, "directory for environments and scratch (default: under the coordinator's)")
    kinds: list[str] = key(list(BUILTIN_KINDS), "action kinds served", split=",", metavar="KIND,...")
    handler: list[str] = key([], "handler for a user-registered kind: FUNC(spec, cpus) -> (status, output, error) "
                             "(repeatable)", metavar="KIND=MODULE:FUNC")
    heartbeat_s: float = key(1.0, "seconds between heartbeats", flag="--heartbeat", minimum=0.01)
    coordinator_timeout_s: float = key(5.0, "seconds of coordinator silence before registering again",
                                       flag="--coordinator-timeout", minimum=0.1)
    orphan_exit_s: float = key(600.0, "seconds of coordinator silence before exiting", flag="--orphan-exit",
                               minimum=1)
    max_output_bytes: int = key(MAX_FRAME_BYTES // 2, "largest action output sent back (larger: a failed result)",
                                minimum=1024)
    leave_grace_s: float = key(5.0, "seconds a leaving or stopped worker lets running actions finish before it "
                               "interrupts them (they are retried) and hands its environments back",
                               flag="--leave-grace", minimum=0)
    stuck_leave_s: float = key(120.0, "seconds an attempt the coordinator killed may go on running (a Python "
                               "function or a reward model's score() cannot be interrupted) before the worker "
                               "leaves, so that a fresh one takes its place (0: never)", flag="--stuck-leave",
                               minimum=0)


@dataclass
class SandboxSettings:
    """[sandbox] bubblewrap sandboxes of CPU workers"""

    unsafe: bool = key(False, "run sandbox commands WITHOUT isolation when bubblewrap is unavailable (never on "
                       "shared machines: model-written code then sees everything your account can)",
                       flag="--unsafe-sandbox")
    allow_network: bool = key(False, "let payloads ask for network access")
    warm_pool: int = key(2, "ready-made environments kept", minimum=0)
    template: Path | None = key(None, "project tree every new environment starts as a copy of (a repository "
                                "checkout; a payload's template \"empty\" still makes an empty one); a move then "
                                "carries only what changed", flag="--sandbox-template")
    env_ttl_s: float = key(3600.0, "seconds an idle environment is kept", flag="--sandbox-env-ttl", minimum=0)
    snapshot_dir: Path | None = key(None, "shared directory for environment snapshots (default: the one the "
                                    "coordinator names, STATE_DIR/snapshots)", flag="--snapshot-dir")
    seccomp: bool = key(True, "syscall filter in every sandbox: no nested user namespaces, keyrings, bpf, "
                        "io_uring, perf events, userfaultfd or fallocate")
    sessions: bool = key(False, "keep each environment's processes between its actions, frozen (a live "
                         "session: a shell, a kernel or a server started in one action is there in the next)",
                         flag="--sandbox-sessions", env="TANGRAM_SANDBOX_SESSIONS")
    session_idle_s: float = key(600.0, "seconds an idle session's processes are kept (0: as long as the "
                                "environment)", minimum=0)
    session_min_free_mb: int = key(1024, "below this much available memory, idle sessions are ended (their "
                                   "files stay)", minimum=0)
    session_prestart: int = key(2, "live sessions kept started ahead for new environments, claimed by their "
                                "first action (0: none)", minimum=0, env="TANGRAM_SANDBOX_PRESTART")
    # 0 turns a limit off; the defaults are Limits' own (managers/limits.py).
    timeout_s: float = key(_LIMITS_DEFAULTS["timeout_s"], "seconds an action may run when it names no timeout (0: none)",
                           flag="--sandbox-timeout", minimum=0)
    memory_mb: int = key(_LIMITS_DEFAULTS["memory_mb"], "memory of an action that declares no mem_mb, in MiB (0: none)",
                         flag="--sandbox-memory-mb", minimum=0)
    disk_mb: int = key(_LIMITS_DEFAULTS["disk_mb"], "disk space of one environment, in MiB (0: none)", minimum=0)
    disk_files: int = key(_LIMITS_DEFAULTS["disk_files"], "files and directories one environment may hold (0: none)",
                          minimum=0)


@dataclass
class SlurmSettings:
    """[slurm] worker jobs on Slurm, and the pool that grows with the backlog and shrinks when idle"""

    partition: str | None = key(None, "partition for CPU workers (default: the cluster default)",
                                env="TANGRAM_PARTITION")
    gpu_partition: str | None = key(None, "partition for GPU workers (default: partition)",
                                    env="TANGRAM_GPU_PARTITION")
    account: str | None = key(None, "account to charge worker jobs to", env="TANGRAM_ACCOUNT")
    qos: str | None = key(None, "QOS of worker jobs", env="TANGRAM_QOS")
    time_min: int = key(60, "worker job time limit in minutes", flag="--slurm-time", env="TANGRAM_WORKER_TIME",
                        minimum=1, metavar="MIN")
    mem_per_core_mb: int | None = key(None, "memory per core when a shape gives none", flag="--slurm-mem-per-core",
                                      minimum=1, metavar="MB")
    sbatch: list[str] = key([], "extra sbatch option for worker jobs, e.g. constraint=ib (repeatable)",
                            metavar="KEY=VALUE")
    setup_file: str | None = key(None, "shell file each worker job sources first, before the setup lines "
                                 "(module loads, a venv; coordinator.sbatch sources it too)", env="TANGRAM_SETUP",
                                 metavar="FILE")
    setup: list[str] = key([], "shell line run in each worker job first, e.g. 'source venv/bin/activate' "
                           "(repeatable)", metavar="LINE")
    view: str = key("auto", "how to query Slurm (auto: pyslurm when it matches the running Slurm)",
                    choices=("auto", "cli", "pyslurm"))
    worker_cores: int = key(4, "cores per CPU worker job", env="TANGRAM_WORKER_CORES", minimum=1)
    worker_mem_mb: int = key(0, "memory per CPU worker job (0: the partition default)", minimum=0)
    max_workers: int = key(8, "most CPU worker jobs, queued ones included", env="TANGRAM_MAX_WORKERS", minimum=0)
    min_workers: int = key(0, "CPU workers kept even when idle", minimum=0)
    gpu_workers: int = key(0, "most GPU worker jobs (0: none)", env="TANGRAM_GPU_WORKERS", minimum=0)
    gpus_per_worker: int = key(1, "GPUs per GPU worker job", minimum=1)
    gpu_worker_cores: int = key(2, "cores per GPU worker job", minimum=1)
    idle_s: float = key(30.0, "reclaim a worker idle this long while nothing waits", flag="--slurm-idle",
                        env="TANGRAM_IDLE", minimum=0)
    replace_before_s: float = key(180.0, "drain and replace a worker this long before its job's time limit "
                                  "(at least 150: Slurm may send its warning signal up to 150 s before)",
                                  flag="--slurm-replace-before", minimum=0)
    env_idle_s: float | None = key(None, "idle time before a worker hosting sandbox environments is drained; its "
                                   "environments are snapshotted and follow their trajectories (default: twice "
                                   "idle_s)", flag="--slurm-env-idle", minimum=0)
    startup_s: float = key(30.0, "seconds from submitting a worker job to its joining, until the pool has seen "
                           "some (it then uses the median it saw): the pool asks for enough workers to clear the "
                           "backlog in about this time", flag="--slurm-startup", minimum=0.1)
    target_util: float = key(_POOL_DEFAULTS["target_util"], "busy share of the pool's cores it aims for under a steady load "
                             "(lower: more headroom, shorter queues)", flag="--slurm-target-util", minimum=0.05)
    hold_steps: bool = key(_POOL_DEFAULTS["hold_steps"], "keep the current and the previous RL step's peak capacity while "
                           "the run is active, so the next step's burst finds its workers up",
                           flag="--no-slurm-hold-steps")
    hold_idle_s: float | None = key(_POOL_DEFAULTS["hold_idle_s"], "quiet time after which the held step capacity is let "
                                    "go (default: idle_s)", flag="--slurm-hold-idle", minimum=0)


@dataclass
class LaunchSettings:
    """[launch] the one throttle on worker launches, whatever the backend (Slurm jobs or local processes)"""

    rate: float = key(30.0, "most workers launched per minute", flag="--launch-rate", minimum=0.001,
                      metavar="PER_MIN")
    burst: int = key(8, "most workers launched at once", flag="--launch-burst", minimum=1)
    backoff_s: float = key(1.0, "wait after a failed start, doubled after each further one (up to max_backoff_s)",
                           flag="--launch-backoff", minimum=0)
    max_backoff_s: float = key(60.0, "longest wait between failed starts", flag="--launch-max-backoff", minimum=0)
    breaker: int = key(5, "stop launching after this many failed starts within breaker_window_s", minimum=1,
                       flag="--launch-breaker", metavar="K")
    breaker_window_s: float = key(300.0, "window of the circuit breaker", flag="--launch-breaker-window", minimum=1)
    breaker_cooldown_s: float = key(120.0, "seconds launches stay stopped once the breaker trips (then one trial "
                                    "launch; 'tangram-hpc pool resume' retries at once)",
                                    flag="--launch-breaker-cooldown", minimum=0)
    healthy_after_s: float = key(20.0, "a worker that joined and stayed this long is a good start; one whose job "
                                 "fails sooner is a failed start", flag="--launch-healthy-after", minimum=0)


@dataclass
class Settings:
    """The whole configuration: one attribute per section, and where each value came from."""

    coordinator: CoordinatorSettings = field(default_factory=CoordinatorSettings)
    pool: PoolSettings = field(default_factory=PoolSettings)
    services: ServicesSettings = field(default_factory=ServicesSettings)
    slurm: SlurmSettings = field(default_factory=SlurmSettings)
    launch: LaunchSettings = field(default_factory=LaunchSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    sandbox: SandboxSettings = field(default_factory=SandboxSettings)
    #: (section, key) -> "file", "env NAME" or "command line"; absent: the default
    sources: dict[tuple[str, str], str] = field(default_factory=dict)
    file: Path | None = None

    def source(self, section: str, name: str) -> str:
        return self.sources.get((section, name), "default")

    def explicit(self, section: str) -> dict[str, Any]:
        """The keys of a section that were set (file, environment or command line), with their values."""
        values = getattr(self, section)
        return {name: getattr(values, name) for (sec, name) in self.sources if sec == section}


#: The sections whose keys are flags of each command (a file may hold every section).
COMMAND_SECTIONS = {
    "coordinator": ("coordinator", "pool", "services", "slurm", "launch"),
    "worker": ("worker", "sandbox", "services"),
}


# -- the schema, derived from the dataclasses ------------------------------------------

@dataclass(frozen=True, slots=True)
class DeclaredKey:
    """One declared key as the loader sees it: its section, name, base type, default and :class:`Key`."""

    section: str
    name: str
    type: Any           # str, int, float, bool, Path or list (of str)
    optional: bool
    default: Any
    key: Key

    @property
    def label(self) -> str:
        return f"[{self.section}] {self.name}"


def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(Settings)
    return {f.name: hints[f.name] for f in dataclasses.fields(Settings) if dataclasses.is_dataclass(hints[f.name])}


def _fields(cls: type, section: str) -> dict[str, DeclaredKey]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = type(None) in typing.get_args(tp)
        base = args[0] if optional else tp
        if typing.get_origin(base) is list:
            base = list
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out[f.name] = DeclaredKey(section, f.name, base, optional, default, f.metadata["key"])
    return out


SECTIONS: dict[str, type] = _section_classes()
SCHEMA: dict[str, dict[str, DeclaredKey]] = {name: _fields(cls, name) for name, cls in SECTIONS.items()}


def _unknown(what: str, name: str, valid: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown {what} {name!r} in {where}{hint} Valid: {', '.join(valid)}")


def convert(f: DeclaredKey, value: Any, where: str, text: bool = False) -> Any:
    """A value as the key's type, checked: TOML types from a file, a string (``text``) from a variable or flag."""
    try:
        out = _parse_text(f, value) if text else _check_type(f, value)
    except ValueError as e:
        raise ConfigError(f"{f.label} from {where}: {e}, got {value!r}") from None
    if f.key.choices is not None and out not in f.key.choices:
        raise ConfigError(f"{f.label} from {where}: must be one of {', '.join(map(str, f.key.choices))}, got {out!r}")
    if f.key.minimum is not None and out < f.key.minimum:
        raise ConfigError(f"{f.label} from {where}: must be at least {f.key.minimum:g}, got {out!r}")
    return out


_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", list: "a list of strings",
             Path: "a path", str: "a string"}


def _check_type(f: DeclaredKey, value: Any) -> Any:
    tp = f.type
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is list and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    if tp is Path and isinstance(value, str) and value:
        return Path(value).expanduser()
    if tp in (bool, int, float, str) and type(value) is tp:
        return value
    raise ValueError(f"expected {_EXPECTED[tp]}")


def _parse_text(f: DeclaredKey, text: str) -> Any:
    tp = f.type
    if tp is bool:
        word = text.strip().lower()
        if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError("expected true or false")
        return word in ("1", "true", "yes", "on")
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            raise ValueError(f"expected {_EXPECTED[tp]}") from None
    if tp is list:
        return [v.strip() for v in text.split(f.key.split or ",") if v.strip()]
    if tp is Path:
        if not text:
            raise ValueError("expected a path")
        return Path(text).expanduser()
    return text


def read_file(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """A configuration file's sections, checked against the schema (values not converted yet)."""
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"configuration file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"configuration file {path} is not valid TOML: {e}") from None
    for section, table in doc.items():
        if section not in SCHEMA:
            raise _unknown("section", section, list(SCHEMA), str(path))
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] in {path} must be a table of keys")
        for name in table:
            if name not in SCHEMA[section]:
                raise _unknown("key", name, list(SCHEMA[section]), f"[{section}] of {path}")
    return doc


def load(file: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None,
         cli: Mapping[tuple[str, str], Any] | None = None) -> Settings:
    """The effective configuration: defaults, then ``file`` (or ``$TANGRAM_CONFIG``), environment, ``cli``."""
    environ = os.environ if environ is None else environ
    path = file if file is not None else (environ.get(CONFIG_ENV) or None)
    doc = read_file(path) if path else {}
    values: dict[str, dict[str, Any]] = {s: {} for s in SCHEMA}
    sources: dict[tuple[str, str], str] = {}
    for section, fields_ in SCHEMA.items():
        for name, f in fields_.items():
            if name in doc.get(section, {}):
                values[section][name] = convert(f, doc[section][name], f"file {path}")
                sources[section, name] = "file"
            if f.key.env and environ.get(f.key.env):
                values[section][name] = convert(f, environ[f.key.env], f"${f.key.env}", text=True)
                sources[section, name] = f"env {f.key.env}"
    for (section, name), value in (cli or {}).items():
        values[section][name] = value
        sources[section, name] = "command line"
    return Settings(**{s: SECTIONS[s](**values[s]) for s in SCHEMA}, sources=sources,
                    file=Path(path).resolve() if path else None)


def default_run_dir(runs_root: str | os.PathLike | None = None) -> Path:
    """A new run directory: ``RUNS_ROOT/<date>-<time>-<pid>``."""
    root = Path(runs_root if runs_root is not None else load().coordinator.runs_root).expanduser()
    return root / time.strftime(f"%Y%m%d-%H%M%S-{os.getpid()}")
