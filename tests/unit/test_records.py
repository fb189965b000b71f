"""storage/records.py: schema validation, Arrow round trip, record codec and checksums."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from loaderd.storage.checksum import xxh3_64
from loaderd.storage.errors import CorruptRecordError
from loaderd.storage.records import (
    RECORD_HEADER,
    RECORD_VERSION,
    STORED_VERSION,
    Field,
    RecordCodec,
    Schema,
    seal,
    stamp,
    verify,
    verify_all,
)

FULL = Schema(
    (
        Field("image", "uint8", (3, 5, 2)),
        Field("label", "int64"),
        Field("flag", "bool"),
        Field("blob", "binary"),
        Field("emb", "float16", (3,)),
        Field("caption", "string"),
        Field("score", "float64"),
        Field("small", "int8", (1,)),
        Field("u32", "uint32", (2, 2)),
    )
)


def full_sample(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.integers(0, 256, (3, 5, 2), dtype=np.uint8),
        "label": int(rng.integers(-(2**62), 2**62)),
        "flag": True,
        "blob": rng.bytes(int(rng.integers(0, 40))),
        "emb": rng.standard_normal(3).astype(np.float16),
        "caption": "naïve café ☕" * int(rng.integers(0, 3)),
        "score": -1.5e300,
        "small": [-128],
        "u32": [[0, 1], [2**32 - 1, 7]],
    }


# ---------------------------------------------------------------- schema validation


def test_schema_refuses_duplicate_names() -> None:
    with pytest.raises(ValueError, match="duplicate field names"):
        Schema((Field("a", "uint8"), Field("b", "binary"), Field("a", "int64")))


@pytest.mark.parametrize("name", ["id", "weight"])
def test_schema_refuses_reserved_names(name: str) -> None:
    with pytest.raises(ValueError, match=f"\\['{name}'\\] are reserved"):
        Schema((Field("x", "uint8"), Field(name, "int64")))


def test_schema_refuses_no_fields() -> None:
    with pytest.raises(ValueError, match="at least one field"):
        Schema(())


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        ("complex64", ()),
        ("U4", ()),
        ("object", ()),
        ("datetime64[ns]", ()),
        (">f4", ()),
        (">i8", (2,)),
    ],
)
def test_field_refuses_unsupported_dtypes(dtype: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"field 'x': unsupported dtype"):
        Field("x", dtype, shape)


def test_field_refuses_unknown_dtype() -> None:
    with pytest.raises(TypeError):
        Field("x", "floaty")


@pytest.mark.parametrize("shape", [(0,), (3, 0), (-1,)])
def test_field_refuses_empty_dimensions(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="empty dimension"):
        Field("x", "uint8", shape)


@pytest.mark.parametrize("dtype", ["binary", "string"])
def test_variable_fields_have_no_shape(dtype: str) -> None:
    with pytest.raises(ValueError, match=f"{dtype} fields have no shape"):
        Field("x", dtype, (3,))
    assert Field("x", dtype).variable


def test_field_needs_a_name() -> None:
    with pytest.raises(ValueError, match="needs a name"):
        Field("", "uint8")


def test_layout_aligns_fixed_fields_and_lists_variable_ones() -> None:
    layout = FULL.layout
    assert layout.offsets == {
        "image": 0,  # 30 bytes -> 32
        "label": 32,
        "flag": 40,
        "emb": 48,  # 6 bytes -> 8
        "score": 56,
        "small": 64,
        "u32": 72,  # 16 bytes
    }
    assert layout.fixed_bytes == 88
    assert layout.variable == ("blob", "caption")
    assert all(off % 8 == 0 for off in layout.offsets.values())


# ---------------------------------------------------------------- Arrow / JSON round trip


@pytest.mark.parametrize(
    "schema",
    [
        FULL,
        Schema((Field("only", "binary"),)),
        Schema((Field("t", "float32", (1,)), Field("s", "string"))),
        Schema(tuple(Field(f"f{i}", d) for i, d in enumerate(["int16", "uint64", "float32"]))),
    ],
)
def test_schema_arrow_round_trip(schema: Schema) -> None:
    arrow = schema.to_arrow()
    assert arrow.names == [f.name for f in schema.fields]
    assert Schema.from_arrow(arrow) == schema
    # through the IPC bytes the store keeps in its meta database
    raw = arrow.serialize().to_pybytes()
    assert Schema.from_arrow(pa.ipc.read_schema(pa.py_buffer(raw))) == schema


def test_arrow_types_of_fixed_and_variable_fields() -> None:
    arrow = FULL.to_arrow()
    assert arrow.field("image").type == pa.list_(pa.uint8(), 30)
    assert arrow.field("label").type == pa.int64()
    assert arrow.field("blob").type == pa.binary()
    assert arrow.field("caption").type == pa.string()


def test_schema_json_round_trip() -> None:
    assert Schema.from_json(FULL.to_json()) == FULL


# ---------------------------------------------------------------- codec


def test_codec_round_trips_every_kind_of_field() -> None:
    codec = RecordCodec(FULL)
    for seed in range(5):
        sample = full_sample(seed)
        out = codec.decode(codec.encode(sample), seed, "test")
        assert set(out) == {f.name for f in FULL.fields}
        for f in FULL.fields:
            if f.variable:
                assert out[f.name] == sample[f.name]
                assert isinstance(out[f.name], str if f.dtype == "string" else bytes)
            else:
                assert out[f.name].dtype == np.dtype(f.dtype)
                assert out[f.name].shape == f.shape
                np.testing.assert_array_equal(out[f.name], np.asarray(sample[f.name], f.dtype))


def test_codec_record_layout_matches_the_header() -> None:
    codec = RecordCodec(FULL)
    rec = codec.encode(full_sample())
    digest, length, version = RECORD_HEADER.unpack_from(rec)
    assert version == RECORD_VERSION
    assert length == len(rec) - RECORD_HEADER.size
    assert digest == xxhash.xxh3_64_intdigest(rec[RECORD_HEADER.size :])
    # the fixed part sits where the layout says: one slice, no parsing
    body = rec[RECORD_HEADER.size :]
    off = FULL.layout.offsets["label"]
    assert np.frombuffer(body, np.int64, 1, off)[0] == full_sample()["label"]


def test_codec_decode_copies_nothing() -> None:
    codec = RecordCodec(Schema((Field("a", "float32", (4,)), Field("b", "binary"))))
    rec = bytearray(codec.encode({"a": np.arange(4), "b": b"xy"}))
    out = codec.decode(memoryview(rec), 0, "t")
    assert np.shares_memory(out["a"], np.frombuffer(rec, np.uint8))


def test_codec_accepts_bytearray_and_memoryview_for_binary() -> None:
    codec = RecordCodec(Schema((Field("b", "binary"), Field("s", "string"))))
    rec = codec.encode({"b": memoryview(b"abc"), "s": bytearray(b"raw")})
    assert codec.decode(rec, 1, "t") == {"b": b"abc", "s": "raw"}


@pytest.mark.parametrize(
    ("sample", "pattern"),
    [
        ({"label": 1, "blob": b""}, "sample has no field 'image'"),
        ({"image": np.zeros((2, 2)), "label": 1, "blob": b""}, r"field 'image': expected shape"),
        ({"image": np.zeros((2, 3)), "label": [1, 2], "blob": b""}, "field 'label'"),
        ({"image": np.zeros((2, 3)), "label": 1}, "field 'blob': expected bytes or str"),
        ({"image": np.zeros((2, 3)), "label": 1, "blob": 5}, "got int"),
    ],
)
def test_codec_encode_refuses_bad_samples(sample: dict[str, Any], pattern: str) -> None:
    codec = RecordCodec(
        Schema((Field("image", "uint8", (2, 3)), Field("label", "int64"), Field("blob", "binary")))
    )
    with pytest.raises(ValueError, match=pattern):
        codec.encode(sample)


def test_codec_encode_out_of_range_value_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        RecordCodec(Schema((Field("a", "uint8"),))).encode({"a": 300})


# ---------------------------------------------------------------- corruption


def test_seal_and_verify() -> None:
    body = b"hello world"
    assert bytes(verify(seal(body), 3, "x")) == body


@pytest.mark.parametrize("size", [0, 65_536, 65_537, 100_000])  # python-xxhash's own, then ours
def test_checksum_of_any_size_matches_xxhash_and_catches_a_flipped_byte(size: int) -> None:
    body = np.random.default_rng(size).integers(0, 256, size, np.uint8).tobytes()
    view = memoryview(b"pad" + body)[3:]  # a view at an odd address, as a store's record
    assert xxh3_64(view) == xxh3_64(body) == xxhash.xxh3_64_intdigest(body)
    assert xxh3_64(view, 2**40 + 7) == xxhash.xxh3_64_intdigest(body, 2**40 + 7)
    record = bytearray(seal(body))
    assert bytes(verify(memoryview(bytes(record)), 5, "x")) == body
    if size:
        record[RECORD_HEADER.size + size // 2] ^= 0x10
        with pytest.raises(CorruptRecordError, match="sample 5"):
            verify(memoryview(bytes(record)), 5, "x")


SMALL = Schema((Field("x", "float32", (3,)), Field("tag", "string")))
SMALL_RECORD = RecordCodec(SMALL).encode({"x": [1, 2, 3], "tag": "abc"})


@settings(max_examples=150, deadline=None)
@given(
    bit=st.integers(0, len(SMALL_RECORD) * 8 - 1),
    sample_id=st.integers(0, 2**63 - 1),
)
def test_any_flipped_bit_is_caught_and_names_the_sample(bit: int, sample_id: int) -> None:
    rec = bytearray(SMALL_RECORD)
    rec[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptRecordError) as info:
        RecordCodec(SMALL).decode(bytes(rec), sample_id, "store /x")
    assert info.value.sample_id == sample_id
    assert f"sample {sample_id}:" in str(info.value)
    assert "store /x" in str(info.value)


@pytest.mark.parametrize(
    "cut", [0, 1, RECORD_HEADER.size - 1, RECORD_HEADER.size, len(SMALL_RECORD) - 1]
)
def test_truncated_record(cut: int) -> None:
    with pytest.raises(CorruptRecordError, match="sample 17: "):
        RecordCodec(SMALL).decode(SMALL_RECORD[:cut], 17, "t")


def _damaged(how: str) -> bytes:
    rec = bytearray(SMALL_RECORD)
    if how == "bit":
        rec[-1] ^= 0x10
    elif how == "version":
        rec[12] += 2  # neither version
    elif how == "long":
        rec += b"\0"
    else:
        return SMALL_RECORD[: int(how)]
    return bytes(rec)


@pytest.mark.parametrize("how", ["bit", "version", "long", "0", "15", "16"])
@pytest.mark.parametrize("at", [0, 3, 6])
def test_a_batch_names_the_first_damaged_record_as_one_by_one_would(how: str, at: int) -> None:
    big = seal(bytes(range(256)) * 300)  # hashed by the other path (> 64 KiB)
    records: list[bytes | memoryview] = [SMALL_RECORD] * 8
    records[5] = memoryview(big)
    records[at] = _damaged(how)
    records[at + 1] = _damaged("bit")
    ids = np.arange(100, 108)
    with pytest.raises(CorruptRecordError) as one:
        verify(records[at], 100 + at, "store /x")
    with pytest.raises(CorruptRecordError) as batch:
        verify_all(records, ids, "store /x")
    assert str(batch.value) == str(one.value) and batch.value.sample_id == 100 + at
    verify_all([SMALL_RECORD, memoryview(big), SMALL_RECORD], [1, 2, 3], "store /x")
    verify_all([], [], "store /x")


@pytest.mark.parametrize("size", [10, 100_000])  # python-xxhash's own, then ours
def test_a_stored_record_is_valid_only_under_its_own_id(size: int) -> None:
    body = np.random.default_rng(size).integers(0, 256, size, np.uint8).tobytes()
    stored = stamp(seal(body), 7)
    assert RECORD_HEADER.unpack_from(stored)[2] == STORED_VERSION
    assert bytes(verify(stored, 7, "x")) == body
    with pytest.raises(CorruptRecordError, match="sample 8: checksum mismatch"):
        verify(stored, 8, "x")  # another sample's bytes, whole and valid, are refused
    other = stamp(seal(body[::-1]), 9)
    verify_all([seal(body), stored, other], [3, 7, 9], "x")  # versions 1 and 2 side by side
    with pytest.raises(CorruptRecordError, match="sample 9: checksum mismatch"):
        verify_all([seal(body), stored, stored], [3, 7, 9], "x")


def test_extended_record_is_refused() -> None:
    with pytest.raises(CorruptRecordError, match="header is damaged"):
        verify(SMALL_RECORD + b"\0", 5, "t")


def test_wrong_version_is_refused_even_with_a_good_checksum() -> None:
    digest, length, _ = RECORD_HEADER.unpack_from(SMALL_RECORD)
    rec = (
        RECORD_HEADER.pack(digest, length, STORED_VERSION + 1) + SMALL_RECORD[RECORD_HEADER.size :]
    )
    with pytest.raises(CorruptRecordError, match="header is damaged"):
        verify(rec, 5, "t")


def test_layout_mismatch_with_valid_checksum_is_corrupt() -> None:
    with pytest.raises(CorruptRecordError):
        RecordCodec(SMALL).decode(seal(b"\0" * 4), 9, "t")


def test_variable_length_past_the_end_is_corrupt() -> None:
    codec = RecordCodec(Schema((Field("b", "binary"),)))
    with pytest.raises(CorruptRecordError):
        codec.decode(seal(b"\x05\x00\x00\x00ab"), 9, "t")
