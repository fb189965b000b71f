"""The collectives of the cluster's lockstep protocol: a round, and a catch-up.

Every node calls these in the same order with the same arguments' shapes; they are the only
code that decides what goes through the gloo group (``loaderd.cluster_group``), and they are
kept apart from the thread that calls them (``loaderd.cluster``) so a benchmark or a test can
run them directly.

A round is a header allgather (int64: wire version, last round, payload bytes, has content)
and, if some node has content, an allgather of every node's contribution padded to the
longest. A catch-up is an allgather of (last round, oldest round kept) and, when they differ,
broadcasts of the missing rounds' log records from the lowest node that keeps each.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import numpy as np

from loaderd.cluster_group import ClusterError, Group
from loaderd.cluster_wire import WIRE_VERSION, Round, make_round

__all__ = ["catch_up", "exchange", "plan_catch_up"]

_PACKED = struct.Struct("<QQ")  # round number, record length (catch-up broadcasts)


def exchange(
    group: Group, have: int, payload: np.ndarray, has_content: bool
) -> tuple[Round, list[np.ndarray]] | None:
    """Run one round's collectives; the round and every node's bytes, or None when idle.

    Args:
        group: the formed group.
        have: the last round this node holds (every node must hold the same).
        payload: this node's contribution (``encode_contribution``).
        has_content: whether this node has anything new to say.

    Raises:
        GroupBroken: a collective failed.
        ClusterError: the nodes disagree on the wire version or the last round.
    """
    head = np.array([WIRE_VERSION, have, len(payload), int(has_content)], np.int64)
    heads = [h.tolist() for h in group.allgather(head)]
    for rank, (version, their_have, _, _) in enumerate(heads):
        if version != WIRE_VERSION or their_have != have:
            raise ClusterError(
                f"{group.nodes[rank].label} speaks wire {version} at round {their_have}, "
                f"this node wire {WIRE_VERSION} at round {have}"
            )
    if not any(h[3] for h in heads):
        return None
    lengths = [h[2] for h in heads]
    buf = np.zeros(max(lengths), np.uint8)
    buf[: len(payload)] = payload
    outs = group.allgather(buf)
    blobs = [out[:n] for out, n in zip(outs, lengths, strict=True)]
    return make_round(have + 1, blobs), blobs


def plan_catch_up(haves: Sequence[int], firsts: Sequence[int]) -> list[tuple[int, int, int]]:
    """Which node sends which rounds to the nodes that lack them.

    Args:
        haves: each node's last round.
        firsts: each node's oldest round kept.

    Returns:
        (source node, first round, last round) runs, in round order; the source of a round is
        the lowest node that keeps it.

    Raises:
        ClusterError: some round that a node lacks is kept by nobody.
    """
    runs: list[tuple[int, int, int]] = []
    for k in range(min(haves) + 1, max(haves) + 1):
        src = next((r for r in range(len(haves)) if haves[r] >= k and firsts[r] <= k), None)
        if src is None:
            behind = min(range(len(haves)), key=lambda r: haves[r])
            raise ClusterError(
                f"node {behind} holds rounds through {haves[behind]}, and no node keeps round "
                f"{k} any more: give it a copy of another node's state directory"
            )
        if runs and runs[-1][0] == src and runs[-1][2] == k - 1:
            runs[-1] = (src, runs[-1][1], k)
        else:
            runs.append((src, k, k))
    return runs


def catch_up(
    group: Group, have: int, first: int, read: Callable[[int], bytes]
) -> list[tuple[int, np.ndarray]]:
    """Bring every node to the newest round any node holds.

    Args:
        group: the newly formed group.
        have: this node's last round.
        first: this node's oldest round kept.
        read: this node's round log (a round's record by number).

    Returns:
        The records of the rounds this node lacks, ``(number, record)`` in order from
        ``have + 1``.

    Raises:
        GroupBroken: a collective failed.
        ClusterError: a round some node lacks is kept by nobody.
    """
    infos = [t.tolist() for t in group.allgather(np.array([have, first], np.int64))]
    haves, firsts = [i[0] for i in infos], [i[1] for i in infos]
    taken: list[tuple[int, np.ndarray]] = []
    for src, lo, hi in plan_catch_up(haves, firsts):
        data = _pack(read, lo, hi) if group.rank == src else b""
        size = np.array([len(data)], np.int64)
        group.broadcast(size, src)
        buf = np.frombuffer(bytearray(data), np.uint8) if data else np.empty(size[0], np.uint8)
        group.broadcast(buf, src)
        pos = 0
        while pos < len(buf):
            number, length = _PACKED.unpack_from(buf.data, pos)
            if number == have + len(taken) + 1:
                taken.append((number, buf[pos + _PACKED.size : pos + _PACKED.size + length]))
            pos += _PACKED.size + length + (-length % 8)
    return taken


def _pack(read: Callable[[int], bytes], lo: int, hi: int) -> bytes:
    parts = []
    for number in range(lo, hi + 1):
        record = read(number)
        parts += [_PACKED.pack(number, len(record)), record, bytes(-len(record) % 8)]
    return b"".join(parts)
