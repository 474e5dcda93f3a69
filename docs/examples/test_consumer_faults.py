"""Testing a KV event consumer against every fault, with tskv's pytest fixtures.

Needs: pip install tskv-trio pytest pytest-trio  (the `_sync` fixtures need only pytest)
"""

import functools

import pytest
import trio

import tskv


class BlockIndex:
    """The consumer under test: which blocks one worker holds, rebuilt from its events."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.seqs: list[int] = []
        self.losses: list[tskv.Loss] = []

    def on_loss(self, loss: tskv.Loss) -> None:
        self.losses.append(loss)
        self.blocks.clear()  # this worker's state can no longer be trusted: start over

    def apply(self, seq: int, batch: tskv.KVEventBatch) -> None:
        self.seqs.append(seq)
        for event in batch.events:
            if isinstance(event, tskv.BlockStored):
                self.blocks.update(event.block_hashes)
            elif isinstance(event, tskv.BlockRemoved):
                self.blocks.difference_update(event.block_hashes)
            elif isinstance(event, tskv.AllBlocksCleared):
                self.blocks.clear()
            # a tskv.UnknownEvent (a newer engine's event type) changes nothing known

    async def follow(self, endpoint, replay_endpoint, count, replay_timeout=5.0):
        """Apply `count` batches from the stream, then return."""
        async with tskv.open_subscriber(
            endpoint, replay_endpoint, on_loss=self.on_loss, replay_timeout=replay_timeout
        ) as sub:
            async for seq, batch in sub:
                self.apply(seq, batch)
                if len(self.seqs) == count:
                    return


def stored(*hashes):
    return [tskv.BlockStored(list(hashes), None, [1] * 16 * len(hashes), 16)]


async def run_consumer(index, scripted, script, count, **options):
    """Start the consumer, wait until it is subscribed, run the script, wait for the consumer."""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            follow = functools.partial(index.follow, **options)
            nursery.start_soon(follow, scripted.endpoint, scripted.replay_endpoint, count)
            await scripted.wait_for_subscriber()
            script(scripted)


@pytest.mark.trio
async def test_dropped_batches_are_repaired_from_replay(tskv_scripted):
    def script(s):
        s.send(stored(1))
        s.drop(stored(2))  # lost on the way: only the replay buffer has it
        s.send(stored(3))

    index = BlockIndex()
    await run_consumer(index, tskv_scripted, script, count=3)
    assert index.seqs == [0, 1, 2] and index.blocks == {1, 2, 3} and not index.losses


@pytest.mark.trio
async def test_a_gap_the_buffer_no_longer_covers_is_restored_from_a_snapshot(tskv_scripted):
    def script(s):
        s.send(stored(1))
        s.skip(2)  # seqs 1 and 2 are gone from the buffer
        s.send(stored(4))

    index = BlockIndex()
    await run_consumer(index, tskv_scripted, script, count=2)
    # Seqs 1..3 come as one snapshot batch (seq 3) that clears, then stores what is cached.
    assert index.losses == [tskv.Loss(1, 3, tskv.LossReason.SNAPSHOT)]
    assert index.seqs == [0, 3] and index.blocks == {1, 4}


@pytest.mark.trio
async def test_without_snapshots_the_gap_is_reported(tskv_scripted):
    tskv_scripted.snapshots = False  # as TokenSpeed's and vLLM's publishers: replay only

    def script(s):
        s.send(stored(1))
        s.skip(2)
        s.send(stored(4))

    index = BlockIndex()
    await run_consumer(index, tskv_scripted, script, count=2)
    assert index.losses == [tskv.Loss(1, 2, tskv.LossReason.EVICTED)]
    assert index.blocks == {4}  # cleared at the loss, then rebuilt


@pytest.mark.trio
async def test_a_publisher_restart_is_not_mistaken_for_a_gap(tskv_scripted):
    def script(s):
        s.send(stored(1))
        s.send(stored(2))
        s.restart()  # the engine restarted: seqs begin again at 0
        s.send(stored(9))

    index = BlockIndex()
    await run_consumer(index, tskv_scripted, script, count=3)
    assert [loss.reason for loss in index.losses] == [tskv.LossReason.RESTART]
    assert index.seqs == [0, 1, 0] and index.blocks == {9}


@pytest.mark.trio
async def test_a_corrupt_payload_is_skipped_and_reported(tskv_scripted):
    def script(s):
        s.send(stored(1))
        s.send_corrupt()
        s.send(stored(3))

    index = BlockIndex()
    await run_consumer(index, tskv_scripted, script, count=2)
    assert index.losses == [tskv.Loss(1, 1, tskv.LossReason.UNDECODABLE)]


@pytest.mark.trio
async def test_a_slow_replay_still_repairs(tskv_scripted):
    tskv_scripted.replay_delay = 0.5  # seconds before replay answers

    def script(s):
        s.send(stored(1))
        s.drop(stored(2))
        s.send(stored(3))

    index = BlockIndex()
    await run_consumer(index, tskv_scripted, script, count=3)
    assert index.seqs == [0, 1, 2] and not index.losses


@pytest.mark.trio
async def test_a_silent_replay_is_a_loss_and_live_delivery_goes_on(tskv_scripted):
    tskv_scripted.replay_mode = "never"

    def script(s):
        s.send(stored(1))
        s.drop(stored(2))
        s.send(stored(3))

    index = BlockIndex()
    await run_consumer(index, tskv_scripted, script, count=2, replay_timeout=0.5)
    assert index.losses == [tskv.Loss(1, 1, tskv.LossReason.REPLAY_TIMEOUT)]
    assert index.seqs == [0, 2]


@pytest.mark.trio
async def test_vllm_replay_layout(tskv_scripted):
    tskv_scripted.replay_layout = "vllm"  # replies as ["", topic, seq, payload]

    def script(s):
        s.send(stored(1))
        s.drop(stored(2))
        s.send(stored(3))

    index = BlockIndex()
    await run_consumer(index, tskv_scripted, script, count=3)
    assert index.blocks == {1, 2, 3} and not index.losses


@pytest.mark.trio
@pytest.mark.tskv_stream(seed=42, rounds=100)
async def test_a_realistic_stream_rebuilds_the_schedulers_cache(tskv_stream):
    index = BlockIndex()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                index.follow,
                tskv_stream.endpoint,
                tskv_stream.replay_endpoint,
                len(tskv_stream.batches),
            )
            await tskv_stream.play()  # waits for the subscriber, then publishes every batch
    assert index.blocks == tskv_stream.final_blocks


def test_from_a_synchronous_test(tskv_scripted_sync):
    """No Trio in the test itself: the scripted publisher runs on its own thread."""
    index = BlockIndex()

    def script():
        tskv_scripted_sync.wait_for_subscriber()
        tskv_scripted_sync.send(stored(1))
        tskv_scripted_sync.drop(stored(2))
        tskv_scripted_sync.send(stored(3))

    async def consume():  # the consumer runs its own event loop, here in this thread
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                index.follow, tskv_scripted_sync.endpoint, tskv_scripted_sync.replay_endpoint, 3
            )
            await trio.to_thread.run_sync(script)

    trio.run(consume)
    assert index.blocks == {1, 2, 3}
