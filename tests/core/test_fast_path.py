"""The index's fast path (the compiled Matcher) is open exactly while a query with no per-block
identity is a usual one, whatever order the things that decide it change in, and answers as
the general walk does. On the pure path it is never open, and the same checks hold."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import examples
from tskv import AllBlocksCleared, BlockStored, CacheGroup, PrefixIndex
from tskv.core.prefix_index import _walked_match

SIZE = 4
WORKERS = ("a", "b", "c")
PROMPTS = [[n] * SIZE + [n + 1] * SIZE + [n + 2] * SIZE for n in (10, 20)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stored(prompt: int, blocks: int, first_hash: int, lookahead: bool) -> BlockStored:
    tokens = PROMPTS[prompt][: blocks * SIZE]
    ahead = [[7] * 2] * blocks if lookahead else None
    hashes = list(range(first_hash, first_hash + blocks))
    return BlockStored(hashes, None, tokens, SIZE, lookahead_token_ids=ahead)


worker = st.sampled_from(WORKERS)
steps = st.one_of(
    st.tuples(st.just("store"), worker, st.integers(0, 1), st.integers(1, 3), st.booleans()),
    st.tuples(st.just("hybrid"), worker),
    st.tuples(st.just("predict"), worker, st.integers(0, 1), st.sampled_from([0.5, 2.0])),
    st.tuples(st.just("tick"), st.sampled_from([0.25, 1.0, 3.0])),
    st.tuples(st.just("stale"), worker, st.booleans()),
    st.tuples(st.just("clear"), worker),
    st.tuples(st.just("remove"), worker),
)


def take(index: PrefixIndex, clock: Clock, step: tuple[Any, ...], first_hash: int) -> None:
    kind, *args = step
    if kind == "store":
        name, prompt, blocks, lookahead = args
        index.apply(name, [stored(prompt, blocks, first_hash, lookahead)])
    elif kind == "hybrid":
        index.set_groups(args[0], {0: CacheGroup("full_attention", SIZE)})
    elif kind == "predict":
        name, prompt, ttl = args
        index.predict(name, PROMPTS[prompt], ttl)
    elif kind == "tick":
        clock.now += args[0]
    elif kind == "stale":
        (index.mark_stale if args[1] else index.mark_current)(args[0])
    elif kind == "clear":
        index.apply(args[0], [AllBlocksCleared()])
    else:
        index.remove_worker(args[0])


def answer(match: Any) -> tuple[Any, ...]:
    fields = (match.stale, match.workers, match.block_size, match.predicted, match.lower)
    return (sorted(match.items()), *fields)


@settings(max_examples=examples(300))
@given(st.lists(steps, max_size=25))
def test_the_fast_path_is_open_exactly_when_every_query_is_a_usual_one(
    taken: list[tuple[Any, ...]],
) -> None:
    clock = Clock()
    index = PrefixIndex(SIZE, clock=clock)
    holdings, predictions = index._holdings, index._predictions
    for number, step in enumerate(taken):
        take(index, clock, step, 1 + 10 * number)
        for prompt in PROMPTS:
            predictions.expire()  # what the general path does first, so both see one state
            general = holdings.hybrids or index._lookaheads or predictions.masks
            assert index._fast is (None if general else index._matcher)
            got = index.match(prompt)
            walked = _walked_match(holdings, index._lookaheads, index.stale, (prompt, *[None] * 4))
            assert answer(got) == answer(walked)
