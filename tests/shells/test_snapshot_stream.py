"""Snapshots end to end: late and stalled consumers end with exactly the scheduler's cache,
however far behind they were, on real sockets with real publishers."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import pytest
import trio
import trio.testing
import zmq

import tskv
from tests.zmq_helpers import LOOPBACK, inproc_name, publish_parts, raw_socket
from tskv import KVEvent, Loss, LossReason
from tskv.core import frames
from tskv.core.codec import decode
from tskv.shells.publisher import REPLAY_PIPE
from tskv.sim import CacheView, Simulator, Workload, run_round

LIVE_BLOCKS = 2000


def churn(count: int, start: int = 0) -> Iterator[list[KVEvent]]:
    """A cheap scheduler for long streams: one block stored per batch on a chain, the oldest
    removed once LIVE_BLOCKS are cached, and the whole cache cleared at every 250,000th batch
    from the 100,000th."""
    for n in range(start, start + count):
        events: list[KVEvent] = [tskv.BlockStored([n], n - 1 if n else None, [n & 0xFFFF] * 16, 16)]
        if n >= LIVE_BLOCKS:
            events.append(tskv.BlockRemoved([n - LIVE_BLOCKS]))
        if n % 250_000 == 100_000:
            events.append(tskv.AllBlocksCleared())
        yield events


async def follow_until(sub: tskv.Subscriber, view: CacheView, last_seq: int) -> None:
    with trio.fail_after(60):
        async for seq, batch in sub:
            view.apply(seq, batch.events)
            if seq >= last_seq:
                return


async def test_a_consumer_joining_after_a_million_batches_rebuilds_the_cache() -> None:
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=10_000)
    scheduler = CacheView()  # what every batch published says, applied in order
    async with tskv.open_publisher(config) as publisher:
        for seq, events in enumerate(churn(1_000_000)):
            await publisher.publish(events)
            scheduler.apply(seq, events)
        await trio.testing.wait_all_tasks_blocked()  # the publish task has sent them all
        assert publisher.statistics().oldest_seq == 990_000  # replay holds the last 10,000
        losses: list[Loss] = []
        joined = CacheView()
        async with tskv.open_subscriber(
            publisher.endpoint,
            publisher.replay_endpoint,
            start_seq="snapshot",
            on_loss=losses.append,
        ) as sub:
            await publisher.wait_for_subscriber()
            with trio.fail_after(60):
                seq, snapshot = await sub.__anext__()
            assert seq == 999_999 and isinstance(snapshot.events[0], tskv.AllBlocksCleared)
            joined.apply(seq, snapshot.events)
            assert joined.blocks == scheduler.blocks and len(joined.blocks) == LIVE_BLOCKS
            for seq, events in enumerate(churn(500, 1_000_000), 1_000_000):  # then live
                await publisher.publish(events)
                scheduler.apply(seq, events)
            await follow_until(sub, joined, 1_000_499)
            stats = sub.statistics()
        assert joined.blocks == scheduler.blocks
        assert losses == [] and (stats.snapshots, stats.lost, stats.replaced) == (1, 0, 0)
        assert publisher.statistics().replay.snapshots_completed == 1


async def test_a_consumer_that_stalls_past_the_buffer_is_restored_from_a_snapshot() -> None:
    endpoint = inproc_name("stall")  # inproc: no kernel buffers, so the HWMs alone decide drops
    config = tskv.KVEventsConfig(
        endpoint=endpoint, replay_endpoint=inproc_name("stall-replay"), buffer_steps=500, hwm=50
    )
    scheduler, consumer = CacheView(), CacheView()
    losses: list[Loss] = []
    async with (
        tskv.open_publisher(config) as publisher,
        tskv.open_subscriber(
            publisher.endpoint, publisher.replay_endpoint, on_loss=losses.append, hwm=50
        ) as sub,
    ):
        await publisher.wait_for_subscriber()
        batches = enumerate(churn(8000))
        for seq, events in islice(batches, 3000):
            await publisher.publish(events)
            scheduler.apply(seq, events)
        await follow_until(sub, consumer, 2999)
        assert consumer.blocks == scheduler.blocks
        # The consumer stops reading while 5,000 batches go out: ten times the buffer.
        for seq, events in batches:
            await publisher.publish(events)
            scheduler.apply(seq, events)
        await follow_until(sub, consumer, 7999)
        stats = sub.statistics()
    assert consumer.blocks == scheduler.blocks
    replaced = [loss for loss in losses if loss.reason is LossReason.SNAPSHOT]
    assert replaced and stats.snapshots == len(replaced)
    assert [loss for loss in losses if loss.reason is not LossReason.SNAPSHOT] == []
    assert stats.lost == 0 and stats.replaced == sum(loss.count or 0 for loss in replaced)


async def test_late_joiners_rebuild_each_data_parallel_rank_across_a_cache_reset() -> None:
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=50)
    async with (
        tskv.open_publisher(config, dp_rank=0) as rank0,
        tskv.open_publisher(config, dp_rank=1) as rank1,
    ):
        sims = [Simulator(128, 16), Simulator(128, 16)]
        workloads = [Workload(1, 16), Workload(2, 16)]
        for round_ in range(400):
            for sim, workload, publisher in zip(sims, workloads, [rank0, rank1], strict=True):
                events = run_round(sim, workload, 1)
                if round_ == 250 and sim is sims[1]:
                    events += sim.reset()  # rank 1's engine resets its prefix cache
                if events:
                    await publisher.publish(events)
        # publish() returns once a batch is queued: compare with the schedulers' final caches
        # only once every batch is sent, so each snapshot is as of the last one.
        await trio.testing.wait_all_tasks_blocked()
        for sim, publisher in zip(sims, [rank0, rank1], strict=True):
            last_seq = publisher.statistics().next_seq - 1
            assert last_seq > 100  # well past the buffer
            view = CacheView()
            async with tskv.open_subscriber(
                publisher.endpoint, publisher.replay_endpoint, start_seq="snapshot"
            ) as sub:
                with trio.fail_after(30):
                    seq, snapshot = await sub.__anext__()
                assert (seq, snapshot.attn_dp_rank) == (last_seq, publisher.dp_rank)
                view.apply(seq, snapshot.events)
            assert view.blocks == sim.cached_hashes() and view.blocks


async def test_a_publisher_without_snapshots_makes_the_late_joiner_fall_back_to_replay() -> None:
    config = tskv.KVEventsConfig(
        endpoint=LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=10, snapshots=False
    )
    losses: list[Loss] = []
    async with tskv.open_publisher(config) as publisher:
        for events in churn(30):
            await publisher.publish(events)
        await trio.testing.wait_all_tasks_blocked()
        async with tskv.open_subscriber(
            publisher.endpoint,
            publisher.replay_endpoint,
            start_seq="snapshot",
            on_loss=losses.append,
        ) as sub:
            seqs = []
            with trio.fail_after(30):
                async for seq, _ in sub:
                    seqs.append(seq)
                    if seq == 29:
                        break
            stats = sub.statistics()
    assert seqs == list(range(20, 30))  # what replay still had
    assert losses == [Loss(0, 19, LossReason.EVICTED)]  # the rest, reported
    assert stats.snapshots == 0
    assert publisher.statistics().replay.snapshots_completed == 0


async def test_the_threaded_publisher_serves_snapshots_of_what_it_published() -> None:
    publisher = await trio.to_thread.run_sync(
        lambda: tskv.ZmqEventPublisher(0, endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    )
    try:
        scheduler = CacheView()

        def publish_all() -> None:  # from a plain thread, as a non-Trio scheduler does
            for seq, events in enumerate(churn(3000)):
                publisher.publish(tskv.KVEventBatch(float(seq), events))
                scheduler.apply(seq, events)

        await trio.to_thread.run_sync(publish_all)
        assert publisher.replay_endpoint is not None
        view = CacheView()
        async with tskv.open_subscriber(
            publisher.endpoint, publisher.replay_endpoint, start_seq="snapshot"
        ) as sub:
            with trio.fail_after(30):
                async for seq, batch in sub:
                    view.apply(seq, batch.events)
                    if seq == 2999:
                        break
        assert view.blocks == scheduler.blocks and len(view.blocks) == LIVE_BLOCKS
    finally:
        await trio.to_thread.run_sync(publisher.shutdown)


async def test_serving_a_snapshot_lets_the_publishers_loop_run_between_its_parts() -> None:
    """A part is encoded as it is sent, a few ms each: a snapshot of many parts sent in one
    turn would hold the scheduler's loop (and its live batches) for as long as it takes."""
    parts = REPLAY_PIPE - 28  # every part fits in the client's pipe: only the turn's end stops it
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    async with tskv.open_publisher(config) as publisher:
        await publish_parts(publisher, parts)
        assert publisher.replay_endpoint is not None
        seen: set[int] = set()  # parts sent, each time another task got to run meanwhile

        async def watch() -> None:
            while True:
                seen.add(publisher.statistics().replay.snapshot_parts)
                await trio.lowlevel.checkpoint()

        async with (
            raw_socket(zmq.DEALER, publisher.replay_endpoint) as client,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(watch)
            await client.send(frames.snapshot_request())
            received = 0
            with trio.fail_after(60):
                while True:
                    reply = frames.parse_replay_reply(await client.receive())
                    if not isinstance(reply, frames.SnapshotPart):
                        break
                    received += 1
            nursery.cancel_scope.cancel()
    assert received == parts
    assert any(0 < sent < parts for sent in seen), sorted(seen)


async def test_decoding_a_snapshot_lets_the_consumers_loop_run_between_its_parts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decoded in one go, a 400,000-block snapshot held the consumer's loop for 0.65 s."""
    ticks = 0
    seen: list[int] = []  # the ticks counted at each part's decoding

    def counted(payload: bytes) -> tuple[tskv.KVEventBatch, int]:
        seen.append(ticks)
        return decode(payload)

    parts = 100  # more than the 64 calls after which the consumer lets others run anyway
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    async with tskv.open_publisher(config) as publisher, trio.open_nursery() as nursery:
        await publish_parts(publisher, parts)

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await trio.lowlevel.checkpoint()

        assert publisher.replay_endpoint is not None
        async with tskv.open_subscriber(
            publisher.endpoint, publisher.replay_endpoint, start_seq="snapshot"
        ) as sub:
            monkeypatch.setattr(sub._stream, "_read", counted)  # how it decodes each part
            nursery.start_soon(tick)
            with trio.fail_after(60):
                _, snapshot = await sub.__anext__()
        nursery.cancel_scope.cancel()
    assert len(seen) == parts and len(snapshot.events) == parts + 1  # and the clear
    assert seen[-1] > seen[0], "nothing else ran while the snapshot was decoded"
