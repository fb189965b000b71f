"""The wire format between trainers and the daemon: the one place that knows frame order.

A message is a list of ZeroMQ frames (the ROUTER socket adds the peer's identity in front)::

    [header, meta, payload_0, payload_1, ...]

* ``header`` is ``HEADER``: magic, protocol version, message type, flags, request id.
* ``meta`` is a small UTF-8 JSON object whose keys depend on the type (``REQUEST_FIELDS``).
* payload frames carry raw array bytes, never pickles. A BATCH carries ``ids`` (int64),
  ``weights`` (float32), then one frame per fixed-shape field (``[n, *shape]`` in C order)
  and two per variable-length field (int64 offsets ``[n + 1]``, then the bytes).

Replies echo the request id, so a client with several requests in flight (credit-based
prefetching) can match them. Everything a peer sends is validated here before anyone acts on
it: a bad message becomes a ``ProtocolError`` naming what was wrong, never a crash.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any, NamedTuple

import numpy as np

from loaderd.client.errors import ErrorCode, ProtocolError

MAGIC = b"LDRD"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<4sBBHQ")  # magic, version, msg_type, flags, request_id
MAX_META_BYTES = 1 << 20  # a meta object larger than this is an attack or a bug
MAX_FRAMES = 4096
# ZMQ_MAXMSGSIZE for sockets: one frame may not exceed this (a batch of 256 x 1 MB fits).
MAX_FRAME_BYTES = 1 << 30

Buffer = bytes | bytearray | memoryview


class MsgType(IntEnum):
    """Message types; the comment names the meta keys and the reply."""

    PING = 1  # {} -> PONG
    PONG = 2  # {"version", "pid", "uptime_s"}
    HELLO = 3  # {"job", "rank", "world_size", "seed", "batch_size", "options", "version",
    #             "drop_last"?} -> WELCOME
    WELCOME = 4  # {"schema", "num_samples", "job", "instance"?, "shm"?}
    OPEN_PASS = 5  # {"job", "rank", "worker", "phase"} -> PASS
    PASS = 6  # {"epoch", "phase", "batches"}
    # GET_BATCH and ACK may carry "release": [index] (shared-memory slots no longer read) and
    # "loop": true (its "acks" come from the training loop's process: what it received, not
    # slots to give back; with it, "lost": [index] are batches the loop will never get, to be
    # handed out again); an ACK "end": true (the pass is over for this consumer, its
    # feedback recorded). A reply to a request with "acks" goes once they are written.
    GET_BATCH = 7  # {"job", "rank", "worker", "epoch", "phase", "acks"} -> BATCH | END
    # "instance" in WELCOME and BATCH names the daemon's run: a new one means it restarted.
    BATCH = 8  # {"epoch", "phase", "index", "n", "fields", "instance"?}; payload frames
    END = 9  # {"epoch", "phase"}: this pass has no batch left to hand out
    ACK = 10  # {"job", "rank", "worker", "epoch", "phase", "acks"} -> OK
    FEEDBACK = 11  # {"job", "kind"}; frames: ids int64, losses float32 -> OK
    OK = 12  # {} or a small result
    STATS = 13  # {"detail"?: bool (per-job importance histograms)} -> STATS_REPLY
    STATS_REPLY = 14  # the statistics object (see loaderd.stats)
    ERROR = 15  # {"code", "message"}
    SNAPSHOT_PUT = 16  # {"job", "step"}; one frame: the serialised state -> OK
    SNAPSHOT_GET = 17  # {"job"} -> SNAPSHOT | ERROR NOT_FOUND
    SNAPSHOT = 18  # {"job", "step", "bytes"}; one frame: the newest whole snapshot
    PASS_INFO = 19  # {"job", "rank", "phase"} -> PASS {"epoch", "batches": int | None}
    JOB_RESET = 20  # {"job", "force"?: bool} -> OK {"job", "removed"} | ERROR NOT_FOUND
    WAITING = 21  # {"message", "again_s"}: parked (a re-score barrier); the reply follows


class Phase(StrEnum):
    """The two kinds of pass, and of feedback: a training pass, or a forward-only re-score.

    A ``str`` subclass, so it travels in JSON meta as ``"train"`` / ``"rescore"``.
    """

    TRAIN = "train"
    RESCORE = "rescore"


class BatchKey(NamedTuple):
    """One batch of one pass of one rank: the daemon's key for assembling and delivering it."""

    job: str
    rank: int
    epoch: int
    phase: str
    batch_index: int


