"""`tskv demo`: simulated schedulers, publishers and subscribers in one process, checked.

The demo closes the loop: simulated schedulers publish, subscribers rebuild which blocks each
rank holds, and the run ends by comparing that view with the schedulers' own caches. Equal
means no event was lost on the way. Halfway through, a late joiner per rank starts from the
publisher's snapshot (the replay buffer is kept short, so replay alone could not catch it up)
and must end with the same cache.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import AsyncExitStack
from typing import TextIO

import trio

from tskv._cli.options import flags_given, sim_options
from tskv.core.config import KVEventsConfig
from tskv.core.endpoints import LOOPBACK
from tskv.core.losses import Loss
from tskv.shells.publisher import Publisher, open_publisher
from tskv.shells.subscriber import Subscriber, open_subscriber
from tskv.sim import CacheView, SchedulerLoop, SimOptions, check_options
from tskv.sim.routing import RoutingOptions, compare
from tskv.sim.trace import read_trace
from tskv.sim.trace_report import compare_trace
from tskv.sim.trace_routing import TraceOptions

ENDS_WITH_CTRL_C = False  # it runs to a verdict: Ctrl-C interrupts it (exit status 130)
BUFFER_STEPS = 64  # short, so the late joiner needs the snapshot


MIN_DEMO_CACHE_BLOCKS = 16  # a first prompt alone takes up to 9 blocks of 16 tokens


def check_demo_options(args: argparse.Namespace) -> None:
    """Refuse what would leave the demo nothing to check (no request, or a cache too small to
    hold one), naming the flag and the fix, before anything starts."""
    if args.requests_per_round < 1:
        raise ValueError(
            f"--requests-per-round {args.requests_per_round}: the demo would publish nothing "
            "and check nothing; use at least 1"
        )
    least = MIN_DEMO_CACHE_BLOCKS * 16 // (args.block_size or SimOptions().block_size)
    if args.trace is None and args.cache_blocks < least:
        raise ValueError(
            f"--cache-blocks {args.cache_blocks}: too small to cache one request's prompt "
            f"(up to {9 * 16} tokens), so nothing would be published; use at least {least}"
        )


TRACE_FLAGS = ("requests", "cache_tokens", "prefill_rate", "speed", "json", "load_weight")


def check_trace_options(args: argparse.Namespace) -> None:
    if args.trace is not None and args.route is None:
        raise ValueError("--trace FILE goes with --route WORKERS: say how many workers serve it")
    flags = flags_given(args, TRACE_FLAGS)
    if flags and args.trace is None:
        raise ValueError(f"{flags}: only with --route WORKERS --trace FILE")
    if args.trace is not None and args.block_size is not None and 512 % args.block_size:
        raise ValueError(
            f"--block-size {args.block_size} does not divide a trace block (512 tokens): "
            "use 16, 32, 64, 128, 256 or 512"
        )


async def route_trace(args: argparse.Namespace) -> int:
    """`--route N --trace FILE`: exit status 1 if the index ever disagreed with a worker."""
    requests = read_trace(args.trace, args.requests)
    defaults = TraceOptions()
    options = TraceOptions(
        workers=args.route,
        cache_tokens=args.cache_tokens or defaults.cache_tokens,
        block_size=args.block_size or defaults.block_size,
        prefill_rate=args.prefill_rate or defaults.prefill_rate,
        speed=args.speed,
        seed=args.seed,
        load_weight=defaults.load_weight if args.load_weight is None else args.load_weight,
        model=args.model,
    )
    results = await compare_trace(requests, options, print, as_json=args.json, plot=args.plot)
    return 0 if all(result.exact for result in results) else 1


async def main(args: argparse.Namespace) -> int:
    check_demo_options(args)
    check_trace_options(args)
    if args.trace is not None:
        return await route_trace(args)
    if args.route is not None:
        options = sim_options(args)
        routing = RoutingOptions(
            workers=args.route,
            rounds=options.rounds or 300,
            requests_per_round=options.requests_per_round,
            block_size=options.block_size,
            cache_blocks=options.cache_blocks,
            seed=options.seed,
            model=args.model,
        )
        results = await compare(routing, print, args.plot)
        exact = all(r.index_equal and r.exact_answers == r.answers for r in results)
        return 0 if exact else 1
    if args.plot is not None:
        raise ValueError("--plot goes with --route WORKERS")
    if args.model != "full":
        raise ValueError(f"--model {args.model} goes with --route WORKERS")
    return 0 if await demo(sim_options(args)) else 1


async def _consume(sub: Subscriber, view: CacheView) -> None:
    async for seq, batch in sub:
        view.apply(seq, batch.events)


class _LateJoiner:
    """A subscriber that joins halfway, from the publisher's snapshot."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self.view = CacheView()
        self.joined_at: int | None = None  # the seq of the snapshot it started from
        self.snapshot_blocks = 0

    async def run(self, loop: SchedulerLoop, losses: list[Loss]) -> None:
        options = loop.options
        if options.rounds is not None:
            while loop.rounds < options.rounds // 2:
                await loop.round_done.park()
        else:
            assert options.duration is not None
            await trio.sleep(options.duration / 2)
        publisher = self.publisher
        async with open_subscriber(
            publisher.endpoint,
            publisher.replay_endpoint,
            start_seq="snapshot",
            on_loss=losses.append,
        ) as sub:
            async for seq, batch in sub:
                self.view.apply(seq, batch.events)
                if self.joined_at is None:  # the snapshot: it cleared, then stored them all
                    self.joined_at = seq
                    self.snapshot_blocks = len(self.view.blocks)


