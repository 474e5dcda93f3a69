from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import load_vectors
from tskv.sim.block_hash import block_hash, chain_hashes
from tskv.sim.sampling import (
    GenerateRequest,
    SamplingParams,
    SamplingSeedError,
    fan_out,
    resolve_sampling_seed,
)


def test_explicit_sampling_seed() -> None:
    assert resolve_sampling_seed(42, None) == 42


def test_legacy_seed_when_sampling_seed_is_absent() -> None:
    assert resolve_sampling_seed(None, 7) == 7


def test_sampling_seed_wins_when_both_are_set() -> None:
    assert resolve_sampling_seed(5, 9) == 5


def test_sampling_seed_wins_over_a_negative_legacy_seed() -> None:
    # The legacy seed is not looked at when sampling_seed is present, so -1 ("unset") is fine.
    assert resolve_sampling_seed(5, -1) == 5
    assert resolve_sampling_seed(0, -(2**63)) == 0


def test_seed_zero_is_a_seed_not_absent() -> None:
    assert resolve_sampling_seed(0, 9) == 0
    assert resolve_sampling_seed(None, 0) == 0


def test_no_seed_at_all() -> None:
    assert resolve_sampling_seed(None, None) is None


@pytest.mark.parametrize(
    ("sampling", "legacy"), [(None, -1), (-5, None), (2**64, None), (-5, 9), (None, 2**64)]
)
def test_out_of_range_seed_is_refused_naming_the_value(
    sampling: int | None, legacy: int | None
) -> None:
    bad = sampling if sampling is not None else legacy
    with pytest.raises(SamplingSeedError, match="sampling seed must be an unsigned integer") as e:
        resolve_sampling_seed(sampling, legacy)
    assert str(bad) in str(e.value)
    assert isinstance(e.value, ValueError)


def request(seed: int | None, n: int = 3) -> GenerateRequest:
    return GenerateRequest("req", [1, 2, 3], SamplingParams(seed, n))


def test_largest_seed_fans_out_wrapping_at_2_64() -> None:
    choices = fan_out(request(2**64 - 1), 3)
    assert [c.rid for c in choices] == ["req-0", "req-1", "req-2"]
    assert [c.sampling.seed for c in choices] == [2**64 - 1, 0, 1]
    assert all(c.prompt_ids == (1, 2, 3) and c.sampling.n == 1 for c in choices)


def test_no_seed_stays_no_seed_for_every_choice() -> None:
    choices = fan_out(request(None), 3)
    assert [c.sampling.seed for c in choices] == [None, None, None]
    assert [c.rid for c in choices] == ["req-0", "req-1", "req-2"]


def test_n_1_leaves_the_request_as_it_is() -> None:
    original = request(11, n=1)
    assert fan_out(original, 1) == [original]
    assert fan_out(original, 1)[0] is original


def test_sampling_params_are_checked() -> None:
    with pytest.raises(SamplingSeedError):
        SamplingParams(-1)
    with pytest.raises(ValueError, match=r"n \(choices per request\) = 0"):
        SamplingParams(None, 0)


HASHES = load_vectors("block_hashes.json")


@pytest.mark.parametrize("case", HASHES, ids=[str(i) for i in range(len(HASHES))])
def test_block_hash_vectors(case: dict[str, Any]) -> None:
    assert block_hash(case["token_ids"], case["parent"]) == case["hash"]


def test_chain_uses_each_block_as_the_next_ones_parent() -> None:
    first, second = HASHES[0], HASHES[1]
    tokens = first["token_ids"] + second["token_ids"] + [9, 9]  # the partial block is not hashed
    assert list(chain_hashes(tokens, 4)) == [first["hash"], second["hash"]]
