from __future__ import annotations

import gc
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from loaderd.client.device import DeviceBuffering, resolve_cuda_device


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: list[Callable[[], None]] = []
        self.done = 0


def _done() -> None:
    pass


class FakeEvent:
    ids = itertools.count()

    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.seq = len(stream.ops)
        self.id = next(self.ids)

    def complete(self) -> None:
        s = self.stream
        while s.done < self.seq:
            s.ops[s.done]()
            s.ops[s.done] = _done  # a copy done holds no tensor (as a DMA done holds none)
            s.done += 1


class FakeBackend:
    """Copies are lazy: they read their pinned source only when their event completes.

    With ``complete_on_wait`` an event completes when a stream waits on it (the consumer then
    reads the data, as its kernels would); otherwise only when the host synchronises on it.
    """

    def __init__(self, *, complete_on_wait: bool = True) -> None:
        self.complete_on_wait = complete_on_wait
        self.log: list[tuple[Any, ...]] = []
        self.consumer = FakeStream("consumer")
        self.pinned: list[torch.Tensor] = []
        self.streams: list[FakeStream] = []
        self.registered: list[tuple[int, int]] = []  # host ranges page-locked for copies

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned.append(t)
        return t

    def new_stream(self) -> FakeStream:
        s = FakeStream(f"side{len(self.streams)}")
        self.streams.append(s)
        return s

    def current_stream(self) -> FakeStream:
        return self.consumer

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        p = tensor.data_ptr()
        return any(a <= p < a + n for a, n in self.registered)

    def register_host(self, address: int, nbytes: int) -> Callable[[], None]:
        self.registered.append((address, nbytes))
        return lambda: self.registered.remove((address, nbytes))

    def copy_async(self, src: torch.Tensor, stream: FakeStream) -> torch.Tensor:
        ptr = src.untyped_storage().data_ptr()
        assert any(ptr == p.data_ptr() for p in self.pinned) or self.is_pinned(src)
        dst = torch.zeros_like(src)
        stream.ops.append(lambda: dst.copy_(src))
        self.log.append(("copy", stream.name, id(dst)))
        return dst

    def record_event(self, stream: FakeStream) -> FakeEvent:
        ev = FakeEvent(stream)
        self.log.append(("event", ev.id))
        return ev

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        if self.complete_on_wait:
            event.complete()
        self.log.append(("wait", stream.name, event.id))

    def synchronize(self, event: FakeEvent) -> None:
        event.complete()
        self.log.append(("sync", event.id))

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("record_stream", id(tensor), stream.name))

    def flush(self) -> None:
        for s in self.streams:
            FakeEvent(s).complete()


def make_batch(i: int, n: int = 4) -> dict[str, Any]:
    return {
        "x": torch.arange(n * 3, dtype=torch.float32).view(n, 3) + 100 * i + 1,
        "id": torch.arange(n, dtype=torch.int64) + 10 * i + 1,
        "epoch": i,
        "name": f"b{i}",
    }


def check(got: dict[str, Any], i: int, n: int = 4) -> None:
    want = make_batch(i, n)
    assert got.keys() == want.keys()
    assert torch.equal(got["x"], want["x"]) and torch.equal(got["id"], want["id"])
    assert (got["epoch"], got["name"]) == (i, f"b{i}")


def test_yields_in_order_and_only_after_the_copy() -> None:
    fake = FakeBackend()
    seen = 0
    for i, batch in enumerate(DeviceBuffering(map(make_batch, range(10)), backend=fake)):
        check(batch, i)  # a lazy copy not waited for would still read as zeros
        # The consumer's stream waited on this batch's event, then record_stream for both.
        waits = [e for e in fake.log if e[0] == "wait"]
        assert len(waits) == i + 1 and waits[-1][1] == "consumer"
        tail = fake.log[-3:]
        assert tail[0][0] == "wait"
        assert {e[1] for e in tail[1:]} == {id(batch["x"]), id(batch["id"])}
        assert all(e[0] == "record_stream" and e[2] == "consumer" for e in tail[1:])
        seen += 1
    assert seen == 10


def test_copies_run_buffers_ahead_on_a_side_stream() -> None:
    fake = FakeBackend()
    it = iter(DeviceBuffering(map(make_batch, range(10)), backend=fake, buffers=3))
    next(it)
    # Batches 0..2 were staged before batch 0 came out; each with its own event.
    assert sum(e[0] == "event" for e in fake.log) == 3
    assert {e[1] for e in fake.log if e[0] == "copy"} == {"side0"}
    next(it)
    # Asking for batch 1 first staged batch 3 into the buffer batch 0 freed.
    assert sum(e[0] == "event" for e in fake.log) == 4
    assert len(fake.streams) == 1


def test_pinned_buffers_are_reused() -> None:
    fake = FakeBackend()
    buffered = DeviceBuffering(map(make_batch, range(20)), backend=fake, buffers=3)
    for i, batch in enumerate(buffered):
        check(batch, i)
    assert buffered.pinned_allocations == 3 * 2 == len(fake.pinned)  # 3 buffers x 2 tensors
    # A smaller last batch fits in the buffers; a larger one grows just its buffer.
    sizes = [4, 4, 4, 2, 8]
    fake2 = FakeBackend()
    buffered2 = DeviceBuffering(
        (make_batch(i, n) for i, n in enumerate(sizes)), backend=fake2, buffers=2
    )
    for i, batch in enumerate(buffered2):
        check(batch, i, sizes[i])
    assert buffered2.pinned_allocations == 2 * 2 + 2


