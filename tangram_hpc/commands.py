"""Small client commands: ``tangram-hpc submit``, ``tangram-hpc status`` and ``tangram-hpc pool``."""
from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from typing import Iterator

from .actions import ActionSpec, Demand
from .client import Client
from .errors import ValidationError


def _connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connection-file", "-c", help="coordinator connection file (default $TANGRAM_CONNECTION_FILE)")
    p.add_argument("--address", help="coordinator client address instead of a connection file (insecure only)")


def _client(args: argparse.Namespace) -> Client:
    if args.address:
        return Client(args.address)
    return Client(connection_file=args.connection_file)


@contextmanager
def _connected(args: argparse.Namespace, command: str) -> Iterator[Client]:
    """A client of the coordinator; no connection file, or no answer from the coordinator, is one line."""
    try:
        client = _client(args)
    except (ValueError, OSError) as e:      # no connection file given, none there, or not readable
        raise SystemExit(f"tangram-hpc {command}: {e}") from None
    with client:
        try:
            yield client
        except TimeoutError as e:           # the file names a coordinator that does not answer
            raise SystemExit(f"tangram-hpc {command}: {e} (is the connection file stale?)") from None


def _cores(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        cores = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cores must be N or MIN-MAX, got {text!r}") from None
    if not 0 <= cores[0] <= cores[1]:
        raise argparse.ArgumentTypeError(f"cores must be N or MIN-MAX with MIN <= MAX, got {text!r}")
    return cores


def _json_list(text: str) -> list:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text[:80]!r}") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"must be a JSON list, e.g. '[1, 2]', got {text[:80]!r}")
    return value


def add_submit_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("Exit status: 0 for an ok result; a failed command's own exit code (128+N when signal N "
                "killed it, e.g. 137 on a timeout); 1 for another result; 124 when none came within --wait.")
    _connection_args(p)
    p.add_argument("command", nargs="?", help="shell command for a sandbox action")
    p.add_argument("--kind", default="sandbox", help="sandbox (default), function or reward")
    p.add_argument("--fn", help="function target 'module:function' (kind function)")
    p.add_argument("--args", type=_json_list, default=[], help="JSON list of arguments (function) or inputs (reward)")
    p.add_argument("--service", help="reward-model service (kind reward)")
    p.add_argument("--env", help="stateful environment id to run in")
    p.add_argument("--cores", type=_cores, default=(1, 1), help="N or MIN-MAX cores (default 1)")
    p.add_argument("--mem-mb", type=int, default=0)
    p.add_argument("--gpu-mem-mb", type=int, default=0)
    p.add_argument("--timeout", type=float, help="seconds before the action is killed")
    p.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the result (default 600)")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")


def build_spec(args: argparse.Namespace) -> ActionSpec:
    lo, hi = args.cores
    extra = args.args
    if args.kind == "sandbox":
        if not args.command:
            raise SystemExit("tangram-hpc submit: give the command to run, e.g. tangram-hpc submit 'echo hi'")
        payload = {"cmd": args.command}
    elif args.kind == "function":
        if not args.fn:
            raise SystemExit("tangram-hpc submit --kind function needs --fn module:function")
        payload = {"fn": args.fn, "args": extra}
    elif args.kind == "reward":
        if not args.service:
            raise SystemExit("tangram-hpc submit --kind reward needs --service NAME")
        payload = {"inputs": extra}
        lo = hi = 0
    else:
        payload = {"cmd": args.command, "args": extra}
    try:
        return ActionSpec(kind=args.kind, payload=payload, env=args.env, timeout=args.timeout,
                          demand=Demand(lo, hi, args.mem_mb, args.gpu_mem_mb, args.service))
    except ValidationError as e:
        raise SystemExit(f"tangram-hpc submit: {e}") from None


