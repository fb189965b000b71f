"""One node's share of an exchange round, and a whole round, as bytes.

Every node must end a round holding exactly the same entries in exactly the same order (the
importance engine is order-sensitive), so the byte form is canonical: a node's pending feedback
is coalesced into one block per (job, epoch, kind), blocks ordered by job, then epoch, re-score
before training, and every node (the sender too) applies the *decoded* blocks. A block whose
ids are unique and dense enough travels as a bitmap of its id range plus the losses in id
order (a rank's share of an epoch is; ~4.1 bytes a sample instead of 12), otherwise as raw
int64 ids and float32 losses in submission order.

A contribution also carries the node's status (per job: the spec and each of its ranks'
cursor and wanted pass) and the range of its local feedback sequence numbers it contains, so a
restarted node knows which of its own entries the cluster already has.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

WIRE_VERSION = 1
KINDS = ("train", "rescore")  # a feedback entry's kind and a pass's phase
_CONTRIB = struct.Struct("<4sHHQQII")  # magic, version, flags, seq_lo, seq_hi, status, blocks
_CONTRIB_MAGIC = b"LDXC"
_ROUND = struct.Struct("<4sHHQI4x")  # magic, version, flags, round number, nodes (8-aligned)
_ROUND_MAGIC = b"LDXR"
_BLOCK = np.dtype(
    [
        ("job", "<u4"),
        ("epoch", "<i4"),
        ("kind", "u1"),
        ("coding", "u1"),
        ("pad", "V6"),
        ("count", "<u8"),
        ("base", "<i8"),
        ("span", "<u8"),
    ]
)
_RAW, _BITMAP = 0, 1


class WireError(ValueError):
    """Bytes that are not a well-formed contribution or round."""


@dataclass(frozen=True, slots=True)
class RankStatus:
    """Where one of a node's ranks is: its current pass, and the pass it waits to open."""

    epoch: int
    phase: str
    complete: bool
    want: tuple[int, str] | None = None


@dataclass(frozen=True, slots=True)
class JobStatus:
    """What a node says about one job: its spec (JSON-able), ranks and recent plans.

    ``plans`` holds a digest of each pass the node planned lately (``"epoch:phase"`` -> hex),
    so nodes that computed different plans from the same history (different CPUs or numpy
    builds) are found out rather than trusted.
    """

    spec: Mapping[str, Any]
    ranks: Mapping[int, RankStatus]
    plans: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Entries:
    """Feedback of one job, epoch and kind: ids (int64) and losses (float32), aligned."""

    job: str
    epoch: int
    kind: str
    ids: np.ndarray
    losses: np.ndarray


@dataclass(frozen=True, slots=True)
class Pending:
    """A local FEEDBACK not yet in a completed round, under its node-local sequence number."""

    seq: int
    entries: Entries


@dataclass(frozen=True, slots=True)
class Contribution:
    """One node's share of a round.

    ``blocks`` hold the node's local feedback numbered ``seq_lo + 1 .. seq_hi``.
    """

    node: int
    seq_lo: int
    seq_hi: int
    status: Mapping[str, JobStatus]
    blocks: tuple[Entries, ...]


@dataclass(frozen=True, slots=True)
class Round:
    """A completed exchange round: every node's contribution, in node order."""

    number: int
    contributions: tuple[Contribution, ...]

    def entries(self) -> Iterator[Entries]:
        """Every block in the order every node applies them: node by node, block by block."""
        for c in self.contributions:
            yield from c.blocks

    @property
    def num_entries(self) -> int:
        """Feedback samples in the round."""
        return sum(len(b.ids) for b in self.entries())


def coalesce(pending: Sequence[Pending]) -> list[Entries]:
    """One block per (job, epoch, kind), in the canonical order; submission order inside.

    Args:
        pending: the node's local feedback in submission order.

    Returns:
        Blocks ordered by job name, epoch, then re-score before training (the order in which a
        rank walks an epoch's passes).
    """
    groups: dict[tuple[str, int, int], list[Entries]] = {}
    for p in pending:
        e = p.entries
        groups.setdefault((e.job, e.epoch, -KINDS.index(e.kind)), []).append(e)
    blocks = []
    for (job, epoch, neg_kind), parts in sorted(groups.items()):
        if len(parts) == 1:
            ids, losses = parts[0].ids, parts[0].losses
        else:
            ids = np.concatenate([p.ids for p in parts])
            losses = np.concatenate([p.losses for p in parts])
        blocks.append(Entries(job, epoch, KINDS[-neg_kind], ids, losses))
    return blocks


def _pad8(n: int) -> int:
    return -n % 8


