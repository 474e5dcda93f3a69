"""The record of a watcher's followers: it applies each worker's news to the index.

A follower (`_following.follow`) hands it every batch, snapshot, loss, silence and failure of
one worker. The record applies batches and snapshot parts to the index, tells the worker's view
what happened (the view decides stale or current, and the index carries it out), and keeps the
worker's figures. In a reader process a listener (its outbox) also hears each piece of news,
to send the worker's new state to the index's process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import attrs

from tskv.core.applied import Applied
from tskv.core.events import KVEventBatch
from tskv.core.losses import Loss, LossReason
from tskv.core.prefix_index import BlockIndex, Worker
from tskv.core.read_batch import ReadBatch
from tskv.core.worker_view import Changes, WorkerFigures, WorkerView
from tskv.shells._snapshot_parts import SnapshotParts
from tskv.shells._watched import Roster, Watched, log_failure


class Listener(Protocol):
    """Who else hears each worker's news (a reader process's outbox, for the index's process)."""

    async def room(self) -> None:
        """Return when another batch may be applied (the listener's queue is bounded)."""

    def has_room(self) -> bool:
        """Whether `room` would return at once."""

    def noted(
        self,
        worker: Worker,
        figures: WorkerFigures,
        *,
        batch: bool = False,
        loss: Loss | None = None,
        failure: tuple[str, float] | None = None,
    ) -> None:
        """The worker's state changed (now `figures`): a batch applied, a loss, a failure, or
        other news."""

    async def part_noted(self, worker: Worker, figures: WorkerFigures) -> None:
        """A snapshot's part (not its last) was applied: its news goes out on its own."""


class IndexRecord:
    """Applies each watched worker's news to `index` and keeps its figures in the roster."""

    def __init__(
        self,
        index: BlockIndex,
        roster: Roster,
        on_loss: Callable[[Worker, Loss], object] | None = None,
        listener: Listener | None = None,
    ) -> None:
        self.index = index
        self._roster = roster
        self._on_loss = on_loss
        self._listener = listener
        self.applied_so_far = Applied()  # every batch applied here: how late, its events' kinds

    def watching(self, worker: Worker) -> bool:
        return worker in self._roster

    async def room(self) -> None:
        if self._listener is not None:
            await self._listener.room()

    def has_room(self) -> bool:
        return self._listener is None or self._listener.has_room()

    def _tell(self, worker: Worker, changes: Changes) -> None:
        self.index.carry_out(worker, changes)

    def _note(
        self,
        worker: Worker,
        watched: Watched,
        *,
        batch: bool = False,
        loss: Loss | None = None,
        failure: tuple[str, float] | None = None,
    ) -> None:
        if self._listener is not None:
            self._listener.noted(worker, watched.figures, batch=batch, loss=loss, failure=failure)

    def applied(self, worker: Worker, seq: int, batch: KVEventBatch | ReadBatch) -> None:
        watched = self._roster.get(worker)
        if watched is None:
            return  # removed while this batch was on its way
        self.index.apply(worker, batch)  # an AllBlocksCleared in it makes the view whole
        self.applied_so_far.observe(batch, time.time())
        self._delivered(worker, watched, seq)
        self._note(worker, watched, batch=True)

    async def restored(self, worker: Worker, seq: int, snapshot: SnapshotParts) -> None:
        """Apply the snapshot a part at a time: stale until its last part is in, so no query
        trusts a half-restored view; then as the whole snapshot would have left it."""
        watched = self._roster.get(worker)
        if watched is None:
            return
        view = self.index.worker_view(worker)
        self._tell(worker, view.snapshot_begins())
        watched.update(attrs.evolve(watched.figures, stale=True))
        async for part in snapshot:
            if self._roster.get(worker) is not watched:
                return  # removed meanwhile: its parts must not bring it back into the index
            self.index.apply(worker, part)
            if self._listener is not None and not snapshot.complete:
                await self._listener.part_noted(worker, watched.figures)
        if self._roster.get(worker) is not watched:
            return
        self._tell(worker, view.snapshot_ends(snapshot.complete))
        if snapshot.complete:
            self._delivered(worker, watched, seq)
        self._note(worker, watched, batch=True)

    def _delivered(self, worker: Worker, watched: Watched, seq: int) -> None:
        view = self.index.worker_view(worker)
        if view.from_start:
            self._tell(worker, view.delivered(seq))
        watched.update(watched.figures.after_batch(seq, view.stale))

    def lost(self, worker: Worker, loss: Loss) -> None:
        watched = self._roster.get(worker)
        if watched is None:
            return
        view = self.index.worker_view(worker)
        self._tell(worker, view.lost(loss))
        figures = attrs.evolve(watched.figures, losses=watched.figures.losses + 1, stale=view.stale)
        if loss.reason is LossReason.RESTART:  # a new sequence: its seqs start again
            figures = attrs.evolve(figures, last_seq=None)
        watched.update(figures)
        if self._on_loss is not None:
            self._on_loss(worker, loss)
        self._note(worker, watched, loss=loss)

    def synced(self, worker: Worker) -> None:
        self._view_news(worker, WorkerView.synced)

    def silence(self, worker: Worker, silent: bool) -> None:
        self._view_news(worker, lambda view: view.silence(silent), silent=silent)

    def resubscribed(self, worker: Worker) -> None:
        self._view_news(worker, WorkerView.resubscribed)

    def _view_news(
        self, worker: Worker, decide: Callable[[WorkerView], Changes], **figures: Any
    ) -> None:
        """News that only the worker's view decides on: what it decides is carried out, and the
        figures (and the listener) follow."""
        watched = self._roster.get(worker)
        if watched is None:
            return
        view = self.index.worker_view(worker)
        self._tell(worker, decide(view))
        watched.update(attrs.evolve(watched.figures, stale=view.stale, **figures))
        self._note(worker, watched)

    def failed(self, worker: Worker, error: str, retry_in: float) -> None:
        watched = self._roster.get(worker)
        if watched is None:
            return
        figures = watched.figures
        watched.update(attrs.evolve(figures, failures=figures.failures + 1, last_error=error))
        if self._listener is None:
            log_failure(worker, watched, error, retry_in)
        self._note(worker, watched, failure=(error, retry_in))  # the other end logs it
