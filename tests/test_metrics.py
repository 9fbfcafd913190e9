"""Metrics: histograms, the coordinator's figures read from its state, the Prometheus endpoints.

The unit tests drive the socket-free ledger and pool driver and compare every figure with the
state it describes; the end-to-end tests scrape a real coordinator (and ``serve``) over HTTP
and parse the text with prometheus_client's own parser, as Prometheus would.
"""
from __future__ import annotations

import random
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tangram_hpc import LocalCluster, function
from tangram_hpc.actions import ActionSpec, Demand
from tangram_hpc.backends.guards import LaunchThrottle
from tangram_hpc.backends.local import LocalBackend
from tangram_hpc.config import CoordinatorSettings, LaunchSettings
from tangram_hpc.coordinator import ActionLedger, PoolDriver
from tangram_hpc.coordinator.metrics import CoordinatorMetrics
from tangram_hpc.coordinator.exporter import LoopHandoff
from tangram_hpc.metrics import ACT_BUCKETS_S, Family, Histogram, render
from tangram_hpc.policy.static import StaticPool
from tangram_hpc.policy.fifo import FifoPolicy
from tangram_hpc.resources import WorkerInfo, WorkerShape

from serve_support import running_serve


# -- histograms -------------------------------------------------------------------

def test_a_value_equal_to_a_bound_counts_in_that_bucket_as_prometheus_le_says():
    h = Histogram((1.0, 2.0))
    for v in (0.0, 1.0, 1.5, 2.0, 2.0001, 50.0):
        h.observe(v)
    assert h.counts == [2, 2, 2]
    assert h.prometheus_buckets() == [("1.0", 2.0), ("2.0", 4.0), ("+Inf", 6.0)]
    assert h.sum == pytest.approx(56.5001)


def test_a_batch_lands_in_the_same_buckets_as_one_value_at_a_time():
    rng = random.Random(3)
    values = [rng.choice([0.0, *ACT_BUCKETS_S]) for _ in range(500)] + \
        [10 ** rng.uniform(-5, 4) for _ in range(5000)]
    one, batch = Histogram(), Histogram()
    for v in values:
        one.observe(v)
    batch.observe_many(np.array(values[:1000]))
    batch.observe_many(np.array(values[1000:]))
    batch.observe_many(np.array([]))
    assert batch.counts == one.counts and batch.count == len(values)
    assert batch.sum == pytest.approx(one.sum)


def test_quantiles_interpolate_inside_the_bucket_like_histogram_quantile():
    h = Histogram(tuple(float(b) for b in range(1, 11)))
    h.observe_many(np.arange(0.5, 10.0, 1.0))       # one value in each of the ten buckets
    assert h.quantile(0.5) == pytest.approx(5.0)
    assert h.quantile(0.95) == pytest.approx(9.5)
    assert h.mean() == pytest.approx(5.0)
    h.observe(1e9)                                   # the overflow bucket answers with the last bound
    assert h.quantile(1.0) == 10.0
    assert Histogram().quantile(0.5) is None and Histogram().mean() is None


def test_the_difference_of_two_copies_is_what_came_between_and_the_wire_form_round_trips():
    h = Histogram()
    h.observe_many(np.array([0.002, 0.3, 7.0]))
    earlier = Histogram.from_wire(h.to_wire())
    h.observe_many(np.array([0.3, 0.4]))
    d = h.minus(earlier)
    assert d.count == 2 and d.sum == pytest.approx(0.7) and d.quantile(1.0) == pytest.approx(0.5)
    assert h.minus(Histogram.from_wire(h.to_wire())).count == 0
    # A restarted coordinator starts from zero: the newer histogram is taken whole.
    assert earlier.minus(h).count == earlier.count
    with pytest.raises(ValueError):
        Histogram((2.0, 1.0))
    with pytest.raises(ValueError):
        Histogram((1.0,), counts=[1, 2, 3])


