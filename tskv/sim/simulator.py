"""A simulated LLM scheduler with a paged prefix cache: a realistic KV event source, no GPU.

I/O-free and deterministic: the same workload seed and sampling seeds give the same events.
What it models: prompts split into full blocks chained by TokenSpeed's hash; blocks shared
between requests with a common prefix (system prompts, multi-turn conversations, the choices of
an n > 1 request); decode tokens that fill further blocks, drawn from a PRNG seeded like the
engine's sampler; a bounded cache evicting unreferenced blocks least-recently-used, leaves
before their parents. What it does not: real attention, timing, preemption (a request whose
next block finds the cache full of referenced blocks simply ends), or swapping to host memory.
"""

from __future__ import annotations

import heapq
import random
import zlib
from collections import deque

import attrs

from tskv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from tskv.sim.block_hash import block_hash
from tskv.sim.sampling import (
    GenerateRequest,
    SamplingParams,
    fan_out,
    resolve_sampling_seed,
)

VOCAB = 32_000


@attrs.define
class _Block:
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

    def __init__(self, capacity: int, block_size: int, medium: str | None = None) -> None:
        if capacity < 1 or block_size < 1:
            raise ValueError(f"capacity = {capacity} and block_size = {block_size} must be >= 1")
        self.capacity = capacity
        self.block_size = block_size
        self.medium = medium
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
            self.events.append(BlockRemoved(evicted, medium=self.medium))
        return len(evicted) == count - free

    def cached_prefix(self, chain: Chain) -> int:
        """How many leading blocks of `chain` are cached (the hit the request would get)."""
        cached = 0
        while cached < len(chain) and chain[cached][0] in self.blocks:
            cached += 1
        return cached

    def acquire(self, chain: Chain, parent: int | None) -> bool:
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
                BlockStored(hashes, run_parent, tokens, self.block_size, medium=self.medium)
            )
        return True

    def _reference(self, block: _Block) -> None:
        self._unreferenced -= block.refs == 0
        block.refs += 1

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


@attrs.define
class _Running:
    """One choice being decoded: its tokens so far and the blocks it holds."""

    request: GenerateRequest
    conversation: int
    rng: random.Random
    tokens: list[int]
    held: list[int]
    generated: int = 0


def decode_rng(request: GenerateRequest) -> random.Random:
    """The choice's sampler: its seed, or the CRC32 of its id when it has none (as TokenSpeed)."""
    seed = request.sampling.seed
    return random.Random(seed if seed is not None else zlib.crc32(request.rid.encode()))


