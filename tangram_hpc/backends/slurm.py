"""Worker jobs on Slurm, launched through submitit.

Each worker is one Slurm job running ``tangram_hpc.worker.main([...])``.  Its
handle (``tgw-<run>-<n>``) is chosen before submission, passed to the worker
(``--handle`` and ``$TANGRAM_WORKER_HANDLE``) and used as the job name, so a
registered worker, its job and the accounting record are tied together.

Tracking costs one ``squeue`` per :meth:`SlurmBackend.poll` for all jobs, plus
one ``sacct`` only for jobs that vanished from squeue.  Submitit's own per-job
state calls are never used.  The backend submits what it is asked to (the pool
driver's launch throttle decides how many); :meth:`SlurmBackend.preflight`
and :func:`check_time_limits` refuse, at start, settings the cluster would
refuse or that leave a worker no time to serve.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import shlex
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgpack

from ..config import ConfigError, SlurmSettings
from ..resources import ClusterCapacity, PartitionFree, WorkerShape
from ..slurm import ClusterView, JobInfo, PartitionInfo, SlurmCommandError, cluster_view
from .base import HANDLE_ENV, BackendEvent, JobState, WorkerBackend, WorkerLaunchSpec
from .guards import LaunchRefused

__all__ = ["SlurmBackend", "SlurmBackendConfig", "LaunchRefused", "backend_config", "backend_from_settings",
           "check_time_limits", "slurm_shapes", "run_worker", "SIGNAL_DELAY_S",
           "SLURM_JOBS_LOG"]

log = logging.getLogger(__name__)

#: Written by the backend in the run directory: msgpack records
#: ``[time, handle, job_id, cores, gpus, partition]``, one per submitted job.
SLURM_JOBS_LOG = "slurm_jobs.log"

_PENDING = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                      "SUSPENDED", "RESV_DEL_HOLD"})
_RUNNING = frozenset({"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING"})
_FAILED = frozenset({"FAILED", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY", "DEADLINE", "REVOKED"})


_DEFAULT = SlurmSettings()

#: Seconds before its time limit at which Slurm sends a worker job SIGUSR2 (submitit's warning);
#: the worker then leaves, so it must have been drained by then.
SIGNAL_DELAY_S = 90
#: How much earlier than asked Slurm may send that signal ("due to the resolution of event
#: handling", sbatch(1) --signal): seen on the dev cluster 30 s early.
SIGNAL_EARLY_S = 60
#: The shortest time a worker job must be able to serve between starting and being drained.
MIN_SERVE_S = 60.0


@dataclass
class SlurmBackendConfig:
    """How worker jobs are submitted.

    ``partition``/``gpu_partition``: where CPU/GPU workers go when the shape
    names none (None: the cluster default).  ``time_min``: each job's time
    limit; the coordinator replaces workers before it (see ``time_limit``).
    ``mem_per_core_mb``: memory asked when the shape gives none.
    ``extra_sbatch``: more ``#SBATCH`` options, e.g. ``{"constraint": "ib"}``.
    ``setup``: shell lines run in the job before the worker (module load, venv);
    ``setup_file``: a shell file sourced before them.
    ``entry``: the ``module:function`` the job calls with the worker's argv.
    Defaults of the keys a user sets come from the [slurm] section of
    :mod:`tangram_hpc.config`.
    """

    partition: str | None = None
    gpu_partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int = _DEFAULT.time_min
    mem_per_core_mb: int | None = None
    extra_sbatch: dict[str, str] = field(default_factory=dict)
    setup: tuple[str, ...] = ()
    setup_file: str | None = None
    run_dir: str | None = None
    folder: str | None = None          # submitit folder; default RUN_DIR/submitit/<run tag>
    job_prefix: str = "tgw"
    entry: str = "tangram_hpc.worker:main"
    vanished_grace_s: float = 60.0     # gone from squeue and sacct this long: ended
    signal_delay_s: int = SIGNAL_DELAY_S
    cluster_view: str = _DEFAULT.view


def run_worker(entry: str, argv: list[str], handle: str) -> int:
    """What each worker job runs (module level so submitit pickles it by name)."""
    os.environ[HANDLE_ENV] = handle
    module, _, func = entry.partition(":")
    rc = getattr(importlib.import_module(module), func)(list(argv))
    if rc:
        # a non-zero worker exit must show as a failed job in squeue/sacct
        raise RuntimeError(f"worker {handle} exited with status {rc}")
    return 0


_JOB_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SLURMD_")
_KEEP_ENV = frozenset({"SLURM_CONF"})


@contextlib.contextmanager
def _outside_allocation():
    """Submit as if from outside any job.

    The coordinator usually runs inside its own allocation; its SLURM_* and
    SBATCH_* variables would otherwise leak into worker jobs (exported by
    sbatch) and clash with theirs, e.g. srun refusing SLURM_MEM_PER_NODE
    next to the worker's SLURM_MEM_PER_CPU.
    """
    saved = {k: v for k, v in os.environ.items() if k.startswith(_JOB_ENV_PREFIXES) and k not in _KEEP_ENV}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


@dataclass
class _Job:
    handle: str
    job_id: str
    shape: WorkerShape
    partition: str | None
    submitted: float
    state: JobState = JobState.PENDING
    reason: str = ""
    running_since: float | None = None
    end_time: float | None = None
    reclaimed: bool = False
    vanished_since: float | None = None
    final: bool = False


class SlurmBackend(WorkerBackend):
    name = "slurm"

    def __init__(self, config: SlurmBackendConfig | None = None, *, view: ClusterView | None = None,
                 clock: Callable[[], float] = time.time):
        import submitit  # imported here so the rest of the package works without it

        missing = [c for c in ("sbatch", "srun", "squeue", "scancel") if shutil.which(c) is None]
        if missing:
            raise ConfigError(f"the Slurm backend needs {', '.join(missing)}, not on PATH (PATH="
                              f"{os.environ.get('PATH', '')}): install the Slurm client or load its module")
        self.config = cfg = config or SlurmBackendConfig()
        self.clock = clock
        if view is None:
            try:
                view = cluster_view(cfg.cluster_view)
            except SlurmCommandError as e:
                if cfg.cluster_view != "pyslurm":
                    raise
                raise ConfigError(f"[slurm] view = pyslurm: {e} (view = auto uses it when it can)") from None
        self.view = view
        self.run_tag = uuid.uuid4().hex[:8]
        self.prefix = f"{cfg.job_prefix}-{self.run_tag}-"
        if cfg.folder:
            folder = Path(cfg.folder)
        elif cfg.run_dir:
            folder = Path(cfg.run_dir) / "submitit" / self.run_tag
        else:
            folder = Path.home() / ".tangram" / "submitit" / self.run_tag
        # a reused folder can hand an old job's result to a new job with the same id
        if folder.exists() and any(folder.iterdir()):
            folder = folder / self.run_tag
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._executor = submitit.SlurmExecutor(folder=str(folder), max_num_timeout=0)
        self._jobs: dict[str, _Job] = {}
        self._by_id: dict[str, _Job] = {}
        self._seq = 0
        self._pending_events: list[BackendEvent] = []
        self._partitions: tuple[float, list[PartitionInfo]] | None = None
        self._jobs_log = Path(cfg.run_dir) / SLURM_JOBS_LOG if cfg.run_dir else None
        if self._jobs_log:
            self._jobs_log.parent.mkdir(parents=True, exist_ok=True)

    # -- launching -----------------------------------------------------------
    def _partition_for(self, shape: WorkerShape) -> str | None:
        if shape.partition:
            return shape.partition
        return (self.config.gpu_partition or self.config.partition) if shape.gpus else self.config.partition

    def partitions(self, max_age_s: float = 30.0) -> list[PartitionInfo]:
        """Cluster partitions, cached for ``max_age_s`` (the pool controller reads this)."""
        now = self.clock()
        if self._partitions is None or now - self._partitions[0] > max_age_s:
            self._partitions = (now, self.view.partitions())
        return self._partitions[1]

    def capacity(self) -> ClusterCapacity | None:
        """Free resources per partition (``None`` key: the default partition), for the pool."""
        try:
            parts = self.partitions(max_age_s=5.0)
        except SlurmCommandError:
            return None
        out: dict[str | None, PartitionFree] = {}
        for p in parts:
            free = PartitionFree(cores=p.free_cpus, gpus=p.free_gpus, nodes=len(p.nodes),
                                 max_node_cores=max((n.cpus for n in p.nodes), default=0),
                                 max_node_gpus=max((n.gpus for n in p.nodes), default=0))
            out[p.name] = free
            if p.default:
                out[None] = free
        return ClusterCapacity(out, at=self.clock())

    def check_shape(self, shape: WorkerShape) -> str | None:
        """Why no node of the target partition could ever run this shape, or None."""
        name = self._partition_for(shape)
        try:
            parts = self.partitions()
        except SlurmCommandError as e:
            return None if "not found" not in str(e) else str(e)
        part = next((p for p in parts if (p.name == name if name else p.default)), None)
        if part is None:
            return f"partition {name or '(default)'} does not exist"
        mem = shape.mem_mb or (self.config.mem_per_core_mb or 0) * shape.cores
        if not part.can_hold(shape.cores, shape.gpus, mem):
            return (f"no node in partition {part.name} has {shape.cores} cores, {shape.gpus} GPUs "
                    f"and {mem} MB")
        return None

    def _parameters(self, shape: WorkerShape, handle: str) -> dict:
        cfg = self.config
        params: dict = {"job_name": handle, "cpus_per_task": shape.cores, "ntasks_per_node": 1,
                        "nodes": 1, "time": cfg.time_min, "signal_delay_s": cfg.signal_delay_s,
                        "additional_parameters": dict(cfg.extra_sbatch)}
        partition = self._partition_for(shape)
        if partition:
            params["partition"] = partition
        if shape.gpus:
            params["gres"] = f"gpu:{shape.gpus}"
        mem = shape.mem_mb or (cfg.mem_per_core_mb or 0) * shape.cores
        if mem:
            params["mem"] = f"{mem}M"
        if cfg.account:
            params["account"] = cfg.account
        if cfg.qos:
            params["qos"] = cfg.qos
        # the job must import this package even when it is not installed
        root = str(Path(__file__).resolve().parents[2])
        sourced = [f"source {shlex.quote(cfg.setup_file)}"] if cfg.setup_file else []
        params["setup"] = [f'export PYTHONPATH="{root}${{PYTHONPATH:+:$PYTHONPATH}}"', *sourced, *cfg.setup]
        return params

    def launch(self, spec: WorkerLaunchSpec, count: int = 1) -> list[str]:
        """Submit ``count`` worker jobs; after an sbatch error the rest are not tried (they would fail alike)."""
        now = self.clock()
        why = self.check_shape(spec.shape)
        if why:
            raise LaunchRefused(why)
        handles = []
        for _ in range(count):
            handle, ok = self._submit_one(spec, now)
            handles.append(handle)
            if not ok:
                break
        return handles

    def _submit_one(self, spec: WorkerLaunchSpec, now: float) -> tuple[str, bool]:
        self._seq += 1
        handle = f"{self.prefix}{self._seq:04d}"
        shape = spec.shape
        argv = ["--connection-file", spec.connection_file, "--cores", str(shape.cores),
                "--gpus", str(shape.gpus), "--handle", handle, *spec.extra_args]
        self._executor.update_parameters(**self._parameters(shape, handle))
        partition = self._partition_for(shape)
        try:
            with _outside_allocation():
                job = self._executor.submit(run_worker, self.config.entry, argv, handle)
        except Exception as e:  # sbatch refused (bad account, QOS limit, controller down)
            reason = f"sbatch failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
            log.warning("submitting worker job %s: %s", handle, reason)
            j = _Job(handle, "", shape, partition, now, state=JobState.FAILED, reason=reason, final=True)
            self._jobs[handle] = j
            self._pending_events.append(BackendEvent(handle, JobState.FAILED, reason))
            return handle, False
        j = _Job(handle, str(job.job_id), shape, partition, now)
        self._jobs[handle] = j
        self._by_id[j.job_id] = j
        self._pending_events.append(BackendEvent(handle, JobState.PENDING, "submitted"))
        if self._jobs_log:
            with open(self._jobs_log, "ab") as f:
                f.write(msgpack.packb([now, handle, int(job.job_id), shape.cores, shape.gpus, partition]))
        return handle, True

    def job_id(self, handle: str) -> str | None:
        j = self._jobs.get(handle)
        return j.job_id if j and j.job_id else None

    def handles(self, active_only: bool = True) -> list[str]:
        return [h for h, j in self._jobs.items() if not (active_only and j.final)]

    # -- tracking ------------------------------------------------------------
    def poll(self) -> list[BackendEvent]:
        events, self._pending_events = self._pending_events, []
        live = [j for j in self._jobs.values() if not j.final and j.job_id]
        if not live:
            return events
        now = self.clock()
        try:
            seen = {str(ji.job_id): ji for ji in self.view.jobs(name_prefix=self.prefix)}
        except SlurmCommandError as e:
            log.warning("squeue failed, keeping last known states: %s", e)
            return events
        vanished = []
        for j in live:
            info = seen.get(j.job_id)
            if info is None:
                vanished.append(j)
            else:
                j.vanished_since = None
                self._apply(j, info.state, info.reason, info, now, events)
        if vanished:
            self._resolve_vanished(vanished, now, events)
        return events

    def _resolve_vanished(self, jobs: list[_Job], now: float, events: list[BackendEvent]) -> None:
        try:
            recs = {str(r.job_id): r for r in self.view.accounting([int(j.job_id) for j in jobs])}
        except SlurmCommandError as e:
            log.warning("sacct failed: %s", e)
            recs = {}
        for j in jobs:
            r = recs.get(j.job_id)
            if r is not None and r.state not in _PENDING | _RUNNING:
                self._apply(j, r.state, f"exit code {r.exit_code}" if r.exit_code else "", None, now, events)
                continue
            if j.vanished_since is None:
                j.vanished_since = now
            elif now - j.vanished_since >= self.config.vanished_grace_s:
                self._finish(j, JobState.ENDED, "job vanished from squeue and sacct", now, events)

    def _apply(self, j: _Job, slurm_state: str, reason: str, info: JobInfo | None, now: float,
               events: list[BackendEvent]) -> None:
        if slurm_state in _PENDING:
            if j.state is JobState.RUNNING:  # requeued after preemption
                events.append(BackendEvent(j.handle, JobState.PREEMPTED, f"requeued: {reason or slurm_state}"))
                j.running_since = None
            if j.state is not JobState.PENDING or (reason and reason != j.reason):
                j.state, j.reason = JobState.PENDING, reason
                events.append(BackendEvent(j.handle, JobState.PENDING, reason or slurm_state))
            return
        if slurm_state in _RUNNING:
            if info is not None:
                j.end_time = info.end_time
            if j.state is not JobState.RUNNING and slurm_state != "COMPLETING":
                j.state, j.reason, j.running_since = JobState.RUNNING, "", now
                events.append(BackendEvent(j.handle, JobState.RUNNING, f"on {info.nodes}" if info and info.nodes else ""))
            return
        # final states
        if slurm_state == "COMPLETED":
            self._finish(j, JobState.ENDED, "completed", now, events)
        elif slurm_state == "CANCELLED":
            self._finish(j, JobState.ENDED, "reclaimed" if j.reclaimed else "cancelled outside tangram (scancel)",
                         now, events)
        elif slurm_state == "TIMEOUT":
            self._finish(j, JobState.TIMEOUT, "time limit reached", now, events)
        elif slurm_state == "PREEMPTED":
            self._finish(j, JobState.PREEMPTED, reason or "preempted", now, events)
        else:
            # the state says "failed"; the reason says how: NonZeroExitCode, or node_fail, out_of_memory ...
            why = reason if slurm_state == "FAILED" else f"{slurm_state.lower()}{': ' + reason if reason else ''}"
            # what went wrong is in the job's own error log (a setup line, an import): say where
            why += f"{'; ' if why else ''}its log: {self.folder / f'{j.job_id}_0_log.err'}"
            self._finish(j, JobState.FAILED, why, now, events)

    def _finish(self, j: _Job, state: JobState, reason: str, now: float, events: list[BackendEvent]) -> None:
        j.final, j.state, j.reason = True, state, reason
        events.append(BackendEvent(j.handle, state, reason))
        self._by_id.pop(j.job_id, None)

    # -- stopping ------------------------------------------------------------
    def reclaim(self, handle: str) -> None:
        j = self._jobs.get(handle)
        if j is None or j.final or not j.job_id:
            return
        j.reclaimed = True
        self._scancel([j.job_id])

    def shutdown(self) -> None:
        ids = [j.job_id for j in self._jobs.values() if not j.final and j.job_id]
        for j in self._jobs.values():
            if not j.final:
                j.reclaimed = True
        if ids:
            self._scancel(ids)

    def _scancel(self, ids: list[str]) -> None:
        proc = subprocess.run(["scancel", *ids], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            log.warning("scancel %s failed: %s", " ".join(ids), proc.stderr.strip())

    def time_limit(self, handle: str) -> float | None:
        j = self._jobs.get(handle)
        return j.end_time if j and j.state is JobState.RUNNING else None

    # -- checks at start -------------------------------------------------------
    def preflight(self, shapes: list[WorkerShape]) -> None:
        """Refuse, with the cluster's own words, worker jobs Slurm would refuse or never start.

        ``sbatch --test-only`` with each shape's job script (partition, account, QOS, time, size,
        extra options: whatever the controller checks), the partition's MaxTime, and the account
        and QOS names against the accounting database where there is one (a cluster that does not
        enforce associations would otherwise take a misspelt account silently).
        """
        cfg = self.config
        try:
            parts = self.partitions()
        except SlurmCommandError as e:
            raise ConfigError(f"the Slurm backend cannot read the cluster's partitions: {e}") from None
        for shape in shapes:
            self._test_submit(shape)
            name = self._partition_for(shape)
            part = next((p for p in parts if (p.name == name if name else p.default)), None)
            if part is not None and part.max_time_s is not None and cfg.time_min * 60 > part.max_time_s:
                raise ConfigError(
                    f"{_flag('time_min')} = {cfg.time_min} min is longer than partition {part.name}'s MaxTime "
                    f"({part.max_time_s / 60:g} min, scontrol show partition): its worker jobs would never start")
        for what, name, query in (("account", cfg.account, ["account", "format=account"]),
                                  ("QOS", cfg.qos, ["qos", "format=name"])):
            if name:
                known = self._accounting_names(query)
                if known is not None and name not in known:
                    key = "account" if what == "account" else "qos"
                    raise ConfigError(f"{_flag(key)} = {name!r}: Slurm's accounting knows no {what} of that name "
                                      f"(sacctmgr show {query[0]}: {', '.join(sorted(known)) or 'none'})")

    def _test_submit(self, shape: WorkerShape) -> None:
        from submitit.slurm.slurm import _make_sbatch_string   # the very script submit() would send
        script = _make_sbatch_string(command="true", folder=str(self.folder), **self._parameters(shape, "preflight"))
        try:
            with _outside_allocation():
                proc = subprocess.run(["sbatch", "--test-only"], input=script, capture_output=True, text=True,
                                      timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            raise ConfigError(f"sbatch --test-only could not run: {e}") from None
        if proc.returncode != 0:
            words = "; ".join(line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip())
            raise ConfigError(f"Slurm refuses the worker jobs ({shape.cores} cores, {shape.gpus} GPUs, partition "
                              f"{self._partition_for(shape) or '(default)'}): {words or f'exit status {proc.returncode}'}")

    @staticmethod
    def _accounting_names(query: list[str]) -> set[str] | None:
        """Names sacctmgr lists (None when there is no accounting database to ask)."""
        try:
            proc = subprocess.run(["sacctmgr", "-nP", "show", *query], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        if proc.returncode != 0:
            return None
        return {line.strip() for line in proc.stdout.splitlines() if line.strip()}


# -- from the configuration ([slurm] in tangram_hpc.config) ------------------------------

def _flag(key: str) -> str:
    from ..config import SCHEMA
    from ..config_cli import flag_of
    return f"[slurm] {key} ({flag_of(SCHEMA['slurm'][key], 'coordinator')})"


def check_time_limits(s: SlurmSettings, signal_delay_s: int = SIGNAL_DELAY_S) -> None:
    """Refuse worker time limits that leave a worker no time to serve.

    A worker is drained ``replace_before_s`` before its job's time limit (and a replacement
    launched), and Slurm signals it ``signal_delay_s`` before the limit (up to a minute earlier),
    when it leaves with whatever still runs.  With too short a limit every worker would be
    "expiring at birth": drained as soon as it joins while the pool launches replacement after
    replacement.
    """
    lead = signal_delay_s + SIGNAL_EARLY_S
    if s.replace_before_s < lead:
        raise ConfigError(
            f"{_flag('replace_before_s')} = {s.replace_before_s:g} s is shorter than the {lead} s before its time "
            f"limit at which Slurm may signal a worker job (submitit's USR2 warning at {signal_delay_s} s, which "
            f"Slurm may send up to {SIGNAL_EARLY_S} s early): the worker would leave with its actions running "
            f"before it is drained. Use at least {lead}.")
    serve = s.time_min * 60 - s.replace_before_s
    need = max(MIN_SERVE_S, 2 * s.startup_s)
    if serve < need:
        shortest = math.ceil((s.replace_before_s + need) / 60)
        raise ConfigError(
            f"{_flag('time_min')} = {s.time_min} min leaves a worker {max(serve, 0):g} s to serve: it is drained and "
            f"replaced {_flag('replace_before_s')} = {s.replace_before_s:g} s before its time limit, so every worker "
            f"would expire at birth (it needs at least {need:g} s: one minute, and twice {_flag('startup_s')}). Use "
            f"a time of {shortest} min or more, or a smaller replace_before_s (not under {lead} s).")


def slurm_shapes(s: SlurmSettings) -> list[WorkerShape]:
    """The worker shapes the [slurm] settings ask for: the CPU shape, and the GPU one when there are GPU workers."""
    shapes = [WorkerShape(cores=s.worker_cores, mem_mb=s.worker_mem_mb, partition=s.partition)]
    if s.gpu_workers:
        shapes.append(WorkerShape(cores=s.gpu_worker_cores, gpus=s.gpus_per_worker,
                                  partition=s.gpu_partition or s.partition))
    return shapes


#: sbatch options every worker job gets from the backend, and the setting each comes from.
_SET_BY_THE_BACKEND = {
    "time": "[slurm] time_min", "t": "[slurm] time_min", "partition": "[slurm] partition / gpu_partition",
    "p": "[slurm] partition / gpu_partition", "account": "[slurm] account", "A": "[slurm] account",
    "qos": "[slurm] qos", "q": "[slurm] qos", "cpus-per-task": "[slurm] worker_cores", "c": "[slurm] worker_cores",
    "mem": "[slurm] worker_mem_mb / mem_per_core_mb", "gres": "[slurm] gpus_per_worker",
    "signal": "the time-limit warning it needs", "job-name": "the worker's handle", "J": "the worker's handle",
    "nodes": "one node per worker", "N": "one node per worker", "ntasks-per-node": "one task per worker",
}


def backend_config(s: SlurmSettings, run_dir: str | os.PathLike | None = None) -> SlurmBackendConfig:
    """The backend config of a coordinator's [slurm] settings; ``run_dir``: the coordinator's."""
    extra = {}
    for item in s.sbatch:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"[slurm] sbatch wants KEY=VALUE, got {item!r}")
        key = key.strip().lstrip("-")
        own = _SET_BY_THE_BACKEND.get(key.replace("_", "-"))
        if own is not None:
            # it would replace what the backend asks for, past the checks made on that setting
            # (a time limit shorter than time_min drains every worker at birth, one launch after another)
            raise ConfigError(f"[slurm] sbatch may not set {key}: the backend sets it from {own}")
        extra[key] = value
    setup_file = None
    if s.setup_file:
        # the jobs start elsewhere: a relative path is this process's
        setup_file = os.path.abspath(os.path.expanduser(s.setup_file))
        if not os.path.isfile(setup_file):
            raise ConfigError(f"[slurm] setup_file (TANGRAM_SETUP): no file {setup_file}")
    return SlurmBackendConfig(
        partition=s.partition, gpu_partition=s.gpu_partition, account=s.account, qos=s.qos, time_min=s.time_min,
        mem_per_core_mb=s.mem_per_core_mb, extra_sbatch=extra, setup=tuple(s.setup), setup_file=setup_file,
        run_dir=str(run_dir) if run_dir else None, cluster_view=s.view)


def backend_from_settings(s: SlurmSettings, run_dir: str | os.PathLike | None = None, *,
                          preflight: bool = True) -> SlurmBackend:
    """The coordinator's Slurm backend; pass the coordinator's resolved run directory.

    With ``preflight`` (what a coordinator does), settings Slurm would refuse, or that leave a
    worker no time to serve, are a :class:`ConfigError` here rather than a pool that never grows.
    """
    check_time_limits(s)
    backend = SlurmBackend(backend_config(s, run_dir))
    if preflight:
        backend.preflight(slurm_shapes(s))
    return backend
