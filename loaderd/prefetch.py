"""Batch assembly ahead of demand: the one place where a batch's bytes are put together.

``Assembler`` reads a batch's records from the tier stack (views into LMDB's map for misses,
so a record passed through is never copied on the way) and copies each field, once, into the
batch's frames: ids, weights, then per field its rows (fixed shape) or its offsets and bytes
(variable length), in wire order. Where the frames live is the caller's choice: an
``Allocate`` function lends memory (a shared-memory ring slot, ``loaderd.shm_ring``); without
one, or when it has none that fits, the frames are fresh memory. The record layout comes from
``storage.records.Layout``; nothing here knows a byte offset of its own.

``Prefetcher`` runs assemblies on a small thread pool (LMDB reads and checksums release the
GIL for the bytes they touch; the copies into a batch hold it, see ``gather_rows``) and
announces finished ones through a pipe that the server loop polls next to its socket. A batch
whose records DRAM holds (up to ``INLINE_BYTES``) is assembled by ``submit`` itself, on the
server loop: a hit costs less to copy than to hand to a thread and be woken for.
Batches wait for a worker in one queue per stream (a job's rank, the key's first two parts),
served in turn: a client that asks for many batches delays another job's next batch by one
assembly, not by all of its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np

from loaderd import row_copy
from loaderd.client.protocol import BatchArrays, Column, VarColumn
from loaderd.client.shm import slot_layout
from loaderd.fair_share import RoundRobin
from loaderd.gate import Gate
from loaderd.storage.records import RECORD_HEADER, RecordCodec, Schema
from loaderd.storage.tiers import Record, TierStack

logger = logging.getLogger(__name__)

Key = tuple[Any, ...]
# Equal-size records smaller than this are joined and sliced in C (two copies, no Python loop
# per row and field); larger ones are copied once, by the compiled row copy (``row_copy``), or
# row by row from Python where it is not built. Below this size, the compiled copy's ~0.8 us
# a record to find its address costs as much as it saves.
_JOIN_BELOW = 16 << 10
# Batches up to this size whose records are all in DRAM are assembled on the server loop. A
# pool thread's copy holds the GIL as well (``gather_rows``), so handing it over buys no
# overlap, only the wake-ups and GIL handovers: 100 KB hits went from 57-73k to 83-89k
# samples/s (alternating runs) when 6.4 MB batches stayed on the loop. The cap bounds how
# long one copy keeps the loop from other clients (~2 ms).
INLINE_BYTES = 16 << 20


@dataclass(slots=True)
class Placed:
    """Memory lent for one batch: one writable buffer per frame, in wire order."""

    frames: list[memoryview]
    lease: Any = None  # what the allocator lent (given back by its owner); None: fresh memory


Allocate = Callable[[Sequence[int]], "Placed | None"]


@dataclass(slots=True)
class _Queued:
    """A batch waiting for a worker."""

    future: Future[Batch]
    ids: np.ndarray
    weights: np.ndarray
    allocate: Allocate | None


@dataclass(slots=True)
class Batch(BatchArrays):
    """An assembled batch: its arrays view ``frames``, which may lie in lent memory."""

    frames: list[memoryview] | None = None
    lease: Any = None


def fresh(sizes: Sequence[int]) -> Placed:
    """Frames in new memory: one buffer, frames 64-byte aligned as in a ring slot."""
    spans = slot_layout(sizes)
    total = spans[-1][0] + spans[-1][1] if spans else 0
    buf = np.empty(total, np.uint8).data
    return Placed([buf[off : off + n] for off, n in spans])


def gather_rows(records: Sequence[Record], outs: Sequence[tuple[memoryview, int, int]]) -> None:
    """Copy bytes ``[offset, offset + width)`` of record i into row i of each ``out``.

    Args:
        records: the batch's records, in order.
        outs: (``out``, ``offset``, ``width``): ``out`` a byte buffer of ``len(records)`` rows.
    """
    n = len(records)
    if not n or not outs:
        return
    size = len(records[0])
    if size < _JOIN_BELOW and all(len(r) == size for r in records):
        rows = np.frombuffer(b"".join(records), np.uint8).reshape(n, size)
        for out, offset, width in outs:
            np.frombuffer(out, np.uint8).reshape(n, width)[:] = rows[:, offset : offset + width]
        return
    if row_copy.gather(records, outs):
        return
    # Row by row with the GIL held. A copy that lets go of the GIL (np.copyto) must win it
    # back for the next row, 64 times a batch, from the server loop or the other assembler:
    # the gather then spends more time handing over the GIL than copying
    # (benchmarks/bench_gather.py).
    for out, offset, width in outs:
        end = offset + width
        for i, rec in enumerate(records):
            out[i * width : (i + 1) * width] = memoryview(rec)[offset:end]


class BatchWriter:
    """Writes a batch's frames from its records: the schema's side of assembly, no tiers.

    The daemon's ``Assembler`` and a miss worker process (``loaderd.miss_workers``) both
    write batches with it, so a batch has one layout wherever it is assembled.
    """

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.codec = RecordCodec(schema)
        self.layout = schema.layout

    def frame_sizes(self, n: int, var_bytes: Sequence[int] = ()) -> list[int]:
        """Byte size of each frame of an n-sample batch, in wire order.

        Args:
            n: samples in the batch.
            var_bytes: total bytes of each variable-length field (in ``layout.variable``
                order); zeros when left out (to size a ring for fixed fields).
        """
        var = dict(zip(self.layout.variable, var_bytes, strict=False))
        fixed = {s.name: s.nbytes for s in self.layout.fixed}
        sizes = [8 * n, 4 * n]
        for f in self.schema.fields:
            if f.name in fixed:
                sizes.append(n * fixed[f.name])
            else:
                sizes += [8 * (n + 1), var.get(f.name, 0)]
        return sizes

    def frame_bytes(self, n: int, record_bytes: int) -> int:
        """Bytes of an n-sample batch's frames, from its records' total length alone.

        A record is its header, the fixed part and a length per variable field, then the
        variable bytes (``storage.records``), so their total length tells the variable bytes
        of the batch without reading a record.
        """
        layout = self.layout
        per_record = RECORD_HEADER.size + layout.fixed_bytes + 4 * len(layout.variable)
        return sum(self.frame_sizes(n)) + record_bytes - n * per_record

    def measure(self, records: Sequence[Record]) -> tuple[list[int], list[list[memoryview]]]:
        """The frame sizes of a batch of these records, and each one's variable parts."""
        parts: list[list[memoryview]] = []
        var_bytes: list[int] = []
        if self.layout.variable:
            parts = [self.codec.variable_parts(memoryview(r)[16:]) for r in records]
            var_bytes = [sum(p[k].nbytes for p in parts) for k in range(len(self.layout.variable))]
        return self.frame_sizes(len(records), var_bytes), parts

    def fill(
        self,
        ids: np.ndarray,
        weights: np.ndarray,
        records: Sequence[Record],
        parts: list[list[memoryview]],
        frames: list[memoryview],
    ) -> None:
        """Copy ids, weights and each field of the records into the batch's frames."""
        rows = self._start(ids, weights, parts, frames)
        if len(ids):
            gather_rows(records, rows)

    def fill_read(
        self,
        ids: np.ndarray,
        weights: np.ndarray,
        frames: list[memoryview],
        read_rows: Callable[[list[tuple[memoryview, int, int]]], None],
    ) -> None:
        """``fill`` of a batch of fixed fields, whose rows ``read_rows`` writes.

        The records are not in memory: ``read_rows`` reads them from the store's file
        straight into the rows (``SampleStore.read_rows``), where ``fill`` copies them.
        """
        if self.layout.variable:
            raise ValueError("a batch with variable-length fields is filled from its records")
        rows = self._start(ids, weights, [], frames)
        if len(ids):
            read_rows(rows)

    def _start(
        self,
        ids: np.ndarray,
        weights: np.ndarray,
        parts: list[list[memoryview]],
        frames: list[memoryview],
    ) -> list[tuple[memoryview, int, int]]:
        """Write ids, weights and the variable fields; where each fixed field's rows go."""
        np.frombuffer(frames[0], np.int64)[:] = ids
        np.frombuffer(frames[1], np.float32)[:] = weights
        slices = {s.name: s for s in self.layout.fixed}
        rows: list[tuple[memoryview, int, int]] = []
        k, v = 2, 0
        for f in self.schema.fields:
            s = slices.get(f.name)
            if s is not None:
                rows.append((frames[k], s.offset, s.nbytes))
                k += 1
                continue
            offsets = np.frombuffer(frames[k], np.int64)
            offsets[0] = 0
            np.cumsum([p[v].nbytes for p in parts], out=offsets[1:])
            data = frames[k + 1]
            for i, p in enumerate(parts):
                data[int(offsets[i]) : int(offsets[i + 1])] = p[v]
            k, v = k + 2, v + 1
        return rows

    def wrap(self, frames: list[memoryview], lease: Any = None) -> Batch:
        """The batch whose frames ``fill`` wrote: arrays that view them, no copy."""
        ids = np.frombuffer(frames[0], np.int64)
        n = len(ids)
        slices = {s.name: s for s in self.layout.fixed}
        columns: dict[str, Column] = {}
        k = 2
        for f in self.schema.fields:
            s = slices.get(f.name)
            if s is not None:
                columns[f.name] = np.frombuffer(frames[k], s.dtype).reshape(n, *s.shape)
                k += 1
            else:
                columns[f.name] = VarColumn(np.frombuffer(frames[k], np.int64), frames[k + 1])
                k += 2
        weights = np.frombuffer(frames[1], np.float32)
        return Batch(ids, weights, columns, frames=frames, lease=lease)


