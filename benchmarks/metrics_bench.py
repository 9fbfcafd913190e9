"""What the metrics cost: counting finished actions, and serving scrapes beside the dispatch path.

    python benchmarks/metrics_bench.py [--actions 20000] [--rounds 5] [--pending 50000] [--scrape-every 0.25]

* counting: ``CoordinatorMetrics.observe`` over action-log records (what the coordinator does
  each time it flushes its logs), in ns per action, for several batch sizes and kinds;
* throughput: one coordinator with ``--metrics-port 0`` and two local workers; rounds of
  ``--actions`` light no-ops from one client (submitted at once, so up to that many wait in the
  queues a scrape reads), alternately with nobody scraping and with a scraper process hitting
  ``/metrics`` every ``--scrape-every`` seconds (a stress: Prometheus scrapes every 15 s or so);
  actions/s and the coordinator's CPU per 1000 actions side by side;
* scrapes: latency, size and the coordinator's CPU per scrape while it is idle, and while
  ``--pending`` actions wait in its queues (a scrape reads the queues when it comes).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import requests  # noqa: E402

from tangram_hpc import LocalCluster, function, sandbox  # noqa: E402
from tangram_hpc.actions import Status  # noqa: E402
from tangram_hpc.coordinator.metrics import CoordinatorMetrics  # noqa: E402

from dispatch import _cpu_seconds, pct  # noqa: E402


def counting() -> None:
    print("counting finished actions (CoordinatorMetrics.observe), per action:")
    for kinds in (("function",), ("sandbox", "function", "reward")):
        recs = [[f"a{i}", kinds[i % len(kinds)], "x", "w1", 1, 1000.0 + i * 1e-5, 1000.001 + i * 1e-5,
                 1000.002 + i * 1e-5, Status.OK, 1, None] for i in range(20_000)]
        for batch in (100, 1000, 20_000):
            m = CoordinatorMetrics()
            t = time.perf_counter()
            n = 0
            for _ in range(10):
                for i in range(0, len(recs), batch):
                    m.observe(recs[i:i + batch])
                    n += min(batch, len(recs) - i)
            ns = (time.perf_counter() - t) / n * 1e9
            print(f"  {len(kinds)} kind(s), batches of {batch:>6}: {ns:6.0f} ns")


def throughput(cl, url: str, n: int, rounds: int, every: float) -> None:
    def one_round() -> tuple[float, float]:
        cpu0 = _cpu_seconds(cl.proc.pid)
        with cl.client() as c:
            t = time.perf_counter()
            res = c.map([function("tangram_hpc.handlers:noop", i, cores=0) for i in range(n)], timeout=600)
            wall = time.perf_counter() - t
        assert all(r.ok and r.output == i for i, r in enumerate(res))
        return n / wall, (_cpu_seconds(cl.proc.pid) - cpu0) / (n / 1000)

    scraped = f"scraped every {every:g} s"
    out: dict[str, list[tuple[float, float]]] = {"no scraper": [], scraped: []}
    scrapes = mp.Value("i", 0)
    for _ in range(rounds):
        out["no scraper"].append(one_round())
        # The scraper is a process of its own, as Prometheus is: it must not share this client's GIL.
        stop = mp.Event()
        p = mp.Process(target=_scraper, args=(url, every, stop, scrapes))
        p.start()
        time.sleep(0.3)
        out[scraped].append(one_round())
        stop.set()
        p.join()
        assert p.exitcode == 0
    print(f"throughput, {n} light no-ops from one client, {rounds} interleaved rounds (median):")
    base = pct([r for r, _ in out["no scraper"]], 50)
    for name, xs in out.items():
        rate, cpu = pct([r for r, _ in xs], 50), pct([c for _, c in xs], 50)
        print(f"  {name:<22} {rate:9,.0f} actions/s ({rate / base:.2f}x)  coordinator CPU {cpu:.4f} s per 1000")
    print(f"  ({scrapes.value} scrapes answered while the scraped rounds ran)")


def _scraper(url: str, every: float, stop, count) -> None:
    with requests.Session() as s:
        while not stop.wait(every):
            r = s.get(url, timeout=10)
            assert r.status_code == 200
            with count.get_lock():
                count.value += 1


def scrape_figures(cl, url: str, label: str, k: int = 20) -> None:
    times, size = [], 0
    cpu0 = _cpu_seconds(cl.proc.pid)
    for _ in range(k):
        t = time.perf_counter()
        r = requests.get(url, timeout=30)
        times.append(time.perf_counter() - t)
        size = len(r.content)
    cpu = (_cpu_seconds(cl.proc.pid) - cpu0) / k
    print(f"  {label:<26} latency p50 {pct(times, 50) * 1e3:6.1f} ms  p99 {pct(times, 99) * 1e3:6.1f} ms  "
          f"{size / 1024:5.1f} KiB  coordinator CPU {cpu * 1e3:5.1f} ms per scrape "
          f"({cpu / 15:.2%} of a core at a 15 s interval)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actions", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pending", type=int, default=50_000)
    ap.add_argument("--scrape-every", type=float, default=0.25, metavar="SECONDS")
    args = ap.parse_args()
    counting()
    with LocalCluster(workers=2, cores=1, extra_args=["--metrics-port", "0"]) as cl:
        with cl.client() as c:
            url = c.status()["metrics_url"]
        throughput(cl, url, args.actions, args.rounds, args.scrape_every)
        print("scrapes:")
        scrape_figures(cl, url, "idle coordinator")
        with cl.client() as c:
            # Both cores busy, then a backlog of 1-core actions in a few placement classes.
            c.submit_many([sandbox("sleep 600", cores=(1, 1)) for _ in range(2)])
            backlog = [sandbox("true", cores=1, mem_mb=(i % 4) * 256) for i in range(args.pending)]
            c.submit_many(backlog)
            deadline = time.monotonic() + 120
            while c.status()["pending"] < args.pending and time.monotonic() < deadline:
                time.sleep(0.2)
            scrape_figures(cl, url, f"{c.status()['pending']:,} actions waiting")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
