"""The index's answer on hybrid models, against a brute-force model of vLLM 0.33's rules.

A hybrid worker's engine reuses the longest prefix every KV cache group accepts: full attention
needs every block before the hit, a sliding window of W tokens the ceil((W - 1) / block_size)
blocks just before it (every block when the hit is shorter), Mamba the state at its last block,
chunked local attention the blocks of its current chunk (read in vLLM 0.33's
`single_type_kv_cache_manager.py` and `kv_cache_coordinator.py`). The model here keeps what
each group really holds, by prefix, and answers by trying every length from the longest down,
with the definitions written out; it shares no code with `tskv.core.groups`. Events are made
as vLLM's `BlockPool.cache_full_blocks` makes them: a group that does not keep every block
leaves the skipped ones out of its hashes while its tokens cover them all.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tskv
from tests.strategies import examples
from tskv import AllBlocksCleared, BlockRemoved, BlockStored, CacheGroup, KVEvent, decode_batch
from tskv.core.codec import encode_round
from tskv.core.journal_index import JournalIndex
from tskv.core.snapshot import CacheState, SnapshotBuilder

BS = 2  # the index's block size, and every group's smallest
Prefix = tuple[int, ...]


def engine_hash(prefix: Prefix) -> int:
    """The engine's hash of the block ending `prefix`: the same in every group (vLLM's)."""
    return hash(("engine", prefix)) & (2**63 - 1)


class Model:
    """What one worker's engine holds, per (medium, group): each block (by the prefix it
    ends) with its copies, and whether the index can know its content key ("filed"): when it
    was stored under a parent filed somewhere, or (a skipping store's) its hash was filed
    somewhere; a later store of the same block that can be filed files its earlier copies."""

    def __init__(self, groups: dict[int, CacheGroup], told: bool) -> None:
        self.groups = groups
        self.learned = set(groups) if told else set()  # what the index knows of the groups
        self.held: dict[tuple[str, int], dict[Prefix, int]] = {}
        self.filed: dict[tuple[str, int], set[Prefix]] = {}
        self.unplaced = 0

    def filed_anywhere(self, prefix: Prefix) -> bool:
        return any(prefix in blocks for blocks in self.filed.values())

    def store(
        self,
        prompt: Sequence[int],
        group: int,
        medium: str,
        start: int,
        end: int,
        keep: Sequence[bool],
    ) -> BlockStored:
        """Store the group's blocks start..end-1 of `prompt` (in its own block size), the
        skipped ones left out of the event's hashes as vLLM does."""
        spec = self.groups[group]
        size = spec.block_size
        kept = [block for block, on in zip(range(start, end), keep, strict=False) if on]
        if spec.kind == "full_attention":
            kept = list(range(start, end))  # full attention keeps every block
        prefixes = [tuple(prompt[: (block + 1) * size]) for block in kept]
        skipping = len(kept) < end - start
        self.learned.add(group)
        parent = tuple(prompt[: start * size])
        chained = not start or self.filed_anywhere(parent)  # else the index's orphans
        tier = (medium, group)
        blocks, filed = self.held.setdefault(tier, {}), self.filed.setdefault(tier, set())
        for prefix in prefixes:
            known = self.filed_anywhere(prefix) if skipping else chained
            self.unplaced += skipping and not known
            blocks[prefix] = blocks.get(prefix, 0) + 1
            if known:
                filed.add(prefix)  # every copy of it in this tier: the same block
        return BlockStored(
            [engine_hash(prefix) for prefix in prefixes],
            engine_hash(parent) if start else None,
            list(prompt[start * size : end * size]),
            size,
            medium=medium,
            group_idx=group,
            kv_cache_spec_kind=spec.kind,
            kv_cache_spec_sliding_window=spec.window
            if spec.kind != "chunked_local_attention"
            else None,
        )

    def remove(self, tier: tuple[str, int], prefix: Prefix) -> BlockRemoved:
        blocks = self.held[tier]
        blocks[prefix] -= 1
        if not blocks[prefix]:
            del blocks[prefix]
            self.filed[tier].discard(prefix)
        return BlockRemoved([engine_hash(prefix)], medium=tier[0], group_idx=tier[1])

    def clear(self) -> AllBlocksCleared:
        self.held.clear()
        self.filed.clear()
        return AllBlocksCleared()

    # -- the engine's answer, tried length by length -----------------------------------------

    def holds(self, group: int, prefix: Prefix, device_only: bool) -> bool:
        return any(
            prefix in blocks
            for (medium, index), blocks in self.filed.items()
            if index == group and (medium == "GPU" or not device_only)
        )

    def accepts(self, group: int, query: Sequence[int], length: int, device_only: bool) -> bool:
        """Whether the group can serve a hit of `length` index blocks, by its definition."""
        spec = self.groups[group]
        size, tokens = spec.block_size, length * BS
        if tokens % size:
            return False  # a group serves whole blocks of its own
        blocks = tokens // size

        def held(block: int) -> bool:
            return self.holds(group, tuple(query[: (block + 1) * size]), device_only)

        if spec.kind == "full_attention":
            needed = range(blocks)
        elif spec.kind == "sliding_window":
            assert spec.window is not None
            window_blocks = max(1, math.ceil((spec.window - 1) / size))
            needed = range(max(0, blocks - window_blocks), blocks)
        elif spec.kind == "mamba":
            needed = range(blocks - 1, blocks) if blocks else range(0)
        else:  # chunked local attention: the blocks of the hit's current chunk
            assert spec.window is not None
            first = (tokens // spec.window * spec.window) // size
            needed = range(first, blocks)
        return all(held(block) for block in needed)

    def answer(self, query: Sequence[int], device_only: bool) -> int:
        known = [g for g in sorted(self.learned) if self.groups[g].kind != "unknown"]
        longest = len(query) // BS
        if len(known) > 1:  # vLLM's cap on a hybrid: the last prompt token is computed
            longest = (len(query) - 1) // BS
        if not known:  # no rule known: the leading run held in any group, as a plain worker's
            run = 0
            while run < longest and any(
                self.holds(g, tuple(query[: (run + 1) * BS]), device_only) for g in self.groups
            ):
                run += 1
            return run
        for length in range(longest, 0, -1):
            if all(self.accepts(g, query, length, device_only) for g in known):
                return length
        return 0


KINDS = [
    CacheGroup("sliding_window", 2, 2),
    CacheGroup("sliding_window", 2, 5),
    CacheGroup("sliding_window", 4, 9),
    CacheGroup("mamba", 2),
    CacheGroup("mamba", 4),
    CacheGroup("chunked_local_attention", 2, 4),
]
tokens = st.sampled_from([1, 2, 3])
prompts = st.lists(st.lists(tokens, min_size=4, max_size=14), min_size=1, max_size=3)


@st.composite
def steps(draw: st.DrawFn) -> tuple[CacheGroup, list[list[int]], list[tuple[object, ...]]]:
    other = draw(st.sampled_from(KINDS))
    chosen_prompts = draw(prompts)
    made = []
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear"]))
        if kind == "store":
            prompt = draw(st.integers(0, len(chosen_prompts) - 1))
            medium = draw(st.sampled_from(["GPU", "GPU", "CPU"]))
            start, span = draw(st.integers(0, 3)), draw(st.integers(1, 4))
            keep = draw(st.lists(st.booleans(), min_size=4, max_size=4))
            made.append((kind, prompt, medium, start, span, keep, draw(st.booleans())))
        elif kind == "remove":
            made.append((kind, draw(st.integers(0, 10**6))))
        else:
            made.append((kind,))
    return other, chosen_prompts, made


@settings(max_examples=examples(400), deadline=None)
@given(steps(), st.booleans(), st.booleans())
def test_the_index_answers_what_the_engine_would_reuse(
    drawn: tuple[CacheGroup, list[list[int]], list[tuple[object, ...]]],
    told: bool,
    mirrored: bool,
) -> None:
    """Applied here, or (`mirrored`) by a reader process's index whose changes this one
    mirrors, as the watcher's readers send them (msgpack, and back)."""
    other, prompts_, plan = drawn
    groups = {0: CacheGroup("full_attention", BS), 1: other}
    source: Any = JournalIndex(BS) if mirrored else tskv.PrefixIndex(BS)
    index = tskv.PrefixIndex(BS) if mirrored else source
    if told:  # the chunk of chunked local attention is never on the wire: told, or unknown
        source.set_groups("w", groups)
    elif other.kind == "chunked_local_attention":
        groups = {0: groups[0], 1: CacheGroup("unknown", 2)}
    model = Model(groups, told)
    for step in plan:
        batch = list(model_batch(model, prompts_, step))
        if batch:
            source.apply("w", batch)
        if mirrored:
            sent = msgpack.packb(source.take_changes("w"))
            runs, ops = msgpack.unpackb(sent, strict_map_key=False)
            index.apply_changes("w", runs, ops, lookahead=source.lookahead("w"))
        for prompt in prompts_:
            for length in range(2, len(prompt) + 1):
                query = prompt[:length]
                every, device = model.answer(query, False), model.answer(query, True)
                got = index.match(query)
                assert (got.get("w", 0), got.on_device("w")) == (every, device), (query, model.held)
    assert source.statistics().unplaced == model.unplaced


def model_batch(
    model: Model, prompts_: list[list[int]], step: tuple[object, ...]
) -> Iterator[KVEvent]:
    """The events one step of the plan makes, as the model's engine sends them."""
    if step[0] == "store":
        _, which, medium, start, span, keep, both = step
        prompt = prompts_[which]  # type: ignore[index]
        size = model.groups[1].block_size
        end = min(start + span, len(prompt) // size)  # type: ignore[operator]
        if end <= start:  # type: ignore[operator]
            return
        if both:  # the step stored it in the full-attention group too, first
            first, last = start * size // BS, end * size // BS  # type: ignore[operator]
            yield model.store(prompt, 0, medium, first, last, [True] * 8)  # type: ignore[arg-type]
        if model.groups[1].kind != "unknown":
            yield model.store(prompt, 1, medium, start, end, keep)  # type: ignore[arg-type]
    elif step[0] == "remove":
        held = [(tier, prefix) for tier, blocks in model.held.items() for prefix in blocks]
        if held:
            tier, prefix = sorted(held)[step[1] % len(held)]  # type: ignore[operator]
            yield model.remove(tier, prefix)
    else:
        yield model.clear()


def test_a_group_block_size_the_index_cannot_cut_is_refused_naming_the_fix() -> None:
    index = tskv.PrefixIndex(16)
    event = BlockStored([1], None, list(range(24)), 24, group_idx=1, kv_cache_spec_kind="mamba")
    with pytest.raises(tskv.ConfigError, match=r"not a multiple of the index's 16.*block_size=8"):
        index.apply("w", [event])
    with pytest.raises(tskv.ConfigError, match="not a multiple"):
        index.set_groups("v", {0: CacheGroup("full_attention", 24)})


FULL = {"medium": "GPU", "kv_cache_spec_kind": "full_attention"}
WINDOW = {
    "medium": "GPU",
    "kv_cache_spec_kind": "sliding_window",
    "kv_cache_spec_sliding_window": 32,
}


def test_a_block_stored_twice_in_a_group_stays_until_both_copies_are_removed() -> None:
    """vLLM computes a block again when another group cut the hit short, keeps both copies,
    and sends a store and later a removal for each."""
    index = tskv.PrefixIndex(16)
    tokens = list(range(100, 132))
    stored = BlockStored([1, 2], None, tokens, 16, group_idx=0, **FULL)  # type: ignore[arg-type]
    index.apply("w", [stored, BlockStored([1, 2], None, tokens, 16, group_idx=1, **WINDOW)])  # type: ignore[arg-type]
    index.apply("w", [stored])  # the second copy
    index.apply("w", [BlockRemoved([2], medium="GPU", group_idx=0)])
    assert index.match([*tokens, 0]) == {"w": 2}
    index.apply("w", [BlockRemoved([2], medium="GPU", group_idx=0)])
    assert index.match([*tokens, 0]) == {"w": 1}


def test_a_window_group_skipping_blocks_is_filed_under_the_full_groups_keys() -> None:
    """The vectors' first case: group 1's hashes are blocks 2 and 3 of the four its tokens
    cover; its removal of block 3 leaves the full-attention group's copy."""
    index = tskv.PrefixIndex(16)
    tokens = list(range(1000, 1064))
    full = BlockStored([101, 102, 103, 104], None, tokens, 16, group_idx=0, **FULL)  # type: ignore[arg-type]
    window = BlockStored([103, 104], None, tokens, 16, group_idx=1, **WINDOW)  # type: ignore[arg-type]
    for order in ([full, window], [window, full]):  # the batch's order does not matter
        index.apply("w", [AllBlocksCleared(), *order])
        assert index.match([*tokens, 0]) == {"w": 4}  # the window's two blocks, and all four
        assert index.statistics().unplaced == 0
    index.apply("w", [BlockRemoved([104], medium="GPU", group_idx=1)])
    # the window group no longer has the 2 blocks before a hit of 4, nor of 3 (block 1 it never
    # kept): the engine would compute all of it again
    assert index.match([*tokens, 0]) == {}
    assert index.engine_hashes("w") == {101, 102, 103, 104}


@settings(max_examples=examples(200), deadline=None)
@given(steps(), st.sampled_from([1, 3, 64]))
def test_a_snapshot_of_a_hybrid_stream_rebuilds_the_same_answers(
    drawn: tuple[CacheGroup, list[list[int]], list[tuple[object, ...]]], part_blocks: int
) -> None:
    """The publisher's snapshot (its groups declared, tier by tier with full attention's group
    first, each further copy a store of its own) gives a consumer the index the live stream
    gave. Where the live stream left blocks unfiled (a parent never seen, a skipped block found
    nowhere) the snapshot, parents first, may file more; a block that only a skipping group
    still holds it cannot place: those runs are compared by what the snapshot holds."""
    other, prompts_, plan = drawn
    if other.kind == "chunked_local_attention":
        return  # its chunk is never on the wire: nothing to rebuild it from
    groups = {0: CacheGroup("full_attention", BS), 1: other}
    model, live, state = Model(groups, told=False), tskv.PrefixIndex(BS), CacheState()
    for step in plan:
        batch = list(model_batch(model, prompts_, step))
        if batch:
            live.apply("w", batch)
            payload = encode_round(1.0, batch, 0, "vllm")
            assert payload is not None
            state.apply(payload, batch)
    builder = SnapshotBuilder(state.freeze(9), 2.0, 0, "vllm", part_blocks)
    rebuilt = tskv.PrefixIndex(BS)
    while (payload := builder.next_payload()) is not None:
        rebuilt.apply("w", decode_batch(payload))
    skipped_only = {  # blocks a skipping group holds that no full-attention copy does
        engine_hash(prefix)
        for (medium, group), blocks in model.held.items()
        if group == 1
        for prefix in blocks
        if not any(prefix in held for (m, g), held in model.held.items() if g == 0)
    }
    statistics = live.statistics()
    assert live.engine_hashes("w") - skipped_only <= rebuilt.engine_hashes("w")
    if not skipped_only and not statistics.orphans and not statistics.unplaced:
        assert rebuilt.engine_hashes("w") == live.engine_hashes("w")
        for prompt in prompts_:
            for length in range(2, len(prompt) + 1):
                assert rebuilt.match(prompt[:length]) == live.match(prompt[:length])


@pytest.mark.parametrize(
    "events",
    [
        # a lower tier's store naming one hash twice: the second copy, under no key,
        # replaces the first, which the same event took
        [BlockStored([5, 5], None, [1, 1], 2, medium="CPU")],
        # a hybrid worker's block replaced by one no query reaches, named twice
        [
            BlockStored([5], None, [1, 1], 2),
            BlockStored([6], None, [2, 2], 2, medium="CPU"),
            BlockStored([5, 5], None, [], 2),
        ],
    ],
)
def test_a_tiered_workers_block_replaced_within_a_batch_is_let_go_of_once(
    events: list[KVEvent],
) -> None:
    """A worker with a tier files each event as a plain worker would in that tier: here the
    index is left as if the replaced block had never come, where it once let go of a key it
    did not hold yet, or held no longer, and raised KeyError."""
    index = tskv.PrefixIndex(2)
    index.apply("w", events)
    assert index.match([1, 1]) == {}
    assert index.engine_hashes("w") >= {5}
    index.apply("w", [AllBlocksCleared()])
    assert len(index) == 0
