"""The lag histogram: each observation in the first bound it fits, the rest over the last."""

from __future__ import annotations

from tskv.core.lag import BOUNDS, Lag


def test_each_lag_is_counted_under_the_first_bound_it_fits_and_summed() -> None:
    lag = Lag()
    for seconds in (0.0, 0.001, 0.0011, 0.7, 31.0, -0.002):  # a skewed clock can go below 0
        lag.observe(seconds)
    figures = lag.figures()
    expected = [0] * len(BOUNDS)
    expected[0] = 3  # 0.0, 0.001 (at the bound) and the negative one
    expected[BOUNDS.index(0.005)] = 1
    expected[BOUNDS.index(1.0)] = 1
    assert list(figures.counts) == expected and figures.over == 1
    assert figures.batches == 6 and abs(figures.total - 31.7001) < 1e-9
