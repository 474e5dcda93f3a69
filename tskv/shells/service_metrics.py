"""Prometheus metrics for `tskv serve`, read from the figures the library already keeps.

Counters the service itself makes (requests, queries and their duration) are prometheus_client
metrics; what the watchers know (each worker's batches, losses, staleness) is read from
`Watcher.status` when Prometheus scrapes, so nothing is counted twice. Names follow Prometheus'
conventions: a `tskv_` prefix, `_total` counters, `_seconds` histograms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tskv.core.indexer_api import ModelIndex
from tskv.shells.watcher import Watcher

Watched = Callable[[], list[tuple[ModelIndex, Watcher]]]  # each index, and its watcher
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


class ServiceMetrics:
    """The service's registry: its own counters, and a collector over the watchers."""

    def __init__(self, watched: Watched) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "tskv_http_requests_total",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self._query_seconds = Histogram(
            "tskv_query_duration_seconds",
            "Time to answer a /query from the index (the match alone)",
            buckets=(1e-6, 5e-6, 2e-5, 1e-4, 5e-4, 2e-3, 1e-2, 0.1),
            registry=self.registry,
        )
        self.registry.register(_Workers(watched))

    def served(self, route: str, status: int) -> None:
        known = route if route in _ROUTES else "other"  # a label per unknown path would grow
        self._requests.labels(known, str(status)).inc()

    def queried(self, seconds: float) -> None:
        self._query_seconds.observe(seconds)

    def exposition(self) -> tuple[bytes, bytes]:
        return generate_latest(self.registry), CONTENT_TYPE


_ROUTES = frozenset(
    {
        "/register",
        "/unregister",
        "/query",
        "/select",
        "/workers",
        "/health",
        "/metrics",
        "/openapi.json",
    }
)


class _Workers(Collector):
    """Each registered worker's figures, as its watcher has them at scrape time."""

    def __init__(self, watched: Watched) -> None:
        self._watched = watched

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "routing_group", "worker"]
        batches = CounterMetricFamily(
            "tskv_worker_batches", "Batches applied to the index, per worker", labels=labels
        )
        losses = CounterMetricFamily(
            "tskv_worker_losses", "Losses reported (restarts included), per worker", labels=labels
        )
        stale = GaugeMetricFamily(
            "tskv_worker_stale",
            "1 while the index cannot vouch for the worker's view",
            labels=labels,
        )
        silent = GaugeMetricFamily(
            "tskv_worker_silent", "1 while the worker's publisher does not answer", labels=labels
        )
        for model, watcher in self._watched():
            for worker in model.workers:
                status = watcher.status(worker)
                names = [*model.key, f"{worker[0]}:{worker[1]}"]
                batches.add_metric(names, status.batches)
                losses.add_metric(names, status.losses)
                stale.add_metric(names, float(status.stale))
                silent.add_metric(names, float(status.silent))
        yield from (batches, losses, stale, silent)