def submit_main(args: argparse.Namespace) -> int:
    spec = build_spec(args)
    with _connected(args, "submit") as c:
        try:
            res = c.submit(spec).result(timeout=args.wait)
        except TimeoutError:
            why = _why_waiting(c)   # asked before the cancel: the action still counts among those waiting
            c.cancel(spec.id)       # nobody waits for it any more
            print(f"tangram-hpc submit: no result within {args.wait:g} s (--wait); action {spec.id} cancelled. "
                  f"{why}", file=sys.stderr)
            return 124
    if args.json:
        print(json.dumps({f: getattr(res, f) for f in res.__dataclass_fields__} | {"act": res.act},
                         default=str, indent=2))
    else:
        out = res.output
        if isinstance(out, dict) and "stdout" in out:
            sys.stdout.write(out.get("stdout") or "")
            sys.stderr.write(out.get("stderr") or "")
        elif out is not None:
            print(out)
        where = f"worker {res.worker}, {res.cores} cores, " if res.worker else ""
        print(f"[{res.status}] {where}attempt {res.attempts}, "
              f"ACT {res.act * 1000:.1f} ms" + (f": {res.error}" if res.error else ""), file=sys.stderr)
    if res.ok:
        return 0
    rc = res.output.get("returncode") if isinstance(res.output, dict) else None
    if not isinstance(rc, int) or rc == 0:
        return 1
    return 128 - rc if rc < 0 else rc       # killed by signal N (a timeout: SIGKILL): 128 + N, as a shell says


def _why_waiting(c: Client) -> str:
    """What the coordinator says about its workers, for a user whose action got no result."""
    try:
        st = c.status(timeout=5)
    except TimeoutError:
        return "The coordinator does not answer either."
    parts = [f"The coordinator has {len(st['workers'])} workers ({st['starting_workers']} starting) and "
             f"{st['pending']} actions waiting"]
    launch = st.get("launch")
    if launch and launch["state"] != "ok":
        parts.append(_format_launch(launch))
    if st.get("recent_launch_failures"):
        parts.append(f"last failed worker start: {st['recent_launch_failures'][-1]}")
    if st.get("pool") and st["pool"] != "ok":
        parts.append(f"pool: {st['pool']}")
    return "; ".join(parts) + ". 'tangram-hpc status --allocations' shows its worker jobs."


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    _connection_args(p)
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.add_argument("--allocations", action="store_true",
                   help="also list every worker job launched: job id, state, reason, submitted/started/joined/ended")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until interrupted")