_PHASE_FIELDS = ("phase", "kind")  # meta keys whose value must be a Phase

# Required meta keys per request type, with the JSON type each must have. A request that lacks
# one, or has it with another type, is refused with BAD_ARGUMENT naming the key.
_INT = (int,)
_STR = (str,)
REQUEST_FIELDS: dict[MsgType, dict[str, tuple[type, ...]]] = {
    MsgType.PING: {},
    MsgType.HELLO: {
        "job": _STR,
        "rank": _INT,
        "world_size": _INT,
        "seed": _INT,
        "batch_size": _INT,
        "options": (dict,),
    },
    MsgType.OPEN_PASS: {"job": _STR, "rank": _INT, "worker": _INT, "phase": _STR},
    MsgType.GET_BATCH: {
        "job": _STR,
        "rank": _INT,
        "worker": _INT,
        "epoch": _INT,
        "phase": _STR,
        "acks": (list,),
    },
    MsgType.ACK: {
        "job": _STR,
        "rank": _INT,
        "worker": _INT,
        "epoch": _INT,
        "phase": _STR,
        "acks": (list,),
    },
    MsgType.FEEDBACK: {"job": _STR, "kind": _STR},
    MsgType.STATS: {},
    MsgType.SNAPSHOT_PUT: {"job": _STR, "step": _INT},
    MsgType.SNAPSHOT_GET: {"job": _STR},
    MsgType.PASS_INFO: {"job": _STR, "rank": _INT, "phase": _STR},
    MsgType.JOB_RESET: {"job": _STR},
}


class VersionError(ProtocolError):
    """The peer speaks another protocol version (the daemon answers BAD_VERSION)."""


@dataclass(slots=True)
class Message:
    """One decoded message: its type, request id, meta object and raw payload frames."""

    type: MsgType
    request_id: int
    meta: dict[str, Any] = field(default_factory=dict)
    frames: list[memoryview] = field(default_factory=list)
    flags: int = 0


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """How one field of a sample travels: a numpy dtype and shape, or variable-length bytes.

    ``dtype`` is a numpy dtype name (``"uint8"``, ``"float32"``, ...) for fixed-shape fields,
    or ``"binary"`` / ``"string"`` for variable-length ones (``shape`` is then ``()``).
    """

    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    # What the bytes mean (``storage.records.Kind``): "" plain, "list" (variable-length
    # numbers: ``dtype``/``shape`` are one element's), "valid", "time", "dictionary".
    kind: str = ""
    info: dict[str, Any] = field(default_factory=dict, compare=False)  # e.g. the dictionary

    @property
    def variable(self) -> bool:
        """Whether the field has a length of its own per sample."""
        return self.dtype in ("binary", "string") or self.kind == "list"

    def to_json(self) -> dict[str, Any]:
        """The field as a JSON-ready object (``kind`` and ``info`` only when set)."""
        out: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.kind:
            out["kind"] = self.kind
        if self.info:
            out["info"] = self.info
        return out

    @classmethod
    def from_json(cls, obj: Any) -> FieldSpec:
        """Parse a field sent by the daemon, checking every part."""
        try:
            name, dtype, shape = obj["name"], obj["dtype"], obj["shape"]
        except (KeyError, TypeError) as e:
            raise ProtocolError(f"malformed field spec {obj!r}") from e
        if not isinstance(name, str) or not isinstance(dtype, str) or not isinstance(shape, list):
            raise ProtocolError(f"malformed field spec {obj!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            raise ProtocolError(f"malformed field spec {obj!r}: bad shape")
        if dtype not in ("binary", "string"):
            try:
                kind = np.dtype(dtype).kind
            except TypeError as e:
                raise ProtocolError(f"field {name!r} has unknown dtype {dtype!r}") from e
            if kind not in "biuf":
                raise ProtocolError(f"field {name!r} has a non-numeric dtype {dtype!r}")
        kind, info = obj.get("kind", ""), obj.get("info", {})
        if not isinstance(kind, str) or not isinstance(info, dict):
            raise ProtocolError(f"malformed field spec {obj!r}: bad kind or info")
        return cls(name=name, dtype=dtype, shape=tuple(shape), kind=kind, info=info)


@dataclass(slots=True)
class VarColumn:
    """A variable-length field of a batch: sample i is ``data[offsets[i]:offsets[i + 1]]``."""

    offsets: np.ndarray
    data: memoryview

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def item(self, i: int) -> memoryview:
        """Sample i's bytes, without a copy."""
        return self.data[int(self.offsets[i]) : int(self.offsets[i + 1])]


Column = np.ndarray | VarColumn


@dataclass(slots=True)
class BatchArrays:
    """A batch as arrays: sample ids, per-sample weights and one column per field."""

    ids: np.ndarray
    weights: np.ndarray
    columns: dict[str, Column]


# --- encoding -------------------------------------------------------------------------------


# One encoder for every message: ``json.dumps`` with options builds a new one per call.
_META_ENCODER = json.JSONEncoder(separators=(",", ":"))


def encode(msg: Message) -> list[Buffer]:
    """Encode a message into frames (without the ROUTER identity)."""
    header = encode_header(msg.type, msg.request_id, msg.flags)
    return [header, encode_meta(msg.meta), *msg.frames]


def encode_header(type_: MsgType, request_id: int, flags: int = 0) -> bytes:
    """The header frame of a message (``encode`` without building a ``Message``)."""
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, type_, flags, request_id)


