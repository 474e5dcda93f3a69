"""Routing through a worker's failures, on real sockets: a restart on the same ports (tskv's
publisher, TokenSpeed's, one without replay), a restart whose seqs meet ours, a publisher that
exits or hangs, a repair that gives up, and the router's view of each (`on_status`, the
policy's choice)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import tskv
from tests.tokenspeed import LOADED
from tests.zmq_helpers import LOOPBACK, free_loopback_port
from tskv import BlockStored, KVEventsConfig, LoadAwarePolicy, Loss, LossReason, PrefixIndex
from tskv.testing import ScriptedPublisher

TOKENS = list(range(8))
STORED = [BlockStored([11, 12], None, TOKENS, 4)]  # two blocks of 4 tokens


class Turns:
    """What `on_status` was told, in order, for the test to wait on."""

    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[tuple[Any, bool, bool]](math.inf)
        self.seen: list[tuple[Any, bool, bool]] = []

    def __call__(self, worker: Any, status: tskv.WorkerStatus) -> None:
        self._send.send_nowait((worker, status.stale, status.silent))

    async def until(self, worker: Any, *, stale: bool, silent: bool = False) -> None:
        with trio.fail_after(20):
            async for turn in self._receive:
                self.seen.append(turn)
                if turn == (worker, stale, silent):
                    return


def route(index: PrefixIndex, queued: dict[str, float]) -> str:
    choice = LoadAwarePolicy().choose(index.match(TOKENS), len(TOKENS), queued)
    assert isinstance(choice.worker, str)
    return choice.worker


@asynccontextmanager
async def busy_neighbour(watcher: tskv.Watcher) -> AsyncIterator[None]:
    """Worker "b", always up, with nothing cached: the router's other choice."""
    async with tskv.open_publisher(KVEventsConfig(endpoint=LOOPBACK)) as b:
        watcher.add("b", b.endpoint)
        index = watcher.index
        with trio.fail_after(10):
            await b.wait_for_subscriber()
        await b.publish([tskv.AllBlocksCleared()])  # "b" is known empty: trusted
        await watcher.wait_for_seq("b", 0)
        assert "b" not in index.stale
        yield


async def test_a_worker_restarted_on_its_ports_with_an_empty_cache_is_routed_to_again() -> None:
    """The restarted engine publishes nothing: its empty replay makes it trusted again (it
    once stayed stale for good, and got no request that would make it publish)."""
    index, turns = PrefixIndex(4), Turns()
    async with tskv.open_watcher(index, on_status=turns) as watcher, busy_neighbour(watcher):
        first = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
        async with tskv.open_publisher(first) as a:
            watcher.add("a", a.endpoint, a.replay_endpoint)
            await turns.until("a", stale=False)
            await a.publish(STORED)
            await watcher.wait_for_seq("a", 0)
            assert route(index, {"a": 0, "b": 0}) == "a"  # it holds the prefix
            ports = (a.endpoint, a.replay_endpoint)
        await turns.until("a", stale=True, silent=True)  # it exited: known at once
        assert route(index, {"a": 0, "b": 100}) == "b"
        again = KVEventsConfig(endpoint=ports[0], replay_endpoint=ports[1], bind=True)
        async with tskv.open_publisher(again) as restarted:
            assert (restarted.endpoint, restarted.replay_endpoint) == ports
            await turns.until("a", stale=False)
            assert index.match(TOKENS).get("a", 0) == 0  # its old blocks are forgotten
            assert route(index, {"a": 0, "b": 100}) == "a"
            await restarted.publish(STORED)
            await watcher.wait_for_seq("a", 0)
            assert index.match(TOKENS)["a"] == 2
        losses = watcher.status("a").losses
    assert losses == 1  # the restart, once
    assert ("a", True, True) in turns.seen


