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
WELCOME       K->C/W     ``{"coordinator": incarnation id, "limits": {...}}`` to a client;
                         ``{"coordinator", "heartbeat_s", "snapshot_dir", "max_frame_bytes"}``
                         to a worker (frames it sends stay within that limit; it heartbeats at
                         ``heartbeat_s``, or its own interval where longer: :func:`heartbeat_interval`)
SUBMIT        C->K       ``[action wire map, ...]``
CANCEL        C->K       ``[action id, ...]``
RESULT        K->C       ``[result wire list, ...]``
STATUS        C->K       ``{}`` or ``{"allocations": true}``; reply STATUS with a status map
POOL          C->K       ``{"op": "pause" | "resume"}`` (worker launches); reply STATUS with
                         the status map after it, ``"pool_op"`` saying what was done
HEARTBEAT     any        ``{"coordinator": id, "heartbeat_s": s}`` from K to a worker (``s``: the
                         interval the coordinator chose for its number of workers), which adds
                         ``"send_envs": n`` when the worker's ``envs_v`` (n) names a list it has not
                         received; ``{"coordinator": id}`` to a client; ``{}`` from C;
                         ``{"running": n, "services": [...], "envs_v": n, "envs": [...],
                         "service_counts": {service: [loads, evictions, queued]},
                         "service_costs": {service: [load s, evict s]},
                         "devices": [[device, used MB, budget MB, free MB or -1, [service, ...]], ...]}``
                         from W (``envs``, the environments it holds, only when they changed
                         since its last list or K asked; ``envs_v`` numbers that list), which
                         adds ``"leaving": reason`` while it leaves, then ``"left": reason,
                         "interrupted": [[action id, attempt], ...]`` as its last message
ERROR         K->any     ``{"code": str, "message": str}``
REGISTER      W->K       worker description, see :func:`check_register`
ASSIGN        K->W       ``[[action wire map, attempt, cores(, grant)], ...]``; an action with an
                         environment carries its grant ``[generation, source, path]``, source
                         ``held`` | ``new`` | ``restore`` (path: snapshot) | ``adopt`` (path: the
                         environment root of a worker that died)
DONE          W->K       ``[[action id, attempt, status, output, error, started, finished,
                         env_state], ...]``
KILL          K->W       ``[[action id, attempt], ...]`` (cancel / coordinator-side timeout)
STOP          K->W       ``{"reason": str, "reregister": bool}``
CLOSE_ENV     C->K       ``[environment id, ...]``: end these environments
ENV           K->W       ``[[op, environment id, generation], ...]``, op ``save`` (snapshot it and
                         give it up), ``drop`` (delete the copy), ``keep`` (hold it at this
                         generation)
