"""Which accelerators a GPU worker may use, and how much memory services may take on each.

GPUs come from the job's allocation: ``CUDA_VISIBLE_DEVICES`` when set, else
Slurm's gres variables (``SLURM_STEP_GPUS``, then ``SLURM_JOB_GPUS``), and
torch.cuda when torch is installed.  With no usable GPU there is one ``cpu``
device whose memory budget is a byte budget standing in for GPU memory, so
the residency and eviction logic runs (and is tested) on any machine.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping

from ..resources import GPU_MEMORY_SHARE

__all__ = ["Device", "DeviceOps", "discover_devices", "visible_gpu_ids", "DEFAULT_CPU_BUDGET_MB", "CPU_BUDGET_ENV"]

#: Budget of the CPU stand-in device when none is configured.
DEFAULT_CPU_BUDGET_MB = 4096
CPU_BUDGET_ENV = "TANGRAM_SERVICE_CPU_BUDGET_MB"
HOST = "cpu"


@dataclass(slots=True, frozen=True)
class Device:
    """One place services are made resident.

    ``name`` is what the model's ``to()`` is called with (``"cuda:0"``,
    ``"cpu"``); ``memory_mb`` the budget services may occupy on it;
    ``physical_id`` the GPU id from the allocation, for reports;
    ``headroom_mb`` what must stay free on the card beside the services
    (activations, the CUDA context): a load fits only where the card's free
    memory, re-read before it, leaves that much.
    """

    name: str
    memory_mb: float
    physical_id: str | None = None
    headroom_mb: float = 0.0

    @property
    def is_gpu(self) -> bool:
        return self.name.startswith("cuda")

    @property
    def index(self) -> int | None:
        return int(self.name.split(":", 1)[1]) if self.is_gpu else None

    def with_budget(self, memory_mb: float) -> "Device":
        return Device(self.name, memory_mb, self.physical_id, self.headroom_mb)


def visible_gpu_ids(env: Mapping[str, str] | None = None) -> list[str] | None:
    """GPU ids this process was given, from CUDA_VISIBLE_DEVICES or Slurm's gres variables.

    None when no variable says anything (then torch.cuda decides); an empty
    list when one says "no GPU".
    """
    env = os.environ if env is None else env
    for var in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        raw = env.get(var)
        if raw is None:
            continue
        raw = raw.strip()
        # An explicitly empty / disabled list means "no GPU", not "look further".
        if raw in ("", "-1", "NoDevFiles", "none"):
            return []
        return _expand_ids(raw)
    return None


def _expand_ids(raw: str) -> list[str]:
    ids: list[str] = []
    for part in raw.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        if dash and lo.isdigit() and hi.isdigit():
            ids.extend(str(i) for i in range(int(lo), int(hi) + 1))
        elif part:
            ids.append(part)
    return ids


def discover_devices(*, memory_budget_mb: float | None = None, cpu_budget_mb: float | None = None,
                     use_torch: bool = True, env: Mapping[str, str] | None = None) -> list[Device]:
    """The devices services may use, each with its memory budget.

    ``memory_budget_mb`` caps every GPU's budget (default: 90% of its memory);
    ``cpu_budget_mb`` sets the CPU stand-in's budget (default: the
    ``TANGRAM_SERVICE_CPU_BUDGET_MB`` variable, else 4096).  When only Slurm's
    variables name the GPUs, CUDA_VISIBLE_DEVICES is set from them before
    CUDA starts so torch sees exactly the allocation.
    """
    real_env = env is None
    env = os.environ if env is None else env
    ids = visible_gpu_ids(env)
    if real_env and ids and "CUDA_VISIBLE_DEVICES" not in os.environ and not _cuda_started():
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    if ids != [] and use_torch and importlib.util.find_spec("torch") is not None:
        gpus = _torch_gpus(ids, memory_budget_mb)
        if gpus:
            return gpus
    budget = cpu_budget_mb
    if budget is None:
        budget = float(env.get(CPU_BUDGET_ENV, DEFAULT_CPU_BUDGET_MB))
    return [Device(HOST, float(budget))]


def _cuda_started() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _torch_gpus(ids: list[str] | None, memory_budget_mb: float | None) -> list[Device]:
    import torch

    if not torch.cuda.is_available():
        return []
    devices = []
    for i in range(torch.cuda.device_count()):
        total_mb = torch.cuda.get_device_properties(i).total_memory / 2**20
        budget = total_mb * GPU_MEMORY_SHARE
        if memory_budget_mb is not None:
            budget = min(budget, memory_budget_mb)
        devices.append(Device(f"cuda:{i}", budget, ids[i] if ids and i < len(ids) else str(i),
                              headroom_mb=total_mb * (1 - GPU_MEMORY_SHARE)))
    return devices


def _torch() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        import torch
    return torch


class DeviceOps:
    """The memory calls the service manager makes on its devices, and nothing else.

    Thin on purpose: all decisions (budgets, eviction, retry, fallback) are the
    manager's, so a test can give it a fake with the same methods and exercise
    them without a GPU.  On the ``cpu`` stand-in the calls are plain copies and
    the memory queries answer None ("only the budget counts").
    """

    def bind_thread(self, device: Device) -> None:
        """Make ``device`` the current CUDA device of the calling (scoring or loading) thread."""
        if device.is_gpu:
            _torch().cuda.set_device(device.index)

    def can_pin(self) -> bool:
        """Whether pinning host memory means anything here (a CUDA device exists)."""
        torch = sys.modules.get("torch")
        return bool(torch is not None and torch.cuda.is_available())

    def pin(self, tensor: Any) -> Any:
        """``tensor`` page-locked: registered in place where CUDA allows, else a pinned copy.

        Registering avoids a second host copy and the pinned allocator's
        rounding of every size up to a power of two (a 33 GB service would take 64 GB).
        """
        torch = _torch()
        cudart = torch.cuda.cudart()
        register = getattr(cudart, "cudaHostRegister", None)
        if register is not None and tensor.numel():
            err = int(register(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                               _CUDA_HOST_REGISTER_PORTABLE))
            if err == 0:
                return tensor
            # A failed runtime call leaves its error to be read: clear it, or torch's next launch check
            # would report it as its own.
            clear = getattr(cudart, "cudaGetLastError", None)
            if clear is not None:
                clear()
            if err == _CUDA_HOST_MEMORY_ALREADY_REGISTERED:
                return tensor
        return tensor.pin_memory()

    def unpin(self, tensor: Any) -> None:
        """Undo :meth:`pin` of a tensor registered in place (before its memory is freed)."""
        if tensor.numel():
            int(_torch().cuda.cudart().cudaHostUnregister(tensor.data_ptr()))

    def empty_like(self, tensor: Any, device: Device) -> Any:
        return _torch().empty_like(tensor, device=device.name)

    def load_stream(self, device: Device) -> Any:
        """The stream loads to ``device`` are copied on (one per device; None on the CPU)."""
        if not device.is_gpu:
            return None
        streams = self.__dict__.setdefault("_streams", {})
        stream = streams.get(device.name)
        if stream is None:
            stream = streams[device.name] = _torch().cuda.Stream(device=device.index)
        return stream

    def on_stream(self, stream: Any) -> Any:
        return contextlib.nullcontext() if stream is None else _torch().cuda.stream(stream)

    def synchronize(self, stream: Any) -> None:
        if stream is not None:
            stream.synchronize()

    def wait_for_current(self, stream: Any) -> None:
        """``stream`` starts its next work after what the current stream has queued (scoring)."""
        if stream is not None:
            stream.wait_stream(_torch().cuda.current_stream(stream.device))

    def free_mb(self, device: Device) -> float | None:
        """Memory this process could allocate on ``device`` now: free on the card plus its own cache.

        None for the CPU stand-in (only the budget counts there).
        """
        if not device.is_gpu:
            return None
        torch = _torch()
        free, _total = torch.cuda.mem_get_info(device.index)
        cached = torch.cuda.memory_reserved(device.index) - torch.cuda.memory_allocated(device.index)
        return (free + cached) / 2**20

    def allocated_mb(self, device: Device) -> float | None:
        if not device.is_gpu:
            return None
        return _torch().cuda.memory_allocated(device.index) / 2**20

    def release_cache(self, device: Device) -> None:
        """Give this process's cached free blocks back to the driver (for other processes, or a large block)."""
        torch = sys.modules.get("torch")
        if device.is_gpu and torch is not None:     # without torch, nothing of torch's to give back
            torch.cuda.empty_cache()

    def is_out_of_memory(self, exc: BaseException) -> bool:
        torch = sys.modules.get("torch")
        oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
        return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()


_CUDA_HOST_MEMORY_ALREADY_REGISTERED = 712
#: pinned for every device of the process, not only the current one (a worker with several GPUs)
_CUDA_HOST_REGISTER_PORTABLE = 1
