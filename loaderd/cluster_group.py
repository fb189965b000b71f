"""The daemons' ``torch.distributed`` group: rendezvous through node 0's TCPStore, then gloo.

A gloo group whose member died cannot be repaired in place, so the group lives in
*generations*: every (re)formation registers each node under ``loaderd/g<gen>/node<rank>`` in
the store and builds a fresh ``ProcessGroupGloo`` on the store prefix ``loaderd/g<gen>/pg/``.
A node that finds its own key in the current generation (a restarted daemon, or a survivor
whose group broke) moves the store's ``loaderd/gen`` counter on by compare-and-set; everyone
else follows the counter, so all nodes meet in the newest generation. The store is node 0's:
if node 0 dies, the others reconnect until its restarted daemon hosts a fresh store (whose
generations start again at 0). A node missing past the timeout (node 0 included) ends the
join in a NodeMissingError naming it; ``ClusterNode`` reports it and joins again.

At every formation the nodes compare their stores' fingerprints and refuse, in one line
naming both nodes, to go on over different stores. Nothing here runs on the server loop.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from loaderd.config import ClusterConfig

# c10d logs every failed connection attempt with a C++ stack trace (at ERROR); the daemon
# reports what matters itself. Only effective if torch is not imported yet.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

import torch  # after the log level above
import torch.distributed as dist

logger = logging.getLogger(__name__)

_PREFIX = "loaderd/"
_GEN = _PREFIX + "gen"
_POLL_S = 0.05
# One attempt to reach the store; attempts repeat until the deadline. Short, so that a stopping
# daemon's thread is back in Python (and joinable) soon: one left inside the C++ connect when
# the process exits aborts it.
_CONNECT_S = 1.0
_STORE_OP_S = 5.0  # the store's own operations, once connected
_FORM_S = 30.0  # building the gloo mesh once every node has registered


class ClusterError(RuntimeError):
    """The cluster cannot go on; the message is one line naming the node(s) at fault."""


class StoreMismatchError(ClusterError):
    """Two nodes opened different stores."""


class NodeMissingError(ClusterError):
    """A node did not (re)join within the timeout."""


class Stopped(Exception):  # the daemon is shutting down: not a failure
    """Raised out of a wait when the node's stop event is set."""


class GroupBroken(RuntimeError):
    """A collective failed (a peer died or timed out): the generation is over."""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What a node registers in each generation."""

    rank: int
    host: str
    pid: int
    fingerprint: str  # hex
    incarnation: str  # unique per daemon start

    @property
    def label(self) -> str:
        """``node R (host H)``, how every message names a node."""
        return f"node {self.rank} ({self.host})"


def short_error(e: BaseException) -> str:
    """A c10d/gloo error in one line: no source location, advice or C++ stack."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]  # [/path/to/pair.cc:553] ...
    return text.split(". This is typically", 1)[0]


def _key(gen: int, rank: int) -> str:
    return f"{_PREFIX}g{gen}/node{rank}"


def _failed_key(gen: int) -> str:
    return f"{_PREFIX}g{gen}/failed"


def _left_key(rank: int) -> str:
    return f"{_PREFIX}left/node{rank}"


def local_address(config: ClusterConfig) -> str:
    """This node's address on the route to node 0 (the address gloo listens on)."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((config.host, config.port))  # UDP: picks a route, sends nothing
        return str(s.getsockname()[0])


class Group:
    """One generation of the gloo group: collectives on numpy arrays, raising GroupBroken."""

    def __init__(self, generation: int, nodes: Sequence[NodeInfo], rank: int, pg: Any) -> None:
        self.generation = generation
        self.nodes = list(nodes)
        self.rank = rank
        self.size = len(nodes)
        self._pg = pg

    def allgather(self, array: np.ndarray) -> list[np.ndarray]:
        """Every node's ``array`` (all the same shape and dtype), in node order."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        outs = [torch.empty_like(tensor) for _ in range(self.size)]
        self._run(lambda pg: pg.allgather([outs], [tensor]))
        return [o.numpy() for o in outs]

    def broadcast(self, array: np.ndarray, root: int) -> None:
        """Overwrite ``array`` (contiguous, writable) with node ``root``'s, on every node."""
        self._run(lambda pg: pg.broadcast(torch.from_numpy(array), root))

    def _run(self, op: Any) -> None:
        if self._pg is None:
            raise GroupBroken(f"generation {self.generation} is closed")
        try:
            op(self._pg).wait()
        except RuntimeError as e:  # gloo: a peer closed its connection, or a timeout
            raise GroupBroken(short_error(e)) from e

    def close(self) -> None:
        """Drop the group (its connections close, so peers blocked on it fail); safe twice."""
        self._pg = None  # the last reference: gloo closes its sockets


