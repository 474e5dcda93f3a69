"""Raw sockets for tests: a plain SUB and a DEALER replay client, each over tskv's Trio shim."""

from __future__ import annotations

import itertools
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import trio
import trio.testing
import zmq

from tskv import BlockStored, KVEventBatch, Publisher, decode_batch
from tskv.core.frames import (
    parse_live_message,
    parse_replay_reply,
    parse_subscription,
    replay_request,
)
from tskv.core.snapshot import PART_BLOCKS
from tskv.shells._trio_zmq import TrioSocket

_names = itertools.count()


def inproc_name(label: str) -> str:
    """A fresh inproc endpoint, so tests never share one."""
    return f"inproc://tskv-test-{label}-{next(_names)}"


@asynccontextmanager
async def pairs(
    count: int, context: zmq.Context[zmq.Socket[bytes]] | None = None
) -> AsyncIterator[list[tuple[zmq.Socket[bytes], TrioSocket]]]:
    """`count` connected PAIRs: (the sending end, the receiving end as the pump reads it)."""
    context = context or zmq.Context.instance()
    made: list[tuple[zmq.Socket[bytes], TrioSocket]] = []
    try:
        for _ in range(count):
            endpoint = inproc_name("pump")
            receiving = context.socket(zmq.PAIR)
            receiving.bind(endpoint)
            sending = context.socket(zmq.PAIR)
            sending.connect(endpoint)
            made.append((sending, TrioSocket(receiving)))
        yield made
    finally:
        for sending, receiving in made:
            sending.close(linger=0)
            receiving.close()


LOOPBACK = "tcp://127.0.0.1:*"  # binds loopback on a port the OS picks


@asynccontextmanager
async def raw_socket(kind: int, endpoint: str, bind: bool = False) -> AsyncIterator[TrioSocket]:
    sock = zmq.Context.instance().socket(kind)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.RCVHWM, 0)
    wrapped = TrioSocket(sock)
    try:
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
        yield wrapped
    finally:
        wrapped.close()


@asynccontextmanager
async def subscribed(
    publisher: Publisher, topic: bytes = b"", endpoint: str | None = None
) -> AsyncIterator[TrioSocket]:
    """A SUB on the publisher's endpoint whose subscription the publisher has seen."""
    before = publisher.statistics().subscriptions
    async with raw_socket(zmq.SUB, endpoint or publisher.endpoint) as sub:
        sub.sock.setsockopt(zmq.SUBSCRIBE, topic)
        if publisher.config.topic.encode().startswith(topic):
            with trio.fail_after(10):
                await publisher.wait_for_subscriber(before + 1)
        yield sub


async def next_subscription(xpub: TrioSocket) -> None:
    """Until a subscription (to every topic's prefix "") arrives at this XPUB: a subscriber
    connected, or connected again."""
    with trio.fail_after(30):
        while parse_subscription((await xpub.receive())[0], b"") != 1:
            pass


async def receive_batch(sub: TrioSocket) -> tuple[bytes, int, KVEventBatch]:
    with trio.fail_after(10):
        topic, seq, payload = parse_live_message(await sub.receive())
    return topic, seq, decode_batch(payload)


async def request_replay(dealer: TrioSocket, start_seq: int) -> list[tuple[int, bytes]]:
    """Ask for a replay and collect every reply up to the end marker."""
    await dealer.send(replay_request(start_seq))
    replies = []
    with trio.fail_after(10):
        while True:
            reply = parse_replay_reply(await dealer.receive())
            if reply.is_end:
                return replies
            replies.append((reply.seq, reply.payload))


def free_loopback_port() -> int:
    """A loopback port nothing listens on right now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def refusing_endpoint() -> Iterator[str]:
    """A loopback tcp endpoint that refuses every connection for as long as it is held: a
    socket bound there that never listens. A port merely freed can be taken by another process,
    or be picked as the connecting socket's own source port (TCP's self-connect), and either
    answers the connection."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        yield f"tcp://127.0.0.1:{holder.getsockname()[1]}"


async def publish_parts(publisher: Publisher, parts: int) -> None:
    """A cache whose snapshot is `parts` parts: a part's worth of blocks a batch."""
    for n in range(parts):
        hashes = list(range(n * PART_BLOCKS, (n + 1) * PART_BLOCKS))
        await publisher.publish([BlockStored(hashes, None, [n] * 16 * PART_BLOCKS, 16)])
    await trio.testing.wait_all_tasks_blocked()
