"""`tskv demo` and `tskv simulate`: the simulated scheduler publishing through real sockets.

The demo closes the loop in one process: simulated schedulers publish, subscribers rebuild
which blocks each rank holds, and the run ends by comparing that view with the schedulers' own
caches. Equal means no event was lost on the way.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import TextIO

import attrs
import trio

from tskv.codec import WireFormat
from tskv.config import KVEventsConfig
from tskv.endpoints import LOOPBACK
from tskv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from tskv.publisher import Publisher, open_publisher
from tskv.sequencer import Loss
from tskv.sim import Simulator, Workload, run_round
from tskv.subscriber import Subscriber, open_subscriber


@attrs.frozen
class SimOptions:
    """How the simulated schedulers run; the CLI's flags map onto these one to one."""

    rounds: int | None = 300
    duration: float | None = None
    requests_per_round: int = 2
    block_size: int = 16
    cache_blocks: int = 512
    ranks: int = 1
    seed: int = 0
    round_interval: float = 0.01  # seconds between rounds: a decode step's order of magnitude
    medium: str | None = None  # the storage tier every event names (needs the vLLM wire)
    wire_format: WireFormat = "tokenspeed"


@attrs.define
class _Rank:
    sim: Simulator
    workload: Workload
    publisher: Publisher
    batches: int = 0
    events: int = 0


class _SchedulerLoop:
    """Runs every rank's simulator round by round and publishes what each round emits."""

    def __init__(self, options: SimOptions, publishers: list[Publisher]) -> None:
        self.options = options
        self.rounds = 0
        self.ranks = [
            _Rank(
                Simulator(options.cache_blocks, options.block_size, medium=options.medium),
                Workload(options.seed + rank, options.block_size),
                publisher,
            )
            for rank, publisher in enumerate(publishers)
        ]

    def _done(self, started: float) -> bool:
        if self.options.rounds is not None and self.rounds >= self.options.rounds:
            return True
        return self.options.duration is not None and time.monotonic() - started >= (
            self.options.duration
        )

    async def run(self) -> None:
        started = time.monotonic()
        next_round = trio.current_time()
        while not self._done(started):
            for rank in self.ranks:
                events = run_round(rank.sim, rank.workload, self.options.requests_per_round)
                if events:
                    await rank.publisher.publish(events)
                    rank.batches += 1
                    rank.events += len(events)
            self.rounds += 1
            next_round += self.options.round_interval
            await trio.sleep_until(next_round)  # a steady pace, not drifting with the work

    @property
    def hit_rate(self) -> float:
        hits = sum(rank.sim.cache.hits for rank in self.ranks)
        total = hits + sum(rank.sim.cache.misses for rank in self.ranks)
        return hits / total if total else 0.0


