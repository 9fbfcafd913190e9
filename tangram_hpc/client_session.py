"""The client side of the protocol, with no sockets and no threads.

:class:`ClientSession` knows what a client must send and what a frame from the
coordinator means: it keeps every unfinished action until its result arrives,
batches submissions into frames that fit the coordinator's limit, resolves
futures (de-duplicated by action id), answers status requests, and queues all
unfinished actions again when the coordinator's incarnation id changes.

The drivers own the socket: :class:`~tangram_hpc.client.Client` from whichever
thread holds it, :class:`~tangram_hpc.client.AsyncClient` from an asyncio loop.
Both hand frames to :meth:`ClientSession.on_frame` and send what
:meth:`ClientSession.frames` yields.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import InvalidStateError as FutureStateError
from typing import Any, Iterator

from . import protocol as P
from .actions import ID_MAX, ActionResult, ActionSpec
from .errors import CoordinatorError

log = logging.getLogger("tangram.client")

SUBMIT_BATCH = 2000
_RECEIVE_BATCH = 10_000
_FROM_COORDINATOR = frozenset({P.RESULT, P.HEARTBEAT, P.WELCOME, P.STATUS, P.ERROR})


def _settle(fut: Any, result: Any = None, error: BaseException | None = None) -> None:
    # concurrent.futures and asyncio futures alike; one the caller cancelled stays cancelled.
    try:
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)
    except Exception as e:  # both future kinds raise an InvalidStateError of their own when done
        if not isinstance(e, FutureStateError) and type(e).__name__ != "InvalidStateError":
            raise


class ClientSession:
    """Protocol state of one client: unfinished actions, queued messages, the coordinator's limits."""

    def __init__(self, name: str):
        self.name = name
        #: action id -> (future, wire form, when it was submitted: monotonic); an entry leaves only
        #: when its result arrives
        self.pending: dict[str, tuple[Any, dict, float]] = {}
        #: messages to send: action wire maps (batched into SUBMIT frames) and (type, body) pairs
        self.outq: deque = deque()
        self.status_waiters: deque = deque()
        #: ids whose cancel was asked while they were unfinished: a resubmission is cancelled again
        self.cancelled: set[str] = set()
        self.coordinator: str | None = None
        self.max_frame = P.MAX_FRAME_BYTES   # updated from the coordinator's WELCOME
        self.welcomed = False
        self.errors: deque[str] = deque(maxlen=100)
        self.resubmissions = 0

    # -- what the caller asks for ----------------------------------------------------
    def add(self, spec: ActionSpec, fut: Any) -> None:
        aid = spec.id
        if type(aid) is not str or not 0 < len(aid) <= ID_MAX or aid in self.pending:
            # refused here: the coordinator could only answer with an error frame naming no action,
            # and a second future under a pending id would take the first one's result
            why = ("is already pending in this client" if type(aid) is str and 0 < len(aid) <= ID_MAX
                   else f"must be a non-empty string of at most {ID_MAX} characters")
            now = time.time()
            _settle(fut, ActionResult(str(aid)[:ID_MAX], "error", error=f"rejected: action id {str(aid)[:80]!r} {why}",
                                      submitted=now, finished=now))
            return
        wire = spec.to_wire()
        self.pending[aid] = (fut, wire, time.monotonic())
        self.outq.append(wire)

    def cancel(self, ids: list[str]) -> None:
        pending = self.pending
        self.cancelled.update(i for i in ids if i in pending)
        if len(self.cancelled) > 2 * len(pending) + 4096:        # those answered since
            self.cancelled &= pending.keys()
        self.outq.append((P.CANCEL, ids))

    def close_env(self, envs: list[str]) -> None:
        self.outq.append((P.CLOSE_ENV, envs))

    def ask_status(self, fut: Any, body: dict | None = None, mtype: int = P.STATUS) -> None:
        """Ask for the status map (``body``: its options); a POOL request is answered with one too."""
        self.status_waiters.append(fut)
        self.outq.append((mtype, body or {}))

    @staticmethod
    def hello_frame(name: str) -> bytes:
        return P.encode(P.HELLO, {"name": name})

    # -- what to send ----------------------------------------------------------------
    def frames(self) -> Iterator[bytes]:
        """Encode everything queued, submissions in batches that fit the frame limit."""
        outq = self.outq
        batch: list = []
        while outq:
            item = outq.popleft()
            if isinstance(item, dict):
                batch.append(item)
                if len(batch) >= SUBMIT_BATCH:
                    yield from self._submit_frames(batch)
                    batch = []
            else:
                if batch:
                    yield from self._submit_frames(batch)
                    batch = []
                yield P.encode(*item)
        if batch:
            yield from self._submit_frames(batch)

    def _submit_frames(self, batch: list) -> Iterator[bytes]:
        try:
            frame = P.encode(P.SUBMIT, batch)
        except (TypeError, ValueError, OverflowError) as exc:
            # a value msgpack has no form for (a set, an object, an integer past 64 bits): the batch
            # is split until the action that holds it fails alone, the others go out
            frame, why = None, (f"rejected: the action cannot be sent ({type(exc).__name__}: {exc}); a payload "
                                f"holds only None, bool, int (64 bits), float, str, bytes, lists and maps")
        if frame is not None and len(frame) <= self.max_frame:
            yield frame
        elif len(batch) > 1:  # split to fit the coordinator's frame limit
            half = len(batch) // 2
            yield from self._submit_frames(batch[:half])
            yield from self._submit_frames(batch[half:])
        else:
            aid = batch[0]["i"]
            entry = self.pending.pop(aid, None)
            if entry is not None:
                now = time.time()
                if frame is not None:
                    why = (f"rejected: the action is {len(frame)} bytes on the wire, over the coordinator's frame "
                           f"limit of {self.max_frame}; pass large data through files")
                _settle(entry[0], ActionResult(aid, "error", error=why, submitted=now, finished=now))

    # -- what arrived ----------------------------------------------------------------
    def on_frame(self, frame: bytes) -> int:
        """Handle one frame from the coordinator; return how many futures it resolved."""
        try:
            # the coordinator keeps its frames within its own limit (WELCOME), which may be above
            # the default; past that, a frame is still read: dropping it would leave futures unsettled
            mtype, body = P.decode(frame, _FROM_COORDINATOR, 4 * max(self.max_frame, P.MAX_FRAME_BYTES))
        except P.ProtocolError as e:
            self.errors.append(str(e))
            return 0
        if mtype == P.RESULT:
            return self._on_results(body)
        if mtype == P.HEARTBEAT or mtype == P.WELCOME:
            if mtype == P.WELCOME:
                limit = body.get("limits", {}).get("max_frame_bytes")
                if isinstance(limit, int) and limit > 0:
                    self.max_frame = limit
                self.welcomed = True
            cid = body.get("coordinator")
            if self.coordinator is not None and cid != self.coordinator:
                self._requeue_unfinished(cid)
            self.coordinator = cid
        elif mtype == P.STATUS:
            waiters = self.status_waiters
            while waiters and waiters[0].done():
                waiters.popleft()       # its caller gave up (a timeout cancels it): the answer is the next one's
            if waiters:
                _settle(waiters.popleft(), body)
                return 1
        elif mtype == P.ERROR:
            msg = f"{body.get('code')}: {body.get('message')}"
            self.errors.append(msg)
            log.warning("coordinator error: %s", msg)
        return 0

    def _on_results(self, body: list) -> int:
        pending = self.pending
        n = 0
        for w in body:
            entry = pending.pop(w[0], None) if isinstance(w, list) and w else None
            if entry is None:
                continue  # a duplicate (a resubmission raced the first result)
            n += 1
            try:
                res = ActionResult.from_wire(w)
            except Exception as e:
                _settle(entry[0], error=CoordinatorError(f"bad result from coordinator: {e}"))
                continue
            _settle(entry[0], res)
        return n

    def _requeue_unfinished(self, cid: str) -> None:
        """A new coordinator incarnation knows nothing of ours: submit every unfinished action again."""
        now = time.monotonic()
        wires = []
        # A cancel the old incarnation may never have handled goes to the new one right after the
        # resubmission: a waiting action never runs, one still running on its worker is killed.
        # Callers' threads may submit meanwhile (add() takes no lock): work on a copy of the map,
        # and take the queue apart with popleft, which they cannot disturb.
        pending = list(self.pending.items())
        resent = set()
        cancelled = set()
        for aid, (fut, w, submitted) in pending:
            if fut.done() or aid in self.cancelled:     # cancelled by its caller, or by id
                cancelled.add(aid)
            # how long ago it was first submitted: the new incarnation counts its ACT from then
            w["a"] = round(now - submitted, 3)
            wires.append(w)
            resent.add(aid)
        self.cancelled = cancelled
        log.warning("coordinator restarted (%s -> %s): resubmitting %d unfinished actions",
                    self.coordinator, cid, len(wires))
        self.resubmissions += len(wires)
        # Ahead of anything queued: those were meant for the old incarnation too.  A queued action
        # is among the resubmitted unless it was added after the copy above.
        q = self.outq
        kept = []
        while True:
            try:
                item = q.popleft()
            except IndexError:
                break
            if not isinstance(item, dict) or item.get("i") not in resent:
                kept.append(item)
        front = wires + ([(P.CANCEL, sorted(cancelled))] if cancelled else []) + kept
        q.extendleft(reversed(front))   # before whatever was appended while this ran
