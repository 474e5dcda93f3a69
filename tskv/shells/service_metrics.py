"""Prometheus metrics for `tskv serve`: the service's own counters, and the library's
collectors (`tskv.shells.metrics`) over its watchers."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tskv.core.indexer_api import ModelIndex
from tskv.shells.metrics import LossCounter, WatcherCollector
from tskv.shells.watcher import Watcher

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
Watched = Callable[[], list[tuple[ModelIndex, Watcher]]]  # each index, and its watcher
ROUTES = frozenset(
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


class ServiceMetrics:
    """The service's registry: requests and queries counted here, each worker's figures read
    from its watcher, losses by reason counted from the watchers' `on_loss`."""

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
        self.losses = LossCounter(self.registry)

        def labelled() -> Iterable[tuple[Mapping[str, str], Watcher]]:
            for model, watcher in watched():
                yield {"model": model.key[0], "routing_group": model.key[1]}, watcher

        self.registry.register(WatcherCollector(labelled))

    def served(self, route: str, status: int) -> None:
        """A request answered; `route` is one of the app's, or "other"."""
        self._requests.labels(route, str(status)).inc()

    def queried(self, seconds: float) -> None:
        self._query_seconds.observe(seconds)

    def exposition(self) -> tuple[bytes, bytes]:
        return generate_latest(self.registry), CONTENT_TYPE
