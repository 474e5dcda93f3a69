"""Workers serving a Mooncake trace: each the simulator's prefix cache (`PrefixCache`, so many
tokens' worth of blocks, evicting the least recently used leaf) and a prefill queue of so many
tokens a second.

A trace block (512 tokens, one hash id) is `512 / block_size` blocks here, each with token ids
and an engine hash of its own, so the KV events a worker publishes are what an engine with that
block size would publish. A worker serves a request by finding the longest cached prefix of its
blocks (its prefix cache hit), storing the blocks it lacked and evicting what no longer fits.
Those events leave when the prefill is done, not when the request arrives: the router's blind
spot that speculative entries (`PrefixIndex.predict`) cover.
"""

from __future__ import annotations

import attrs

from tskv.core.events import KVEvent
from tskv.sim.hybrid_cache import make_cache
from tskv.sim.prefix_cache import Chain
from tskv.sim.trace import TRACE_BLOCK, TraceRequest


@attrs.frozen
class Served:
    """What a simulated worker did with a request: what it found cached, and what it publishes."""

    cached_tokens: int  # of the prompt, found in the worker's cache
    events: list[KVEvent]  # what the worker publishes once the prefill is done
    done_at: float  # when that is, in trace seconds


def block_hashes(block: int, block_size: int, tokens: int) -> list[int]:
    """The engine hashes of the whole blocks among trace block `block`'s first `tokens` tokens:
    a trace block's hash id stands for its whole prefix, so these do too."""
    per_block = TRACE_BLOCK // block_size
    first = block * per_block + 1  # 0 is never a hash here
    return list(range(first, first + tokens // block_size))


def request_chain(request: TraceRequest, block_size: int) -> Chain:
    """The request's whole blocks, (engine hash, token ids) each, in order: trace block h's
    tokens are h * 512 + 0.. (`TraceRequest.token_ids`)."""
    chain: Chain = []
    for position, block in enumerate(request.hash_ids):
        tokens = request.block_tokens(position)
        start = block * TRACE_BLOCK
        for index, block_hash in enumerate(block_hashes(block, block_size, tokens)):
            first = start + index * block_size
            chain.append((block_hash, tuple(range(first, first + block_size))))
    return chain


class TraceWorker:
    """One worker's prefix cache and prefill queue, in trace time."""

    def __init__(
        self, cache_tokens: int, block_size: int, prefill_rate: float, model: str = "full"
    ) -> None:
        if TRACE_BLOCK % block_size:
            raise ValueError(
                f"block size {block_size} does not divide a trace block ({TRACE_BLOCK} tokens): "
                "use 16, 32, 64, 128, 256 or 512"
            )
        self.block_size = block_size
        self.cache = make_cache(model, max(1, cache_tokens // block_size), block_size)
        self.prefill_rate = prefill_rate  # prompt tokens prefilled a second
        self.busy_until = 0.0

    def queued(self, now: float) -> float:
        """Prompt tokens still waiting to be prefilled at `now`."""
        return max(0.0, self.busy_until - now) * self.prefill_rate

    def serve(self, request: TraceRequest, now: float) -> Served:
        """Serve `request` arriving at `now`: its hit, what it stores and evicts, and when its
        prefill is done (after what is queued)."""
        chain = request_chain(request, self.block_size)
        cached = self.cache.engine_hit(chain, request.input_length) * self.block_size
        if self.cache.acquire(chain, None, request.input_length):  # held while it runs
            self.cache.release([block_hash for block_hash, _ in chain])
        start = max(now, self.busy_until)
        self.busy_until = start + (request.input_length - cached) / self.prefill_rate
        return Served(cached, self.cache.take_events(), self.busy_until)

    def engine_hashes(self) -> set[int]:
        """What this worker's events say it holds: the index must say the same."""
        return set(self.cache.cached_hashes())
