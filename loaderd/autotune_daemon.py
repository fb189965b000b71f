"""``serve --autotune``: the knob controller (``loaderd.autotune``) bound to the running daemon.

The controller core knows knobs only by name; this module knows which of the daemon's settings
can change while it serves and what one round of serving looked like. Each round (some
seconds) it measures the trainers' stall and the daemon's memory, calls the tuner, and applies
the knob it moved:

- ``readahead_bytes``: the read-ahead window's bound (``ReadAhead.set_budget``);
- ``prefetch_depth``: batches assembled ahead per rank and pass (read by the server loop);
- ``workers``: assemblies at once (``Prefetcher.set_workers``: a gate in front of a pool sized
  for the most workers allowed).

The DRAM tier's size is not a knob: its placement policy sizes its bookkeeping from the
capacity when the stack is built, so a resize would be a rebuild, not a cheap move.

Stall: a consumer (one DataLoader worker) is stalled while one of its GET_BATCH requests waits
in the server's waiting list for a batch not yet assembled. The server calls ``turn`` once per
loop turn; between turns the waiting list does not change, so summing "consumers with a
waiting request" x "time since the last turn" integrates the stall exactly as the daemon
sees it. The round's stall fraction is that sum over (consumers active in the round x round
length). It overstates the trainer's own stall when a consumer asks ahead (the client's
``prefetch``): a request may wait while the trainer still computes on an earlier batch; the
daemon cannot see the trainer's step, so this is the measure closest to it.

Memory: what the daemon holds on the trainers' behalf and the knobs move: the DRAM tier's
records, the read-ahead window (page cache asked for) and the batches assembled ahead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from loaderd.autotune import HOLD, Action, HillClimber, Knob, Observation, QLearningTuner, Tuner
from loaderd.config import AutotuneConfig, DaemonConfig

if TYPE_CHECKING:
    from loaderd.consumers import Consumers
    from loaderd.prefetch import Prefetcher
    from loaderd.readahead import ReadAhead
    from loaderd.storage.tiers import TierStack

logger = logging.getLogger(__name__)

Waiting = Mapping[Any, Sequence[tuple[bytes, int]]]  # batch key -> (identity, request id)
MAX_DEPTH = 32
MAX_WORKERS = 8


@dataclass(frozen=True, slots=True)
class Binding:
    """A knob and how the daemon applies it and reads back what it uses now."""

    knob: Knob
    apply: Callable[[int], None]
    read: Callable[[], int]


def max_workers(config: DaemonConfig) -> int | None:
    """The assembly pool's size under ``--autotune`` (None: exactly ``--workers``)."""
    if not config.autotune.enabled:
        return None
    return max(MAX_WORKERS, 2 * config.prefetch.workers)


