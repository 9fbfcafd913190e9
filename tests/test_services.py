"""ServiceManager behaviour with real scoring threads on the CPU stand-in device."""
from __future__ import annotations

import threading
import time

import pytest

from tangram_hpc.actions import Status
from tangram_hpc.managers.devices import Device
from tangram_hpc.managers.rewards import HashingEmbeddingModel
from tangram_hpc.managers.service_spec import ServiceSpec
from tangram_hpc.managers.services import ServiceManager

HASHING = "tangram_hpc.managers.rewards:hashing_similarity"
WAIT_S = 30.0  # upper bound for a result to arrive; never a speed assertion


class Results:
    """A done_callback that records outcomes and lets a test wait for a count of them."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.by_id: dict[str, tuple] = {}
        self.threads: set[str] = set()

    def __call__(self, action_id, status, output, error, stats) -> None:
        with self._cv:
            assert action_id not in self.by_id, f"second callback for {action_id}"
            self.by_id[action_id] = (status, output, error, stats)
            self.threads.add(threading.current_thread().name)
            self._cv.notify_all()

    def wait(self, n: int) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.by_id) >= n, WAIT_S), \
                f"only {len(self.by_id)} of {n} results arrived"


class GatedModel:
    """Blocks its first score call until released, so later requests pile up into one batch."""

    def __init__(self, inner, fail_on: str | None = None) -> None:
        self.inner = inner
        self.fail_on = fail_on
        self.entered = threading.Event()
        self.release = threading.Event()
        self.batch_sizes: list[int] = []

    def score(self, inputs):
        self.batch_sizes.append(len(inputs))
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(WAIT_S)
        if self.fail_on is not None and any(x.get("response") == self.fail_on for x in inputs):
            raise RuntimeError(f"cannot score {self.fail_on!r}")
        return self.inner.score(inputs)


def pair(i: int, ref: str = "the cat sat on the mat") -> dict:
    return {"response": f"answer {i} the cat {i % 7} sat", "reference": ref}


def cpu(budget_mb: float = 64.0) -> list[Device]:
    return [Device("cpu", budget_mb)]


def test_batching_returns_each_caller_its_own_score():
    model = GatedModel(HashingEmbeddingModel(memory_mb=1, seed=3))
    reference = HashingEmbeddingModel(memory_mb=1, seed=3)
    spec = ServiceSpec("sim", lambda: model, memory_mb=1, max_batch=16, max_wait_ms=1)
    results = Results()
    with ServiceManager([spec], cpu()) as mgr:
        mgr.submit("first", "sim", [pair(0)], results)
        assert model.entered.wait(WAIT_S)
        # While the first batch is held, callers on several threads queue
        # actions of one or two inputs each.
        expected: dict[str, list] = {}
        lock = threading.Lock()

        def caller(t: int) -> None:
            for k in range(10):
                inputs = [pair(100 * t + k)] + ([pair(100 * t + k, ref="a dog")] if k % 3 == 0 else [])
                with lock:
                    expected[f"t{t}-{k}"] = inputs
                mgr.submit(f"t{t}-{k}", "sim", inputs, results)

        threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        model.release.set()
        results.wait(1 + len(expected))
        stats = mgr.stats()["sim"]

    assert results.by_id["first"][1] == reference.score([pair(0)])
    for aid, inputs in expected.items():
        status, output, error, _ = results.by_id[aid]
        assert status == Status.OK, error
        # Each caller gets its own scores, in its input order, equal to an unbatched call.
        assert output == [reference.score([x])[0] for x in inputs]
    assert max(model.batch_sizes) > 1
    assert all(n <= 16 for n in model.batch_sizes)
    assert sum(model.batch_sizes) == 1 + sum(len(v) for v in expected.values())
    assert stats["batches"] == len(model.batch_sizes)
    assert stats["mean_batch_size"] > 1
    # Results come from the device's scoring thread, not from the callers.
    assert results.threads == {"tangram-service-cpu"}


def _run_rounds(budget_mb: float) -> tuple[dict[str, list], dict, list[dict]]:
    """Three 3 MB services used in turns, then all at once, on one device of ``budget_mb``."""
    specs = [ServiceSpec(name, HASHING, memory_mb=3, max_batch=8, max_wait_ms=1,
                         kwargs={"memory_mb": 3, "seed": seed})
             for name, seed in (("a", 1), ("b", 2), ("c", 3))]
    results = Results()
    usage: list[dict] = []
    n = 0
    with ServiceManager(specs, cpu(budget_mb)) as mgr:
        rounds = ["a", "b", "c", "a", "c", "b", "abc", "cab"]
        for r, names in enumerate(rounds):
            for i in range(12):
                name = names[i % len(names)]
                mgr.submit(f"{r}-{i}-{name}", name, [pair(r * 100 + i), pair(i, ref="a dog barks")], results)
                n += 1
            results.wait(n)
            usage.extend(mgr.device_stats())
            assert len(mgr.resident()) <= int(budget_mb // 3)
        stats = mgr.stats()
    outputs = {aid: r[1] for aid, r in results.by_id.items()}
    assert all(r[0] == Status.OK for r in results.by_id.values())
    return outputs, stats, usage


def test_eviction_and_restore_give_the_same_scores_as_no_eviction():
    roomy, roomy_stats, _ = _run_rounds(budget_mb=64)
    tight, tight_stats, usage = _run_rounds(budget_mb=7)  # only two of the three fit

    assert tight == roomy
    for name in "abc":
        direct = HashingEmbeddingModel(memory_mb=3, seed=" abc".index(name))
        for aid, out in tight.items():
            if aid.endswith(name):
                r, i = map(int, aid.split("-")[:2])
                assert out == direct.score([pair(r * 100 + i), pair(i, ref="a dog barks")])
    assert sum(s["evictions"] for s in roomy_stats.values()) == 0
    evictions = sum(s["evictions"] for s in tight_stats.values())
    assert evictions >= 3
    # Each service was read from its loader once; restores came from host RAM.
    assert all(s["cold_loads"] == 1 for s in tight_stats.values())
    # Every placement is either still resident or was evicted once.
    for s in tight_stats.values():
        assert s["loads"] - s["evictions"] == (1 if s["resident"] else 0)
    for s in tight_stats.values():
        if s["evictions"]:
            assert s["evict_s_mean"] is not None and s["evict_s_mean"] >= 0
        assert s["load_s_mean"] is not None
    assert all(u["used_mb"] <= u["budget_mb"] for u in usage)


def test_a_failing_batch_is_scored_again_action_by_action_so_only_the_bad_action_fails():
    model = GatedModel(HashingEmbeddingModel(memory_mb=1, seed=5), fail_on="boom")
    other = ServiceSpec("other", HASHING, memory_mb=1, kwargs={"memory_mb": 1})
    spec = ServiceSpec("flaky", lambda: model, memory_mb=1, max_batch=16, max_wait_ms=1)
    results = Results()
    with ServiceManager([spec, other], cpu()) as mgr:
        mgr.submit("held", "flaky", [pair(1)], results)
        assert model.entered.wait(WAIT_S)
        mgr.submit("good-1", "flaky", [pair(2)], results)
        mgr.submit("bad", "flaky", [{"response": "boom", "reference": "x"}], results)
        mgr.submit("good-2", "flaky", [pair(3)], results)
        model.release.set()
        results.wait(4)
        mgr.submit("after", "flaky", [pair(4)], results)
        mgr.submit("other", "other", [pair(5)], results)
        results.wait(6)
        stats = mgr.stats()

    assert results.by_id["held"][0] == Status.OK
    # good-1, bad and good-2 were one batch: it failed, so each was scored alone
    status, output, error, _ = results.by_id["bad"]
    assert status == Status.FAILED and output is None
    assert "flaky" in error and "RuntimeError" in error and "cannot score 'boom'" in error
    assert "scored alone after its batch of 3 failed" in error
    ref = HashingEmbeddingModel(memory_mb=1, seed=5)
    for aid, i in (("good-1", 2), ("good-2", 3)):
        assert results.by_id[aid][:3] == (Status.OK, ref.score([pair(i)]), None)
    assert results.by_id["after"][0] == Status.OK
    assert results.by_id["after"][1] == HashingEmbeddingModel(memory_mb=1, seed=5).score([pair(4)])
    assert results.by_id["other"][0] == Status.OK
    assert stats["flaky"]["failed_batches"] == 2 and stats["flaky"]["failed_actions"] == 1


class WrongLength:
    def score(self, inputs):
        return [0.0] * (len(inputs) + 1)


class Misreports:
    """score() answers with what is not one result per input."""

    def __init__(self, what):
        self.what = what

    def score(self, inputs):
        return self.what(inputs)


class NoSize:
    def score(self, inputs):
        return [1.0 for _ in inputs]


def test_bad_models_and_requests_are_reported_and_the_manager_keeps_serving():
    def broken_loader():
        raise OSError("weights file missing")

    specs = [
        ServiceSpec("wrong", WrongLength, memory_mb=1),
        ServiceSpec("text", lambda: Misreports(lambda xs: "ab"), memory_mb=1),
        ServiceSpec("keys", lambda: Misreports(lambda xs: {"k0": 1.0, "k1": 1.0}), memory_mb=1),
        ServiceSpec("nan", lambda: Misreports(lambda xs: [0.5, float("nan")]), memory_mb=1),
        ServiceSpec("nosize", NoSize),
        ServiceSpec("broken", broken_loader, memory_mb=1),
        ServiceSpec("huge", HASHING, memory_mb=10_000),
        ServiceSpec("ok", HASHING, kwargs={"memory_mb": 1}),  # size from the model's memory_mb()
    ]
    results = Results()
    with ServiceManager(specs, cpu(16)) as mgr:
        mgr.submit("unknown", "nope", [pair(0)], results)
        mgr.submit("not-a-list", "ok", "text", results)
        mgr.submit("empty", "ok", [], results)
        assert len(results.by_id) == 3  # rejected or answered at once, in the caller's thread
        for name in ("wrong", "text", "keys", "nan", "nosize", "broken", "huge", "ok"):
            mgr.submit(name, name, [pair(1), pair(2)], results)
        results.wait(11)
        stats = mgr.stats()

    by = results.by_id
    assert by["unknown"][0] == Status.ERROR and "unknown service 'nope'" in by["unknown"][2]
    assert by["not-a-list"][0] == Status.ERROR and "must be a list" in by["not-a-list"][2]
    assert by["empty"][:2] == (Status.OK, [])
    assert by["wrong"][0] == Status.FAILED and "3 results for 2 inputs" in by["wrong"][2]
    assert by["text"][0] == Status.FAILED and "list of one result per input, not str" in by["text"][2]
    assert by["keys"][0] == Status.FAILED and "not dict" in by["keys"][2]
    assert by["nan"][0] == Status.FAILED and "returned nan for input 1" in by["nan"][2]
    assert by["nosize"][0] == Status.ERROR and "declare memory_mb" in by["nosize"][2]
    assert by["broken"][0] == Status.ERROR and "weights file missing" in by["broken"][2]
    assert by["huge"][0] == Status.ERROR and "largest device budget is 16 MB" in by["huge"][2]
    assert by["ok"][0] == Status.OK and len(by["ok"][1]) == 2
    assert stats["ok"]["memory_mb"] == pytest.approx(1.0, rel=0.01)


def test_preload_cancel_and_close():
    model = GatedModel(HashingEmbeddingModel(memory_mb=1))
    specs = [ServiceSpec("gated", lambda: model, memory_mb=1, max_wait_ms=0),
             ServiceSpec("warm", HASHING, memory_mb=1, kwargs={"memory_mb": 1})]
    results = Results()
    mgr = ServiceManager(specs, cpu())
    try:
        mgr.preload(["warm"])
        deadline = time.monotonic() + WAIT_S
        while "warm" not in mgr.resident() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mgr.resident() == {"warm"}
        assert mgr.stats()["warm"]["batches"] == 0

        mgr.submit("held", "gated", [pair(0)], results)
        assert model.entered.wait(WAIT_S)
        mgr.submit("dropped", "gated", [pair(1)], results)
        mgr.submit("queued", "gated", [pair(2)], results)
        assert mgr.pending() == {"gated": 2}
        assert mgr.cancel("dropped") is True
        assert mgr.cancel("held") is False  # being scored
        closer = threading.Thread(target=mgr.close)
        closer.start()
        while not mgr.closed:
            time.sleep(0.001)
        model.release.set()
        closer.join(WAIT_S)
        assert not closer.is_alive()
    finally:
        model.release.set()
        mgr.close()
    assert results.by_id["held"][0] == Status.OK
    assert "dropped" not in results.by_id
    assert results.by_id["queued"][0] == Status.CANCELLED
    mgr.submit("late", "warm", [pair(3)], results)
    assert results.by_id["late"][0] == Status.ERROR and "closed" in results.by_id["late"][2]


def test_a_raising_result_callback_is_logged_and_answered_with_an_error(caplog):
    results = Results()
    calls: list[str] = []

    def picky(action_id, status, output, error, stats):
        calls.append(status)
        if status == Status.OK:
            raise ValueError("cannot store this output")
        results(action_id, status, output, error, stats)

    specs = [ServiceSpec("ok", HASHING, memory_mb=1, kwargs={"memory_mb": 1}, max_wait_ms=0)]
    with caplog.at_level("ERROR", logger="tangram_hpc.managers.services"):
        with ServiceManager(specs, cpu()) as mgr:
            mgr.submit("a", "ok", [pair(0)], picky)          # raises on its OK outcome
            mgr.submit("empty", "ok", [], picky)             # answered in the caller's thread
            results.wait(2)
            mgr.submit("b", "ok", [pair(1)], results)        # the scoring thread kept serving
            results.wait(3)
    assert sorted(calls) == sorted([Status.OK, Status.ERROR] * 2)   # each OK raised, then an ERROR came
    for aid in ("a", "empty"):
        status, output, error, _ = results.by_id[aid]
        assert status == Status.ERROR and output is None
        assert "result callback raised ValueError: cannot store this output" in error
    assert results.by_id["b"][0] == Status.OK
    assert caplog.text.count("the result callback of action") == 2


def test_a_preload_that_fails_is_tried_once_and_the_other_services_are_served(caplog):
    calls = []

    def failing_loader():
        calls.append(1)
        raise ModuleNotFoundError("No module named 'nosuchpkg'")

    specs = [ServiceSpec("broken", failing_loader),            # no memory_mb: loaded to learn its size
             ServiceSpec("ok", HASHING, memory_mb=1, kwargs={"memory_mb": 1})]
    results = Results()
    with ServiceManager(specs, cpu()) as mgr:
        mgr.preload()
        mgr.submit("scored", "ok", [pair(1)], results)
        results.wait(1)
        time.sleep(0.3)
        assert len(calls) == 1            # it used to be retried in a loop, starving "ok"
        mgr.submit("retry", "broken", [pair(2)], results)
        results.wait(2)
    assert results.by_id["scored"][0] == Status.OK
    assert results.by_id["retry"][0] == Status.ERROR and "nosuchpkg" in results.by_id["retry"][2]
    assert len(calls) == 2                # a request tries the loader again
    assert "service broken failed to load" in caplog.text and "nosuchpkg" in caplog.text
