"""A sample's fields <-> one record of bytes, with its xxh3 checksum.

Record layout (little endian)::

    header  <QII   xxh3_64(body, seed), len(body), version
    body    fixed-shape fields at 8-byte aligned offsets (C order), then one u32 length per
            variable-length field, then their bytes

Fixed fields sit at offsets known from the schema alone, so batch assembly copies a field out
of a record with one slice, without parsing. The checksum covers the whole body: a record that
fails it is never served.

Two versions, told apart by the header, both read. A record as encoded (``RECORD_VERSION``)
hashes its body alone (seed 0). A record as stored (``STORED_VERSION``, made by ``stamp`` when
``StoreWriter`` gives it its id) hashes it seeded with the sample id, so the checksum also
names the sample: bytes of another record, reached through a damaged page number in LMDB's
tree, fail it instead of being served, whole and valid, under the wrong id. Stores written
before the stored version hold version 1 records and stay readable.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from loaderd.storage.checksum import xxh3_64, xxh3_64_all
from loaderd.storage.errors import CorruptRecordError

RECORD_HEADER = struct.Struct("<QII")
# ``RECORD_HEADER`` as a numpy record: a batch's headers checked as one array.
HEADER_DTYPE = np.dtype([("digest", "<u8"), ("length", "<u4"), ("version", "<u4")])
RECORD_VERSION = 1  # as encoded: the checksum of the body alone
STORED_VERSION = 2  # as stored: the checksum seeded with the sample id (``stamp``)
_ALIGN = 8
_VARLEN = struct.Struct("<I")
VARIABLE_DTYPES = ("binary", "string")


class Kind:
    """What a field means beyond its bytes (``Field.kind``).

    The record layout knows only two shapes of field, fixed and variable; every kind is
    stored as one of them.

    * ``PLAIN``: a fixed-shape numeric array, or ``binary`` / ``string`` bytes.
    * ``LIST``: a variable-length list of ``dtype`` elements of ``shape`` each, stored as the
      elements' raw bytes (a variable field); the client turns a batch of them into values +
      offsets, or a padded tensor + lengths.
    * ``VALID``: the bool validity mask of the nullable field ``info["of"]`` (named
      ``<field>.valid``); a null's value is zero, empty or an empty list.
    * ``TIME``: a timestamp, date, time or duration as its integer count of units
      (``info["arrow_type"]``, e.g. ``timestamp[ms, tz=UTC]``).
    * ``DICTIONARY``: integer codes into ``info["dictionary"]`` (the values, in code order).
    """

    PLAIN = ""
    LIST = "list"
    VALID = "valid"
    TIME = "time"
    DICTIONARY = "dictionary"
    ALL = (PLAIN, LIST, VALID, TIME, DICTIONARY)


@dataclass(frozen=True, slots=True)
class Field:
    """One named field: a numpy dtype and shape, or variable-length ``binary`` / ``string``.

    Attributes:
        name: the field's name (a struct's children are ``parent.child``).
        dtype: a numpy dtype name, or ``binary`` / ``string``; for a ``LIST`` the element's.
        shape: the fixed shape of a value; for a ``LIST`` the shape of one element.
        kind: what the bytes mean (``Kind``).
        info: JSON text of what the trainer may need to read the field (the dictionary of a
            ``DICTIONARY``, class names, the Arrow type of a ``TIME``); text, so the schema
            stays hashable.
    """

    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    kind: str = Kind.PLAIN
    info: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a field needs a name")
        if self.kind not in Kind.ALL:
            raise ValueError(f"field {self.name!r}: unknown kind {self.kind!r}")
        if self.dtype in VARIABLE_DTYPES:
            if self.shape or self.kind != Kind.PLAIN:
                raise ValueError(f"field {self.name!r}: {self.dtype} fields have no shape or kind")
            return
        dt = np.dtype(self.dtype)
        if dt.kind not in "biuf" or dt.byteorder == ">":
            raise ValueError(f"field {self.name!r}: unsupported dtype {self.dtype!r}")
        if any(d <= 0 for d in self.shape):
            raise ValueError(f"field {self.name!r}: shape {self.shape} has an empty dimension")

    @property
    def variable(self) -> bool:
        """Whether each sample has its own length for this field."""
        return self.dtype in VARIABLE_DTYPES or self.kind == Kind.LIST

    @property
    def attrs(self) -> dict[str, Any]:
        """``info`` parsed."""
        return dict(json.loads(self.info)) if self.info else {}

    def to_json(self) -> dict[str, Any]:
        """The field as a JSON-ready object (``kind`` and ``info`` only when set)."""
        out: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.kind:
            out["kind"] = self.kind
        if self.info:
            out["info"] = self.attrs
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Field:
        """Inverse of ``to_json``."""
        info = obj.get("info")
        return cls(
            obj["name"],
            obj["dtype"],
            tuple(obj["shape"]),
            obj.get("kind", Kind.PLAIN),
            json.dumps(info, sort_keys=True) if info else "",
        )

    @property
    def nbytes(self) -> int:
        """Bytes of one sample's value (fixed fields only)."""
        return np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True, slots=True)
