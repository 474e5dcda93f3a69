"""Speculative entries in the prefix index, without sockets: a fake clock drives their time."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import examples
from tskv import AllBlocksCleared, BlockRemoved, BlockStored, PrefixIndex

SIZE = 4
PROMPT = list(range(100, 100 + 4 * SIZE))  # four full blocks


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stored(tokens: list[int], first_hash: int = 1) -> BlockStored:
    count = len(tokens) // SIZE
    return BlockStored(list(range(first_hash, first_hash + count)), None, tokens, SIZE)


def test_a_prediction_is_counted_and_marked_until_it_lapses() -> None:
    clock = Clock()
    index = PrefixIndex(SIZE, clock=clock)
    index.apply("a", [stored(PROMPT[: 2 * SIZE])])
    index.predict("b", PROMPT, ttl=5.0)
    match = index.match(PROMPT)
    assert match == {"a": 2, "b": 4} and match.predicted == {"b": 4}
    clock.now = 4.9
    assert index.match(PROMPT)["b"] == 4
    clock.now = 5.0
    match = index.match(PROMPT)
    assert match == {"a": 2} and match.predicted == {}
    assert index.statistics().predicted == 0


def test_blocks_a_worker_already_holds_are_not_predicted_only_the_rest() -> None:
    index = PrefixIndex(SIZE, clock=Clock())
    index.apply("a", [stored(PROMPT[: 2 * SIZE])])
    index.predict("a", PROMPT, ttl=5.0)
    match = index.match(PROMPT)
    assert match == {"a": 4} and match.predicted == {"a": 2}
    assert index.statistics().predicted == 2


def test_the_real_store_replaces_the_prediction_and_a_removal_then_removes_the_block() -> None:
    clock = Clock()
    index = PrefixIndex(SIZE, clock=clock)
    index.predict("a", PROMPT, ttl=1.0)
    index.apply("a", [stored(PROMPT)])
    assert index.statistics().predicted == 0
    clock.now = 10.0  # the prediction's time has passed, the real blocks stay
    match = index.match(PROMPT)
    assert match == {"a": 4} and match.predicted == {}
    index.apply("a", [BlockRemoved([3, 4])])
    assert index.match(PROMPT) == {"a": 2}


def test_a_removal_or_a_reset_forgets_predictions() -> None:
    index = PrefixIndex(SIZE, clock=Clock())
    index.apply("a", [stored(PROMPT[:SIZE])])
    index.predict("a", PROMPT, ttl=9.0)
    index.apply("a", [AllBlocksCleared()])
    assert index.match(PROMPT) == {} and index.statistics().predicted == 0
    index.predict("b", PROMPT, ttl=9.0)
    index.clear_worker("b")
    assert index.match(PROMPT) == {}
    index.predict("c", PROMPT, ttl=9.0)
    index.remove_worker("c")
    assert index.match(PROMPT) == {} and index.statistics().predicted == 0


def test_memory_is_bounded_whatever_the_router_predicts() -> None:
    index = PrefixIndex(SIZE, clock=Clock(), max_predicted=10)
    for request in range(50):
        index.predict(f"w{request % 7}", list(range(request * 1000, request * 1000 + 16)), 60.0)
        assert index.statistics().predicted <= 10
    assert index.match(list(range(49_000, 49_016))) == {"w0": 4}  # the newest are kept


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["predict", "store", "remove", "clear", "tick"]),
            st.sampled_from(["a", "b"]),
            st.integers(1, 4),  # blocks
            st.floats(0.1, 5.0),  # ttl, or time passing
        ),
        max_size=40,
    )
)
def test_predicted_counts_are_exactly_a_model_of_live_predictions_over_real_blocks(
    steps: list[tuple[str, str, int, float]],
) -> None:
    """Against a model: per worker, the real blocks held and the predictions with their expiry;
    a match counts the leading blocks each holds really or by a live prediction."""
    clock = Clock()
    index = PrefixIndex(SIZE, clock=clock)
    real: dict[str, set[int]] = {"a": set(), "b": set()}
    predicted: dict[str, dict[int, float]] = {"a": {}, "b": {}}
    for action, worker, blocks, amount in steps:
        if action == "predict":
            index.predict(worker, PROMPT[: blocks * SIZE], amount)
            for block in range(blocks):
                if block not in real[worker]:
                    predicted[worker][block] = clock.now + amount
        elif action == "store":
            index.apply(worker, [stored(PROMPT[: blocks * SIZE])])
            real[worker].update(range(blocks))
            for block in range(blocks):
                predicted[worker].pop(block, None)
        elif action == "remove":
            index.apply(worker, [BlockRemoved([blocks])])  # engine hash n is block n - 1
            if blocks - 1 in real[worker]:  # a removal of a block never stored says nothing
                real[worker].discard(blocks - 1)
                predicted[worker].pop(blocks - 1, None)
        elif action == "clear":
            index.apply(worker, [AllBlocksCleared()])
            real[worker].clear()
            predicted[worker].clear()
        else:
            clock.now += amount
        expected = {}
        for name in ("a", "b"):
            live = {b for b, expiry in predicted[name].items() if expiry > clock.now}
            depth = 0
            while depth < 4 and (depth in real[name] or depth in live):
                depth += 1
            if depth:
                expected[name] = depth
        assert index.match(PROMPT) == expected


def test_predicting_the_same_blocks_again_and_again_keeps_memory_bounded() -> None:
    """A router that predicts one hot prefix on every request, with a long time to live."""
    from tskv.core.predictions import Predictions

    predictions = Predictions(Clock(), max_entries=50)
    for _ in range(20_000):
        predictions.add(1, range(40), ttl=1e9)
        assert len(predictions) == 40
    assert len(predictions._queue) < 200  # superseded entries are compacted away
