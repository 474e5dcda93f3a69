"""`python -m tskv.bench` (`nox -s bench`, `tskv bench`): tskv against the ceiling, in one run.

Machines here are shared and noisy, so every figure comes with a reference measured in the same
run, with the same subscriber process: the ceiling (a plain pyzmq PUB sending pre-encoded
payloads: no encoding, no queue, no Trio) and the baseline (the conventional threaded publisher
TokenSpeed and vLLM ship: a queue.Queue, one thread, msgspec, blocking pyzmq). Each figure is the
median of several alternating repetitions, with the spread (min..max).

This is not a test: nothing here passes or fails.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import multiprocessing
import os
import platform
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import trio
import trio.testing
import zmq

import tskv
from tskv import codec as codec_module
from tskv._trio_zmq import bound_endpoint
from tskv.config import KVEventsConfig
from tskv.events import BlockStored, KVEvent, KVEventBatch
from tskv.publisher import open_publisher

LOOPBACK = "tcp://127.0.0.1:*"


def shape(name: str) -> list[KVEvent]:
    """The three round shapes: small and large rounds, and one huge prefill."""
    if name == "huge":
        return [BlockStored(range(10**6, 10**6 + 2048), None, range(32_768), 16)]
    count = 10 if name == "small" else 200
    return [
        BlockStored([4 * i + 1, 4 * i + 2, 4 * i + 3, 4 * i + 4], 4 * i, range(64), 16)
        for i in range(count)
    ]


ROUNDS = {"small": 20_000, "large": 2_000, "huge": 300}


# -- the subscriber process ---------------------------------------------------------------------


def _subscriber(endpoint: str, count: int, decode: bool, conn: Connection) -> None:
    """Receive `count` batches (decoding each, or only counting frames) and report timings."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    conn.send("connected")
    received = 0
    first = last = 0.0
    latencies: list[float] = []
    sock.setsockopt(zmq.RCVTIMEO, 20_000)
    try:
        while received < count:
            frames = sock.recv_multipart()
            now = time.time()
            if received == 0:
                first = time.monotonic()
            if decode:
                batch = tskv.decode_batch(frames[2])
                latencies.append(now - batch.ts)
            received += 1
        last = time.monotonic()
    except zmq.Again:
        last = time.monotonic()
    conn.send((received, first, last, latencies))
    sock.close(linger=0)


@contextmanager
def subscriber_process(endpoint: str, count: int, decode: bool) -> Iterator[Connection]:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_subscriber, args=(endpoint, count, decode, child))
    process.start()
    assert parent.recv() == "connected"
    try:
        yield parent
    finally:
        process.join(60)
        if process.is_alive():
            process.kill()


def _wait_subscribed(sock: zmq.Socket[bytes]) -> None:
    """Block until an XPUB sees a subscription: the plain senders' answer to the slow joiner."""
    sock.setsockopt(zmq.RCVTIMEO, 20_000)
    sock.recv()


# -- the three publishers ------------------------------------------------------------------------


def run_tskv(
    events: list[KVEvent], count: int, decode: bool, codec: str | None = None
) -> dict[str, Any]:
    """tskv's Trio publisher: publish() each round, the publish task sends."""
    if codec is not None:
        _set_codec(codec)
    result: dict[str, Any] = {}

    async def main() -> None:
        config = KVEventsConfig(endpoint=LOOPBACK, hwm=0, max_queue_size=100_000)
        async with open_publisher(config) as publisher:
            with subscriber_process(publisher.endpoint, count, decode) as conn:
                await publisher.wait_for_subscriber()
                inside = 0.0
                started = time.monotonic()
                for _ in range(count):
                    before = time.perf_counter()
                    await publisher.publish(events)
                    inside += time.perf_counter() - before
                result["publish_us"] = inside / count * 1e6
                received, _, last, latencies = await trio.to_thread.run_sync(conn.recv)
        result.update(_rates(count, received, started, last, latencies))

    trio.run(main)
    return result


