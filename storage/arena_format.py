"""The arena's on-disk format: header page, record framing, and the recovery sweep.

File layout (little-endian; offsets in bytes)::

    [0, 4096)                      header page: magic, version, arena uid, store fingerprint,
                                   layout sizes, xxh3 of the header
    [4096, 4096 + log_bytes)       the log: records at 64-byte aligned offsets, used as a ring
    [snap_offset, file end)        two snapshot slots, written alternately (arena_snapshot.py)

A record is a 64-byte header (magic, version, arena uid, sequence, sample id, payload length,
xxh3 of the payload, xxh3 of the header), the payload, then an 8-byte commit word derived from
the header checksum, stored only once the payload is durable. A zero commit word revokes a
record (discarded, replaced or found corrupt).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, NamedTuple

import numpy as np

from loaderd.storage.checksum import xxh3_64

Payload = bytes | bytearray | memoryview

FORMAT_VERSION: Final = 1
HEADER_PAGE: Final = 4096
ALIGN: Final = 64  # record alignment: one cache line, and a cheap vectorised header search
REC_HEAD: Final = 64  # the payload starts at the cache line after the record header

_ARENA_MAGIC: Final = b"LDARENA\x00"
# magic, version, flags, arena uid, fingerprint, file bytes, log offset, log bytes,
# snapshot offset, snapshot slot bytes; the xxh3 of these bytes follows.
_HEADER = struct.Struct("<8sIIQ16sQQQQQ")
CHECKSUM = struct.Struct("<Q")

_REC_MAGIC: Final = 0x4344524C  # b"LRDC" read as a little-endian u32
_REC_KIND_SAMPLE: Final = 1
# magic, version, kind, reserved, arena uid, seq, sample id, length, payload xxh3; then the
# header's own xxh3.
_REC = struct.Struct("<IBBHQQQQQ")
_COMMIT_SALT: Final = 0xC0EC0111DEADBEEF
_SCAN_CHUNK: Final = 64 << 20


def xxh(data: Payload) -> int:
    """The xxh3_64 checksum used throughout the arena.

    With the GIL held, as the store's checksums are (``checksum.py`` says why): the arena's
    writer thread hashes every record it admits, and python-xxhash's own call, letting go of
    the GIL for a record over 64 KiB, kept the server loop waiting for it each time.
    """
    return xxh3_64(data)


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def commit_word(header_xxh: int) -> int:
    """The commit word of a record; never zero, since zero revokes."""
    return (header_xxh ^ _COMMIT_SALT) | 1


def commit_offset(off: int, length: int) -> int:
    """Where the commit word of the record at ``off`` with a ``length``-byte payload lies."""
    return off + REC_HEAD + _align(length, 8)


def record_extent(length: int) -> int:
    """Bytes a record with a ``length``-byte payload takes in the log (header, commit, pad)."""
    return _align(REC_HEAD + _align(length, 8) + 8, ALIGN)


class Rec(NamedTuple):
    """A record header found intact in the log."""

    off: int  # absolute file offset
    extent: int
    seq: int
    sample_id: int
    length: int
    payload_xxh: int
    header_xxh: int


@dataclass(frozen=True, slots=True)
class Layout:
    """Where the regions of an arena file lie; the header page records it."""

    fingerprint: bytes
    file_bytes: int
    log_bytes: int
    slot_bytes: int
    log_off: int = HEADER_PAGE

    @classmethod
    def plan(cls, capacity_bytes: int, snapshot_bytes: int, fingerprint: bytes) -> Layout:
        """Lay out a file of ``capacity_bytes`` (rounded down to 4 KiB).

        Raises:
            ValueError: A size or the fingerprint is out of range.
        """
        if len(fingerprint) != 16:
            raise ValueError(f"`fingerprint` must be 16 bytes, got {len(fingerprint)}")
        if snapshot_bytes < 0:
            raise ValueError(f"`snapshot_bytes` must be >= 0, got {snapshot_bytes}")
        file_bytes = capacity_bytes // HEADER_PAGE * HEADER_PAGE
        slot_bytes = snapshot_bytes // 2 // HEADER_PAGE * HEADER_PAGE
        if snapshot_bytes and slot_bytes < 2 * HEADER_PAGE:
            raise ValueError(f"`snapshot_bytes` must be 0 or >= 16384, got {snapshot_bytes}")
        log_bytes = file_bytes - HEADER_PAGE - 2 * slot_bytes
        if log_bytes < HEADER_PAGE:
            raise ValueError(
                f"`capacity_bytes`={capacity_bytes} leaves no room for the log "
                f"(header {HEADER_PAGE} + snapshots {2 * slot_bytes} bytes)"
            )
        return cls(bytes(fingerprint), file_bytes, log_bytes, slot_bytes)

    @property
    def log_end(self) -> int:
        """One past the log's last byte; the snapshot region starts here."""
        return self.log_off + self.log_bytes

    def _fields(self) -> tuple[int, int, int, int, int]:
        return self.file_bytes, self.log_off, self.log_bytes, self.log_end, self.slot_bytes

    def header(self, uid: int) -> bytes:
        """The header page's bytes for an arena with this layout and ``uid``."""
        fields = _HEADER.pack(
            _ARENA_MAGIC, FORMAT_VERSION, 0, uid, self.fingerprint, *self._fields()
        )
        return fields + CHECKSUM.pack(xxh(fields))

    def check(self, raw: bytes, size: int) -> tuple[int, str | None]:
        """Read a header page against this layout.

        Args:
            raw: The file's first bytes (at least ``HEADER_BYTES``).
            size: The file's size.

        Returns:
            ``(uid, None)`` when the file is an arena of this store and layout, else
            ``(0, why not)``.
        """
        if size != self.file_bytes:
            return 0, f"its size is {size} bytes, expected {self.file_bytes}"
        fields = raw[: _HEADER.size]
        (magic, version, _flags, uid, fingerprint, *layout) = _HEADER.unpack(fields)
        if magic != _ARENA_MAGIC:
            return 0, "its header is not an arena header"
        if CHECKSUM.unpack_from(raw, _HEADER.size)[0] != xxh(fields):
            return 0, "its header checksum does not match"
        if version != FORMAT_VERSION:
            return 0, f"it has format version {version}, expected {FORMAT_VERSION}"
        if fingerprint != self.fingerprint:
            return 0, f"it belongs to another store (fingerprint {fingerprint.hex()})"
        if tuple(layout) != self._fields():
            return 0, "its layout (log or snapshot sizes) differs"
        return uid, None


