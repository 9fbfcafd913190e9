"""The wire protocol: one msgpack frame per message, versioned, validated at the edge.

Every message is a single ZMQ frame (after the ROUTER identity) holding the
msgpack array ``[version, type, body]``.  Hot-path messages carry *lists*
(a SUBMIT holds many specs, an ASSIGN many assignments, a DONE many
outcomes) so that a busy peer pays one frame, one syscall and one decode for
a whole batch.

Message types and bodies (``C`` client, ``K`` coordinator, ``W`` worker):

============  =========  ======================================================
type          direction  body
============  =========  ======================================================
HELLO         C->K       ``{"name": str}``
WELCOME       K->C/W     ``{"coordinator": incarnation id, "limits": {...}}``
SUBMIT        C->K       ``[action wire map, ...]``
CANCEL        C->K       ``[action id, ...]``
RESULT        K->C       ``[result wire list, ...]``
STATUS        C->K       ``{}`` or ``{"allocations": true}``; reply STATUS with a status map
POOL          C->K       ``{"op": "pause" | "resume"}`` (worker launches); reply STATUS with
                         the status map after it, ``"pool_op"`` saying what was done
HEARTBEAT     any        ``{"coordinator": id}`` from K; ``{}`` from C;
                         ``{"running": n, "services": [...], "envs": [...],
                         "service_counts": {service: [loads, evictions, queued]}}`` from W
ERROR         K->any     ``{"code": str, "message": str}``
REGISTER      W->K       worker description, see :func:`check_register`
ASSIGN        K->W       ``[[action wire map, attempt, cores], ...]``
DONE          W->K       ``[[action id, attempt, status, output, error, started, finished], ...]``
KILL          K->W       ``[[action id, attempt], ...]`` (cancel / coordinator-side timeout)
STOP          K->W       ``{"reason": str, "reregister": bool}``
============  =========  ======================================================

A frame that cannot be decoded, has another version, an unknown type or a
body of the wrong shape raises :class:`ProtocolError`; the coordinator
answers it with an ERROR frame and keeps going.
"""
from __future__ import annotations

from typing import Any

import msgpack

from .errors import ProtocolError, ValidationError

#: 2: POOL (pause/resume launches), STATUS may ask for the allocation history.
PROTOCOL_VERSION = 2

HELLO = 1
WELCOME = 2
SUBMIT = 3
CANCEL = 4
RESULT = 5
STATUS = 6
HEARTBEAT = 7
ERROR = 8
REGISTER = 9
ASSIGN = 10
DONE = 11
KILL = 12
STOP = 13
POOL = 14

NAMES = {v: k for k, v in dict(HELLO=HELLO, WELCOME=WELCOME, SUBMIT=SUBMIT, CANCEL=CANCEL, RESULT=RESULT,
         STATUS=STATUS, HEARTBEAT=HEARTBEAT, ERROR=ERROR, REGISTER=REGISTER, ASSIGN=ASSIGN,
         DONE=DONE, KILL=KILL, STOP=STOP, POOL=POOL).items()}
CLIENT_TYPES = frozenset({HELLO, SUBMIT, CANCEL, STATUS, HEARTBEAT, POOL})
WORKER_TYPES = frozenset({REGISTER, HEARTBEAT, DONE})

#: Default largest frame accepted (bytes).  Also set as ZMQ_MAXMSGSIZE so the
#: transport drops larger frames before they are buffered whole.
MAX_FRAME_BYTES = 16 * 1024 * 1024


_packer = msgpack.Packer(use_bin_type=True)


def encode(mtype: int, body: Any) -> bytes:
    try:
        return _packer.pack([PROTOCOL_VERSION, mtype, body])
    except BaseException:
        # A Packer keeps partial output after a failure; start clean next time.
        _packer.reset()
        raise


def decode(frame: bytes, allowed: frozenset[int], max_bytes: int = MAX_FRAME_BYTES) -> tuple[int, Any]:
    """Decode one frame, checking size, version, type and outer shape."""
    if len(frame) > max_bytes:
        raise ProtocolError("too_large", f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        msg = msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for bad input
        raise ProtocolError("malformed", f"frame is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(msg, list) or len(msg) != 3:
        raise ProtocolError("malformed", "frame must be [version, type, body]")
    version, mtype, body = msg
    if version != PROTOCOL_VERSION:
        raise ProtocolError("version", f"protocol version {version!r} not supported; this peer speaks {PROTOCOL_VERSION}")
    if not isinstance(mtype, int) or mtype not in allowed:  # a list or map here is unhashable
        raise ProtocolError("unknown_type", f"message type {mtype!r} not accepted here")
    shape = _BODY_SHAPE.get(mtype)
    if shape is not None and not isinstance(body, shape):
        raise ProtocolError("malformed", f"{NAMES[mtype]} body must be a {shape.__name__}")
    return mtype, body


_BODY_SHAPE = {
    HELLO: dict, WELCOME: dict, SUBMIT: list, CANCEL: list, RESULT: list, STATUS: dict,
    HEARTBEAT: dict, ERROR: dict, REGISTER: dict, ASSIGN: list, DONE: list, KILL: list, STOP: dict, POOL: dict,
}


def error_frame(code: str, message: str) -> bytes:
    return encode(ERROR, {"code": code, "message": message[:500]})


def check_register(body: dict) -> dict:
    """Validate a worker's REGISTER body and return it with defaults filled in."""
    out: dict[str, Any] = {}
    wid = body.get("id")
    if not isinstance(wid, str) or not 0 < len(wid) <= 128:
        raise ProtocolError("malformed", "REGISTER needs a worker id string")
    out["id"] = wid
    for key in ("cores", "mem_mb", "gpus", "gpu_mem_mb", "pid"):
        v = body.get(key, 0)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 40:
            raise ProtocolError("malformed", f"REGISTER {key} must be a non-negative integer")
        out[key] = v
    if out["cores"] < 1:
        raise ProtocolError("malformed", "REGISTER cores must be at least 1")
    for key in ("kinds", "services"):
        v = body.get(key, [])
        if not isinstance(v, list) or len(v) > 100_000 or not all(isinstance(s, str) for s in v):
            raise ProtocolError("malformed", f"REGISTER {key} must be a list of strings")
        out[key] = v
    for key in ("handle", "host", "partition"):
        v = body.get(key)
        if v is not None and not isinstance(v, str):
            raise ProtocolError("malformed", f"REGISTER {key} must be a string")
        out[key] = v
    return out


def check_done(item: Any) -> tuple[str, int, str, Any, str | None, float, float]:
    if not isinstance(item, list) or len(item) != 7:
        raise ValidationError("DONE item must be [id, attempt, status, output, error, started, finished]")
    aid, attempt, status, output, error, started, finished = item
    if not isinstance(aid, str) or not isinstance(attempt, int) or not isinstance(status, str):
        raise ValidationError("DONE item has a bad id, attempt or status")
    if not isinstance(started, (int, float)) or not isinstance(finished, (int, float)):
        raise ValidationError("DONE item has bad times")
    if error is not None and not isinstance(error, str):
        raise ValidationError("DONE error must be a string")
    return aid, attempt, status, output, error, float(started), float(finished)
