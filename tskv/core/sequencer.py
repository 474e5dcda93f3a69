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

from typing import Literal, NamedTuple

import attrs

from tskv.core.errors import ConfigError
from tskv.core.losses import Loss, LossReason

MAX_HELD = 10_000  # live batches held while a gap is repaired; later ones are fetched again
MAX_GAP = 2**32  # a forward jump larger than this is a discontinuity, not a loss of 4e9 batches
MAX_SNAPSHOT_BYTES = 256 << 20  # a snapshot's parts, gathered: ~3.5M blocks of 16 tokens


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


@attrs.frozen
class SnapshotTooLarge:
    """A snapshot's parts passed `max_snapshot_bytes` (at `size` bytes): it was given up, and
    no more are asked for (the next would be as large). What it would restore is lost."""

    size: int


Action = (
    Deliver | DeliverSnapshot | Loss | RequestReplay | RequestSnapshot | Silence | SnapshotTooLarge
)


@attrs.frozen
class Idle:
    """No request under way: batches in order are delivered as they come."""


@attrs.frozen
class Replaying:
    """A replay request is under way."""

    request_id: int
    expected_at_request: int  # where delivery stood when asked: the end marker measures progress
    verifying: bool  # it starts one seq early, at the last batch delivered, to compare it
    probe: bool  # asked because the stream went quiet


@attrs.define
class Snapshotting:
    """A snapshot request is under way, gathering its parts until the end marker."""

    request_id: int
    bootstrap: bool  # the consumer asked to start from a snapshot (start_seq="snapshot")
    resumes_at: int | None  # where replay went on after what it no longer held (None: unknown)
    limit: int  # bytes its parts may come to (`Sequencer`'s max_snapshot_bytes)
    parts: list[bytes] = attrs.Factory(list)
    next_seq: int = 0  # the seq the snapshot's state is before
    broken: bool = False  # a part was missing or came from another snapshot
    size: int = 0  # bytes of the parts so far

    def add(self, next_seq: int, index: int, payload: bytes) -> bool:
        """Keep a part; False when the parts are now over the limit."""
        if index != len(self.parts) or (self.parts and next_seq != self.next_seq):
            self.broken = True
        self.next_seq = next_seq
        self.size += len(payload)
        self.parts.append(payload)
        return self.size <= self.limit


State = Idle | Replaying | Snapshotting
IDLE = Idle()


class Asking:
    """The request under way, if any (`state`), and the request ids that tell a reply to it
    from a reply to one given up on."""

    def __init__(self, max_snapshot_bytes: int = MAX_SNAPSHOT_BYTES) -> None:
        self.state: State = IDLE
        self.last_id = 0  # each request gets the next
        self.max_snapshot_bytes = max_snapshot_bytes

    def replay(self, expected: int, seen_last: bool, probe: bool = False) -> RequestReplay:
        """Ask for what follows `expected - 1`. A request starts one seq early, at the last
        batch delivered, to compare it (`seen_last`); a probe does so even unseen (after a
        snapshot): the publisher still holds its newest batch, so a reply without it means a
        sequence behind ours."""
        self.last_id += 1
        verifying = expected > 0 and (probe or seen_last)
        self.state = Replaying(self.last_id, expected, verifying, probe)
        return RequestReplay(expected - 1 if verifying else expected, self.last_id, probe)

    def snapshot(self, resumes_at: int | None = None, bootstrap: bool = False) -> RequestSnapshot:
        self.last_id += 1
        self.state = Snapshotting(self.last_id, bootstrap, resumes_at, self.max_snapshot_bytes)
        return RequestSnapshot(self.last_id)

    def current(self, request_id: int) -> Replaying | Snapshotting | None:
        """The request under way, if `request_id` names it; None for a reply to a request
        given up on (or answered already)."""
        state = self.state
        if isinstance(state, Idle) or state.request_id != request_id:
            return None
        return state

    def take(self, request_id: int) -> Replaying | Snapshotting | None:
        """The request under way if `request_id` names it, which its end (or failure) ends."""
        state = self.current(request_id)
        if state is not None:
            self.state = IDLE
        return state

    @property
    def busy(self) -> bool:
        return self.state is not IDLE

    def forget(self) -> None:
        """Replies to any request made so far describe a sequence that is over."""
        self.state = IDLE
        self.last_id += 1