def encode_meta(meta: dict[str, Any]) -> bytes:
    """The meta frame of a message: compact UTF-8 JSON."""
    return _META_ENCODER.encode(meta).encode()


def error_message(request_id: int, code: ErrorCode, message: str) -> Message:
    """An ERROR reply for the request with this id."""
    return Message(MsgType.ERROR, request_id, {"code": int(code), "message": message})


def batch_frames(arrays: BatchArrays, schema: Sequence[FieldSpec]) -> list[Buffer]:
    """Payload frames of a BATCH in the schema's field order (arrays must be C-contiguous)."""
    frames: list[Buffer] = [_raw(arrays.ids), _raw(arrays.weights)]
    for spec in schema:
        col = arrays.columns[spec.name]
        if isinstance(col, VarColumn):
            frames += [_raw(col.offsets), col.data]
        else:
            frames.append(_raw(col))
    return frames


def _raw(a: np.ndarray) -> memoryview:
    assert a.flags.c_contiguous, "payload arrays must be C-contiguous"
    return a.reshape(-1).data.cast("B")


# --- decoding -------------------------------------------------------------------------------


def decode(frames: Sequence[Any]) -> Message:
    """Decode frames (bytes or zmq.Frame) into a Message, validating header and meta.

    Raises:
        ProtocolError: the frames are not a well-formed message of this protocol version.
    """
    if len(frames) < 2:
        raise ProtocolError(f"expected at least 2 frames (header, meta), got {len(frames)}")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(f"too many frames: {len(frames)} > {MAX_FRAMES}")
    views = [memoryview(f) for f in frames]
    head = views[0]
    if head.nbytes != HEADER.size:
        raise ProtocolError(f"header must be {HEADER.size} bytes, got {head.nbytes}")
    magic, version, type_, flags, request_id = HEADER.unpack(head)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise VersionError(
            f"this side speaks loaderd protocol {PROTOCOL_VERSION}, the peer {version}: "
            "run the same loaderd version on the daemon and the trainers"
        )
    try:
        msg_type = MsgType(type_)
    except ValueError:
        raise ProtocolError(f"unknown message type {type_}") from None
    if views[1].nbytes > MAX_META_BYTES:
        raise ProtocolError(f"meta is {views[1].nbytes} bytes, limit {MAX_META_BYTES}")
    try:
        meta = json.loads(views[1].tobytes()) if views[1].nbytes else {}
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ProtocolError(f"meta of {msg_type.name} is not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise ProtocolError(f"meta of {msg_type.name} must be a JSON object")
    return Message(msg_type, request_id, meta, views[2:], flags)


def peek_request_id(frames: Sequence[Any]) -> int:
    """The request id of a message whose decoding failed, or 0 when even the header is bad."""
    if frames and memoryview(frames[0]).nbytes == HEADER.size:
        return int(HEADER.unpack(memoryview(frames[0]))[4])
    return 0


def check_request(msg: Message) -> None:
    """Check that a request carries every meta key its type needs, with the right JSON type.

    Raises:
        ProtocolError: the type is not a request, or a key is missing or mistyped.
    """
    fields = REQUEST_FIELDS.get(msg.type)
    if fields is None:
        raise ProtocolError(f"{msg.type.name} is not a request")
    for key, types in fields.items():
        value = msg.meta.get(key)
        # bool is an int to Python, never to us
        if value is None or isinstance(value, bool) or not isinstance(value, types):
            want = "/".join(t.__name__ for t in types)
            raise ProtocolError(f"{msg.type.name}: field {key!r} must be {want}, got {value!r}")
        if key in _PHASE_FIELDS and value not in Phase.__members__.values():
            raise ProtocolError(
                f"{msg.type.name}: field {key!r} must be one of "
                f"{', '.join(p.value for p in Phase)}, got {value!r}"
            )


# Meta keys every reply of a type carries, checked by the client before it reads them: a
# daemon of another build that answers differently fails here, naming the key, not later
# with a KeyError deep in the dataset.
REPLY_FIELDS: dict[MsgType, dict[str, tuple[type, ...]]] = {
    MsgType.PONG: {"version": _INT, "pid": _INT},
    MsgType.WELCOME: {"schema": (list,), "num_samples": _INT, "job": (dict,)},
    # PASS_INFO's PASS may not know the coming pass's length yet: "batches" is then null.
    MsgType.PASS: {"epoch": _INT, "phase": _STR, "batches": (int, type(None))},
    MsgType.BATCH: {"epoch": _INT, "phase": _STR, "index": _INT, "n": _INT},
    MsgType.END: {"epoch": _INT, "phase": _STR},
    MsgType.SNAPSHOT: {"job": _STR, "step": _INT},
    MsgType.ERROR: {"code": _INT, "message": _STR},
    MsgType.WAITING: {"message": _STR, "again_s": (int, float)},
}


def check_reply(msg: Message) -> None:
    """Check that a reply carries the meta keys its type promises (``REPLY_FIELDS``).

    Raises:
        ProtocolError: a key is missing or has another JSON type.
    """
    for key, types in REPLY_FIELDS.get(msg.type, {}).items():
        value = msg.meta.get(key)
        if value is None and type(None) in types and key in msg.meta:
            continue
        if value is None or isinstance(value, bool) or not isinstance(value, types):
            want = "/".join(t.__name__ for t in types)
            raise ProtocolError(
                f"{msg.type.name} reply: field {key!r} must be {want}, got {value!r}"
            )


def check_int_list(name: str, value: Any, limit: int) -> list[int]:
    """Validate a list of non-negative ints (e.g. ``acks``) of at most ``limit`` entries."""
    if not isinstance(value, list) or len(value) > limit:
        raise ProtocolError(f"field {name!r} must be a list of at most {limit} ints")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ProtocolError(f"field {name!r} must hold non-negative ints")
    return value


def decode_error(msg: Message) -> tuple[ErrorCode, str]:
    """The code and message of an ERROR reply (an unknown code reads as INTERNAL)."""
    try:
        code = ErrorCode(int(msg.meta.get("code", ErrorCode.INTERNAL)))
    except (TypeError, ValueError):
        code = ErrorCode.INTERNAL
    return code, str(msg.meta.get("message", "no message"))


def snapshot_payload(msg: Message) -> memoryview:
    """The one payload frame of a SNAPSHOT_PUT or SNAPSHOT message.

    Raises:
        ProtocolError: the message does not carry exactly one payload frame.
    """
    if len(msg.frames) != 1:
        raise ProtocolError(f"{msg.type.name} needs 1 payload frame, got {len(msg.frames)}")
    return msg.frames[0]


def decode_feedback(msg: Message) -> tuple[np.ndarray, np.ndarray]:
    """The (ids int64, losses float32) arrays of a FEEDBACK request, without copying."""
    if len(msg.frames) != 2:
        raise ProtocolError(f"FEEDBACK needs 2 payload frames (ids, losses), got {len(msg.frames)}")
    ids_b, loss_b = msg.frames
    if ids_b.nbytes % 8 or loss_b.nbytes % 4 or ids_b.nbytes // 8 != loss_b.nbytes // 4:
        raise ProtocolError(
            f"FEEDBACK frames disagree: {ids_b.nbytes} bytes of int64 ids, "
            f"{loss_b.nbytes} bytes of float32 losses"
        )
    return np.frombuffer(ids_b, np.int64), np.frombuffer(loss_b, np.float32)


def feedback_frames(ids: np.ndarray, losses: np.ndarray) -> list[Buffer]:
    """Payload frames of a FEEDBACK request."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    losses = np.ascontiguousarray(losses, dtype=np.float32)
    if ids.shape != losses.shape or ids.ndim != 1:
        raise ValueError(f"ids {ids.shape} and losses {losses.shape} must be 1-D and equal")
    return [_raw(ids), _raw(losses)]


def decode_batch(msg: Message, schema: Sequence[FieldSpec]) -> BatchArrays:
    """Turn a BATCH's frames into arrays that view the frames' memory (no copy).

    Raises:
        ProtocolError: a frame is missing or its size does not match the schema.
    """
    n = msg.meta.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ProtocolError(f"BATCH: field 'n' must be a non-negative int, got {n!r}")
    want, plan = _batch_plan(schema)
    if len(msg.frames) != want:
        raise ProtocolError(f"BATCH of this schema needs {want} frames, got {len(msg.frames)}")
    frames = iter(msg.frames)
    ids = _array(next(frames), _INT64, (n,), "ids")
    weights = _array(next(frames), _FLOAT32, (n,), "weights")
    columns: dict[str, Column] = {}
    for name, variable, dtype, shape in plan:
        if variable:
            offsets = _array(next(frames), dtype, (n + 1,), name)
            data = next(frames)
            if n and (
                offsets[0] != 0 or offsets[-1] != data.nbytes or np.any(np.diff(offsets) < 0)
            ):
                raise ProtocolError(f"BATCH: offsets of field {name!r} do not fit its data")
            columns[name] = VarColumn(offsets, data)
        else:
            columns[name] = _array(next(frames), dtype, (n, *shape), name)
    return BatchArrays(ids, weights, columns)


_INT64 = np.dtype(np.int64)
_FLOAT32 = np.dtype(np.float32)
_FieldPlan = tuple[str, bool, "np.dtype[Any]", tuple[int, ...]]
# The last schema decoded and what decoding needs of it: every batch of a pass has the same.
_last_plan: tuple[tuple[FieldSpec, ...], int, list[_FieldPlan]] = ((), 2, [])


def _batch_plan(schema: Sequence[FieldSpec]) -> tuple[int, list[_FieldPlan]]:
    """(frames a BATCH of ``schema`` has, (name, variable, dtype, shape) per field).

    ``dtype`` is that of the field's first frame: its offsets (int64) when it is variable.
    """
    global _last_plan
    key = tuple(schema)
    last = _last_plan
    if last[0] != key:  # equal specs decode alike (``info`` plays no part here)
        plan: list[_FieldPlan] = [
            (s.name, s.variable, _INT64 if s.variable else np.dtype(s.dtype), s.shape) for s in key
        ]
        last = _last_plan = (key, 2 + sum(2 if s.variable else 1 for s in key), plan)
    return last[1], last[2]


def _array(buf: memoryview, dtype: np.dtype[Any], shape: tuple[int, ...], name: str) -> np.ndarray:
    expected = dtype.itemsize * math.prod(shape)
    if buf.nbytes != expected:
        raise ProtocolError(f"BATCH: frame {name!r} has {buf.nbytes} bytes, expected {expected}")
    return np.frombuffer(buf, dtype).reshape(shape)
