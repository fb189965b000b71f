"""Ingest readers for the formats Arrow does not read.

``.npz`` (streamed member by member, never decoded whole), ImageFolder trees and WebDataset
``.tar`` shards.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import tarfile
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from loaderd.storage.arrow_columns import make_field
from loaderd.storage.errors import SourceError
from loaderd.storage.readers import (
    Array,
    ColumnBatch,
    Source,
    checked_schema,
    one_line,
)
from loaderd.storage.records import Field

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

_WDS_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


@dataclass(slots=True)
class _NpyMember:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    fortran: bool
    version: tuple[int, int]


class NpzSource(Source):
    """An ``.npz``: each array is a field, its first dimension the sample index.

    Members are streamed in slices of rows (a stored member is read straight from the file,
    a compressed one decompressed as it goes), so no array is ever decoded whole unless it
    was saved in Fortran order.
    """

    kind = "npz"

    def __init__(self, path: Path, batch_rows: int) -> None:
        self.where, self.extra_info, self.batch_rows = str(path), {}, batch_rows
        try:
            self._zip = zipfile.ZipFile(path)
            self._members = [self._header(n) for n in self._zip.namelist() if n.endswith(".npy")]
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise SourceError(f"{path}: cannot read as .npz ({one_line(e)})") from e
        if not self._members:
            raise SourceError(f"{path}: the .npz holds no arrays")
        fields = [self._field(m) for m in self._members]
        lengths = {m.name: m.shape[0] for m in self._members}
        if len(set(lengths.values())) > 1:
            listed = ", ".join(f"{k} {v}" for k, v in lengths.items())
            raise SourceError(
                f"{path}: arrays have different first dimensions ({listed}); the first "
                "dimension is the sample index and must be shared"
            )
        self.total = next(iter(lengths.values()))
        if self.total == 0:
            raise SourceError(f"{path}: the dataset is empty (0 samples)")
        self.schema = checked_schema(self.where, fields)

    def _header(self, member: str) -> _NpyMember:
        with self._zip.open(member) as fp:
            version = np.lib.format.read_magic(fp)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
            else:  # version 3 headers are rare; the fallback below loads them whole
                arr = np.load(fp, allow_pickle=False)
                shape, fortran, dtype = arr.shape, False, arr.dtype
        return _NpyMember(member.removesuffix(".npy"), shape, dtype, fortran, version)

    def _field(self, m: _NpyMember) -> Field:
        where, dt = self.where, m.dtype
        if not m.shape:
            raise SourceError(f"{where}: array {m.name!r} is a scalar; it needs a first dimension")
        if dt.kind in "US":
            if len(m.shape) != 1:
                raise SourceError(f"{where}: array {m.name!r}: text arrays must be 1-D")
            return make_field(where, m.name, "string" if dt.kind == "U" else "binary")
        if dt.kind == "b":
            return make_field(where, m.name, "uint8", m.shape[1:])
        if dt.kind not in "iuf" or dt.itemsize > 8 or dt.names is not None:
            raise SourceError(
                f"{where}: array {m.name!r} has dtype {dt}, which loaderd cannot store "
                "(it takes integers, floats, bool and strings)"
            )
        return make_field(where, m.name, dt.newbyteorder("=").name, m.shape[1:])

    def batches(self) -> Iterator[ColumnBatch]:
        """See ``Source.batches``."""
        assert self.total is not None
        readers = [self._rows(m) for m in self._members]
        for start in range(0, self.total, self.batch_rows):
            n = min(self.batch_rows, self.total - start)
            out = ColumnBatch(n)
            for f, reader in zip(self.schema.fields, readers, strict=True):
                chunk = next(reader)
                if f.dtype == "string":
                    out.variable[f.name] = [s.encode() for s in chunk.tolist()]
                elif f.dtype == "binary":
                    out.variable[f.name] = chunk.tolist()
                else:
                    out.fixed[f.name] = chunk.astype(f.dtype, copy=False)
            yield out

    def _rows(self, m: _NpyMember) -> Iterator[Array]:
        """Consecutive slices of ``batch_rows`` rows of one member."""
        if (m.fortran and len(m.shape) > 1) or m.version not in ((1, 0), (2, 0)):
            logger.warning("%s: array %r is loaded whole (Fortran order)", self.where, m.name)
            with self._zip.open(m.name + ".npy") as fp:
                whole = np.lib.format.read_array(fp, allow_pickle=False)
            for start in range(0, m.shape[0], self.batch_rows):
                yield np.ascontiguousarray(whole[start : start + self.batch_rows])
            return
        row_bytes = m.dtype.itemsize * int(np.prod(m.shape[1:], dtype=np.int64))
        with self._zip.open(m.name + ".npy") as fp:
            _skip_header(fp, m.version)
            for start in range(0, m.shape[0], self.batch_rows):
                n = min(self.batch_rows, m.shape[0] - start)
                try:
                    raw = fp.read(n * row_bytes)
                except (zipfile.BadZipFile, OSError, EOFError) as e:
                    raise SourceError(f"{self.where}: array {m.name!r}: {one_line(e)}") from e
                if len(raw) != n * row_bytes:
                    raise SourceError(f"{self.where}: array {m.name!r} is truncated at row {start}")
                yield np.frombuffer(raw, m.dtype).reshape((n, *m.shape[1:]))

    def close(self) -> None:
        """See ``Source.close``."""
        self._zip.close()


def _skip_header(fp: IO[bytes], version: tuple[int, int]) -> None:
    np.lib.format.read_magic(fp)
    if version == (1, 0):
        np.lib.format.read_array_header_1_0(fp)
    else:
        np.lib.format.read_array_header_2_0(fp)


# --- ImageFolder -------------------------------------------------------------------------


class ImageFolderSource(Source):
    """``root/<class>/**/<image>``: the encoded file bytes and the class index.

    Classes are the sorted names of the directories under ``root`` (as torchvision's
    ``ImageFolder`` numbers them); images are not decoded here.
    """

    kind = "imagefolder"
    _READERS = 8  # file reads overlap: a network file system answers each one slowly

    def __init__(self, root: Path, batch_rows: int) -> None:
        self.where, self.batch_rows = str(root), batch_rows
        classes = sorted(d.name for d in root.iterdir() if d.is_dir() and d.name[0] not in "._")
        if not classes:
            raise SourceError(
                f"{root}: an ImageFolder without classes (images must sit in "
                "root/<class>/, one directory per class)"
            )
        self.files: list[Path] = []
        self.labels: list[int] = []
        for index, name in enumerate(classes):
            found = sorted(_images_under(root / name))
            if not found:
                logger.warning("%s: class %r has no images", root, name)
            self.files += found
            self.labels += [index] * len(found)
        if not self.files:
            raise SourceError(f"{root}: the dataset is empty (0 images under {classes[:5]})")
        self.total = len(self.files)
        self.extra_info = {"classes": classes}
        names = json.dumps({"names": classes})
        self.schema = checked_schema(
            self.where, [Field("image", "binary"), Field("label", "int64", info=names)]
        )

    def batches(self) -> Iterator[ColumnBatch]:
        """See ``Source.batches``."""
        return self.batches_from(0)

    def batches_from(self, start: int) -> Iterator[ColumnBatch]:
        """See ``Source.batches_from``: the files before ``start`` are not read."""
        labels = np.asarray(self.labels, np.int64)
        with ThreadPoolExecutor(self._READERS, thread_name_prefix="ingest-read") as pool:
            for at in range(start, len(self.files), self.batch_rows):
                files = self.files[at : at + self.batch_rows]
                try:
                    images = list(pool.map(Path.read_bytes, files))
                except OSError as e:
                    raise SourceError(
                        f"{self.where}: cannot read {e.filename} ({e.strerror})"
                    ) from e
                yield ColumnBatch(
                    len(files),
                    fixed={"label": labels[at : at + len(files)]},
                    variable={"image": images},
                )


def _images_under(directory: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(directory, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith("."):
                yield Path(dirpath, name)


# --- WebDataset --------------------------------------------------------------------------


class WebDatasetSource(Source):
    """WebDataset tar shards, named as the ``webdataset`` library names them.

    Files are grouped into samples by key (the path up to the first dot of the file name);
    each sample has the string field ``__key__`` and one field per extension, named by the
    extension (lower case, e.g. ``jpg``, ``seg.png``): the integer extensions of
    ``webdataset``'s default decoders (``cls``, ``cls2``, ``class``, ``count``, ``index``,
    ``inx``) as int64, ``txt`` / ``text`` / ``transcript`` / ``json`` as strings, the rest
    as the file's bytes. Every sample must carry the same extensions.
    """

    kind = "webdataset"
    INT_EXTENSIONS = ("cls", "cls2", "class", "count", "index", "inx")
    TEXT_EXTENSIONS = ("txt", "text", "transcript", "json")

    def __init__(self, where: str, shards: list[Path], batch_rows: int) -> None:
        self.where, self.batch_rows, self.extra_info = where, batch_rows, {"shards": len(shards)}
        self.total = None
        self._it = self._samples(shards)
        first = next(self._it, None)
        if first is None:
            raise SourceError(f"{where}: the dataset is empty (0 samples)")
        self._first: tuple[Path, str, dict[str, bytes]] | None = first
        self._exts = sorted(first[2])
        fields = [Field("__key__", "string"), *(self._field(e) for e in self._exts)]
        self.schema = checked_schema(where, fields)

    def _field(self, ext: str) -> Field:
        if ext in self.INT_EXTENSIONS:
            return make_field(self.where, ext, "int64")
        return make_field(self.where, ext, "string" if ext in self.TEXT_EXTENSIONS else "binary")

    def _samples(self, shards: list[Path]) -> Iterator[tuple[Path, str, dict[str, bytes]]]:
        for shard in shards:
            try:
                with tarfile.open(shard, "r|*") as tar:
                    key: str | None = None
                    files: dict[str, bytes] = {}
                    for member in tar:
                        m = _WDS_NAME.match(member.name)
                        if not member.isfile() or m is None:
                            continue
                        if m.group(1) != key:
                            if key is not None:
                                yield shard, key, files
                            key, files = m.group(1), {}
                        ext = m.group(2).lower()
                        if ext in files:
                            raise SourceError(f"{shard}: sample {key!r} has two .{ext} files")
                        data = tar.extractfile(member)
                        assert data is not None  # a regular file always has data
                        files[ext] = data.read()
                    if key is not None:
                        yield shard, key, files
            except (tarfile.TarError, OSError, EOFError) as e:
                raise SourceError(f"{shard}: cannot read as a tar shard ({one_line(e)})") from e

    def batches(self) -> Iterator[ColumnBatch]:
        """See ``Source.batches``."""
        if self._first is None:
            raise RuntimeError("batches() may be called once")
        first, self._first = self._first, None
        samples = itertools.chain([first], self._it)
        while chunk := list(itertools.islice(samples, self.batch_rows)):
            out = ColumnBatch(len(chunk))
            for shard, key, files in chunk:
                if sorted(files) != self._exts:
                    raise SourceError(
                        f"{shard}: sample {key!r} has files {sorted(files)}, "
                        f"the first sample had {self._exts}"
                    )
            out.variable["__key__"] = [key.encode() for _, key, _ in chunk]
            for ext in self._exts:
                if ext in self.INT_EXTENSIONS:
                    out.fixed[ext] = np.array(
                        [_parse_int(shard, key, ext, f[ext]) for shard, key, f in chunk], np.int64
                    )
                else:
                    out.variable[ext] = [f[ext] for _, _, f in chunk]
            yield out


def _parse_int(shard: Path, key: str, ext: str, raw: bytes) -> int:
    try:
        return int(raw.decode().strip())
    except (UnicodeDecodeError, ValueError):
        raise SourceError(
            f"{shard}: sample {key!r}: .{ext} holds {raw[:20]!r}, not an integer"
        ) from None
