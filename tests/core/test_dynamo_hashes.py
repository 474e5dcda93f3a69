"""Dynamo's block hashes kept beside the index (`tskv serve --dynamo-hashes`): made as Dynamo
makes them, and in step with the index through stores, removals, clears and losses."""

from __future__ import annotations

import pytest

pytest.importorskip("xxhash", reason="the serve extra is not installed (pip install '.[serve]')")

from tskv.core.block_keys import blocks_of
from tskv.core.dynamo_hashes import DynamoHashes, answer, tokens_hash
from tskv.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from tskv.core.journal_index import JournalIndex
from tskv.core.prefix_index import PrefixIndex
from tskv.core.worker_view import ViewChange
from tskv.sim import Simulator, Workload, run_round

SIZE = 4


def stored(hashes: list[int], parent: int | None, tokens: list[int], **more: object) -> BlockStored:
    return BlockStored(hashes, parent, tokens, SIZE, **more)  # type: ignore[arg-type]


def prefix(tokens: list[int]) -> list[int]:
    return [tokens_hash(block) for block in blocks_of(tokens, SIZE)]


def test_a_blocks_hash_is_dynamos() -> None:
    # made by ai-dynamo-runtime 1.6.1's own compute_block_hash_for_seq([0, 1, 2, 3], 4), and
    # with lora_name="lx"; tests/interop/test_service_dropin.py checks more against it
    assert tokens_hash([0, 1, 2, 3]) == 9143094415614847814
    assert tokens_hash([0, 1, 2, 3], "lx") == 8358943602452934160
    assert tokens_hash([0, 1, 2, 3], "") == tokens_hash([0, 1, 2, 3])


def test_the_hashes_answer_as_the_index_does_through_a_workload() -> None:
    index = PrefixIndex(SIZE, dynamo_hashes=True)
    prompts: list[list[int]] = []
    for worker, seed in ((("a", 0), 1), (("b", 0), 2)):
        sim, workload = Simulator(64, SIZE, medium="GPU"), Workload(seed, SIZE, prompts=prompts)
        for _ in range(80):  # a small cache: blocks are evicted and stored again
            index.apply(worker, run_round(sim, workload, 1))
    held = 0
    for prompt in prompts:
        counts, lower = index.dynamo.match(prefix(prompt))
        assert (counts, lower) == (dict(index.match(prompt)), {}), prompt[:8]
        held += bool(counts)
    assert held  # some prompts are held: the comparison can fail


def test_tiers_removals_and_clears_are_followed() -> None:
    index = PrefixIndex(SIZE, dynamo_hashes=True)
    tokens = list(range(12))
    index.apply("w", [stored([1, 2], None, tokens[:8], medium="GPU")])
    index.apply("w", [stored([3], 2, tokens[8:], medium="CPU")])
    assert index.dynamo.match(prefix(tokens)) == ({"w": 3}, {"w": 1})
    index.apply("w", [BlockRemoved([2], medium="GPU")])
    assert index.dynamo.match(prefix(tokens)) == ({"w": 1}, {})
    assert [store[:3] for store in index.dynamo.stores("w")] == [
        ("device", None, 1),
        ("host_pinned", 2, 3),
    ]
    index.apply("w", [AllBlocksCleared()])
    assert index.dynamo.match(prefix(tokens)) == ({}, {})
    index.apply("w", [stored([1], None, tokens[:4])])
    index.carry_out("w", [ViewChange.CLEAR])  # a loss: the index forgets, and so do the hashes
    assert index.dynamo.stores("w") == [] and index.dynamo.match(prefix(tokens)) == ({}, {})
    index.apply("w", [stored([1], None, tokens[:4])])
    index.remove_worker("w")
    assert index.dynamo.workers() == [] and index.dynamo.match(prefix(tokens)) == ({}, {})


def test_what_dynamo_would_hash_otherwise_is_left_out_and_counted() -> None:
    hashes = DynamoHashes(SIZE)
    tokens = list(range(8))
    hashes.apply(
        "w",
        [
            stored([2], None, tokens[:4], cache_salt="tenant"),
            stored([3], 99, tokens[4:]),  # a parent it never saw: Dynamo skips it too
            stored([4], None, [1, 2, 3, -1]),
            BlockStored([5], None, tokens[:8], 8),  # another block size
        ],
    )
    assert hashes.left_out == 4
    assert hashes.stores("w") == [] and hashes.match(prefix(tokens)) == ({}, {})


def test_a_reader_processes_index_keeps_them_and_answers_for_a_worker() -> None:
    """A reader process's JournalIndex keeps them as the router's index would, and answers
    for one worker in plain lists (as its frames carry them)."""
    reader = JournalIndex(SIZE, dynamo_hashes=True)
    tokens = list(range(8))
    reader.apply("w", [stored([1, 2], None, tokens, medium="GPU"), stored([3], None, tokens[:4])])
    reader.apply("w", [stored([4], None, tokens[:4], cache_salt="tenant")])
    assert answer(reader.dynamo, "w", prefix(tokens)) == [2, 0]
    left_out, stores = answer(reader.dynamo, "w", None)
    assert left_out == 1 and [store[2] for store in stores] == [1, 3, 2]
    assert answer(None, "w", None) == []  # an index that keeps none
