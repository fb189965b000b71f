"""The daemon side of ``--autotune``: the gate the workers knob moves, the stall meter, the
knobs' grids, and a round from measurement to the knob applied."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from loaderd.autotune_daemon import Binding, DaemonTuner, StallMeter, daemon_knobs, max_workers
from loaderd.config import AutotuneConfig, DaemonConfig, PrefetchConfig
from loaderd.gate import Gate
from tests.helpers import wait_until


def test_gate_admits_up_to_its_limit_and_a_raise_lets_waiters_in() -> None:
    gate = Gate(1)
    release = threading.Event()

    def hold() -> None:
        with gate:
            release.wait()

    threads = [threading.Thread(target=hold) for _ in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: gate.inside == 1, what="one holder")
    assert gate.peak == 1
    gate.set_limit(3)
    wait_until(lambda: gate.inside == 3, what="three holders")
    release.set()
    for t in threads:
        t.join(timeout=10)
    assert gate.inside == 0 and gate.reset_peak() == 3 and gate.peak == 0
    with pytest.raises(ValueError, match="limit"):
        gate.set_limit(0)


def test_stall_meter_integrates_consumers_with_a_waiting_request() -> None:
    m = StallMeter(now=0.0)
    a, b = b"a", b"b"
    m.turn({("j", 0, 0, "train", 1): [(a, 1), (a, 2)], ("j", 0, 0, "train", 2): [(b, 3)]}, 10.0)
    m.turn({("j", 0, 0, "train", 2): [(b, 3)]}, 12.0)  # a and b waited 2 s each
    m.turn({}, 13.0)  # b waited one more second
    stalled, waited = m.take()
    assert stalled == pytest.approx(5.0) and waited == {a, b}
    assert m.take() == (0.0, set())


def config(**prefetch: int) -> DaemonConfig:
    return DaemonConfig(
        db=Path("db"),
        socket="ipc:///tmp/x.sock",
        state_dir=Path("s"),
        prefetch=PrefetchConfig(**prefetch),
        autotune=AutotuneConfig(mode="q"),
    )


def test_knobs_start_at_the_configured_values() -> None:
    knobs = {k.name: k for k in daemon_knobs(config(depth=8, workers=2, readahead_bytes=1 << 20))}
    assert knobs["readahead_bytes"].start == 1 << 20
    assert knobs["readahead_bytes"].grid[0] == 1 << 16 and knobs["readahead_bytes"].high == 4 << 20
    assert knobs["prefetch_depth"].start == 8 and knobs["prefetch_depth"].grid[0] == 1
    assert knobs["workers"].start == 2 and knobs["workers"].high == max_workers(config()) == 8
    assert "readahead_bytes" not in {k.name for k in daemon_knobs(config(readahead_bytes=0))}


def test_a_round_measures_steps_the_tuner_and_applies_its_move() -> None:
    applied: dict[str, int] = {}
    knobs = daemon_knobs(config(depth=2, workers=1, readahead_bytes=4096))
    bindings = [
        Binding(k, lambda v, n=k.name: applied.__setitem__(n, v), lambda n=k.name: applied[n])
        for k in knobs
    ]
    active: set[bytes] = set()
    tuner = DaemonTuner(
        AutotuneConfig(mode="hill", interval_s=0.05),
        bindings,
        memory=lambda: 500,
        budget_bytes=1000,
        active_since=lambda t: active,
    )
    assert applied == {"readahead_bytes": 4096, "prefetch_depth": 2, "workers": 1}
    time.sleep(0.06)
    tuner.turn({})  # nobody active: an idle round, nothing learnt or moved
    assert tuner.idle_rounds == 1 and tuner.tuner.rounds == 0
    active.add(b"c")
    tuner.turn({("j", 0, 0, "train", 0): [(b"c", 1)]})
    time.sleep(0.06)
    tuner.turn({})  # c waited the whole round: stall 1
    assert tuner.tuner.rounds == 1 and tuner.last is not None
    assert tuner.last.stall_fraction == pytest.approx(1.0, abs=0.2)
    assert tuner.last.memory_fraction == 0.5
    assert applied["readahead_bytes"] == 8192  # the hill-climber's first trial, applied
    s = tuner.stats()
    assert s["knobs"]["readahead_bytes"] == {
        "value": 8192,
        "low": 256,
        "high": 16384,
        "applied": 8192,
    }
    assert s["last_action"] == "readahead_bytes+"
