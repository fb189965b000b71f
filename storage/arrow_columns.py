"""Arrow columns -> loaderd fields: every Arrow type a training set uses, one converter each.

A store knows two shapes of field (fixed and variable, ``records.Layout``); this module maps
each Arrow type onto them, and records what the bytes mean in ``Field.kind`` so the trainer's
client can give them back their meaning:

* integers, floats, bool: fixed scalars; fixed-size lists, tensors and lists of one length:
  fixed arrays;
* binary and string: variable bytes;
* lists of numbers of varying length: ``Kind.LIST`` (the elements' raw bytes per sample);
* structs: flattened to one field per leaf, named ``parent.child``;
* nulls: a ``<field>.valid`` bool mask beside the field, the value zero / empty;
* timestamps, dates, times, durations: their integer count of units (``Kind.TIME``);
* dictionaries: int64 codes into one dictionary for the whole store (``Kind.DICTIONARY``).

Whether a plain list has one length everywhere, or a column holds nulls, shows only in the
data. The first batch decides; a later batch that contradicts it raises ``SchemaChange``,
and ``ingest`` starts again with that column made ragged or nullable, so no user ever has to
say so up front (``ragged`` / ``nullable`` in ``ColumnOptions`` do it without the restart).
"""

from __future__ import annotations

import itertools
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from loaderd.storage.errors import SourceError
from loaderd.storage.records import Field, Kind

# A dictionary larger than this as JSON stays in the store's info only: the field's info
# travels to every trainer in its WELCOME, whose meta is capped at 1 MiB.
MAX_INLINE_DICTIONARY = 256 << 10
VALID_SUFFIX = ".valid"

Array = np.ndarray[Any, Any]


@dataclass(frozen=True, slots=True)
class ColumnOptions:
    """Which columns to ingest, and how (``loaderd ingest --columns/--exclude``).

    Attributes:
        columns: ingest only these (a struct's name selects all its children); empty: all.
        exclude: skip these (same matching).
        ragged: list columns to store as variable-length even if the first rows agree.
        nullable: columns to give a validity mask even if the first rows hold no null.
    """

    columns: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    ragged: frozenset[str] = frozenset()
    nullable: frozenset[str] = frozenset()

    def selects(self, name: str) -> bool:
        """Whether the (flattened) column ``name`` is ingested."""
        if self.columns and not any(_matches(name, c) for c in self.columns):
            return False
        return not any(_matches(name, c) for c in self.exclude)

    def check(self, where: str, names: Sequence[str]) -> None:
        """Raise a SourceError naming a ``--columns`` / ``--exclude`` entry that matches nothing."""
        for sel in (*self.columns, *self.exclude):
            if not any(_matches(n, sel) for n in names):
                raise SourceError(f"{where}: no column {sel!r} (it has {', '.join(names[:20])})")
        if not any(self.selects(n) for n in names):
            raise SourceError(f"{where}: --columns / --exclude leave no column")


def _matches(name: str, selection: str) -> bool:
    return name == selection or name.startswith(selection + ".")


class SchemaChange(SourceError):
    """A later batch showed what the first did not: a ragged list or a null.

    Attributes:
        column: the column's name.
        ragged: the column needs variable-length storage.
        nullable: the column needs a validity mask.
    """

    def __init__(self, message: str, column: str, *, ragged: bool = False) -> None:
        super().__init__(message)
        self.column, self.ragged, self.nullable = column, ragged, not ragged


def flatten(names: Sequence[str], arrays: Sequence[pa.Array]) -> list[tuple[str, pa.Array]]:
    """Struct columns replaced by their children, ``parent.child``, at every depth.

    A null struct makes each of its children null there (Arrow's ``StructArray.flatten``).
    """
    out: list[tuple[str, pa.Array]] = []
    for name, arr in zip(names, arrays, strict=True):
        if pa.types.is_struct(arr.type):
            kids = [f"{name}.{arr.type.field(i).name}" for i in range(arr.type.num_fields)]
            out += flatten(kids, arr.flatten())
        else:
            out.append((name, arr))
    return out