class CacheView:
    """What a KV-aware router knows of one worker: the blocks its events say it holds."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.last_seq: int | None = None
        self.batches = 0
        self.changed = trio.lowlevel.ParkingLot()

    def apply(self, seq: int, events: Sequence[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.blocks.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()
        self.last_seq = seq
        self.batches += 1
        self.changed.unpark_all()


async def _consume(sub: Subscriber, view: CacheView) -> None:
    async for seq, batch in sub:
        view.apply(seq, batch.events)


def _progress(loop: _SchedulerLoop, subs: list[Subscriber], views: list[CacheView]) -> str:
    batches = sum(rank.batches for rank in loop.ranks)
    events = sum(rank.events for rank in loop.ranks)
    cached = sum(len(rank.sim.cached_hashes()) for rank in loop.ranks)
    repaired = sum(sub.statistics().repaired for sub in subs)
    lost = sum(sub.statistics().lost for sub in subs)
    received = sum(view.batches for view in views)
    return (
        f"round {loop.rounds:>5}  batches {batches:>6} (received {received:>6})  "
        f"events {events:>7}  blocks cached {cached:>5}  prefix hit rate {loop.hit_rate:6.1%}  "
        f"gaps repaired {repaired}  lost {lost}"
    )


async def demo(options: SimOptions, out: TextIO = sys.stdout, live: bool | None = None) -> bool:
    """Run the closed loop and print progress and a summary; True if every view matched."""
    check_options(options)
    live = out.isatty() if live is None else live
    losses: list[Loss] = []
    async with AsyncExitStack() as stack:
        publishers = [
            await stack.enter_async_context(
                open_publisher(
                    KVEventsConfig(
                        endpoint=LOOPBACK,
                        replay_endpoint=LOOPBACK,
                        wire_format=options.wire_format,
                        strict=True,
                    ),
                    rank,
                )
            )
            for rank in range(options.ranks)
        ]
        subs = [
            await stack.enter_async_context(
                open_subscriber(p.endpoint, p.replay_endpoint, start_seq=0, on_loss=losses.append)
            )
            for p in publishers
        ]
        for publisher in publishers:
            with trio.fail_after(10):
                await publisher.wait_for_subscriber()
        print(
            f"tskv demo: {options.ranks} rank(s) publishing on "
            + ", ".join(p.endpoint for p in publishers),
            file=out,
        )
        loop = _SchedulerLoop(options, publishers)
        views = [CacheView() for _ in publishers]
        async with trio.open_nursery() as nursery:
            for sub, view in zip(subs, views, strict=True):
                nursery.start_soon(_consume, sub, view)
            nursery.start_soon(_report_progress, loop, subs, views, out, live)
            await loop.run()
            with trio.move_on_after(10):  # let each subscriber catch up with its last batch
                for view, sub, rank in zip(views, subs, loop.ranks, strict=True):
                    while view.batches + sub.statistics().lost < rank.batches:
                        await view.changed.park()
            nursery.cancel_scope.cancel()
        if live:
            print(file=out)
        return _summary(loop, subs, views, losses, out)


async def _report_progress(
    loop: _SchedulerLoop, subs: list[Subscriber], views: list[CacheView], out: TextIO, live: bool
) -> None:
    while True:
        line = _progress(loop, subs, views)
        if live:
            print("\r" + line, end="", file=out, flush=True)
            await trio.sleep(0.1)
        else:
            print(line, file=out, flush=True)
            await trio.sleep(1.0)


def _summary(
    loop: _SchedulerLoop,
    subs: list[Subscriber],
    views: list[CacheView],
    losses: list[Loss],
    out: TextIO,
) -> bool:
    print(_progress(loop, subs, views), file=out)
    all_equal = True
    for rank, (state, view) in enumerate(zip(loop.ranks, views, strict=True)):
        actual = state.sim.cached_hashes()
        equal = view.blocks == actual
        all_equal &= equal
        verdict = "EQUAL" if equal else "DIFFERENT"
        detail = (
            ""
            if equal
            else f" (missing {len(actual - view.blocks)}, extra {len(view.blocks - actual)})"
        )
        print(
            f"rank {rank}: {state.batches} batches published, {view.batches} received; "
            f"rebuilt cache of {len(view.blocks)} blocks vs scheduler's {len(actual)}: "
            f"{verdict}{detail}",
            file=out,
        )
    for loss in losses:
        print(f"  loss: {loss}", file=out)
    print(
        "tskv demo: the subscribers' rebuilt caches "
        + ("equal the schedulers' caches: nothing was lost" if all_equal else "DO NOT match"),
        file=out,
    )
    return all_equal


@trio.lowlevel.enable_ki_protection  # Ctrl-C lands at a checkpoint, so the summary is printed
async def simulate(
    options: SimOptions,
    config: KVEventsConfig,
    out: TextIO = sys.stdout,
    *,
    task_status: trio.TaskStatus[list[Publisher]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Publish the simulated schedulers' events for an external consumer until done.

    With `await nursery.start(simulate, ...)`, the publishers are handed back once they are
    open, so a test or a tool can point consumers at them.
    """
    check_options(options)
    loop: _SchedulerLoop | None = None
    try:
        async with AsyncExitStack() as stack:
            publishers = [
                await stack.enter_async_context(open_publisher(config, rank))
                for rank in range(options.ranks)
            ]
            loop = _SchedulerLoop(options, publishers)
            for rank, publisher in enumerate(publishers):
                replay = publisher.replay_endpoint
                print(
                    f"rank {rank}: publishing on {publisher.endpoint}"
                    + (f", replay on {replay}" if replay else ""),
                    file=out,
                    flush=True,
                )
            task_status.started(publishers)
            await loop.run()
    finally:
        if loop is not None:
            batches = sum(rank.batches for rank in loop.ranks)
            print(
                f"tskv simulate: {loop.rounds} rounds, {batches} batches published",
                file=out,
                flush=True,
            )


def check_options(options: SimOptions) -> None:
    """Refuse options that cannot run, naming the flag."""
    problems = []
    if options.rounds is not None and options.rounds < 1:
        problems.append(f"--rounds {options.rounds}: must be at least 1")
    if options.duration is not None and not (
        math.isfinite(options.duration) and options.duration > 0
    ):
        problems.append(f"--duration {options.duration}: must be a positive number of seconds")
    for flag, value, lowest in [
        ("--requests-per-round", options.requests_per_round, 0),
        ("--block-size", options.block_size, 1),
        ("--cache-blocks", options.cache_blocks, 1),
        ("--ranks", options.ranks, 1),
    ]:
        if value < lowest:
            problems.append(f"{flag} {value}: must be at least {lowest}")
    if problems:
        raise ValueError("; ".join(problems))