class Order:
    """Where delivery stands in one publisher's sequence: the next seq to deliver, the live
    batches held past a hole (at most `max_held`), the last live seq heard, and the last batch
    delivered (to compare with replay's copy). It delivers what follows on and reports holes;
    what to ask for is the Sequencer's to decide."""

    def __init__(self, expected: int | None, max_held: int) -> None:
        self.expected = expected  # None: nothing delivered yet, and no start asked for
        self.max_held = max_held
        self.last_live: int | None = None
        self.pending: dict[int, bytes] = {}
        self.last_payload: bytes | None = None  # what was delivered at expected - 1

    def hold(self, seq: int, payload: bytes) -> bool:
        """Hold a live batch past a hole, unless the hold is full: holding more would let one
        stalled repair take unbounded memory, so the batch is let go, not lost (it is
        fetched from replay, or reported, when the repair ends)."""
        if len(self.pending) >= self.max_held:
            return False
        self.pending[seq] = payload
        return True

    def start_over(self, expected: int) -> None:
        """Deliver from `expected` on, in a sequence whose batch before it was never seen."""
        self.expected = expected
        self.last_payload = None

    def behind(self) -> bool:
        """Live batches were heard past what was delivered and are not held: let go while the
        hold was full, so known to exist and still to fetch (or report)."""
        return (
            self.last_live is not None
            and self.expected is not None
            and (self.expected <= self.last_live and self.last_live not in self.pending)
        )

    def missing(self) -> bool:
        """Batches are known to exist past what was delivered: held, or let go (`behind`)."""
        return bool(self.pending) or self.behind()

    def deliver(self, seq: int, payload: bytes, from_replay: bool) -> Deliver:
        self.expected = seq + 1
        self.last_payload = payload
        return Deliver(seq, payload, from_replay)

    def drain(self, actions: list[Action]) -> None:
        """Deliver held live batches that now follow on without a hole."""
        while self.expected in self.pending:
            seq = self.expected
            actions.append(self.deliver(seq, self.pending.pop(seq), False))

    def advance_to(self, target: int, reason: LossReason, actions: list[Action]) -> None:
        """Move on to `target`: deliver the held batches on the way, report the holes."""
        assert self.expected is not None
        while self.expected < target:
            if self.expected in self.pending:
                self.drain(actions)
                continue
            next_held = min((seq for seq in self.pending if seq < target), default=target)
            actions.append(Loss(self.expected, next_held - 1, reason))
            self.start_over(next_held)

    def give_up_to_next_pending(self, reason: LossReason, actions: list[Action]) -> None:
        """Report the hole before the next held batch as lost, and deliver from there."""
        if self.pending:
            self.advance_to(min(self.pending), reason, actions)
        self.drain(actions)

    def give_up_tail(self, reason: LossReason, actions: list[Action]) -> None:
        """Report what was heard live but let go of (the hold was full) and replay did not
        give: from `expected` up to the last live batch."""
        assert self.expected is not None and self.last_live is not None
        actions.append(Loss(self.expected, self.last_live, reason))
        self.start_over(self.last_live + 1)

    @property
    def last_delivered(self) -> int | None:
        return None if self.expected is None else self.expected - 1

    def flush(self, reason: LossReason, actions: list[Action]) -> None:
        """Deliver everything held, reporting the holes between."""
        while self.pending:
            self.give_up_to_next_pending(reason, actions)

    def give_up_all(self, reason: LossReason, actions: list[Action]) -> None:
        """Deliver everything held and report every hole, up to the last live batch heard."""
        self.flush(reason, actions)
        if self.behind():
            self.give_up_tail(reason, actions)

    def restarted(self, seq: int, payload: bytes, actions: list[Action]) -> bool:
        """Report a restart heard live at `seq`, and deliver the new sequence from its start,
        seq 0. True if batches 0..seq-1 went out before this one was heard (it is held)."""
        assert self.expected is not None
        actions.append(Loss(self.expected, None, LossReason.RESTART, new_seq=0))
        self.start_over(0)
        self.last_live = seq
        if seq == 0:
            actions.append(self.deliver(seq, payload, False))
            return False
        self.pending[seq] = payload
        return True

    def jumped(self, seq: int, payload: bytes, actions: list[Action]) -> None:
        """Report a discontinuity and go on from `seq`, delivered."""
        assert self.expected is not None
        actions.append(Loss(self.expected, None, LossReason.RESTART, new_seq=seq))
        actions.append(self.deliver(seq, payload, False))

    def replaced(self, actions: list[Action]) -> None:
        """Report a restart found on replay; the held live batches belong to the new sequence,
        to be delivered from seq 0."""
        assert self.expected is not None
        actions.append(Loss(self.expected, None, LossReason.RESTART, new_seq=0))
        self.start_over(0)
        # what was heard live of the old sequence says nothing of the new one's length
        self.last_live = max(self.pending, default=None)

    def restore(
        self, after: int, parts: list[bytes], bootstrap: bool, actions: list[Action]
    ) -> None:
        """Deliver a snapshot of the state before seq `after` as one batch (reporting a restart
        first if it is older than what we have), drop the held batches it covers and deliver
        those that follow it."""
        assert self.expected is not None
        if after < self.expected and not bootstrap:  # older than what we have: a new sequence
            actions.append(Loss(self.expected, None, LossReason.RESTART, new_seq=after))
            self.last_live = max((seq for seq in self.pending if seq >= after), default=None)
        if bootstrap or (after > 0 and after != self.expected):  # an empty cache is news too
            replaced = None if bootstrap or after < self.expected else self.expected
            actions.append(DeliverSnapshot(after - 1, parts, replaced))
        self.start_over(after)  # the batch before it was never seen on its own
        for seq in [seq for seq in self.pending if seq < after]:
            del self.pending[seq]
        self.drain(actions)


