"""Whatever a publisher sends, a subscriber's memory stays bounded and it goes on: a snapshot
over `max_snapshot_bytes` is given up, one that never ends too, and a message over
`max_message_bytes` costs that batch (repaired or reported), not the connection."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing
import zmq

import tskv
from tests.zmq_helpers import LOOPBACK, next_subscription, raw_socket
from tskv import BlockStored, KVEventBatch, Loss, LossReason
from tskv.core import frames
from tskv.shells._trio_zmq import TrioSocket


def stored(n: int) -> list[tskv.KVEvent]:
    return [BlockStored([n], n - 1 if n else None, [n] * 16, 16)]


def payload(n: int) -> bytes:
    return tskv.encode_batch(KVEventBatch(1.0, stored(n)))


async def first(sub: tskv.Subscriber, count: int) -> AsyncIterator[tuple[int, KVEventBatch]]:
    """The subscriber's next `count` batches, or a failure after 30 s."""
    with trio.fail_after(30):
        async for item in sub:
            yield item
            count -= 1
            if not count:
                return


def warned(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in record.getMessage() for record in caplog.records)


async def test_a_snapshot_over_the_limit_is_given_up_for_replay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = tskv.KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=10)
    losses: list[Loss] = []
    async with tskv.open_publisher(config) as publisher:
        for n in range(30):
            await publisher.publish(stored(n))
        await trio.testing.wait_all_tasks_blocked()
        with caplog.at_level(logging.WARNING, logger="tskv"):
            async with tskv.open_subscriber(
                publisher.endpoint,
                publisher.replay_endpoint,
                start_seq="snapshot",
                on_loss=losses.append,
                max_snapshot_bytes=100,  # 30 cached blocks take more
            ) as sub:
                seqs = [seq async for seq, _ in first(sub, 10)]
                stats = sub.statistics()
    assert seqs == list(range(20, 30)) and losses == [Loss(0, 19, LossReason.EVICTED)]
    assert stats.snapshots == 0 and warned(caplog, "over max_snapshot_bytes = 100")


async def _endless_snapshots(router: TrioSocket, buffered: list[bytes]) -> None:
    """A replay endpoint whose snapshots never end (broken, or hostile): part after part, until
    the client is gone. Replays are answered from `buffered`, from seq 0."""
    client = None
    index = 0
    while True:
        if client is not None:
            try:
                router.send_nowait(frames.snapshot_part(client, 5, index, b"\x90" * 1000))
                index += 1
            except trio.WouldBlock:
                pass
            except zmq.ZMQError:  # EHOSTUNREACH: the client left
                client = None
        try:
            message = router.receive_nowait()
        except trio.WouldBlock:
            await trio.sleep(0.001 if client is None else 0)
            continue
        request = frames.parse_replay_request(message)
        asker = request.client
        if request.form is frames.RequestForm.SNAPSHOT:
            client, index = asker, 0
            continue
        for seq, body in enumerate(buffered):
            await router.send(frames.replay_reply(asker, seq, body, None))
        await router.send(frames.replay_end(asker, None))


async def test_a_snapshot_that_never_ends_is_given_up_and_delivery_goes_on() -> None:
    """Kept, its parts would grow the subscriber without bound; at the limit it is given up,
    its reply abandoned (the socket replaced), and the bootstrap goes on from replay."""
    async with (
        raw_socket(zmq.PUB, LOOPBACK, bind=True) as pub,
        raw_socket(zmq.ROUTER, LOOPBACK, bind=True) as router,
        trio.open_nursery() as nursery,
    ):
        router.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        nursery.start_soon(_endless_snapshots, router, [payload(n) for n in range(5)])
        endpoint = pub.sock.last_endpoint.decode()
        replay = router.sock.last_endpoint.decode()
        async with tskv.open_subscriber(
            endpoint, replay, start_seq="snapshot", max_snapshot_bytes=50_000
        ) as sub:
            seqs = [seq async for seq, _ in first(sub, 5)]
        nursery.cancel_scope.cancel()
    assert seqs == [0, 1, 2, 3, 4]


async def test_a_message_over_the_limit_costs_that_batch_not_the_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """ZeroMQ ends the connection of a peer that sends more than MAXMSGSIZE and never retries
    it: without connecting again, the subscriber would hear nothing more, for good."""
    losses: list[Loss] = []
    async with raw_socket(zmq.XPUB, LOOPBACK, bind=True) as pub:
        pub.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        endpoint = pub.sock.last_endpoint.decode()
        with caplog.at_level(logging.WARNING, logger="tskv"):
            async with tskv.open_subscriber(
                endpoint, on_loss=losses.append, max_message_bytes=2048
            ) as sub:
                await next_subscription(pub)
                pub.send_nowait(frames.live_message(b"", 0, payload(0)))
                pub.send_nowait(frames.live_message(b"", 1, b"\x90" * 4096))
                await next_subscription(pub)  # connected again
                pub.send_nowait(frames.live_message(b"", 2, payload(2)))
                seqs = [seq async for seq, _ in first(sub, 2)]
    assert seqs == [0, 2] and losses == [Loss(1, 1, LossReason.NO_REPLAY)]
    assert warned(caplog, "a batch over max_message_bytes = 2048")


async def test_a_replay_reply_over_the_limit_times_out_and_delivery_goes_on() -> None:
    losses: list[Loss] = []
    async with (
        raw_socket(zmq.XPUB, LOOPBACK, bind=True) as pub,
        raw_socket(zmq.ROUTER, LOOPBACK, bind=True) as router,
    ):
        pub.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        endpoint, replay = (s.sock.last_endpoint.decode() for s in (pub, router))
        async with tskv.open_subscriber(
            endpoint,
            replay,
            start_seq=0,
            on_loss=losses.append,
            max_message_bytes=2048,
            replay_timeout=0.5,
        ) as sub:
            with trio.fail_after(30):
                client = frames.parse_replay_request(await router.receive()).client
                await router.send(frames.replay_reply(client, 0, b"\x90" * 4096, None))
                await next_subscription(pub)
            pub.send_nowait(frames.live_message(b"", 1, payload(1)))
            seqs = [seq async for seq, _ in first(sub, 1)]
    assert seqs == [1] and losses == [Loss(0, 0, LossReason.REPLAY_TIMEOUT)]
