"""One DEALER socket per process to the daemon, with timeouts and a fresh socket after fork.

Several requests may be in flight at once (prefetch credits, feedback); replies carry the
request id, so ``wait`` returns the one asked for and keeps the others until they are wanted.
A WAITING note (the daemon parked the request, e.g. at a re-score barrier) is logged once per
reason and restarts the wait: a parked request is slow, not lost.

A daemon that dies takes the requests it had read with it, and their replies never come.
ZeroMQ's socket monitor reports the closed connection at once (on ``ipc://``, or a
``tcp://`` peer whose host is up), so a wait ends there instead of at its timeout, and the
caller resends to the daemon that comes back: a trainer resumes as soon as it can.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from loaderd.client.address import check_address, unreachable_hint
from loaderd.client.curve import ClientKeys
from loaderd.client.errors import DaemonUnavailableError, ProtocolError, RemoteError
from loaderd.client.pids import current_pid
from loaderd.client.protocol import (
    MAX_FRAME_BYTES,
    Buffer,
    Message,
    MsgType,
    check_reply,
    decode,
    decode_error,
    encode_header,
    encode_meta,
)
from loaderd.client.turns import Turns

logger = logging.getLogger(__name__)

# Plain ints: pyzmq's flag enums cost an enum operation per frame.
_SNDMORE = int(zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)
_MAX_MS = 2**31 - 1  # zmq's timeouts are C ints of milliseconds (~24.8 days)


class Connection:
    """A request/reply channel to one daemon address: one per process, any of its threads.

    Threads take turns at the socket (``client/turns.py``); a reply that reaches another
    thread's wait is kept for its own.

    Args:
        address: the daemon's endpoint (``ipc://...`` or ``tcp://...``).
        timeout_s: how long to wait for any reply before the daemon counts as gone.
        curve_dir: a key directory (``loaderd keys generate``) for a daemon's CURVE-secured
            ``tcp://`` endpoint: ``client.key_secret`` and the daemon's ``server.key``.

    Raises:
        KeyFileError: a key file in ``curve_dir`` is missing or unreadable.
        ValueError: ``address`` is not an endpoint loaderd serves (``loaderd.client.address``).
    """

    def __init__(
        self, address: str, timeout_s: float = 30.0, curve_dir: str | Path | None = None
    ) -> None:
        self.address = check_address(address)
        self.timeout_s = timeout_s
        self.curve_dir = None if curve_dir is None else Path(curve_dir)
        self._keys = None if self.curve_dir is None else ClientKeys.load(self.curve_dir)
        self._pid = -1
        self._sock: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._closer: weakref.finalize[..., Connection] | None = None  # closes all, once
        self._turns = Turns()
        self._last_id = 0  # request ids count up from 1
        self._lost_upto = 0  # requests up to this id went to a connection that closed
        self._dropped_upto = 0  # ... or to a socket reset dropped since
        self._stash: dict[int, Message] = {}
        self._ignored: set[int] = set()
        self._last_waiting = ""

    def _socket(self) -> zmq.Socket[bytes]:
        if self._pid != current_pid():
            # After fork the parent's context belongs to the parent: never touch it here.
            if self._closer is not None:
                self._closer.detach()
            self._sock, self._monitor, self._closer = None, None, None
            self._pid = current_pid()
            self._stash.clear()
            self._ignored.clear()
        elif self._closer is not None and not self._closer.alive:
            # The collector closed them: this Connection is garbage, and a neighbour in its
            # cycle still sends from its own finalizer (a DataLoader iterator's shutdown).
            self.reset()
        if self._sock is None:
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
            try:
                sock, monitor = self._open(ctx)
            except BaseException:
                ctx.destroy(linger=0)
                raise
            self._sock, self._monitor = sock, monitor
            # Closed by a finalizer that holds them, not by ``__del__``: a Connection caught
            # in a reference cycle is collected with whatever only it holds, in an order
            # the collector picks, and a context finalized before its sockets hangs in term().
            # Sockets opened again after ``__del__`` had run would never be closed at all.
            self._closer = weakref.finalize(self, _close, ctx, sock, monitor, self._pid)
            self._closer.atexit = False  # at exit a thread may still be using it; the OS closes
        return self._sock

    def _open(
        self, ctx: zmq.Context[zmq.Socket[bytes]]
    ) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.setsockopt(zmq.RCVHWM, 0)
        # A DEALER with no live pipe blocks on send, e.g. after a failed CURVE handshake
        # tore its pipe down: bound it like a reply, never hang.
        sock.setsockopt(zmq.SNDTIMEO, min(max(1, int(self.timeout_s * 1000)), _MAX_MS))
        # ZMTP heartbeats: a daemon that stops answering drops the connection, and the
        # next request goes to whichever daemon binds the address again.
        sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
        if self._keys is not None:
            self._keys.apply(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        return sock, monitor

    def send(self, type_: MsgType, meta: dict[str, Any], frames: Sequence[Buffer] = ()) -> int:
        """Send a request without waiting; returns its request id."""
        turns = self._turns_here()
        turns.take()
        try:
            return self._send(type_, meta, frames)
        finally:
            turns.give()

    def _send(self, type_: MsgType, meta: dict[str, Any], frames: Sequence[Buffer]) -> int:
        sock = self._socket()
        self._note_closes()  # a connection that closed by now carried none of this request
        self._last_id += 1
        request_id = self._last_id
        # Frame by frame: the header and meta are small (copied by zmq either way) and
        # send_multipart re-checks every part on each call. Once the first part is queued
        # the rest of the message goes too (zmq queues a message whole).
        try:
            sock.send(encode_header(type_, request_id), _SNDMORE)
        except zmq.Again:
            self.reset()
            raise self._unavailable(self.timeout_s) from None
        if frames:
            sock.send(encode_meta(meta), _SNDMORE)
            for frame in frames[:-1]:
                sock.send(frame, _SNDMORE, copy=False)
            sock.send(frames[-1], copy=False)
        else:
            sock.send(encode_meta(meta))
        return request_id

    def wait(self, request_id: int, timeout_s: float | None = None) -> Message:
        """The reply to ``request_id``; other replies that arrive meanwhile are kept.

        Raises:
            RemoteError: the daemon answered with ERROR.
            DaemonUnavailableError: no reply within the timeout.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        turns = self._turns_here()
        turns.take()
        try:
            reply = self._wait(request_id, timeout, turns)
        finally:
            turns.give()
        if reply.type == MsgType.ERROR:
            raise RemoteError(*decode_error(reply))
        check_reply(reply)
        return reply

    def _wait(self, request_id: int, timeout: float, turns: Turns) -> Message:
        deadline = time.monotonic() + timeout
        while (reply := self._stash.pop(request_id, None)) is None:
            sock = self._socket()  # anew after each turn another thread had: it may reset
            assert self._monitor is not None
            # Replies that came before a close are read first; after it, none will come.
            lost = request_id <= self._lost_upto
            left = deadline - time.monotonic()
            if not lost and left <= 0:
                self.reset()
                raise self._unavailable(timeout)
            watch: list[tuple[Any, int]] = [(sock, _POLLIN), (self._monitor, _POLLIN)]
            watch.append((turns.wake_fd, _POLLIN))  # a raw fd: zmq polls it beside the sockets
            polled = zmq.zmq_poll(watch, 0 if lost else int(left * 1000) + 1)
            ready: set[Any] = {s for s, _ in polled}
            if turns.wake_fd in ready:
                turns.let_in()
                continue
            if sock not in ready:
                if lost:
                    if request_id > self._dropped_upto:  # not the socket another thread opened
                        self.reset()
                    raise self._unavailable(timeout, closed=True)
                self._note_closes()  # the monitor's, or the timeout's: both seen above
                continue
            msg = decode(_recv_frames(sock))
            if msg.type == MsgType.WAITING:  # parked, not lost: say why and wait on
                self._note_waiting(msg)
                if msg.request_id == request_id:  # the next note comes within again_s
                    again = 2 * float(msg.meta["again_s"])
                    deadline = time.monotonic() + max(timeout, again)
            elif msg.request_id in self._ignored:
                self._ignored.discard(msg.request_id)
                self._log_if_error(msg)
            else:
                self._stash[msg.request_id] = msg  # ours too: popped at the loop's top
        return reply

    def request(
        self,
        type_: MsgType,
        meta: dict[str, Any],
        frames: Sequence[Buffer] = (),
        expect: MsgType | None = None,
    ) -> Message:
        """Send a request and wait for its reply (of type ``expect`` when given)."""
        reply = self.wait(self.send(type_, meta, frames))
        if expect is not None and reply.type != expect:
            raise ProtocolError(
                f"expected {expect.name} in reply to {type_.name}, got {reply.type.name}"
            )
        return reply

    def ignore(self, request_id: int) -> None:
        """Drop the reply to ``request_id`` when it arrives (logging it if it is an error)."""
        turns = self._turns_here()
        turns.take()
        try:
            msg = self._stash.pop(request_id, None)
            if msg is not None:
                self._log_if_error(msg)
            else:
                self._ignored.add(request_id)
        finally:
            turns.give()

    def _turns_here(self) -> Turns:
        turns = self._turns
        if not turns.usable:  # a forked child (its parent's may be held), or collected
            turns = self._turns = Turns()
        return turns

    def _note_closes(self) -> None:
        """Read the monitor's events: a closed connection lost every request sent so far.

        Some of them may have gone to the new connection after all: they are sent again,
        and the daemon's replies say which it had (requests are at-least-once on the wire).
        """
        monitor = self._monitor
        assert monitor is not None
        while int(monitor.get(zmq.EVENTS)) & _POLLIN:
            event = parse_monitor_message(monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._lost_upto = self._last_id

    def _unavailable(self, timeout: float, closed: bool = False) -> DaemonUnavailableError:
        hint = unreachable_hint(self.address, self._keys is not None)
        if closed:
            return DaemonUnavailableError(
                f"loaderd at {self.address} closed the connection before it replied ({hint})"
            )
        return DaemonUnavailableError(
            f"no reply from loaderd at {self.address} within {timeout:g} s ({hint})"
        )

    def _note_waiting(self, msg: Message) -> None:
        check_reply(msg)
        text = msg.meta["message"]
        if text != self._last_waiting:  # once per reason, not every few seconds
            self._last_waiting = text
            logger.warning("loaderd at %s: %s", self.address, text)

    @staticmethod
    def _log_if_error(msg: Message) -> None:
        if msg.type == MsgType.ERROR:
            code, text = decode_error(msg)
            logger.warning("loaderd refused a request: %s: %s", code.name, text)

    def reset(self) -> None:
        """Drop the socket (replies in flight are lost); the next request opens a new one."""
        turns = self._turns_here()
        turns.take()
        try:
            if self._closer is not None:
                self._closer()
            self._sock = self._monitor = self._closer = None
            # Another thread's wait ends at once, and leaves the new socket alone.
            self._lost_upto = self._dropped_upto = self._last_id
            self._stash.clear()
            self._ignored.clear()
        finally:
            turns.give()

    close = reset

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into DataLoader workers: only the address travels, never a socket.
        return {"address": self.address, "timeout_s": self.timeout_s, "curve_dir": self.curve_dir}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["address"], state["timeout_s"], state.get("curve_dir"))  # type: ignore[misc]


def _close(
    ctx: zmq.Context[zmq.Socket[bytes]],
    sock: zmq.Socket[bytes],
    monitor: zmq.Socket[bytes],
    pid: int,
) -> None:
    if pid != current_pid():
        return  # a forked child's copy of its parent's sockets: the parent closes them
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)
    ctx.term()


def _recv_frames(sock: zmq.Socket[bytes]) -> list[zmq.Frame]:
    """One whole multipart message, without copying its frames (the caller polled first)."""
    frame = sock.recv(copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(copy=False)
        frames.append(frame)
    return frames