def _status_json(status: Mapping[str, JobStatus], names: Sequence[str]) -> bytes:
    jobs = {
        name: {
            "spec": dict(js.spec),
            "plans": dict(js.plans),
            "ranks": {
                str(r): [s.epoch, s.phase, s.complete, *(s.want if s.want else (None, None))]
                for r, s in sorted(js.ranks.items())
            },
        }
        for name, js in sorted(status.items())
    }
    return json.dumps({"jobs": jobs, "names": list(names)}, sort_keys=True).encode()


def _bitmap(ids: np.ndarray, losses: np.ndarray) -> tuple[int, int, np.ndarray, np.ndarray] | None:
    """(base, span, packed bits, losses in id order) when that is smaller and ids are unique."""
    if not len(ids):
        return None
    base = int(ids.min())
    span = int(ids.max()) - base + 1
    if span // 8 + 8 >= 8 * len(ids):
        return None
    offsets = ids - base
    mask = np.zeros(span, np.bool_)
    mask[offsets] = True
    if int(np.count_nonzero(mask)) != len(ids):
        return None  # a repeated id: keep every entry, in order
    dense = np.empty(span, np.float32)
    dense[offsets] = losses
    # A gather at the set positions: twice as fast as indexing by the boolean mask.
    return base, span, np.packbits(mask), dense[np.flatnonzero(mask)]


def encode_contribution(
    seq_lo: int, seq_hi: int, status: Mapping[str, JobStatus], blocks: Sequence[Entries]
) -> np.ndarray:
    """A node's share of a round as one uint8 array (what the collective sends).

    Args:
        seq_lo: the last local sequence number a previous round carried.
        seq_hi: the last local sequence number these blocks carry.
        status: the node's jobs.
        blocks: from :func:`coalesce`.
    """
    names = sorted({b.job for b in blocks})
    status_raw = _status_json(status, names)
    table = np.zeros(len(blocks), _BLOCK)
    parts: list[np.ndarray] = []  # ids (raw or bitmap) then losses, block by block
    for i, b in enumerate(blocks):
        ids = np.ascontiguousarray(b.ids, np.int64)
        losses = np.ascontiguousarray(b.losses, np.float32)
        row = table[i]
        row["job"], row["epoch"], row["kind"] = names.index(b.job), b.epoch, KINDS.index(b.kind)
        row["count"] = len(ids)
        packed = _bitmap(ids, losses)
        if packed is None:
            row["coding"] = _RAW
            parts += [ids.view(np.uint8), losses.view(np.uint8)]
        else:
            row["coding"], row["base"], row["span"] = _BITMAP, packed[0], packed[1]
            parts += [packed[2], packed[3].view(np.uint8)]
    size = _CONTRIB.size + len(status_raw) + _pad8(len(status_raw)) + table.nbytes
    size += sum(len(a) + _pad8(len(a)) for a in parts)
    out = np.zeros(size, np.uint8)
    _CONTRIB.pack_into(
        out.data, 0, _CONTRIB_MAGIC, WIRE_VERSION, 0, seq_lo, seq_hi, len(status_raw), len(blocks)
    )
    pos = _CONTRIB.size
    out[pos : pos + len(status_raw)] = np.frombuffer(status_raw, np.uint8)
    pos += len(status_raw) + _pad8(len(status_raw))
    out[pos : pos + table.nbytes] = table.view(np.uint8)
    pos += table.nbytes
    for arr in parts:
        out[pos : pos + len(arr)] = arr
        pos += len(arr) + _pad8(len(arr))
    return out


