"""verl reward functions that score on tangram-hpc reward services, batched.

In verl's config (0.9: the ``reward`` section; older releases: top level)::

    reward.custom_reward_function.path=pkg://tangram_hpc.integrations.verl
    reward.custom_reward_function.name=compute_score
    +reward.custom_reward_function.reward_kwargs.service=judge
    +reward.custom_reward_function.reward_kwargs.connection_file=/shared/run/connection.json

:func:`compute_score` is a coroutine: verl's reward loop calls it once per
sample, many at a time, and the calls made within a few milliseconds go to
the service as one ``reward`` action (:class:`~.batching.RewardBatcher`).
:func:`compute_score_batch` takes whole lists, for verl's ``batch`` reward
manager.  Each input the service sees is ``{"response": solution_str,
"reference": ground_truth (JSON text unless a string), "data_source"}``; its
score (a number, or a dict with ``"score"``) is returned as is.

Imports are absolute so that verl may also load this file by path.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Sequence

from tangram_hpc.actions import Status, reward
from tangram_hpc.client import Client
from tangram_hpc.connection import CONNECTION_FILE_ENV
from tangram_hpc.errors import ConfigError
from tangram_hpc.integrations.clients import shared_client
from tangram_hpc.integrations.batching import RewardBatcher, RewardError, reward_item

__all__ = ["compute_score", "compute_score_batch", "batching_stats", "RewardError"]

# Per event loop (verl may run several, one per thread): the loop and its batchers.
_loops: dict[int, tuple[asyncio.AbstractEventLoop, dict[tuple, RewardBatcher]]] = {}
_totals: Counter = Counter()


def _client(connection_file: str | None) -> Client:
    try:
        return shared_client(connection_file, "verl-reward")
    except ConfigError:
        raise RewardError(f"tangram reward: pass reward_kwargs.connection_file or set ${CONNECTION_FILE_ENV}") from None


def _batcher(service: str, connection_file: str | None, max_batch: int, batch_window_ms: float,
             timeout_s: float | None, wait_s: float | None, gpu_mem_mb: int) -> RewardBatcher:
    client = _client(connection_file)
    loop = asyncio.get_running_loop()
    entry = _loops.get(id(loop))
    if entry is None or entry[0] is not loop:
        for ended in [k for k, (other, _) in _loops.items() if other.is_closed()]:
            del _loops[ended]  # loops that ended (each asyncio.run makes one)
        entry = _loops[id(loop)] = (loop, {})
    batchers = entry[1]
    key = (id(client), service, max_batch, batch_window_ms, timeout_s, wait_s, gpu_mem_mb)
    b = batchers.get(key)
    if b is None:
        b = batchers[key] = RewardBatcher(lambda spec: asyncio.wrap_future(client.submit(spec)), client.cancel,
                                          service, max_batch=max_batch, window_s=batch_window_ms / 1000.0,
                                          timeout=timeout_s, wait_s=wait_s, gpu_mem_mb=gpu_mem_mb, totals=_totals)
    return b


def batching_stats() -> dict[str, int]:
    """Reward actions sent by :func:`compute_score` in this process, and the inputs they carried."""
    return {"actions": _totals["actions"], "items": _totals["items"]}


async def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                        *, service: str, connection_file: str | None = None, max_batch: int = 64,
                        batch_window_ms: float = 5.0, timeout_s: float | None = None, wait_s: float = 600.0,
                        gpu_mem_mb: int = 0, on_error: float | None = None, **_: Any) -> Any:
    """verl's ``compute_score`` for one sample, scored by ``service`` in batches.

    ``timeout_s``: how long the reward action may run once started; ``wait_s``: how
    long to wait for its result in all, queueing included (then it is cancelled).
    ``on_error``: the score to give when the reward action fails (default: raise
    :class:`RewardError`, so a broken service cannot quietly train on zeros).
    Unknown keyword arguments verl passes (e.g. ``reward_router_address``) are ignored.
    """
    b = _batcher(service, connection_file, max_batch, batch_window_ms, timeout_s, wait_s, gpu_mem_mb)
    try:
        return await b.score(reward_item(solution_str, ground_truth, data_source=str(data_source)))
    except RewardError:
        if on_error is None:
            raise
        return on_error


def compute_score_batch(data_sources: Sequence[str], solution_strs: Sequence[str], ground_truths: Sequence[Any],
                        extra_infos: Sequence[dict] | None = None, *, service: str,
                        connection_file: str | None = None, max_batch: int = 64, timeout_s: float | None = None,
                        wait_s: float = 600.0, gpu_mem_mb: int = 0, on_error: float | None = None,
                        **_: Any) -> list[Any]:
    """verl's batch ``compute_score``: the lists go out as reward actions of ``max_batch`` inputs."""
    items = [reward_item(s, g, data_source=str(d)) for d, s, g in zip(data_sources, solution_strs, ground_truths)]
    client = _client(connection_file)
    specs = [reward(service, items[i:i + max_batch], gpu_mem_mb=gpu_mem_mb, timeout=timeout_s)
             for i in range(0, len(items), max_batch)]
    futures = client.submit_many(specs)
    try:
        results = client.gather(futures, timeout=wait_s)
    except FutureTimeout:
        client.cancel([spec.id for spec, fut in zip(specs, futures) if not fut.done()])
        if on_error is None:
            raise RewardError(f"no result from reward service {service!r} within {wait_s:g}s "
                              f"(is a worker offering it?); its actions were cancelled") from None
        return [on_error] * len(items)
    scores: list[Any] = []
    for spec, res in zip(specs, results):
        n = len(spec.payload["inputs"])
        if res.status == Status.OK and isinstance(res.output, list) and len(res.output) == n:
            scores.extend(res.output)
        elif on_error is not None:
            scores.extend([on_error] * n)
        else:
            raise RewardError(f"reward action {res.status}: {res.error}", res)
    return scores