ENV           W->K       ``[[op, environment id, generation, detail], ...]``, op ``saved``
                         (detail: the snapshot's path), ``unsaved`` (detail: why), ``gone``
                         (detail: why, e.g. its TTL expired)
OUTCOMES      W->K       DONE items of attempts that ended under an earlier registration of
                         this worker (a restarted coordinator, a worker declared lost)
PREFETCH      K->W       ``[service, ...]``: start loading these services now, ahead of their
                         calls (the scheduler's prefetch); a hint, never answered
============  =========  ======================================================

Version 7 made the coordinator's ``heartbeat_s`` (WELCOME, its heartbeats) the interval its
workers heartbeat at, chosen from the number of workers.  Version 6 made a worker's heartbeat
list its environments only when they changed (``envs_v``, ``send_envs``).  Version 5 added PREFETCH.  Version 3 added the environment grant, ``env_state`` (DONE, RESULT), CLOSE_ENV, ENV and
OUTCOMES.

A frame that cannot be decoded, has another version, an unknown type or a
body of the wrong shape raises :class:`ProtocolError`; the coordinator
answers it with an ERROR frame and keeps going.
"""
from __future__ import annotations

from enum import IntEnum
from math import isfinite
from threading import get_ident
from typing import Any, NamedTuple

import msgpack

from .actions import ID_MAX, ActionSpec, EnvState, Status
from .errors import ProtocolError, ValidationError

#: 2: POOL (pause/resume launches), STATUS may ask for the allocation history.
#: 3: environment grants in ASSIGN, env_state in DONE and RESULT, CLOSE_ENV, ENV, OUTCOMES.
#: 4: a saved environment (ENV saved, a restore grant) may be a delta over its template's base,
#:    which a worker speaking 3 would restore without the base.
#: 5: PREFETCH (coordinator to worker), which a worker speaking 4 would answer as an unknown type.
#: 6: a worker's heartbeat lists its environments only when they changed (envs_v, send_envs).
#: 7: workers heartbeat at the interval the coordinator tells them (WELCOME, its HEARTBEAT), which
#:    grows with the number of workers; a worker speaking 6 would keep its own and be lost.
PROTOCOL_VERSION = 7

class MsgType(IntEnum):
    """The type of a message (the second element of every frame)."""
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
    CLOSE_ENV = 15
    ENV = 16
    OUTCOMES = 17
    PREFETCH = 18


(HELLO, WELCOME, SUBMIT, CANCEL, RESULT, STATUS, HEARTBEAT, ERROR, REGISTER, ASSIGN, DONE, KILL, STOP, POOL,
 CLOSE_ENV, ENV, OUTCOMES, PREFETCH) = MsgType
NAMES = {t.value: t.name for t in MsgType}
#: value -> member, so that decoding pays an index, not an enum lookup
_BY_VALUE: tuple[MsgType | None, ...] = tuple(MsgType(v) if v in NAMES else None for v in range(max(NAMES) + 1))
CLIENT_TYPES = frozenset({HELLO, SUBMIT, CANCEL, STATUS, HEARTBEAT, POOL, CLOSE_ENV})
WORKER_TYPES = frozenset({REGISTER, HEARTBEAT, DONE, ENV, OUTCOMES})

#: Grant sources in an ASSIGN (see the table above).
GRANT_HELD, GRANT_NEW, GRANT_RESTORE, GRANT_ADOPT = "held", "new", "restore", "adopt"
#: Operations of ENV messages.
ENV_SAVE, ENV_DROP, ENV_KEEP = "save", "drop", "keep"
ENV_SAVED, ENV_UNSAVED, ENV_GONE = "saved", "unsaved", "gone"
_ENV_FROM_WORKER = frozenset({ENV_SAVED, ENV_UNSAVED, ENV_GONE})

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


def encode_within(mtype: int, items: list, max_bytes: int) -> list[bytes]:
    """``items`` (a list body: DONE, OUTCOMES, RESULT) as frames of at most ``max_bytes`` each.

    The common case costs one encoding and a length check; a larger batch is cut into as many
    parts as its size asks for (and those again, if uneven).  A single item larger than the
    limit stays one frame: keeping items within it is the sender's business.
    """
    frame = encode(mtype, items)
    if len(frame) <= max_bytes or len(items) <= 1:
        return [frame]
    parts = min(len(items), -(-len(frame) // max_bytes) + 1)
    step = -(-len(items) // parts)
    out: list[bytes] = []
    for i in range(0, len(items), step):
        out += encode_within(mtype, items[i:i + step], max_bytes)
    return out


# -- outcomes packed where they are made ---------------------------------------------------
# A worker packs each action's output on the thread that ran the action, after a size check that
# needs no packing, so the I/O thread only joins bytes: it never waits behind a user-sized result.

def _packs_over(value: Any, limit: int) -> bool:
    """Whether ``value`` packs to more than ``limit`` bytes, found without packing it: a walk adding up
    what msgpack takes for each part, which stops once past the limit (so it takes at most about
    ``limit`` steps, even for a huge or cyclic value).  A type msgpack does not know counts as 9
    bytes: packing it fails anyway."""
    budget = limit
    stack = [value]
    pop, push = stack.pop, stack.extend
    while stack:
        v = pop()
        if isinstance(v, str):
            n = len(v)
            if n > budget:                          # UTF-8 takes a byte a character at least
                return True
            if not v.isascii():
                n = len(v.encode("utf-8", "surrogatepass"))
            budget -= n + (1 if n < 32 else 2 if n < 256 else 3 if n < 65536 else 5)
        elif isinstance(v, (bytes, bytearray, memoryview)):
            n = v.nbytes if isinstance(v, memoryview) else len(v)
            budget -= n + (2 if n < 256 else 3 if n < 65536 else 5)
        elif isinstance(v, (list, tuple, dict)):
            n = len(v)
            budget -= (1 if n < 16 else 3 if n < 65536 else 5)
            if isinstance(v, dict):
                if 2 * n > budget:                  # a key and a value: two bytes at least
                    return True
                push(v.keys())
                push(v.values())
            else:
                if n > budget:
                    return True
                push(v)
        elif isinstance(v, bool) or v is None:
            budget -= 1
        elif isinstance(v, int):
            budget -= (1 if -32 <= v < 128 else 2 if -128 <= v < 256 else 3 if -32768 <= v < 65536
                       else 5 if -(1 << 31) <= v < 1 << 32 else 9)
        else:
            budget -= 9                             # a float; anything else fails to pack below
        if budget < 0:
            return True
    return False


def pack_output(output: Any, limit: int) -> tuple[bytes | None, str | None]:
    """``(output packed, None)``, or ``(None, why)`` when it would pack to more than ``limit`` bytes or
    cannot be packed; a large output is refused before it is packed."""
    if output is None:
        return _NIL, None
    if _packs_over(output, limit):
        return None, f"action output exceeds the limit of {limit} bytes (max_output_bytes); nothing of it is kept"
    try:
        packed = msgpack.packb(output, use_bin_type=True)
    except Exception as e:      # a type msgpack does not know, a structure too deep
        return None, f"action output cannot be serialised: {type(e).__name__}: {e}"
    if len(packed) > limit:     # the walk's count is exact for what msgpack packs: a safeguard
        return None, f"action output of {len(packed)} bytes exceeds the limit of {limit} (max_output_bytes)"
    return packed, None


_NIL = msgpack.packb(None)


def pack_outcome(o: Outcome | list, limit: int) -> bytes:
    """``o`` packed (an :class:`Outcome` or its 8 fields in a list: a DONE or OUTCOMES item, for
    :func:`encode_packed`), or, when it would pack to more than ``limit`` bytes or cannot be packed, the
    same outcome ``failed`` with the reason in place of its output.  Meant for the thread that made the
    outcome: its cost grows with the output's size, up to about ``limit``, never past it."""
    out, err = o[3], o[4]
    t = type(out)
    small = limit >> 4
    if ((out is None or t is int or t is float or t is bool or ((t is str or t is bytes) and len(out) <= small))
            and (err is None or len(err) <= small)):
        packer = _thread_packer()
        try:     # the common case: no walk (a str of n characters packs to 4n + 5 bytes at most)
            return packer.pack(o)
        except Exception:
            packer.reset()   # an int too large for msgpack: told below
    packed, why = pack_output(o, limit)
    if packed is None:
        packed = msgpack.packb(Outcome(*o)._replace(status=Status.FAILED, output=None, error=why), use_bin_type=True)
    return packed


_packers: dict[int, msgpack.Packer] = {}      # thread id -> its packer


def _thread_packer() -> msgpack.Packer:
    """A packer for the calling thread (a Packer is not thread-safe; making one per call costs more
    than the packing of a small outcome).  A thread id may be reused: the packer goes with it."""
    packer = _packers.get(get_ident())
    if packer is None:
        packer = _packers[get_ident()] = msgpack.Packer(use_bin_type=True)
    return packer


def encode_packed(mtype: int, items: list[bytes]) -> bytes:
    """A frame of a list body whose items are packed already (as :func:`encode` would give it)."""
    p = _packer
    return b"".join((p.pack_array_header(3), p.pack(PROTOCOL_VERSION), p.pack(mtype),
                     p.pack_array_header(len(items)), *items))


class PackedList(list):
    """A list body decoded with each item as it was packed (``packed[i]``: the bytes of item ``i``),
    so a receiver may keep an item as those bytes and send it on unchanged (:func:`encode_assign`)."""

    __slots__ = ("packed",)

    def __init__(self, items: list, packed: list[bytes]):
        super().__init__(items)
        self.packed = packed


def with_packed_items(frame: bytes, body: list) -> PackedList:
    """``body``, the list body :func:`decode` read from ``frame``, with each item's bytes in the frame
    (a walk that skips over each item: about a tenth of decoding it)."""
    u = msgpack.Unpacker(max_buffer_size=len(frame) or 1)
    u.feed(frame)
    u.read_array_header()
    u.skip()                     # the version
    u.skip()                     # the type
    u.read_array_header()
    tell, skip = u.tell, u.skip
    packed = []
    start = tell()
    for _ in range(len(body)):
        skip()
        end = tell()
        packed.append(frame[start:end])
        start = end
    return PackedList(body, packed)


_ASSIGN3 = _packer.pack_array_header(3)


def encode_assign(items: list) -> bytes:
    """An ASSIGN frame.  An item's action map may be bytes, packed as its SUBMIT carried it: it is
    spliced in as it is (what a coordinator keeps of a waiting action is those bytes, not the map)."""
    parts = []
    pack = _packer.pack
    for item in items:
        wire = item[0]
        if type(wire) is not bytes:
            parts.append(pack(item))
        elif len(item) == 3 and 0 <= item[1] < 128 and 0 <= item[2] < 128:   # one byte each (positive fixint)
            parts.append(b"".join((_ASSIGN3, wire, bytes((item[1], item[2])))))
        else:
            parts.append(b"".join((_packer.pack_array_header(len(item)), wire, *map(pack, item[1:]))))
    return encode_packed(ASSIGN, parts)


def encode_packed_within(mtype: int, items: list[bytes], max_bytes: int) -> list[bytes]:
    """Packed items as frames of at most ``max_bytes`` each (one item larger than that alone)."""
    if sum(map(len, items)) <= max_bytes - 16:     # the common case: one frame
        return [encode_packed(mtype, items)]
    out: list[bytes] = []
    start, size = 0, 0
    for i, item in enumerate(items):
        if size + len(item) > max_bytes - 16 and i > start:
            out.append(encode_packed(mtype, items[start:i]))
            start, size = i, 0
        size += len(item)
    if start < len(items):
        out.append(encode_packed(mtype, items[start:]))
    return out


#: An output (or error text) up to this size may wait to be packed with its batch on the I/O thread.
SMALL_OUTCOME = 4096


def is_small(item: list) -> bool:
    """Whether an outcome's fields are small enough to be packed with its batch: None, a number
    msgpack takes, or a str or bytes of at most :data:`SMALL_OUTCOME`."""
    out, err = item[3], item[4]
    t = type(out)
    return ((out is None or t is bool or t is float or (t is int and -(1 << 63) <= out < 1 << 64)
             or ((t is str or t is bytes) and len(out) <= SMALL_OUTCOME))
            and (err is None or len(err) <= SMALL_OUTCOME))


def encode_outcomes(mtype: int, items: list, max_bytes: int) -> list[bytes]:
    """DONE or OUTCOMES frames of at most ``max_bytes`` (one larger item alone) from outcomes that are
    small lists (:func:`is_small`) or packed already (:func:`pack_outcome`): a batch of small ones is
    one encoding, as :func:`encode_within` does it."""
    if bytes not in set(map(type, items)):
        try:
            return encode_within(mtype, items, max_bytes)
        except Exception:
            pass   # is_small let something through that msgpack refuses: each item alone, below
    return encode_packed_within(mtype, [i if type(i) is bytes else pack_outcome(i, max_bytes) for i in items],
                                max_bytes)


def decode(frame: bytes, allowed: frozenset[int], max_bytes: int = MAX_FRAME_BYTES) -> tuple[MsgType, Any]:
    """Decode one frame, checking size, version, type and outer shape (items are checked by the
    ``check_*`` functions below, where the receiver takes them apart)."""
    if len(frame) > max_bytes:
        raise ProtocolError("too_large", f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        msg = msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for bad input
        raise ProtocolError("malformed", f"frame is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(msg, list) or len(msg) != 3:
        raise ProtocolError("malformed", "frame must be [version, type, body]")
    version, mtype, body = msg
    if type(version) is not int or version != PROTOCOL_VERSION:   # msgpack's true would equal 1
        raise ProtocolError("version", f"protocol version {version!r} not supported; this peer speaks {PROTOCOL_VERSION}")
    if type(mtype) is not int or mtype not in allowed:  # a list or map here is unhashable; true is no type
        raise ProtocolError("unknown_type", f"message type {mtype!r} not accepted here")
    shape = _BODY_SHAPE.get(mtype)
    if shape is not None and not isinstance(body, shape):
        raise ProtocolError("malformed", f"{NAMES[mtype]} body must be a {shape.__name__}")
    return _BY_VALUE[mtype], body


_BODY_SHAPE: dict[int, type] = {
    HELLO: dict, WELCOME: dict, SUBMIT: list, CANCEL: list, RESULT: list, STATUS: dict,
    HEARTBEAT: dict, ERROR: dict, REGISTER: dict, ASSIGN: list, DONE: list, KILL: list, STOP: dict, POOL: dict,
    CLOSE_ENV: list, ENV: list, OUTCOMES: list, PREFETCH: list,
}


def error_frame(code: str, message: str) -> bytes:
    return encode(ERROR, {"code": code, "message": message[:500]})


def check_register(body: dict) -> dict:
    """Validate a worker's REGISTER body and return it with defaults filled in."""
    out: dict[str, Any] = {}
    wid = body.get("id")
    if not isinstance(wid, str) or not 0 < len(wid) <= ID_MAX:
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
    for key in ("handle", "host", "partition", "env_root"):
        v = body.get(key)
        if v is not None and not isinstance(v, str):
            raise ProtocolError("malformed", f"REGISTER {key} must be a string")
        out[key] = v
    envs = body.get("envs", [])
    if not isinstance(envs, list) or len(envs) > 1_000_000 or not all(_env_gen_pair(e) for e in envs):
        raise ProtocolError("malformed", "REGISTER envs must be a list of [environment id, generation]")
    out["envs"] = envs
    return out


def check_worker_heartbeat(body: dict) -> dict:
    """A worker's HEARTBEAT: what the coordinator keeps of it (``services``, ``envs``) must be strings,
    the number of its environment list (``envs_v``) an integer."""
    for key in ("services", "envs"):
        v = body.get(key)
        if v is not None and not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            raise ProtocolError("malformed", f"HEARTBEAT {key} must be a list of strings")
    v = body.get("envs_v")
    if v is not None and (type(v) is not int or not 0 <= v < 1 << 62):
        raise ProtocolError("malformed", "HEARTBEAT envs_v must be a non-negative integer")
    return body


#: The longest heartbeat interval a worker accepts from a coordinator (a larger one is ignored).
MAX_HEARTBEAT_S = 3600.0


def heartbeat_interval(body: dict) -> float | None:
    """The ``heartbeat_s`` of a coordinator's WELCOME or HEARTBEAT, if it is a usable interval
    (a finite number of seconds in (0, :data:`MAX_HEARTBEAT_S`]); else None (the worker keeps its own)."""
    v = body.get("heartbeat_s")
    if type(v) not in (int, float) or not 0 < v <= MAX_HEARTBEAT_S:    # NaN fails the comparison
        return None
    return float(v)


def _env_gen_pair(e: Any) -> bool:
    return (isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and 0 < len(e[0]) <= ID_MAX
            and isinstance(e[1], int) and not isinstance(e[1], bool) and 0 <= e[1] < 1 << 62)


# -- typed items -------------------------------------------------------------------------
# The items of the list bodies travel as msgpack arrays; a receiver turns each into one of these
# (a NamedTuple packs as the same array, so a sender may build them too).

class Grant(NamedTuple):
    """An environment grant in an ASSIGN item: which generation of the environment the action runs in
    and where that copy comes from (``source``: GRANT_HELD, GRANT_NEW, GRANT_RESTORE, GRANT_ADOPT)."""
    generation: int
    source: str
    path: str | None


class Assignment(NamedTuple):
    """One ASSIGN item: the action, its attempt, the cores granted and its environment's grant."""
    spec: ActionSpec
    attempt: int
    cores: int
    grant: Grant | None


class Outcome(NamedTuple):
    """One DONE (or OUTCOMES) item: how an attempt of an action ended."""
    id: str
    attempt: int
    status: str
    output: Any
    error: str | None
    started: float
    finished: float
    env_state: str | None


class EnvReport(NamedTuple):
    """One item of a worker's ENV message."""
    op: str             # ENV_SAVED, ENV_UNSAVED, ENV_GONE
    env: str
    generation: int
    detail: str | None


_new_tuple = tuple.__new__
_GRANT_SOURCES = frozenset({GRANT_HELD, GRANT_NEW, GRANT_RESTORE, GRANT_ADOPT})
_MAX_CORES = 1 << 20


def _count(v: Any, limit: int) -> bool:
    return type(v) is int and 0 <= v < limit


def check_assign(item: Any) -> Assignment:
    """An ASSIGN item ``[action wire map, attempt, cores(, grant)]``; raises ValidationError."""
    if not isinstance(item, list) or not 3 <= len(item) <= 4:
        raise ValidationError("ASSIGN item must be [action, attempt, cores(, grant)]")
    spec = ActionSpec.from_wire(item[0])
    attempt, cores = item[1], item[2]
    if not (type(attempt) is int and type(cores) is int and 0 <= attempt < 1 << 62 and 0 <= cores < _MAX_CORES):
        raise ValidationError(f"ASSIGN item of {spec.id} has a bad attempt or core count")
    grant = item[3] if len(item) == 4 else None
    if grant is not None:
        if not (isinstance(grant, list) and len(grant) == 3 and _count(grant[0], 1 << 62)
                and grant[1] in _GRANT_SOURCES and (grant[2] is None or isinstance(grant[2], str))):
            raise ValidationError(f"ASSIGN item of {spec.id} has a malformed environment grant")
        grant = Grant(*grant)
    return _new_tuple(Assignment, (spec, attempt, cores, grant))   # as Assignment(...), without its __new__


def assigned_attempt(item: Any) -> tuple[str, int] | None:
    """The action id and attempt of an ASSIGN item :func:`check_assign` refused, when it still names
    them (so that the attempt can be answered), else None."""
    if not (isinstance(item, list) and len(item) >= 2 and isinstance(item[0], dict) and _count(item[1], 1 << 62)):
        return None
    aid = item[0].get("i")
    return (aid, item[1]) if isinstance(aid, str) and 0 < len(aid) <= ID_MAX else None


def check_done(item: Any) -> Outcome:
    """A DONE or OUTCOMES item; raises ValidationError."""
    if not isinstance(item, list) or len(item) != 8:
        raise ValidationError("DONE item must be [id, attempt, status, output, error, started, finished, env_state]")
    aid, attempt, status, output, error, started, finished, env_state = item
    if not isinstance(aid, str) or not isinstance(attempt, int) or not isinstance(status, str):
        raise ValidationError("DONE item has a bad id, attempt or status")
    if (not isinstance(started, (int, float)) or not isinstance(finished, (int, float))
            or not (isfinite(started) and isfinite(finished))):    # a NaN would poison every ACT sum
        raise ValidationError("DONE item has bad times")
    if error is not None and not isinstance(error, str):
        raise ValidationError("DONE error must be a string")
    if env_state is not None and (not isinstance(env_state, str) or env_state not in EnvState.ALL):
        raise ValidationError(f"DONE item has an unknown env_state {env_state!r}")
    return Outcome(aid, attempt, status, output, error, float(started), float(finished), env_state)


def check_env_item(item: Any) -> EnvReport:
    """One item of a worker's ENV message: (op, environment id, generation, detail)."""
    if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str) and item[0] in _ENV_FROM_WORKER
            and _env_gen_pair(item[1:3]) and (item[3] is None or isinstance(item[3], str))):
        raise ValidationError("ENV item must be [saved|unsaved|gone, environment id, generation, detail]")
    return EnvReport(*item)


#: Most services one PREFETCH names (a scheduler sends one or two a turn).
MAX_PREFETCH = 1024


def check_prefetch(body: list) -> list[str]:
    """A PREFETCH body: service names (strings of 1 to ID_MAX characters, at most MAX_PREFETCH)."""
    if len(body) > MAX_PREFETCH or not all(isinstance(s, str) and 0 < len(s) <= ID_MAX for s in body):
        raise ProtocolError("malformed", f"PREFETCH body must be a list of at most {MAX_PREFETCH} service names")
    return body


def check_ids(mtype: int, body: list) -> list[str]:
    """A CANCEL or CLOSE_ENV body: action or environment ids."""
    if len(body) > 100_000 or not all(isinstance(e, str) and 0 < len(e) <= ID_MAX for e in body):
        raise ProtocolError("malformed", f"{NAMES[mtype]} body must be a list of ids (strings of 1 to {ID_MAX} "
                                         f"characters, at most 100,000)")
    return body
