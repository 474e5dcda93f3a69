"""A shared-prefix workload routed across simulated workers, by each policy of `core/routing.py`:
load-aware over the prefix index (`tskv.LoadAwarePolicy`), longest prefix, round-robin, or at
random. `tskv demo --route N` runs it and prints what each policy costs.

Every worker is a real publisher on loopback; the index is kept by a real watcher. Before each
round is routed, the watcher has applied every batch the workers published (a router's view as
of the last round). The run ends by checking the index against every worker's own cache.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack

import attrs

from tskv.core.config import KVEventsConfig
from tskv.core.endpoints import LOOPBACK
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
from tskv.sim.block_hash import chain_hashes
from tskv.sim.plotting import pyplot
from tskv.sim.sampling import GenerateRequest
from tskv.sim.simulator import Simulator, Workload, step_round
from tskv.sim.watched import watched_publishers

POLICIES = ("kv", "longest_prefix", "round_robin", "random")


def make_policy(name: str, seed: int) -> Policy:
    """The policy the demo names."""
    makers: dict[str, Callable[[], Policy]] = {
        "kv": LoadAwarePolicy,
        "longest_prefix": LongestPrefixPolicy,
        "round_robin": RoundRobinPolicy,
        "random": lambda: RandomPolicy(seed),
    }
    return makers[name]()


@attrs.frozen
class RoutingOptions:
    workers: int = 4
    rounds: int = 300
    requests_per_round: int = 2
    block_size: int = 16
    cache_blocks: int = 256
    seed: int = 0


@attrs.define
class PolicyResult:
    policy: str
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens not in the chosen worker's cache when routed
    index_equal: bool = True  # the index equalled every worker's cache at the end
    stale_answers: int = 0
    load: dict[int, int] = attrs.Factory(dict)  # prompt tokens routed to each worker

    @property
    def max_load_share(self) -> float:
        total = sum(self.load.values())
        return max(self.load.values()) / total if total else 0.0

    @property
    def hit_rate(self) -> float:
        return 1 - self.prefilled_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _outstanding(sim: Simulator) -> float:
    """A worker's queued work, in tokens: prompts waiting, and tokens still to decode."""
    waiting = sum(len(request.prompt_ids) for request, _ in sim.waiting)
    return waiting + sum(r.request.max_new_tokens - r.generated for r in sim.running)


def _cached_prefix(sim: Simulator, prompt: tuple[int, ...], block_size: int) -> int:
    """Tokens of `prompt` the worker really holds, block by block from the start."""
    chain = [(block, ()) for block in chain_hashes(prompt, block_size)]
    return sim.cache.cached_prefix(chain) * block_size  # type: ignore[arg-type]


async def run_policy(policy: str, options: RoutingOptions) -> PolicyResult:
    """Route the seed's workload with `policy`; the same requests for every policy."""
    result = PolicyResult(policy)
    workload = Workload(options.seed, options.block_size)
    sims = [Simulator(options.cache_blocks, options.block_size) for _ in range(options.workers)]
    index = PrefixIndex(options.block_size)
    router = make_policy(policy, options.seed)
    config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    async with AsyncExitStack() as stack:
        publishers, watcher = await watched_publishers(stack, config, options.workers, index)

        def route(request: GenerateRequest) -> int:
            match = index.match(request.prompt_ids)
            result.stale_answers += bool(match.stale)
            queued: dict[Worker, float] = {w: _outstanding(sim) for w, sim in enumerate(sims)}
            prompt = len(request.prompt_ids)
            rank = router.choose(match, prompt, options.block_size, queued).worker
            assert isinstance(rank, int)
            return rank

        for _ in range(options.rounds):
            for _ in range(options.requests_per_round):
                request, conversation = workload.next_request()
                worker = route(request)
                result.prompt_tokens += len(request.prompt_ids)
                result.load[worker] = result.load.get(worker, 0) + len(request.prompt_ids)
                cached = _cached_prefix(sims[worker], request.prompt_ids, options.block_size)
                result.prefilled_tokens += len(request.prompt_ids) - cached
                sims[worker].submit(request, conversation)
            await _step_all(sims, publishers, workload, watcher)
        result.index_equal = all(
            index.engine_hashes(rank) == sim.cached_hashes() for rank, sim in enumerate(sims)
        )
    return result


async def _step_all(
    sims: list[Simulator], publishers: list[Publisher], workload: Workload, watcher: Watcher
) -> None:
    for sim, publisher in zip(sims, publishers, strict=True):
        events = step_round(sim, workload)
        if events:
            await publisher.publish(events)
    for rank, publisher in enumerate(publishers):  # the router's view as of this round
        last = publisher.statistics().accepted - 1
        if last >= 0:
            await watcher.wait_for_seq(rank, last)


def bar_chart(results: list[PolicyResult], width: int = 40) -> list[str]:
    """Hit rate per policy as a terminal bar chart."""
    return [
        f"{r.policy:>12} |{'#' * round(r.hit_rate * width):<{width}}| {r.hit_rate:6.1%}"
        for r in results
    ]


def save_plot(results: list[PolicyResult], path: str) -> bool:
    """A bar chart image when matplotlib is installed; False (nothing written) otherwise."""
    plt = pyplot()
    if plt is None:
        return False
    figure, axes = plt.subplots(figsize=(6, 3))
    axes.bar([r.policy for r in results], [r.hit_rate * 100 for r in results])
    axes.set_ylabel("prefix cache hit rate (%)")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


async def compare(
    options: RoutingOptions, out: Callable[[str], None], plot: str | None = None
) -> list[PolicyResult]:
    """Run every policy on the same workload and print the table and chart."""
    results = [await run_policy(policy, options) for policy in POLICIES]
    out(
        f"tskv demo --route: {options.workers} workers, {options.rounds} rounds, "
        f"{options.requests_per_round} requests a round, seed {options.seed}"
    )
    out(f"{'policy':>12}   prefix hit rate   prompt tokens   tokens to prefill   busiest worker")
    for r in results:
        tokens = f"{r.prompt_tokens:13,}   {r.prefilled_tokens:17,}"
        out(f"{r.policy:>12}   {r.hit_rate:15.1%}   {tokens}   {r.max_load_share:14.1%}")
    out("")
    for line in bar_chart(results):
        out(line)
    if plot is not None:
        out(
            f"plot written to {plot}"
            if save_plot(results, plot)
            else "plot: matplotlib is not installed"
        )
    indexed = results[0]
    out(
        "the index equals every worker's cache: "
        + ("yes" if indexed.index_equal else "NO")
        + f" (answers that named a stale worker: {indexed.stale_answers})"
    )
    return results
