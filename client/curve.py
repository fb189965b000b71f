"""A client's CURVE keys for a daemon's TCP endpoint (``loaderd keys generate DIR``).

The client needs its own keypair (``client.key_secret``) and the daemon's public key
(``server.key``); the daemon admits it only if its public key is in the daemon's
``authorized/`` directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth


class KeyFileError(ValueError):
    """A key file that is missing, unreadable or lacks its secret half."""


def load_key(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret or None) of a key file written by ``zmq.auth.create_certificates``.

    Raises:
        KeyFileError: the file is missing or unreadable, or has no secret when one is needed.
    """
    if not path.is_file():
        raise KeyFileError(f"missing key file {path} (run `loaderd keys generate DIR`)")
    try:
        public, private = zmq.auth.load_certificate(str(path))
    except (ValueError, OSError) as e:
        raise KeyFileError(f"cannot read key file {path}: {e}") from None
    if secret and private is None:
        raise KeyFileError(f"{path} holds no secret key")
    return public, private


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """What a DEALER needs to talk CURVE to one daemon."""

    public: bytes
    secret: bytes
    server: bytes

    @classmethod
    def load(cls, directory: Path) -> ClientKeys:
        """Read ``client.key_secret`` and ``server.key`` from a key directory.

        Raises:
            KeyFileError: a file is missing or unreadable.
        """
        public, secret = load_key(directory / "client.key_secret", secret=True)
        server, _ = load_key(directory / "server.key", secret=False)
        assert secret is not None
        return cls(public, secret, server)

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` a CURVE client of the daemon (before it connects)."""
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server)
