"""verl's reward functions and OpenRLHF's remote reward model, scored by a real tangram reward service."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import signal

import aiohttp
import pytest

from tangram_hpc.integrations import verl as tverl
from tangram_hpc.integrations.batching import RewardError
from tangram_hpc.launch import LocalCluster
from tangram_hpc.managers.rewards import HashingEmbeddingModel

from serve_support import running_serve

pytestmark = pytest.mark.slow

# The worker loads the service with the loader's defaults; the same defaults here give the same model.
SERVICE = "judge=tangram_hpc.managers.rewards:hashing_similarity,max_wait_ms=2"
MODEL = HashingEmbeddingModel()

SAMPLES = [(f"def add(a, b): return a + b  # v{i}", f"adds two numbers {i % 7}") for i in range(120)]


def expected(response: str, reference: str) -> float:
    return MODEL.similarity(response, reference)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(workers=1, cores=1, reward_workers=1, services=[SERVICE],
                      run_dir=tmp_path_factory.mktemp("integrations-run")) as cl:
        yield cl


def test_verl_compute_score_batches_concurrent_calls(cluster):
    kw = {"service": "judge", "connection_file": str(cluster.connection_file)}

    async def step():
        return await asyncio.gather(*(tverl.compute_score("codegen", resp, ref, {"i": i}, **kw)
                                      for i, (resp, ref) in enumerate(SAMPLES)))

    before = tverl.batching_stats()
    scores = asyncio.run(step())
    assert scores == pytest.approx([expected(r, g) for r, g in SAMPLES], abs=1e-5)
    after = tverl.batching_stats()
    sent, items = after["actions"] - before["actions"], after["items"] - before["items"]
    assert items == len(SAMPLES)
    assert sent <= 4, f"{len(SAMPLES)} calls went out as {sent} reward actions"  # 64 per action at most


def test_verl_compute_score_batch_and_errors(cluster):
    kw = {"service": "judge", "connection_file": str(cluster.connection_file), "max_batch": 50}
    scores = tverl.compute_score_batch(["codegen"] * len(SAMPLES), [s for s, _ in SAMPLES],
                                       [g for _, g in SAMPLES], [{}] * len(SAMPLES), **kw)
    assert scores == pytest.approx([expected(r, g) for r, g in SAMPLES], abs=1e-5)
    # A ground truth that is not text reaches the service as JSON text.
    (s,) = tverl.compute_score_batch(["x"], ["a b"], [{"inputs": ["a"], "outputs": ["b"]}], **kw)
    assert s == pytest.approx(expected("a b", '{"inputs": ["a"], "outputs": ["b"]}'), abs=1e-5)
    # No worker can ever offer this service: the call fails at once, saying why.
    bad = {"service": "no-such-service", "connection_file": str(cluster.connection_file), "wait_s": 30.0}
    with pytest.raises(RewardError, match="cannot be placed: service 'no-such-service' is hosted by no worker"):
        tverl.compute_score_batch(["x"], ["a"], ["b"], **bad)
    assert tverl.compute_score_batch(["x"], ["a"], ["b"], on_error=-1.0, **bad) == [-1.0]
    # The service's worker hangs: the caller waits wait_s, then its actions are cancelled.
    hung = dict(kw, wait_s=1.0)
    with cluster.client() as c:
        (pid,) = [w["pid"] for w in c.status()["workers"] if w["kinds"] == ["reward"]]
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(RewardError, match="no result from reward service 'judge' within 1s"):
            tverl.compute_score_batch(["x"], ["a"], ["b"], **hung)
        assert asyncio.run(tverl.compute_score("x", "a", "b", on_error=0.0, **hung)) == 0.0
    finally:
        os.kill(pid, signal.SIGCONT)
    with cluster.client() as c:  # and nothing of them is left in the queue
        assert c.status()["pending"] == 0


@pytest.mark.verl
@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="needs verl (WITH_MODEL=1 scripts/setup-env.sh)")
def test_verl_loads_and_calls_the_reward_function(cluster):
    """verl's own loader (reward.custom_reward_function) takes the module by pkg:// path and by file path."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    for path in ("pkg://tangram_hpc.integrations.verl", tverl.__file__):
        cfg = OmegaConf.create({"reward": {"custom_reward_function": {
            "path": path, "name": "compute_score",
            "reward_kwargs": {"service": "judge", "connection_file": str(cluster.connection_file)}}}})
        fn = get_custom_reward_fn(cfg)

        async def step():  # as verl's reward loop calls it: keyword arguments, one sample per call
            return await asyncio.gather(*(fn(data_source="codegen", solution_str=r, ground_truth=g, extra_info={})
                                          for r, g in SAMPLES[:40]))

        assert asyncio.run(step()) == pytest.approx([expected(r, g) for r, g in SAMPLES[:40]], abs=1e-5)


def test_openrlhf_remote_reward_endpoint(cluster):
    prompt = "Write add.\n"

    async def post_all(url):
        async with aiohttp.ClientSession() as s:
            async def one(resp, ref):  # OpenRLHF's SingleTurnAgentExecutor: one query per request
                body = {"query": [prompt + resp], "prompts": [prompt], "labels": [ref]}
                async with s.post(f"{url}/reward/judge", json=body) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()
            many = await asyncio.gather(*(one(r, g) for r, g in SAMPLES[:60]))
            async with s.post(f"{url}/reward/judge", json={"query": [prompt + r for r, _ in SAMPLES[:5]],
                                                            "prompts": [prompt] * 5,
                                                            "labels": [g for _, g in SAMPLES[:5]]}) as r:
                batch = await r.json()
            async with s.post(f"{url}/reward/judge", json={"query": ["a"], "labels": []}) as r:
                invalid = (r.status, await r.json())
            async with s.post(f"{url}/reward/nope", json={"query": ["a"]}) as r:
                unknown = (r.status, await r.json())
            return many, batch, invalid, unknown

    with running_serve(cluster.connection_file, "--reward-wait", "2") as (_, url):
        many, batch, invalid, unknown = asyncio.run(post_all(url))
    for (resp, ref), reply in zip(SAMPLES, many):
        assert reply["rewards"] == pytest.approx([expected(resp, ref)], abs=1e-5)
        assert reply["scores"] == reply["rewards"] and reply["extra_logs"] == {}
    assert batch["rewards"] == pytest.approx([expected(r, g) for r, g in SAMPLES[:5]], abs=1e-5)
    assert invalid[0] == 422 and invalid[1]["detail"][0]["loc"] == ["body", "labels"]
    assert unknown[0] == 404 and "cannot be placed: service 'nope' is hosted by no worker" in unknown[1]["detail"]
