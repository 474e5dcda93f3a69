"""What keeping the cache state costs a publisher, a snapshot's size and time, and capacity with
snapshots on and off."""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection

import trio
import trio.testing
import zmq

from benchmarks.capacity import trio_capacity
from benchmarks.codec_costs import per_call
from benchmarks.helpers import fmt, in_fresh_process
from benchmarks.rounds import (
    ROUNDS,
    SHAPES,
    Row,
    blocks_per_round,
    churn_maker,
    fill_rounds,
)
from tskv.core import frames
from tskv.core.codec import encode_round
from tskv.core.config import KVEventsConfig
from tskv.core.endpoints import LOOPBACK
from tskv.core.events import KVEvent
from tskv.core.snapshot import CacheState, SnapshotBuilder
from tskv.shells._trio_zmq import TrioSocket
from tskv.shells.publisher import open_publisher


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
            samples["plain"].append(per_call(partial(_churn_round, plain, None), n, reps=1))
            samples["state"].append(per_call(partial(_churn_round, make, state), n, reps=1))
        figures[shape] = {name: statistics.median(v) for name, v in samples.items()}
        figures[shape]["blocks"] = state.blocks
    return figures


def _state_memory(shape: str, conn: Connection) -> None:
    """Bytes per cached block the state keeps alive (its entries and the events they hold),
    measured with tracemalloc in a fresh process."""

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


def _serving_hold(blocks_wanted: int, conn: Connection) -> None:
    """A publisher serving one snapshot to a client in its own loop: the longest time the loop
    was held without another task running (a scheduler's loop, in a real engine), in ms."""

    async def main() -> dict[str, float]:
        config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
        async with open_publisher(config) as publisher, trio.open_nursery() as nursery:
            make = churn_maker("small", blocks_wanted)
            for _ in range(-(-blocks_wanted // blocks_per_round("small"))):
                await publisher.publish(make())  # a new round each time, as a scheduler's
            await trio.testing.wait_all_tasks_blocked()
            longest = 0.0

            async def tick() -> None:
                nonlocal longest
                last = time.perf_counter()
                while True:
                    await trio.lowlevel.checkpoint()
                    now = time.perf_counter()
                    longest, last = max(longest, now - last), now

            assert publisher.replay_endpoint is not None
            client = TrioSocket(zmq.Context.instance().socket(zmq.DEALER))
            client.sock.connect(publisher.replay_endpoint)
            nursery.start_soon(tick)
            started = time.perf_counter()
            await client.send(frames.snapshot_request())
            part = frames.SnapshotPart
            while isinstance(frames.parse_replay_reply(await client.receive()), part):
                pass
            served = time.perf_counter() - started
            client.close()
            nursery.cancel_scope.cancel()
        return {"blocks": blocks_wanted, "served_ms": served * 1e3, "longest_ms": longest * 1e3}

    conn.send(trio.run(main))


def run_snapshot_capacity(shape: str, count: int, snapshots: bool) -> Row:
    """The Trio publisher with a replay endpoint, churning rounds, snapshots on or off, after
    filling the cache (a steady state)."""
    config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, hwm=0, snapshots=snapshots)
    return trio_capacity(churn_maker(shape), config, count, fill_rounds(shape))


def snapshots_section(out: Callable[[str], None], reps: int) -> None:
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
    out("\nThrough a publisher, its client in the same loop (fresh process each):\n")
    out("| blocks | served in | longest the loop was held |")
    out("|---|---|---|")
    for blocks in (100_000, 400_000):
        t = in_fresh_process(_serving_hold, blocks)
        out(f"| {t['blocks']:,} | {t['served_ms']:.0f} ms | {t['longest_ms']:.1f} ms |")