def test_rendered_families_parse_back_with_prometheus_own_parser():
    h = Histogram((0.1, 1.0))
    h.observe_many(np.array([0.05, 0.5, 5.0]))
    fams = [Family("x_total", "counter", "c", ("kind",)).add(3, "sandbox").add(4, 'we"ird\n'),
            Family("y", "gauge", "g").add(2.5),
            Family("z_seconds", "histogram", "h", ("kind",)).add(h, "function")]
    body, ctype = render(fams)
    assert ctype.startswith("text/plain")
    got = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert {(s.labels["kind"], s.value) for s in got["x"].samples} == {("sandbox", 3.0), ('we"ird\n', 4.0)}
    assert got["y"].samples[0].value == 2.5
    buckets = {s.labels["le"]: s.value for s in got["z_seconds"].samples if s.name.endswith("_bucket")}
    assert buckets == {"0.1": 1.0, "1.0": 2.0, "+Inf": 3.0}
    with pytest.raises(ValueError):
        Family("w", "gauge", "g", ("a",)).add(1)


# -- the coordinator's figures, from its socket-free core -------------------------------

def _families(metrics: CoordinatorMetrics, ledger: ActionLedger, now: float, driver=None) -> dict[str, Family]:
    metrics.observe(ledger.action_log)
    ledger.action_log.clear()
    return {f.name: f for f in metrics.families(ledger, driver, now, coordinator="c0", uptime_s=now)}


def test_finished_actions_queues_workers_and_services_are_read_from_the_ledger():
    ledger = ActionLedger(CoordinatorSettings(), FifoPolicy())
    metrics = CoordinatorMetrics()
    ledger.add_worker(WorkerInfo(id="w1", cores=2, services=frozenset({"judge"})), b"w1", 0.0)
    ledger.add_worker(WorkerInfo(id="w2", cores=1, handle="job-7"), b"w2", 0.0)
    quick = [function("math:sqrt", i) for i in range(3)]
    ledger.submit(b"c", [s.to_wire() for s in quick], 10.0)
    ledger.dispatch(10.0)
    started = {aid for items in ledger.outbox.assign.values() for (wire, _, _) in items for aid in [wire["i"]]}
    assert started == {s.id for s in quick}
    ledger.outbox.assign.clear()
    # Two finish well, one fails: ACT 2 s, 3 s and 4 s; each started 1 s after its submission.
    for i, s in enumerate(quick):
        wid = ledger.attempt_of(s.id)[1]
        ledger.done(wid, [[s.id, 1, "ok" if i < 2 else "failed", None, None, 11.0, 12.0 + i, None]], 12.0 + i)
    # Two 4-core actions nobody can run yet, and one cancelled while it waited.
    big = [ActionSpec(kind="sandbox", payload={"cmd": "true"}, demand=Demand(4, 4), env=f"e{i}") for i in range(2)]
    ledger.submit(b"c", [big[0].to_wire()], 20.0)
    ledger.submit(b"c", [big[1].to_wire()], 25.0)
    gone = ActionSpec(kind="sandbox", payload={"cmd": "true"}, demand=Demand(4, 4))
    ledger.submit(b"c", [gone.to_wire()], 26.0)
    ledger.cancel([gone.id], 27.0)
    ledger.dispatch(27.0)
    # A heartbeat: judge resident on w1 after 3 loads; entries for services it does not host,
    # or of the wrong shape, are ignored.
    ledger.worker_report("w1", {"services": ["judge"], "envs": ["e9"],
                                "service_counts": {"judge": [3, 1, 5], "other": [1, 1, 1], "x": "y"}}, 27.0)
    ledger.worker_report("w2", {"service_counts": {"judge": [-1, 0, 0]}}, 27.0)

    f = _families(metrics, ledger, 30.0)
    fin = f["tangram_actions_finished_total"]
    assert fin.value("function", "ok") == 2 and fin.value("function", "failed") == 1
    assert fin.value("sandbox", "cancelled") == 1
    act = f["tangram_action_completion_seconds"].value("function")
    assert act.count == 3 and act.sum == pytest.approx(2 + 3 + 4)
    assert f["tangram_action_completion_seconds"].value("sandbox").sum == pytest.approx(1.0)
    qt = f["tangram_action_queue_seconds"]
    assert qt.value("function").count == 3 and qt.value("function").sum == pytest.approx(3.0)
    assert qt.value("sandbox").count == 0                     # it never started
    assert f["tangram_actions_pending"].value() == 2 and f["tangram_actions_running"].value() == 0
    assert f["tangram_queue_pending_actions"].samples == [(("sandbox", "", "4", "0", "0"), 2)]
    assert f["tangram_queue_oldest_wait_seconds"].value("sandbox", "", "4", "0", "0") == pytest.approx(10.0)
    assert f["tangram_workers"].value("ok") == 2 and f["tangram_workers"].value("draining") == 0
    assert f["tangram_worker_cores"].value("w2", "job-7") == 1
    assert f["tangram_worker_environments"].value("w1", "") == 1
    assert f["tangram_service_resident"].samples == [(("judge", "w1"), 1)]
    assert f["tangram_service_loads_total"].samples == [(("judge", "w1"), 3)]
    assert f["tangram_service_queued_inputs"].value("judge", "w1") == 5
    assert f["tangram_actions_submitted_total"].value() == 6

    st = metrics.status(ledger, 30.0)
    assert st["finished_by_kind"] == {"function": {"failed": 1, "ok": 2}, "sandbox": {"cancelled": 1}}
    [q] = st["queues"]
    assert (q["kind"], q["min_cores"], q["pending"], q["env_bound"]) == ("sandbox", 4, 2, 2)
    assert Histogram.from_wire(st["act"]["function"]).counts == act.counts

    # Drained and busy: the state and the bound cores follow.
    ledger.drain("w2", "test", 31.0)
    ledger.submit(b"c", [function("math:sqrt", 9).to_wire()], 31.0)
    ledger.dispatch(31.0)
    f = _families(metrics, ledger, 32.0)
    assert f["tangram_workers"].value("draining") == 1
    assert f["tangram_worker_busy_cores"].value("w1", "") == 1