def _left(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _format_launch(launch: dict) -> str:
    text = f"launches {launch['state']}" + (f": {launch['reason']}" if launch.get("reason") else "")
    if launch.get("retry_at"):
        text += f"; retry at {launch['retry_at'].replace('T', ' ')} (in {launch['retry_in_s']:.0f} s)"
    if launch["state"] in ("stopped", "backing-off", "trial"):
        text += "; 'tangram-hpc pool resume' retries now"
    return text


def format_status(st: dict) -> str:
    lines = [f"coordinator {st['coordinator']}  up {st['uptime_s']:.0f}s  pending {st['pending']}  "
             f"running {st['running']}  completed {st['completed']}  failed {st['failed']}  "
             f"retried {st['retried']}  rejected {st['rejected']}  bad frames {st['bad_frames']}"]
    faults = [f"{k.replace('_', ' ')} {st[k]}" for k in ("workers_lost", "stale_results", "replayed", "launch_failures")
              if st.get(k)]
    if faults:
        lines.append("; ".join(faults))
    envs = st.get("environments")
    if envs:
        lines.append("environments: " + ", ".join(f"{n} {state}" for state, n in sorted(envs.items()))
                     + (f"; {st['envs_closed']} closed" if st.get("envs_closed") else "")
                     + (f"; {st['env_moves']} moved by the scheduler" if st.get("env_moves") else "")
                     + (f" (a move takes ~{st['env_move_s']:.2f} s, its restore ~{st['env_restore_s']:.2f} s)"
                        if st.get("env_moves") and st.get("env_move_s") is not None
                        and st.get("env_restore_s") is not None else ""))
    if st.get("zombie_cores"):
        lines.append(f"zombie cores: {st['zombie_cores']} (held by timed-out or cancelled actions their workers "
                     "have not yet reported ended)")
    if st.get("launch"):
        lines.append(_format_launch(st["launch"]))
    if st.get("pool"):
        lines.append(f"pool: {st['pool']}")
    if st.get("starting_workers"):
        lines.append(f"workers starting: {st['starting_workers']}")
    lines.append(f"{'worker':<34} {'host':<14} {'cores':>9} {'run':>5} {'gpus':>4} {'envs':>4} {'job':>8} "
                 f"{'time left':>9}  state")
    for w in st["workers"]:
        lines.append(f"{w['id'][:34]:<34} {w['host'][:14]:<14} {w['busy_cores']:>4}/{w['cores']:<4} "
                     f"{w['running']:>5} {w['gpus']:>4} {w['envs']:>4} {w.get('job_id') or '-':>8} "
                     f"{_left(w.get('time_left_s')):>9}  {w['state']}"
                     + (f", {w['zombie_cores']} zombie cores" if w.get("zombie_cores") else "")
                     + (f"  services: {','.join(w['services'])}" if w["services"] else ""))
    if not st["workers"]:
        lines.append("(no workers registered)")
    if "allocations" in st:
        lines.append("")
        lines.append(format_allocations(st["allocations"]))
    return "\n".join(lines)


def format_allocations(allocs: list[dict]) -> str:
    """The worker jobs the coordinator launched, oldest first (like ``hq alloc info``)."""
    counts: dict[str, int] = {}
    for a in allocs:
        counts[a["state"]] = counts.get(a["state"], 0) + 1
    head = f"allocations: {len(allocs)}" + (f" ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))})"
                                           if allocs else "")

    def hms(t: str | None) -> str:
        return t[11:] if t else "-"
    rows = [[a["handle"], a["job_id"] or "-", f"{a['cores']}c" + (f"+{a['gpus']}g" if a["gpus"] else ""),
             a["partition"] or "-", a["state"], a["worker"] or "-", hms(a["submitted"]), hms(a["started"]),
             hms(a["joined"]), hms(a["ended"]), a["reason"]] for a in allocs]
    headers = ["handle", "job", "shape", "partition", "state", "worker", "submitted", "started", "joined", "ended",
               "reason"]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers[:-1])]
    out = [head, "  ".join(h.ljust(w) for h, w in zip(headers, widths)) + "  reason"]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    return "\n".join(out)


def status_json(st: dict) -> str:
    """``st`` as JSON, a key a line and a worker a line: ``json.dumps(indent=2)`` runs the pure-Python
    encoder, 75 ms for 2,000 workers; each line here is one call of the C one."""
    lines = []
    for key, value in st.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            text = "[\n" + ",\n".join("    " + json.dumps(v) for v in value) + "\n  ]"
        else:
            text = json.dumps(value)
        lines.append(f"  {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(lines) + "\n}"


def status_main(args: argparse.Namespace) -> int:
    with _connected(args, "status") as c:
        while True:
            st = c.status(allocations=args.allocations)
            print(status_json(st) if args.json else format_status(st), flush=True)
            if not args.watch:
                return 0
            time.sleep(args.watch)


def add_pool_arguments(p: argparse.ArgumentParser) -> None:
    _connection_args(p)
    p.add_argument("op", choices=("pause", "resume"),
                   help="pause: launch no more workers; resume: launch again at once, forgetting the failed starts "
                        "that stopped or slowed launches")


def pool_main(args: argparse.Namespace) -> int:
    with _connected(args, "pool") as c:
        st = c.pool(args.op)
    if st.get("pool_error"):
        print(f"tangram-hpc pool {args.op}: {st['pool_error']}", file=sys.stderr)
        return 1
    print(f"{st['pool_op']}; now: {_format_launch(st['launch'])}")
    return 0
