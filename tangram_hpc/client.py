"""The Python API a training job uses: submit actions, get futures, gather results.

A :class:`Client` owns one DEALER socket; whichever thread *owns* it does the
socket I/O (ZMQ sockets are not thread-safe, so exactly one thread at a time):

* a thread waiting in ``future.result()`` takes the socket and polls it
  itself, so a sequential submit/result loop costs no thread hand-off at all;
  other waiting threads follow, each woken exactly when its own future
  resolves or when the socket is handed on to it;
* ``submit`` sends at once from the caller's thread when nobody owns the
  socket, else queues and wakes the owner;
* a background I/O thread owns the socket when nobody waits (results for
  futures watched through callbacks, ``as_completed`` or asyncio), sends
  heartbeats and follows a restarted coordinator.  After a waiting thread
  returns it stays away a couple of milliseconds, so the next call of a
  sequential loop finds the socket free.

:class:`AsyncClient` drives its own socket from the asyncio loop, with no
thread at all.  Both speak the protocol through one
:class:`~tangram_hpc.client_session.ClientSession`:

* every unfinished action is remembered until its result arrives; when the
  coordinator restarts (heartbeat replies carry its incarnation id) the
  client resubmits them all, re-reading the connection file in case the
  address changed;
* results are de-duplicated by action id: a future resolves once.

``client.env("traj-17")`` is a handle on a stateful sandbox environment: its
``run``/``submit`` name the environment, and leaving its ``with`` block ends it
(``close_env``), which frees its disk and its pin to a worker at once.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import Any, Iterable

import zmq

from . import protocol as P
from .actions import ActionResult, ActionSpec, run_cells, sandbox
from .client_session import ClientSession, CoordinatorError
from .connection import ConnectionInfo, default_connection_file, reread_connection

__all__ = ["Client", "AsyncClient", "ActionFuture", "CoordinatorError", "EnvHandle", "AsyncEnvHandle"]

log = logging.getLogger("tangram.client")

#: After a waiting thread hands the socket back, the I/O thread leaves it alone this long,
#: so a sequential submit/result loop keeps doing its own I/O without hand-offs.
_LINGER_S = 0.002
#: How long a new client waits for the coordinator's WELCOME (its frame limit) before going on.
_HELLO_WAIT_S = 2.0
_CLOSE_WAIT_S = 5.0


def _resolve(address: str | None, connection_file: str | None,
             connection: ConnectionInfo | None) -> tuple[str, str | None, ConnectionInfo | None]:
    if connection is None and address is None:
        connection_file = connection_file or default_connection_file()
        if not connection_file:
            raise ValueError("give a coordinator address, a connection file, or set $TANGRAM_CONNECTION_FILE")
        connection = ConnectionInfo.read(connection_file)
    return address or connection.client_address, connection_file, connection


def _dealer(ctx: zmq.Context, ident: bytes, address: str, conn: ConnectionInfo | None) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, ident)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)   # never drop a submission on our side: the coordinator applies limits
    s.setsockopt(zmq.RCVHWM, 0)
    if conn is not None and conn.secure:
        from .security import CurveKeys
        CurveKeys.apply_client(s, conn)
    s.connect(address)
    return s


class ActionFuture(Future):
    """A :class:`concurrent.futures.Future` of an :class:`ActionResult` (whatever its status).

    ``result()`` never raises for a failed action; while it waits, the calling thread may do the
    client's socket I/O itself instead of waiting for the I/O thread to hand the result over.
    ``cancel()`` cancels the action too (as :meth:`Client.cancel` does) and the future at once.
    """

    def __init__(self, client: "Client", action_id: str | None = None):
        super().__init__()
        self._client = client
        self.action_id = action_id

    def cancel(self) -> bool:
        if not super().cancel():
            return False            # it has its result already
        if self.action_id is not None and not self._client._closed:
            self._client.cancel(self.action_id)
        return True

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self._client._wait_for(self, timeout)
        # A client closing fails its unresolved futures from the I/O thread: give that a moment.
        return super().result(timeout=_CLOSE_WAIT_S if self._client._closed else 0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            self._client._wait_for(self, timeout)
        return super().exception(timeout=_CLOSE_WAIT_S if self._client._closed else 0)


class _Waiter:
    """A thread parked until its future resolves or the socket is handed to it (a locked lock)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def wake(self, *_: Any) -> None:
        try:
            self._lock.release()
        except RuntimeError:
            pass  # woken twice (its future resolved and the socket was offered): once is enough

    def wait(self, timeout: float | None) -> None:
        self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout))


