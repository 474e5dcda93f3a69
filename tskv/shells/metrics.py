"""Prometheus collectors over the figures tskv already keeps, for any Trio program that embeds a
publisher or a watcher (`tskv serve` uses the same ones). Needs prometheus_client (the `serve`
extra brings it).

Each collector reads `statistics()` or `Watcher.status` when Prometheus scrapes, so nothing is
counted twice and the hot paths pay nothing; `LossCounter` is the one figure the library hands
out as it happens (a loss's reason), counted from the watcher's `on_loss`. Names follow
Prometheus' conventions: a `tskv_` prefix, `_total` counters, labels `worker` and `reason`.

```python
registry = prometheus_client.CollectorRegistry()
losses = LossCounter(registry)
registry.register(PublisherCollector(publisher))
async with tskv.open_watcher(index, on_loss=losses.on_loss) as watcher:
    registry.register(WatcherCollector(lambda: [({}, watcher)]))
```
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tskv.core.applied import BOUNDS, AppliedFigures
from tskv.core.losses import Loss
from tskv.core.prefix_index import Worker
from tskv.shells.publisher import Publisher
from tskv.shells.watcher import Watcher

Labelled = Callable[[], Iterable[tuple[Mapping[str, str], Watcher]]]  # watchers, each labelled


def worker_label(worker: Worker) -> str:
    """How a worker is named in a label: `instance:rank` for tskv serve's, else its str."""
    if isinstance(worker, tuple):
        return ":".join(str(part) for part in worker)
    return str(worker)


class WatcherCollector(Collector):
    """Each watched worker's figures (batches applied, losses, failures, stale, silent, the
    last seq applied, blocks held by storage medium) and each watcher's (events applied by
    kind, the lag of its batches), its reader processes' included. `watchers` gives the
    watchers to read, each with labels of its own (tskv serve's: its index's model and
    routing group)."""

    def __init__(self, watchers: Labelled) -> None:
        self._watchers = watchers

    def collect(self) -> Iterator[Metric]:
        families: _Families | None = None
        for labels, watcher in self._watchers():
            if families is None:
                families = _Families(list(labels))
            families.add_applied(list(labels.values()), watcher.applied)
            for worker in watcher.workers:
                status = watcher.status(worker)
                values = [*labels.values(), worker_label(worker)]
                figures = families.worker
                figures["batches"].add_metric(values, status.batches)
                figures["losses"].add_metric(values, status.losses)
                figures["failures"].add_metric(values, status.failures)
                figures["stale"].add_metric(values, float(status.stale))
                figures["silent"].add_metric(values, float(status.silent))
                if status.last_seq is not None:
                    figures["last_seq"].add_metric(values, status.last_seq)
                for medium, held in watcher.blocks_by_medium(worker).items():
                    families.blocks.add_metric([*values, medium or UNNAMED_MEDIUM], held)
        if families is not None:
            yield from families.worker.values()
            yield from (families.blocks, families.events, families.lag)


UNNAMED_MEDIUM = "unnamed"  # the medium label of blocks whose events name none (the device's)
WORKER_FIGURES = (  # key, counter (else a gauge), name, what it counts
    ("batches", True, "tskv_worker_batches", "Batches applied to the index"),
    ("losses", True, "tskv_worker_losses", "Losses reported, restarts included"),
    ("failures", True, "tskv_worker_failures", "Times the worker's subscriber failed"),
    ("stale", False, "tskv_worker_stale", "1 while the index cannot vouch for the view"),
    ("silent", False, "tskv_worker_silent", "1 while the worker's publisher does not answer"),
    ("last_seq", False, "tskv_worker_last_seq", "The last seq applied from the stream"),
)


class _Families:
    """One scrape's families, each labelled with the watcher's labels and, where it is a
    worker's figure, `worker`."""

    def __init__(self, labels: list[str]) -> None:
        worker = [*labels, "worker"]
        self.worker: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            key: (CounterMetricFamily if counter else GaugeMetricFamily)(name, text, labels=worker)
            for key, counter, name, text in WORKER_FIGURES
        }
        text = "Blocks the index holds for the worker, by storage medium (as its events name it)"
        self.blocks = GaugeMetricFamily("tskv_worker_blocks", text, labels=[*worker, "medium"])
        text = "Events applied to the index, by kind (the event's class name)"
        self.events = CounterMetricFamily("tskv_events_applied", text, labels=[*labels, "type"])
        text = "Time from a batch's timestamp to its being applied to the index"
        self.lag = HistogramMetricFamily("tskv_event_lag_seconds", text, labels=labels)

    def add_applied(self, values: list[str], figures: AppliedFigures) -> None:
        cumulative, buckets = 0, []
        for bound, count in zip(BOUNDS, figures.counts, strict=True):
            cumulative += count
            buckets.append((repr(bound), cumulative))
        buckets.append(("+Inf", figures.batches))
        self.lag.add_metric(values, buckets, figures.total)
        for kind, count in sorted(figures.events.items()):
            self.events.add_metric([*values, kind], count)


class LossCounter:
    """Losses by worker and reason, counted as the watcher reports them: pass `on_loss`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counter = Counter(
            "tskv_worker_losses_by_reason",
            "Losses reported, by reason (restart, evicted, replay-timeout, ...)",
            ["worker", "reason"],
            registry=registry,
        )

    def on_loss(self, worker: Worker, loss: Loss) -> None:
        self._counter.labels(worker_label(worker), loss.reason.value).inc()


class PublisherCollector(Collector):
    """A publisher's figures: batches accepted and published, queued, subscriptions, cached
    blocks, and what its replay endpoint served (replays, snapshots, descriptors, refusals)."""

    def __init__(self, publisher: Publisher, labels: Mapping[str, str] | None = None) -> None:
        self._publisher = publisher
        self._labels = dict(labels or {})

    def collect(self) -> Iterator[Metric]:
        stats = self._publisher.statistics()
        names, values = list(self._labels), list(self._labels.values())

        def counter(name: str, text: str, value: float) -> Metric:
            family = CounterMetricFamily(name, text, labels=names)
            family.add_metric(values, value)
            return family

        def gauge(name: str, text: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, text, labels=names)
            family.add_metric(values, value)
            return family

        yield counter("tskv_publisher_accepted", "Batches accepted by publish()", stats.accepted)
        yield counter("tskv_publisher_published", "Batches sent", stats.published)
        yield gauge("tskv_publisher_queued", "Batches waiting to be sent", stats.queued)
        yield gauge("tskv_publisher_subscriptions", "Subscriptions seen", stats.subscriptions)
        if stats.cached_blocks is not None:
            text = "Blocks the stream says are cached"
            yield gauge("tskv_publisher_cached_blocks", text, stats.cached_blocks)
        replay = stats.replay
        if replay is None:
            return
        text = "Requests on the replay endpoint, by type"
        requests = CounterMetricFamily("tskv_replay_requests", text, labels=[*names, "type"])
        replays = replay.requests - replay.snapshots - replay.descriptors
        requests.add_metric([*values, "replay"], replays)
        requests.add_metric([*values, "snapshot"], replay.snapshots)
        requests.add_metric([*values, "describe"], replay.descriptors)
        yield requests
        yield counter("tskv_replay_refused", "Requests refused by its limits", replay.refused)
        yield counter("tskv_replay_batches", "Batches sent in replies", replay.batches)
        yield counter("tskv_snapshot_parts", "Snapshot parts sent", replay.snapshot_parts)
        yield gauge("tskv_replay_running", "Replays and snapshots under way", replay.running)
