"""The aiohttp application of ``tangram-hpc serve``.

One process, one event loop, one :class:`~tangram_hpc.client.AsyncClient`:
each ``/run_code`` request becomes one sandbox action and waits for its
result, so hundreds of requests are in flight at once without a thread per
request.  The scheduler, the sandbox limits and the Slurm pool apply to them
as to any action.

Every route but ``/v1/ping`` needs the service's token (``Authorization:
Bearer TOKEN``, or HTTP basic auth with the token as password, which is what
a client sends for ``http://tangram:TOKEN@host:port``) unless it was started
with ``--no-auth``; a request whose headers or body do not arrive within
their timeouts is cut off, so idle half-sent connections cannot hold the
service.

Routes:

``POST /run_code``
    SandboxFusion's run_code (see :mod:`tangram_hpc.serve.translate`).
``POST /reward/{service}``
    OpenRLHF's remote reward model (``--remote_rm_url``): ``{"query", "prompts",
    "labels"}`` lists in, ``{"rewards", "scores", "extra_logs"}`` out, scored by
    the tangram reward service named in the path; concurrent requests are
    batched into one ``reward`` action (:class:`~tangram_hpc.integrations.batching.RewardBatcher`).
``POST /run_jupyter``
    SandboxFusion's run_jupyter: the cells run in the environment's stateful Python kernel
    (:mod:`tangram_hpc.managers.pykernel`); ``tangram.env`` keeps the environment, and so the kernel
    where processes are kept, across requests.
``GET /v1/ping``
    ``"pong"``, as SandboxFusion answers its health check.
``GET /health``
    the coordinator's worker and queue counts; HTTP 503 when it does not answer.
``GET /stats``
    this service's request metrics (:class:`~tangram_hpc.serve.metrics.RequestMetrics`).
``GET /metrics``
    the same metrics for Prometheus (``tangram_serve_*``; HTTP 501 without the
    ``metrics`` extra).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..client import AsyncClient
from ..managers.sandboxfusion import RunCodeError
from ..metrics import render
from .metrics import RequestMetrics
from ..integrations.batching import RewardBatcher, RewardError
from .translate import (RUN_JUPYTER_EMPTY, FieldError, Reply, busy_reply, invalid_reply, openrlhf_items,
                        refused_for_load, run_code_reply, run_code_spec, run_jupyter_spec, unknown_service)

__all__ = ["ServeConfig", "make_app", "serve_forever"]

log = logging.getLogger("tangram.serve")

_RUN_CODE = "/run_code"
_RUN_JUPYTER = "/run_jupyter"
_REWARD = "/reward"


@dataclass
class ServeConfig:
    """Options of the HTTP service (the command line's flags)."""

    host: str = "127.0.0.1"
    port: int = 8080
    #: requests answered with HTTP 429 beyond this many in flight
    max_inflight: int = 1024
    #: the Retry-After of HTTP 429 and 503 replies
    retry_after_s: int = 1
    #: largest request body (SandboxFusion's files travel base64 inside it)
    max_body_mb: int = 16
    #: on SIGTERM, how long requests in flight may take to finish before the service exits
    drain_s: float = 60.0
    #: /reward: most inputs in one reward action, and how long the first one waits for more
    reward_max_batch: int = 64
    reward_window_ms: float = 5.0
    #: /reward: how long a request waits for its scores, queueing included (then HTTP 502)
    reward_wait_s: float = 170.0
    #: the token every request but /v1/ping must carry; None: no authentication (loopback only)
    token: str | None = None
    #: how long a connection may take to send a request's headers (and may stay idle between requests;
    #: above aiohttp's client keep-alive of 15 s, so a pooled connection is dropped by its client first)
    header_timeout_s: float = 20.0
    #: how long a request may take to send its body
    body_timeout_s: float = 60.0


class _Service:
    def __init__(self, client: AsyncClient, config: ServeConfig, metrics: RequestMetrics):
        self.client = client
        self.config = config
        self.metrics = metrics
        self.batchers: dict[str, RewardBatcher] = {}

    def _refuse(self, route: str, t0: float) -> web.Response | None:
        """HTTP 429 when this service already has ``max_inflight`` requests in flight."""
        m = self.metrics
        if m.in_flight < self.config.max_inflight:
            return None
        reply = busy_reply(429, f"{m.in_flight} requests in flight, the limit of this service "
                                f"(--max-inflight {self.config.max_inflight}); retry later",
                           self.config.retry_after_s)
        m.finished(route, reply.status, time.perf_counter() - t0, counted=False)
        return _response(reply)

    async def run_code(self, request: web.Request) -> web.Response:
        return await self._sandbox(request, _RUN_CODE, run_code_spec, {})

    async def run_jupyter(self, request: web.Request) -> web.Response:
        return await self._sandbox(request, _RUN_JUPYTER, run_jupyter_spec, {"empty": RUN_JUPYTER_EMPTY})

    async def _sandbox(self, request: web.Request, route: str, to_spec, reply_kw: dict) -> web.Response:
        """One SandboxFusion request: its body as one sandbox action, its result as the reply."""
        t0 = time.perf_counter()
        m = self.metrics
        refused = self._refuse(route, t0)
        if refused is not None:
            return refused
        m.started()
        reply = outcome = None
        try:
            body, reply = await self._json(request)
            if reply is not None:
                return _response(reply)
            try:
                spec = to_spec(body)
            except RunCodeError as e:
                reply = invalid_reply(e)
                return _response(reply)
            try:
                res = await self.client.submit(spec)
            except asyncio.CancelledError:
                # the caller hung up (handler cancellation): its action was cancelled with its future
                reply = Reply(499, {"detail": "client closed the request"})
                raise
            reply = run_code_reply(res, self.config.retry_after_s, **reply_kw)
            outcome = reply.body.get("status") if reply.status == 200 else None
            return _response(reply)
        finally:
            m.finished(route, reply.status if reply is not None else 500, time.perf_counter() - t0, outcome)

    async def reward(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        refused = self._refuse(_REWARD, t0)
        if refused is not None:
            return refused
        self.metrics.started()
        reply = None
        try:
            body, reply = await self._json(request)
            if reply is not None:
                return _response(reply)
            try:
                items = openrlhf_items(body)
            except FieldError as e:
                reply = invalid_reply(e)
                return _response(reply)
            service = request.match_info["service"]
            batcher = self.batchers.get(service)
            if batcher is None:
                batcher = self.batchers[service] = RewardBatcher(
                    self.client.submit_nowait, self.client.cancel, service, max_batch=self.config.reward_max_batch,
                    window_s=self.config.reward_window_ms / 1000.0, wait_s=self.config.reward_wait_s)
            try:
                scores = await asyncio.gather(*(batcher.score(item) for item in items))
            except RewardError as e:
                if refused_for_load(e.result):
                    reply = busy_reply(503, str(e), self.config.retry_after_s)
                elif unknown_service(e.result):
                    self.batchers.pop(service, None)  # a name the caller chose: keep no state for it
                    reply = Reply(404, {"detail": f"reward service {service!r}: {e}"})
                else:
                    reply = Reply(502, {"detail": f"reward service {service!r}: {e}"})
                return _response(reply)
            scores = [s["score"] if isinstance(s, dict) and "score" in s else s for s in scores]
            reply = Reply(200, {"rewards": scores, "scores": scores, "extra_logs": {}})
            return _response(reply)
        finally:
            self.metrics.finished(_REWARD, reply.status if reply is not None else 500, time.perf_counter() - t0)

    async def _json(self, request: web.Request) -> tuple[Any, Reply | None]:
        """The request's JSON body, or the reply that refuses it (422, 413, 408)."""
        try:
            raw = await asyncio.wait_for(request.read(), self.config.body_timeout_s)
        except web.HTTPRequestEntityTooLarge as e:
            return None, _too_large(e)
        except asyncio.TimeoutError:
            return None, Reply(408, {"detail": f"the request body did not arrive within "
                                               f"{self.config.body_timeout_s:g}s (--body-timeout)"})
        try:
            return json.loads(raw), None
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            return None, _json_invalid(e)

    async def ping(self, request: web.Request) -> web.Response:
        return web.json_response("pong")

    async def health(self, request: web.Request) -> web.Response:
        try:
            st = await self.client.status(timeout=2.0)
        except (TimeoutError, OSError) as e:
            return _response(Reply(503, {"ok": False, "detail": f"coordinator not answering: {e}"}))
        return web.json_response({"ok": True, "coordinator": st.get("coordinator"),
                                  "workers": len(st.get("workers", [])), "pending": st.get("pending"),
                                  "running": st.get("running"), "in_flight": self.metrics.in_flight})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.metrics.snapshot())

    async def prometheus(self, request: web.Request) -> web.Response:
        try:
            body, content_type = render(self.metrics.families())
        except ImportError as e:
            return _response(Reply(501, {"detail": str(e)}))
        return web.Response(body=body, headers={"Content-Type": content_type})


def _response(reply: Reply) -> web.Response:
    resp = web.Response(status=reply.status, headers=reply.headers, content_type="application/json",
                        text=json.dumps(reply.body))
    if reply.status == 408:
        resp.force_close()  # the rest of a body that stalled is not waited for
    return resp


def authorized(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``token`` (as a bearer token or a basic-auth password)."""
    if not header:
        return False
    scheme, _, value = header.strip().partition(" ")
    scheme, value = scheme.lower(), value.strip()
    if scheme == "basic":
        try:
            value = base64.b64decode(value, validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return False
    elif scheme != "bearer":
        return False
    # aiohttp decodes header bytes that are not UTF-8 as surrogates: they must compare, not raise
    return hmac.compare_digest(value.encode("utf-8", "surrogateescape"), token.encode())


def _auth_middleware(token: str):
    @web.middleware
    async def check(request: web.Request, handler):
        if request.path != "/v1/ping" and not authorized(request.headers.get("Authorization"), token):
            return _response(Reply(401, {"detail": "this service needs its token: the header 'Authorization: "
                                                   "Bearer TOKEN', or the URL http://tangram:TOKEN@host:port"},
                                   {"WWW-Authenticate": 'Bearer realm="tangram-hpc serve"'}))
        return await handler(request)
    return check


def make_app(client: AsyncClient, config: ServeConfig | None = None,
             metrics: RequestMetrics | None = None) -> web.Application:
    """The application; ``client`` must stay open while it serves."""
    config = config or ServeConfig()
    svc = _Service(client, config, metrics or RequestMetrics())
    middlewares = [_auth_middleware(config.token)] if config.token is not None else []
    app = web.Application(client_max_size=config.max_body_mb << 20, middlewares=middlewares)
    app["metrics"] = svc.metrics
    app.add_routes([
        web.post(_RUN_CODE, svc.run_code),
        web.post(_REWARD + "/{service}", svc.reward),
        web.post(_RUN_JUPYTER, svc.run_jupyter),
        web.get("/v1/ping", svc.ping),
        web.get("/health", svc.health),
        web.get("/stats", svc.stats),
        web.get("/metrics", svc.prometheus),
    ])
    return app


def _json_invalid(e: Exception) -> Reply:
    what = "nested too deeply" if isinstance(e, RecursionError) else str(e)
    return Reply(422, {"detail": [{"type": "json_invalid", "loc": ["body"], "msg": f"JSON decode error: {what}",
                                   "input": None}]})


def _too_large(e: web.HTTPRequestEntityTooLarge) -> Reply:
    return Reply(413, {"detail": f"{e.text} (--max-body-mb)"})


async def serve_forever(app: web.Application, config: ServeConfig, stop: asyncio.Event,
                        on_ready: Any = None) -> None:
    """Serve until ``stop`` is set, then let requests in flight finish (up to ``drain_s``)."""
    # No access log: a line per request would be a log line per action.
    # handler_cancellation: a caller that hangs up cancels its handler, and so its action
    # keepalive_timeout: aiohttp closes a connection that has not sent a whole request's headers
    # within it (from its start, or from the end of its last request).
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                           keepalive_timeout=config.header_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, shutdown_timeout=config.drain_s)
    await site.start()
    try:
        if on_ready is not None:
            on_ready(runner.addresses)
        await stop.wait()
        metrics: RequestMetrics = app["metrics"]
        if metrics.in_flight:
            log.info("stopping: waiting up to %gs for %d requests in flight", config.drain_s, metrics.in_flight)
    finally:
        await runner.cleanup()
