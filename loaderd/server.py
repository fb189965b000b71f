"""The daemon's ZeroMQ ROUTER loop: receive, decode, dispatch, reply. No cache logic here.

One thread owns the socket. Requests that need I/O (a batch not yet assembled) are parked
until the prefetcher announces the batch, so a slow read never stalls other clients. Every
failure of a request becomes an ERROR reply naming what went wrong; the loop keeps serving.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from itertools import islice
from pathlib import Path
from typing import Any

import zmq

from loaderd import __version__, crashpoints
from loaderd.auth import CurveServer
from loaderd.client.errors import ErrorCode, ProtocolError
from loaderd.client.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    FieldSpec,
    Message,
    MsgType,
    check_int_list,
    check_request,
    decode,
    decode_feedback,
    encode,
    error_message,
    peek_request_id,
)
from loaderd.config import DaemonConfig
from loaderd.consumers import Consumers
from loaderd.importance_plot import histograms
from loaderd.jobs import Job, JobError, JobSpec, NotReady, PassState, Resume
from loaderd.prefetch import Assembler, Prefetcher
from loaderd.shm_delivery import ShmDelivery
from loaderd.snapshots import Snapshots
from loaderd.stats import build_stats
from loaderd.storage.errors import CorruptRecordError, StorageError
from loaderd.storage.store import SampleStore
from loaderd.tiering import Placement, build_tiers

logger = logging.getLogger(__name__)

BatchKey = tuple[str, int, int, str, int]  # job, rank, epoch, phase, batch index
_TICK_S = 0.5
_MAX_ACKS = 1 << 16


class DaemonLockedError(RuntimeError):
    """Another live daemon holds the socket path or the state directory."""


class PathLock:
    """An exclusive ``flock`` on a file that dies with the process holding it.

    A crashed daemon's lock is released by the kernel, so a restart with the same command
    always works, while a live daemon can never be displaced.
    """

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            raise DaemonLockedError(
                f"{what} is already served by a live daemon (pid {holder})"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Drop the lock (safe to call twice)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Server:
    """Serves one store to any number of jobs over one ROUTER socket.

    Args:
        config: the daemon configuration.
    """

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.job_defaults = config.importance
        self.started = time.monotonic()
        self._locks: list[PathLock] = []
        self.state_dir = config.state_dir
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._locks.append(
            PathLock(self.state_dir / "daemon.lock", f"state directory {self.state_dir}")
        )
        self.ipc_path = (
            Path(config.socket[len("ipc://") :]) if config.socket.startswith("ipc://") else None
        )
        if self.ipc_path is not None:
            self.ipc_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._locks.append(
                PathLock(
                    self.ipc_path.with_name(self.ipc_path.name + ".lock"), f"socket {config.socket}"
                )
            )
            self.ipc_path.unlink(missing_ok=True)  # stale: its owner's lock is gone
        self.store = SampleStore(config.db)
        self.tiers = build_tiers(config.cache, self.store)
        self.placement = Placement(self.tiers)
        self.snapshots = Snapshots(self.tiers.arena)
        self.schema = [FieldSpec(f.name, f.dtype, f.shape) for f in self.store.schema.fields]
        self.shm = ShmDelivery(
            config.shm,
            self.schema,
            self.store.total_bytes // max(self.store.num_samples, 1),
        )
        self.prefetcher = Prefetcher(
            self.shm.assembler(Assembler(self.tiers, self.store.schema)).assemble,
            config.prefetch.workers,
            on_discard=self.shm.discard,
        )
        self.jobs: dict[str, Job] = {}
        self._waiting: dict[BatchKey, list[tuple[bytes, int]]] = {}
        self._parked_opens: list[tuple[bytes, Message]] = []
        # FEEDBACK is acknowledged only once journalled and fsynced: one fsync per loop turn
        # covers every feedback that arrived in it (group commit).
        self._unsynced: list[tuple[bytes, Message]] = []
        # Batches ready when asked for go out only after the loop turn's cursors are written,
        # so a batch a trainer may hold is never handed to another consumer after a crash.
        self._ready: list[BatchKey] = []
        # ACK replies wait for the cursor commit too: an acknowledged ACK is never lost.
        self._acked_replies: list[tuple[bytes, Message]] = []
        self.consumers = Consumers(config.consumer_timeout_s)
        self._load_jobs()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its identity
        set_heartbeats(self.sock)
        self._curve = secure_tcp(config)  # before binding anything: refuse to start unsafely
        self.sock.bind(config.socket)
        self._local = config.socket.startswith(("ipc://", "inproc://"))  # peers' pids are ours
        if self._curve is not None and config.tcp is not None:
            # The ipc endpoint is bound already and keeps the NULL mechanism: libzmq copies a
            # socket's security options into each endpoint at bind time.
            self._curve.secure(self.ctx, self.sock)
            self.sock.bind(config.tcp)
            logger.info("also serving %s (CURVE, ZAP)", config.tcp)
        if self.ipc_path is not None:
            os.chmod(self.ipc_path, 0o600)
        self._handlers: dict[MsgType, Callable[[bytes, Message], Message | None]] = {
            MsgType.PING: self._ping,
            MsgType.HELLO: self._hello,
            MsgType.OPEN_PASS: self._open_pass,
            MsgType.GET_BATCH: self._get_batch,
            MsgType.ACK: self._ack,
            MsgType.FEEDBACK: self._feedback,
            MsgType.STATS: self._stats,
            MsgType.SNAPSHOT_PUT: self.snapshots.put,
            MsgType.SNAPSHOT_GET: self.snapshots.get,
        }

    # --- lifecycle ----------------------------------------------------------------------------

    def serve(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set, then flush state and close."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.prefetcher.wake_fd, zmq.POLLIN)
        logger.info(
            "ready: serving %s (%d samples) on %s",
            self.store.path,
            self.store.num_samples,
            self.config.socket,
        )
        next_tick = time.monotonic() + _TICK_S
        try:
            while not stop.is_set():
                events = dict(poller.poll(timeout=int(_TICK_S * 1000)))
                if self.sock in events:
                    for _ in range(256):  # bounded, so completions are never starved
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._dispatch(frames)
                    self._commit_cursors()
                    self._commit_feedback()
                if self.prefetcher.wake_fd in events:
                    for key in self.prefetcher.completed():
                        self._deliver(key)
                if time.monotonic() >= next_tick:
                    self._tick()
                    next_tick = time.monotonic() + _TICK_S
        finally:
            self.close()

    def _commit_cursors(self) -> None:
        """Write changed cursors, then send the batches that were waiting for them.

        No fsync: the page cache outlives a daemon crash, and a machine crash takes the
        trainers (and what they hold) down with it; the tick's save is the fsynced one.
        """
        for job in self.jobs.values():
            job.commit_cursors()
        crashpoints.hit("commit")
        ready, self._ready = self._ready, []
        for key in ready:
            self._deliver(key)
        replies, self._acked_replies = self._acked_replies, []
        for identity, reply in replies:
            self._send(identity, reply)

    def _commit_feedback(self) -> None:
        if not self._unsynced:
            return
        for job in self.jobs.values():
            if job.journal is not None:
                job.journal.sync()
        for identity, reply in self._unsynced:
            self._send(identity, reply)
        self._unsynced.clear()

    def _tick(self) -> None:
        self._retry_parked()
        for name, rank, worker in self.consumers.gone():
            job = self.jobs.get(name)
            n = job.requeue(rank, worker) if job is not None else 0
            if n:
                logger.warning(
                    "job %s rank %d: %d batches of gone worker %d go back to the rank",
                    name,
                    rank,
                    n,
                    worker,
                )
        self.shm.check_dead()
        for job in self.jobs.values():
            job.save()

    def close(self) -> None:
        """Flush every job's state, close the socket and remove the socket file (idempotent)."""
        if self.sock.closed:
            return
        self.sock.close()
        if self._curve is not None:
            self._curve.close()
        self.ctx.term()
        self.prefetcher.close()
        self.shm.close()
        for job in self.jobs.values():
            job.close()
        self.snapshots.close()
        self.tiers.close()
        if self.ipc_path is not None:
            self.ipc_path.unlink(missing_ok=True)
        for lock in self._locks:
            lock.release()
        logger.info("stopped")

    def _load_jobs(self) -> None:
        from loaderd.journal import read_json

        for path in sorted((self.state_dir / "jobs").glob("*/job.json")):
            saved = read_json(path)
            try:
                spec = JobSpec(**saved["spec"])
                job = self.jobs[spec.name] = Job(
                    spec, self.store.num_samples, self.job_defaults, path.parent
                )
                for rank, state in enumerate(job.passes):
                    for worker in set(state.inflight.values()) if state else ():
                        self.consumers.restored((spec.name, rank, worker))
            except (JobError, KeyError, TypeError, ValueError) as e:
                logger.warning("skipping saved job in %s: %s", path.parent, e)

    # --- dispatch -----------------------------------------------------------------------------

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        identity, body = frames[0].bytes, frames[1:]
        if self._curve is not None:
            self._local = not is_curve_peer(frames[-1])  # a remote pid means nothing here
        try:
            msg = decode(body)
            check_request(msg)
            handler = self._handlers.get(msg.type)
            if handler is None:  # a request of a newer protocol, or of a part not built in
                raise JobError(
                    f"this daemon does not handle {msg.type.name}", ErrorCode.UNKNOWN_TYPE
                )
            reply = handler(identity, msg)
        except ProtocolError as e:
            reply = error_message(peek_request_id(body), ErrorCode.BAD_MESSAGE, str(e))
        except JobError as e:
            reply = error_message(peek_request_id(body), e.code, str(e))
        except CorruptRecordError as e:
            logger.error("%s", e)
            reply = error_message(peek_request_id(body), ErrorCode.CORRUPT_RECORD, str(e))
        except StorageError as e:
            logger.error("%s", e)
            reply = error_message(peek_request_id(body), ErrorCode.STORAGE, str(e))
        except Exception as e:
            logger.exception("request failed")
            reply = error_message(
                peek_request_id(body), ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"
            )
        if reply is not None:
            self._send(identity, reply)

    def _send(self, identity: bytes, msg: Message) -> None:
        self.sock.send_multipart([identity, *encode(msg)], copy=False)

    def _job(self, meta: dict[str, Any]) -> Job:
        job = self.jobs.get(meta["job"])
        if job is None:
            raise JobError(f"unknown job {meta['job']!r}: send HELLO first", ErrorCode.UNKNOWN_JOB)
        return job

    # --- handlers -----------------------------------------------------------------------------

    def _ping(self, identity: bytes, msg: Message) -> Message:
        return Message(
            MsgType.PONG,
            msg.request_id,
            {
                "version": PROTOCOL_VERSION,
                "loaderd": __version__,
                "pid": os.getpid(),
                "uptime_s": time.monotonic() - self.started,
            },
        )

    def _hello(self, identity: bytes, msg: Message) -> Message:
        m = msg.meta
        spec = JobSpec(m["job"], m["world_size"], m["seed"], m["batch_size"], m["options"])
        spec.check(self.config.max_batch_size)
        job = self.jobs.get(spec.name)
        if job is None:
            job = Job(
                spec, self.store.num_samples, self.job_defaults, self.state_dir / "jobs" / spec.name
            )
            self.jobs[spec.name] = job
            job.save(force=True)
            logger.info("job %s opened: %s", spec.name, spec)
        elif job.spec != spec:
            raise JobError(
                f"job {spec.name!r} is running with {asdict(job.spec)}, "
                f"this client asked for {asdict(spec)}",
                ErrorCode.JOB_CONFLICT,
            )
        job.check_rank(m["rank"])
        self.consumers.hello(identity, m.get("pid"), m.get("pidns"), self._local)
        return Message(
            MsgType.WELCOME,
            msg.request_id,
            {
                "schema": [s.to_json() for s in self.schema],
                "num_samples": self.store.num_samples,
                "job": asdict(job.spec),
                **self.shm.hello(identity, m, spec.batch_size),
            },
        )

    def _open_pass(self, identity: bytes, msg: Message) -> Message | None:
        m = msg.meta
        job = self._job(m)
        self.shm.reclaim(identity)  # what this consumer held and never acknowledged is lost
        resume = parse_resume(m.get("resume"))
        job.check_rank(m["rank"])
        self.consumers.seen((job.spec.name, m["rank"], m["worker"]), identity)
        try:
            state = job.open_pass(m["rank"], m["worker"], m["phase"], resume)
        except NotReady:
            self._parked_opens.append((identity, msg))
            return None
        self._forget_other_passes(job, m["rank"], state)
        self.placement.on_pass(job, state)
        self._prefetch_ahead(job, m["rank"], state)
        return Message(
            MsgType.PASS,
            msg.request_id,
            {
                "epoch": state.epoch,
                "phase": state.phase,
                "batches": state.plan.num_batches,
            },
        )

    def _retry_parked(self) -> None:
        parked, self._parked_opens = self._parked_opens, []
        for identity, msg in parked:
            reply = self._open_pass(identity, msg)
            if reply is not None:
                self._send(identity, reply)

    def _get_batch(self, identity: bytes, msg: Message) -> Message | None:
        m = msg.meta
        job = self._job(m)
        self.shm.release_acked(identity, m)
        rank, epoch, phase = m["rank"], m["epoch"], m["phase"]
        state = job.get_pass(rank, epoch, phase)
        self.consumers.seen((job.spec.name, rank, m["worker"]), identity)
        end = Message(MsgType.END, msg.request_id, {"epoch": epoch, "phase": phase})
        if state is None:
            return end  # a request for a pass that is over
        job.ack(state, check_int_list("acks", m["acks"], _MAX_ACKS))
        got = job.assign(rank, state, m["worker"])
        if got is None:
            if state.complete and self._parked_opens:
                self._retry_parked()
            return end
        index, ids, weights = got
        key: BatchKey = (job.spec.name, rank, epoch, phase, index)
        fut = self.prefetcher.submit(key, ids, weights)
        self._prefetch_ahead(job, rank, state)
        self._waiting.setdefault(key, []).append((identity, msg.request_id))
        if fut.done():
            self._ready.append(key)  # sent once the assignment is written (_commit_cursors)
        return None

    def _prefetch_ahead(self, job: Job, rank: int, state: PassState) -> None:
        for index in islice(state.queue, self.config.prefetch.depth):
            ids, weights = state.plan.batch(index)
            self.prefetcher.submit(
                (job.spec.name, rank, state.epoch, state.phase, index), ids, weights
            )

    def _forget_other_passes(self, job: Job, rank: int, state: PassState) -> None:
        name, cur = job.spec.name, (state.epoch, state.phase)
        self.prefetcher.drop(
            lambda k: (
                k not in self._waiting and k[0] == name and k[1] == rank and (k[2], k[3]) != cur
            )
        )

    def _deliver(self, key: BatchKey) -> None:
        """Send an assembled batch to whoever is waiting for it."""
        fut = self.prefetcher.get(key)
        if fut is None or not fut.done():
            # A stale announcement: the batch went back to the queue and was handed out again
            # under the same key before its first assembly finished; the new one announces itself.
            return
        waiters = self._waiting.pop(key, None)
        if not waiters:
            return  # assembled ahead of demand: it waits in the prefetcher
        self.prefetcher.pop(key)
        _, _, epoch, phase, index = key
        arrays = None
        for identity, request_id in waiters:
            try:
                arrays = fut.result()
            except Exception as e:
                code = (
                    ErrorCode.CORRUPT_RECORD
                    if isinstance(e, CorruptRecordError)
                    else ErrorCode.STORAGE
                )
                logger.error("batch %s failed: %s", key, e)
                self._send(identity, error_message(request_id, code, str(e)))
                continue
            meta: dict[str, Any] = {
                "epoch": epoch,
                "phase": phase,
                "index": index,
                "n": len(arrays.ids),
            }
            desc, payload, copy = self.shm.payload(identity, key, arrays)
            if desc is not None:
                meta["shm"] = desc  # the payload lies in a ring slot; no frames follow
            frames = encode(Message(MsgType.BATCH, request_id, meta))
            self.sock.send_multipart([identity, *frames, *payload], copy=copy)
            crashpoints.hit("deliver")
        if arrays is not None:
            self.shm.settle(arrays)

    def _ack(self, identity: bytes, msg: Message) -> None:
        m = msg.meta
        job = self._job(m)
        self.shm.release_acked(identity, m)
        state = job.get_pass(m["rank"], m["epoch"], m["phase"])
        self.consumers.seen((job.spec.name, m["rank"], m["worker"]), identity)
        if state is not None:
            job.ack(state, check_int_list("acks", m["acks"], _MAX_ACKS))
            if state.complete:
                self._retry_parked()
        self._acked_replies.append((identity, Message(MsgType.OK, msg.request_id)))
        return None

    def _feedback(self, identity: bytes, msg: Message) -> None:
        job = self._job(msg.meta)
        kind = msg.meta["kind"]
        if kind not in ("train", "rescore"):
            raise JobError(f"FEEDBACK: unknown kind {kind!r}, expected 'train' or 'rescore'")
        ids, losses = decode_feedback(msg)
        job.record_feedback(ids, losses, kind)
        self._unsynced.append(
            (identity, Message(MsgType.OK, msg.request_id, {"samples": len(ids)}))
        )

    def _stats(self, identity: bytes, msg: Message) -> Message:
        stats = self.stats()
        if msg.meta.get("detail") is True:  # `loaderd stats --plot`: binned, never N floats
            for name, job in self.jobs.items():
                stats["jobs"][name]["importance_detail"] = histograms(job.engine)
        return Message(MsgType.STATS_REPLY, msg.request_id, stats)

    def stats(self) -> dict[str, Any]:
        """Everything ``loaderd stats`` shows."""
        out = build_stats(
            dataset={
                "path": str(self.store.path),
                "samples": self.store.num_samples,
                "bytes": self.store.total_bytes,
                "fields": [s.to_json() for s in self.schema],
            },
            tiers=self.tiers.stats(),
            jobs={name: job.stats() for name, job in self.jobs.items()},
            daemon={
                "pid": os.getpid(),
                "version": __version__,
                "socket": self.config.socket,
                "state_dir": str(self.state_dir),
                "prefetched": self.prefetcher.pending,
            },
            uptime_s=time.monotonic() - self.started,
        )
        out["shm"] = self.shm.stats()
        out["snapshots"] = self.snapshots.stats()
        out["consumers"] = {"tracked": len(self.consumers), "gone": self.consumers.gone_total}
        return out


