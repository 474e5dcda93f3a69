"""Events cost what a msgspec Struct costs to build; their values are checked when the round is
published: O(1) checks always, every hash and token id in strict mode."""

from __future__ import annotations

import math

import pytest

import tskv
from tskv import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tskv.core.codec import encode_round
from tskv.core.events import check_events, event_fields


def publish(*events: object, strict: bool = False) -> bytes | None:
    """What publish() does with a round: encode it, checking as the publisher does."""
    return encode_round(1.0, list(events), 0, strict=strict)  # type: ignore[arg-type]


def test_events_are_frozen_values_that_keep_what_they_were_given() -> None:
    hashes, tokens = [1, 2], [5, 6, 7, 8]
    event = BlockStored(hashes, None, tokens, 2)
    assert event.block_hashes is hashes and event.token_ids is tokens  # nothing copied
    assert event == BlockStored([1, 2], None, [5, 6, 7, 8], 2)
    assert event != BlockStored([1, 2], None, [5, 6, 7, 8], 4)
    with pytest.raises(AttributeError):
        event.block_size = 3  # type: ignore[misc]
    assert not hasattr(event, "__dict__")


def test_optional_fields_default_to_unset_and_are_listed_only_when_set() -> None:
    plain = BlockStored([1], None, [1], 1)
    assert (plain.medium, plain.lora_name, plain.group_idx) == (None, None, None)
    assert set(event_fields(plain)) == {
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
    }
    tiered = BlockRemoved([1], medium="CPU", locality="LOCAL")
    assert event_fields(tiered) == {"block_hashes": [1], "medium": "CPU", "locality": "LOCAL"}


@pytest.mark.parametrize("good", [-(2**63), 0, 2**63, 2**64 - 1])
def test_hash_range_edges_are_published(good: int) -> None:
    assert publish(BlockRemoved([good]), BlockStored([1], good, [], 1))


@pytest.mark.parametrize("bad", [-(2**63) - 1, 2**64])
def test_a_hash_no_encoder_can_hold_fails_at_publish_naming_it(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"events\[0\].block_hashes\[1\] = {bad}"):
        publish(BlockRemoved([1, bad]))
    with pytest.raises(ValueError, match=rf"events\[1\].parent_block_hash\[0\] = {bad}"):
        publish(AllBlocksCleared(), BlockStored([1], bad, [], 1))


@pytest.mark.parametrize("bad", [0, -4, 1.5, True])
def test_a_bad_block_size_is_named_in_strict_mode_and_refused_by_any_decoder(bad: object) -> None:
    event = BlockStored([1], None, [1], bad)  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError), match=r"events\[0\].block_size"):
        publish(event, strict=True)
    payload = publish(event)  # unchecked: it encodes, and a consumer refuses it, never misreads
    assert payload is not None
    with pytest.raises(tskv.WireError, match="block_size"):
        tskv.decode_batch(payload)


@pytest.mark.parametrize("bad", [range(3), (n for n in range(3))])
def test_a_container_no_encoder_takes_fails_at_publish_naming_the_field(bad: object) -> None:
    with pytest.raises(TypeError, match=r"events\[0\].token_ids must be a list or tuple"):
        publish(BlockStored([1], None, bad, 1))  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["abc", 7])
def test_a_container_of_the_wrong_type_is_named_in_strict_mode_and_refused_when_decoded(
    bad: object,
) -> None:
    event = BlockRemoved(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"events\[0\].block_hashes must be a list or tuple"):
        publish(event, strict=True)
    payload = publish(event)
    assert payload is not None
    with pytest.raises(tskv.WireError, match="block_hashes"):
        tskv.decode_batch(payload)


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1])
def test_strict_mode_names_a_token_id_outside_int32(bad: int) -> None:
    event = BlockStored([1], None, [0, 1, bad], 4)
    assert publish(event)  # not checked without strict: it is a valid msgpack int
    with pytest.raises(ValueError, match=rf"events\[0\].token_ids\[2\] = {bad}"):
        publish(event, strict=True)


@pytest.mark.parametrize("bad", [1.0, "7", True, None])
def test_strict_mode_names_a_hash_of_the_wrong_type(bad: object) -> None:
    with pytest.raises(TypeError, match=r"events\[0\].block_hashes\[0\] must be an int"):
        publish(BlockRemoved([bad]), strict=True)  # type: ignore[list-item]


def test_strict_mode_checks_the_optional_fields_too() -> None:
    with pytest.raises(TypeError, match=r"events\[0\].medium = 3 must be str"):
        check_events([BlockRemoved([1], medium=3)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"events\[0\].group_idx = -1"):
        check_events([BlockStored([1], None, [1], 1, group_idx=-1)])
    with pytest.raises(TypeError, match=r"extra_keys\[1\] = 5 must be list or tuple"):
        check_events([BlockStored([1], None, [1], 1, extra_keys=[None, 5])])  # type: ignore[list-item]


def test_token_count_need_not_match_blocks() -> None:
    # TokenSpeed emits per-page events whose tokens do not fill every block.
    assert publish(BlockStored([1, 2, 3], None, [1], 16), strict=True)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_ts_must_be_finite(bad: float) -> None:
    with pytest.raises(ValueError, match="ts = "):
        KVEventBatch(bad, [])


def test_ts_int_becomes_float_rank_defaults_to_none_and_any_iterable_of_events_is_kept() -> None:
    batch = KVEventBatch(3, (event for event in [AllBlocksCleared()]))  # type: ignore[arg-type]
    assert batch.ts == 3.0 and type(batch.ts) is float
    assert batch.attn_dp_rank is None
    assert batch.events == [AllBlocksCleared()]


def test_a_foreign_object_fails_at_publish_naming_the_fix() -> None:
    with pytest.raises(TypeError, match=r"events\[1\].*scheduler_kv_event_to_wire_event"):
        publish(AllBlocksCleared(), object())
    with pytest.raises(TypeError, match=r"events\[1\].*scheduler_kv_event_to_wire_event"):
        tskv.encode_batch(KVEventBatch(0.0, [AllBlocksCleared(), object()]))  # type: ignore[list-item]


@pytest.mark.parametrize("bad", [-1, True, "0"])
def test_rank_must_be_non_negative_int(bad: object) -> None:
    with pytest.raises((TypeError, ValueError), match="attn_dp_rank"):
        KVEventBatch(0.0, [], bad)  # type: ignore[arg-type]
