"""The routing policies, without sockets: each rule with exact numbers, a property of the
load-aware one against a brute-force cost, and the calls they refuse."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import tskv
from tskv import (
    BlockStored,
    ConfigError,
    LoadAwarePolicy,
    LongestPrefixPolicy,
    Match,
    PrefixIndex,
    RandomPolicy,
    RoundRobinPolicy,
    TskvError,
)

BLOCK = 16
POLICIES = [LoadAwarePolicy(), LongestPrefixPolicy(), RoundRobinPolicy(), RandomPolicy(0)]


def answer(
    counts: dict[str, int],
    workers: str,
    stale: str = "",
    lower: dict[str, int] | None = None,
) -> Match:
    """The Match an index of `workers` (one letter each) would give."""
    return Match(counts, frozenset(stale), None, lower, BLOCK, tuple(workers))


def test_the_worker_holding_the_prefix_wins_while_its_queue_is_short() -> None:
    choice = LoadAwarePolicy().choose(answer({"a": 4}, "ab"), 100, {"a": 10, "b": 0})
    assert (choice.worker, choice.cached_tokens, choice.cost) == ("a", 64, 36 + 10)


def test_a_long_queue_sends_the_request_elsewhere_even_with_the_prefix_cached() -> None:
    """Longest prefix first would send everything sharing a system prompt to one worker."""
    match = answer({"a": 4, "b": 4}, "abc")
    choice = LoadAwarePolicy().choose(match, 100, {"a": 500, "b": 20, "c": 0})
    assert choice.worker == "b"
    busy = LoadAwarePolicy().choose(match, 100, {"a": 500, "b": 200, "c": 0})
    assert (busy.worker, busy.cached_tokens) == ("c", 0)  # 100 to prefill beats 36 + 200


def test_the_weights_trade_cache_hits_against_load() -> None:
    match = answer({"a": 4}, "ab")
    queued = {"a": 80, "b": 0}
    assert LoadAwarePolicy().choose(match, 100, queued).worker == "b"  # 36+80 > 100
    assert LoadAwarePolicy(load_weight=0.5).choose(match, 100, queued).worker == "a"
    assert LoadAwarePolicy(prefill_weight=0).choose(match, 100, queued).worker == "b"


def test_stale_workers_are_passed_over_unless_nothing_else_is_left() -> None:
    assert LoadAwarePolicy().choose(answer({"a": 6}, "ab", "a"), 100, {"b": 50}).worker == "b"
    alone = LoadAwarePolicy().choose(answer({"a": 6}, "a", "a"), 100)
    assert (alone.worker, alone.cached_tokens) == ("a", 96)


def test_a_worker_missing_from_queued_is_idle_not_skipped() -> None:
    """The trap this replaced: `queued` decided the candidates, so the worker holding the
    prefix was never considered when the router had no figure for it."""
    choice = LoadAwarePolicy().choose(answer({"a": 2}, "ab"), 100, {"b": 0})
    assert (choice.worker, choice.cost) == ("a", 100 - 32)
    assert LoadAwarePolicy().choose(answer({"a": 2}, "ab"), 100).worker == "a"  # none given


def test_workers_given_join_those_the_index_knows() -> None:
    """A worker that has published nothing yet is not in the index: give it to be chosen."""
    match = answer({"a": 1}, "a")
    choice = LoadAwarePolicy().choose(match, 100, {"a": 500}, workers=["new"])
    assert (choice.worker, choice.cached_tokens) == ("new", 0)
    assert LoadAwarePolicy().choose(match, 100, {"a": 500}).worker == "a"  # the only one known


def test_the_block_size_is_the_index_s() -> None:
    index = PrefixIndex(4)
    index.apply("a", [BlockStored([1, 2], None, list(range(8)), 4)])
    index.apply("b", [])
    match = index.match(list(range(12)))
    assert (match.block_size, match.workers) == (4, ("a", "b"))
    choice = LoadAwarePolicy().choose(match, 12, {"a": 0, "b": 0})
    assert (choice.worker, choice.cached_tokens, choice.cost) == ("a", 8, 4)


def test_ties_go_to_the_least_loaded_then_the_first_known() -> None:
    # a: 84 to prefill + 16 queued; b: 100 + 0 queued; same cost, b less loaded
    assert LoadAwarePolicy().choose(answer({"a": 1}, "ab"), 100, {"a": 16}).worker == "b"
    assert LoadAwarePolicy().choose(answer({}, "xy"), 50).worker == "x"


def test_cached_tokens_never_exceed_the_prompt() -> None:
    assert LoadAwarePolicy().choose(answer({"a": 10}, "a"), 20).cached_tokens == 20
    with pytest.raises(ConfigError, match="load_weight = -1"):
        LoadAwarePolicy(load_weight=-1)


@given(
    counts=st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 20)),
    queued=st.dictionaries(st.sampled_from("abcdef"), st.floats(0, 1e6)),
    known=st.lists(st.sampled_from("abcdef"), min_size=1, unique=True),
    stale=st.frozensets(st.sampled_from("abcdef")),
    prompt=st.integers(0, 400),
    weights=st.tuples(st.floats(0, 10), st.floats(0, 10)),
)
def test_the_choice_has_the_lowest_cost_among_the_trusted_workers(
    counts: dict[str, int],
    queued: dict[str, float],
    known: list[str],
    stale: frozenset[str],
    prompt: int,
    weights: tuple[float, float],
) -> None:
    policy = LoadAwarePolicy(*weights)
    match = Match(counts, stale, None, None, BLOCK, tuple(known))
    choice = policy.choose(match, prompt, queued)
    pool = [w for w in known if w not in stale] or known
    assert choice.worker in pool

    def cost(worker: str) -> float:
        cached = min(counts.get(worker, 0) * BLOCK, prompt)
        return weights[0] * (prompt - cached) + weights[1] * queued.get(worker, 0.0)

    assert choice.cost == cost(choice.worker) == min(cost(w) for w in pool)


def test_longest_prefix_follows_the_cache_whatever_the_load() -> None:
    match = answer({"a": 4, "b": 2}, "abc")
    choice = LongestPrefixPolicy().choose(match, 100, {"a": 10_000, "b": 0, "c": 0})
    assert (choice.worker, choice.cached_tokens, choice.cost) == ("a", 64, 36)
    tie = LongestPrefixPolicy().choose(answer({}, "ab"), 100, {"a": 9, "b": 3})
    assert tie.worker == "b"  # nothing cached anywhere: the least loaded


def test_round_robin_takes_each_trusted_worker_in_turn() -> None:
    policy = RoundRobinPolicy()
    match = answer({"a": 4}, "abc", "b")
    chosen = [policy.choose(match, 100).worker for _ in range(4)]
    assert chosen == ["a", "c", "a", "c"]
    assert policy.choose(match, 100).cached_tokens == 64  # "a", as the index says


def test_random_draws_the_same_workers_from_the_same_seed() -> None:
    match = answer({}, "abcdef")
    one, again = RandomPolicy(7), RandomPolicy(7)
    assert [one.choose(match, 10).worker for _ in range(20)] == [
        again.choose(match, 10).worker for _ in range(20)
    ]
    assert len({one.choose(match, 10).worker for _ in range(60)}) > 1


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_refuses_a_call_it_cannot_answer_naming_the_fix(policy: tskv.Policy) -> None:
    with pytest.raises(TskvError, match=r"no worker to route to.*workers=") as empty:
        policy.choose(answer({}, ""), 10)
    assert isinstance(empty.value, ValueError)
    with pytest.raises(TskvError, match="block size now comes from the Match") as old:
        policy.choose(answer({}, "a"), 10, 16, {"a": 0})  # type: ignore[arg-type, call-arg]
    assert isinstance(old.value, TypeError)
    with pytest.raises(TskvError, match="does not say its block size"):
        policy.choose(Match({"a": 1}, frozenset()), 10)
    with pytest.raises(TskvError, match="prompt_tokens = -1"):
        policy.choose(answer({}, "a"), -1)
    with pytest.raises(TskvError, match="workers = 'ab' must be an iterable of workers"):
        policy.choose(answer({}, "a"), 10, None, "ab")
    with pytest.raises(TskvError, match="must be the Match"):
        policy.choose({"a": 1}, 10)  # type: ignore[arg-type]


def test_a_block_held_only_in_a_lower_tier_costs_a_fraction_of_a_prefill() -> None:
    """Worker a holds 4 blocks, 3 of them only on CPU; b holds 2 on its GPU."""
    match = answer({"a": 4, "b": 2}, "ab", lower={"a": 3})
    choice = LoadAwarePolicy().choose(match, 100)
    assert (choice.worker, choice.cached_tokens, choice.cost) == ("a", 64, 36 + 0.25 * 48)
    slow_disk = LoadAwarePolicy(lower_tier_cost=0.75).choose(match, 100)
    assert (slow_disk.worker, slow_disk.cost) == ("b", 68)  # 36 + 36 > 68
    with pytest.raises(ConfigError, match="lower_tier_cost = -1"):
        LoadAwarePolicy(lower_tier_cost=-1)
