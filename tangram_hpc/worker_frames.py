"""The DONE frames of a worker: those the send queue had no room for yet, and those sent under the
current registration, kept to be sent again as OUTCOMES should the coordinator not have heard them
(it restarted, or it declared this worker lost).  Used on the I/O thread only."""
from __future__ import annotations

import logging
import time
from collections import deque

import zmq

from . import protocol as P

log = logging.getLogger("tangram.worker")

#: DONE frames kept for OUTCOMES: those sent this long before the coordinator was last heard, or later,
#: at most this many and this many bytes.
RESEND_WINDOW_S = 2.0
_KEEP_SENT_FRAMES = 256
_KEEP_SENT_BYTES = 16 << 20


class DoneFrames:
    def __init__(self) -> None:
        self.unsent: deque[bytes] = deque()     # DONE frames the send queue had no room for
        self._blocked = False
        self._sent: deque[tuple[int, float, bytes]] = deque()   # (generation, time sent, frame)
        self._sent_bytes = 0
        self._older: list[bytes] = []           # DONE frames of the last registration, until WELCOME

    def queue(self, frame: bytes, generation: int) -> None:
        """A DONE frame to send (and keep, under ``generation``)."""
        self.unsent.append(frame)
        sent = self._sent
        sent.append((generation, time.time(), frame))
        self._sent_bytes += len(frame)
        while len(sent) > _KEEP_SENT_FRAMES or self._sent_bytes > _KEEP_SENT_BYTES:
            self._sent_bytes -= len(sent.popleft()[2])

    def flush(self, sock: zmq.Socket) -> None:
        """Send what waits, as far as the send queue takes it."""
        unsent = self.unsent
        while unsent:
            try:
                sock.send(unsent[0], zmq.NOBLOCK)
            except zmq.Again:
                if not self._blocked:
                    self._blocked = True
                    log.warning("the coordinator is not taking results (send queue full): %d DONE frames kept "
                                "and sent again when it does", len(unsent))
                return
            unsent.popleft()
        if self._blocked:
            self._blocked = False
            log.info("the coordinator takes results again; every kept DONE frame is sent")

    def registering(self, last_heard_wall: float) -> None:
        """A REGISTER goes out: outcomes sent under the last registration shortly before the coordinator
        was last heard, or after, may never have been handled; they go again as OUTCOMES once it
        welcomes us (REGISTER goes every heartbeat until a WELCOME: the frames of the first try stay)."""
        cutoff = last_heard_wall - RESEND_WINDOW_S
        self._older.extend(f for _, t, f in self._sent if t >= cutoff)
        self._sent.clear()
        self._sent_bytes = 0

    def take_older(self) -> list:
        """The outcome items of the frames kept from the last registration (welcomed: to send again)."""
        items: list = []
        for frame in self._older:
            try:
                _, body = P.decode(frame, frozenset({P.DONE}), len(frame))   # our own frame
            except P.ProtocolError:
                continue
            items.extend(body)
        self._older = []
        return items
