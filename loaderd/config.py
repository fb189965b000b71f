"""The daemon's configuration: frozen, keyword-only, validated where it is built."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from loaderd.importance import ImportanceConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(i?))?B?\s*$", re.IGNORECASE)
_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``2GiB``, ``512MB``, ``64k`` or ``1048576``.

    ``KiB/MiB/GiB`` are powers of 1024; ``KB/MB/GB`` and bare ``K/M/G`` are too, because a
    cache is sized against memory, which is counted in powers of two.

    Raises:
        ValueError: the text is not a size.
    """
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (expected e.g. 512MiB, 2GiB, 1048576)")
    number, unit, _ = m.groups()
    return int(float(number) * (1024 ** _UNITS[(unit or "").upper()]))


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheConfig:
    """The cache tiers in front of the store (see ``storage/tiers.py``)."""

    dram_bytes: int = 2 << 30
    nvram_dir: Path | None = None  # where the arena file lives; None: no NVRAM tier
    nvram_bytes: int = 8 << 30  # the arena file's size, snapshot region included
    snapshot_bytes: int | None = None  # the snapshot region (two slots); None: a quarter
    policy: str = "importance"
    # Record bytes waiting for DRAM admission behind the serving path; 0: admit while serving.
    # What waits are views of the store's pages, not copies: the bound caps the backlog, not
    # memory (64 MiB dropped up to a quarter of a 100 KB warm-miss epoch on 2 loaded cores).
    admit_queue_bytes: int = 256 << 20
    # Hold large records admitted from the store as its pages locked in RAM (False: copies).
    lock_pages: bool = True
    # Where DRAM can hold the whole store: bring it into RAM at start, in file order.
    load_map: bool = True

    def __post_init__(self) -> None:
        from loaderd.storage.policies import POLICIES

        if self.dram_bytes < 0:
            raise ValueError(f"`dram_bytes` must be >= 0, got {self.dram_bytes}")
        if self.admit_queue_bytes < 0:
            raise ValueError(f"`dram_admit_queue` must be >= 0, got {self.admit_queue_bytes}")
        if self.policy not in POLICIES:
            raise ValueError(
                f"`cache_policy` must be one of {', '.join(POLICIES)}, got {self.policy!r}"
            )
        if self.nvram_bytes < 256 << 10:
            raise ValueError(f"`nvram_bytes` must be at least 256 KiB, got {self.nvram_bytes}")
        snap = self.snapshot_bytes
        if snap is not None and not (snap == 0 or 16384 <= snap <= self.nvram_bytes - (64 << 10)):
            raise ValueError(
                f"`snapshot_bytes` must be 0 or in [16 KiB, nvram_bytes - 64 KiB], got {snap}"
            )

    @property
    def snapshot_region_bytes(self) -> int:
        """Bytes of the arena reserved for the two snapshot slots."""
        if self.snapshot_bytes is not None:
            return self.snapshot_bytes
        return self.nvram_bytes // 4


def default_miss_procs() -> int:
    """Miss worker processes for this machine: one per core the process may use, 2 to 4.

    The server loop is one interpreter and keeps the books of every batch; the workers read
    and hash beside it. On 16 cores (``benchmarks/results/cores_node.md``), 4 workers ran a
    store four times DRAM 8-54 % faster than 2 in nine of ten comparisons of fresh daemons
    (level in the tenth), and 6 or 8 were no faster than 4, the loop being the bound; on 2
    cores (``cores.md``), the medians of three alternating pairs were 6-10 % higher with 4 at
    100 KB, level at 3 KB: there 2 are kept, leaving a trainer's own work its share of the
    two cores (and the test suite its pace).
    """
    return min(4, max(2, len(os.sched_getaffinity(0))))


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefetchConfig:
    """How far ahead of demand batches are assembled, and by how many threads."""

    depth: int = 8  # batches assembled ahead of the first unassigned one, per rank and pass
    workers: int = 2  # assembly threads (LMDB reads and checksums release the GIL)
    # Worker processes that assemble batches missing DRAM into shm slots (loaderd.miss_workers)
    miss_procs: int = field(default_factory=default_miss_procs)
    # Store bytes asked of the kernel ahead of the passes (loaderd.readahead); 0: off.
    readahead_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.readahead_bytes < 0:
            raise ValueError(f"`readahead_bytes` must be >= 0, got {self.readahead_bytes}")
        if self.depth < 0:
            raise ValueError(f"`depth` must be >= 0, got {self.depth}")
        if self.workers < 1:
            raise ValueError(f"`workers` must be >= 1, got {self.workers}")
        if self.miss_procs < 0:
            raise ValueError(f"`miss_procs` must be >= 0, got {self.miss_procs}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ShmConfig:
    """Same-host delivery through a shared-memory ring (``loaderd.shm_delivery``)."""

    enabled: bool = True
    slots: int | None = None  # None: ``auto_slots``, within a share of /dev/shm
    slot_bytes: int | None = None  # None: sized per job (one ring per slot size needed)
    auto_slots: int = 32
    # All rings together never take more of /dev/shm than this (nor a quarter of what is free
    # there): a job whose ring would not fit goes over the socket, with the reason in stats.
    max_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"`shm_bytes` must be positive, got {self.max_bytes}")
        if self.slots is not None and not 1 <= self.slots <= 65536:
            raise ValueError(f"`shm_slots` must be in 1..65536, got {self.slots}")
        if self.slot_bytes is not None and self.slot_bytes <= 0:
            raise ValueError(f"`shm_slot_bytes` must be positive, got {self.slot_bytes}")


