"""Ingest readers: each kind of dataset as a ``Source`` of column batches.

A ``Source`` knows its loaderd ``Schema``, its sample count where that is cheap to know, and
yields ``ColumnBatch``es. Fixed fields arrive as one numpy array per batch, so the encoder
copies whole columns instead of touching each sample in Python. ``ingest.open_source`` picks
the reader.

This module holds the shared types and the Arrow readers: Parquet and Arrow IPC / Feather
through ``pyarrow.dataset`` (local paths and object-store URIs alike; the IPC stream format and
Feather V1 through their own readers). ``file_sources`` holds the others.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.feather as feather
import pyarrow.fs as pafs

from loaderd.storage.errors import SourceError
from loaderd.storage.records import Field, Schema

logger = logging.getLogger(__name__)

RESERVED_FIELDS = ("id", "weight")
# torchvision's IMG_EXTENSIONS, so an ImageFolder tree means the same thing in both.
# WebDataset's rule: the key is everything up to the first dot of the file name.

Array = npt.NDArray[Any]
Bytes = bytes | memoryview


@dataclass(frozen=True, slots=True)
class ColumnBatch:
    """Consecutive samples of a source, column by column.

    Attributes:
        rows: how many samples the batch holds.
        fixed: per fixed field, an array of shape ``(rows, *field.shape)`` in the field's dtype.
        variable: per binary/string field, one bytes-like value per sample (strings UTF-8).
    """

    rows: int
    fixed: dict[str, Array] = field(default_factory=dict)
    variable: dict[str, Sequence[Bytes]] = field(default_factory=dict)


class Source(ABC):
    """An opened ingest source. Use as a context manager; ``batches()`` may be called once.

    Attributes:
        kind: what was detected, e.g. ``"parquet"`` or ``"imagefolder"``.
        where: the source as given (a path or URI), for messages.
        schema: the loaderd schema every batch follows.
        total: the number of samples, or None where counting would mean a second pass.
        extra_info: what the store's info should also carry (e.g. ImageFolder class names).
    """

    kind: str
    where: str
    schema: Schema
    total: int | None = None
    extra_info: dict[str, Any]

    @abstractmethod
    def batches(self) -> Iterator[ColumnBatch]:
        """The samples, in source order, as batches of at most ``batch_rows`` rows.

        Raises:
            SourceError: the source turns out unreadable or inconsistent part way through.
        """

    def close(self) -> None:  # noqa: B027  (most sources hold nothing to release)
        """Release open files (safe to call twice)."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def one_line(e: BaseException) -> str:
    """The first line of an exception's message: library errors can run to pages."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


# --- Arrow: Parquet, IPC file / stream, Feather -------------------------------------------


def open_arrow_dataset(
    where: str,
    fmt: str,
    paths: str | list[str],
    kind: str,
    fs: pafs.FileSystem | None,
    batch_rows: int,
) -> Source:
    """Parquet or Arrow IPC files (one, a list, or a directory / URI) as one source.

    Args:
        where: the source as the user gave it, for messages.
        fmt: ``"parquet"`` or ``"arrow"`` (the IPC file format, i.e. Feather V2).
        paths: what ``pyarrow.dataset.dataset`` takes: a path, a list of paths, or a path
            on ``fs``.
        kind: the name the summary and the store's info give this source.
        fs: the filesystem of an object-store URI, None for local paths.
        batch_rows: the most samples per batch.
    """
    try:
        dataset = pads.dataset(paths, format=fmt, filesystem=fs)
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{where}: cannot read as {fmt} ({one_line(e)})") from e
    try:
        # Parquet footers hold row counts, so this reads no data. A file that cannot even
        # give its footer fails the scan below with a better message; here it only costs
        # the progress bar its total.
        total: int | None = dataset.count_rows()
    except (pa.ArrowException, OSError) as e:
        logger.debug("%s: no row count (%s)", where, e)
        total = None
    batches = dataset.to_batches(batch_size=batch_rows)
    return ArrowSource(where, kind, dataset.schema, batches, total)


def open_arrow_stream(path: Path, batch_rows: int) -> Source:
    """An Arrow IPC file in the stream format (no footer, so no row count)."""
    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(path)))
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{path}: cannot read as an Arrow stream ({one_line(e)})") from e
    batches = (
        big.slice(i, batch_rows) for big in reader for i in range(0, big.num_rows, batch_rows)
    )
    return ArrowSource(str(path), "arrow-stream", reader.schema, batches, None)


def open_feather_v1(path: Path, batch_rows: int) -> Source:
    """A legacy Feather V1 file."""
    try:  # the legacy format has no batches; memory-mapping keeps it from loading up front
        table = feather.read_table(str(path), memory_map=True)
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{path}: cannot read as Feather ({one_line(e)})") from e
    batches = table.to_batches(max_chunksize=batch_rows)
    return ArrowSource(str(path), "feather-v1", table.schema, iter(batches), table.num_rows)


class ArrowSource(Source):
    """Record batches with an Arrow schema, mapped onto loaderd fields column by column."""

    def __init__(
        self,
        where: str,
        kind: str,
        schema: pa.Schema,
        batches: Iterable[pa.RecordBatch],
        total: int | None,
    ) -> None:
        self.where, self.kind, self.total, self.extra_info = where, kind, total, {}
        _check_names(where, schema.names)
        self._it = (b for b in _guard(where, batches) if b.num_rows)
        first = next(self._it, None)
        if first is None:
            raise SourceError(f"{where}: the dataset is empty (0 samples)")
        self._first: pa.RecordBatch | None = first
        # Plain list columns learn their shape from the first row here.
        self._columns = [_column(where, af, first.column(i)) for i, af in enumerate(schema)]
        self.schema = checked_schema(where, [c.field for c in self._columns])

    def batches(self) -> Iterator[ColumnBatch]:
        """See ``Source.batches``."""
        if self._first is None:
            raise RuntimeError("batches() may be called once")
        first, self._first = self._first, None
        row0 = 0
        for rb in itertools.chain([first], self._it):
            out = ColumnBatch(rb.num_rows)
            for i, col in enumerate(self._columns):
                col.convert(rb.column(i), row0, out)
            yield out
            row0 += rb.num_rows


def _guard(where: str, it: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    try:
        yield from it
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{where}: cannot read ({one_line(e)})") from e


def _check_names(where: str, names: Sequence[str]) -> None:
    for name in names:
        if name in RESERVED_FIELDS:
            raise SourceError(
                f"{where}: field {name!r} is reserved by loaderd (it adds 'id' and 'weight' "
                "to every batch); rename it"
            )
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise SourceError(f"{where}: duplicate field names {dups}")


def checked_schema(where: str, fields: list[Field]) -> Schema:
    """A Schema of ``fields``, or a SourceError naming the source."""
    _check_names(where, [f.name for f in fields])
    try:
        return Schema(tuple(fields))
    except ValueError as e:
        raise SourceError(f"{where}: {e}") from e


def make_field(where: str, name: str, dtype: str, shape: tuple[int, ...] = ()) -> Field:
    """A Field, or a SourceError naming the source and the column."""
    try:
        return Field(name, dtype, shape)
    except ValueError as e:
        raise SourceError(f"{where}: {e}") from e


def _first_null(arr: pa.Array) -> int:
    return int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])


def _numeric(t: pa.DataType) -> np.dtype[Any] | None:
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


class _Column(ABC):
    field: Field

    def __init__(self, where: str, name: str) -> None:
        self.where, self.name = where, name

    @abstractmethod
    def convert(self, arr: pa.Array, row0: int, out: ColumnBatch) -> None:
        """Add this column of a record batch (whose first row is ``row0``) to ``out``."""

    def check_nulls(self, arr: pa.Array, row0: int, per_row: int = 1) -> None:
        if arr.null_count:
            row = row0 + _first_null(arr) // per_row
            raise SourceError(f"{self.where}: column {self.name!r} has a null at row {row}")


def _unsupported(where: str, af: pa.Field) -> SourceError:
    return SourceError(
        f"{where}: column {af.name!r} has type {af.type}, which loaderd cannot store (it takes "
        "integers, floats, bool, fixed-size lists / tensors / equal-length lists of those, "
        "binary and string)"
    )


def _column(where: str, af: pa.Field, sample: pa.Array) -> _Column:
    t = af.type
    decode = pa.types.is_dictionary(t)
    if decode:
        t = t.value_type
    dtype = _numeric(t)
    if dtype is not None:
        return _ScalarColumn(where, af.name, dtype, decode)
    if _is_var(t):
        is_str = pa.types.is_string(t) or pa.types.is_large_string(t) or t == pa.string_view()
        return _VarColumn(where, af.name, is_str, decode)
    if decode:
        raise _unsupported(where, af)
    col = _FixedColumn.build(where, af)
    if col is None:
        raise _unsupported(where, af)
    col.learn_shape(sample)
    return col


class _ScalarColumn(_Column):
    def __init__(self, where: str, name: str, dtype: np.dtype[Any], decode: bool) -> None:
        super().__init__(where, name)
        self.field = make_field(where, name, dtype.name)
        self.dtype, self.decode = dtype, decode

    def convert(self, arr: pa.Array, row0: int, out: ColumnBatch) -> None:
        self.check_nulls(arr, row0)
        if self.decode:
            arr = arr.dictionary_decode()
        out.fixed[self.name] = arr.to_numpy(zero_copy_only=False).astype(self.dtype, copy=False)


class _VarColumn(_Column):
    def __init__(self, where: str, name: str, is_str: bool, decode: bool) -> None:
        super().__init__(where, name)
        self.field = make_field(where, name, "string" if is_str else "binary")
        self.target = pa.large_string() if is_str else pa.large_binary()
        self.decode = decode

    def convert(self, arr: pa.Array, row0: int, out: ColumnBatch) -> None:
        self.check_nulls(arr, row0)
        if self.decode:
            arr = arr.dictionary_decode()
        if arr.type != self.target:
            arr = arr.cast(self.target)  # one offsets layout to slice, whatever came in
        _, offsets_buf, data_buf = arr.buffers()
        offsets = np.frombuffer(offsets_buf, np.int64)[arr.offset : arr.offset + len(arr) + 1]
        data = memoryview(data_buf if data_buf is not None else b"")
        bounds = offsets.tolist()
        out.variable[self.name] = [data[a:b] for a, b in itertools.pairwise(bounds)]


class _FixedColumn(_Column):
    """Fixed-size lists (nested), fixed_shape_tensor, and plain lists of one length."""

    def __init__(
        self,
        where: str,
        name: str,
        levels: list[str],
        dims: list[int | None],
        dtype: np.dtype[Any],
        tensor: pa.FixedShapeTensorType | None,
    ) -> None:
        super().__init__(where, name)
        self.levels, self.dims, self.dtype, self.tensor = levels, dims, dtype, tensor

    @classmethod
    def build(cls, where: str, af: pa.Field) -> _FixedColumn | None:
        t = af.type
        if isinstance(t, pa.FixedShapeTensorType):
            dtype = _numeric(t.value_type)
            if dtype is None:
                return None
            # The storage is one flat fixed-size list per row; the type carries the shape,
            # which a permutation reorders into the logical shape.
            perm = t.permutation or range(len(t.shape))
            dims: list[int | None] = [int(t.shape[p]) for p in perm]
            return cls(where, af.name, ["tensor"], dims, dtype, t)
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
        dtype = _numeric(t)
        if not levels or dtype is None:
            return None
        # A store exported by loaderd keeps the real shape of a flat fixed-size list here.
        meta = (af.metadata or {}).get(b"shape")
        if meta and levels == ["fixed"]:
            shape: list[int | None] = [int(d) for d in json.loads(meta)]
            if shape and math.prod(d or 0 for d in shape) == dims[0]:
                dims, levels = shape, ["tensor"]
        return cls(where, af.name, levels, dims, dtype, None)

    def learn_shape(self, sample: pa.Array) -> None:
        self.to_numpy(sample[:1], 0)  # fills the plain-list dimensions from row 0
        self.field = make_field(self.where, self.name, self.dtype.name, self.shape)

    @property
    def shape(self) -> tuple[int, ...]:
        assert all(d is not None for d in self.dims)
        return tuple(int(d) for d in self.dims if d is not None)

    def to_numpy(self, arr: pa.Array, row0: int) -> Array:
        n = len(arr)
        perm = None if self.tensor is None else self.tensor.permutation
        if perm is not None and list(perm) != list(range(len(perm))):
            # A permuted tensor's storage is not in logical row-major order; Arrow reorders.
            self.check_nulls(arr, row0)
            return np.ascontiguousarray(arr.to_numpy_ndarray(), self.dtype)
        if self.tensor is not None:
            arr = arr.storage
        values, per_row = arr, 1
        for level, kind in enumerate(self.levels):
            self.check_nulls(values, row0, per_row)
            if kind == "list":
                self._check_lengths(values, level, row0, per_row)
            values = values.flatten()
            if kind == "tensor":
                break
            per_row *= int(self.dims[level] or 0)
        self.check_nulls(values, row0, len(values) // max(n, 1))
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
            raise SourceError(
                f"{self.where}: column {self.name!r}: row {row} holds a list of {got} values "
                f"where row 0 held {want}; list columns need one length in every row"
            )

    def convert(self, arr: pa.Array, row0: int, out: ColumnBatch) -> None:
        out.fixed[self.name] = self.to_numpy(arr, row0)
