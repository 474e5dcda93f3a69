"""Hypothesis strategies for events and batches, shared by the codec and publisher tests."""

from __future__ import annotations

from hypothesis import strategies as st

from tskv import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from tskv.events import HASH_LIMIT, HASH_MIN, TOKEN_LIMIT, TOKEN_MIN

hashes = st.integers(HASH_MIN, HASH_LIMIT - 1)
tokens = st.integers(TOKEN_MIN, TOKEN_LIMIT - 1)

events: st.SearchStrategy[KVEvent] = st.one_of(
    st.builds(
        BlockStored,
        st.lists(hashes, max_size=8),
        st.none() | hashes,
        st.lists(tokens, max_size=40),
        st.integers(1, 2**16),
    ),
    st.builds(BlockRemoved, st.lists(hashes, max_size=8)),
    st.just(AllBlocksCleared()),
)

batches = st.builds(
    KVEventBatch,
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(events, max_size=6),
    st.none() | st.integers(0, 2**32),
)
