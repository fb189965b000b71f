"""The daemon's ZeroMQ ROUTER loop: receive, decode, dispatch, reply. No cache logic here.

One thread owns the socket. Requests that need I/O (a batch not yet assembled) are parked
until the prefetcher announces the batch, so a slow read never stalls other clients. Every
failure of a request becomes an ERROR reply naming what went wrong; the loop keeps serving.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from loaderd import __version__, autotune_daemon, crashpoints, row_copy
from loaderd.auth import is_curve_peer, secure_tcp
from loaderd.client.errors import ErrorCode, ProtocolError
from loaderd.client.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    BatchKey,
    FieldSpec,
    Message,
    MsgType,
    VersionError,
    check_int_list,
    check_request,
    decode,
    decode_feedback,
    encode,
    error_message,
    peek_request_id,
)
from loaderd.config import DaemonConfig
from loaderd.connections import ConnectionWatch
from loaderd.consumers import Consumers
from loaderd.fair_share import Inbox
from loaderd.importance_plot import histograms
from loaderd.job_admin import remove_job_dir, sweep
from loaderd.jobs import Job, JobError, JobSpec, NotReady, Resume, reset_hint
from loaderd.journal import JournalWriteError
from loaderd.limits import check_hello, check_request_size, check_rewind
from loaderd.loop_clock import LoopClock
from loaderd.memory_split import split_memory
from loaderd.miss_workers import Forker, MissWorkers
from loaderd.outbox import After, Outbox
from loaderd.outstanding import Outstanding, still_out_in
from loaderd.parked_opens import Group, ParkedOpens
from loaderd.pass_state import PassState
from loaderd.prefetch import Assembler, Prefetcher
from loaderd.readahead import ReadAhead
from loaderd.shm_delivery import ShmDelivery
from loaderd.snapshots import Snapshots
from loaderd.state_writes import (
    DAMAGED_STATE_ERRORS,
    STATE_DISK,
    durability_failure,
    note_failed_write,
    quarantine,
)
from loaderd.stats import build_stats
from loaderd.storage.errors import CorruptRecordError, StorageError
from loaderd.storage.safe_files import (
    PathLock,
    private_dir,
    remove_stale_socket,
    socket_dir,
)
from loaderd.storage.store import SampleStore
from loaderd.tiering import Placement, build_tiers

if TYPE_CHECKING:
    from loaderd.cluster_jobs import ClusterJobs

logger = logging.getLogger(__name__)

_TICK_S = 0.5
# Feedback's replies wait up to this long so that one fsync records several FEEDBACKs (at
# 3 KB hits one fsync each took a fifth of the loop). A trainer sends one every 8192 samples
# or quarter of a second (``client/losses.py``), and does not wait for the replies (up to 64
# in flight) but at a pass's end.
_GROUP_COMMIT_S = 0.01
_WAITING_EVERY_S = 5.0
Noted = tuple[bytes, int]  # a request told why it waits: (identity, request id)
_MAX_ACKS = 1 << 16


class Server:
    """Serves one store to any number of jobs over one ROUTER socket.

    Args:
        config: the daemon configuration.
    """

    def __init__(self, config: DaemonConfig) -> None:
        # Forked first, while this process runs one thread (``miss_workers.Forker``).
        misses = config.prefetch.miss_procs and config.shm.enabled  # they fill ring slots
        forker = Forker.start(str(config.db)) if misses else None
        self.config = config
        self.job_defaults = config.importance
        self.started = time.monotonic()
        self.loop_clock = LoopClock()  # serve starts it afresh
        # Names this run of the daemon in WELCOME and each BATCH: a client whose requests
        # reached a restarted daemon without a HELLO sees a new name and says HELLO again.
        self.instance = secrets.token_hex(8)
        self._locks: list[PathLock] = []
        # Locks, private directories and the TCP policy come before the store and the pools
        # open: a daemon that must refuse to start refuses before it allocates anything.
        self.state_dir = private_dir(config.state_dir, "state directory")
        STATE_DISK.watch(self.state_dir)  # shown in stats: writes to it failing, or not
        self._curve = secure_tcp(config)  # reads the keys; binds nothing yet
        self._locks.append(
            PathLock(self.state_dir / "daemon.lock", f"state directory {self.state_dir}")
        )
        self.ipc_path = (
            Path(config.socket[len("ipc://") :]) if config.socket.startswith("ipc://") else None
        )
        if self.ipc_path is not None:
            socket_dir(self.ipc_path.parent)
            self._locks.append(
                PathLock(
                    self.ipc_path.with_name(self.ipc_path.name + ".lock"), f"socket {config.socket}"
                )
            )
            remove_stale_socket(self.ipc_path)  # its owner's lock is gone
        self.store = SampleStore(config.db)
        self._store_id = self.store.fingerprint.hex()  # jobs are bound to the store they use
        self.memory = split = split_memory(config)
        self.tiers = build_tiers(replace(config.cache, dram_bytes=split.dram_bytes), self.store)
        self.placement = Placement(self.tiers, node_local=config.cluster.enabled)
        self.snapshots = Snapshots(self.tiers.arena, self.state_dir / "snapshots")
        self.schema = [FieldSpec.from_json(f.to_json()) for f in self.store.schema.fields]
        self.consumers = Consumers(config.consumer_timeout_s)
        assembler = Assembler(self.tiers, self.store.schema)
        shm = replace(config.shm, max_bytes=max(1, split.rings_bytes))
        self.shm = ShmDelivery(shm, slot_estimate(assembler), self.consumers)
        self.misses = MissWorkers(
            self.tiers, assembler, config.prefetch.miss_procs, forker, self.shm.ring_names
        )
        self.misses.start()
        self.prefetcher = Prefetcher(
            assembler,
            config.prefetch.workers,
            allocator_for=self.shm.allocator_for,
            on_discard=self.shm.discard,
            max_workers=autotune_daemon.max_workers(config),
            elsewhere=self.misses,
        )
        self.readahead = ReadAhead(
            self.store,
            self.tiers.cached,
            config.prefetch.readahead_bytes,
            reads_here=self._reads_here,
            paused=lambda: self.tiers.in_ram_whole,
        )
        self.prefetch_depth = config.prefetch.depth  # `--autotune` moves it while serving
        self.autotune = autotune_daemon.build(self) if config.autotune.enabled else None
        self.jobs: dict[str, Job] = {}
        # One daemon per node: jobs' feedback and plans go through the cluster's rounds.
        self.cluster: ClusterJobs | None = None
        if config.cluster.enabled:  # imported here: it loads torch.distributed
            from loaderd.cluster_jobs import ClusterJobs

            self.cluster = ClusterJobs(
                config.cluster, self.store.fingerprint, self.state_dir, self._open_job
            )
        self._waiting: dict[BatchKey, list[tuple[bytes, int]]] = {}
        limits = config.limits
        self.parked = ParkedOpens(limits.max_parked_opens_per_client, limits.max_parked_opens)
        self._waiting_noted: dict[Noted, float] = {}  # parked open -> its last WAITING
        self._held_noted: dict[Noted, float] = {}  # held on a failed write -> the same
        self.outstanding = Outstanding(config.limits.max_outstanding_batches)
        # Each connection's requests wait in its own queue; the loop takes a few of each per turn.
        self.inbox = Inbox(limits.max_backlog_per_client, limits.max_request_bytes)
        self._still_out = still_out_in(self.jobs)
        # Replies that promise something durable wait for the loop turn's commit.
        self.outbox = Outbox(self._send, self._deliver)
        self._journal_due: float | None = None  # when feedback replies held must be synced
        self._load_jobs()
        if self.cluster is not None:
            self.cluster.start()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its identity
        set_heartbeats(self.sock)
        self.connections = ConnectionWatch(self.sock, self.consumers.connection_closed)
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
            MsgType.PASS_INFO: self._pass_info,
            MsgType.JOB_RESET: self._reset_job,
        }

    # --- lifecycle ----------------------------------------------------------------------------

    def serve(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set, then flush state and close."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.prefetcher.wake_fd, zmq.POLLIN)
        self.prefetcher.watch(partial(poller.register, flags=zmq.POLLIN), poller.unregister)
        if self.cluster is not None:
            poller.register(self.cluster.wake_fd, zmq.POLLIN)
        logger.info(
            "ready: serving %s (%d samples) on %s",
            self.store.path,
            self.store.num_samples,
            self.config.socket,
        )
        next_tick = time.monotonic() + _TICK_S
        clock = self.loop_clock = LoopClock()
        try:
            while not stop.is_set():
                timeout = 0 if self.inbox else self._poll_ms()  # requests still wait
                clock.polling()
                events = dict(poller.poll(timeout=timeout))
                clock.polled()
                if self.sock in events or self.inbox:
                    self.inbox.receive(self.sock, self._send)  # past a backlog: refused
                    for frames in self.inbox.turn():  # bounded, so completions are never starved
                        self._dispatch(frames)
                    self._commit()
                    clock.mark("requests")
                elif self._journal_due is not None:
                    self._commit()
                if self.prefetcher.wake_fd in events:
                    for key in self.prefetcher.completed():
                        self._deliver(BatchKey(*key))
                for key in self.prefetcher.landed(events):
                    self._deliver(BatchKey(*key))
                clock.mark("assembled")
                if self.cluster is not None:
                    self._cluster_turn(self.cluster.wake_fd in events)
                if time.monotonic() >= next_tick:
                    self._tick()
                    clock.sample()
                    next_tick = time.monotonic() + _TICK_S
                if self.autotune is not None:
                    self.autotune.turn(self._waiting)
        finally:
            self.close()

    def _commit(self, sync_now: bool = False) -> None:
        """Make this loop turn's changes durable, then send what waited for them.

        Cursors are written without fsync: the page cache outlives a daemon crash, and a
        machine crash takes the trainers (and what they hold) down with it; the tick's save
        is the fsynced one. Feedback is fsynced once for all that came within
        ``_GROUP_COMMIT_S`` (group commit; ``sync_now``: at once), its replies held till then.
        """
        failed = durability_failure(job.commit_cursors for job in self.jobs.values())
        if failed is not None:
            if self._journal_due is not None:  # retried at the tick, not in a spinning poll
                self._journal_due = time.monotonic() + _TICK_S
            self._note_held(failed.message)
            return  # nothing waiting on a cursor goes out before it is written: next turn
        self._held_noted.clear()
        crashpoints.hit("commit")
        self.outbox.release(After.CURSORS)
        if self.outbox.waiting_for(After.JOURNAL):
            now = time.monotonic()
            if self._journal_due is None:
                self._journal_due = now + _GROUP_COMMIT_S
            if now < self._journal_due and not sync_now:
                return  # more feedback may come to share the fsync
            self._journal_due = None
            syncs = [job.journal.sync for job in self.jobs.values() if job.journal is not None]
            if self.cluster is not None:
                syncs.insert(0, self.cluster.sync)  # the node's outbox holds this turn's feedback
            failed = durability_failure(syncs)
            self.outbox.release(After.JOURNAL, None if failed is None else failed.reply_to)

    def _poll_ms(self) -> int:
        """How long the loop may wait for a request: until the tick, or held feedback's sync."""
        if self._journal_due is None:
            return int(_TICK_S * 1000)
        return max(0, math.ceil((self._journal_due - time.monotonic()) * 1000))

    def _cluster_turn(self, woken: bool) -> None:
        """Apply the cluster's new rounds and publish where this node's ranks are.

        Opens waiting for a pass the rounds decided go on. Raises ClusterError when the
        cluster failed: the daemon stops with its message.
        """
        assert self.cluster is not None
        if woken and self.cluster.apply():
            self._retry_parked()
        self.cluster.publish(self.jobs)

    def _tick(self) -> None:
        self._retry_parked()
        left: set[tuple[str, int]] = set()
        for name, rank, worker in self.consumers.gone():
            left.add((name, rank))
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
        alive = {k[:2] for name in {n for n, _ in left} for k in self.consumers.of_job(name)}
        for name, rank in left - alive:
            # No consumer of the rank is left: its batches assembled ahead give their ring
            # slots back, and nothing is read ahead for it, until a consumer opens a pass again
            # (kept, a few trainers that stopped early sent a fifth of a running job's batches
            # over the socket).
            self._forget(partial(_of_rank, name, rank))
        self.connections.poll()
        going = self.shm.check_dead()  # jobs whose ring goes: their slots must come back
        if going:
            self.prefetcher.drop(lambda k: k[0] in going and k not in self._waiting)
        self.outstanding.prune(self._still_out)
        durability_failure(job.save for job in self.jobs.values())
        if self.outbox.waiting_for(After.CURSORS):  # a commit that failed (a full disk), again
            self._commit()

    def close(self) -> None:
        """Flush every job's state, close the socket and remove the socket file (idempotent)."""
        if self.sock.closed:
            return
        if self._journal_due is not None:
            self._commit(sync_now=True)  # feedback replies held for a group commit go out
        self.connections.close()
        self.sock.close()
        if self._curve is not None:
            self._curve.close()
        self.ctx.term()
        if self.cluster is not None:
            self.cluster.close()
        self.readahead.close()
        self.prefetcher.close()
        self.misses.close()
        self.shm.close()
        durability_failure(job.close for job in self.jobs.values())
        self.snapshots.close()
        self.tiers.close()
        if self.ipc_path is not None:
            self.ipc_path.unlink(missing_ok=True)
        for lock in self._locks:
            lock.release()
        logger.info("stopped")

    def _load_jobs(self) -> None:
        from loaderd.journal import read_json

        sweep(self.state_dir, self.config.job_retention_s)  # idle jobs do not pile up
        for path in sorted((self.state_dir / "jobs").glob("*/job.json")):
            try:
                saved = read_json(path)
                spec = JobSpec(**saved["spec"])
                job = self.jobs[spec.name] = self._make_job(spec)
                for rank, state in enumerate(job.passes):
                    for worker in set(state.inflight.values()) if state else ():
                        self.consumers.restored((spec.name, rank, worker))
            except DAMAGED_STATE_ERRORS as e:
                if isinstance(e, JobError) and e.code == ErrorCode.JOB_CONFLICT:
                    # Whole, but of another store: refused when asked for, kept on disk until
                    # `loaderd jobs reset`. Only damaged state is quarantined.
                    logger.warning("job in %s not loaded: %s", path.parent, e)
                    continue
                quarantine(path.parent, self.state_dir, e)  # serve the other jobs

    def _make_job(self, spec: JobSpec) -> Job:
        """A job object over its state directory (in a cluster: kept by the cluster)."""
        job = Job(
            spec,
            self.store.num_samples,
            self.job_defaults,
            self.state_dir / "jobs" / spec.name,
            inputs=None if self.cluster is None else self.cluster.inputs,
            store=self._store_id,
            keep_selections=self.config.keep_selections,
        )
        if self.cluster is not None:
            self.cluster.attach(job)
        return job

    def _open_job(self, spec: JobSpec) -> Job:
        """The job named by ``spec``, created if new (JobError: another spec of that name)."""
        job = self.jobs.get(spec.name)
        if job is None:
            job = self.jobs[spec.name] = self._make_job(spec)
            job.save(force=True)
            logger.info("job %s opened: %s", spec.name, spec)
        elif job.spec != spec:
            raise JobError(
                f"job {spec.name!r} is running with {asdict(job.spec)}, "
                f"this client asked for {asdict(spec)}: {reset_hint(spec.name)}",
                ErrorCode.JOB_CONFLICT,
            )
        return job

    # --- dispatch -----------------------------------------------------------------------------

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        identity, body = frames[0].bytes, frames[1:]
        self.connections.seen(identity, frames[-1])
        if self._curve is not None:
            self._local = not is_curve_peer(frames[-1])  # a remote pid means nothing here
        try:
            if not self._local and self._curve is not None and not self._curve.admits(frames[-1]):
                raise JobError(
                    "this client's key was removed from authorized/", ErrorCode.UNAUTHORIZED
                )
            msg = decode(body)
            check_request(msg)
            check_request_size(msg, self.config.limits)
            handler = self._handlers.get(msg.type)
            if handler is None:  # a request of a newer protocol, or of a part not built in
                raise JobError(
                    f"this daemon does not handle {msg.type.name}", ErrorCode.UNKNOWN_TYPE
                )
            reply = handler(identity, msg)
        except VersionError as e:
            reply = error_message(peek_request_id(body), ErrorCode.BAD_VERSION, str(e))
        except ProtocolError as e:
            reply = error_message(peek_request_id(body), ErrorCode.BAD_MESSAGE, str(e))
        except JobError as e:
            reply = error_message(peek_request_id(body), e.code, str(e))
        except CorruptRecordError as e:
            logger.error("%s", e)
            reply = error_message(peek_request_id(body), ErrorCode.CORRUPT_RECORD, str(e))
        except StorageError as e:
            logger.error("%s", e)
            if isinstance(e, JournalWriteError):
                note_failed_write(e)
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
        job.last_active = time.time()
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
        if m.get("version", PROTOCOL_VERSION) != PROTOCOL_VERSION:
            raise JobError(
                f"client of job {m['job']!r} speaks protocol {m.get('version')!r}, this daemon "
                f"{PROTOCOL_VERSION}: run the same loaderd version on both sides",
                ErrorCode.BAD_VERSION,
            )
        spec = JobSpec(
            m["job"],
            m["world_size"],
            m["seed"],
            m["batch_size"],
            m["options"],
            m.get("drop_last", False),
        )
        spec.check(self.config.max_batch_size)
        check_hello(spec, self.jobs.keys(), self.config.limits)
        job = self._open_job(spec)
        job.last_active = time.time()
        job.check_rank(m["rank"])
        self.consumers.hello(identity, m.get("pid"), m.get("pidns"), self._local)
        shm = self.shm.hello(identity, m, spec.batch_size)
        if shm:
            self.misses.start()  # any worker lost since: started again before its first miss
        return Message(
            MsgType.WELCOME,
            msg.request_id,
            {
                "schema": [s.to_json() for s in self.schema],
                "num_samples": self.store.num_samples,
                "job": asdict(job.spec),
                "instance": self.instance,
                **shm,
            },
        )

    def _open_pass(self, identity: bytes, msg: Message) -> Message | None:
        m = msg.meta
        job = self._job(m)
        self.shm.reclaim(identity)  # what this consumer held and never acknowledged is lost
        resume = parse_resume(m.get("resume"))
        check_rewind(job, resume)
        job.check_rank(m["rank"])
        self.consumers.seen((job.spec.name, m["rank"], m["worker"]), identity)
        try:
            state = job.open_pass(m["rank"], m["worker"], m["phase"], resume)
        except (NotReady, OSError, JournalWriteError) as e:
            why = str(e)
            if not isinstance(e, NotReady):
                # The epoch's selection is not on disk (a full disk): no batch of it goes
                # out before it is, or a restart could select again and serve other samples.
                # Parked like a barrier, the open is tried again at each tick.
                note_failed_write(e)
                why = f"waiting for the daemon's state disk: cannot write daemon state: {e}"
            rewind = resume.epoch if resume is not None and resume.rewind else None
            self.parked.park((job.spec.name, m["rank"], m["phase"], rewind), identity, msg, why)
            self._note_waiting(identity, msg.request_id, why)
            return None
        self._forget_other_passes(job, m["rank"], state)
        self.placement.on_pass(job, m["rank"], state)
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

    def _pass_info(self, identity: bytes, msg: Message) -> Message:
        m = msg.meta
        if m["phase"] != "train":
            raise JobError(f"PASS_INFO: only the train pass has a length, not {m['phase']!r}")
        epoch, batches = self._job(m).coming_batches(m["rank"])
        return Message(
            MsgType.PASS, msg.request_id, {"epoch": epoch, "phase": "train", "batches": batches}
        )

    def _note_waiting(
        self, identity: bytes, request_id: int, why: str, noted: dict[Noted, float] | None = None
    ) -> None:
        """Tell a parked client why it waits (at once, then every few seconds).

        Its reply may take longer than its timeout; a WAITING note keeps it from taking the
        silence for a dead daemon, and says which ranks it waits for. ``noted``: when each
        request was last told (default: the parked opens').
        """
        noted = self._waiting_noted if noted is None else noted
        now, key = time.monotonic(), (identity, request_id)
        last = noted.get(key)
        if last is None or now - last >= _WAITING_EVERY_S:
            noted[key] = now
            note = {"message": why, "again_s": _WAITING_EVERY_S}
            self._send(identity, Message(MsgType.WAITING, request_id, note))

    def _note_held(self, why: str) -> None:
        """Tell each request held for a cursor write that failed why it waits (a full disk).

        Its batch is assigned and goes out once the write succeeds; sent before, a restart
        could hand it to another consumer. Without a note the client would take the silence
        for a dead daemon and reconnect again and again, blaming the wrong cause.
        """
        held = self.outbox.held(After.CURSORS)
        held += [w for waiters in self._waiting.values() for w in waiters]
        for identity, request_id in held:
            self._note_waiting(
                identity,
                request_id,
                f"waiting for the daemon's state disk: {why}",
                self._held_noted,
            )

    def _retry_parked(self) -> None:
        """Try each group of parked opens once (its first request): the rest follow it."""
        for key, group in self.parked.take():
            (identity, msg), rest = group.requests[0], group.requests[1:]
            if self._reopen(identity, msg) or not rest:
                for peer, request in rest:
                    self._reopen(peer, request)
                continue
            self.parked.put_back(key, Group(group.why, rest))
            for peer, request in rest:
                self._note_waiting(peer, request.request_id, self.parked.why(key))
        still = self.parked.waiting()
        self._waiting_noted = {k: t for k, t in self._waiting_noted.items() if k in still}

    def _reopen(self, identity: bytes, msg: Message) -> bool:
        """Retry one parked OPEN_PASS; False when it is parked again."""
        try:
            reply = self._open_pass(identity, msg)
        except (JobError, ProtocolError) as e:  # its job reset, its rank's pass moved on
            code = e.code if isinstance(e, JobError) else ErrorCode.BAD_MESSAGE
            reply = error_message(msg.request_id, code, str(e))
        if reply is None:
            return False
        self._send(identity, reply)
        return True

    def _get_batch(self, identity: bytes, msg: Message) -> Message | None:
        m = msg.meta
        job = self._job(m)
        check_int_list("release", m.get("release", []), _MAX_ACKS)
        self.shm.release_acked(identity, m)
        rank, epoch, phase = m["rank"], m["epoch"], m["phase"]
        state = job.get_pass(rank, epoch, phase)
        self.consumers.seen((job.spec.name, rank, m["worker"]), identity)
        end = Message(MsgType.END, msg.request_id, {"epoch": epoch, "phase": phase})
        if state is None:
            return end  # a request for a pass that is over
        # A pass restored after a restart is resumed by the requests ZeroMQ queued for the new
        # daemon, with no OPEN_PASS: its tiers are placed here (once; a no-op after that).
        self.placement.on_pass(job, rank, state)
        acks = check_int_list("acks", m["acks"], _MAX_ACKS)
        job.ack(state, acks)
        self.outstanding.acked(job.spec.name, rank, epoch, phase, acks)
        self.outstanding.check(identity)  # before anything is handed out
        got = job.assign(rank, state, m["worker"])
        if got is None:
            if state.complete and self.parked:
                self._retry_parked()
            if acks:  # it says "recorded" of them too, as an ACK's OK does
                self.outbox.hold(identity, end, After.CURSORS)
                return None
            return end
        index, ids, weights = got
        key = BatchKey(job.spec.name, rank, epoch, phase, index)
        self.outstanding.handed(identity, key, m["worker"])
        fut = self.prefetcher.submit(key, ids, weights)
        self._prefetch_ahead(job, rank, state)
        self._waiting.setdefault(key, []).append((identity, msg.request_id))
        if fut.done():
            self.outbox.hold_batch(key)  # sent once the assignment is written
        return None

    def _reads_here(self, key: tuple[Any, ...]) -> bool:
        """Whether this process reads a pass's misses (else the miss workers do)."""
        return not (self.misses.enabled and self.shm.allocator_for(key) is not None)

    def _prefetch_ahead(self, job: Job, rank: int, state: PassState) -> None:
        name = job.spec.name
        room = self.shm.room_ahead(name)  # slots this job's batches may hold (None: no bound)
        if room is not None:
            room -= self.prefetcher.count(lambda k: k[0] == name)
        for index in islice(state.queue, self.prefetch_depth):
            key = BatchKey(name, rank, state.epoch, state.phase, index)
            if self.prefetcher.get(key) is None:  # most of the window is under way already
                if room is not None:
                    if room <= 0:
                        break  # the ring's last slots are for batches asked for
                    room -= 1
                self.prefetcher.submit(key, *state.plan.batch(index))
        head = state.queue[0] if state.queue else state.plan.num_batches
        self.readahead.follow((name, rank, state.epoch, state.phase), state.plan, head)

    def _forget(self, which: Callable[[tuple[Any, ...]], bool]) -> None:
        """Drop these passes' batches assembled ahead, not yet asked for, and their read-ahead."""
        self.prefetcher.drop(lambda k: k not in self._waiting and which(k))
        self.readahead.drop(which)

    def _forget_other_passes(self, job: Job, rank: int, state: PassState) -> None:
        name, cur = job.spec.name, (state.epoch, state.phase)

        def other(k: tuple[Any, ...]) -> bool:
            return k[0] == name and k[1] == rank and (k[2], k[3]) != cur

        self._forget(other)

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
                "instance": self.instance,
            }
            desc, payload, copy = self.shm.payload(identity, key, arrays)
            if desc is not None:
                meta["shm"] = desc  # the payload lies in a ring slot; no frames follow
            frames = encode(Message(MsgType.BATCH, request_id, meta))
            self.sock.send_multipart([identity, *frames, *payload], copy=copy)
            crashpoints.hit("deliver")
        if arrays is not None:
            self.shm.settle(arrays)

    def _ack(self, identity: bytes, msg: Message) -> Message | None:
        m = msg.meta
        check_int_list("release", m.get("release", []), _MAX_ACKS)
        acks = check_int_list("acks", m["acks"], _MAX_ACKS)
        lost = check_int_list("lost", m.get("lost", []), _MAX_ACKS)
        if loop_ack(m) and not acks and not lost and not m.get("end"):
            # Handed slots given back alone (client/slot_handover.py): no job or pass is
            # needed, the job may have been reset since and the pass be long gone.
            self.shm.release_acked(identity, m)
            return Message(MsgType.OK, msg.request_id)
        job = self._job(m)
        self.shm.release_acked(identity, m)
        state = job.get_pass(m["rank"], m["epoch"], m["phase"])
        if not loop_ack(m):  # the loop's process acknowledging is not a consumer's liveness
            self.consumers.seen((job.spec.name, m["rank"], m["worker"]), identity)
        end = m.get("end", False)
        if not isinstance(end, bool):
            raise ProtocolError(f"ACK: field 'end' must be a bool, got {end!r}")
        if state is not None:
            job.lost(m["rank"], state, lost)  # the loop will never get them: out again
            job.ack(state, acks)
            self.outstanding.acked(job.spec.name, m["rank"], m["epoch"], m["phase"], acks)
            state.ended |= end and state.complete
            if state.complete:
                self._retry_parked()
        self.outbox.hold(identity, Message(MsgType.OK, msg.request_id), After.CURSORS)
        return None

    def _reset_job(self, identity: bytes, msg: Message) -> Message:
        """Forget a job: its passes, statistics and saved state (``loaderd jobs reset``)."""
        name, force = msg.meta["job"], msg.meta.get("force") is True
        job = self.jobs.get(name)
        if job is not None:
            live = self.consumers.of_job(name)
            if live and not force:
                ranks = sorted({rank for _, rank, _ in live})
                raise JobError(
                    f"job {name!r} has {len(live)} live consumers (ranks {ranks}): stop its "
                    "trainers first, or reset with --force",
                    ErrorCode.JOB_CONFLICT,
                )
            gone = JobError(f"job {name!r} was reset", ErrorCode.UNKNOWN_JOB)
            for key in [k for k in self._waiting if k[0] == name]:
                for peer, request_id in self._waiting.pop(key):
                    self._send(peer, error_message(request_id, gone.code, str(gone)))
            for parked_key, group in self.parked.take():
                if parked_key[0] != name:
                    self.parked.put_back(parked_key, group)
                    continue
                for peer, opening in group.requests:
                    self._send(peer, error_message(opening.request_id, gone.code, str(gone)))
            self.prefetcher.drop(lambda k: k[0] == name)
            self.readahead.drop(lambda k: k[0] == name)
            self.consumers.forget_job(name)
            self.outstanding.forget_job(name)
            job.discard()
            del self.jobs[name]
        try:
            removed: str | None = str(remove_job_dir(self.state_dir, name))
        except ValueError:
            if job is None:
                raise JobError(f"no job {name!r} in this daemon", ErrorCode.NOT_FOUND) from None
            removed = None  # a job that never saved anything
        logger.info("job %s reset%s", name, " (forced)" if force else "")
        return Message(MsgType.OK, msg.request_id, {"job": name, "removed": removed})

    def _feedback(self, identity: bytes, msg: Message) -> None:
        job = self._job(msg.meta)
        kind = msg.meta["kind"]  # a Phase: check_request saw to it
        ids, losses = decode_feedback(msg)
        if self.cluster is not None:
            self.cluster.feedback(job, ids, losses, kind)  # applied when a round carries it
        else:
            job.record_feedback(ids, losses, kind)
        reply = Message(MsgType.OK, msg.request_id, {"samples": len(ids)})
        self.outbox.hold(identity, reply, After.JOURNAL)

    def _stats(self, identity: bytes, msg: Message) -> Message:
        stats = self.stats()
        if msg.meta.get("detail") is True:  # `loaderd stats --plot`: binned, never N floats
            for name, job in self.jobs.items():
                stats["jobs"][name]["importance_detail"] = job.engine_stats.detail(histograms)
        return Message(MsgType.STATS_REPLY, msg.request_id, stats)

    def stats(self) -> dict[str, Any]:
        """Everything ``loaderd stats`` shows."""
        out = build_stats(
            dataset={
                "path": str(self.store.path),
                "samples": self.store.num_samples,
                "bytes": self.store.total_bytes,
                "fields": [s.to_json() for s in self.schema],
                # 2: each record's checksum names its sample (records.STORED_VERSION)
                "record_version": int(self.store.info.get("record_version", 1)),
            },
            tiers=self.tiers.stats(),
            jobs={name: job.stats() for name, job in self.jobs.items()},
            daemon={
                "pid": os.getpid(),
                "version": __version__,
                "socket": self.config.socket,
                "state_dir": str(self.state_dir),
                "prefetched": self.prefetcher.pending,
                "assembled_inline": self.prefetcher.inline,
                # how rows of records over 16 KiB are copied (``loaderd.row_copy``)
                "row_copy": "compiled" if row_copy.AVAILABLE else "python",
            },
            uptime_s=time.monotonic() - self.started,
        )
        out["memory"] = self.memory.stats()
        out["shm"] = self.shm.stats()
        out["miss_workers"] = self.misses.stats()
        out["readahead"] = self.readahead.stats()
        out["placement"] = self.placement.stats()
        out["snapshots"] = self.snapshots.stats()
        out["fair_share"] = self.inbox.stats()
        out["consumers"] = {"tracked": len(self.consumers), "gone": self.consumers.gone_total}
        out["loop"] = self.loop_clock.stats()
        out["state_disk"] = STATE_DISK.stats()
        if self.cluster is not None:
            out["cluster"] = self.cluster.stats()
        if self.autotune is not None:
            out["autotune"] = self.autotune.stats()
        return out


