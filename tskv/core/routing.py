"""Choosing a worker for a request, from what the prefix index says and how busy each worker is.

Every policy is a class with one method, `choose(match, prompt_tokens, block_size, queued,
workers=None) -> Choice`: the index's answer for the request, its length, and the work queued on
each worker. `LoadAwarePolicy` is the one to route with. Longest prefix first
(`LongestPrefixPolicy`) is not enough on its own: when many requests share their first blocks
(a system prompt), whoever holds them wins every time and one worker gets all the traffic. The
load-aware cost of sending a request to a worker is what it would take that worker to get to the
request's first new token: the prompt tokens it must prefill (those not in its cache), plus the
work already queued on it; the cheapest wins. `RoundRobinPolicy` and `RandomPolicy` ignore the
cache: the baselines the demos compare with. Every policy passes over stale workers (whose view
the index cannot vouch for) while any other is available.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import Protocol

import attrs

from tskv.core._checks import at_least
from tskv.core.errors import ConfigError
from tskv.core.prefix_index import Match, Worker


@attrs.frozen
class Choice:
    """Where a request goes, and why."""

    worker: Worker
    cached_tokens: int  # of the prompt, as the index says that worker holds (predictions too)
    cost: float  # what the policy minimised (LoadAwarePolicy: see there); 0 for the baselines


class Policy(Protocol):
    """What a routing policy is: anything with this `choose`."""

    def choose(
        self,
        match: Match,
        prompt_tokens: int,
        block_size: int,
        queued: Mapping[Worker, float],
        workers: Iterable[Worker] | None = None,
    ) -> Choice:
        """One of `workers` (default: those in `queued`) for a prompt of `prompt_tokens`
        tokens; `match` is the index's answer for it, `queued[w]` the work, in tokens, waiting
        on worker w (missing: none)."""
        ...


def candidates(
    match: Match, queued: Mapping[Worker, float], workers: Iterable[Worker] | None
) -> list[Worker]:
    """The workers a policy chooses among, in order: the trusted ones, or every one if none is."""
    given = list(queued if workers is None else workers)
    if not given:
        raise ConfigError("no worker to route to: give the workers (or their queued work)")
    return [worker for worker in given if worker not in match.stale] or given


def _cached(match: Match, worker: Worker, prompt_tokens: int, block_size: int) -> int:
    return min(match.get(worker, 0) * block_size, prompt_tokens)


@attrs.frozen
class LoadAwarePolicy:
    """Route to the worker with the lowest cost: `prefill_weight` per prompt token it must
    prefill, plus `load_weight` per token of work queued on it. With the default weights of 1, a
    token waiting in a queue costs what a token to prefill does; a higher `load_weight` spreads
    load at the expense of cache hits, a lower one follows the cache harder. A cached token held
    only in a lower tier (CPU, disk: `Match.lower`) costs `lower_tier_cost` of a prefill, for
    loading it back: 0.25 by default, Dynamo's price for host memory (its router's default
    `host_cache_hit_weight` credits such a block 0.75 of a device one); 0.75 is its disk's."""

    prefill_weight: float = attrs.field(default=1.0, validator=at_least(0, error=ConfigError))
    load_weight: float = attrs.field(default=1.0, validator=at_least(0, error=ConfigError))
    lower_tier_cost: float = attrs.field(default=0.25, validator=at_least(0, error=ConfigError))

    def choose(
        self,
        match: Match,
        prompt_tokens: int,
        block_size: int,
        queued: Mapping[Worker, float],
        workers: Iterable[Worker] | None = None,
    ) -> Choice:
        """The cheapest worker (`Policy.choose`). Ties go to the least loaded, then to the
        first given. Raises ConfigError when there is no worker to choose from."""
        best: tuple[float, float, int, Worker, int] | None = None
        for order, worker in enumerate(candidates(match, queued, workers)):
            cached = _cached(match, worker, prompt_tokens, block_size)
            lower = min(match.lower.get(worker, 0) * block_size, cached)
            load = queued.get(worker, 0.0)
            prefill = prompt_tokens - cached + self.lower_tier_cost * lower
            cost = self.prefill_weight * prefill + self.load_weight * load
            if best is None or (cost, load, order) < best[:3]:
                best = (cost, load, order, worker, cached)
        assert best is not None
        cost, _, _, worker, cached = best
        return Choice(worker, cached, cost)


@attrs.frozen
class LongestPrefixPolicy:
    """Route to the worker holding the most leading blocks of the request (ties: the least
    loaded, then the first given); its cost is the tokens left to prefill. Blind to load: shown
    beside `LoadAwarePolicy` to see what load-awareness buys."""

    def choose(
        self,
        match: Match,
        prompt_tokens: int,
        block_size: int,
        queued: Mapping[Worker, float],
        workers: Iterable[Worker] | None = None,
    ) -> Choice:
        ranked = [
            (
                -_cached(match, worker, prompt_tokens, block_size),
                queued.get(worker, 0.0),
                order,
                worker,
            )
            for order, worker in enumerate(candidates(match, queued, workers))
        ]
        held, _, _, worker = min(ranked)
        return Choice(worker, -held, float(prompt_tokens + held))


@attrs.define
class RoundRobinPolicy:
    """Each request to the next worker in turn, whatever it holds: a baseline."""

    _turn: int = 0

    def choose(
        self,
        match: Match,
        prompt_tokens: int,
        block_size: int,
        queued: Mapping[Worker, float],
        workers: Iterable[Worker] | None = None,
    ) -> Choice:
        pool = candidates(match, queued, workers)
        worker = pool[self._turn % len(pool)]
        self._turn += 1
        return Choice(worker, _cached(match, worker, prompt_tokens, block_size), 0.0)


@attrs.define
class RandomPolicy:
    """Each request to a worker drawn at random (from `seed`, when given): a baseline."""

    seed: int | None = None
    _draw: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._draw = random.Random(self.seed)

    def choose(
        self,
        match: Match,
        prompt_tokens: int,
        block_size: int,
        queued: Mapping[Worker, float],
        workers: Iterable[Worker] | None = None,
    ) -> Choice:
        worker = self._draw.choice(candidates(match, queued, workers))
        return Choice(worker, _cached(match, worker, prompt_tokens, block_size), 0.0)
