"""Service declarations (TOML, CLI), device discovery and the eviction policy."""
from __future__ import annotations

import pytest

from tangram_hpc.actions import ActionSpec
from tangram_hpc.managers.devices import Device, discover_devices, visible_gpu_ids
from tangram_hpc.policy.residency import Resident, choose_victims, eviction_value
from tangram_hpc.managers.rewards import (HashingEmbeddingModel, compute_score_action, exact_match_score,
                                          run_compute_score)
from tangram_hpc.managers.service_spec import (ServiceSpec, ServiceSpecError, load_service_specs,
                                               parse_service_option, specs_from_cli)

SERVICES_TOML = """
[defaults]
max_batch = 16
max_wait_ms = 2.5

[[service]]
name = "minilm"
loader = "tangram_hpc.managers.rewards:minilm_similarity"
memory_mb = 200
max_batch = 64

[[service]]
name = "hash"
loader = "tangram_hpc.managers.rewards:hashing_similarity"
[service.kwargs]
memory_mb = 2
seed = 7
"""


def test_toml_services(tmp_path):
    path = tmp_path / "services.toml"
    path.write_text(SERVICES_TOML)
    minilm, hashed = load_service_specs(path)
    assert (minilm.name, minilm.memory_mb, minilm.max_batch, minilm.max_wait_ms) == ("minilm", 200, 64, 2.5)
    assert (hashed.max_batch, hashed.memory_mb, hashed.kwargs) == (16, None, {"memory_mb": 2, "seed": 7})
    model = hashed.load()  # the string loader path, with its kwargs
    assert isinstance(model, HashingEmbeddingModel) and model.memory_mb() == pytest.approx(2, rel=0.01)
    pair = {"response": "a b c", "reference": "a b d"}
    assert model.score([pair]) == HashingEmbeddingModel(memory_mb=2, seed=7).score([pair])


@pytest.mark.parametrize("text, message", [
    ('[[service]]\nname = "x"\n', "'name' and 'loader' are required"),
    ('[[service]]\nname = "x"\nloader = "m:f"\nbatch = 3\n', "unknown keys ['batch']"),
    ('[[service]]\nname = "x"\nloader = "nocolon"\n', "loader must be 'module:callable'"),
    ('[[service]]\nname = "x"\nloader = "m:f"\nmax_batch = 0\n', "max_batch must be a positive integer"),
    ('[[service]]\nname = "x"\nloader = "m:f"\n[[service]]\nname = "x"\nloader = "m:g"\n', "declared twice"),
    ('[server]\nport = 1\n', "unknown top-level keys ['server']"),
    ('[[service]\n', "services.toml"),
    ('[[service]]\nname = "a"\nloader = "m:f"\n[[service]]\nname = "b"\nloader = "m:f"\nmemory_mb = -1\n',
     "services.toml: service #2: service b: memory_mb must be a finite non-negative number"),
    ('[[service]]\nname = "x"\nloader = "m:f"\nmemory_mb = inf\n', "memory_mb must be a finite"),
    ('[defaults]\nmax_batch = 0\n[[service]]\nname = "a"\nloader = "m:f"\n',
     "services.toml: [defaults]: max_batch must be a positive integer"),
    ('service = [1, 2]\n', "service #1: must be a table"),
])
def test_toml_errors_say_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "services.toml"
    path.write_text(text)
    with pytest.raises(ServiceSpecError, match=None) as err:
        load_service_specs(path)
    assert message in str(err.value)


