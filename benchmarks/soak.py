"""Load and soak benchmark: a million no-op actions, many clients, many workers, memory over time.

    python benchmarks/soak.py [--actions 1000000] [--clients 8] [--workers 4] [--cores 1] [--wave 1000]

Starts a local coordinator with ``--workers`` workers, then ``--clients``
client processes each push their share of ``--actions`` no-op function
actions in waves of ``--wave`` (submit a wave, wait for all of its results,
check every output, next wave), so the number of unfinished actions stays
near ``clients * wave`` and the coordinator's memory should level off.

While it runs, this process reads the coordinator's and the workers' VmRSS
from /proc every ``--sample-s`` seconds.  At the end it prints:

* throughput (actions/s over the whole run) and a timeline of completed
  actions, rate and coordinator RSS;
* latency percentiles: the coordinator-side action completion time
  (finish - submit, from every result) and the client round trip (from
  handing a wave to the client to the future resolving) of every
  ``--sample-every``-th action;
* the coordinator's RSS: at warm-up, at the end, max/min after warm-up, and
  the slope of RSS against completed actions after warm-up and over the
  second half of the run (MiB per 100k actions; about zero when memory is
  flat).  Warm-up ends once ``--warmup`` actions have completed: the
  coordinator keeps the last 200,000 results
  (``[coordinator] result_cache``) so that a client resubmitting after a
  reconnect gets them again; that cache fills during the first 200,000
  actions, and its hash table is rebuilt once more (a new table allocated
  while the old one is live) about 150,000 insertions after it is full;
* the workers' RSS at warm-up and at the end.

It is a benchmark, not a test: it asserts nothing except that every result
came back and was right (it exits 1 otherwise).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tangram_hpc import LocalCluster  # noqa: E402

NOOP = "tangram_hpc.handlers:noop"


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _client(conn_file: str, k: int, n: int, wave: int, sample_every: int, progress, start, out,
            action_cores: int = 1) -> None:
    from tangram_hpc import Client, function
    acts = np.empty(n, dtype=np.float32)
    rtts: list[float] = []
    bad = 0
    with Client(connection_file=conn_file, name=f"soak{k}") as c:
        start.wait()
        i = 0
        while i < n:
            m = min(wave, n - i)
            specs = [function(NOOP, i + j, cores=action_cores) for j in range(m)]
            t_sub = time.perf_counter()
            futs = c.submit_many(specs)
            stamps = []
            for j in range(0, m, sample_every):
                stamp = [0.0]
                futs[j].add_done_callback(lambda _f, s=stamp: s.__setitem__(0, time.perf_counter()))
                stamps.append(stamp)
            res = c.gather(futs, timeout=900)
            for j, r in enumerate(res):
                if not r.ok or r.output != i + j:
                    bad += 1
                acts[i + j] = r.finished - r.submitted
            rtts.extend(s[0] - t_sub for s in stamps)
            i += m
            progress.value = i
    out.put((k, bad, acts, np.asarray(rtts, dtype=np.float32)))


def pct(a: np.ndarray, p: float) -> float:
    return float(np.percentile(a, p)) if len(a) else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actions", type=int, default=1_000_000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--cores", type=int, default=1, help="cores per worker")
    ap.add_argument("--wave", type=int, default=1000, help="actions each client has in flight at once")
    ap.add_argument("--sample-every", type=int, default=100, help="client round trip of every N-th action")
    ap.add_argument("--sample-s", type=float, default=1.0, help="seconds between RSS samples")
    ap.add_argument("--warmup", type=int, default=400_000, help="completed actions before memory should be flat")
    ap.add_argument("--timeline", type=int, default=24, help="rows in the printed timeline")
    ap.add_argument("--policy", default=None)
    ap.add_argument("--action-cores", type=int, default=1,
                    help="core demand of each no-op (0: light actions, pipelined to workers; default 1)")
    ap.add_argument("--run-dir", help="coordinator run directory (default: a temporary one, removed at the end)")
    args = ap.parse_args()

    run_dir = args.run_dir or tempfile.mkdtemp(prefix="tangram-soak-")
    per = [args.actions // args.clients + (k < args.actions % args.clients) for k in range(args.clients)]
    ctx = mp.get_context("fork")
    try:
        with LocalCluster(workers=args.workers, cores=args.cores, run_dir=run_dir, policy=args.policy) as cl:
            st = cl.wait_for_workers(args.workers)
            coord_pid = cl.proc.pid
            worker_pids = [w["pid"] for w in st["workers"]]
            progress = [ctx.Value("q", 0, lock=False) for _ in per]
            start = ctx.Event()
            out = ctx.Queue()
            procs = [ctx.Process(target=_client, args=(str(cl.connection_file), k, n, args.wave, args.sample_every,
                                                       progress[k], start, out, args.action_cores))
                     for k, n in enumerate(per)]
            for p in procs:
                p.start()
            time.sleep(1.0)  # clients connected
            print(f"soak: {args.actions:,} no-op actions, {args.clients} clients x waves of {args.wave}, "
                  f"{args.workers} workers x {args.cores} cores; coordinator pid {coord_pid}", flush=True)
            # (t, completed, coordinator RSS, [worker RSS]), from a baseline before the first submission
            samples = [(0.0, 0, rss_mib(coord_pid), [rss_mib(p) for p in worker_pids])]
            t0 = time.perf_counter()
            start.set()
            outs = []
            next_print = 10.0
            while len(outs) < len(procs):
                time.sleep(args.sample_s)
                t = time.perf_counter() - t0
                done = sum(v.value for v in progress)
                samples.append((t, done, rss_mib(coord_pid), [rss_mib(p) for p in worker_pids]))
                if t >= next_print:
                    print(f"  {t:6.0f}s {done:>10,} done  coordinator {samples[-1][2]:7.1f} MiB", flush=True)
                    next_print += 10.0
                try:
                    while True:
                        outs.append(out.get_nowait())
                except queue.Empty:
                    pass
                if cl.proc.poll() is not None:
                    print("the coordinator died", file=sys.stderr)
                    return 1
            wall = time.perf_counter() - t0
            for p in procs:
                p.join()
            with cl.client() as c:
                final = c.status()
    finally:
        if not args.run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)

    bad = sum(o[1] for o in outs)
    acts = np.concatenate([o[2] for o in outs])
    rtts = np.concatenate([o[3] for o in outs])
    total = sum(per)
    print(f"\nthroughput: {total:,} actions in {wall:.1f}s = {total / wall:,.0f} actions/s; "
          f"wrong or missing results: {bad}")
    print(f"coordinator counters: submitted {final['submitted']:,} completed {final['completed']:,} "
          f"failed {final['failed']} retried {final['retried']} rejected {final['rejected']}")
    ms = 1000.0
    print(f"ACT (coordinator, all {len(acts):,}): p50 {pct(acts, 50) * ms:.2f} ms  p90 {pct(acts, 90) * ms:.2f}  "
          f"p99 {pct(acts, 99) * ms:.2f}  p99.9 {pct(acts, 99.9) * ms:.2f}  max {acts.max() * ms:.1f} ms")
    print(f"client round trip (wave -> result, {len(rtts):,} sampled): p50 {pct(rtts, 50) * ms:.1f} ms  "
          f"p90 {pct(rtts, 90) * ms:.1f}  p99 {pct(rtts, 99) * ms:.1f}  max {rtts.max() * ms:.1f} ms")

    print("\ntimeline:        t  completed     rate/s  coordinator RSS MiB  workers RSS MiB (sum)")
    step = max(1, len(samples) // args.timeline)
    prev_t, prev_done = 0.0, 0
    for t, done, crss, wrss in samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else []):
        rate = (done - prev_done) / max(1e-9, t - prev_t)
        print(f"          {t:7.1f}s {done:>10,} {rate:>10,.0f} {crss:>20.1f} {sum(wrss):>16.1f}")
        prev_t, prev_done = t, done
    warm = [s for s in samples if s[1] >= args.warmup]
    if len(warm) >= 3:
        crss = np.array([s[2] for s in warm])
        done = np.array([s[1] for s in warm], dtype=float)
        slope = np.polyfit(done, crss, 1)[0] * 100_000
        print(f"\ncoordinator RSS: {samples[0][2]:.1f} MiB at start, {warm[0][2]:.1f} MiB at warm-up "
              f"({warm[0][1]:,} actions), {warm[-1][2]:.1f} MiB at the end; after warm-up min {crss.min():.1f} "
              f"max {crss.max():.1f} MiB, max/min {crss.max() / crss.min():.3f}, slope {slope:+.2f} MiB per 100k actions; "
              f"peak over the run {max(s[2] for s in samples):.1f} MiB")
        half = [s for s in samples if s[1] >= samples[-1][1] / 2]
        if len(half) >= 3:
            hslope = np.polyfit([s[1] for s in half], [s[2] for s in half], 1)[0] * 100_000
            print(f"second half of the run ({half[0][1]:,} to {half[-1][1]:,} actions): RSS {min(s[2] for s in half):.1f}"
                  f"..{max(s[2] for s in half):.1f} MiB, slope {hslope:+.3f} MiB per 100k actions")
        w0, w1 = warm[0][3], warm[-1][3]
        print("worker RSS MiB at warm-up -> end: " + ", ".join(f"{a:.1f} -> {b:.1f}" for a, b in zip(w0, w1)))
    else:
        print(f"\n(fewer than 3 samples after {args.warmup:,} actions: no flatness figures; lower --warmup)")
    return 1 if bad or final["completed"] != total else 0


if __name__ == "__main__":
    raise SystemExit(main())
