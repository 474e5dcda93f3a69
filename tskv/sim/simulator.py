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

import random
import zlib
from collections import deque

import attrs

from tskv.core.events import KVEvent
from tskv.sim.block_hash import block_hash
from tskv.sim.hybrid_cache import Cache, make_cache
from tskv.sim.sampling import (
    GenerateRequest,
    SamplingParams,
    fan_out,
    resolve_sampling_seed,
)

VOCAB = 32_000


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
        model: str = "full",
    ) -> None:
        self.cache: Cache = make_cache(model, cache_blocks, block_size, medium)
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
            if not self.cache.acquire(chain, None, len(tokens)):
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
        return self.cache.cached_hashes()


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
        prompts: list[list[int]] | None = None,
    ) -> None:
        self.rng = random.Random(seed)
        self.prompts = prompts  # given a list, every prompt drawn is appended (a test's queries)
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
        if self.prompts is not None:
            self.prompts.append(list(prompt))
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
