"""Background assembly of batches ahead of demand, so the server loop never waits on I/O.

Assembly reads a batch's records from the tier stack and copies each field into one contiguous
array per field, ready to go out as a frame. It runs on a small thread pool: LMDB reads,
checksums and numpy copies release the GIL for the bytes they touch. Finished batches are
announced through a pipe that the server loop polls next to its socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np

from loaderd.client.protocol import BatchArrays, Column, VarColumn
from loaderd.storage.records import RECORD_HEADER, RecordCodec, Schema
from loaderd.storage.tiers import TierStack

logger = logging.getLogger(__name__)

Key = tuple[Any, ...]
# Records smaller than this are joined and sliced in C (two copies, no Python loop); larger ones
# are copied row by row (one copy), where the loop's ~2 us per row no longer matters.
_JOIN_BELOW = 16 << 10


def gather_fixed(records: Sequence[bytes], outs: Sequence[tuple[np.ndarray, int]]) -> None:
    """Copy bytes ``[offset, offset + width)`` of each record into row i of each ``out``.

    Args:
        records: the batch's records, in order.
        outs: (``out``, ``offset``) pairs, ``out`` a uint8 array ``[len(records), width]``.
    """
    if not records:
        return
    size = len(records[0])
    if size < _JOIN_BELOW and all(len(r) == size for r in records):
        rows = np.frombuffer(b"".join(records), np.uint8).reshape(len(records), size)
        for out, offset in outs:
            out[:] = rows[:, offset : offset + out.shape[1]]
        return
    for out, offset in outs:
        width = out.shape[1]
        for i, rec in enumerate(records):
            out[i] = np.frombuffer(rec, np.uint8, width, offset)


class Assembler:
    """Turns sample ids into a batch of contiguous arrays, one per field."""

    def __init__(self, tiers: TierStack, schema: Schema) -> None:
        self.tiers = tiers
        self.codec = RecordCodec(schema)
        layout = schema.layout
        # (name, dtype, shape, offset in the record, bytes) of each fixed-shape field
        self.fixed = [
            (
                f.name,
                np.dtype(f.dtype),
                f.shape,
                RECORD_HEADER.size + layout.offsets[f.name],
                f.nbytes,
            )
            for f in schema.fields
            if not f.variable
        ]

    def assemble(self, ids: np.ndarray, weights: np.ndarray) -> BatchArrays:
        """Read and pack one batch (records are verified by the tiers they come from)."""
        records = self.tiers.get_many(ids)
        n = len(records)
        columns: dict[str, Column] = {}
        outs = []
        for name, dtype, shape, off, _ in self.fixed:
            out = np.empty((n, *shape), dtype)
            outs.append((out.reshape(n, int(np.prod(shape))).view(np.uint8), off))
            columns[name] = out
        gather_fixed(records, outs)
        if self.codec.layout.variable:
            parts = [
                self.codec.variable_parts(memoryview(rec)[RECORD_HEADER.size :]) for rec in records
            ]
            for k, name in enumerate(self.codec.layout.variable):
                lengths = np.fromiter((p[k].nbytes for p in parts), np.int64, n)
                offsets = np.zeros(n + 1, np.int64)
                np.cumsum(lengths, out=offsets[1:])
                data = b"".join(p[k] for p in parts)
                columns[name] = VarColumn(offsets, memoryview(data))
        return BatchArrays(
            np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(weights, np.float32), columns
        )


class Prefetcher:
    """A keyed pool of batch assemblies whose completions wake the server loop.

    Args:
        assemble: the function that builds a batch from (ids, weights).
        workers: the number of assembly threads.
    """

    def __init__(
        self,
        assemble: Callable[[np.ndarray, np.ndarray], BatchArrays],
        workers: int,
        on_discard: Callable[[BatchArrays], None] | None = None,
    ) -> None:
        self._assemble = assemble
        self._on_discard = on_discard  # gives back what a dropped batch holds (a shm slot)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="loaderd-prefetch")
        self._futures: dict[Key, Future[BatchArrays]] = {}
        self._done: list[Key] = []
        self._lock = threading.Lock()
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)

    def submit(self, key: Key, ids: np.ndarray, weights: np.ndarray) -> Future[BatchArrays]:
        """Start assembling ``key`` unless it is already under way; returns its future."""
        fut = self._futures.get(key)
        if fut is None:
            fut = self._pool.submit(self._assemble, ids, weights)
            self._futures[key] = fut
            fut.add_done_callback(partial(self._announce, key))
        return fut

    def __contains__(self, key: Key) -> bool:
        return key in self._futures

    def get(self, key: Key) -> Future[BatchArrays] | None:
        """The current assembly of ``key``, if any."""
        return self._futures.get(key)

    def pop(self, key: Key) -> Future[BatchArrays] | None:
        """Forget a key (its batch was sent or is no longer wanted)."""
        return self._futures.pop(key, None)

    def drop(self, predicate: Callable[[Key], bool]) -> None:
        """Forget every key that matches (e.g. all batches of a finished pass)."""
        for key in [k for k in self._futures if predicate(k)]:
            fut = self._futures.pop(key)
            if not fut.cancel() and self._on_discard is not None:
                fut.add_done_callback(self._discard)  # runs now if it is done already

    def _discard(self, fut: Future[BatchArrays]) -> None:
        if self._on_discard is not None and not fut.cancelled() and fut.exception() is None:
            self._on_discard(fut.result())

    def _announce(self, key: Key, _future: Future[BatchArrays]) -> None:
        with self._lock:
            self._done.append(key)
        with contextlib.suppress(BlockingIOError):  # a full pipe: the loop is awake already
            os.write(self._wake_w, b"x")

    def completed(self) -> list[Key]:
        """Keys finished since the last call (drains the wake-up pipe)."""
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            done, self._done = self._done, []
        return done

    @property
    def pending(self) -> int:
        """Batches assembled or under way."""
        return len(self._futures)

    def close(self) -> None:
        """Stop the workers (queued assemblies are cancelled); safe to call twice."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in (self.wake_fd, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
