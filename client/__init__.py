"""The loaderd client: what trainers import, and the wire contract shared with the daemon.

``LoaderdDataset`` is loaded on first use, so the daemon can import the protocol without
paying for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loaderd.client.errors import DaemonUnavailableError, LoaderdError, ProtocolError, RemoteError

if TYPE_CHECKING:
    from loaderd.client.dataset import LoaderdDataset

__all__ = [
    "DaemonUnavailableError",
    "LoaderdDataset",
    "LoaderdError",
    "ProtocolError",
    "RemoteError",
]


def __getattr__(name: str) -> Any:
    if name == "LoaderdDataset":
        from loaderd.client.dataset import LoaderdDataset

        return LoaderdDataset
    raise AttributeError(f"module 'loaderd.client' has no attribute {name!r}")
