"""One coordinator at scale: a worker harness speaking the real worker protocol for N simulated workers.

    python benchmarks/worker_harness.py [--workers 4 10 100 1000 2000] [--envs 1000 10000 100000]
                                        [--actions 20000] [--queued 100000] [--json]

For each worker count it starts one coordinator as the product starts it (``tangram-hpc
coordinator --backend none``, its own process, CurveZMQ on) and connects that many simulated
workers to it from this one process: one DEALER socket each (the identity the coordinator knows
a worker by), REGISTER, a heartbeat every ``heartbeat_s`` as the coordinator tells it (the interval
grows with the number of workers; listing the environments each holds when they changed,
as a worker with sandboxes does, else the number of its last list), every ASSIGN answered with DONE after a sampled duration
(``--duration``: 0 answers in the same turn), an environment's first action answered ``created``.
One event loop, raw msgpack, one DONE frame per worker per turn, pre-encoded heartbeats: the
harness costs a few microseconds per action, so the coordinator is what is measured.  A raw
client on the same loop submits batches of light no-ops (``min_cores=0``) and checks that each
is answered exactly once.  Then, at each environment count (created cumulatively, one sandbox
action each, never closed), it measures:

* ``act/s`` light-action throughput, and the client's round trip p50/p99 under that load;
* ``place µs`` the placement policy alone, in this process, per light / one-core action (its
  submit, schedule and finish; the part of the coordinator's CPU that a scan over workers would grow);
* ``cpu µs/act`` the coordinator's CPU per action (from /proc, less its idle rate measured just
  before), and its ratio to the first row (the fewest workers, no environments);
* ``hb %core`` the coordinator's CPU while only heartbeats flow (both ways), as a share of one
  core, and ``µs/hb`` per worker heartbeat;
* ``KiB/worker``, ``KiB/env`` the coordinator's RSS growth per worker registered / per
  environment created;
* ``status ms`` a STATUS round trip plus its JSON dump (what ``tangram-hpc status --json``
  pays after connecting), ``top ms`` that plus ``top``'s view and frame drawn off-screen;

and once per worker count, at the last environment count, ``KiB/queued``: RSS growth per live
action while ``--queued`` actions wait behind workers whose cores are all taken.

Figures are of one run on whatever machine runs it; the ratios between rows of one run are what
to compare.  ``--json`` prints the rows as JSON.
"""
from __future__ import annotations

import argparse
import heapq
import io
import json
import os
import random
import resource
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tangram_hpc import protocol as P  # noqa: E402
from tangram_hpc.commands import status_json  # noqa: E402
from tangram_hpc.connection import ConnectionInfo, wait_for_file  # noqa: E402

_NOOP = {"fn": "tangram_hpc.handlers:noop"}
_LIGHT = [0, 0, 0, 0, None]
_ONE_CORE = [1, 1, 0, 0, None]
_V = P.PROTOCOL_VERSION


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


