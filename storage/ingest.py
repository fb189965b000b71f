"""Turn a dataset (Parquet, Arrow / Feather, .npz, ImageFolder, WebDataset) into a store.

``ingest`` is what ``loaderd ingest SOURCE --out DB`` runs: ``readers.open_source`` detects
the kind and yields column batches, ``BatchEncoder`` turns each batch into checksummed
records, and ``StoreWriter`` appends them in one LMDB transaction per batch. The store is
built in the sibling ``.OUT.partial`` and renamed into place at the end, so an ingest that
fails or is interrupted leaves nothing at ``out``; an interrupted one is continued by the
next ingest of the same source into the same ``out`` (``ingest_resume``).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import count, repeat
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import xxhash
from tqdm import tqdm

from loaderd.storage.arrow_columns import ColumnOptions, SchemaChange
from loaderd.storage.errors import SourceError
from loaderd.storage.file_sources import (
    IMAGE_EXTENSIONS,
    ImageFolderSource,
    NpzSource,
    WebDatasetSource,
)
from loaderd.storage.ingest_resume import check_same_source, source_identity, with_learned
from loaderd.storage.readers import (
    ArrowSource,
    ColumnBatch,
    Source,
    one_line,
    open_arrow_dataset,
    open_arrow_streams,
    open_feather_v1,
    open_huggingface,
)
from loaderd.storage.records import RECORD_HEADER, RECORD_VERSION, STORED_VERSION, Schema, seal
from loaderd.storage.store_writer import StoreWriter, discard_partial, read_partial

logger = logging.getLogger(__name__)
T = TypeVar("T")

# The per-field length prefix of a record's variable part: the layout in records.py's
# docstring. tests/unit/test_ingest.py pins BatchEncoder byte for byte to RecordCodec.encode.
_VARLEN = struct.Struct("<I")
_PARQUET_EXT = (".parquet", ".pq", ".parq")
_ARROW_EXT = (".arrow", ".feather", ".ipc", ".arrows")
_TAR_EXT = (".tar", ".tgz", ".tar.gz")
_SUPPORTED = "Parquet, Arrow IPC / Feather, .npz, WebDataset .tar shards or an ImageFolder tree"


@dataclass(frozen=True, slots=True)
class IngestSummary:
    """What an ingest wrote.

    Attributes:
        samples: records written (ids 0..samples-1).
        bytes: total size of the records, headers included.
        seconds: wall time of the whole ingest.
        source: the source as given.
        out: the store directory.
        kind: the detected source kind (``parquet``, ``npz``, ``imagefolder``, ...).
        fields: the stored fields, as ``name:dtype[shape]`` (with their kind where not plain).
        restarts: how often the ingest started again because a later batch showed a ragged
            list or a null the first batch did not.
        resumed_at: the samples an interrupted ingest had written, which this one kept.
    """

    samples: int
    bytes: int
    seconds: float
    source: str
    out: Path
    kind: str = ""
    fields: str = ""
    restarts: int = 0
    resumed_at: int = 0

    def __str__(self) -> str:
        mib = self.bytes / 2**20
        rate = mib / self.seconds if self.seconds > 0 else float("inf")
        return (
            f"ingested {self.samples:,} samples ({mib:,.1f} MiB) from {self.kind} "
            f"{self.source} into {self.out} in {self.seconds:.1f} s ({rate:,.1f} MiB/s)"
        )


def ingest(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: bool = True,
    batch_rows: int = 4096,
    columns: Sequence[str] = (),
    exclude: Sequence[str] = (),
    resume: bool = True,
) -> IngestSummary:
    """Write every sample of ``source`` into a new store at ``out``.

    An interrupted ingest (killed, ^C, a full disk) leaves its committed batches in the
    partial store ``.OUT.partial`` beside ``out``; the same call later continues from there,
    and the store is the one an uninterrupted ingest writes. A different source or options
    is refused (``ResumeError``).

    Args:
        source: a Parquet file or folder, an Arrow IPC / Feather file (file or stream
            format), a Hugging Face ``save_to_disk`` folder, an ``.npz``, an ImageFolder
            tree, WebDataset ``.tar`` shards (a file or a folder), or an object-store URI of
            Parquet / Arrow data.
        out: the store directory to create.
        overwrite: replace ``out`` if it exists (only once the new store is complete).
        progress: draw a progress bar on stderr.
        batch_rows: samples per read batch and per LMDB write transaction.
        columns: ingest only these fields (a struct's name selects all its children).
        exclude: skip these fields.
        resume: continue an interrupted ingest into ``out``; False drops its partial store
            and starts over (``--restart``).

    Returns:
        What was written.

    Raises:
        SourceError: the source is missing, unreadable, empty, of an unsupported kind or has
            a field loaderd cannot store; nothing is left at ``out``.
        FileExistsError: ``out`` exists and ``overwrite`` is False.
        StoreFullError: the store could not be written (e.g. the disk is full); what was
            written is kept for a later call to continue.
        ResumeError: the interrupted ingest at ``out`` read another source, or with other
            options; or another ingest is writing ``out`` right now.
    """
    if batch_rows <= 0:
        raise ValueError(f"`batch_rows` must be positive, got {batch_rows}")
    start = time.perf_counter()
    options = ColumnOptions(tuple(columns), tuple(exclude))
    if not resume:
        discard_partial(out)
    elif (partial := read_partial(out)) is not None:
        options = with_learned(options, partial["identity"])
    restarts = 0
    while True:
        try:
            summary = _ingest_once(source, out, overwrite, progress, batch_rows, options)
            break
        except SchemaChange as e:
            # Shown only by a later batch: start again with the column ragged or nullable
            # (the partial store is dropped; the first pass cost at most what it read).
            restarts += 1
            how = "variable-length" if e.ragged else "nullable"
            logger.warning("%s; starting again with %r %s", e, e.column, how)
            options = replace(
                options,
                ragged=options.ragged | ({e.column} if e.ragged else set()),
                nullable=options.nullable | ({e.column} if e.nullable else set()),
            )
    return replace(summary, seconds=time.perf_counter() - start, restarts=restarts)


def _ingest_once(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    overwrite: bool,
    progress: bool,
    batch_rows: int,
    options: ColumnOptions,
) -> IngestSummary:
    where = os.fspath(source)
    with open_source(source, batch_rows=batch_rows, options=options) as src:
        logger.debug("ingesting %s %s: %s", src.kind, where, _describe(src.schema))
        identity = _bounded(where, lambda: source_identity(where, src, options, batch_rows))
        partial = read_partial(out)
        if partial is not None:
            check_same_source(Path(out), partial["identity"], identity)
        encoder = BatchEncoder(src.schema)
        with StoreWriter(out, src.schema, overwrite=overwrite, resumable=identity) as writer:
            start = writer.resumed_at
            dictionaries = _Dictionaries(src, writer)
            if start:
                logger.warning("continuing the interrupted ingest into %s at sample %d", out, start)
            with tqdm(
                total=src.total,
                initial=start,
                desc=f"ingest {src.kind}",
                unit=" samples",
                disable=not progress,
                file=sys.stderr,
                dynamic_ncols=True,
            ) as bar:
                for batch in src.batches_from(start):
                    records = encoder.encode(batch, first_id=writer.next_id)
                    writer.append(records, dictionaries.growth())
                    bar.update(batch.rows)
                    bar.set_postfix_str(f"{writer.bytes / 2**20:,.1f} MiB", refresh=False)
            info: dict[str, Any] = {"source": where, "source_kind": src.kind, **src.extra_info}
            if dictionaries.values:
                info["dictionaries"] = dictionaries.values
            writer.commit(info, schema=src.final_schema())
        return IngestSummary(
            samples=writer.count,
            bytes=writer.bytes,
            seconds=0.0,
            source=where,
            out=writer.path,
            kind=src.kind,
            fields=_describe(src.final_schema()),
            resumed_at=start,
        )


class _Dictionaries:
    """Dictionary columns' values, saved with each batch so a resumed ingest numbers alike.

    Each batch saves only the values it added, under ``dict:<column>``, NUL, ``<first code>``.
    """

    def __init__(self, src: Source, writer: StoreWriter) -> None:
        self._src = src
        saved: dict[str, list[Any]] = {}
        for key, raw in writer.partial_items(b"dict:"):
            saved.setdefault(key[5:].split(b"\0")[0].decode(), []).extend(json.loads(raw))
        if saved and isinstance(src, ArrowSource):
            src.restore_dictionaries(saved)
        self._saved = {name: len(v) for name, v in self.values.items()}

    @property
    def values(self) -> dict[str, list[Any]]:
        return dict(getattr(self._src, "dictionaries", None) or {})

    def growth(self) -> dict[bytes, bytes]:
        out = {}
        for name, values in self.values.items():
            done = self._saved.get(name, 0)
            if len(values) > done:
                key = f"dict:{name}\0{done:012d}".encode()
                out[key] = json.dumps(values[done:]).encode()
                self._saved[name] = len(values)
        return out


def open_source(
    source: str | os.PathLike[str],
    *,
    batch_rows: int = 4096,
    options: ColumnOptions | None = None,
) -> Source:
    """Detect what ``source`` is and open it.

    Args:
        source: a local path, a ``file://`` URI, or an object-store URI (``s3://``, ``gs://``,
            ...) of Parquet or Arrow data.
        batch_rows: the most samples per ``ColumnBatch``.
        options: which columns to take, and how (``arrow_columns.ColumnOptions``).

    Returns:
        The opened source; its first batch has been read already to settle the schema.

    Raises:
        SourceError: the source is missing, unreadable, empty, of an unsupported kind, or has
            a column loaderd cannot store.
    """
    options = options or ColumnOptions()
    src = _open(source, batch_rows, options)
    if isinstance(src, ArrowSource) or not (options.columns or options.exclude):
        return src
    return SelectedSource(src, options)


def _open(source: str | os.PathLike[str], batch_rows: int, options: ColumnOptions) -> Source:
    if batch_rows <= 0:
        raise ValueError(f"`batch_rows` must be positive, got {batch_rows}")
    text = os.fspath(source)
    url = urlparse(text)
    if url.scheme == "file":
        text = url.path
    elif len(url.scheme) > 1:  # one letter is a Windows drive, not a scheme
        return _open_uri(text, batch_rows, options)
    path = Path(text)
    if not path.exists():
        raise SourceError(f"{path}: no such file or directory")
    if path.is_dir():
        return _open_dir(path, batch_rows, options)
    kind = _sniff(path)
    if kind in ("parquet", "arrow"):
        return open_arrow_dataset(str(path), kind, [str(path)], kind, None, batch_rows, options)
    if kind == "arrow-stream":
        return open_arrow_streams(str(path), [path], "arrow-stream", batch_rows, options)
    if kind == "feather-v1":
        return open_feather_v1(path, batch_rows, options)
    if kind == "npz":
        return NpzSource(path, batch_rows)
    if kind == "tar":
        return WebDatasetSource(str(path), [path], batch_rows)
    raise SourceError(f"{path}: unsupported format (expected {_SUPPORTED})")


def _read_head(path: Path) -> bytes:
    with path.open("rb") as fp:
        return fp.read(512)


def _sniff(path: Path) -> str:
    """The kind of one file, by magic first: extensions lie, magic numbers rarely do."""
    try:
        head = _read_head(path)
    except OSError as e:
        raise SourceError(f"{path}: cannot read ({e.strerror or e})") from e
    if not head:
        raise SourceError(f"{path}: the file is empty (0 bytes)")
    name = path.name.lower()
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"ARROW1"):
        return "arrow"
    if head.startswith(b"\xff\xff\xff\xff"):  # the IPC stream format's continuation marker
        return "arrow-stream"
    if head.startswith(b"FEA1"):
        return "feather-v1"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "npz"
    if head[257:262] == b"ustar" or (head.startswith(b"\x1f\x8b") and name.endswith(_TAR_EXT)):
        return "tar"
    return "unknown"


def _ext_kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(_PARQUET_EXT):
        return "parquet"
    if name.endswith(_ARROW_EXT):
        return "arrow"
    if name.endswith(_TAR_EXT):
        return "tar"
    if name.endswith(".npz"):
        return "npz"
    if name.endswith(IMAGE_EXTENSIONS):
        return "image"
    return None


def _hidden(rel: Path) -> bool:
    # Spark and Hive leave _SUCCESS / _metadata and dot files next to the data.
    return any(part.startswith((".", "_")) for part in rel.parts)


def _open_dir(root: Path, batch_rows: int, options: ColumnOptions) -> Source:
    if (root / "dataset_dict.json").is_file():
        splits = sorted(d.name for d in root.iterdir() if (d / "state.json").is_file())
        raise SourceError(
            f"{root}: a Hugging Face DatasetDict of splits {splits}; ingest one split's "
            f"folder, e.g. {root / (splits[0] if splits else 'train')}"
        )
    if (root / "state.json").is_file():
        return open_huggingface(root, batch_rows, options)
    by_kind: dict[str, list[Path]] = {}
    try:
        files = sorted(p for p in root.rglob("*") if p.is_file())
    except OSError as e:
        raise SourceError(f"{root}: cannot list the directory ({e.strerror or e})") from e
    unknown = []
    for p in files:
        if _hidden(p.relative_to(root)):
            continue
        kind = _ext_kind(p)
        if kind is None:
            unknown.append(p)
        else:
            by_kind.setdefault(kind, []).append(p)
    if not by_kind.keys() - {"image"}:
        for p in unknown:  # extensionless data files (e.g. part-00000): ask their magic
            sniffed = _sniff(p)
            if sniffed in ("parquet", "arrow", "tar"):
                by_kind.setdefault(sniffed, []).append(p)
    data_kinds = sorted(by_kind.keys() - {"image"})
    if len(data_kinds) > 1:
        raise SourceError(f"{root}: holds more than one kind of data ({', '.join(data_kinds)})")
    if data_kinds == ["arrow"] and _sniff(by_kind["arrow"][0]) == "arrow-stream":
        streams = by_kind["arrow"]
        return open_arrow_streams(str(root), streams, "arrow-stream-folder", batch_rows, options)
    if data_kinds == ["parquet"] or data_kinds == ["arrow"]:
        fmt = data_kinds[0]
        paths = [str(p) for p in by_kind[fmt]]
        return open_arrow_dataset(str(root), fmt, paths, f"{fmt}-folder", None, batch_rows, options)
    if data_kinds == ["tar"]:
        return WebDatasetSource(str(root), by_kind["tar"], batch_rows)
    if data_kinds == ["npz"]:
        raise SourceError(f"{root}: a folder of .npz files is not supported; pass one .npz")
    if "image" in by_kind:
        return ImageFolderSource(root, batch_rows)
    classes = [d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")]
    if files and not classes:
        raise SourceError(f"{root}: unsupported format (expected {_SUPPORTED})")
    if classes:
        raise SourceError(f"{root}: no images in its class directories {sorted(classes)[:5]}")
    raise SourceError(f"{root}: the directory is empty (expected {_SUPPORTED})")


# How long opening an object-store URI may take (credentials, listing, the first batch): an
# unreachable endpoint otherwise hangs in the SDK's retries for minutes without a word.
URI_OPEN_TIMEOUT_S = 60.0


def _open_uri(uri: str, batch_rows: int, options: ColumnOptions) -> Source:
    fmt = "arrow" if uri.lower().rstrip("/").endswith(_ARROW_EXT) else "parquet"

    def opened() -> Source:
        try:
            fs, path = pafs.FileSystem.from_uri(uri)
            info = fs.get_file_info(path)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise SourceError(f"{uri}: cannot open ({one_line(e)})") from e
        if info.type == pafs.FileType.NotFound:
            raise SourceError(f"{uri}: no such file or directory")
        kind = fmt if info.type == pafs.FileType.File else f"{fmt}-folder"
        return open_arrow_dataset(uri, fmt, path, kind, fs, batch_rows, options)

    return _bounded(uri, opened)


def _bounded(where: str, fn: Callable[[], T]) -> T:
    """``fn()``, or a SourceError if ``where`` is an object store that does not answer."""
    url = urlparse(where)
    if len(url.scheme) <= 1 or url.scheme == "file":
        return fn()
    # A daemon thread: one stuck in a network call must not keep the process alive.
    result: list[T | BaseException] = []
    thread = threading.Thread(
        target=lambda: result.append(_call(fn)), name="ingest-open", daemon=True
    )
    thread.start()
    thread.join(URI_OPEN_TIMEOUT_S)
    if not result:
        raise SourceError(
            f"{where}: the file system did not answer within {URI_OPEN_TIMEOUT_S:.0f} s "
            "(unreachable endpoint, or missing credentials / network access?)"
        )
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _call(fn: Callable[[], T]) -> T | BaseException:
    try:
        return fn()
    except BaseException as e:  # handed to the waiting thread, which raises it
        return e


def _describe(schema: Schema) -> str:
    return ", ".join(
        f"{f.name}:{f.kind + '<' if f.kind else ''}{f.dtype}{list(f.shape) if f.shape else ''}"
        f"{'>' if f.kind else ''}"
        for f in schema.fields
    )


class SelectedSource(Source):
    """Another source with only the fields ``--columns`` / ``--exclude`` keep."""

    def __init__(self, inner: Source, options: ColumnOptions) -> None:
        self.inner = inner
        self.kind, self.where, self.total = inner.kind, inner.where, inner.total
        self.extra_info = inner.extra_info
        names = [f.name for f in inner.schema.fields]
        options.check(inner.where, names)
        self.schema = Schema(tuple(f for f in inner.schema.fields if options.selects(f.name)))

    def batches(self) -> Iterator[ColumnBatch]:
        """See ``Source.batches``."""
        return self.batches_from(0)

    def batches_from(self, start: int) -> Iterator[ColumnBatch]:
        """See ``Source.batches_from``."""
        keep = {f.name for f in self.schema.fields}
        for b in self.inner.batches_from(start):
            yield ColumnBatch(
                b.rows,
                {k: v for k, v in b.fixed.items() if k in keep},
                {k: v for k, v in b.variable.items() if k in keep},
            )

    def close(self) -> None:
        """See ``Source.close``."""
        self.inner.close()


class BatchEncoder:
    """Encodes a ``ColumnBatch`` into records, byte for byte what ``RecordCodec.encode`` makes.

    The fixed part of every record (fixed fields, then the variable fields' lengths) is built
    for the whole batch in one numpy array, one column copy per field; what is left per
    sample is the checksum and joining the variable bytes.

    Args:
        schema: the schema of the records.
    """

    def __init__(self, schema: Schema) -> None:
        layout = schema.layout
        self._fixed = [
            (f.name, layout.offsets[f.name], f.nbytes, np.dtype(f.dtype), f.shape)
            for f in schema.fields
            if not f.variable
        ]
        self._variable = layout.variable
        self._lengths_at = layout.fixed_bytes
        self._prefix = layout.fixed_bytes + _VARLEN.size * len(self._variable)
        # Alignment gaps between fixed fields: the only bytes no column writes. Zeroing just
        # these, not the whole buffer, saves touching every byte twice.
        self._gaps: list[tuple[int, int]] = []
        end = 0
        for _, off, nbytes, _, _ in sorted(self._fixed, key=lambda f: f[1]):
            if off > end:
                self._gaps.append((end, off))
            end = off + nbytes
        if end < layout.fixed_bytes:
            self._gaps.append((end, layout.fixed_bytes))

    def encode(self, batch: ColumnBatch, first_id: int | None = None) -> list[bytes]:
        """The batch's samples as checksummed records, in order.

        With ``first_id``, as stored under ids ``first_id``, ``first_id + 1``, ...: each
        checksum seeded with its id (``records.STORED_VERSION``), so that the store writer
        writes them as they are.

        Raises:
            ValueError: a column does not match the schema (a reader bug, not a user error),
                or a variable value is 4 GiB or larger.
        """
        n = batch.rows
        head = RECORD_HEADER.size
        # One buffer for the whole batch: [record header | fixed part] per row, filled by
        # column; the headers are written last, once the checksums are known.
        buf = np.empty((n, head + self._prefix), np.uint8)
        for a, b in self._gaps:
            buf[:, head + a : head + b] = 0
        for name, off, nbytes, dtype, shape in self._fixed:
            col = batch.fixed[name]
            if col.shape != (n, *shape) or col.dtype != dtype:
                raise ValueError(
                    f"field {name!r}: expected {dtype}{(n, *shape)}, got {col.dtype}{col.shape}"
                )
            flat = np.ascontiguousarray(col).reshape(n, -1).view(np.uint8)
            buf[:, head + off : head + off + nbytes] = flat
        parts = [batch.variable[name] for name in self._variable]
        for j, values in enumerate(parts):
            lengths = np.fromiter(map(len, values), np.int64, n)
            if n and int(lengths.max()) >= 1 << 32:
                raise ValueError(f"field {self._variable[j]!r}: a value of 4 GiB or more")
            at = head + self._lengths_at + _VARLEN.size * j
            buf[:, at : at + _VARLEN.size] = lengths.astype("<u4").view(np.uint8).reshape(n, -1)
        if parts:
            return self._encode_variable(buf[:, head:], parts, first_id)
        return self._encode_fixed(buf, first_id)

    def _encode_fixed(
        self, buf: np.ndarray[Any, np.dtype[np.uint8]], first_id: int | None
    ) -> list[bytes]:
        n, width = buf.shape
        head = RECORD_HEADER.size
        bodies = buf[:, head:]
        seeds = [0] * n if first_id is None else range(first_id, first_id + n)
        sums = np.fromiter(map(xxhash.xxh3_64_intdigest, bodies, seeds), np.uint64, n)
        version = RECORD_VERSION if first_id is None else STORED_VERSION
        header = np.zeros(n, np.dtype([("sum", "<u8"), ("len", "<u4"), ("ver", "<u4")]))
        header["sum"], header["len"], header["ver"] = sums, width - head, version
        buf[:, :head] = header.view(np.uint8).reshape(n, head)
        # One bytes object per record is what StoreWriter.append takes; this copy is most of
        # what encoding costs per sample (views into one blob would make it free).
        return [row.tobytes() for row in buf]

    def _encode_variable(
        self,
        prefixes: np.ndarray[Any, np.dtype[np.uint8]],
        parts: list[Any],
        first_id: int | None,
    ) -> list[bytes]:
        join = b"".join
        ids = repeat(None) if first_id is None else count(first_id)  # endless: strict=False
        return [
            seal(join((prefix, *values)), sid)
            for sid, (prefix, *values) in zip(ids, zip(prefixes, *parts, strict=True), strict=False)
        ]