def test_a_batch_of_many_kinds_is_split_by_kind():
    metrics = CoordinatorMetrics()
    recs = [["a%d" % i, ("sandbox", "function", "reward")[i % 3], "x", "w", 1, 0.0, 0.5, 1.0 + i % 3,
             "ok", 1, None] for i in range(300)]
    metrics.observe(recs)
    assert {k: h.count for k, h in metrics.act.items()} == {"sandbox": 100, "function": 100, "reward": 100}
    assert metrics.act["reward"].sum == pytest.approx(300.0)
    # A worker clock behind the coordinator's does not make a negative queue time.
    metrics.observe([["b", "sandbox", "x", "w", 1, 10.0, 9.0, 12.0, "ok", 1, None]])
    assert metrics.queue_time["sandbox"].counts[0] == 1


def test_the_pool_driver_counts_launches_and_reclaims_and_keeps_its_recent_decisions(tmp_path):
    backend = LocalBackend(tmp_path / "workers")
    try:
        ledger = ActionLedger(CoordinatorSettings(), FifoPolicy())
        driver = PoolDriver(ledger.config, StaticPool([WorkerShape(cores=1)]), backend, ledger,
                            connection_file=str(tmp_path / "none.json"), throttle=LaunchThrottle(LaunchSettings()))
        driver.decide(100.0)
        [handle] = driver.starting
        deadline = time.monotonic() + 20
        while ledger.counters.launch_failures == 0:     # no connection file: the worker exits at once
            assert time.monotonic() < deadline
            time.sleep(0.05)
            driver.poll(101.0)
        # Two workers of the one shape kept: one is drained, then reclaimed.
        for wid in ("a", "b"):
            ledger.add_worker(WorkerInfo(id=wid, cores=1), wid.encode(), 102.0).launched_shape = WorkerShape(cores=1)
        driver.decide(102.0)
        driver.finish_drains(102.0)
        st = driver.status(103.0)
        assert ledger.counters.launches == 1 and ledger.counters.reclaims == 1
        assert [(t, what) for t, what, _ in st["pool_decisions"]] == \
            [(100.0, "launch"), (101.0, "launch failed"), (102.0, "drain"), (102.0, "reclaim")]
        assert st["pool_decisions"][0][2] == f"1 x 1 cores ({handle}): 0 actions waiting, 0 workers, 0 starting"
        assert handle in st["pool_decisions"][1][2]
        [left] = [w.info.id for w in ledger.workers]
        gone = "b" if left == "a" else "a"
        assert st["pool_decisions"][2][2].startswith(f"{gone}: ") and st["pool_decisions"][3][2].startswith(gone)
        f = {x.name: x for x in CoordinatorMetrics().families(ledger, driver, 103.0, coordinator="c", uptime_s=1)}
        assert f["tangram_worker_launches_total"].value() == 1
        assert f["tangram_worker_reclaims_total"].value() == 1
        assert f["tangram_worker_launch_failures_total"].value() == 1
    finally:
        backend.shutdown()


