"""A worker's configuration: :class:`WorkerConfig`, built from the [worker], [sandbox] and [services]
sections of the settings (:func:`config_from_settings`) or from command-line flags."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from .actions import BUILTIN_KINDS
from .config import ConfigError, Settings, WorkerSettings
from .connection import ConnectionInfo
from .handlers import Handler, resolve

if TYPE_CHECKING:
    from .managers.limits import Limits

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
    #: where ``connection`` was read: a worker started by hand follows its coordinator to a new address
    connection_file: str | None = None
    stuck_leave_s: float = _DEFAULT.stuck_leave_s  # a killed attempt still running this long: leave (0: never)
    unsafe_sandbox: bool = False        # run sandbox commands without bubblewrap (explicit opt-in)
    sandbox_options: dict = field(default_factory=dict)   # more SandboxManager keyword arguments
    snapshot_dir: str | None = None     # shared directory for environment snapshots (default: the coordinator's)
    leave_grace_s: float = _DEFAULT.leave_grace_s          # running actions' time to finish when leaving


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
        services = ServiceManager(specs_from_cli(sv.file, sv.service),
                                  discover_devices(cpu_budget_mb=sv.budget_mb,
                                                   memory_budget_mb=sv.gpu_budget_mb or None),
                                  pinned_mb=sv.pinned_mb or None)
        if sv.preload:
            services.preload()
        gpus = gpus or sum(d.name != "cpu" for d in services.devices)
        gpu_mem = gpu_mem or int(services.capacity_mb())
    elif "reward" in kinds:
        kinds.remove("reward")  # nothing to score with
    return WorkerConfig(connection=ConnectionInfo.read(ws.connection_file), connection_file=str(ws.connection_file),
                        cores=ws.cores, mem_mb=ws.mem_mb,
                        gpus=gpus, gpu_mem_mb=gpu_mem, handle=ws.handle,
                        run_dir=str(ws.run_dir) if ws.run_dir else None, heartbeat_s=ws.heartbeat_s,
                        coordinator_timeout_s=ws.coordinator_timeout_s, orphan_exit_s=ws.orphan_exit_s,
                        kinds=tuple(kinds), handlers=handlers, services=services,
                        max_output_bytes=ws.max_output_bytes, unsafe_sandbox=ss.unsafe,
                        snapshot_dir=str(ss.snapshot_dir) if ss.snapshot_dir else None,
                        leave_grace_s=ws.leave_grace_s, stuck_leave_s=ws.stuck_leave_s,
                        sandbox_options={"allow_network": ss.allow_network, "warm_pool": ss.warm_pool,
                                         "env_ttl": ss.env_ttl_s, "seccomp": ss.seccomp,
                                         "sessions": ss.sessions, "session_idle_s": ss.session_idle_s or None,
                                         "session_min_free_mb": ss.session_min_free_mb,
                                         "session_prestart": ss.session_prestart,
                                         "default_limits": sandbox_limits(ss), **sandbox_templates(ss)})


def sandbox_templates(ss) -> dict:
    """The templates of a worker's [sandbox] settings: ``template`` is the default one, named "project"."""
    if ss.template is None:
        return {}
    if not os.path.isdir(ss.template):
        raise ConfigError(f"[sandbox] template {ss.template} is not a directory (--sandbox-template)")
    source = os.path.abspath(ss.template)
    return {"templates": {"project": {"kind": "tree", "source": source}}, "default_template": "project"}


def sandbox_limits(ss) -> Limits:
    """The per-action limits of a worker's [sandbox] settings (0 turns one off)."""
    from .managers.limits import Limits
    return Limits(timeout_s=ss.timeout_s or None, memory_mb=ss.memory_mb or None, disk_mb=ss.disk_mb or None,
                  disk_files=ss.disk_files or None)
