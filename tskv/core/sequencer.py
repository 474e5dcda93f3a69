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
without snapshots ends the request at once, and the hole is reported as before.
"""

from __future__ import annotations

import enum
from typing import Literal, NamedTuple

import attrs

MAX_HELD = 10_000  # live batches held while a gap is repaired; later ones are fetched again
MAX_GAP = 2**32  # a forward jump larger than this is a discontinuity, not a loss of 4e9 batches


class LossReason(str, enum.Enum):
    """Why batches were not delivered."""

    EVICTED = "evicted"  # replay answered, but the publisher's buffer no longer held them
    NO_REPLAY = "no-replay"  # the subscriber has no replay endpoint to ask
    REPLAY_TIMEOUT = "replay-timeout"  # the replay endpoint did not answer in time
    REFUSED = "refused"  # the replay endpoint kept refusing (its limits) until the timeout
    UNDECODABLE = "undecodable"  # the batch arrived but its payload was not a batch
    INTERRUPTED = "interrupted"  # a repair was under way when the publisher restarted
    RESTART = "restart"  # the publisher started a new sequence (or the seq jumped absurdly)
    SNAPSHOT = "snapshot"  # not lost: replaced by the snapshot delivered next, which has them


@attrs.frozen
class Loss:
    """Batches `first_seq`..`last_seq` (inclusive) the consumer will never see.

    For a restart, `last_seq` is None (what the old publisher sent after `first_seq - 1` is
    unknown) and `new_seq` is where delivery goes on in the new sequence: a consumer should
    forget what it knew of this publisher's cache, as the restarted engine's cache is new too.
    """

    first_seq: int
    last_seq: int | None
    reason: LossReason
    new_seq: int | None = None

    @property
    def count(self) -> int | None:
        return None if self.last_seq is None else self.last_seq - self.first_seq + 1


class Deliver(NamedTuple):  # one per batch: a tuple is the cheapest value to make
    seq: int
    payload: bytes
    from_replay: bool


class DeliverSnapshot(NamedTuple):
    """A snapshot's parts, to deliver as one batch under `seq` (the state after that seq).
    `replaced` is the first seq it stands in for (None for a bootstrap the consumer asked
    for): the subscriber reports `replaced..seq` once the parts decode."""

    seq: int
    payloads: list[bytes]
    replaced: int | None


@attrs.frozen
class RequestReplay:
    start_seq: int
    request_id: int
    probe: bool = False  # asked because the stream went quiet: a refusal proves it alive


@attrs.frozen
class RequestSnapshot:
    request_id: int


@attrs.frozen
class Silence:
    """The publisher stopped answering (`silent`: its replay endpoint did not answer a probe of
    a quiet stream), or answers again. Nothing is known lost; what it holds is unknown."""

    silent: bool
    last_seq: int | None  # the last seq delivered before (or after) the silence


Action = Deliver | DeliverSnapshot | Loss | RequestReplay | RequestSnapshot | Silence


class Sequencer:
    """Gap detection and repair for one publisher's stream."""

    def __init__(
        self,
        has_replay: bool,
        start_seq: int | Literal["snapshot"] | None = None,
        *,
        snapshots: bool = True,
        max_held: int = MAX_HELD,
        max_gap: int = MAX_GAP,
    ) -> None:
        self.has_replay = has_replay
        self.snapshots = snapshots  # repair what replay no longer holds from a snapshot
        self.max_held = max_held
        self.max_gap = max_gap
        self._bootstrapping = start_seq == "snapshot"
        # the next seq to deliver; a snapshot bootstrap holds every live batch until it is in
        self.expected: int | None = 0 if start_seq == "snapshot" else start_seq
        self.last_live: int | None = None
        self.pending: dict[int, bytes] = {}  # live batches held while a gap is repaired
        self.request_id = 0
        self.repairing = False
        self._expected_at_request: int | None = None
        self._last_payload: bytes | None = None  # what was delivered at expected - 1
        self._verifying = False  # the current request started at expected - 1, to compare
        self._probing = False  # the current request asks a quiet publisher what it has
        self.silent = False  # a probe went unanswered, and nothing has been heard since
        self.snapshotting = False  # the current request is for a snapshot
        self._parts: list[bytes] = []  # the snapshot's parts received so far
        self._snapshot_next = 0  # the seq the snapshot's state is before
        self._parts_broken = False
        self._resumes_at: int | None = None  # where replay went on after what it had lost

    def start(self) -> list[Action]:
        """Actions to take before any message: a bootstrap replay when a start seq was given."""
        if self.expected is None:
            return []
        if not self.has_replay:
            start = "snapshot" if self._bootstrapping else self.expected
            raise ValueError(
                f"start_seq = {start!r} needs a replay endpoint to fetch past batches from"
            )
        return [self._request_snapshot() if self._bootstrapping else self._request()]

    def _request(self, probe: bool = False) -> RequestReplay:
        assert self.expected is not None
        self.request_id += 1
        self.repairing = True
        self._probing = probe
        self._expected_at_request = self.expected
        # A probe starts at the last batch even unseen (after a snapshot): the publisher still
        # holds its newest batch, so a reply without it means a sequence behind ours.
        self._verifying = self.expected > 0 and (probe or self._last_payload is not None)
        self.snapshotting = False
        start = self.expected - 1 if self._verifying else self.expected
        return RequestReplay(start, self.request_id, probe)

    def _behind(self) -> bool:
        """Live batches were heard past what was delivered and are not held: let go while the
        hold was full, so known to exist and still to fetch (or report)."""
        return (
            self.last_live is not None
            and self.expected is not None
            and (self.expected <= self.last_live and self.last_live not in self.pending)
        )

    def _heard(self, actions: list[Action]) -> None:
        """The publisher answered (live or on replay): a silence it was in is over."""
        self.silent = False
        actions.append(Silence(False, None if self.expected is None else self.expected - 1))

    def quiet(self) -> list[Action]:
        """No live batch has come for the quiet interval: ask replay what followed the last
        batch delivered, unless a request is under way already (it asks the same). Returns the
        probe to send, or nothing (no replay endpoint, nothing delivered yet)."""
        if not self.has_replay or self.expected is None or self.repairing:
            return []
        return [self._request(probe=True)]

    def _request_snapshot(self, resumes_at: int | None = None) -> RequestSnapshot:
        self._resumes_at = resumes_at
        self.request_id += 1
        self.repairing = True
        self.snapshotting = True
        self._verifying = False
        self._parts = []
        self._parts_broken = False
        return RequestSnapshot(self.request_id)

    def _deliver(self, seq: int, payload: bytes, from_replay: bool) -> Deliver:
        self.expected = seq + 1
        self._last_payload = payload
        return Deliver(seq, payload, from_replay)

    def _drain_pending(self, actions: list[Action]) -> None:
        """Deliver held live batches that now follow on without a hole."""
        while self.expected in self.pending:
            seq = self.expected
            actions.append(self._deliver(seq, self.pending.pop(seq), False))

    def _advance_to(self, target: int, reason: LossReason, actions: list[Action]) -> None:
        """Move on to `target`: deliver the held batches on the way, report the holes."""
        assert self.expected is not None
        while self.expected < target:
            if self.expected in self.pending:
                self._drain_pending(actions)
                continue
            next_held = min((seq for seq in self.pending if seq < target), default=target)
            actions.append(Loss(self.expected, next_held - 1, reason))
            self.expected = next_held
            self._last_payload = None  # the batch before `expected` was never seen

    def _give_up_to_next_pending(self, reason: LossReason, actions: list[Action]) -> None:
        """Report the hole before the next held batch as lost, and deliver from there."""
        if self.pending:
            self._advance_to(min(self.pending), reason, actions)
        self._drain_pending(actions)

    def live(self, seq: int, payload: bytes) -> list[Action]:
        actions: list[Action] = []
        if self.silent:
            self._heard(actions)
        if self.last_live is not None and seq <= self.last_live:
            return actions + self._restart(seq, payload)
        self.last_live = seq
        if self.expected is None:
            return [*actions, self._deliver(seq, payload, False)]
        if seq < self.expected:
            return actions  # before the requested start, or already delivered from replay
        if seq == self.expected and not self.snapshotting:
            actions.append(self._deliver(seq, payload, False))
            self._drain_pending(actions)
            return actions
        if seq - self.expected > self.max_gap and not self._bootstrapping:
            return actions + self._discontinuity(seq, payload)
        if len(self.pending) >= self.max_held:
            # Holding more would let one stalled repair take unbounded memory. This batch is
            # let go, not lost: it is fetched from replay (or reported) when the repair ends.
            return actions
        self.pending[seq] = payload
        if self.repairing:
            return actions
        if self.has_replay:
            return [*actions, self._request()]
        self._give_up_to_next_pending(LossReason.NO_REPLAY, actions)
        return actions

    def _flush_old_generation(self, actions: list[Action]) -> None:
        """What was held from the old sequence still goes out, in order, with its holes named."""
        while self.pending:
            self._give_up_to_next_pending(LossReason.INTERRUPTED, actions)
        self.repairing = False  # replies to an old request describe the old sequence
        self._verifying = self._probing = False
        self.snapshotting = self._bootstrapping = False
        self.request_id += 1

    def _restart(self, seq: int, payload: bytes) -> list[Action]:
        """A seq at or below one already seen: a new publisher, whose sequence began at 0."""
        actions: list[Action] = []
        self._flush_old_generation(actions)
        return actions + self._new_generation(seq, payload)

    def _new_generation(self, seq: int, payload: bytes) -> list[Action]:
        """Report the restart, then deliver the new sequence from its start: seq 0."""
        assert self.expected is not None
        actions: list[Action] = [Loss(self.expected, None, LossReason.RESTART, new_seq=0)]
        self.expected = 0
        self._last_payload = None
        self.last_live = seq
        if seq == 0:
            actions.append(self._deliver(seq, payload, False))
            return actions
        self.pending[seq] = payload  # batches 0..seq-1 went out before we heard this one
        if self.has_replay:
            actions.append(self._request())
        else:
            self._give_up_to_next_pending(LossReason.NO_REPLAY, actions)
        return actions

    def _discontinuity(self, seq: int, payload: bytes) -> list[Action]:
        """A jump no real gap explains (garbage, or a stream we cannot relate to ours)."""
        actions: list[Action] = []
        self._flush_old_generation(actions)
        assert self.expected is not None
        actions.append(Loss(self.expected, None, LossReason.RESTART, new_seq=seq))
        actions.append(self._deliver(seq, payload, False))
        return actions

    def replayed(self, request_id: int, seq: int, payload: bytes) -> list[Action]:
        actions: list[Action] = []
        if request_id != self.request_id or not self.repairing:
            return actions  # a reply to a request given up on
        if self.silent:
            self._heard(actions)
        assert self.expected is not None
        if seq > max(self.expected, self.last_live or 0) + self.max_gap:
            return actions  # no replay buffer reaches that far ahead of the live stream
        if self._verifying:
            self._verifying = False
            if seq == self.expected - 1:
                if self._last_payload is None or payload == self._last_payload:
                    return actions  # the same stream (as far as can be told): go on from here
                return actions + self._replaced()
        if seq < self.expected:
            return actions
        if seq > self.expected and self.snapshots:
            # The buffer no longer holds what we miss: a snapshot stands in for it, and the
            # rest of this replay (answering a request now given up on) is ignored.
            return [*actions, self._request_snapshot(resumes_at=seq)]
        self.pending.pop(seq, None)  # held live too: the replayed copy goes out instead
        # Replay skipping ahead means the buffer lost what came before, but not what we hold.
        self._advance_to(seq, LossReason.EVICTED, actions)
        actions.append(self._deliver(seq, payload, True))
        self._drain_pending(actions)
        return actions

    def _replaced(self) -> list[Action]:
        """Replay holds a different batch where ours was: the publisher restarted and its new
        sequence has already passed ours. The held live batches belong to the new sequence;
        it is fetched from its start, and the rest of this reply describes it too."""
        assert self.expected is not None
        actions: list[Action] = [Loss(self.expected, None, LossReason.RESTART, new_seq=0)]
        self.expected = 0
        self._last_payload = None
        # what was heard live of the old sequence says nothing of the new one's length
        self.last_live = max(self.pending, default=None)
        actions.append(self._request())
        return actions

    def snapshot_part(
        self, request_id: int, next_seq: int, index: int, payload: bytes
    ) -> list[Action]:
        """One part of the snapshot asked for; it is delivered whole when the end comes."""
        if request_id == self.request_id and self.snapshotting:
            self.silent = False  # a part is an answer; the end marker reports it
            if index != len(self._parts) or (self._parts and next_seq != self._snapshot_next):
                self._parts_broken = True  # a part missing or from another snapshot
            self._snapshot_next = next_seq
            self._parts.append(payload)
        return []

    def _snapshot_ended(self) -> list[Action]:
        self.repairing = self.snapshotting = False
        bootstrap, self._bootstrapping = self._bootstrapping, False
        if not self._parts:  # a publisher without snapshots ends the request at once
            self.snapshots = False  # so later holes are reported without asking again
            return self._snapshot_failed(LossReason.EVICTED, bootstrap)
        if self._parts_broken:
            self._parts = []
            return self._snapshot_failed(LossReason.UNDECODABLE, bootstrap)
        assert self.expected is not None
        actions: list[Action] = []
        after = self._snapshot_next
        parts, self._parts = self._parts, []
        if after < self.expected and not bootstrap:  # older than what we have: a new sequence
            actions.append(Loss(self.expected, None, LossReason.RESTART, new_seq=after))
            self.last_live = max((seq for seq in self.pending if seq >= after), default=None)
        if after > 0 and (after != self.expected or bootstrap):
            replaced = None if bootstrap or after < self.expected else self.expected
            actions.append(DeliverSnapshot(after - 1, parts, replaced))
        self.expected = after
        self._last_payload = None  # the batch before `expected` was never seen on its own
        for seq in [seq for seq in self.pending if seq < after]:
            del self.pending[seq]
        self._drain_pending(actions)
        if self.pending or self._behind():
            actions.append(self._request())  # what was published since the snapshot's seq
        return actions

    def _snapshot_failed(self, reason: LossReason, bootstrap: bool) -> list[Action]:
        """No snapshot: a bootstrap takes what replay still has, a repair reports its hole."""
        if bootstrap:
            return [self._request()]
        actions: list[Action] = []
        if self._resumes_at is not None:  # replay holds what follows the hole: fetch it again
            self._advance_to(self._resumes_at, reason, actions)
            return [*actions, self._request()]
        self._give_up_to_next_pending(reason, actions)
        if self.pending or self._behind():
            actions.append(self._request())
        return actions

    def replay_ended(self, request_id: int) -> list[Action]:
        """The end marker of the current request: ask again while progress is made, else
        restore from a snapshot or report the holes. For a probe that got nothing at all (not
        even our last batch), the publisher's sequence is behind ours: a restart."""
        actions: list[Action] = []
        if request_id != self.request_id or not self.repairing:
            return actions
        if self.silent:
            self._heard(actions)
        if self.snapshotting:
            return actions + self._snapshot_ended()
        probe, answered_nothing = self._probing, self._verifying
        self.repairing = self._verifying = self._probing = False
        assert self.expected is not None
        if probe and answered_nothing:
            return actions + self._replaced()
        if not self.pending and not self._behind():
            return actions
        if self.expected != self._expected_at_request:
            # Progress was made, but batches published after the request are still missing:
            # ask again from where we are.
            actions.append(self._request())
            return actions
        if self.snapshots:
            return [*actions, self._request_snapshot()]  # what the buffer lost, a snapshot restores
        self._give_up_to_next_pending(LossReason.EVICTED, actions)
        if self.pending:
            actions.append(self._request())  # a further hole, after the one just given up
        elif self._behind():
            self._give_up_tail(LossReason.EVICTED, actions)
        return actions

    def _give_up_tail(self, reason: LossReason, actions: list[Action]) -> None:
        """Report what was heard live but let go of (the hold was full) and replay did not
        give: from `expected` up to the last live batch."""
        assert self.expected is not None and self.last_live is not None
        actions.append(Loss(self.expected, self.last_live, reason))
        self.expected = self.last_live + 1
        self._last_payload = None

    def replay_failed(
        self, request_id: int, reason: LossReason = LossReason.REPLAY_TIMEOUT
    ) -> list[Action]:
        """The replay endpoint did not serve the request: what it should have filled is lost
        (a probe's refusal proves the publisher alive; its silence is reported)."""
        actions: list[Action] = []
        if request_id != self.request_id or not self.repairing:
            return actions
        if self.snapshotting:
            self.repairing = self.snapshotting = False
            bootstrap, self._bootstrapping = self._bootstrapping, False
            return self._snapshot_failed(reason, bootstrap)
        probe = self._probing
        self.repairing = self._verifying = self._probing = False
        if probe and reason is LossReason.REFUSED:  # busy, not gone: repair what is missing
            if self.silent:
                self._heard(actions)
            if self.pending or self._behind():
                actions.append(self._request())
            return actions
        if probe and reason is LossReason.REPLAY_TIMEOUT and not self.silent:
            self.silent = True
            assert self.expected is not None
            actions.append(Silence(True, self.expected - 1))
        while self.pending:
            self._give_up_to_next_pending(reason, actions)
        if self._behind():
            self._give_up_tail(reason, actions)
        return actions
