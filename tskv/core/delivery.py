"""Where delivery stands in one publisher's sequence (`Order`), and the replay or snapshot
request under way (`Asking`), without I/O: the parts the `Sequencer` decides with.

`Order` delivers what follows on and reports holes; what to ask for is the Sequencer's to
decide. `Asking` holds the request under way as one value (`Idle`, `Replaying`,
`Snapshotting`) and the request ids that tell a reply to it from a reply to one given up on.
"""

from __future__ import annotations

import attrs

from tskv.core.actions import (
    Action,
    Deliver,
    DeliverSnapshot,
    RequestReplay,
    RequestSnapshot,
)
from tskv.core.losses import Loss, LossReason

MAX_SNAPSHOT_BYTES = 256 << 20  # a snapshot's parts, gathered: ~3.5M blocks of 16 tokens
RECENT = 64  # batches delivered whose fingerprint is kept, to compare with replay's (a power of 2)


class Recent:
    """What the last `RECENT` batches delivered were, and from which seq on no replay has shown
    them since they could have come from a publisher now gone.

    A live batch may be a dead publisher's: a SUB reads each connection's queue in turn, so one
    sent just before a crash can be read after the new publisher came up, at the very seq that
    comes next. Once the connection drops, so may any batch delivered (a replay cut short by
    the crash). Replay, answered by the publisher up now, shows which: a probe starts at
    `first_unverified`, and a batch it shows that differs from ours is a restart. A fingerprint
    is the length and first 24 bytes of the payload, which hold the round's timestamp: two
    incarnations do not share it, and it costs a slice, not a hash of the payload.
    """

    __slots__ = ("_ring", "_unverified_from")

    def __init__(self) -> None:
        self._ring: list[tuple[int, int, bytes] | None] = [None] * RECENT
        self._unverified_from: int | None = None

    def note(self, seq: int, payload: bytes, live: bool) -> None:
        self._ring[seq & (RECENT - 1)] = (seq, len(payload), payload[:24])
        if live and self._unverified_from is None:
            self._unverified_from = seq

    def doubt_all(self) -> None:
        """The connection dropped or came back: any of them may be a dead publisher's."""
        seqs = [entry[0] for entry in self._ring if entry is not None]
        if seqs:
            self._unverified_from = min(seqs)

    def forget(self) -> None:
        """A new sequence: the seqs kept are the old one's."""
        self._ring = [None] * RECENT
        self._unverified_from = None

    def shows(self, seq: int, payload: bytes) -> bool:
        """Replay shows `payload` at `seq`: False if we delivered another batch there."""
        entry = self._ring[seq & (RECENT - 1)]
        return entry is None or entry[0] != seq or entry[1:] == (len(payload), payload[:24])

    def first_unverified(self, expected: int) -> int | None:
        """Where a probe starts to show every batch kept that no replay has shown (None: all
        shown)."""
        start = self._unverified_from
        if start is None or start >= expected:
            return None
        self._unverified_from = start = max(start, expected - RECENT)
        return start

    def shown_before(self, seq: int) -> None:
        """A probe from `first_unverified` ended: what it asked about before `seq` was shown
        (or its publisher no longer buffers it, and nothing can show it)."""
        if self._unverified_from is not None and self._unverified_from < seq:
            self._unverified_from = seq


@attrs.frozen
class Idle:
    """No request under way: batches in order are delivered as they come."""


Delivered = tuple[int, bytes | None]  # a seq delivered, and its payload when it is known


@attrs.frozen
class Replaying:
    """A replay request is under way."""

    request_id: int
    expected_at_request: int  # where delivery stood when asked: the end marker measures progress
    # It starts at a batch delivered, to compare with replay's (None: compared already, or
    # nothing to compare); a payload of None only asks that replay still has that seq.
    compare: Delivered | None
    probe: bool  # asked because the stream went quiet (or the connection came back)
    bootstrap: bool = False  # the start_seq the consumer asked for: what it delivers fills no hole