def test_pinned_buffer_not_overwritten_while_a_copy_may_read_it() -> None:
    # Nothing completes on the consumer's wait: only the host's synchronise before reusing
    # a pinned buffer keeps the lazy copies from reading the next batch's bytes.
    fake = FakeBackend(complete_on_wait=False)
    got = list(DeviceBuffering(map(make_batch, range(7)), backend=fake, buffers=2))
    fake.flush()
    for i, batch in enumerate(got):
        check(batch, i)
    syncs = [e for e in fake.log if e[0] == "sync"]
    assert len(syncs) == 7  # before each reuse (5), and for each buffer at the pass's end


def test_every_pass_reuses_the_buffers_and_stream() -> None:
    fake = FakeBackend()
    buffered = DeviceBuffering([make_batch(i) for i in range(5)], backend=fake, buffers=3)
    for _ in range(3):
        for i, batch in enumerate(buffered):
            check(batch, i)
    assert buffered.pinned_allocations == 6 and len(fake.streams) == 1


def test_dtypes_shapes_and_passthrough() -> None:
    fake = FakeBackend()
    meta = torch.empty(3, device="meta")
    batch = {
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 5, dtype=torch.int16),
        "mask": torch.tensor([True, False, True]),
        "t": torch.arange(12, dtype=torch.int32).view(3, 4).t(),  # not contiguous
        "half": torch.arange(5, dtype=torch.bfloat16),
        "on_device": meta,
        "none": None,
    }
    (out,) = DeviceBuffering([batch], backend=fake)
    for k in ("scalar", "empty", "mask", "t", "half"):
        assert out[k].dtype == batch[k].dtype and out[k].shape == batch[k].shape
        assert torch.equal(out[k], batch[k]), k
    assert out["on_device"] is meta and out["none"] is None


def test_source_error_comes_after_the_batches_before_it() -> None:
    def source() -> Iterator[dict[str, Any]]:
        yield from map(make_batch, range(4))
        raise OSError("daemon gone")

    got = []
    with pytest.raises(OSError, match="daemon gone"):
        for batch in DeviceBuffering(source(), backend=FakeBackend(), buffers=3):
            got.append(batch)  # noqa: PERF402 (keeps what came before the error)
    assert len(got) == 4
    for i, batch in enumerate(got):
        check(batch, i)


def test_breaking_out_closes_the_source() -> None:
    closed = []

    def source() -> Iterator[dict[str, Any]]:
        try:
            yield from map(make_batch, range(100))
        finally:
            closed.append(True)

    it = iter(DeviceBuffering(source(), backend=FakeBackend()))
    next(it)
    it.close()  # type: ignore[attr-defined]
    assert closed == [True]


def test_arguments() -> None:
    with pytest.raises(ValueError, match="buffers"):
        DeviceBuffering([], backend=FakeBackend(), buffers=0)
    with pytest.raises(ValueError, match="buffers"):
        DeviceBuffering([], backend=FakeBackend(), buffers=True)
    with pytest.raises(ValueError, match="'cpu'"):
        DeviceBuffering([], device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on CPU-only machines")
def test_cuda_refused_without_cuda() -> None:
    for device in ("cuda", "cuda:1", torch.device("cuda", 0)):
        with pytest.raises(RuntimeError, match=r"'cuda.*torch\.cuda\.is_available\(\) is False"):
            DeviceBuffering([], device=device)
    with pytest.raises(RuntimeError, match="is_available"):
        resolve_cuda_device("cuda")


def test_a_pinned_source_is_copied_directly_and_held_until_its_copy_completed() -> None:
    """A batch in page-locked memory (a registered ring slot) is not staged: the copy reads
    the batch itself, which is held (its slot not given back) until that copy completed."""
    fake = FakeBackend(complete_on_wait=False)  # copies complete when the host syncs only
    ring = torch.zeros(6, 4, 3)  # six "slots"
    fake.register_host(ring.data_ptr(), ring.numel() * ring.element_size())
    freed: list[int] = []

    def batches() -> Iterator[dict[str, Any]]:
        for i in range(6):
            ring[i] = make_batch(i)["x"]
            x = ring[i]
            weakref.finalize(x, freed.append, i)  # the slot goes back once x is dropped
            yield {"x": x, "id": make_batch(i)["id"], "epoch": i, "name": f"b{i}"}

    buffering = DeviceBuffering(batches(), backend=fake, buffers=2)
    for i, batch in enumerate(buffering):
        gc.collect()
        # Batches i and i + 1 are under way: neither source is let go before its copy.
        assert all(k < i for k in freed), (i, freed)
        fake.synchronize(fake.record_event(fake.streams[0]))  # the consumer's step reads x
        assert torch.equal(batch["x"], make_batch(i)["x"])
    gc.collect()
    assert sorted(freed) == list(range(6))  # the pass's end let every one go
    assert buffering.direct_copies == 6  # "x" each time; "id" was staged
    assert all(p.numel() < ring.numel() for p in fake.pinned)  # no staging buffer for "x"
