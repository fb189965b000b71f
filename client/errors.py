"""Errors raised on purpose by the client, shared with the daemon through the protocol."""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """What went wrong, as the daemon reports it in an ERROR reply."""

    BAD_MESSAGE = 1  # malformed frames, bad magic, bad JSON, wrong sizes
    BAD_VERSION = 2  # the peer speaks another protocol version
    UNKNOWN_TYPE = 3  # a message type this daemon does not handle
    UNKNOWN_JOB = 4  # a request names a job nobody opened
    BAD_RANK = 5  # rank outside [0, world_size)
    BAD_ARGUMENT = 6  # a field has the wrong type or value
    JOB_CONFLICT = 7  # the job exists with another world_size / seed / batch size
    CORRUPT_RECORD = 8  # a stored record failed its checksum
    NOT_FOUND = 9  # e.g. no snapshot stored yet
    STORAGE = 10  # a tier or the store failed (full disk, I/O error)
    UNKNOWN_PASS = 11  # a request for a pass the daemon does not have (it restarted): reopen it
    UNAUTHORIZED = 12  # a TCP client whose key was removed from authorized/ since it connected
    INTERNAL = 15  # a bug in the daemon; it logged the traceback and kept serving


class LoaderdError(Exception):
    """Base class for every error loaderd raises on purpose."""


class ProtocolError(LoaderdError):
    """Bad magic, malformed frames or a protocol version mismatch."""


class DaemonUnavailableError(LoaderdError, ConnectionError):
    """The daemon did not answer within the timeout: it is gone, hung or unreachable."""


class RemoteError(LoaderdError):
    """The daemon answered a request with an ERROR reply.

    Also made from its text alone: a ``DataLoader`` re-raises a worker's exception as its
    type called with one message (the worker's traceback, ending in this error's line), and
    falls back to a ``RuntimeError`` when that call fails. Then ``code`` and ``message`` are
    read back from that last line, so ``except RemoteError`` and ``e.code`` work the same
    with and without DataLoader workers. The class's own ``message`` makes the DataLoader pass
    the text by keyword, in its ``raise`` statement: called positionally, it keeps the error
    in a local of its re-raising frame, a cycle that keeps the finished iterator (and its
    worker processes' handles) alive until a garbage collection, and the next epoch's forked
    workers then complain as they collect it.
    """

    message: str = "an ERROR reply from the daemon"  # each instance has its own

    def __init__(self, code: ErrorCode | str | None = None, message: str | None = None) -> None:
        if not isinstance(code, ErrorCode):  # the text of one, re-raised by a DataLoader
            text = str(code if message is None else message)
            self.code, self.message = _parse_remote(text)
            super().__init__(text)
            return
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = str(message)


def _parse_remote(text: str) -> tuple[ErrorCode, str]:
    """(code, message) of the last ``RemoteError: CODE: message`` line in a traceback's text.

    Raises:
        TypeError: there is none (the caller then gets the DataLoader's RuntimeError).
    """
    for line in reversed(text.splitlines()):
        _, sep, rest = line.partition("RemoteError: ")
        name, colon, message = rest.partition(": ")
        if sep and colon and name in ErrorCode.__members__:
            return ErrorCode[name], message
    raise TypeError("RemoteError needs an ErrorCode and a message")