def run_ceiling(events: list[KVEvent], count: int, decode: bool) -> dict[str, Any]:
    """A plain pyzmq PUB sending pre-encoded payloads in a loop: what the socket can do."""
    payload = tskv.encode_batch(KVEventBatch(time.time(), events, 0))
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.XPUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(LOOPBACK)
    endpoint = bound_endpoint(sock)
    copy = len(payload) < 65536
    try:
        with subscriber_process(endpoint, count, decode) as conn:
            _wait_subscribed(sock)
            started = time.monotonic()
            for seq in range(count):
                sock.send_multipart([b"", seq.to_bytes(8, "big"), payload], copy=copy)
            received, _, last, _ = conn.recv()
    finally:
        sock.close(linger=0)
    return _rates(count, received, started, last, [])


class _BaselinePublisher:
    """The conventional design, written here: queue.Queue, a thread, msgspec, blocking pyzmq."""

    def __init__(self, endpoint: str) -> None:
        import msgspec

        self._encode = msgspec.msgpack.Encoder().encode
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=100_000)
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.XPUB)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.bind(endpoint)
        self.endpoint = bound_endpoint(self.sock)
        self._buffer: list[tuple[int, bytes]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def publish(self, batch: Any) -> None:
        self._queue.put_nowait(batch)

    def _run(self) -> None:
        seq = 0
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            payload = self._encode(batch)
            seq_bytes = seq.to_bytes(8, "big")
            self._buffer.append((seq, payload))
            self.sock.send_multipart([b"", seq_bytes, payload])
            seq += 1

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.sock.close(linger=0)


def _msgspec_batch(events: list[KVEvent]) -> Any:
    """The baseline's own event types: msgspec Structs, array-like and tagged, as TokenSpeed's."""
    import msgspec

    class Stored(msgspec.Struct, array_like=True, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int

    class Batch(msgspec.Struct, array_like=True):
        ts: float
        events: list[Stored]
        attn_dp_rank: int

    stored = [
        Stored(list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size)
        for e in events
        if isinstance(e, BlockStored)
    ]
    return lambda: Batch(time.time(), stored, 0)


def _run_sync_publisher(
    endpoint: str,
    wait_subscribed: Callable[[], None],
    publish: Callable[[Any], None],
    make_batch: Callable[[], Any],
    count: int,
    decode: bool,
) -> dict[str, Any]:
    """Publish `count` batches from this (plain, non-Trio) thread, timing each publish call."""
    with subscriber_process(endpoint, count, decode) as conn:
        wait_subscribed()
        inside = 0.0
        started = time.monotonic()
        for _ in range(count):
            batch = make_batch()
            before = time.perf_counter()
            publish(batch)
            inside += time.perf_counter() - before
        received, _, last, latencies = conn.recv()
    result = _rates(count, received, started, last, latencies)
    result["publish_us"] = inside / count * 1e6
    return result


def run_baseline(events: list[KVEvent], count: int, decode: bool) -> dict[str, Any]:
    if "msgspec" not in codec_module.available_codecs():
        return {"batches_per_s": math.nan, "publish_us": math.nan}  # the baseline needs msgspec
    publisher = _BaselinePublisher(LOOPBACK)
    try:
        return _run_sync_publisher(
            publisher.endpoint,
            functools.partial(_wait_subscribed, publisher.sock),
            publisher.publish,
            _msgspec_batch(events),
            count,
            decode,
        )
    finally:
        publisher.shutdown()


def run_threaded_tskv(events: list[KVEvent], count: int, decode: bool) -> dict[str, Any]:
    """tskv's drop-in ZmqEventPublisher, for its scheduler-side cost."""
    publisher = tskv.ZmqEventPublisher(0, endpoint=LOOPBACK, hwm=0)

    def wait_subscribed() -> None:
        deadline = time.monotonic() + 20
        while publisher.statistics().subscriptions < 1 and time.monotonic() < deadline:
            time.sleep(0.001)  # a plain thread: poll the publisher's own count

    try:
        return _run_sync_publisher(
            publisher.endpoint,
            wait_subscribed,
            publisher.publish,
            lambda: KVEventBatch(time.time(), events, 0),
            count,
            decode,
        )
    finally:
        publisher.shutdown()


def _rates(
    count: int, received: int, started: float, last: float, latencies: list[float]
) -> dict[str, Any]:
    elapsed = max(last - started, 1e-9)
    result: dict[str, Any] = {"batches_per_s": received / elapsed, "received": received}
    if received < count:
        result["missing"] = count - received
    if latencies:
        result["latencies"] = latencies
    return result


# -- repetitions and reporting ---------------------------------------------------------------


def median_spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def fmt(values: list[float], unit: str = "", scale: float = 1.0, digits: int = 0) -> str:
    if any(math.isnan(value) for value in values):
        return "n/a (needs msgspec)"
    mid, low, high = median_spread([v * scale for v in values])
    return f"{mid:,.{digits}f}{unit} ({low:,.{digits}f}..{high:,.{digits}f})"


def repeat(runs: Mapping[str, Callable[[], dict[str, Any]]], reps: int) -> dict[str, list[Any]]:
    """Run each contender `reps` times, alternating, so drift hits all of them alike."""
    results: dict[str, list[Any]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            gc.collect()
            results[name].append(run())
    return results


def _set_codec(name: str) -> None:
    codec_module._ACTIVE = codec_module.available_codecs()[name]


def throughput_table(
    reps: int, decode: bool, codecs: list[str], out: Callable[[str], None]
) -> None:
    title = (
        "End-to-end, decoding subscriber" if decode else "Publisher capacity, counting subscriber"
    )
    out(f"\n## {title} (batches/s, median (min..max) of {reps}; ratios of medians)\n")
    header = "| shape | ceiling | baseline (threaded, msgspec) |"
    rule = "|---|---|---|"
    for name in codecs:
        header += f" tskv ({name}) | × ceiling | × baseline |"
        rule += "---|---|---|"
    out(header)
    out(rule)
    for shape_name, count in ROUNDS.items():
        events = shape(shape_name)
        runs: dict[str, Callable[[], dict[str, Any]]] = {
            "ceiling": functools.partial(run_ceiling, events, count, decode),
            "baseline": functools.partial(run_baseline, events, count, decode),
        }
        for name in codecs:
            runs[name] = functools.partial(run_tskv, events, count, decode, name)
        results = repeat(runs, reps)
        rates = {k: [r["batches_per_s"] for r in v] for k, v in results.items()}
        ceiling = statistics.median(rates["ceiling"])
        baseline = statistics.median(rates["baseline"])
        row = f"| {shape_name} ({len(events)} events) | {fmt(rates['ceiling'])} | "
        row += f"{fmt(rates['baseline'])} |"
        for name in codecs:
            mid = statistics.median(rates[name])
            row += f" {fmt(rates[name])} | {mid / ceiling:.2f} | {mid / baseline:.2f} |"
        out(row)
        lost = {k: sum(r.get("missing", 0) for r in v) for k, v in results.items()}
        if any(lost.values()):
            out(f"|   (batches not received: {lost}) |")


def encode_table(out: Callable[[str], None]) -> None:
    out("\n## Encode cost (µs per batch, median of 5 timings)\n")
    out("| shape | msgspec | msgpack | msgpack.packb on plain lists | packb share of msgpack |")
    out("|---|---|---|---|---|")
    codecs = codec_module.available_codecs()
    for shape_name in ROUNDS:
        batch = KVEventBatch(time.time(), shape(shape_name), 0)
        plain = [
            batch.ts,
            [[p[0], list(p[1]), p[2], list(p[3]), p[4]] for p in codec_module.to_plain(batch)[1]],
            0,
        ]
        n = {"small": 5000, "large": 300, "huge": 100}[shape_name]
        timings = {
            name: _time_per_call(functools.partial(c.encode_batch, batch), n)
            for name, c in codecs.items()
        }
        packb = _time_per_call(functools.partial(msgpack.packb, plain), n)
        share = packb / timings["msgpack"]
        out(
            f"| {shape_name} | {timings.get('msgspec', float('nan')):.1f} | "
            f"{timings['msgpack']:.1f} | {packb:.1f} | {share:.0%} |"
        )


def _time_per_call(fn: Callable[[], object], n: int) -> float:
    samples = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - started) / n * 1e6)
    return statistics.median(samples)


def scheduler_cost_table(reps: int, codecs: list[str], out: Callable[[str], None]) -> None:
    out("\n## Scheduler-side cost (µs inside publish() per round, median (min..max))\n")
    out("| shape | Trio publish() | threaded ZmqEventPublisher.publish() | baseline publish() |")
    out("|---|---|---|---|")
    for shape_name in ("small", "large"):
        events = shape(shape_name)
        count = ROUNDS[shape_name] // 4
        for name in codecs:
            _set_codec(name)
            runs = {
                "trio": functools.partial(run_tskv, events, count, False, name),
                "threaded": functools.partial(run_threaded_tskv, events, count, False),
                "baseline": functools.partial(run_baseline, events, count, False),
            }
            results = repeat(runs, reps)
            cost = {k: [r["publish_us"] for r in v] for k, v in results.items()}
            out(
                f"| {shape_name}, {name} | {fmt(cost['trio'], digits=1)} | "
                f"{fmt(cost['threaded'], digits=1)} | {fmt(cost['baseline'], digits=1)} |"
            )


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def latency_table(out: Callable[[str], None]) -> None:
    out("\n## Latency, publish() to decoded at the subscriber, 1,000 rounds/s (small rounds)\n")
    out("| condition | p50 | p99 | max | batches | replayed meanwhile |")
    out("|---|---|---|---|---|---|")
    for replaying in (False, True):
        latencies, replayed = _paced_latencies(replaying)
        p50, p99 = _percentile(latencies, 0.5) * 1e3, _percentile(latencies, 0.99) * 1e3
        label = "while 10,000-batch replays are served" if replaying else "steady"
        out(
            f"| {label} | {p50:.2f} ms | {p99:.2f} ms | {max(latencies) * 1e3:.2f} ms "
            f"| {len(latencies)} | {replayed:,} |"
        )


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


def _paced_latencies(replaying: bool) -> tuple[list[float], int]:
    """Live latencies at 1,000 rounds/s, and how many batches a replay client took meanwhile."""
    events = shape("small")
    count = 3000
    latencies: list[float] = []
    replayed = 0

    async def main() -> None:
        nonlocal replayed
        config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, hwm=0)
        async with open_publisher(config) as publisher:
            if replaying:
                for _ in range(10_000):
                    await publisher.publish(events)
            with subscriber_process(publisher.endpoint, count, True) as conn:
                await publisher.wait_for_subscriber()
                if replaying:
                    context = multiprocessing.get_context("spawn")
                    replay_conn, child = context.Pipe()
                    assert publisher.replay_endpoint is not None
                    client = context.Process(
                        target=_replay_client, args=(publisher.replay_endpoint, child)
                    )
                    client.start()
                    await trio.to_thread.run_sync(replay_conn.recv)
                next_round = trio.current_time()
                for _ in range(count):
                    await publisher.publish(events)
                    next_round += 0.001
                    await trio.sleep_until(next_round)
                latencies.extend((await trio.to_thread.run_sync(conn.recv))[3])
                if replaying:
                    replay_conn.send("stop")
                    replayed = await trio.to_thread.run_sync(replay_conn.recv)
                    client.join()

    trio.run(main)
    return latencies, replayed


