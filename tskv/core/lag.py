"""How late batches are applied: the time from a batch's timestamp (taken when the scheduler
handed its round over) to its being applied to an index, as a histogram. No I/O.

A fixed set of bounds and a count per bound, so observing costs a comparison walk and an
increment per batch, and Prometheus' histogram (`tskv.shells.metrics`) reads it as it is. The
two clocks are the publisher's and the applier's: across machines, their skew is in it too.
"""

from __future__ import annotations

import attrs

BOUNDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)  # seconds


@attrs.frozen
class LagFigures:
    """A histogram's state at one moment: `counts[i]` batches at or under `BOUNDS[i]` and over
    the one before, `over` above the last; their `total` seconds; `batches` in all."""

    counts: tuple[int, ...]
    over: int
    total: float
    batches: int


class Lag:
    """The histogram a watcher keeps of the batches it applies."""

    __slots__ = ("_counts", "_over", "_total")

    def __init__(self) -> None:
        self._counts = [0] * len(BOUNDS)
        self._over = 0
        self._total = 0.0

    def observe(self, seconds: float) -> None:
        self._total += seconds
        for n, bound in enumerate(BOUNDS):  # most batches land in the first bound or two
            if seconds <= bound:
                self._counts[n] += 1
                return
        self._over += 1

    def figures(self) -> LagFigures:
        counts = tuple(self._counts)
        return LagFigures(counts, self._over, self._total, sum(counts) + self._over)