@pytest.mark.skipif(isinstance(LOADED, str), reason=str(LOADED))
async def test_tokenspeeds_publisher_restarted_with_nothing_published_is_trusted_again(
    tmp_path: Path,
) -> None:
    ts: Any = LOADED
    live, replay = f"ipc://{tmp_path}/live", f"ipc://{tmp_path}/replay"  # TokenSpeed binds ipc
    index, turns = PrefixIndex(4), Turns()
    async with tskv.open_watcher(index, on_status=turns) as watcher, busy_neighbour(watcher):
        first = ts.ZmqEventPublisher(attn_dp_rank=0, endpoint=live, replay_endpoint=replay)
        try:
            first.publish(
                ts.KVEventBatch(ts=1.0, events=[ts.BlockStored([11, 12], None, TOKENS, 4)])
            )
            watcher.add("a", live, replay)
            await watcher.wait_for_seq("a", 0)
            await turns.until("a", stale=False)
            assert index.match(TOKENS)["a"] == 2
        finally:
            await trio.to_thread.run_sync(first.shutdown)
        await turns.until("a", stale=True, silent=True)
        restarted = ts.ZmqEventPublisher(attn_dp_rank=0, endpoint=live, replay_endpoint=replay)
        try:
            await turns.until("a", stale=False)
            assert index.match(TOKENS).get("a", 0) == 0
            assert route(index, {"a": 0, "b": 100}) == "a"
        finally:
            await trio.to_thread.run_sync(restarted.shutdown)


async def test_a_publisher_without_replay_is_routed_to_again_when_it_is_back() -> None:
    """Nothing can be asked of it: it is trusted again when it reconnects, and its first
    batch (seq 0 again) tells the restart, forgetting its old blocks."""
    index, turns = PrefixIndex(4), Turns()
    async with tskv.open_watcher(index, on_status=turns) as watcher, busy_neighbour(watcher):
        async with tskv.open_publisher(KVEventsConfig(endpoint=LOOPBACK)) as a:
            watcher.add("a", a.endpoint)
            with trio.fail_after(10):
                await a.wait_for_subscriber()
            await a.publish([tskv.AllBlocksCleared(), *STORED])
            await watcher.wait_for_seq("a", 0)
            await turns.until("a", stale=False)
            endpoint = a.endpoint
        await turns.until("a", stale=True, silent=True)
        again = KVEventsConfig(endpoint=endpoint, bind=True)
        async with tskv.open_publisher(again) as restarted:
            await turns.until("a", stale=False)
            assert route(index, {"a": 0, "b": 100}) == "a"
            with trio.fail_after(10):
                await restarted.wait_for_subscriber()
            await restarted.publish([BlockStored([21], None, [9, 9, 9, 9], 4)])
            await watcher.wait_for_loss("a")
            await watcher.wait_for_seq("a", 0)
            assert index.match(TOKENS).get("a", 0) == 0  # the restart forgot the old blocks
            assert index.match([9, 9, 9, 9])["a"] == 1


def batch(seq: int, generation: str) -> list[tskv.KVEvent]:
    offset = 0 if generation == "old" else 1000
    return [BlockStored([offset + seq], None, [offset + seq] * 4, 4)]


def first_hashes(events: list[tskv.KVEvent]) -> list[int]:
    return [event.block_hashes[0] for event in events if isinstance(event, BlockStored)]


class Seen:
    """A subscriber's deliveries and losses, in the order its consumer met them."""

    def __init__(self) -> None:
        self.items: list[tuple[int, int] | Loss] = []

    def loss(self, loss: Loss) -> None:
        self.items.append(loss)

    def after_the_restart(self) -> list[tuple[int, int] | Loss]:
        losses = [n for n, item in enumerate(self.items) if isinstance(item, Loss)]
        return self.items[losses[-1] + 1 :] if losses else []

    async def read_first(self, sub: tskv.Subscriber, count: int) -> None:
        with trio.fail_after(20):
            for _ in range(count):
                seq, got = await sub.__anext__()
                event = got.events[0]
                assert isinstance(event, BlockStored)
                self.items.append((seq, event.block_hashes[0]))

    async def read(self, sub: tskv.Subscriber, until: tuple[int, int]) -> None:
        """Read until `until` (seq, first hash) is delivered after a restart was reported."""
        with trio.fail_after(20):
            async for seq, got in sub:
                event = got.events[0]
                assert isinstance(event, BlockStored)
                self.items.append((seq, event.block_hashes[0]))
                if until in self.after_the_restart():
                    return


