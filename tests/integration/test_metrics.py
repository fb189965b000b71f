"""``loaderd serve --metrics-port``: Prometheus scrapes the numbers of ``loaderd stats``."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loaderd.client import LoaderdDataset
from tests.conftest import N_SAMPLES
from tests.helpers import Daemon, wait_until

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def reachable(port: int) -> bool:
    try:
        scrape(port)
    except (urllib.error.URLError, ConnectionError):
        return False
    return True


def test_metrics_endpoint_scraped_during_a_run(
    dataset: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    port = free_port()
    extra = ["--metrics-port", str(port)]
    with Daemon(db=dataset[0], state_dir=tmp_path / "state", extra=extra) as d:
        wait_until(lambda: reachable(port), what="the metrics endpoint")
        before = scrape(port)
        assert before[("loaderd_up", ())] == 1.0
        assert before[("loaderd_dataset_samples", ())] == N_SAMPLES
        ds = LoaderdDataset(d.address, job="scraped", batch_size=50)
        served = 0
        for batch in ds:
            served += len(batch["id"])
            if served == 100:  # mid-epoch: the counters move while the job runs
                mid = scrape(port)
                job = (("job", "scraped"),)
                assert mid[("loaderd_job_samples_served_total", job)] >= 100
        after = scrape(port)
        job = (("job", "scraped"),)
        assert after[("loaderd_job_samples_served_total", job)] == N_SAMPLES
        stats = ds.stats()
        # the same numbers as `loaderd stats`, per tier as well
        assert after[("loaderd_cache_misses_total", ())] == stats["cache"]["misses"]
        tiers = [k for k in after if k[0] == "loaderd_tier_hits_total"]
        assert tiers, "one hits counter per tier"