class _ClientBase:
    """What both clients share: where the coordinator is, who we are, the protocol session."""

    _default_name = "client"

    def __init__(self, address: str | None = None, *, connection_file: str | None = None,
                 connection: ConnectionInfo | None = None, name: str | None = None,
                 heartbeat_s: float = 1.0, reconnect_after_s: float = 3.0):
        self._address, self._connection_file, self._conn = _resolve(address, connection_file, connection)
        self.name = name or f"{self._default_name}-{os.getpid()}"
        self._ident = f"{self.name}-{os.urandom(4).hex()}".encode()
        self._heartbeat_s = heartbeat_s
        self._reconnect_after_s = reconnect_after_s
        self._session = ClientSession(self.name)

    @classmethod
    def from_connection_file(cls, path: str | None = None, **kw: Any):
        return cls(connection_file=path, **kw)

    @property
    def outstanding(self) -> int:
        """Actions submitted whose result has not arrived."""
        return len(self._session.pending)

    @property
    def resubmissions(self) -> int:
        """Actions sent again because the coordinator restarted."""
        return self._session.resubmissions

    @property
    def errors(self) -> deque[str]:
        """The coordinator's recent ERROR replies to this client."""
        return self._session.errors

    def _fail_unresolved(self) -> None:
        err = CoordinatorError("the client was closed before the result arrived")
        futs = [e[0] for e in list(self._session.pending.values())] + list(self._session.status_waiters)
        for fut in futs:
            if not fut.done():
                fut.set_exception(err)


