"""Multi-buffered asynchronous copies of batches to the accelerator (seed 003).

``DeviceBuffering`` wraps an iterable of batches (dicts of CPU tensors, plus any other values,
which pass through) and yields the same batches with their CPU tensors on the device::

    for batch in DeviceBuffering(ds, device="cuda", buffers=3):
        out = model(batch["image"])          # already on the GPU, in order

It keeps ``buffers`` batches staged in pinned host memory (buffers allocated once and reused,
grown only when a batch is larger than any before), and issues each host-to-device copy on a
side stream while the current step computes. A tensor already in pinned memory (a batch in
the daemon's shared-memory ring, which the dataset registers with CUDA, ``register_host``) is
copied straight from there, with no staging copy, and held until its copy has completed.
Each batch's copies end with an event; before a batch is yielded, the consumer's current
stream waits on that event, and each device tensor is ``record_stream``-ed on the consumer's
stream so that the caching allocator does not hand its memory to another tensor while the
consumer's kernels may still read it. A pinned buffer is overwritten, and a held tensor let
go, only after the event of the copy that last read it has completed.

Every stream, event and pinned-memory operation goes through a ``CopyBackend``: ``CudaBackend``
on a GPU, a fake one in the tests, which checks the ordering on a CPU-only machine.
"""

from __future__ import annotations

import ctypes
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)


