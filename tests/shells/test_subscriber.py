"""The subscriber against real publishers and faults: nothing is lost silently."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

import tskv
from tests.zmq_helpers import LOOPBACK
from tskv import BlockRemoved, KVEventsConfig, Loss, LossReason


def events(n: int) -> list[tskv.KVEvent]:
    return [BlockRemoved([n])]


def payload(n: int, rank: int = 0) -> bytes:
    return tskv.encode_batch(tskv.KVEventBatch(1.0, events(n), rank))


async def test_live_batches_arrive_in_order_with_their_events() -> None:
    cfg = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    async with (
        tskv.open_publisher(cfg) as publisher,
        tskv.open_subscriber(publisher.endpoint, publisher.replay_endpoint) as sub,
    ):
        with trio.fail_after(10):
            await publisher.wait_for_subscriber()
        for n in range(20):
            await publisher.publish(events(n))
        got = []
        with trio.fail_after(10):
            async for seq, batch in sub:
                got.append((seq, batch.events))
                if seq == 19:
                    break
        stats = sub.statistics()
    assert got == [(n, events(n)) for n in range(20)]
    assert (stats.received, stats.delivered, stats.lost, stats.repaired) == (20, 20, 0, 0)


async def test_stalled_subscriber_gets_every_dropped_batch_back_from_replay() -> None:
    count = 5000
    # Big batches (about 4 kB), so the kernel's socket buffers cannot hide the stall.
    tokens = list(range(1000, 2000))

    def big(n: int) -> list[tskv.KVEvent]:
        return [tskv.BlockStored([n], None, tokens, 16)]

    cfg = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, hwm=20, buffer_steps=count)
    losses: list[Loss] = []
    async with (
        tskv.open_publisher(cfg) as publisher,
        tskv.open_subscriber(
            publisher.endpoint, publisher.replay_endpoint, hwm=20, on_loss=losses.append
        ) as sub,
    ):
        with trio.fail_after(10):
            await publisher.wait_for_subscriber()
        for n in range(count):  # the consumer is not iterating: its queues fill, ZeroMQ drops
            await publisher.publish(big(n))
        await trio.testing.wait_all_tasks_blocked()
        assert publisher.statistics().published == count
        seqs = []
        with trio.fail_after(60):
            async for seq, batch in sub:
                assert batch.events == big(seq)
                seqs.append(seq)
                if seq == count - 1:
                    break
        stats = sub.statistics()
    assert seqs == list(range(count))
    assert stats.repaired > 0, "the stall should have made ZeroMQ drop some live batches"
    assert stats.received + stats.repaired == count
    assert losses == [] and stats.lost == 0


async def test_late_joiner_with_start_seq_0_gets_the_buffer_then_live() -> None:
    cfg = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    async with tskv.open_publisher(cfg) as publisher:
        for n in range(50):  # nobody is listening yet
            await publisher.publish(events(n))
        await trio.testing.wait_all_tasks_blocked()  # all 50 sent before anyone subscribes
        async with tskv.open_subscriber(
            publisher.endpoint, publisher.replay_endpoint, start_seq=0
        ) as sub:
            with trio.fail_after(10):
                await publisher.wait_for_subscriber()
            for n in range(50, 80):
                await publisher.publish(events(n))
            seqs = []
            with trio.fail_after(10):
                async for seq, batch in sub:
                    assert batch.events == events(seq)
                    seqs.append(seq)
                    if seq == 79:
                        break
            stats = sub.statistics()
    assert seqs == list(range(80))
    # a start from the buffer fills no hole: those 50 are delivered, not counted as repaired
    assert stats.delivered == 80 and stats.repaired == 0 and stats.lost == 0


async def test_evicted_batches_are_reported_through_on_loss() -> None:
    cfg = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=10)
    losses: list[Loss] = []
    async with tskv.open_publisher(cfg) as publisher:
        for n in range(30):
            await publisher.publish(events(n))
        await trio.testing.wait_all_tasks_blocked()  # all 30 sent before anyone subscribes
        async with tskv.open_subscriber(
            publisher.endpoint,
            publisher.replay_endpoint,
            start_seq=0,
            on_loss=losses.append,
            snapshots=False,  # the hole stays a hole
        ) as sub:
            seqs = []
            with trio.fail_after(10):
                async for seq, _ in sub:
                    seqs.append(seq)
                    if seq == 29:
                        break
    assert losses == [Loss(0, 19, LossReason.EVICTED)]
    assert seqs == list(range(20, 30))
    assert sub.statistics().lost == 20


async def test_a_publisher_restarted_on_the_same_endpoints_is_followed_from_its_seq_0(
    tmp_path: Path,
) -> None:
    losses: list[Loss] = []
    # The subscriber binds loopback and each run of the publisher connects to it, as a
    # restarted engine would; replay is on an ipc path both runs bind in turn (a tcp port freed
    # between the two could be handed to another process meanwhile).
    replay_endpoint = f"ipc://{tmp_path}/replay"
    async with tskv.open_subscriber(LOOPBACK, replay_endpoint, on_loss=losses.append) as sub:
        assert sub.endpoint.startswith("tcp://127.0.0.1:") and "*" not in sub.endpoint
        config = KVEventsConfig(endpoint=sub.endpoint, replay_endpoint=replay_endpoint)
        async with tskv.open_publisher(config) as publisher:
            with trio.fail_after(10):
                await publisher.wait_for_subscriber()
            for n in range(100):
                await publisher.publish(events(n))
            old = [await sub.__anext__() for _ in range(100)]
        async with tskv.open_publisher(config) as publisher:
            for n in range(65):  # at once: before the subscriber's connection is back
                publisher.publish_nowait(events(1000 + n))
            with trio.fail_after(10):
                await publisher.wait_for_subscriber()
            for n in range(65, 70):
                await publisher.publish(events(1000 + n))
            with trio.fail_after(10):
                new = [await sub.__anext__() for _ in range(70)]
        stats = sub.statistics()
    assert [seq for seq, _ in old] == list(range(100))
    assert [seq for seq, _ in new] == list(range(70))
    assert [list(batch.events) for _, batch in new] == [events(1000 + n) for n in range(70)]
    assert losses == [Loss(100, None, LossReason.RESTART, new_seq=0)]
    assert stats.restarts == 1 and stats.lost == 0


async def test_bad_arguments_are_refused_clearly() -> None:
    import pytest

    with pytest.raises(ValueError, match="not a ZeroMQ address"):
        async with tskv.open_subscriber("localhost:5557"):
            pass
    with pytest.raises(ValueError, match="start_seq = 3 needs a replay endpoint"):
        async with tskv.open_subscriber("tcp://127.0.0.1:1", start_seq=3):
            pass
    with pytest.raises(ValueError, match="start_seq = -1"):
        async with tskv.open_subscriber("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", start_seq=-1):
            pass
