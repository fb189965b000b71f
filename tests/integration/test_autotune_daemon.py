"""``serve --autotune`` on a real daemon: its knobs change what the daemon does, the controller
stays within its bounds and shows in the stats, it is off by default, bad flags are one line."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loaderd.client import LoaderdDataset
from loaderd.config import AutotuneConfig, CacheConfig, DaemonConfig, PrefetchConfig
from loaderd.server import Server
from loaderd.stats import format_table
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon, make_npz, wait_until
from tests.integration.test_errors import loaderd, one_line_error

pytestmark = pytest.mark.integration

Dataset = tuple[Path, dict[str, np.ndarray]]
WINDOW = 256 << 10  # the read-ahead's first bound: a batch of 8 records spans ~128 KiB


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of 12 KiB records: a read-ahead counts whole pages, so records of a few hundred
    bytes would put a batch's pages (and the whole store) under one small window."""
    from loaderd.storage.ingest import ingest

    root = tmp_path_factory.mktemp("wide")
    make_npz(root / "wide.npz", N_SAMPLES, shape=(3, 64, 64))
    ingest(root / "wide.npz", root / "wide.db", progress=False)
    return root / "wide.db"


@pytest.fixture
def server(wide: Path, tmp_path: Path) -> Iterator[Server]:
    """A daemon in this process (its loop on a thread), so the test can turn its knobs.

    The controller's rounds are an hour long: only the test moves the knobs here.
    """
    sock = Path(tempfile.mkdtemp(prefix="ld-at-", dir="/tmp")) / "d.sock"
    config = DaemonConfig(
        db=wide,
        socket=f"ipc://{sock}",
        state_dir=tmp_path / "state",
        prefetch=PrefetchConfig(depth=2, workers=1, readahead_bytes=WINDOW),
        autotune=AutotuneConfig(mode="hill", interval_s=3600),
        # The store fits DRAM: brought in whole at start, it would leave the read-ahead,
        # one of the knobs, nothing to read.
        cache=CacheConfig(load_map=False),
    )
    srv = Server(config)
    stop = threading.Event()
    loop = threading.Thread(target=srv.serve, args=(stop,), daemon=True)
    loop.start()
    try:
        yield srv
    finally:
        stop.set()
        loop.join(timeout=20)
        shutil.rmtree(sock.parent, ignore_errors=True)


def knob(srv: Server, name: str, value: int) -> None:
    """Move one knob as the controller does: through its binding."""
    assert srv.autotune is not None
    srv.autotune.bindings[name].apply(value)


def test_knobs_change_what_the_daemon_does(server: Server) -> None:
    ds = LoaderdDataset(server.config.socket, job="knobs", batch_size=8, prefetch=1)
    it = iter(ds)
    next(it)  # then the trainer pauses: the read-ahead window fills, assemblies stop
    ra = server.readahead
    wait_until(lambda: not ra.busy and ra.stats()["window_bytes"] > 0, what="a window")
    assert ra.stats()["window_bytes"] <= WINDOW
    wait_until(lambda: server.prefetcher.pending == 2, what="two batches assembled ahead")

    knob(server, "readahead_bytes", 4 * WINDOW)  # the window grows to the new bound, not past it
    wait_until(lambda: ra.stats()["window_bytes"] > 2 * WINDOW, what="a wider window")
    wait_until(lambda: not ra.busy, what="the window to fill")
    assert 2 * WINDOW < ra.stats()["window_bytes"] <= 4 * WINDOW

    knob(server, "prefetch_depth", 8)  # read at the next request
    next(it)
    wait_until(lambda: server.prefetcher.pending == 8, what="eight batches assembled ahead")

    # One assembly at a time, whatever the pool's size; then three.
    assert server.prefetcher.max_workers >= 3
    server.prefetcher.gate.reset_peak()
    for _ in range(12):
        next(it)
    assert server.prefetcher.gate.peak <= 1
    knob(server, "workers", 3)
    assert server.prefetcher.workers == 3
    for _ in range(12):
        next(it)
    assert server.prefetcher.gate.peak <= 3
    assert sum(1 for _ in it) == 60 - 26  # and every batch of the epoch still arrives once


def trainer(address: str, stop: threading.Event, job: str) -> threading.Thread:
    def run() -> None:
        ds = LoaderdDataset(address, job=job, batch_size=8, prefetch=2)
        while not stop.is_set():
            for _ in ds:
                if stop.is_set():
                    break

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("mode", ["hill", "q"])
def test_controller_moves_knobs_within_bounds(dataset: Dataset, tmp_path: Path, mode: str) -> None:
    extra = ["--autotune", mode, "--autotune-interval", "0.1", "--readahead-bytes", "4KiB"]
    extra += ["--prefetch", "2", "--workers", "1"]
    with Daemon(db=dataset[0], state_dir=tmp_path / "state", extra=extra) as d:
        stop = threading.Event()
        t = trainer(d.address, stop, "tuned")
        probe = LoaderdDataset(d.address, job="probe", batch_size=8)
        seen: list[dict[str, Any]] = []
        start = {"readahead_bytes": 4096, "prefetch_depth": 2, "workers": 1}

        def moved() -> bool:
            s = probe.stats()
            tune = s["autotune"]
            for name, k in tune["knobs"].items():
                assert k["low"] <= k["value"] <= k["high"], (name, k)
                seen.append({name: k["value"]})
            # What the daemon's own read-ahead reports is the knob's value.
            assert s["readahead"]["budget_bytes"] == tune["knobs"]["readahead_bytes"]["value"]
            return tune["rounds"] >= 5 and any(
                v != start[n] for entry in seen for n, v in entry.items()
            )

        try:
            wait_until(moved, timeout_s=60, what="the controller to move a knob")
        finally:
            stop.set()
            t.join(timeout=30)
        tune = probe.stats()["autotune"]
        assert tune["mode"] == mode and tune["last_cost"] is not None
        knobs = tune["knobs"]
        assert knobs["readahead_bytes"]["low"] == 256 and knobs["readahead_bytes"]["high"] == 16384
        assert knobs["workers"]["high"] >= 2 and knobs["prefetch_depth"]["high"] == 32
        for k in knobs.values():
            assert k["applied"] == k["value"]
        assert f"autotune ({mode})" in format_table(probe.stats())


def test_off_by_default(daemon: Daemon) -> None:
    stats = LoaderdDataset(daemon.address, job="plain", batch_size=8).stats()
    assert "autotune" not in stats
    assert stats["readahead"]["budget_bytes"] == PrefetchConfig().readahead_bytes
    assert "autotune" not in format_table(stats)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--autotune", "sgd"], "--autotune"),
        (["--autotune", "q", "--autotune-interval", "soon"], "--autotune-interval"),
        (["--autotune", "--autotune-interval", "0"], "--autotune-interval"),
        (["--autotune", "hill", "--autotune-budget", "lots"], "--autotune-budget"),
        (["--autotune-interval", "2"], "need `--autotune`"),
    ],
)
def test_bad_flags_are_one_line(
    dataset: Dataset, tmp_path: Path, flags: list[str], needle: str
) -> None:
    sock = f"ipc://{tmp_path}/s.sock"
    one_line_error(loaderd("serve", "--db", str(dataset[0]), "--socket", sock, *flags), needle)
