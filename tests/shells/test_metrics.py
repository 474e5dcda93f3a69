"""The Prometheus collectors any Trio program can register: the figures a publisher and a watcher
keep, read at scrape time, and losses by reason as the watcher reports them."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import tskv
from tests.zmq_helpers import LOOPBACK
from tskv import BlockStored
from tskv.testing import ScriptedPublisher

prometheus_client = pytest.importorskip("prometheus_client", reason="needs the serve extra")

from tskv.shells.metrics import LossCounter, PublisherCollector, WatcherCollector  # noqa: E402


def scraped(registry: object) -> list[str]:
    return prometheus_client.generate_latest(registry).decode().splitlines()  # type: ignore[no-any-return]


async def test_a_publisher_and_a_watcher_are_scraped_with_what_they_counted() -> None:
    registry = prometheus_client.CollectorRegistry()
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    index = tskv.PrefixIndex(4)
    async with tskv.open_publisher(config) as publisher:
        registry.register(PublisherCollector(publisher, {"engine": "e0"}))
        for n in range(3):
            await publisher.publish([BlockStored([n], None, [n] * 4, 4)])
        async with tskv.open_watcher(index) as watcher:
            registry.register(WatcherCollector(lambda: [({"model": "m"}, watcher)]))
            watcher.add("w", publisher.endpoint, publisher.replay_endpoint)
            with trio.fail_after(10):
                await watcher.wait_for_seq("w", 2)  # from its snapshot
                await publisher.publish([BlockStored([3], 2, [3] * 4, 4)])
                await watcher.wait_for_seq("w", 3)  # live, applied as it came
            lines = scraped(registry)
    assert 'tskv_publisher_published_total{engine="e0"} 4.0' in lines
    assert 'tskv_publisher_cached_blocks{engine="e0"} 4.0' in lines
    assert 'tskv_replay_requests_total{engine="e0",type="snapshot"} 1.0' in lines  # the bootstrap
    assert 'tskv_replay_requests_total{engine="e0",type="describe"} 1.0' in lines  # at `add`
    assert 'tskv_worker_stale{model="m",worker="w"} 0.0' in lines
    assert 'tskv_worker_last_seq{model="m",worker="w"} 3.0' in lines
    assert 'tskv_worker_blocks{model="m",worker="w"} 4.0' in lines
    assert 'tskv_event_lag_seconds_count{model="m"} 1.0' in lines  # the snapshot is no batch
    assert 'tskv_event_lag_seconds_bucket{le="+Inf",model="m"} 1.0' in lines


async def test_losses_are_counted_by_reason_as_the_watcher_reports_them(
    tskv_scripted: ScriptedPublisher,
) -> None:
    registry = prometheus_client.CollectorRegistry()
    losses = LossCounter(registry)
    tskv_scripted.snapshots = False  # what replay no longer holds is lost, not restored
    index = tskv.PrefixIndex(4)
    async with tskv.open_watcher(index, on_loss=losses.on_loss) as watcher:
        watcher.add(("i", 0), tskv_scripted.endpoint, tskv_scripted.replay_endpoint)
        with trio.fail_after(10):
            await tskv_scripted.wait_for_subscriber()
            tskv_scripted.send([BlockStored([1], None, [1] * 4, 4)])
            await watcher.wait_for_seq(("i", 0), 0)
            tskv_scripted.skip(2)  # gone from its buffer before anyone asked
            tskv_scripted.send([BlockStored([2], None, [2] * 4, 4)])
            await watcher.wait_for_loss(("i", 0))
    assert 'tskv_worker_losses_by_reason_total{reason="evicted",worker="i:0"} 1.0' in scraped(
        registry
    )
