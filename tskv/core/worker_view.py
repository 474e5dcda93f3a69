"""Whether a router may trust what the index says of one worker: every stale or current decision,
made here from what happened to that worker's view, without I/O.

A view is whole when the index holds the worker's whole cache: it followed the stream from its
seq 0, or applied a cache reset (a snapshot starts with one), or learnt that the stream, from
its start, holds nothing yet (a restarted engine that has published nothing), or the worker's
own user said so (`PrefixIndex.mark_current`). It is stale, and a router should not route on
it, from the moment a watcher starts following the worker until then; after a loss (a restart
also clears it: the restarted engine's cache starts empty); while a snapshot's parts are being
applied (a query must not trust a half-restored view); and while its publisher is silent,
until it answers with nothing lost meanwhile. The index keeps one `WorkerView` per worker and
carries out the changes its methods return (`PrefixIndex.carry_out`); the watcher's followers
and the snapshot path only report what happened.
"""

from __future__ import annotations

import enum

import attrs

from tskv.core.losses import Loss, LossReason


class ViewChange(enum.Enum):
    """What a worker's view decides and the index carries out: the one vocabulary between them."""

    CLEAR = "clear"  # forget the worker's blocks
    STALE = "stale"  # answers about it are not to be trusted
    CURRENT = "current"  # its view is whole again


Changes = tuple[ViewChange, ...]
CLEAR_AND_STALE = (ViewChange.CLEAR, ViewChange.STALE)
STALE = (ViewChange.STALE,)
CURRENT = (ViewChange.CURRENT,)
NOTHING: Changes = ()


@attrs.define
class WorkerView:
    """One worker's trust. A worker the index learns of from its events alone is trusted (its
    user applies what it knows); one a watcher follows is stale until its view is whole."""

    stale: bool = False
    from_start: bool = True  # the next delivery may be seq 0 of a whole stream
    stale_for_silence: bool = False  # stale only because the publisher went silent
    restoring: bool = False  # a snapshot's parts are being applied
    restore_clears: bool = False  # the snapshot being applied began with a cache reset

    def _becomes(self, stale: bool) -> Changes:
        if stale == self.stale:
            return NOTHING
        self.stale = stale
        return STALE if stale else CURRENT

    def marked(self, stale: bool) -> Changes:
        """The worker's user says the view is (not) whole: `mark_stale`, `mark_current`, or a
        reader process that decided it in its own index."""
        self.stale_for_silence = False
        return self._becomes(stale)

    def watched(self) -> Changes:
        """A watcher starts following the worker: nothing is known of it yet."""
        self.from_start = True
        self.stale_for_silence = False
        return self._becomes(True)

    def reset_applied(self) -> Changes:
        """A batch applied to the index held AllBlocksCleared: from there on the index knows
        the worker's whole cache, unless it is a snapshot's first part (then the last decides)."""
        if self.restoring:
            self.restore_clears = True
            return NOTHING
        self.stale_for_silence = False
        return self._becomes(False)

    def delivered(self, seq: int) -> Changes:
        """A batch was applied: the first one after a (re)start makes the view whole if it is
        the stream's very first batch."""
        if not self.from_start:
            return NOTHING
        self.from_start = False
        return self._becomes(False) if seq == 0 else NOTHING

    def synced(self) -> Changes:
        """The worker's stream, read from its start, has published nothing: its cache is empty,
        so the view is whole once what the index held of it is forgotten."""
        self.from_start = True  # its first batch will be its seq 0
        self.stale_for_silence = False
        return (ViewChange.CLEAR, *self._becomes(False))

    def snapshot_begins(self) -> Changes:
        """A snapshot's parts are about to be applied: stale until the last is in, whatever
        made it stale before."""
        self.restoring, self.restore_clears = True, False
        self.stale_for_silence = False
        return self._becomes(True)

    def snapshot_ends(self, complete: bool) -> Changes:
        """The snapshot's parts are all applied (`complete`), or it broke off: whole if every
        part went in and it cleared the view first (every snapshot's first part does)."""
        whole = complete and self.restore_clears
        self.restoring = self.restore_clears = False
        if whole:
            self.stale_for_silence = False
            return self._becomes(False)
        return NOTHING

    def lost(self, loss: Loss) -> Changes:
        """A loss was reported: only a repair (snapshot, reset, seq 0) makes the view whole."""
        self.stale_for_silence = False
        if loss.reason is LossReason.RESTART:
            self.from_start = True
            self.stale = True
            return CLEAR_AND_STALE
        return self._becomes(True)

    def silence(self, silent: bool) -> Changes:
        """The publisher went silent, or answers again."""
        if silent and not self.stale:
            self.stale_for_silence = True
            return self._becomes(True)  # it may be gone: route nothing on its word
        if not silent and self.stale_for_silence:
            self.stale_for_silence = False
            return self._becomes(False)  # it answers, and nothing was lost meanwhile
        return NOTHING

    def resubscribed(self) -> Changes:
        """Its subscriber failed and is started again (or its reader process ended): what it
        missed meanwhile is unknown."""
        self.from_start = True
        self.stale_for_silence = False
        return self._becomes(True)


@attrs.frozen
class WorkerFigures:
    """A watched worker's figures, as its follower keeps them, a reader process sends them and
    `Watcher.status` hands them out (inside a `WorkerStatus`)."""

    batches: int = 0  # applied to the index (a snapshot counts once)
    losses: int = 0  # loss reports (snapshots and restarts included)
    failures: int = 0  # times its subscriber failed and was started again
    last_error: str | None = None
    last_seq: int | None = None
    silent: bool = False  # its publisher did not answer a probe of its quiet stream
    stale: bool = True  # the index cannot vouch for its view right now

    def after_batch(self, seq: int, stale: bool) -> WorkerFigures:
        """These figures after one more batch (written out: it runs for every batch)."""
        return WorkerFigures(
            self.batches + 1, self.losses, self.failures, self.last_error, seq, self.silent, stale
        )

    def plus(self, earlier: WorkerFigures) -> WorkerFigures:
        """These figures with the counts of `earlier` (a reader process that ended) added."""
        return attrs.evolve(
            self,
            batches=earlier.batches + self.batches,
            losses=earlier.losses + self.losses,
            failures=earlier.failures + self.failures,
            last_error=self.last_error or earlier.last_error,
        )