AUTOTUNE_MODES = ("q", "hill")
KEEP_SELECTIONS = 4  # epochs of selections a job keeps by default: each is ids and weights
MAX_KEEP_SELECTIONS = 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class AutotuneConfig:
    """``serve --autotune``: a controller that moves the daemon's knobs while it serves.

    Off (``mode`` None) unless asked for: on the changing-load benchmark neither controller
    beat the fixed defaults beyond the run-to-run spread
    (``benchmarks/results/autotune_daemon.md``).
    """

    mode: str | None = None  # None: off; "q": Q-learning (seed 001); "hill": hill-climbing
    interval_s: float = 5.0  # one round: observe, learn, move one knob
    memory_budget_bytes: int | None = None  # None: the DRAM cache plus the read-ahead budget
    memory_weight: float = 0.3  # w in the seed's cost: 0 minds only stalls, 1 only memory
    seed: int = 0  # of the Q-learner's exploration

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in AUTOTUNE_MODES:
            raise ValueError(
                f"`--autotune` must be one of {', '.join(AUTOTUNE_MODES)}, got {self.mode!r}"
            )
        if not (0.05 <= self.interval_s <= 3600):
            raise ValueError(
                f"`--autotune-interval` must be in [0.05, 3600] seconds, got {self.interval_s}"
            )
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise ValueError(
                f"`--autotune-budget` must be positive, got {self.memory_budget_bytes}"
            )
        if not 0.0 <= self.memory_weight <= 1.0:
            raise ValueError(
                f"`--autotune-memory-weight` must be in [0, 1], got {self.memory_weight}"
            )

    @property
    def enabled(self) -> bool:
        """Whether a controller runs."""
        return self.mode is not None


_TCP_ADDRESS = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
MAX_NODES = 4096


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterConfig:
    """One daemon per node: how this node's daemon finds the others (``loaderd.cluster``).

    Without an ``address`` the daemon is a cluster of one. With one, the daemons of ``nodes``
    nodes form a ``torch.distributed`` gloo group whose rendezvous store node 0 hosts at
    ``address``.
    """

    address: str | None = None  # tcp://HOST:PORT of node 0's rendezvous store
    nodes: int = 1
    node_rank: int = 0
    # How long the others wait for a node that is gone (to rejoin, or to answer a collective)
    # before they report the cluster stalled with an error naming it (and keep trying).
    timeout_s: float = 300.0
    # Cadence of the exchange rounds: feedback waits at most this long for the next round.
    round_interval_s: float = 0.25

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"`nodes` must be in [1, {MAX_NODES}], got {self.nodes}")
        if isinstance(self.node_rank, bool) or not 0 <= self.node_rank < self.nodes:
            raise ValueError(
                f"`node_rank` must be in [0, {self.nodes - 1}] for {self.nodes} nodes, "
                f"got {self.node_rank}"
            )
        if self.address is None:
            if self.nodes > 1:
                raise ValueError(
                    f"{self.nodes} nodes need a rendezvous `cluster` address (tcp://HOST:PORT)"
                )
        else:
            m = _TCP_ADDRESS.match(self.address)
            if m is None or not 1 <= int(m.group(2)) <= 65535:
                raise ValueError(
                    f"`cluster` must be tcp://HOST:PORT (node 0's address), got {self.address!r}"
                )
        if not self.timeout_s > 0:
            raise ValueError(f"`cluster_timeout` must be positive, got {self.timeout_s}")
        if not 0 < self.round_interval_s < self.timeout_s:
            raise ValueError(
                f"`round_interval_s` must be in (0, {self.timeout_s}), got {self.round_interval_s}"
            )

    @property
    def enabled(self) -> bool:
        """Whether this daemon is part of a cluster (``address`` is set)."""
        return self.address is not None

    @property
    def host(self) -> str:
        """Node 0's host name or address (IPv6 without brackets)."""
        assert self.address is not None, "not a cluster"
        host = self.address[len("tcp://") :].rsplit(":", 1)[0]
        return host[1:-1] if host.startswith("[") else host

    @property
    def port(self) -> int:
        """The rendezvous store's TCP port."""
        assert self.address is not None, "not a cluster"
        return int(self.address.rsplit(":", 1)[1])


