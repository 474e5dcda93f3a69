"""A shared-prefix workload routed across simulated workers, by each policy of `core/routing.py`:
load-aware over the prefix index (`tskv.LoadAwarePolicy`), longest prefix, round-robin, or at
random. `tskv demo --route N` runs it and prints what each policy costs.

Every worker is a real publisher on loopback; the index is kept by a real watcher. Before each
round is routed, the watcher has applied every batch the workers published (a router's view as
of the last round). The run ends by checking the index against every worker's own cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack

import attrs

from tskv.core.config import KVEventsConfig
from tskv.core.endpoints import LOOPBACK
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
from tskv.sim.block_hash import chain_hashes
from tskv.sim.group_blind import GroupBlind
from tskv.sim.plotting import pyplot
from tskv.sim.prefix_cache import Chain
from tskv.sim.sampling import GenerateRequest
from tskv.sim.simulator import Simulator, Workload, step_round
from tskv.sim.watched import watched_publishers

POLICIES = ("kv", "longest_prefix", "round_robin", "random")
HYBRID_POLICIES = ("kv", "kv_group_blind", "round_robin", "random")


def make_policy(name: str, seed: int) -> Policy:
    """The policy the demo names."""
    makers: dict[str, Callable[[], Policy]] = {
        "kv": LoadAwarePolicy,
        "kv_group_blind": LoadAwarePolicy,  # on an index that counts full attention alone
        "longest_prefix": LongestPrefixPolicy,
        "round_robin": RoundRobinPolicy,
        "random": lambda: RandomPolicy(seed),
    }
    return makers[name]()


@attrs.frozen
class RoutingOptions:
    """How a routing simulation runs; the CLI's flags map onto these one to one."""

    workers: int = 4
    rounds: int = 300
    requests_per_round: int = 2
    block_size: int = 16
    cache_blocks: int = 256
    seed: int = 0
    model: str = "full"  # hybrid-swa, hybrid-mamba: a hybrid model's two KV cache groups


@attrs.define
class PolicyResult:
    """What one policy achieved in a routing simulation, and whether the index stayed exact."""

    policy: str
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens not in the chosen worker's cache when routed
    index_equal: bool = True  # the index equalled every worker's cache at the end
    answers: int = 0  # index answers checked against every worker's engine, routing each
    exact_answers: int = 0  # of them, the number that equalled the engine's own hit
    blind_over: int = 0  # of them, where an index of full attention alone said more
    blind_extra: int = 0  # the blocks it said too many, in all
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


def _engine_hit(sim: Simulator, prompt: Sequence[int], block_size: int) -> int:
    """The blocks of `prompt` the worker's engine would reuse (its own rules, its own cache)."""
    chain: Chain = [(block, ()) for block in chain_hashes(tuple(prompt), block_size)]
    return sim.cache.engine_hit(chain, len(prompt))


async def run_policy(policy: str, options: RoutingOptions) -> PolicyResult:
    """Route the seed's workload with `policy`; the same requests for every policy."""
    result = PolicyResult(policy)
    workload = Workload(options.seed, options.block_size)
    size = options.block_size
    sims = [
        Simulator(options.cache_blocks, size, model=options.model) for _ in range(options.workers)
    ]
    index, blind = PrefixIndex(size), PrefixIndex(size)
    router = make_policy(policy, options.seed)
    wire: WireFormat = "tokenspeed" if options.model == "full" else "vllm"  # with the groups
    config = KVEventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, wire_format=wire)
    filters = [GroupBlind() for _ in sims]
    async with AsyncExitStack() as stack:
        publishers, watcher = await watched_publishers(stack, config, options.workers, index)

        def route(request: GenerateRequest) -> int:
            said, blind_said = index.match(request.prompt_ids), blind.match(request.prompt_ids)
            for number, sim in enumerate(sims):  # the index says what each engine would reuse
                result.answers += 1
                engine = _engine_hit(sim, request.prompt_ids, size)
                result.exact_answers += said.get(number, 0) == engine
                over = blind_said.get(number, 0) - engine
                result.blind_over += over > 0
                result.blind_extra += max(over, 0)
            asked = blind if policy == "kv_group_blind" else index
            match = asked.match(request.prompt_ids)
            result.stale_answers += bool(match.stale)
            queued: dict[Worker, float] = {w: _outstanding(sim) for w, sim in enumerate(sims)}
            prompt = len(request.prompt_ids)
            rank = router.choose(match, prompt, queued, workers=queued).worker
            assert isinstance(rank, int)
            return rank

        for _ in range(options.rounds):
            for _ in range(options.requests_per_round):
                request, conversation = workload.next_request()
                worker = route(request)
                result.prompt_tokens += len(request.prompt_ids)
                result.load[worker] = result.load.get(worker, 0) + len(request.prompt_ids)
                cached = _engine_hit(sims[worker], request.prompt_ids, size) * size
                result.prefilled_tokens += len(request.prompt_ids) - cached
                sims[worker].submit(request, conversation)
            for rank, events in enumerate(await _step_all(sims, publishers, workload, watcher)):
                blind.apply(rank, filters[rank].events(events))
        result.index_equal = all(
            index.engine_hashes(rank) == sim.cached_hashes() for rank, sim in enumerate(sims)
        )
    return result


async def _step_all(
    sims: list[Simulator], publishers: list[Publisher], workload: Workload, watcher: Watcher
) -> list[list[KVEvent]]:
    """One round of every worker, published; the router's view waits for it. Each worker's
    events, as published."""
    published = []
    for sim, publisher in zip(sims, publishers, strict=True):
        events = step_round(sim, workload)
        published.append(events)
        if events:
            await publisher.publish(events)
    for rank, publisher in enumerate(publishers):  # the router's view as of this round
        last = publisher.statistics().accepted - 1
        if last >= 0:
            await watcher.wait_for_seq(rank, last)
    return published


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
    policies = POLICIES if options.model == "full" else HYBRID_POLICIES
    results = [await run_policy(policy, options) for policy in policies]
    out(
        f"tskv demo --route: {options.workers} workers, {options.rounds} rounds, "
        f"{options.requests_per_round} requests a round, seed {options.seed}, "
        f"model {options.model}"
    )
    out(f"{'policy':>14}   prefix hit rate   prompt tokens   tokens to prefill   busiest worker")
    for r in results:
        tokens = f"{r.prompt_tokens:13,}   {r.prefilled_tokens:17,}"
        out(f"{r.policy:>14}   {r.hit_rate:15.1%}   {tokens}   {r.max_load_share:14.1%}")
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
    exact = all(r.exact_answers == r.answers for r in results)
    answers = sum(r.answers for r in results)
    out(
        "the index's answer equals every engine's own hit: "
        + ("yes" if exact else "NO")
        + f" ({sum(r.exact_answers for r in results):,} of {answers:,} answers)"
    )
    out(
        "the index equals every worker's cache: "
        + ("yes" if all(r.index_equal for r in results) else "NO")
        + f" (answers that named a stale worker: {indexed.stale_answers})"
    )
    if options.model != "full":
        over, extra = sum(r.blind_over for r in results), sum(r.blind_extra for r in results)
        out(
            "an index of full attention alone (Dynamo's) promised more than the engine would "
            f"reuse in {over:,} of {answers:,} answers, {extra / max(over, 1):.1f} blocks too "
            "many on average"
        )
    return results