# -- the hand-off between a scrape and the coordinator loop ---------------------------------------

def test_the_loop_answers_a_scrape_and_a_silent_loop_gives_the_last_answer_with_its_age():
    h = LoopHandoff()
    try:
        assert h.ask(lambda: 1, timeout=0.05) == (None, None)      # nobody answers, nothing known

        def loop(stop: threading.Event) -> None:
            import select
            while not stop.is_set():
                if select.select([h.fd], [], [], 0.05)[0]:
                    h.answer()      # the first wake-up is the unanswered question's: nothing to run

        stop = threading.Event()
        t = threading.Thread(target=loop, args=(stop,), name="loop")
        t.start()
        value, age = h.ask(lambda: threading.current_thread().name, timeout=5)
        assert value == "loop" and age < 1.0            # it ran on the loop's thread
        stop.set()
        t.join()
        time.sleep(0.1)
        value, age = h.ask(lambda: "new", timeout=0.1)
        assert value == "loop" and age >= 0.2                   # stale, and says so
    finally:
        h.close()
    assert h.ask(lambda: "after", timeout=5)[0] == "loop"       # closed: at once, no write to a closed pipe


# -- end to end: a real coordinator scraped over HTTP --------------------------------------------

def scrape(url: str) -> dict:
    r = requests.get(url, timeout=10)
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def sample(fams: dict, name: str, suffix: str = "", **labels) -> float:
    fam = fams[name]
    hits = [s.value for s in fam.samples
            if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, fam.samples)
    return hits[0]


@pytest.mark.slow
def test_the_coordinator_endpoint_agrees_with_status_under_load_and_survives_junk(tmp_path):
    with LocalCluster(workers=2, cores=1, run_dir=tmp_path / "run",
                      extra_args=["--metrics-port", "0", "--metrics-targets-dir", str(tmp_path / "targets")]) as cl, \
            cl.client() as c:
        url = c.status()["metrics_url"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        import json
        [target] = json.loads((tmp_path / "targets" / "tangram-run.json").read_text())
        assert f"http://{target['targets'][0]}/metrics" == url and target["labels"]["run"] == "run"
        errors: list = []
        stop = threading.Event()

        def scraper() -> None:
            last = 0.0
            while not stop.is_set():
                try:
                    n = sample(scrape(url), "tangram_actions_submitted", "_total")
                    if n < last:
                        errors.append(f"counter went back from {last} to {n}")
                    last = n
                except Exception as e:      # noqa: BLE001 - collected and asserted below
                    errors.append(repr(e))

        threads = [threading.Thread(target=scraper) for _ in range(3)]
        for t in threads:
            t.start()
        res = c.map([function("math:sqrt", i, cores=0) for i in range(3000)] +
                    [function("math:sqrt", -1.0) for _ in range(4)], timeout=120)
        stop.set()
        for t in threads:
            t.join()
        assert not errors and sum(r.ok for r in res) == 3000
        # Hostile bytes on the metrics port: the coordinator keeps answering.
        host, port = url.split("//")[1].split("/")[0].split(":")
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"\x00\xffGARBAGE / HTTP/9\r\n\r\n" + b"A" * 100_000)
        st = c.status()
        f = scrape(url)
        assert sample(f, "tangram_actions_finished", "_total", kind="function", status="ok") == 3000 == \
            st["finished_by_kind"]["function"]["ok"]
        assert sample(f, "tangram_actions_finished", "_total", kind="function", status="failed") == 4
        assert sample(f, "tangram_action_completion_seconds", "_count", kind="function") == 3004
        assert sample(f, "tangram_workers", state="ok") == 2 == len(st["workers"])
        assert sample(f, "tangram_worker_launches", "_total") == 2 == st["launches"]
        assert sample(f, "tangram_metrics_age_seconds") < 1.0
        assert sum(s.value for s in f["tangram_worker_cores"].samples) == 2
    assert not list((tmp_path / "targets").iterdir())                    # gone with the coordinator


