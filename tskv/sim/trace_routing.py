"""Routing a Mooncake trace across simulated workers, over real ZeroMQ: `tskv demo --route N
--trace FILE`.

Each worker (`TraceWorker`) is a real publisher; the router keeps a `PrefixIndex` current with a
real watcher and routes every request of the trace in turn, by each policy. Time is the trace's:
a worker's KV events are published when its prefill of the request is done, and before each
request is routed the watcher has applied every batch published by then (the router's view at
that moment). With `speed`, requests are paced at that many times real time; without, as fast
as the router keeps up. The run ends by checking the index against every worker's cache.
"""

from __future__ import annotations

import heapq
import itertools
import sys
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import TextIO

import attrs
import trio

from tskv.core.config import KVEventsConfig
from tskv.core.events import KVEvent
from tskv.core.prefix_index import PrefixIndex, Worker
from tskv.core.routing import (
    LoadAwarePolicy,
    LongestPrefixPolicy,
    Policy,
    RandomPolicy,
    RoundRobinPolicy,
)
from tskv.shells.publisher import Publisher
from tskv.shells.watcher import Watcher
from tskv.sim.trace import TraceRequest
from tskv.sim.trace_fleet import TraceWorker
from tskv.sim.watched import watched_publishers

POLICIES = ("kv", "kv_without_predictions", "longest_prefix", "round_robin", "random")
PREDICTING = ("kv",)  # the policies that record speculative entries for what they route
_RUNS = itertools.count()


@attrs.frozen
class TraceOptions:
    workers: int = 8
    cache_tokens: int = 3_000_000
    block_size: int = 64
    prefill_rate: float = 5_000.0  # prompt tokens a second per worker
    predicted_ttl: float = 10.0  # trace seconds a speculative entry lasts
    load_weight: float = 1.0  # LoadAwarePolicy's weight of a queued token
    speed: float | None = None  # times real time; None: as fast as the router keeps up
    seed: int = 0


@attrs.define
class TraceResult:
    policy: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    load: list[int] = attrs.Factory(list)  # prompt tokens routed to each worker
    hit_rate_over_time: list[float] = attrs.Factory(list)  # cumulative, every 1% of the trace
    index_exact: bool = True
    losses: int = 0  # loss reports the watcher heard (each repaired from replay or a snapshot)
    stale_answers: int = 0  # index answers that named a worker it could not vouch for
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def max_load_share(self) -> float:
        return max(self.load) / sum(self.load) if sum(self.load) else 0.0

    def record(self, request: TraceRequest, worker: int, cached_tokens: int) -> None:
        self.prompt_tokens += request.input_length
        self.cached_tokens += cached_tokens
        self.load[worker] += request.input_length

    def summary(self) -> dict[str, float | int]:
        return {
            "hit_rate": round(self.hit_rate, 4),
            "prefill_tokens": self.prompt_tokens - self.cached_tokens,
            "max_load_share": round(self.max_load_share, 4),
        }


class Fleet:
    """The workers, their publishers, and the events waiting for their prefill to end; with a
    watcher, publishing waits until the watcher's index holds what was published."""

    def __init__(
        self,
        workers: list[TraceWorker],
        publishers: list[Publisher],
        watcher: Watcher | None = None,
    ) -> None:
        self.workers, self.publishers, self.watcher = workers, publishers, watcher
        self._due: list[tuple[float, int, int, list[KVEvent]]] = []
        self._order = itertools.count()

    def served(self, worker: int, done_at: float, events: list[KVEvent]) -> None:
        if events:
            heapq.heappush(self._due, (done_at, next(self._order), worker, events))

    async def publish_until(self, now: float) -> None:
        """Publish every batch done by `now`, and wait until the index holds them."""
        touched: set[int] = set()
        while self._due and self._due[0][0] <= now:
            _, _, worker, events = heapq.heappop(self._due)
            await self.publishers[worker].publish(events)
            touched.add(worker)
        if self.watcher is None:
            return
        for worker in touched:
            last = self.publishers[worker].accepted - 1  # not statistics(): every request
            await self.watcher.wait_for_seq(worker, last)


