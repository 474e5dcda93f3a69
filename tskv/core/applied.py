"""What a watcher applied to its index: how late each batch was, and its events by kind. No I/O.

Lateness is the time from a batch's timestamp (taken when the scheduler handed its round over)
to its being applied, kept as a histogram: fixed bounds and a count per bound, so observing
costs a comparison walk and an increment per batch, and Prometheus' histogram
(`tskv.shells.metrics`) reads it as it is. The two clocks are the publisher's and the
applier's: across machines, their skew is in it too. A reader process keeps its own and sends
its figures with its news; the index's process adds them up (`AppliedFigures.plus`).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from tskv.core.events import KVEventBatch
from tskv.core.read_batch import CLEARED, REMOVED, STORED, ReadBatch

BOUNDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)  # seconds
# what a batch the compiled core read names each of its steps' kinds: the events' class names
STEP_KINDS = {STORED: "BlockStored", REMOVED: "BlockRemoved", CLEARED: "AllBlocksCleared"}


@attrs.frozen
class AppliedFigures:
    """The figures at one moment: `counts[i]` batches at or under `BOUNDS[i]` late and over
    the one before, `over` above the last, their `total` seconds; `batches` in all; and the
    events applied, by their class name."""

    counts: tuple[int, ...] = (0,) * len(BOUNDS)
    over: int = 0
    total: float = 0.0
    events: Mapping[str, int] = attrs.Factory(dict)

    @property
    def batches(self) -> int:
        return sum(self.counts) + self.over

    def plus(self, other: AppliedFigures) -> AppliedFigures:
        events = dict(self.events)
        for kind, count in other.events.items():
            events[kind] = events.get(kind, 0) + count
        counts = tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        return AppliedFigures(counts, self.over + other.over, self.total + other.total, events)


class Applied:
    """The figures a watcher (or a reader process) keeps of the batches it applies."""

    __slots__ = ("_counts", "_events", "_over", "_steps", "_total")

    def __init__(self) -> None:
        self._counts = [0] * len(BOUNDS)
        self._over = 0
        self._total = 0.0
        # by the event's class, or the step's kind: named only when asked
        self._events: dict[type | int, int] = {}

    def observe(self, batch: KVEventBatch | ReadBatch, now: float) -> None:
        """`batch` was applied at `now` (wall-clock seconds, as its timestamp is)."""
        events = self._events
        if type(batch) is ReadBatch:
            for step in batch.steps:
                kind: type | int = step[0]
                events[kind] = events.get(kind, 0) + 1
        else:
            for event in batch.events:
                kind = type(event)
                events[kind] = events.get(kind, 0) + 1
        self.late(now - batch.ts)

    def late(self, seconds: float) -> None:
        self._total += seconds
        for n, bound in enumerate(BOUNDS):  # most batches land in the first bound or two
            if seconds <= bound:
                self._counts[n] += 1
                return
        self._over += 1

    def figures(self) -> AppliedFigures:
        events: dict[str, int] = {}
        for kind, count in self._events.items():
            name = STEP_KINDS[kind] if isinstance(kind, int) else kind.__name__
            events[name] = events.get(name, 0) + count
        return AppliedFigures(tuple(self._counts), self._over, self._total, events)