def tcp_endpoints() -> tuple[str, str]:
    return (
        f"tcp://127.0.0.1:{free_loopback_port()}",
        f"tcp://127.0.0.1:{free_loopback_port()}",
    )


async def test_a_restart_whose_seqs_meet_ours_is_found_on_reconnect() -> None:
    """0-4 delivered; the successor on the same ports publishes its 0-4 before this subscriber
    is back, then 5, exactly the seq expected next. The check made on reconnect (replay's
    batch at our last seq, and tskv's epoch) finds the restart."""
    seen = Seen()
    live, replay = tcp_endpoints()
    config = KVEventsConfig(endpoint=live, replay_endpoint=replay, bind=True)
    async with tskv.open_subscriber(live, replay, on_loss=seen.loss) as sub:
        async with tskv.open_publisher(config) as old:
            with trio.fail_after(10):
                await old.wait_for_subscriber()
            for n in range(5):
                await old.publish(batch(n, "old"))
            await seen.read_first(sub, 5)
            old_epoch = old.epoch
        async with tskv.open_publisher(config) as new:
            assert new.epoch != old_epoch
            for n in range(5):
                await new.publish(batch(n, "new"))
            with trio.fail_after(10):
                await new.wait_for_subscriber()
            await new.publish(batch(5, "new"))
            await seen.read(sub, until=(5, 1005))
    assert seen.items[:5] == [(n, n) for n in range(5)]
    [restart] = [item for item in seen.items if isinstance(item, Loss)]
    assert restart.reason is LossReason.RESTART and restart.new_seq == 0
    assert seen.after_the_restart() == [(n, 1000 + n) for n in range(6)]


@pytest.mark.skipif(isinstance(LOADED, str), reason=str(LOADED))
async def test_a_tokenspeed_restart_whose_seqs_meet_ours_is_found_on_reconnect(
    tmp_path: Path,
) -> None:
    """As above against TokenSpeed's own publisher, which says no epoch: the batch its
    replay holds at our last seq is not the one delivered."""
    ts: Any = LOADED
    live, replay = f"ipc://{tmp_path}/live", f"ipc://{tmp_path}/replay"
    seen = Seen()

    def ts_batch(seq: int, generation: str) -> Any:
        [event] = batch(seq, generation)
        assert isinstance(event, BlockStored)
        stored = ts.BlockStored(event.block_hashes, None, event.token_ids, 4)
        return ts.KVEventBatch(ts=1.0, events=[stored])

    old = ts.ZmqEventPublisher(attn_dp_rank=0, endpoint=live, replay_endpoint=replay)
    # from seq 0: what TokenSpeed's PUB sends before the subscription reaches it, replay has
    async with tskv.open_subscriber(live, replay, start_seq=0, on_loss=seen.loss) as sub:
        try:
            for n in range(5):
                old.publish(ts_batch(n, "old"))
            await seen.read_first(sub, 5)
        finally:
            await trio.to_thread.run_sync(old.shutdown)
        new = ts.ZmqEventPublisher(attn_dp_rank=0, endpoint=live, replay_endpoint=replay)
        try:
            for n in range(5):
                new.publish(ts_batch(n, "new"))
            with trio.fail_after(10):  # TokenSpeed's PUB says nothing of its subscribers
                while sub.statistics().handshakes < 2:  # noqa: ASYNC110 - statistics only
                    await trio.sleep(0.01)
            new.publish(ts_batch(5, "new"))
            await seen.read(sub, until=(5, 1005))
        finally:
            await trio.to_thread.run_sync(new.shutdown)
    [restart] = [item for item in seen.items if isinstance(item, Loss)]
    assert restart.reason is LossReason.RESTART
    assert seen.after_the_restart() == [(n, 1000 + n) for n in range(6)]