class Sequencer:
    """Gap detection and repair for one publisher's stream.

    Its mode is one value, `asking.state`: `Idle`, `Replaying` (verifying or not, a probe or not) or
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
        self.has_replay = has_replay
        self.snapshots = snapshots  # repair what replay no longer holds from a snapshot
        self.max_gap = max_gap
        self._start_from_snapshot = start_seq == "snapshot"
        # a snapshot bootstrap holds every live batch until the snapshot is in
        self.order = Order(0 if start_seq == "snapshot" else start_seq, max_held)
        self.asking = Asking(max_snapshot_bytes)
        self.silent = False  # a probe went unanswered, and nothing has been heard since

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
        return [self._request()]

    # -- what arrives ---------------------------------------------------------------------

    def live(self, seq: int, payload: bytes) -> list[Action]:
        """A live batch. Returns `Silence(False)` first if the publisher was silent; then: a
        restart's report and the new sequence's start (seq at or below one heard); the batch
        and the held ones that follow it (the next one in order); nothing (already delivered,
        or held while a repair is under way, or let go when the hold is full); or, for a gap,
        a replay request (with replay) or the hole reported (without)."""
        actions: list[Action] = []
        if self.silent:
            self._heard(actions)
        if self.order.last_live is not None and seq <= self.order.last_live:
            return actions + self._restart(seq, payload)
        self.order.last_live = seq
        if self.order.expected is None:
            return [*actions, self.order.deliver(seq, payload, False)]
        if seq < self.order.expected:
            return actions  # before the requested start, or already delivered from replay
        state = self.asking.state
        if seq == self.order.expected and not isinstance(state, Snapshotting):
            actions.append(self.order.deliver(seq, payload, False))
            self.order.drain(actions)
            return actions
        bootstrap = isinstance(state, Snapshotting) and state.bootstrap
        if seq - self.order.expected > self.max_gap and not bootstrap:
            return actions + self._discontinuity(seq, payload)
        if not self.order.hold(seq, payload) or self.asking.busy:
            return actions
        if self.has_replay:
            return [*actions, self._request()]
        self.order.give_up_to_next_pending(LossReason.NO_REPLAY, actions)
        return actions

    def quiet(self) -> list[Action]:
        """No live batch has come for the quiet interval. Returns a probe (a replay request
        from the last batch delivered, to compare), or nothing: no replay endpoint, nothing
        delivered yet, or a request already under way (it asks the same)."""
        if not self.has_replay or self.order.expected is None or self.asking.busy:
            return []
        return [self._request(probe=True)]

    def replayed(self, request_id: int, seq: int, payload: bytes) -> list[Action]:
        """One batch of the current request's replay. Returns `Silence(False)` first if the
        publisher was silent; then nothing (the verified batch matches ours, or it is one
        already delivered); a restart's report and a request from seq 0 (the verified batch
        differs); a snapshot request (replay skipped past what we miss, with snapshots on);
        or the holes before it reported, the batch, and the held ones that follow it."""
        actions: list[Action] = []
        state = self.asking.current(request_id)
        if state is None:
            return actions
        if self.silent:
            self._heard(actions)
        assert self.order.expected is not None
        if seq > max(self.order.expected, self.order.last_live or 0) + self.max_gap:
            return actions  # no replay buffer reaches that far ahead of the live stream
        if isinstance(state, Replaying) and state.verifying:
            self.asking.state = attrs.evolve(state, verifying=False)
            if seq == self.order.expected - 1:
                if self.order.last_payload is None or payload == self.order.last_payload:
                    return actions  # the same stream (as far as can be told): go on from here
                return actions + self._replaced()
        if seq < self.order.expected:
            return actions
        if seq > self.order.expected and self.snapshots:
            # The buffer no longer holds what we miss: a snapshot stands in for it, and the
            # rest of this replay (answering a request now given up on) is ignored.
            return [*actions, self.asking.snapshot(resumes_at=seq)]
        self.order.pending.pop(seq, None)  # held live too: the replayed copy goes out instead
        # Replay skipping ahead means the buffer lost what came before, but not what we hold.
        self.order.advance_to(seq, LossReason.EVICTED, actions)
        actions.append(self.order.deliver(seq, payload, True))
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

    def replay_ended(self, request_id: int) -> list[Action]:
        """The current request's end marker. Returns `Silence(False)` first if the publisher was
        silent. A snapshot ends as `_snapshot_ended` says. A replay that made progress but left
        batches missing asks again from where delivery stands; one that made none asks for a
        snapshot (snapshots on) or reports the holes (then asks for the next hole, if any). A
        probe that got nothing at all, not even our last batch, means the publisher's
        sequence is behind ours: a restart, and a request from seq 0."""
        actions: list[Action] = []
        state = self.asking.take(request_id)
        if state is None:
            return actions
        if self.silent:
            self._heard(actions)
        if isinstance(state, Snapshotting):
            return actions + self._snapshot_ended(state)
        assert self.order.expected is not None
        if state.probe and state.verifying:  # still verifying: nothing came back at all
            return actions + self._replaced()
        if not self.order.missing():
            return actions
        if self.order.expected != state.expected_at_request:
            # Progress was made, but batches published after the request are still missing:
            # ask again from where we are.
            return [*actions, self._request()]
        if self.snapshots:
            return [*actions, self.asking.snapshot()]  # what the buffer lost, a snapshot restores
        self.order.give_up_to_next_pending(LossReason.EVICTED, actions)
        if self.order.pending:
            actions.append(self._request())  # a further hole, after the one just given up
        elif self.order.behind():
            self.order.give_up_tail(LossReason.EVICTED, actions)
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
            return actions
        if state.probe and reason is LossReason.REPLAY_TIMEOUT and not self.silent:
            self.silent = True
            actions.append(Silence(True, self.order.last_delivered))
        self.order.give_up_all(reason, actions)
        return actions

    # -- requests ----------------------------------------------------------------------------

    def _request(self, probe: bool = False) -> RequestReplay:
        order = self.order
        assert order.expected is not None
        return self.asking.replay(order.expected, order.last_payload is not None, probe)

    def _ask_if_missing(self, actions: list[Action]) -> None:
        if self.order.missing():
            actions.append(self._request())

    def _heard(self, actions: list[Action]) -> None:
        """The publisher answered (live or on replay): a silence it was in is over."""
        self.silent = False
        actions.append(Silence(False, self.order.last_delivered))

    # -- a new sequence, a snapshot's end ----------------------------------------------------

    def _flush_old_generation(self, actions: list[Action]) -> None:
        """What was held from the old sequence still goes out, in order, with its holes named."""
        self.order.flush(LossReason.INTERRUPTED, actions)
        self.asking.forget()

    def _restart(self, seq: int, payload: bytes) -> list[Action]:
        """A seq at or below one already seen: a new publisher, whose sequence began at 0."""
        actions: list[Action] = []
        self._flush_old_generation(actions)
        if not self.order.restarted(seq, payload, actions):
            return actions
        if self.has_replay:
            actions.append(self._request())
        else:
            self.order.give_up_to_next_pending(LossReason.NO_REPLAY, actions)
        return actions

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
        self.order.replaced(actions)
        actions.append(self._request())
        return actions

    def _snapshot_ended(self, snapshot: Snapshotting) -> list[Action]:
        """Deliver the parts as one snapshot (`Order.restore`) and ask for what was published
        since. No parts: the publisher serves none (never ask again); broken parts: reported
        undecodable. Both then go on as `_snapshot_failed`."""
        if not snapshot.parts:  # a publisher without snapshots ends the request at once
            self.snapshots = False  # so later holes are reported without asking again
            return self._snapshot_failed(snapshot, LossReason.EVICTED)
        if snapshot.broken:
            return self._snapshot_failed(snapshot, LossReason.UNDECODABLE)
        actions: list[Action] = []
        self.order.restore(snapshot.next_seq, snapshot.parts, snapshot.bootstrap, actions)
        self._ask_if_missing(actions)  # what was published since the snapshot's seq
        return actions

    def _snapshot_failed(self, snapshot: Snapshotting, reason: LossReason) -> list[Action]:
        """No snapshot: a bootstrap takes what replay still has; a repair reports its hole and
        fetches what follows it (from where replay went on, if known)."""
        if snapshot.bootstrap:
            return [self._request()]
        actions: list[Action] = []
        if snapshot.resumes_at is not None:  # replay holds what follows the hole: fetch it again
            self.order.advance_to(snapshot.resumes_at, reason, actions)
            return [*actions, self._request()]
        self.order.give_up_to_next_pending(reason, actions)
        self._ask_if_missing(actions)
        return actions