class InFlight(Protocol):
    """A batch handed to another process: its socket is readable once the answer is there."""

    def fileno(self) -> int:
        """The socket its answer comes on."""


class Elsewhere(Protocol):
    """Assembles batches in other processes (``loaderd.miss_workers``), without waiting."""

    @property
    def running(self) -> int:
        """Processes up to take batches."""

    @property
    def idle(self) -> int:
        """Batches they can take now."""

    def takes(self, ids: np.ndarray, allocate: Allocate | None) -> bool:
        """Whether this batch, bound for this memory, may go to them."""

    def send(self, ids: np.ndarray, weights: np.ndarray, allocate: Allocate | None) -> Any:
        """The batch handed out (an ``InFlight``), or None: not taken (assemble it here)."""

    def finish(self, flight: Any) -> Batch | None:
        """The batch ``send`` handed out (its socket is readable), or None: assemble it here."""

    def gone(self, flight: Any) -> bool:
        """Whether its process is gone (its other batches will not be answered)."""

    def abandon(self, flight: Any) -> None:
        """Give up on a batch under way (the daemon is closing)."""


class Assembler(BatchWriter):
    """Turns sample ids into a batch: one frame per id array, fixed field, variable part.

    Args:
        tiers: where records come from.
        schema: the store's schema.
    """

    def __init__(self, tiers: TierStack, schema: Schema) -> None:
        super().__init__(schema)
        self.tiers = tiers

    def assemble(
        self, ids: np.ndarray, weights: np.ndarray, allocate: Allocate | None = None
    ) -> Batch:
        """Read and copy one batch, into memory from ``allocate`` when it has some.

        A batch whose records DRAM holds skips the read's per-record steps (``resident``).
        """
        batch = self.assemble_resident(ids, weights, allocate)
        if batch is not None:
            return batch
        with self.tiers.read(ids) as records:
            return self._build(ids, weights, records, allocate)

    def assemble_resident(
        self, ids: np.ndarray, weights: np.ndarray, allocate: Allocate | None = None
    ) -> Batch | None:
        """``assemble``, when DRAM holds every record; None (nothing done) otherwise.

        Records of fixed fields that DRAM holds as views of the store's map are gathered
        from their addresses (``TierStack.located``): no Python object is touched per
        record, which at 3 KB cost a hit more than the copy itself.
        """
        if not self.layout.variable and row_copy.AVAILABLE:
            at = self.tiers.located(ids)
            if at is not None:
                rows = partial(row_copy.gather_at, *at)
                return self._placed(
                    self.frame_sizes(len(ids)),
                    allocate,
                    partial(self.fill_read, ids, weights, read_rows=rows),
                )
        records = self.tiers.resident(ids)
        return None if records is None else self._build(ids, weights, records, allocate)

    def _build(
        self,
        ids: np.ndarray,
        weights: np.ndarray,
        records: list[Record],
        allocate: Allocate | None,
    ) -> Batch:
        sizes, parts = self.measure(records)
        return self._placed(sizes, allocate, partial(self.fill, ids, weights, records, parts))

    def _placed(
        self,
        sizes: list[int],
        allocate: Allocate | None,
        fill: Callable[[list[memoryview]], None],
    ) -> Batch:
        """The batch ``fill`` writes into frames of these sizes, from ``allocate`` or fresh."""
        placed = allocate(sizes) if allocate is not None else None
        if placed is None:
            placed = fresh(sizes)
        try:
            fill(placed.frames)
        except BaseException:
            if placed.lease is not None:
                placed.lease.release()
            raise
        return self.wrap(placed.frames, placed.lease)


