"""What a watcher applied: each batch's lateness under the first bound it fits, its events by
kind, and figures that add up across reader processes."""

from __future__ import annotations

from tskv import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tskv.core.applied import BOUNDS, Applied
from tskv.core.read_batch import CLEARED, REMOVED, STORED, ReadBatch


def test_each_lateness_is_counted_under_the_first_bound_it_fits_and_summed() -> None:
    applied = Applied()
    for seconds in (0.0, 0.001, 0.0011, 0.7, 31.0, -0.002):  # a skewed clock can go below 0
        applied.late(seconds)
    figures = applied.figures()
    expected = [0] * len(BOUNDS)
    expected[0] = 3  # 0.0, 0.001 (at the bound) and the negative one
    expected[BOUNDS.index(0.005)] = 1
    expected[BOUNDS.index(1.0)] = 1
    assert list(figures.counts) == expected and figures.over == 1
    assert figures.batches == 6 and abs(figures.total - 31.7001) < 1e-9


def test_events_are_counted_by_kind_from_decoded_and_read_batches_alike() -> None:
    applied = Applied()
    stored = BlockStored([1], None, [0] * 4, 4)
    applied.observe(KVEventBatch(100.0, [stored, stored, BlockRemoved([1])]), now=100.002)
    steps = [(STORED, [2], None, b"", 4), (REMOVED, [2]), (CLEARED,)]
    applied.observe(ReadBatch(100.0, None, steps, b""), now=100.0)
    applied.observe(KVEventBatch(100.0, [AllBlocksCleared()]), now=140.0)
    figures = applied.figures()
    assert figures.events == {"BlockStored": 3, "BlockRemoved": 2, "AllBlocksCleared": 2}
    assert figures.counts[0] == 1 and figures.counts[1] == 1 and figures.over == 1


def test_the_figures_of_two_appliers_add_up() -> None:
    first, second = Applied(), Applied()
    first.observe(KVEventBatch(0.0, [BlockRemoved([1])]), now=0.0)
    second.observe(KVEventBatch(0.0, [BlockRemoved([1]), AllBlocksCleared()]), now=2.0)
    both = first.figures().plus(second.figures())
    assert both.events == {"BlockRemoved": 2, "AllBlocksCleared": 1}
    assert both.batches == 2 and both.total == 2.0
    assert both.counts[0] == 1 and both.counts[BOUNDS.index(5.0)] == 1