class Rendezvous:
    """Forms the newest generation of the group with the other nodes.

    Args:
        config: the cluster's configuration.
        fingerprint: this node's store fingerprint.
        host: how messages name this node (default: the host name).
    """

    def __init__(self, config: ClusterConfig, fingerprint: bytes, host: str | None = None) -> None:
        self.config = config
        self.me = NodeInfo(
            config.node_rank,
            host or socket.gethostname(),
            os.getpid(),
            fingerprint.hex(),
            uuid.uuid4().hex,
        )
        self._store: Any = None
        self._joining: int | None = None  # the generation registered in and not yet formed
        self._known: dict[int, NodeInfo] = {}  # each node as last seen, for error messages
        self._last_error = ""

    # --- the store ----------------------------------------------------------------------------

    def _connect(self, deadline: float, stop: threading.Event) -> Any:
        """The store: hosted here on node 0, else a client connection (retried)."""
        while self._store is None:
            if stop.is_set():
                raise Stopped
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._store_gone()
            try:
                self._store = dist.TCPStore(  # type: ignore[attr-defined]
                    self.config.host,
                    self.config.port,
                    None,
                    self.config.node_rank == 0,
                    datetime.timedelta(seconds=min(_CONNECT_S, max(left, 0.1))),
                    wait_for_workers=False,
                )
                self._store.set_timeout(datetime.timedelta(seconds=_STORE_OP_S))
            except (RuntimeError, OSError) as e:
                self._last_error = short_error(e)
                logger.debug("cluster: store at %s: %s", self.config.address, self._last_error)
                stop.wait(_POLL_S * 4)
        return self._store

    def _store_gone(self) -> ClusterError:
        if self.config.node_rank == 0:
            return ClusterError(
                f"cannot host the rendezvous store on port {self.config.port}: {self._last_error}"
            )
        node0 = self._known.get(0)
        who = node0.label if node0 else f"node 0 ({self.config.host})"
        return NodeMissingError(
            f"{who}, which hosts the rendezvous store at {self.config.address}, was not reachable "
            f"within {self.config.timeout_s:g} s ({self._last_error})"
        )

    def drop_store(self) -> None:
        """Forget a failed connection to node 0's store; the next join reconnects.

        Node 0 keeps its store: dropping it would stop serving it.
        """
        if self.config.node_rank != 0:
            self._store = None

    # --- joining ------------------------------------------------------------------------------

    def join(self, stop: threading.Event) -> Group:
        """Form the newest generation with every node; blocks until then.

        Raises:
            StoreMismatchError: the nodes' stores differ.
            NodeMissingError: a node did not register within ``config.timeout_s``.
            ClusterError: node 0 cannot host the store.
            Stopped: ``stop`` was set.
        """
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            store = self._connect(deadline, stop)
            try:
                group = self._try(store, deadline, stop)
            except dist.DistNetworkError as e:  # the store's host died under us
                self._last_error = short_error(e)
                logger.warning(
                    "cluster: lost the rendezvous store (%s); reconnecting", self._last_error
                )
                self.drop_store()
                self._joining = None
                continue
            if group is not None:
                return group

    def _try(self, store: Any, deadline: float, stop: threading.Event) -> Group | None:
        gen = int(store.compare_set(_GEN, "", "0"))
        mine = _key(gen, self.me.rank)
        if self._joining != gen:
            if store.check([mine]):  # an earlier life of this node, or a group that broke
                store.compare_set(_GEN, str(gen), str(gen + 1))
                return None
            store.set(mine, json.dumps(asdict(self.me)))
            with contextlib.suppress(RuntimeError):
                store.delete_key(_left_key(self.me.rank))
            self._joining = gen
            logger.info(
                "cluster: %s waiting for %d nodes (generation %d)",
                self.me.label,
                self.config.nodes,
                gen,
            )
        keys = [_key(gen, r) for r in range(self.config.nodes)]
        while not store.check(keys):
            if int(store.get(_GEN)) != gen:
                return None  # someone moved on: follow
            if store.check([_failed_key(gen)]):
                raise self._fail(store, gen, None)
            if time.monotonic() > deadline:
                raise self._fail(store, gen, self._missing(store, gen))
            if stop.wait(_POLL_S):
                raise Stopped
        nodes = [NodeInfo(**json.loads(v)) for v in store.multi_get(keys)]
        self._known.update({n.rank: n for n in nodes})
        mismatch = self._check_stores(nodes)
        if mismatch is not None:
            raise self._fail(store, gen, mismatch)
        self._joining = None  # from here on, a failure means this generation is over
        pg = self._gloo(store, gen)
        if pg is None:
            return None
        logger.info(
            "cluster: generation %d formed: %s",
            gen,
            ", ".join(f"{n.label} pid {n.pid}" for n in nodes),
        )
        return Group(gen, nodes, self.me.rank, pg)

    def _gloo(self, store: Any, gen: int) -> Any:
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = datetime.timedelta(seconds=min(_FORM_S, self.config.timeout_s))
        if not os.environ.get("GLOO_SOCKET_IFNAME"):  # else gloo picks that interface itself
            opts._devices = [
                dist.ProcessGroupGloo.create_device(hostname=local_address(self.config))
            ]
        try:
            pg = dist.ProcessGroupGloo(
                dist.PrefixStore(f"{_PREFIX}g{gen}/pg/", store),  # type: ignore[attr-defined]
                self.me.rank,
                self.config.nodes,
                opts,
            )
        except RuntimeError as e:  # a registered node died before connecting
            logger.warning("cluster: generation %d did not connect (%s)", gen, short_error(e))
            return None
        pg.set_timeout(datetime.timedelta(seconds=self.config.timeout_s))
        return pg

    @staticmethod
    def _check_stores(nodes: Sequence[NodeInfo]) -> StoreMismatchError | None:
        first = nodes[0]
        for n in nodes[1:]:
            if n.fingerprint != first.fingerprint:
                return StoreMismatchError(
                    f"{n.label} serves store {n.fingerprint[:16]} but {first.label} serves "
                    f"{first.fingerprint[:16]}: every node must open the same store"
                )
        return None

    def _fail(self, store: Any, gen: int, error: ClusterError | None) -> ClusterError:
        """The generation's failure, the same on every node: the first one published wins.

        Node 0 hosts the store, so it waits (briefly) until every registered node has read
        the failure before it goes down: otherwise the others would only see the store vanish.
        """
        mine = json.dumps([type(error).__name__, str(error)]) if error is not None else ""
        kind, message = json.loads(store.compare_set(_failed_key(gen), "", mine) or mine)
        seen = store.add(f"{_PREFIX}g{gen}/failed_seen", 1)
        if self.me.rank == 0:
            registered = sum(store.check([_key(gen, r)]) for r in range(self.config.nodes))
            until = time.monotonic() + 2.0
            while seen < registered and time.monotonic() < until:
                time.sleep(_POLL_S)
                seen = store.add(f"{_PREFIX}g{gen}/failed_seen", 0)
        cls = {"StoreMismatchError": StoreMismatchError, "NodeMissingError": NodeMissingError}
        return cls.get(kind, ClusterError)(message)

    def _missing(self, store: Any, gen: int) -> NodeMissingError:
        parts = []
        for rank in range(self.config.nodes):
            if store.check([_key(gen, rank)]):
                continue
            known = self._known.get(rank) or self._registered_before(store, gen, rank)
            if known is None:
                parts.append(f"node {rank} never joined")
                continue
            left = store.check([_left_key(rank)])
            parts.append(f"{known.label} {'was stopped and ' if left else ''}did not rejoin")
        return NodeMissingError(
            f"{'; '.join(parts)} within {self.config.timeout_s:g} s "
            f"(generation {gen} at {self.config.address}, seen from {self.me.label})"
        )

    @staticmethod
    def _registered_before(store: Any, gen: int, rank: int) -> NodeInfo | None:
        for g in range(gen - 1, max(gen - 16, -1), -1):
            if store.check([_key(g, rank)]):
                return NodeInfo(**json.loads(store.get(_key(g, rank))))
        return None

    def retry(self) -> None:
        """After a NodeMissingError: the next join starts a fresh generation, its own deadline.

        The timed-out generation is marked failed in the store; registering again in it
        (this node's key is there) moves every node on to the next.
        """
        self._joining = None
        self.drop_store()

    def leave(self) -> None:
        """Say in the store that this node stops on purpose (for the others' messages)."""
        if self._store is not None:
            with contextlib.suppress(RuntimeError):
                self._store.set(_left_key(self.me.rank), json.dumps(asdict(self.me)))

    def close(self) -> None:
        """Drop the store (node 0: stop hosting it); safe to call twice."""
        self._store = None