class Schema:
    """The ordered fields of every record in a store, and the record layout they imply."""

    fields: tuple[Field, ...]

    def __post_init__(self) -> None:
        if not self.fields:
            raise ValueError("a schema needs at least one field")
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate field names in {names}")
        reserved = {"id", "weight"} & set(names)
        if reserved:
            raise ValueError(f"field names {sorted(reserved)} are reserved for loaderd")

    @property
    def layout(self) -> Layout:
        """Byte offsets of the fixed fields and the size of the fixed part."""
        return _layout(self)

    def to_json(self) -> list[dict[str, Any]]:
        """The schema as JSON-ready objects."""
        return [f.to_json() for f in self.fields]

    @classmethod
    def from_json(cls, obj: Sequence[Mapping[str, Any]]) -> Schema:
        """Inverse of ``to_json``."""
        return cls(tuple(Field.from_json(o) for o in obj))

    def to_arrow(self) -> pa.Schema:
        """The schema as Arrow: fixed fields are fixed-size lists with their shape in metadata.

        A field's kind and info ride in its metadata (``loaderd``), so a store written before
        kinds existed reads back as plain fields.
        """
        out = []
        for f in self.fields:
            meta = {"shape": json.dumps(list(f.shape))}
            if f.kind or f.info:
                meta["loaderd"] = json.dumps({"kind": f.kind, "info": f.info})
            if f.dtype in VARIABLE_DTYPES:
                t = pa.binary() if f.dtype == "binary" else pa.string()
            else:
                prim = pa.from_numpy_dtype(np.dtype(f.dtype))
                size = int(np.prod(f.shape, dtype=np.int64))
                t = pa.list_(prim, size) if f.shape else prim
                if f.kind == Kind.LIST:
                    t = pa.large_list(t)
            out.append(pa.field(f.name, t, metadata=meta))
        return pa.schema(out)

    @classmethod
    def from_arrow(cls, schema: pa.Schema) -> Schema:
        """Inverse of ``to_arrow``."""
        fields = []
        for af in schema:
            meta = af.metadata or {}
            shape = tuple(json.loads(meta.get(b"shape", b"[]")))
            extra = json.loads(meta[b"loaderd"]) if b"loaderd" in meta else {}
            kind, info = extra.get("kind", Kind.PLAIN), extra.get("info", "")
            t = af.type.value_type if kind == Kind.LIST else af.type
            if pa.types.is_binary(t) or pa.types.is_large_binary(t):
                dtype = "binary"
            elif pa.types.is_string(t) or pa.types.is_large_string(t):
                dtype = "string"
            else:
                prim = t.value_type if pa.types.is_fixed_size_list(t) else t
                dtype = np.dtype(prim.to_pandas_dtype()).name
            fields.append(Field(af.name, dtype, shape, kind, info))
        return cls(tuple(fields))