async def test_restarts_the_consumer_does_not_read_are_counted_and_told_when_it_does() -> None:
    """Four publishers in turn on one port while nothing reads the subscriber: more drops and
    returns than its inbox holds. Each handshake is counted as it happens (the monitor never
    waits on the consumer), and once read, the stream goes on from the last one."""
    live = f"tcp://127.0.0.1:{free_loopback_port()}"
    config = KVEventsConfig(endpoint=live, bind=True)
    async with tskv.open_subscriber(live) as sub:
        for made in range(1, 5):
            async with tskv.open_publisher(config) as publisher:
                with trio.fail_after(10):
                    await publisher.wait_for_subscriber()
                    while sub.statistics().handshakes < made:  # noqa: ASYNC110 - statistics
                        await trio.sleep(0.01)
        async with tskv.open_publisher(config) as publisher:
            with trio.fail_after(10):
                await publisher.wait_for_subscriber()
            await publisher.publish(batch(0, "new"))
            with trio.fail_after(10):
                seq, got = await sub.__anext__()
    assert (seq, got.events) == (0, batch(0, "new"))
    assert sub.statistics().handshakes == 5


def ev(n: int) -> list[tskv.KVEvent]:
    return [BlockStored([100 + n], None, [n] * 4, 4)]


async def test_a_view_a_timed_out_repair_left_with_a_hole_is_made_whole_when_it_answers(
    tskv_scripted: ScriptedPublisher,
) -> None:
    """The publisher stalls past the replay timeout during a repair (the batch it would have
    given back is lost), then answers: a snapshot makes the view whole, and the worker is
    current again, with the lost batch's block."""
    index, turns = PrefixIndex(4), Turns()
    settings = {"quiet_interval": 0.2, "replay_timeout": 0.3}
    async with tskv.open_watcher(index, on_status=turns, **settings) as watcher:
        watcher.add("a", tskv_scripted.endpoint, tskv_scripted.replay_endpoint)
        await turns.until("a", stale=False)  # its (empty) snapshot
        with trio.fail_after(10):
            await tskv_scripted.wait_for_subscriber()
        tskv_scripted.send(ev(0))
        await watcher.wait_for_seq("a", 0)
        tskv_scripted.replay_mode = "never"
        tskv_scripted.drop(ev(1))
        tskv_scripted.send(ev(2))
        await watcher.wait_for_loss("a")
        assert "a" in index.stale and index.match([1] * 4).get("a", 0) == 0
        tskv_scripted.replay_mode = "answer"
        await turns.until("a", stale=False)
        assert index.match([1] * 4)["a"] == 1  # batch 1's block: the snapshot had it
        assert [index.match([n] * 4)["a"] for n in (0, 2)] == [1, 1]
        asked = tskv_scripted.replay_requests
    assert asked.count(None) == 2  # the bootstrap's snapshot, and the one that made it whole


async def test_a_hung_publisher_is_silent_after_two_quiet_intervals_and_back_when_it_answers(
    tskv_scripted: ScriptedPublisher,
) -> None:
    index, turns = PrefixIndex(4), Turns()
    async with tskv.open_watcher(index, on_status=turns, quiet_interval=0.2) as watcher:
        watcher.add("a", tskv_scripted.endpoint, tskv_scripted.replay_endpoint)
        await turns.until("a", stale=False)
        tskv_scripted.replay_mode = "never"  # alive on the wire, answering nothing
        await turns.until("a", stale=True, silent=True)
        assert watcher.status("a").silent and "a" in index.stale
        tskv_scripted.replay_mode = "answer"
        await turns.until("a", stale=False)
        assert not watcher.status("a").silent