def test_a_bad_services_file_is_a_one_line_error_from_the_command_line(tmp_path):
    import subprocess
    import sys
    bad = tmp_path / "services.toml"
    bad.write_text('[[service]]\nname = "x"\nloader = "m:f"\nmemory_mb = -1\n')
    for option in (["--services", str(bad)], ["--services", str(tmp_path / "missing.toml")],
                   ["--service", "x=m:f,memory_mb=inf"]):
        r = subprocess.run([sys.executable, "-m", "tangram_hpc", "coordinator", "--backend", "none",
                            "--run-dir", str(tmp_path / "run"), *option], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith("tangram-hpc coordinator: error: ") and len(r.stderr.splitlines()) == 1, r.stderr


def test_cli_service_option():
    spec = parse_service_option("hash=tangram_hpc.managers.rewards:hashing_similarity,memory_mb=3,"
                                "max_batch=8,seed=4,dim=32")
    assert spec == ServiceSpec("hash", "tangram_hpc.managers.rewards:hashing_similarity", memory_mb=3,
                               max_batch=8, kwargs={"seed": 4, "dim": 32})
    assert spec.load().dim == 32
    for bad in ("nohead", "x=", "x=m:f,novalue"):
        with pytest.raises(ServiceSpecError):
            parse_service_option(bad)


def test_worker_options_combine_file_and_flags(tmp_path):
    path = tmp_path / "services.toml"
    path.write_text(SERVICES_TOML)
    names = [s.name for s in specs_from_cli(path, ["extra=tangram_hpc.managers.rewards:hashing_similarity"])]
    assert names == ["minilm", "hash", "extra"]
    with pytest.raises(ServiceSpecError, match="declared twice"):
        specs_from_cli(path, ["hash=tangram_hpc.managers.rewards:hashing_similarity"])
    assert specs_from_cli(None, None) == []


def test_loader_must_return_a_scorer():
    with pytest.raises(ServiceSpecError, match="has no score"):
        ServiceSpec("x", "collections:OrderedDict").load()


def test_gpu_ids_from_cuda_and_slurm_variables():
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "", "SLURM_JOB_GPUS": "0"}) == []
    assert visible_gpu_ids({"SLURM_STEP_GPUS": "1", "SLURM_JOB_GPUS": "0,1"}) == ["1"]
    assert visible_gpu_ids({"SLURM_JOB_GPUS": "0-2,5"}) == ["0", "1", "2", "5"]
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "GPU-6f1c,GPU-88aa"}) == ["GPU-6f1c", "GPU-88aa"]
    assert visible_gpu_ids({}) is None


def test_no_gpu_gives_the_cpu_stand_in_with_its_budget():
    assert discover_devices(env={"CUDA_VISIBLE_DEVICES": ""}, cpu_budget_mb=300) == [Device("cpu", 300.0)]
    env = {"CUDA_VISIBLE_DEVICES": "-1", "TANGRAM_SERVICE_CPU_BUDGET_MB": "1234"}
    assert discover_devices(env=env) == [Device("cpu", 1234.0)]
    # GPUs named by Slurm but no torch to drive them: services stay on the CPU.
    assert discover_devices(env={"SLURM_JOB_GPUS": "0"}, use_torch=False, cpu_budget_mb=10)[0].name == "cpu"


def _r(name, mb, pending=0, idle=0.0, reload=0.0, evict=0.0):
    return Resident(name, mb, pending, idle, reload, evict)


def test_eviction_prefers_idle_cheap_services_without_demand():
    assert choose_victims([_r("a", 4)], need_mb=3, free_mb=3) == []
    assert choose_victims([_r("a", 1)], need_mb=5, free_mb=1) is None
    # LRU part: the longer-idle service goes.
    assert choose_victims([_r("recent", 4, idle=1), _r("old", 4, idle=100)], 4, 0) == ["old"]
    # Demand part: a service with queued inputs is kept.
    assert choose_victims([_r("wanted", 4, pending=50, idle=100), _r("spare", 4, idle=1)], 4, 0) == ["spare"]
    # Cost part: the one that is costly to bring back is kept.
    assert choose_victims([_r("slow", 4, reload=5.0), _r("fast", 4, reload=0.01)], 4, 0) == ["fast"]
    assert eviction_value(_r("x", 1, pending=1, idle=0, reload=1)) > eviction_value(_r("x", 1, idle=0, reload=1))


def test_victims_not_needed_are_kept():
    # The greedy pass takes small cheap ones first; when the big one alone frees enough, the small stay.
    residents = [_r("s1", 1, idle=100), _r("s2", 1, idle=90), _r("big", 8, idle=50)]
    assert choose_victims(residents, need_mb=8, free_mb=0) == ["big"]
    assert sorted(choose_victims(residents, need_mb=10, free_mb=0)) == ["big", "s1", "s2"]