class Simulator:
    """One data-parallel rank's scheduler: `step()` runs a round and returns its events."""

    def __init__(
        self,
        cache_blocks: int = 512,
        block_size: int = 16,
        tokens_per_round: int = 8,
        max_running: int = 32,
        medium: str | None = None,
    ) -> None:
        self.cache = PrefixCache(cache_blocks, block_size, medium)
        self.tokens_per_round = tokens_per_round
        self.max_running = max_running
        self.waiting: deque[tuple[GenerateRequest, int]] = deque()
        self.running: list[_Running] = []
        self.finished: list[tuple[int, GenerateRequest, list[int]]] = []  # conversation, tokens

    def submit(self, request: GenerateRequest, conversation: int = -1) -> None:
        """Queue a request; n > 1 becomes n choices that share the prompt's blocks."""
        for choice in fan_out(request, request.sampling.n):
            self.waiting.append((choice, conversation))

    def _chain(
        self, tokens: list[int], start_block: int, parent: int | None
    ) -> list[tuple[int, tuple[int, ...]]]:
        size = self.cache.block_size
        chain = []
        for index in range(start_block, len(tokens) // size):
            block_tokens = tuple(tokens[index * size : (index + 1) * size])
            parent = block_hash(block_tokens, parent)
            chain.append((parent, block_tokens))
        return chain

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            request, conversation = self.waiting[0]
            tokens = list(request.prompt_ids)
            chain = self._chain(tokens, 0, None)
            if not self.cache.acquire(chain, None):
                break  # the cache is full of blocks in use: wait for a later round
            self.waiting.popleft()
            self.running.append(
                _Running(request, conversation, decode_rng(request), tokens, [h for h, _ in chain])
            )

    def _decode(self, running: _Running) -> bool:
        """Decode one round's tokens; False when the request is done."""
        size = self.cache.block_size
        budget = min(self.tokens_per_round, running.request.max_new_tokens - running.generated)
        for _ in range(budget):
            running.tokens.append(running.rng.randrange(VOCAB))
            running.generated += 1
            if len(running.tokens) % size == 0:
                parent = running.held[-1] if running.held else None
                chain = self._chain(running.tokens, len(running.tokens) // size - 1, parent)
                if not self.cache.acquire(chain, parent):
                    return False  # no room for the next block: the request ends here
                running.held.append(chain[0][0])
        return running.generated < running.request.max_new_tokens

    def step(self) -> list[KVEvent]:
        """One scheduling round: admit, prefill, decode, retire. Returns the round's events."""
        self._admit()
        still_running = []
        for running in self.running:
            if self._decode(running):
                still_running.append(running)
            else:
                self.cache.release(running.held)
                self.finished.append((running.conversation, running.request, running.tokens))
        self.running = still_running
        return self.cache.take_events()

    def reset(self) -> list[KVEvent]:
        """Drop every request and clear the cache, as an engine's cache reset does."""
        self.running.clear()
        self.waiting.clear()
        self.cache.clear()
        return self.cache.take_events()

    def cached_hashes(self) -> frozenset[int]:
        return frozenset(self.cache.blocks)


MAX_CONVERSATIONS = 256  # conversations that may go on; the oldest is let go past this


class Workload:
    """Seeded requests with shared prefixes: system prompts and conversations that go on.

    `sampling_seed_offset` changes every sampling seed without touching anything else drawn,
    so two runs differ only in what is decoded. At most `MAX_CONVERSATIONS` conversations are
    kept (the oldest goes), so a workload that runs for hours holds bounded memory and draws a
    conversation in bounded time.
    """

    def __init__(
        self,
        seed: int,
        block_size: int = 16,
        system_prompts: int = 4,
        sampling_seed_offset: int = 0,
    ) -> None:
        self.rng = random.Random(seed)
        self.sampling_seed_offset = sampling_seed_offset
        self.system_prompts = [
            [self.rng.randrange(VOCAB) for _ in range(block_size * self.rng.randint(2, 6))]
            for _ in range(system_prompts)
        ]
        self.conversations: dict[int, list[int]] = {}  # id -> history so far
        self.count = 0

    def _seeds(self) -> tuple[int | None, int | None]:
        kind = self.rng.random()
        drawn = self.rng.getrandbits(63)
        if kind < 0.4:
            return (drawn + self.sampling_seed_offset) % 2**64, None
        if kind < 0.6:
            return None, (drawn + self.sampling_seed_offset) % 2**63
        return None, None

    def next_request(self) -> tuple[GenerateRequest, int]:
        """A new request and the conversation it belongs to."""
        self.count += 1
        rid = f"req{self.count}"
        user = [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(8, 40))]
        if self.conversations and self.rng.random() < 0.5:
            conversation = self.rng.choice(sorted(self.conversations))  # at most 256 to sort
            prompt = self.conversations[conversation] + user
        else:
            conversation = self.count
            prompt = list(self.rng.choice(self.system_prompts)) + user
        sampling_seed, legacy_seed = self._seeds()
        n = 1 if self.rng.random() < 0.75 else self.rng.randint(2, 4)
        max_new = self.rng.randint(16, 64)
        seed = resolve_sampling_seed(sampling_seed, legacy_seed)
        return GenerateRequest(rid, prompt, SamplingParams(seed, n), max_new), conversation

    def conversation_went_on(self, conversation: int, tokens: list[int]) -> None:
        """A turn finished: the next turn of this conversation starts from its tokens."""
        if conversation < 0 or (
            conversation not in self.conversations and self._let_go_of(conversation)
        ):
            return
        self.conversations[conversation] = tokens[:2048]

    def _let_go_of(self, conversation: int) -> bool:
        """Make room for a new conversation by letting the oldest go; True if the new one is
        itself older than all kept (then it is the one let go)."""
        if len(self.conversations) < MAX_CONVERSATIONS:
            return False
        oldest = min(self.conversations)
        if conversation < oldest:
            return True
        del self.conversations[oldest]
        return False


def run_round(sim: Simulator, workload: Workload, arrivals: int) -> list[KVEvent]:
    """Submit `arrivals` new requests, run one round, and let conversations go on."""
    for _ in range(arrivals):
        request, conversation = workload.next_request()
        sim.submit(request, conversation)
    return step_round(sim, workload)


def step_round(sim: Simulator, workload: Workload) -> list[KVEvent]:
    """Run one round of what was submitted, and let the conversations that finished go on."""
    events = sim.step()
    for conversation, request, tokens in sim.finished:
        if request.rid.endswith("-0") or "-" not in request.rid:  # choice 0 carries the turn on
            workload.conversation_went_on(conversation, tokens)
    sim.finished.clear()
    return events