def _of_rank(name: str, rank: int, key: tuple[Any, ...]) -> bool:
    """Whether a batch or read-ahead key belongs to this job's rank."""
    return bool(key[0] == name and key[1] == rank)


def slot_estimate(assembler: Assembler) -> Callable[[int], list[int]]:
    """Frame sizes of a batch of n samples, for sizing ring slots before any is read.

    Variable-length fields are estimated at twice the store's mean record size per sample;
    a larger batch is assembled in fresh memory and goes over the socket.
    """
    store = assembler.tiers.store
    mean = store.total_bytes // max(store.num_samples, 1)
    nvar = len(assembler.layout.variable)
    return lambda n: assembler.frame_sizes(n, [2 * mean * n] * nvar)


def set_heartbeats(sock: zmq.Socket[Any], ivl_ms: int = 2000, timeout_ms: int = 10000) -> None:
    """Turn on ZMTP heartbeats, so a peer that stops answering is disconnected.

    A dead TCP peer is noticed this way without any message from the application.
    """
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)


def loop_ack(meta: dict[str, Any]) -> bool:
    """Whether an ACK comes from the training loop's process rather than the consumer.

    Such an ACK says "the loop received these" and frees no shared-memory slot: the slots are
    given back by ``release`` when the consumer no longer reads them, or by the loop's
    process's ``returned`` when a DataLoader worker handed them over (``shm_delivery``).
    """
    value = meta.get("loop", False)
    if not isinstance(value, bool):
        raise ProtocolError(f"ACK: field 'loop' must be a bool, got {value!r}")
    return value


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
