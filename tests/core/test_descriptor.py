"""A publisher's descriptor, without sockets: what it encodes, what a reader refuses, and when a
worker's configuration is told apart from its index's."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tskv import BlockStored, WireError
from tskv.core.descriptor import (
    MAX_DESCRIPTOR_BYTES,
    Descriptor,
    GroupInfo,
    PublishedGroups,
    mismatch,
)


def descriptor(**changes: object) -> Descriptor:
    fields: dict[str, object] = {
        "tskv_version": "0.1.0",
        "epoch": 2**64 - 1,
        "wire_format": "vllm",
        "topic": "kv",
        "dp_rank": 1,
        "block_size": 16,
        "hash_algorithm": "sha256_cbor",
        "groups": (
            GroupInfo(0, "full_attention", 16, None),
            GroupInfo(1, "sliding_window", 16, 4096),
        ),
        "oldest_seq": 3,
        "newest_seq": 9,
        "snapshots": True,
    }
    fields.update(changes)
    return Descriptor(**fields)  # type: ignore[arg-type]


def test_a_descriptor_reads_back_as_it_was_written() -> None:
    for said in (
        descriptor(),
        descriptor(block_size=None, hash_algorithm=None, epoch=None, groups=()),
    ):
        assert Descriptor.decode(said.encode()) == said


def test_fields_a_later_tskv_adds_are_kept_and_a_missing_required_one_is_refused() -> None:
    data = msgpack.unpackb(descriptor().encode())
    data["prefill_chunk"] = 512
    read = Descriptor.decode(msgpack.packb(data))
    assert read.unknown_fields == {"prefill_chunk": 512} and read.block_size == 16
    del data["wire_format"]
    with pytest.raises(WireError, match="wire_format must be str"):
        Descriptor.decode(msgpack.packb(data))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_size", "16", "block_size must be int"),
        ("dp_rank", True, "dp_rank must be int"),
        ("groups", {"0": 1}, "groups must be a list"),
        ("groups", [{"index": 0}], "block_size must be int"),
        ("groups", [[0, "full", 16]], "group must be a map"),
        ("snapshots", 1, "snapshots must be bool"),
    ],
)
def test_a_field_of_the_wrong_type_is_a_wire_error_naming_it(
    field: str, value: object, message: str
) -> None:
    data = msgpack.unpackb(descriptor().encode())
    data[field] = value
    with pytest.raises(WireError, match=message):
        Descriptor.decode(msgpack.packb(data))


def test_what_is_not_a_descriptor_is_a_wire_error() -> None:
    for payload in (
        b"",
        b"\xc1",
        msgpack.packb([1, 2]),
        msgpack.packb({1: 2}),
        b"\x00" * (MAX_DESCRIPTOR_BYTES + 1),
    ):
        with pytest.raises(WireError):
            Descriptor.decode(payload)


VALUES = st.none() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8) | st.booleans()
FIELDS = st.sampled_from([*msgpack.unpackb(descriptor().encode()), "other"])
GROUP = st.dictionaries(st.sampled_from(["index", "kind", "block_size", "sliding_window"]), VALUES)


@settings(max_examples=500, deadline=None)
@given(
    st.binary(max_size=200)
    | st.builds(
        msgpack.packb,
        st.dictionaries(FIELDS, VALUES | st.lists(GROUP | VALUES, max_size=3), max_size=14),
    )
    | st.builds(  # a real descriptor with one field changed
        lambda name, value: msgpack.packb({**msgpack.unpackb(descriptor().encode()), name: value}),
        FIELDS,
        VALUES | st.lists(GROUP, max_size=3),
    )
)
def test_any_payload_reads_as_a_descriptor_or_a_wire_error_never_another_exception(
    payload: bytes,
) -> None:
    with contextlib.suppress(WireError):
        Descriptor.decode(payload)


def test_the_groups_published_are_named_once_each_with_their_latest_shape() -> None:
    groups = PublishedGroups()
    full = BlockStored([1], None, [0] * 16, 16, group_idx=0, kv_cache_spec_kind="full_attention")
    window = BlockStored(
        [1],
        None,
        [0] * 16,
        16,
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
    )
    groups.apply(b"", [full, window, BlockStored([2], 1, [0] * 16, 16)])
    groups.apply(b"", [full])
    said = Descriptor.with_groups(
        groups.groups.values(), **{k: v for k, v in descriptor().summary().items() if k != "groups"}
    )
    assert said.groups == (
        GroupInfo(0, "full_attention", 16, None),
        GroupInfo(1, "sliding_window", 16, 128),
    )


def test_a_block_size_or_hash_that_differs_is_named_with_both_values() -> None:
    assert mismatch(descriptor(), 16, [descriptor()]) is None
    assert mismatch(descriptor(), 32, []) == "its block size is 16, the index's is 32"
    assert mismatch(descriptor(block_size=None), 32, []) is None  # unsaid: never a mismatch
    assert (
        mismatch(descriptor(block_size=None, hash_algorithm="xxhash"), 16, [descriptor()])
        == "its hash algorithm is xxhash, another worker's is sha256_cbor"
    )
    assert mismatch(descriptor(block_size=None), 64, [descriptor(block_size=32)]) is None, (
        "the other worker's block size is its own matter with the index"
    )
    assert (
        mismatch(descriptor(hash_algorithm=None), 16, [descriptor(hash_algorithm="xxhash")]) is None
    )
