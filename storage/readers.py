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
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy.typing as npt
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.feather as feather
import pyarrow.fs as pafs

from loaderd.storage.arrow_columns import (
    ColumnOptions,
    DictionaryColumn,
    build_column,
    flatten,
    with_dictionaries,
)
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

    def tail(self, start: int) -> ColumnBatch:
        """The samples from ``start`` on."""
        return ColumnBatch(
            self.rows - start,
            {k: v[start:] for k, v in self.fixed.items()},
            {k: v[start:] for k, v in self.variable.items()},
        )


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

    def batches_from(self, start: int) -> Iterator[ColumnBatch]:
        """``batches()`` from sample ``start`` on: where an interrupted ingest resumes.

        This default reads and drops what comes before; sources that can seek override it.
        """
        seen = 0
        for batch in self.batches():
            if seen + batch.rows > start:
                yield batch.tail(start - seen) if seen < start else batch
            seen += batch.rows

    def final_schema(self) -> Schema:
        """The schema to store once every batch was read (dictionaries complete)."""
        return self.schema

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
    options: ColumnOptions | None = None,
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
        options: which columns, and how (``arrow_columns.ColumnOptions``).
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
    source = ArrowSource(where, kind, dataset.schema, batches, total, options)
    source.reopen = partial(_dataset_from, dataset, batch_rows)
    return source


def _dataset_from(dataset: pads.Dataset, batch_rows: int, start: int) -> Iterator[pa.RecordBatch]:
    """The dataset's record batches from row ``start`` on, reading little of what precedes.

    Whole files, then whole Parquet row groups, before ``start`` are skipped on their
    footers' row counts; the rest is scanned as a full scan would (batches never span a
    row group or a file), so the batches from ``start`` on are the same ones.
    """
    pieces: list[pads.Fragment] = []
    skip = start
    for fragment in dataset.get_fragments():
        if skip:
            rows = fragment.count_rows()
            if rows <= skip:
                skip -= rows
                continue
            if isinstance(fragment, pads.ParquetFileFragment):
                for group in fragment.split_by_row_group():
                    # count_rows() of a row-group piece counts its whole file: ask its metadata.
                    rows = sum(rg.num_rows for rg in group.row_groups)
                    if pieces or rows > skip:
                        pieces.append(group)
                    else:
                        skip -= rows
                continue
        pieces.append(fragment)
    scan = pads.FileSystemDataset(pieces, dataset.schema, dataset.format, dataset.filesystem)
    yield from _skip_rows(scan.to_batches(batch_size=batch_rows), skip)


def _skip_rows(batches: Iterable[pa.RecordBatch], skip: int) -> Iterator[pa.RecordBatch]:
    for rb in batches:
        if skip >= rb.num_rows:
            skip -= rb.num_rows
            continue
        yield rb.slice(skip) if skip else rb
        skip = 0


def open_arrow_streams(
    where: str,
    paths: Sequence[Path],
    kind: str,
    batch_rows: int,
    options: ColumnOptions | None = None,
) -> ArrowSource:
    """Arrow IPC files in the stream format (no footer, so no row count), one after another."""

    def batches() -> Iterator[pa.RecordBatch]:
        for path in paths:
            try:
                reader = pa.ipc.open_stream(pa.memory_map(str(path)))
            except (pa.ArrowException, OSError) as e:
                raise SourceError(f"{path}: cannot read as an Arrow stream ({one_line(e)})") from e
            for big in reader:
                for i in range(0, big.num_rows, batch_rows):
                    yield big.slice(i, batch_rows)

    it = batches()
    first = next(it, None)  # the schema comes with the first file's first batch
    schema = first.schema if first is not None else pa.schema([])
    chained = itertools.chain([first] if first is not None else [], it)
    return ArrowSource(where, kind, schema, chained, None, options)


