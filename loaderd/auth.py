"""CURVE keys and the ZAP authenticator that guard the daemon's TCP endpoint.

A key directory, as ``loaderd keys generate DIR`` writes it::

    DIR/server.key            the daemon's public key (clients need it: copy it to them)
    DIR/server.key_secret     the daemon's secret key (stays on the daemon's host)
    DIR/client.key            a client keypair, for convenience (public ...
    DIR/client.key_secret     ... and secret)
    DIR/authorized/*.key      the public keys of the clients the daemon admits

CURVE encrypts, but on its own admits any client key: only the ZAP authenticator, which
checks each client key against ``authorized/``, keeps strangers out. The directory is
re-read whenever a key file in it is added, removed or changed, and every message from a
CURVE peer is checked against the current view, so a removed key is locked out at once,
live connections included. So the daemon never
binds TCP without both, and the ipc endpoint (bound before the CURVE options are set; libzmq
copies a socket's security options into each endpoint when it is bound) stays as it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from loaderd.client.curve import KeyFileError, load_key
from loaderd.config import DaemonConfig
from loaderd.storage.safe_files import create_exclusive, fsync_dir, private_dir

logger = logging.getLogger(__name__)


def _key_file(public: bytes, secret: bytes | None = None) -> bytes:
    # The certificate format ``zmq.auth.load_certificate`` reads.
    lines = ["#   ZeroMQ CURVE certificate written by loaderd", "metadata", "curve"]
    lines.append(f'    public-key = "{public.decode()}"')
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return ("\n".join(lines) + "\n").encode()


def generate_keys(directory: Path) -> dict[str, Path]:
    """Write a server and a client keypair, and authorize the client.

    The directory is made private (0700; an existing one of ours is tightened, another
    user's is refused) and every file is created 0600 from its first byte, never through
    an existing name or link.

    Returns:
        The paths written, by role.

    Raises:
        KeyFileError: the directory already holds a server key (never overwritten).
        UnsafePathError: the directory is another user's, or writable by others.
    """
    private_dir(directory, "key directory")
    if (directory / "server.key_secret").exists():
        raise KeyFileError(f"{directory} already holds a server key; not overwriting it")
    authorized = private_dir(directory / "authorized", "authorized keys directory")
    names = [
        directory / f"{r}.{ext}" for r in ("server", "client") for ext in ("key", "key_secret")
    ]
    for path in [*names, authorized / "client.key"]:
        if os.path.lexists(path):  # checked first: never leave half a set of keys behind
            raise KeyFileError(f"{path} already exists; not overwriting it")
    paths: dict[str, Path] = {}
    for role in ("server", "client"):
        public, secret = zmq.curve_keypair()
        paths[role] = directory / f"{role}.key"
        paths[f"{role}_secret"] = directory / f"{role}.key_secret"
        create_exclusive(paths[f"{role}_secret"], _key_file(public, secret))
        create_exclusive(paths[role], _key_file(public))
        if role == "client":
            create_exclusive(authorized / "client.key", _key_file(public))
    fsync_dir(authorized)
    fsync_dir(directory)
    return {**paths, "authorized": authorized}


class AuthorizedKeys:
    """The client keys in ``authorized/``, re-read whenever a file in it changes.

    Each CURVE handshake asks ``admits_key``, and each message from a CURVE peer asks
    ``admits`` (re-checking the directory at most once per ``recheck_s``), so removing a
    key's file locks that client out within a second, live connections included.

    Args:
        directory: the ``authorized/`` directory.
        recheck_s: how stale the view may be when a message asks.
    """

    def __init__(self, directory: Path, recheck_s: float = 1.0) -> None:
        self.directory = directory
        self._recheck_s = recheck_s
        self._lock = threading.Lock()
        self._signature: tuple[tuple[str, int, int], ...] | None = None
        self._keys: frozenset[bytes] = frozenset()
        self._checked = 0.0
        self.refresh()

    def _current_signature(self) -> tuple[tuple[str, int, int], ...]:
        try:
            entries = sorted(os.scandir(self.directory), key=lambda e: e.name)
        except FileNotFoundError:
            return ()
        sig = []
        for e in entries:
            if e.name.endswith(".key"):
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat()
                    sig.append((e.name, st.st_mtime_ns, st.st_size))
        return tuple(sig)

    def refresh(self) -> int:
        """Re-read the keys if a file was added, removed or changed; return how many."""
        with self._lock:
            self._checked = time.monotonic()
            sig = self._current_signature()
            if sig != self._signature:
                try:
                    keys = frozenset(zmq.auth.load_certificates(self.directory))
                except (OSError, ValueError) as e:
                    # Half-written key file: keep the last view, try again at the next check.
                    logger.warning("cannot re-read %s: %s", self.directory, e)
                    return len(self._keys)
                if self._signature is not None:
                    logger.info("authorized keys changed: %d in %s", len(keys), self.directory)
                self._keys, self._signature = keys, sig
            return len(self._keys)

    def admits_key(self, z85_key: bytes) -> bool:
        """Whether a client key (z85) is authorized now (re-reads a changed directory)."""
        self.refresh()
        return z85_key in self._keys

    def admits(self, user_id: str) -> bool:
        """Whether the peer a message came from (its ZAP User-Id: the z85 key) is still admitted."""
        if time.monotonic() - self._checked >= self._recheck_s:
            self.refresh()
        return user_id.encode() in self._keys

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP credentials provider's hook (called by pyzmq for each handshake)."""
        ok = self.admits_key(key)
        if not ok:
            logger.warning("refused a CURVE client whose key is not in %s", self.directory)
        return ok


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
        self.keys = AuthorizedKeys(self.authorized)
        if not self.keys.refresh():
            raise KeyFileError(
                f"no authorized client keys in {self.authorized}: CURVE without them would "
                "admit nobody, and without an authenticator anybody"
            )
        self._auth: ThreadAuthenticator | None = None

    def secure(self, ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes]) -> None:
        """Start the ZAP authenticator, then make ``sock``'s next binds CURVE servers."""
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("loaderd.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self.keys)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        logger.info(
            "CURVE on: %d authorized client keys in %s (re-read when changed)",
            self.keys.refresh(),
            self.authorized,
        )

    def admits(self, frame: zmq.Frame) -> bool:
        """Whether a message from a CURVE peer comes from a key that is still authorized."""
        return self.keys.admits(str(frame.get("User-Id")))

    def close(self) -> None:
        """Stop the authenticator (safe to call twice)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def secure_tcp(config: DaemonConfig) -> CurveServer | None:
    """The CURVE server for ``config.tcp``, or None; refuses TCP without keys.

    Raises:
        ValueError: TCP without a key directory (CURVE without an authenticator admits any
            key, and no CURVE admits anybody).
        KeyFileError: the key directory lacks the server secret or any authorized key.
    """
    if config.socket.startswith("tcp://"):
        raise ValueError(
            f"refusing to serve {config.socket} unauthenticated: bind ipc:// with --socket "
            "and add --tcp tcp://HOST:PORT --curve-dir DIR"
        )
    if config.tcp is None:
        return None
    if not config.tcp.startswith("tcp://"):
        raise ValueError(f"`tcp` must be a tcp:// address, got {config.tcp!r}")
    if config.curve_dir is None:
        raise ValueError(
            f"refusing to serve {config.tcp} without CURVE keys: add --curve-dir DIR "
            "(`loaderd keys generate DIR` writes one)"
        )
    return CurveServer(config.curve_dir)


def is_curve_peer(frame: zmq.Frame) -> bool:
    """Whether a message came over a CURVE connection (ZAP set its User-Id)."""
    try:
        return bool(frame.get("User-Id"))
    except zmq.ZMQError:
        return False