@dataclass(frozen=True, kw_only=True, slots=True)
class LimitsConfig:
    """What one client may make the daemon hold (checked by loaderd.limits)."""

    # Each job is a state directory reloaded at every start, and its engine's arrays.
    max_jobs: int = 64
    # The engine keeps a loss column per classification epoch for every sample.
    max_warmup_epochs: int = 64
    # ZMQ_MAXMSGSIZE bounds one frame; these bound a whole request (a snapshot is one frame).
    max_request_frames: int = 8
    max_request_bytes: int = (1 << 30) + (1 << 20)
    # One FEEDBACK's samples: recording them costs a few times their bytes.
    max_feedback_samples: int = 1 << 22
    # Batches one connection was handed and has not acknowledged (asked for, being assembled,
    # or sent and unread): a client that stops reading keeps at most this many in the
    # daemon's queues. The client library keeps `prefetch` (default 4) per connection.
    max_outstanding_batches: int = 256
    # OPEN_PASS requests waiting for a pass to be decided (a re-score barrier, the cluster):
    # one per worker in the client library.
    max_parked_opens_per_client: int = 16
    max_parked_opens: int = 4096
    # Requests of one connection read from the socket and not yet handled (loaderd.fair_share):
    # the server loop takes a few of each connection per turn; past this backlog a request is
    # refused. The client library keeps a few in flight per connection.
    max_backlog_per_client: int = 512

    def __post_init__(self) -> None:
        for name in (
            "max_jobs",
            "max_warmup_epochs",
            "max_request_frames",
            "max_request_bytes",
            "max_feedback_samples",
            "max_outstanding_batches",
            "max_parked_opens_per_client",
            "max_parked_opens",
            "max_backlog_per_client",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DaemonConfig:
    """Everything ``loaderd serve`` needs; each part goes to the object that uses it."""

    db: Path
    socket: str
    state_dir: Path
    cache: CacheConfig = field(default_factory=CacheConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    importance: ImportanceConfig = field(default_factory=ImportanceConfig)  # jobs' defaults
    shm: ShmConfig = field(default_factory=ShmConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    autotune: AutotuneConfig = field(default_factory=AutotuneConfig)
    max_batch_size: int = 65536
    # A consumer silent this long is gone and its batches go back to its rank (a local
    # consumer whose process exited is noticed at once, see loaderd.consumers).
    consumer_timeout_s: float = 600.0
    # A second, authenticated endpoint for other hosts: tcp:// with CURVE keys (loaderd.auth).
    tcp: str | None = None
    curve_dir: Path | None = None
    # Jobs idle longer than this are removed when the daemon starts (loaderd.job_admin); 0 keeps
    # every job.
    job_retention_s: float = 30 * 86400.0
    # Each job keeps the selections of its newest K epochs on disk (one small file each), so a
    # trainer restored from a checkpoint up to K epochs old replays exactly that epoch.
    keep_selections: int = KEEP_SELECTIONS

    def __post_init__(self) -> None:
        if not self.socket.startswith(("ipc://", "tcp://", "inproc://")):
            raise ValueError(
                f"`socket` must be an ipc://, tcp:// or inproc:// address, got {self.socket!r}"
            )
        if self.socket.startswith("ipc://") and len(self.socket) - 6 > 100:
            # sockaddr_un holds 107 bytes; longer ipc paths fail late and obscurely in libzmq.
            raise ValueError(f"`socket` path is longer than 100 characters: {self.socket}")
        if not 1 <= self.keep_selections <= MAX_KEEP_SELECTIONS:
            raise ValueError(
                f"`keep_selections` must be in 1..{MAX_KEEP_SELECTIONS}, got {self.keep_selections}"
            )
        if not self.job_retention_s >= 0:  # also refuses NaN
            raise ValueError(f"`job_retention_s` must be >= 0, got {self.job_retention_s}")