async def run_policy(
    policy: str,
    requests: list[TraceRequest],
    options: TraceOptions,
    progress: Callable[[str, int], None] = lambda policy, done: None,
) -> TraceResult:
    """Route `requests` by `policy` on fresh workers; the same requests for every policy."""
    result = TraceResult(policy, load=[0] * options.workers)
    now = 0.0
    index = PrefixIndex(options.block_size, clock=lambda: now)  # predictions live in trace time
    router = make_policy(policy, options)
    started = time.monotonic()
    async with AsyncExitStack() as stack:
        fleet = await _watched_fleet(stack, options, index)
        workers, watcher = fleet.workers, fleet.watcher
        assert watcher is not None
        step = max(1, len(requests) // 100)
        for number, request in enumerate(requests):
            now = request.timestamp_ms / 1000
            if options.speed is not None:
                await trio.sleep_until(_wall(started, now, options.speed))
            await fleet.publish_until(now)
            tokens = request.token_ids()
            queued: dict[Worker, float] = {r: w.queued(now) for r, w in enumerate(workers)}
            worker = _choose(index, router, tokens, queued, result)
            if policy in PREDICTING:
                index.predict(worker, tokens, options.predicted_ttl)
            served = workers[worker].serve(request, now)
            fleet.served(worker, served.done_at, served.events)
            result.record(request, worker, served.cached_tokens)
            if number % step == step - 1 or number == len(requests) - 1:
                result.hit_rate_over_time.append(result.hit_rate)
                progress(policy, number + 1)
        await fleet.publish_until(float("inf"))
        result.losses = sum(watcher.status(rank).losses for rank in range(options.workers))
        result.index_exact = all(
            index.engine_hashes(rank) == worker.engine_hashes()
            for rank, worker in enumerate(workers)
        )
    result.seconds = time.monotonic() - started
    return result


async def _watched_fleet(stack: AsyncExitStack, options: TraceOptions, index: PrefixIndex) -> Fleet:
    """Fresh workers, each a publisher on inproc, and a watcher keeping `index` current."""
    name = f"inproc://tskv-trace-{next(_RUNS)}"
    config = KVEventsConfig(endpoint=name, replay_endpoint=f"{name}-replay")
    publishers, watcher = await watched_publishers(stack, config, options.workers, index)
    workers = [
        TraceWorker(options.cache_tokens, options.block_size, options.prefill_rate)
        for _ in publishers
    ]
    return Fleet(workers, publishers, watcher)


async def publish_trace(
    requests: list[TraceRequest],
    publishers: list[Publisher],
    options: TraceOptions,
    progress: Callable[[str, int], None] = lambda policy, done: None,
) -> list[TraceWorker]:
    """Serve the trace's requests round-robin on one worker per publisher and publish their KV
    events (`tskv simulate --trace`); returns the workers, whose caches the events describe."""
    workers = [
        TraceWorker(options.cache_tokens, options.block_size, options.prefill_rate)
        for _ in publishers
    ]
    fleet = Fleet(workers, publishers)
    started = time.monotonic()
    for number, request in enumerate(requests):
        now = request.timestamp_ms / 1000
        if options.speed is not None:
            await trio.sleep_until(_wall(started, now, options.speed))
        await fleet.publish_until(now)
        worker = number % len(workers)
        served = workers[worker].serve(request, now)
        fleet.served(worker, served.done_at, served.events)
        progress("published", number + 1)
    await fleet.publish_until(float("inf"))
    return workers


def make_policy(name: str, options: TraceOptions) -> Policy:
    """The policy a trace run names."""
    if name.startswith("kv"):
        return LoadAwarePolicy(load_weight=options.load_weight)
    if name == "longest_prefix":
        return LongestPrefixPolicy()
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "random":
        return RandomPolicy(options.seed)
    raise ValueError(f"no policy {name!r}: use one of {', '.join(POLICIES)}")


def _choose(
    index: PrefixIndex,
    router: Policy,
    tokens: list[int],
    queued: dict[Worker, float],
    result: TraceResult,
) -> int:
    match = index.match(tokens)
    result.stale_answers += bool(match.stale)
    chosen = router.choose(match, len(tokens), index.block_size, queued).worker
    assert isinstance(chosen, int)
    return chosen


def _wall(started: float, trace_seconds: float, speed: float) -> float:
    """The Trio time at which a request `trace_seconds` into the trace is due."""
    return trio.current_time() - (time.monotonic() - started) + trace_seconds / speed


class ProgressBar:
    """A bar on stderr while a run goes (only on a terminal: a log gets nothing)."""

    def __init__(self, total: int, out: TextIO = sys.stderr, width: int = 30) -> None:
        self.total, self.out, self.width = total, out, width
        self.shown = out.isatty()

    def __call__(self, policy: str, done: int) -> None:
        if not self.shown:
            return
        filled = round(self.width * done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        end = "\n" if done == self.total else ""
        print(f"\r{policy:>22} [{bar}] {done}/{self.total}", end=end, file=self.out, flush=True)
