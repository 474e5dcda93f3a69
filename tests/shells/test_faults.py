"""The subscriber through every fault, driven by tskv's own pytest fixtures (tskv.testing)."""

from __future__ import annotations

import pytest
import trio

import tskv
from tskv import BlockRemoved, Loss, LossReason
from tskv.sim import CacheView
from tskv.testing import ScriptedPublisher, ScriptedPublisherThread, SimulatedStream


def ev(n: int) -> list[tskv.KVEvent]:
    return [BlockRemoved([n])]


async def take(sub: tskv.Subscriber, count: int) -> list[int]:
    seqs = []
    with trio.fail_after(10):
        async for seq, _ in sub:
            seqs.append(seq)
            if len(seqs) == count:
                break
    return seqs


async def test_dropped_batches_come_back_from_replay(tskv_scripted: ScriptedPublisher) -> None:
    losses: list[Loss] = []
    async with tskv.open_subscriber(
        tskv_scripted.endpoint, tskv_scripted.replay_endpoint, on_loss=losses.append
    ) as sub:
        await tskv_scripted.wait_for_subscriber()
        tskv_scripted.send(ev(0))
        tskv_scripted.drop(ev(1))
        tskv_scripted.drop(ev(2))
        tskv_scripted.send(ev(3))
        assert await take(sub, 4) == [0, 1, 2, 3]
    assert losses == [] and sub.statistics().repaired == 2
    assert tskv_scripted.replay_requests == [0]  # from the last batch delivered, to compare


async def test_a_buffer_that_no_longer_covers_the_gap_is_a_loss(
    tskv_scripted: ScriptedPublisher,
) -> None:
    tskv_scripted.snapshots = False  # as TokenSpeed's publisher: replay only
    losses: list[Loss] = []
    async with tskv.open_subscriber(
        tskv_scripted.endpoint, tskv_scripted.replay_endpoint, on_loss=losses.append
    ) as sub:
        await tskv_scripted.wait_for_subscriber()
        tskv_scripted.send(ev(0))
        tskv_scripted.skip(3)  # seqs 1..3: gone from the buffer
        tskv_scripted.drop(ev(4))
        tskv_scripted.send(ev(5))
        assert await take(sub, 3) == [0, 4, 5]
    assert losses == [Loss(1, 3, LossReason.EVICTED)]


async def test_a_restart_is_reported_and_delivery_goes_on(tskv_scripted: ScriptedPublisher) -> None:
    losses: list[Loss] = []
    async with tskv.open_subscriber(tskv_scripted.endpoint, on_loss=losses.append) as sub:
        await tskv_scripted.wait_for_subscriber()
        for n in range(3):
            tskv_scripted.send(ev(n))
        tskv_scripted.restart()
        tskv_scripted.send(ev(100))
        assert await take(sub, 4) == [0, 1, 2, 0]
    assert losses == [Loss(3, None, LossReason.RESTART, new_seq=0)]


async def test_a_restart_heard_only_after_the_new_sequence_began_is_delivered_from_0(
    tskv_scripted: ScriptedPublisher,
) -> None:
    losses: list[Loss] = []
    async with tskv.open_subscriber(
        tskv_scripted.endpoint, tskv_scripted.replay_endpoint, on_loss=losses.append
    ) as sub:
        await tskv_scripted.wait_for_subscriber()
        for n in range(100):
            tskv_scripted.send(ev(n))
        tskv_scripted.restart()
        for n in range(65):  # sent before this subscriber's subscription reached the new one
            tskv_scripted.drop(ev(1000 + n))
        tskv_scripted.send(ev(1065))
        got = await take_batches(sub, 166)
    assert [seq for seq, _ in got] == list(range(100)) + list(range(66))
    assert [list(batch.events) for _, batch in got[100:]] == [ev(1000 + n) for n in range(66)]
    assert losses == [Loss(100, None, LossReason.RESTART, new_seq=0)]


