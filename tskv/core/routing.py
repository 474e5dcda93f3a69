"""Choosing a worker for a request, from what the prefix index says and how busy each worker is.

Longest prefix first is not a policy: when many requests share their first blocks (a system
prompt), whoever holds them wins every time and one worker gets all the traffic. The cost of
sending a request to a worker is what it would take that worker to get to the request's first
new token: the prompt tokens it must prefill (those not in its cache), plus the work already
queued on it. The cheapest worker wins; both terms are in tokens, each with a weight.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from tskv.core._checks import at_least
from tskv.core.errors import ConfigError
from tskv.core.prefix_index import Match, Worker


@attrs.frozen
class Choice:
    """Where a request goes, and why."""

    worker: Worker
    cached_tokens: int  # of the prompt, as the index says that worker holds (predictions too)
    cost: float  # prefill_weight * tokens to prefill + load_weight * queued work


@attrs.frozen
class LoadAwarePolicy:
    """Route to the worker with the lowest cost: `prefill_weight` per prompt token it must
    prefill, plus `load_weight` per token of work queued on it. With the default weights of 1, a
    token waiting in a queue costs what a token to prefill does; a higher `load_weight` spreads
    load at the expense of cache hits, a lower one follows the cache harder. Stale workers (whose
    view the index cannot vouch for) are passed over while any other is available."""

    prefill_weight: float = attrs.field(default=1.0, validator=at_least(0, error=ConfigError))
    load_weight: float = attrs.field(default=1.0, validator=at_least(0, error=ConfigError))

    def choose(
        self,
        match: Match,
        prompt_tokens: int,
        block_size: int,
        queued: Mapping[Worker, float],
        workers: Iterable[Worker] | None = None,
    ) -> Choice:
        """The cheapest of `workers` (default: those in `queued`) for a prompt of
        `prompt_tokens` tokens. `match` is the index's answer for it; `queued[w]` is the work,
        in tokens, already waiting on worker w (missing: none). Ties go to the least loaded,
        then to the first given. Raises ConfigError when there is no worker to choose from."""
        candidates = list(queued if workers is None else workers)
        trusted = [worker for worker in candidates if worker not in match.stale]
        if not candidates:
            raise ConfigError("no worker to route to: give the workers (or their queued work)")
        best: tuple[float, float, int, Worker, int] | None = None
        for order, worker in enumerate(trusted or candidates):
            cached = min(match.get(worker, 0) * block_size, prompt_tokens)
            load = queued.get(worker, 0.0)
            cost = self.prefill_weight * (prompt_tokens - cached) + self.load_weight * load
            if best is None or (cost, load, order) < best[:3]:
                best = (cost, load, order, worker, cached)
        assert best is not None
        cost, _, _, worker, cached = best
        return Choice(worker, cached, cost)
