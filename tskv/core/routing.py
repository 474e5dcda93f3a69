"""Choosing a worker for a request, from what the prefix index says and how busy each worker is.

Every policy is a class with one method, `choose(match, prompt_tokens, queued=None,
workers=None) -> Choice`: the index's answer for the request (which carries the block size and
every worker the index knows), the request's length, and the work queued on each worker (a
worker missing from it is idle). `LoadAwarePolicy` is the one to route with. Longest prefix first
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
from tskv.core.errors import ConfigError, TskvTypeError, TskvValueError
from tskv.core.prefix_index import Match, Worker

Queued = Mapping[Worker, float]


@attrs.frozen
class Choice:
    """Where a request goes, and why."""

    worker: Worker
    cached_tokens: int  # of the prompt, as the index says that worker holds (predictions too)
    cost: float  # what the policy minimised (LoadAwarePolicy: see there); 0 for the baselines


@attrs.frozen
class Cost:
    """One candidate's reckoning under `LoadAwarePolicy`: the prompt tokens it holds (`cached`,
    of which `lower` only in a lower tier), the tokens queued on it, and the cost."""

    worker: Worker
    cached: int
    lower: int
    queued: float
    cost: float


class Policy(Protocol):
    """What a routing policy is: anything with this `choose`."""

    def choose(
        self,
        match: Match,
        prompt_tokens: int,
        queued: Queued | None = None,
        workers: Iterable[Worker] | None = None,
    ) -> Choice:
        """A worker for a prompt of `prompt_tokens` tokens: one the index knows (`match.workers`)
        or one of `workers` (those it does not know yet, say); `match` is the index's answer for
        the prompt, `queued[w]` the work, in tokens, waiting on worker w (missing: none)."""
        ...


def candidates(match: Match, workers: Iterable[Worker] | None = None) -> list[Worker]:
    """The workers a policy chooses among, in order: the index's and then those given, the
    trusted ones only if any is. Raises TskvValueError when there are none."""
    pool = list(match.workers)
    if workers is not None:
        if isinstance(workers, (str, bytes)) or not isinstance(workers, Iterable):
            raise TskvTypeError(
                f"workers = {workers!r:.60} must be an iterable of workers (e.g. a list)"
            )
        known = set(pool)
        for worker in workers:
            if worker not in known:
                known.add(worker)
                pool.append(worker)
    if not pool:
        raise TskvValueError(
            "no worker to route to: the index knows none and none was given; add workers to "
            "the watcher (or apply their events to the index), or pass workers=[...]"
        )
    return [worker for worker in pool if worker not in match.stale] or pool


def _checked(match: Match, prompt_tokens: int, queued: Queued | None) -> tuple[int, Queued]:
    """The block size to count tokens with, and the queued work (none given: all idle), or a
    TskvError saying what to pass instead."""
    if not isinstance(match, Match):
        raise TskvTypeError(
            f"match = {match!r:.60} must be the Match that PrefixIndex.match returns"
        )
    if match.block_size is None:
        raise TskvValueError(
            "this Match does not say its block size: use the one PrefixIndex.match returns, "
            "or make it with Match(counts, stale, block_size=...)"
        )
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
        raise TskvValueError(
            f"prompt_tokens = {prompt_tokens!r:.60} must be the prompt's length in tokens (an "
            "int >= 0)"
        )
    if queued is None:
        return match.block_size, {}
    if not isinstance(queued, Mapping):
        hint = ""
        if isinstance(queued, int):  # choose(match, tokens, block_size, queued): the old call
            hint = "; the block size now comes from the Match: choose(match, tokens, queued)"
        raise TskvTypeError(
            f"queued = {queued!r:.60} must map each worker to its queued tokens{hint}"
        )
    return match.block_size, queued


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
        queued: Queued | None = None,
        workers: Iterable[Worker] | None = None,
    ) -> Choice:
        """The cheapest worker (`Policy.choose`). Ties go to the least loaded, then to the
        first in `candidates`' order. Raises TskvValueError when there is no worker to choose
        from, TskvTypeError for arguments of the wrong kind (each naming the fix)."""
        costs = self.costs(match, prompt_tokens, queued, workers)
        best = min(costs, key=lambda c: (c.cost, c.queued))  # min keeps the first of equals
        return Choice(best.worker, best.cached, best.cost)

    def costs(
        self,
        match: Match,
        prompt_tokens: int,
        queued: Queued | None = None,
        workers: Iterable[Worker] | None = None,
    ) -> list[Cost]:
        """What each candidate would cost, in `candidates`' order: the reasons behind
        `choose` (a service that chooses for a gateway shows them)."""
        block_size, queued = _checked(match, prompt_tokens, queued)
        costs = []
        for worker in candidates(match, workers):
            cached = _cached(match, worker, prompt_tokens, block_size)
            lower = min(match.lower.get(worker, 0) * block_size, cached)
            load = queued.get(worker, 0.0)
            prefill = prompt_tokens - cached + self.lower_tier_cost * lower
            cost = self.prefill_weight * prefill + self.load_weight * load
            costs.append(Cost(worker, cached, lower, load, cost))
        return costs


@attrs.frozen
class LongestPrefixPolicy:
    """Route to the worker holding the most leading blocks of the request (ties: the least
    loaded, then the first given); its cost is the tokens left to prefill. Blind to load: shown
    beside `LoadAwarePolicy` to see what load-awareness buys."""

    def choose(
        self,
        match: Match,
        prompt_tokens: int,
        queued: Queued | None = None,
        workers: Iterable[Worker] | None = None,
    ) -> Choice:
        block_size, queued = _checked(match, prompt_tokens, queued)
        ranked = [
            (
                -_cached(match, worker, prompt_tokens, block_size),
                queued.get(worker, 0.0),
                order,
                worker,
            )
            for order, worker in enumerate(candidates(match, workers))
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
        queued: Queued | None = None,
        workers: Iterable[Worker] | None = None,
    ) -> Choice:
        block_size, _ = _checked(match, prompt_tokens, queued)
        pool = candidates(match, workers)
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
        queued: Queued | None = None,
        workers: Iterable[Worker] | None = None,
    ) -> Choice:
        block_size, _ = _checked(match, prompt_tokens, queued)
        worker = self._draw.choice(candidates(match, workers))
        return Choice(worker, _cached(match, worker, prompt_tokens, block_size), 0.0)
