"""Prometheus metrics (``loaderd serve --metrics-port P``): the numbers of ``loaderd stats``.

Why the exporter asks the daemon's own socket for STATS on each scrape, like ``loaderd
stats`` does, instead of reading the server's objects: the server loop stays the only thread
that touches its state (no locks added to it), and the metrics can never disagree with
``loaderd stats``, because they are the same reply. Every numeric leaf of the reply becomes
one metric, named by its path (``loaderd_cache_hits_total``); the entries of ``tiers`` and
``jobs`` become the label ``tier`` / ``job`` of one metric each
(``loaderd_job_samples_served_total{job="run-1"}``). Monotonic numbers are counters, the
rest gauges.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

logger = logging.getLogger(__name__)

# Leaves that only grow while the daemon runs: exported as counters (``_total``).
COUNTERS = frozenset(
    {
        "hits",
        "misses",
        "evictions",
        "promotions",
        "demotions",
        "corrupt_dropped",
        "reads",
        "bytes_read",
        "batches_served",
        "samples_served",
        "feedback_samples",
        "advised_bytes",
        "advised_records",
        "delivered",
        "fallbacks",
        "turns",  # the server loop's (``loop_clock``)
        "busy_s",
        "waited_s",
        "cpu_s",
    }
)
# Sections whose keys are names (a tier, a job), which become a label.
LABELLED = {"tiers": "tier", "jobs": "job"}
_BAD = re.compile(r"[^a-zA-Z0-9_]")


def metrics_of(stats: Mapping[str, Any]) -> list[Metric]:
    """The STATS reply as Prometheus metric families."""
    families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}

    def add(path: list[str], value: float, labels: dict[str, str]) -> None:
        name = _BAD.sub("_", "_".join(["loaderd", *path]))
        family = families.get(name)
        if family is None:
            doc = "loaderd stats: " + ".".join(path)
            family = (
                CounterMetricFamily(name, doc, labels=list(labels))
                if path[-1] in COUNTERS
                else GaugeMetricFamily(name, doc, labels=list(labels))
            )
            families[name] = family
        family.add_metric(list(labels.values()), value)

    def walk(node: Any, path: list[str], labels: dict[str, str]) -> None:
        if isinstance(node, int | float):  # bool included: 0 or 1
            add(path, float(node), labels)
        elif isinstance(node, Mapping):
            label = LABELLED.get(path[-1]) if len(path) == 1 and not labels else None
            for key, child in node.items():
                if label is not None and isinstance(child, Mapping):
                    walk(child, [label], {**labels, label: str(key)})
                else:
                    walk(child, [*path, str(key)], labels)
        elif isinstance(node, list) and path[-1] in LABELLED and not labels:
            label = LABELLED[path[-1]]  # a list of named entries (the tiers, in order)
            for child in node:
                if isinstance(child, Mapping) and "name" in child:
                    walk(child, [label], {label: str(child["name"])})
        # other lists (cursors, histograms) and strings are not metrics

    for key, value in stats.items():
        walk(value, [key], {})
    return list(families.values())


class StatsCollector(Collector):
    """A collector that asks ``fetch`` for a STATS reply on each scrape.

    Args:
        fetch: returns the daemon's statistics (raises when the daemon does not answer).
    """

    def __init__(self, fetch: Callable[[], Mapping[str, Any]]) -> None:
        self._fetch = fetch
        self._lock = threading.Lock()  # scrapes come on several threads; one socket

    def collect(self) -> Iterator[Metric]:
        """See ``prometheus_client.registry.Collector``."""
        with self._lock:
            try:
                stats = self._fetch()
            except Exception:  # a scrape must not kill the exporter; `up` tells the scraper
                logger.warning("metrics: the daemon did not answer STATS", exc_info=True)
                yield GaugeMetricFamily("loaderd_up", "the daemon answered STATS", value=0.0)
                return
        yield GaugeMetricFamily("loaderd_up", "the daemon answered STATS", value=1.0)
        yield from metrics_of(stats)


class MetricsServer:
    """An HTTP endpoint serving the daemon's metrics at ``http://host:port/metrics``.

    Args:
        address: the daemon's socket to ask for STATS.
        port: the TCP port to listen on (0: any free port, see ``port``).
        host: the address to bind.
        timeout_s: how long a scrape waits for the daemon.
    """

    def __init__(
        self, address: str, port: int, host: str = "127.0.0.1", timeout_s: float = 5.0
    ) -> None:
        from prometheus_client import start_http_server

        from loaderd.client.connection import Connection
        from loaderd.client.protocol import MsgType

        self._conn = Connection(address, timeout_s)

        def fetch() -> Mapping[str, Any]:
            return self._conn.request(MsgType.STATS, {}, expect=MsgType.STATS_REPLY).meta

        registry = CollectorRegistry()
        registry.register(StatsCollector(fetch))
        self._http, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port = int(self._http.server_address[1])
        self._closed = False
        logger.info("metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        """Stop serving (safe to call twice)."""
        if self._closed:
            return
        self._closed = True
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)
        self._conn.close()