async def test_a_restart_already_past_our_seq_is_not_spliced_onto_the_old_sequence(
    tskv_scripted: ScriptedPublisher,
) -> None:
    losses: list[Loss] = []
    async with tskv.open_subscriber(
        tskv_scripted.endpoint, tskv_scripted.replay_endpoint, on_loss=losses.append
    ) as sub:
        await tskv_scripted.wait_for_subscriber()
        for n in range(20):
            tskv_scripted.send(ev(n))
        tskv_scripted.restart()  # the publisher died after seq 19; its successor...
        for n in range(211):
            tskv_scripted.drop(ev(5000 + n))  # ...was at 211 before we heard from it
        tskv_scripted.send(ev(5211))
        got = await take_batches(sub, 20 + 212)
    assert [seq for seq, _ in got] == list(range(20)) + list(range(212))
    assert [list(batch.events) for _, batch in got[20:]] == [ev(5000 + n) for n in range(212)]
    assert losses == [Loss(20, None, LossReason.RESTART, new_seq=0)]
    assert tskv_scripted.replay_requests == [19, 0]  # compare at our last seq, then refetch


async def take_batches(sub: tskv.Subscriber, count: int) -> list[tuple[int, tskv.KVEventBatch]]:
    got = []
    with trio.fail_after(10):
        async for item in sub:
            got.append(item)
            if len(got) == count:
                break
    return got


async def test_a_corrupt_payload_is_reported_not_raised(tskv_scripted: ScriptedPublisher) -> None:
    losses: list[Loss] = []
    async with tskv.open_subscriber(tskv_scripted.endpoint, on_loss=losses.append) as sub:
        await tskv_scripted.wait_for_subscriber()
        tskv_scripted.send(ev(0))
        tskv_scripted.send_corrupt()
        tskv_scripted.send(ev(2))
        assert await take(sub, 2) == [0, 2]
    assert losses == [Loss(1, 1, LossReason.UNDECODABLE)]
    assert sub.statistics().undecodable == 1


async def test_a_late_replay_still_repairs(tskv_scripted: ScriptedPublisher) -> None:
    tskv_scripted.replay_delay = 0.3
    async with tskv.open_subscriber(
        tskv_scripted.endpoint, tskv_scripted.replay_endpoint, replay_timeout=5
    ) as sub:
        await tskv_scripted.wait_for_subscriber()
        tskv_scripted.send(ev(0))
        tskv_scripted.drop(ev(1))
        tskv_scripted.send(ev(2))
        assert await take(sub, 3) == [0, 1, 2]
    assert sub.statistics().lost == 0


async def test_a_silent_replay_is_a_loss_after_the_timeout(
    tskv_scripted: ScriptedPublisher,
) -> None:
    tskv_scripted.replay_mode = "never"
    losses: list[Loss] = []
    async with tskv.open_subscriber(
        tskv_scripted.endpoint,
        tskv_scripted.replay_endpoint,
        replay_timeout=0.3,
        on_loss=losses.append,
    ) as sub:
        await tskv_scripted.wait_for_subscriber()
        tskv_scripted.send(ev(0))
        tskv_scripted.drop(ev(1))
        tskv_scripted.send(ev(2))
        tskv_scripted.send(ev(3))
        assert await take(sub, 3) == [0, 2, 3]
    assert losses == [Loss(1, 1, LossReason.REPLAY_TIMEOUT)]
    assert tskv_scripted.replay_requests == [0]  # from the last batch delivered, to compare


@pytest.mark.parametrize("layout", ["tokenspeed", "vllm"])
async def test_both_replay_layouts_repair(tskv_scripted: ScriptedPublisher, layout: str) -> None:
    tskv_scripted.replay_layout = layout  # type: ignore[assignment]
    async with tskv.open_subscriber(tskv_scripted.endpoint, tskv_scripted.replay_endpoint) as sub:
        await tskv_scripted.wait_for_subscriber()
        tskv_scripted.send(ev(0))
        for n in (1, 2):
            tskv_scripted.drop(ev(n))
        tskv_scripted.send(ev(3))
        assert await take(sub, 4) == [0, 1, 2, 3]
    assert sub.statistics().repaired == 2


