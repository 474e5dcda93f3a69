"""A quiet stream hides nothing, on real sockets: batches lost at its very end, a publisher that
restarted and went quiet, and one that is gone are each found out within a quiet interval or
two, and a busy stream is never probed."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

import tskv
from tskv import BlockStored, KVEventBatch, Loss, LossReason
from tskv.testing import ScriptedPublisher

QUIET = 0.2  # seconds: short, so the tests are quick; the default is 2


def stored(n: int, label: int = 0) -> list[tskv.KVEvent]:
    return [BlockStored([n + 1000 * label], None, [n, label], 2)]


async def take(sub: tskv.Subscriber, count: int) -> list[tuple[int, KVEventBatch]]:
    with trio.fail_after(10):
        return [await sub.__anext__() for _ in range(count)]


@pytest.mark.parametrize("layout", ["tokenspeed", "vllm"])  # TensorRT-LLM's is vLLM's
async def test_batches_lost_at_the_end_of_a_quiet_stream_are_repaired(
    tskv_scripted: ScriptedPublisher, layout: str
) -> None:
    """The live stream loses its last 6 batches and the publisher goes quiet: replay still has
    them, and the probe of the quiet stream brings them back, with either reply layout."""
    tskv_scripted.replay_layout = layout  # type: ignore[assignment]
    async with tskv.open_subscriber(
        tskv_scripted.endpoint, tskv_scripted.replay_endpoint, quiet_interval=QUIET
    ) as sub:
        with trio.fail_after(10):
            await tskv_scripted.wait_for_subscriber()
        for n in range(3):
            tskv_scripted.send(stored(n))
        for n in range(3, 9):
            tskv_scripted.drop(stored(n))  # lost on the way; nothing follows them
        got = await take(sub, 9)
        assert [seq for seq, _ in got] == list(range(9))
        assert [batch.events for _, batch in got] == [stored(n) for n in range(9)]
        stats = sub.statistics()
        assert (stats.lost, stats.repaired, stats.probes) == (0, 6, 1)
        # from the first batch live gave that replay has not shown: each compared on the way
        assert tskv_scripted.replay_requests == [0]


async def test_a_publisher_restarted_and_quiet_is_reported_and_its_batches_delivered(
    tskv_scripted: ScriptedPublisher,
) -> None:
    """The engine restarts, publishes 5 batches the subscriber does not hear, and idles: the
    probe finds the new sequence behind ours, reports RESTART, and delivers it from seq 0."""
    losses: list[Loss] = []
    async with tskv.open_subscriber(
        tskv_scripted.endpoint,
        tskv_scripted.replay_endpoint,
        quiet_interval=QUIET,
        on_loss=losses.append,
    ) as sub:
        with trio.fail_after(10):
            await tskv_scripted.wait_for_subscriber()
        for n in range(10):
            tskv_scripted.send(stored(n))
        await take(sub, 10)
        tskv_scripted.restart()
        for n in range(5):
            tskv_scripted.drop(stored(n, label=1))  # sent while the subscriber reconnected
        got = await take(sub, 5)
    assert [seq for seq, _ in got] == list(range(5))
    assert [batch.events for _, batch in got] == [stored(n, label=1) for n in range(5)]
    assert losses == [Loss(10, None, LossReason.RESTART, new_seq=0)]


async def test_tskvs_own_publisher_restarted_on_the_same_endpoints_is_told_apart(
    tmp_path: Path,
) -> None:
    """A real publisher, closed and opened again on the same ipc endpoints, publishing 5
    batches and going quiet: RESTART, then the new batches (heard live or fetched by a
    probe, whichever the reconnection allows)."""
    config = tskv.KVEventsConfig(
        endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay"
    )
    losses: list[Loss] = []
    async with tskv.open_subscriber(
        config.endpoint, config.replay_endpoint, quiet_interval=QUIET, on_loss=losses.append
    ) as sub:
        async with tskv.open_publisher(config) as first:
            with trio.fail_after(10):
                await first.wait_for_subscriber()
            for n in range(10):
                await first.publish(stored(n))
            await take(sub, 10)
        async with tskv.open_publisher(config) as second:
            for n in range(5):
                await second.publish(stored(n, label=1))
            got = await take(sub, 5)
    assert [(seq, batch.events) for seq, batch in got] == [
        (n, stored(n, label=1)) for n in range(5)
    ]
    assert [loss.reason for loss in losses] == [LossReason.RESTART]


async def test_a_publisher_that_is_gone_is_reported_silent(tmp_path: Path) -> None:
    """tskv's publisher closes: the quiet stream's probe goes unanswered and the subscriber
    says so (on_silence), within two quiet intervals."""
    config = tskv.KVEventsConfig(
        endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay"
    )
    silences: list[bool] = []
    heard = trio.Event()

    def on_silence(silent: bool) -> None:
        silences.append(silent)
        heard.set()

    async with tskv.open_subscriber(
        config.endpoint, config.replay_endpoint, quiet_interval=QUIET, on_silence=on_silence
    ) as sub:
        async with tskv.open_publisher(config) as publisher:
            with trio.fail_after(10):
                await publisher.wait_for_subscriber()
            await publisher.publish(stored(0))
            await take(sub, 1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(take, sub, 1)  # iterating is what reports the silence
            with trio.fail_after(10):
                await heard.wait()
            nursery.cancel_scope.cancel()
        assert silences == [True]
        assert sub.statistics().silent and sub.statistics().silences == 1
        assert sub.statistics().lost == 0  # nothing is known lost


async def test_a_silent_publisher_that_answers_again_is_heard(
    tskv_scripted: ScriptedPublisher,
) -> None:
    silences: list[bool] = []
    changed = trio.Event()

    def on_silence(silent: bool) -> None:
        nonlocal changed
        silences.append(silent)
        changed.set()
        changed = trio.Event()

    async with tskv.open_subscriber(
        tskv_scripted.endpoint,
        tskv_scripted.replay_endpoint,
        quiet_interval=QUIET,
        on_silence=on_silence,
    ) as sub:
        with trio.fail_after(10):
            await tskv_scripted.wait_for_subscriber()
        tskv_scripted.send(stored(0))
        await take(sub, 1)
        tskv_scripted.replay_mode = "never"  # as a publisher that is gone
        async with trio.open_nursery() as nursery:
            nursery.start_soon(take, sub, 1)
            with trio.fail_after(10):
                await changed.wait()
                assert silences == [True]
                tskv_scripted.replay_mode = "answer"
                await changed.wait()
            nursery.cancel_scope.cancel()
        assert silences == [True, False]
        assert not sub.statistics().silent


async def test_a_busy_stream_is_never_probed_and_a_quiet_one_once_an_interval(
    tskv_scripted: ScriptedPublisher,
) -> None:
    interval = 2.0  # a stall of a whole interval on a busy machine would be needed to probe
    async with tskv.open_subscriber(
        tskv_scripted.endpoint, tskv_scripted.replay_endpoint, quiet_interval=interval
    ) as sub:
        with trio.fail_after(10):
            await tskv_scripted.wait_for_subscriber()
        started = trio.current_time()
        n = 0
        while trio.current_time() - started < 1.5 * interval:  # a batch every 20 ms
            tskv_scripted.send(stored(n))
            await take(sub, 1)
            n += 1
            await trio.sleep(0.02)  # the publisher's pace, not a wait for anything
        assert sub.statistics().probes == 0 and tskv_scripted.replay_requests == []
        quiet_since = trio.current_time()
        with trio.move_on_after(2.5 * interval):
            await take(sub, 1)  # nothing comes: the stream is quiet
        quiet_for = trio.current_time() - quiet_since
    assert 1 <= sub.statistics().probes <= quiet_for / interval + 1
    assert len(tskv_scripted.replay_requests) == sub.statistics().probes
