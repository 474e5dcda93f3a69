"""Publisher capacity with new events every round: tskv under Trio and threaded, beside the
conventional threaded publisher (written here) and the ZeroMQ ceiling."""

from __future__ import annotations

import gc
import math
import queue
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import trio
import trio.testing
import zmq

import tskv
from benchmarks.helpers import child, counting_subscriber, last_endpoint
from benchmarks.rounds import ROUNDS, SHAPES, Row, msgspec, round_makers
from tskv.core import frames
from tskv.core.config import KVEventsConfig
from tskv.core.endpoints import LOOPBACK
from tskv.core.events import KVEvent, KVEventBatch
from tskv.shells.publisher import open_publisher


def _rates(count: int, received: int, started: float, last: float) -> Row:
    result: Row = {"batches_per_s": received / max(last - started, 1e-9)}
    if received < count:
        result["missing"] = count - received
    return result


def run_tskv(shape: str, count: int, source: str = "tskv") -> Row:
    """tskv's Trio publisher: each round builds new events and publish()es them."""
    config = KVEventsConfig(endpoint=LOOPBACK, hwm=0)
    return trio_capacity(round_makers(shape)[source], config, count, warmup=0)


def trio_capacity(
    make: Callable[[], list[KVEvent]], config: KVEventsConfig, count: int, warmup: int
) -> Row:
    """Batches a second `open_publisher(config)` sends to a subscriber in another process,
    each round built by `make`, after `warmup` rounds sent before anyone subscribed; and the
    CPU time this process spent per batch meanwhile (its every thread, ZeroMQ's included),
    which other tenants of a shared machine disturb less than the rate."""
    result: Row = {}

    async def main() -> None:
        async with open_publisher(config) as publisher:
            for _ in range(warmup):
                await publisher.publish(make())
            with child(counting_subscriber, publisher.endpoint, count) as conn:
                await trio.to_thread.run_sync(conn.recv)
                await publisher.wait_for_subscriber()
                started, cpu_started = time.monotonic(), time.process_time()
                for _ in range(count):
                    await publisher.publish(make())
                received, _, last = await trio.to_thread.run_sync(conn.recv)
                cpu = time.process_time() - cpu_started
        result.update(_rates(count, received, started, last))
        result["cpu_us_per_batch"] = cpu / count * 1e6

    trio.run(main)
    return result


def run_threaded_tskv(shape: str, count: int) -> Row:
    """tskv's drop-in ZmqEventPublisher, fed from a plain thread."""
    make = round_makers(shape)["tskv"]
    publisher = tskv.ZmqEventPublisher(0, endpoint=LOOPBACK, hwm=0)
    try:
        with child(counting_subscriber, publisher.endpoint, count) as conn:
            conn.recv()
            deadline = time.monotonic() + 20
            while publisher.statistics().subscriptions < 1 and time.monotonic() < deadline:
                time.sleep(0.001)  # a plain thread: poll the publisher's own count
            started = time.monotonic()
            for _ in range(count):
                publisher.publish(KVEventBatch(time.time(), make(), 0))
            received, _, last = conn.recv()
    finally:
        publisher.shutdown()
    return _rates(count, received, started, last)


class BaselinePublisher:
    """The conventional design, written here: queue.Queue, a thread, msgspec, blocking pyzmq,
    and a replay buffer as TokenSpeed's keeps."""

    def __init__(self) -> None:
        assert msgspec is not None
        self._encode = msgspec.msgpack.Encoder().encode
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=100_000)
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.XPUB)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.bind(LOOPBACK)
        self.endpoint = last_endpoint(self.sock)
        self._buffer: list[tuple[int, bytes]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def publish(self, batch: Any) -> None:
        self._queue.put(batch)

    def _run(self) -> None:
        seq = 0
        while (batch := self._queue.get()) is not None:
            payload = self._encode(batch)
            self._buffer.append((seq, payload))
            self.sock.send_multipart(frames.live_message(b"", seq, payload))
            seq += 1

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.sock.close(linger=0)


def run_baseline(shape: str, count: int, source: str = "TokenSpeed Structs") -> Row:
    if msgspec is None:
        return {"batches_per_s": math.nan}
    make = round_makers(shape)[source]
    publisher = BaselinePublisher()
    try:
        with child(counting_subscriber, publisher.endpoint, count) as conn:
            conn.recv()
            publisher.sock.setsockopt(zmq.RCVTIMEO, 20_000)
            publisher.sock.recv()  # the subscription
            started = time.monotonic()
            for _ in range(count):
                publisher.publish(make())
            received, _, last = conn.recv()
    finally:
        publisher.shutdown()
    return _rates(count, received, started, last)


def capacity(reps: int) -> dict[str, dict[str, list[float]]]:
    """Batches a second each publisher sustains with new events every round."""
    results: dict[str, dict[str, list[float]]] = {}
    for shape in SHAPES:
        count = ROUNDS[shape]
        runs: dict[str, Callable[[], Row]] = {
            "baseline": partial(run_baseline, shape, count),
            "tskv Trio": partial(run_tskv, shape, count),
            "tskv threaded": partial(run_threaded_tskv, shape, count),
            "baseline from scheduler objects": partial(
                run_baseline, shape, count, "TokenSpeed from scheduler objects"
            ),
            "tskv Trio from scheduler objects": partial(
                run_tskv, shape, count, "tskv from scheduler objects"
            ),
        }
        results[shape] = {name: [] for name in runs}
        for _ in range(reps):  # alternating, so drift hits all of them alike
            for name, run in runs.items():
                gc.collect()
                results[shape][name].append(run()["batches_per_s"])
    return results
