"""Clients written to vLLM's and TokenSpeed's replay protocol read tskv's replay unchanged: on a
fresh publisher, after it restarted on the same ports (a new epoch, which only tskv's own
clients are told), and after it refused a request (an empty end, which they read as "nothing
more").

The clients are written here from those projects' own words, not copied: vLLM's documented
subscriber (`examples/online_serving/kv_events_subscriber.py`) asks on a REQ socket with the
start seq as 8 big-endian bytes, reads `seq_bytes, payload = replay.recv_multipart()` and stops
on an empty payload; TokenSpeed's publisher (`pd/kv_events.py` in its wheel) documents that a
DEALER receives `(seq_bytes, payload)` per batch and `(-1, b"")` at the end. vLLM's current
publisher puts the topic frame first (`(topic, seq_bytes, payload)`). Each payload is decoded
as a batch by msgpack, as their msgspec decoders would: anything of tskv's own in that frame
would fail here as it failed Dynamo's indexer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgpack
import pytest
import trio
import trio.testing
import zmq

import tskv
from tests.zmq_helpers import LOOPBACK, free_loopback_port
from tskv.core.wire_format import WireFormat

END = (-1).to_bytes(8, "big", signed=True)
WAIT_MS = 10_000


def decoded(payload: bytes) -> int:
    """A replayed payload as their decoders read it: a batch `[ts, events, ...]`; its count."""
    batch = msgpack.unpackb(payload)
    assert isinstance(batch, list) and isinstance(batch[0], float), batch
    assert isinstance(batch[1], list)
    return len(batch[1])


def split(frames: list[bytes], wire: WireFormat) -> tuple[bytes, bytes]:
    """`seq_bytes, payload`, as the client of each layout unpacks a reply."""
    if wire == "vllm":
        _topic, seq_bytes, payload = frames
    else:
        seq_bytes, payload = frames
    return seq_bytes, payload


def vllm_documented_client(
    endpoint: str, start_seq: int, wire: WireFormat, sock: zmq.Socket[bytes] | None = None
) -> list[int]:
    """vLLM's example: a REQ socket, so one reply per request (a REQ takes no more)."""
    replay = sock or zmq.Context.instance().socket(zmq.REQ)
    try:
        if sock is None:
            replay.connect(endpoint)
        replay.send(start_seq.to_bytes(8, "big"))
        assert replay.poll(WAIT_MS), "the replay endpoint did not answer"
        seq_bytes, payload = split(replay.recv_multipart(), wire)
        if not payload:  # the end of the replay
            assert seq_bytes == END
            return []
        decoded(payload)
        return [int.from_bytes(seq_bytes, "big")]
    finally:
        if sock is None:
            replay.close(linger=0)


def tokenspeed_protocol_client(
    endpoint: str, start_seq: int, wire: WireFormat, sock: zmq.Socket[bytes] | None = None
) -> list[int]:
    """A DEALER, as TokenSpeed's publisher documents its replies: every batch, until the end."""
    dealer = sock or zmq.Context.instance().socket(zmq.DEALER)
    try:
        if sock is None:
            dealer.connect(endpoint)
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        seqs = []
        while True:
            assert dealer.poll(WAIT_MS), "the replay endpoint did not answer"
            empty, *rest = dealer.recv_multipart()
            assert empty == b""
            seq_bytes, payload = split(rest, wire)
            if not payload:
                assert seq_bytes == END
                return seqs
            decoded(payload)
            seqs.append(int.from_bytes(seq_bytes, "big"))
    finally:
        if sock is None:
            dealer.close(linger=0)


@asynccontextmanager
async def publishing(
    wire: WireFormat, replay_port: int, **settings: object
) -> AsyncIterator[tskv.Publisher]:
    config = tskv.KVEventsConfig(
        endpoint=LOOPBACK,
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        wire_format=wire,
        topic="kv",
        **settings,  # type: ignore[arg-type]
    )
    async with tskv.open_publisher(config) as publisher:
        for n in range(5):
            await publisher.publish([tskv.BlockStored([n], None, [n] * 4, 4)])
        await trio.testing.wait_all_tasks_blocked()  # all five are in the buffer
        yield publisher


@pytest.mark.parametrize("wire", ["tokenspeed", "vllm"])
async def test_their_clients_read_tskvs_replay_before_and_after_a_restart(
    wire: WireFormat,
) -> None:
    port = free_loopback_port()
    epochs = []
    for _generation in range(2):  # the second on the same port: a restarted engine
        async with publishing(wire, port) as publisher:
            endpoint = publisher.replay_endpoint
            assert endpoint is not None
            epochs.append(publisher.epoch)
            read = trio.to_thread.run_sync
            assert await read(tokenspeed_protocol_client, endpoint, 0, wire) == [0, 1, 2, 3, 4]
            assert await read(tokenspeed_protocol_client, endpoint, 3, wire) == [3, 4]
            assert await read(tokenspeed_protocol_client, endpoint, 5, wire) == []
            assert await read(vllm_documented_client, endpoint, 4, wire) == [4]
            assert await read(vllm_documented_client, endpoint, 5, wire) == []
    assert epochs[0] != epochs[1]  # told to tskv's own clients, and to no one else


@pytest.mark.parametrize("wire", ["tokenspeed", "vllm"])
@pytest.mark.parametrize("client", [tokenspeed_protocol_client, vllm_documented_client])
async def test_a_refused_request_reads_as_an_empty_end_to_their_clients(
    wire: WireFormat, client: object
) -> None:
    """One connection's budget is one request (replay_burst=1): its second is refused."""
    kind = zmq.REQ if client is vllm_documented_client else zmq.DEALER
    async with publishing(
        wire, free_loopback_port(), replay_burst=1, replay_rate=0.001
    ) as publisher:
        sock = zmq.Context.instance().socket(kind)
        try:
            assert publisher.replay_endpoint is not None
            sock.connect(publisher.replay_endpoint)
            first = await trio.to_thread.run_sync(client, "", 5, wire, sock)  # type: ignore[operator]
            refused = await trio.to_thread.run_sync(client, "", 0, wire, sock)  # type: ignore[operator]
        finally:
            sock.close(linger=0)
        stats = publisher.statistics().replay
    assert (first, refused) == ([], [])  # no batch after 4; and the refusal: nothing, cleanly
    assert stats is not None and stats.refused == 1
