"""A simulated hybrid model's KV cache: a full-attention group beside a sliding-window or Mamba
group, publishing its KV events as vLLM 0.33 does. No I/O, deterministic.

Group 0 is full attention (a `PrefixCache`); group 1 keeps, by default (vLLM's sparse retention,
`prefix_cache_retention_interval=0`), only what a later request can reuse: a sliding window of W
tokens the `ceil((W - 1) / block_size)` blocks before each of two points, a Mamba group the state
at each: the request's replay boundary (its length less one, floored to a block) and the junction
with a shared prefix that the hit cut short. Every store names its group, kind and window, and
group 1's leaves the blocks it does not keep out of its hashes while its tokens cover them all,
as `BlockPool.cache_full_blocks` does; a decode step's new block is kept by both. The engine's
own hit (`engine_hit`) is computed here as vLLM's managers scan for it, right to left, with no
code shared with `tskv.core.groups`: the demos check the index's answer against it.

Not modelled: the second copy vLLM keeps of a block a full-attention group computes again when
the other group cut the hit short (the index's own tests cover copies), and a shared block pool
(each group has `capacity` blocks).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Protocol

from tskv.core.events import BlockRemoved, BlockStored, KVEvent
from tskv.sim.prefix_cache import Chain, PrefixCache

MODELS = ("full", "hybrid-swa", "hybrid-mamba")
WINDOW_BLOCKS = 8  # the simulated sliding window, in blocks (128 tokens at 16: gpt-oss's)
FULL = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}


class Cache(Protocol):
    """What a simulated worker's cache does, whatever its model."""

    block_size: int

    @property
    def hits(self) -> int: ...

    @property
    def misses(self) -> int: ...

    def engine_hit(self, chain: Chain, prompt_tokens: int) -> int: ...

    def acquire(
        self, chain: Chain, parent: int | None, prompt_tokens: int | None = None
    ) -> bool: ...

    def release(self, hashes: list[int]) -> None: ...

    def clear(self) -> None: ...

    def take_events(self) -> list[KVEvent]: ...

    def cached_hashes(self) -> frozenset[int]: ...


def make_cache(model: str, capacity: int, block_size: int, medium: str | None = None) -> Cache:
    """The cache of a worker serving `model` (one of MODELS)."""
    if model == "full":
        return PrefixCache(capacity, block_size, medium)
    if model not in MODELS:
        raise ValueError(f"model = {model!r}: use one of {', '.join(MODELS)}")
    kind = "sliding_window" if model == "hybrid-swa" else "mamba"
    return HybridCache(capacity, block_size, kind, medium or "GPU")


class HybridCache:
    """Group 0 (full attention) and group 1 (a sliding window or Mamba), `capacity` blocks
    each; group 1 evicts its least recently used block first."""

    def __init__(self, capacity: int, block_size: int, kind: str, medium: str = "GPU") -> None:
        self.block_size = block_size
        self.kind = kind
        self.window = WINDOW_BLOCKS * block_size if kind == "sliding_window" else None
        self.full = PrefixCache(capacity, block_size, medium, FULL)
        self.events = self.full.events  # one list: the groups' events in the order they came
        self.side: OrderedDict[int, None] = OrderedDict()  # group 1's blocks, least recent first
        self.capacity = capacity
        self.medium = medium
        # the blocks group 1 keeps before a point: a window's, or Mamba's one state
        self.span = 1 if self.window is None else max(1, math.ceil((self.window - 1) / block_size))

    @property
    def hits(self) -> int:
        return self.full.hits

    @property
    def misses(self) -> int:
        return self.full.misses

    def engine_hit(self, chain: Chain, prompt_tokens: int) -> int:
        """The blocks the engine would reuse: full attention's leading run, then group 1's
        scan from the right, as vLLM's managers do (one pass: full attention only shrinks)."""
        longest = min(len(chain), (prompt_tokens - 1) // self.block_size)
        hit = self.full.cached_prefix(chain[:longest])
        hashes = [block for block, _ in chain]
        if self.kind == "mamba":
            for i in range(hit - 1, -1, -1):
                if hashes[i] in self.side:
                    return i + 1
            return 0
        count = 0
        for i in range(hit - 1, -1, -1):
            if hashes[i] in self.side:
                count += 1
                if count >= self.span:
                    return i + self.span
            else:
                count = 0
        return count  # no whole window: the run of held blocks from the start

    def acquire(self, chain: Chain, parent: int | None, prompt_tokens: int | None = None) -> bool:
        """Cache `chain` after `parent`: a prompt (`prompt_tokens` given) from its hit on, a
        decode step's block(s) otherwise. False, with nothing stored, if group 0 has no room."""
        if prompt_tokens is None:
            if not self.full.acquire(chain, parent):
                return False
            self._store_side(chain, parent, range(len(chain)))
            return True
        hit = self.engine_hit(chain, prompt_tokens)
        junction = self.full.cached_prefix(chain)
        if not self.full.acquire(chain, parent):
            return False
        boundaries = {(prompt_tokens - 1) // self.block_size}
        if hit < junction:
            boundaries.add(junction)
        kept = [
            i
            for i in range(hit, len(chain))
            if any(point - self.span <= i < point for point in boundaries)
        ]
        self._store_side(chain[hit:], chain[hit - 1][0] if hit else parent, [i - hit for i in kept])
        return True

    def _store_side(self, chain: Chain, parent: int | None, kept: range | list[int]) -> None:
        """Group 1 stores `chain`'s blocks at `kept` (those it has already are not stored
        again); its event's tokens cover the whole chain."""
        if not chain:
            return
        hashes = [chain[i][0] for i in kept if chain[i][0] not in self.side]
        for block in hashes:
            self.side[block] = None
        for block in [chain[i][0] for i in kept]:
            self.side.move_to_end(block)
        tokens = [token for _, block_tokens in chain for token in block_tokens]
        self.events.append(
            BlockStored(
                hashes,
                parent,
                tokens,
                self.block_size,
                medium=self.medium,
                group_idx=1,
                kv_cache_spec_kind=self.kind,
                kv_cache_spec_sliding_window=self.window,
            )
        )
        evicted = []
        while len(self.side) > self.capacity:
            evicted.append(self.side.popitem(last=False)[0])
        if evicted:
            self.events.append(BlockRemoved(evicted, medium=self.medium, group_idx=1))

    def release(self, hashes: list[int]) -> None:
        self.full.release(hashes)

    def clear(self) -> None:
        self.side.clear()
        self.full.clear()

    def take_events(self) -> list[KVEvent]:
        events = self.full.take_events()
        self.events = self.full.events
        return events

    def cached_hashes(self) -> frozenset[int]:
        return frozenset(self.full.blocks) | frozenset(self.side)
