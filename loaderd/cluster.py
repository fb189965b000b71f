"""One daemon per node: a thread of exchange rounds that keeps every node's history identical.

Each node's trainers feed losses back to their own daemon only, yet every node must plan the
same epochs, so every node must hold the same loss history, applied in the same order. The
daemons form a gloo group (``loaderd.cluster_group``) and this module's thread runs *rounds*
(``loaderd.cluster_rounds``): the same collectives in the same order on every node. A round
in which some node has content (feedback, or a status that changed) becomes round
``last + 1`` on every node, decoded identically (``loaderd.cluster_wire``); it is appended to
the round log and fsynced, and only then handed to the server loop (:meth:`ClusterNode.rounds`,
with a wake-up pipe to poll next to the socket). The loop never waits on a collective.

A node enters a round every ``round_interval_s``, or at once when its status changed (a rank
finished a pass or waits for a plan). An idle cluster therefore costs one 32-byte allgather
per node every interval, and nothing is written.

After every (re)formation of the group the nodes catch up on the rounds some of them lack
(a restarted node, or one that missed the last round when a peer died mid-collective). A
node's own feedback stays in its outbox until a round carries it (the round says which of the
node's sequence numbers it holds), so a restarted node re-sends exactly what the cluster lacks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from loaderd.cluster_group import (
    ClusterError,
    Group,
    GroupBroken,
    NodeMissingError,
    Rendezvous,
    Stopped,
)
from loaderd.cluster_log import Outbox, RoundLog
from loaderd.cluster_rounds import catch_up, exchange
from loaderd.cluster_wire import (
    KINDS,
    Entries,
    JobStatus,
    Pending,
    Round,
    coalesce,
    contribution_seqs,
    decode_round,
    encode_contribution,
    make_round,
    round_parts,
    split_round,
    status_key,
)
from loaderd.config import ClusterConfig
from loaderd.journal import read_json, write_json_atomic

logger = logging.getLogger(__name__)

__all__ = ["ClusterError", "ClusterNode", "check_identity"]


def check_identity(directory: Path, config: ClusterConfig) -> None:
    """Refuse a cluster state directory of another node or another cluster size.

    Raises:
        ClusterError: naming both identities.
    """
    path = directory / "node.json"
    mine = {"node_rank": config.node_rank, "nodes": config.nodes}
    saved = read_json(path)
    if saved is None:
        write_json_atomic(path, mine)
    elif saved != mine:
        raise ClusterError(
            f"{directory} holds the state of node {saved.get('node_rank')} of "
            f"{saved.get('nodes')}, not of node {config.node_rank} of {config.nodes}"
        )


class ClusterNode:
    """This node's member of the cluster: feedback and status in, identical rounds out.

    Args:
        config: the cluster configuration (``enabled``).
        fingerprint: the store's fingerprint, compared with every other node's.
        state_dir: the daemon's state directory (the cluster keeps ``cluster/`` in it).
        applied_round: the last round the caller's persisted state already contains; the
            rounds after it that this node's log holds are handed out again first.
        host: how messages name this node (default: the host name).

    Raises:
        ClusterError: the log does not reach back to ``applied_round``.
    """

    def __init__(
        self,
        config: ClusterConfig,
        fingerprint: bytes,
        state_dir: Path,
        *,
        applied_round: int = 0,
        host: str | None = None,
    ) -> None:
        if not config.enabled:
            raise ValueError("a ClusterNode needs a cluster address")
        self.config = config
        self.dir = state_dir / "cluster"
        self.dir.mkdir(parents=True, exist_ok=True)
        check_identity(self.dir, config)
        self._log = RoundLog(self.dir)
        try:
            self._results, acked = self._replay(applied_round)
        except BaseException:
            self._log.close()
            raise
        self._have = self._log.last
        self._lock = threading.Lock()  # pending, status, outbox, results
        self._outbox = Outbox(self.dir / "outbox.log")
        self._acked = max(acked, self._outbox.floor)
        self._pending = [p for p in self._outbox.pending if p.seq > self._acked]
        self._next_seq = max([self._acked, *(p.seq for p in self._pending)]) + 1
        # Entries numbered from here on are this life's. Until the first catch-up this node
        # cannot know every number an earlier life used (entries it sent but had not synced,
        # or a state directory restored from an older copy): they are renumbered after it.
        self._life_from: int | None = self._next_seq
        self._status: dict[str, JobStatus] = {}
        self._sent_key: bytes | None = None  # the status the last round carried
        self._rdv = Rendezvous(config, fingerprint, host)
        self._group: Group | None = None
        self._compact_to = 0  # what the caller asked for
        self._compacted = 0  # what was done
        self._last_round_t = 0.0
        self._failure: ClusterError | None = None
        self._stalled: NodeMissingError | None = None  # a node missing past the timeout
        self._stop = threading.Event()
        self._kick = threading.Event()
        self.formed = threading.Event()  # set while a generation is formed
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)
        self._counters = {
            "rounds": 0,
            "heartbeats": 0,
            "generations": 0,
            "entries": 0,
            "caught_up": 0,
        }
        self._last_round: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, name="loaderd-cluster", daemon=True)
        if self._results:
            self._wake()
        logger.info(
            "cluster: node %d of %d, %d rounds kept, %d to replay, %d entries to send",
            config.node_rank,
            config.nodes,
            len(range(self._log.first, self._log.last + 1)),
            len(self._results),
            sum(len(p.entries.ids) for p in self._pending),
        )

    def _replay(self, applied_round: int) -> tuple[deque[Round], int]:
        """The logged rounds after ``applied_round``, and the last own entry any round holds."""
        log = self._log
        if applied_round < log.first - 1:
            raise ClusterError(
                f"{self.dir}: the caller's state is at round {applied_round} but the round log "
                f"starts at round {log.first}"
            )
        if applied_round > log.last:  # the log was lost, the caller's state was not
            logger.warning(
                "%s: the round log ends at round %d, the caller's state at %d: going on from it",
                self.dir,
                log.last,
                applied_round,
            )
            log.skip_to(applied_round)
        rounds: deque[Round] = deque()
        acked = 0
        for number in range(log.first, log.last + 1):
            record = log.read(number)
            _, blobs = split_round(record)
            acked = max(acked, contribution_seqs(blobs[self.config.node_rank])[1])
            if number > applied_round:
                rounds.append(decode_round(record))
        return rounds, acked

    # --- the server loop's side ---------------------------------------------------------------

    def start(self) -> None:
        """Start the cluster thread (rendezvous happens there, never on the caller)."""
        self._thread.start()

    def submit(self, job: str, epoch: int, kind: str, ids: np.ndarray, losses: np.ndarray) -> int:
        """Queue this node's feedback for the next round (durable after :meth:`sync`).

        Args:
            job: the job's name.
            epoch: the epoch the losses belong to.
            kind: ``"train"`` or ``"rescore"``.
            ids: sample ids (copied).
            losses: one loss per id (copied as float32).

        Returns:
            The entry's sequence number on this node.

        Raises:
            ValueError: a bad kind, epoch or shape.
        """
        if kind not in KINDS:
            raise ValueError(f"`kind` must be one of {', '.join(KINDS)}, got {kind!r}")
        if epoch < 0:
            raise ValueError(f"`epoch` must be >= 0, got {epoch}")
        ids = np.array(ids, np.int64, copy=True).reshape(-1)
        losses = np.array(losses, np.float32, copy=True).reshape(-1)
        if len(ids) != len(losses):
            raise ValueError(f"{len(ids)} ids but {len(losses)} losses")
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            p = Pending(seq, Entries(job, epoch, kind, ids, losses))
            self._pending.append(p)
            self._outbox.append(p)
        return seq

    def sync(self) -> None:
        """Make every submitted entry survive a crash (acknowledge FEEDBACK after this)."""
        with self._lock:
            self._outbox.sync()

    def set_status(self, job: str, status: JobStatus) -> None:
        """Replace this node's status of ``job``; a change starts the next round at once."""
        with self._lock:
            if self._status.get(job) == status:
                return
            self._status[job] = status
        self._kick.set()

    def rounds(self) -> list[Round]:
        """The rounds completed since the last call, in order (drains the wake-up pipe).

        Apply each round's entries in order, then decide from its statuses: every node does
        the same, so every node plans the same passes.
        """
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_fd, 4096):
                pass
        with self._lock:
            out = list(self._results)
            self._results.clear()
        return out

    @property
    def failure(self) -> ClusterError | None:
        """Set when the cluster cannot go on (the daemon should stop with this message)."""
        return self._failure

    @property
    def stalled(self) -> NodeMissingError | None:
        """Set while a node (node 0: the store's host) stays missing past the timeout.

        Not a failure: the thread keeps trying to re-form the group and clears this once it
        has. Meanwhile nothing that needs the nodes' agreement (a new pass) can be decided.
        """
        return self._stalled

    def compact(self, through_round: int) -> None:
        """The caller's persisted state now holds every round up to ``through_round``.

        Rounds a restarted peer might still need are kept anyway; whole log segments older
        than both are deleted by the cluster thread.
        """
        self._compact_to = max(self._compact_to, through_round)
        self._kick.set()

    def stats(self) -> dict[str, Any]:
        """The node's part of ``loaderd stats``."""
        group = self._group
        with self._lock:
            pending = sum(len(p.entries.ids) for p in self._pending)
        return {
            "node_rank": self.config.node_rank,
            "nodes": self.config.nodes,
            "state": self._state(),
            "generation": group.generation if group is not None else None,
            "joined": [n.label for n in group.nodes] if group is not None else [],
            "round": self._have,
            "pending_entries": pending,
            **self._counters,
            "last_round": dict(self._last_round),
            "error": str(self._failure or self._stalled or "") or None,
        }

    def _state(self) -> str:
        if self._failure is not None:
            return "failed"
        if self.formed.is_set():
            return "formed"
        return "stalled" if self._stalled is not None else "forming"

    def __enter__(self) -> ClusterNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the thread, tell the others this node left on purpose, close files; safe twice.

        A thread inside a collective finishes it first (the peers enter theirs within an
        interval); one blocked by a hung peer is left behind after a few seconds.
        """
        self._stop.set()
        self._kick.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.config.round_interval_s * 4 + 5)
            if self._thread.is_alive():
                logger.warning("cluster: the thread is still in a collective; leaving it")
                return
        with self._lock:
            self._outbox.close()
        self._log.close()
        for fd in (self.wake_fd, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # --- the cluster thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    if self._group is None:
                        self._group = self._join()
                        if self._group is None:
                            continue
                        self._counters["generations"] += 1
                        self._catch_up()
                        self._begin_life()
                        self.formed.set()
                        self._recovered()
                    if self._wait_turn():
                        self._compact()
                        self._round()
                except GroupBroken as e:
                    self._drop_group(e)
        except Stopped:
            pass
        except ClusterError as e:
            self._fail(e)
        except Exception as e:  # a bug: stop the cluster loudly rather than diverge
            logger.exception("cluster: thread failed")
            self._fail(ClusterError(f"cluster thread failed: {e}"))
        finally:
            if self._group is not None:
                self._group.close()
                self._group = None
            self.formed.clear()
            if self._stop.is_set():
                self._rdv.leave()
            self._rdv.close()

    def _join(self) -> Group | None:
        """The next generation; None after a timeout (stalled: the caller tries again)."""
        try:
            return self._rdv.join(self._stop)
        except NodeMissingError as e:
            self._stalled = e
            logger.error("cluster: %s; still trying (stats say 'stalled')", e)
            self._rdv.retry()
            self._wake()
            return None

    def _recovered(self) -> None:
        if self._stalled is not None:
            assert self._group is not None
            logger.warning(
                "cluster: recovered: generation %d formed after '%s'",
                self._group.generation,
                self._stalled,
            )
            self._stalled = None
            self._wake()

    def _drop_group(self, e: BaseException) -> None:
        assert self._group is not None
        logger.warning(
            "cluster: generation %d broke (%s); waiting up to %g s for every node to rejoin",
            self._group.generation,
            e,
            self.config.timeout_s,
        )
        self.formed.clear()
        self._group.close()
        self._group = None

    def _fail(self, e: ClusterError) -> None:
        logger.error("cluster: %s", e)
        self._failure = e
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: the loop is awake already
            os.write(self._wake_w, b"x")

    def _wait_turn(self) -> bool:
        """Sleep until the next round is due or a status change asks for one now."""
        due = self._last_round_t + self.config.round_interval_s
        while not self._stop.is_set() and not self._kick.is_set():
            left = due - time.monotonic()
            if left <= 0:
                break
            self._kick.wait(left)
        self._kick.clear()
        self._last_round_t = time.monotonic()
        return not self._stop.is_set()

    def _round(self) -> None:
        assert self._group is not None
        t0 = time.perf_counter()
        with self._lock:
            pending = list(self._pending)
            status = dict(self._status)
        seq_hi = pending[-1].seq if pending else self._acked
        key = status_key(status)
        payload = encode_contribution(self._acked, seq_hi, status, coalesce(pending))
        t1 = time.perf_counter()
        got = exchange(self._group, self._have, payload, bool(pending) or key != self._sent_key)
        if got is None:
            self._counters["heartbeats"] += 1
            return
        rnd, blobs = got
        t2 = time.perf_counter()
        self._log.append(rnd.number, round_parts(rnd.number, blobs))
        t3 = time.perf_counter()
        self._have = rnd.number
        self._sent_key = key
        self._carried(seq_hi)
        self._deliver([rnd])
        self._counters["rounds"] += 1
        self._counters["entries"] += rnd.num_entries
        self._last_round = {
            "round": rnd.number,
            "entries": rnd.num_entries,
            "bytes": sum(len(b) for b in blobs),
            "encode_s": t1 - t0,
            "exchange_s": t2 - t1,
            "persist_s": t3 - t2,
        }

    def _carried(self, seq_hi: int) -> None:
        """A persisted round holds this node's entries up to ``seq_hi``: drop them."""
        with self._lock:
            if seq_hi <= self._acked:
                return
            self._acked = seq_hi
            self._pending = [p for p in self._pending if p.seq > seq_hi]
            # Entries still pending were acknowledged (fsynced) already: keep them durable.
            self._outbox.reset(self._acked, self._pending, sync=bool(self._pending))

    def _renumber_after(self, used: int) -> None:
        """An earlier life of this node used entry numbers up to ``used``: move this life's.

        Runs before the rounds that say so are persisted, so no restart can mistake this
        life's entries for ones a round carried.
        """
        with self._lock:
            life = self._life_from
            if life is None:
                return
            mine = [p for p in self._pending if p.seq >= life]
            if mine and mine[0].seq <= used:
                logger.warning(
                    "cluster: an earlier life of this node numbered entries up to %d; "
                    "%d entries of this one renumbered after it",
                    used,
                    len(mine),
                )
                mine = [Pending(used + 1 + i, p.entries) for i, p in enumerate(mine)]
                self._pending = [p for p in self._pending if p.seq < life] + mine
                self._outbox.reset(self._acked, self._pending, sync=True)
                self._life_from = used + 1
            self._next_seq = max(self._next_seq, used + 1, *(p.seq + 1 for p in mine))

    def _begin_life(self) -> None:
        """The first catch-up is over: every later round holds only this life's entries."""
        self._life_from = None

    def _deliver(self, rounds: list[Round]) -> None:
        with self._lock:
            self._results.extend(rounds)
        self._wake()

    def _catch_up(self) -> None:
        """Bring every node to the newest round any node holds (lockstep on every node)."""
        assert self._group is not None
        taken = []
        for number, record in catch_up(self._group, self._have, self._log.first, self._log.read):
            _, blobs = split_round(record)
            rnd = make_round(number, blobs)
            own = contribution_seqs(blobs[self.config.node_rank])[1]
            self._renumber_after(own)
            self._log.append(number, record.tobytes())
            self._have = number
            self._carried(own)
            taken.append(rnd)
        if taken:
            self._counters["caught_up"] += len(taken)
            logger.info("cluster: caught up to round %d (%d rounds)", self._have, len(taken))
            self._deliver(taken)

    def _compact(self) -> None:
        through = min(self._compact_to, self._have - 1)  # a peer may lack the newest round
        if through <= self._compacted:
            return
        self._compacted = through
        with self._lock:  # first make the outbox say which entries the dropped rounds held
            self._outbox.reset(self._acked, self._pending, sync=True)
        dropped = self._log.compact(through)
        if dropped:
            logger.info("cluster: dropped %d rounds up to %d from the log", dropped, through)