@pytest.mark.tskv_stream(seed=5, rounds=80, cache_blocks=64, block_size=4)
async def test_the_simulated_stream_rebuilds_the_final_cache(tskv_stream: SimulatedStream) -> None:
    view = CacheView()
    async with tskv.open_subscriber(tskv_stream.endpoint, tskv_stream.replay_endpoint) as sub:
        await tskv_stream.play()
        with trio.fail_after(20):
            async for seq, batch in sub:
                assert list(batch.events) == tskv_stream.batches[seq]
                view.apply(seq, batch.events)
                if seq == len(tskv_stream.batches) - 1:
                    break
    assert view.blocks == tskv_stream.final_blocks and view.blocks


def test_sync_fixture_drives_a_consumer_in_another_thread(
    tskv_scripted_sync: ScriptedPublisherThread,
) -> None:
    tskv_scripted_sync.replay_layout = "vllm"
    tskv_scripted_sync.snapshots = False
    losses: list[Loss] = []

    async def consume() -> list[int]:  # a consumer with its own event loop, as in a real app
        async with tskv.open_subscriber(
            tskv_scripted_sync.endpoint, tskv_scripted_sync.replay_endpoint, on_loss=losses.append
        ) as sub:
            await trio.to_thread.run_sync(script)
            return await take(sub, 5)

    def script() -> None:  # plain blocking calls, as from any sync test
        tskv_scripted_sync.wait_for_subscriber()
        tskv_scripted_sync.send(ev(0))
        tskv_scripted_sync.drop(ev(1))
        tskv_scripted_sync.send(ev(2))
        tskv_scripted_sync.skip()
        tskv_scripted_sync.send(ev(4))
        tskv_scripted_sync.send_corrupt()
        tskv_scripted_sync.send(ev(6))

    assert trio.run(consume) == [0, 1, 2, 4, 6]
    assert losses == [Loss(3, 3, LossReason.EVICTED), Loss(5, 5, LossReason.UNDECODABLE)]


async def test_the_scripted_replay_survives_a_client_that_leaves(
    tskv_scripted: ScriptedPublisher,
) -> None:
    import zmq

    from tests.zmq_helpers import raw_socket, request_replay

    for n in range(2000):
        tskv_scripted.drop(ev(n))
    assert tskv_scripted.replay_endpoint is not None
    async with raw_socket(zmq.DEALER, tskv_scripted.replay_endpoint) as leaving:
        leaving.sock.setsockopt(zmq.RCVHWM, 1)
        await leaving.send([b"", (0).to_bytes(8, "big")])
        await leaving.receive()  # the replay has begun; the client now goes away
    async with raw_socket(zmq.DEALER, tskv_scripted.replay_endpoint) as fresh:
        replies = await request_replay(fresh, 1990)
    assert [seq for seq, _ in replies] == list(range(1990, 2000))


async def test_a_refusing_replay_is_retried_and_reported_as_refused_not_evicted(
    tskv_scripted: ScriptedPublisher,
) -> None:
    tskv_scripted.replay_mode = "refuse"
    losses: list[Loss] = []
    async with tskv.open_subscriber(
        tskv_scripted.endpoint,
        tskv_scripted.replay_endpoint,
        replay_timeout=0.5,
        on_loss=losses.append,
    ) as sub:
        await tskv_scripted.wait_for_subscriber()
        tskv_scripted.send(ev(0))
        tskv_scripted.drop(ev(1))  # the buffer has it, but the publisher will not say
        tskv_scripted.send(ev(2))
        assert await take(sub, 2) == [0, 2]
    assert losses == [Loss(1, 1, LossReason.REFUSED)]
    assert len(tskv_scripted.replay_requests) > 1  # asked again, with a backoff
    assert sub.statistics().replay_refusals == len(tskv_scripted.replay_requests)


