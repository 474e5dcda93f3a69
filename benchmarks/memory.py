"""What a publisher's memory does: the replay buffer as it fills, and idle replay clients."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import trio
import trio.testing
import zmq

from benchmarks.processes import fmt, in_fresh_process, rss
from benchmarks.rounds import round_makers
from tskv.core import frames
from tskv.core.codec import encode_round
from tskv.core.config import KVEventsConfig
from tskv.core.endpoints import LOOPBACK
from tskv.shells.publisher import open_publisher


def _buffer_growth(conn: Connection) -> None:
    """In a fresh process (so earlier runs' freed memory cannot hide the growth)."""
    make = round_makers("small")["tskv"]

    async def main() -> int:
        config = KVEventsConfig(endpoint=LOOPBACK, buffer_steps=10_000)
        async with open_publisher(config) as publisher:
            for _ in range(100):
                await publisher.publish(make())
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            before = rss()
            for _ in range(10_000):
                await publisher.publish(make())
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            return rss() - before

    conn.send(trio.run(main))


def _idle_replay_clients(clients: int, conn: Connection) -> None:
    """Publisher growth while `clients` replay clients each ask for the whole buffer and never
    read a reply (in a fresh process)."""
    make = round_makers("small")["tskv"]

    async def main() -> int:
        config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=10_000)
        async with open_publisher(config) as publisher:
            for _ in range(10_000):
                await publisher.publish(make())
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            before = rss()
            assert publisher.replay_endpoint is not None
            sockets: list[zmq.Socket[bytes]] = []
            for _ in range(clients):
                dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
                dealer.setsockopt(zmq.RCVHWM, 1)
                dealer.setsockopt(zmq.RCVBUF, 4096)
                dealer.connect(publisher.replay_endpoint)
                dealer.send_multipart(frames.replay_request(0))
                sockets.append(dealer)
            await trio.sleep(3)  # every replay has filled its pipe, then stalled
            grown = rss() - before
            for dealer in sockets:
                dealer.close(linger=0)
            return grown

    conn.send(trio.run(main))


def memory_section(out: Callable[[str], None]) -> None:
    out("\n## Memory (resident growth, each measured in a fresh process)\n")
    samples = [in_fresh_process(_buffer_growth) for _ in range(3)]
    payload = encode_round(time.time(), round_makers("small")["tskv"](), 0)
    assert payload is not None
    out(f"- per 10,000 buffered small batches: {fmt(samples, ' MiB', 2**-20, 1)}")
    size = len(payload)
    out(f"- the payloads themselves: {size * 10_000 / 2**20:.1f} MiB ({size} B each)")
    idle = [in_fresh_process(_idle_replay_clients, 50) for _ in range(3)]
    grown = fmt(idle, " MiB", 2**-20, 1)
    out(f"- 50 replay clients asking for 10,000 batches, never reading: {grown}")