async def test_unknown_workers_are_refused_naming_those_watched() -> None:
    async with tskv.open_watcher(PrefixIndex(4)) as watcher:
        watcher.add("a", "tcp://127.0.0.1:1")  # nothing there: it is tried, quietly
        for call in (watcher.status, watcher.remove):
            with pytest.raises(
                tskv.TskvError, match=r"worker 'nope' is not watched \(watched: 'a'\)"
            ):
                call("nope")
        with pytest.raises(KeyError):
            await watcher.wait_for_seq("nope", 0)
        assert watcher.status("a").config.quiet_interval == 1.0  # a watcher's default
        watcher.remove("a")
        assert watcher.workers == []


def three_free_ports() -> int:
    """A port whose next two are free as well (so ranks 1 and 2 can bind them)."""
    for _ in range(50):
        base = free_loopback_port()
        try:
            import socket

            probes = [socket.socket() for _ in range(3)]
            try:
                for n, probe in enumerate(probes):
                    probe.bind(("127.0.0.1", base + n))
                return base
            finally:
                for probe in probes:
                    probe.close()
        except OSError:
            continue
    raise AssertionError("no three consecutive free ports on loopback")


async def test_a_restart_given_the_configured_endpoint_and_rank_binds_the_same_ports() -> None:
    """What docs/publisher.md tells a restart to pass; the endpoint reported (already offset)
    with the rank again is offset twice, where no subscriber looks."""
    base = three_free_ports()
    configured = f"tcp://127.0.0.1:{base}"
    config = KVEventsConfig(endpoint=configured, bind=True)
    async with tskv.open_publisher(config, dp_rank=1) as first:
        assert (first.configured_endpoint, first.endpoint) == (
            configured,
            f"tcp://127.0.0.1:{base + 1}",
        )
        reported = first.endpoint
    async with tskv.open_publisher(KVEventsConfig(endpoint=reported, bind=True), 1) as moved:
        assert moved.endpoint == f"tcp://127.0.0.1:{base + 2}"
    async with tskv.open_publisher(config, dp_rank=1) as again:
        assert again.endpoint == reported  # the same ports: what the watcher connects to


@pytest.mark.parametrize("epoch", [None, 7], ids=["no-epoch", "epoch"])
async def test_a_dead_publishers_batch_read_after_the_new_one_came_up_is_found_out(
    tskv_scripted: ScriptedPublisher, epoch: int | None
) -> None:
    """A crash loop's interleaving, scripted: the old publisher's 0-2 delivered; it dies, and
    its batch 3, still queued on its connection, is read after the new one's first batches
    were lost (its own 0-3 heard by no one); the new one's 4 then follows on, seq for seq.
    Nothing live tells them apart; the quiet stream's probe compares every batch live gave
    with replay's (the new publisher's), finds 0 differs, and restarts from the new one's 0."""
    tskv_scripted.epoch = epoch
    losses: list[Loss] = []
    got: list[tuple[int, list[int]]] = []
    endpoints = (tskv_scripted.endpoint, tskv_scripted.replay_endpoint)
    async with tskv.open_subscriber(
        *endpoints, start_seq=0, on_loss=losses.append, quiet_interval=0.2
    ) as sub:
        for n in range(3):
            tskv_scripted.send(batch(n, "old"))
        await tskv_scripted.wait_for_subscriber()
        tskv_scripted.restart()  # the new one, on the same endpoints
        tskv_scripted.send_stale(3, batch(3, "old"))
        for n in range(4):
            tskv_scripted.drop(batch(n, "new"))
        tskv_scripted.send(batch(4, "new"))
        with trio.fail_after(20):
            async for seq, received in sub:
                got.append((seq, first_hashes(received.events)))
                if seq == 4 and any(loss.reason is LossReason.RESTART for loss in losses):
                    break
    restart = next(n for n, loss in enumerate(losses) if loss.reason is LossReason.RESTART)
    assert losses[restart] == Loss(5, None, LossReason.RESTART, new_seq=0)
    since = got[-5:]
    assert since == [(n, first_hashes(batch(n, "new"))) for n in range(5)]