def _progress(loop: SchedulerLoop, subs: list[Subscriber], views: list[CacheView]) -> str:
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
                        buffer_steps=BUFFER_STEPS,
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
        loop = SchedulerLoop(options, publishers)
        views = [CacheView() for _ in publishers]
        late = [_LateJoiner(publisher) for publisher in publishers]
        async with trio.open_nursery() as nursery:
            for sub, view in zip(subs, views, strict=True):
                nursery.start_soon(_consume, sub, view)
            for joiner in late:
                nursery.start_soon(joiner.run, loop, losses)
            nursery.start_soon(_report_progress, loop, subs, views, out, live)
            await loop.run()
            with trio.move_on_after(10):  # let each subscriber catch up with its last batch
                for view, sub, rank in zip(views, subs, loop.ranks, strict=True):
                    while view.batches + sub.statistics().lost < rank.batches:
                        await view.changed.park()
                for joiner in late:
                    while joiner.view.last_seq != joiner.publisher.statistics().accepted - 1:
                        await joiner.view.changed.park()
            nursery.cancel_scope.cancel()
        if live:
            print(file=out)
        return _summary(loop, subs, views, late, losses, out)


async def _report_progress(
    loop: SchedulerLoop, subs: list[Subscriber], views: list[CacheView], out: TextIO, live: bool
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
    loop: SchedulerLoop,
    subs: list[Subscriber],
    views: list[CacheView],
    late: list[_LateJoiner],
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
    for rank, (state, joiner) in enumerate(zip(loop.ranks, late, strict=True)):
        actual = state.sim.cached_hashes()
        equal = joiner.view.blocks == actual and joiner.joined_at is not None
        all_equal &= equal
        joined = (
            "never joined"
            if joiner.joined_at is None
            else f"joined after seq {joiner.joined_at} from a snapshot of "
            f"{joiner.snapshot_blocks} blocks (replay held only the last {BUFFER_STEPS})"
        )
        print(
            f"rank {rank} late joiner: {joined}; rebuilt cache of {len(joiner.view.blocks)} "
            f"blocks vs scheduler's {len(actual)}: {'EQUAL' if equal else 'DIFFERENT'}",
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