class CopyBackend(Protocol):
    """The accelerator operations ``DeviceBuffering`` needs; streams and events are opaque."""

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """A new uint8 tensor of ``nbytes`` in page-locked host memory."""
        ...

    def new_stream(self) -> Any:
        """A stream for copies, apart from the consumer's."""
        ...

    def current_stream(self) -> Any:
        """The stream the consumer computes on now."""
        ...

    def copy_async(self, src: torch.Tensor, stream: Any) -> torch.Tensor:
        """Enqueue a copy of pinned ``src`` to the device on ``stream``; return the target."""
        ...

    def record_event(self, stream: Any) -> Any:
        """An event that completes when the work enqueued on ``stream`` so far has completed."""
        ...

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make later work on ``stream`` wait for ``event`` (without blocking the host)."""
        ...

    def synchronize(self, event: Any) -> None:
        """Block the host until ``event`` has completed."""
        ...

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the allocator that ``tensor`` is used on ``stream`` too."""
        ...

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether a CPU tensor lies in page-locked memory the device can copy from directly."""
        ...

    def register_host(self, address: int, nbytes: int) -> Callable[[], None] | None:
        """Page-lock a range of host memory for direct copies; its undoing, or None: refused."""
        ...


class CudaBackend:
    """``CopyBackend`` over ``torch.cuda``."""

    def __init__(self, device: torch.device) -> None:
        """Bind to one CUDA device (its index resolved)."""
        self.device = device

    def pinned_empty(self, nbytes: int) -> torch.Tensor:  # noqa: D102
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def new_stream(self) -> Any:  # noqa: D102
        return torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]

    def current_stream(self) -> Any:  # noqa: D102
        return torch.cuda.current_stream(self.device)

    def copy_async(self, src: torch.Tensor, stream: Any) -> torch.Tensor:  # noqa: D102
        # Allocated on the side stream; record_stream at hand-over covers the consumer's use.
        with torch.cuda.stream(stream):
            return src.to(self.device, non_blocking=True)

    def record_event(self, stream: Any) -> Any:  # noqa: D102
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:  # noqa: D102
        stream.wait_event(event)

    def synchronize(self, event: Any) -> None:  # noqa: D102
        event.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:  # noqa: D102
        tensor.record_stream(stream)

    def is_pinned(self, tensor: torch.Tensor) -> bool:  # noqa: D102
        return tensor.is_pinned()

    def register_host(self, address: int, nbytes: int) -> Callable[[], None] | None:  # noqa: D102
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        with torch.cuda.device(self.device):
            err = cudart.cudaHostRegister(address, nbytes, 0)
        if int(err) != 0:
            # The runtime keeps a failed call's error until it is read, and torch reads it
            # after its next kernel launch: read it here, or that launch fails with it.
            _clear_last_error()
            logger.info("cannot page-lock %d bytes for direct copies (%s): staged", nbytes, err)
            return None
        return lambda: cudart.cudaHostUnregister(address)


def _clear_last_error() -> None:
    """``cudaGetLastError`` of the CUDA runtime torch loaded (found in this process's maps)."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((ln.split()[-1] for ln in maps if "libcudart.so" in ln), None)
        if path is not None:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass


def resolve_cuda_device(device: str | torch.device) -> torch.device:
    """Check that ``device`` is a usable CUDA device and pin down its index.

    Raises:
        ValueError: the device is not a CUDA device, or its index is out of range.
        RuntimeError: CUDA is not available to this torch (no GPU, or a CPU-only build).
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(
            f"device {str(dev)!r}: DeviceBuffering copies to a CUDA device; "
            "CPU batches need no copy, use them as they come"
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device {str(dev)!r} needs CUDA, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < count:
        raise ValueError(f"device {str(dev)!r}: this machine has {count} CUDA device(s)")
    return torch.device("cuda", index)


@dataclass(slots=True)
class _HostBuffer:
    """One batch's worth of pinned memory: a byte buffer per field, reused batch after batch."""

    storage: dict[str, torch.Tensor] = field(default_factory=dict)
    event: Any = None  # the copy that last read these buffers; wait before overwriting
    held: list[torch.Tensor] = field(default_factory=list)  # pinned sources copied directly

    def settle(self, backend: CopyBackend) -> None:
        """Wait for the copy that last read this batch's memory; let go of its sources."""
        if self.event is not None:
            backend.synchronize(self.event)
            self.event = None
        self.held.clear()  # a slot of the ring goes back once nothing views it


@dataclass(slots=True)
class _Staged:
    batch: dict[str, Any]
    tensors: list[torch.Tensor]
    event: Any


class DeviceBuffering:
    """Yield batches with their CPU tensors copied to the device, ``buffers`` batches ahead.

    Batches come out in the order the source gives them, and each one only after its copies
    are ordered before the consumer's work (its stream waits on the batch's event). Values
    that are not CPU tensors pass through unchanged. An exception from the source is raised
    after the batches staged before it have been yielded. The object can be iterated again
    (one pass per epoch) and keeps its pinned buffers across passes.

    Args:
        source: batches, each a mapping of field name to value.
        device: the CUDA device to copy to.
        buffers: how many batches to keep staged in pinned memory (3 in seed 003).
        backend: the stream/event/pinning operations; ``CudaBackend(device)`` when None.

    Raises:
        ValueError: ``buffers`` < 1, or ``device`` is not a CUDA device.
        RuntimeError: no backend is given and CUDA is not available.
    """

    def __init__(
        self,
        source: Iterable[Mapping[str, Any]],
        *,
        device: str | torch.device = "cuda",
        buffers: int = 3,
        backend: CopyBackend | None = None,
    ) -> None:
        if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 1:
            raise ValueError(f"`buffers` must be a positive int, got {buffers!r}")
        if backend is None:
            backend = CudaBackend(resolve_cuda_device(device))
        self._source = source
        self._backend = backend
        self.buffers = buffers
        self._host = [_HostBuffer() for _ in range(buffers)]
        self._stream: Any = None  # made on first use, so construction touches no device
        self.pinned_allocations = 0
        self.pinned_bytes = 0
        self.direct_copies = 0  # tensors copied from pinned memory of their own, not staged

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._stream is None:
            self._stream = self._backend.new_stream()
        source = iter(self._source)
        pending: deque[_Staged] = deque()
        error: Exception | None = None
        exhausted = False
        n = 0

        def fill() -> None:
            nonlocal error, exhausted, n
            while not exhausted and error is None and len(pending) < self.buffers:
                try:
                    batch = next(source)
                except StopIteration:
                    exhausted = True
                except Exception as e:  # deferred: the batches before it are still delivered
                    error = e
                else:
                    pending.append(self._stage(self._host[n % self.buffers], batch))
                    n += 1

        try:
            fill()
            while pending:
                staged = pending.popleft()
                consumer = self._backend.current_stream()
                self._backend.wait_event(consumer, staged.event)
                for t in staged.tensors:
                    self._backend.record_stream(t, consumer)
                yield staged.batch
                # Stage the next batch only now: the consumer has enqueued its step, so this
                # copy runs beside it, and the buffer freed by `staged` is the one refilled.
                fill()
            if error is not None:
                raise error
        finally:
            close = getattr(source, "close", None)
            if callable(close):
                close()
            for host in self._host:  # no source is let go while a copy may read it
                host.settle(self._backend)

    def _stage(self, host: _HostBuffer, batch: Mapping[str, Any]) -> _Staged:
        """Copy a batch's CPU tensors to the device, through ``host``'s pinned memory or not.

        A tensor in pinned memory of its own is copied from there and held by ``host`` until
        the copy has completed; any other is copied into ``host``'s buffers first.
        """
        # The copy that last read this memory was enqueued `buffers` batches ago and has all
        # but surely completed; never overwrite pinned memory a DMA may read.
        host.settle(self._backend)
        out: dict[str, Any] = {}
        tensors: list[torch.Tensor] = []
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                out[key] = value
                continue
            if self._backend.is_pinned(value):
                host.held.append(value)
                self.direct_copies += 1
                source = value
            else:
                source = self._pinned_view(host, key, value)
                source.copy_(value)
            dev = self._backend.copy_async(source, self._stream)
            out[key] = dev
            tensors.append(dev)
        host.event = self._backend.record_event(self._stream)
        return _Staged(out, tensors, host.event)

    def _pinned_view(self, host: _HostBuffer, key: str, like: torch.Tensor) -> torch.Tensor:
        """A pinned tensor shaped like ``like``, carved from ``host``'s buffer for ``key``."""
        nbytes = like.numel() * like.element_size()
        buf = host.storage.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = self._backend.pinned_empty(max(nbytes, 1))
            if key in host.storage:
                logger.debug("pinned buffer for %r grows to %d bytes", key, nbytes)
            host.storage[key] = buf
            self.pinned_allocations += 1
            self.pinned_bytes = sum(b.numel() for h in self._host for b in h.storage.values())
        return buf[:nbytes].view(like.dtype).view(like.shape)