HEADER_BYTES: Final = _HEADER.size + CHECKSUM.size


def pack_record_header(
    uid: int, seq: int, sample_id: int, length: int, payload_xxh: int
) -> tuple[bytes, int]:
    """A record header's bytes and its checksum (which the commit word is derived from)."""
    fields = _REC.pack(
        _REC_MAGIC, FORMAT_VERSION, _REC_KIND_SAMPLE, 0, uid, seq, sample_id, length, payload_xxh
    )
    hxh = xxh(fields)
    return fields + CHECKSUM.pack(hxh), hxh


def parse_record(mm: mmap.mmap, off: int, uid: int, log_end: int) -> Rec | None:
    """The record header at ``off`` if it belongs to this arena and is intact, else None."""
    magic, version, kind, _, r_uid, seq, sample_id, length, pxh = _REC.unpack_from(mm, off)
    if magic != _REC_MAGIC or version != FORMAT_VERSION or kind != _REC_KIND_SAMPLE:
        return None
    hxh = CHECKSUM.unpack_from(mm, off + _REC.size)[0]
    if r_uid != uid or hxh != xxh(mm[off : off + _REC.size]):
        return None
    extent = record_extent(length)
    if off + extent > log_end:
        return None
    return Rec(off, extent, seq, sample_id, length, pxh, hxh)


def record_state(mm: mmap.mmap, rec: Rec) -> bool | None:
    """Whether a record is whole.

    Returns:
        True when committed and the payload checks out; None when not committed (torn, or
        revoked); False when committed but the payload is wrong (corruption).
    """
    commit = CHECKSUM.unpack_from(mm, commit_offset(rec.off, rec.length))[0]
    if commit != commit_word(rec.header_xxh):
        return None if commit == 0 else False
    start = rec.off + REC_HEAD
    return xxh(mm[start : start + rec.length]) == rec.payload_xxh


def find_headers(mm: mmap.mmap, log_off: int, log_end: int, uid: int) -> list[Rec]:
    """Every intact record header in the log, newest first."""
    found: list[Rec] = []
    for lo in range(log_off, log_end, _SCAN_CHUNK):
        n = min(_SCAN_CHUNK, log_end - lo)
        words = np.frombuffer(mm, dtype="<u4", count=n // 4, offset=lo)
        hits = np.flatnonzero(words[:: ALIGN // 4] == _REC_MAGIC)
        del words  # release the export, or the mmap cannot be closed
        recs = (parse_record(mm, off, uid, log_end) for off in (hits * ALIGN + lo).tolist())
        found.extend(rec for rec in recs if rec is not None)
    found.sort(key=lambda r: r.seq, reverse=True)
    return found


def unswept(recs: list[Rec], log_off: int, log_bytes: int) -> Iterator[Rec]:
    """The records (newest first) that no later write of the ring has come round to.

    Writes go to the ring sequentially, so all that was written after a record lies in the
    ring between that record's end and the newest record's end, whether or not those later
    headers survived. Replaying newest to oldest, a record is still there when the span
    swept since, plus the gap up to it, plus itself, fits in one lap.
    """
    swept = 0  # bytes of ring written after the record under consideration
    sweep_start = 0  # relative offset where that span begins
    for i, rec in enumerate(recs):
        rel = rec.off - log_off
        if i > 0:
            gap = (sweep_start - (rel + rec.extent)) % log_bytes
            if gap + rec.extent + swept > log_bytes:
                continue  # overwritten by a later lap
            swept += gap
        swept += rec.extent
        sweep_start = rel
        yield rec
        if swept >= log_bytes:
            return
