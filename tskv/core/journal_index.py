"""The index a watcher's reader process keeps: its workers' blocks, and the holds they took
and let go of for the index's process to mirror. No I/O.

A reader process follows some of a watcher's workers and files their events as any index
does (`BlockIndex`), but keeps no holders: the router's `PrefixIndex`, in the index's process,
mirrors what each worker took and let go of (`PrefixIndex.apply_changes`) and answers the
queries. So this index has no `match()`: there is nothing here to answer one from.
"""

from __future__ import annotations

import time

from tskv.core.holdings import Journal
from tskv.core.hybrid import Op
from tskv.core.predictions import Predictions
from tskv.core.prefix_index import BlockIndex, Worker, checked_block_size


class JournalIndex(BlockIndex):
    """A reader process's index: every worker's blocks, and a journal of their holds."""

    def __init__(self, block_size: int = 16, *, dynamo_hashes: bool = False) -> None:
        predictions = Predictions(time.monotonic, 0)  # none are made here; filing reads them
        journal = Journal(checked_block_size(block_size), predictions)
        super().__init__(journal, predictions, dynamo_hashes)
        self._journal = journal

    def take_changes(self, worker: Worker) -> tuple[list[list[int]], list[Op]]:
        """What `worker` came to hold and let go of since last asked, for the index's process
        to mirror with `PrefixIndex.apply_changes`: the keys as runs (taken, let go of,
        taken...), and a hybrid worker's changes by tier (`core/hybrid.py`), every copy of a
        key."""
        worker_blocks = self._holdings.workers.get(worker)
        return ([], []) if worker_blocks is None else self._journal.take_changes(worker_blocks)
