"""The publisher's cache state and the snapshots made from it, without sockets.

The oracle is a model that keeps, per cached block, everything a consumer needs to rebuild it
(its parent, its tokens, its fields): applying a snapshot's events to an empty model must give
the model the whole stream built, with every parent stored before its children.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tskv import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, decode_batch
from tskv.core.codec import DroppedFields, encode_round
from tskv.core.snapshot import CacheState, SnapshotBuilder
from tskv.core.wire_format import WireFormat

BLOCK = 2
Key = tuple[str | None, int]  # (medium, hash)
Model = dict[Key, tuple[Any, ...]]


def model_apply(
    model: Model, events: list[KVEvent], order: list[Key] | None = None, wire: WireFormat = "vllm"
) -> None:
    """What a consumer of `wire` ends with: TokenSpeed's carries no tier nor optional field."""
    full = wire == "vllm"
    for event in events:
        if isinstance(event, BlockStored):
            hashes = event.block_hashes
            extra = event.extra_keys if full else None
            for j, block in enumerate(hashes):
                parent = event.parent_block_hash if j == 0 else hashes[j - 1]
                keys = None if extra is None or len(extra) != len(hashes) else extra[j]
                tokens = tuple(event.token_ids[j * BLOCK : (j + 1) * BLOCK])
                key = (event.medium if full else None, block)
                model[key] = (parent, tokens, keys, event.lora_name if full else None)
                if order is not None:
                    order.append(key)
        elif isinstance(event, BlockRemoved):
            for block in event.block_hashes:
                model.pop((event.medium if full else None, block), None)
        else:
            model.clear()


def follow(state: CacheState, events: list[KVEvent], wire: WireFormat = "vllm") -> None:
    """What the publish task does with a batch (the publisher counts and says what is dropped)."""
    payload = encode_round(1.0, events, 0, wire, dropped=DroppedFields(lambda message: None))
    if payload is not None:
        state.apply(payload, events)


def snapshot_events(
    state: CacheState, part_blocks: int = 5, wire: WireFormat = "vllm"
) -> tuple[list[KVEvent], int]:
    builder = SnapshotBuilder(state.freeze(42), 7.0, 3, wire, part_blocks)
    events: list[KVEvent] = []
    parts = 0
    while (payload := builder.next_payload()) is not None:
        batch = decode_batch(payload)  # the parts are real batches on the wire
        assert (batch.ts, batch.attn_dp_rank) == (7.0, 3)
        events.extend(batch.events)
        parts += 1
    assert builder.next_seq == 42
    return events, parts


mediums = st.sampled_from([None, "CPU"])
block_hashes = st.integers(0, 24)  # few, so blocks are stored again, removed, re-parented


@st.composite
def stored_events(draw: st.DrawFn) -> BlockStored:
    hashes = draw(st.lists(block_hashes, min_size=1, max_size=5, unique=True))
    full = draw(st.booleans())  # schedulers may send fewer tokens than the blocks hold
    count = len(hashes) * BLOCK if full else draw(st.integers(0, len(hashes) * BLOCK))
    tokens = draw(st.lists(st.integers(0, 99), min_size=count, max_size=count))
    extra = draw(st.none() | st.just([[f"k{h}"] for h in hashes]))
    return BlockStored(
        hashes,
        draw(st.none() | block_hashes),
        tokens,
        BLOCK,
        medium=draw(mediums),
        lora_name=draw(st.none() | st.just("adapter")),
        extra_keys=extra,
    )


removed_events = st.builds(
    BlockRemoved, st.lists(block_hashes, min_size=1, max_size=4), medium=mediums
)
streams = st.lists(
    st.lists(
        st.one_of(stored_events(), stored_events(), removed_events, st.just(AllBlocksCleared())),
        max_size=4,
    ),
    max_size=40,
)


def acyclic(model: Model, key: Key) -> bool:
    seen = set()
    while key in model and key not in seen:
        seen.add(key)
        key = (key[0], model[key][0])
    return key not in seen


