"""The LMDB sample store: read-only for serving, written once by a single ingest writer.

A store is a directory holding an LMDB environment with two named databases:

* ``samples``: key = sample id as 8 big-endian bytes (so key order is id order and a
  sequential scan is a sequential read), value = a checksummed record (``records.py``).
* ``meta``: ``schema`` (Arrow schema IPC bytes) and ``info`` (JSON: samples, bytes,
  format version, fingerprint).

The writer builds the store in a temporary sibling directory and renames it into place only
after every record and the metadata are synced, so an interrupted ingest never leaves a
directory that looks like a complete store.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import lmdb
import numpy as np
import pyarrow as pa
import xxhash

from loaderd.storage.errors import NotAStoreError, StoreFullError
from loaderd.storage.records import Schema, verify

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_KEY = struct.Struct(">Q")
_SAMPLES = b"samples"
_META = b"meta"


def sample_key(sample_id: int) -> bytes:
    """The LMDB key of a sample."""
    return _KEY.pack(sample_id)


class SampleStore:
    """A read-only view of a store directory. Thread-safe; never use it across a fork.

    Args:
        path: the store directory (as written by ``StoreWriter``).

    Raises:
        NotAStoreError: the path is missing or is not a loaderd store.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not (self.path / "data.mdb").is_file():
            raise NotAStoreError(f"{self.path}: not a loaderd store (no data.mdb)")
        try:
            # lock=False: a finished store is immutable, so readers need no lock table (and a
            # crashed reader leaves no stale slot behind). readahead=False: access is random.
            self._env = lmdb.open(
                str(self.path), readonly=True, lock=False, max_dbs=2, readahead=False
            )
            self._samples = self._env.open_db(_SAMPLES, create=False)
            meta = self._env.open_db(_META, create=False)
            with self._env.begin(db=meta) as txn:
                info_raw, schema_raw = txn.get(b"info"), txn.get(b"schema")
        except lmdb.Error as e:
            raise NotAStoreError(f"{self.path}: not a loaderd store ({e})") from e
        if info_raw is None or schema_raw is None:
            raise NotAStoreError(f"{self.path}: not a loaderd store (no metadata)")
        info = json.loads(info_raw)
        if info.get("format_version") != FORMAT_VERSION:
            raise NotAStoreError(
                f"{self.path}: store format {info.get('format_version')}, "
                f"this loaderd reads {FORMAT_VERSION}"
            )
        self.schema = Schema.from_arrow(pa.ipc.read_schema(pa.py_buffer(schema_raw)))
        self.num_samples: int = int(info["samples"])
        self.total_bytes: int = int(info["bytes"])
        self.fingerprint: bytes = bytes.fromhex(info["fingerprint"])
        self.info: dict[str, Any] = info
        self.reads = 0
        self.bytes_read = 0

    def get(self, sample_id: int) -> bytes:
        """One verified record.

        Raises:
            KeyError: no such sample.
            CorruptRecordError: the record failed its checksum.
        """
        return self.get_many([sample_id])[0]

    def get_many(self, ids: Sequence[int] | np.ndarray) -> list[bytes]:
        """Verified records for ids, in order, read in one transaction."""
        out: list[bytes] = []
        with self._env.begin(db=self._samples) as txn:
            for sid in ids:
                sid = int(sid)
                rec = txn.get(_KEY.pack(sid))
                if rec is None:
                    raise KeyError(f"sample {sid} is not in store {self.path}")
                verify(rec, sid, f"store {self.path}")
                out.append(rec)
        # Counters are statistics, not invariants: a lost increment under a race is harmless.
        self.reads += len(out)
        self.bytes_read += sum(len(r) for r in out)
        return out

    def close(self) -> None:
        """Close the environment (safe to call twice)."""
        self._env.close()

    def __enter__(self) -> SampleStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StoreWriter:
    """Builds a new store at ``path``, appending records with ids 0, 1, 2, ...

    Use as a context manager: a clean exit commits (syncs, writes metadata, renames into
    place); an exception removes the partial store.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
    """

    def __init__(self, path: str | os.PathLike[str], schema: Schema, *, overwrite: bool = False):
        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise FileExistsError(f"{self.path} already exists (pass --overwrite to replace it)")
        self.schema = schema
        self.overwrite = overwrite
        self.tmp = self.path.with_name(
            f".{self.path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self.tmp.mkdir(parents=True)
        self._map_size = 64 << 20
        self._env = lmdb.open(str(self.tmp), map_size=self._map_size, max_dbs=2, sync=False)
        self._samples = self._env.open_db(_SAMPLES)
        self._meta = self._env.open_db(_META)
        self.count = 0
        self.bytes = 0
        self._hash = xxhash.xxh3_128()
        self._done = False

    def append(self, records: Iterable[bytes]) -> None:
        """Append a batch of records in one transaction, growing the map as needed."""
        batch = list(records)
        while True:
            try:
                with self._env.begin(write=True, db=self._samples) as txn:
                    for i, rec in enumerate(batch):
                        txn.put(_KEY.pack(self.count + i), rec, append=True)
                break
            except lmdb.MapFullError:
                self._grow(sum(len(r) for r in batch))
            except lmdb.Error as e:
                raise StoreFullError(f"{self.tmp}: cannot write records ({e})") from e
        for rec in batch:
            self._hash.update(rec[:8])  # each record's checksum: the fingerprint covers content
        self.count += len(batch)
        self.bytes += sum(len(r) for r in batch)

    def _grow(self, need: int) -> None:
        self._map_size = max(self._map_size * 2, self._map_size + 4 * need)
        self._env.set_mapsize(self._map_size)

    def commit(self, extra_info: dict[str, Any] | None = None) -> Path:
        """Write the metadata, sync, and rename the store into place (once)."""
        if self._done:
            return self.path
        self._done = True
        info = {
            "format_version": FORMAT_VERSION,
            "samples": self.count,
            "bytes": self.bytes,
            "fingerprint": self._hash.hexdigest()[:32],
            "created": time.time(),
            **(extra_info or {}),
        }
        while True:
            try:
                with self._env.begin(write=True, db=self._meta) as txn:
                    txn.put(b"info", json.dumps(info).encode())
                    txn.put(b"schema", self.schema.to_arrow().serialize().to_pybytes())
                break
            except lmdb.MapFullError:
                self._grow(1 << 20)
        try:
            self._env.sync(True)
        except lmdb.Error as e:
            raise StoreFullError(f"{self.tmp}: cannot sync the store ({e})") from e
        self._env.close()
        if self.path.exists() and self.overwrite:
            shutil.rmtree(self.path)
        os.replace(self.tmp, self.path)
        _fsync_dir(self.path.parent)
        logger.info("wrote store %s: %d samples, %d bytes", self.path, self.count, self.bytes)
        return self.path

    def abort(self) -> None:
        """Drop the partial store (a no-op after commit)."""
        if self._done:
            return
        self._done = True
        self._env.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
