"""A watched worker, as the watcher's parts share it: the handle adds and removes it and reads
its figures, the index record (or the mirror of its reader process) keeps them current."""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs
import trio

from tskv.core.config import SubscriberConfig
from tskv.core.descriptor import Descriptor
from tskv.core.prefix_index import Worker
from tskv.core.worker_view import WorkerFigures


@attrs.define
class Watched:
    """A watched worker: where it publishes, its settings, its follower's cancel scope, and its
    figures, which `Watcher.status` hands out and `wait_for_seq` waits on."""

    endpoint: str
    replay_endpoint: str | None
    config: SubscriberConfig
    slot: int  # how a reader process names it: its `add`'s number
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)  # its follower's, here
    figures: WorkerFigures = attrs.Factory(WorkerFigures)
    changed: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)
    on_turn: Callable[[], object] | None = None  # told when it turns stale, current, silent, back
    descriptor: Descriptor | None = None  # what its publisher said it is, if it said
    described: trio.Event = attrs.Factory(trio.Event)  # set once its publisher was asked
    mismatch: str | None = None  # why its blocks cannot match the index's, if they cannot

    def update(self, figures: WorkerFigures) -> None:
        """New figures: whoever waits on this worker looks again, and a turn is told."""
        before, self.figures = self.figures, figures
        if self.changed:  # most reports find no one waiting, and unparking none costs calls
            self.changed.unpark_all()
        turned = before.stale != figures.stale or before.silent != figures.silent
        if turned and self.on_turn is not None:
            self.on_turn()


Roster = dict[Worker, Watched]


logger = logging.getLogger("tskv.shells.watcher")


def log_failure(worker: Worker, watched: Watched, error: str, retry_in: float) -> None:
    """A worker's subscriber failed: said where the watcher's user looks, whichever process
    followed the worker."""
    logger.warning(
        "watching %r on %s failed (%s); trying again in %.1f s",
        worker,
        watched.endpoint,
        error,
        retry_in,
    )


def log_mismatch(worker: Worker, watched: Watched, why: str) -> None:
    logger.warning(
        "worker %r on %s cannot be matched with this index: %s; give every worker of an index "
        "the same block size and hash algorithm (or a PrefixIndex of its own)",
        worker,
        watched.endpoint,
        why,
    )