class Client(_ClientBase):
    """Connect to a coordinator by connection file (or ``$TANGRAM_CONNECTION_FILE``) or by address."""

    def __init__(self, address: str | None = None, *, connection_file: str | None = None,
                 connection: ConnectionInfo | None = None, name: str | None = None,
                 heartbeat_s: float = 1.0, reconnect_after_s: float = 3.0):
        super().__init__(address, connection_file=connection_file, connection=connection, name=name,
                         heartbeat_s=heartbeat_s, reconnect_after_s=reconnect_after_s)
        # Socket ownership: at most one thread (the owner) touches the socket and the poller.
        self._cv = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._followers: deque[_Waiter] = deque()
        self._step_aside = False          # a waiting thread asks the I/O thread for the socket
        self._linger_until = 0.0
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._wake_sent = False
        self._next_hb = 0.0
        self._last_heard = time.monotonic()
        self._ctx = zmq.Context()
        self._sock = _dealer(self._ctx, self._ident, self._address, self._conn)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._hello = threading.Event()
        self._io_ident: int | None = None
        self._thread = threading.Thread(target=self._io, name="tangram-client-io", daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait()
        # Learn the coordinator's limits before the first submission when it is up; go on if it is not.
        self._hello.wait(timeout=_HELLO_WAIT_S)

    # -- public API ----------------------------------------------------------
    def submit(self, spec: ActionSpec) -> ActionFuture:
        """Queue one action; the future resolves to its :class:`ActionResult`."""
        if self._closed:
            raise CoordinatorError("the client is closed")
        fut = ActionFuture(self, spec.id)
        self._session.add(spec, fut)
        self._kick()
        return fut

    def submit_many(self, specs: Iterable[ActionSpec]) -> list[ActionFuture]:
        if self._closed:
            raise CoordinatorError("the client is closed")
        add = self._session.add
        futs = []
        for spec in specs:
            fut = ActionFuture(self, spec.id)
            add(spec, fut)
            futs.append(fut)
        self._kick()
        return futs

    def map(self, specs: Iterable[ActionSpec], timeout: float | None = None) -> list[ActionResult]:
        """Submit all, wait for all, return the results in order."""
        return self.gather(self.submit_many(specs), timeout=timeout)

    @staticmethod
    def gather(futures: Iterable[Future], timeout: float | None = None) -> list[ActionResult]:
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for f in futures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            out.append(f.result(timeout=left))
        return out

    def cancel(self, action_ids: str | Iterable[str]) -> None:
        """Ask the coordinator to cancel; the futures still resolve (status ``cancelled`` or final)."""
        self._session.cancel([action_ids] if isinstance(action_ids, str) else list(action_ids))
        self._kick()

    def close_env(self, env: str | Iterable[str]) -> None:
        """End environments: each is removed (its files, its snapshot, its pin to a worker) once the
        actions already submitted in it have finished.  A later action naming it starts a new, empty one."""
        self._session.close_env([env] if isinstance(env, str) else list(env))
        self._kick()

    def env(self, env_id: str | None = None, *, close: bool = True, **defaults: Any) -> "EnvHandle":
        """A handle on the environment ``env_id`` (a new id when None): ``with c.env("traj-17") as e:
        e.run("make")``.  ``defaults``: keyword arguments of :func:`~tangram_hpc.sandbox` for its commands."""
        return EnvHandle(self, env_id or _new_env_id(), close=close, defaults=defaults)

    def status(self, timeout: float = 10.0, *, allocations: bool = False) -> dict:
        """The coordinator's view: workers, queue, counters (``allocations``: and every worker job's history)."""
        return self._ask_status({"allocations": True} if allocations else None, P.STATUS, timeout)

    def pool(self, op: str, timeout: float = 10.0) -> dict:
        """``pause`` or ``resume`` worker launches; returns the status after it (``pool_op``, ``pool_error``)."""
        return self._ask_status({"op": op}, P.POOL, timeout)

    def _ask_status(self, body: dict | None, mtype: int, timeout: float) -> dict:
        if self._closed:
            raise CoordinatorError("the client is closed")
        fut = ActionFuture(self)
        self._session.ask_status(fut, body, mtype)
        self._kick()
        try:
            return fut.result(timeout)
        except FutureTimeout:
            fut.cancel()      # a late answer goes to the next request, not to this one nobody waits for
            raise TimeoutError(f"no status from the coordinator at {self._address} within {timeout:g}s") from None

    def close(self) -> None:
        """Disconnect; futures still unresolved get a :class:`CoordinatorError`."""
        if self._closed:
            return
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._wake()
        # The I/O thread takes the socket back, closes it and fails what is unresolved, which wakes
        # every waiting thread through its future.
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)
        with self._cv:
            r, w, self._wake_w = self._wake_r, self._wake_w, -1
        os.close(r)
        os.close(w)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- socket ownership -------------------------------------------------------
    def _wake(self) -> None:
        if not self._wake_sent and self._wake_w >= 0:
            self._wake_sent = True
            try:
                os.write(self._wake_w, b"\0")
            except OSError:
                pass  # pipe full: the owner wakes anyway

    def _kick(self) -> None:
        """Send what is queued: from this thread when the socket is free, else by waking its owner."""
        cv = self._cv
        outq = self._session.outq
        while outq:
            if self._owner is None and cv.acquire(blocking=False):
                if self._owner is None and not self._closed:
                    self._owner = threading.get_ident()
                    cv.release()
                    try:
                        self._flush()
                    finally:
                        self._release()
                    continue  # threads that found us owning only queued: send theirs too
                cv.release()
            self._wake()
            return

    def _release(self, linger: bool = False) -> None:
        with self._cv:
            self._owner = None
            if linger:
                self._linger_until = time.monotonic() + _LINGER_S
            self._offer()

    def _offer(self) -> None:
        """Hand the free socket to a parked waiter, else to the I/O thread (cv held).

        While lingering the I/O thread is not woken: it would only find it must keep away, and its
        wake-up would compete for the GIL with the caller's next round trip.
        """
        if self._owner is None:
            if self._followers:
                self._followers.popleft().wake()
            elif time.monotonic() >= self._linger_until:
                self._cv.notify_all()

    def _wait_for(self, fut: Future, timeout: float | None) -> None:
        """Return once ``fut`` is done, ``timeout`` passed or the client closed; meanwhile lead or follow."""
        deadline = None if timeout is None else time.monotonic() + timeout
        cv = self._cv
        try:
            while not fut.done() and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                with cv:
                    lead = self._owner is None
                    if lead:
                        self._owner = threading.get_ident()
                    else:
                        waiter = _Waiter()
                        self._followers.append(waiter)
                        if self._owner == self._io_ident:
                            self._step_aside = True
                            self._wake()
                if lead:
                    try:
                        self._lead(fut, deadline)
                    finally:
                        self._release(linger=True)
                else:
                    fut.add_done_callback(waiter.wake)
                    waiter.wait(left)
                    with cv:
                        try:
                            self._followers.remove(waiter)
                        except ValueError:
                            pass  # it was handed the socket
        finally:
            with cv:
                self._offer()  # the socket may have been offered to us after our future resolved

    def _lead(self, fut: Future, deadline: float | None) -> None:
        while not fut.done() and not self._closed:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            wait = self._next_hb - now
            if deadline is not None:
                wait = min(wait, deadline - now)
            self._pump(max(0.0, wait))

    # -- socket I/O (only ever by the owner) ------------------------------------
    def _pump(self, timeout_s: float) -> None:
        """Send what is queued, wait up to ``timeout_s`` for input, handle it, do the heartbeat."""
        outq = self._session.outq
        if outq:
            self._flush()
        sock = self._sock
        readable = False
        for obj, _ in self._poller.poll(math.ceil(timeout_s * 1000)):
            if obj is sock:
                readable = True
            else:
                self._wake_sent = False
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
        if outq:
            self._flush()
        if readable:
            self._last_heard = time.monotonic()
            self._receive()
            if outq:   # a coordinator restart queued every unfinished action again
                self._flush()
        if time.monotonic() >= self._next_hb:
            self._heartbeat()

    def _flush(self) -> None:
        send = self._sock.send
        for frame in self._session.frames():
            send(frame)

    def _receive(self) -> None:
        sock = self._sock
        on_frame = self._session.on_frame
        for _ in range(10_000):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            on_frame(frame)
        if self._session.welcomed and not self._hello.is_set():
            self._hello.set()

    def _heartbeat(self) -> None:
        now = time.monotonic()
        self._sock.send(P.encode(P.HEARTBEAT, {}))
        self._next_hb = now + self._heartbeat_s
        if now - self._last_heard > self._reconnect_after_s:
            info = reread_connection(self._connection_file, self._conn, self._address)
            if info is not None:  # the coordinator came back on another address or with other keys
                self._poller.unregister(self._sock)
                self._sock.close(0)
                self._conn, self._address = info, info.client_address
                self._sock = _dealer(self._ctx, self._ident, self._address, self._conn)
                self._poller.register(self._sock, zmq.POLLIN)
                self._sock.send(ClientSession.hello_frame(self.name))
                self._last_heard = now

    def _io(self) -> None:
        me = self._io_ident = threading.get_ident()
        cv = self._cv
        with cv:
            self._owner = me
        self._sock.send(ClientSession.hello_frame(self.name))
        self._release()
        self._ready.set()
        while True:
            with cv:
                while not self._closed:
                    if self._owner is None and not self._followers:
                        now = time.monotonic()
                        if now >= self._linger_until or now >= self._next_hb:
                            break
                        cv.wait(min(self._linger_until, self._next_hb) - now)
                    else:
                        cv.wait(self._heartbeat_s)  # an owning waiter sends the heartbeats meanwhile
                if self._closed:
                    break
                self._owner = me
                self._step_aside = False
                brief = time.monotonic() < self._linger_until
            stepped_aside = False
            try:
                if brief:   # only the heartbeat is due: the socket goes straight back
                    self._pump(0.0)
                else:
                    while not self._closed:
                        if self._step_aside:
                            stepped_aside = True
                            break
                        self._pump(max(0.0, self._next_hb - time.monotonic()))
            finally:
                self._release(linger=stepped_aside)
        self._shut_down()

    def _shut_down(self) -> None:
        with self._cv:
            while self._owner is not None:
                self._cv.wait(0.05)
            self._owner = threading.get_ident()
        self._sock.close(0)
        self._fail_unresolved()


