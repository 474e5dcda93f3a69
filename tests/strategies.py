"""Hypothesis strategies for events and batches, shared by the codec and publisher tests."""

from __future__ import annotations

from hypothesis import strategies as st

from tskv import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from tskv.events import HASH_LIMIT, HASH_MIN, TOKEN_LIMIT, TOKEN_MIN

hashes = st.integers(HASH_MIN, HASH_LIMIT - 1)
tokens = st.integers(TOKEN_MIN, TOKEN_LIMIT - 1)
names = st.none() | st.text(max_size=8)
small = st.none() | st.integers(0, 2**16)
extra_keys = st.none() | st.lists(
    st.none() | st.lists(st.text(max_size=4) | st.integers(-5, 5), max_size=3), max_size=3
)


def stored(optional: bool) -> st.SearchStrategy[BlockStored]:
    """BlockStored events; with `optional`, any of vLLM's optional fields may be set."""
    required = (
        st.lists(hashes, max_size=8),
        st.none() | hashes,
        st.lists(tokens, max_size=40),
        st.integers(1, 2**16),
    )
    if not optional:
        return st.builds(BlockStored, *required)
    return st.builds(
        BlockStored,
        *required,
        lora_id=st.none() | st.integers(0, 2**31),
        medium=names,
        lora_name=names,
        extra_keys=extra_keys,
        group_idx=small,
        kv_cache_spec_kind=names,
        kv_cache_spec_sliding_window=small,
        locality=names,
    )


def removed(optional: bool) -> st.SearchStrategy[BlockRemoved]:
    if not optional:
        return st.builds(BlockRemoved, st.lists(hashes, max_size=8))
    return st.builds(
        BlockRemoved, st.lists(hashes, max_size=8), medium=names, group_idx=small, locality=names
    )


def events(optional: bool = False) -> st.SearchStrategy[KVEvent]:
    return st.one_of(stored(optional), removed(optional), st.just(AllBlocksCleared()))


def batches(optional: bool = False) -> st.SearchStrategy[KVEventBatch]:
    return st.builds(
        KVEventBatch,
        st.floats(allow_nan=False, allow_infinity=False),
        st.lists(events(optional), max_size=6),
        st.none() | st.integers(0, 2**32),
    )