class Prefetcher:
    """A keyed pool of batch assemblies whose completions wake the server loop.

    Args:
        assembler: builds batches.
        workers: how many assemblies run at once (``set_workers`` changes it).
        allocator_for: the memory a batch with this key is assembled into (None: fresh).
        on_discard: gives back what a dropped batch holds (its lease).
        max_workers: the most ``set_workers`` may allow (default ``workers``): the pool's
            threads, each assembly passing a ``Gate`` of ``workers`` first.
        inline_bytes: a batch expected to be at most this large (the store's mean record
            size times its samples) whose records DRAM holds is assembled by ``submit`` on
            the caller's thread; 0: every batch goes to the pool.
        elsewhere: worker processes for batches that miss DRAM, driven from the caller's
            loop once it ``watch``-es them; None: every batch is assembled here.
    """

    def __init__(
        self,
        assembler: Assembler,
        workers: int,
        allocator_for: Callable[[Key], Allocate | None] | None = None,
        on_discard: Callable[[Batch], None] | None = None,
        max_workers: int | None = None,
        inline_bytes: int = INLINE_BYTES,
        elsewhere: Elsewhere | None = None,
    ) -> None:
        self._assembler = assembler
        self._elsewhere = elsewhere
        store = assembler.tiers.store
        mean = store.total_bytes // max(store.num_samples, 1)
        self._inline_samples = inline_bytes // max(mean, 1) if inline_bytes > 0 else 0
        self.inline = 0  # batches assembled on the caller's thread (all in DRAM, <= inline_bytes)
        self.gate = Gate(workers)
        self.max_workers = max(workers, max_workers or workers)
        self._allocator_for = allocator_for
        self._on_discard = on_discard
        self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="loaderd-prefetch")
        self._futures: dict[Key, Future[Batch]] = {}
        self._queue: RoundRobin[Key, _Queued] = RoundRobin()  # waiting for a worker, per stream
        self._done: list[Key] = []
        self._lock = threading.Lock()
        # Batches for worker processes (``watch``): waiting for one, and under way by socket.
        self._watch: tuple[Callable[[int], None], Callable[[int], None]] | None = None
        self._worker_queue: RoundRobin[Key, tuple[Key, _Queued]] = RoundRobin()
        self._flights: dict[int, deque[tuple[Key, _Queued, Any]]] = {}
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)

    def submit(self, key: Key, ids: np.ndarray, weights: np.ndarray) -> Future[Batch]:
        """Start assembling ``key`` unless it is already under way; returns its future.

        A batch whose records DRAM holds, up to ``inline_bytes``, is assembled here and now:
        its future is done when this returns, and it is not announced (``completed``), so
        the caller looks.
        """
        fut = self._futures.get(key)
        if fut is None:
            allocate = self._allocator_for(key) if self._allocator_for is not None else None
            fut = Future()
            self._futures[key] = fut
            if len(ids) <= self._inline_samples and self._assemble_here(
                fut, ids, weights, allocate
            ):
                return fut
            item = _Queued(fut, ids, weights, allocate)
            if not self._for_workers(key, item):
                self._to_pool(key, item)
        return fut

    def _to_pool(self, key: Key, item: _Queued) -> None:
        """Queue a batch for the thread pool, announced (``completed``) when it is done."""
        item.future.add_done_callback(partial(self._announce, key))
        with self._lock:
            self._queue.push(key[:2], item)
        self._pool.submit(self._assemble_next)  # one task per batch: it takes the next one

    # --- batches for worker processes, driven by the caller's loop ----------------------------

    def watch(self, register: Callable[[int], None], unregister: Callable[[int], None]) -> None:
        """Hand misses to ``elsewhere``'s processes from the caller's loop, which polls them.

        Once called, a batch bound for memory a worker process can fill (``Elsewhere.takes``)
        waits in a queue of its own and goes to the next worker with room; the loop polls
        the file descriptors given to ``register`` and passes those it found readable to
        ``landed``. No thread waits on a worker (``loaderd.miss_workers``).
        """
        self._watch = (register, unregister)

    def _for_workers(self, key: Key, item: _Queued) -> bool:
        """Queue a batch for a worker process; False: it is not theirs (the pool's)."""
        elsewhere = self._elsewhere
        if self._watch is None or elsewhere is None or not elsewhere.running:
            return False
        if not elsewhere.takes(item.ids, item.allocate):
            return False
        self._worker_queue.push(key[:2], (key, item))
        self._dispatch()
        return True

    def _dispatch(self) -> None:
        """Send queued batches to workers with room; with none running, the pool takes them."""
        elsewhere, watch = self._elsewhere, self._watch
        assert elsewhere is not None and watch is not None
        while self._worker_queue and (elsewhere.idle or not elsewhere.running):
            got = self._worker_queue.pop()
            assert got is not None
            key, item = got[1]
            if item.future.cancelled():
                continue  # dropped while it waited
            flight = elsewhere.send(item.ids, item.weights, item.allocate)
            if flight is None:
                self._to_pool(key, item)
                self._sweep()  # a worker whose socket broke on the send: its other batches
                continue
            fd = flight.fileno()
            queue = self._flights.get(fd)
            if queue is None:
                queue = self._flights[fd] = deque()
                watch[0](fd)
            queue.append((key, item, flight))

    def landed(self, readable: Collection[Any]) -> list[Key]:
        """Take one answer from each worker whose socket is ``readable``; keys finished.

        A batch a worker did not assemble goes to the pool, and so do the others it held
        when it is gone; one dropped while under way gives its memory back. Then queued
        batches go to the workers with room.
        """
        elsewhere, watch = self._elsewhere, self._watch
        done: list[Key] = []
        if elsewhere is None or watch is None:
            return done
        for fd in [fd for fd in self._flights if fd in readable]:
            queue = self._flights[fd]
            key, item, flight = queue.popleft()
            try:
                batch = elsewhere.finish(flight)
            except Exception as e:
                batch = None
                if not item.future.cancelled():
                    item.future.set_exception(e)
                    done.append(key)
            else:
                if batch is None:
                    if not item.future.cancelled():
                        self._to_pool(key, item)
                elif item.future.cancelled():
                    if self._on_discard is not None:
                        self._on_discard(batch)
                else:
                    item.future.set_result(batch)
                    done.append(key)
            if not queue:
                del self._flights[fd]
                watch[1](fd)
        self._sweep()
        self._dispatch()
        return done

    def _sweep(self) -> None:
        """Batches held by workers that are gone go to the pool, and their sockets unwatched.

        Done before the loop polls again: a closed socket must not stay in its poll, where
        its number may soon be another worker's.
        """
        elsewhere, watch = self._elsewhere, self._watch
        assert elsewhere is not None and watch is not None
        for fd, queue in list(self._flights.items()):
            if not elsewhere.gone(queue[0][2]):
                continue
            del self._flights[fd]
            watch[1](fd)
            for key, item, flight in queue:
                elsewhere.finish(flight)  # None at once: its slot back, a fallback counted
                if not item.future.cancelled():
                    self._to_pool(key, item)

    def _assemble_here(
        self, fut: Future[Batch], ids: np.ndarray, weights: np.ndarray, allocate: Allocate | None
    ) -> bool:
        """Assemble on this thread if every record is in DRAM; False: nothing was done.

        A hit's bytes are a short copy, cheaper than handing the batch to a worker and being
        woken by it.
        """
        try:
            batch = self._assembler.assemble_resident(ids, weights, allocate)
        except Exception as e:
            fut.set_exception(e)
            return True
        if batch is None:
            return False
        self.inline += 1
        fut.set_result(batch)
        return True

    def _assemble_next(self) -> None:
        """Assemble the next batch in turn.

        It is chosen once through the gate, so that a batch another stream queued meanwhile
        goes before this stream's next one.
        """
        with self.gate:
            while True:
                with self._lock:
                    got = self._queue.pop()
                if got is None:
                    return  # its batch was dropped and another task took the rest
                item = got[1]
                if not item.future.set_running_or_notify_cancel():
                    continue  # dropped while it waited
                try:
                    batch = self._assembler.assemble(item.ids, item.weights, item.allocate)
                except BaseException as e:
                    item.future.set_exception(e)
                else:
                    item.future.set_result(batch)
                return

    @property
    def workers(self) -> int:
        """How many assemblies may run at once."""
        return self.gate.limit

    def set_workers(self, n: int) -> None:
        """Allow ``n`` assemblies at once (1..``max_workers``), from the next one on."""
        if not 1 <= n <= self.max_workers:
            raise ValueError(f"workers must be in [1, {self.max_workers}], got {n}")
        self.gate.set_limit(n)

    def assembled_bytes(self) -> int:
        """Bytes held by batches assembled and not yet sent (ahead of demand)."""
        total = 0
        for fut in list(self._futures.values()):
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                frames = fut.result().frames
                total += sum(f.nbytes for f in frames) if frames else 0
        return total

    def get(self, key: Key) -> Future[Batch] | None:
        """The current assembly of ``key``, if any."""
        return self._futures.get(key)

    def pop(self, key: Key) -> Future[Batch] | None:
        """Forget a key (its batch was sent or is no longer wanted)."""
        return self._futures.pop(key, None)

    def drop(self, predicate: Callable[[Key], bool]) -> None:
        """Forget every key that matches (e.g. all batches of a finished pass)."""
        for key in [k for k in self._futures if predicate(k)]:
            fut = self._futures.pop(key)
            if not fut.cancel() and self._on_discard is not None:
                fut.add_done_callback(self._discard)  # runs now if it is done already

    def _discard(self, fut: Future[Batch]) -> None:
        if self._on_discard is not None and not fut.cancelled() and fut.exception() is None:
            self._on_discard(fut.result())

    def _announce(self, key: Key, _future: Future[Batch]) -> None:
        """Queue ``key`` for ``completed``; wake the loop if nothing was queued before it.

        Keys finished while earlier ones wait are picked up by the same ``completed``: one
        pipe write per drain, not per batch (a write lets go of the GIL, and winning it back
        from the loop or another assembler delays this worker's next batch).
        """
        with self._lock:
            first = not self._done
            self._done.append(key)
        if first:
            with contextlib.suppress(BlockingIOError):  # a full pipe: the loop is awake already
                os.write(self._wake_w, b"x")

    def completed(self) -> list[Key]:
        """Keys finished since the last call (drains the wake-up pipe first).

        The pipe is drained before the keys are taken: a key queued after that finds the
        queue empty and writes again, so that no key waits for a wake-up that was read.
        """
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            done, self._done = self._done, []
        return done

    def count(self, which: Callable[[Key], bool]) -> int:
        """How many of the batches assembled or under way ``which`` picks."""
        return sum(map(which, self._futures))

    @property
    def pending(self) -> int:
        """Batches assembled or under way."""
        return len(self._futures)

    def close(self) -> None:
        """Stop the workers (queued assemblies are cancelled); safe to call twice."""
        self.gate.set_limit(self.max_workers)  # no started assembly waits behind a low limit
        with self._lock:
            queued = self._queue.drain()
        queued += [item for _, item in self._worker_queue.drain()]
        for item in queued:
            item.future.cancel()
        for queue in self._flights.values():
            for _, item, flight in queue:
                item.future.cancel()
                if self._elsewhere is not None:
                    self._elsewhere.abandon(flight)
        self._flights.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in (self.wake_fd, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