class FixedSlice(NamedTuple):
    """Where one fixed-shape field lies in a whole record (header included)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # from the start of the record, header included
    nbytes: int


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each field lives in a record: what batch assembly needs to know, and no more.

    Fixed fields are byte ranges at the same place in every record (``fixed``, offsets counted
    from the start of the record, header included), so a batch gathers them with one slice
    per record, or one strided copy per field when records are equally long. Variable-length
    fields (``variable``) are found per record by ``RecordCodec.variable_parts``: for each
    record, one view per variable field, whatever its kind.
    """

    offsets: Mapping[str, int]  # fixed field -> offset in the body (after the header)
    fixed_bytes: int  # size of the fixed part, aligned
    variable: tuple[str, ...]  # names of the variable-length fields, in order
    fixed: tuple[FixedSlice, ...] = ()

    @property
    def record_bytes(self) -> int | None:
        """Size of every record when the schema has no variable field, else None."""
        return None if self.variable else RECORD_HEADER.size + self.fixed_bytes


_LAYOUTS: dict[Schema, Layout] = {}


def _layout(schema: Schema) -> Layout:
    cached = _LAYOUTS.get(schema)
    if cached is not None:
        return cached
    offsets: dict[str, int] = {}
    fixed: list[FixedSlice] = []
    pos = 0
    for f in schema.fields:
        if not f.variable:
            offsets[f.name] = pos
            fixed.append(FixedSlice(f.name, f.dtype, f.shape, RECORD_HEADER.size + pos, f.nbytes))
            pos += -(-f.nbytes // _ALIGN) * _ALIGN
    variable = tuple(f.name for f in schema.fields if f.variable)
    layout = Layout(offsets, pos, variable, tuple(fixed))
    _LAYOUTS[schema] = layout
    return layout


class RecordCodec:
    """Encodes samples of one schema into records and reads them back."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.layout = schema.layout

    @cached_property
    def _fixed(self) -> list[tuple[Field, int]]:
        return [(f, self.layout.offsets[f.name]) for f in self.schema.fields if not f.variable]

    def encode(self, values: Mapping[str, Any]) -> bytes:
        """One sample (field name -> array-like, bytes or str) as a checksummed record.

        Raises:
            ValueError: a field is missing or its value does not fit the schema.
        """
        body = bytearray(self.layout.fixed_bytes)
        for f, off in self._fixed:
            try:
                arr = np.asarray(values[f.name], dtype=f.dtype)
            except KeyError:
                raise ValueError(f"sample has no field {f.name!r}") from None
            except OverflowError as e:
                raise ValueError(f"field {f.name!r}: value out of range for {f.dtype}: {e}") from e
            if arr.shape != f.shape:
                raise ValueError(f"field {f.name!r}: expected shape {f.shape}, got {arr.shape}")
            body[off : off + f.nbytes] = arr.tobytes()
        tail = []
        for name in self.layout.variable:
            v = values.get(name)
            f = self._by_name[name]
            if f.kind == Kind.LIST and not isinstance(v, (bytes, bytearray, memoryview)):
                elements = np.ascontiguousarray(v, dtype=f.dtype)
                if elements.shape[1:] != f.shape:
                    raise ValueError(f"field {name!r}: elements of shape {f.shape} expected")
                v = elements.tobytes()
            if isinstance(v, str):
                v = v.encode()
            if not isinstance(v, (bytes, bytearray, memoryview)):
                raise ValueError(f"field {name!r}: expected bytes or str, got {type(v).__name__}")
            body += _VARLEN.pack(len(v))
            tail.append(bytes(v))
        body += b"".join(tail)
        return seal(body)

    def decode(self, record: bytes | memoryview, sample_id: int, where: str) -> dict[str, Any]:
        """Verify a record and return its fields (numpy arrays, bytes or str), copying nothing.

        Raises:
            CorruptRecordError: the checksum or the layout does not match.
        """
        body = verify(record, sample_id, where)
        if body.nbytes < self.layout.fixed_bytes + 4 * len(self.layout.variable):
            raise CorruptRecordError(sample_id, where, "record is shorter than its schema")
        out: dict[str, Any] = {}
        for f, off in self._fixed:
            out[f.name] = np.frombuffer(body, f.dtype, int(np.prod(f.shape)), off).reshape(f.shape)
        try:
            parts = self.variable_parts(body)
        except ValueError as e:
            raise CorruptRecordError(sample_id, where, str(e)) from None
        for name, value in zip(self.layout.variable, parts, strict=True):
            f = self._by_name[name]
            if f.kind == Kind.LIST:
                out[name] = np.frombuffer(value, f.dtype).reshape(-1, *f.shape)
            else:
                out[name] = bytes(value).decode() if f.dtype == "string" else bytes(value)
        return out

    @cached_property
    def _by_name(self) -> dict[str, Field]:
        return {f.name: f for f in self.schema.fields}

    def variable_parts(self, body: memoryview) -> list[memoryview]:
        """The variable-length fields of a verified body, as views.

        Raises:
            ValueError: the lengths run past the end of the body.
        """
        pos = self.layout.fixed_bytes
        lengths = []
        for _ in self.layout.variable:
            (n,) = _VARLEN.unpack_from(body, pos)
            lengths.append(n)
            pos += _VARLEN.size
        if pos + sum(lengths) != body.nbytes:
            raise ValueError("variable-length fields do not fit the record")
        parts = []
        for n in lengths:
            parts.append(body[pos : pos + n])
            pos += n
        return parts


def seal(body: bytes | bytearray | memoryview, sample_id: int | None = None) -> bytes:
    """Prefix a body with its checksum header: as stored under ``sample_id`` if given."""
    if sample_id is None:
        return RECORD_HEADER.pack(xxh3_64(body), len(body), RECORD_VERSION) + body
    return RECORD_HEADER.pack(xxh3_64(body, sample_id), len(body), STORED_VERSION) + body


def stamp(record: bytes, sample_id: int) -> bytes:
    """The record as stored under ``sample_id`` (``StoreWriter``, as it gives it its id).

    A record the encoder sealed with its id already (``STORED_VERSION``) is taken at its
    word, as it is: checking would hash it again. Any other is sealed anew (a copy).
    """
    if RECORD_HEADER.unpack_from(record)[2] == STORED_VERSION:
        return record
    return seal(memoryview(record)[RECORD_HEADER.size :], sample_id)


def verify(record: bytes | memoryview, sample_id: int, where: str) -> memoryview:
    """Check a record's header and checksum and return a view of its body.

    A stored record's checksum is seeded with its sample id: another sample's record fails.

    Raises:
        CorruptRecordError: naming the sample id and where the record came from.
    """
    view = memoryview(record)
    if view.nbytes < RECORD_HEADER.size:
        raise CorruptRecordError(sample_id, where, f"record of {view.nbytes} bytes is truncated")
    digest, length, version = RECORD_HEADER.unpack_from(view)
    body = view[RECORD_HEADER.size :]
    if version not in (RECORD_VERSION, STORED_VERSION) or length != body.nbytes:
        raise CorruptRecordError(sample_id, where, "record header is damaged")
    if xxh3_64(body, sample_id if version == STORED_VERSION else 0) != digest:
        raise CorruptRecordError(sample_id, where)
    return body


def verify_all(
    records: Sequence[bytes | memoryview], ids: Sequence[int] | np.ndarray, where: str
) -> None:
    """``verify`` of a batch: the headers parsed and compared as arrays, one hash call each.

    A record of a few KiB cost about 1.3 us to verify alone, most of it Python around a
    0.1 us hash; here the headers are one array and the hashes one ``map``.

    Raises:
        CorruptRecordError: naming the first record (in batch order) that fails.
    """
    n = len(records)
    views = [memoryview(r) for r in records]
    head = RECORD_HEADER.size
    joined = b"".join([v[:head] for v in views])
    if len(joined) != n * head:  # a record shorter than its header: ``verify`` names it
        for v, sid in zip(views, ids, strict=True):
            verify(v, int(sid), where)
    headers = np.frombuffer(joined, HEADER_DTYPE)
    bodies = [v[head:] for v in views]
    lengths = np.fromiter(map(len, bodies), np.int64, n)
    version = headers["version"]
    stored = version == STORED_VERSION
    good = (stored | (version == RECORD_VERSION)) & (headers["length"] == lengths)
    if good.all():
        seeds = np.where(stored, np.asarray(ids, np.int64), 0).tolist()
        good = headers["digest"] == xxh3_64_all(bodies, seeds)
        if good.all():
            return
    bad = int(np.argmin(good))
    verify(views[bad], int(ids[bad]), where)  # raises, with the reason
    raise AssertionError("verify passed a record verify_all failed")  # pragma: no cover
