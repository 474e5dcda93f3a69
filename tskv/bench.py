"""`python -m tskv.bench` (`nox -s bench`, `tskv bench`): what a scheduler and a router really pay.

Every figure is set beside references measured in the same run, on the loop users really run:
a scheduler builds new event objects every round (from the block hashes and token lists its
cache already holds) and a router decodes every batch it receives. The references:

- TokenSpeed's way: msgspec Structs, array-like and tagged as TokenSpeed's events are, built
  every round, and msgspec's encoder; on the consumer side, msgspec's typed decoder into Structs.
- the ceiling: a plain pyzmq PUB sending pre-encoded payloads (no encoding, no queue, no Trio).
- the baseline: the conventional threaded publisher TokenSpeed and vLLM ship (queue.Queue, a
  thread, msgspec, blocking pyzmq), building its Structs every round.

Machines here are shared and noisy: each figure is the median of several alternating
repetitions, with the spread. The figures without msgspec come from a child process started with
TSKV_CODEC=msgpack, so they are what a machine without msgspec runs. This is not a test: nothing
here passes or fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache, partial
from multiprocessing.connection import Connection
from typing import Any

import trio
import trio.testing
import zmq

import tskv
from tskv._msgspec import msgspec
from tskv._trio_zmq import bound_endpoint
from tskv.codec import encode_round
from tskv.config import KVEventsConfig
from tskv.endpoints import LOOPBACK
from tskv.events import BlockRemoved, BlockStored, KVEvent, KVEventBatch
from tskv.publisher import open_publisher
from tskv.snapshot import CacheState, SnapshotBuilder

SHAPES = {"small": (10, 4, 64), "large": (200, 4, 64), "huge": (1, 2048, 32_768)}
ROUNDS = {"small": 20_000, "large": 2_000, "huge": 300}
SCRAMBLE = 0x9E3779B97F4A7C15  # odd: n -> n * SCRAMBLE & HASH_MASK is one-to-one on 63 bits
HASH_MASK = (1 << 63) - 1
Row = dict[str, Any]


# -- the scheduler's state and the three ways of turning it into a round ----------------------


class NativeEvent:
    """What a scheduler binding hands over: an object with a kind and the block's data."""

    __slots__ = ("block_hashes", "block_size", "kind", "parent_block_hash", "token_ids")

    def __init__(self, hashes: list[int], parent: int | None, tokens: list[int]) -> None:
        self.kind = "BlockStored"
        self.block_hashes, self.parent_block_hash, self.token_ids = hashes, parent, tokens
        self.block_size = 16


def scheduler_state(shape: str) -> list[tuple[list[int], int | None, list[int]]]:
    """The hashes, parents and token lists a round's events are built from: the scheduler's
    own data, made once (every publisher is handed the same lists). Hashes spread over 63
    bits and token ids above 256, as real ones are: Python shares the ints below 257, so ids
    0..63 would spare every decoder the int objects a real round costs it."""
    events, hashes, tokens = SHAPES[shape]
    chain = [(block + 1) * SCRAMBLE & HASH_MASK for block in range(events * hashes)]
    return [
        (
            chain[n * hashes : (n + 1) * hashes],
            chain[n * hashes - 1] if n else None,
            list(range(1000 + n * tokens, 1000 + (n + 1) * tokens)),
        )
        for n in range(events)
    ]


@cache
def tokenspeed_types() -> tuple[Any, Any, Any]:
    """TokenSpeed's event types as msgspec Structs (array-like, tagged), its batch, and a typed
    decoder for its batches, written here to the same shape."""
    import msgspec

    stored = msgspec.defstruct(
        "Stored",
        [
            ("block_hashes", list[int]),
            ("parent_block_hash", int | None),
            ("token_ids", list[int]),
            ("block_size", int),
        ],
        array_like=True,
        tag="BlockStored",
    )
    batch = msgspec.defstruct(
        "Batch",
        [("ts", float), ("events", list[stored]), ("attn_dp_rank", int | None, None)],  # type: ignore[valid-type]
        array_like=True,
    )
    return stored, batch, msgspec.msgpack.Decoder(batch)


