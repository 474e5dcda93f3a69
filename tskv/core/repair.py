"""How the Sequencer repairs one publisher's sequence when it breaks, without I/O: what to ask
replay for, a restart's new sequence, a hold that overflows, a snapshot's end or failure.

`Repair` keeps where delivery stands (`Order`) and the request under way (`Asking`); the
`Sequencer` built on it takes what arrives and decides with these steps, each of which
appends the actions it takes to the list it is given or returns them.
"""

from __future__ import annotations

from tskv.core.actions import Action, RequestReplay
from tskv.core.delivery import Asking, Delivered, Order, Snapshotting
from tskv.core.losses import LossReason


class Repair:
    """The state a sequence's repair works on, and its steps."""

    def __init__(self, has_replay: bool, snapshots: bool, order: Order, asking: Asking) -> None:
        self.has_replay = has_replay
        self.snapshots = snapshots  # repair what replay no longer holds from a snapshot
        self.order = order
        self.asking = asking
        # A repair gave up: the view has a hole a snapshot would fill. It is asked for when
        # the publisher is next heard from (a live batch, an answered probe); until then
        # the quiet stream's probes, one batch each, are all that is sent (`_resync_due`).
        self.resync = False
        # The last batch delivered before the connection dropped, compared with replay's on
        # reconnect; a new sequence begun meanwhile (a restart reported) makes it no longer ours.
        self._before_drop: Delivered | None = None

    # -- requests ----------------------------------------------------------------------------

    def _request(
        self, probe: bool = False, bootstrap: bool = False, compare: Delivered | None = None
    ) -> RequestReplay:
        """Ask for what follows delivery; a probe starts where the batches no replay has shown
        yet start, to compare them all (`Recent`)."""
        order = self.order
        assert order.expected is not None
        verify_from = order.recent.first_unverified(order.expected) if probe else None
        return self.asking.replay(
            order.expected, order.last_payload, probe, compare, bootstrap, verify_from
        )

    def _overrun(self, bootstrap: bool) -> list[Action]:
        """The hold passed `max_held`. During a bootstrap the oldest held batch goes (the
        snapshot covers it, or replay fetches it again). Otherwise the repair under way has
        taken longer than `max_held` live batches: its hole is given up (reported OVERRUN)
        and what is held delivered, so the newest batches are kept and delivery keeps up with
        the stream; a further hole is asked for anew."""
        actions: list[Action] = []
        if bootstrap:
            del self.order.pending[min(self.order.pending)]
            return actions
        self.asking.forget()  # its replies describe a hole delivery has passed
        self.order.give_up_to_next_pending(LossReason.OVERRUN, actions)
        if self.order.pending and self.has_replay:
            actions.append(self._request())
        elif self.order.pending:
            self.order.give_up_to_next_pending(LossReason.NO_REPLAY, actions)
        return actions

    def _ask_if_missing(self, actions: list[Action]) -> None:
        if self.order.missing():
            actions.append(self._request())

    def _flush_old_generation(self, actions: list[Action]) -> None:
        """What was held from the old sequence still goes out, in order, with its holes named."""
        self.order.flush(LossReason.INTERRUPTED, actions)
        self.asking.forget()

    def _restart(self, seq: int, payload: bytes) -> list[Action]:
        """A seq at or below one already seen: a new publisher, whose sequence began at 0."""
        actions: list[Action] = []
        self._before_drop = None
        self._flush_old_generation(actions)
        if not self.order.restarted(seq, payload, actions):
            # Delivered as the new sequence's first: replay, answered by the publisher up now,
            # must hold the same batch at seq 0, or this one came from a publisher since gone
            # (a crash loop's: a SUB reads its connections' queues in turn, old ones too).
            if self.has_replay:
                actions.append(self._request(probe=True))
            return actions
        if self.has_replay:
            actions.append(self._from_start())
        else:
            self.order.give_up_to_next_pending(LossReason.NO_REPLAY, actions)
        return actions

    def _from_start(self) -> RequestReplay:
        """A new sequence, fetched from its seq 0: every batch replay still has (past what it
        lost, a snapshot), or nothing at all (`Synced`: it has published nothing yet). The
        old sequence's hole goes with it."""
        self.resync = False
        return self._request()

    def _resync_due(self, actions: list[Action]) -> None:
        """The publisher was just heard from: a view with a hole asks for its snapshot now.
        A snapshot that times out is asked again at the next sign of life, so a publisher that
        does not answer gets a probe per quiet interval, not snapshot after snapshot."""
        if self.resync and self.snapshots and not self.asking.busy:
            actions.append(self.asking.snapshot(resync=True))

    def _discontinuity(self, seq: int, payload: bytes) -> list[Action]:
        """A jump no real gap explains (garbage, or a stream we cannot relate to ours)."""
        actions: list[Action] = []
        self._flush_old_generation(actions)
        self.order.jumped(seq, payload, actions)
        return actions

    def _replaced(self) -> list[Action]:
        """Replay holds a different batch where ours was: the publisher restarted and its new
        sequence has already passed ours. It is fetched from its start, and the rest of this
        reply describes it too."""
        actions: list[Action] = []
        self._before_drop = None
        self.order.replaced(actions)
        actions.append(self._from_start())
        return actions

    def _snapshot_ended(self, snapshot: Snapshotting) -> list[Action]:
        """Deliver the parts as one snapshot (`Order.restore`) and ask for what was published
        since. No parts: the publisher serves none (never ask again); broken parts: reported
        undecodable. Both then go on as `_snapshot_failed`."""
        if not snapshot.parts:  # a publisher without snapshots ends the request at once
            self.snapshots = False  # so later holes are reported without asking again
            return self._snapshot_failed(snapshot, LossReason.EVICTED)
        if snapshot.broken:
            self.resync = False  # the next would be as broken: the hole stays reported
            return self._snapshot_failed(snapshot, LossReason.UNDECODABLE)
        actions: list[Action] = []
        after, parts = snapshot.next_seq, snapshot.parts
        self.order.restore(after, parts, snapshot.bootstrap, actions, snapshot.resync)
        self.resync = self.resync and not snapshot.resync
        self._ask_if_missing(actions)  # what was published since the snapshot's seq
        return actions

    def _snapshot_failed(self, snapshot: Snapshotting, reason: LossReason) -> list[Action]:
        """No snapshot: a bootstrap takes what replay still has; a repair reports its hole and
        fetches what follows it (from where replay went on, if known)."""
        if snapshot.bootstrap:
            return [self._request(bootstrap=True)]
        actions: list[Action] = []
        if snapshot.resumes_at is not None:  # replay holds what follows the hole: fetch it again
            self.order.advance_to(snapshot.resumes_at, reason, actions)
            return [*actions, self._request()]
        self.order.give_up_to_next_pending(reason, actions)
        self._ask_if_missing(actions)
        return actions
