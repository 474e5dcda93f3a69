"""Whether a router may trust what the index says of one worker, decided from what that
worker's stream reports, without I/O.

A view is stale from the start until it is whole: followed from the stream's seq 0, or restored
by a snapshot or a cache reset (the index itself marks those current when it applies them). A
loss makes it stale; a restart also clears it (the restarted engine's cache starts empty); a
publisher gone silent makes it stale until it answers with nothing lost meanwhile. The watcher
(`tskv.shells.watcher`) applies the changes returned here to the index.
"""

from __future__ import annotations

import enum

import attrs

from tskv.core.losses import Loss, LossReason


class ViewChange(enum.Enum):
    CLEAR = "clear"  # forget the worker's blocks
    STALE = "stale"  # answers about it are not to be trusted
    CURRENT = "current"  # its view is whole again


CLEAR_AND_STALE = (ViewChange.CLEAR, ViewChange.STALE)
STALE = (ViewChange.STALE,)
CURRENT = (ViewChange.CURRENT,)
NOTHING: tuple[ViewChange, ...] = ()


@attrs.define
class WorkerView:
    """One worker's trust, from its subscriber's reports."""

    from_start: bool = True  # the next delivery may be seq 0 of a whole stream
    stale_for_silence: bool = False  # stale only because the publisher went silent

    def delivered(self, seq: int) -> tuple[ViewChange, ...]:
        """A batch was applied: the first one after a (re)start makes the view whole if it is
        the stream's very first batch."""
        if not self.from_start:
            return NOTHING
        self.from_start = False
        return CURRENT if seq == 0 else NOTHING

    def lost(self, loss: Loss) -> tuple[ViewChange, ...]:
        """A loss was reported: only a repair (snapshot, reset, seq 0) makes the view whole."""
        self.stale_for_silence = False
        if loss.reason is LossReason.RESTART:
            self.from_start = True
            return CLEAR_AND_STALE
        return STALE

    def silence(self, silent: bool, stale: bool) -> tuple[ViewChange, ...]:
        """The publisher went silent, or answers again; `stale` is what the index says now."""
        if silent and not stale:
            self.stale_for_silence = True
            return STALE  # it may be gone: route nothing on its word
        if not silent and self.stale_for_silence:
            self.stale_for_silence = False
            return CURRENT  # it answers, and nothing was lost meanwhile
        return NOTHING

    def resubscribed(self) -> tuple[ViewChange, ...]:
        """Its subscriber failed and is started again: what it missed meanwhile is unknown."""
        self.from_start = True
        self.stale_for_silence = False
        return STALE