@settings(max_examples=400)
@given(streams, st.integers(1, 8), st.sampled_from(["vllm", "tokenspeed"]))
def test_a_snapshot_rebuilds_every_cached_block_parents_first(
    batches: list[list[KVEvent]], part_blocks: int, wire: WireFormat
) -> None:
    state, model = CacheState(tiered=wire == "vllm"), {}
    for events in batches:
        follow(state, events, wire)
        model_apply(model, events, wire=wire)
    assert state.blocks == len(model)  # memory follows the cache, not the history

    events, parts = snapshot_events(state, part_blocks, wire)
    # A snapshot marks what it has sent in its own frozen copy: the live state is untouched,
    # so the next snapshot is the same one.
    assert snapshot_events(state, part_blocks, wire) == (events, parts)
    assert isinstance(events[0], AllBlocksCleared)
    assert parts >= 1 and all(not isinstance(e, AllBlocksCleared) for e in events[1:])
    rebuilt: Model = {}
    order: list[Key] = []
    model_apply(rebuilt, events, order, wire)
    assert rebuilt == model
    assert len(order) == len(model)  # each block once
    position = {key: index for index, key in enumerate(order)}
    for key, (parent, *_) in model.items():
        parent_key = (key[0], parent)
        if parent_key in model and acyclic(model, key):
            assert position[parent_key] < position[key], f"{parent_key} after its child {key}"


def test_a_parent_stored_again_after_its_child_still_goes_first() -> None:
    state = CacheState()
    follow(state, [BlockStored([1, 2], None, [0] * 4, BLOCK)])  # 1 <- 2
    follow(state, [BlockRemoved([1])])
    follow(state, [BlockStored([1], None, [5, 5], BLOCK)])  # 1 is back, after its child 2
    events, _ = snapshot_events(state)
    # 1 goes first, and 2 goes on its chain: one event says both.
    assert chains(events) == [([1, 2], None, [5, 5, 0, 0])]


def chains(events: list[KVEvent]) -> list[tuple[list[int], int | None, list[int | str]]]:
    return [
        (list(e.block_hashes), e.parent_block_hash, list(e.token_ids))
        for e in events
        if isinstance(e, BlockStored)
    ]


def test_a_request_stored_over_rounds_goes_out_as_one_event_per_part() -> None:
    state = CacheState()
    for first in (1, 3, 5):  # a request's blocks, two a round, each round's parent the last
        parent = None if first == 1 else first - 1
        keys = [[f"k{first}"], [f"k{first + 1}"]]
        stored = BlockStored([first, first + 1], parent, [first] * 4, BLOCK, extra_keys=keys)
        follow(state, [stored])
    events, parts = snapshot_events(state, part_blocks=4)
    assert (parts, chains(events)) == (
        2,
        [([1, 2, 3, 4], None, [1] * 4 + [3] * 4), ([5, 6], 4, [5] * 4)],
    )
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [list(e.extra_keys or ()) for e in stored] == [
        [["k1"], ["k2"], ["k3"], ["k4"]],
        [["k5"], ["k6"]],
    ]


def test_runs_are_not_joined_across_short_tokens_or_other_fields() -> None:
    state = CacheState()
    follow(state, [BlockStored([1, 2], None, [0, 0, 0], BLOCK)])  # block 2 has one token
    follow(state, [BlockStored([3], 2, [3, 3], BLOCK)])
    follow(state, [BlockStored([4], 3, [4, 4], BLOCK, medium="CPU")])
    follow(state, [BlockStored([5], 3, [5, 5], BLOCK, extra_keys=[["k"], ["k"]])])  # 2 for 1 block
    follow(state, [BlockStored([6], 5, [6, 6], BLOCK, extra_keys=[["k"], ["k"]])])
    events, _ = snapshot_events(state, part_blocks=100)
    assert [hashes for hashes, _, _ in chains(events)] == [[1, 2], [3], [5], [6], [4]]


