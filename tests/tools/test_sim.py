"""The simulated scheduler: a prefix cache whose events rebuild it exactly, reproducibly."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

import tskv
from tskv import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tskv.sim import (
    CacheView,
    GenerateRequest,
    PrefixCache,
    SamplingParams,
    Simulator,
    Workload,
    chain_hashes,
    run_round,
)


def run(seed: int, rounds: int, offset: int = 0, cache: int = 64) -> list[list[tskv.KVEvent]]:
    sim = Simulator(cache_blocks=cache, block_size=4)
    workload = Workload(seed, block_size=4, sampling_seed_offset=offset)
    return [run_round(sim, workload, 2) for _ in range(rounds)]


def test_same_seeds_give_the_same_batches_byte_for_byte() -> None:
    first = [tskv.encode_batch(KVEventBatch(0.0, r, 0)) for r in run(7, 200)]
    second = [tskv.encode_batch(KVEventBatch(0.0, r, 0)) for r in run(7, 200)]
    assert first == second
    assert sum(len(r) for r in run(7, 200)) > 100  # a stream with something in it
    assert first != [tskv.encode_batch(KVEventBatch(0.0, r, 0)) for r in run(8, 200)]


def test_sampling_seeds_change_decode_blocks_not_shared_prompt_blocks() -> None:
    prompt = list(range(100, 132))  # 8 blocks of 4

    def stored(seed: int) -> list[tuple[int, ...]]:
        sim = Simulator(cache_blocks=256, block_size=4)
        sim.submit(GenerateRequest("r", prompt, SamplingParams(seed, n=3), max_new_tokens=16))
        events = []
        for _ in range(4):
            events += sim.step()
        return [e.block_hashes for e in events if isinstance(e, BlockStored)]

    a, b = stored(1), stored(100)  # choices get 1..3 and 100..102
    prompt_blocks = list(chain_hashes(prompt, 4))
    assert a[0] == b[0] == prompt_blocks  # stored once, shared by all three choices
    decode_a = {h for hashes in a[1:] for h in hashes}
    decode_b = {h for hashes in b[1:] for h in hashes}
    assert len(decode_a) == len(decode_b) == 3 * 4  # each choice decodes its own 4 blocks
    assert decode_a.isdisjoint(decode_b)
    assert stored(1) == a  # and the same seed decodes the same again


def test_no_seed_uses_the_crc32_of_the_choice_id_so_choices_still_differ() -> None:
    sim = Simulator(cache_blocks=256, block_size=4)
    sim.submit(GenerateRequest("r", list(range(8)), SamplingParams(None, n=2), 4))
    events = sim.step()
    decode = [e.block_hashes for e in events if isinstance(e, BlockStored)][1:]
    assert len(decode) == 2 and decode[0] != decode[1]


def test_workload_sampling_offset_keeps_prompts_and_changes_decodes() -> None:
    plain, shifted = Workload(3), Workload(3, sampling_seed_offset=99)
    for _ in range(20):
        (a, _), (b, _) = plain.next_request(), shifted.next_request()
        assert a.prompt_ids == b.prompt_ids and a.rid == b.rid
        assert (a.sampling.seed is None) == (b.sampling.seed is None)


def test_new_blocks_go_out_as_one_run_with_the_parent_of_the_first() -> None:
    cache = PrefixCache(capacity=10, block_size=2)
    chain = [(h, (i, i)) for i, h in enumerate([11, 12, 13])]
    assert cache.acquire(chain[:1], None)
    assert cache.acquire(chain, None)
    assert cache.take_events() == [
        BlockStored([11], None, [0, 0], 2),
        BlockStored([12, 13], 11, [1, 1, 2, 2], 2),
    ]
    assert cache.hits == 1 and cache.misses == 3


def test_eviction_is_lru_among_unreferenced_leaves_before_parents() -> None:
    cache = PrefixCache(capacity=3, block_size=1)
    assert cache.acquire([(1, (1,)), (2, (2,))], None)  # chain 1 <- 2
    assert cache.acquire([(3, (3,))], None)
    cache.release([1, 2])
    cache.release([3])  # 3 was used after 1 and 2, but 1 is 2's parent
    cache.take_events()
    assert cache.acquire([(4, (4,)), (5, (5,))], None)
    # LRU leaf first: 2 (older than 3), then 1 (now a leaf, older than 3), in one event
    assert cache.take_events()[:1] == [BlockRemoved([2, 1])]
    assert set(cache.blocks) == {3, 4, 5}


def test_a_full_cache_of_referenced_blocks_refuses_and_holds_nothing() -> None:
    cache = PrefixCache(capacity=2, block_size=1)
    assert cache.acquire([(1, (1,)), (2, (2,))], None)
    assert not cache.acquire([(1, (1,)), (9, (9,))], None)
    assert cache.blocks[1].refs == 1  # the hit taken during the attempt was given back
    assert cache.take_events() == [BlockStored([1, 2], None, [1, 2], 1)]


def test_reset_clears_everything_with_one_event() -> None:
    sim = Simulator(cache_blocks=64, block_size=4)
    workload = Workload(1, block_size=4)
    for _ in range(5):
        run_round(sim, workload, 2)
    assert sim.cached_hashes()
    assert sim.reset() == [AllBlocksCleared()]
    assert sim.cached_hashes() == frozenset()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), cache=st.integers(8, 200), rounds=st.integers(1, 80))
def test_the_events_rebuild_the_cache_exactly(seed: int, cache: int, rounds: int) -> None:
    sim = Simulator(cache_blocks=cache, block_size=4)
    workload = Workload(seed, block_size=4)
    view = CacheView()
    for round_number in range(rounds):
        events = run_round(sim, workload, 3)
        if round_number == rounds // 2:
            events += sim.reset()
        view.apply(round_number, tuple(events))
        assert view.blocks == sim.cached_hashes()
        assert len(view.blocks) <= cache


def test_a_workload_that_runs_for_hours_stays_bounded() -> None:
    """`tskv simulate` runs until stopped: after 20,000 rounds everything the workload and the
    simulator hold is within the same bounds as after a thousand (the conversations grew by
    one a round before, and were sorted for every request)."""
    from tskv.sim.simulator import MAX_CONVERSATIONS

    sim, workload = Simulator(256, 16), Workload(0, 16)

    def held() -> tuple[int, int, int, int]:
        tokens = sum(len(history) for history in workload.conversations.values())
        return len(workload.conversations), tokens, len(sim.cache.blocks), len(sim.waiting)

    for _ in range(1_000):
        run_round(sim, workload, 2)
    early = held()
    for _ in range(19_000):
        run_round(sim, workload, 2)
    late = held()
    assert late[0] == early[0] == MAX_CONVERSATIONS
    assert late[1] <= MAX_CONVERSATIONS * 2048 and late[2] <= 256
    assert late[3] <= early[3] + 8  # requests do not pile up waiting


def test_a_hybrid_cache_publishes_as_vllm_033_and_keeps_the_window_before_the_boundary() -> None:
    """A prompt of 10 blocks of 2 tokens: full attention stores all 10; the window group
    (WINDOW_BLOCKS blocks of span) keeps only the blocks before the replay boundary (block 9,
    the prompt less one token), and its event's tokens cover all 10."""
    from tskv.sim.hybrid_cache import WINDOW_BLOCKS, HybridCache

    cache = HybridCache(capacity=100, block_size=2, kind="sliding_window")
    chain = [(100 + i, (i, i)) for i in range(10)]
    assert cache.acquire(chain, None, prompt_tokens=20)
    full, window = cache.take_events()
    assert isinstance(full, BlockStored) and isinstance(window, BlockStored)
    assert (full.group_idx, full.kv_cache_spec_kind, full.block_hashes) == (
        0,
        "full_attention",
        [100 + i for i in range(10)],
    )
    span = math.ceil((WINDOW_BLOCKS * 2 - 1) / 2)
    assert window.block_hashes == [100 + i for i in range(9 - span, 9)]
    assert (window.group_idx, window.kv_cache_spec_sliding_window) == (1, WINDOW_BLOCKS * 2)
    assert len(window.token_ids) == 20 and window.parent_block_hash is None
    assert cache.engine_hit(chain, 20) == 9  # the hit ends at the boundary its window kept
    assert cache.engine_hit(chain[:5], 11) == 0  # no window before block 5: computed again
