"""The Python API a training job uses: submit actions, get futures, gather results.

A :class:`Client` owns one DEALER socket driven by a background I/O thread.
``submit`` only appends to a queue (and wakes the thread when it may be
asleep), so callers on any thread pay microseconds; the I/O thread sends
queued submissions in batches and resolves futures as results arrive.

Robustness:

* every unfinished action is remembered until its result arrives; when the
  coordinator restarts (heartbeat replies carry its incarnation id) the
  client resubmits them all, re-reading the connection file in case the
  address changed;
* results are de-duplicated by action id: a future resolves once.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Iterable

import zmq

from . import protocol as P
from .actions import ActionResult, ActionSpec
from .connection import ConnectionInfo, default_connection_file
from .errors import CoordinatorError

log = logging.getLogger("tangram.client")

_SUBMIT_BATCH = 2000

ActionFuture = Future  # resolves to an ActionResult (whatever its status); never raises for a failed action


class Client:
    """Connect to a coordinator by connection file (or ``$TANGRAM_CONNECTION_FILE``) or by address."""

    def __init__(self, address: str | None = None, *, connection_file: str | None = None,
                 connection: ConnectionInfo | None = None, name: str | None = None,
                 heartbeat_s: float = 1.0, reconnect_after_s: float = 3.0):
        if connection is None and address is None:
            connection_file = connection_file or default_connection_file()
            if not connection_file:
                raise ValueError("give a coordinator address, a connection file, or set $TANGRAM_CONNECTION_FILE")
            connection = ConnectionInfo.read(connection_file)
        self._connection_file = connection_file
        self._conn = connection
        self._address = address or connection.client_address
        self.name = name or f"client-{os.getpid()}"
        self._ident = f"{self.name}-{os.urandom(4).hex()}".encode()
        self._heartbeat_s = heartbeat_s
        self._reconnect_after_s = reconnect_after_s
        self._pending: dict[str, tuple[Future, dict]] = {}
        self._outq: deque = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._wake_sent = False
        self._closed = False
        self._coordinator: str | None = None
        self._max_frame = P.MAX_FRAME_BYTES  # updated from the coordinator's WELCOME
        self._status_waiters: deque[Future] = deque()
        self.errors: deque[str] = deque(maxlen=100)
        self.resubmissions = 0
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._io, name="tangram-client-io", daemon=True)
        self._ready = threading.Event()
        self._hello = threading.Event()
        self._thread.start()
        self._ready.wait()
        # Learn the coordinator's limits before the first submission when it is up; go on if it is not.
        self._hello.wait(timeout=2.0)

    @classmethod
    def from_connection_file(cls, path: str | None = None, **kw: Any) -> "Client":
        return cls(connection_file=path, **kw)

    # -- public API ----------------------------------------------------------
    def submit(self, spec: ActionSpec) -> ActionFuture:
        """Queue one action; the future resolves to its :class:`ActionResult`."""
        fut: Future = Future()
        wire = spec.to_wire()
        self._pending[spec.id] = (fut, wire)
        self._outq.append(wire)
        self._wake()
        return fut

    def submit_many(self, specs: Iterable[ActionSpec]) -> list[ActionFuture]:
        futs = []
        pending = self._pending
        outq = self._outq
        for spec in specs:
            fut: Future = Future()
            wire = spec.to_wire()
            pending[spec.id] = (fut, wire)
            outq.append(wire)
            futs.append(fut)
        self._wake()
        return futs

    def map(self, specs: Iterable[ActionSpec], timeout: float | None = None) -> list[ActionResult]:
        """Submit all, wait for all, return the results in order."""
        return self.gather(self.submit_many(specs), timeout=timeout)

    @staticmethod
    def gather(futures: Iterable[ActionFuture], timeout: float | None = None) -> list[ActionResult]:
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for f in futures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            out.append(f.result(timeout=left))
        return out

    def cancel(self, action_ids: str | Iterable[str]) -> None:
        """Ask the coordinator to cancel; the futures still resolve (status ``cancelled`` or final)."""
        ids = [action_ids] if isinstance(action_ids, str) else list(action_ids)
        self._outq.append((P.CANCEL, ids))
        self._wake()

    def status(self, timeout: float = 10.0) -> dict:
        """The coordinator's view: workers, queue, counters."""
        fut: Future = Future()
        self._status_waiters.append(fut)
        self._outq.append((P.STATUS, {}))
        self._wake()
        try:
            return fut.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"no status from the coordinator at {self._address} within {timeout:g}s") from None

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake()
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- I/O thread ------------------------------------------------------------
    def _wake(self) -> None:
        if not self._wake_sent:
            self._wake_sent = True
            try:
                os.write(self._wake_w, b"\0")
            except (BlockingIOError, OSError):
                pass

    def _connect(self) -> zmq.Socket:
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, self._ident)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)   # never drop a submission on our side: the coordinator applies limits
        s.setsockopt(zmq.RCVHWM, 0)
        if self._conn is not None and self._conn.secure:
            from .security import CurveKeys
            CurveKeys.apply_client(s, self._conn)
        s.connect(self._address)
        return s

    def _io(self) -> None:
        sock = self._connect()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        sock.send(P.encode(P.HELLO, {"name": self.name}))
        self._ready.set()
        last_heard = time.monotonic()
        next_hb = 0.0
        while not self._closed:
            now = time.monotonic()
            if now >= next_hb:
                sock.send(P.encode(P.HEARTBEAT, {}))
                next_hb = now + self._heartbeat_s
                if now - last_heard > self._reconnect_after_s and self._reread_connection():
                    poller.unregister(sock)
                    sock.close(0)
                    sock = self._connect()
                    sock.send(P.encode(P.HELLO, {"name": self.name}))
                    poller.register(sock, zmq.POLLIN)
                    last_heard = now
            events = dict(poller.poll(int(max(0.0, next_hb - now) * 1000) + 1))
            if self._wake_r in events:
                self._wake_sent = False
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if self._outq:
                self._send_queued(sock)
            if sock in events:
                last_heard = time.monotonic()
                self._receive(sock)
        sock.close(0)

    def _send_queued(self, sock: zmq.Socket) -> None:
        outq = self._outq
        batch: list = []
        while outq:
            item = outq.popleft()
            if isinstance(item, dict):
                batch.append(item)
                if len(batch) >= _SUBMIT_BATCH:
                    self._send_submit(sock, batch)
                    batch = []
            else:
                if batch:
                    self._send_submit(sock, batch)
                    batch = []
                sock.send(P.encode(*item))
        if batch:
            self._send_submit(sock, batch)

    def _send_submit(self, sock: zmq.Socket, batch: list) -> None:
        frame = P.encode(P.SUBMIT, batch)
        if len(frame) <= self._max_frame:
            sock.send(frame)
        elif len(batch) > 1:  # split to fit the coordinator's frame limit
            half = len(batch) // 2
            self._send_submit(sock, batch[:half])
            self._send_submit(sock, batch[half:])
        else:
            aid = batch[0]["i"]
            entry = self._pending.pop(aid, None)
            if entry is not None:
                now = time.time()
                entry[0].set_result(ActionResult(aid, "error", error=(
                    f"rejected: the action is {len(frame)} bytes on the wire, over the coordinator's frame "
                    f"limit of {self._max_frame}; pass large data through files"), submitted=now, finished=now))

    def _receive(self, sock: zmq.Socket) -> None:
        pending = self._pending
        for _ in range(10_000):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                mtype, body = P.decode(frame, _FROM_COORDINATOR)
            except P.ProtocolError as e:
                self.errors.append(str(e))
                continue
            if mtype == P.RESULT:
                for w in body:
                    entry = pending.pop(w[0], None) if isinstance(w, list) and w else None
                    if entry is None:
                        continue  # a duplicate (resubmission raced the first result)
                    try:
                        entry[0].set_result(ActionResult.from_wire(w))
                    except Exception as e:
                        entry[0].set_exception(CoordinatorError(f"bad result from coordinator: {e}"))
            elif mtype == P.HEARTBEAT or mtype == P.WELCOME:
                limit = body.get("limits", {}).get("max_frame_bytes") if mtype == P.WELCOME else None
                if isinstance(limit, int) and limit > 0:
                    self._max_frame = limit
                    self._hello.set()
                cid = body.get("coordinator")
                if self._coordinator is not None and cid != self._coordinator:
                    self._resubmit(sock, cid)
                self._coordinator = cid
            elif mtype == P.STATUS:
                if self._status_waiters:
                    self._status_waiters.popleft().set_result(body)
            elif mtype == P.ERROR:
                msg = f"{body.get('code')}: {body.get('message')}"
                self.errors.append(msg)
                log.warning("coordinator error: %s", msg)

    def _resubmit(self, sock: zmq.Socket, cid: str) -> None:
        wires = [w for _, w in list(self._pending.values())]
        log.warning("coordinator restarted (%s -> %s): resubmitting %d unfinished actions",
                    self._coordinator, cid, len(wires))
        self.resubmissions += len(wires)
        for i in range(0, len(wires), _SUBMIT_BATCH):
            sock.send(P.encode(P.SUBMIT, wires[i:i + _SUBMIT_BATCH]))

    def _reread_connection(self) -> bool:
        """After a silence, follow a coordinator that came back on another address."""
        if not self._connection_file:
            return False
        try:
            info = ConnectionInfo.read(self._connection_file)
        except (OSError, ValueError):
            return False
        if info.client_address == self._address and info.server_public_key == getattr(self._conn, "server_public_key", ""):
            return False
        self._conn = info
        self._address = info.client_address
        return True


_FROM_COORDINATOR = frozenset({P.RESULT, P.HEARTBEAT, P.WELCOME, P.STATUS, P.ERROR})


class AsyncClient:
    """asyncio flavour of :class:`Client`: ``await client.submit(spec)`` returns the result."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._client = Client(*args, **kwargs)

    @classmethod
    def from_connection_file(cls, path: str | None = None, **kw: Any) -> "AsyncClient":
        return cls(connection_file=path, **kw)

    def submit_nowait(self, spec: ActionSpec) -> "asyncio.Future[ActionResult]":
        return asyncio.wrap_future(self._client.submit(spec))

    async def submit(self, spec: ActionSpec) -> ActionResult:
        return await self.submit_nowait(spec)

    async def map(self, specs: Iterable[ActionSpec]) -> list[ActionResult]:
        futs = self._client.submit_many(specs)
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futs)))

    async def status(self, timeout: float = 10.0) -> dict:
        return await asyncio.get_running_loop().run_in_executor(None, self._client.status, timeout)

    def cancel(self, action_ids: str | Iterable[str]) -> None:
        self._client.cancel(action_ids)

    async def close(self) -> None:
        self._client.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
