"""Per-job snapshot files: where a job's snapshot goes when the arena's slots belong to others.

The arena's snapshot region has two slots for the whole daemon, and a job keeps its previous
snapshot readable by writing the slot it does not hold. With two jobs, the second one's next
write would land on the first job's only snapshot. Rather than destroy it (silently, as it
used to), the daemon writes that job's snapshots to ``--state-dir/snapshots/`` instead, one
file per job, replaced atomically (so the previous one stays whole until the new one is), and
checksummed (so a damaged file is reported, never served).
"""

from __future__ import annotations

import struct
from pathlib import Path

import xxhash

from loaderd.storage.errors import StorageError
from loaderd.storage.safe_files import private_dir, write_atomic

_MAGIC = b"LDSP"
# magic, version, job name length, step, payload length, xxh3 of the payload
_HEAD = struct.Struct("<4sBHqQQ")
_VERSION = 1


class SnapshotFiles:
    """One atomically replaced, checksummed file per job in a private directory.

    Args:
        directory: where the files live (created 0700 on first write).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, job: str) -> Path:
        """The job's file (named by a hash: job names may hold any character)."""
        return self.directory / f"{xxhash.xxh3_128_hexdigest(job.encode())}.snap"

    def has(self, job: str) -> bool:
        """Whether the job's snapshots live here (then they always do: the file is newest)."""
        return self.path(job).exists()

    def write(self, job: str, step: int, payload: bytes | memoryview) -> None:
        """Replace the job's snapshot (the previous one stays whole if this fails).

        Raises:
            OSError: the write failed (a full disk); the previous snapshot is intact.
        """
        private_dir(self.directory, "snapshot directory")
        name = job.encode()
        data = bytes(payload)
        head = _HEAD.pack(
            _MAGIC, _VERSION, len(name), step, len(data), xxhash.xxh3_64_intdigest(data)
        )
        write_atomic(self.path(job), head + name + data)

    def read(self, job: str) -> tuple[int, bytes] | None:
        """``(step, payload)`` of the job's snapshot, or None if it has no file.

        Raises:
            StorageError: the file is damaged (names it; it is left for the user).
        """
        path = self.path(job)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        if len(raw) < _HEAD.size:
            raise StorageError(f"snapshot file {path} is truncated ({len(raw)} bytes)")
        magic, version, name_len, step, length, digest = _HEAD.unpack_from(raw)
        start = _HEAD.size + name_len
        data = raw[start : start + length]
        if magic != _MAGIC or version != _VERSION or raw[_HEAD.size : start] != job.encode():
            raise StorageError(f"snapshot file {path} is not a snapshot of job {job!r}")
        if len(data) != length or xxhash.xxh3_64_intdigest(data) != digest:
            raise StorageError(f"snapshot file {path} is damaged (checksum or length)")
        return step, data
