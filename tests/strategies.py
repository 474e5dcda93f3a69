"""Hypothesis strategies for events and batches, shared by the codec and publisher tests; and
how many examples a property runs."""

from __future__ import annotations

import os
from types import MappingProxyType
from typing import Any

from hypothesis import strategies as st

from tskv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    MMKey,
    UnknownEvent,
)
from tskv.core.events import FIELDS, HASH_LIMIT, HASH_MIN, TOKEN_LIMIT, TOKEN_MIN

# `nox -s sanitize` runs the compiled core's properties with more examples than the tests do:
# under the sanitizers each example is also a check of the memory it touched.
EXAMPLES_SCALE = int(os.environ.get("TSKV_EXAMPLES_SCALE", "1"))


def examples(count: int) -> int:
    """`count` examples, scaled by TSKV_EXAMPLES_SCALE."""
    return count * EXAMPLES_SCALE


hashes = st.integers(HASH_MIN, HASH_LIMIT - 1)
tokens = st.integers(TOKEN_MIN, TOKEN_LIMIT - 1)
names = st.none() | st.text(max_size=8)
small = st.none() | st.integers(0, 2**16)
extra_keys = st.none() | st.lists(
    st.none() | st.lists(st.text(max_size=4) | st.integers(-5, 5), max_size=3), max_size=3
)


KNOWN_NAMES = {"type", *(name for fields in FIELDS.values() for name in fields)}
# what a newer engine might add: values of any msgpack shape, under names tskv does not know
wire_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=6,
)
new_names = st.text(min_size=1, max_size=6).filter(lambda name: name not in KNOWN_NAMES)
unknown_fields = st.dictionaries(new_names, wire_values, max_size=3).map(
    lambda fields: MappingProxyType(fields)
)
mm_key = st.builds(MMKey, st.text(max_size=6), st.integers(0, 2**16), st.none() | st.text())
token_lists = st.lists(tokens | st.sampled_from(["<image>", "<audio>"]), max_size=40)


def stored(optional: bool) -> st.SearchStrategy[BlockStored]:
    """BlockStored events; with `optional`, any optional field (vLLM's, TensorRT-LLM's,
    SGLang's, unknown ones) may be set, and token ids may be strings."""
    required: tuple[st.SearchStrategy[Any], ...] = (
        st.lists(hashes, max_size=8),
        st.none() | hashes,
        token_lists if optional else st.lists(tokens, max_size=40),
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
        mm_keys=st.none() | st.lists(st.lists(mm_key, max_size=2), max_size=3),
        cache_salt=names,
        session_id=names,
        unknown_fields=unknown_fields,
    )


def removed(optional: bool) -> st.SearchStrategy[BlockRemoved]:
    if not optional:
        return st.builds(BlockRemoved, st.lists(hashes, max_size=8))
    return st.builds(
        BlockRemoved,
        st.lists(hashes, max_size=8),
        medium=names,
        group_idx=small,
        locality=names,
        unknown_fields=unknown_fields,
    )


def unknown_events() -> st.SearchStrategy[UnknownEvent]:
    """Events of a type no engine tskv knows sends yet, with fields of any shape."""
    types = new_names.filter(lambda name: name not in {kind.__name__ for kind in FIELDS})
    fields = st.dictionaries(new_names, wire_values, max_size=3)
    return st.builds(UnknownEvent, types, fields.map(lambda f: MappingProxyType(f)))


def events(optional: bool = False) -> st.SearchStrategy[KVEvent]:
    if not optional:
        return st.one_of(stored(False), removed(False), st.just(AllBlocksCleared()))
    cleared = st.builds(AllBlocksCleared, unknown_fields=unknown_fields)
    return st.one_of(stored(True), removed(True), cleared, unknown_events())


def batches(optional: bool = False) -> st.SearchStrategy[KVEventBatch]:
    return st.builds(
        KVEventBatch,
        st.floats(allow_nan=False, allow_infinity=False),
        st.lists(events(optional), max_size=6),
        st.none() | st.integers(0, 2**32),
    )