def test_verl_compute_score_as_a_function_action():
    spec = compute_score_action("tangram_hpc.managers.rewards:exact_match_score", "gsm8k",
                                "work...\n42", "42", extra_info={"split": "train"}, trajectory="t1")
    wire = ActionSpec.from_wire(spec.to_wire())
    assert (wire.kind, wire.label, wire.trajectory) == ("function", "compute_score", "t1")
    fn, args, kwargs = wire.payload["fn"], wire.payload["args"], wire.payload["kwargs"]
    # What a CPU worker does with a function payload: import fn and call it.
    from tangram_hpc.managers.service_spec import resolve_loader
    assert resolve_loader(fn)(*args, **kwargs) == 1.0
    assert run_compute_score("tangram_hpc.managers.rewards:exact_match_score", "gsm8k", "41", "42") == 0.0
    assert exact_match_score("x", "", "42") == 0.0


def test_load_seconds_a_worker_measured_teach_the_policy_its_load_time():
    from tangram_hpc.config import CoordinatorSettings
    from tangram_hpc.coordinator import ActionLedger
    from tangram_hpc.policy.elastic import ElasticScheduler
    from tangram_hpc.resources import WorkerInfo

    policy = ElasticScheduler()
    ledger = ActionLedger(CoordinatorSettings(), policy)
    ledger.add_worker(WorkerInfo(id="w1", cores=1, gpus=1, gpu_mem_mb=1000, services=frozenset({"judge"})),
                      b"w1", 0.0)
    default = policy.predictor.load_time("judge")
    ledger.worker_report("w1", {"service_counts": {"judge": [1, 0, 0]}, "service_costs": {"judge": [0.5, 0.01]}},
                         1.0)
    assert policy.predictor.load_time("judge") == pytest.approx(0.5)
    assert default != pytest.approx(0.5)
    # The same report again (no new load) teaches nothing more; malformed entries are ignored.
    ledger.worker_report("w1", {"service_counts": {"judge": [1, 0, 0]}, "service_costs": {"judge": [9.0, 0.0]}},
                         2.0)
    ledger.worker_report("w1", {"service_counts": {"judge": [2, 1, 0]},
                                "service_costs": {"judge": [float("nan"), 0.0], "other": [1.0, 1.0]}}, 3.0)
    assert policy.predictor.load_time("judge") == pytest.approx(0.5)
    assert ledger.workers.by_id["w1"].service_costs == {}


def test_a_reward_workers_devices_reach_status_metrics_and_top():
    from tangram_hpc.config import CoordinatorSettings
    from tangram_hpc.coordinator import ActionLedger
    from tangram_hpc.coordinator.metrics import CoordinatorMetrics
    from tangram_hpc.policy.fifo import FifoPolicy
    from tangram_hpc.resources import WorkerInfo
    from tangram_hpc.top import _services

    ledger = ActionLedger(CoordinatorSettings(), FifoPolicy())
    ledger.add_worker(WorkerInfo(id="w1", cores=1, gpus=2, gpu_mem_mb=2048, services=frozenset({"a", "b"})),
                      b"w1", 0.0)
    devices = [["cuda:0", 512.0, 1024.0, 300.0, ["a", "intruder"]], ["cuda:1", 0, 1024.0, -1.0, []],
               ["cuda:2", "x", 1, 1, []], ["cuda:3", float("nan"), 1, 1, []]]
    ledger.worker_report("w1", {"services": ["a"], "devices": devices}, 1.0)
    w = ledger.workers.by_id["w1"]
    assert w.devices == [("cuda:0", 512.0, 1024.0, 300.0, ["a"]), ("cuda:1", 0.0, 1024.0, -1.0, [])]
    fams = {f.name: f for f in CoordinatorMetrics().families(ledger, None, 2.0, coordinator="c", uptime_s=2.0)}
    assert fams["tangram_service_device_used_mb"].value("w1", "cuda:0") == 512.0
    assert fams["tangram_service_device_free_mb"].value("w1", "cuda:0") == 300.0
    row = {"services": ["a"], "devices": [{"device": "cuda:0", "used_mb": 512.0, "budget_mb": 1024.0,
                                           "free_mb": 300.0, "resident": ["a"]}]}
    assert _services(row) == "cuda:0 0.5/1.0 GB: a"
    assert _services({"services": ["a"]}) == "a"
