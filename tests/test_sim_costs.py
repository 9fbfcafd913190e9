"""The simulator reading measured service load costs (benchmarks/gpu_services.py --costs, or its report)."""
from __future__ import annotations

import json

import pytest

from tangram_hpc.sim.costs import read_costs, with_measured_costs
from tangram_hpc.sim.workload import WorkloadError, load_workload


def test_a_measured_service_takes_its_seconds_and_the_others_their_size_over_the_bandwidth(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"device": "cuda:0", "load_mb_per_s": 50_000.0,
                                "services": {"rm-7b": {"gpu_mem_mb": 18000, "load_s": 0.5}}}))
    w = with_measured_costs(load_workload("judge"), read_costs(path))
    assert w.services["rm-7b"].load_s == 0.5
    assert w.services["judge-32b"].load_s == pytest.approx(70_000 / 50_000)
    assert w.services["safety-2b"].load_s == pytest.approx(6000 / 50_000)


def test_a_benchmark_report_gives_the_same_figures(tmp_path):
    report = {"device": "cpu",
              "load_evict": [{"size_gb": 1.048576, "load_s": 0.5}],            # 1000 MB in 0.5 s
              "rotation": {"sim_services": [{"name": "r0", "gpu_mem_mb": 1000, "load_s": 0.5},
                                            {"name": "r1", "gpu_mem_mb": 1000, "load_s": None}]}}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(report))
    costs = read_costs(path)
    assert costs.load_s == {"r0": 0.5} and costs.load_mb_per_s == pytest.approx(2000.0)


@pytest.mark.parametrize("text", ["[]", "{}", '{"services": {"a": {"load_s": -1}}}', "not json",
                                  '{"services": {}, "load_mb_per_s": null}'])
def test_a_costs_file_that_says_nothing_usable_is_refused(tmp_path, text):
    path = tmp_path / "costs.json"
    path.write_text(text)
    with pytest.raises(WorkloadError):
        read_costs(path)


def test_bench_runs_with_measured_costs(tmp_path, capsys):
    from tangram_hpc.cli import main

    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"load_mb_per_s": 1000.0, "services": {}}))
    out = tmp_path / "fig.json"
    rc = main(["bench", "--workload", "judge", "--scale", "0.02", "--steps", "1", "--no-search", "--quiet",
               "--service-costs", str(path), "--json", str(out)])
    assert rc == 0
    assert "judge-32b 70 s" in capsys.readouterr().err       # 70,000 MB at 1,000 MB/s
    assert json.loads(out.read_text())["trajectories"] > 0
