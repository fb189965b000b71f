"""Writing a store: once, by a single ingest writer, resumable after a crash or ^C.

``StoreWriter`` builds the store (``store.py`` describes its layout) in a temporary sibling
directory and renames it into place only after every record and the metadata are synced, so
an interrupted ingest never leaves a directory that looks like a complete store. A resumable
writer keeps its partial store (``partial_path``) with its progress in the same transactions
as the records, so whatever a crash leaves is a consistent prefix that a later writer of the
same identity continues.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import lmdb
import xxhash

from loaderd.storage.errors import ResumeError, StoreFullError
from loaderd.storage.records import RECORD_HEADER, STORED_VERSION, Schema, stamp
from loaderd.storage.safe_files import fsync_dir
from loaderd.storage.store import FORMAT_VERSION, META_DB, SAMPLES_DB, sample_key

logger = logging.getLogger(__name__)


class StoreWriter:
    """Builds a new store at ``path``, appending records with ids 0, 1, 2, ...

    Use as a context manager: a clean exit commits (syncs, writes metadata, renames into
    place); an exception removes the partial store.

    A resumable writer (``resumable`` given) builds the store in the fixed sibling
    ``.NAME.partial`` instead of a throw-away one, holds an ``flock`` on it while it writes,
    and writes its progress (records so far, their bytes, the fingerprint's state) in the
    transaction that commits those records: whatever a crash leaves is a consistent prefix. A
    later writer of the same identity continues after it (``resumed_at``). Interrupted by
    ^C or a full disk, the partial store is kept for that; any other error drops it.

    Args:
        path: the store directory to create.
        schema: the records' schema.
        overwrite: replace a store at ``path`` (only once the new one is complete).
        resumable: what is being written (the source and options, JSON-able), or None for
            a writer that starts over every time.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        ResumeError: another live ingest writes the partial store, or it holds records of
            another identity or schema.
    """

    COMMIT_SECONDS = 1.0  # a resumable writer commits (and syncs) about this often
    COMMIT_BYTES = 256 << 20  # or once it holds this much

    def __init__(
        self,
        path: str | os.PathLike[str],
        schema: Schema,
        *,
        overwrite: bool = False,
        resumable: dict[str, Any] | None = None,
    ):
        self.path = Path(path)
        if self.path.exists() or self.path.is_symlink():
            if not overwrite:
                raise FileExistsError(
                    f"{self.path} already exists (pass --overwrite to replace it)"
                )
            _check_replaceable(self.path)
        self.schema = schema
        self.overwrite = overwrite
        self.resumable = resumable is not None
        self._lock_fd = -1
        self.count = 0
        self.bytes = 0
        self._fingerprint = _Fingerprint()
        self._all_stamped = True  # every record written stamped with its id (not resumed)
        self._done = False
        self._pending: list[bytes] = []  # a resumable writer's batches not committed yet
        self._pending_extra: dict[bytes, bytes] = {}
        self._pending_bytes = 0
        self._committed_at = time.monotonic()
        if resumable is None:
            self.tmp = self.path.with_name(
                f".{self.path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            )
            self.tmp.mkdir(parents=True)
        else:
            self.tmp = partial_path(self.path)
            self._lock_fd = _lock_partial(self.tmp, create=True)
        self._map_size = max(64 << 20, 2 * _file_size(self.tmp / "data.mdb"))
        # A resumable store syncs its data pages at every commit (its meta page rides on the
        # next one's sync: LMDB's NOMETASYNC keeps the file consistent, a power cut loses at
        # most the last commit's worth); a throw-away one needs no sync before the final one.
        self._env = lmdb.open(
            str(self.tmp),
            map_size=self._map_size,
            max_dbs=2,
            sync=self.resumable,
            metasync=False,
        )
        self._samples = self._env.open_db(SAMPLES_DB)
        self._meta = self._env.open_db(META_DB)
        if resumable is not None:
            self._start_or_resume(resumable)
        self.resumed_at = self.count

    def _start_or_resume(self, identity: dict[str, Any]) -> None:
        schema = self.schema.to_arrow().serialize().to_pybytes()
        with self._env.begin(db=self._meta) as txn:
            old, progress = txn.get(_IDENTITY), txn.get(_PROGRESS)
            old_schema, pending = txn.get(b"schema"), txn.get(_PENDING)
        if old is None or progress is None:
            # New; or killed before its first batch, or after its last commit but before the
            # rename: either way nothing in it says what it holds, so it starts empty.
            with self._env.begin(write=True) as txn:
                txn.drop(self._samples, delete=False)
                txn.drop(self._meta, delete=False)
            self._put_meta({_IDENTITY: json.dumps(identity).encode(), b"schema": schema})
            return
        if json.loads(old) != identity or old_schema != schema:
            self.close_partial()
            raise ResumeError(
                f"{self.tmp}: holds an interrupted ingest of another source or schema; "
                "start over with --restart"
            )
        state = json.loads(progress)
        self.count, self.bytes = int(state["samples"]), int(state["bytes"])
        self._fingerprint = _Fingerprint(bytes.fromhex(state["chain"]), bytes(pending or b""))
        with self._env.begin(db=self._samples) as txn:
            held = int(txn.stat(self._samples)["entries"])
        if held != self.count:  # the progress key and the records commit together
            self.close_partial()
            raise ResumeError(f"{self.tmp}: {held} records but progress says {self.count}")
        with self._env.begin(db=self._samples) as txn:
            first = txn.get(sample_key(0))
        self._all_stamped = first is None or (RECORD_HEADER.unpack_from(first)[2] == STORED_VERSION)
        logger.info("resuming %s at record %d", self.tmp, self.count)

    def _put_meta(self, items: dict[bytes, bytes]) -> None:
        while True:
            try:
                with self._env.begin(write=True, db=self._meta) as txn:
                    for k, v in items.items():
                        txn.put(k, v)
                return
            except lmdb.MapFullError:
                self._grow(sum(len(v) for v in items.values()))

    def partial_items(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The ``extra`` metadata earlier ``append`` calls wrote under ``prefix``, in key order.

        What a resumed ingest needs back, e.g. a dictionary's values.
        """
        key = _PARTIAL + prefix
        out = []
        with self._env.begin(db=self._meta) as txn:
            cur = txn.cursor()
            if cur.set_range(key):
                for k, v in cur:
                    if not k.startswith(key):
                        break
                    out.append((k[len(_PARTIAL) :], bytes(v)))
        return out

    def append(self, records: Iterable[bytes], extra: dict[bytes, bytes] | None = None) -> None:
        """Append a batch of records, growing the map as needed.

        A plain writer commits each batch in its own transaction. A resumable one gathers
        batches for up to ``COMMIT_SECONDS`` (or ``COMMIT_BYTES``) and commits them, with
        their progress, in one synced transaction: an fsync per batch of small records
        would double an ingest's time.

        Args:
            records: the records, ids following the last ones (``next_id`` the first).
                Each is stored with its checksum seeded with its id (``records.stamp``);
                one the encoder sealed so already is written as it is.
            extra: metadata a resumed writer needs back (``partial_items``), written in the
                same transaction as the records and dropped at ``commit``.
        """
        first = self.next_id
        batch = [stamp(rec, first + i) for i, rec in enumerate(records)]
        if not self.resumable:
            self._write(batch, {})
            return
        self._pending += batch
        self._pending_extra.update(extra or {})
        self._pending_bytes += sum(len(r) for r in batch)
        due = time.monotonic() - self._committed_at >= self.COMMIT_SECONDS
        if due or self._pending_bytes >= self.COMMIT_BYTES:
            self.flush()

    @property
    def next_id(self) -> int:
        """The id the next record appended gets (the batches not committed yet counted)."""
        return self.count + len(self._pending)

    def flush(self) -> None:
        """Commit the batches a resumable writer has gathered (a no-op without any)."""
        if self._pending:
            self._write(self._pending, self._pending_extra)
        self._pending, self._pending_extra, self._pending_bytes = [], {}, 0
        self._committed_at = time.monotonic()

    def _write(self, batch: list[bytes], extra: dict[bytes, bytes]) -> None:
        fingerprint = self._fingerprint.after(b"".join(rec[:8] for rec in batch))
        count = self.count + len(batch)
        size = self.bytes + sum(len(r) for r in batch)
        while True:
            try:
                with self._env.begin(write=True, db=self._samples) as txn:
                    for i, rec in enumerate(batch):
                        txn.put(sample_key(self.count + i), rec, append=True)
                    if self.resumable:
                        for k, v in extra.items():
                            txn.put(_PARTIAL + k, v, db=self._meta)
                        state = {"samples": count, "bytes": size, "chain": fingerprint.chain.hex()}
                        txn.put(_PROGRESS, json.dumps(state).encode(), db=self._meta)
                        txn.put(_PENDING, fingerprint.pending, db=self._meta)
                break
            except lmdb.MapFullError:
                self._grow(sum(len(r) for r in batch))
            except lmdb.Error as e:
                raise StoreFullError(f"{self.tmp}: cannot write records ({e})") from e
        self._fingerprint, self.count, self.bytes = fingerprint, count, size

    def _grow(self, need: int) -> None:
        self._map_size = max(self._map_size * 2, self._map_size + 4 * need)
        self._env.set_mapsize(self._map_size)

    def commit(
        self, extra_info: dict[str, Any] | None = None, schema: Schema | None = None
    ) -> Path:
        """Write the metadata, sync, and rename the store into place (once).

        Args:
            extra_info: more keys for the store's info (the source, class names, ...).
            schema: the schema to store, if it changed while writing: the same fields and
                layout, with info learned from the data (a dictionary's values).
        """
        if self._done:
            return self.path
        self.flush()
        self._done = True
        if schema is not None:
            if schema.layout != self.schema.layout:
                raise ValueError("commit: the schema's record layout changed while writing")
            self.schema = schema
        info = {
            "format_version": FORMAT_VERSION,
            # Every record's checksum names its sample (``records.stamp``); absent where a
            # resumed ingest continued records an older writer stored without.
            **({"record_version": STORED_VERSION} if self._all_stamped else {}),
            "samples": self.count,
            "bytes": self.bytes,
            "fingerprint": self._fingerprint.hexdigest(),
            "created": time.time(),
            **(extra_info or {}),
        }
        while True:
            try:
                with self._env.begin(write=True, db=self._meta) as txn:
                    # What only a resumed writer needs goes in the transaction that completes
                    # the store, so the finished store holds the same keys however it was made.
                    cur = txn.cursor()
                    while cur.set_range(_PARTIAL) and cur.key().startswith(_PARTIAL):
                        cur.delete()
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
        old = None
        if self.overwrite and self.path.exists():
            _check_replaceable(self.path)  # again: it may have changed while we wrote
            # Two renames, never a window without a store at `path`: the old store moves
            # aside first, and is deleted only once the new one is in place.
            old = self.path.with_name(f".{self.path.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(self.path, old)
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        self.close_partial()
        if old is not None:
            shutil.rmtree(old)
        logger.debug("wrote store %s: %d samples, %d bytes", self.path, self.count, self.bytes)
        return self.path

    def abort(self, *, keep: bool = False) -> None:
        """Drop the partial store (a no-op after commit).

        Args:
            keep: keep a resumable writer's partial store for a later run to continue.
        """
        if self._done:
            return
        if keep and self.resumable:
            try:  # what was read before a ^C is whole: keep it too
                self.flush()
            except StoreFullError:
                logger.debug("the last %d records did not fit", len(self._pending))
        self._done = True
        self._env.close()
        if keep and self.resumable:
            logger.warning(
                "kept the partial store %s (%d records): the same command continues it, "
                "--restart drops it",
                self.tmp,
                self.count,
            )
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.close_partial()

    def close_partial(self) -> None:
        """Release the partial store's lock (safe to call twice)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

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
            self.abort(keep=issubclass(exc_type, (KeyboardInterrupt, StoreFullError)))


_PARTIAL = b"partial:"  # meta keys of a partial store, dropped at commit
_IDENTITY = _PARTIAL + b"identity"
_PROGRESS = _PARTIAL + b"progress"
_PENDING = _PARTIAL + b"pending"
_FINGERPRINT_BLOCK = 8 * 1024  # record checksums folded into the chain at a time


@dataclass(frozen=True, slots=True)
class _Fingerprint:
    """xxh3-128 over every record's checksum, as a chain that can be saved and resumed.

    ``chain`` folds each full block of checksums (``xxh3_128(chain + block)``), ``pending``
    holds the checksums since; both fit in a batch's transaction, which a running hash
    object's state does not. The blocks do not depend on how records were batched.
    """

    chain: bytes = bytes(16)
    pending: bytes = b""

    def after(self, checksums: bytes) -> _Fingerprint:
        data = self.pending + checksums
        chain, full = self.chain, len(data) - len(data) % _FINGERPRINT_BLOCK
        for at in range(0, full, _FINGERPRINT_BLOCK):
            chain = xxhash.xxh3_128_digest(chain + data[at : at + _FINGERPRINT_BLOCK])
        return _Fingerprint(chain, data[full:])

    def hexdigest(self) -> str:
        return xxhash.xxh3_128_hexdigest(self.chain + self.pending)[:32]


def partial_path(path: Path) -> Path:
    """Where a resumable ingest into ``path`` builds the store."""
    return path.with_name(f".{path.name}.partial")


def read_partial(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The identity and progress of an interrupted ingest into ``path``, or None.

    Returns:
        ``{"identity": ..., "samples": n}`` as the last committed batch left them.

    Raises:
        ResumeError: a live ingest is writing it.
    """
    tmp = partial_path(Path(path))
    if not tmp.is_dir() or tmp.is_symlink():
        return None
    os.close(_lock_partial(tmp, create=False))
    try:
        env = lmdb.open(str(tmp), readonly=True, lock=False, max_dbs=2)
    except lmdb.Error:
        return None  # killed before LMDB wrote its first page: nothing to continue
    try:
        with env.begin() as txn:
            meta = env.open_db(META_DB, txn=txn, create=False)
            identity, progress = txn.get(_IDENTITY, db=meta), txn.get(_PROGRESS, db=meta)
    except lmdb.Error:
        identity = progress = None
    finally:
        env.close()
    if identity is None or progress is None:
        return None
    return {"identity": json.loads(identity), "samples": json.loads(progress)["samples"]}


def discard_partial(path: str | os.PathLike[str]) -> bool:
    """Remove an interrupted ingest's partial store (loaderd's own files only).

    Returns:
        Whether there was one.

    Raises:
        ResumeError: a live ingest is writing it.
        FileExistsError: something else than a partial store has its name.
    """
    tmp = partial_path(Path(path))
    if not tmp.exists() and not tmp.is_symlink():
        return False
    fd = _lock_partial(tmp, create=False)
    try:
        shutil.rmtree(tmp)
    finally:
        os.close(fd)
    return True


def _lock_partial(tmp: Path, *, create: bool) -> int:
    """An flock on the partial store's directory, held while a writer appends to it."""
    if create:
        with contextlib.suppress(FileExistsError):
            tmp.mkdir(parents=True)
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise FileExistsError(f"{tmp} is not a partial loaderd store; not touching it") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ResumeError(f"{tmp}: another ingest is writing this store right now") from None
    names = {p.name for p in tmp.iterdir()}
    if os.fstat(fd).st_uid != os.geteuid() or names - {"data.mdb", "lock.mdb"}:
        os.close(fd)
        raise FileExistsError(f"{tmp} is not a partial loaderd store; not touching it")
    return fd


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _check_replaceable(path: Path) -> None:
    """Refuse to overwrite anything but a loaderd store: the user's files are never deleted.

    Raises:
        FileExistsError: ``path`` is a file, a link, or a directory that holds anything but
            a store's ``data.mdb`` and ``lock.mdb``.
    """
    if path.is_symlink() or not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a loaderd store; not replacing it")
    names = {p.name for p in path.iterdir()}
    if "data.mdb" not in names or names - {"data.mdb", "lock.mdb"}:
        raise FileExistsError(
            f"{path} exists and is not a loaderd store (it holds {sorted(names)[:5]}); "
            "not replacing it"
        )
