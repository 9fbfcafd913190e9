"""``tangram-hpc top``: a live terminal view of a coordinator.

It polls the coordinator's ``status`` (the same reply ``tangram-hpc status``
prints) every ``--interval`` seconds and draws, with ``rich``:

* a header: workers by state, cores busy/total, actions pending/running,
  finished and failed, throughput over the last minute;
* workers: Slurm job (or backend handle), host, state, cores busy/total, running
  actions, time left in the job, environments, resident services;
* queues: waiting actions per placement class, with the oldest wait;
* ACT and queue-time percentiles per kind of action over the last minute
  (differences of the coordinator's cumulative histograms), and since start;
* the pool's recent decisions (launches, drains, reclaims, failed starts).

``q`` or Ctrl-C quits.  ``--once`` prints one frame and exits (also what it
does when stdout is not a terminal), for logs and bug reports.
"""
from __future__ import annotations

import argparse
import os
import select
import sys
import time
from collections import deque
from datetime import datetime
from typing import Any

from .commands import _client, _connection_args
from .metrics import Histogram

__all__ = ["TopView", "add_arguments", "main"]

#: the window of rates and percentiles, in seconds
WINDOW_S = 60.0
#: workers drawn one row each; past it, the first in trouble and the busiest
MAX_WORKER_ROWS = 40

_TABLE: dict[str, Any] = {"show_edge": False, "pad_edge": False, "header_style": "bold", "title_style": "bold cyan"}
#: Columns of a frame written to a pipe or a file (the widest frame the view draws).
_PIPE_WIDTH = 132


def add_arguments(p: argparse.ArgumentParser) -> None:
    _connection_args(p)
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                   help="seconds between refreshes (default 2)")
    p.add_argument("--once", action="store_true",
                   help="print one frame and exit (what it does anyway when stdout is not a terminal)")


