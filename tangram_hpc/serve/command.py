"""``tangram-hpc serve``: SandboxFusion's /run_code and OpenRLHF's remote reward over HTTP, in front of a coordinator."""
from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
from pathlib import Path

from ..connection import CONNECTION_FILE_ENV, default_connection_file
from ..security import is_loopback

#: The variable holding serve's token itself, and the one naming a file that holds it.
TOKEN_ENV = "TANGRAM_SERVE_TOKEN"
TOKEN_FILE_ENV = "TANGRAM_SERVE_TOKEN_FILE"
#: The token file's name beside the connection file, when neither --token-file nor a variable says.
DEFAULT_TOKEN_FILE = "serve.token"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connection-file", "-c",
                   help=f"the coordinator's connection file (default ${CONNECTION_FILE_ENV})")
    p.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on (default 127.0.0.1; another one needs --allow-remote)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080, SandboxFusion's; 0: any free one)")
    p.add_argument("--allow-remote", action="store_true",
                   help="listen on a non-loopback interface (anyone who reaches the port and holds the token "
                        "can run code in the sandboxes)")
    p.add_argument("--token-file", metavar="FILE",
                   help=f"the file holding the token every request must carry (default ${TOKEN_FILE_ENV}, else "
                        f"${TOKEN_ENV} holds the token itself, else {DEFAULT_TOKEN_FILE} beside the connection "
                        f"file, created with a random token if missing)")
    p.add_argument("--no-auth", action="store_true",
                   help="no token: anyone who can reach the port runs code as you. Only on a loopback address, "
                        "for a single-user machine")
    p.add_argument("--header-timeout", type=float, default=20.0, metavar="SECONDS",
                   help="close a connection that has not sent a request's headers within this long, from its "
                        "start or its last request (default 20)")
    p.add_argument("--body-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="answer HTTP 408 and close a connection whose request body has not arrived within "
                        "this long (default 60)")
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
    if not (args.header_timeout > 0 and args.body_timeout > 0):
        print("tangram-hpc serve: --header-timeout and --body-timeout must be positive", file=sys.stderr)
        return 2
    token, where = None, "none (--no-auth)"
    if args.no_auth:
        if not is_loopback(args.host):
            print("tangram-hpc serve: --no-auth is for a loopback address only; on any other, requests must "
                  "carry the token", file=sys.stderr)
            return 2
    else:
        try:
            token, where = read_token(args.token_file, Path(path).parent)
        except (OSError, ValueError) as e:
            print(f"tangram-hpc serve: {e}", file=sys.stderr)
            return 2
    config = ServeConfig(host=args.host, port=args.port, max_inflight=args.max_inflight,
                         retry_after_s=args.retry_after, max_body_mb=args.max_body_mb, drain_s=args.drain,
                         reward_max_batch=args.reward_max_batch, reward_window_ms=args.reward_window_ms,
                         reward_wait_s=args.reward_wait, token=token, header_timeout_s=args.header_timeout,
                         body_timeout_s=args.body_timeout)
    asyncio.run(_run(config, str(path), where))
    return 0


def read_token(token_file: str | None, default_dir: Path) -> tuple[str, str]:
    """The token and where it came from: ``token_file``, ``$TANGRAM_SERVE_TOKEN_FILE``,
    ``$TANGRAM_SERVE_TOKEN``, or ``serve.token`` in ``default_dir`` (made, mode 0600, if missing)."""
    token_file = token_file or os.environ.get(TOKEN_FILE_ENV)
    if not token_file and os.environ.get(TOKEN_ENV):
        token, where = os.environ[TOKEN_ENV].strip(), f"${TOKEN_ENV}"
    else:
        path = Path(token_file) if token_file else default_dir / DEFAULT_TOKEN_FILE
        if not token_file and not path.exists():
            # written whole, then linked in place: a serve started beside this one reads the
            # same token, never an empty file
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        token, where = path.read_text().strip(), str(path)
    if len(token) < 16 or not token.isprintable() or ":" in token or any(c.isspace() for c in token):
        raise ValueError(f"the token in {where} must be at least 16 printable characters, without spaces or ':'")
    return token, where


async def _run(config, path: str, token_from: str) -> None:
    from ..client import AsyncClient
    from .app import make_app, serve_forever

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def ready(addresses) -> None:
        for host, port, *_ in addresses:
            print(f"serving SandboxFusion /run_code at http://{_url_host(host)}:{port} "
                  f"(coordinator: {path}; token: {token_from})", flush=True)

    async with AsyncClient(connection_file=path, name="serve") as client:
        await serve_forever(make_app(client, config), config, stop, on_ready=ready)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