def shutdown_table(out: Callable[[str], None]) -> None:
    out("\n## Shutdown (time to leave `open_publisher`, median (min..max) of 5)\n")
    out("| condition | time |")
    out("|---|---|")
    for full in (False, True):
        samples = [_shutdown_time(full) for _ in range(5)]
        label = "full queue (100,000 small batches), no subscriber" if full else "empty queue"
        out(f"| {label} | {fmt(samples, ' ms', 1e3, 1)} |")


def _shutdown_time(full: bool) -> float:
    events = shape("small")
    elapsed = 0.0

    async def main() -> None:
        nonlocal elapsed
        config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
        async with open_publisher(config) as publisher:
            if full:
                payload = tskv.encode_batch(KVEventBatch(time.time(), events, 0))
                for _ in range(config.max_queue_size):  # fill without a checkpoint
                    publisher.publish_encoded_nowait(payload)
            else:
                await trio.sleep(0.05)
            started = time.perf_counter()
        elapsed = time.perf_counter() - started

    trio.run(main)
    return elapsed


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory_growth(conn: Connection) -> None:
    """In a fresh process (so earlier runs' freed memory cannot hide the growth)."""
    grown: list[int] = []

    async def main() -> None:
        config = KVEventsConfig(endpoint=LOOPBACK, buffer_steps=10_000)
        events = shape("small")
        async with open_publisher(config) as publisher:
            for _ in range(100):
                await publisher.publish(events)
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            before = _rss()
            for _ in range(10_000):
                await publisher.publish(events)
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            grown.append(_rss() - before)

    trio.run(main)
    conn.send(grown[0])