async def test_a_replay_refused_for_a_while_still_repairs(
    tskv_scripted: ScriptedPublisher,
) -> None:
    tskv_scripted.replay_mode = "refuse"
    # The mode changes below while the first answer is still on its way: the publisher
    # decided it when the request came, as a real one does.
    tskv_scripted.replay_delay = 0.05
    losses: list[Loss] = []
    async with tskv.open_subscriber(
        tskv_scripted.endpoint, tskv_scripted.replay_endpoint, on_loss=losses.append
    ) as sub:
        await tskv_scripted.wait_for_subscriber()
        tskv_scripted.send(ev(0))
        tskv_scripted.drop(ev(1))
        tskv_scripted.send(ev(2))
        seqs: list[int] = []

        async def consume() -> None:
            seqs.extend(await take(sub, 3))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            with trio.fail_after(10):
                while not tskv_scripted.replay_requests:  # noqa: ASYNC110
                    await trio.sleep(0.01)  # the first request has been refused
            tskv_scripted.replay_mode = "answer"  # its limits let the next one through
    assert seqs == [0, 1, 2]
    assert losses == [] and sub.statistics().replay_refusals >= 1


async def test_an_absurd_seq_is_one_discontinuity_not_9e18_lost_batches(
    tskv_scripted: ScriptedPublisher,
) -> None:
    losses: list[Loss] = []
    async with tskv.open_subscriber(
        tskv_scripted.endpoint, tskv_scripted.replay_endpoint, on_loss=losses.append
    ) as sub:
        await tskv_scripted.wait_for_subscriber()
        for n in range(3):
            tskv_scripted.send(ev(n))
        tskv_scripted.send(ev(99), seq=2**63)
        assert await take(sub, 4) == [0, 1, 2, 2**63]
        stats = sub.statistics()
    assert losses == [Loss(3, None, LossReason.RESTART, new_seq=2**63)]
    assert stats.lost == 0


async def test_a_full_hold_keeps_the_newest_and_delivery_reaches_the_head(
    tskv_scripted: ScriptedPublisher,
) -> None:
    """Seqs 0-4, then 10 (5-9 lost on the way, and gone from replay), then 11-1010 while the
    repair is slow, with room for 100 held: every batch received is delivered, 1010 last, and
    only 5-9 are reported lost."""
    tskv_scripted.replay_delay = 2.0  # the repair outlasts the 1,000 batches that follow
    tskv_scripted.snapshots = False
    losses: list[Loss] = []
    async with tskv.open_subscriber(
        tskv_scripted.endpoint,
        tskv_scripted.replay_endpoint,
        max_held=100,
        on_loss=losses.append,
    ) as sub:
        await tskv_scripted.wait_for_subscriber()
        for n in range(5):
            tskv_scripted.send(ev(n))
        for n in range(5, 10):
            tskv_scripted.drop(ev(n))
        tskv_scripted.evict(below=10)  # replay answers the repair with its end marker only
        for n in range(10, 1011):
            tskv_scripted.send(ev(n))
        got = []
        with trio.fail_after(10):
            async for seq, batch in sub:
                assert sub.statistics().held <= 100
                got.append((seq, list(batch.events)))
                if seq == 1010:
                    break
    assert got == [(n, ev(n)) for n in [*range(5), *range(10, 1011)]]
    assert losses == [Loss(5, 9, LossReason.OVERRUN)]


def test_the_sync_scripted_publisher_forwards_every_setting_and_refuses_others(
    tskv_scripted_sync: ScriptedPublisherThread,
) -> None:
    tskv_scripted_sync.rank = 5
    tskv_scripted_sync.replay_delay = 0.25
    assert (tskv_scripted_sync.scripted.rank, tskv_scripted_sync.replay_delay) == (5, 0.25)
    assert tskv.decode_batch(tskv_scripted_sync.scripted.payload(ev(1))).attn_dp_rank == 5
    with pytest.raises(AttributeError, match="'replay_dleay' is not a setting"):
        tskv_scripted_sync.replay_dleay = 1.0
