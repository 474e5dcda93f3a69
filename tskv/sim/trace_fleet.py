"""Workers serving a Mooncake trace: each a prefix cache of so many tokens, evicting the least
recently used trace block, and a prefill queue of so many tokens a second.

A worker serves a request by finding the longest cached prefix of its trace blocks (its prefix
cache hit), storing the blocks it lacked, and evicting what no longer fits; the KV events it
publishes say exactly that, in tskv blocks of `block_size` tokens. Those events leave when the
prefill is done, not when the request arrives: the router's blind spot that speculative
entries (`PrefixIndex.predict`) cover.
"""

from __future__ import annotations

from collections import OrderedDict

import attrs

from tskv.core.events import BlockRemoved, BlockStored, KVEvent
from tskv.sim.trace import TRACE_BLOCK, TraceRequest


@attrs.frozen
class Served:
    cached_tokens: int  # of the prompt, found in the worker's cache
    events: list[KVEvent]  # what the worker publishes once the prefill is done
    done_at: float  # when that is, in trace seconds


class TraceWorker:
    """One worker's prefix cache and prefill queue, in trace time."""

    def __init__(self, cache_tokens: int, block_size: int, prefill_rate: float) -> None:
        if TRACE_BLOCK % block_size:
            raise ValueError(
                f"block size {block_size} does not divide a trace block ({TRACE_BLOCK} tokens): "
                "use 16, 32, 64, 128, 256 or 512"
            )
        self.block_size = block_size
        self.capacity = cache_tokens
        self.prefill_rate = prefill_rate  # prompt tokens prefilled a second
        self.cached: OrderedDict[int, int] = OrderedDict()  # trace block -> tokens stored, LRU
        self.tokens = 0  # held in `cached`
        self.busy_until = 0.0
        self._per_block = TRACE_BLOCK // block_size

    def queued(self, now: float) -> float:
        """Prompt tokens still waiting to be prefilled at `now`."""
        return max(0.0, self.busy_until - now) * self.prefill_rate

    def hashes(self, block: int, tokens: int) -> list[int]:
        """The engine hashes of trace block `block`'s whole tskv blocks."""
        first = block * self._per_block + 1  # 0 is never a hash here
        return list(range(first, first + tokens // self.block_size))

    def serve(self, request: TraceRequest, now: float) -> Served:
        cached = depth = 0
        for position, block in enumerate(request.hash_ids):
            held = self.cached.get(block)
            if held is None or held < request.block_tokens(position):
                break
            cached += request.block_tokens(position)
            depth += 1
        events: list[KVEvent] = []
        parent: int | None = None
        for position, block in enumerate(request.hash_ids):
            tokens = request.block_tokens(position)
            if position >= depth and self.cached.get(block, 0) < tokens:
                events += self._store(block, tokens, parent)
            stored = self.cached.get(block, 0)
            parent = self.hashes(block, stored)[-1] if stored >= self.block_size else parent
        for block in reversed(request.hash_ids):  # the prefix's root is the last to go
            if block in self.cached:
                self.cached.move_to_end(block)
        events += self._evict(keep=set(request.hash_ids))
        start = max(now, self.busy_until)
        self.busy_until = start + (request.input_length - cached) / self.prefill_rate
        return Served(cached, events, self.busy_until)

    def _store(self, block: int, tokens: int, parent: int | None) -> list[KVEvent]:
        old = self.cached.get(block, 0)
        self.cached[block] = tokens
        self.tokens += tokens - old
        hashes = self.hashes(block, tokens)[old // self.block_size :]
        if not hashes:
            return []
        start = (old // self.block_size) * self.block_size
        token_ids = list(range(block * TRACE_BLOCK + start, block * TRACE_BLOCK + tokens))
        whole = len(hashes) * self.block_size
        if old >= self.block_size:
            parent = self.hashes(block, old)[-1]
        return [BlockStored(hashes, parent, token_ids[:whole], self.block_size)]

    def _evict(self, keep: set[int]) -> list[KVEvent]:
        removed: list[int] = []
        while self.tokens > self.capacity and len(self.cached) > len(keep):
            block, tokens = next(iter(self.cached.items()))
            if block in keep:  # the request's own blocks stay while it runs
                self.cached.move_to_end(block)
                continue
            del self.cached[block]
            self.tokens -= tokens
            removed += self.hashes(block, tokens)
        return [BlockRemoved(removed)] if removed else []

    def engine_hashes(self) -> set[int]:
        """What this worker's events say it holds: the index must say the same."""
        return {h for block, tokens in self.cached.items() for h in self.hashes(block, tokens)}