def test_a_metrics_port_in_use_stops_the_coordinator_with_a_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "tangram_hpc.cli", "coordinator", "--backend", "none", "--insecure",
                            "--run-dir", str(tmp_path / "run"), "--metrics-port", str(port)],
                           capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in p.stderr and "in use" in p.stderr
    assert not (tmp_path / "run" / "connection.json").exists()     # refused before anyone could connect


@pytest.mark.sandbox
def test_serve_exports_its_request_metrics(tmp_path):
    with LocalCluster(workers=1, cores=1, run_dir=tmp_path / "run") as cl, \
            running_serve(cl.connection_file) as (_, url):
        for code in ("print(1)", "print(2)", "raise SystemExit(3)"):
            requests.post(f"{url}/run_code", json={"code": code, "language": "python"}, timeout=60)
        requests.post(f"{url}/run_code", json={"code": "x", "language": "cobol"}, timeout=60)
        r = requests.get(f"{url}/metrics", timeout=10)
        assert r.headers["Content-Type"].startswith("text/plain")
        f = {x.name: x for x in text_string_to_metric_families(r.text)}
    assert sample(f, "tangram_serve_run_code_outcomes", "_total", status="Success") == 2
    assert sample(f, "tangram_serve_run_code_outcomes", "_total", status="Failed") == 1
    assert sample(f, "tangram_serve_requests", "_total", route="/run_code", code="200") == 3
    assert sum(s.value for s in f["tangram_serve_requests"].samples
               if s.labels["code"].startswith("4")) == 1
    assert sample(f, "tangram_serve_request_duration_seconds", "_count", route="/run_code") == 4
    assert sample(f, "tangram_serve_requests_in_flight") == 0


@pytest.mark.slow
def test_service_residency_and_loads_come_from_the_reward_workers_heartbeats(tmp_path):
    from tangram_hpc import reward

    service = "judge=tangram_hpc.managers.rewards:hashing_similarity,max_wait_ms=2"
    with LocalCluster(workers=0, reward_workers=1, services=[service], run_dir=tmp_path / "run",
                      extra_args=["--metrics-port", "0"]) as cl, cl.client() as c:
        res = c.map([reward("judge", [{"response": f"r{i}", "reference": "ref"}]) for i in range(20)], timeout=60)
        assert all(r.ok for r in res)
        url = c.status()["metrics_url"]
        deadline = time.monotonic() + 10
        while True:       # the worker reports residency in its next heartbeat (every second)
            f = scrape(url)
            if f["tangram_service_resident"].samples or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        [w] = c.status()["workers"]
    assert sample(f, "tangram_service_resident", service="judge", worker=w["id"]) == 1
    assert w["services"] == ["judge"]
    assert sample(f, "tangram_service_loads", "_total", service="judge", worker=w["id"]) >= 1
    assert sample(f, "tangram_service_evictions", "_total", service="judge", worker=w["id"]) == 0
    assert sample(f, "tangram_service_queued_inputs", service="judge", worker=w["id"]) == 0
    assert sample(f, "tangram_actions_finished", "_total", kind="reward", status="ok") == 20
