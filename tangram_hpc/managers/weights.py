"""A service's weights: one host copy for the service's life, device copies made and dropped.

At its first placement a torch service's parameters and buffers become a
:class:`HostCopy`: the host tensors are pinned (page-locked) where the worker's
pinned cap allows, and kept.  Making the service resident allocates device
tensors and copies into them in chunks, non-blocking, on the device's load
stream, so a scoring thread keeps computing on the default stream meanwhile.
Evicting it points the model back at the host tensors and drops the device
ones: nothing is copied back, since the weights did not change, unless the
model declares ``mutable_state = True`` (then its device tensors are copied
into the host copy first).

Every CUDA call goes through a :class:`~tangram_hpc.managers.devices.DeviceOps`,
so the logic here runs (and is tested) with a fake device object on a machine
without a GPU.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from .devices import Device, DeviceOps

__all__ = ["HostCopy", "PinnedBudget", "torch_weights", "CHUNK_BYTES"]

_log = logging.getLogger(__name__)

#: Bytes per copy call.  Chunks let a load of many GB interleave with scoring on
#: the same copy engine and keep each call's staging bounded when the source is
#: pageable; 64 MB is far above the size where a copy reaches full bandwidth.
CHUNK_BYTES = 64 << 20


class PinnedBudget:
    """Pinned host memory held by a worker's services, capped (``[services] pinned_mb``).

    Page-locked memory cannot be swapped out and is taken from the whole node,
    so a worker holds at most ``cap_mb`` of it; the services beyond stay pageable.
    """

    def __init__(self, cap_mb: float | None) -> None:
        self.cap_bytes = None if cap_mb is None else int(cap_mb * 2**20)
        self.used_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.cap_bytes is not None and self.used_bytes + nbytes > self.cap_bytes:
                return False
            self.used_bytes += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.used_bytes -= nbytes


def torch_weights(model: Any) -> Any | None:
    """The torch module holding ``model``'s weights, or None when they are not torch tensors.

    A model says where its weights are with ``weights()`` (a wrapper returns its
    inner module); a torch module is its own.
    """
    weights = getattr(model, "weights", None)
    if callable(weights):
        return weights()
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        return model
    return None


class HostCopy:
    """The kept host tensors of one torch module, and the device tensors while it is resident.

    ``pinned`` says whether the host tensors are page-locked; ``note`` why not
    (for stats and the log).  Not thread-safe: the manager gives a service to
    one thread at a time.
    """

    def __init__(self, module: Any, ops: DeviceOps, budget: PinnedBudget, *, pin: bool) -> None:
        self.module = module
        self.ops = ops
        self._places: list[tuple[Any, bool, str, int]] = []   # (owner module, is parameter, name, tensor index)
        self.host: list[Any] = []
        seen: dict[int, int] = {}
        for owner in module.modules():
            for is_param, table in ((True, owner._parameters), (False, owner._buffers)):
                for name, t in table.items():
                    if t is None:
                        continue
                    # Tied weights (one tensor under two names) are copied once.
                    i = seen.setdefault(id(t), len(self.host))
                    if i == len(self.host):
                        self.host.append(t.data.contiguous() if is_param else t.contiguous())
                    self._places.append((owner, is_param, name, i))
        self.nbytes = sum(t.numel() * t.element_size() for t in self.host)
        self.pinned = False
        self.note: str | None = None
        self._budget = budget
        if pin:
            self._pin()
        else:
            self.note = "pageable: no CUDA device to pin host memory for"
        self._point_at(self.host)
        self.device: Device | None = None
        self._on_device: list[Any] | None = None

    def _pin(self) -> None:
        if not self._budget.take(self.nbytes):
            cap = self._budget.cap_bytes or 0
            self.note = (f"pageable: pinning {self.nbytes / 2**20:.0f} MB would pass the worker's pinned "
                         f"cap of {cap / 2**20:.0f} MB ({self._budget.used_bytes / 2**20:.0f} MB pinned)")
            return
        pinned: list[Any] = []
        try:
            for t in self.host:
                pinned.append(self.ops.pin(t))
        except Exception as e:  # pinning is an optimisation: a service stays usable without it
            self._unpin(pinned)
            self._budget.give(self.nbytes)
            self.note = f"pageable: pinning failed: {type(e).__name__}: {e}"
            return
        self.host = pinned
        self.pinned = True

    def _unpin(self, pinned: list[Any]) -> None:
        # Tensors pinned in place are unregistered; pinned copies free themselves.
        for original, p in zip(self.host, pinned):
            if p is original:
                try:
                    self.ops.unpin(p)
                except Exception:
                    _log.exception("unpinning a host tensor failed")

    def release(self) -> None:
        """Unpin the host copy and give back its accounting (the service is forgotten)."""
        if self.pinned:
            self._unpin(self.host)
            self._budget.give(self.nbytes)
            self.pinned = False

    @property
    def resident(self) -> bool:
        return self._on_device is not None

    def load(self, device: Device) -> None:
        """Copy the host tensors to ``device`` and point the module at the copies.

        On failure (out of memory included) the partial device tensors are
        dropped and the module still points at the host copy.
        """
        ops = self.ops
        stream = ops.load_stream(device)
        on_device: list[Any] = []
        try:
            with ops.on_stream(stream):
                for t in self.host:
                    d = ops.empty_like(t, device)
                    _copy_chunked(d, t, non_blocking=self.pinned)
                    on_device.append(d)
            ops.synchronize(stream)
        except BaseException:
            on_device.clear()
            raise
        self._on_device = on_device
        self.device = device
        self._point_at(on_device)

    def drop(self, copy_back: bool = False) -> None:
        """Point the module back at the host copy and free the device tensors.

        ``copy_back``: the model changed its device tensors (``mutable_state``);
        copy them into the host copy first.
        """
        on_device = self._on_device
        if on_device is None:
            return
        if copy_back and self.device is not None:
            stream = self.ops.load_stream(self.device)
            self.ops.wait_for_current(stream)
            with self.ops.on_stream(stream):
                for h, d in zip(self.host, on_device):
                    _copy_chunked(h, d, non_blocking=self.pinned)
            self.ops.synchronize(stream)
        self._point_at(self.host)
        self._on_device = None
        self.device = None

    def _point_at(self, tensors: list[Any]) -> None:
        for owner, is_param, name, i in self._places:
            if is_param:
                owner._parameters[name].data = tensors[i]
            else:
                owner._buffers[name] = tensors[i]


def _copy_chunked(dst: Any, src: Any, *, non_blocking: bool) -> None:
    nbytes = src.numel() * src.element_size()
    if nbytes <= CHUNK_BYTES or src.dim() == 0:
        dst.copy_(src, non_blocking=non_blocking)
        return
    d, s = dst.view(-1), src.view(-1)
    step = max(1, CHUNK_BYTES // src.element_size())
    for lo in range(0, s.numel(), step):
        d[lo:lo + step].copy_(s[lo:lo + step], non_blocking=non_blocking)