class AsyncClient(_ClientBase):
    """asyncio flavour of :class:`Client`: ``await client.submit(spec)`` returns the result.

    It drives its own socket from the event loop it is first used in (readiness callbacks on the
    socket's file descriptor, a heartbeat task), so results reach coroutines with no thread hand-off.
    """

    _default_name = "aclient"

    def __init__(self, address: str | None = None, *, connection_file: str | None = None,
                 connection: ConnectionInfo | None = None, name: str | None = None,
                 heartbeat_s: float = 1.0, reconnect_after_s: float = 3.0):
        super().__init__(address, connection_file=connection_file, connection=connection, name=name,
                         heartbeat_s=heartbeat_s, reconnect_after_s=reconnect_after_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: zmq.Socket | None = None
        self._fd: int | None = None
        self._ticker: asyncio.Task | None = None
        self._hold_until = 0.0   # submissions wait for WELCOME (the frame limit) until then
        self._last_heard = 0.0
        self._closed = False

    # -- public API ----------------------------------------------------------
    def submit_nowait(self, spec: ActionSpec) -> "asyncio.Future[ActionResult]":
        """Queue one action from the running loop; the returned future resolves to its result."""
        loop = self._start()
        fut = loop.create_future()
        self._session.add(spec, fut)
        fut.add_done_callback(partial(self._cancel_if_cancelled, spec.id))
        self._flush()
        return fut

    def _cancel_if_cancelled(self, action_id: str, fut: "asyncio.Future[ActionResult]") -> None:
        # a future cancelled by its caller (wait_for's timeout, a cancelled task) cancels its action
        if fut.cancelled() and not self._closed:
            self.cancel(action_id)

    async def submit(self, spec: ActionSpec) -> ActionResult:
        return await self.submit_nowait(spec)

    async def map(self, specs: Iterable[ActionSpec]) -> list[ActionResult]:
        loop = self._start()
        futs = []
        for spec in specs:
            fut = loop.create_future()
            self._session.add(spec, fut)
            fut.add_done_callback(partial(self._cancel_if_cancelled, spec.id))
            futs.append(fut)
        self._flush()
        return list(await asyncio.gather(*futs))

    async def status(self, timeout: float = 10.0, *, allocations: bool = False) -> dict:
        fut = self._start().create_future()
        self._session.ask_status(fut, {"allocations": True} if allocations else None)
        self._flush()
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no status from the coordinator at {self._address} within {timeout:g}s") from None

    def cancel(self, action_ids: str | Iterable[str]) -> None:
        self._session.cancel([action_ids] if isinstance(action_ids, str) else list(action_ids))
        if self._sock is not None:
            self._flush()

    def close_env(self, env: str | Iterable[str]) -> None:
        """See :meth:`Client.close_env`."""
        self._session.close_env([env] if isinstance(env, str) else list(env))
        if self._sock is not None:
            self._flush()

    def env(self, env_id: str | None = None, *, close: bool = True, **defaults: Any) -> "AsyncEnvHandle":
        """``async with c.env("traj-17") as e: await e.run("make")``; see :meth:`Client.env`."""
        return AsyncEnvHandle(self, env_id or _new_env_id(), close=close, defaults=defaults)

    async def close(self) -> None:
        """Disconnect; futures still unresolved get a :class:`CoordinatorError`."""
        if self._closed:
            return
        self._closed = True
        if self._ticker is not None:
            self._ticker.cancel()
        self._disconnect()
        self._fail_unresolved()

    async def __aenter__(self) -> "AsyncClient":
        self._start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- the loop side ---------------------------------------------------------
    def _start(self) -> asyncio.AbstractEventLoop:
        if self._loop is not None:
            return self._loop
        if self._closed:
            raise CoordinatorError("the client is closed")
        self._loop = loop = asyncio.get_running_loop()
        self._connect()
        self._hold_until = time.monotonic() + _HELLO_WAIT_S
        self._ticker = loop.create_task(self._tick())
        return loop

    def _connect(self) -> None:
        # The process-wide context: an AsyncClient dropped without close() after its loop ended
        # must not block the garbage collector terminating a context of its own.
        self._sock = _dealer(zmq.Context.instance(), self._ident, self._address, self._conn)
        self._fd = int(self._sock.getsockopt(zmq.FD))
        self._loop.add_reader(self._fd, self._on_readable)
        self._sock.send(ClientSession.hello_frame(self.name))
        self._last_heard = time.monotonic()
        self._on_readable()

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._loop.remove_reader(self._fd)
            self._sock.close(0)
            self._sock = None

    def _flush(self) -> None:
        s = self._session
        if self._sock is None or not s.outq:
            return
        if not s.welcomed and time.monotonic() < self._hold_until:
            return  # sent once WELCOME tells the coordinator's frame limit (or the hold passes)
        send = self._sock.send
        for frame in s.frames():
            send(frame)
        # ZMQ's descriptor is edge-triggered and a send may consume the edge: look for input now.
        self._on_readable()

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        on_frame = self._session.on_frame
        got = False
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[arg-type,operator]  # an int (the stubs: int | bytes | str)
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            got = True
            on_frame(frame)
        if got:
            self._last_heard = time.monotonic()
            if self._session.outq:   # WELCOME arrived, or a restarted coordinator needs our actions again
                self._flush()

    async def _tick(self) -> None:
        while not self._closed:
            await asyncio.sleep(self._heartbeat_s)
            if self._sock is None:
                continue
            now = time.monotonic()
            self._sock.send(P.encode(P.HEARTBEAT, {}))
            if now - self._last_heard > self._reconnect_after_s:
                info = reread_connection(self._connection_file, self._conn, self._address)
                if info is not None:
                    self._disconnect()
                    self._conn, self._address = info, info.client_address
                    self._connect()
            self._flush()
            self._on_readable()


def _new_env_id() -> str:
    return f"env-{os.urandom(8).hex()}"


class _EnvHandleBase:
    def __init__(self, client: Any, env_id: str, *, close: bool = True, defaults: dict | None = None):
        self.client = client
        self.id = env_id
        self._close_on_exit = close
        self._defaults = dict(defaults or {})
        self.closed = False

    def _spec(self, cmd: str | list[str], kw: dict) -> ActionSpec:
        return sandbox(cmd, env=self.id, **{**self._defaults, **kw})

    def close(self) -> None:
        """End the environment (``close_env``) once the actions already submitted in it have finished."""
        if not self.closed:
            self.closed = True
            self.client.close_env(self.id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"


class EnvHandle(_EnvHandleBase):
    """A stateful sandbox environment: every command it runs names it, so files persist between them.

    ``with client.env("traj-17") as e:`` ends the environment when the block is left
    (``close=False`` keeps it); :meth:`close` does the same by hand.  Ending frees its disk and its
    pin to a worker at once rather than after its idle TTL.
    """

    def submit(self, cmd: str | list[str], **kw: Any) -> ActionFuture:
        """Submit a command in this environment; ``kw``: :func:`~tangram_hpc.sandbox` arguments."""
        return self.client.submit(self._spec(cmd, kw))

    def run(self, cmd: str | list[str], *, wait: float | None = None, **kw: Any) -> ActionResult:
        """Run a command in this environment and wait (up to ``wait`` seconds) for its result."""
        return self.submit(cmd, **kw).result(wait)

    def run_cells(self, cells: str | list[str], *, wait: float | None = None, **kw: Any) -> ActionResult:
        """Run Python cells in this environment's kernel and wait; ``kw``: :func:`~tangram_hpc.run_cells`
        arguments (docs/sandbox.md, "Kernel mode")."""
        return self.client.submit(run_cells(cells, env=self.id, **kw)).result(wait)

    def __enter__(self) -> "EnvHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._close_on_exit:
            self.close()


class AsyncEnvHandle(_EnvHandleBase):
    """The asyncio flavour of :class:`EnvHandle`: ``async with c.env("t") as e: r = await e.run("ls")``."""

    def submit(self, cmd: str | list[str], **kw: Any) -> "asyncio.Future[ActionResult]":
        return self.client.submit_nowait(self._spec(cmd, kw))

    async def run(self, cmd: str | list[str], **kw: Any) -> ActionResult:
        return await self.submit(cmd, **kw)

    async def run_cells(self, cells: str | list[str], **kw: Any) -> ActionResult:
        return await self.client.submit_nowait(run_cells(cells, env=self.id, **kw))

    async def __aenter__(self) -> "AsyncEnvHandle":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._close_on_exit:
            self.close()
