"""Latency from publish() to the decoded batch, with and without a replay under way, and the
time leaving open_publisher takes."""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import trio
import trio.testing
import zmq

import tskv
from benchmarks.helpers import child, fmt, percentile
from benchmarks.rounds import round_makers
from tskv.core import frames
from tskv.core.codec import encode_round
from tskv.core.config import KVEventsConfig
from tskv.core.endpoints import LOOPBACK
from tskv.shells.publisher import open_publisher


def _replay_client(endpoint: str, conn: Connection) -> None:
    """Another process asking for the whole buffer again and again until told to stop."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    conn.send("connected")
    replayed = 0
    while not conn.poll():
        sock.send_multipart(frames.replay_request(0))
        while True:
            reply = frames.parse_replay_reply(sock.recv_multipart())
            if isinstance(reply, frames.ReplayReply) and reply.is_end:
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


def latency_section(out: Callable[[str], None], reps: int) -> None:
    """`reps` runs of each condition, their latencies pooled."""
    out("\n## Latency, publish() to decoded at the subscriber, 1,000 rounds/s (small rounds)\n")
    out("| condition | p50 | p99 | max | batches | replayed meanwhile |")
    out("|---|---|---|---|---|---|")
    for replaying in (False, True):
        latencies: list[float] = []
        replayed = 0
        for _ in range(reps):
            run, served = paced_latencies(replaying)
            latencies.extend(run)
            replayed += served
        p50, p99 = percentile(latencies, 0.5) * 1e3, percentile(latencies, 0.99) * 1e3
        label = "while 10,000-batch replays are served" if replaying else "steady"
        out(
            f"| {label} | {p50:.2f} ms | {p99:.2f} ms | {max(latencies) * 1e3:.2f} ms "
            f"| {len(latencies)} | {replayed:,} |"
        )


def shutdown_section(out: Callable[[str], None], reps: int) -> None:
    out(f"\n## Shutdown (time to leave `open_publisher`, median (min..max) of {reps})\n")
    out("| condition | time |")
    out("|---|---|")
    for full in (False, True):
        samples = [shutdown_time(full) for _ in range(reps)]
        label = "full queue (100,000 small batches), no subscriber" if full else "empty queue"
        out(f"| {label} | {fmt(samples, ' ms', 1e3, 1)} |")
