"""The trainer's side of the fast path: shared-memory batches and device buffering.

``ShmReceiver`` turns a BATCH whose meta carries ``"shm": <descriptor>`` into the same
payload frames the socket would have carried, as views of the daemon's ring slot, so
``protocol.decode_batch`` reads it unchanged. The views stay valid until the trainer asks
for the next batch (that request acknowledges this one and the daemon reuses the slot);
tensors kept longer must be copied on purpose with ``shm.copy_batch``.

``on_device`` wraps a pass in ``device.DeviceBuffering`` when the dataset was given a device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from loaderd.client.device import CudaBackend, DeviceBuffering, resolve_cuda_device
from loaderd.client.pids import current_pid
from loaderd.client.protocol import Message
from loaderd.client.shm import ShmError, ShmRing, SlotDescriptor, is_uint
from loaderd.client.slot_lifetime import hold_slot

logger = logging.getLogger(__name__)

_MAX_RINGS = 8


class ShmReceiver:
    """One process's attachment to the daemon's ring; pickles to a fresh, unattached one.

    Args:
        wanted: whether to ask for shared memory (the dataset's ``shm`` flag and an ipc://
            address: only a client on the daemon's host can map its ring).
    """

    def __init__(self, wanted: bool) -> None:
        self.wanted = wanted
        self._rings: dict[str, ShmRing] = {}  # a daemon has one ring per slot size
        self.slots = 0  # of the ring the daemon offered this process last (0: none)
        self._pid = -1
        # The last descriptor's ring, its "frames" as sent and as checked: the next batches
        # of a pass have the same layout, so only their slot and generation need checking.
        self._known: tuple[ShmRing, Any, tuple[tuple[int, int], ...]] | None = None
        # Page-locks the rings this process maps (``pin``), and which process asked.
        self._register: tuple[int, Callable[[int, int], Callable[[], None] | None]] | None = None

    def pin(self, register: Callable[[int, int], Callable[[], None] | None]) -> None:
        """Page-lock every ring this process maps, now and later, with ``register``.

        ``DeviceBuffering`` then copies a batch to the GPU straight from its slot. A forked
        child pins nothing its parent asked for.
        """
        self._register = (current_pid(), register)
        if self._pid == current_pid():
            for ring in self._rings.values():
                ring.pin(register)

    def accept(self, welcome: dict[str, Any]) -> bool:
        """Attach to the ring a WELCOME names; False when it cannot (use the socket then)."""
        info = welcome.get("shm")
        if not isinstance(info, dict) or not isinstance(info.get("ring"), str):
            return True  # the daemon did not offer shared memory: nothing to do
        try:
            self.slots = self._attach(info["ring"]).slots
        except ShmError as e:
            logger.warning("cannot map the daemon's ring, using the socket: %s", e)
            self.wanted = False
            return False
        return True

    def _attach(self, name: str) -> ShmRing:
        if self._pid != current_pid():
            self._rings, self._pid = {}, current_pid()  # a forked child maps its own
            self._known = None
        ring = self._rings.get(name)
        if ring is None:
            if len(self._rings) >= _MAX_RINGS:  # rings of daemons that restarted since
                self._rings.pop(next(iter(self._rings))).close()
                self._known = None
            ring = self._rings[name] = ShmRing.attach(name)
            if self._register is not None and self._register[0] == self._pid:
                ring.pin(self._register[1])
        return ring

    def slot(self, ring: str, slot: int, generation: int) -> memoryview:
        """A whole slot of a ring, mapped here if need be, while it holds that generation.

        Raises:
            ProtocolError: the slot is outside the ring, or was lent again.
            ShmError: the ring cannot be mapped.
        """
        return self._attach(ring).lent_slot(slot, generation)

    def resolve(self, msg: Message, on_free: Callable[[], None] | None = None) -> memoryview | None:
        """Point a BATCH's frames at its slot when it came through shared memory.

        Args:
            msg: a BATCH.
            on_free: called once nothing views the batch's frames any more (the slot can go
                back, ``slot_lifetime``); None: the frames are plain views of the slot.

        Returns:
            The whole slot the batch lies in; None: it came over the socket.

        Raises:
            ProtocolError: the descriptor is malformed or names a slot lent again.
            ShmError: the ring it names cannot be mapped.
        """
        obj = msg.meta.get("shm")
        if obj is None:
            return None
        known = self._known
        if (
            known is not None
            and self._pid == current_pid()
            and isinstance(obj, dict)
            and obj.get("ring") == known[0].name
            and obj.get("frames") == known[1]
            and is_uint(obj.get("slot"))
            and is_uint(obj.get("gen"))
        ):
            # The layout of a ring already checked (numbers equal to checked ones name the
            # same bytes): what is left is whether the slot still holds this batch.
            ring, spans, slot, gen = known[0], known[2], obj["slot"], obj["gen"]
        else:
            d = SlotDescriptor.from_json(obj)
            ring = self._attach(d.ring)
            ring.check_layout(d)
            self._known = (ring, obj["frames"], d.frames)
            spans, slot, gen = d.frames, d.slot, d.generation
        view = ring.lent_slot(slot, gen)
        if on_free is None:
            msg.frames = [view[off : off + n] for off, n in spans]
        else:
            msg.frames = hold_slot(view, spans, on_free)
        return view

    def close(self) -> None:
        """Unmap (views still held keep the mapping until they go); safe to call twice."""
        if self._pid == current_pid():
            for ring in self._rings.values():
                ring.close()
        self._rings = {}
        self._known = None

    def __getstate__(self) -> dict[str, Any]:
        return {"wanted": self.wanted}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["wanted"])  # type: ignore[misc]


def to_shared_tensors(batch: dict[str, Any]) -> dict[str, Any]:
    """Copy a batch's tensors out of a ring slot into torch shared memory, once.

    A DataLoader worker hands its batch to a queue whose feeder thread pickles it later, while
    the worker already asks for (and so gives back the slot of) the next batch; the copy has
    to happen before. Torch would move the tensors into shared memory to send them anyway, so
    this costs no copy more than the socket path.
    """
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            t = torch.empty(v.shape, dtype=v.dtype).share_memory_()  # type: ignore[no-untyped-call]
            t.copy_(v)
            v = t
        out[k] = v
    return out


def check_device(device: str | torch.device | None, buffers: int) -> torch.device | None:
    """Validate ``device=`` / ``buffers=`` of a dataset up front.

    Raises:
        ValueError: ``buffers`` < 1, or ``device`` is not a CUDA device.
        RuntimeError: CUDA is not available on this machine.
    """
    if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 1:
        raise ValueError(f"`buffers` must be a positive int, got {buffers!r}")
    if device is None:
        return None
    return resolve_cuda_device(device)


def on_device(
    batches: Iterator[dict[str, Any]],
    device: torch.device | None,
    buffers: int,
    shm: ShmReceiver | None = None,
) -> Iterator[dict[str, Any]]:
    """``batches`` as they are, or copied to ``device`` ``buffers`` batches ahead.

    With ``shm``, its rings are page-locked for the device, so that a batch is copied from
    its slot with no staging copy.
    """
    if device is None:
        return batches
    backend = CudaBackend(device)
    if shm is not None:
        shm.pin(backend.register_host)
    return iter(DeviceBuffering(batches, device=device, buffers=buffers, backend=backend))
