"""What the coordinator's loop does with a frame it refuses and with one whose handling raised.

A frame refused at the edge (it does not decode, or fails its check) is a peer's fault: it is
answered with an ERROR frame and counted in ``bad_frames``.  Anything raised while a checked frame
is handled is a bug of ours: it is logged with its traceback (once a minute per message and
exception type), counted in ``internal_errors``, and the actions the frame names end with an
error result (:meth:`~.ledger.ActionLedger.abort`), so that no client waits on an action left in
an unknown state.  Either way the loop goes on.
"""
from __future__ import annotations

import logging
import time

import zmq

from .. import protocol as P
from .ledger import ActionLedger

log = logging.getLogger("tangram.coordinator")

_FAILURE_LOG_S = 60.0  # a failure of one kind is logged with its traceback at most this often


class FrameFaults:
    def __init__(self, ledger: ActionLedger):
        self.ledger = ledger
        self.counters = ledger.counters
        self._refused_logged: set[str] = set()
        self._failure_logged: dict[tuple, float] = {}   # (message type, exception type) -> when last logged

    def refused(self, sock: zmq.Socket, ident: bytes, err: P.ProtocolError) -> None:
        """A frame from ``ident`` on ``sock`` that ``err`` refused."""
        self.counters.bad_frames += 1
        if err.code not in self._refused_logged:  # once per kind of fault, not per frame
            self._refused_logged.add(err.code)
            log.warning("rejected a frame (%s): %s", err.code, err)
        try:
            sock.send_multipart([ident, P.error_frame(err.code, str(err))], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # peer gone or queue full: dropped, and counted above

    def failed(self, sock: zmq.Socket, ident: bytes, mtype: P.MsgType, body, err: Exception, *,
               answer: bool) -> None:
        """Handling a valid frame raised ``err``: a bug in the ledger, the policy or the loop.
        ``answer``: the peer is a client, which gets an ERROR reply unless it sent a SUBMIT (whose
        actions get their error results)."""
        self.counters.internal_errors += 1
        now = time.time()
        kind = (mtype, type(err).__name__)
        if now - self._failure_logged.get(kind, -_FAILURE_LOG_S) >= _FAILURE_LOG_S:
            self._failure_logged[kind] = now
            log.error("handling a %s frame failed (%d failures so far); the actions it names end with an error",
                      mtype.name, self.counters.internal_errors, exc_info=err)
        why = f"internal error in the coordinator while handling {mtype.name}: {type(err).__name__}: {err}"[:500]
        try:
            if mtype == P.SUBMIT:
                ids = [w["i"] for w in body if isinstance(w, dict) and isinstance(w.get("i"), str)]
                self.ledger.abort(ids, why, now, client=ident)
            elif mtype == P.CANCEL:
                self.ledger.abort(body, why, now)
            elif mtype in (P.DONE, P.OUTCOMES):
                wid = ident.decode("utf-8", "replace")
                ended = [o.id for o in _outcomes(body) if self.ledger.attempt_of(o.id) == (o.attempt, wid)]
                self.ledger.abort(ended, why, now, ended_on=wid)
        except Exception:
            log.exception("could not end the actions of a %s frame whose handling failed", mtype.name)
        if answer and mtype != P.SUBMIT:   # a client waiting for a reply gets one
            try:
                sock.send_multipart([ident, P.error_frame("internal", why)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass


def _outcomes(items: list) -> list[P.Outcome]:
    out = []
    for item in items:
        try:
            out.append(P.check_done(item))
        except P.ValidationError:
            pass
    return out