def set_heartbeats(sock: zmq.Socket[Any], ivl_ms: int = 2000, timeout_ms: int = 10000) -> None:
    """Turn on ZMTP heartbeats, so a peer that stops answering is disconnected.

    A dead TCP peer is noticed this way without any message from the application.
    """
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)


def secure_tcp(config: DaemonConfig) -> CurveServer | None:
    """The CURVE server for ``config.tcp``, or None; refuses TCP without keys.

    Raises:
        ValueError: TCP without a key directory (CURVE without an authenticator admits any
            key, and no CURVE admits anybody).
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


def parse_resume(value: Any) -> Resume | None:
    """OPEN_PASS's optional ``resume``: {"epoch", "delivered": [batch index, ...], "rewind"}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError(f"OPEN_PASS: field 'resume' must be an object, got {value!r}")
    epoch = value.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ProtocolError(f"OPEN_PASS: 'resume.epoch' must be an int >= 0, got {epoch!r}")
    rewind = value.get("rewind", False)
    if not isinstance(rewind, bool):
        raise ProtocolError(f"OPEN_PASS: 'resume.rewind' must be a bool, got {rewind!r}")
    delivered = check_int_list("resume.delivered", value.get("delivered", []), _MAX_ACKS)
    return Resume(epoch, delivered, rewind)
