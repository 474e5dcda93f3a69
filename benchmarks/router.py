"""A router decoding every batch: open_subscriber beside a bare pyzmq SUB with msgspec's typed
decoder, both fed by the same plain pyzmq publisher."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

import trio
import trio.testing
import zmq

import tskv
from benchmarks.helpers import child, last_endpoint
from benchmarks.rounds import msgspec, round_makers, tokenspeed_types
from tskv.core import frames
from tskv.core.codec import encode_round
from tskv.core.endpoints import LOOPBACK


def _stream_publisher(shape: str, count: int, conn: Connection) -> None:
    """Send `count` pre-encoded batches as fast as the socket takes them, once subscribed."""
    payload = encode_round(time.time(), round_makers(shape)["tskv"](), 0)
    assert payload is not None
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.XPUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(LOOPBACK)
    conn.send(last_endpoint(sock))
    sock.recv()  # a subscription
    for seq in range(count):
        sock.send_multipart(frames.live_message(b"", seq, payload))
    conn.recv()  # until told the run is over
    sock.close(linger=0)


def subscriber_rates(shape: str, count: int) -> dict[str, float]:
    """Decoded batches a second: open_subscriber against a bare pyzmq SUB + msgspec typed
    decode loop, each reading the same stream from a publisher in another process."""
    rates = {"open_subscriber": _tskv_consumer(shape, count)}
    if msgspec is not None:
        rates["bare pyzmq + msgspec"] = _bare_consumer(shape, count)
    return rates


def _bare_consumer(shape: str, count: int) -> float:
    decode = tokenspeed_types()[2].decode
    with child(_stream_publisher, shape, count) as conn:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(conn.recv())
        first = 0.0
        for n in range(count):
            _, _, payload = sock.recv_multipart()
            decode(payload)
            if n == 0:
                first = time.monotonic()
        elapsed = time.monotonic() - first
        sock.close(linger=0)
        conn.send("done")
    return (count - 1) / elapsed


def _tskv_consumer(shape: str, count: int) -> float:
    elapsed = 0.0

    async def main() -> None:
        nonlocal elapsed
        with child(_stream_publisher, shape, count) as conn:
            endpoint = await trio.to_thread.run_sync(conn.recv)
            async with tskv.open_subscriber(endpoint, hwm=0) as sub:
                first = 0.0
                n = 0
                async for _ in sub:
                    if n == 0:
                        first = time.monotonic()
                    n += 1
                    if n == count:
                        break
                elapsed = time.monotonic() - first
            conn.send("done")

    trio.run(main)
    return (count - 1) / elapsed
