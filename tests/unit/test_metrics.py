from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loaderd.metrics import StatsCollector, metrics_of


def test_stats_become_named_labelled_counters_and_gauges() -> None:
    stats = {
        "cache": {"hits": 3, "hit_rate": 0.5, "policy": "lru"},
        "tiers": [{"name": "dram", "hits": 2}, {"name": "nvram", "hits": 1}],
        "jobs": {"a": {"samples_served": 7, "cursors": [1, 2]}, "b": {"samples_served": 1}},
        "readahead": {"busy": True},
        "loop": {"busy_s": 2.5, "busy_share": None, "shares": {"requests": 0.5}},
        "uptime_s": 1.5,
    }
    got = {m.name: m for m in metrics_of(stats)}
    assert isinstance(got["loaderd_cache_hits"], CounterMetricFamily)  # exposed as ..._total
    assert isinstance(got["loaderd_cache_hit_rate"], GaugeMetricFamily)
    assert "loaderd_cache_policy" not in got, "text is not a metric"
    tier = {tuple(s.labels.items()): s.value for s in got["loaderd_tier_hits"].samples}
    assert tier == {(("tier", "dram"),): 2.0, (("tier", "nvram"),): 1.0}
    job = {s.labels["job"]: s.value for s in got["loaderd_job_samples_served"].samples}
    assert job == {"a": 7.0, "b": 1.0}
    assert got["loaderd_readahead_busy"].samples[0].value == 1.0
    assert got["loaderd_uptime_s"].samples[0].value == 1.5
    # The server loop's busy seconds only grow (a rate is its busy share); shares are gauges.
    assert isinstance(got["loaderd_loop_busy_s"], CounterMetricFamily)
    assert got["loaderd_loop_shares_requests"].samples[0].value == 0.5
    assert "loaderd_loop_busy_share" not in got, "no figure yet: no sample"


def test_a_daemon_that_does_not_answer_reads_as_down() -> None:
    def fetch() -> dict[str, object]:
        raise ConnectionError("gone")

    (up,) = list(StatsCollector(fetch).collect())
    assert up.name == "loaderd_up" and up.samples[0].value == 0.0
