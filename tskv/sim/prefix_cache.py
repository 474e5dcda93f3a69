"""The simulator's prefix cache: a full-attention model's paged KV cache, block by block, with
the KV events an engine would publish for every change. No I/O, deterministic."""

from __future__ import annotations

import heapq
from typing import Any

import attrs

from tskv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@attrs.define
class _Block:
    """A cached block of the simulated prefix cache: its parent, who uses it, when it was used."""

    parent: int | None
    refs: int = 0
    children: int = 0
    last_used: int = 0


Chain = list[tuple[int, tuple[int, ...]]]  # a request's blocks: (engine hash, token ids) each


class PrefixCache:
    """`capacity` blocks of `block_size` tokens; every change is recorded as a KV event, tagged
    with `medium` (the storage tier, e.g. "GPU") when one is given. The one worker model of the
    simulator: its scheduler and the trace replay's workers both keep their cache in one.

    Eviction takes the least recently used unreferenced leaf first (a parent outlives its
    children), found through a heap of candidates in O(log n) a block, so a cache of a hundred
    thousand blocks evicts as fast as one of ten.
    """

    def __init__(
        self,
        capacity: int,
        block_size: int,
        medium: str | None = None,
        group: dict[str, Any] | None = None,
    ) -> None:
        if capacity < 1 or block_size < 1:
            raise ValueError(f"capacity = {capacity} and block_size = {block_size} must be >= 1")
        self.capacity = capacity
        self.block_size = block_size
        self.medium = medium
        # the KV cache group every event names (a hybrid model's full-attention group)
        self.group = group or {}
        self.blocks: dict[int, _Block] = {}
        self.events: list[KVEvent] = []
        self._clock = 0
        self._unreferenced = 0  # blocks with no request holding them
        self._leaves: list[tuple[int, int]] = []  # (last used, hash): maybe evictable, a heap
        self.hits = 0
        self.misses = 0

    def _touch(self, block: _Block) -> None:
        self._clock += 1
        block.last_used = self._clock

    def _maybe_evictable(self, block_hash: int, block: _Block) -> None:
        if block.refs == 0 and block.children == 0:
            heapq.heappush(self._leaves, (block.last_used, block_hash))
            if len(self._leaves) > 2 * len(self.blocks) + 64:  # stale entries: drop them
                self._leaves = [
                    entry for entry in self._leaves if self._evictable(*entry) is not None
                ]
                heapq.heapify(self._leaves)

    def _evictable(self, last_used: int, block_hash: int) -> _Block | None:
        block = self.blocks.get(block_hash)
        if block is None or block.refs or block.children or block.last_used != last_used:
            return None  # gone, held, a parent, or used since: a stale entry
        return block

    def _evict_one(self) -> int | None:
        """Evict the least recently used unreferenced leaf; its hash, or None if none is."""
        while self._leaves:
            entry = heapq.heappop(self._leaves)
            block = self._evictable(*entry)
            if block is None:
                continue
            block_hash = entry[1]
            del self.blocks[block_hash]
            self._unreferenced -= 1
            parent = self.blocks.get(block.parent) if block.parent is not None else None
            if parent is not None:
                parent.children -= 1
                self._maybe_evictable(block.parent, parent)  # type: ignore[arg-type]
            return block_hash
        return None

    def room_for(self, count: int) -> bool:
        """Make room for `count` new blocks by evicting, if the unreferenced blocks allow it;
        what one call evicts goes out as one BlockRemoved."""
        free = self.capacity - len(self.blocks)
        if count <= free:
            return True
        if count > free + self._unreferenced:
            return False
        evicted = []
        for _ in range(count - free):
            block_hash = self._evict_one()
            if block_hash is None:
                break
            evicted.append(block_hash)
        if evicted:
            group = {"group_idx": self.group["group_idx"]} if self.group else {}
            self.events.append(BlockRemoved(evicted, medium=self.medium, **group))
        return len(evicted) == count - free

    def cached_prefix(self, chain: Chain) -> int:
        """How many leading blocks of `chain` are cached (the hit the request would get)."""
        cached = 0
        while cached < len(chain) and chain[cached][0] in self.blocks:
            cached += 1
        return cached

    def acquire(self, chain: Chain, parent: int | None, prompt_tokens: int | None = None) -> bool:
        """Reference the blocks of `chain` (hash, tokens) after `parent`, storing new ones.

        Cached blocks always form a prefix of a chain (a parent outlives its children), so the
        new ones are one run and go out as one BlockStored. False, with nothing held, if the
        cache cannot make room.
        """
        cached = self.cached_prefix(chain)
        new = chain[cached:]
        for block_hash_, _ in chain[:cached]:
            self._reference(self.blocks[block_hash_])  # held, so eviction cannot take them
        if not self.room_for(len(new)):
            self.release([block_hash_ for block_hash_, _ in chain[:cached]])
            return False
        for block_hash_, _ in chain[:cached]:
            self._touch(self.blocks[block_hash_])
        self.hits += cached
        self.misses += len(new)
        run_parent = chain[cached - 1][0] if cached else parent
        previous = run_parent
        for block_hash_, _ in new:
            block = _Block(previous, refs=1)
            self._touch(block)
            self.blocks[block_hash_] = block
            if previous is not None and previous in self.blocks:
                self.blocks[previous].children += 1
            previous = block_hash_
        if new:
            tokens = [token for _, block_tokens in new for token in block_tokens]
            hashes = [h for h, _ in new]
            self.events.append(
                BlockStored(
                    hashes, run_parent, tokens, self.block_size, medium=self.medium, **self.group
                )
            )
        return True

    def _reference(self, block: _Block) -> None:
        self._unreferenced -= block.refs == 0
        block.refs += 1

    def engine_hit(self, chain: Chain, prompt_tokens: int) -> int:
        """The blocks of `chain` a request would reuse: its leading run cached."""
        return self.cached_prefix(chain)

    def cached_hashes(self) -> frozenset[int]:
        return frozenset(self.blocks)

    def release(self, hashes: list[int]) -> None:
        for block_hash_ in hashes:
            block = self.blocks[block_hash_]
            block.refs -= 1
            if block.refs == 0:
                self._unreferenced += 1
                self._maybe_evictable(block_hash_, block)

    def clear(self) -> None:
        self.blocks.clear()
        self._leaves.clear()
        self._unreferenced = 0
        self.events.append(AllBlocksCleared())

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