def decode_contribution(node: int, data: np.ndarray) -> Contribution:
    """The inverse of :func:`encode_contribution`; arrays are views into ``data``.

    Raises:
        WireError: naming the node and what is wrong.
    """
    where = f"contribution of node {node}"
    if len(data) < _CONTRIB.size:
        raise WireError(f"{where}: {len(data)} bytes, shorter than its header")
    magic, version, _, seq_lo, seq_hi, status_len, n_blocks = _CONTRIB.unpack_from(data.data, 0)
    if magic != _CONTRIB_MAGIC or version != WIRE_VERSION:
        raise WireError(f"{where}: magic {magic!r} version {version}, expected wire {WIRE_VERSION}")
    pos = _CONTRIB.size
    try:
        raw = json.loads(bytes(data[pos : pos + status_len]))
        names: list[str] = raw["names"]
        status = {
            name: JobStatus(
                job["spec"],
                {
                    int(r): RankStatus(int(e), p, bool(c), None if we is None else (int(we), wp))
                    for r, (e, p, c, we, wp) in job["ranks"].items()
                },
                {str(k): str(v) for k, v in job["plans"].items()},
            )
            for name, job in raw["jobs"].items()
        }
    except (ValueError, KeyError, TypeError) as e:
        raise WireError(f"{where}: bad status ({e})") from None
    pos += status_len + _pad8(status_len)
    table = np.frombuffer(data, _BLOCK, n_blocks, pos) if n_blocks else np.zeros(0, _BLOCK)
    pos += table.nbytes
    blocks: list[Entries] = []
    for row in table:
        count, span = int(row["count"]), int(row["span"])
        id_bytes = 8 * count if row["coding"] == _RAW else (span + 7) // 8
        end = pos + id_bytes + _pad8(id_bytes) + 4 * count
        if row["job"] >= len(names) or row["kind"] >= len(KINDS) or end > len(data):
            raise WireError(f"{where}: block {len(blocks)} runs past the end or names no job")
        if row["coding"] == _RAW:
            ids = np.frombuffer(data, np.int64, count, pos)
        else:
            mask = np.unpackbits(data[pos : pos + id_bytes], count=span).view(np.bool_)
            ids = np.flatnonzero(mask).astype(np.int64, copy=False)
            ids += int(row["base"])
            if len(ids) != count:
                raise WireError(f"{where}: bitmap of block {len(blocks)} holds {len(ids)} ids")
        pos += id_bytes + _pad8(id_bytes)
        losses = np.frombuffer(data, np.float32, count, pos)
        pos += 4 * count + _pad8(4 * count)
        blocks.append(
            Entries(names[row["job"]], int(row["epoch"]), KINDS[row["kind"]], ids, losses)
        )
    return Contribution(node, seq_lo, seq_hi, status, tuple(blocks))


def round_parts(number: int, blobs: Sequence[np.ndarray]) -> list[bytes | memoryview]:
    """A completed round (every node's contribution bytes) as the parts of one log record.

    The parts are written one after the other: a round of 10 M samples is tens of MB, and
    joining them first would copy it once more.
    """
    head = _ROUND.pack(_ROUND_MAGIC, WIRE_VERSION, 0, number, len(blobs))
    lengths = struct.pack(f"<{len(blobs)}Q", *(len(b) for b in blobs))
    parts: list[bytes | memoryview] = [head, lengths]
    for b in blobs:
        parts += [np.ascontiguousarray(b).data, bytes(_pad8(len(b)))]
    return parts


def encode_round(number: int, blobs: Sequence[np.ndarray]) -> bytes:
    """:func:`round_parts` joined into one record."""
    return b"".join(round_parts(number, blobs))


def split_round(data: bytes | memoryview | np.ndarray) -> tuple[int, list[np.ndarray]]:
    """The inverse of :func:`encode_round`: the round's number and each node's bytes.

    Raises:
        WireError: the record is not a round.
    """
    buf = np.frombuffer(data, np.uint8)
    if len(buf) < _ROUND.size:
        raise WireError(f"round record of {len(buf)} bytes is shorter than its header")
    magic, version, _, number, n = _ROUND.unpack_from(buf.data, 0)
    if magic != _ROUND_MAGIC or version != WIRE_VERSION or len(buf) < _ROUND.size + 8 * n:
        raise WireError(f"round record: magic {magic!r} version {version}, {n} nodes")
    pos = _ROUND.size + 8 * n
    blobs = []
    for length in struct.unpack_from(f"<{n}Q", buf.data, _ROUND.size):
        if pos + length > len(buf):
            raise WireError(f"round {number}: a contribution runs past the record")
        blobs.append(buf[pos : pos + length])
        pos += length + _pad8(length)
    return number, blobs


def decode_round(data: bytes | memoryview | np.ndarray) -> Round:
    """A round record from :func:`encode_round`, decoded.

    Raises:
        WireError: the record is not a round.
    """
    return make_round(*split_round(data))


def contribution_seqs(data: np.ndarray) -> tuple[int, int]:
    """(seq_lo, seq_hi) of a node's contribution bytes, without decoding the rest."""
    if len(data) < _CONTRIB.size:
        raise WireError(f"contribution of {len(data)} bytes is shorter than its header")
    fields = _CONTRIB.unpack_from(data.data, 0)
    return int(fields[3]), int(fields[4])


def status_key(status: Mapping[str, JobStatus]) -> bytes:
    """The canonical bytes of a node's status: equal bytes, equal status."""
    return _status_json(status, ())


def make_round(number: int, blobs: Sequence[np.ndarray]) -> Round:
    """Decode every node's contribution bytes (node i sent ``blobs[i]``) into a round."""
    return Round(number, tuple(decode_contribution(i, b) for i, b in enumerate(blobs)))
