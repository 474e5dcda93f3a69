"""The subscriber's bookkeeping, without I/O: which seq comes next, what to ask replay for,
and what to report as lost.

Fed live messages and replay replies in the order they arrive, it returns actions in the
order the consumer must see them: batches to deliver (strictly increasing seq within a
generation, no duplicates), losses to report, and replay requests to send. The Trio shell in
`subscriber.py` only moves bytes between sockets and this object.

The wire carries no publisher epoch, so a restarted publisher is recognised two ways: its seq
goes back (the usual case), or, when its seq is already past ours, the batch replay holds at
our last delivered seq differs from the one we delivered. Every repair therefore asks replay
to start one seq early, at the last batch delivered, and compares.

A quiet stream hides nothing: when no live batch has come for a while, the subscriber calls
`quiet()`, which asks replay for what followed the last batch delivered (starting at that
batch, to compare). Batches the live stream lost at its very end come back that way; a reply
with nothing at or after our last batch means the publisher's sequence is behind ours, so it
restarted; no reply at all means the publisher is silent (`Silence`), which a router must know
before it trusts that worker's view.

What replay can no longer give (the publisher's buffer has moved on) is repaired from a
snapshot when the publisher serves them: the state as of some seq, delivered as one batch that
clears and restores the cache, with the batches it replaces reported as such. A publisher
without snapshots ends the request at once, and the hole is reported as before; so is one whose
snapshot passes `max_snapshot_bytes` while its parts are gathered.
"""

from __future__ import annotations

from typing import Literal

import attrs

from tskv.core.actions import (
    Action,
    Silence,
    SnapshotTooLarge,
    Synced,
)
from tskv.core.delivery import (
    MAX_SNAPSHOT_BYTES,
    Asking,
    Order,
    Replaying,
    Snapshotting,
)
from tskv.core.errors import ConfigError
from tskv.core.losses import LossReason
from tskv.core.repair import Repair

MAX_HELD = 10_000  # live batches held while a gap is repaired; later ones are fetched again
MAX_GAP = 2**32  # a forward jump larger than this is a discontinuity, not a loss of 4e9 batches


