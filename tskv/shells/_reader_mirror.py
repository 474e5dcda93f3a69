"""The index's process's mirror of what its reader processes report.

A reader process follows its workers in an index of its own and reports, after each piece of
news, the holds that index took and let go of, whether the worker's view is stale there, and
its figures. The mirror applies the holds to the router's index (`PrefixIndex.apply_changes`),
marks the worker as its reader decided, keeps its figures, and hands the losses to `on_loss`.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from tskv.core.losses import Loss
from tskv.core.prefix_index import PrefixIndex, Worker
from tskv.core.reader_messages import Report
from tskv.core.worker_view import WorkerFigures
from tskv.shells._watched import Roster, log_failure


class ReaderMirror:
    """The index's process's side of its reader processes: their reports applied to the router's
    index, their figures kept, their losses handed to `on_loss`."""

    def __init__(
        self,
        index: PrefixIndex,
        roster: Roster,
        on_loss: Callable[[Worker, Loss], object] | None,
    ) -> None:
        self.index = index
        self._roster = roster
        self._on_loss = on_loss
        # the counts of each worker's reader processes that ended, added to the current one's
        self._earlier: dict[Worker, WorkerFigures] = {}
        # the blocks each worker holds by storage medium, as its reader last said
        self.blocks: dict[Worker, dict[str | None, int]] = {}

    def report(self, worker: Worker, report: Report) -> None:
        watched = self._roster.get(worker)
        if watched is None:
            return  # removed while this was on its way
        index = self.index
        index.apply_changes(
            worker, report.changes, report.ops, strings=report.strings, lookahead=report.lookahead
        )
        index.carry_out(worker, index.worker_view(worker).marked(report.figures.stale))
        self.blocks[worker] = report.blocks
        earlier = self._earlier.get(worker)
        watched.update(report.figures if earlier is None else report.figures.plus(earlier))
        if self._on_loss is not None:
            for loss in report.losses:
                self._on_loss(worker, loss)
        if report.failure is not None:
            log_failure(worker, watched, *report.failure)

    def reader_lost(self, workers: list[Worker]) -> None:
        """Their reader process ended: what the index holds of them is forgotten, and they are
        stale until the next one's snapshots are in."""
        workers = [worker for worker in workers if worker in self._roster]
        self.index.clear_workers(workers)
        for worker in workers:
            self.blocks.pop(worker, None)
            watched = self._roster[worker]
            self.index.carry_out(worker, self.index.worker_view(worker).resubscribed())
            figures = watched.figures
            ended = attrs.evolve(
                figures,
                failures=figures.failures + 1,
                last_error="its reader process ended",
                stale=True,
            )
            self._earlier[worker] = ended
            watched.update(ended)

    def forget(self, worker: Worker) -> None:
        """The worker is no longer watched."""
        self._earlier.pop(worker, None)
        self.blocks.pop(worker, None)
