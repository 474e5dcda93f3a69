"""The Prometheus collectors any Trio program can register: the figures a publisher and a watcher
keep, read at scrape time, and losses by reason as the watcher reports them."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import tskv
from tests.zmq_helpers import LOOPBACK
from tskv import BlockRemoved, BlockStored
from tskv.testing import ScriptedPublisher

prometheus_client = pytest.importorskip("prometheus_client", reason="needs the serve extra")

from tskv.shells.metrics import LossCounter, PublisherCollector, WatcherCollector  # noqa: E402


def scraped(registry: object) -> list[str]:
    return prometheus_client.generate_latest(registry).decode().splitlines()  # type: ignore[no-any-return]


@pytest.mark.parametrize("processes", [0, 1], ids=["in-process", "reader-process"])
async def test_a_publisher_and_a_watcher_are_scraped_with_what_they_counted(
    processes: int,
) -> None:
    """A reader process's batches, events and blocks are counted as the watcher's own are."""
    registry = prometheus_client.CollectorRegistry()
    wire = {"wire_format": "vllm"}  # it carries a block's medium
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, **wire)
    index = tskv.PrefixIndex(4)
    async with tskv.open_publisher(config) as publisher:
        registry.register(PublisherCollector(publisher, {"engine": "e0"}))
        for n in range(3):
            await publisher.publish([BlockStored([n], None, [n] * 4, 4)])
        async with tskv.open_watcher(index, processes=processes) as watcher:
            registry.register(WatcherCollector(lambda: [({"model": "m"}, watcher)]))
            watcher.add("w", publisher.endpoint, publisher.replay_endpoint)
            with trio.fail_after(20):
                await watcher.wait_for_seq("w", 2)  # from its snapshot
                await publisher.publish(
                    [BlockStored([3], 2, [3] * 4, 4), BlockRemoved([1]), BlockRemoved([0])]
                )
                await watcher.wait_for_seq("w", 3)  # live, applied as it came
                await publisher.publish([BlockStored([9], None, [9] * 4, 4, medium="CPU")])
                await watcher.wait_for_seq("w", 4)
            lines = scraped(registry)
    assert 'tskv_publisher_published_total{engine="e0"} 5.0' in lines
    assert 'tskv_publisher_cached_blocks{engine="e0"} 3.0' in lines
    assert 'tskv_replay_requests_total{engine="e0",type="snapshot"} 1.0' in lines  # the bootstrap
    assert 'tskv_replay_requests_total{engine="e0",type="describe"} 1.0' in lines  # at `add`, once
    assert 'tskv_worker_stale{model="m",worker="w"} 0.0' in lines
    assert 'tskv_worker_last_seq{model="m",worker="w"} 4.0' in lines
    assert 'tskv_worker_blocks{medium="unnamed",model="m",worker="w"} 2.0' in lines
    assert 'tskv_worker_blocks{medium="CPU",model="m",worker="w"} 1.0' in lines
    assert 'tskv_events_applied_total{model="m",type="BlockStored"} 2.0' in lines
    assert 'tskv_events_applied_total{model="m",type="BlockRemoved"} 2.0' in lines
    assert 'tskv_event_lag_seconds_count{model="m"} 2.0' in lines  # the snapshot is no batch
    assert 'tskv_event_lag_seconds_bucket{le="+Inf",model="m"} 2.0' in lines


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