class CoordinatorProcess:
    """A coordinator started as ``tangram-hpc coordinator --backend none`` in ``run_dir``."""

    def __init__(self, run_dir: Path, *extra: str, insecure: bool = False):
        self.run_dir = run_dir
        conn = run_dir / "connection.json"
        cmd = [sys.executable, "-m", "tangram_hpc.cli", "coordinator", "--backend", "none",
               "--run-dir", str(run_dir), "--connection-file", str(conn), *extra]
        if insecure:
            cmd.append("--insecure")
        self._log = open(run_dir / "coordinator.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self.info = wait_for_file(conn, timeout=60)
        except BaseException:
            self.close()
            raise
        self.pid = self.proc.pid

    def cpu(self) -> float:
        return _cpu_seconds(self.pid)

    def rss_kib(self) -> int:
        return _rss_kib(self.pid)

    def close(self, harness: "Harness | None" = None) -> None:
        """Stop it as a signal does; ``harness``'s workers are heard out meanwhile (they leave when told)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            deadline = time.monotonic() + 60
            while self.proc.poll() is None and time.monotonic() < deadline:
                if harness is not None:
                    harness.pump(20)
                else:
                    time.sleep(0.02)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class SimWorker:
    __slots__ = ("id", "sock", "envs", "envs_v", "list_due", "hb_frame", "welcomed", "done", "held", "assigned")

    def __init__(self, wid: str, sock: zmq.Socket):
        self.id = wid
        self.sock = sock
        self.envs: set[str] = set()
        self.envs_v = 0                        # the number of the last environment list sent
        self.list_due = True                   # the next heartbeat lists the environments
        self.hb_frame: bytes | None = None     # this worker's heartbeat without the list, encoded once per list
        self.welcomed = False
        self.done: list[list] = []             # DONE items of this turn
        self.held: list[list] = []             # assignments kept unanswered (hold mode)
        self.assigned = 0


class Harness:
    """N simulated workers and one raw client on one event loop, against the coordinator of ``info``."""

    def __init__(self, info: ConnectionInfo, *, cores: int = 8, heartbeat_s: float = 1.0,
                 duration: float = 0.0, seed: int = 0):
        self.info = info
        self.ctx = zmq.Context(io_threads=1)
        self.ctx.max_sockets = 100_000          # one socket per simulated worker (the default stops at 1023)
        self.cores = cores
        self.own_heartbeat_s = heartbeat_s
        self.heartbeat_s = heartbeat_s          # the interval the coordinator told (WELCOME, its heartbeats)
        self.duration = duration               # mean of the exponential run time of an action (0: none)
        self.rng = random.Random(seed)
        self.workers: list[SimWorker] = []
        self.by_sock: dict[zmq.Socket, SimWorker] = {}
        # epoll over each socket's ZMQ_FD: a zmq.Poller of 2,000 sockets costs milliseconds a call
        self.epoll = select.epoll()
        self.by_fd: dict[int, SimWorker | None] = {}    # None: the client
        self._sent_on: list[SimWorker] = []              # sent to this turn: their FD may not signal again
        self._sweep_at = 0.0
        self.due: list[tuple[float, int, int, list]] = []   # (when, seq, worker index, DONE item)
        self._seq = 0
        self.hold = False
        self._hb_at = time.monotonic()          # heartbeats owed are counted up to then
        self._hb_owed = 0.0
        self._hb_next = 0                       # the index of the worker whose heartbeat is next
        self.client = self._socket(b"harness-client", info.client_address)
        self._watch(self.client, None)
        self.sent: dict[str, float] = {}        # action id -> when submitted, until answered
        self.rtts: list[float] = []
        self.answered = 0
        self.duplicates = 0                     # results for an action already answered (or never sent)
        self.failed: list[list] = []
        self.errors: list[dict] = []
        self._next_id = 0
        self._status_sock: zmq.Socket | None = None
        self.env_root = tempfile.gettempdir()   # never written: the harness keeps no files
        self._answering: list[SimWorker] = []   # workers with DONE items to send this turn

    # -- sockets -----------------------------------------------------------------
    def _watch(self, sock: zmq.Socket, w: SimWorker | None) -> None:
        fd = sock.getsockopt(zmq.FD)
        self.by_fd[fd] = w
        self.epoll.register(fd, select.EPOLLIN)

    def _socket(self, ident: bytes, address: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, ident)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        if self.info.secure:
            from tangram_hpc.security import CurveKeys
            CurveKeys.apply_client(s, self.info)
        s.connect(address)
        return s

    def add_workers(self, n: int, timeout: float = 300.0) -> None:
        """Connect and register ``n`` more workers; returns once each is welcomed."""
        pid = os.getpid()
        fresh = []
        for _ in range(n):
            wid = f"hw{len(self.workers):05d}-{pid}"
            w = SimWorker(wid, self._socket(wid.encode(), self.info.worker_address))
            self.workers.append(w)
            self.by_sock[w.sock] = w
            self._watch(w.sock, w)
            fresh.append(w)
        deadline = time.monotonic() + timeout
        last_try = 0.0
        while not all(w.welcomed for w in fresh):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sum(not w.welcomed for w in fresh)} workers were never welcomed")
            # REGISTER again until welcomed, as a worker does, but after 10 s rather than each heartbeat:
            # 2,000 joining at once are welcomed over seconds (CurveZMQ handshakes first), and a second
            # REGISTER from a worker already registered counts as the old registration lost
            if time.monotonic() - last_try > 10.0:
                last_try = time.monotonic()
                for w in fresh:
                    if not w.welcomed:
                        self._register(w)
            self.pump(50)

    def _register(self, w: SimWorker) -> None:
        w.list_due = True
        w.sock.send(P.encode(P.REGISTER, {
            "id": w.id, "pid": os.getpid(), "cores": self.cores, "mem_mb": 0, "gpus": 0, "gpu_mem_mb": 0,
            "kinds": ["function", "sandbox"], "services": [], "handle": None, "host": "harness",
            "partition": None, "envs": [], "env_root": self.env_root}), zmq.NOBLOCK)

    # -- the loop ------------------------------------------------------------------
    def pump(self, timeout_ms: int = 0) -> None:
        """One turn: read every ready socket, answer what is due, send the heartbeats whose turn came."""
        if self.due:
            timeout_ms = min(timeout_ms, max(0, int((self.due[0][0] - time.monotonic()) * 1000)))
        ready = self.epoll.poll(timeout_ms / 1000)
        by_fd = self.by_fd
        for fd, _ in ready:
            w = by_fd[fd]
            if w is None:
                self._client_in()
            else:
                self._worker_in(w)
        now = time.monotonic()
        due = self.due
        while due and due[0][0] <= now:
            _, _, i, item = heapq.heappop(due)
            self._answer(self.workers[i], item)
        if self._answering:
            answering, self._answering = self._answering, []
            for w in answering:
                items, w.done = w.done, []
                w.sock.send(P.encode(P.DONE, items), zmq.NOBLOCK)
            self._sent_on += answering
        self._heartbeats(now)
        # A ZMQ_FD signals an edge: after a send, what arrived meanwhile is found by asking the socket.
        if now >= self._sweep_at:
            self._sweep_at = now + 0.2
            self._sent_on = list(self.workers)
            self._client_in()
        if self._sent_on:
            sent_on, self._sent_on = self._sent_on, []
            for w in sent_on:
                if w.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self._worker_in(w)

    def _answer(self, w: SimWorker, item: list) -> None:
        if not w.done:
            self._answering.append(w)
        w.done.append(item)

    def _heartbeats(self, now: float) -> None:
        """Each worker once per ``heartbeat_s``, spread evenly over it."""
        n = len(self.workers)
        if not n:
            return
        self._hb_owed = min(self._hb_owed + (now - self._hb_at) / self.heartbeat_s * n, n)
        self._hb_at = now
        owed = int(self._hb_owed)
        self._hb_owed -= owed
        for _ in range(owed):
            w = self.workers[self._hb_next % n]
            self._hb_next += 1
            if not w.welcomed:
                continue
            if w.list_due:
                w.list_due = False
                w.envs_v += 1
                body = {"running": 0, "busy_cores": 0, "killed_running": [], "envs_v": w.envs_v}
                w.hb_frame = P.encode(P.HEARTBEAT, body)
                w.sock.send(P.encode(P.HEARTBEAT, body | {"envs": sorted(w.envs)}), zmq.NOBLOCK)
            else:
                w.sock.send(w.hb_frame, zmq.NOBLOCK)
            self._sent_on.append(w)

    def _worker_in(self, w: SimWorker) -> None:
        sock = w.sock
        unpack = msgpack.unpackb
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            _, mtype, body = unpack(frame, raw=False)
            if mtype == P.ASSIGN:
                self._assigned(w, body)
                continue
            if mtype == P.HEARTBEAT or mtype == P.WELCOME:
                told = P.heartbeat_interval(body)     # as a worker does (never shorter than its own)
                if told is not None:
                    self.heartbeat_s = max(self.own_heartbeat_s, told)
            if mtype == P.WELCOME:
                w.welcomed = True
            elif mtype == P.STOP:
                if body.get("reregister"):
                    w.welcomed = False
                    self._register(w)
                else:      # leave as a worker does: its last heartbeat says so
                    w.welcomed = False
                    w.sock.send(P.encode(P.HEARTBEAT, {"left": "told to stop", "interrupted": []}), zmq.NOBLOCK)
            elif mtype == P.ERROR:
                self.errors.append(body)
            elif mtype == P.HEARTBEAT and "send_envs" in body:
                w.list_due = True
            # KILL, ENV from the coordinator: nothing to do for a worker that runs nothing

    def _assigned(self, w: SimWorker, items: list) -> None:
        if self.hold:
            w.held.extend(items)
            w.assigned += len(items)
            return
        now = time.time()
        mean = self.duration
        index = None
        for item in items:
            spec, attempt = item[0], item[1]
            env_state = None
            if len(item) == 4 and item[3] is not None:
                env = spec["e"]
                env_state = "kept" if item[3][1] == P.GRANT_HELD else "created"
                if env not in w.envs:
                    w.envs.add(env)
                    w.list_due = True
            done = [spec["i"], attempt, "ok", None, None, now, now, env_state]
            if mean > 0:
                if index is None:
                    index = self.workers.index(w)
                self._seq += 1
                heapq.heappush(self.due, (time.monotonic() + self.rng.expovariate(1 / mean), self._seq, index, done))
            else:
                self._answer(w, done)
        w.assigned += len(items)

    def release(self) -> int:
        """Answer every held assignment now (ends hold mode)."""
        self.hold = False
        n = 0
        for w in self.workers:
            if w.held:
                held, w.held = w.held, []
                n += len(held)
                w.assigned -= len(held)
                self._assigned(w, held)
        return n

    # -- the client ----------------------------------------------------------------
    def _client_in(self) -> None:
        sent = self.sent
        now = time.monotonic()
        while True:
            try:
                frame = self.client.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            _, mtype, body = msgpack.unpackb(frame, raw=False)
            if mtype == P.RESULT:
                for r in body:
                    t = sent.pop(r[0], None)
                    if t is None:
                        self.duplicates += 1
                        continue
                    self.answered += 1
                    self.rtts.append(now - t)
                    if r[1] != "ok":
                        self.failed.append(r)
            elif mtype == P.ERROR:
                self.errors.append(body)

    def submit(self, specs: list[dict]) -> None:
        now = time.monotonic()
        for s in specs:
            self.sent[s["i"]] = now
        self.client.send(P.encode(P.SUBMIT, specs), zmq.NOBLOCK)
        self._client_in()

    def _ids(self, n: int) -> range:
        start = self._next_id
        self._next_id += n
        return range(start, start + n)

    def run(self, make, n: int, *, batch: int = 1000, window: int = 10_000, timeout: float = 600.0) -> float:
        """Submit ``n`` actions made by ``make(i)`` in batches, at most ``window`` unanswered; returns
        the seconds until the last was answered."""
        ids = self._ids(n)
        t0 = time.monotonic()
        deadline = t0 + timeout
        i = 0
        while i < n or self.sent:
            if i < n and len(self.sent) < window:
                k = min(batch, n - i, window - len(self.sent))
                self.submit([make(ids[j]) for j in range(i, i + k)])
                i += k
                self.pump(0)
            else:
                self.pump(20)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.sent)} actions unanswered after {timeout:.0f}s")
        return time.monotonic() - t0

    def idle(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.pump(20)

    def status(self) -> tuple[dict, float]:
        """A STATUS round trip on a socket of its own, with the JSON dump ``status --json`` makes."""
        if self._status_sock is None:
            self._status_sock = self._socket(b"harness-status", self.info.client_address)
        self.pump(0)
        t0 = time.perf_counter()
        self._status_sock.send(P.encode(P.STATUS, {}))
        # Waited for alone, as the command does: pumping 2,000 workers meanwhile would time the harness.
        # A reply takes far less than the workers' silence limit, so none is lost for it.
        if not self._status_sock.poll(30_000):
            raise TimeoutError("no STATUS reply in 30 s")
        _, _, st = msgpack.unpackb(self._status_sock.recv(), raw=False)
        status_json(st)
        return st, time.perf_counter() - t0

    def close(self) -> None:
        self.epoll.close()
        self.ctx.destroy(linger=0)


# -- actions -------------------------------------------------------------------------
def noop(i: int) -> dict:
    return {"i": f"n{i}", "k": "function", "p": _NOOP, "d": _LIGHT}


def env_action(i: int) -> dict:
    return {"i": f"e{i}", "k": "sandbox", "p": {"cmd": "true"}, "e": f"env-{i}", "d": _ONE_CORE}


def long_action(i: int) -> dict:
    return {"i": f"q{i}", "k": "function", "p": _NOOP, "d": _ONE_CORE, "h": 60.0}


# -- measurements ---------------------------------------------------------------------
def top_refresh(h: Harness) -> float:
    """A STATUS round trip plus what ``top`` does with it each refresh: its view and frame, drawn off-screen."""
    from rich.console import Console

    from tangram_hpc.top import TopView
    view = TopView()
    Console(file=io.StringIO(), width=132).print(view.frame())     # the imports a running top made long ago
    st, _ = h.status()
    view.add(st, time.time() - 2)
    t0 = time.perf_counter()
    st, _ = h.status()
    view.add(st, time.time())
    Console(file=io.StringIO(), width=132).print(view.frame())
    return time.perf_counter() - t0


def measure(h: Harness, coord: CoordinatorProcess, args, row: dict) -> dict:
    """The figures of one row: throughput, CPU, heartbeats, status and top at the present size."""
    cpu0, t0 = coord.cpu(), time.monotonic()
    h.idle(args.idle)
    idle_rate = (coord.cpu() - cpu0) / (time.monotonic() - t0)
    w = len(h.workers)
    row["hb_core_pct"] = 100 * idle_rate
    row["hb_s"] = h.heartbeat_s
    row["hb_us"] = 1e6 * idle_rate * h.heartbeat_s / w if w else None
    h.rtts = []
    cpu0, own0 = coord.cpu(), _cpu_seconds(os.getpid())
    wall = h.run(noop, args.actions, batch=args.batch)
    cpu = coord.cpu() - cpu0
    row["harness_us_action"] = 1e6 * (_cpu_seconds(os.getpid()) - own0) / args.actions
    row["actions_s"] = args.actions / wall
    row["cpu_us_action"] = 1e6 * max(0.0, cpu - idle_rate * wall) / args.actions
    row["rtt_p50_ms"] = 1e3 * pct(h.rtts, 50)
    row["rtt_p99_ms"] = 1e3 * pct(h.rtts, 99)
    times = sorted(h.status()[1] for _ in range(args.status_reps))
    row["status_ms"] = 1e3 * times[len(times) // 2]
    row["status_max_ms"] = 1e3 * times[-1]
    row["top_ms"] = 1e3 * top_refresh(h)
    row["rss_mib"] = coord.rss_kib() / 1024
    return row


def placement_cost(workers: int, n: int, cores: int, policy: str = "elastic") -> dict:
    """The placement policy alone, in this process: µs per action of submit, schedule and finish for
    ``n`` light and ``n`` one-core no-ops over ``workers`` workers (no sockets, no ledger)."""
    from tangram_hpc.actions import ActionSpec
    from tangram_hpc.launch import make_policy
    from tangram_hpc.resources import WorkerInfo
    out = {}
    for name, make in (("light", noop), ("core", long_action)):
        p = make_policy(policy)
        now = 1000.0
        for i in range(workers):
            p.add_worker(WorkerInfo(id=f"w{i}", cores=cores, mem_mb=0, gpus=0, gpu_mem_mb=0,
                                    kinds=frozenset({"function", "sandbox"})), now)
        specs = [ActionSpec.from_wire(make(i)) for i in range(n)]
        t0 = time.process_time()      # CPU time: the machine may be shared
        for i in range(0, n, 1000):
            for s in specs[i:i + 1000]:
                p.submit(s, now)
            while p.pending_count:
                started = p.schedule(now)
                if not started:
                    break
                now += 1e-4
                for a in started:
                    p.finished(a.action_id, now, run_time=1e-4)
        out[name] = 1e6 * (time.process_time() - t0) / n
    return out


def queued_memory(h: Harness, coord: CoordinatorProcess, queued: int) -> float:
    """KiB of coordinator RSS per live action while ``queued`` wait behind full workers."""
    slots = len(h.workers) * h.cores
    n = queued + slots
    rss0 = coord.rss_kib()
    h.hold = True
    ids = h._ids(n)
    for i in range(0, n, 1000):
        h.submit([long_action(ids[j]) for j in range(i, min(n, i + 1000))])
        h.pump(0)
    deadline = time.monotonic() + 300
    while True:     # every core taken and every other action queued at the coordinator
        h.pump(50)
        st, _ = h.status()
        if st["submitted"] >= h._next_id - 0 and sum(w.assigned for w in h.workers) >= slots \
                and st["pending"] >= queued:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"queue never filled: {st['pending']} pending")
    per = (coord.rss_kib() - rss0) / n
    h.release()
    deadline = time.monotonic() + 600
    while h.sent:
        h.pump(20)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(h.sent)} queued actions unanswered")
    return per


def scale_run(args, workers: int, envs: list[int], rows: list[dict], say) -> None:
    with tempfile.TemporaryDirectory(prefix="tangram-harness-") as tmp:
        pace = ["--heartbeats-per-s", str(args.heartbeats_per_s)] if args.heartbeats_per_s is not None else []
        coord = CoordinatorProcess(Path(tmp), "--heartbeat", str(args.heartbeat), *pace, insecure=args.insecure)
        h = Harness(coord.info, cores=args.cores, heartbeat_s=args.heartbeat, duration=args.duration)
        try:
            placement = placement_cost(workers, args.placement, args.cores)
            h.idle(0.5)
            rss0 = coord.rss_kib()
            h.add_workers(workers)
            h.idle(1.0)
            per_worker = (coord.rss_kib() - rss0) / workers
            lost_joining = h.status()[0]["workers_lost"]
            made = 0
            for level in [0, *envs]:
                row = {"workers": workers, "envs": level, "kib_worker": per_worker,
                       "place_light_us": placement["light"], "place_core_us": placement["core"]}
                if level > made:
                    rss0 = coord.rss_kib()
                    t = time.monotonic()
                    h.run(env_action, level - made, batch=args.batch)   # each action a new environment
                    row["envs_s"] = (level - made) / (time.monotonic() - t)
                    h.idle(1.5 * h.heartbeat_s)   # every worker has reported its environments since
                    row["kib_env"] = (coord.rss_kib() - rss0) / (level - made)
                    made = level
                measure(h, coord, args, row)
                st, _ = h.status()
                row["workers_seen"] = len(st["workers"])
                row["lost_joining"] = lost_joining            # repeated REGISTERs while thousands join
                row["workers_lost"] = st["workers_lost"] - lost_joining   # since: 0 unless something stalled
                row["envs_seen"] = sum(w["envs"] for w in st["workers"])
                if level == envs[-1] if envs else level == 0:
                    row["kib_queued"] = queued_memory(h, coord, args.queued)
                rows.append(row)
                say(row)
            if h.duplicates or h.failed or h.errors:
                raise RuntimeError(f"{h.duplicates} duplicate results, {len(h.failed)} failed actions "
                                   f"(first: {h.failed[:1]}), errors {h.errors[:3]}")
        finally:
            coord.close(h)
            h.close()


_COLUMNS = [("workers", "workers", "{:.0f}"), ("envs", "envs", "{:.0f}"), ("actions_s", "act/s", "{:.0f}"),
            ("cpu_us_action", "cpu µs/act", "{:.1f}"), ("cpu_ratio", "x first", "{:.2f}"),
            ("harness_us_action", "harness µs/act", "{:.1f}"),
            ("place_light_us", "place µs light", "{:.1f}"), ("place_core_us", "place µs core", "{:.1f}"),
            ("rtt_p50_ms", "rtt p50 ms", "{:.1f}"), ("rtt_p99_ms", "rtt p99 ms", "{:.1f}"),
            ("hb_core_pct", "hb %core", "{:.1f}"), ("hb_s", "hb s", "{:.2f}"), ("hb_us", "µs/hb", "{:.0f}"),
            ("kib_worker", "KiB/worker", "{:.1f}"), ("kib_env", "KiB/env", "{:.2f}"),
            ("kib_queued", "KiB/queued", "{:.2f}"), ("status_ms", "status ms", "{:.1f}"),
            ("top_ms", "top ms", "{:.1f}"), ("rss_mib", "RSS MiB", "{:.0f}"),
            ("lost_joining", "lost joining", "{:.0f}"), ("workers_lost", "lost", "{:.0f}")]


def table(rows: list[dict]) -> str:
    cells = [[head for _, head, _ in _COLUMNS]]
    for r in rows:
        cells.append(["-" if r.get(k) is None else fmt.format(r[k]) for k, _, fmt in _COLUMNS])
    widths = [max(len(c[i]) for c in cells) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(c[i].rjust(widths[i]) for i in range(len(c))) for c in cells)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 10, 100, 1000, 2000])
    ap.add_argument("--envs", type=int, nargs="*", default=[1000, 10_000, 100_000],
                    help="environment counts measured at (created cumulatively, for each worker count)")
    ap.add_argument("--actions", type=int, default=20_000, help="light no-ops per throughput measurement")
    ap.add_argument("--queued", type=int, default=100_000, help="actions queued for the memory per queued action")
    ap.add_argument("--placement", type=int, default=20_000, help="actions through the placement policy alone")
    ap.add_argument("--cores", type=int, default=8, help="cores each simulated worker registers")
    ap.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat_s of the coordinator and the workers")
    ap.add_argument("--heartbeats-per-s", type=float, default=None,
                    help="the coordinator's bound on the workers' heartbeats a second (default: its own)")
    ap.add_argument("--duration", type=float, default=0.0, help="mean run time of an action in seconds (exponential)")
    ap.add_argument("--idle", type=float, default=3.0, help="seconds of heartbeats alone per row")
    ap.add_argument("--batch", type=int, default=1000, help="actions per SUBMIT frame")
    ap.add_argument("--status-reps", type=int, default=5)
    ap.add_argument("--insecure", action="store_true", help="plain TCP instead of CurveZMQ")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)

    want = 2 * max(args.workers) + 256          # a socket and its mailbox per simulated worker
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(want, soft), hard), hard))
    rows: list[dict] = []

    def say(row: dict) -> None:     # progress on stderr, the table or JSON on stdout at the end
        print(f"  {row['workers']} workers, {row['envs']} environments: {row['actions_s']:.0f} act/s, "
              f"{row['cpu_us_action']:.1f} µs/act", file=sys.stderr, flush=True)

    for w in args.workers:
        scale_run(args, w, args.envs, rows, say)
    first = rows[0]["cpu_us_action"]
    for r in rows:
        r["cpu_ratio"] = r["cpu_us_action"] / first if first else None
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