class Sequencer(Repair):
    """Gap detection and repair for one publisher's stream.

    Its mode is one value, `asking.state`: `Idle`, `Replaying` (comparing or not, a probe or not) or
    `Snapshotting` (with the parts so far). Every entry point takes what arrived and returns the
    actions to carry out, in order: deliveries and loss reports in the order the consumer must
    see them, then at most one new request (which replaces the one under way). A reply is
    acted on only while its request is the current one (`Asking.current`); a reply to a
    request given up on returns no actions.
    """

    def __init__(
        self,
        has_replay: bool,
        start_seq: int | Literal["snapshot"] | None = None,
        *,
        snapshots: bool = True,
        max_held: int = MAX_HELD,
        max_gap: int = MAX_GAP,
        max_snapshot_bytes: int = MAX_SNAPSHOT_BYTES,
    ) -> None:
        # a snapshot bootstrap holds every live batch until the snapshot is in
        order = Order(0 if start_seq == "snapshot" else start_seq, max_held)
        super().__init__(has_replay, snapshots, order, Asking(max_snapshot_bytes))
        self.max_gap = max_gap
        self._start_from_snapshot = start_seq == "snapshot"
        self.silent = False  # a probe went unanswered, and nothing has been heard since
        self.epoch: int | None = None  # the publisher's incarnation, when it says it (tskv's)

    def start(self) -> list[Action]:
        """Before any message. Returns the bootstrap request when a start seq was given (a
        replay from it, or a snapshot), else nothing. Raises ValueError for a start seq
        without a replay endpoint."""
        if self.order.expected is None:
            return []
        if not self.has_replay:
            start = "snapshot" if self._start_from_snapshot else self.order.expected
            raise ConfigError(
                f"start_seq = {start!r} needs a replay endpoint to fetch past batches from"
            )
        if self._start_from_snapshot:
            return [self.asking.snapshot(bootstrap=True)]
        return [self._request(bootstrap=True)]

    # -- what arrives ---------------------------------------------------------------------

    def live(self, seq: int, payload: bytes) -> list[Action]:
        """A live batch. Returns: a restart's report and the new sequence's start (seq at or
        below one heard); the batch and the held ones that follow it (the next one in order),
        and a resync's snapshot request if a view with a hole waits for one; nothing (already
        delivered, or held while a repair is under way); the repair's hole given up when the
        hold is full (`_overrun`); or, for a gap, a replay request (with replay) or the hole
        reported (without). Then `Silence(False)` if the publisher was silent (`_answered`)."""
        if self.silent and not self._probing():  # else the probe's answer ends the silence
            return self._answered(self._live(seq, payload))
        return self._live(seq, payload)

    def _live(self, seq: int, payload: bytes) -> list[Action]:
        actions: list[Action] = []
        if self.order.last_live is not None and seq <= self.order.last_live:
            return actions + self._restart(seq, payload)
        self.order.last_live = seq
        if self.order.expected is None:
            return [*actions, self.order.deliver_live(seq, payload)]
        if seq < self.order.expected:
            return actions  # before the requested start, or already delivered from replay
        state = self.asking.state
        if seq == self.order.expected and not isinstance(state, Snapshotting):
            actions.append(self.order.deliver_live(seq, payload))
            self.order.drain(actions)
            self._resync_due(actions)
            return actions
        bootstrap = isinstance(state, Snapshotting) and state.bootstrap
        if seq - self.order.expected > self.max_gap and not bootstrap:
            return actions + self._discontinuity(seq, payload)
        self.order.pending[seq] = payload
        if len(self.order.pending) > self.order.max_held:
            return actions + self._overrun(bootstrap)
        if self.asking.busy:
            return actions
        if self.has_replay:
            return [*actions, self._request()]
        self.order.give_up_to_next_pending(LossReason.NO_REPLAY, actions)
        return actions

    def quiet(self) -> list[Action]:
        """No live batch has come for the quiet interval. Returns a probe (a replay request
        from the last batch delivered, to compare), or nothing: no replay endpoint, nothing
        delivered yet, or a request already under way (it asks the same). A view with a hole
        (`resync`) asks for its snapshot once the probe is answered."""
        if not self.has_replay or self.order.expected is None or self.asking.busy:
            return []
        return [self._request(probe=True)]

    def reconnected(self) -> list[Action]:
        """The live connection was made again. Whoever answers may be a restarted publisher
        whose sequence meets ours, so with replay, replay's batch at our last seq is compared
        with ours (as a quiet stream's probe does), and its answer ends a silence. Without
        replay nothing can be compared: the publisher is back, and its first batch tells a
        restart (seq 0 again) from a continuation."""
        compare, self._before_drop = self._before_drop, None
        self.order.recent.doubt_all()
        expected = self.order.expected
        if self.has_replay and expected is not None:
            if isinstance(self.asking.state, Snapshotting):
                return []  # it stands in for everything: a restart shows in it, and its epoch
            # A replay under way was asked of whoever was there before: this one replaces it.
            return [self._request(probe=True, compare=compare)]
        actions: list[Action] = []
        if self.silent:
            self._heard(actions)
        return actions

    def disconnected(self) -> list[Action]:
        """The live connection dropped (a publisher that exits or crashes closes it): silent
        until it is heard again, without waiting for a probe to go unanswered. The last batch
        delivered is kept to compare on reconnect: a restarted publisher's next batch may come
        first and pass for ours."""
        self.order.recent.doubt_all()
        if self.order.expected:
            self._before_drop = (self.order.expected - 1, self.order.last_payload)
        if self.silent:
            return []
        self.silent = True
        return [Silence(True, self.order.last_delivered, disconnected=True)]

    def replayed(self, request_id: int, seq: int, payload: bytes) -> list[Action]:
        """One batch of the current request's replay. Returns nothing (the verified batch
        matches ours, or it is one already delivered); a restart's report and a request from
        seq 0 (the verified batch differs); a snapshot request (replay skipped past what we
        miss, with snapshots on); or the holes before it reported, the batch, and the held
        ones that follow it. A silence ends with the end marker, which says the epoch."""
        state = self.asking.current(request_id)
        if state is None:
            return []
        return self._replayed(state, seq, payload)  # its end marker ends a silence

    def _replayed(self, state: Replaying | Snapshotting, seq: int, payload: bytes) -> list[Action]:
        actions: list[Action] = []
        assert self.order.expected is not None
        if seq > max(self.order.expected, self.order.last_live or 0) + self.max_gap:
            return actions  # no replay buffer reaches that far ahead of the live stream
        if isinstance(state, Replaying) and state.compare is not None:
            self.asking.state = attrs.evolve(state, compare=None)
            compared, ours = state.compare
            if seq == compared:
                if ours is None or payload == ours:
                    return actions  # the same stream (as far as can be told): go on from here
                return actions + self._replaced()
        if seq < self.order.expected:  # delivered: if ours differs, a gone publisher's was
            return actions if self.order.recent.shows(seq, payload) else self._replaced()
        if seq > self.order.expected and self.snapshots:
            # The buffer no longer holds what we miss: a snapshot stands in for it, and the
            # rest of this replay (answering a request now given up on) is ignored.
            return [*actions, self.asking.snapshot(resumes_at=seq)]
        self.order.pending.pop(seq, None)  # held live too: the replayed copy goes out instead
        # Replay skipping ahead means the buffer lost what came before, but not what we hold.
        self.order.advance_to(seq, LossReason.EVICTED, actions)
        repaired = not (isinstance(state, Replaying) and state.bootstrap)
        actions.append(self.order.deliver(seq, payload, repaired))
        self.order.drain(actions)
        return actions

    def snapshot_part(
        self, request_id: int, next_seq: int, index: int, payload: bytes
    ) -> list[Action]:
        """One part of the snapshot asked for, kept until the end marker (no actions) unless
        the parts pass `max_snapshot_bytes`, as a publisher's that never ends them would: then
        `SnapshotTooLarge`, and on as `_snapshot_failed` says. A part out of order spoils it."""
        state = self.asking.current(request_id)
        if not isinstance(state, Snapshotting):
            return []
        self.silent = False  # a part is an answer; the end marker reports it
        if state.add(next_seq, index, payload):
            return []
        self.asking.take(request_id)  # the rest of its parts are ignored, and none asked again
        self.snapshots = False
        return [SnapshotTooLarge(state.size), *self._snapshot_failed(state, LossReason.TOO_LARGE)]

    def replay_ended(self, request_id: int, epoch: int | None = None) -> list[Action]:
        """The current request's end marker, with the publisher's epoch if it says one.
        Returns `Silence(False)` first if the publisher was silent. Another epoch than the one
        it said before is a restart, whatever the seqs say. A snapshot ends as
        `_snapshot_ended` says. A replay that made progress but left batches missing asks
        again from where delivery stands; one that made none asks for a snapshot (snapshots
        on) or reports the holes (then asks for the next hole, if any). A probe that got
        nothing at all, not even our last batch, means the publisher's sequence is behind
        ours: a restart, and its new sequence asked for from its start. A replay from the
        start of a sequence that has published nothing says so (`Synced`). Then
        `Silence(False)` if the publisher was silent."""
        state = self.asking.take(request_id)
        if state is None:
            return []
        if self.silent:
            return self._answered(self._replay_ended(state, epoch))
        return self._replay_ended(state, epoch)

    def _replay_ended(self, state: Replaying | Snapshotting, epoch: int | None) -> list[Action]:
        actions: list[Action] = []
        if epoch is not None:
            known, self.epoch = self.epoch, epoch
            # A new incarnation: a restart, if anything delivered before this request came
            # from the old one (a snapshot, or a replay from its start, is all the new one's).
            old = isinstance(state, Replaying) and state.expected_at_request > 0
            if known is not None and known != epoch and old:
                return actions + self._replaced()
        if isinstance(state, Snapshotting):
            return actions + self._snapshot_ended(state)
        assert self.order.expected is not None
        if state.probe and state.compare is not None:  # nothing came back at all
            return actions + self._replaced()
        if state.probe:
            self.order.recent.shown_before(state.expected_at_request)
        if not self.order.missing():
            if self.order.expected == 0 and state.expected_at_request == 0 and not state.probe:
                actions.append(Synced())
            self._resync_due(actions)
            return actions
        if self.order.expected != state.expected_at_request:
            # Progress was made, but batches published after the request are still missing:
            # ask again from where we are.
            return [*actions, self._request(bootstrap=state.bootstrap)]
        if self.snapshots:
            return [*actions, self.asking.snapshot()]  # what the buffer lost, a snapshot restores
        self.order.give_up_to_next_pending(LossReason.EVICTED, actions)
        if self.order.pending:
            actions.append(self._request())  # a further hole, after the one just given up
        return actions

    def replay_failed(
        self, request_id: int, reason: LossReason = LossReason.REPLAY_TIMEOUT
    ) -> list[Action]:
        """The replay endpoint did not serve the current request (it timed out, or kept
        refusing). A snapshot that failed is handled as `_snapshot_failed` says. A refused probe
        proves the publisher alive: `Silence(False)` if it was silent, and a request for what is
        missing. A probe that timed out reports `Silence(True)` (once), then, as for any other
        failure, what the request should have filled is reported lost."""
        actions: list[Action] = []
        state = self.asking.take(request_id)
        if state is None:
            return actions
        if isinstance(state, Snapshotting):
            return self._snapshot_failed(state, reason)
        if state.probe and reason is LossReason.REFUSED:  # busy, not gone: repair what is missing
            if self.silent:
                self._heard(actions)
            self._ask_if_missing(actions)
            self._resync_due(actions)
            return actions
        if state.probe and reason is LossReason.REPLAY_TIMEOUT and not self.silent:
            self.silent = True
            actions.append(Silence(True, self.order.last_delivered))
        if self.order.missing() and not state.probe:
            self.resync = True  # the hole it leaves, a snapshot fills when the publisher answers
        self.order.give_up_all(reason, actions)
        return actions

    # -- the publisher's presence ------------------------------------------------------------

    def _heard(self, actions: list[Action]) -> None:
        """The publisher answered (live or on replay): a silence it was in is over."""
        self.silent = False
        actions.append(Silence(False, self.order.last_delivered))

    def _probing(self) -> bool:
        """A probe is under way: whether the publisher is the one we knew is not known until
        it ends (its end marker says its epoch)."""
        state = self.asking.state
        return isinstance(state, Replaying) and state.probe

    def _answered(self, actions: list[Action]) -> list[Action]:
        """`actions`, decided on what a silent publisher just said, then the end of its
        silence: a restart it reveals is reported first, so nothing trusts the old view in
        between."""
        if self.silent:  # a timeout while deciding may have said it again
            self._heard(actions)
        return actions
