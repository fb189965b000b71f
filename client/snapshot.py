"""Parameter snapshots through the daemon (seed 000): send one, fetch the newest back.

The state is serialised with ``torch.save`` into bytes here, in the trainer, and travels as
one raw frame. The daemon answers as soon as it holds the bytes and writes them into its
NVRAM arena in the background, so a slow NVRAM write never stalls training.
"""

from __future__ import annotations

import io
from typing import Any

from loaderd.client.connection import Connection
from loaderd.client.errors import ErrorCode, RemoteError
from loaderd.client.protocol import MsgType, snapshot_payload


def serialize(obj: Any) -> bytes:
    """``torch.save`` an object into bytes."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def send_snapshot(conn: Connection, job: str, obj: Any, step: int) -> int:
    """Send a snapshot and wait until the daemon holds it (not until it is written).

    Args:
        conn: the connection to the daemon.
        job: the job's name.
        obj: the state to keep (a ``state_dict`` or any ``torch.save``-able object).
        step: the training step it belongs to.

    Returns:
        The number of bytes sent.

    Raises:
        RemoteError: the daemon refused it (no arena, or larger than a snapshot slot).
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"`step` must be an int >= 0, got {step!r}")
    payload = serialize(obj)
    conn.request(MsgType.SNAPSHOT_PUT, {"job": job, "step": step}, [payload], expect=MsgType.OK)
    return len(payload)


def fetch_snapshot(address: str, job: str, timeout_s: float = 30.0) -> tuple[int, bytes] | None:
    """The job's newest whole snapshot as ``(step, torch.save bytes)``, or None if it has none.

    Raises:
        RemoteError: the daemon has no arena, or failed to read it.
        DaemonUnavailableError: no daemon answered at ``address``.
    """
    with Connection(address, timeout_s=timeout_s) as conn:
        try:
            reply = conn.request(MsgType.SNAPSHOT_GET, {"job": job}, expect=MsgType.SNAPSHOT)
        except RemoteError as e:
            if e.code == ErrorCode.NOT_FOUND:
                return None
            raise
        return int(reply.meta["step"]), snapshot_payload(reply).tobytes()


def load_snapshot(
    address: str, job: str, *, timeout_s: float = 30.0, weights_only: bool = True
) -> Any | None:
    """The job's newest whole snapshot, deserialised with ``torch.load``; None if none.

    Args:
        address: the daemon's endpoint.
        job: the job's name.
        timeout_s: how long to wait for the daemon.
        weights_only: passed to ``torch.load`` (True: tensors and plain containers only).
    """
    got = fetch_snapshot(address, job, timeout_s)
    if got is None:
        return None
    import torch

    return torch.load(io.BytesIO(got[1]), weights_only=weights_only)
