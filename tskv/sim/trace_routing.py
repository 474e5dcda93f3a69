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
from tskv.core.wire_format import WireFormat
from tskv.shells.publisher import Publisher
from tskv.shells.watcher import Watcher
from tskv.sim.group_blind import GroupBlind
from tskv.sim.trace import TraceRequest
from tskv.sim.trace_fleet import TraceWorker, request_chain
from tskv.sim.watched import watched_publishers

POLICIES = ("kv", "kv_without_predictions", "longest_prefix", "round_robin", "random")
HYBRID_POLICIES = ("kv", "kv_group_blind", "round_robin", "random")
EXACT_SAMPLE = 400  # requests whose every worker's answer is checked against its engine
PREDICTING = ("kv",)  # the policies that record speculative entries for what they route
_RUNS = itertools.count()


@attrs.frozen
class TraceOptions:
    """How a trace is replayed through a router; the CLI's flags map onto these one to one."""

    workers: int = 8
    cache_tokens: int = 3_000_000
    block_size: int = 64
    prefill_rate: float = 5_000.0  # prompt tokens a second per worker
    predicted_ttl: float = 10.0  # trace seconds a speculative entry lasts
    load_weight: float = 1.0  # LoadAwarePolicy's weight of a queued token
    speed: float | None = None  # times real time; None: as fast as the router keeps up
    seed: int = 0
    model: str = "full"  # hybrid-swa, hybrid-mamba: a hybrid model's two KV cache groups


@attrs.define
class TraceResult:
    """What one policy achieved over a trace: hits, load, and whether the index stayed exact."""

    policy: str
    model: str = "full"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    load: list[int] = attrs.Factory(list)  # prompt tokens routed to each worker
    hit_rate_over_time: list[float] = attrs.Factory(list)  # cumulative, every 1% of the trace
    index_exact: bool = True
    answers: int = 0  # index answers checked against the engine, once every event is in
    exact_answers: int = 0
    blind_over: int = 0  # of them, where an index of full attention alone said more
    blind_extra: int = 0  # the blocks it said too many, in all
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

    @property
    def exact(self) -> bool:
        """The index equalled the caches, and said what each engine would reuse."""
        return self.index_exact and self.exact_answers == self.answers

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
        blind: PrefixIndex | None = None,
    ) -> None:
        self.workers, self.publishers, self.watcher = workers, publishers, watcher
        self.blind = blind  # an index counting full attention alone, fed the same events
        self._filters = [GroupBlind() for _ in workers]
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
            if self.blind is not None:
                self.blind.apply(worker, self._filters[worker].events(events))
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
    result = TraceResult(policy, load=[0] * options.workers, model=options.model)
    now = 0.0
    index = PrefixIndex(options.block_size, clock=lambda: now)  # predictions live in trace time
    blind = PrefixIndex(options.block_size, clock=lambda: now)
    router = make_policy(policy, options)
    started = time.monotonic()
    async with AsyncExitStack() as stack:
        fleet = await _watched_fleet(stack, options, index, blind)
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
            asked = blind if policy == "kv_group_blind" else index
            worker = _choose(asked, router, tokens, queued, result)
            if policy in PREDICTING:
                index.predict(worker, tokens, options.predicted_ttl)
            served = workers[worker].serve(request, now)
            fleet.served(worker, served.done_at, served.events)
            result.record(request, worker, served.cached_tokens)
            if number % step == step - 1 or number == len(requests) - 1:
                result.hit_rate_over_time.append(result.hit_rate)
                progress(policy, number + 1)
        await fleet.publish_until(float("inf"))
        _check_answers(index, blind, workers, requests[-EXACT_SAMPLE:], result)
        result.losses = sum(watcher.status(rank).losses for rank in range(options.workers))
        result.index_exact = all(
            index.engine_hashes(rank) == worker.engine_hashes()
            for rank, worker in enumerate(workers)
        )
    result.seconds = time.monotonic() - started
    return result


def _check_answers(
    index: PrefixIndex,
    blind: PrefixIndex,
    workers: list[TraceWorker],
    asked: list[TraceRequest],
    result: TraceResult,
) -> None:
    """Once every event is in: does the index say, for each request asked and each worker,
    what the worker's engine would reuse (predictions aside)? And how far off is an index of
    full attention alone?"""
    for request in asked:
        said, blind_said = index.match(request.token_ids()), blind.match(request.token_ids())
        chain = request_chain(request, index.block_size)
        for rank, worker in enumerate(workers):
            engine = worker.cache.engine_hit(chain, request.input_length)
            real = said.get(rank, 0) - said.predicted.get(rank, 0)
            result.answers += 1
            result.exact_answers += real == engine
            over = blind_said.get(rank, 0) - blind_said.predicted.get(rank, 0) - engine
            result.blind_over += over > 0
            result.blind_extra += max(over, 0)


async def _watched_fleet(
    stack: AsyncExitStack, options: TraceOptions, index: PrefixIndex, blind: PrefixIndex
) -> Fleet:
    """Fresh workers, each a publisher on inproc, and a watcher keeping `index` current."""
    name = f"inproc://tskv-trace-{next(_RUNS)}"
    wire: WireFormat = "tokenspeed" if options.model == "full" else "vllm"  # with the groups
    config = KVEventsConfig(endpoint=name, replay_endpoint=f"{name}-replay", wire_format=wire)
    publishers, watcher = await watched_publishers(stack, config, options.workers, index)
    workers = [
        TraceWorker(options.cache_tokens, options.block_size, options.prefill_rate, options.model)
        for _ in publishers
    ]
    return Fleet(workers, publishers, watcher, blind)


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
    if name.startswith("kv"):  # with or without predictions, on the index or a blind one
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
    chosen = router.choose(match, len(tokens), queued, workers=queued).worker
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
