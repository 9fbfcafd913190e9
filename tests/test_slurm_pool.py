"""The backlog pool's decisions (pure: views built by hand, partitions from captured sinfo)."""
import json

from slurm_support import FIXTURES
from tangram_hpc.actions import ActionSpec, Demand
from tangram_hpc.policy.base import Launch, PoolView, Reclaim, WorkerStatus
from tangram_hpc.resources import WorkerInfo, WorkerShape
from tangram_hpc.slurm.cli_view import parse_scontrol_partitions, parse_sinfo_json
from tangram_hpc.slurm.pool import BacklogPool, BacklogPoolConfig

CPU = WorkerShape(cores=4)
GPU = WorkerShape(cores=1, gpus=1)


def acts(n, cores=1, **kw):
    return [ActionSpec(kind="function", demand=Demand(cores, cores), **kw) for _ in range(n)]


def worker(wid, cores=4, busy=0, running=0, idle_since=None, gpus=0, ends_at=None):
    return WorkerStatus(WorkerInfo(wid, cores, gpus=gpus, handle=f"h-{wid}"), busy_cores=busy,
                        running=running, idle_since=idle_since, ends_at=ends_at)


def test_grows_to_cover_the_backlog_and_counts_queued_jobs():
    pool = BacklogPool(BacklogPoolConfig(cpu_shape=CPU, max_workers=10))
    assert pool.decide(PoolView(0.0, acts(10), [])) == [Launch(CPU, 3)]
    # the same backlog with three jobs still queued in Slurm: nothing more
    assert pool.decide(PoolView(1.0, acts(10), [], starting=[(CPU, 0.0)] * 3)) == []
    # free cores on a running worker count too
    assert pool.decide(PoolView(1.0, acts(5), [worker("w1")])) == [Launch(CPU, 1)]
    assert "5 cores waiting" in pool.explain()


def test_respects_max_workers_and_launch_batch():
    pool = BacklogPool(BacklogPoolConfig(cpu_shape=CPU, max_workers=3, max_launch_at_once=2))
    assert pool.decide(PoolView(0.0, acts(100), [])) == [Launch(CPU, 2)]
    assert pool.decide(PoolView(0.0, acts(100), [worker("a", busy=4, running=4)] * 3)) == []
    assert "max_workers=3" in pool.explain()


def test_shrinks_idle_workers_but_keeps_min():
    pool = BacklogPool(BacklogPoolConfig(cpu_shape=CPU, idle_s=30, min_workers=1))
    ws = [worker("a", idle_since=0.0), worker("b", idle_since=10.0), worker("c", busy=1, running=1)]
    assert pool.decide(PoolView(35.0, [], ws)) == [Reclaim("a", "idle")]
    assert pool.decide(PoolView(45.0, [], ws)) == [Reclaim("a", "idle"), Reclaim("b", "idle")]
    assert pool.decide(PoolView(45.0, [], ws[:1])) == []          # the last idle one is the minimum
    assert pool.decide(PoolView(45.0, acts(1), ws[:2])) == []     # work waiting: keep them


def test_replaces_workers_before_their_time_limit():
    pool = BacklogPool(BacklogPoolConfig(cpu_shape=CPU, replace_before_s=120))
    ws = [worker("old", busy=4, running=4, ends_at=1100.0)]
    out = pool.decide(PoolView(1000.0, acts(4), ws))
    assert Reclaim("old", "time limit") in out and Launch(CPU, 1) in out


def test_gpu_workers_one_at_a_time():
    pool = BacklogPool(BacklogPoolConfig(cpu_shape=CPU, gpu_shape=GPU, max_gpu_workers=2))
    rewards = [ActionSpec(kind="reward", demand=Demand(service="rm")) for _ in range(5)]
    assert pool.decide(PoolView(0.0, rewards, [])) == [Launch(GPU, 1)]
    assert pool.decide(PoolView(0.0, rewards, [], starting=[(GPU, 0.0)])) == []


def test_partition_choice_from_cluster_view():
    nodes = parse_sinfo_json(json.loads((FIXTURES / "sinfo-22.05.json").read_text()))
    parts = parse_scontrol_partitions((FIXTURES / "scontrol-partitions-22.05.txt").read_text(), nodes)
    # the captured node has 10 free CPUs and 2 free GPUs of 16 and 4
    pool = BacklogPool(BacklogPoolConfig(cpu_shape=WorkerShape(cores=32)), partitions=lambda: parts)
    assert pool.decide(PoolView(0.0, acts(4), [])) == []
    assert "no partition can hold" in pool.explain()
    pool = BacklogPool(BacklogPoolConfig(cpu_shape=WorkerShape(cores=8), partitions=("gpu", "cpu")),
                       partitions=lambda: parts)
    [launch] = pool.decide(PoolView(0.0, acts(8), []))
    assert launch.shape.partition == "gpu" and launch.count == 1
    pool = BacklogPool(BacklogPoolConfig(cpu_shape=WorkerShape(cores=12), partitions=("gpu", "cpu")),
                       partitions=lambda: parts)
    [launch] = pool.decide(PoolView(0.0, acts(12), []))   # fits nowhere now: first that can ever hold it
    assert launch.shape.partition == "gpu"
