"""Daemon addresses: the one default, and a one-line refusal of what ZeroMQ would misread.

ZeroMQ takes ``ipc:/x`` or a bare path as an error deep inside ``connect`` (or, worse, as a
relative socket path that nobody serves), and spells Unix sockets ``ipc://``, not ``unix://``.
Every entry point (``loaderd serve``, ``loaderd stats``, ``LoaderdDataset``, ``Connection``)
checks an address here first, so a mistyped one is named at once instead of timing out.
"""

from __future__ import annotations

import os

ENV_VAR = "LOADERD_SOCKET"
_SCHEMES = ("ipc://", "tcp://", "inproc://")


def default_address() -> str:
    """``$LOADERD_SOCKET``, else ``ipc:///tmp/loaderd-<uid>/loaderd.sock`` (per user)."""
    return os.environ.get(ENV_VAR) or f"ipc:///tmp/loaderd-{os.getuid()}/loaderd.sock"


def check_address(address: object) -> str:
    """Return ``address`` if it is a ZeroMQ endpoint loaderd can use.

    Raises:
        ValueError: one line naming the address and the spelling that works.
    """
    if not isinstance(address, str) or not address:
        raise ValueError(f"daemon address must be a non-empty string, got {address!r}")
    if address.startswith("unix://"):
        fix = "ipc://" + address[len("unix://") :]
        raise ValueError(f"address {address!r}: Unix sockets are spelled {fix!r} in ZeroMQ")
    if not address.startswith(_SCHEMES):
        if address.startswith("/"):
            hint = f"ipc://{address}"
        elif address.startswith("ipc:"):
            hint = "ipc:///" + address[len("ipc:") :].lstrip("/")
        else:
            hint = "ipc:///path/to/loaderd.sock or tcp://host:port"
        raise ValueError(f"address {address!r} is not a ZeroMQ endpoint: did you mean {hint!r}?")
    if address.startswith("ipc://") and not address[len("ipc://") :].startswith(("/", "@")):
        raise ValueError(
            f"address {address!r}: an ipc:// path must be absolute (ipc:///path/to/socket)"
        )
    if address.startswith("tcp://") and ":" not in address[len("tcp://") :]:
        raise ValueError(f"address {address!r}: a tcp:// address needs a port (tcp://host:port)")
    return address


def unreachable_hint(address: str, has_keys: bool) -> str:
    """What to say when nobody answered at ``address``."""
    if address.startswith("tcp://") and not has_keys:
        return (
            "a tcp:// daemon answers only clients with CURVE keys: pass curve_dir "
            "(the directory `loaderd keys generate` wrote)"
        )
    return "is `loaderd serve` running there?"