def first_null(arr: pa.Array) -> int:
    """The index of the first null of ``arr`` (which has one)."""
    return int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])


def make_field(where: str, name: str, dtype: str, shape: tuple[int, ...] = (), **kw: str) -> Field:
    """A Field, or a SourceError naming the source and the column."""
    try:
        return Field(name, dtype, shape, **kw)
    except ValueError as e:
        raise SourceError(f"{where}: {e}") from e


def numeric(t: pa.DataType) -> np.dtype[Any] | None:
    """The numpy dtype a scalar Arrow type is stored as; bool becomes uint8."""
    if pa.types.is_boolean(t):
        return np.dtype(np.uint8)
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        dtype: np.dtype[Any] = np.dtype(t.to_pandas_dtype())
        return dtype
    return None


def _is_var(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_binary_view(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_string_view(t)
    )


def _is_str(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or t == pa.string_view())


class ArrowColumn(ABC):
    """One flattened Arrow column and the field(s) it becomes: its value, then its mask."""

    def __init__(self, where: str, name: str, nullable: bool) -> None:
        self.where, self.name, self.nullable = where, name, nullable

    @property
    @abstractmethod
    def field(self) -> Field:
        """The value's field."""

    @property
    def fields(self) -> list[Field]:
        """The value's field, and the mask's when the column is nullable."""
        if not self.nullable:
            return [self.field]
        info = json.dumps({"of": self.name})
        return [self.field, Field(self.name + VALID_SUFFIX, "bool", (), Kind.VALID, info)]

    def convert(self, arr: pa.Array, row0: int, out: Any) -> None:
        """Add this column of a batch (whose first row is ``row0``) to ``out`` (a ColumnBatch).

        Raises:
            SchemaChange: a null in a column without a mask, or a ragged list in a fixed one.
        """
        valid: Array | None = None
        if arr.null_count:
            if not self.nullable:
                raise SchemaChange(
                    f"{self.where}: column {self.name!r} has a null at row "
                    f"{row0 + first_null(arr)}",
                    self.name,
                )
            valid = arr.is_valid().to_numpy(zero_copy_only=False)
        if self.nullable:
            out.fixed[self.name + VALID_SUFFIX] = (
                valid if valid is not None else np.ones(len(arr), bool)
            )
        self.put(arr, valid, row0, out)

    @abstractmethod
    def put(self, arr: pa.Array, valid: Array | None, row0: int, out: Any) -> None:
        """Convert ``arr``; where ``valid`` is False the value is a null (store zero/empty)."""

    def inner_null(self) -> SourceError:
        """The error for a null inside a list value."""
        return SourceError(
            f"{self.where}: column {self.name!r} holds a null inside a value (only whole "
            "values may be null); --exclude it or fill the nulls first"
        )


def unsupported(where: str, name: str, t: pa.DataType) -> SourceError:
    """The error for a column type loaderd cannot store."""
    return SourceError(
        f"{where}: column {name!r} has type {t}, which loaderd cannot store (it takes numbers, "
        "bool, strings, binaries, lists and fixed-shape arrays of numbers, structs of those, "
        f"timestamps and dictionaries); skip it with --exclude {name}"
    )


def build_column(
    where: str, name: str, sample: pa.Array, opts: ColumnOptions, shape_meta: bytes | None = None
) -> ArrowColumn:
    """The converter of one flattened column, its shape learned from ``sample`` (a batch).

    Raises:
        SourceError: the type cannot be stored.
    """
    t = sample.type
    nullable = name in opts.nullable or sample.null_count > 0
    if pa.types.is_dictionary(t):
        return DictionaryColumn(where, name, nullable)
    if pa.types.is_temporal(t):
        return _TimeColumn(where, name, nullable, t)
    dtype = numeric(t)
    if dtype is not None:
        return _ScalarColumn(where, name, nullable, dtype)
    if _is_var(t):
        return _VarColumn(where, name, nullable, _is_str(t))
    is_list = pa.types.is_list(t) or pa.types.is_large_list(t)
    if is_list and name in opts.ragged:
        return _RaggedColumn.build(where, name, nullable, t)
    fixed = _FixedColumn.build(where, name, nullable, t, shape_meta)
    if fixed is None:
        raise unsupported(where, name, t)
    try:
        fixed.learn_shape(sample.drop_null() if sample.null_count else sample)
    except SchemaChange:
        return _RaggedColumn.build(where, name, nullable, t)
    return fixed


class _ScalarColumn(ArrowColumn):
    """Integers, floats and bool (as uint8)."""

    def __init__(self, where: str, name: str, nullable: bool, dtype: np.dtype[Any]) -> None:
        super().__init__(where, name, nullable)
        self._field = make_field(where, name, dtype.name)
        self.dtype = dtype

    @property
    def field(self) -> Field:
        return self._field

    def put(self, arr: pa.Array, valid: Array | None, row0: int, out: Any) -> None:
        if valid is not None:
            arr = pc.fill_null(arr, pa.scalar(0, arr.type) if arr.type != pa.bool_() else False)
        out.fixed[self.name] = arr.to_numpy(zero_copy_only=False).astype(self.dtype, copy=False)


class _TimeColumn(_ScalarColumn):
    """Timestamps, dates, times and durations as their integer count of units."""

    def __init__(self, where: str, name: str, nullable: bool, t: pa.DataType) -> None:
        self.int_type = pa.int32() if t.bit_width == 32 else pa.int64()
        ArrowColumn.__init__(self, where, name, nullable)
        self.dtype = np.dtype(self.int_type.to_pandas_dtype())
        info = {"arrow_type": str(t)}
        unit = getattr(t, "unit", "d" if pa.types.is_date32(t) else "ms")
        info["unit"] = unit
        if getattr(t, "tz", None):
            info["tz"] = t.tz
        self._field = make_field(
            where, name, self.dtype.name, kind=Kind.TIME, info=json.dumps(info)
        )

    def put(self, arr: pa.Array, valid: Array | None, row0: int, out: Any) -> None:
        super().put(arr.cast(self.int_type), valid, row0, out)


class _VarColumn(ArrowColumn):
    """Binary and string values, as views of the batch's data buffer."""

    def __init__(self, where: str, name: str, nullable: bool, is_str: bool) -> None:
        super().__init__(where, name, nullable)
        self._field = make_field(where, name, "string" if is_str else "binary")
        self.target = pa.large_string() if is_str else pa.large_binary()

    @property
    def field(self) -> Field:
        return self._field

    def put(self, arr: pa.Array, valid: Array | None, row0: int, out: Any) -> None:
        if arr.type != self.target:
            arr = arr.cast(self.target)  # one offsets layout to slice, whatever came in
        if valid is not None:
            arr = pc.fill_null(
                arr, pa.scalar("" if self.target == pa.large_string() else b"", self.target)
            )
        _, offsets_buf, data_buf = arr.buffers()
        offsets = np.frombuffer(offsets_buf, np.int64)[arr.offset : arr.offset + len(arr) + 1]
        data = memoryview(data_buf if data_buf is not None else b"")
        out.variable[self.name] = [data[a:b] for a, b in itertools.pairwise(offsets.tolist())]


class DictionaryColumn(ArrowColumn):
    """Dictionary-encoded values as int64 codes into one dictionary for the whole store.

    Parquet row groups and Arrow batches each carry their own dictionary; each batch's codes
    are mapped onto the store's (first seen, first numbered), so a code means one value
    everywhere.
    """

    def __init__(self, where: str, name: str, nullable: bool) -> None:
        super().__init__(where, name, nullable)
        self.values: list[Any] = []
        self._codes: dict[Any, int] = {}

    @property
    def field(self) -> Field:
        """The codes' field, its info holding the dictionary as it stands."""
        text = json.dumps({"dictionary": self.values})
        if len(text) > MAX_INLINE_DICTIONARY:
            text = json.dumps({"dictionary_size": len(self.values), "in_store_info": True})
        return make_field(self.where, self.name, "int64", kind=Kind.DICTIONARY, info=text)

    def restore(self, values: list[Any]) -> None:
        """Number ``values`` first, in order (what an interrupted ingest had numbered)."""
        self.values, self._codes = list(values), {v: i for i, v in enumerate(values)}

    def put(self, arr: pa.Array, valid: Array | None, row0: int, out: Any) -> None:
        """See ``ArrowColumn.put``."""
        local = arr.dictionary.to_pylist()
        remap = np.empty(len(local) + 1, np.int64)
        for i, v in enumerate(local):
            if isinstance(v, bytes):
                v = v.decode("utf-8", "backslashreplace")  # JSON holds text, not bytes
            elif not isinstance(v, (str, int, float, bool)):
                v = str(v)  # dates and the like: their text
            code = self._codes.get(v)
            if code is None:
                code = self._codes[v] = len(self.values)
                self.values.append(v)
            remap[i] = code
        remap[-1] = 0  # a null's code (the mask says it is null)
        indices = pc.fill_null(arr.indices, len(local)).to_numpy(zero_copy_only=False)
        out.fixed[self.name] = remap[indices.astype(np.int64, copy=False)]


def _element(t: pa.DataType) -> tuple[np.dtype[Any] | None, tuple[int, ...]]:
    """The numpy dtype and shape of a list element: a number or fixed-size lists of numbers."""
    shape: list[int] = []
    while pa.types.is_fixed_size_list(t):
        shape.append(t.list_size)
        t = t.value_type
    return numeric(t), tuple(shape)


def _flat_numbers(values: pa.Array, dtype: np.dtype[Any], depth: int) -> Array:
    for _ in range(depth):
        values = values.flatten()
    flat: Array = values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return flat


class _RaggedColumn(ArrowColumn):
    """Lists of numbers (or of fixed-size arrays of numbers) of any length: ``Kind.LIST``."""

    def __init__(
        self, where: str, name: str, nullable: bool, dtype: np.dtype[Any], shape: tuple[int, ...]
    ) -> None:
        super().__init__(where, name, nullable)
        self.dtype, self.shape = dtype, shape
        self._field = make_field(where, name, dtype.name, shape, kind=Kind.LIST)
        self.elem_bytes = dtype.itemsize * math.prod(shape)

    @classmethod
    def build(cls, where: str, name: str, nullable: bool, t: pa.DataType) -> _RaggedColumn:
        dtype, shape = _element(t.value_type)
        if dtype is None:
            raise unsupported(where, name, t)
        return cls(where, name, nullable, dtype, shape)

    @property
    def field(self) -> Field:
        return self._field

    def put(self, arr: pa.Array, valid: Array | None, row0: int, out: Any) -> None:
        if valid is not None:
            arr = pc.fill_null(arr, pa.scalar([], arr.type))
        values = arr.flatten()
        if values.null_count:
            raise self.inner_null()
        flat = np.ascontiguousarray(_flat_numbers(values, self.dtype, len(self.shape)))
        offsets = arr.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
        bounds = ((offsets - offsets[0]) * self.elem_bytes).tolist()
        data = memoryview(flat.reshape(-1).view(np.uint8).data)
        out.variable[self.name] = [data[a:b] for a, b in itertools.pairwise(bounds)]


class _FixedColumn(ArrowColumn):
    """Fixed-size lists (nested), fixed_shape_tensor, and plain lists of one length."""

    def __init__(
        self,
        where: str,
        name: str,
        nullable: bool,
        levels: list[str],
        dims: list[int | None],
        dtype: np.dtype[Any],
        tensor: pa.FixedShapeTensorType | None,
    ) -> None:
        super().__init__(where, name, nullable)
        self.levels, self.dims, self.dtype, self.tensor = levels, dims, dtype, tensor
        self._field: Field | None = None

    @classmethod
    def build(
        cls, where: str, name: str, nullable: bool, t: pa.DataType, meta: bytes | None = None
    ) -> _FixedColumn | None:
        if isinstance(t, pa.FixedShapeTensorType):
            dtype = numeric(t.value_type)
            if dtype is None:
                return None
            # The storage is one flat fixed-size list per row; the type carries the shape,
            # which a permutation reorders into the logical shape.
            perm = t.permutation or range(len(t.shape))
            dims: list[int | None] = [int(t.shape[p]) for p in perm]
            return cls(where, name, nullable, ["tensor"], dims, dtype, t)
        levels: list[str] = []
        dims = []
        while True:
            if pa.types.is_fixed_size_list(t):
                levels.append("fixed")
                dims.append(t.list_size)
            elif pa.types.is_list(t) or pa.types.is_large_list(t):
                levels.append("list")
                dims.append(None)
            else:
                break
            t = t.value_type
        dtype = numeric(t)
        if not levels or dtype is None:
            return None
        # A store exported by loaderd keeps the real shape of a flat fixed-size list here.
        if meta and levels == ["fixed"]:
            shape: list[int | None] = [int(d) for d in json.loads(meta)]
            if shape and math.prod(d or 0 for d in shape) == dims[0]:
                dims, levels = shape, ["tensor"]
        return cls(where, name, nullable, levels, dims, dtype, None)

    def learn_shape(self, sample: pa.Array) -> None:
        """Settle the plain lists' lengths from ``sample`` (every row must agree)."""
        if len(sample):
            self.to_numpy(sample, 0)
        if any(d is None for d in self.dims):  # only nulls so far: nothing to learn from
            raise SchemaChange(f"{self.where}: column {self.name!r}", self.name, ragged=True)
        self._field = make_field(self.where, self.name, self.dtype.name, self.shape)

    @property
    def field(self) -> Field:
        assert self._field is not None, "learn_shape() first"
        return self._field

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.dims if d is not None)

    def to_numpy(self, arr: pa.Array, row0: int) -> Array:
        n = len(arr)
        perm = None if self.tensor is None else self.tensor.permutation
        if perm is not None and list(perm) != list(range(len(perm))):
            # A permuted tensor's storage is not in logical row-major order; Arrow reorders.
            return np.ascontiguousarray(arr.to_numpy_ndarray(), self.dtype)
        if self.tensor is not None:
            arr = arr.storage
        values, per_row = arr, 1
        for level, kind in enumerate(self.levels):
            if level and values.null_count:
                raise self.inner_null()
            if kind == "list":
                self._check_lengths(values, level, row0, per_row)
            values = values.flatten()
            if kind == "tensor":
                break
            per_row *= int(self.dims[level] or 0)
        if values.null_count:
            raise self.inner_null()
        flat: Array = values.to_numpy(zero_copy_only=False).astype(self.dtype, copy=False)
        return flat.reshape((n, *self.shape))

    def _check_lengths(self, values: pa.Array, level: int, row0: int, per_row: int) -> None:
        lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False)
        want = self.dims[level]
        if want is None:
            want = self.dims[level] = int(lengths[0])
        bad = np.flatnonzero(lengths != want)
        if bad.size:
            row, got = row0 + int(bad[0]) // per_row, int(lengths[bad[0]])
            message = (
                f"{self.where}: column {self.name!r}: row {row} holds a list of {got} values "
                f"where the rows before held {want}"
            )
            if level == 0 and len(self.levels) == 1 + sum(k == "fixed" for k in self.levels[1:]):
                raise SchemaChange(message, self.name, ragged=True)
            raise SourceError(message + "; only the outer list may vary in length")

    def put(self, arr: pa.Array, valid: Array | None, row0: int, out: Any) -> None:
        if valid is None:
            out.fixed[self.name] = self.to_numpy(arr, row0)
            return
        whole = np.zeros((len(arr), *self.shape), self.dtype)
        whole[valid] = self.to_numpy(arr.filter(pa.array(valid)), row0)
        out.fixed[self.name] = whole


def with_dictionaries(fields: Sequence[Field], columns: Sequence[ArrowColumn]) -> list[Field]:
    """``fields`` with each dictionary column's field as it stands now (its values known)."""
    latest = {c.name: c.field for c in columns if isinstance(c, DictionaryColumn)}
    return [replace(f, info=latest[f.name].info) if f.name in latest else f for f in fields]
