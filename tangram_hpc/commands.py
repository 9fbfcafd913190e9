"""Small client commands: ``tangram-hpc submit`` and ``tangram-hpc status``."""
from __future__ import annotations

import argparse
import json
import sys
import time

from .actions import ActionSpec, Demand
from .client import Client


def _connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connection-file", "-c", help="coordinator connection file (default $TANGRAM_CONNECTION_FILE)")
    p.add_argument("--address", help="coordinator client address instead of a connection file (insecure only)")


def _client(args: argparse.Namespace) -> Client:
    if args.address:
        return Client(args.address)
    return Client(connection_file=args.connection_file)


def _cores(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cores must be N or MIN-MAX, got {text!r}") from None


def add_submit_arguments(p: argparse.ArgumentParser) -> None:
    _connection_args(p)
    p.add_argument("command", nargs="?", help="shell command for a sandbox action")
    p.add_argument("--kind", default="sandbox", help="sandbox (default), function or reward")
    p.add_argument("--fn", help="function target 'module:function' (kind function)")
    p.add_argument("--args", default="[]", help="JSON list of arguments (function) or inputs (reward)")
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
    extra = json.loads(args.args)
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
    return ActionSpec(kind=args.kind, payload=payload, env=args.env, timeout=args.timeout,
                      demand=Demand(lo, hi, args.mem_mb, args.gpu_mem_mb, args.service))


def submit_main(args: argparse.Namespace) -> int:
    spec = build_spec(args)
    with _client(args) as c:
        res = c.submit(spec).result(timeout=args.wait)
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
        print(f"[{res.status}] worker {res.worker}, {res.cores} cores, attempt {res.attempts}, "
              f"ACT {res.act * 1000:.1f} ms" + (f": {res.error}" if res.error else ""), file=sys.stderr)
    if res.ok:
        return 0
    return res.output.get("returncode", 1) if isinstance(res.output, dict) and res.output.get("returncode") else 1


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    _connection_args(p)
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until interrupted")


def format_status(st: dict) -> str:
    lines = [f"coordinator {st['coordinator']}  up {st['uptime_s']:.0f}s  pending {st['pending']}  "
             f"running {st['running']}  completed {st['completed']}  failed {st['failed']}  "
             f"retried {st['retried']}  rejected {st['rejected']}  bad frames {st['bad_frames']}"]
    if st.get("zombie_cores"):
        lines.append(f"zombie cores: {st['zombie_cores']} (held by timed-out or cancelled actions their workers "
                     "have not yet reported ended)")
    if st.get("pool"):
        lines.append(f"pool: {st['pool']}")
    if st.get("starting_workers"):
        lines.append(f"workers starting: {st['starting_workers']}")
    lines.append(f"{'worker':<34} {'host':<14} {'cores':>9} {'run':>5} {'gpus':>4} {'envs':>4}  state")
    for w in st["workers"]:
        lines.append(f"{w['id'][:34]:<34} {w['host'][:14]:<14} {w['busy_cores']:>4}/{w['cores']:<4} "
                     f"{w['running']:>5} {w['gpus']:>4} {w['envs']:>4}  {w['state']}"
                     + (f", {w['zombie_cores']} zombie cores" if w.get("zombie_cores") else "")
                     + (f"  services: {','.join(w['services'])}" if w["services"] else ""))
    if not st["workers"]:
        lines.append("(no workers registered)")
    return "\n".join(lines)


def status_main(args: argparse.Namespace) -> int:
    with _client(args) as c:
        while True:
            st = c.status()
            print(json.dumps(st, indent=2) if args.json else format_status(st), flush=True)
            if not args.watch:
                return 0
            time.sleep(args.watch)