@attrs.define
class Snapshotting:
    """A snapshot request is under way, gathering its parts until the end marker."""

    request_id: int
    bootstrap: bool  # the consumer asked to start from a snapshot (start_seq="snapshot")
    resumes_at: int | None  # where replay went on after what it no longer held (None: unknown)
    limit: int  # bytes its parts may come to (`Sequencer`'s max_snapshot_bytes)
    resync: bool = False  # asked to make a view with a hole whole again: delivered even at our seq
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

    def replay(
        self,
        expected: int,
        last: bytes | None,
        probe: bool = False,
        compare: Delivered | None = None,
        bootstrap: bool = False,
        verify_from: int | None = None,
    ) -> RequestReplay:
        """Ask for what follows `expected - 1`. A request starts at a batch delivered, to
        compare it: `compare` when given, else the last one (`last`, its payload). A probe
        does so even unseen (after a snapshot): the publisher still holds its newest batch, so
        a reply without it means a sequence behind ours. `verify_from`, the first live batch
        no replay has shown yet, starts it earlier still."""
        self.last_id += 1
        if compare is None and expected > 0 and (probe or last is not None):
            compare = (expected - 1, last)
        self.state = Replaying(self.last_id, expected, compare, probe, bootstrap)
        start = expected if compare is None else compare[0]
        if verify_from is not None:  # earlier, to see what replay has at those seqs too
            start = min(start, verify_from)
        return RequestReplay(start, self.last_id, probe)

    def snapshot(
        self, resumes_at: int | None = None, bootstrap: bool = False, resync: bool = False
    ) -> RequestSnapshot:
        self.last_id += 1
        limit = self.max_snapshot_bytes
        self.state = Snapshotting(self.last_id, bootstrap, resumes_at, limit, resync)
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
        self.recent = Recent()  # to tell a dead publisher's batches from the live one's

    def start_over(self, expected: int) -> None:
        """Deliver from `expected` on, in a sequence whose batch before it was never seen."""
        self.expected = expected
        self.last_payload = None

    def deliver_live(self, seq: int, payload: bytes) -> Deliver:
        self.expected = seq + 1
        self.last_payload = payload
        self.recent.note(seq, payload, True)
        return Deliver(seq, payload, False)

    def missing(self) -> bool:
        """Batches are known to exist past what was delivered: held past a hole."""
        return bool(self.pending)

    def deliver(self, seq: int, payload: bytes, repaired: bool) -> Deliver:
        """A batch from replay: the publisher that answered it is the one up now."""
        self.expected = seq + 1
        self.last_payload = payload
        self.recent.note(seq, payload, False)
        return Deliver(seq, payload, repaired)

    def drain(self, actions: list[Action]) -> None:
        """Deliver held live batches that now follow on without a hole."""
        while self.expected in self.pending:
            seq = self.expected
            actions.append(self.deliver_live(seq, self.pending.pop(seq)))

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

    @property
    def last_delivered(self) -> int | None:
        """The last seq delivered of this sequence (None: none yet)."""
        return None if not self.expected else self.expected - 1

    def flush(self, reason: LossReason, actions: list[Action]) -> None:
        """Deliver everything held, reporting the holes between."""
        while self.pending:
            self.give_up_to_next_pending(reason, actions)

    def give_up_all(self, reason: LossReason, actions: list[Action]) -> None:
        """Deliver everything held and report every hole between."""
        self.flush(reason, actions)

    def restarted(self, seq: int, payload: bytes, actions: list[Action]) -> bool:
        """Report a restart heard live at `seq`, and deliver the new sequence from its start,
        seq 0. True if batches 0..seq-1 went out before this one was heard (it is held)."""
        assert self.expected is not None
        actions.append(Loss(self.expected, None, LossReason.RESTART, new_seq=0))
        self.start_over(0)
        self.recent.forget()
        self.last_live = seq
        if seq == 0:
            actions.append(self.deliver_live(seq, payload))
            return False
        self.pending[seq] = payload
        return True

    def jumped(self, seq: int, payload: bytes, actions: list[Action]) -> None:
        """Report a discontinuity and go on from `seq`, delivered."""
        assert self.expected is not None
        actions.append(Loss(self.expected, None, LossReason.RESTART, new_seq=seq))
        self.recent.forget()
        actions.append(self.deliver_live(seq, payload))

    def replaced(self, actions: list[Action]) -> None:
        """Report a restart found on replay; the held live batches belong to the new sequence,
        to be delivered from seq 0."""
        assert self.expected is not None
        actions.append(Loss(self.expected, None, LossReason.RESTART, new_seq=0))
        self.start_over(0)
        self.recent.forget()
        # what was heard live of the old sequence says nothing of the new one's length
        self.last_live = max(self.pending, default=None)

    def restore(
        self,
        after: int,
        parts: list[bytes],
        bootstrap: bool,
        actions: list[Action],
        resync: bool = False,
    ) -> None:
        """Deliver a snapshot of the state before seq `after` as one batch (reporting a restart
        first if it is older than what we have), drop the held batches it covers and deliver
        those that follow it. A snapshot at our own seq is news only to a bootstrap or a
        resync (a view with a hole: the snapshot makes it whole)."""
        assert self.expected is not None
        if after < self.expected and not bootstrap:  # older than what we have: a new sequence
            actions.append(Loss(self.expected, None, LossReason.RESTART, new_seq=after))
            self.recent.forget()
            self.last_live = max((seq for seq in self.pending if seq >= after), default=None)
        if bootstrap or resync or (after > 0 and after != self.expected):  # empty is news too
            replaced = self.expected if after > self.expected and not bootstrap else None
            actions.append(DeliverSnapshot(after - 1, parts, replaced))
        self.start_over(after)  # the batch before it was never seen on its own
        for seq in [seq for seq in self.pending if seq < after]:
            del self.pending[seq]
        self.drain(actions)
