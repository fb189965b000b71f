"""What a consumer remembers of its pass, so it can continue after the daemon restarts.

The cursor of a pass is the set of batch indices the training loop has received (known in
the loop's process: see ``client/loop_acks.py``). After a reconnect it is sent with OPEN_PASS
(``resume``): the daemon counts those batches as acknowledged, even if their acknowledgements
never reached it, and sends the rest. Batches that arrive twice anyway (delivery on the wire
is at-least-once) are dropped by (epoch, batch index) and counted. ``state_dict`` saves the
same cursor in a trainer's checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from loaderd.client.errors import DaemonUnavailableError, ErrorCode, RemoteError

STATE_VERSION = 1


@dataclass(slots=True)
class PassProgress:
    """One pass as this process knows it: its epoch, what the loop received, what arrived.

    In the loop's process ``delivered`` and ``seen`` grow together. A DataLoader worker only
    fetches: ``seen`` (its duplicate filter) grows, ``delivered`` stays what a checkpoint said.
    """

    phase: str
    epoch: int | None = None
    delivered: set[int] = field(default_factory=set)
    rewind: bool = False  # from a checkpoint: the daemon's cursor goes back to this one
    seen: set[int] = field(default_factory=set)
    over: bool = False  # a worker's finished pass, still reported by its state_dict
    restored: bool = False  # from a checkpoint, not yet opened

    def resume_meta(self) -> dict[str, Any]:
        """OPEN_PASS's ``resume`` field, or nothing for a pass not yet begun."""
        if self.epoch is None:
            return {}
        resume: dict[str, Any] = {"epoch": self.epoch, "delivered": sorted(self.delivered)}
        if self.rewind:
            resume["rewind"] = True
        return {"resume": resume}

    def begin(self, epoch: int) -> None:
        """The daemon opened ``epoch``: a new epoch starts with nothing seen."""
        if epoch != self.epoch:
            self.delivered, self.seen = set(), set()
        self.seen |= self.delivered
        self.epoch = epoch
        self.rewind = self.restored = False


@dataclass(slots=True)
class DeliveryStats:
    """Counters of what the reconnect machinery did in this process."""

    reconnects: int = 0
    duplicates: int = 0  # batches received twice and dropped
    lost: int = 0  # batches a DataLoader worker handed over whose bytes were gone, asked again


def recoverable(e: Exception) -> bool:
    """Whether a failed request means 'the daemon restarted': reconnect and resume."""
    if isinstance(e, DaemonUnavailableError):
        return True
    return isinstance(e, RemoteError) and e.code in (ErrorCode.UNKNOWN_JOB, ErrorCode.UNKNOWN_PASS)


class Deadline:
    """How long a consumer keeps trying to reach a daemon that went away."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def passed(self) -> bool:
        """Whether the time is up."""
        return time.monotonic() > self.at


def check_state(state: Any) -> dict[str, Any]:
    """Validate a ``state_dict`` from a checkpoint.

    Raises:
        ValueError: it is not a loaderd dataset state of a known version.
    """
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise ValueError(f"not a LoaderdDataset state of version {STATE_VERSION}: {state!r:.200}")
    progress = state.get("progress")
    if not isinstance(progress, dict):
        raise ValueError("LoaderdDataset state: `progress` must be a dict")
    return state


def merge_worker_states(states: list[dict[str, Any]], job: str, rank: int) -> dict[str, Any]:
    """One state from the parts of a StatefulDataLoader's workers: the union of the newest pass.

    Each part holds what its worker had handed on when the loop received that worker's last
    batch, so the union over the workers is what the loop had received.
    """
    progress: dict[str, dict[str, Any]] = {}
    for state in states:
        for phase, p in state["progress"].items():
            cur = progress.get(phase)
            if cur is None or p["epoch"] > cur["epoch"]:
                progress[phase] = {"epoch": p["epoch"], "delivered": set(p["delivered"])}
            elif p["epoch"] == cur["epoch"]:
                cur["delivered"] |= set(p["delivered"])
    return {"version": STATE_VERSION, "job": job, "rank": rank, "progress": progress}
