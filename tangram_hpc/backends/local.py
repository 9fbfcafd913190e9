"""Workers as plain processes on this machine: the embedded default when there is no Slurm.

Plain ``subprocess`` rather than submitit's LocalExecutor: a worker is a
long-lived server, not a function whose result we wait for, so pickling a
callable, a job folder per worker and submitit's result polling would add a
second of start-up and files to clean for nothing.  A process exit is seen
at the next :meth:`poll`, which is how the coordinator learns of a SIGKILLed
worker before its heartbeat times out.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from .base import BackendEvent, JobState, WorkerBackend, WorkerLaunchSpec


class LocalBackend(WorkerBackend):
    name = "local"

    def __init__(self, log_dir: str | os.PathLike, python: str = sys.executable):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.python = python
        self._procs: dict[str, subprocess.Popen] = {}
        self._seq = 0

    def launch(self, spec: WorkerLaunchSpec, count: int = 1) -> list[str]:
        handles = []
        for _ in range(count):
            self._seq += 1
            handle = f"local-{os.getpid()}-{self._seq}"
            shape = spec.shape
            cmd = [self.python, "-m", "tangram_hpc.worker", "--connection-file", spec.connection_file,
                   "--cores", str(shape.cores), "--handle", handle]
            if shape.mem_mb:
                cmd += ["--mem-mb", str(shape.mem_mb)]
            if shape.gpus:
                cmd += ["--gpus", str(shape.gpus), "--gpu-mem-mb", str(shape.gpus * shape.gpu_mem_mb)]
            cmd += list(spec.extra_args)
            out = open(self.log_dir / f"{handle}.log", "ab")
            try:
                # Own session: killing the coordinator's terminal group does not kill workers
                # mid-action, and reclaim() can signal a worker's whole process tree.
                self._procs[handle] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                       stdin=subprocess.DEVNULL, start_new_session=True)
            finally:
                out.close()
            handles.append(handle)
        return handles

    def poll(self) -> list[BackendEvent]:
        events = []
        for handle, p in list(self._procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            del self._procs[handle]
            if rc == 0:
                events.append(BackendEvent(handle, JobState.ENDED))
            else:
                why = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
                if rc > 0:      # it ended itself: its log says why (a signal is a reclaim or the kernel)
                    log = self.log_dir / f"{handle}.log"
                    last = _last_line(log)
                    why += f"{': ' + last if last else ''}; its log: {log}"
                events.append(BackendEvent(handle, JobState.FAILED, why))
        return events

    def reclaim(self, handle: str) -> None:
        p = self._procs.get(handle)
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def shutdown(self) -> None:
        for p in self._procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self._procs.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._procs.clear()


def _last_line(path: Path, limit: int = 300) -> str:
    """The last non-empty line of a worker's log (where a worker that could not start says why)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    last = next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
    return last[:limit]