def round_makers(shape: str) -> dict[str, Callable[[], Any]]:
    """Callables that build one round's new events each time they are called."""
    state = scheduler_state(shape)
    native = [NativeEvent(*item) for item in state]
    makers: dict[str, Callable[[], Any]] = {
        "tskv": lambda: [BlockStored(h, p, t, 16) for h, p, t in state],
        "tskv from scheduler objects": lambda: [
            tskv.scheduler_kv_event_to_wire_event(event) for event in native
        ],
    }
    if msgspec is not None:
        stored, batch, _ = tokenspeed_types()

        def translate(event: Any) -> Any:  # as TokenSpeed's own translation does, by kind
            if event.kind == "BlockStored":
                return stored(
                    event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size
                )
            raise TypeError(event.kind)

        makers["TokenSpeed Structs"] = lambda: batch(
            time.time(), [stored(h, p, t, 16) for h, p, t in state], 0
        )
        makers["TokenSpeed from scheduler objects"] = lambda: batch(
            time.time(), [translate(event) for event in native], 0
        )
    return makers


def _per_call(fn: Callable[[], object], n: int, reps: int = 5) -> float:
    samples = []
    for _ in range(reps):
        gc.collect()
        started = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - started) / n * 1e6)
    return statistics.median(samples)


def _encode_with(encode: Callable[[Any], bytes], make: Callable[[], Any]) -> bytes:
    return encode(make())


def _publish_round(make: Callable[[], list[KVEvent]], strict: bool) -> bytes | None:
    return encode_round(time.time(), make(), 0, strict=strict)


def build_encode_costs() -> dict[str, dict[str, float]]:
    """µs per round to build new events and encode them, per shape and contender."""
    encode = None if msgspec is None else msgspec.msgpack.Encoder().encode
    results: dict[str, dict[str, float]] = {}
    for shape in SHAPES:
        makers = round_makers(shape)
        n = {"small": 3000, "large": 200, "huge": 60}[shape]
        row = {}
        for name, make in makers.items():
            if name.startswith("TokenSpeed"):
                assert encode is not None
                row[name] = _per_call(partial(_encode_with, encode, make), n)
            else:
                row[name] = _per_call(partial(_publish_round, make, False), n)
        row["tskv, strict"] = _per_call(partial(_publish_round, makers["tskv"], True), n)
        results[shape] = row
    return results


def decode_costs() -> dict[str, dict[str, float]]:
    """µs per batch for a router to decode what it receives."""
    results: dict[str, dict[str, float]] = {}
    for shape in SHAPES:
        payload = encode_round(time.time(), round_makers(shape)["tskv"](), 0)
        assert payload is not None
        n = {"small": 3000, "large": 200, "huge": 40}[shape]
        row = {"tskv": _per_call(partial(tskv.decode_batch, payload), n)}
        if msgspec is not None:
            row["msgspec typed"] = _per_call(partial(tokenspeed_types()[2].decode, payload), n)
        results[shape] = row
    return results


# -- processes on the other end of the socket -------------------------------------------------


def _counting_subscriber(endpoint: str, count: int, conn: Connection) -> None:
    """Receive `count` batches (frames only) and report when the first and last arrived."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVTIMEO, 20_000)
    sock.connect(endpoint)
    conn.send("connected")
    received, first, last = 0, 0.0, 0.0
    try:
        while received < count:
            sock.recv_multipart()
            if received == 0:
                first = time.monotonic()
            received += 1
    except zmq.Again:
        pass
    last = time.monotonic()
    conn.send((received, first, last))
    sock.close(linger=0)


def _stream_publisher(shape: str, count: int, conn: Connection) -> None:
    """Send `count` pre-encoded batches as fast as the socket takes them, once subscribed."""
    payload = encode_round(time.time(), round_makers(shape)["tskv"](), 0)
    assert payload is not None
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.XPUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(LOOPBACK)
    conn.send(bound_endpoint(sock))
    sock.recv()  # a subscription
    for seq in range(count):
        sock.send_multipart([b"", seq.to_bytes(8, "big"), payload])
    conn.recv()  # until told the run is over
    sock.close(linger=0)


@contextmanager
def child(target: Callable[..., None], *args: Any) -> Iterator[Connection]:
    context = multiprocessing.get_context("spawn")
    parent, end = context.Pipe()
    process = context.Process(target=target, args=(*args, end))
    process.start()
    try:
        yield parent
    finally:
        process.join(60)
        if process.is_alive():
            process.kill()


# -- consumers: a router decoding every batch --------------------------------------------------


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


# -- publishers: a scheduler building new events every round -----------------------------------


def _rates(count: int, received: int, started: float, last: float) -> Row:
    result: Row = {"batches_per_s": received / max(last - started, 1e-9)}
    if received < count:
        result["missing"] = count - received
    return result


def run_tskv(shape: str, count: int, source: str = "tskv") -> Row:
    """tskv's Trio publisher: each round builds new events and publish()es them."""
    config = KVEventsConfig(endpoint=LOOPBACK, hwm=0)
    return _trio_capacity(round_makers(shape)[source], config, count, warmup=0)