class TopView:
    """The status replies of the last :data:`WINDOW_S` seconds, and the frame drawn from them."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self.history: deque[tuple[float, dict]] = deque()
        self.error: str | None = None

    def add(self, status: dict, now: float) -> None:
        self.history.append((now, status))
        self.error = None
        # Keep one reply at least window_s old: the differences are taken against it.
        while len(self.history) > 2 and self.history[1][0] <= now - self.window_s:
            self.history.popleft()

    def failed(self, why: str) -> None:
        self.error = why

    # -- derived figures -----------------------------------------------------------
    def _window(self) -> tuple[float, dict | None, dict]:
        """(seconds covered, the oldest reply kept or None, the latest reply)."""
        t1, latest = self.history[-1]
        t0, oldest = self.history[0]
        if len(self.history) < 2 or oldest.get("coordinator") != latest.get("coordinator"):
            return 0.0, None, latest
        return t1 - t0, oldest, latest

    def rate(self, key: str) -> float | None:
        span, old, new = self._window()
        if old is None or span <= 0 or new.get(key, 0) < old.get(key, 0):
            return None
        return (new.get(key, 0) - old.get(key, 0)) / span

    def recent(self, section: str, kind: str) -> Histogram | None:
        """The ``act`` or ``queue_time`` histogram of ``kind`` over the window (None without one)."""
        _, old, new = self._window()
        h = new.get(section, {}).get(kind)
        if h is None or old is None:
            return None
        cur = Histogram.from_wire(h)
        before = old.get(section, {}).get(kind)
        return cur.minus(Histogram.from_wire(before)) if before is not None else cur

    # -- the frame -----------------------------------------------------------------
    def frame(self):
        """A ``rich`` renderable of the latest reply."""
        from rich.console import Group
        from rich.text import Text

        if not self.history:
            return Text(self.error or "waiting for the coordinator ...", style="bold red" if self.error else "")
        st = self.history[-1][1]
        parts = [self._header(st)]
        if self.error:
            parts.append(Text(f"coordinator not answering: {self.error} (showing the last answer)", style="bold red"))
        parts += [self._workers(st), self._queues(st), self._act(st), self._decisions(st)]
        return Group(*[p for p in parts if p is not None])

    def _header(self, st: dict):
        from rich.text import Text

        workers = st.get("workers", [])
        states: dict[str, int] = {}
        for w in workers:
            states[w.get("state", "?")] = states.get(w.get("state", "?"), 0) + 1
        if st.get("starting_workers"):
            states["starting"] = st["starting_workers"]
        busy = sum(w.get("busy_cores", 0) for w in workers)
        cores = sum(w.get("cores", 0) for w in workers)
        rate = self.rate("completed")
        failed_rate = self.rate("failed")
        t = Text()
        t.append("tangram-hpc top", style="bold")
        t.append(f"  coordinator {st.get('coordinator', '?')}  up {_dur(st.get('uptime_s', 0))}")
        if st.get("metrics_url"):
            t.append(f"  metrics {st['metrics_url']}", style="dim")
        t.append("\nworkers ")
        t.append(f"{len(workers)}", style="bold")
        if states:
            t.append(" (" + ", ".join(f"{n} {s}" for s, n in sorted(states.items())) + ")")
        t.append("  cores ")
        t.append(f"{busy}/{cores}", style="bold")
        t.append(f" busy {_bar(busy, cores, 12)}")
        if st.get("zombie_cores"):
            t.append(f"  zombie cores {st['zombie_cores']}", style="yellow")
        t.append("\nactions pending ")
        t.append(f"{st.get('pending', 0):,}", style="bold")
        t.append("  running ")
        t.append(f"{st.get('running', 0):,}", style="bold")
        t.append(f"  completed {st.get('completed', 0):,}  failed {st.get('failed', 0):,}"
                 f"  retried {st.get('retried', 0):,}  rejected {st.get('rejected', 0):,}")
        if rate is not None:
            span = self._window()[0]
            t.append(f"  | last {_dur(span)}: {rate:,.1f} done/s", style="green")
            if failed_rate:
                t.append(f", {failed_rate:,.1f} failed/s", style="red")
        return t

    def _workers(self, st: dict):
        from rich.table import Table
        from rich.text import Text

        workers = st.get("workers", [])
        if not workers:
            return _empty("workers", "(no workers registered)")
        table = Table(title="workers", title_justify="left", **_TABLE)
        for col, kw in (("worker", {"no_wrap": True, "overflow": "ellipsis", "max_width": 22}),
                        ("job", {"no_wrap": True}), ("host", {"overflow": "ellipsis", "max_width": 14}),
                        ("state", {}), ("cores busy", {"no_wrap": True}), ("run", {"justify": "right"}),
                        ("time left", {"justify": "right"}), ("envs", {"justify": "right"}),
                        ("services", {"overflow": "fold"})):
            table.add_column(col, **kw)
        shown = workers
        if len(workers) > MAX_WORKER_ROWS:
            # At thousands of workers a row each would take seconds to draw and scroll off anyway:
            # those not ok first, then the busiest; the rest are counted in the caption.
            shown = sorted(workers, key=lambda w: (w.get("state", "ok") == "ok", -w.get("busy_cores", 0),
                                                   -w.get("running", 0)))[:MAX_WORKER_ROWS]
            table.caption = f"{len(workers) - len(shown):,} more workers not shown (idlest)"
            table.caption_justify = "left"
        for w in shown:
            busy, cores = w.get("busy_cores", 0), w.get("cores", 0)
            zombie = w.get("zombie_cores", 0)
            state = str(w.get("state", ""))
            busy_text = Text(f"{busy:>3}/{cores:<3} {_bar(busy, cores, 8)}")
            if zombie:
                busy_text.append(f" {zombie} zombie", style="yellow")
            table.add_row(
                Text(w.get("id", "?")), Text(_job(w)), Text(w.get("host", "")),
                Text(state, style="yellow" if state != "ok" else ""), busy_text,
                str(w.get("running", 0)), _time_left(w), str(w.get("envs", 0)),
                Text(_services(w)))
        return table

    def _queues(self, st: dict):
        from rich.table import Table
        from rich.text import Text

        queues = st.get("queues") or []
        if not queues:
            return _empty("queues", "(nothing waiting)")
        table = Table(title="queues", title_justify="left", **_TABLE)
        for col in ("kind", "service", "cores", "mem", "GPU mem", "pending", "in an env", "oldest wait"):
            table.add_column(col, justify="left" if col in ("kind", "service") else "right")
        for q in queues[:10]:
            table.add_row(Text(q["kind"]), Text(q["service"] or "-"), str(q["min_cores"]), _mb(q["mem_mb"]),
                          _mb(q["gpu_mem_mb"]), f"{q['pending']:,}", f"{q['env_bound']:,}", _dur(q["oldest_s"]))
        if len(queues) > 10:
            table.add_row(f"... {len(queues) - 10} more classes", *[""] * 7)
        return table

    def _act(self, st: dict):
        from rich.table import Table
        from rich.text import Text

        act = st.get("act") or {}
        if not act:
            return _empty("action completion time (ACT) and queue time", "(no action finished yet)")
        span = self._window()[0]
        # Percentiles over the window once there is one (the first frame: since the start).
        over = f"over the last {_dur(span)}" if span else "since the start"
        table = Table(title=f"action completion time (ACT) and queue time, percentiles {over}",
                      title_justify="left", **_TABLE)
        table.add_column("kind")
        for col in ("finished", "failed", "in window", "ACT p50", "p90", "p99", "mean", "queue p50", "p99"):
            table.add_column(col, justify="right")
        finished = st.get("finished_by_kind") or {}
        for kind in sorted(act):
            win = self.recent("act", kind) if span else Histogram.from_wire(act[kind])
            qwin = self.recent("queue_time", kind) if span else Histogram.from_wire(st["queue_time"][kind])
            counts = finished.get(kind, {})
            bad = sum(n for s, n in counts.items() if s != "ok")
            table.add_row(kind, f"{sum(counts.values()):,}", Text(f"{bad:,}", style="red" if bad else ""),
                          f"{win.count:,}", *(_q(win, q) for q in (0.5, 0.9, 0.99)), _dur(win.mean()),
                          *(_q(qwin, q) for q in (0.5, 0.99)))
        return table

    def _decisions(self, st: dict):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        head = Text("pool", style=_TABLE["title_style"])
        if st.get("pool"):
            head.append(f": {st['pool']}")
        launch = st.get("launch") or {}
        if launch.get("state") not in (None, "ok"):        # the launch throttle holds launches back
            head.append(f"\nlaunches {launch['state']}" + (f": {launch['reason']}" if launch.get("reason") else "")
                        + (f" (again at {launch['retry_at']})" if launch.get("retry_at") else ""), style="yellow")
        jobs = st.get("allocation_states") or {}
        if jobs:
            head.append("\nworker jobs " + ", ".join(f"{n} {s}" for s, n in sorted(jobs.items())))
        decisions = st.get("pool_decisions") or []
        table = Table(**_TABLE)
        table.add_column("time", no_wrap=True)
        table.add_column("decision", no_wrap=True)
        table.add_column("detail", overflow="fold")
        for t, what, detail in decisions[-8:]:
            style = "red" if "fail" in what else ("yellow" if what in ("drain", "reclaim", "withdraw") else "")
            table.add_row(datetime.fromtimestamp(t).strftime("%H:%M:%S"), Text(what, style=style), Text(detail))
        for why in st.get("recent_launch_failures") or []:
            if not any(why in d for _, _, d in decisions):
                table.add_row("", Text("launch failed", style="red"), Text(why))
        if not table.row_count:
            head.append("\n(no decisions yet)", style="dim")
            return head
        return Group(head, table)


# -- small formatters ------------------------------------------------------------------

def _empty(title: str, message: str):
    from rich.text import Text

    out = Text(title, style=_TABLE["title_style"])
    out.append(f"\n{message}", style="dim")
    return out


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 0.001:
        return f"{s * 1e6:.0f}us"
    if s < 1:
        return f"{s * 1000:.1f}ms" if s < 0.01 else f"{s * 1000:.0f}ms"
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _q(h: Histogram | None, q: float) -> str:
    return _dur(h.quantile(q)) if h is not None and h.count else "-"


def _mb(mb: int) -> str:
    if not mb:
        return "-"
    return f"{mb / 1024:.0f}G" if mb >= 1024 and mb % 1024 == 0 else f"{mb}M"


def _bar(used: int, total: int, width: int) -> str:
    if total <= 0:
        return ""
    full = min(width, round(width * used / total))
    return "\u2588" * full + "\u2591" * (width - full)


def _services(w: dict) -> str:
    """Resident services; per device, with the memory they hold out of the budget, for a reward worker."""
    devices = w.get("devices") or []
    if not devices:
        return ", ".join(w.get("services") or []) or "-"
    return "; ".join(f"{d['device']} {d['used_mb'] / 1024:.1f}/{d['budget_mb'] / 1024:.1f} GB: "
                     f"{', '.join(d['resident']) or '-'}" for d in devices)


def _job(w: dict) -> str:
    """The Slurm job id when the coordinator gives one, else the backend handle."""
    job = w.get("job_id")
    return str(job) if job else (w.get("handle") or "-")


def _time_left(w: dict):
    from rich.text import Text

    left = w.get("time_left_s")
    if left is None:
        return "-"
    return Text(_dur(max(0.0, left)), style="red" if left < 300 else "")


# -- the command -------------------------------------------------------------------------

def main(args: argparse.Namespace) -> int:
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError as e:
        print(f"tangram-hpc top needs rich: pip install 'tangram-hpc[top]' ({e})", file=sys.stderr)
        return 2
    if args.interval <= 0:
        print("tangram-hpc top: --interval must be above 0", file=sys.stderr)
        return 2
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=_PIPE_WIDTH)     # a pipe or a file: the full frame, not 80 columns of it
    view = TopView()
    try:
        client = _client(args)
    except (ValueError, OSError) as e:      # no connection file given, or none there
        print(f"tangram-hpc top: {e}", file=sys.stderr)
        return 2
    with client:
        if args.once or not console.is_terminal:
            _poll(client, view, args.interval)
            console.print(view.frame())
            return 0 if view.error is None else 1
        try:
            with _keys() as key, Live(console=console, screen=True, auto_refresh=False) as live:
                while True:
                    _poll(client, view, args.interval)
                    live.update(view.frame(), refresh=True)
                    if key(args.interval) in ("q", "Q"):
                        return 0
        except KeyboardInterrupt:
            return 0


def _poll(client, view: TopView, interval: float) -> None:
    try:
        view.add(client.status(timeout=max(2.0, interval)), time.time())
    except (TimeoutError, OSError) as e:
        view.failed(str(e) or type(e).__name__)


class _keys:
    """Single key presses from a terminal stdin (cbreak mode, restored on exit); ``key(timeout)``
    waits up to ``timeout`` seconds and returns the key or None."""

    def __enter__(self):
        self._fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
        self._saved = None
        if self._fd is not None:
            import termios
            import tty
            self._saved = termios.tcgetattr(self._fd)
            tty.setcbreak(self._fd)
        return self._read

    def _read(self, timeout: float) -> str | None:
        if self._fd is None:
            time.sleep(timeout)
            return None
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if not ready:
            return None
        data = os.read(self._fd, 32)
        return data[:1].decode("ascii", "replace") if data else None

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            import termios
            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
