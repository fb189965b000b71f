"""client/protocol.py: message round trips, malformed frames, request checks and BATCH payloads."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from loaderd.client.errors import ErrorCode, ProtocolError, RemoteError
from loaderd.client.protocol import (
    HEADER,
    MAGIC,
    MAX_FRAMES,
    MAX_META_BYTES,
    PROTOCOL_VERSION,
    REQUEST_FIELDS,
    BatchArrays,
    FieldSpec,
    Message,
    MsgType,
    Phase,
    VarColumn,
    VersionError,
    batch_frames,
    check_int_list,
    check_reply,
    check_request,
    decode,
    decode_batch,
    decode_error,
    decode_feedback,
    encode,
    error_message,
    feedback_frames,
    peek_request_id,
)

# ---------------------------------------------------------------- helpers

VALID_META: dict[MsgType, dict[str, Any]] = {
    MsgType.PING: {},
    MsgType.HELLO: {
        "job": "j",
        "rank": 0,
        "world_size": 2,
        "seed": 7,
        "batch_size": 32,
        "options": {"sampler": "uniform"},
    },
    MsgType.OPEN_PASS: {"job": "j", "rank": 1, "worker": 3, "phase": "train"},
    MsgType.GET_BATCH: {
        "job": "j",
        "rank": 0,
        "worker": 0,
        "epoch": 2,
        "phase": "rescore",
        "acks": [1, 2],
    },
    MsgType.ACK: {"job": "j", "rank": 0, "worker": 1, "epoch": 0, "phase": "train", "acks": []},
    MsgType.FEEDBACK: {"job": "j", "kind": "train"},
    MsgType.STATS: {},
    MsgType.SNAPSHOT_PUT: {"job": "j", "step": 100},
    MsgType.SNAPSHOT_GET: {"job": "j"},
    MsgType.PASS_INFO: {"job": "j", "rank": 0, "phase": "train"},
    MsgType.JOB_RESET: {"job": "j"},
}


def header(
    *,
    magic: bytes = MAGIC,
    version: int = PROTOCOL_VERSION,
    msg_type: int = int(MsgType.PING),
    flags: int = 0,
    request_id: int = 1,
) -> bytes:
    return HEADER.pack(magic, version, msg_type, flags, request_id)


def as_bytes(frames: list[Any]) -> list[bytes]:
    """What actually crosses the socket: each frame as plain bytes."""
    return [bytes(f) for f in frames]


SCHEMA = (
    FieldSpec("image", "uint8", (2, 3)),
    FieldSpec("label", "int64"),
    FieldSpec("blob", "binary"),
    FieldSpec("caption", "string"),
    FieldSpec("emb", "float32", (4,)),
)


def make_batch(n: int, seed: int = 0) -> BatchArrays:
    rng = np.random.default_rng(seed)
    blobs = [rng.bytes(int(k)) for k in rng.integers(0, 9, n)]
    captions = [f"cap-{i}-é".encode() * (i % 3) for i in range(n)]

    def var(items: list[bytes]) -> VarColumn:
        offsets = np.zeros(n + 1, np.int64)
        offsets[1:] = np.cumsum([len(b) for b in items])
        return VarColumn(offsets, memoryview(b"".join(items)))

    return BatchArrays(
        ids=rng.integers(0, 1 << 40, n).astype(np.int64),
        weights=rng.random(n).astype(np.float32),
        columns={
            "image": rng.integers(0, 256, (n, 2, 3)).astype(np.uint8),
            "label": rng.integers(-5, 5, n).astype(np.int64),
            "blob": var(blobs),
            "caption": var(captions),
            "emb": rng.standard_normal((n, 4)).astype(np.float32),
        },
    )


def batch_message(frames: list[Any], n: int) -> Message:
    return decode([header(msg_type=MsgType.BATCH), json.dumps({"n": n}).encode(), *frames])


# ---------------------------------------------------------------- encode / decode


@pytest.mark.parametrize("msg_type", list(MsgType), ids=lambda t: t.name)
def test_every_message_type_round_trips(msg_type: MsgType) -> None:
    meta = VALID_META.get(msg_type, {"epoch": 3, "note": "ünï", "nested": {"a": [1, 2.5, None]}})
    payload = [b"\x00\x01\x02", b"", np.arange(5, dtype=np.int64).tobytes()]
    msg = Message(msg_type, request_id=2**64 - 1, meta=meta, frames=payload, flags=0xBEEF)

    frames = as_bytes(encode(msg))
    assert len(frames) == 2 + len(payload)
    assert len(frames[0]) == HEADER.size and frames[0][:4] == MAGIC

    out = decode(frames)
    assert out.type is msg_type
    assert out.request_id == 2**64 - 1
    assert out.flags == 0xBEEF
    assert out.meta == meta
    assert [bytes(f) for f in out.frames] == payload


def test_decode_accepts_empty_meta_as_empty_object() -> None:
    msg = decode([header(msg_type=MsgType.STATS, request_id=9), b""])
    assert msg.type is MsgType.STATS and msg.meta == {} and msg.frames == []


def test_decode_payload_frames_are_views_of_the_input() -> None:
    payload = bytearray(b"abcdef")
    msg = decode([header(), b"{}", payload])
    payload[0] = ord("z")
    assert bytes(msg.frames[0]) == b"zbcdef"


def test_error_message_round_trips_its_code() -> None:
    out = decode(as_bytes(encode(error_message(42, ErrorCode.BAD_RANK, "rank 9 out of range"))))
    assert out.type is MsgType.ERROR and out.request_id == 42
    assert decode_error(out) == (ErrorCode.BAD_RANK, "rank 9 out of range")


@pytest.mark.parametrize("code", [999, "x", None])
def test_decode_error_reads_unknown_codes_as_internal(code: Any) -> None:
    meta = {} if code is None else {"code": code, "message": "m"}
    code_out, _ = decode_error(Message(MsgType.ERROR, 1, meta))
    assert code_out is ErrorCode.INTERNAL


# ---------------------------------------------------------------- bad frames


def test_a_remote_error_re_raised_by_a_dataloader_keeps_its_type_and_code() -> None:
    from torch._utils import ExceptionWrapper  # what a DataLoader re-raises workers' errors with

    try:
        raise RemoteError(ErrorCode.CORRUPT_RECORD, "sample 7: checksum mismatch in store /x")
    except RemoteError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 1")
    with pytest.raises(RemoteError) as got:
        wrapped.reraise()
    assert got.value.code == ErrorCode.CORRUPT_RECORD
    assert got.value.message == "sample 7: checksum mismatch in store /x"
    assert "worker process 1" in str(got.value)  # the worker's traceback is kept
    # Raised with no reference to itself from its traceback's frames: no cycle keeps the
    # DataLoader's iterator alive past the loop (its next epoch's workers would inherit it).
    tb, frames = got.value.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    assert not any(v is got.value for f in frames for v in f.f_locals.values())
    with pytest.raises(TypeError):
        RemoteError("a text without the error's line")  # a DataLoader then raises RuntimeError


def test_too_few_frames() -> None:
    with pytest.raises(ProtocolError, match=r"at least 2 frames.*got 1"):
        decode([header()])
    with pytest.raises(ProtocolError, match="got 0"):
        decode([])


def test_too_many_frames() -> None:
    with pytest.raises(ProtocolError, match="too many frames"):
        decode([header(), b"{}", *([b""] * (MAX_FRAMES - 1))])


@pytest.mark.parametrize("size", [0, HEADER.size - 1, HEADER.size + 1])
def test_wrong_header_size(size: int) -> None:
    with pytest.raises(ProtocolError, match=f"header must be {HEADER.size} bytes, got {size}"):
        decode([b"\x00" * size, b"{}"])


def test_bad_magic() -> None:
    with pytest.raises(ProtocolError, match="bad magic b'XXXX'"):
        decode([header(magic=b"XXXX"), b"{}"])


def test_wrong_version_names_both_versions() -> None:
    with pytest.raises(ProtocolError) as info:
        decode([header(version=PROTOCOL_VERSION + 6), b"{}"])
    text = str(info.value)
    assert str(PROTOCOL_VERSION) in text and str(PROTOCOL_VERSION + 6) in text


@pytest.mark.parametrize("type_", [0, 99, 255])
def test_unknown_type(type_: int) -> None:
    with pytest.raises(ProtocolError, match=f"unknown message type {type_}"):
        decode([header(msg_type=type_), b"{}"])


@pytest.mark.parametrize("meta", [b"{", b"not json", b"\xff\xfe\x00garbage", b'{"a":1}x'])
def test_non_json_meta(meta: bytes) -> None:
    with pytest.raises(ProtocolError, match="meta of PING is not JSON"):
        decode([header(), meta])


@pytest.mark.parametrize("meta", [b"[1,2]", b"3", b'"s"', b"null", b"true"])
def test_non_object_meta(meta: bytes) -> None:
    with pytest.raises(ProtocolError, match="must be a JSON object"):
        decode([header(), meta])


def test_oversize_meta() -> None:
    meta = b'{"k":"' + b"a" * MAX_META_BYTES + b'"}'
    with pytest.raises(ProtocolError, match=f"limit {MAX_META_BYTES}"):
        decode([header(), meta])


def test_meta_at_the_limit_is_accepted() -> None:
    filler = MAX_META_BYTES - len(b'{"k":""}')
    meta = b'{"k":"' + b"a" * filler + b'"}'
    assert len(meta) == MAX_META_BYTES
    assert len(decode([header(), meta]).meta["k"]) == filler


def test_deeply_nested_meta_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode([header(), b"[" * 100_000])


def test_peek_request_id() -> None:
    assert peek_request_id([header(request_id=1234, magic=b"nope"), b"garbage"]) == 1234
    assert peek_request_id([b"short"]) == 0
    assert peek_request_id([]) == 0


# ---------------------------------------------------------------- check_request


@pytest.mark.parametrize("msg_type", list(REQUEST_FIELDS), ids=lambda t: t.name)
def test_check_request_accepts_valid_requests(msg_type: MsgType) -> None:
    check_request(Message(msg_type, 1, dict(VALID_META[msg_type])))


@pytest.mark.parametrize("msg_type", [t for t in MsgType if t not in REQUEST_FIELDS])
def test_check_request_refuses_replies(msg_type: MsgType) -> None:
    with pytest.raises(ProtocolError, match=f"{msg_type.name} is not a request"):
        check_request(Message(msg_type, 1, {}))


REQUIRED_KEYS = [(t, k) for t, keys in REQUEST_FIELDS.items() for k in keys]


@pytest.mark.parametrize(("msg_type", "key"), REQUIRED_KEYS, ids=lambda v: getattr(v, "name", v))
def test_check_request_missing_key_is_named(msg_type: MsgType, key: str) -> None:
    meta = dict(VALID_META[msg_type])
    del meta[key]
    with pytest.raises(ProtocolError, match=f"{msg_type.name}: field '{key}' must be"):
        check_request(Message(msg_type, 1, meta))


@pytest.mark.parametrize(("msg_type", "key"), REQUIRED_KEYS, ids=lambda v: getattr(v, "name", v))
def test_check_request_wrong_type_is_named(msg_type: MsgType, key: str) -> None:
    meta = dict(VALID_META[msg_type])
    # a value of a JSON type that none of the allowed types is
    meta[key] = {"x": 1} if isinstance(meta[key], list | str | int) else [1]
    with pytest.raises(ProtocolError, match=f"field '{key}'"):
        check_request(Message(msg_type, 1, meta))


@pytest.mark.parametrize("key", ["rank", "world_size", "seed", "batch_size"])
@pytest.mark.parametrize("value", [True, False, 1.0, "1", None])
def test_check_request_refuses_bool_float_str_for_int(key: str, value: Any) -> None:
    meta = dict(VALID_META[MsgType.HELLO], **{key: value})
    with pytest.raises(ProtocolError, match=f"field '{key}' must be int, got {value!r}"):
        check_request(Message(MsgType.HELLO, 1, meta))


def test_check_request_ignores_extra_keys() -> None:
    check_request(Message(MsgType.PING, 1, {"extra": [1, 2]}))


# ---------------------------------------------------------------- check_int_list


def test_check_int_list_accepts_and_returns() -> None:
    assert check_int_list("acks", [0, 5, 2**40], 3) == [0, 5, 2**40]
    assert check_int_list("acks", [], 0) == []


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        ([1, 2, 3, 4], "at most 3 ints"),
        ("123", "at most 3 ints"),
        ((1, 2), "at most 3 ints"),
        (None, "at most 3 ints"),
        ([1, -1], "non-negative ints"),
        ([1, True], "non-negative ints"),
        ([1.0], "non-negative ints"),
        (["1"], "non-negative ints"),
        ([None], "non-negative ints"),
    ],
)
def test_check_int_list_refuses(value: Any, pattern: str) -> None:
    with pytest.raises(ProtocolError, match=f"field 'acks' must .*{pattern}"):
        check_int_list("acks", value, 3)


# ---------------------------------------------------------------- feedback


def test_feedback_round_trip_without_copy() -> None:
    ids = np.array([3, 1, 2**40], np.int64)
    losses = np.array([0.5, np.inf, -1.25], np.float32)
    frames = as_bytes(feedback_frames(ids, losses))
    msg = decode([header(msg_type=MsgType.FEEDBACK), b'{"job":"j","kind":"train"}', *frames])
    ids_out, losses_out = decode_feedback(msg)
    assert ids_out.dtype == np.int64 and losses_out.dtype == np.float32
    np.testing.assert_array_equal(ids_out, ids)
    np.testing.assert_array_equal(losses_out, losses)
    assert np.shares_memory(ids_out, np.frombuffer(msg.frames[0], np.uint8))


def test_feedback_frames_converts_dtypes() -> None:
    ids_b, loss_b = feedback_frames(np.array([1, 2], np.int32), np.array([1.0, 2.0]))
    assert bytes(ids_b) == np.array([1, 2], np.int64).tobytes()
    assert bytes(loss_b) == np.array([1, 2], np.float32).tobytes()


@pytest.mark.parametrize(
    ("ids", "losses"), [(np.zeros(3), np.zeros(2)), (np.zeros((2, 2)), np.zeros((2, 2)))]
)
def test_feedback_frames_refuses_mismatched_shapes(ids: np.ndarray, losses: np.ndarray) -> None:
    with pytest.raises(ValueError, match="must be 1-D and equal"):
        feedback_frames(ids, losses)


@pytest.mark.parametrize(
    ("ids_bytes", "loss_bytes"),
    [
        (16, 4),  # 2 ids, 1 loss
        (8, 8),  # 1 id, 2 losses
        (12, 6),  # not whole int64s / float32s
        (7, 0),
    ],
)
def test_decode_feedback_size_mismatch(ids_bytes: int, loss_bytes: int) -> None:
    msg = Message(
        MsgType.FEEDBACK, 1, {}, [memoryview(b"\0" * ids_bytes), memoryview(b"\0" * loss_bytes)]
    )
    with pytest.raises(ProtocolError, match=f"{ids_bytes} bytes of int64 ids, {loss_bytes} bytes"):
        decode_feedback(msg)


@pytest.mark.parametrize("n_frames", [0, 1, 3])
def test_decode_feedback_frame_count(n_frames: int) -> None:
    msg = Message(MsgType.FEEDBACK, 1, {}, [memoryview(b"")] * n_frames)
    with pytest.raises(ProtocolError, match=f"needs 2 payload frames.*got {n_frames}"):
        decode_feedback(msg)


def test_decode_feedback_empty() -> None:
    ids, losses = decode_feedback(Message(MsgType.FEEDBACK, 1, {}, [memoryview(b"")] * 2))
    assert ids.shape == (0,) and losses.shape == (0,)


# ---------------------------------------------------------------- batches


@pytest.mark.parametrize("n", [1, 7])
def test_batch_round_trip(n: int) -> None:
    batch = make_batch(n, seed=n)
    frames = as_bytes(batch_frames(batch, SCHEMA))
    assert len(frames) == 2 + 1 + 1 + 2 + 2 + 1
    out = decode_batch(batch_message(frames, n), SCHEMA)

    np.testing.assert_array_equal(out.ids, batch.ids)
    np.testing.assert_array_equal(out.weights, batch.weights)
    for spec in SCHEMA:
        got, want = out.columns[spec.name], batch.columns[spec.name]
        if spec.variable:
            assert isinstance(got, VarColumn) and isinstance(want, VarColumn)
            assert len(got) == n
            assert [bytes(got.item(i)) for i in range(n)] == [bytes(want.item(i)) for i in range(n)]
        else:
            assert isinstance(got, np.ndarray)
            assert got.dtype == np.dtype(spec.dtype) and got.shape == (n, *spec.shape)
            np.testing.assert_array_equal(got, want)


SCALAR_SCHEMA = (FieldSpec("label", "int64"), FieldSpec("blob", "binary"))


def test_empty_batch_round_trip_without_shaped_fields() -> None:
    full = make_batch(0)
    batch = BatchArrays(
        full.ids, full.weights, {s.name: full.columns[s.name] for s in SCALAR_SCHEMA}
    )
    out = decode_batch(
        batch_message(as_bytes(batch_frames(batch, SCALAR_SCHEMA)), 0), SCALAR_SCHEMA
    )
    assert out.ids.shape == (0,) and out.columns["label"].shape == (0,)
    assert len(out.columns["blob"]) == 0


def test_empty_batch_with_shaped_fields_round_trips() -> None:
    frames = as_bytes(batch_frames(make_batch(0), SCHEMA))
    out = decode_batch(batch_message(frames, 0), SCHEMA)
    assert out.columns["image"].shape == (0, 2, 3)


def test_batch_string_items_decode_to_the_original_text() -> None:
    batch = make_batch(5)
    out = decode_batch(batch_message(as_bytes(batch_frames(batch, SCHEMA)), 5), SCHEMA)
    col = out.columns["caption"]
    assert isinstance(col, VarColumn)
    assert bytes(col.item(2)).decode() == "cap-2-é" * 2


def test_decode_batch_is_zero_copy() -> None:
    batch = make_batch(6)
    msg = batch_message(as_bytes(batch_frames(batch, SCHEMA)), 6)
    out = decode_batch(msg, SCHEMA)
    frame = {
        name: np.frombuffer(f, np.uint8)
        for name, f in zip(
            ["ids", "weights", "image", "label", "blob_off", "blob", "cap_off", "cap", "emb"],
            msg.frames,
            strict=True,
        )
    }
    assert np.shares_memory(out.ids, frame["ids"])
    assert np.shares_memory(out.weights, frame["weights"])
    assert np.shares_memory(out.columns["image"], frame["image"])
    assert np.shares_memory(out.columns["emb"], frame["emb"])
    blob = out.columns["blob"]
    assert isinstance(blob, VarColumn)
    assert np.shares_memory(blob.offsets, frame["blob_off"])
    assert np.shares_memory(np.frombuffer(blob.item(1), np.uint8), frame["blob"]) or (
        blob.item(1).nbytes == 0
    )
    assert np.shares_memory(np.frombuffer(blob.data, np.uint8), frame["blob"])


def test_decode_batch_follows_a_changed_schema() -> None:
    """A schema of the same names but other dtypes (a daemon restarted on another store)."""
    first = [FieldSpec("x", "int64", (2,))]
    msg = Message(MsgType.BATCH, 1, {"n": 1}, [memoryview(b"\0" * 8), memoryview(b"\0" * 4)])
    msg.frames.append(memoryview(np.array([[1, 2]], np.int64).tobytes()))
    assert decode_batch(msg, first).columns["x"].dtype == np.int64  # type: ignore[union-attr]
    second = [FieldSpec("x", "float32", (4,))]
    out = decode_batch(msg, second).columns["x"]
    assert out.dtype == np.float32 and out.shape == (1, 4)  # type: ignore[union-attr]
    with pytest.raises(ProtocolError, match="needs 4 frames"):
        decode_batch(msg, [FieldSpec("x", "binary")])


def test_batch_frames_are_views_of_the_arrays() -> None:
    batch = make_batch(4)
    frames = batch_frames(batch, SCHEMA)
    assert np.shares_memory(np.frombuffer(frames[0], np.uint8), batch.ids)
    assert np.shares_memory(np.frombuffer(frames[2], np.uint8), batch.columns["image"])


def wire(n: int = 4) -> list[bytes]:
    return as_bytes(batch_frames(make_batch(n), SCHEMA))


@pytest.mark.parametrize(
    ("index", "name"),
    [(0, "ids"), (1, "weights"), (2, "image"), (3, "label"), (4, "blob"), (8, "emb")],
)
@pytest.mark.parametrize("delta", [-1, 1])
def test_decode_batch_refuses_wrong_frame_size(index: int, name: str, delta: int) -> None:
    frames = wire()
    frames[index] = frames[index][:-1] if delta < 0 else frames[index] + b"\0"
    with pytest.raises(ProtocolError, match=f"frame '{name}' has"):
        decode_batch(batch_message(frames, 4), SCHEMA)


@pytest.mark.parametrize("count", [8, 10, 2])
def test_decode_batch_refuses_wrong_frame_count(count: int) -> None:
    frames = [*wire(), b""][:count]
    with pytest.raises(ProtocolError, match=f"needs 9 frames, got {count}"):
        decode_batch(batch_message(frames, 4), SCHEMA)


def offsets_frame(values: list[int]) -> bytes:
    return np.array(values, np.int64).tobytes()


@pytest.mark.parametrize(
    "offsets",
    [
        [1, 2, 3, 4, 6],  # does not start at 0
        [0, 1, 2, 3, 5],  # ends before the data does
        [0, 1, 2, 3, 7],  # ends past the data
        [0, 4, 2, 5, 6],  # goes backwards
        [0, -1, 2, 3, 6],
    ],
)
def test_decode_batch_refuses_bad_offsets(offsets: list[int]) -> None:
    frames = wire()
    frames[4], frames[5] = offsets_frame(offsets), b"x" * 6
    with pytest.raises(ProtocolError, match="offsets of field 'blob' do not fit its data"):
        decode_batch(batch_message(frames, 4), SCHEMA)


@pytest.mark.parametrize("n", [-1, "4", 4.0, True, None])
def test_decode_batch_refuses_bad_n(n: Any) -> None:
    msg = Message(MsgType.BATCH, 1, {} if n is None else {"n": n}, [])
    with pytest.raises(ProtocolError, match="field 'n' must be a non-negative int"):
        decode_batch(msg, SCHEMA)


def test_decode_batch_n_disagrees_with_frames() -> None:
    with pytest.raises(ProtocolError, match="frame 'ids' has 32 bytes, expected 40"):
        decode_batch(batch_message(wire(4), 5), SCHEMA)


# ---------------------------------------------------------------- FieldSpec


@pytest.mark.parametrize(
    "spec",
    [
        FieldSpec("a", "uint8", (32, 32, 3)),
        FieldSpec("b", "float16"),
        FieldSpec("c", "binary"),
        FieldSpec("d", "string"),
    ],
)
def test_field_spec_json_round_trip(spec: FieldSpec) -> None:
    assert FieldSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert spec.variable == (spec.dtype in ("binary", "string"))


@pytest.mark.parametrize(
    ("obj", "pattern"),
    [
        ({"dtype": "uint8", "shape": []}, "malformed field spec"),
        ({"name": "a", "shape": []}, "malformed field spec"),
        ({"name": "a", "dtype": "uint8"}, "malformed field spec"),
        ({"name": "a", "dtype": "uint8", "shape": 3}, "malformed field spec"),
        ({"name": "a", "dtype": "uint8", "shape": ["x"]}, "malformed field spec"),
        ({"name": "a", "dtype": "uint8", "shape": [None]}, "malformed field spec"),
        ({"name": 1, "dtype": "uint8", "shape": []}, "malformed field spec"),
        ({"name": "a", "dtype": 5, "shape": []}, "malformed field spec"),
        (["a", "uint8", []], "malformed field spec"),
        (None, "malformed field spec"),
        ({"name": "a", "dtype": "floaty", "shape": []}, "field 'a' has unknown dtype 'floaty'"),
    ],
)
def test_field_spec_from_json_refuses(obj: Any, pattern: str) -> None:
    with pytest.raises(ProtocolError, match=pattern):
        FieldSpec.from_json(obj)


@pytest.mark.parametrize("shape", ["12", [-1], [2, -3]])
def test_field_spec_from_json_refuses_bad_shapes(shape: Any) -> None:
    with pytest.raises(ProtocolError):
        FieldSpec.from_json({"name": "a", "dtype": "uint8", "shape": shape})


def test_field_spec_from_json_refuses_object_dtype() -> None:
    with pytest.raises(ProtocolError):
        FieldSpec.from_json({"name": "a", "dtype": "object", "shape": []})


def test_phase_fields_must_name_a_phase() -> None:
    meta = dict(VALID_META[MsgType.OPEN_PASS], phase="eval")
    with pytest.raises(ProtocolError, match="field 'phase' must be one of train, rescore"):
        check_request(Message(MsgType.OPEN_PASS, 1, meta))
    meta = dict(VALID_META[MsgType.FEEDBACK], kind="test")
    with pytest.raises(ProtocolError, match="field 'kind' must be one of train, rescore"):
        check_request(Message(MsgType.FEEDBACK, 1, meta))
    assert json.loads(encode(Message(MsgType.PASS, 1, {"phase": Phase.RESCORE}))[1]) == {
        "phase": "rescore"
    }


def test_replies_are_checked_before_the_client_reads_them() -> None:
    check_reply(Message(MsgType.PASS, 1, {"epoch": 2, "phase": "train", "batches": 3}))
    check_reply(Message(MsgType.OK, 1, {}))  # no promised keys
    with pytest.raises(ProtocolError, match="PASS reply: field 'epoch' must be int"):
        check_reply(Message(MsgType.PASS, 1, {"phase": "train", "batches": 3}))
    with pytest.raises(ProtocolError, match="WELCOME reply: field 'num_samples'"):
        check_reply(Message(MsgType.WELCOME, 1, {"schema": [], "num_samples": "9", "job": {}}))


def test_a_wrong_version_is_a_version_error() -> None:
    with pytest.raises(VersionError, match="run the same loaderd version"):
        decode([header(version=PROTOCOL_VERSION + 1), b"{}"])