def daemon_knobs(config: DaemonConfig) -> list[Knob]:
    """The knobs' grids around the configured values, which are where they start.

    Read-ahead moves by factors of 2 from a sixteenth to four times ``--readahead-bytes``
    (no knob when read-ahead is off: its thread does not exist), the depth by factors of 2 up
    to 32 (a configured depth of 0 starts at 1), the workers by one up to ``max_workers``.
    """
    p = config.prefetch
    knobs = []
    if p.readahead_bytes > 0:
        knobs.append(
            Knob(
                name="readahead_bytes",
                low=max(1, p.readahead_bytes // 16),
                high=4 * p.readahead_bytes,
                step=2,
                geometric=True,
                initial=p.readahead_bytes,
            )
        )
    knobs.append(
        Knob(
            name="prefetch_depth",
            low=1,
            high=max(MAX_DEPTH, 4 * p.depth),
            step=2,
            geometric=True,
            initial=max(1, p.depth),
        )
    )
    workers = max_workers(config) or p.workers
    knobs.append(Knob(name="workers", low=1, high=workers, step=1, initial=p.workers))
    return knobs


def make_tuner(config: AutotuneConfig, knobs: Sequence[Knob]) -> Tuner:
    """The controller ``config.mode`` names, with the seed's alpha, gamma and weighting."""
    if config.mode == "q":
        return QLearningTuner(knobs, memory_weight=config.memory_weight, seed=config.seed)
    if config.mode == "hill":
        return HillClimber(knobs, memory_weight=config.memory_weight)
    raise ValueError(f"no controller {config.mode!r}")


class StallMeter:
    """Consumer-seconds spent with a GET_BATCH waiting, integrated over the loop's turns."""

    def __init__(self, now: float | None = None) -> None:
        self._t = time.monotonic() if now is None else now
        self._stalled: set[bytes] = set()  # consumers with a request waiting since ``_t``
        self.waited: set[bytes] = set()  # consumers that waited in this round
        self.stalled_s = 0.0

    def turn(self, waiting: Waiting, now: float) -> None:
        """Account the time since the last turn, then note who waits now."""
        self.stalled_s += len(self._stalled) * (now - self._t)
        self._t = now
        self._stalled = {identity for waiters in waiting.values() for identity, _ in waiters}
        self.waited |= self._stalled

    def take(self) -> tuple[float, set[bytes]]:
        """This round's consumer-seconds of stall and who waited; starts the next round."""
        out = (self.stalled_s, self.waited)
        self.stalled_s, self.waited = 0.0, set(self._stalled)
        return out


class DaemonTuner:
    """One controller moving the daemon's knobs every ``interval_s`` of serving.

    Args:
        config: the controller, its round length, budget and memory weight.
        bindings: the knobs and how to apply them (applied at their start values here).
        memory: the daemon's memory that counts against the budget, in bytes.
        budget_bytes: the memory budget.
        active_since: identities of the consumers heard from since a ``time.monotonic()``.
    """

    def __init__(
        self,
        config: AutotuneConfig,
        bindings: Iterable[Binding],
        *,
        memory: Callable[[], int],
        budget_bytes: int,
        active_since: Callable[[float], set[bytes]],
    ) -> None:
        self.config = config
        self.bindings = {b.knob.name: b for b in bindings}
        self.tuner = make_tuner(config, [b.knob for b in self.bindings.values()])
        self.budget_bytes = budget_bytes
        self._memory = memory
        self._active_since = active_since
        self.meter = StallMeter()
        self._round_start = time.monotonic()
        self.idle_rounds = 0
        self.last: Observation | None = None
        self.last_action: Action = HOLD
        for name, b in self.bindings.items():
            b.apply(int(self.tuner.settings[name]))

    def turn(self, waiting: Waiting) -> None:
        """Called by the server once per loop turn, after its requests and completions."""
        now = time.monotonic()
        self.meter.turn(waiting, now)
        if now - self._round_start >= self.config.interval_s:
            self._end_round(now)

    def _end_round(self, now: float) -> None:
        length, start = now - self._round_start, self._round_start
        self._round_start = now
        stalled_s, waited = self.meter.take()
        active = self._active_since(start) | waited
        if not active:  # nobody trained: nothing to learn from, nothing to move
            self.idle_rounds += 1
            return
        obs = Observation(
            stall_fraction=min(1.0, stalled_s / (len(active) * length)),
            memory_bytes=float(self._memory()),
            memory_budget_bytes=float(self.budget_bytes),
        )
        action = self.tuner.step(obs)
        if action.knob is not None:
            value = int(self.tuner.settings[action.knob])
            self.bindings[action.knob].apply(value)
            logger.info(
                "autotune round %d: stall %.1f%%, memory %.0f%% of budget, cost %.4f -> %s = %d",
                self.tuner.rounds,
                100 * obs.stall_fraction,
                100 * obs.memory_fraction,
                self.tuner.last_cost or 0.0,
                action.knob,
                value,
            )
        self.last, self.last_action = obs, action

    def stats(self) -> dict[str, Any]:
        """The ``autotune`` section of STATS: knobs (value, bounds, what the daemon uses)..."""
        last = self.last
        return {
            "mode": self.config.mode,
            "interval_s": self.config.interval_s,
            "rounds": self.tuner.rounds,
            "idle_rounds": self.idle_rounds,
            "memory_weight": self.tuner.memory_weight,
            "budget_bytes": self.budget_bytes,
            "last_cost": self.tuner.last_cost,
            "last_stall": None if last is None else last.stall_fraction,
            "last_memory_bytes": None if last is None else last.memory_bytes,
            "last_action": str(self.last_action),
            "knobs": {
                name: {
                    "value": int(self.tuner.settings[name]),
                    "low": int(b.knob.low),
                    "high": int(b.knob.high),
                    "applied": b.read(),
                }
                for name, b in self.bindings.items()
            },
        }


class Tunable(Protocol):
    """What the controller reads and moves in a serving daemon (the server is one)."""

    config: DaemonConfig
    prefetch_depth: int
    readahead: ReadAhead
    prefetcher: Prefetcher
    tiers: TierStack
    consumers: Consumers


def build(server: Tunable) -> DaemonTuner:
    """The controller bound to ``server``'s read-ahead, prefetch depth and assembly workers."""
    config = server.config
    by_name = {k.name: k for k in daemon_knobs(config)}

    def set_depth(n: int) -> None:
        server.prefetch_depth = n

    appliers: dict[str, tuple[Callable[[int], None], Callable[[], int]]] = {
        "readahead_bytes": (
            server.readahead.set_budget,
            lambda: server.readahead.budget_bytes,
        ),
        "prefetch_depth": (set_depth, lambda: server.prefetch_depth),
        "workers": (server.prefetcher.set_workers, lambda: server.prefetcher.workers),
    }
    bindings = [Binding(knob, *appliers[name]) for name, knob in by_name.items()]
    budget = config.autotune.memory_budget_bytes or (  # DRAM as the memory split left it
        server.tiers.dram.capacity_bytes + config.prefetch.readahead_bytes
    )

    def memory() -> int:
        return (
            server.tiers.dram.used_bytes
            + int(server.readahead.stats()["window_bytes"])
            + server.prefetcher.assembled_bytes()
        )

    return DaemonTuner(
        config.autotune,
        bindings,
        memory=memory,
        budget_bytes=budget or (1 << 30),  # no cache and no read-ahead: a nominal GiB
        active_since=server.consumers.active_since,
    )
