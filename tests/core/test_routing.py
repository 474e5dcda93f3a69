"""The routing policies, without sockets: each rule with exact numbers, and a property of the
load-aware one against a brute-force cost."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import tskv
from tskv import (
    ConfigError,
    LoadAwarePolicy,
    LongestPrefixPolicy,
    Match,
    RandomPolicy,
    RoundRobinPolicy,
)

BLOCK = 16


def test_the_worker_holding_the_prefix_wins_while_its_queue_is_short() -> None:
    match = Match({"a": 4}, frozenset())
    choice = LoadAwarePolicy().choose(match, 100, BLOCK, {"a": 10, "b": 0})
    assert (choice.worker, choice.cached_tokens, choice.cost) == ("a", 64, 36 + 10)


def test_a_long_queue_sends_the_request_elsewhere_even_with_the_prefix_cached() -> None:
    """Longest prefix first would send everything sharing a system prompt to one worker."""
    match = Match({"a": 4, "b": 4}, frozenset())
    choice = LoadAwarePolicy().choose(match, 100, BLOCK, {"a": 500, "b": 20, "c": 0})
    assert choice.worker == "b"
    busy = LoadAwarePolicy().choose(match, 100, BLOCK, {"a": 500, "b": 200, "c": 0})
    assert (busy.worker, busy.cached_tokens) == ("c", 0)  # 100 to prefill beats 36 + 200


def test_the_weights_trade_cache_hits_against_load() -> None:
    match = Match({"a": 4}, frozenset())
    queued = {"a": 80, "b": 0}
    assert LoadAwarePolicy().choose(match, 100, BLOCK, queued).worker == "b"  # 36+80 > 100
    assert LoadAwarePolicy(load_weight=0.5).choose(match, 100, BLOCK, queued).worker == "a"
    assert LoadAwarePolicy(prefill_weight=0).choose(match, 100, BLOCK, queued).worker == "b"


def test_stale_workers_are_passed_over_unless_nothing_else_is_left() -> None:
    match = Match({"a": 6}, frozenset({"a"}))
    assert LoadAwarePolicy().choose(match, 100, BLOCK, {"a": 0, "b": 50}).worker == "b"
    alone = LoadAwarePolicy().choose(match, 100, BLOCK, {"a": 0}, workers=["a"])
    assert (alone.worker, alone.cached_tokens) == ("a", 96)


def test_ties_go_to_the_least_loaded_then_the_first_given() -> None:
    match = Match({"a": 1}, frozenset())
    # a: 84 to prefill + 16 queued; b: 100 + 0 queued; same cost, b less loaded
    assert LoadAwarePolicy().choose(match, 100, BLOCK, {"a": 16, "b": 0}).worker == "b"
    assert (
        LoadAwarePolicy().choose(Match({}, frozenset()), 50, BLOCK, {"x": 0, "y": 0}).worker == "x"
    )


def test_cached_tokens_never_exceed_the_prompt_and_bad_input_is_refused() -> None:
    match = Match({"a": 10}, frozenset())
    assert LoadAwarePolicy().choose(match, 20, BLOCK, {"a": 0}).cached_tokens == 20
    with pytest.raises(ConfigError, match="no worker to route to"):
        LoadAwarePolicy().choose(match, 20, BLOCK, {})
    with pytest.raises(ConfigError, match="load_weight = -1"):
        LoadAwarePolicy(load_weight=-1)


@given(
    counts=st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 20)),
    queued=st.dictionaries(st.sampled_from("abcdef"), st.floats(0, 1e6), min_size=1),
    stale=st.frozensets(st.sampled_from("abcdef")),
    prompt=st.integers(0, 400),
    weights=st.tuples(st.floats(0, 10), st.floats(0, 10)),
)
def test_the_choice_has_the_lowest_cost_among_the_trusted_workers(
    counts: dict[str, int],
    queued: dict[str, float],
    stale: frozenset[str],
    prompt: int,
    weights: tuple[float, float],
) -> None:
    policy = LoadAwarePolicy(*weights)
    choice = policy.choose(Match(counts, stale), prompt, BLOCK, queued)
    pool = [w for w in queued if w not in stale] or list(queued)
    assert choice.worker in pool

    def cost(worker: str) -> float:
        cached = min(counts.get(worker, 0) * BLOCK, prompt)
        return weights[0] * (prompt - cached) + weights[1] * queued[worker]

    assert choice.cost == cost(choice.worker) == min(cost(w) for w in pool)


def test_longest_prefix_follows_the_cache_whatever_the_load() -> None:
    match = Match({"a": 4, "b": 2}, frozenset())
    choice = LongestPrefixPolicy().choose(match, 100, BLOCK, {"a": 10_000, "b": 0, "c": 0})
    assert (choice.worker, choice.cached_tokens, choice.cost) == ("a", 64, 36)
    tie = LongestPrefixPolicy().choose(Match({}, frozenset()), 100, BLOCK, {"a": 9, "b": 3})
    assert tie.worker == "b"  # nothing cached anywhere: the least loaded


def test_round_robin_takes_each_trusted_worker_in_turn() -> None:
    policy = RoundRobinPolicy()
    match = Match({"a": 4}, frozenset({"b"}))
    queued = {"a": 0, "b": 0, "c": 0}
    chosen = [policy.choose(match, 100, BLOCK, queued).worker for _ in range(4)]
    assert chosen == ["a", "c", "a", "c"]
    assert policy.choose(match, 100, BLOCK, queued).cached_tokens == 64  # "a", as the index says


def test_random_draws_the_same_workers_from_the_same_seed() -> None:
    match, queued = Match({}, frozenset()), {w: 0.0 for w in "abcdef"}
    one, again = RandomPolicy(7), RandomPolicy(7)
    assert [one.choose(match, 10, BLOCK, queued).worker for _ in range(20)] == [
        again.choose(match, 10, BLOCK, queued).worker for _ in range(20)
    ]
    assert len({one.choose(match, 10, BLOCK, queued).worker for _ in range(60)}) > 1


@pytest.mark.parametrize(
    "policy", [LoadAwarePolicy(), LongestPrefixPolicy(), RoundRobinPolicy(), RandomPolicy(0)]
)
def test_every_policy_refuses_a_call_with_no_worker_naming_the_fix(policy: tskv.Policy) -> None:
    with pytest.raises(ConfigError, match="no worker to route to"):
        policy.choose(Match({}, frozenset()), 10, BLOCK, {})


def test_a_block_held_only_in_a_lower_tier_costs_a_fraction_of_a_prefill() -> None:
    """Worker a holds 4 blocks, 3 of them only on CPU; b holds 2 on its GPU."""
    match = Match({"a": 4, "b": 2}, frozenset(), lower={"a": 3})
    queued = {"a": 0.0, "b": 0.0}
    choice = LoadAwarePolicy().choose(match, 100, BLOCK, queued)
    assert (choice.worker, choice.cached_tokens, choice.cost) == ("a", 64, 36 + 0.25 * 48)
    slow_disk = LoadAwarePolicy(lower_tier_cost=0.75).choose(match, 100, BLOCK, queued)
    assert (slow_disk.worker, slow_disk.cost) == ("b", 68)  # 36 + 36 > 68
    with pytest.raises(ConfigError, match="lower_tier_cost = -1"):
        LoadAwarePolicy(lower_tier_cost=-1)
