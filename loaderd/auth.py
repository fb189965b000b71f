"""CURVE keys and the ZAP authenticator that guard the daemon's TCP endpoint.

A key directory, as ``loaderd keys generate DIR`` writes it::

    DIR/server.key            the daemon's public key (clients need it: copy it to them)
    DIR/server.key_secret     the daemon's secret key (stays on the daemon's host)
    DIR/client.key            a client keypair, for convenience (public ...
    DIR/client.key_secret     ... and secret)
    DIR/authorized/*.key      the public keys of the clients the daemon admits

CURVE encrypts, but on its own admits any client key: only the ZAP authenticator, which
checks each client key against ``authorized/``, keeps strangers out. So the daemon never
binds TCP without both, and the ipc endpoint (bound before the CURVE options are set; libzmq
copies a socket's security options into each endpoint when it is bound) stays as it was.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from loaderd.client.curve import KeyFileError, load_key

logger = logging.getLogger(__name__)


def generate_keys(directory: Path) -> dict[str, Path]:
    """Write a server and a client keypair, and authorize the client.

    Returns:
        The paths written, by role.

    Raises:
        KeyFileError: the directory already holds a server key (never overwritten).
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if (directory / "server.key_secret").exists():
        raise KeyFileError(f"{directory} already holds a server key; not overwriting it")
    server_pub, server_sec = zmq.auth.create_certificates(str(directory), "server")
    client_pub, client_sec = zmq.auth.create_certificates(str(directory), "client")
    for secret in (server_sec, client_sec):
        os.chmod(secret, 0o600)
    authorized = directory / "authorized"
    authorized.mkdir(mode=0o700, exist_ok=True)
    shutil.copy(client_pub, authorized / "client.key")
    return {
        "server": Path(server_pub),
        "server_secret": Path(server_sec),
        "client": Path(client_pub),
        "client_secret": Path(client_sec),
        "authorized": authorized,
    }


class CurveServer:
    """The daemon's CURVE identity and its authenticator.

    Args:
        directory: the key directory (``server.key_secret`` and ``authorized/``).

    Raises:
        KeyFileError: the server secret is missing, or no client is authorized.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.public, secret = load_key(directory / "server.key_secret", secret=True)
        assert secret is not None
        self._secret = secret
        self.authorized = directory / "authorized"
        keys = sorted(self.authorized.glob("*.key")) if self.authorized.is_dir() else []
        if not keys:
            raise KeyFileError(
                f"no authorized client keys in {self.authorized}: CURVE without them would "
                "admit nobody, and without an authenticator anybody"
            )
        self.clients = len(keys)
        self._auth: ThreadAuthenticator | None = None

    def secure(self, ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes]) -> None:
        """Start the ZAP authenticator, then make ``sock``'s next binds CURVE servers."""
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("loaderd.zap"))
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(self.authorized))
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        logger.info("CURVE on: %d authorized client keys in %s", self.clients, self.authorized)

    def close(self) -> None:
        """Stop the authenticator (safe to call twice)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