def _trio_capacity(
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
            with child(_counting_subscriber, publisher.endpoint, count) as conn:
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
        with child(_counting_subscriber, publisher.endpoint, count) as conn:
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
        self.endpoint = bound_endpoint(self.sock)
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
            self.sock.send_multipart([b"", seq.to_bytes(8, "big"), payload])
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
        with child(_counting_subscriber, publisher.endpoint, count) as conn:
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


# -- latency, shutdown, memory ----------------------------------------------------------------


def _replay_client(endpoint: str, conn: Connection) -> None:
    """Another process asking for the whole buffer again and again until told to stop."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    conn.send("connected")
    replayed = 0
    while not conn.poll():
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            frames = sock.recv_multipart()
            if frames[1] == b"\xff" * 8:
                break
            replayed += 1
    conn.send(replayed)
    sock.close(linger=0)


def _latency_subscriber(endpoint: str, count: int, conn: Connection) -> None:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    conn.send("connected")
    latencies = []
    for _ in range(count):
        payload = sock.recv_multipart()[2]
        latencies.append(time.time() - tskv.decode_batch(payload).ts)
    conn.send(latencies)
    sock.close(linger=0)


def paced_latencies(replaying: bool, count: int = 3000) -> tuple[list[float], int]:
    """Live latencies at 1,000 rounds/s, and how many batches a replay client took meanwhile."""
    make = round_makers("small")["tskv"]
    latencies: list[float] = []
    replayed = 0

    async def main() -> None:
        nonlocal replayed
        config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, hwm=0)
        async with open_publisher(config) as publisher:
            if replaying:
                for _ in range(10_000):
                    await publisher.publish(make())
            assert publisher.replay_endpoint is not None
            with (
                child(_latency_subscriber, publisher.endpoint, count) as conn,
                child(_replay_client, publisher.replay_endpoint) as replay_conn,
            ):
                await trio.to_thread.run_sync(conn.recv)
                await publisher.wait_for_subscriber()
                if replaying:
                    await trio.to_thread.run_sync(replay_conn.recv)
                next_round = trio.current_time()
                for _ in range(count):
                    await publisher.publish(make())
                    next_round += 0.001
                    await trio.sleep_until(next_round)
                latencies.extend(await trio.to_thread.run_sync(conn.recv))
                if replaying:
                    replay_conn.send("stop")
                    replayed = await trio.to_thread.run_sync(replay_conn.recv)
                else:
                    replay_conn.send("stop")
                    await trio.to_thread.run_sync(replay_conn.recv)

    trio.run(main)
    return latencies, replayed


def shutdown_time(full: bool) -> float:
    make = round_makers("small")["tskv"]
    elapsed = 0.0

    async def main() -> None:
        nonlocal elapsed
        config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
        async with open_publisher(config) as publisher:
            if full:
                events = make()
                payload = encode_round(time.time(), events, 0)
                assert payload is not None
                for _ in range(config.max_queue_size):  # fill without a checkpoint
                    publisher.publish_encoded_nowait(payload, events)
            else:
                await trio.sleep(0.05)
            started = time.perf_counter()
        elapsed = time.perf_counter() - started

    trio.run(main)
    return elapsed


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
            before = _rss()
            for _ in range(10_000):
                await publisher.publish(make())
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            return _rss() - before

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
            before = _rss()
            assert publisher.replay_endpoint is not None
            sockets: list[zmq.Socket[bytes]] = []
            for _ in range(clients):
                dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
                dealer.setsockopt(zmq.RCVHWM, 1)
                dealer.setsockopt(zmq.RCVBUF, 4096)
                dealer.connect(publisher.replay_endpoint)
                dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                sockets.append(dealer)
            await trio.sleep(3)  # every replay has filled its pipe, then stalled
            grown = _rss() - before
            for dealer in sockets:
                dealer.close(linger=0)
            return grown

    conn.send(trio.run(main))


def in_fresh_process(target: Callable[..., None], *args: Any) -> Any:
    with child(target, *args) as conn:
        return conn.recv()


# -- reporting ---------------------------------------------------------------------------------


def fmt(values: list[float], unit: str = "", scale: float = 1.0, digits: int = 0) -> str:
    if any(math.isnan(value) for value in values):
        return "n/a (needs msgspec)"
    scaled = [v * scale for v in values]
    mid = statistics.median(scaled)
    return f"{mid:,.{digits}f}{unit} ({min(scaled):,.{digits}f}..{max(scaled):,.{digits}f})"


def child_figures(sections: list[str]) -> dict[str, Any]:
    """The same sections measured without msgspec, in a process that never imports it."""
    env = {**os.environ, "TSKV_CODEC": "msgpack"}
    done = subprocess.run(
        [sys.executable, "-m", "tskv.bench", "--json", *[f"--only={s}" for s in sections]],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    figures: dict[str, Any] = json.loads(done.stdout)
    return figures


def measure(sections: list[str], reps: int) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    if "build" in sections:
        figures["build"] = build_encode_costs()
    if "decode" in sections:
        figures["decode"] = decode_costs()
    if "subscriber" in sections:
        figures["subscriber"] = {
            shape: {
                name: [subscriber_rates(shape, count // 2)[name] for _ in range(reps)]
                for name in subscriber_rates(shape, 100)
            }
            for shape, count in ROUNDS.items()
        }
    if "capacity" in sections:
        figures["capacity"] = capacity(reps)
    return figures


def report(figures: dict[str, Any], plain: dict[str, Any], out: Callable[[str], None]) -> None:
    if "build" in figures:
        out("\n## Build + encode a round with new events (µs per round, median of 5 timings)\n")
        out("| shape | TokenSpeed Structs | tskv | × TokenSpeed | tskv strict | tskv, no msgspec |")
        out("|---|---|---|---|---|---|")
        for shape, row in figures["build"].items():
            base = row.get("TokenSpeed Structs", math.nan)
            nomsgspec = plain.get("build", {}).get(shape, {}).get("tskv", math.nan)
            out(
                f"| {shape} | {base:.1f} | {row['tskv']:.1f} | {row['tskv'] / base:.2f} | "
                f"{row['tskv, strict']:.1f} | {nomsgspec:.1f} |"
            )
        out("\nFrom the scheduler's own event objects (`scheduler_kv_event_to_wire_event`):\n")
        out("| shape | TokenSpeed from scheduler objects | tskv from scheduler objects | × |")
        out("|---|---|---|---|")
        for shape, row in figures["build"].items():
            base = row.get("TokenSpeed from scheduler objects", math.nan)
            ours = row["tskv from scheduler objects"]
            out(f"| {shape} | {base:.1f} | {ours:.1f} | {ours / base:.2f} |")
    if "decode" in figures:
        out("\n## Decode a batch (µs per batch, median of 5 timings)\n")
        out("| shape | msgspec typed (TokenSpeed Structs) | tskv | × msgspec | tskv, no msgspec |")
        out("|---|---|---|---|---|")
        for shape, row in figures["decode"].items():
            base = row.get("msgspec typed", math.nan)
            nomsgspec = plain.get("decode", {}).get(shape, {}).get("tskv", math.nan)
            out(
                f"| {shape} | {base:.1f} | {row['tskv']:.1f} | {row['tskv'] / base:.2f} | "
                f"{nomsgspec:.1f} |"
            )
    if "subscriber" in figures:
        out("\n## A router decoding every batch (batches/s, median (min..max))\n")
        out("| shape | bare pyzmq SUB + msgspec typed decode | open_subscriber | × bare |")
        out("|---|---|---|---|")
        for shape, row in figures["subscriber"].items():
            base = row.get("bare pyzmq + msgspec", [math.nan])
            ours = row["open_subscriber"]
            ratio = statistics.median(ours) / statistics.median(base)
            out(f"| {shape} | {fmt(base)} | {fmt(ours)} | {ratio:.2f} |")
    if "capacity" in figures:
        out("\n## Publisher capacity, new events every round (batches/s, median (min..max))\n")
        names = list(next(iter(figures["capacity"].values())))
        out("| shape | " + " | ".join(names) + " | Trio × baseline | tskv, no msgspec |")
        out("|---|" + "---|" * (len(names) + 2))
        for shape, row in figures["capacity"].items():
            ratio = statistics.median(row["tskv Trio"]) / statistics.median(row["baseline"])
            nomsgspec = plain.get("capacity", {}).get(shape, {}).get("tskv Trio", [math.nan])
            cells = " | ".join(fmt(row[name]) for name in names)
            out(f"| {shape} | {cells} | {ratio:.2f} | {fmt(nomsgspec)} |")


def latency_section(out: Callable[[str], None]) -> None:
    out("\n## Latency, publish() to decoded at the subscriber, 1,000 rounds/s (small rounds)\n")
    out("| condition | p50 | p99 | max | batches | replayed meanwhile |")
    out("|---|---|---|---|---|---|")
    for replaying in (False, True):
        latencies, replayed = paced_latencies(replaying)
        ordered = sorted(latencies)
        p50 = ordered[len(ordered) // 2] * 1e3
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3
        label = "while 10,000-batch replays are served" if replaying else "steady"
        out(
            f"| {label} | {p50:.2f} ms | {p99:.2f} ms | {ordered[-1] * 1e3:.2f} ms "
            f"| {len(latencies)} | {replayed:,} |"
        )


def shutdown_section(out: Callable[[str], None]) -> None:
    out("\n## Shutdown (time to leave `open_publisher`, median (min..max) of 5)\n")
    out("| condition | time |")
    out("|---|---|")
    for full in (False, True):
        samples = [shutdown_time(full) for _ in range(5)]
        label = "full queue (100,000 small batches), no subscriber" if full else "empty queue"
        out(f"| {label} | {fmt(samples, ' ms', 1e3, 1)} |")


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


# -- snapshots: what keeping the state costs ---------------------------------------------------

CACHED = {"small": 10_000, "large": 100_000, "huge": 100_000}  # blocks cached in steady state
# The state's rounds are encoded on TokenSpeed's wire, which carries no tier: the publisher
# keeps an untiered state for it (CacheState(tiered=False)), and so does every figure here.


def blocks_per_round(shape: str) -> int:
    events, hashes, _ = SHAPES[shape]
    return events * hashes


def fill_rounds(shape: str) -> int:
    """Churning rounds after which the cache is full and has turned over once: a steady state."""
    return 2 * CACHED[shape] // blocks_per_round(shape) + 1


def churn_maker(shape: str, cached: int | None = None) -> Callable[[], list[KVEvent]]:
    """Rounds as a busy cache makes them: every block new (fresh hashes and token lists, token
    ids above 256 as real ones are, so each is an int object of its own), and once the cache is
    full, as many old blocks removed as were stored. Hashes are spread over 63 bits as an
    engine's are: counting ones would land in neighbouring dict slots and flatter the state."""
    events, hashes, tokens = SHAPES[shape]
    per_round = blocks_per_round(shape)
    window = -(-(cached or CACHED[shape]) // per_round)  # rounds a block stays cached
    counter = iter(range(1 << 62))
    mask = HASH_MASK

    def make() -> list[KVEvent]:
        base = next(counter) * per_round
        made: list[KVEvent] = []
        parent = None
        for n in range(events):
            first = base + n * hashes
            made.append(
                BlockStored(
                    [block * SCRAMBLE & mask for block in range(first, first + hashes)],
                    parent,
                    list(range(1000 + base, 1000 + base + tokens)),
                    16,
                )
            )
            parent = (first + hashes - 1) * SCRAMBLE & mask
        old = base - window * per_round
        if old >= 0:
            made.append(
                BlockRemoved([block * SCRAMBLE & mask for block in range(old, old + per_round)])
            )
        return made

    return make


def _churn_round(make: Callable[[], list[KVEvent]], state: CacheState | None) -> None:
    events = make()
    payload = encode_round(time.time(), events, 0)
    if state is not None:
        assert payload is not None
        state.apply(payload, events)


def state_costs() -> dict[str, dict[str, float]]:
    """µs per round: building and encoding a churning round, then also following it in the
    state (the publish task's extra work when snapshots are on)."""
    figures: dict[str, dict[str, float]] = {}
    for shape in SHAPES:
        n = {"small": 3000, "large": 200, "huge": 60}[shape]
        make, state = churn_maker(shape), CacheState(tiered=False)
        plain = churn_maker(shape)  # its own hashes: the state sees every round of `make`
        for _ in range(fill_rounds(shape)):
            _churn_round(make, state)  # a full cache: removals as many as stores

        samples: dict[str, list[float]] = {"plain": [], "state": []}
        for _ in range(3):  # alternating, so drift hits both alike
            samples["plain"].append(_per_call(partial(_churn_round, plain, None), n, reps=1))
            samples["state"].append(_per_call(partial(_churn_round, make, state), n, reps=1))
        figures[shape] = {name: statistics.median(v) for name, v in samples.items()}
        figures[shape]["blocks"] = state.blocks
    return figures


def _state_memory(shape: str, conn: Connection) -> None:
    """Bytes per cached block the state keeps alive (its entries and the events they hold),
    measured with tracemalloc in a fresh process."""
    import tracemalloc

    make, state = churn_maker(shape), CacheState(tiered=False)
    tracemalloc.start()
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(fill_rounds(shape)):
        _churn_round(make, state)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    conn.send(grown / state.blocks)


def _snapshot_time(blocks_wanted: int, conn: Connection) -> None:
    """Freezing the state (done at once, holding up live batches) and making every part (done a
    part at a time between live batches), in ms."""
    make, state = churn_maker("large", blocks_wanted), CacheState(tiered=False)
    while state.blocks < blocks_wanted:  # the cache holds blocks_wanted before it churns
        _churn_round(make, state)
    # Then churns until every block has been replaced once, as a running cache has: its dict
    # is then full of deleted slots, which make a careless copy three times as slow.
    for _ in range(-(-blocks_wanted // blocks_per_round("large"))):
        _churn_round(make, state)
    started = time.perf_counter()
    frozen = state.freeze(0)
    frozen_at = time.perf_counter()
    builder = SnapshotBuilder(frozen, 0.0, 0, "tokenspeed")
    longest = 0.0
    while True:
        part_started = time.perf_counter()
        if builder.next_payload() is None:
            break
        longest = max(longest, time.perf_counter() - part_started)
    done = time.perf_counter()
    conn.send(
        {
            "blocks": state.blocks,
            "freeze_ms": (frozen_at - started) * 1e3,
            "parts_ms": (done - frozen_at) * 1e3,
            "parts": builder.parts_made,
            "longest_part_ms": longest * 1e3,
        }
    )


def run_snapshot_capacity(shape: str, count: int, snapshots: bool) -> Row:
    """The Trio publisher with a replay endpoint, churning rounds, snapshots on or off, after
    filling the cache (a steady state)."""
    config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, hwm=0, snapshots=snapshots)
    return _trio_capacity(churn_maker(shape), config, count, fill_rounds(shape))


def snapshots_section(reps: int, out: Callable[[str], None]) -> None:
    out("\n## Snapshots: what keeping the cache's state costs\n")
    out(
        "Rounds that churn as a full cache does (every block new, as many removed), µs per round "
        "(median of 3):\n"
    )
    out("| shape | blocks cached | build + encode | + follow in the state | extra | × |")
    out("|---|---|---|---|---|---|")
    for shape, row in state_costs().items():
        extra = row["state"] - row["plain"]
        out(
            f"| {shape} | {row['blocks']:,.0f} | {row['plain']:.1f} | {row['state']:.1f} | "
            f"{extra:.1f} | {row['state'] / row['plain']:.2f} |"
        )
    out(
        "\nPublisher capacity with a replay endpoint, churning rounds: batches/s, and the "
        "publishing process's CPU µs per batch (median of the runs):\n"
    )
    out("| shape | snapshots off | snapshots on | on × off | CPU off | CPU on | CPU on × off |")
    out("|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        count = ROUNDS[shape] // 2
        runs: dict[bool, list[Row]] = {False: [], True: []}
        for _ in range(reps):
            for snapshots in runs:
                gc.collect()
                runs[snapshots].append(run_snapshot_capacity(shape, count, snapshots))
        rates = {on: [row["batches_per_s"] for row in rows] for on, rows in runs.items()}
        cpu = {
            on: statistics.median(row["cpu_us_per_batch"] for row in rows)
            for on, rows in runs.items()
        }
        ratio = statistics.median(rates[True]) / statistics.median(rates[False])
        out(
            f"| {shape} | {fmt(rates[False])} | {fmt(rates[True])} | {ratio:.2f} | "
            f"{cpu[False]:.1f} | {cpu[True]:.1f} | {cpu[True] / cpu[False]:.2f} |"
        )
    out("\nMemory the state keeps alive per cached block (tracemalloc, fresh process):\n")
    for shape in SHAPES:
        _, hashes, tokens = SHAPES[shape]
        per_block = in_fresh_process(_state_memory, shape)
        out(
            f"- {shape} rounds ({tokens // hashes} tokens a block): {per_block:,.0f} B per block, "
            f"{per_block * 1e6 / 2**20:,.0f} MiB per million blocks"
        )
    out("\nServing one snapshot (fresh process each):\n")
    out("| blocks | freeze (at once) | make every part | parts | longest part |")
    out("|---|---|---|---|---|")
    for blocks in (10_000, 100_000, 1_000_000):
        t = in_fresh_process(_snapshot_time, blocks)
        out(
            f"| {t['blocks']:,} | {t['freeze_ms']:.1f} ms | {t['parts_ms']:.0f} ms | "
            f"{t['parts']:,} | {t['longest_part_ms']:.2f} ms |"
        )


SECTIONS = [
    "build",
    "decode",
    "subscriber",
    "capacity",
    "latency",
    "shutdown",
    "memory",
    "snapshots",
    "index",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tskv.bench", description=__doc__)
    parser.add_argument("--reps", type=int, default=3, help="repetitions per figure (3)")
    parser.add_argument("--only", choices=SECTIONS, action="append", help="only these sections")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # for the child
    args = parser.parse_args(argv)
    sections = args.only or SECTIONS
    if args.json:
        print(json.dumps(measure(sections, args.reps)))
        return 0

    def out(line: str) -> None:
        print(line, flush=True)

    encoders = "msgspec and msgpack" if msgspec is not None else "msgpack only"
    out(f"# tskv {tskv.__version__} benchmark, {time.strftime('%Y-%m-%d %H:%M')}")
    out(
        f"\n{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"pyzmq {zmq.pyzmq_version()} (libzmq {zmq.zmq_version()}), encoders: {encoders}"
    )
    started = time.monotonic()
    measured = measure(sections, args.reps)
    comparable = [s for s in ("build", "decode", "capacity") if s in sections]
    plain = child_figures(comparable) if msgspec is not None and comparable else {}
    report(measured, plain, out)
    if "latency" in sections:
        latency_section(out)
    if "shutdown" in sections:
        shutdown_section(out)
    if "memory" in sections:
        memory_section(out)
    if "snapshots" in sections:
        snapshots_section(args.reps, out)
    if "index" in sections:
        from tskv.bench_index import index_section

        index_section(out)
    out(f"\n(benchmark took {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
