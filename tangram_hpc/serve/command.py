"""``tangram-hpc serve``: SandboxFusion's /run_code and OpenRLHF's remote reward over HTTP, in front of a coordinator."""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from ..connection import CONNECTION_FILE_ENV, default_connection_file
from ..security import is_loopback


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connection-file", "-c",
                   help=f"the coordinator's connection file (default ${CONNECTION_FILE_ENV})")
    p.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on (default 127.0.0.1; another one needs --allow-remote)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080, SandboxFusion's; 0: any free one)")
    p.add_argument("--allow-remote", action="store_true",
                   help="listen on a non-loopback interface: anyone who reaches the port can run code in "
                        "the sandboxes (as with SandboxFusion, there is no authentication)")
    p.add_argument("--max-inflight", type=int, default=1024,
                   help="requests in flight before new ones get HTTP 429 with Retry-After (default 1024)")
    p.add_argument("--retry-after", type=int, default=1, metavar="SECONDS",
                   help="Retry-After of HTTP 429/503 replies (default 1)")
    p.add_argument("--max-body-mb", type=int, default=16, help="largest request body in MiB (default 16)")
    p.add_argument("--reward-max-batch", type=int, default=64,
                   help="/reward: most inputs batched into one reward action (default 64)")
    p.add_argument("--reward-window-ms", type=float, default=5.0,
                   help="/reward: how long a request waits for others to batch with (default 5 ms)")
    p.add_argument("--reward-wait", type=float, default=170.0, metavar="SECONDS",
                   help="/reward: how long a request waits for its scores, queueing included, before HTTP 502 "
                        "(default 170, under OpenRLHF's 180 s client timeout)")
    p.add_argument("--drain", type=float, default=60.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long requests in flight may take to finish (default 60)")


def main(args: argparse.Namespace) -> int:
    try:
        from .app import ServeConfig
    except ImportError as e:
        print(f"tangram-hpc serve needs aiohttp: pip install 'tangram-hpc[serve]' ({e})", file=sys.stderr)
        return 2

    path = args.connection_file or default_connection_file()
    if not path:
        print(f"tangram-hpc serve: give --connection-file or set ${CONNECTION_FILE_ENV}", file=sys.stderr)
        return 2
    if not is_loopback(args.host) and not args.allow_remote:
        print(f"tangram-hpc serve: {args.host} is not a loopback address; anyone who reaches it could run "
              f"code on the cluster. Add --allow-remote if that is intended.", file=sys.stderr)
        return 2
    if args.max_inflight < 1:
        print("tangram-hpc serve: --max-inflight must be at least 1", file=sys.stderr)
        return 2
    config = ServeConfig(host=args.host, port=args.port, max_inflight=args.max_inflight,
                         retry_after_s=args.retry_after, max_body_mb=args.max_body_mb, drain_s=args.drain,
                         reward_max_batch=args.reward_max_batch, reward_window_ms=args.reward_window_ms,
                         reward_wait_s=args.reward_wait)
    asyncio.run(_run(config, str(path)))
    return 0


async def _run(config, path: str) -> None:
    from ..client import AsyncClient
    from .app import make_app, serve_forever

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def ready(addresses) -> None:
        for host, port, *_ in addresses:
            print(f"serving SandboxFusion /run_code at http://{_url_host(host)}:{port} "
                  f"(coordinator: {path})", flush=True)

    async with AsyncClient(connection_file=path, name="serve") as client:
        await serve_forever(make_app(client, config), config, stop, on_ready=ready)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