def test_a_whole_event_goes_out_as_it_was_and_a_partly_removed_one_in_runs() -> None:
    state = CacheState()
    whole = BlockStored([10, 11], None, [1, 2, 3, 4], BLOCK, lora_name="a")
    follow(state, [whole, BlockStored([20, 21, 22, 23], 11, list(range(8)), BLOCK)])
    follow(state, [BlockRemoved([21])])
    events, _ = snapshot_events(state, part_blocks=100)
    assert events[1] == whole
    assert [(list(e.block_hashes), e.parent_block_hash, list(e.token_ids)) for e in events[2:]] == [  # type: ignore[union-attr]
        ([20], 11, [0, 1]),
        ([22, 23], 21, [4, 5, 6, 7]),  # its parent is named even though it is gone
    ]


def test_an_empty_or_cleared_cache_is_one_part_that_only_clears() -> None:
    state = CacheState()
    assert snapshot_events(state) == ([AllBlocksCleared()], 1)
    follow(state, [BlockStored([1], None, [0, 0], BLOCK), AllBlocksCleared()])
    assert snapshot_events(state) == ([AllBlocksCleared()], 1)
    assert state.blocks == 0


def test_the_frozen_state_is_not_changed_by_later_batches() -> None:
    state = CacheState()
    follow(state, [BlockStored([1, 2], None, [0] * 4, BLOCK)])
    builder = SnapshotBuilder(state.freeze(1), 0.0, 0, "tokenspeed")
    follow(state, [AllBlocksCleared(), BlockStored([9], None, [0, 0], BLOCK)])
    payload = builder.next_payload()
    assert payload is not None and builder.next_payload() is None
    assert decode_batch(payload).events[1:] == [BlockStored([1, 2], None, [0] * 4, BLOCK)]


def test_tiers_are_kept_apart() -> None:
    state = CacheState()
    follow(
        state,
        [
            BlockStored([1], None, [0, 0], BLOCK),
            BlockStored([1], None, [0, 0], BLOCK, medium="CPU"),
        ],
    )
    follow(state, [BlockRemoved([1], medium="CPU")])
    events, _ = snapshot_events(state)
    assert events[1:] == [BlockStored([1], None, [0, 0], BLOCK)]


def test_on_a_wire_without_tiers_a_block_in_two_tiers_is_one_block() -> None:
    """A TokenSpeed-wire consumer sees the store twice and the removal once, and forgets the
    block; a snapshot must leave it where following the stream would."""
    state = CacheState(tiered=False)
    stores = [
        BlockStored([1], None, [0, 0], BLOCK),
        BlockStored([1], None, [0, 0], BLOCK, medium="CPU"),
    ]
    follow(state, stores, "tokenspeed")
    follow(state, [BlockRemoved([1], medium="CPU")], "tokenspeed")
    assert snapshot_events(state, wire="tokenspeed") == ([AllBlocksCleared()], 1)


def test_the_state_keeps_no_reference_to_the_schedulers_lists() -> None:
    state = CacheState()
    hashes, tokens = [1, 2], [7, 7, 8, 8]
    follow(state, [BlockStored(hashes, None, tokens, BLOCK)])
    hashes[:] = [5, 6]  # a scheduler reusing its buffers for the next round
    tokens[:] = [0, 0, 0, 0]
    events, _ = snapshot_events(state)
    assert events[1:] == [BlockStored([1, 2], None, [7, 7, 8, 8], BLOCK)]


def test_a_subclass_of_an_event_is_followed_as_the_event_it_is() -> None:
    """vLLM's wire encodes by isinstance, so a scheduler's subclass gets published; the state
    must neither drop it nor mistake it for a cache reset."""

    class MyStored(BlockStored):
        pass

    class MyRemoved(BlockRemoved):
        pass

    state = CacheState()
    follow(state, [BlockStored([1], None, [0, 0], BLOCK), MyStored([2], 1, [3, 3], BLOCK)])
    follow(state, [MyRemoved([1])])
    assert state.blocks == 1
    events, _ = snapshot_events(state)
    assert [list(e.block_hashes) for e in events[1:]] == [[2]]  # type: ignore[union-attr]
