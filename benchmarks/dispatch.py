"""Dispatch-path benchmark: no-op function actions through a local coordinator.

    python benchmarks/dispatch.py [--actions 10000] [--clients 4] [--workers 2] [--latency 2000]

Starts a coordinator with local workers, then

* throughput: ``--clients`` client processes submit ``--actions`` no-ops in
  total, all at once, and check every result; prints actions/s and the
  round-trip percentiles seen under that load;
* latency: one client sends ``--latency`` no-ops one at a time (an unloaded
  round trip client -> coordinator -> worker -> client) and prints p50/p99;
* the CPU seconds each process used, per 1000 actions;
* a baseline measured in the same run: a bare two-hop ZMQ relay in Python (the
  same numbers of client and worker processes, one msgpack frame per request,
  no scheduling, no checks), so throughput reads as a ratio to what Python and
  ZMQ allow on this machine.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tangram_hpc import LocalCluster, function  # noqa: E402


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client_proc(conn_file: str, n: int, offset: int, cores: int, q) -> None:
    from tangram_hpc import Client
    with Client(connection_file=conn_file) as c:
        specs = [function("tangram_hpc.handlers:noop", offset + i, cores=cores) for i in range(n)]
        t0 = time.perf_counter()
        sent = time.time()
        futs = c.submit_many(specs)
        res = c.gather(futs, timeout=600)
        wall = time.perf_counter() - t0
        bad = sum(1 for i, r in enumerate(res) if not r.ok or r.output != offset + i)
        lat = [r.finished - r.submitted for r in res]   # coordinator-side ACT of each action
        q.put((wall, bad, lat, sent, time.time(), _cpu_seconds(os.getpid())))


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actions", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cores", type=int, default=2, help="cores per worker")
    ap.add_argument("--latency", type=int, default=2000, help="sequential round trips to time")
    ap.add_argument("--policy", default=None)
    ap.add_argument("--action-cores", type=int, nargs="+", default=[0, 1],
                    help="core demand of the no-ops; 0 = light actions pipelined to workers (default: 0 and 1)")
    ap.add_argument("--no-relay", action="store_true", help="skip the bare-relay baseline")
    args = ap.parse_args()

    args.relay_rate = None if args.no_relay else relay_throughput(args)
    with LocalCluster(workers=args.workers, cores=args.cores, policy=args.policy) as cl:
        st = cl.wait_for_workers(args.workers)
        worker_pids = [w["pid"] for w in st["workers"]]
        bad = 0
        for cores in args.action_cores:
            bad += throughput(cl, args, cores, worker_pids)
        bad += latency(cl, args.latency)
    return 1 if bad else 0


def latency(cl, n: int, rounds: int = 4) -> int:
    """Sequential no-op round trips through a raw socket, Client and AsyncClient, interleaved in rounds."""
    import asyncio

    import zmq

    from tangram_hpc import AsyncClient, protocol as P
    from tangram_hpc.security import CurveKeys

    info = cl.info
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.IDENTITY, b"bench-raw-" + os.urandom(4).hex().encode())
    if info.secure:
        CurveKeys.apply_client(raw, info)
    raw.connect(info.client_address)
    raw.send(P.encode(P.HELLO, {"name": "bench-raw"}))
    raw.recv()  # WELCOME

    def raw_once(i: int) -> float:
        spec = function("tangram_hpc.handlers:noop", i)
        t = time.perf_counter()
        raw.send(P.encode(P.SUBMIT, [spec.to_wire()]))
        while True:
            mtype, body = P.decode(raw.recv(), frozenset({P.RESULT, P.HEARTBEAT, P.WELCOME}))
            if mtype == P.RESULT:
                break
        dt = time.perf_counter() - t
        assert body[0][2] == i
        return dt

    times: dict[str, list[float]] = {"raw socket": [], "Client": [], "AsyncClient": []}
    bad = 0
    with cl.client() as c:
        def client_once(i: int) -> float:
            t = time.perf_counter()
            r = c.submit(function("tangram_hpc.handlers:noop", i)).result(10)
            dt = time.perf_counter() - t
            assert r.output == i
            return dt

        async def async_round(k: int) -> list[float]:
            out = []
            async with AsyncClient(connection_file=str(cl.connection_file)) as ac:
                for i in range(50):      # warm-up
                    await ac.submit(function("tangram_hpc.handlers:noop", i))
                for i in range(k):
                    t = time.perf_counter()
                    r = await ac.submit(function("tangram_hpc.handlers:noop", i))
                    out.append(time.perf_counter() - t)
                    assert r.output == i
            return out

        for i in range(50):
            raw_once(i)
            client_once(i)
        per = max(1, n // rounds)
        for _ in range(rounds):
            times["raw socket"] += [raw_once(i) for i in range(per)]
            times["Client"] += [client_once(i) for i in range(per)]
            times["AsyncClient"] += asyncio.run(async_round(per))
    ctx.destroy(0)
    base = pct(times["raw socket"], 50)
    print(f"latency: {per * rounds} sequential no-op round trips each, interleaved in {rounds} rounds:")
    for name, xs in times.items():
        print(f"  {name:<12} p50 {pct(xs, 50) * 1e3:.3f} ms  p99 {pct(xs, 99) * 1e3:.3f} ms  "
              f"(p50 {pct(xs, 50) / base:.2f}x the raw socket)")
    return bad


def throughput(cl, args, cores: int, worker_pids: list[int]) -> int:
    procs_before = {p: _cpu_seconds(p) for p in [cl.proc.pid] + worker_pids}
    q = mp.Queue()
    per = args.actions // args.clients
    t0 = time.perf_counter()
    ps = [mp.Process(target=_client_proc, args=(str(cl.connection_file), per, i * per, cores, q))
          for i in range(args.clients)]
    for p in ps:
        p.start()
    outs = [q.get(timeout=900) for _ in ps]
    wall = time.perf_counter() - t0
    for p in ps:
        p.join()
    total = per * args.clients
    bad = sum(o[1] for o in outs)
    lats = [x for o in outs for x in o[2]]
    busy = max(o[4] for o in outs) - min(o[3] for o in outs)
    client_cpu = sum(o[5] for o in outs)
    procs_after = {p: _cpu_seconds(p) for p in procs_before}
    print(f"throughput, {cores}-core no-ops: {total} from {args.clients} clients through {args.workers} workers: "
          f"{total / busy:,.0f} actions/s (first submit to last result {busy:.2f}s; with process start "
          f"{wall:.2f}s); wrong or failed results: {bad}")
    if args.relay_rate:
        print(f"  {total / busy / args.relay_rate:.2f}x the bare relay's rate")
    print(f"  ACT under load (coordinator clock): p50 {pct(lats, 50) * 1e3:.2f} ms  p99 {pct(lats, 99) * 1e3:.2f} ms")
    cpu_c = procs_after[cl.proc.pid] - procs_before[cl.proc.pid]
    cpu_w = sum(procs_after[p] - procs_before[p] for p in worker_pids)
    k = total / 1000
    print(f"  CPU seconds per 1000 actions: coordinator {cpu_c / k:.3f}, workers {cpu_w / k:.3f}, "
          f"clients {client_cpu / k:.3f} (client figure includes interpreter start-up)")
    return bad


# -- the baseline: a bare two-hop relay ----------------------------------------------

def _relay_proc(front: str, back: str, n_workers: int) -> None:
    import zmq
    ctx = zmq.Context()
    f, b = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    f.bind(front)
    b.bind(back)
    workers = [b.recv_multipart()[0] for _ in range(n_workers)]   # each says hello first
    poller = zmq.Poller()
    poller.register(f, zmq.POLLIN)
    poller.register(b, zmq.POLLIN)
    k = 0
    while True:
        for sock, _ in poller.poll():
            if sock is f:
                cid, payload = f.recv_multipart()
                if payload == b"stop":
                    for w in workers:
                        b.send_multipart([w, b"", b"stop"])
                    return
                b.send_multipart([workers[k], cid, payload])
                k = (k + 1) % n_workers
            else:
                _, cid, payload = b.recv_multipart()
                f.send_multipart([cid, payload])


def _relay_worker(back: str) -> None:
    import msgpack
    import zmq
    s = zmq.Context().socket(zmq.DEALER)
    s.connect(back)
    s.send_multipart([b"", b"hello"])
    while True:
        cid, payload = s.recv_multipart()
        if payload == b"stop":
            return
        req = msgpack.unpackb(payload)
        s.send_multipart([cid, msgpack.packb([req[0], "ok", req[2]])])


def _relay_client(front: str, n: int, q) -> None:
    import msgpack
    import zmq
    s = zmq.Context().socket(zmq.DEALER)
    s.connect(front)
    time.sleep(0.2)                       # connected before the clock starts, as a Client is
    sent = time.time()
    for i in range(n):
        s.send(msgpack.packb([i, "noop", i]))
    bad = sum(msgpack.unpackb(s.recv())[2] is None for _ in range(n))
    q.put((sent, time.time(), bad))


def relay_throughput(args) -> float:
    import socket

    def port() -> str:
        with socket.socket() as so:
            so.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{so.getsockname()[1]}"
    front, back = port(), port()
    relay = mp.Process(target=_relay_proc, args=(front, back, args.workers))
    relay.start()
    workers = [mp.Process(target=_relay_worker, args=(back,)) for _ in range(args.workers)]
    for w in workers:
        w.start()
    per = args.actions // args.clients
    q = mp.Queue()
    clients = [mp.Process(target=_relay_client, args=(front, per, q)) for _ in range(args.clients)]
    for c in clients:
        c.start()
    outs = [q.get(timeout=600) for _ in clients]
    for c in clients:
        c.join()
    import zmq
    stop = zmq.Context.instance().socket(zmq.DEALER)
    stop.connect(front)
    stop.send(b"stop")
    for p in [relay] + workers:
        p.join(10)
    stop.close(0)
    busy = max(o[1] for o in outs) - min(o[0] for o in outs)
    rate = per * args.clients / busy
    print(f"baseline, bare two-hop ZMQ relay: {per * args.clients} requests from {args.clients} clients through "
          f"{args.workers} workers: {rate:,.0f} requests/s")
    return rate


if __name__ == "__main__":
    raise SystemExit(main())
