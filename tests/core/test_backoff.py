"""The one backoff every retry uses, without time: doubling, bounded, jittered, reset."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tskv.core.backoff import Backoff


def test_waits_double_up_to_the_longest_each_drawn_between_half_and_all_of_it() -> None:
    drawn: list[tuple[float, float]] = []

    def lowest(low: float, high: float) -> float:
        drawn.append((low, high))
        return low

    backoff = Backoff(0.5, 3.0, uniform=lowest)
    assert [backoff.next() for _ in range(5)] == [0.25, 0.5, 1.0, 1.5, 1.5]
    assert set(drawn) == {(0.5, 1.0)}
    backoff.reset()
    assert backoff.nominal == 0.5 and backoff.next() == 0.25


@given(st.floats(0.01, 10), st.floats(1, 100), st.integers(1, 30))
def test_no_wait_is_ever_longer_than_the_longest(first: float, longest: float, count: int) -> None:
    backoff = Backoff(first, max(first, longest))
    assert all(0 < backoff.next() <= max(first, longest) for _ in range(count))
