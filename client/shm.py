"""Shared-memory batch rings, the trainer's side: attach, view a slot, copy a batch out.

The daemon creates a ring (``loaderd.shm_ring``: create, lend, reclaim, stale cleanup), a
file under ``/dev/shm`` named ``loaderd-<daemon pid>-<token>`` that both sides map. It holds
``slots`` slots of ``slot_bytes`` each. The daemon assembles a batch straight into a lent slot
and sends the trainer a ``SlotDescriptor`` in the BATCH meta instead of payload frames. The
trainer attaches once per ring (``ShmRing.attach``) and turns each descriptor into
memoryviews over the slot (``frames``), in the same order the payload frames would have had,
so ``protocol.decode_batch`` reads them unchanged.

Lifetime: views over a slot are valid until the trainer hands the slot back, that is until
its next request acknowledges the batch (the window of batches in flight). A trainer that
keeps tensors beyond that must copy them on purpose (``copy_batch``); otherwise the daemon
reuses the slot and the kept tensors silently change. ``ShmRing.is_current`` tells whether a
descriptor's slot still holds that batch.

File layout (all little-endian)::

    0      header  HEADER (magic, version, slots, slot_bytes, data_offset, owner pid,
                   owner start time) + crc32 of those bytes
    64     slots x uint64 generation, bumped each time the daemon lends the slot
    data_offset (page-aligned)  slot 0, slot 1, ... each slot_bytes (a multiple of the page)

Inside a slot, frames start at 64-byte-aligned offsets; ``slot_layout`` is the only code that
decides where, and ``ShmRing.frames`` the only code that reads a layout back.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import re
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeGuard

import numpy as np

from loaderd.client.errors import LoaderdError, ProtocolError
from loaderd.client.protocol import MAX_FRAMES

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
DEFAULT_PREFIX = "loaderd-"
MAGIC = b"LDRDRING"
VERSION = 1
# magic, version, (pad), slots, slot_bytes, data_offset, owner_pid, owner_start; then crc32
HEADER = struct.Struct("<8sH2xIQQQQ")
CRC = struct.Struct("<I")
GEN = struct.Struct("<Q")
GEN_TABLE_OFFSET = 64
ALIGN = 64  # frame alignment inside a slot: a cache line, and enough for any dtype / SIMD load
PAGE = mmap.PAGESIZE
MAX_SLOTS = 1 << 16
MAX_SLOT_BYTES = 1 << 40
# A ring name comes from the daemon over the wire: never let it walk out of the directory.
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
# Pre-fault page tables when mapping: a first touch of each 4 KiB page otherwise costs about as
# much as copying it, on every batch of the first pass over the ring.
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class ShmError(LoaderdError):
    """A shared-memory ring cannot be created, attached or used; the message names the path."""


class RingGone(ShmError):
    """The ring's file is gone: its daemon stopped, and a new one removed it."""


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def slot_layout(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Where each frame of a batch goes in a slot: the one definition of the slot layout.

    Args:
        sizes: byte size of each frame, in wire order.

    Returns:
        ``(offset, nbytes)`` per frame; each offset is a multiple of ``ALIGN`` (64).

    Raises:
        ValueError: a size is negative.
    """
    out: list[tuple[int, int]] = []
    offset = 0
    for i, n in enumerate(sizes):
        if n < 0:
            raise ValueError(f"frame {i} has negative size {n}")
        out.append((offset, n))
        offset = _round_up(offset + n, ALIGN)
    return out


def layout_bytes(sizes: Sequence[int]) -> int:
    """Slot bytes needed for frames of these sizes (to size a ring for the largest batch)."""
    spans = slot_layout(sizes)
    return spans[-1][0] + spans[-1][1] if spans else 0


@dataclass(frozen=True, slots=True)
class SlotDescriptor:
    """Where a batch lies in shared memory: what the BATCH meta carries instead of frames.

    JSON form (``to_json``)::

        {"ring": "loaderd-4242-9f3a1c0e", "slot": 3, "gen": 17,
         "frames": [[0, 2048], [2048, 1024], [3072, 6291456]]}

    ``frames`` lists ``[offset, nbytes]`` per payload frame, in the order the socket path
    would send the frames.
    """

    ring: str
    slot: int
    generation: int
    frames: tuple[tuple[int, int], ...]

    def to_json(self) -> dict[str, Any]:
        """The descriptor as a JSON-ready object."""
        return {
            "ring": self.ring,
            "slot": self.slot,
            "gen": self.generation,
            "frames": [[o, n] for o, n in self.frames],
        }

    @classmethod
    def from_json(cls, obj: Any) -> SlotDescriptor:
        """Parse a descriptor sent by the daemon, checking every part's type.

        Raises:
            ProtocolError: a key is missing or has the wrong type.
        """
        if not isinstance(obj, dict):
            raise ProtocolError(f"slot descriptor must be an object, got {obj!r}")
        ring, slot, gen, frames = (obj.get(k) for k in ("ring", "slot", "gen", "frames"))
        if not isinstance(ring, str) or not NAME_RE.fullmatch(ring):
            raise ProtocolError(f"slot descriptor: bad ring name {ring!r}")
        if not is_uint(slot) or not is_uint(gen):
            raise ProtocolError(f"slot descriptor: 'slot' and 'gen' must be ints, got {obj!r}")
        if (
            not isinstance(frames, list)
            or len(frames) > MAX_FRAMES
            or not all(
                isinstance(f, list) and len(f) == 2 and is_uint(f[0]) and is_uint(f[1])
                for f in frames
            )
        ):
            raise ProtocolError("slot descriptor: 'frames' must be a list of [offset, nbytes]")
        return cls(ring, slot, gen, tuple((f[0], f[1]) for f in frames))


def is_uint(v: object) -> TypeGuard[int]:
    """Whether a JSON value is a non-negative int (a bool is not)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class ShmRing:
    """A ring of fixed-size batch slots in a shared-memory file, as a trainer maps it.

    Trainers ``attach`` and read (or write their own lent slot: tensors are writable, an
    in-place transform must not fault). The daemon's subclass (``loaderd.shm_ring``) creates
    the file and lends the slots. A ring is a context manager; ``close`` is safe to call twice.
    """

    def __init__(
        self, path: Path, mm: mmap.mmap, *, slots: int, slot_bytes: int, data_offset: int
    ) -> None:
        """Use ``attach`` (or the daemon's ``create``); this only wraps a validated mapping."""
        self.path = path
        self.name = path.name
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._mm: mmap.mmap | None = mm
        self._data_offset = data_offset
        self._unpin: Callable[[], None] | None = None  # undoes ``pin``
        self._pinned = False

    @classmethod
    def attach(cls, name: str, *, directory: str | os.PathLike[str] = SHM_DIR) -> ShmRing:
        """Attach to a ring the daemon created (the trainer side).

        Args:
            name: the ring's file name, as in a ``SlotDescriptor``.
            directory: where the file lives.

        Returns:
            The ring, mapped read-write (tensors over it must be writable).

        Raises:
            ShmError: the file is missing or is not a valid ring; the message names the path.
        """
        path = Path(directory) / name
        if not NAME_RE.fullmatch(name):
            raise ShmError(f"bad shared-memory ring name {name!r}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise RingGone(
                f"no shared-memory ring at {path} (the daemon that made it is gone?)"
            ) from None
        except OSError as e:
            raise ShmError(f"cannot open shared-memory ring {path}: {e.strerror}") from e
        try:
            slots, slot_bytes, data_offset, _, _ = read_header(fd, path)
            size = os.fstat(fd).st_size
            want = data_offset + slots * slot_bytes
            if size != want:
                raise ShmError(f"ring {path} is {size} bytes, its header says {want}")
            mm = mmap.mmap(fd, size, flags=MAP_FLAGS)
        finally:
            os.close(fd)
        logger.debug("attached shm ring %s: %d slots of %d bytes", path, slots, slot_bytes)
        return cls(path, mm, slots=slots, slot_bytes=slot_bytes, data_offset=data_offset)

    def close(self) -> None:
        """Unmap. Safe to call twice.

        Views still held elsewhere (tensors of a batch) keep the mapping alive: it is then
        unmapped when the last of them is freed, never under their feet.
        """
        mm, self._mm = self._mm, None
        unpin, self._unpin = self._unpin, None
        if unpin is not None:
            unpin()
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                logger.debug("shm ring %s still has views; unmapped when they go", self.path)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = type(self).__name__
        return f"{kind}({self.name!r}, slots={self.slots}, slot_bytes={self.slot_bytes})"

    # --- bytes ------------------------------------------------------------------------------

    def pin(self, register: Callable[[int, int], Callable[[], None] | None]) -> None:
        """Have ``register`` page-lock the whole mapping (once); ``close`` undoes it first.

        For direct copies to a GPU (``device.CopyBackend.register_host``): a tensor over a
        pinned slot is copied by the device from the slot itself, with no staging copy.
        """
        if not self._pinned:
            mm = self._map()
            self._pinned = True  # refused or not: asked once
            self._unpin = register(int(np.frombuffer(mm, np.uint8).ctypes.data), len(mm))

    def view(self, slot: int, offset: int = 0, nbytes: int | None = None) -> memoryview:
        """A writable view of part of a slot, without a copy.

        Raises:
            ValueError: the range does not lie inside the slot.
        """
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range 0..{self.slots - 1} in ring {self.name}")
        if nbytes is None:
            nbytes = self.slot_bytes - offset
        if offset < 0 or nbytes < 0 or offset + nbytes > self.slot_bytes:
            raise ValueError(
                f"range [{offset}, {offset + nbytes}) outside slot of {self.slot_bytes} bytes "
                f"in ring {self.name}"
            )
        start = self._data_offset + slot * self.slot_bytes + offset
        return memoryview(self._map())[start : start + nbytes]

    def frames(self, desc: SlotDescriptor) -> list[memoryview]:
        """The frames a descriptor names, as views of the slot (the inverse of ``layout``).

        Args:
            desc: a descriptor from a BATCH meta (``SlotDescriptor.from_json``).

        Returns:
            One writable memoryview per frame, valid until the slot is handed back.

        Raises:
            ProtocolError: the descriptor names another ring, a slot or a range outside this
                ring, or a slot the daemon has already lent again.
        """
        self.check_layout(desc)
        slot = self.lent_slot(desc.slot, desc.generation)
        return [slot[off : off + n] for off, n in desc.frames]

    def check_layout(self, desc: SlotDescriptor) -> None:
        """Check that a descriptor's ring, slot and frames fit this ring (not its generation).

        What passes here holds for every descriptor with the same frames: a receiver checks
        a layout once and then only ``lent_slot``.

        Raises:
            ProtocolError: another ring, a slot outside it, or frames off the slot layout.
        """
        if desc.ring != self.name:
            raise ProtocolError(f"descriptor names ring {desc.ring!r}, attached to {self.name!r}")
        if desc.slot >= self.slots:
            raise ProtocolError(
                f"descriptor names slot {desc.slot}, ring {self.name} has {self.slots}"
            )
        if len(desc.frames) > 0 and desc.frames != tuple(slot_layout([n for _, n in desc.frames])):
            raise ProtocolError(f"descriptor frames {desc.frames} do not follow the slot layout")
        end = desc.frames[-1][0] + desc.frames[-1][1] if desc.frames else 0
        if end > self.slot_bytes:
            raise ProtocolError(
                f"descriptor reaches byte {end} of a {self.slot_bytes}-byte slot in {self.name}"
            )

    def lent_slot(self, slot: int, generation: int) -> memoryview:
        """A whole slot's bytes, if it still holds the batch of that generation.

        Raises:
            ProtocolError: the slot is outside the ring, or the daemon has lent it again.
        """
        if not 0 <= slot < self.slots:
            raise ProtocolError(f"descriptor names slot {slot}, ring {self.name} has {self.slots}")
        mm = self._map()
        if GEN.unpack_from(mm, GEN_TABLE_OFFSET + GEN.size * slot)[0] != generation:
            raise ProtocolError(f"slot {slot} of {self.name} was lent again")
        base = self._data_offset + slot * self.slot_bytes
        return memoryview(mm)[base : base + self.slot_bytes]

    def is_current(self, desc: SlotDescriptor) -> bool:
        """Whether the descriptor's slot still holds its batch (not yet lent again).

        A trainer that kept views past handing the slot back can check them with this.
        """
        return self.generation(desc.slot) == desc.generation

    def generation(self, slot: int) -> int:
        """How many times the slot has been lent (read from the shared table)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range 0..{self.slots - 1} in ring {self.name}")
        return int(GEN.unpack_from(self._map(), GEN_TABLE_OFFSET + GEN.size * slot)[0])

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            raise ShmError(f"shared-memory ring {self.path} is closed")
        return self._mm


# --- the header -----------------------------------------------------------------------------


def read_header(fd: int, path: Path) -> tuple[int, int, int, int, int]:
    """Validate a ring's header; returns (slots, slot_bytes, data_offset, pid, start_time)."""
    raw = os.pread(fd, HEADER.size + CRC.size, 0)
    if len(raw) < HEADER.size + CRC.size:
        raise ShmError(f"{path} is not a loaderd ring: {len(raw)}-byte file, no header")
    head = raw[: HEADER.size]
    magic, version, slots, slot_bytes, data_offset, pid, start = HEADER.unpack(head)
    if magic != MAGIC:
        raise ShmError(f"{path} is not a loaderd ring: magic {magic!r}, expected {MAGIC!r}")
    if CRC.unpack_from(raw, HEADER.size)[0] != zlib.crc32(head):
        raise ShmError(f"ring {path} has a corrupt header (checksum mismatch)")
    if version != VERSION:
        raise ShmError(f"ring {path} has layout version {version}, this client reads {VERSION}")
    if not (
        1 <= slots <= MAX_SLOTS
        and 0 < slot_bytes <= MAX_SLOT_BYTES
        and slot_bytes % PAGE == 0
        and data_offset % PAGE == 0
        and data_offset >= GEN_TABLE_OFFSET + GEN.size * slots
    ):
        raise ShmError(
            f"ring {path} has an impossible geometry: {slots} slots of {slot_bytes} bytes "
            f"from offset {data_offset}"
        )
    return slots, slot_bytes, data_offset, pid, start


# --- keeping a batch past its slot -------------------------------------------------------------


def copy_batch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """Copy a batch out of shared memory, for a trainer that keeps it past the next request.

    Tensors are cloned, numpy arrays and memoryviews copied, and lists, tuples, dicts and
    dataclasses (such as ``protocol.BatchArrays``) copied member by member; anything else
    (ints, strings) is kept as is.
    """
    return {k: _copy(v) for k, v in batch.items()}


def _copy(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.copy()
    if isinstance(v, memoryview):
        return bytes(v)
    if isinstance(v, list | tuple):
        return type(v)(_copy(x) for x in v)
    if isinstance(v, Mapping):
        return {k: _copy(x) for k, x in v.items()}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        # e.g. protocol.VarColumn / BatchArrays, whose arrays and views point into the slot
        return type(v)(**{f.name: _copy(getattr(v, f.name)) for f in dataclasses.fields(v)})
    clone = getattr(v, "clone", None)  # torch.Tensor, without importing torch here
    return clone() if callable(clone) else v