def memory_table(out: Callable[[str], None]) -> None:
    out("\n## Memory (resident growth as the replay buffer fills with small batches)\n")
    context = multiprocessing.get_context("spawn")
    samples = []
    for _ in range(3):
        parent, child = context.Pipe()
        process = context.Process(target=_memory_growth, args=(child,))
        process.start()
        samples.append(parent.recv())
        process.join()
    payload = len(tskv.encode_batch(KVEventBatch(time.time(), shape("small"), 0)))
    out(f"- RSS growth per 10,000 buffered small batches: {fmt(samples, ' MiB', 2**-20, 1)}")
    out(f"- the payloads themselves: {payload * 10_000 / 2**20:.1f} MiB ({payload} bytes each)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tskv.bench", description=__doc__)
    parser.add_argument("--reps", type=int, default=3, help="repetitions per figure (3)")
    parser.add_argument(
        "--only",
        choices=["throughput", "capacity", "encode", "cost", "latency", "shutdown", "memory"],
        action="append",
        help="run only these sections",
    )
    args = parser.parse_args(argv)
    sections = args.only or [
        "throughput",
        "capacity",
        "encode",
        "cost",
        "latency",
        "shutdown",
        "memory",
    ]
    codecs = sorted(codec_module.available_codecs(), reverse=True)  # msgspec first
    lines: list[str] = []

    def out(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    out(f"# tskv {tskv.__version__} benchmark, {time.strftime('%Y-%m-%d %H:%M')}")
    out(
        f"\n{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"pyzmq {zmq.pyzmq_version()} (libzmq {zmq.zmq_version()}), encoders: {', '.join(codecs)}"
    )
    started = time.monotonic()
    if "throughput" in sections:
        throughput_table(args.reps, True, codecs, out)
    if "capacity" in sections:
        throughput_table(args.reps, False, codecs, out)
    if "encode" in sections:
        encode_table(out)
    if "cost" in sections:
        scheduler_cost_table(args.reps, codecs, out)
    if "latency" in sections:
        latency_table(out)
    if "shutdown" in sections:
        shutdown_table(out)
    if "memory" in sections:
        memory_table(out)
    out(f"\n(benchmark took {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