def open_huggingface(root: Path, batch_rows: int, options: ColumnOptions | None = None) -> Source:
    """A Hugging Face ``Dataset.save_to_disk`` folder: its Arrow stream files, in order.

    ``ClassLabel`` names go into their field's info (``{"names": [...]}``) and the store's
    info (``classes``), as ImageFolder's do; the features go into the store's info as they are.
    """
    try:
        state = json.loads((root / "state.json").read_text())
        files = [root / f["filename"] for f in state["_data_files"]]
        info_path = root / "dataset_info.json"
        features = (
            json.loads(info_path.read_text()).get("features", {}) if info_path.exists() else {}
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SourceError(f"{root}: not a readable save_to_disk folder ({one_line(e)})") from e
    if not files:
        raise SourceError(f"{root}: the dataset is empty (no data files)")
    src = open_arrow_streams(str(root), files, "huggingface", batch_rows, options)
    names = {
        k: v["names"]
        for k, v in features.items()
        if isinstance(v, dict) and v.get("_type") == "ClassLabel" and "names" in v
    }
    if names:
        src.schema = Schema(
            tuple(
                replace(f, info=json.dumps({"names": names[f.name]})) if f.name in names else f
                for f in src.schema.fields
            )
        )
        src.extra_info["classes"] = names
    src.extra_info["features"] = features
    return src


def open_feather_v1(path: Path, batch_rows: int, options: ColumnOptions | None = None) -> Source:
    """A legacy Feather V1 file."""
    try:  # the legacy format has no batches; memory-mapping keeps it from loading up front
        table = feather.read_table(str(path), memory_map=True)
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{path}: cannot read as Feather ({one_line(e)})") from e
    batches = table.to_batches(max_chunksize=batch_rows)
    return ArrowSource(
        str(path), "feather-v1", table.schema, iter(batches), table.num_rows, options
    )


class ArrowSource(Source):
    """Record batches with an Arrow schema, mapped onto loaderd fields column by column.

    Struct columns are flattened first (``parent.child``); ``options`` selects columns and
    forces list columns ragged or columns nullable (``arrow_columns``).
    """

    def __init__(
        self,
        where: str,
        kind: str,
        schema: pa.Schema,
        batches: Iterable[pa.RecordBatch],
        total: int | None,
        options: ColumnOptions | None = None,
    ) -> None:
        self.where, self.kind, self.total, self.extra_info = where, kind, total, {}
        self.options = options or ColumnOptions()
        self._it = (b for b in _guard(where, batches) if b.num_rows)
        first = next(self._it, None)
        if first is None:
            raise SourceError(f"{where}: the dataset is empty (0 samples)")
        self._first: pa.RecordBatch | None = first
        flat = flatten(first.schema.names, first.columns)
        self.options.check(where, [name for name, _ in flat])
        self._keep = [self.options.selects(name) for name, _ in flat]
        _check_names(
            where, [name for (name, _), keep in zip(flat, self._keep, strict=True) if keep]
        )
        # A store exported by loaderd keeps the real shape of a flat fixed-size list here.
        shapes = {af.name: (af.metadata or {}).get(b"shape") for af in schema}
        # Plain list columns learn their shape from the first batch here.
        self._columns = [
            build_column(where, name, arr, self.options, shapes.get(name))
            for (name, arr), keep in zip(flat, self._keep, strict=True)
            if keep
        ]
        self.schema = checked_schema(where, [f for c in self._columns for f in c.fields])
        # Record batches from a row on, for a resumed ingest (None: read through the rest).
        self.reopen: Callable[[int], Iterator[pa.RecordBatch]] | None = None

    def batches(self) -> Iterator[ColumnBatch]:
        """See ``Source.batches``."""
        return self.batches_from(0)

    def batches_from(self, start: int) -> Iterator[ColumnBatch]:
        """See ``Source.batches_from``; what precedes ``start`` is never converted.

        So a dictionary column's values seen there must be given back first
        (``restore_dictionaries``).
        """
        if self._first is None:
            raise RuntimeError("batches() may be called once")
        first, self._first = self._first, None
        if start == 0:
            raw: Iterable[pa.RecordBatch] = itertools.chain([first], self._it)
        elif self.reopen is not None:
            raw = (b for b in _guard(self.where, self.reopen(start)) if b.num_rows)
        else:
            raw = _skip_rows(itertools.chain([first], self._it), start)
        row0 = start
        for rb in raw:
            out = ColumnBatch(rb.num_rows)
            flat = flatten(rb.schema.names, rb.columns)
            if len(flat) != len(self._keep):
                raise SourceError(f"{self.where}: the columns change at row {row0}")
            arrays = (arr for (_, arr), keep in zip(flat, self._keep, strict=True) if keep)
            for col, arr in zip(self._columns, arrays, strict=True):
                col.convert(arr, row0, out)
            yield out
            row0 += rb.num_rows

    def final_schema(self) -> Schema:
        """See ``Source.final_schema``: dictionaries hold every value seen."""
        return Schema(tuple(with_dictionaries(self.schema.fields, self._columns)))

    @property
    def dictionaries(self) -> dict[str, list[Any]]:
        """Each dictionary column's values, in code order."""
        return {c.name: c.values for c in self._columns if isinstance(c, DictionaryColumn)}

    def restore_dictionaries(self, values: dict[str, list[Any]]) -> None:
        """Give dictionary columns back the values an interrupted ingest had numbered."""
        for c in self._columns:
            if isinstance(c, DictionaryColumn):
                c.restore(values.get(c.name, []))


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
