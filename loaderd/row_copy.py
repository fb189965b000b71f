"""A batch's rows copied in one compiled call (``loaderd/gather_rows.c``).

The copy on a cache hit's path is bound by memory, and from Python it runs one core's
ordinary stores: 5.6-6.3 GB/s of 100 KB rows into ring slots on the benchmark's VM, where a
streaming copy on two threads ran 8.5-9.8 (``benchmarks/bench_gather.py``). The library is
plain C, loaded with ``ctypes.PyDLL``: the GIL stays held for the call, as it is for the
Python copy (``prefetch.gather_rows`` says why). Where the library was not built, ``gather``
says so and the caller copies from Python.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from collections.abc import Sequence

import numpy as np

from loaderd.storage.syscalls import address_of

logger = logging.getLogger(__name__)

Rows = Sequence[tuple[memoryview, int, int]]  # (out, offset, width): a field's rows

# A batch at least this large is streamed to memory: it is written back from the cache
# before the trainer reads it in any case, a few batches later.
STREAM_BYTES = 1 << 20
# One thread per this many bytes of rows, up to ``THREADS``: a thread costs ~30 us to start,
# and where cores are few it takes one from the daemon's other work. On 16 cores, 512 KiB a
# thread and up to 8 served 100 KB hits at 84k, 71k and 79k samples/s against 66k, 63k and
# 79k with 2 MiB and up to 4 (alternating fresh daemons; ``docs/design.md``, "On a machine
# of many cores"); on 2 cores 512 KiB split 20 KB hits' 1.3 MB batches in two and ran them
# at 49-71k samples/s against 64-77k (hit epochs of three alternating pairs). On 2 cores one
# thread copies as fast as two, memory being the bound (20-21 GB/s either way), and leaves
# the other core to the trainer: 100 KB hits at 132-149k samples/s for 6.4-7.3 us of the
# daemon's CPU a sample, against 132-144k for 9.6-10.5 with two (three alternating pairs).
_CORES = len(os.sched_getaffinity(0))
THREAD_BYTES = 512 << 10 if _CORES >= 8 else 2 << 20
THREADS = min(8, _CORES) if _CORES > 2 else 1


def _load() -> ctypes.PyDLL | None:
    spec = importlib.util.find_spec("loaderd._gather_rows")
    if spec is None or spec.origin is None:
        logger.info("the compiled row copy is not built: batches are copied from Python")
        return None
    lib = ctypes.PyDLL(spec.origin)
    p, n = ctypes.c_void_p, ctypes.c_size_t
    lib.loaderd_gather_rows.argtypes = [p, n, p, n, ctypes.c_int, ctypes.c_int]
    lib.loaderd_gather_rows.restype = ctypes.c_int
    return lib


_LIB = _load()
AVAILABLE = _LIB is not None


def _table(n: int, shortest: int, outs: Rows) -> np.ndarray:
    """The outputs as (address, offset, width) rows, checked against n records.

    Raises:
        ValueError: a record too short (``shortest``), or an ``out`` read-only, not
            contiguous or of the wrong size (nothing is written out of bounds).
    """
    table = np.empty((len(outs), 3), np.uint64)
    for k, (out, offset, width) in enumerate(outs):
        if out.readonly or not out.contiguous:
            raise ValueError("rows are copied into a writable, contiguous frame")
        if out.nbytes != n * width or offset < 0 or offset + width > shortest:
            raise ValueError(
                f"rows [{offset}, {offset + width}) of {n} records (shortest {shortest} B) "
                f"do not fit a frame of {out.nbytes} B"
            )
        table[k] = (address_of(out), offset, width)
    return table


def gather(records: Sequence[bytes | memoryview], outs: Rows) -> bool:
    """``prefetch.gather_rows`` in one compiled call; False: not built, nothing was copied.

    Args:
        records: the batch's records (at least one), each as long as every ``offset + width``.
        outs: (``out``, ``offset``, ``width``): ``out`` holds ``len(records)`` rows of ``width``.

    Raises:
        ValueError: see ``_table``.
    """
    if _LIB is None:
        return False
    n = len(records)
    table = _table(n, min(map(len, records)), outs)
    _copy(np.fromiter(map(address_of, records), np.uint64, n), table, outs)
    return True


def gather_at(sources: np.ndarray, shortest: int, outs: Rows) -> None:
    """``gather`` of records given by address: no Python step per record.

    Args:
        sources: where each record lies in this process's memory (uint64), readable for the
            call (``DramCache.located``).
        shortest: the shortest record's length (no row is read past it).
        outs: as ``gather``'s.

    Raises:
        ValueError: see ``_table``; RuntimeError: the compiled copy is not built (check
            ``AVAILABLE`` first).
    """
    if _LIB is None:
        raise RuntimeError("the compiled row copy is not built")
    _copy(np.ascontiguousarray(sources, np.uint64), _table(len(sources), shortest, outs), outs)


def _copy(sources: np.ndarray, table: np.ndarray, outs: Rows) -> None:
    assert _LIB is not None
    nbytes = len(sources) * sum(w for _, _, w in outs)
    _LIB.loaderd_gather_rows(
        sources.ctypes.data,
        len(sources),
        table.ctypes.data,
        len(outs),
        max(1, min(THREADS, nbytes // THREAD_BYTES)),
        nbytes >= STREAM_BYTES,
    )
