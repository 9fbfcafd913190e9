"""Coalescing concurrent reward requests into batched ``reward`` actions.

RL frameworks score one sample per call (verl's reward loop runs one
``compute_score`` coroutine per sample; OpenRLHF posts one query per
request), while a reward model is fastest on batches.  A
:class:`RewardBatcher` collects the items requested on one event loop within
``window_s`` (or until ``max_batch`` are waiting) and sends them as one
``reward`` action; the worker's service manager may batch further with other
actions for the same service.
"""
from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any, Callable, Iterable

from tangram_hpc.actions import ActionResult, ActionSpec, Status, reward
from tangram_hpc.errors import TangramError

__all__ = ["RewardBatcher", "RewardError", "reward_item"]


class RewardError(TangramError, RuntimeError):
    """A reward action did not give one score per input; ``result`` says why."""

    def __init__(self, message: str, result: ActionResult | None = None):
        super().__init__(message)
        self.result = result


def reward_item(response: str, reference: Any, **extra: Any) -> dict[str, Any]:
    """One input of a reward service: ``{"response", "reference", ...}`` (see docs/services.md).

    A reference that is not text (verl ground truths may be test-case maps) is
    sent as JSON text, so every service gets a string.
    """
    if not isinstance(reference, str):
        reference = json.dumps(reference, sort_keys=True, default=str)
    return {"response": response, "reference": reference, **extra}


class RewardBatcher:
    """Batches :meth:`score` calls made on one event loop into ``reward`` actions for ``service``.

    ``submit`` sends an action and returns an asyncio future of its result on this loop
    (``AsyncClient.submit_nowait``, or ``asyncio.wrap_future`` of ``Client.submit`` for a client
    shared by several loops); ``cancel`` cancels actions by id.
    """

    def __init__(self, submit: Callable[[ActionSpec], "asyncio.Future[ActionResult]"],
                 cancel: Callable[[str | Iterable[str]], None], service: str, *, max_batch: int = 64,
                 window_s: float = 0.005,
                 timeout: float | None = None, wait_s: float | None = 600.0, gpu_mem_mb: int = 0,
                 totals: Counter | None = None):
        if max_batch < 1 or window_s < 0 or (wait_s is not None and wait_s <= 0):
            raise ValueError("max_batch must be at least 1, window_s not negative and wait_s positive")
        self.submit = submit
        self.cancel = cancel
        self.service = service
        self.max_batch = max_batch
        self.window_s = window_s
        self.timeout = timeout   # seconds the action may run once started (the coordinator's deadline)
        # Seconds to wait for a result in all, queueing included: an action for a service that no
        # worker offers waits in the queue for one to join, and the caller must not wait forever.
        self.wait_s = wait_s
        self.gpu_mem_mb = gpu_mem_mb
        # Reward actions sent and the inputs they carried, here and (optionally) in ``totals``
        # shared by the batchers of several event loops.
        self.totals: Counter = totals if totals is not None else Counter()
        self._items: list[Any] = []
        self._futures: list[asyncio.Future] = []
        self._timer: asyncio.TimerHandle | None = None

    async def score(self, item: Any) -> Any:
        """The service's score for one input (raises :class:`RewardError` if the action fails)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._items.append(item)
        self._futures.append(fut)
        if len(self._items) >= self.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.window_s, self._flush)
        return await fut

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        items, futures = self._items, self._futures
        self._items, self._futures = [], []
        if not items:
            return
        self.totals["actions"] += 1
        self.totals["items"] += len(items)
        spec = reward(self.service, items, gpu_mem_mb=self.gpu_mem_mb, timeout=self.timeout)
        pending = self.submit(spec)
        pending.add_done_callback(lambda f: _deliver(f, futures))
        if self.wait_s is not None:
            expiry = asyncio.get_running_loop().call_later(self.wait_s, self._expire, spec.id, pending, futures)
            pending.add_done_callback(lambda _: expiry.cancel())

    def _expire(self, action_id: str, pending: asyncio.Future, futures: list[asyncio.Future]) -> None:
        if pending.done():
            return
        self.cancel(action_id)
        error = RewardError(f"no result from reward service {self.service!r} within {self.wait_s:g}s "
                            f"(is a worker offering it?); action {action_id} cancelled")
        for fut in futures:
            if not fut.done():
                fut.set_exception(error)


def _deliver(done: asyncio.Future, futures: list[asyncio.Future]) -> None:
    try:
        res: ActionResult = done.result()
    except Exception as e:  # the client could not even submit it
        error: RewardError | None = RewardError(f"reward action not submitted: {e}")
    else:
        error = None
        if res.status != Status.OK:
            error = RewardError(f"reward action {res.status}: {res.error}", res)
        elif not isinstance(res.output, list) or len(res.output) != len(futures):
            error = RewardError(f"reward service gave {type(res.output).__name__} for {len(futures)} inputs", res)
    for i, fut in enumerate(futures):
        if fut.done():
            continue  # its caller was cancelled
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(res.output[i])
