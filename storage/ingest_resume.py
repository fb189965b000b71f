"""Continuing an interrupted ingest: what identifies its source, and when to refuse.

An ingest of a large source that is killed part way keeps its partial store (``StoreWriter``
with ``resumable``); running the same command again continues it. That is only sound when
the source is the one the partial store was read from, read the same way: the identity
written into the partial store at its start holds the source's location, a digest of its
file listing (every path, size and modification time), its row count where known, and the
options that shape the records. Anything else is refused in one line, naming what changed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import xxhash

from loaderd.storage.arrow_columns import ColumnOptions
from loaderd.storage.errors import ResumeError, SourceError
from loaderd.storage.readers import Source, one_line

IDENTITY_VERSION = 1
# Learned from the data during a first pass (a ragged list, a null): a resumed ingest takes
# them from the partial store instead of comparing them with the command line's.
LEARNED = ("ragged", "nullable")


def source_identity(
    where: str, src: Source, options: ColumnOptions, batch_rows: int
) -> dict[str, Any]:
    """What a partial store must match to be continued by this ingest.

    Args:
        where: the source as given (a path or a URI).
        src: the opened source.
        options: the column options in force (learned ones included).
        batch_rows: samples per batch (a transaction's worth, and dictionary numbering).

    Raises:
        SourceError: the source's files cannot be listed.
    """
    location, files = _listing(where)
    digest = xxhash.xxh3_128()
    for name, size, mtime in files:
        digest.update(f"{name}\0{size}\0{mtime}\n".encode())
    return {
        "version": IDENTITY_VERSION,
        "source": location,
        "kind": src.kind,
        "files": len(files),
        "bytes": sum(size for _, size, _ in files),
        "newest_mtime_ns": max((m for _, _, m in files), default=0),
        "listing": digest.hexdigest(),
        "rows": src.total,
        "columns": list(options.columns),
        "exclude": list(options.exclude),
        "batch_rows": batch_rows,
        "ragged": sorted(options.ragged),
        "nullable": sorted(options.nullable),
    }


def with_learned(options: ColumnOptions, identity: dict[str, Any]) -> ColumnOptions:
    """``options`` with the ragged / nullable columns a partial store's first pass learned."""
    return ColumnOptions(
        options.columns,
        options.exclude,
        options.ragged | frozenset(identity.get("ragged", ())),
        options.nullable | frozenset(identity.get("nullable", ())),
    )


def check_same_source(out: Path, old: dict[str, Any], new: dict[str, Any]) -> None:
    """Refuse to continue a partial store that another source (or other options) began.

    Raises:
        ResumeError: one line naming the first difference and the way out (``--restart``).
    """
    why = next(_differences(old, new), None)
    if why is not None:
        raise ResumeError(
            f"{out}: refusing to resume the interrupted ingest of {old.get('source')}: {why}; "
            "run again with --restart to start over (it drops only loaderd's partial store)"
        )


def _differences(old: dict[str, Any], new: dict[str, Any]) -> Iterator[str]:
    if old.get("version") != new["version"]:
        yield "it was written by another loaderd version"
    if old.get("source") != new["source"]:
        yield f"the source is now {new['source']}"
    if old.get("kind") != new["kind"]:
        yield f"it was read as {old.get('kind')}, now as {new['kind']}"
    if (old.get("files"), old.get("bytes")) != (new["files"], new["bytes"]):
        yield (
            f"the source changed: {old.get('files')} files of {old.get('bytes'):,} bytes then, "
            f"{new['files']} of {new['bytes']:,} now"
        )
    if old.get("rows") != new["rows"]:
        yield f"the source changed: {old.get('rows')} rows then, {new['rows']} now"
    if old.get("newest_mtime_ns") != new["newest_mtime_ns"] or old.get("listing") != new["listing"]:
        yield "the source changed: a file was modified, renamed or replaced since"
    for key in ("columns", "exclude", "batch_rows"):
        if old.get(key) != new[key]:
            yield f"{key.replace('_', ' ')} were {old.get(key)}, now {new[key]}"
    learned = {k: old.get(k) for k in LEARNED}
    if learned != {k: new[k] for k in LEARNED}:
        yield "the columns found ragged or nullable differ"


def _listing(where: str) -> tuple[str, list[tuple[str, int, int]]]:
    """The source's location and its files as (relative name, size, mtime in ns)."""
    url = urlparse(where)
    if len(url.scheme) > 1 and url.scheme != "file":
        return where, _uri_listing(where)
    root = Path(url.path if url.scheme == "file" else where).resolve()
    try:
        if root.is_file():
            st = root.stat()
            return str(root), [(root.name, st.st_size, st.st_mtime_ns)]
        files = []
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                path = Path(dirpath, name)
                st = path.stat()
                files.append((str(path.relative_to(root)), st.st_size, st.st_mtime_ns))
    except OSError as e:
        raise SourceError(f"{where}: cannot list the source ({e.strerror or e})") from e
    return str(root), files


def _uri_listing(uri: str) -> list[tuple[str, int, int]]:
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
        info = fs.get_file_info(path)
        infos = (
            [info]
            if info.type == pafs.FileType.File
            else fs.get_file_info(pafs.FileSelector(path, recursive=True))
        )
    except (pa.ArrowException, OSError, ValueError) as e:
        raise SourceError(f"{uri}: cannot list the source ({one_line(e)})") from e
    return sorted(
        (i.path, int(i.size or 0), int(i.mtime_ns or 0))
        for i in infos
        if i.type == pafs.FileType.File
    )
