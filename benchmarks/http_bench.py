"""HTTP benchmark: a trivial python program through ``tangram-hpc serve`` vs the same action through the Client.

    python benchmarks/http_bench.py [--requests 300] [--concurrency 64] [--rounds 2] [--sequential 100]
                                    [--workers 2] [--cores 2]

Starts a coordinator with local sandbox workers and ``tangram-hpc serve`` beside
it, then alternates rounds of the two paths so that drift on a shared machine
hits both alike:

* HTTP: ``--requests`` SandboxFusion ``/run_code`` requests (``print(<n> * 2)``),
  at most ``--concurrency`` in flight, over keep-alive connections;
* Client: the very same sandbox actions (built by serve's own translation)
  submitted through :class:`~tangram_hpc.client.AsyncClient` with the same
  concurrency.

Every answer is checked.  Prints requests/s and the p50/p99 latency of each
path under load, the same for ``--sequential`` requests one at a time (the
unloaded round trip), the ratios, and the CPU seconds the serve process spent
per 1000 requests.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import aiohttp  # noqa: E402

from tangram_hpc import LocalCluster  # noqa: E402
from tangram_hpc.client import AsyncClient  # noqa: E402
from tangram_hpc.serve.translate import run_code_spec  # noqa: E402


def body(n: int) -> dict:
    return {"language": "python", "code": f"print({n} * 2)", "run_timeout": 30}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def http_round(session: aiohttp.ClientSession, url: str, n: int, concurrency: int) -> tuple[float, list[float]]:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> float:
        async with sem:
            t = time.perf_counter()
            async with session.post(f"{url}/run_code", json=body(i)) as r:
                out = await r.json()
            took = time.perf_counter() - t
        if r.status != 200 or out["status"] != "Success" or out["run_result"]["stdout"] != f"{i * 2}\n":
            raise SystemExit(f"wrong HTTP answer for request {i}: {r.status} {out}")
        return took

    t0 = time.perf_counter()
    lat = await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t0, list(lat)


async def client_round(client: AsyncClient, n: int, concurrency: int) -> tuple[float, list[float]]:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> float:
        async with sem:
            t = time.perf_counter()
            res = await client.submit(run_code_spec(body(i)))
            took = time.perf_counter() - t
        out = res.output
        if not res.ok or out["status"] != "Success" or out["run_result"]["stdout"] != f"{i * 2}\n":
            raise SystemExit(f"wrong Client answer for action {i}: {res.status} {res.error} {out}")
        return took

    t0 = time.perf_counter()
    lat = await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t0, list(lat)


def start_serve(conn_file: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "tangram_hpc.cli", "serve", "--connection-file", str(conn_file),
                             "--port", "0", "--max-inflight", "100000"], stdout=subprocess.PIPE, text=True,
                            cwd=str(Path(__file__).resolve().parents[1]))
    line = proc.stdout.readline()
    if " at http://" not in line:
        proc.kill()
        raise SystemExit(f"serve did not start: {line!r}")
    token = (conn_file.parent / "serve.token").read_text().strip()   # made by serve, beside the connection file
    return proc, line.split(" at ", 1)[1].split()[0].replace("http://", f"http://tangram:{token}@", 1)


async def bench(args: argparse.Namespace, conn_file: Path, url: str, serve_pid: int) -> None:
    figures: dict[str, dict[str, list]] = {"HTTP (serve)": {"wall": [], "lat": [], "seq": []},
                                           "Client": {"wall": [], "lat": [], "seq": []}}
    serve_requests = 0
    serve_cpu = 0.0
    async with AsyncClient(connection_file=str(conn_file), name="http-bench") as client, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency)) as session:
        await http_round(session, url, 20, 8)            # warm-up: connections, interpreter caches
        await client_round(client, 20, 8)
        for r in range(args.rounds):
            c0 = cpu_seconds(serve_pid)
            wall, lat = await http_round(session, url, args.requests, args.concurrency)
            serve_cpu += cpu_seconds(serve_pid) - c0
            serve_requests += args.requests
            figures["HTTP (serve)"]["wall"].append(wall)
            figures["HTTP (serve)"]["lat"] += lat
            wall, lat = await client_round(client, args.requests, args.concurrency)
            figures["Client"]["wall"].append(wall)
            figures["Client"]["lat"] += lat
            print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        for _ in range(2):  # unloaded round trips, interleaved in halves
            figures["HTTP (serve)"]["seq"] += (await http_round(session, url, args.sequential // 2, 1))[1]
            figures["Client"]["seq"] += (await client_round(client, args.sequential // 2, 1))[1]

    total = args.requests * args.rounds
    print(f"{total} run_code requests per path (python 'print(n * 2)', sandboxed), {args.concurrency} in flight, "
          f"{args.workers} workers x {args.cores} cores; every answer checked")
    print(f"{'path':<14} {'req/s':>8} {'p50 ms':>9} {'p99 ms':>9}   {'sequential p50 ms':>18} {'p99 ms':>8}")
    rows = {}
    for name, f in figures.items():
        rate = total / sum(f["wall"])
        rows[name] = (rate, pct(f["lat"], 50), pct(f["lat"], 99), pct(f["seq"], 50), pct(f["seq"], 99))
        print(f"{name:<14} {rate:>8.1f} {rows[name][1] * 1e3:>9.1f} {rows[name][2] * 1e3:>9.1f}   "
              f"{rows[name][3] * 1e3:>18.1f} {rows[name][4] * 1e3:>8.1f}")
    h, c = rows["HTTP (serve)"], rows["Client"]
    print(f"HTTP / Client: throughput {h[0] / c[0]:.2f}x, p50 {h[1] / c[1]:.2f}x, p99 {h[2] / c[2]:.2f}x, "
          f"sequential p50 +{(h[3] - c[3]) * 1e3:.2f} ms")
    print(f"serve process CPU: {serve_cpu / serve_requests * 1000:.3f} s per 1000 requests under load")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300, help="requests per path per round (default 300)")
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight (default 64)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per path (default 2)")
    ap.add_argument("--sequential", type=int, default=100, help="one-at-a-time requests per path (default 100)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cores", type=int, default=2, help="cores per worker")
    args = ap.parse_args()
    with LocalCluster(workers=args.workers, cores=args.cores) as cl:
        proc, url = start_serve(cl.connection_file)
        try:
            asyncio.run(bench(args, cl.connection_file, url, proc.pid))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
