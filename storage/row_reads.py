"""Records read from data.mdb with ``preadv`` straight into a batch's rows, verified there.

A miss worker that slices a record out of its map of the store has every page of it mapped
into its process (a fault, or a fault-around, per few pages), then reads the record twice:
once for its checksum, once to copy it into the batch. ``preadv`` maps nothing: the kernel
copies from the page cache and scatters the record as it goes (its header to a scratch
buffer, each fixed field into its row of the batch's frame, the padding between them to the
scratch), and the checksum is then computed over the pieces where they landed, in record
order, while they are still in the CPU's cache. One call per record, and a cold record's
pages are read in one request rather than one fault after another.

It pays for large records only (``benchmarks/bench_row_reads.py``, CPU per record on this
project's 2-core VMs, two runs): 100 KB records took 14-27 % less than through the map, 300 KB
3-13 % less; 50 KB records 3-15 % more and 3 KB records 60 % more (the Python around each call
outweighs the faults it saves). So records under ``MIN_BYTES`` are sliced as before.
Only a caller that knows each record's place in the file (the value index) reads this way,
and only records whose checksums name their samples, or whose place LMDB confirmed: a wrong
offset must fail the checksum (``map_slices.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import xxhash

from loaderd.storage.errors import CorruptRecordError
from loaderd.storage.records import RECORD_HEADER, RECORD_VERSION, STORED_VERSION

# Records at least this long are read with ``preadv`` (``SampleStore.read_rows``).
MIN_BYTES = 64 << 10

Rows = Sequence[tuple[memoryview, int, int]]  # (out, offset in the record, width), as gather_rows


def read_rows(
    fd: int,
    ids: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    rows: Rows,
    where: str,
) -> None:
    """Read record i (``lengths[i]`` bytes at ``offsets[i]`` of ``fd``) into row i of each out.

    Args:
        fd: the store's data.mdb, open for reading.
        ids: the batch's sample ids, in row order.
        offsets: where each record starts in the file.
        lengths: each record's length, header included.
        rows: (``out``, ``offset``, ``width``): bytes ``[offset, offset + width)`` of each
            record go to row i of ``out``, a buffer of ``len(ids)`` rows; disjoint ranges past
            the header. Bytes of a record no range covers are read and hashed, not kept.
        where: names the store in errors.

    Raises:
        CorruptRecordError: the first record (in row order) that is short, too short for its
            rows, or fails its header or checksum; rows already read hold their records.
    """
    head = RECORD_HEADER.size
    order = sorted(rows, key=lambda r: r[1])
    need = max((off + width for _, off, width in order), default=head)
    scratch = memoryview(bytearray(max(int(lengths.max(initial=0)), need)))
    for i, (sid, start, length) in enumerate(
        zip(ids.tolist(), offsets.tolist(), lengths.tolist(), strict=True)
    ):
        if length < need:
            raise CorruptRecordError(
                sid, where, f"record of {length} bytes, its fields need {need}"
            )
        pieces = [scratch[:head]]
        pos = head
        for out, off, width in order:
            if off > pos:
                pieces.append(scratch[pos:off])
            pieces.append(out[i * width : (i + 1) * width])
            pos = off + width
        if length > pos:
            pieces.append(scratch[pos:length])
        if os.preadv(fd, pieces, start) != length:
            raise CorruptRecordError(sid, where, "record runs past the end of data.mdb")
        digest, body_bytes, version = RECORD_HEADER.unpack_from(scratch)
        if version not in (RECORD_VERSION, STORED_VERSION) or body_bytes != length - head:
            raise CorruptRecordError(sid, where, "record header is damaged")
        hasher = xxhash.xxh3_64(seed=sid if version == STORED_VERSION else 0)
        for piece in pieces[1:]:
            hasher.update(piece)
        if hasher.intdigest() != digest:
            raise CorruptRecordError(sid, where)
