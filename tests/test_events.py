import math

import pytest

from tskv import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def test_events_are_frozen_and_compare_by_value() -> None:
    event = BlockStored([1, 2], None, [5, 6, 7, 8], 2)
    assert event == BlockStored((1, 2), None, (5, 6, 7, 8), 2)
    assert event.block_hashes == (1, 2)
    with pytest.raises(AttributeError):
        event.block_size = 3  # type: ignore[misc]
    assert hash(event) == hash(BlockStored([1, 2], None, [5, 6, 7, 8], 2))
    assert not hasattr(event, "__dict__")  # slotted


@pytest.mark.parametrize("good", [-(2**63), 0, 2**63, 2**64 - 1])
def test_hash_range_edges_accepted(good: int) -> None:
    assert BlockRemoved([good]).block_hashes == (good,)
    assert BlockStored([1], good, [], 1).parent_block_hash == good


@pytest.mark.parametrize("bad", [-(2**63) - 1, 2**64])
def test_hash_out_of_range_names_field_index_and_value(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"block_hashes\[1\] = {bad}"):
        BlockRemoved([1, bad])
    with pytest.raises(ValueError, match=rf"parent_block_hash\[0\] = {bad}"):
        BlockStored([1], bad, [], 1)


@pytest.mark.parametrize("bad", [1.0, "7", True, None])
def test_hash_of_wrong_type_is_refused(bad: object) -> None:
    with pytest.raises(TypeError, match=r"block_hashes\[0\] must be an int"):
        BlockRemoved([bad])  # type: ignore[list-item]


def test_hashes_must_be_a_sequence() -> None:
    with pytest.raises(TypeError, match="block_hashes must be a sequence"):
        BlockRemoved(5)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1])
def test_token_ids_must_fit_int32(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"token_ids\[2\] = {bad}"):
        BlockStored([1], None, [0, 1, bad], 4)


def test_token_id_edges_and_numpy_like_ints() -> None:
    class Index:
        def __index__(self) -> int:
            return 9

    event = BlockStored([1], None, [-(2**31), 2**31 - 1, Index()], 4)  # type: ignore[list-item]
    assert event.token_ids == (-(2**31), 2**31 - 1, 9)
    assert all(type(token) is int for token in event.token_ids)


def test_token_count_need_not_match_blocks() -> None:
    # TokenSpeed emits per-page events whose tokens do not fill every block.
    assert BlockStored([1, 2, 3], None, [1], 16).token_ids == (1,)


@pytest.mark.parametrize("bad", [0, -4])
def test_block_size_at_least_one(bad: int) -> None:
    with pytest.raises(ValueError, match=f"block_size = {bad}"):
        BlockStored([1], None, [1], bad)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_ts_must_be_finite(bad: float) -> None:
    with pytest.raises(ValueError, match="ts = "):
        KVEventBatch(bad, [])


def test_ts_int_becomes_float_and_rank_defaults_to_none() -> None:
    batch = KVEventBatch(3, [AllBlocksCleared()])
    assert batch.ts == 3.0 and type(batch.ts) is float
    assert batch.attn_dp_rank is None


def test_batch_refuses_foreign_event_objects() -> None:
    with pytest.raises(TypeError, match=r"events\[1\].*scheduler_kv_event_to_wire_event"):
        KVEventBatch(0.0, [AllBlocksCleared(), object()])  # type: ignore[list-item]


@pytest.mark.parametrize("bad", [-1, True, "0"])
def test_rank_must_be_non_negative_int(bad: object) -> None:
    with pytest.raises((TypeError, ValueError), match="attn_dp_rank"):
        KVEventBatch(0.0, [], bad)  # type: ignore[arg-type]
